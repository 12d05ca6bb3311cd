import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini.ops.bias_dropout_residual import bias_dropout_residual, bias_dropout_residual_ref
from lsmini.ops.dropout import keep_mask
from util import (LOWP, LsminiOps, assert_close_fp32, assert_column_sum_close, assert_dropout_keep_stats,
                  assert_lowp_rule, next_seed_offset, PHILOX_ROUNDS, philox4x32, philox_keep_mask)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(shape, dtype, device, bias_dtype="same", seed=0):
    """x, bias (or None), residual, grad_out: seeded, never zero."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = shape[-1]
    x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    residual = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    grad = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    if bias_dtype is None:
        bias = None
    else:
        bdt = dtype if bias_dtype == "same" else bias_dtype
        bias = torch.randn(hidden, generator=g).to(device=device, dtype=bdt)
    return x, bias, residual, grad


def _run(fn, x, bias, residual, grad):
    """Forward and every gradient of fn(x, bias, residual) with the given grad_output."""
    x = x.detach().clone().requires_grad_(True)
    residual = residual.detach().clone().requires_grad_(True)
    bias = bias.detach().clone().requires_grad_(True) if bias is not None else None
    out = fn(x, bias, residual)
    out.backward(grad)
    return out.detach(), x.grad, (bias.grad if bias is not None else None), residual.grad


# ------------------------------------------------------------------------------------ CPU (CI) ---

@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (64, 512), (3, 5, 24)])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_reference_matches_torch(shape, has_bias, p):
    x, bias, residual, grad = _inputs(shape, torch.float32, "cpu", "same" if has_bias else None)

    def plain(x, b, r):
        return r + F.dropout(x + b if b is not None else x, p, training=True)

    torch.manual_seed(1)
    ours = _run(lambda x, b, r: bias_dropout_residual_ref(x, b, r, p), x, bias, residual, grad)
    torch.manual_seed(1)  # the same draw of the same shape: the same mask
    theirs = _run(plain, x, bias, residual, grad)
    for name, a, r in zip(("out", "grad_x", "grad_bias", "grad_residual"), ours, theirs):
        if r is None:
            assert a is None
            continue
        assert_close_fp32(a, r, atol=1e-5, rtol=1e-5, name=name)


def test_reference_eval_p0_and_mask():
    x, bias, residual, _ = _inputs((6, 10), torch.float32, "cpu")
    plain = residual + x + bias
    assert_close_fp32(bias_dropout_residual_ref(x, bias, residual, 0.7, training=False), plain)
    assert_close_fp32(bias_dropout_residual_ref(x, bias, residual, 0.0), plain)
    mask = torch.rand(6, 10, generator=torch.Generator().manual_seed(3)) > 0.4
    want = residual + torch.where(mask, (x + bias) / 0.6, torch.zeros_like(x))
    assert_close_fp32(bias_dropout_residual_ref(x, bias, residual, 0.4, mask=mask), want)
    assert torch.equal(bias_dropout_residual_ref(x, bias, residual, 1.0, mask=mask), residual)
    assert torch.equal(bias_dropout_residual_ref(x, bias, residual, 1.0), residual)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_computes_in_fp32_and_keeps_dtype(dtype):
    x, bias, residual, _ = _inputs((5, 12), dtype, "cpu", bias_dtype=torch.float32)
    out = bias_dropout_residual_ref(x, bias, residual)
    assert out.dtype == dtype
    want = (residual.float() + (x.float() + bias)).to(dtype)
    assert torch.equal(out, want)


def _plain(x, bias, residual, keep, p):
    """residual + dropout(x + bias) in plain PyTorch, with the given keep-mask (None: no dropout)."""
    y = x if bias is None else x + bias.to(x.dtype)
    if keep is not None:
        y = torch.where(keep, y * (1.0 / (1.0 - p)), torch.zeros_like(y))
    return residual + y


@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (3, 5, 24), (129, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_op_on_cpu_matches_torch(shape, dtype, p):
    """The registered operator's CPU implementation, forward and every gradient with one random
    grad_output, against plain PyTorch applying the mask the op draws: the reference's keep-mask
    (``lsmini.ops.dropout.keep_mask``) from torch's CPU generator, here drawn again under the same seed."""
    for bias_kind in _bias_kinds(dtype):
        x, bias, residual, grad = _inputs(shape, dtype, "cpu", bias_kind)
        torch.manual_seed(1)
        with LsminiOps() as ops:
            ours = _run(lambda x, b, r: bias_dropout_residual(x, b, r, p), x, bias, residual, grad)
        calls_backward = p > 0 or bias is not None  # else grad_x is grad_out itself
        assert ops.names == ["bias_dropout_residual"] + ["bias_dropout_residual_backward"] * calls_backward
        torch.manual_seed(1)
        keep = keep_mask(x.shape, p, "cpu")
        up = lambda t: t.float() if t is not None else None  # noqa: E731
        ref32 = _run(lambda x, b, r: _plain(x, b, r, keep, p), up(x), up(bias), up(residual), up(grad))
        lowp = _lowp_torch(x, bias, residual, grad, keep, p)
        _check_all(dtype, ours, ref32, lowp)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_op_on_cpu_dropout_statistics_same_mask_and_seed(p):
    g = torch.Generator(device="cpu").manual_seed(2)
    shape = (333, 1032)
    x = (1 + torch.rand(*shape, generator=g)).requires_grad_()  # |x + 0| ≥ 1: kept ≠ 0
    residual = torch.randn(*shape, generator=g).requires_grad_()
    grad = 1 + torch.rand(*shape, generator=g)
    torch.manual_seed(3)
    out = bias_dropout_residual(x, None, residual, p)
    (gx,) = torch.autograd.grad(out, (x,), grad)
    keep = out != residual  # a dropped element gives exactly the residual
    assert_dropout_keep_stats(keep, p, name=f"mask p={p}")
    assert torch.equal(gx == 0, ~keep)  # the backward applies the forward's mask
    assert_close_fp32(gx[keep], grad[keep] / (1 - p), atol=0, rtol=1e-6)
    torch.manual_seed(3)
    assert torch.equal(bias_dropout_residual(x, None, residual, p), out)
    assert not torch.equal(bias_dropout_residual(x, None, residual, p), out), "each call draws a new mask"


def test_op_on_cpu_eval_p0_and_forced_reference(monkeypatch):
    x, bias, residual, _ = _inputs((4, 16), torch.float32, "cpu")
    state = torch.get_rng_state()
    with LsminiOps() as ops:
        plain = bias_dropout_residual(x, bias, residual)
        assert torch.equal(bias_dropout_residual(x, bias, residual, 0.5, training=False), plain)
    assert ops.names == ["bias_dropout_residual"] * 2
    assert torch.equal(torch.get_rng_state(), state), "p == 0 / eval must not draw"
    assert torch.equal(plain, bias_dropout_residual_ref(x, bias, residual))
    with LsminiOps() as ops:
        bias_dropout_residual(x.double(), bias.double(), residual.double())
    assert ops.names == []
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        assert torch.equal(bias_dropout_residual(x, bias, residual), plain)
    assert ops.names == []


def test_bad_inputs_cpu():
    x, bias, residual, _ = _inputs((4, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match="residual must have x's shape"):
        bias_dropout_residual(x, bias, residual[:, :4])
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        bias_dropout_residual(x, bias, residual.double())
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_dropout_residual(x, bias[:4], residual)
    with pytest.raises(TypeError, match="bias must be torch.float32"):
        bias_dropout_residual(x, bias.double(), residual)
    with pytest.raises(TypeError, match="bias must be torch.float16 .* or torch.float32"):
        bias_dropout_residual(x.half(), bias.bfloat16(), residual.half())
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got 1.5"):
        bias_dropout_residual(x, bias, residual, 1.5)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        bias_dropout_residual(x, bias, residual, -0.1)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        bias_dropout_residual(x, bias, residual, "0.1")
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        bias_dropout_residual(x.long(), None, residual.long())
    with pytest.raises(TypeError, match="x must be a Tensor"):
        bias_dropout_residual([1.0], None, residual)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        bias_dropout_residual(x[:, :0], None, residual[:, :0])


# Random123's tests/kat_vectors, "philox4x32 R": ctr[4], key[2] -> out[4]. The kernels draw with 7 rounds; the
# 10-round vectors check the same round function once more.
_M32 = 0xFFFFFFFF
_PI_CTR, _PI_KEY = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)
_PHILOX_KAT = {
    7: [((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
        ((_M32,) * 4, (_M32, _M32), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
        (_PI_CTR, _PI_KEY, (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A))],
    10: [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
         ((_M32,) * 4, (_M32, _M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
         (_PI_CTR, _PI_KEY, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))],
}


@pytest.mark.parametrize("rounds", [PHILOX_ROUNDS, 10])
def test_python_philox_matches_known_answers(rounds):
    for ctr, key, want in _PHILOX_KAT[rounds]:
        got = philox4x32(*(torch.tensor([c], dtype=torch.int64) for c in ctr), *key, rounds=rounds)
        assert [int(w) for w in got] == list(want)


def test_python_keep_mask_statistics():
    keep = philox_keep_mask(512 * 1024, 0.1, seed=12345, offset=8).view(512, 1024)
    assert_dropout_keep_stats(keep, 0.1)
    assert philox_keep_mask(4096, 0.0, 1, 0).all()


# ----------------------------------------------------------------------------------- CUDA ---------

SHAPES = [(1, 1), (1, 8), (7, 7), (33, 8), (2049, 1), (129, 7), (31, 1032), (257, 1032), (127, 4104),
          (3, 16384), (3, 5, 1032)]


def _bias_kinds(dtype):
    return [None, "same"] + ([torch.float32] if dtype in LOWP else [])


def _check_all(dtype, ours, ref32, lowp, names=("out", "grad_x", "grad_bias", "grad_residual")):
    """ours: the kernel's (out, grads...); ref32: the reference on fp32 inputs; lowp: plain PyTorch
    in the low precision. grad_bias (index 2) in fp32 gets the summation bound."""
    for k, (name, a, r, t) in enumerate(zip(names, ours, ref32, lowp)):
        if r is None:
            assert a is None, f"{name}: expected None"
            continue
        want_dtype = t.dtype if dtype in LOWP else r.dtype
        assert a.dtype == want_dtype, f"{name}: dtype {a.dtype}, expected {want_dtype}"
        if dtype in LOWP:
            assert_lowp_rule(a, r, t, name=name)
        elif name == "grad_bias":
            gx = ref32[1]
            assert_column_sum_close(a, r, gx.abs().reshape(-1, gx.shape[-1]).sum(0), gx.numel() // gx.shape[-1])
        else:
            assert_close_fp32(a, r, name=name)


def _lowp_torch(x, bias, residual, grad, mask, p):
    """Plain PyTorch in x's low precision: forward, grad_x, grad_bias, grad_residual."""
    dt = x.dtype
    scale = 1.0 / (1.0 - p) if p < 1 else 0.0
    b = bias.to(dt) if bias is not None else None
    y = x + b if b is not None else x
    y = torch.where(mask, y * scale, torch.zeros_like(y)) if mask is not None else y
    out = residual + y
    gx = torch.where(mask, grad * scale, torch.zeros_like(grad)) if mask is not None else grad
    gb = gx.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype) if bias is not None else None
    return out, gx, gb, grad


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.25])
def test_kernel_matches_reference(shape, dtype, p):
    """Forward and every gradient vs the fp32 reference, with the kernel's Philox mask reproduced by
    the independent Python Philox (element index = row·hidden + col)."""
    for bias_kind in _bias_kinds(dtype):
        x, bias, residual, grad = _inputs(shape, dtype, "cuda", bias_kind)
        mask = None
        if p > 0:
            seed, offset = next_seed_offset(11)
            mask = philox_keep_mask(x.numel(), p, seed, offset, "cuda").view(shape)
        ours = _run(lambda x, b, r: bias_dropout_residual(x, b, r, p), x, bias, residual, grad)
        up = lambda t: t.float() if t is not None else None  # noqa: E731
        ref32 = _run(lambda x, b, r: bias_dropout_residual_ref(x, b, r, p, mask=mask),
                     up(x), up(bias), up(residual), up(grad))
        lowp = _lowp_torch(x, bias, residual, grad, mask, p)
        _check_all(dtype, ours, ref32, lowp)
        if bias is not None:
            assert ours[2].dtype == bias.dtype


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_binding_outputs_and_grad_bias_dtype(dtype):
    ext = lsmini._backend.ext()
    x, bias, residual, grad = _inputs((37, 1032), dtype, "cuda", torch.float32)
    out = ext.bias_dropout_residual_fwd(x, bias, residual, 0.0, (0, 0, 0, 0))
    ref = bias_dropout_residual_ref(x.float(), bias, residual.float())
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out, ref.to(dtype))  # one rounding of the same fp32 sum
    given = torch.full_like(x, float("nan"))  # into a given tensor; in place over residual too
    assert ext.bias_dropout_residual_fwd(x, bias, residual, 0.3, (5, 8, 0, 0), given).data_ptr() == given.data_ptr()
    fresh = ext.bias_dropout_residual_fwd(x, bias, residual, 0.3, (5, 8, 0, 0))
    in_place = residual.clone()
    ext.bias_dropout_residual_fwd(x, bias, in_place, 0.3, (5, 8, 0, 0), out=in_place)
    assert torch.equal(given, fresh) and torch.equal(in_place, fresh)
    with pytest.raises(RuntimeError, match="bias_dropout_residual_fwd: out partially overlaps x"):
        flat = torch.empty(2 * x.numel(), dtype=dtype, device="cuda")
        ext.bias_dropout_residual_fwd(flat[:x.numel()].view_as(x), bias, residual, 0.3, (5, 8, 0, 0),
                                      flat[1:x.numel() + 1].view_as(x))
    gx, gb = ext.bias_dropout_residual_bwd(grad, 0.0, (0, 0, 0, 0), True, torch.float32)
    assert gx is grad or gx.data_ptr() == grad.data_ptr()  # p == 0: grad_out passes through, no copy
    assert gb.dtype == torch.float32
    assert_column_sum_close(gb, grad.double().sum(0), grad.double().abs().sum(0), 37)
    gx, gb = ext.bias_dropout_residual_bwd(grad, 0.3, (5, 8, 0, 0), True)
    assert gb.dtype == dtype and gx.data_ptr() != grad.data_ptr()
    gx, gb = ext.bias_dropout_residual_bwd(grad, 0.3, (5, 8, 0, 0), False)
    assert gb is None
    # grad_x: written there with p > 0 (the same bits), untouched with p == 0 (grad_out passes through)
    buf = torch.full_like(grad, float("nan"))
    gx2, _ = ext.bias_dropout_residual_bwd(grad, 0.3, (5, 8, 0, 0), False, None, buf)
    assert gx2.data_ptr() == buf.data_ptr() and torch.equal(gx2, gx)
    gx3, _ = ext.bias_dropout_residual_bwd(grad, 0.0, (0, 0, 0, 0), False, None, buf)
    assert gx3.data_ptr() == grad.data_ptr() and torch.equal(buf, gx)
    with pytest.raises(RuntimeError, match="bias_dropout_residual_bwd: grad_x overlaps grad_out"):
        ext.bias_dropout_residual_bwd(grad, 0.3, (5, 8, 0, 0), False, None, grad)
    with pytest.raises(RuntimeError, match=r"bias_dropout_residual_bwd: grad_x must have shape"):
        ext.bias_dropout_residual_bwd(grad, 0.3, (5, 8, 0, 0), False, None, buf[:3])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_grad_residual_is_grad_out(device):
    x, bias, residual, grad = _inputs((9, 64), torch.float16, device)
    out = bias_dropout_residual(x.requires_grad_(), bias.requires_grad_(), residual.requires_grad_(), 0.2)
    gx, gb, gr = torch.autograd.grad(out, (x, bias, residual), grad)
    assert gr.data_ptr() == grad.data_ptr()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("shape", [(1024, 1024), (4097, 7), (333, 1032)])
def test_dropout_statistics_and_same_mask(dtype, p, shape):
    g = torch.Generator(device="cpu").manual_seed(2)
    x = (1 + torch.rand(*shape, generator=g)).to("cuda", dtype).requires_grad_()  # |x + 0| ≥ 1: kept ≠ 0
    residual = torch.randn(*shape, generator=g).to("cuda", dtype).requires_grad_()
    grad = (1 + torch.rand(*shape, generator=g)).to("cuda", dtype)
    torch.manual_seed(3)
    out = bias_dropout_residual(x, None, residual, p)
    (gx,) = torch.autograd.grad(out, (x,), grad)
    keep = out != residual  # a dropped element gives exactly the residual
    assert_dropout_keep_stats(keep, p, name=f"mask {dtype} p={p}")
    # the backward regenerates the forward's mask: zero exactly where dropped, g/(1-p) where kept
    assert torch.equal(gx == 0, ~keep)
    assert_close_fp32(gx[keep].float(), grad[keep].float() / (1 - p), atol=0, rtol=1e-2 if dtype in LOWP else 1e-6)
    # and it is the convention's mask
    seed, offset = next_seed_offset(3)
    assert torch.equal(keep.view(-1), philox_keep_mask(keep.numel(), p, seed, offset, "cuda"))


@pytest.mark.cuda
def test_dropout_reproducible_p0_exact_and_eval_draws_nothing():
    x, bias, residual, _ = _inputs((65, 1024), torch.float16, "cuda")
    torch.manual_seed(7)
    a = bias_dropout_residual(x, bias, residual, 0.3)
    b = bias_dropout_residual(x, bias, residual, 0.3)
    torch.manual_seed(7)
    assert torch.equal(bias_dropout_residual(x, bias, residual, 0.3), a)
    assert not torch.equal(a, b), "consecutive calls must draw new masks"
    want = (residual.float() + (x.float() + bias.float())).half()
    state = torch.cuda.get_rng_state()
    assert torch.equal(bias_dropout_residual(x, bias, residual, 0.0), want)
    assert torch.equal(bias_dropout_residual(x, bias, residual, 0.5, training=False), want)
    assert torch.equal(torch.cuda.get_rng_state(), state), "p == 0 / eval must not advance the generator"
    assert torch.equal(bias_dropout_residual(x, bias, residual, 1.0), residual)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_and_scalar_paths_agree(dtype):
    # Same data at a 16-byte-aligned and a misaligned address: the scalar fallback must produce the
    # same values and the same mask (the element index does not depend on the path).
    ext = lsmini._backend.ext()
    rows, hidden = 77, 1032
    x, bias, residual, grad = _inputs((rows, hidden), dtype, "cuda")
    buf = torch.empty(3 * rows * hidden + 3, device="cuda", dtype=dtype)
    xs, rs, gs = (buf[1 + k * rows * hidden: 1 + (k + 1) * rows * hidden].view(rows, hidden) for k in range(3))
    xs.copy_(x), rs.copy_(residual), gs.copy_(grad)
    assert xs.data_ptr() % 16 != 0
    for p in (0.0, 0.4):
        a = ext.bias_dropout_residual_fwd(x, bias, residual, p, (99, 12, 0, 0))
        b = ext.bias_dropout_residual_fwd(xs, bias, rs, p, (99, 12, 0, 0))
        assert torch.equal(a, b)
        ga, gba = ext.bias_dropout_residual_bwd(grad, p, (99, 12, 0, 0), True)
        gb, gbb = ext.bias_dropout_residual_bwd(gs, p, (99, 12, 0, 0), True)
        assert torch.equal(ga, gb)
        # the two paths tile the columns differently, so the fp32 sums differ in order: allow one
        # rounding step of the output dtype
        rtol = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        torch.testing.assert_close(gba.float(), gbb.float(), atol=1e-4, rtol=rtol)


@pytest.mark.cuda
def test_grad_bias_deterministic_and_many_rows():
    x, bias, residual, grad = _inputs((20000, 520), torch.float32, "cuda")
    ext = lsmini._backend.ext()
    _, g1 = ext.bias_dropout_residual_bwd(grad, 0.2, (3, 4, 0, 0), True)
    _, g2 = ext.bias_dropout_residual_bwd(grad, 0.2, (3, 4, 0, 0), True)
    assert torch.equal(g1, g2)
    keep = philox_keep_mask(grad.numel(), 0.2, 3, 4, "cuda").view(grad.shape)
    terms = torch.where(keep, grad.double() / (1 - 0.2), torch.zeros_like(grad, dtype=torch.float64))
    assert_column_sum_close(g1, terms.sum(0), terms.abs().sum(0), 20000)


@pytest.mark.cuda
def test_empty_rows():
    x, bias, residual, grad = _inputs((0, 24), torch.float16, "cuda")
    out, gx, gb, gr = _run(lambda x, b, r: bias_dropout_residual(x, b, r, 0.1), x, bias, residual, grad)
    assert out.shape == (0, 24) and gx.shape == (0, 24)
    assert torch.equal(gb, torch.zeros_like(gb))


@pytest.mark.cuda
def test_bad_inputs_cuda():
    x, bias, residual, _ = _inputs((4, 8), torch.float16, "cuda")
    with pytest.raises(ValueError, match="residual is on cpu but x is on cuda"):
        bias_dropout_residual(x, bias, residual.cpu())
    with pytest.raises(ValueError, match="bias is on cpu but x is on cuda"):
        bias_dropout_residual(x, bias.cpu(), residual)
    with pytest.raises(TypeError, match="residual must have x's dtype"):
        bias_dropout_residual(x, bias, residual.float())
    ext = lsmini._backend.ext()
    with pytest.raises(RuntimeError, match="bias_dropout_residual_fwd: x must be a CUDA tensor"):
        ext.bias_dropout_residual_fwd(x.cpu(), None, residual.cpu(), 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"bias_dropout_residual_fwd: residual must have shape \[4, 8\]"):
        ext.bias_dropout_residual_fwd(x, None, residual[:2], 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"bias_dropout_residual_fwd: bias must have shape \[8\]"):
        ext.bias_dropout_residual_fwd(x, bias[:3], residual, 0.0, (0, 0, 0, 0))
    with pytest.raises(TypeError, match="bias_dropout_residual_fwd: bias must be Half .* or float32"):
        ext.bias_dropout_residual_fwd(x, bias.bfloat16(), residual, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="bias_dropout_residual_fwd: residual must be Half"):
        ext.bias_dropout_residual_fwd(x, None, residual.float(), 0.0, (0, 0, 0, 0))
    with pytest.raises(ValueError, match=r"bias_dropout_residual_fwd: p must be in \[0, 1\]"):
        ext.bias_dropout_residual_fwd(x, None, residual, 1.5, (0, 0, 0, 0))
    with pytest.raises(ValueError, match="bias_dropout_residual_fwd: x must be 2-D"):
        ext.bias_dropout_residual_fwd(x.view(2, 2, 8), None, residual.view(2, 2, 8), 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="bias_dropout_residual_fwd: x must be float32, float16 or bfloat16"):
        ext.bias_dropout_residual_fwd(x.double(), None, residual.double(), 0.0, (0, 0, 0, 0))
    with pytest.raises(TypeError, match="bias_dropout_residual_bwd: bias_dtype must be"):
        ext.bias_dropout_residual_bwd(x, 0.1, (0, 0, 0, 0), True, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bias_dropout_residual_bwd: grad_out must be a CUDA tensor"):
        ext.bias_dropout_residual_bwd(x.cpu(), 0.1, (0, 0, 0, 0), True)
