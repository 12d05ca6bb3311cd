"""Attention softmax: masked softmax over the keys of attention scores, fused with dropout: the public op,
its reference (and the reference attention mask) and its registered operators.

    masked[b, h, i, j] = key_padding_mask[b, j]  or  (causal and j > i + k_len − q_len)
    y   = softmax(scores.masked_fill(masked, −inf), dim=−1)     (a row with every key masked → 0)
    out = dropout(y, p)                                         (only when training and p > 0)

Shapes: scores [batch, heads, q_len, k_len], already scaled by 1/sqrt(head_dim) (fold the scale
into the QKᵀ product); key_padding_mask bool [batch, k_len], True = pad; out like scores.

The causal mask is aligned bottom-right: query i sees key j iff j ≤ i + (k_len − q_len), so the
last query always sees every key. With q_len == k_len this is the usual lower triangle; with
q_len < k_len it is a decoding step over cached keys; with q_len > k_len the first q_len − k_len
queries see nothing and get zeros.

Backward: g = dout · keep / (1 − p),  dscores = y · (g − Σ_j y_j g_j). The kernel saves only y (the
pre-dropout softmax) and regenerates the dropout mask from the call's Philox state ``rng``
(``_backend.philox_seed_offset``), which the kernels read at run time: the op can be captured in a CUDA
graph and every replay draws a fresh mask.

The CUDA kernel covers float32/float16/bfloat16 (fp32 math) and k_len ≤ 16384
(``lsmini.limits.ATTENTION_SOFTMAX_MAX_KEYS``, on every backend).

The op is registered once (see ``lsmini.ops.library``) as ``lsmini::attention_softmax`` /
``lsmini::attention_softmax_backward``: the kernels on CUDA; on CPU ``attention_softmax_ref`` with the
reference's keep-mask as the dropout state, and its gradient by autograd; fake implementations for
tracing; autograd saving the softmax and the dropout state. ``attention_softmax`` checks its arguments
and calls it in eager and compiled code alike; other dtypes (e.g. float64) and the forced reference run
``attention_softmax_ref`` directly.
"""
import torch
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_causal_and_dropout, check_floating, check_key_padding_mask, check_tensor
from lsmini.ops.dropout import dropout_ref
from lsmini.ops.library import (RANDOM_TAGS, draw_dropout_state, draw_keep_mask, fake_dropout_state, keep_mask_or_none,
                                operator, state_rng)
from lsmini.ops.reference_grads import reference_grads


def attention_mask_ref(batch, q_len, k_len, key_padding_mask=None, causal=False, device=None):
    """Bool mask (True = masked) broadcastable to [batch, heads, q_len, k_len], or None."""
    masked = None
    if key_padding_mask is not None:
        masked = key_padding_mask.bool().view(batch, 1, 1, k_len)
    if causal:
        i = torch.arange(q_len, device=device).view(q_len, 1)
        j = torch.arange(k_len, device=device).view(1, k_len)
        above = j > i + (k_len - q_len)
        masked = above if masked is None else masked | above
    return masked


def attention_softmax_ref(scores, key_padding_mask=None, causal=False, dropout_p=0.0, training=True, mask=None):
    """Pure-PyTorch attention softmax in fp32 math (the oracle and the CPU path); returns scores' dtype.

    Rows whose every key is masked give zeros (forward) and zero gradients, never NaN. ``mask`` (bool,
    shaped like scores, True = keep) replaces the random dropout draw, so a caller can reproduce a given
    dropout pattern.
    """
    return dropout_ref(_masked_softmax_ref(scores, key_padding_mask, causal), dropout_p, training,
                       mask).to(scores.dtype)


def _masked_softmax_ref(scores, key_padding_mask, causal):
    """The fp32 softmax of ``attention_softmax_ref`` before dropout."""
    b, _, q, k = scores.shape
    x = scores.float()
    masked = attention_mask_ref(b, q, k, key_padding_mask, causal, scores.device)
    if masked is not None:
        x = x.masked_fill(masked, float("-inf"))
    # Rows with no finite maximum (all keys masked) would give 0/0: softmax a zero row instead and
    # zero it afterwards, so neither the output nor the gradient sees a NaN.
    dead = (x == float("-inf")).all(dim=-1, keepdim=True)
    return torch.softmax(x.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)


@operator("lsmini::attention_softmax", tags=RANDOM_TAGS)
def _attention_softmax_op(scores: Tensor, key_padding_mask: Tensor | None, causal: bool,
                          p: float) -> tuple[Tensor, Tensor, Tensor]:
    """(probs, softmax, dropout state) for scores [batch, heads, q_len, k_len]: probs and, when p > 0, the
    pre-dropout softmax, both contiguous like scores. With p == 0 the two are one tensor, which an
    operator may not return twice: softmax is then an empty tensor (backward reads probs instead). This
    function is the CUDA implementation (the kernel; the state is the call's Philox state)."""
    rng, state = draw_dropout_state(p, scores.device)
    probs, softmax = _backend.ext().attention_softmax_fwd(scores, key_padding_mask, causal, p, rng)
    return probs, softmax if p > 0 else softmax.new_empty((0,)), state


@_attention_softmax_op.register_kernel("cpu")
def _attention_softmax_cpu(scores, key_padding_mask, causal, p):
    state = draw_keep_mask(scores.shape, p, scores.device)
    y = _masked_softmax_ref(scores, key_padding_mask, causal).contiguous()
    if p == 0:
        return y.to(scores.dtype), scores.new_empty((0,)), state
    return dropout_ref(y, p, True, state).to(scores.dtype), y.to(scores.dtype), state


@_attention_softmax_op.register_fake
def _(scores, key_padding_mask, causal, p):
    softmax = scores.new_empty(scores.shape if p > 0 else (0,))
    return scores.new_empty(scores.shape), softmax, fake_dropout_state(scores, scores.shape, p)


@operator("lsmini::attention_softmax_backward", differentiable=False)
def _attention_softmax_backward_op(grad_probs: Tensor, softmax: Tensor, state: Tensor, p: float) -> Tensor:
    """grad_scores (contiguous, like softmax) from grad_probs, the pre-dropout softmax and the forward's
    dropout state."""
    return _backend.ext().attention_softmax_bwd(grad_probs, softmax, p, state_rng(state, p), False)


@_attention_softmax_backward_op.register_kernel("cpu")
def _attention_softmax_backward_cpu(grad_probs, softmax, state, p):
    # The reference's gradient at log(softmax): a softmax is unchanged by a shift of its row, so
    # softmax(log y) = y and the gradient there is the gradient at the scores. Masked keys are −inf in
    # log y already, and a row with every key masked is all −inf, which the reference gives zeros.
    keep = keep_mask_or_none(state, p)
    (grad,) = reference_grads(lambda s: attention_softmax_ref(s, None, False, p, True, keep), [softmax.float().log()],
                              grad_probs.float())
    return grad.to(softmax.dtype).contiguous()


@_attention_softmax_backward_op.register_fake
def _(grad_probs, softmax, state, p):
    return softmax.new_empty(softmax.shape)


def _attention_softmax_setup_context(ctx, inputs, output):
    p = inputs[3]
    probs, softmax, state = output
    ctx.mark_non_differentiable(softmax)
    ctx.save_for_backward(softmax if p > 0 else probs, state)
    ctx.p = p


def _attention_softmax_backward(ctx, grad_probs, _grad_softmax, _grad_state):
    softmax, state = ctx.saved_tensors
    grad = torch.ops.lsmini.attention_softmax_backward.default(grad_probs, softmax, state, ctx.p)
    return grad, None, None, None


_attention_softmax_op.register_autograd(_attention_softmax_backward, setup_context=_attention_softmax_setup_context)


def _check_args(scores, key_padding_mask, causal, dropout_p):
    name = "attention_softmax"
    check_tensor(name, "scores", scores)
    check_floating(name, "scores", scores)
    if scores.dim() != 4:
        raise ValueError(f"{name}: scores must be 4-D [batch, heads, q_len, k_len], got shape {tuple(scores.shape)}")
    b, _, _, k = scores.shape
    if k > limits.ATTENTION_SOFTMAX_MAX_KEYS:
        raise ValueError(f"{name}: k_len (last dim of scores) must be at most {limits.ATTENTION_SOFTMAX_MAX_KEYS}, "
                         f"got {k}")
    check_key_padding_mask(name, key_padding_mask, b, k, scores.device, "scores")
    check_causal_and_dropout(name, causal, dropout_p)


def attention_softmax(scores, key_padding_mask=None, causal=False, dropout_p=0.0, training=True):
    """Masked softmax over the last dim of scores [batch, heads, q_len, k_len], then dropout.

    key_padding_mask: bool [batch, k_len], True = pad (that key gets probability 0), or None.
    causal: bottom-right aligned (query i sees key j iff j ≤ i + k_len − q_len).
    dropout_p: attention-probability dropout, applied only when ``training`` and dropout_p > 0.
    Returns probabilities after dropout, same shape and dtype as scores. Rows with every key
    masked are zeros. k_len must be at most 16384.
    Calls ``torch.ops.lsmini.attention_softmax`` for float32/float16/bfloat16 scores: the fused CUDA
    kernel for CUDA tensors, ``attention_softmax_ref`` (with a keep-mask drawn from torch's CPU
    generator) for CPU tensors; other dtypes and the forced reference run ``attention_softmax_ref``.
    """
    _check_args(scores, key_padding_mask, causal, dropout_p)
    p = float(dropout_p) if training else 0.0
    if (_backend.force_reference() or scores.dtype not in limits.KERNEL_DTYPES
            or not _backend.has_op_impl(scores.device)):
        return attention_softmax_ref(scores, key_padding_mask, causal, p, training)
    probs, _, _ = torch.ops.lsmini.attention_softmax.default(scores, key_padding_mask, causal, p)
    return probs
