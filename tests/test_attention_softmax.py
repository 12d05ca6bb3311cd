import math

import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini.limits import ATTENTION_SOFTMAX_MAX_KEYS as MAX_KEYS
from lsmini.ops.attention_softmax import attention_softmax, attention_softmax_ref
from lsmini.ops.dropout import keep_mask
from util import (attention_masks, LOWP, LsminiOps, assert_close_fp32, assert_dropout_keep_stats, assert_lowp_rule,
                  philox_keep_mask)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MASK_KINDS = ["none", "pad", "causal", "both"]
K_LENS = [1, 3, 7, 31, 32, 33, 64, 127, 128, 255, 1000, 1024, 2049, 4096, 8192, 16384]


# ------------------------------------------------------------------------------------- helpers ---

def _inputs(shape, dtype, device, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    scores = (scale * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)
    grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return scores, grad, gen


def _run(fn, scores, grad):
    x = scores.detach().clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _plain_torch(scores, masked, grad, keep=None, p=0.0):
    """masked_fill + softmax in scores' own dtype, then the keep-mask (None: no dropout), autograd
    backward. Fully masked rows come out NaN in plain PyTorch; they are set to 0 here (the op's
    definition) so the error rule can compare."""
    def fn(x):
        y = torch.softmax(x if masked is None else x.masked_fill(masked, float("-inf")), dim=-1)
        return y if keep is None else torch.where(keep, y * (1.0 / (1.0 - p)), torch.zeros_like(y))
    y, dx = _run(fn, scores, grad)
    return y.nan_to_num(0.0), dx.nan_to_num(0.0)


def _dead_rows(masked, shape):
    return masked.expand(shape).all(dim=-1) if masked is not None else torch.zeros(shape[:-1], dtype=torch.bool)


# ------------------------------------------------------------------------------------ CPU (CI) ---

@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", [(3, 2, 5, 7), (3, 2, 7, 5), (4, 2, 1, 9), (3, 3, 16, 16), (1, 1, 1, 1)])
def test_reference_matches_torch(shape, kind):
    b, h, q, k = shape
    scores, grad, gen = _inputs(shape, torch.float32, "cpu")
    kpm, causal, masked = attention_masks(b, q, k, kind, gen, "cpu")
    y, dx = _run(lambda x: attention_softmax_ref(x, kpm, causal), scores, grad)
    yt, dxt = _run(lambda x: torch.softmax(x if masked is None else x.masked_fill(masked, float("-inf")), -1),
                   scores.double(), grad.double())
    dead = _dead_rows(masked, shape)
    live = ~dead
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert_close_fp32(y[live], yt[live].float(), name="probs")
    assert_close_fp32(dx[live], dxt[live].float(), name="grad_scores")
    assert (y[dead] == 0).all() and (dx[dead] == 0).all()
    if masked is not None:
        assert (y[masked.expand(shape)] == 0).all() and (dx[masked.expand(shape)] == 0).all()


@pytest.mark.parametrize("q,k", [(1, 6), (4, 9), (9, 9)])
def test_reference_causal_is_bottom_right_like_sdpa(q, k):
    from torch.nn.attention.bias import causal_lower_right

    gen = torch.Generator().manual_seed(1)
    qq, kk, vv = (torch.randn(2, 3, n, 8, generator=gen) for n in (q, k, k))
    scores = qq @ kk.transpose(-1, -2) / math.sqrt(8)
    ours = attention_softmax_ref(scores, causal=True) @ vv
    theirs = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=causal_lower_right(q, k))
    assert_close_fp32(ours, theirs, atol=1e-5, rtol=1e-4)
    if q == k:
        assert_close_fp32(ours, F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), atol=1e-5, rtol=1e-4)


def test_reference_padding_matches_sdpa():
    gen = torch.Generator().manual_seed(2)
    qq, kk, vv = (torch.randn(3, 2, 7, 16, generator=gen) for _ in range(3))
    kpm = torch.tensor([[False] * 7, [False] * 4 + [True] * 3, [True, False] * 3 + [True]])
    scores = qq @ kk.transpose(-1, -2) / 4.0
    ours = attention_softmax_ref(scores, kpm) @ vv
    theirs = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=~kpm.view(3, 1, 1, 7))
    assert_close_fp32(ours, theirs, atol=1e-5, rtol=1e-4)


def test_reference_fully_masked_rows_are_zero_not_nan():
    scores = torch.randn(2, 2, 3, 4, requires_grad=True)
    kpm = torch.tensor([[True] * 4, [False, True, True, True]])
    y = attention_softmax_ref(scores, kpm)
    y.backward(torch.randn_like(y))
    assert (y[0] == 0).all() and (scores.grad[0] == 0).all()
    torch.testing.assert_close(y[1, :, :, 0], torch.ones(2, 3))
    # q_len > k_len with causal: the first q_len − k_len queries see no key
    y = attention_softmax_ref(torch.randn(1, 1, 5, 2), causal=True)
    assert (y[0, 0, :3] == 0).all() and torch.isfinite(y).all()
    torch.testing.assert_close(y[0, 0, 3:].sum(-1), torch.ones(2))


def test_reference_dropout_semantics():
    scores = torch.randn(2, 2, 8, 16)
    y = attention_softmax_ref(scores)
    assert torch.equal(attention_softmax_ref(scores, dropout_p=0.5, training=False), y)
    assert torch.equal(attention_softmax_ref(scores, dropout_p=0.0), y)
    torch.manual_seed(0)
    out = attention_softmax_ref(scores, dropout_p=0.5)
    kept = out != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(out[kept], 2 * y[kept])


def test_reference_keeps_dtype():
    scores = torch.randn(1, 2, 3, 4).to(torch.bfloat16)
    assert attention_softmax_ref(scores, causal=True).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2, 5, 7), (3, 2, 7, 5), (1, 1, 1, 1), (3, 3, 16, 33)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_op_on_cpu_matches_torch(shape, dtype, kind, p):
    """The registered operator's CPU implementation, forward and backward with one random grad_output,
    against plain PyTorch applying the mask the op draws: the reference's keep-mask
    (``lsmini.ops.dropout.keep_mask``) from torch's CPU generator, here drawn again under the same seed.
    fp32 against float64; fp16/bf16 by the 2x rule, plain PyTorch in that precision as the yardstick."""
    b, h, q, k = shape
    scores, grad, gen = _inputs(shape, dtype, "cpu")
    kpm, causal, masked = attention_masks(b, q, k, kind, gen, "cpu")
    torch.manual_seed(1)
    with LsminiOps() as ops:
        y, dx = _run(lambda x: attention_softmax(x, kpm, causal, p), scores, grad)
    assert ops.names == ["attention_softmax", "attention_softmax_backward"]
    assert y.dtype == dtype and dx.dtype == dtype
    torch.manual_seed(1)
    keep = keep_mask(shape, p, "cpu")
    yt, dxt = _plain_torch(scores.double(), masked, grad.double(), keep, p)
    if dtype in LOWP:
        yl, dxl = _plain_torch(scores, masked, grad, keep, p)
        assert_lowp_rule(y, yt, yl, atol=1e-3, name="probs")
        assert_lowp_rule(dx, dxt, dxl, atol=1e-3, name="grad_scores")
    else:
        assert_close_fp32(y, yt, name="probs")
        assert_close_fp32(dx, dxt, atol=1e-5, rtol=1e-4, name="grad_scores")
    if masked is not None:  # masked keys and fully masked rows are exactly 0, forward and backward
        mb = masked.expand(shape)
        assert (y[mb] == 0).all() and (dx[mb] == 0).all()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_op_on_cpu_dropout_statistics_same_mask_and_seed(p):
    k = 64
    scores = torch.zeros(8, 4, 32, k, requires_grad=True)  # every probability 1/k: kept ≠ 0
    grad = 1 + torch.rand(8, 4, 32, k, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    out = attention_softmax(scores, None, False, p)
    (dx,) = torch.autograd.grad(out, (scores,), grad)
    keep = out != 0
    assert_dropout_keep_stats(keep.view(-1, k), p, name=f"mask p={p}")
    # the backward applies the forward's mask: dx = y·(g' − Σ y·g'), g' the dropped gradient
    g = torch.where(keep, grad / (1 - p), torch.zeros_like(grad))
    assert_close_fp32(dx, (g - (g / k).sum(-1, keepdim=True)) / k, atol=1e-7, rtol=1e-5)
    torch.manual_seed(3)
    assert torch.equal(attention_softmax(scores, None, False, p), out)
    assert not torch.equal(attention_softmax(scores, None, False, p), out), "each call draws a new mask"


def test_float64_and_forced_reference_call_the_reference_directly(monkeypatch):
    scores, _, gen = _inputs((3, 2, 4, 6), torch.float64, "cpu")
    kpm, _, _ = attention_masks(3, 4, 6, "pad", gen, "cpu")
    with LsminiOps() as ops:
        y = attention_softmax(scores, kpm, causal=True)
    assert ops.names == [] and y.dtype == torch.float64
    torch.testing.assert_close(y, attention_softmax_ref(scores, kpm, causal=True))
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        y = attention_softmax(scores.float(), kpm, causal=True)
    assert ops.names == []
    torch.testing.assert_close(y, attention_softmax_ref(scores.float(), kpm, causal=True))


def test_bad_input_errors():
    x = torch.randn(2, 2, 3, 5)
    with pytest.raises(ValueError, match="4-D"):
        attention_softmax(torch.randn(2, 3, 5))
    with pytest.raises(TypeError, match="floating-point"):
        attention_softmax(torch.ones(2, 2, 3, 5, dtype=torch.int64))
    with pytest.raises(TypeError, match="scores must be a Tensor"):
        attention_softmax([[1.0]])
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, k_len\) = \(2, 5\)"):
        attention_softmax(x, torch.zeros(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool"):
        attention_softmax(x, torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(TypeError, match="causal must be a bool"):
        attention_softmax(x, causal="yes")
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        attention_softmax(x, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
        attention_softmax(x, dropout_p=-0.1)
    with pytest.raises(ValueError, match=f"k_len .* at most {MAX_KEYS}, got {MAX_KEYS + 1}"):
        attention_softmax(torch.randn(1, 1, 1, MAX_KEYS + 1))


# ---------------------------------------------------------------------------------------- CUDA ---

def _kernel_case(shape, dtype, kind, seed=0, scale=2.0):
    b, h, q, k = shape
    scores, grad, gen = _inputs(shape, dtype, "cuda", seed=seed, scale=scale)
    kpm, causal, masked = attention_masks(b, q, k, kind, gen, "cuda")
    y, dx = _run(lambda x: attention_softmax(x, kpm, causal), scores, grad)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == shape
    yr, dxr = _run(lambda x: attention_softmax_ref(x, kpm, causal), scores.float(), grad.float())
    if dtype in LOWP:
        yt, dxt = _plain_torch(scores, masked, grad)
        assert_lowp_rule(y, yr, yt, atol=1e-3, name="probs")
        assert_lowp_rule(dx, dxr, dxt, atol=1e-3, name="grad_scores")
    else:
        assert_close_fp32(y, yr, name="probs")
        # dx = y·(g − Σ y·g): the fp32 y error (≈1e-6 relative, from the hardware exp) times
        # |g − Σ y·g| (a few units) needs a relative slack of 1e-4 on dx.
        assert_close_fp32(dx, dxr, atol=1e-5, rtol=1e-4, name="grad_scores")
    if masked is not None:  # masked keys and fully masked rows are exactly 0, forward and backward
        mb = masked.expand(shape)
        assert (y[mb] == 0).all() and (dx[mb] == 0).all()


def _rows_for(k):
    return max(1, min(100, (1 << 20) // (6 * k)))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("k", K_LENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(dtype, k, kind):
    # b = 3: one unpadded, one randomly padded and one fully padded sequence; q ≠ k (q > k for short
    # rows, so causal leaves some rows with no key at all).
    _kernel_case((3, 2, _rows_for(k), k), dtype, kind)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 33, 128, 1000, 2049])
def test_kernel_causal_square_and_decode(k, dtype):
    _kernel_case((1, 2, k, k), dtype, "both", seed=1)
    _kernel_case((5, 3, 1, k), dtype, "both", seed=2)  # one decoding step over k cached keys
    # the last query sees every key: causal with q_len = 1 changes nothing
    scores, _, _ = _inputs((2, 3, 1, k), dtype, "cuda", seed=3)
    assert torch.equal(attention_softmax(scores, causal=True), attention_softmax(scores))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_peaked_and_inf_scores(dtype):
    _kernel_case((2, 2, 16, 300), dtype, "both", scale=40.0)
    # -inf scores the caller put in themselves act like masked keys; a row of -inf is zeros
    scores, _, _ = _inputs((1, 1, 3, 64), dtype, "cuda")
    scores[0, 0, 0] = float("-inf")
    scores[0, 0, 1, :10] = float("-inf")
    y = attention_softmax(scores)
    assert (y[0, 0, 0] == 0).all() and (y[0, 0, 1, :10] == 0).all() and torch.isfinite(y).all()


@pytest.mark.cuda
@pytest.mark.parametrize("k", [3, 64, 1000, 4096])
def test_kernel_many_rows(k):
    _kernel_case((7, 16, max(1, (1 << 22) // (112 * k)), k), torch.float16, "both", seed=4)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [64, 500, 1024, 4096, 16384])
def test_kernel_misaligned_and_strided_inputs(k, dtype):
    # a storage offset of one element pushes the kernel onto its scalar path; a transposed view and
    # a misaligned mask must give the same numbers as the aligned, contiguous call
    b, h, q = 3, 2, 5
    scores, _, gen = _inputs((b, h, q, k), dtype, "cuda")
    kpm, _, _ = attention_masks(b, q, k, "pad", gen, "cuda")
    want = attention_softmax(scores, kpm, causal=True)
    buf = torch.empty(scores.numel() + 1, dtype=dtype, device="cuda")
    buf[1:].copy_(scores.reshape(-1))
    shifted = buf[1:].view(b, h, q, k)
    mbuf = torch.empty(kpm.numel() + 3, dtype=torch.bool, device="cuda")
    mbuf[3:].copy_(kpm.reshape(-1))
    got = attention_softmax(shifted, mbuf[3:].view(b, k), causal=True)
    # the scalar path sums in another order: fp32 differs by summation rounding, fp16/bf16 by at
    # most one rounding of the output
    rtol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6)
    transposed = scores.transpose(1, 2).contiguous().transpose(1, 2)
    assert not transposed.is_contiguous()
    assert torch.equal(attention_softmax(transposed, kpm, causal=True), want)


@pytest.mark.cuda
@pytest.mark.parametrize("k", [7, 64, 1000, 2049, 4096])
def test_kernel_writes_every_output(k):
    # recycle NaN-filled memory through the caching allocator right before each kernel allocates
    ext = lsmini._backend.ext()
    shape = (3, 2, 9, k)
    scores, grad, gen = _inputs(shape, torch.float16, "cuda")
    kpm, _, _ = attention_masks(3, 9, k, "pad", gen, "cuda")
    for causal in (False, True):
        junk = torch.full((4 * scores.numel(),), float("nan"), dtype=torch.float16, device="cuda")
        del junk
        probs, sm = ext.attention_softmax_fwd(scores, kpm, causal, 0.25, (123, 8, 0, 0))
        assert torch.isfinite(probs).all() and torch.isfinite(sm).all()
        junk = torch.full((4 * scores.numel(),), float("nan"), dtype=torch.float16, device="cuda")
        del junk
        dx = ext.attention_softmax_bwd(grad, sm, 0.25, (123, 8, 0, 0), False)
        assert torch.isfinite(dx).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [33, 1024, 2049])
def test_kernel_inplace_backward(k, dtype):
    ext = lsmini._backend.ext()
    scores, grad, _ = _inputs((2, 3, 4, k), dtype, "cuda")
    _, sm = ext.attention_softmax_fwd(scores, None, True, 0.2, (99, 4, 0, 0))
    want = ext.attention_softmax_bwd(grad, sm, 0.2, (99, 4, 0, 0), False)
    g = grad.clone()
    out = ext.attention_softmax_bwd(g, sm, 0.2, (99, 4, 0, 0), True)
    assert out.data_ptr() == g.data_ptr()
    assert torch.equal(g, want)
    assert not torch.equal(grad, want)  # the non-inplace call left its input alone
    with pytest.raises(RuntimeError, match="inplace=True .* must then be contiguous"):
        ext.attention_softmax_bwd(grad.transpose(0, 1), sm.transpose(0, 1), 0.2, (99, 4, 0, 0), True)


@pytest.mark.cuda
def test_kernel_empty_inputs():
    for shape in [(0, 2, 3, 5), (2, 0, 3, 5), (2, 2, 0, 5), (2, 2, 3, 0)]:
        x = torch.randn(shape, device="cuda", requires_grad=True)
        kpm = torch.zeros(shape[0], shape[3], dtype=torch.bool, device="cuda")
        y = attention_softmax(x, kpm, causal=True, dropout_p=0.1)
        assert y.shape == shape
        y.sum().backward()
        assert x.grad.shape == shape


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [7, 33, 64, 1000, 2049, 4096, 12289, 16384])
def test_dropout_mask_is_philox_of_flat_index(k, dtype, p):
    # Forward and backward against an independent Philox: element i = row·k_len + col of the
    # [b, h, q, k] tensor is kept iff 16-bit value i % 8 of philox({i / 8, offset}, seed) ≥ p·65536.
    ext = lsmini._backend.ext()
    b, h, q = 3, 2, max(1, 2048 // k + 1)
    shape = (b, h, q, k)
    scores, grad, gen = _inputs(shape, dtype, "cuda")
    kpm, _, _ = attention_masks(b, q, k, "pad", gen, "cuda")
    seed, offset = 0x9E3779B97F4A7C15, (1 << 33) + 44  # both 32-bit halves in use
    probs, sm = ext.attention_softmax_fwd(scores, kpm, True, p, (seed, offset, 0, 0))
    keep = philox_keep_mask(scores.numel(), p, seed, offset, "cuda").view(shape)
    scale = 1.0 / (1.0 - torch.tensor(p, dtype=torch.float32).item())
    y = sm.float()
    assert (probs[~keep] == 0).all()
    assert (probs[keep & (sm != 0)] != 0).all()
    # probs = round(y32·scale) and sm = round(y32) agree to one rounding of each (atol: subnormals)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(probs.float(), torch.where(keep, y * scale, torch.zeros_like(y)), rtol=eps,
                               atol=torch.finfo(dtype).tiny)
    dx = ext.attention_softmax_bwd(grad, sm, p, (seed, offset, 0, 0), False)
    g = torch.where(keep, grad.float() * scale, torch.zeros_like(y))
    want = y * (g - (y * g).sum(-1, keepdim=True))
    torch.testing.assert_close(dx.float(), want, rtol=eps, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate_and_independence(p):
    scores, _, _ = _inputs((4, 8, 64, 1024), torch.float16, "cuda", scale=1.0)
    torch.manual_seed(5)
    out = attention_softmax(scores, dropout_p=p)
    y = attention_softmax(scores)
    assert (y > 0).all()
    kept = out != 0
    n = kept.numel()
    assert_dropout_keep_stats(kept.view(-1, 1024), p)  # rate, flat and row-to-row neighbours
    # two fp16 roundings apart (atol: fp16 subnormals, spaced 2^-24, hold the smallest probabilities)
    torch.testing.assert_close(out[kept].float(), y[kept].float() / (1 - p), rtol=2e-3, atol=2.0 ** -23)
    # masks of neighbouring heads and batches are independent too: they agree at p² + (1 − p)²
    agree = p * p + (1 - p) ** 2
    for a, b in [(kept[:, 1:], kept[:, :-1]), (kept[1:], kept[:-1])]:
        m = (a == b).float().mean().item()
        assert abs(m - agree) < 6 * math.sqrt(agree * (1 - agree) / a.numel()), m
    # every column position is dropped at the same rate
    col_rate = kept.float().mean(dim=(0, 1, 2))
    assert (col_rate - (1 - p)).abs().max().item() < 6 * math.sqrt(p * (1 - p) / (n // 1024))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [31, 128, 2049])
def test_dropout_forward_backward_same_mask(k, dtype):
    # Through autograd: infer the kept set from the output, and check the gradient used exactly it.
    shape = (3, 2, 8, k)
    scores, grad, gen = _inputs(shape, dtype, "cuda")
    kpm, _, _ = attention_masks(3, 8, k, "pad", gen, "cuda")
    torch.manual_seed(11)
    out, dx = _run(lambda x: attention_softmax(x, kpm, True, 0.5), scores, grad)
    y = attention_softmax(scores, kpm, True).float()  # the kernel's own pre-dropout softmax
    kept = out != 0
    g = torch.where(kept, grad.float() * 2.0, torch.zeros_like(y))
    want = y * (g - (y * g).sum(-1, keepdim=True))
    torch.testing.assert_close(dx.float(), want, rtol=torch.finfo(dtype).eps, atol=1e-5)
    assert (~kept & (y > 0)).any()  # the case did drop live entries


@pytest.mark.cuda
def test_dropout_reproducible_and_p0_exact():
    scores, grad, gen = _inputs((2, 4, 16, 96), torch.bfloat16, "cuda")
    kpm, _, _ = attention_masks(2, 16, 96, "pad", gen, "cuda")
    torch.manual_seed(7)
    a, da = _run(lambda x: attention_softmax(x, kpm, True, 0.3), scores, grad)
    torch.manual_seed(7)
    b, db = _run(lambda x: attention_softmax(x, kpm, True, 0.3), scores, grad)
    c = attention_softmax(scores, kpm, True, 0.3)
    assert torch.equal(a, b) and torch.equal(da, db)
    assert not torch.equal(a, c)  # the generator advanced
    torch.manual_seed(8)
    assert not torch.equal(attention_softmax(scores, kpm, True, 0.3), a)
    # p = 0 (or eval mode) draws no random numbers and equals the no-dropout path exactly
    state = torch.cuda.get_rng_state()
    y0, dy0 = _run(lambda x: attention_softmax(x, kpm, True, 0.0), scores, grad)
    ye, dye = _run(lambda x: attention_softmax(x, kpm, True, 0.3, training=False), scores, grad)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert torch.equal(y0, ye) and torch.equal(dy0, dye)
    ext = lsmini._backend.ext()
    probs, sm = ext.attention_softmax_fwd(scores, kpm, True, 0.0, (0, 0, 0, 0))
    assert probs.data_ptr() == sm.data_ptr() and torch.equal(probs, y0)
    assert torch.equal(ext.attention_softmax_bwd(grad, sm, 0.0, (0, 0, 0, 0), False), dy0)
    # p = 1 drops everything, gradient 0
    y1, dy1 = _run(lambda x: attention_softmax(x, kpm, True, 1.0), scores, grad)
    assert (y1 == 0).all() and (dy1 == 0).all()


@pytest.mark.cuda
def test_kernel_bad_input_errors():
    ext = lsmini._backend.ext()
    x = torch.randn(2, 2, 3, 5, device="cuda")
    kpm = torch.zeros(2, 5, dtype=torch.bool, device="cuda")
    with pytest.raises(RuntimeError, match="attention_softmax_fwd: scores must be a CUDA tensor"):
        ext.attention_softmax_fwd(x.cpu(), None, False, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="scores must be 4-D"):
        ext.attention_softmax_fwd(x[0], None, False, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=f"must be at most {MAX_KEYS}, got {MAX_KEYS + 1}"):
        ext.attention_softmax_fwd(torch.randn(1, 1, 1, MAX_KEYS + 1, device="cuda"), None, False, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="key_padding_mask must be a CUDA tensor"):
        ext.attention_softmax_fwd(x, kpm.cpu(), False, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="key_padding_mask must be Bool"):
        ext.attention_softmax_fwd(x, kpm.to(torch.uint8), False, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"key_padding_mask must have shape \[2, 5\]"):
        ext.attention_softmax_fwd(x, kpm[:, :4], False, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"dropout p must be in \[0, 1\]"):
        ext.attention_softmax_fwd(x, None, False, 1.5, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="must be float32, float16 or bfloat16"):
        ext.attention_softmax_fwd(x.double(), None, False, 0.0, (0, 0, 0, 0))
    _, sm = ext.attention_softmax_fwd(x, kpm, False, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="grad_probs must have shape"):
        ext.attention_softmax_bwd(x[:, :1], sm, 0.0, (0, 0, 0, 0), False)
    with pytest.raises(RuntimeError, match="grad_probs must be Float, got Half"):
        ext.attention_softmax_bwd(x.half(), sm, 0.0, (0, 0, 0, 0), False)
    with pytest.raises(RuntimeError, match="grad_probs must be a CUDA tensor"):
        ext.attention_softmax_bwd(x.cpu(), sm, 0.0, (0, 0, 0, 0), False)
    # the functional names the argument before anything reaches the kernel
    with pytest.raises(ValueError, match="key_padding_mask is on cpu but scores is on cuda"):
        attention_softmax(x, kpm.cpu())
    with pytest.raises(ValueError, match=f"at most {MAX_KEYS}"):
        attention_softmax(torch.randn(1, 1, 2, MAX_KEYS + 8, device="cuda"))


@pytest.mark.cuda
def test_float64_on_cuda_runs_the_reference():
    x = torch.randn(2, 2, 3, 5, device="cuda", dtype=torch.float64, requires_grad=True)
    with LsminiOps() as ops:
        y = attention_softmax(x, causal=True)
    assert y.dtype == torch.float64 and ops.names == [] and y.grad_fn is not None
    torch.testing.assert_close(y, attention_softmax_ref(x, causal=True))


@pytest.mark.cuda
def test_config_reference(monkeypatch):
    x = torch.randn(2, 2, 3, 5, device="cuda", requires_grad=True)
    with LsminiOps() as ops:
        attention_softmax(x)
    assert ops.names == ["attention_softmax"]
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        y = attention_softmax(x, causal=True)
    assert ops.names == [] and y.grad_fn is not None
    torch.testing.assert_close(y, attention_softmax_ref(x, causal=True))
