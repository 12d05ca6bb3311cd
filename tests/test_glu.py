"""lsmini.ops.swiglu and geglu (the glu family): the reference against plain PyTorch, the registered operators
on CPU (CI) and the kernels on CUDA against the reference, forward and backward with one shared random output
gradient, the fused [gate | up] form, and dropout (statistics, the same mask in backward, reproducibility)."""
import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini.ops import geglu, glu_ref, swiglu
from lsmini.ops.dropout import keep_mask
from lsmini.ops.glu import ACTIVATIONS
from util import (LOWP, LsminiOps, assert_close_fp32, assert_dropout_keep_stats, assert_lowp_rule, next_seed_offset,
                  philox_keep_mask)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PUBLIC = {"silu": lambda g, u, p=0.0: swiglu(g, u, p), "gelu": lambda g, u, p=0.0: geglu(g, u, p),
          "gelu_tanh": lambda g, u, p=0.0: geglu(g, u, p, approximate="tanh")}


def _inputs(shape, dtype, device, seed=0):
    """gate, up, grad_out of the output's shape: seeded, never zero; gate spans the bend of every activation."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    gate = (2 * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
    up = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    return gate, up, grad


def _torch_act(v, activation):
    return F.silu(v) if activation == "silu" else F.gelu(v, approximate="tanh" if activation == "gelu_tanh" else "none")


def _plain(gate, up, grad, activation, mask, p):
    """Plain PyTorch in the inputs' precision, autograd through the same graph: out, grad_gate, grad_up."""
    gate = gate.detach().clone().requires_grad_(True)
    up = up.detach().clone().requires_grad_(True)
    h = _torch_act(gate, activation) * up
    if mask is not None:
        h = torch.where(mask, h * (1.0 / (1.0 - p)), torch.zeros_like(h))
    h.backward(grad)
    return h.detach(), gate.grad, up.grad


def _ours(activation, gate, up, grad, p, fused):
    """The public op on (gate, up), or on their concatenation [gate | up] (fused): out, grad_gate, grad_up (the
    fused gradient split back in two)."""
    gate = gate.detach().clone().requires_grad_(True)
    up = up.detach().clone().requires_grad_(True)
    if fused:
        gate_up = torch.cat([gate.detach(), up.detach()], -1).requires_grad_(True)
        out = PUBLIC[activation](gate_up, None, p)
        out.backward(grad)
        assert gate_up.grad.shape == gate_up.shape
        grad_gate, grad_up = gate_up.grad.chunk(2, -1)
        return out.detach(), grad_gate, grad_up
    out = PUBLIC[activation](gate, up, p)
    out.backward(grad)
    return out.detach(), gate.grad, up.grad


def _check_all(dtype, ours, ref32, lowp, ref64=None):
    """fp16/bf16: the 2x rule against the fp32 reference. fp32: elementwise against the fp32 reference, or,
    given ref64 (the float64 reference), the 2x rule against it with plain fp32 PyTorch (lowp) as the yardstick:
    gelu_tanh's derivative cancels for negative inputs (1 + tanh and 1 − tanh² both near 0), so any fp32
    evaluation, PyTorch's included, is off by about 1e-5 there on large rows, and two fp32 evaluations
    differ by twice that."""
    for i, (name, a, r, t) in enumerate(zip(("out", "grad_gate", "grad_up"), ours, ref32, lowp)):
        assert a.dtype == dtype, f"{name}: dtype {a.dtype}, expected {dtype}"
        if dtype in LOWP:
            assert_lowp_rule(a, r, t, name=name)
        elif ref64 is not None:
            assert_lowp_rule(a, ref64[i], t, atol=1e-5, name=name)
        else:
            assert_close_fp32(a, r, name=name)


# ------------------------------------------------------------------------------------ CPU (CI) ---

@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 5, 24)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_reference_matches_torch(activation, shape, fused, p):
    """In float64 the reference computes in float64: it matches act(gate)·up and F.dropout under the same seed
    to rounding, forward and backward, also split from one [gate | up] tensor."""
    gate, up, grad = _inputs(shape, torch.float64, "cpu")
    g1, u1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    gu = torch.cat([gate, up], -1).requires_grad_()
    torch.manual_seed(1)
    ours = glu_ref(gu, None, activation, p) if fused else glu_ref(g1, u1, activation, p)
    ours.backward(grad)
    ours_grads = gu.grad.chunk(2, -1) if fused else (g1.grad, u1.grad)
    g2, u2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    torch.manual_seed(1)  # the same draw of the same shape: the same mask
    theirs = F.dropout(_torch_act(g2, activation) * u2, p, training=True)
    theirs.backward(grad)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours_grads[0], g2.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ours_grads[1], u2.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_reference_eval_p0_and_mask(activation):
    gate, up, _ = _inputs((6, 10), torch.float32, "cpu")
    plain = _torch_act(gate, activation) * up
    assert_close_fp32(glu_ref(gate, up, activation, 0.7, training=False), plain)
    assert_close_fp32(glu_ref(gate, up, activation, 0.0), plain)
    mask = torch.rand(6, 10, generator=torch.Generator().manual_seed(3)) > 0.4
    assert_close_fp32(glu_ref(gate, up, activation, 0.4, mask=mask), torch.where(mask, plain / 0.6, 0.0))
    assert torch.equal(glu_ref(gate, up, activation, 1.0), torch.zeros_like(gate))
    assert_close_fp32(glu_ref(torch.cat([gate, up], -1), None, activation), glu_ref(gate, up, activation))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_computes_in_fp32_and_keeps_dtype(dtype):
    gate, up, _ = _inputs((5, 12), dtype, "cpu")
    out = glu_ref(gate, up, "silu")
    assert out.dtype == dtype
    assert torch.equal(out, (F.silu(gate.float()) * up.float()).to(dtype))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 5, 24), (129, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_op_on_cpu_matches_torch(activation, shape, dtype, p):
    """The registered operators' CPU implementations, separate and fused, forward and every gradient with one
    random grad_output, against plain PyTorch applying the mask the op draws: the reference's keep-mask
    (``lsmini.ops.dropout.keep_mask``) from torch's CPU generator, here drawn again under the same seed."""
    gate, up, grad = _inputs(shape, dtype, "cpu")
    torch.manual_seed(1)
    keep = keep_mask(shape, p, "cpu")
    ref32 = _plain(gate.float(), up.float(), grad.float(), activation, keep, p)
    lowp = _plain(gate, up, grad, activation, keep, p)
    for fused in (False, True):
        torch.manual_seed(1)
        with LsminiOps() as ops:
            ours = _ours(activation, gate, up, grad, p, fused)
        assert ops.names == ["glu", "glu_backward"]
        _check_all(dtype, ours, ref32, lowp)


def test_public_ops_pick_the_activation():
    gate, up, _ = _inputs((4, 16), torch.float32, "cpu")
    assert torch.equal(swiglu(gate, up), glu_ref(gate, up, "silu"))
    assert torch.equal(geglu(gate, up), glu_ref(gate, up, "gelu"))
    assert torch.equal(geglu(gate, up, approximate="tanh"), glu_ref(gate, up, "gelu_tanh"))
    assert_close_fp32(geglu(gate, up), F.gelu(gate) * up)
    assert_close_fp32(swiglu(torch.cat([gate, up], -1)), F.silu(gate) * up)  # first half: the gate
    assert_close_fp32(geglu(torch.cat([gate, up], -1), approximate="tanh"), F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_op_on_cpu_dropout_statistics_same_mask_and_seed(p):
    g = torch.Generator(device="cpu").manual_seed(2)
    shape = (333, 1032)
    gate = (1 + torch.rand(*shape, generator=g)).requires_grad_()  # silu(gate)·up > 0: kept ≠ 0
    up = (1 + torch.rand(*shape, generator=g)).requires_grad_()
    grad = 1 + torch.rand(*shape, generator=g)
    torch.manual_seed(3)
    out = swiglu(gate, up, p)
    gg, gu = torch.autograd.grad(out, (gate, up), grad)
    keep = out != 0
    assert_dropout_keep_stats(keep, p, name=f"mask p={p}")
    assert torch.equal(gg == 0, ~keep) and torch.equal(gu == 0, ~keep)  # the backward applies the forward's mask
    assert_close_fp32(gu[keep], (grad * F.silu(gate))[keep] / (1 - p), atol=0, rtol=1e-6)
    torch.manual_seed(3)
    assert torch.equal(swiglu(gate, up, p), out)
    assert not torch.equal(swiglu(gate, up, p), out), "each call draws a new mask"


def test_op_on_cpu_eval_p0_and_forced_reference(monkeypatch):
    gate, up, _ = _inputs((4, 16), torch.float32, "cpu")
    state = torch.get_rng_state()
    with LsminiOps() as ops:
        assert torch.equal(swiglu(gate, up), glu_ref(gate, up, "silu"))
        assert torch.equal(swiglu(gate, up, 0.5, training=False), glu_ref(gate, up, "silu"))
        assert torch.equal(geglu(gate, up, 0.5, training=False), glu_ref(gate, up, "gelu"))
    assert ops.names == ["glu"] * 3
    assert torch.equal(torch.get_rng_state(), state), "p == 0 / eval must not draw"
    with LsminiOps() as ops:
        out = swiglu(gate.double(), up.double())
    assert ops.names == [] and out.dtype == torch.float64
    torch.testing.assert_close(out, F.silu(gate.double()) * up.double(), atol=1e-12, rtol=1e-12)
    monkeypatch.setattr(lsmini.config, "reference", True)
    gate.requires_grad_()
    with LsminiOps() as ops:
        out = geglu(gate, up)
        out.sum().backward()
    assert ops.names == [] and gate.grad is not None
    assert torch.equal(out, glu_ref(gate, up, "gelu"))


def test_empty_rows_on_cpu():
    gate, up, grad = _inputs((0, 3, 16), torch.float32, "cpu")
    out, gg, gu = _ours("silu", gate, up, grad, 0.2, fused=False)
    assert out.shape == gg.shape == gu.shape == (0, 3, 16)
    out, gg, gu = _ours("gelu", gate, up, grad, 0.2, fused=True)
    assert out.shape == gg.shape == gu.shape == (0, 3, 16)


def test_backward_saves_the_inputs_and_the_dropout_state():
    """No activation is kept: the backward recomputes act(gate) from gate."""
    gate, up, _ = _inputs((4, 3, 16), torch.bfloat16, "cpu")
    gate.requires_grad_()
    out = swiglu(gate, up, 0.25)
    node = out.grad_fn
    while "lsmini" not in type(node).__name__:
        node = node.next_functions[0][0]
    saved = node.saved_tensors
    assert len(saved) == 3 and saved[0].data_ptr() == gate.data_ptr() and saved[1].data_ptr() == up.data_ptr()
    assert saved[2].dtype == torch.bool and saved[2].shape == (12, 16)  # the CPU keep-mask


BAD_CALLS = [
    (lambda g, u: swiglu(g[:, :7]), ValueError, r"swiglu: without up, gate holds \[gate \| up\] along its last "
                                                r"dimension, which must be even, got shape \(4, 7\)"),
    (lambda g, u: geglu(g, u[:2]), ValueError, r"geglu: up must have gate's shape \(4, 16\), got \(2, 16\)"),
    (lambda g, u: swiglu(g, u.half()), TypeError, "swiglu: up must have gate's dtype torch.float32, got torch.float16"),
    (lambda g, u: swiglu(g, u.tolist()), TypeError, "swiglu: up must be a Tensor or None, got list"),
    (lambda g, u: swiglu(g.int(), None), TypeError, "swiglu: gate must be a floating-point tensor"),
    (lambda g, u: swiglu(g[:, :0], None), ValueError, "swiglu: gate must have a non-empty last dimension"),
    (lambda g, u: swiglu(None, u), TypeError, "swiglu: gate must be a Tensor, got NoneType"),
    (lambda g, u: swiglu(g, u, 1.5), ValueError, r"swiglu: dropout_p must be in \[0, 1\], got 1.5"),
    (lambda g, u: geglu(g, u, None), TypeError, "geglu: dropout_p must be a float in \\[0, 1\\], got NoneType"),
    (lambda g, u: geglu(g, u, approximate="erf"), ValueError, "geglu: approximate must be 'none' or 'tanh', got 'erf'"),
]


@pytest.mark.parametrize("case", range(len(BAD_CALLS)))
def test_bad_input_errors_before_any_operator_runs(case):
    call, error, match = BAD_CALLS[case]
    gate, up, _ = _inputs((4, 16), torch.float32, "cpu")
    with LsminiOps() as ops:
        with pytest.raises(error, match=match):
            call(gate, up)
    assert ops.names == []


# ---------------------------------------------------------------------------------------- CUDA ---

# Output shapes [rows, ffn]: one element, one row, odd sizes (the scalar path), the vector path from 8 to 16384
# columns, many rows, 3-D.
SHAPES = [(1, 1), (1, 8), (7, 7), (33, 8), (2049, 1), (129, 7), (31, 1032), (257, 1032), (127, 4104), (3, 16384),
          (2, 8192), (5, 1001), (3, 5, 1032)]


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_kernel_matches_reference(activation, shape, dtype, p):
    """Forward and every gradient, separate and fused, vs the reference (_check_all), with the kernel's Philox mask
    reproduced by the independent Python Philox (element index = row·ffn + col of the output)."""
    gate, up, grad = _inputs(shape, dtype, "cuda")
    mask = None
    if p > 0:
        seed, offset = next_seed_offset(11)
        mask = philox_keep_mask(gate.numel(), p, seed, offset, "cuda").view(shape)
    ref32 = _plain(gate.float(), up.float(), grad.float(), activation, mask, p)
    ref64 = _plain(gate.double(), up.double(), grad.double(), activation, mask, p)
    lowp = _plain(gate, up, grad, activation, mask, p)
    for fused in (False, True):
        torch.manual_seed(11)
        ours = _ours(activation, gate, up, grad, p, fused)
        _check_all(dtype, ours, ref32, lowp, ref64)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_and_separate_forms_agree_bitwise(activation, dtype):
    """[gate | up] in one tensor gives the bits of gate and up apart: the same math, the same mask (the index is
    the output's)."""
    gate, up, grad = _inputs((65, 1032), dtype, "cuda")
    for p in (0.0, 0.3):
        torch.manual_seed(5)
        a = _ours(activation, gate, up, grad, p, fused=False)
        torch.manual_seed(5)
        b = _ours(activation, gate, up, grad, p, fused=True)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_accuracy_over_a_wide_range(activation):
    """fp32 act(gate) (up = 1) and its derivative (the gradient of gate with grad_out = 1) on a dense grid over
    [-20, 20] plus the extremes, vs float64: within the fp32 rule and no worse than 2x PyTorch's own fp32
    error."""
    ext = lsmini._backend.ext()
    v = torch.cat([torch.linspace(-20, 20, 200003), torch.tensor([-100.0, -80.0, 80.0, 100.0, 0.0])])
    gate = v.view(1, -1).cuda()
    ones = torch.ones_like(gate)
    vd = v.double().requires_grad_()
    y64 = _torch_act(vd, activation)
    (d64,) = torch.autograd.grad(y64.sum(), vd)
    y = ext.glu_fwd(gate, ones, activation, 0.0, (0, 0, 0, 0))
    dgate, dup = ext.glu_bwd(ones, gate, ones, activation, 0.0, (0, 0, 0, 0))
    assert_close_fp32(y.view(-1).cpu(), y64.detach().float(), name=f"{activation} forward")
    assert_close_fp32(dgate.view(-1).cpu(), d64.float(), name=f"{activation} derivative")
    assert_close_fp32(dup, y, atol=1e-7, rtol=1e-6, name="grad_up = grad_out · act(gate)")
    yt = _torch_act(gate, activation).view(-1).cpu()
    assert (y.view(-1).cpu().double() - y64).abs().max() <= 2 * (yt.double() - y64).abs().max() + 1e-7


@pytest.mark.cuda
def test_nan_propagates():
    ext = lsmini._backend.ext()
    gate = torch.tensor([[float("nan"), 1.0, -1.0, 0.0]], device="cuda")
    up = torch.tensor([[1.0, float("nan"), 2.0, 3.0]], device="cuda")
    for act in ACTIVATIONS:
        out = ext.glu_fwd(gate, up, act, 0.0, (0, 0, 0, 0))
        assert torch.equal(torch.isnan(out), torch.isnan(_torch_act(gate, act) * up)), act


@pytest.mark.cuda
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("shape", [(1024, 1024), (4097, 7), (333, 1032)])
def test_dropout_statistics_and_same_mask(activation, dtype, p, shape):
    g = torch.Generator(device="cpu").manual_seed(2)
    gate = (1 + torch.rand(*shape, generator=g)).to("cuda", dtype).requires_grad_()  # act(gate)·up > 0
    up = (1 + torch.rand(*shape, generator=g)).to("cuda", dtype).requires_grad_()
    grad = (1 + torch.rand(*shape, generator=g)).to("cuda", dtype)
    torch.manual_seed(3)
    out = PUBLIC[activation](gate, up, p)
    gg, gu = torch.autograd.grad(out, (gate, up), grad)
    keep = out != 0
    assert_dropout_keep_stats(keep, p, name=f"mask {dtype} p={p}")
    # the backward regenerates the forward's mask: the gradients are zero exactly where the output was dropped
    assert torch.equal(gg == 0, ~keep) and torch.equal(gu == 0, ~keep)
    seed, offset = next_seed_offset(3)
    assert torch.equal(keep.view(-1), philox_keep_mask(keep.numel(), p, seed, offset, "cuda"))


@pytest.mark.cuda
def test_dropout_reproducible_p0_exact_and_eval_draws_nothing():
    gate, up, _ = _inputs((65, 1024), torch.bfloat16, "cuda")
    torch.manual_seed(7)
    a = swiglu(gate, up, 0.3)
    b = swiglu(gate, up, 0.3)
    torch.manual_seed(7)
    assert torch.equal(swiglu(gate, up, 0.3), a)
    assert not torch.equal(a, b), "consecutive calls must draw new masks"
    want = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    state = torch.cuda.get_rng_state()
    torch.testing.assert_close(swiglu(gate, up), want)  # p == 0: no mask at all
    assert torch.equal(swiglu(gate, up, 0.5, training=False), swiglu(gate, up))
    assert torch.equal(torch.cuda.get_rng_state(), state), "p == 0 / eval must not advance the generator"
    assert torch.equal(geglu(gate, up, 1.0), torch.zeros_like(gate))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_vector_and_scalar_paths_agree(dtype, activation):
    """The same data at a 16-byte-aligned and a misaligned address: the scalar fallback gives the same bits and the
    same mask (the element index does not depend on the path)."""
    ext = lsmini._backend.ext()
    rows, cols = 77, 1032
    gate, up, grad = _inputs((rows, cols), dtype, "cuda")
    n = rows * cols
    buf = torch.empty(3 * n + 1, device="cuda", dtype=dtype)
    gs, us, ds = (buf[1 + k * n: 1 + (k + 1) * n].view(rows, cols) for k in range(3))
    gs.copy_(gate), us.copy_(up), ds.copy_(grad)
    assert gs.data_ptr() % 16 != 0
    for p in (0.0, 0.4):
        rng = (99, 12, 0, 0)
        assert torch.equal(ext.glu_fwd(gate, up, activation, p, rng), ext.glu_fwd(gs, us, activation, p, rng))
        a = ext.glu_bwd(grad, gate, up, activation, p, rng)
        b = ext.glu_bwd(ds, gs, us, activation, p, rng)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.cuda
def test_non_contiguous_inputs():
    """gate and up as views of one [rows, 2·ffn] tensor (chunk): copied to contiguous, the same result as the
    fused form."""
    gate_up = torch.randn(33, 2 * 520, device="cuda", dtype=torch.float16)
    gate, up = gate_up.chunk(2, -1)
    assert not gate.is_contiguous()
    torch.manual_seed(1)
    a = swiglu(gate, up, 0.2)
    torch.manual_seed(1)
    assert torch.equal(a, swiglu(gate_up, None, 0.2))


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True])
def test_empty_rows(fused):
    gate, up, grad = _inputs((0, 24), torch.float16, "cuda")
    out, gg, gu = _ours("silu", gate, up, grad, 0.1, fused)
    assert out.shape == gg.shape == gu.shape == (0, 24)


@pytest.mark.cuda
def test_backward_saves_the_inputs():
    gate, up, _ = _inputs((16, 64), torch.float16, "cuda")
    gate.requires_grad_()
    up.requires_grad_()
    out = swiglu(gate, up, 0.1)
    node = out.grad_fn
    while "lsmini" not in type(node).__name__:
        node = node.next_functions[0][0]
    saved = node.saved_tensors
    assert saved[0].data_ptr() == gate.data_ptr() and saved[1].data_ptr() == up.data_ptr()
    assert saved[2].shape == (1, 2) and saved[2].dtype == torch.int64  # the Philox state, not a mask


@pytest.mark.cuda
def test_binding_bad_input_errors():
    ext = lsmini._backend.ext()
    gate, up, grad = _inputs((4, 8), torch.float16, "cuda")
    rng = (0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="glu_fwd: gate must be a CUDA tensor"):
        ext.glu_fwd(gate.cpu(), None, "silu", 0.0, rng)
    with pytest.raises(RuntimeError, match="glu_fwd: gate must be float32, float16 or bfloat16, got Double"):
        ext.glu_fwd(gate.double(), None, "silu", 0.0, rng)
    with pytest.raises(ValueError, match=r"glu_fwd: gate must be 2-D \[rows, hidden\]"):
        ext.glu_fwd(gate.view(2, 2, 8), None, "silu", 0.0, rng)
    with pytest.raises(ValueError, match="glu_fwd: without up, gate holds gate and up side by side and its last "
                                         "dimension must be even, got 7"):
        ext.glu_fwd(gate[:, :7], None, "silu", 0.0, rng)
    with pytest.raises(RuntimeError, match=r"glu_fwd: up must have shape \[4, 8\]"):
        ext.glu_fwd(gate, up[:2], "silu", 0.0, rng)
    with pytest.raises(RuntimeError, match="glu_fwd: up must be Half"):
        ext.glu_fwd(gate, up.float(), "silu", 0.0, rng)
    with pytest.raises(RuntimeError, match="glu_fwd: up must be a CUDA tensor"):
        ext.glu_fwd(gate, up.cpu(), "silu", 0.0, rng)
    with pytest.raises(ValueError, match="glu_fwd: unknown activation 'relu', expected one of 'silu', 'gelu', "
                                         "'gelu_tanh'"):
        ext.glu_fwd(gate, up, "relu", 0.0, rng)
    with pytest.raises(ValueError, match=r"glu_fwd: p must be in \[0, 1\]"):
        ext.glu_fwd(gate, up, "silu", 1.5, rng)
    with pytest.raises(RuntimeError, match="glu_fwd: rng must be"):
        ext.glu_fwd(gate, up, "silu", 0.5, (0, 0, 8, 0))
    with pytest.raises(RuntimeError, match=r"glu_bwd: grad_out must have shape \[4, 4\]"):
        ext.glu_bwd(grad, gate, None, "silu", 0.0, rng)
    with pytest.raises(RuntimeError, match="glu_bwd: grad_out must be Half"):
        ext.glu_bwd(grad.float(), gate, up, "silu", 0.0, rng)
    with pytest.raises(ValueError, match="glu_bwd: unknown activation 'tanh'"):
        ext.glu_bwd(grad, gate, up, "tanh", 0.0, rng)
    with pytest.raises(ValueError, match="swiglu: up is on cpu but gate is on cuda"):
        swiglu(gate, up.cpu())
