import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini.ops.bias_act_dropout import ACTIVATIONS, bias_act_dropout, bias_act_dropout_ref
from lsmini.ops.dropout import keep_mask
from util import (LOWP, LsminiOps, assert_close_fp32, assert_column_sum_close, assert_dropout_keep_stats,
                  assert_lowp_rule, next_seed_offset, philox_keep_mask)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, dtype, device, bias_dtype="same", seed=0):
    """x, bias (or None), grad_out: seeded, never zero; x spans the bend of every activation."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = shape[-1]
    x = (2 * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
    grad = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    if bias_dtype is None:
        bias = None
    else:
        bdt = dtype if bias_dtype == "same" else bias_dtype
        bias = torch.randn(hidden, generator=g).to(device=device, dtype=bdt)
    return x, bias, grad


def _run(fn, x, bias, grad):
    """Forward and every gradient of fn(x, bias) with the given grad_output."""
    x = x.detach().clone().requires_grad_(True)
    bias = bias.detach().clone().requires_grad_(True) if bias is not None else None
    out = fn(x, bias)
    out.backward(grad)
    return out.detach(), x.grad, (bias.grad if bias is not None else None)


def _torch_act(y, activation):
    return F.relu(y) if activation == "relu" else F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


# ------------------------------------------------------------------------------------ CPU (CI) ---

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 5, 24)])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_reference_matches_torch(activation, shape, has_bias, p):
    x, bias, grad = _inputs(shape, torch.float32, "cpu", "same" if has_bias else None)

    def plain(x, b):
        return F.dropout(_torch_act(x + b if b is not None else x, activation), p, training=True)

    torch.manual_seed(1)
    ours = _run(lambda x, b: bias_act_dropout_ref(x, b, activation, p), x, bias, grad)
    torch.manual_seed(1)  # the same draw of the same shape: the same mask
    theirs = _run(plain, x, bias, grad)
    for name, a, r in zip(("out", "grad_x", "grad_bias"), ours, theirs):
        if r is None:
            assert a is None
            continue
        assert_close_fp32(a, r, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_eval_p0_and_mask(activation):
    x, bias, _ = _inputs((6, 10), torch.float32, "cpu")
    plain = _torch_act(x + bias, activation)
    assert_close_fp32(bias_act_dropout_ref(x, bias, activation, 0.7, training=False), plain)
    assert_close_fp32(bias_act_dropout_ref(x, bias, activation, 0.0), plain)
    mask = torch.rand(6, 10, generator=torch.Generator().manual_seed(3)) > 0.4
    want = torch.where(mask, plain / 0.6, torch.zeros_like(x))
    assert_close_fp32(bias_act_dropout_ref(x, bias, activation, 0.4, mask=mask), want)
    assert torch.equal(bias_act_dropout_ref(x, bias, activation, 1.0), torch.zeros_like(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_computes_in_fp32_and_keeps_dtype(dtype):
    x, bias, _ = _inputs((5, 12), dtype, "cpu", bias_dtype=torch.float32)
    out = bias_act_dropout_ref(x, bias, "gelu")
    assert out.dtype == dtype
    assert torch.equal(out, F.gelu(x.float() + bias).to(dtype))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 5, 24), (129, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_op_on_cpu_matches_torch(activation, shape, dtype, p):
    """The registered operator's CPU implementation, forward and every gradient with one random
    grad_output, against plain PyTorch applying the mask the op draws: the reference's keep-mask
    (``lsmini.ops.dropout.keep_mask``) from torch's CPU generator, here drawn again under the same seed."""
    for bias_kind in _bias_kinds(dtype):
        x, bias, grad = _inputs(shape, dtype, "cpu", bias_kind)
        torch.manual_seed(1)
        with LsminiOps() as ops:
            ours = _run(lambda x, b: bias_act_dropout(x, b, activation, p), x, bias, grad)
        assert ops.names == ["bias_act_dropout", "bias_act_dropout_backward"]
        torch.manual_seed(1)
        keep = keep_mask(x.shape, p, "cpu")
        up = lambda t: t.float() if t is not None else None  # noqa: E731
        ref32 = _lowp_torch(up(x), up(bias), up(grad), activation, keep, p)  # plain PyTorch in fp32
        lowp = _lowp_torch(x, bias, grad, activation, keep, p)
        _check_all(dtype, ours, ref32, lowp)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_op_on_cpu_dropout_statistics_same_mask_and_seed(p):
    g = torch.Generator(device="cpu").manual_seed(2)
    shape = (333, 1032)
    x = (1 + torch.rand(*shape, generator=g)).requires_grad_()  # relu(x) ≥ 1: kept ≠ 0
    grad = 1 + torch.rand(*shape, generator=g)
    torch.manual_seed(3)
    out = bias_act_dropout(x, None, "relu", p)
    (gx,) = torch.autograd.grad(out, (x,), grad)
    keep = out != 0
    assert_dropout_keep_stats(keep, p, name=f"mask p={p}")
    assert torch.equal(gx == 0, ~keep)  # the backward applies the forward's mask
    assert_close_fp32(gx[keep], grad[keep] / (1 - p), atol=0, rtol=1e-6)
    torch.manual_seed(3)
    assert torch.equal(bias_act_dropout(x, None, "relu", p), out)
    assert not torch.equal(bias_act_dropout(x, None, "relu", p), out), "each call draws a new mask"


def test_op_on_cpu_eval_p0_and_forced_reference(monkeypatch):
    x, bias, _ = _inputs((4, 16), torch.float32, "cpu")
    state = torch.get_rng_state()
    with LsminiOps() as ops:
        for act in ACTIVATIONS:
            assert torch.equal(bias_act_dropout(x, bias, act), bias_act_dropout_ref(x, bias, act))
        assert torch.equal(bias_act_dropout(x, bias, "relu", 0.5, training=False), F.relu(x + bias))
        assert torch.equal(bias_act_dropout(x, None), F.relu(x))  # relu by default
    assert ops.names == ["bias_act_dropout"] * 5
    assert torch.equal(torch.get_rng_state(), state), "p == 0 / eval must not draw"
    with LsminiOps() as ops:
        bias_act_dropout(x.double(), bias.double(), "gelu")
    assert ops.names == []
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        assert torch.equal(bias_act_dropout(x, bias, "gelu"), bias_act_dropout_ref(x, bias, "gelu"))
    assert ops.names == []


def test_bad_inputs_cpu():
    x, bias, _ = _inputs((4, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"unknown activation 'swish', expected one of 'relu', 'gelu', 'gelu_tanh'"):
        bias_act_dropout(x, bias, "swish")
    with pytest.raises(ValueError, match="'relu', 'gelu', 'gelu_tanh'"):
        bias_act_dropout(x, bias, "GELU")
    with pytest.raises(TypeError, match="activation must be one of 'relu', 'gelu', 'gelu_tanh'"):
        bias_act_dropout(x, bias, F.gelu)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_act_dropout(x, bias[:4])
    with pytest.raises(TypeError, match="bias must be torch.float32"):
        bias_act_dropout(x, bias.double())
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got 2"):
        bias_act_dropout(x, bias, "relu", 2)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        bias_act_dropout(x, bias, "relu", None)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        bias_act_dropout(x.int(), None)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        bias_act_dropout(x[:, :0], None)


# ----------------------------------------------------------------------------------- CUDA ---------

SHAPES = [(1, 1), (1, 8), (7, 7), (33, 8), (2049, 1), (129, 7), (31, 1032), (257, 1032), (127, 4104),
          (3, 16384), (3, 5, 1032)]


def _bias_kinds(dtype):
    return [None, "same"] + ([torch.float32] if dtype in LOWP else [])


def _lowp_torch(x, bias, grad, activation, mask, p):
    """Plain PyTorch in x's low precision (autograd through the same graph): out, grad_x, grad_bias."""
    dt = x.dtype
    x = x.detach().clone().requires_grad_(True)
    b = bias.detach().to(dt).requires_grad_(True) if bias is not None else None
    y = _torch_act(x + b if b is not None else x, activation)
    if mask is not None:
        y = torch.where(mask, y * (1.0 / (1.0 - p)), torch.zeros_like(y))
    y.backward(grad)
    gb = b.grad.to(bias.dtype) if b is not None else None
    return y.detach(), x.grad, gb


def _check_all(dtype, ours, ref32, lowp):
    for name, a, r, t in zip(("out", "grad_x", "grad_bias"), ours, ref32, lowp):
        if r is None:
            assert a is None, f"{name}: expected None"
            continue
        want_dtype = t.dtype if dtype in LOWP else r.dtype
        assert a.dtype == want_dtype, f"{name}: dtype {a.dtype}, expected {want_dtype}"
        if dtype in LOWP:
            assert_lowp_rule(a, r, t, name=name)
        elif name == "grad_bias":
            # grad_bias is the column sum of grad_x, and grad_x was checked elementwise just above. The
            # activation derivative's fp32 rounding differs per element between kernel and torch (both
            # a few ulp), and over many rows those differences add up beyond a pure summation-order
            # bound; so check the sum against the kernel's own grad_x, with the summation bound.
            gx = ours[1].reshape(-1, ours[1].shape[-1]).double()
            assert_column_sum_close(a, gx.sum(0), gx.abs().sum(0), gx.shape[0])
        else:
            assert_close_fp32(a, r, name=name)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_kernel_matches_reference(activation, shape, dtype, p):
    """Forward and every gradient vs the fp32 reference, with the kernel's Philox mask reproduced by
    the independent Python Philox (element index = row·hidden + col)."""
    for bias_kind in _bias_kinds(dtype):
        x, bias, grad = _inputs(shape, dtype, "cuda", bias_kind)
        mask = None
        if p > 0:
            seed, offset = next_seed_offset(11)
            mask = philox_keep_mask(x.numel(), p, seed, offset, "cuda").view(shape)
        ours = _run(lambda x, b: bias_act_dropout(x, b, activation, p), x, bias, grad)
        up = lambda t: t.float() if t is not None else None  # noqa: E731
        ref32 = _run(lambda x, b: bias_act_dropout_ref(x, b, activation, p, mask=mask), up(x), up(bias), up(grad))
        lowp = _lowp_torch(x, bias, grad, activation, mask, p)
        _check_all(dtype, ours, ref32, lowp)
        if bias is not None:
            assert ours[2].dtype == bias.dtype


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_gelu_accuracy_over_a_wide_range(activation):
    # fp32 forward and derivative on a dense grid over [-12, 12] plus the extremes, vs float64
    ext = lsmini._backend.ext()
    v = torch.cat([torch.linspace(-12, 12, 200003), torch.tensor([-80.0, -20.0, 20.0, 80.0, 0.0])])
    x = v.view(1, -1).to("cuda")
    vd = v.double().requires_grad_()
    y64 = F.gelu(vd, approximate="tanh" if activation == "gelu_tanh" else "none")
    (d64,) = torch.autograd.grad(y64.sum(), vd)
    y = ext.bias_act_dropout_fwd(x, None, activation, 0.0, (0, 0, 0, 0))
    gx, _ = ext.bias_act_dropout_bwd(torch.ones_like(x), x, None, activation, 0.0, (0, 0, 0, 0))
    # both within the fp32 rule, and no worse than 2x PyTorch's own fp32 error
    assert_close_fp32(y.view(-1).cpu(), y64.detach().float(), name=f"{activation} forward")
    assert_close_fp32(gx.view(-1).cpu(), d64.float(), name=f"{activation} derivative")
    yt = F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none").view(-1).cpu()
    assert (y.view(-1).cpu().double() - y64).abs().max() <= 2 * (yt.double() - y64).abs().max() + 1e-7


@pytest.mark.cuda
def test_relu_and_nan_propagation():
    ext = lsmini._backend.ext()
    x = torch.tensor([[-1.0, 0.0, 2.0, float("nan"), float("inf"), -float("inf"), 1e-30, -1e-30]], device="cuda")
    want = F.relu(x)
    got = ext.bias_act_dropout_fwd(x, None, "relu", 0.0, (0, 0, 0, 0))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    fin = ~torch.isnan(want)
    assert torch.equal(got[fin], want[fin])
    assert torch.isnan(ext.bias_act_dropout_fwd(x, None, "gelu", 0.0, (0, 0, 0, 0))[0, 3])
    gx, _ = ext.bias_act_dropout_bwd(torch.ones_like(x), x, None, "relu", 0.0, (0, 0, 0, 0))
    xr = x.clone().requires_grad_()
    (want_gx,) = torch.autograd.grad(F.relu(xr), xr, torch.ones_like(x))
    assert want_gx.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]]  # NaN: relu(NaN) <= 0 is false
    assert torch.equal(gx, want_gx)


@pytest.mark.cuda
def test_backward_recomputes_from_saved_input():
    x, bias, grad = _inputs((16, 64), torch.float16, "cuda")
    x.requires_grad_()
    bias.requires_grad_()
    out = bias_act_dropout(x, bias, "gelu", 0.1)
    node = out.grad_fn.next_functions[0][0]  # under the view to x's shape: the operator's autograd node
    assert "bias_act_dropout" in node.name()
    saved = node.saved_tensors  # x and bias themselves (no activation-sized tensor), and the dropout state
    assert len(saved) == 3
    assert saved[0].data_ptr() == x.data_ptr() and saved[1].data_ptr() == bias.data_ptr()
    assert saved[2].dtype == torch.int64 and saved[2].shape == (1, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_binding_act_ids_and_grad_bias_dtype(dtype):
    ext = lsmini._backend.ext()
    x, bias, grad = _inputs((37, 1032), dtype, "cuda", torch.float32)
    for i, name in enumerate(ACTIVATIONS):
        a = ext.bias_act_dropout_fwd(x, bias, name, 0.2, (5, 8, 0, 0))
        b = ext.bias_act_dropout_fwd(x, bias, i, 0.2, (5, 8, 0, 0))
        assert torch.equal(a, b) and a.dtype == dtype
        gx, gb = ext.bias_act_dropout_bwd(grad, x, bias, name, 0.2, (5, 8, 0, 0))
        assert gx.dtype == dtype and gb.dtype == torch.float32
    gx, gb = ext.bias_act_dropout_bwd(grad, x, None, "relu", 0.2, (5, 8, 0, 0))
    assert gb is None


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_bias", [True, False])
def test_binding_out_and_in_place(dtype, has_bias):
    """out / grad_x: written and returned, bitwise equal to a fresh output, also in place (out = x,
    grad_x = grad_out or x)."""
    ext = lsmini._backend.ext()
    x, bias, grad = _inputs((333, 1032), dtype, "cuda", "same" if has_bias else None)
    rng = (5, 8, 0, 0)
    fresh = ext.bias_act_dropout_fwd(x, bias, "gelu", 0.2, rng)
    buf = torch.empty_like(x)
    assert ext.bias_act_dropout_fwd(x, bias, "gelu", 0.2, rng, out=buf).data_ptr() == buf.data_ptr()
    assert torch.equal(buf, fresh)
    xx = x.clone()
    assert torch.equal(ext.bias_act_dropout_fwd(xx, bias, "gelu", 0.2, rng, out=xx), fresh)
    gx, gb = ext.bias_act_dropout_bwd(grad, x, bias, "gelu", 0.2, rng)
    for into in ("buffer", "grad_out", "x"):
        g2, x2 = grad.clone(), x.clone()
        dst = {"buffer": torch.empty_like(x), "grad_out": g2, "x": x2}[into]
        gx2, gb2 = ext.bias_act_dropout_bwd(g2, x2, bias, "gelu", 0.2, rng, grad_x=dst)
        assert gx2.data_ptr() == dst.data_ptr() and torch.equal(gx2, gx), into
        assert (gb2 is None and gb is None) or torch.equal(gb2, gb), into


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("shape", [(333, 1032), (5, 7)])  # vectorized, and one element per thread
def test_binding_relu_from_output(dtype, p, shape):
    """relu's backward from the forward's output (from_output=True) equals the one recomputed from the
    input — same mask, same gradient bits (grad_bias: the same fp32 column sums, possibly taken in
    another order, as the two kernel variants may size their grids differently) — also into
    grad_x = grad_out, the layers' in-place use."""
    ext = lsmini._backend.ext()
    x, bias, grad = _inputs(shape, dtype, "cuda", torch.float32)
    x[0, :3] = torch.tensor([float("nan"), 0.0, -0.0], dtype=dtype)
    bias[:3] = 0.0
    rng = (7, 3, 0, 0)
    y = ext.bias_act_dropout_fwd(x, bias, "relu", p, rng)
    want_gx, want_gb = ext.bias_act_dropout_bwd(grad, x, bias, "relu", p, rng)
    gx, gb = ext.bias_act_dropout_bwd(grad, y, bias, "relu", p, (0, 0, 0, 0), from_output=True)
    assert torch.equal(gx, want_gx)
    assert_column_sum_close(gb, want_gb, want_gx.float().abs().sum(0), shape[0])
    g2 = grad.clone()
    gx2, _ = ext.bias_act_dropout_bwd(g2, y, bias, 0, p, (0, 0, 0, 0), grad_x=g2, from_output=True)
    assert gx2.data_ptr() == g2.data_ptr() and torch.equal(gx2, want_gx)
    with pytest.raises(ValueError, match="bias_act_dropout_bwd: from_output=True needs act 'relu'.*got 'gelu'"):
        ext.bias_act_dropout_bwd(grad, y, bias, "gelu", p, rng, from_output=True)


@pytest.mark.cuda
def test_binding_out_checks():
    ext = lsmini._backend.ext()
    x, bias, grad = _inputs((4, 8), torch.float16, "cuda")
    rng = (0, 0, 0, 0)
    flat = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    bad = [(torch.empty(4, 9, dtype=x.dtype, device="cuda"), RuntimeError, r"out must have shape \[4, 8\]"),
           (torch.empty_like(x, dtype=torch.float32), RuntimeError, "out must be Half"),
           (torch.empty(8, 4, dtype=x.dtype, device="cuda").t(), RuntimeError, "out must be contiguous"),
           (torch.empty_like(x, device="cpu"), RuntimeError, "out must be a CUDA tensor")]
    for out, exc, match in bad:
        with pytest.raises(exc, match="bias_act_dropout_fwd: " + match):
            ext.bias_act_dropout_fwd(x, bias, "relu", 0.0, rng, out=out)
    flat[:-1].copy_(x.flatten())
    with pytest.raises(RuntimeError, match="bias_act_dropout_fwd: out partially overlaps x"):
        ext.bias_act_dropout_fwd(flat[:-1].view(4, 8), bias, "relu", 0.0, rng, out=flat[1:].view(4, 8))
    with pytest.raises(RuntimeError, match="bias_act_dropout_bwd: grad_x partially overlaps grad_out"):
        ext.bias_act_dropout_bwd(flat[:-1].view(4, 8), x, bias, "relu", 0.0, rng, grad_x=flat[1:].view(4, 8))
    with pytest.raises(RuntimeError, match=r"bias_act_dropout_bwd: grad_x must have shape \[4, 8\]"):
        ext.bias_act_dropout_bwd(grad, x, bias, "relu", 0.0, rng, grad_x=x[:2])


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("shape", [(1024, 1024), (4097, 7), (333, 1032)])
def test_dropout_statistics_and_same_mask(activation, dtype, p, shape):
    g = torch.Generator(device="cpu").manual_seed(2)
    x = (1 + torch.rand(*shape, generator=g)).to("cuda", dtype).requires_grad_()  # act(x) > 0: kept ≠ 0
    grad = (1 + torch.rand(*shape, generator=g)).to("cuda", dtype)
    torch.manual_seed(3)
    out = bias_act_dropout(x, None, activation, p)
    (gx,) = torch.autograd.grad(out, (x,), grad)
    keep = out != 0
    assert_dropout_keep_stats(keep, p, name=f"mask {dtype} p={p}")
    # the backward regenerates the forward's mask: grad_x is zero exactly where the output was dropped
    assert torch.equal(gx == 0, ~keep)
    seed, offset = next_seed_offset(3)
    assert torch.equal(keep.view(-1), philox_keep_mask(keep.numel(), p, seed, offset, "cuda"))


@pytest.mark.cuda
def test_dropout_reproducible_p0_exact_and_eval_draws_nothing():
    x, bias, _ = _inputs((65, 1024), torch.bfloat16, "cuda")
    torch.manual_seed(7)
    a = bias_act_dropout(x, bias, "gelu", 0.3)
    b = bias_act_dropout(x, bias, "gelu", 0.3)
    torch.manual_seed(7)
    assert torch.equal(bias_act_dropout(x, bias, "gelu", 0.3), a)
    assert not torch.equal(a, b), "consecutive calls must draw new masks"
    want = F.relu(x.float() + bias.float()).to(x.dtype)
    state = torch.cuda.get_rng_state()
    assert torch.equal(bias_act_dropout(x, bias, "relu", 0.0), want)
    assert torch.equal(bias_act_dropout(x, bias, "relu", 0.5, training=False), want)
    assert torch.equal(torch.cuda.get_rng_state(), state), "p == 0 / eval must not advance the generator"
    assert torch.equal(bias_act_dropout(x, bias, "gelu", 1.0), torch.zeros_like(x))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_vector_and_scalar_paths_agree(dtype, activation):
    # Same data at a 16-byte-aligned and a misaligned address: the scalar fallback must produce the
    # same values and the same mask (the element index does not depend on the path).
    ext = lsmini._backend.ext()
    rows, hidden = 77, 1032
    x, bias, grad = _inputs((rows, hidden), dtype, "cuda")
    buf = torch.empty(2 * rows * hidden + 1, device="cuda", dtype=dtype)
    xs, gs = (buf[1 + k * rows * hidden: 1 + (k + 1) * rows * hidden].view(rows, hidden) for k in range(2))
    xs.copy_(x), gs.copy_(grad)
    assert xs.data_ptr() % 16 != 0
    for p in (0.0, 0.4):
        assert torch.equal(ext.bias_act_dropout_fwd(x, bias, activation, p, (99, 12, 0, 0)),
                           ext.bias_act_dropout_fwd(xs, bias, activation, p, (99, 12, 0, 0)))
        ga, gba = ext.bias_act_dropout_bwd(grad, x, bias, activation, p, (99, 12, 0, 0))
        gb, gbb = ext.bias_act_dropout_bwd(gs, xs, bias, activation, p, (99, 12, 0, 0))
        assert torch.equal(ga, gb)
        # the two paths tile the columns differently, so the fp32 sums differ in order: allow one
        # rounding step of the output dtype
        rtol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        torch.testing.assert_close(gba.float(), gbb.float(), atol=1e-4, rtol=rtol)


@pytest.mark.cuda
def test_grad_bias_deterministic_and_many_rows():
    x, bias, grad = _inputs((20000, 520), torch.float32, "cuda")
    ext = lsmini._backend.ext()
    gx1, g1 = ext.bias_act_dropout_bwd(grad, x, bias, "gelu", 0.2, (3, 4, 0, 0))
    gx2, g2 = ext.bias_act_dropout_bwd(grad, x, bias, "gelu", 0.2, (3, 4, 0, 0))
    assert torch.equal(g1, g2) and torch.equal(gx1, gx2)
    assert_column_sum_close(g1, gx1.double().sum(0), gx1.double().abs().sum(0), 20000)


@pytest.mark.cuda
def test_empty_rows():
    x, bias, grad = _inputs((0, 24), torch.float16, "cuda")
    out, gx, gb = _run(lambda x, b: bias_act_dropout(x, b, "gelu", 0.1), x, bias, grad)
    assert out.shape == (0, 24) and gx.shape == (0, 24)
    assert torch.equal(gb, torch.zeros_like(gb))


@pytest.mark.cuda
def test_bad_inputs_cuda():
    x, bias, grad = _inputs((4, 8), torch.float16, "cuda")
    with pytest.raises(ValueError, match="bias is on cpu but x is on cuda"):
        bias_act_dropout(x, bias.cpu())
    with pytest.raises(ValueError, match="unknown activation 'silu', expected one of 'relu', 'gelu', 'gelu_tanh'"):
        bias_act_dropout(x, bias, "silu")
    ext = lsmini._backend.ext()
    with pytest.raises(ValueError, match="bias_act_dropout_fwd: unknown activation 'tanh', expected one of "
                                         "'relu', 'gelu', 'gelu_tanh'"):
        ext.bias_act_dropout_fwd(x, bias, "tanh", 0.0, (0, 0, 0, 0))
    with pytest.raises(ValueError, match="bias_act_dropout_fwd: unknown activation id 3"):
        ext.bias_act_dropout_fwd(x, bias, 3, 0.0, (0, 0, 0, 0))
    with pytest.raises(TypeError, match="bias_act_dropout_fwd: act must be a str"):
        ext.bias_act_dropout_fwd(x, bias, 1.5, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="bias_act_dropout_fwd: x must be a CUDA tensor"):
        ext.bias_act_dropout_fwd(x.cpu(), None, "relu", 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"bias_act_dropout_fwd: bias must have shape \[8\]"):
        ext.bias_act_dropout_fwd(x, bias[:3], "relu", 0.0, (0, 0, 0, 0))
    with pytest.raises(TypeError, match="bias_act_dropout_fwd: bias must be Half .* or float32"):
        ext.bias_act_dropout_fwd(x, bias.double(), "relu", 0.0, (0, 0, 0, 0))
    with pytest.raises(ValueError, match=r"bias_act_dropout_fwd: p must be in \[0, 1\]"):
        ext.bias_act_dropout_fwd(x, bias, "relu", -0.5, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"bias_act_dropout_bwd: x must have shape \[4, 8\]"):
        ext.bias_act_dropout_bwd(grad, x[:2], bias, "relu", 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="bias_act_dropout_bwd: x must be Half"):
        ext.bias_act_dropout_bwd(grad, x.float(), bias, "relu", 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="bias_act_dropout_bwd: x must be a CUDA tensor"):
        ext.bias_act_dropout_bwd(grad, x.cpu(), bias, "relu", 0.0, (0, 0, 0, 0))
    with pytest.raises(ValueError, match="bias_act_dropout_bwd: unknown activation"):
        ext.bias_act_dropout_bwd(grad, x, bias, "elu", 0.0, (0, 0, 0, 0))
