"""Attention: fused scaled-dot-product attention (FlashAttention-style; the scores never reach memory): the
public op, its reference, its registered operators and the forward/backward primitives of the fused layers.

    s[b, h, i, j]  = scale · q[b, h, i] · k[b, h, j]                       (scale defaults to 1/sqrt(d))
    masked[b, h, i, j] = key_padding_mask[b, j]  or  (causal and j > i + k_len − q_len)
    P   = softmax(s.masked_fill(masked, −inf), dim=−1)                    (a row with every key masked → 0)
    out = dropout(P, p) @ v                                               (only when training and p > 0)

Shapes: q [batch, heads, q_len, d], k and v [batch, kv_heads, k_len, d] with kv_heads dividing heads
(grouped-query attention: query head h reads K/V head h // (heads // kv_heads); the kernels read the shared
heads in place and sum their gradients inside the dK/dV kernels); key_padding_mask bool [batch, k_len],
True = pad; out [batch, heads, q_len, d] in q's dtype. The kernel returns out as the
transposed view of a contiguous [batch, q_len, heads, d] buffer, so merging heads
(``out.transpose(1, 2).reshape(batch, q_len, heads * d)``) costs no copy.

The causal mask is aligned bottom-right exactly as in ``lsmini.ops.attention_softmax``: query i sees
key j iff j ≤ i + (k_len − q_len). With q_len > k_len the first q_len − k_len queries see no key and
get zeros (and zero gradients).

Dropout: the kept set is the attention_softmax kernel's — element (b, h, i, j) of the [b, h, q_len,
k_len] probabilities draws Philox at flat index ((b·heads + h)·q_len + i)·k_len + j of the call's
``rng`` (``_backend.dropout_rng``) — and kept probabilities are scaled by 1/(1 − p). So, with the same
rng, the fused op equals ``attention_softmax(scale·q@kᵀ, ...) @ v``. The kernel saves out and the row
log-sum-exp (fp32 [b, h, q_len]); backward regenerates the mask from rng, except where the bits cost no
more memory than q itself (``keep_buffer``: k_len ≤ 16·d, the usual training lengths;
``lsmini.config.attention_dropout_bits`` changes where): there the forward also stores the mask it drew, one bit per score, and backward reads it
instead, which spares the backward's two kernels a Philox draw each; the bits are the same either way.

The CUDA kernel covers ``lsmini.limits.ATTENTION_DTYPES`` (float16/bfloat16) with head_dim d in
``lsmini.limits.ATTENTION_HEAD_DIMS``, and so does the registered operator on CPU; anything else
(float32, float64, other d) runs ``attention_ref``. Backward is deterministic (no atomics). On Hopper
(compute capability 9.0, an sm_90a build) head dims 64 and 128 run kernels built on warpgroup MMAs
(``sm90_kernels_available``); the same math, masks and dropout bits as the sm_80 kernels, which
``lsmini._debug.sm90_attention(False)`` selects instead.

- ``attention(q, k, v, key_padding_mask, causal, dropout_p, training, scale)``: the op: argument checks,
  then ``torch.ops.lsmini.attention`` where ``fused_attention_supported``, ``attention_ref`` elsewhere.
- ``attention_ref``: pure PyTorch in fp32 math, the oracle and the operators' CPU implementation.
- ``lsmini::attention`` / ``lsmini::attention_backward``: the op registered once (see
  ``lsmini.ops.library``): the kernels on CUDA; on CPU the reference with the reference's keep-mask as the
  dropout state (and no keep bits), and its gradients by autograd; fake implementations for tracing;
  autograd saving q, k, v, out, lse, the mask, the dropout state and the bits.
- ``attention_fwd`` / ``attention_bwd``: the primitives a layer's hand-written backward is built on: a
  forward that returns the merged-heads output and its saved state, a backward that writes the
  gradients into given views (e.g. of one projection-gradient buffer); fused kernel or reference.
"""
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lsmini import _backend, limits
from lsmini.config import config
from lsmini.ops.attention_softmax import attention_mask_ref, attention_softmax_ref
from lsmini.ops.checks import (check_causal_and_dropout, check_floating, check_key_padding_mask, check_same_device,
                               check_tensor)
from lsmini.ops.dropout import keep_mask
from lsmini.ops.library import (RANDOM_TAGS, draw_dropout_state, draw_keep_mask, fake_dropout_state, keep_mask_or_none,
                                operator, state_rng)
from lsmini.ops.reference_grads import reference_grads


def fused_attention_supported(dtype, head_dim):
    """True when the fused CUDA kernel handles this dtype and head_dim (the device is checked apart)."""
    return dtype in limits.ATTENTION_DTYPES and head_dim in limits.ATTENTION_HEAD_DIMS


def sm90_kernels_available():
    """True when fused attention on the current CUDA device runs the Hopper kernels for head dims 64 and 128:
    the extension was built for sm_90a (``LSMINI_CUDA_ARCHS``, default) and the device is compute capability
    9.0."""
    ext = _backend.ext_or_none()
    return ext is not None and torch.cuda.is_available() and ext.attention_sm90_available()


def keep_numel(batch, heads, q_len, k_len):
    """int32 words of the kernels' dropout keep-bit buffer (csrc/kernels/attention.h): one per lane of each
    16-query × 64-key tile, the queries in whole blocks of 64."""
    return batch * heads * ((q_len + 63) // 64 * 4) * ((k_len + 63) // 64) * 32


def keeps_bits(p, k_len, head_dim):
    """Whether the fused forward stores its dropout keep bits for the backward to read, under
    ``lsmini.config.attention_dropout_bits`` ("auto": with dropout, where the bits take no more memory than
    q, k_len ≤ 16·head_dim — one bit a score against two bytes an element of q); else the backward draws
    them again. The layers' C++ plan keeps them by the same "auto" rule."""
    if p <= 0:
        return False
    policy = config.attention_dropout_bits
    return policy == "always" or (policy == "auto" and k_len <= 16 * head_dim)


def keep_buffer(q, k, p):
    """An empty buffer for the fused forward to store its dropout keep bits in, for the backward to read; None
    where they are not kept (``keeps_bits``)."""
    b, h, lq, d = q.shape
    if not keeps_bits(p, k.shape[2], d):
        return None
    return torch.empty(keep_numel(b, h, lq, k.shape[2]), dtype=torch.int32, device=q.device)


def attention_ref(q, k, v, key_padding_mask=None, causal=False, dropout_p=0.0, training=True, scale=None,
                  keep=None):
    """Pure-PyTorch attention in fp32 math (the oracle and the CPU path); returns [b, h, q_len, d] in q's dtype.

    k and v may have fewer heads than q (dividing them): each is repeated for its group of query heads, so
    autograd sums a shared head's gradients. Differentiable by autograd. Rows whose every key is masked give
    zeros and zero gradients, never NaN.
    keep: optional bool [b, h, q_len, k_len] (True = kept) that replaces the random dropout mask, so a
    test can apply the kernel's own Philox mask; it is applied (probs·keep/(1 − p)) even when p = 0 or
    not training. Without keep, dropout is ``F.dropout`` when training and p > 0.
    """
    b, h, lq, d = q.shape
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    groups = h // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    # masked_fill, the dead-row guard and the fp32 softmax are attention_softmax's own oracle
    probs = attention_softmax_ref(s, key_padding_mask, causal, 0.0, False)
    if keep is not None:
        if tuple(keep.shape) != tuple(probs.shape):
            raise ValueError(f"attention_ref: keep must have shape {tuple(probs.shape)}, got {tuple(keep.shape)}")
        probs = probs * keep.to(probs.dtype) * (1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0)
    elif training and dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v.float()).to(q.dtype)


def attention_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale, fused):
    """Attention of q [b, h, lq, d] over k, v [b, hk, lk, d] (views into the projections, say) → (out, saved)
    for ``attention_bwd``, with out [b, lq, h·d] contiguous: heads already merged.

    Always draws a dropout mask when dropout_p > 0 (training); scale is a float. fused: run the flash kernel
    (CUDA, ``fused_attention_supported``); out is then its merged-heads buffer, with no copy. Otherwise
    ``attention_ref`` runs and its bool keep-mask goes into saved. saved holds the inputs and arguments,
    "out", and the kernel's "rng", row log-sum-exp "lse" and keep bits "bits" (``keep_buffer``), or the
    reference's "keep".
    """
    batch, heads, q_len, head_dim = q.shape
    saved = {"q": q, "k": k, "v": v, "key_padding_mask": key_padding_mask, "causal": causal, "p": dropout_p,
             "scale": scale}
    if fused:
        saved["rng"] = _backend.dropout_rng(dropout_p, q.device)
        saved["bits"] = keep_buffer(q, k, dropout_p)
        out, saved["lse"] = _backend.ext().attention_fwd(q, k, v, key_padding_mask, causal, dropout_p, scale,
                                                         saved["rng"], saved["bits"])
    else:
        saved["keep"] = keep_mask((batch, heads, q_len, k.shape[2]), dropout_p, q.device)
        out = attention_ref(q, k, v, key_padding_mask, causal, dropout_p, True, scale, saved["keep"])
    out = out.transpose(1, 2).reshape(batch, q_len, heads * head_dim)  # free for the kernel's [b, lq, h, d] buffer
    saved["out"] = out
    return out, saved


def attention_bwd(grad_out, saved, grad_q, grad_k, grad_v, fused):
    """Writes the gradients of q, k, v into grad_q, grad_k, grad_v (views shaped like q, k, v), from the
    gradient grad_out [b, lq, h·d] of ``attention_fwd``'s output and its saved state; returns None."""
    batch, heads, q_len, head_dim = saved["q"].shape

    def split(merged):
        return merged.view(batch, q_len, heads, head_dim).transpose(1, 2)

    if fused:
        _backend.ext().attention_bwd(split(grad_out), saved["q"], saved["k"], saved["v"], split(saved["out"]),
                                     saved["lse"], saved["key_padding_mask"], saved["causal"], saved["p"],
                                     saved["scale"], saved["rng"], grad_q, grad_k, grad_v, saved["bits"])
        return

    def reference(q, k, v):
        return attention_ref(q, k, v, saved["key_padding_mask"], saved["causal"], saved["p"], True, saved["scale"],
                             saved["keep"])

    grads = reference_grads(reference, [saved["q"], saved["k"], saved["v"]], split(grad_out))
    for grad, result in zip((grad_q, grad_k, grad_v), grads):
        grad.copy_(result)


@operator("lsmini::attention", tags=RANDOM_TAGS)
def _attention_op(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, causal: bool, p: float,
                  scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, lse, dropout state, keep bits): out [b, h, lq, d] as the transposed view of a contiguous
    [b, lq, h, d] buffer, lse float32 [b, h, lq] (+inf where every key is masked), the bits int32
    (``keep_buffer``; empty when not kept, and always on CPU). This function is the CUDA implementation
    (the kernel; the state is the call's Philox state)."""
    rng, state = draw_dropout_state(p, q.device)
    bits = keep_buffer(q, k, p)
    out, lse = _backend.ext().attention_fwd(q, k, v, key_padding_mask, causal, p, scale, rng, bits)
    return out, lse, state, q.new_empty(0, dtype=torch.int32) if bits is None else bits


@_attention_op.register_kernel("cpu")
def _attention_cpu(q, k, v, key_padding_mask, causal, p, scale):
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    state = draw_keep_mask((b, h, lq, lk), p, q.device)
    out = attention_ref(q, k, v, key_padding_mask, causal, p, True, scale, keep_mask_or_none(state, p))
    s = torch.matmul(q.float(), k.float().repeat_interleave(h // k.shape[1], dim=1).transpose(-1, -2)) * scale
    masked = attention_mask_ref(b, lq, lk, key_padding_mask, causal, q.device)
    lse = torch.logsumexp(s if masked is None else s.masked_fill(masked, float("-inf")), dim=-1)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # the kernel's value for a row that sees no key
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse, state, q.new_empty(0, dtype=torch.int32)


@_attention_op.register_fake
def _(q, k, v, key_padding_mask, causal, p, scale):
    b, h, lq, d = q.shape
    out = q.new_empty((b, lq, h, d)).transpose(1, 2)
    bits = keep_buffer(q, k, p) if q.device.type == "cuda" else None
    return (out, q.new_empty((b, h, lq), dtype=torch.float32), fake_dropout_state(q, (b, h, lq, k.shape[2]), p),
            q.new_empty(0, dtype=torch.int32) if bits is None else bits)


@operator("lsmini::attention_backward", differentiable=False)
def _attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           key_padding_mask: Tensor | None, state: Tensor, bits: Tensor, causal: bool, p: float,
                           scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous, shaped like q, k, v; the dropout mask read from the forward's bits, or
    regenerated from its state when the bits are empty."""
    if dout.stride(-1) != 1:  # e.g. the all-zero-stride gradient of out.sum()
        dout = dout.contiguous()
    dq, dk, dv = _backend.ext().attention_bwd(dout, q, k, v, out, lse, key_padding_mask, causal, p, scale,
                                              state_rng(state, p), keep=bits if bits.numel() else None)
    return dq, dk, dv


@_attention_backward_op.register_kernel("cpu")
def _attention_backward_cpu(dout, q, k, v, out, lse, key_padding_mask, state, bits, causal, p, scale):
    keep = keep_mask_or_none(state, p)
    dq, dk, dv = reference_grads(lambda q, k, v: attention_ref(q, k, v, key_padding_mask, causal, p, True, scale, keep),
                                 [q, k, v], dout)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, key_padding_mask, state, bits, causal, p, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, causal, p, scale = inputs
    out, lse, state, bits = output
    ctx.mark_non_differentiable(lse, bits)
    # the mask goes through save_for_backward too: an in-place change before backward then errors
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, state, bits)
    ctx.causal, ctx.p, ctx.scale = causal, p, scale


def _attention_backward(ctx, dout, _grad_lse, _grad_state, _grad_bits):
    q, k, v, out, lse, key_padding_mask, state, bits = ctx.saved_tensors
    dq, dk, dv = torch.ops.lsmini.attention_backward.default(dout, q, k, v, out, lse, key_padding_mask, state, bits,
                                                             ctx.causal, ctx.p, ctx.scale)
    return dq, dk, dv, None, None, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)


def _check_args(q, k, v, key_padding_mask, causal, dropout_p, scale):
    name = "attention"
    for arg, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, arg, t)
        check_floating(name, arg, t)
        if t.dim() != 4:
            what = "[batch, heads, q_len, head_dim]" if arg == "q" else "[batch, heads, k_len, head_dim]"
            raise ValueError(f"{name}: {arg} must be 4-D {what}, got shape {tuple(t.shape)}")
    for arg, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: {arg} must have q's dtype {q.dtype}, got {t.dtype}")
        check_same_device(name, arg, t, "q", q.device)
    b, h, _, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    for arg, t in (("k", k), ("v", v)):
        got = (t.shape[0], t.shape[3])
        if got != (b, d):
            raise ValueError(f"{name}: {arg} must have (batch, head_dim) = ({b}, {d}) like q, got shape "
                             f"{tuple(t.shape)}")
    if hk == 0 or h % hk:
        raise ValueError(f"{name}: k's heads ({hk}) must divide q's heads ({h}) (grouped-query attention), got "
                         f"q {tuple(q.shape)} and k {tuple(k.shape)}")
    if tuple(v.shape[1:3]) != (hk, lk):
        raise ValueError(f"{name}: v must have k's (heads, k_len) = ({hk}, {lk}), got shape {tuple(v.shape)}")
    check_key_padding_mask(name, key_padding_mask, b, lk, q.device, "q")
    check_causal_and_dropout(name, causal, dropout_p)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"{name}: scale must be a float or None, got {type(scale).__name__}")
        if not (1e-38 <= scale <= 1e38):
            raise ValueError(f"{name}: scale must be a positive float from 1e-38 to 1e38 (the kernels take "
                             f"scale·log2(e) as a normal float32), got {scale}")


def attention(q, k, v, key_padding_mask=None, causal=False, dropout_p=0.0, training=True, scale=None):
    """Scaled-dot-product attention, fused: softmax(scale·q·kᵀ + masks) with dropout, times v.

    q [batch, heads, q_len, d]; k, v [batch, kv_heads, k_len, d], kv_heads dividing heads (query head h
    reads K/V head h // (heads // kv_heads)); all the same floating dtype and device.
    key_padding_mask: bool [batch, k_len], True = pad (that key gets probability 0), or None.
    causal: bottom-right aligned (query i sees key j iff j ≤ i + k_len − q_len).
    dropout_p: attention-probability dropout, applied only when ``training`` and dropout_p > 0.
    scale: multiplier of q·k, default 1/sqrt(d).
    Returns out [batch, heads, q_len, d] in q's dtype; rows with every key masked are zeros. Calls
    ``torch.ops.lsmini.attention`` where the fused kernel applies (float16/bfloat16, d in 16/32/64/128,
    no empty dimension): the kernel for CUDA tensors, ``attention_ref`` (with a keep-mask drawn from
    torch's CPU generator) for CPU tensors; out is then a transposed view of a contiguous
    [batch, q_len, heads, d] buffer. Other cases and the forced reference run ``attention_ref``.
    """
    _check_args(q, k, v, key_padding_mask, causal, dropout_p, scale)
    p = float(dropout_p) if training else 0.0
    d = q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    empty = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] == 0  # nothing for a kernel to do
    if (_backend.force_reference() or empty or not fused_attention_supported(q.dtype, d)
            or not _backend.has_op_impl(q.device)):
        return attention_ref(q, k, v, key_padding_mask, causal, p, training, scale)
    return torch.ops.lsmini.attention.default(q, k, v, key_padding_mask, causal, p, scale)[0]
