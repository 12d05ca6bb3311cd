import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini import _backend
from lsmini._debug import sm90_attention
from lsmini.limits import ATTENTION_DTYPES, ATTENTION_HEAD_DIMS
from lsmini.ops.attention import (attention, attention_ref, fused_attention_supported, keep_buffer, keep_numel,
                                  keeps_bits, sm90_kernels_available)
from lsmini.ops.attention_softmax import attention_softmax
from lsmini.ops.dropout import keep_mask
from util import (LsminiOps, attention_masks, assert_close_fp32, assert_dropout_keep_stats, assert_lowp_rule, max_err,
                  next_seed_offset, philox_keep_mask, poison)

MASK_KINDS = ["none", "pad", "causal", "both"]
RNG = (1234, 8, 0, 0)  # a fixed eager Philox state (seed, offset, 0, 0) for calls to the extension
P = 0.2
# atol of the low-precision rule for dq/dk/dv. The kernel's backward takes D = rowsum(dout·out) from the
# saved out, which was rounded to fp16/bf16 (FlashAttention does the same; the binding gets no fp32 copy),
# an error plain PyTorch's softmax backward does not have: it shifts every dS of a row by about
# |dout|·|out|·eps/2. With bf16's eps that alone can exceed twice PyTorch's error on small heads.
GRAD_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


# ------------------------------------------------------------------------------------- helpers ---

def _inputs(b, h, lq, lk, d, dtype, device, seed=0, q_scale=1.0, hk=None):
    """Seeded random q, k, v (hk K/V heads, default h), grad_out (never zeros) and the generator for the masks."""
    gen = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(b, h, lq, d, generator=gen)
    k, v = (torch.randn(b, h if hk is None else hk, lk, d, generator=gen) for _ in range(2))
    dout = torch.randn(b, h, lq, d, generator=gen)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, dout)] + [gen]


def _run(fn, q, k, v, dout):
    """fn(q, k, v) on fresh leaves, backward with dout: (out, (dq, dk, dv))."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), tuple(t.grad for t in leaves)


# Under compute-sanitizer's racecheck (torch 2.11 + CUDA 13.0, H200) cuBLAS's fp16/bf16 batched GEMMs raise a
# hardware exception the tool cannot handle, also when it instruments no kernel at all. scripts/check_gpu.sh
# sets LSMINI_TEST_FP32_GEMM=1 for racecheck: _plain's GEMMs then run in float32 and round to the inputs'
# dtype, as cuBLAS's float32-accumulating half GEMMs do; the kernels under test are the same.
_FP32_GEMM = os.environ.get("LSMINI_TEST_FP32_GEMM") == "1"


def _matmul(a, b):
    if _FP32_GEMM and a.dtype in (torch.float16, torch.bfloat16):
        return torch.matmul(a.float(), b.float()).to(a.dtype)
    return torch.matmul(a, b)


def _plain(q, k, v, masked, scale, keep=None, p=0.0):
    """Attention written out with masked_fill / softmax / matmul in the inputs' own dtype. Plain softmax
    makes fully masked rows NaN; they are zeroed after it (the op's definition). The NaN never reaches
    a gradient: masked_fill's backward zeroes every masked score, and a dead row is all masked."""
    s = _matmul(q, k.transpose(-1, -2)) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    probs = torch.softmax(s, dim=-1)
    if masked is not None:
        probs = probs.masked_fill(masked.all(dim=-1, keepdim=True), 0.0)
    if keep is not None:
        probs = probs * keep.to(probs.dtype) * (1.0 / (1.0 - p))
    return _matmul(probs, v)


def _dead_rows(masked, b, h, lq):
    """Bool [b, h, lq]: queries that see no key."""
    if masked is None:
        return torch.zeros(b, h, lq, dtype=torch.bool)
    return masked.all(dim=-1).expand(b, h, lq)


# ------------------------------------------------------------------------------------ CPU (CI) ---

CPU_SHAPES = [(3, 2, 5, 7, 8), (3, 2, 7, 5, 16), (4, 2, 1, 9, 32), (3, 3, 16, 16, 64), (1, 1, 1, 1, 16),
              (3, 2, 65, 63, 24), (3, 1, 7, 65, 128)]


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", CPU_SHAPES)
def test_reference_matches_plain_torch(shape, kind):
    b, h, lq, lk, d = shape
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, torch.float32, "cpu")
    kpm, causal, masked = attention_masks(b, lq, lk, kind, gen, "cpu")
    out, grads = _run(lambda q, k, v: attention_ref(q, k, v, kpm, causal), q, k, v, dout)
    want, want_grads = _run(lambda q, k, v: _plain(q, k, v, masked, 1.0 / math.sqrt(d)),
                            q.double(), k.double(), v.double(), dout.double())
    assert out.dtype == torch.float32 and out.shape == (b, h, lq, d)
    for name, x in zip(("out", "dq", "dk", "dv"), (out,) + grads):
        assert torch.isfinite(x).all(), f"{name}: non-finite values"
    assert_close_fp32(out, want.float(), atol=1e-5, rtol=1e-4, name="out")
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close_fp32(g, w.float(), atol=1e-5, rtol=1e-4, name=name)
    # queries that see no key: out 0 and dq 0; keys padded out: dk 0 and dv 0
    dead = _dead_rows(masked, b, h, lq)
    assert (out[dead] == 0).all() and (grads[0][dead] == 0).all()
    if kpm is not None:
        pad = kpm.view(b, 1, lk).expand(b, h, lk)
        assert (grads[1][pad] == 0).all() and (grads[2][pad] == 0).all()


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("h,hk", [(4, 2), (6, 1), (4, 4)])
def test_reference_grouped_kv_heads_equal_repeated_ones(h, hk, kind):
    # Grouped K/V: query head j reads K/V head j // (h // hk); a shared head's gradient is the sum over its
    # query heads (= the gradient through an explicit repeat)
    b, lq, lk, d = 2, 9, 11, 16
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, torch.float32, "cpu", hk=hk)
    kpm, causal, masked = attention_masks(b, lq, lk, kind, gen, "cpu")
    out, grads = _run(lambda q, k, v: attention(q, k, v, kpm, causal), q, k, v, dout)
    g = h // hk
    want, want_grads = _run(lambda q, k, v: _plain(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), masked,
                                                   1.0 / math.sqrt(d)),
                            q.double(), k.double(), v.double(), dout.double())
    assert out.shape == (b, h, lq, d) and grads[1].shape == grads[2].shape == (b, hk, lk, d)
    assert_close_fp32(out, want.float(), atol=1e-5, rtol=1e-4, name="out")
    for name, x, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close_fp32(x, w.float(), atol=1e-5, rtol=1e-4, name=name)


def test_reference_fully_padded_batch_row():
    q, k, v, dout, _ = _inputs(2, 2, 4, 6, 16, torch.float32, "cpu")
    kpm = torch.tensor([[True] * 6, [False] * 3 + [True] * 3])
    out, (dq, dk, dv) = _run(lambda q, k, v: attention_ref(q, k, v, kpm, True, 0.0), q, k, v, dout)
    assert (out[0] == 0).all() and (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    assert (out[1] != 0).all()


@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("lq,lk", [(1, 9), (7, 7), (5, 12), (16, 16)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_reference_matches_sdpa(lq, lk, kind, scale):
    # SDPA gives NaN for rows that see no key: every batch keeps a key here, and causal has lq ≤ lk
    b, h, d = 3, 2, 16
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, torch.float32, "cpu", seed=1)
    kpm = None
    if kind in ("pad", "both"):
        lengths = torch.randint(1, lk + 1, (b, 1), generator=gen)
        kpm = torch.arange(lk).view(1, lk) >= lengths
        kpm[:, 0] = False  # the first key is always there, so causal rows see at least it
    causal = kind in ("causal", "both")
    attend = torch.ones(b, 1, lq, lk, dtype=torch.bool)
    if kpm is not None:
        attend &= ~kpm.view(b, 1, 1, lk)
    if causal:
        attend &= torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    out, grads = _run(lambda q, k, v: attention_ref(q, k, v, kpm, causal, scale=scale), q, k, v, dout)
    want, want_grads = _run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale),
                            q, k, v, dout)
    assert_close_fp32(out, want, atol=1e-5, rtol=1e-4, name="out")
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_close_fp32(g, w, atol=1e-5, rtol=1e-4, name=name)
    if kind == "causal" and lq == lk:
        assert_close_fp32(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
                          atol=1e-5, rtol=1e-4)


def test_reference_custom_scale_and_causal_lq_gt_lk():
    b, h, lq, lk, d = 2, 3, 9, 4, 32
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, torch.float32, "cpu", seed=2)
    kpm, causal, masked = attention_masks(b, lq, lk, "both", gen, "cpu")
    out, grads = _run(lambda q, k, v: attention_ref(q, k, v, kpm, causal, scale=0.7), q, k, v, dout)
    want, want_grads = _run(lambda q, k, v: _plain(q, k, v, masked, 0.7), q.double(), k.double(), v.double(),
                            dout.double())
    assert_close_fp32(out, want.float(), atol=1e-5, rtol=1e-4)
    for g, w in zip(grads, want_grads):
        assert_close_fp32(g, w.float(), atol=1e-5, rtol=1e-4)
    assert (out[:, :, : lq - lk] == 0).all()  # the first lq − lk queries see no key


def test_reference_dropout_semantics():
    b, h, lq, lk, d = 2, 2, 8, 16, 16
    q, k, v, dout, _ = _inputs(b, h, lq, lk, d, torch.float32, "cpu", seed=3)
    y = attention_ref(q, k, v)
    assert torch.equal(attention_ref(q, k, v, dropout_p=0.5, training=False), y)
    assert torch.equal(attention_ref(q, k, v, dropout_p=0.0), y)
    # F.dropout path: torch.manual_seed reproduces it, and it does drop something
    torch.manual_seed(0)
    a = attention_ref(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    assert torch.equal(attention_ref(q, k, v, dropout_p=0.5), a)
    assert not torch.equal(a, y)
    assert (attention_ref(q, k, v, dropout_p=1.0) == 0).all()
    # an explicit keep mask: probs·keep/(1 − p), forward and backward
    keep = torch.rand(b, h, lq, lk, generator=torch.Generator().manual_seed(4)) >= P
    out, grads = _run(lambda q, k, v: attention_ref(q, k, v, dropout_p=P, keep=keep), q, k, v, dout)
    want, want_grads = _run(lambda q, k, v: _plain(q, k, v, None, 0.25, keep, P), q.double(), k.double(),
                            v.double(), dout.double())
    assert_close_fp32(out, want.float(), atol=1e-5, rtol=1e-4)
    for g, w in zip(grads, want_grads):
        assert_close_fp32(g, w.float(), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="keep must have shape"):
        attention_ref(q, k, v, dropout_p=P, keep=keep[:, :1])


def test_reference_keeps_dtype():
    q, k, v, dout, _ = _inputs(1, 2, 3, 4, 16, torch.bfloat16, "cpu")
    out, grads = _run(lambda q, k, v: attention_ref(q, k, v, causal=True), q, k, v, dout)
    assert out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads)


def test_fused_attention_supported():
    for dtype in ATTENTION_DTYPES:
        for d in ATTENTION_HEAD_DIMS:
            assert fused_attention_supported(dtype, d)
        for d in (8, 24, 48, 96, 256):
            assert not fused_attention_supported(dtype, d)
    for dtype in (torch.float32, torch.float64):
        assert not fused_attention_supported(dtype, 64)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("shape", [(3, 2, 5, 7, 16), (3, 2, 7, 5, 32), (1, 1, 1, 1, 16), (2, 2, 17, 9, 64)])
@pytest.mark.parametrize("p", [0.0, P])
def test_op_on_cpu_matches_plain_torch(p, shape, kind, dtype):
    """The registered operators' CPU implementation (the kernel's dtypes and head dims), forward and
    backward with one random grad_output, against plain PyTorch applying the mask the op draws: the
    reference's keep-mask (``lsmini.ops.dropout.keep_mask``) from torch's CPU generator, here drawn again
    under the same seed. By the 2x rule against float64, plain PyTorch in the same precision the yardstick."""
    b, h, lq, lk, d = shape
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, dtype, "cpu")
    kpm, causal, masked = attention_masks(b, lq, lk, kind, gen, "cpu")
    scale = 1.0 / math.sqrt(d)
    torch.manual_seed(1)
    with LsminiOps() as ops:
        out, grads = _run(lambda q, k, v: attention(q, k, v, kpm, causal, p), q, k, v, dout)
    assert ops.names == ["attention", "attention_backward"]
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    torch.manual_seed(1)
    keep = keep_mask((b, h, lq, lk), p, "cpu")
    truth, truth_grads = _run(lambda q, k, v: _plain(q, k, v, masked, scale, keep, p),
                              q.double(), k.double(), v.double(), dout.double())
    lowp, lowp_grads = _run(lambda q, k, v: _plain(q, k, v, masked, scale, keep, p), q, k, v, dout)
    assert_lowp_rule(out, truth, lowp, atol=1e-3, name="out")
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, truth_grads, lowp_grads):
        assert g.dtype == dtype and torch.isfinite(g).all(), name
        assert_lowp_rule(g, r, t, atol=GRAD_ATOL[dtype], name=name)
    dead = _dead_rows(masked, b, h, lq)
    assert (out[dead] == 0).all() and (grads[0][dead] == 0).all()
    if kpm is not None:
        pad = kpm.view(b, 1, lk).expand(b, h, lk)
        assert (grads[1][pad] == 0).all() and (grads[2][pad] == 0).all()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_op_on_cpu_dropout_statistics_same_mask_and_seed(p):
    # v[b, h, j] = e_j makes out[b, h, i, j] the dropped probability itself: the mask becomes visible, and
    # grad_v = (dropped probabilities)ᵀ · dout shows the backward's mask
    b, h, lq, lk, d = 4, 4, 64, 64, 64
    q, k, _, dout, _ = _inputs(b, h, lq, lk, d, torch.bfloat16, "cpu", seed=7, q_scale=0.1)
    v = torch.eye(lk, d, dtype=torch.bfloat16).expand(b, h, lk, d).contiguous().requires_grad_(True)
    torch.manual_seed(3)
    out = attention(q, k, v, dropout_p=p)
    (gv,) = torch.autograd.grad(out, v, dout)
    kept = out != 0
    assert (attention(q, k, v.detach()) > 0).all()
    assert_dropout_keep_stats(kept.reshape(-1, lk), p)
    assert_close_fp32(gv.float(), out.float().transpose(-1, -2) @ dout.float(), atol=2e-2, rtol=2e-2, name="dv")
    torch.manual_seed(3)
    assert torch.equal(attention(q, k, v, dropout_p=p), out)
    assert not torch.equal(attention(q, k, v, dropout_p=p), out), "each call draws a new mask"


def test_float32_on_cpu_calls_the_reference_directly():
    b, h, lq, lk, d = 3, 2, 4, 6, 16
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, torch.float32, "cpu")
    kpm, _, _ = attention_masks(b, lq, lk, "pad", gen, "cpu")
    with LsminiOps() as ops:
        out, grads = _run(lambda q, k, v: attention(q, k, v, kpm, causal=True), q, k, v, dout)
    assert ops.names == []
    want, want_grads = _run(lambda q, k, v: attention_ref(q, k, v, kpm, causal=True), q, k, v, dout)
    assert torch.equal(out, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    torch.manual_seed(3)
    a = attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    torch.testing.assert_close(a, attention_ref(q, k, v, dropout_p=0.3))
    # eval mode draws nothing
    assert torch.equal(attention(q, k, v, dropout_p=0.3, training=False), attention_ref(q, k, v))
    torch.testing.assert_close(attention(q, k, v, scale=2), attention_ref(q, k, v, scale=2.0))


def test_functional_empty_inputs():
    q, k, v, _, _ = _inputs(2, 2, 3, 5, 16, torch.float32, "cpu")
    assert attention(q, k[:, :, :0], v[:, :, :0]).shape == (2, 2, 3, 16)
    assert (attention(q, k[:, :, :0], v[:, :, :0]) == 0).all()
    assert attention(q[:, :, :0], k, v, causal=True).shape == (2, 2, 0, 16)


def test_bad_input_errors():
    q, k, v, _, _ = _inputs(2, 2, 3, 5, 16, torch.float32, "cpu")
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"q must be 4-D \[batch, heads, q_len, head_dim\], got shape \(2, 3, 16\)"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"k must be 4-D"):
        attention(q, k[0], v)
    with pytest.raises(ValueError, match=r"v must be 4-D"):
        attention(q, k, v.unsqueeze(0))
    with pytest.raises(TypeError, match="q must be a Tensor, got list"):
        attention([[1.0]], k, v)
    with pytest.raises(TypeError, match="v must be a floating-point tensor, got torch.int64"):
        attention(q, k, torch.ones(2, 2, 5, 16, dtype=torch.int64))
    with pytest.raises(TypeError, match="k must have q's dtype torch.float32, got torch.float16"):
        attention(q, k.half(), v)
    with pytest.raises(TypeError, match="v must have q's dtype torch.float32, got torch.bfloat16"):
        attention(q, k, v.bfloat16())
    with pytest.raises(ValueError, match=r"k must have \(batch, head_dim\) = \(2, 16\) like q, "
                                         r"got shape \(2, 2, 5, 8\)"):
        attention(q, k[..., :8], v)
    with pytest.raises(ValueError, match=r"v must have \(batch, head_dim\) = \(2, 16\)"):
        attention(q, k, v[:1])
    with pytest.raises(ValueError, match=r"v must have k's \(heads, k_len\) = \(2, 5\), got shape \(2, 2, 4, 16\)"):
        attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match=r"v must have k's \(heads, k_len\) = \(2, 5\), got shape \(2, 1, 5, 16\)"):
        attention(q, k, v[:, :1])
    q3 = torch.randn(2, 3, 3, 16)
    with pytest.raises(ValueError, match=r"k's heads \(2\) must divide q's heads \(3\)"):
        attention(q3, k, v)
    with pytest.raises(ValueError, match=r"k's heads \(0\) must divide q's heads \(2\)"):
        attention(q, k[:, :0], v[:, :0])
    with pytest.raises(TypeError, match="key_padding_mask must have dtype torch.bool .* got torch.uint8"):
        attention(q, k, v, kpm.to(torch.uint8))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(batch, k_len\) = \(2, 5\), got \(2, 4\)"):
        attention(q, k, v, kpm[:, :4])
    with pytest.raises(TypeError, match="key_padding_mask must be a bool Tensor or None, got list"):
        attention(q, k, v, [[False] * 5] * 2)
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got 1.5"):
        attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\], got -0.1"):
        attention(q, k, v, dropout_p=-0.1)
    with pytest.raises(TypeError, match="dropout_p must be a float, got str"):
        attention(q, k, v, dropout_p="0.1")
    with pytest.raises(TypeError, match="dropout_p must be a float, got bool"):
        attention(q, k, v, dropout_p=True)
    for bad in (-1.0, 0.0, 1e-40, 1e39, float("inf"), float("nan")):
        message = f"scale must be a positive float from 1e-38 to 1e38 .*, got {re.escape(str(bad))}$"
        with pytest.raises(ValueError, match=message):
            attention(q, k, v, scale=bad)
    with pytest.raises(TypeError, match="scale must be a float or None, got Tensor"):
        attention(q, k, v, scale=torch.tensor(0.5))


# ----------------------------------------------------------------------------------------- CUDA ---

@pytest.fixture(params=["sm90", "sm80"])
def family(request):
    """Runs a kernel test with each kernel family: the Hopper kernels (head dims 64 and 128 on a compute
    capability 9.0 device; elsewhere, and for 16 and 32, the same kernels as "sm80") and the sm_80 ones."""
    if request.param == "sm90" and not sm90_kernels_available():
        pytest.skip("the Hopper attention kernels need an sm_90a build and a compute capability 9.0 device")
    with sm90_attention(request.param == "sm90"):
        yield request.param


# (lq, lk) pairs; each pair runs with every head dim, the mask kind cycling so that each pair also sees
# every kind: causal with lq < lk (a decode-like step over more keys) and lq > lk (leading queries dead).
# lk ≤ 64, and ≤ 128 for d ≥ 32, take the one-CTA-per-head backward; the rest the two tiled kernels.
LENS = [(1, 1), (7, 7), (63, 65), (64, 64), (65, 63), (128, 128), (200, 200), (1, 200), (200, 7), (7, 128),
        (65, 200), (128, 63)]
KERNEL_CASES = [(lq, lk, d, MASK_KINDS[(i + j) % len(MASK_KINDS)])
                for i, (lq, lk) in enumerate(LENS) for j, d in enumerate(ATTENTION_HEAD_DIMS)]


def _kernel_case(b, h, lq, lk, d, dtype, kind, seed=0, q_scale=1.0, scale=None, hk=None):
    hk = h if hk is None else hk
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, dtype, "cuda", seed=seed, q_scale=q_scale, hk=hk)
    kpm, causal, masked = attention_masks(b, lq, lk, kind, gen, "cuda")
    out, grads = _run(lambda q, k, v: attention(q, k, v, kpm, causal, scale=scale), q, k, v, dout)
    assert out.dtype == dtype and out.shape == (b, h, lq, d)
    assert out.transpose(1, 2).is_contiguous(), "out must be the [b, h, lq, d] view of a [b, lq, h, d] buffer"
    sm = 1.0 / math.sqrt(d) if scale is None else scale
    ref, ref_grads = _run(lambda q, k, v: attention_ref(q, k, v, kpm, causal, scale=scale),
                          q.float(), k.float(), v.float(), dout.float())
    lowp, lowp_grads = _run(lambda q, k, v: _plain(q, k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1),
                                                   masked, sm), q, k, v, dout)
    assert_lowp_rule(out, ref, lowp, atol=1e-3, name="out")
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert g.dtype == dtype and g.shape == r.shape
        assert torch.isfinite(g).all(), f"{name}: non-finite values"
        assert_lowp_rule(g, r, t, atol=GRAD_ATOL[dtype], name=name)
    # queries that see no key: out and dq exactly 0; padded keys: dk and dv exactly 0
    dead = _dead_rows(masked, b, h, lq).cuda()
    assert (out[dead] == 0).all() and (grads[0][dead] == 0).all()
    if kpm is not None:
        pad = kpm.view(b, 1, lk).expand(b, hk, lk)
        assert (grads[1][pad] == 0).all() and (grads[2][pad] == 0).all()
    return q, k, v, dout, kpm, causal, masked


@pytest.mark.cuda
@pytest.mark.parametrize("lq,lk,d,kind", KERNEL_CASES)
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_kernel_matches_reference(dtype, lq, lk, d, kind, family):
    # b = 3: with a padding mask, one unpadded, one randomly padded and one fully padded sequence
    _kernel_case(3, 2, lq, lk, d, dtype, kind)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("d", ATTENTION_HEAD_DIMS)
# the one-CTA backward (≤ 64 keys, ≤ 128 for d ≥ 32) and the tiled kernels; partial blocks, lq ≠ lk
@pytest.mark.parametrize("lq,lk,kind", [(7, 9, "both"), (65, 128, "causal"), (200, 200, "both"), (130, 257, "pad"),
                                        (257, 130, "causal")])
@pytest.mark.parametrize("h,hk", [(6, 2), (4, 1)])
def test_kernel_grouped_kv_heads(h, hk, lq, lk, kind, d, dtype, family):
    # Grouped-query attention: K/V heads read in place by their query heads, dK/dV summed over each group
    _kernel_case(3, h, lq, lk, d, dtype, kind, seed=12, hk=hk)


@pytest.mark.cuda
@pytest.mark.parametrize("d", [64, 128])
# The Hopper dK/dV kernel splits a K/V group's heads over a cluster of CTAs when one CTA's walk over the group
# would be the grid's tail: one sequence, causal, takes the clusters (groups of 3 and 8; 11 has no cluster
# size), 32 sequences without a mask one CTA a key block (1024 CTAs, more than an H100 holds at once)
@pytest.mark.parametrize("b,h,hk,kind", [(1, 6, 2, "causal"), (1, 16, 2, "causal"), (1, 11, 1, "causal"),
                                         (32, 6, 2, "none")])
def test_kernel_grouped_kv_heads_dkv_splits(b, h, hk, kind, d, family):
    # dK/dV are the group sums of the call over explicitly repeated K/V heads, within one rounding of each
    # part and of the sum (as in the dropout test below), and the same bits on a second call
    ext = _backend.ext()
    dtype, lq, g = torch.bfloat16, 1024, h // hk
    q, k, v, dout, gen = _inputs(b, h, lq, lq, d, dtype, "cuda", seed=14, hk=hk)
    kpm, causal, _ = attention_masks(b, lq, lq, kind, gen, "cuda")
    scale = 1.0 / math.sqrt(d)

    def call(k, v):
        out, lse = ext.attention_fwd(q, k, v, kpm, causal, 0.0, scale, RNG, None)
        return ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, 0.0, scale, RNG, keep=None)

    _, dk, dv = call(k, v)
    _, dk_r, dv_r = call(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    eps = torch.finfo(dtype).eps
    for name, x, r in (("dk", dk, dk_r), ("dv", dv, dv_r)):
        parts = r.float().view(b, hk, g, lq, d)
        want = parts.sum(2)
        excess = (x.float() - want).abs() - (eps * (parts.abs().sum(2) + want.abs()) + 1e-4)
        assert excess.max() <= 0, f"{name}: off the group sum by {excess.max().item():.3g} past the rounding bound"
    _, dk2, dv2 = call(k, v)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("lq,lk,kind", [(7, 9, "both"), (70, 200, "causal"), (129, 1031, "pad")])
@pytest.mark.parametrize("kept", [False, True])
def test_kernel_grouped_kv_heads_dropout(kept, lq, lk, kind, d, dtype, family):
    # With dropout: the grouped call drops what the call over explicitly repeated K/V heads drops (element
    # (b, query head, i, j) in both): out and dQ bit for bit, dK/dV the group sums of the repeated call's. The
    # repeated call rounds each query head's part to dtype before the sum, the grouped kernel only the sum: they
    # differ by at most one rounding of each part and one of the sum, eps·(Σ|part| + |sum|) (plus a small atol).
    ext = _backend.ext()
    b, h, hk = 2, 6, 2
    g = h // hk
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, dtype, "cuda", seed=13, hk=hk)
    kpm, causal, _ = attention_masks(b, lq, lk, kind, gen, "cuda")
    scale = 1.0 / math.sqrt(d)

    def call(k, v):
        keep = torch.empty(keep_numel(b, h, lq, lk), dtype=torch.int32, device="cuda") if kept else None
        out, lse = ext.attention_fwd(q, k, v, kpm, causal, P, scale, RNG, keep)
        return (out, lse) + ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, scale, RNG, keep=keep)

    out, lse, dq, dk, dv = call(k, v)
    out_r, lse_r, dq_r, dk_r, dv_r = call(k.repeat_interleave(g, 1), v.repeat_interleave(g, 1))
    assert torch.equal(out, out_r) and torch.equal(lse, lse_r) and torch.equal(dq, dq_r)
    assert dk.shape == dv.shape == (b, hk, lk, d)
    eps = torch.finfo(dtype).eps
    for name, x, r in (("dk", dk, dk_r), ("dv", dv, dv_r)):
        parts = r.float().view(b, hk, g, lk, d)
        want = parts.sum(2)
        bound = eps * (parts.abs().sum(2) + want.abs()) + 1e-4
        excess = (x.float() - want).abs() - bound
        assert excess.max() <= 0, f"{name}: off the group sum by {excess.max().item():.3g} past the rounding bound"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("d", ATTENTION_HEAD_DIMS)
def test_kernel_long_peaked_and_custom_scale(d, dtype, family):
    _kernel_case(2, 3, 1000, 1000, d, dtype, "both", seed=1)
    _kernel_case(2, 2, 130, 257, d, dtype, "pad", seed=2, q_scale=6.0)  # near one-hot softmax rows
    _kernel_case(2, 2, 65, 64, d, dtype, "causal", seed=3, scale=0.5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_kernel_uses_the_fused_path_and_lse(dtype):
    ext = _backend.ext()
    b, h, lq, lk, d = 3, 2, 65, 63, 64
    q, k, v, _, gen = _inputs(b, h, lq, lk, d, dtype, "cuda")
    kpm, causal, masked = attention_masks(b, lq, lk, "both", gen, "cuda")
    with LsminiOps() as ops:
        attention(q.requires_grad_(), k, v, kpm, causal)
    assert ops.names == ["attention"]
    out, lse = ext.attention_fwd(q.detach(), k, v, kpm, causal, 0.0, 0.125, (0, 0, 0, 0))
    assert lse.dtype == torch.float32 and lse.shape == (b, h, lq) and lse.is_contiguous()
    s = (q.detach().float() @ k.float().transpose(-1, -2)) * 0.125
    want = torch.logsumexp(s.masked_fill(masked, float("-inf")), dim=-1)
    dead = _dead_rows(masked, b, h, lq).cuda()
    assert dead.any() and (lse[dead] == float("inf")).all(), "rows with every key masked must have lse = +inf"
    torch.testing.assert_close(lse[~dead], want[~dead], rtol=1e-4, atol=1e-4)
    assert (out[dead] == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("d", ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize("p", [0.0, P])
def test_kernel_strided_inputs_and_out_params(p, d, dtype, family):
    # q/k/v as views into one [b, l, 3, h, d] projection output, gradients written into views of one
    # [b, l, 3, h, d] buffer: the same bits as the contiguous call
    ext = _backend.ext()
    b, h, l = 3, 2, 65
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(b, l, 3, h, d, generator=gen).to(device="cuda", dtype=dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous() and q.stride(-1) == 1
    dout = torch.randn(b, h, l, d, generator=gen).to(device="cuda", dtype=dtype)
    kpm, causal, _ = attention_masks(b, l, l, "both", gen, "cuda")
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    scale = 1.0 / math.sqrt(d)
    rng = RNG if p > 0 else (0, 0, 0, 0)

    out_c, lse_c = ext.attention_fwd(qc, kc, vc, kpm, causal, p, scale, rng)
    grads_c = ext.attention_bwd(dout, qc, kc, vc, out_c, lse_c, kpm, causal, p, scale, rng)
    out, lse = ext.attention_fwd(q, k, v, kpm, causal, p, scale, rng)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    # the output and lse into given tensors: out in the merged [b, l, h·d] layout, lse one row of a buffer
    merged = poison(torch.empty(b, l, h, d, dtype=dtype, device="cuda"))
    lse_buf = torch.full((2, b, h, l), float("nan"), device="cuda")
    out_g, lse_g = ext.attention_fwd(q, k, v, kpm, causal, p, scale, rng, out=merged.transpose(1, 2), lse=lse_buf[1])
    assert out_g.data_ptr() == merged.data_ptr() and lse_g.data_ptr() == lse_buf[1].data_ptr()
    assert torch.equal(out_g, out_c) and torch.equal(lse_buf[1], lse_c)
    with pytest.raises(RuntimeError, match="attention_fwd: out overlaps q"):
        ext.attention_fwd(q, k, v, kpm, causal, p, scale, rng, out=q)
    with pytest.raises(RuntimeError, match="attention_fwd: out must have head_dim contiguous"):
        ext.attention_fwd(q, k, v, kpm, causal, p, scale, rng, out=torch.zeros_like(merged).transpose(1, 3)
                          .contiguous().transpose(1, 3).transpose(1, 2))
    with pytest.raises(RuntimeError, match="attention_fwd: lse must have shape"):
        ext.attention_fwd(q, k, v, kpm, causal, p, scale, rng, lse=lse_buf)

    dqkv = poison(torch.empty(b, l, 3, h, d, dtype=dtype, device="cuda"))
    dq, dk, dv = dqkv.permute(2, 0, 3, 1, 4).unbind(0)
    # dout in out's own layout ([b, lq, h, d] underneath) and positional out-params
    dout_t = dout.transpose(1, 2).contiguous().transpose(1, 2)
    got = ext.attention_bwd(dout_t, q, k, v, out, lse, kpm, causal, p, scale, rng, dq, dk, dv)
    for name, g, want, buf in zip(("dq", "dk", "dv"), got, grads_c, (dq, dk, dv)):
        assert g.data_ptr() == buf.data_ptr() and g.stride() == buf.stride(), f"{name}: not written in place"
        assert torch.equal(g, want), f"{name}: strided call differs from the contiguous one"
    assert not torch.isnan(dqkv).any()
    # fresh outputs come from recycled NaN memory: every element must be written
    junk = torch.full((8 * qkv.numel(),), float("nan"), dtype=dtype, device="cuda")
    del junk
    out2, _ = ext.attention_fwd(q, k, v, kpm, causal, p, scale, rng)
    junk = torch.full((8 * qkv.numel(),), float("nan"), dtype=dtype, device="cuda")
    del junk
    grads2 = ext.attention_bwd(dout, q, k, v, out2, lse, kpm, causal, p, scale, rng)
    assert torch.equal(out2, out_c) and all(torch.equal(g, w) for g, w in zip(grads2, grads_c))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("d", ATTENTION_HEAD_DIMS)
# the one-CTA backward (k_len ≤ 128) and the two tiled kernels; partial query blocks, q_len ≠ k_len and
# rows with every key masked ("both")
@pytest.mark.parametrize("lq,lk,kind", [(7, 9, "both"), (65, 130, "causal"), (129, 129, "pad"), (70, 200, "both"),
                                        (200, 70, "causal")])
def test_kernel_kept_dropout_bits(lq, lk, kind, d, dtype, family):
    # The forward stores the dropout bits it drew and the backward reads them: outputs and gradients
    # equal to the backward that draws them again, and the bits are really read (another rng, same bits,
    # same gradients).
    ext = _backend.ext()
    b, h = 2, 3
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, dtype, "cuda", seed=4)
    kpm, causal, _ = attention_masks(b, lq, lk, kind, gen, "cuda")
    scale = 1.0 / math.sqrt(d)
    keep = torch.full((keep_numel(b, h, lq, lk),), -1, dtype=torch.int32, device="cuda")
    out, lse = ext.attention_fwd(q, k, v, kpm, causal, P, scale, RNG, keep)
    out_d, lse_d = ext.attention_fwd(q, k, v, kpm, causal, P, scale, RNG)
    assert torch.equal(out, out_d) and torch.equal(lse, lse_d)
    drawn = ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, scale, RNG)
    read = ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, scale, RNG, keep=keep)
    other_rng = ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, scale, (4321, 0, 0, 0), keep=keep)
    for name, x, y, z in zip(("dq", "dk", "dv"), drawn, read, other_rng):
        assert torch.equal(x, y), f"{name}: read bits differ from drawn ones"
        assert torch.equal(y, z), f"{name}: the backward drew bits instead of reading them"
    assert not torch.equal(ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, scale, (4321, 0, 0, 0))[2],
                           drawn[2]), "another rng must draw another mask"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("d", [64, 128])
# partial blocks, q_len ≠ k_len both ways, dead rows ("both", and causal with q_len > k_len), lengths past
# what keeps the dropout bits at d 64 (1031 keys), one query over many keys
@pytest.mark.parametrize("lq,lk,kind", [(129, 129, "both"), (1031, 129, "causal"), (129, 1031, "pad"),
                                        (1, 300, "none"), (300, 1031, "causal"), (1031, 1031, "both")])
def test_sm90_kernels_match_sm80(lq, lk, kind, d, dtype):
    # The Hopper kernels against the sm_80 ones on the same call: the same dropout bits (the stored words
    # equal), outputs and gradients within accumulation-order rounding, and both within the reference rule.
    if not sm90_kernels_available():
        pytest.skip("the Hopper attention kernels need an sm_90a build and a compute capability 9.0 device")
    ext = _backend.ext()
    b, h = 2, 2
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, dtype, "cuda", seed=11)
    kpm, causal, _ = attention_masks(b, lq, lk, kind, gen, "cuda")
    scale = 1.0 / math.sqrt(d)
    results = {}
    for hopper in (True, False):
        keep = None
        if keeps_bits(P, lk, d):
            keep = torch.full((keep_numel(b, h, lq, lk),), -1, dtype=torch.int32, device="cuda")
        with sm90_attention(hopper):
            out, lse = ext.attention_fwd(q, k, v, kpm, causal, P, scale, RNG, keep)
            grads = ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, scale, RNG, keep=keep)
        results[hopper] = (out, lse, grads, keep)
    (out9, lse9, grads9, keep9), (out8, lse8, grads8, keep8) = results[True], results[False]
    if keep9 is not None:
        assert torch.equal(keep9, keep8), "the two kernel families drew different dropout bits"
    torch.testing.assert_close(lse9, lse8, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out9, out8, atol=2e-3, rtol=1e-2)
    for name, x, y in zip(("dq", "dk", "dv"), grads9, grads8):
        torch.testing.assert_close(x, y, atol=GRAD_ATOL[dtype], rtol=2e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
# Head dim 128 past 256 keys takes the Hopper warp-specialized forward. 48 heads give it more query blocks than an
# H100 or H200 has SMs, so that its CTAs walk several blocks each: a partial last block, causal with q_len > k_len
# (blocks that see no key), padding, and dropout (the stored bits compared too).
@pytest.mark.parametrize("lq,lk,kind,p", [(1100, 1100, "causal", 0.0), (1500, 600, "causal", 0.0),
                                          (700, 900, "pad", 0.0), (1100, 1100, "causal", P)])
def test_sm90_forward_over_many_blocks_matches_sm80(lq, lk, kind, p, dtype):
    if not sm90_kernels_available():
        pytest.skip("the Hopper attention kernels need an sm_90a build and a compute capability 9.0 device")
    ext = _backend.ext()
    b, h, d = 4, 12, 128
    q, k, v, _, gen = _inputs(b, h, lq, lk, d, dtype, "cuda", seed=13)
    kpm, causal, _ = attention_masks(b, lq, lk, kind, gen, "cuda")
    results = {}
    for hopper in (True, False):
        keep = torch.full((keep_numel(b, h, lq, lk),), -1, dtype=torch.int32, device="cuda") if p > 0 else None
        with sm90_attention(hopper):
            out, lse = ext.attention_fwd(q, k, v, kpm, causal, p, 1.0 / math.sqrt(d), RNG, keep)
        results[hopper] = (out, lse, keep)
    (out9, lse9, keep9), (out8, lse8, keep8) = results[True], results[False]
    if p > 0:
        assert torch.equal(keep9, keep8), "the two kernel families drew different dropout bits"
    torch.testing.assert_close(lse9, lse8, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out9, out8, atol=2e-3, rtol=1e-2)


def test_keep_buffer_policy():
    # kept with dropout while the bits take no more memory than q (k_len ≤ 16·head_dim)
    q, k = torch.empty(2, 3, 100, 64), torch.empty(2, 3, 1024, 64)
    bits = keep_buffer(q, k, 0.1)
    assert bits.dtype == torch.int32 and bits.shape == (keep_numel(2, 3, 100, 1024),)
    assert keep_numel(2, 3, 100, 1024) == 2 * 3 * 8 * 16 * 32  # 2 query blocks of 4 row groups, 16 key tiles
    assert keep_buffer(q, k, 0.0) is None
    assert keep_buffer(q, torch.empty(2, 3, 1025, 64), 0.1) is None


def test_dropout_bits_policy():
    # "always" keeps the bits past 16·head_dim keys, "never" keeps none, and each block restores the policy
    # it found
    q, short, long = torch.empty(2, 3, 100, 64), torch.empty(2, 3, 1024, 64), torch.empty(2, 3, 1025, 64)
    with lsmini.config.override(attention_dropout_bits="always"):
        assert keep_buffer(q, long, 0.1).shape == (keep_numel(2, 3, 100, 1025),)
        assert keep_buffer(q, long, 0.0) is None
        with lsmini.config.override(attention_dropout_bits="never"):
            assert keep_buffer(q, short, 0.1) is None and not keeps_bits(0.1, 1, 64)
        assert keeps_bits(0.1, 1 << 20, 64)
    assert keep_buffer(q, short, 0.1) is not None and keep_buffer(q, long, 0.1) is None
    assert keeps_bits(0.1, 1024, 64) and not keeps_bits(0.1, 1025, 64)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
# past 16·head_dim keys (the default redraws there): d 64 over 1031 keys, d 128 over 2053; odd lengths, dead rows
@pytest.mark.parametrize("lq,lk,d,kind", [(129, 1031, 64, "pad"), (65, 1031, 64, "both"), (70, 2053, 128, "causal")])
def test_dropout_bits_always_matches_drawn(lq, lk, d, kind, dtype, family):
    # The op with the bits kept at every length gives the same output and gradients, bit for bit, as the op
    # that draws them again in the backward
    q, k, v, dout, gen = _inputs(2, 2, lq, lk, d, dtype, "cuda", seed=9)
    kpm, causal, _ = attention_masks(2, lq, lk, kind, gen, "cuda")
    results = []
    for policy in ("never", "always"):
        with lsmini.config.override(attention_dropout_bits=policy):
            torch.manual_seed(5)
            out, grads = _run(lambda q, k, v: attention(q, k, v, kpm, causal, P), q, k, v, dout)
        results.append((out, *grads))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), f"{name}: kept bits give another result than drawn ones"


@pytest.mark.cuda
def test_kernel_backward_of_sum_and_partial_grads():
    # out.sum() hands backward a gradient with all-zero strides
    q, k, v, _, gen = _inputs(2, 2, 33, 40, 32, torch.float16, "cuda")
    kpm, causal, _ = attention_masks(2, 33, 40, "both", gen, "cuda")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    attention(*leaves, kpm, causal).sum().backward()
    _, want = _run(lambda q, k, v: attention(q, k, v, kpm, causal), q, k, v, torch.ones_like(q))
    assert all(torch.equal(a.grad, w) for a, w in zip(leaves, want))
    # only q needs a gradient (e.g. frozen keys/values)
    qq = q.clone().requires_grad_(True)
    attention(qq, k, v, kpm, causal).backward(torch.ones_like(q))
    assert torch.equal(qq.grad, want[0])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("lq,lk,d,kind", [(64, 64, 64, "pad"), (65, 200, 32, "both"), (200, 63, 128, "both"),
                                          (7, 7, 16, "none"), (100, 128, 64, "both")])
def test_dropout_mask_is_attention_softmax_mask(lq, lk, d, kind, dtype, monkeypatch, family):
    # With the same rng, fused attention = attention_softmax(scale·q@kᵀ) @ v, forward and backward.
    # Both functionals get RNG through the patched _backend.dropout_rng; the oracle runs the softmax
    # kernel in fp32.
    monkeypatch.setattr(_backend, "dropout_rng", lambda p, device: RNG if p > 0 else _backend.NO_RNG)
    b, h = 3, 2
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, dtype, "cuda", seed=6)
    kpm, causal, masked = attention_masks(b, lq, lk, kind, gen, "cuda")
    scale = 1.0 / math.sqrt(d)
    out, grads = _run(lambda q, k, v: attention(q, k, v, kpm, causal, P), q, k, v, dout)
    ref, ref_grads = _run(lambda q, k, v: attention_softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, kpm,
                                                            causal, P) @ v,
                          q.float(), k.float(), v.float(), dout.float())
    # the Python Philox oracle gives the softmax kernel's mask at flat index ((b·h + h)·lq + i)·lk + j
    keep = philox_keep_mask(b * h * lq * lk, P, RNG[0], RNG[1], "cuda").view(b, h, lq, lk)
    ref_keep = attention_ref(q.float(), k.float(), v.float(), kpm, causal, P, scale=scale, keep=keep)
    assert_close_fp32(ref, ref_keep, atol=1e-5, rtol=1e-4, name="softmax-kernel oracle vs Philox oracle")
    lowp, lowp_grads = _run(lambda q, k, v: _plain(q, k, v, masked, scale, keep, P), q, k, v, dout)
    assert_lowp_rule(out, ref, lowp, atol=1e-3, name="out")
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_lowp_rule(g, r, t, atol=GRAD_ATOL[dtype], name=name)
    # the rule is sharp enough to tell masks apart: another offset's mask is far off
    other = philox_keep_mask(b * h * lq * lk, P, RNG[0], RNG[1] + 4, "cuda").view(b, h, lq, lk)
    if lq * lk > 16:
        wrong = attention_ref(q.float(), k.float(), v.float(), kpm, causal, P, scale=scale, keep=other)
        assert max_err(out, wrong) > 4 * max_err(out, ref) + 1e-3
    # the extension called directly with the same rng gives the functional's bits
    direct, _ = _backend.ext().attention_fwd(q, k, v, kpm, causal, P, scale, RNG)
    assert torch.equal(direct, out)


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keep_rate_via_one_hot_values(p):
    # v[b, h, j] = e_j makes out[b, h, i, j] the dropped probability itself: the mask becomes visible
    b, h, lq, lk, d = 4, 8, 128, 128, 128
    q, k, _, _, _ = _inputs(b, h, lq, lk, d, torch.float16, "cuda", seed=7, q_scale=0.1)
    v = torch.eye(lk, d, dtype=torch.float16, device="cuda").expand(b, h, lk, d).contiguous()
    seed, offset = next_seed_offset(9)
    out = attention(q, k, v, dropout_p=p)
    probs = attention(q, k, v)
    assert (probs > 0).all()
    kept = out != 0
    keep = philox_keep_mask(b * h * lq * lk, p, seed, offset, "cuda").view(b, h, lq, lk)
    assert torch.equal(kept, keep), f"{int((kept != keep).sum())} mask elements differ from Philox"
    assert_dropout_keep_stats(kept.reshape(-1, lk), p)  # kept is a transposed view
    torch.testing.assert_close(out[kept].float(), probs[kept].float() / (1 - p), rtol=2e-3, atol=2.0 ** -23)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_dropout_functional_matches_philox_reference(dtype):
    # torch.manual_seed → (seed, offset) of the next call → the reference with that Philox mask
    b, h, lq, lk, d = 3, 2, 65, 128, 64
    q, k, v, dout, gen = _inputs(b, h, lq, lk, d, dtype, "cuda", seed=8)
    kpm, causal, masked = attention_masks(b, lq, lk, "both", gen, "cuda")
    seed, offset = next_seed_offset(21)
    out, grads = _run(lambda q, k, v: attention(q, k, v, kpm, causal, P), q, k, v, dout)
    keep = philox_keep_mask(b * h * lq * lk, P, seed, offset, "cuda").view(b, h, lq, lk)
    ref, ref_grads = _run(lambda q, k, v: attention_ref(q, k, v, kpm, causal, P, keep=keep),
                          q.float(), k.float(), v.float(), dout.float())
    lowp, lowp_grads = _run(lambda q, k, v: _plain(q, k, v, masked, 1.0 / math.sqrt(d), keep, P), q, k, v, dout)
    assert_lowp_rule(out, ref, lowp, atol=1e-3, name="out")
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref_grads, lowp_grads):
        assert_lowp_rule(g, r, t, atol=GRAD_ATOL[dtype], name=name)


@pytest.mark.cuda
def test_dropout_reproducible_and_p0_exact():
    q, k, v, dout, gen = _inputs(2, 4, 96, 96, 64, torch.bfloat16, "cuda")
    kpm, _, _ = attention_masks(2, 96, 96, "pad", gen, "cuda")

    def run():
        return _run(lambda q, k, v: attention(q, k, v, kpm, True, 0.3), q, k, v, dout)

    torch.manual_seed(7)
    a, da = run()
    torch.manual_seed(7)
    b, db = run()
    c, _ = run()
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(da, db))
    assert not torch.equal(a, c)  # the generator advanced
    torch.manual_seed(8)
    assert not torch.equal(run()[0], a)
    # p = 0 (or eval mode) draws no random numbers and equals the no-dropout path exactly
    state = torch.cuda.get_rng_state()
    y0, dy0 = _run(lambda q, k, v: attention(q, k, v, kpm, True, 0.0), q, k, v, dout)
    ye, dye = _run(lambda q, k, v: attention(q, k, v, kpm, True, 0.3, training=False), q, k, v, dout)
    assert torch.equal(torch.cuda.get_rng_state(), state)
    assert torch.equal(y0, ye) and all(torch.equal(x, y) for x, y in zip(dy0, dye))
    # p = 1 drops everything: out 0, gradients 0 and finite
    y1, dy1 = _run(lambda q, k, v: attention(q, k, v, kpm, True, 1.0), q, k, v, dout)
    assert (y1 == 0).all() and all((g == 0).all() for g in dy1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
@pytest.mark.parametrize("l", [128, 1024])  # one CTA per (batch, head) / the two tiled kernels
def test_backward_is_deterministic(dtype, l, family):
    ext = _backend.ext()
    b, h, d = 2, 4, 64
    q, k, v, dout, gen = _inputs(b, h, l, l, d, dtype, "cuda", seed=9)
    kpm, causal, _ = attention_masks(b, l, l, "pad", gen, "cuda")
    out, lse = ext.attention_fwd(q, k, v, kpm, causal, P, 0.125, RNG)
    first = ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, 0.125, RNG)
    for _ in range(2):
        again = ext.attention_bwd(dout, q, k, v, out, lse, kpm, causal, P, 0.125, RNG)
        assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert torch.equal(ext.attention_fwd(q, k, v, kpm, causal, P, 0.125, RNG)[0], out)


@pytest.mark.cuda
def test_kernel_bad_input_errors():
    ext = _backend.ext()
    q, k, v, dout, _ = _inputs(2, 2, 8, 8, 64, torch.float16, "cuda")
    rng = (0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # unsupported head_dim
        ext.attention_fwd(q[..., :24], k[..., :24], v[..., :24], None, False, 0.0, 0.2, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # float32
        ext.attention_fwd(q.float(), k.float(), v.float(), None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # dtypes differ
        ext.attention_fwd(q, k.bfloat16(), v, None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # head dims differ
        ext.attention_fwd(q, k[..., :32], v, None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # k and v lengths differ
        ext.attention_fwd(q, k, v[:, :, :7], None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # batch differs
        ext.attention_fwd(q, k[:1], v[:1], None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # mask shape
        ext.attention_fwd(q, k, v, torch.zeros(2, 7, dtype=torch.bool, device="cuda"), False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # mask dtype
        ext.attention_fwd(q, k, v, torch.zeros(2, 8, dtype=torch.uint8, device="cuda"), False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # CPU tensors
        ext.attention_fwd(q.cpu(), k.cpu(), v.cpu(), None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_fwd"):  # p out of range
        ext.attention_fwd(q, k, v, None, False, 1.5, 0.125, rng)
    out, lse = ext.attention_fwd(q, k, v, None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_bwd"):  # dout shape
        ext.attention_bwd(dout[:, :1], q, k, v, out, lse, None, False, 0.0, 0.125, rng)
    with pytest.raises(RuntimeError, match="attention_bwd"):  # out-param shape
        ext.attention_bwd(dout, q, k, v, out, lse, None, False, 0.0, 0.125, rng, torch.empty_like(q[:1]),
                          torch.empty_like(k), torch.empty_like(v))
    keep = torch.empty(keep_numel(2, 2, 8, 8), dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="attention_fwd: keep must be a contiguous int32"):  # keep size
        ext.attention_fwd(q, k, v, None, False, P, 0.125, RNG, keep[1:])
    with pytest.raises(RuntimeError, match="attention_bwd.*keep"):  # keep dtype
        ext.attention_bwd(dout, q, k, v, out, lse, None, False, P, 0.125, RNG, keep=keep.float())
    # the functional names the argument before anything reaches the kernel
    with pytest.raises(ValueError, match="key_padding_mask is on cpu but q is on cuda"):
        attention(q, k, v, torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
        attention(q, k.cpu(), v)


@pytest.mark.cuda
def test_unsupported_cases_on_cuda_run_the_reference():
    q, k, v, _, _ = _inputs(2, 2, 8, 9, 24, torch.float16, "cuda")  # head_dim 24
    with LsminiOps() as ops:
        y = attention(q.requires_grad_(), k, v, causal=True)
    assert ops.names == [] and y.grad_fn is not None
    assert torch.equal(y, attention_ref(q, k, v, causal=True))
    q, k, v, _, _ = _inputs(2, 2, 8, 9, 64, torch.float32, "cuda")  # float32
    with LsminiOps() as ops:
        y = attention(q.requires_grad_(), k, v)
    assert ops.names == [] and y.grad_fn is not None
    assert torch.equal(y, attention_ref(q, k, v))
    q, k, v, _, _ = _inputs(2, 2, 8, 0, 64, torch.float16, "cuda")  # no keys at all
    assert (attention(q, k, v, dropout_p=0.1) == 0).all()


@pytest.mark.cuda
def test_config_reference(monkeypatch):
    q, k, v, _, _ = _inputs(2, 2, 8, 9, 64, torch.float16, "cuda")
    q.requires_grad_(True)
    with LsminiOps() as ops:
        attention(q, k, v)
    assert ops.names == ["attention"]
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        y = attention(q, k, v, causal=True)
    assert ops.names == [] and y.grad_fn is not None
    assert torch.equal(y, attention_ref(q, k, v, causal=True))
    assert lsmini.backend() == "reference"
