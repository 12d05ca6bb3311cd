"""Fused bias + activation + dropout, the step after the first FFN GEMM of a Transformer layer: the public
op, its reference, its registered operators and the forward/backward primitives of the fused layers.

    out = dropout(act(x + bias)),   act ∈ {"relu", "gelu" (exact, erf), "gelu_tanh"}

Shapes: x [..., hidden]; bias [hidden] in x's dtype or float32, or None; out like x. The CUDA kernel
handles float32/float16/bfloat16 with fp32 math and one rounding.

Dropout (training and p > 0): element e of x, with flat index i = row * hidden + col of x viewed as
[rows, hidden], is kept iff its Philox word (keyed by the call's Philox state ``rng`` drawn from torch's
CUDA generator, see ``_backend.philox_seed_offset``, so ``torch.manual_seed`` reproduces it) passes the
threshold; kept values are scaled by 1 / (1 - p). The backward regenerates the mask from ``rng``. The
kernels read ``rng`` at run time, so the op can be captured in a CUDA graph and every replay draws a
fresh mask. On CPU the reference's bool keep-mask, drawn from torch's CPU generator, is what the
backward gets instead.

Backward: grad_x = act'(x + bias) · dropout backward of grad_out, recomputed from the saved input x
(and bias), not from a saved activation; grad_bias = grad_x summed over all rows (fp32 accumulation,
returned in bias's dtype).

- ``bias_act_dropout(x, bias, activation, dropout_p, training)``: the op: argument checks, then
  ``torch.ops.lsmini.bias_act_dropout``.
- ``bias_act_dropout_ref``: pure PyTorch in fp32 math, the oracle and the operators' CPU implementation.
- ``lsmini::bias_act_dropout`` / ``lsmini::bias_act_dropout_backward``: the op registered once (see
  ``lsmini.ops.library``): the kernels on CUDA, the reference and its gradients by autograd on CPU, fake
  implementations for tracing, autograd saving x, bias and the dropout state.
- ``bias_act_dropout_fwd`` / ``bias_act_dropout_bwd``: the primitives a layer's hand-written backward is
  built on (forward returns its saved state, backward takes it; kernels or reference). The forward can
  replay an earlier call (same dropout mask) to recompute an output instead of keeping it; for relu,
  ``relu_output_saved`` lets the backward read the derivative off the forward's output instead.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_bias, check_dropout_p, check_x
from lsmini.ops.dropout import dropout_ref, keep_mask
from lsmini.ops.library import (RANDOM_TAGS, draw_dropout_state, draw_keep_mask, fake_dropout_state, keep_mask_or_none,
                                operator, optional_outputs, state_rng)
from lsmini.ops.reference_grads import reference_grads

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")


def _act_ref(y, activation):
    if activation == "relu":
        return F.relu(y)
    if activation == "gelu":
        return F.gelu(y)
    return F.gelu(y, approximate="tanh")


def bias_act_dropout_ref(x, bias, activation="relu", dropout_p=0.0, training=True, mask=None):
    """Pure-PyTorch ``dropout(act(x + bias))`` in fp32 math (the oracle and the CPU path); returns x's
    dtype. ``mask`` (bool, shaped like x, True = keep) replaces the random draw, so a caller can
    reproduce a given dropout pattern."""
    y = x.float()
    if bias is not None:
        y = y + bias.float()
    y = dropout_ref(_act_ref(y, activation), dropout_p, training, mask)
    return y.to(x.dtype)


def bias_act_dropout_fwd(x2d, bias, activation, dropout_p, kernels, replay=None, out=None):
    """``dropout(act(x2d + bias))`` for x2d [rows, ffn] → (y, saved) for ``bias_act_dropout_bwd``.

    kernels: run the CUDA kernel (else the reference). replay: the saved state of an earlier call on the
    same x2d; recompute exactly that output (same dropout mask) instead of drawing a new mask. out: where
    to write y (else a fresh tensor). saved: {"x": x2d, "p": dropout_p} plus the kernel's Philox state
    "rng" or the reference's bool keep-mask "keep" (None without dropout).
    """
    if kernels:
        rng = replay["rng"] if replay is not None else _backend.dropout_rng(dropout_p, x2d.device)
        y = _backend.ext().bias_act_dropout_fwd(x2d, bias, activation, dropout_p, rng, out)
        return y, {"x": x2d, "p": dropout_p, "rng": rng}
    keep = replay["keep"] if replay is not None else keep_mask(x2d.shape, dropout_p, x2d.device)
    y = bias_act_dropout_ref(x2d, bias, activation, dropout_p, True, keep)
    return y if out is None else out.copy_(y), {"x": x2d, "p": dropout_p, "keep": keep}


def relu_output_saved(y, dropout_p):
    """The saved state of a relu ``bias_act_dropout_bwd`` that reads relu's derivative off the forward's
    output y: y > 0 exactly where the gradient passes (kept and positive), so neither the input nor the
    dropout mask needs keeping. Replaces ``bias_act_dropout_fwd``'s saved state (which holds the input)."""
    return {"y": y, "p": dropout_p}


def bias_act_dropout_bwd(grad2d, bias, activation, saved, kernels, out=None):
    """(grad_x, grad_bias) from the gradient grad2d [rows, ffn] of the output and the forward's saved
    state (``bias_act_dropout_fwd``'s, or ``relu_output_saved``). grad_x goes into out when given (out
    may be grad2d itself), else into a fresh tensor; grad_bias is fresh, in bias's dtype."""
    if "y" in saved:
        if kernels:
            return _backend.ext().bias_act_dropout_bwd(grad2d, saved["y"], bias, "relu", saved["p"], _backend.NO_RNG,
                                                       out, True)
        scale = 1.0 / (1.0 - saved["p"]) if saved["p"] < 1 else 0.0
        grad_x = torch.where(saved["y"] <= 0, 0.0, grad2d.float() * scale).to(grad2d.dtype)  # NaN passes, as the kernel
        return grad_x if out is None else out.copy_(grad_x), grad_x.float().sum(0).to(bias.dtype)
    if kernels:
        grad_x, grad_bias = _backend.ext().bias_act_dropout_bwd(grad2d, saved["x"], bias, activation, saved["p"],
                                                                saved["rng"], out)
        return grad_x, grad_bias

    def reference(x, b):
        return bias_act_dropout_ref(x, b, activation, saved["p"], True, saved["keep"])

    grad_x, grad_bias = reference_grads(reference, [saved["x"], bias], grad2d)
    return grad_x if out is None else out.copy_(grad_x), grad_bias


@operator("lsmini::bias_act_dropout", tags=RANDOM_TAGS)
def _bias_act_dropout_op(x: Tensor, bias: Tensor | None, activation: str, p: float) -> tuple[Tensor, Tensor]:
    """(out [rows, hidden] contiguous like x, dropout state) for x [rows, hidden]. This function is the CUDA
    implementation (the kernel; the state is the call's Philox state)."""
    rng, state = draw_dropout_state(p, x.device)
    return _backend.ext().bias_act_dropout_fwd(x, bias, activation, p, rng), state


@_bias_act_dropout_op.register_kernel("cpu")
def _bias_act_dropout_cpu(x, bias, activation, p):
    state = draw_keep_mask(x.shape, p, x.device)
    out = bias_act_dropout_ref(x, bias, activation, p, True, keep_mask_or_none(state, p))
    return out.contiguous(), state


@_bias_act_dropout_op.register_fake
def _(x, bias, activation, p):
    return x.new_empty(x.shape), fake_dropout_state(x, x.shape, p)


@operator("lsmini::bias_act_dropout_backward", differentiable=False)
def _bias_act_dropout_backward_op(grad: Tensor, x: Tensor, bias: Tensor | None, state: Tensor, activation: str,
                                  p: float) -> list[Tensor]:
    """[grad_x [rows, hidden] contiguous like x, grad_bias [hidden] in bias's dtype (only when bias is
    given)]; act' recomputed from x + bias, the forward's dropout mask applied again (the kernel
    regenerates it from the Philox state)."""
    grad_x, grad_bias = _backend.ext().bias_act_dropout_bwd(grad, x, bias, activation, p, state_rng(state, p))
    return [grad_x] if grad_bias is None else [grad_x, grad_bias]


@_bias_act_dropout_backward_op.register_kernel("cpu")
def _bias_act_dropout_backward_cpu(grad, x, bias, state, activation, p):
    keep = keep_mask_or_none(state, p)
    grad_x, grad_bias = reference_grads(lambda x, b: bias_act_dropout_ref(x, b, activation, p, True, keep), [x, bias],
                                        grad)
    return [grad_x.contiguous()] if grad_bias is None else [grad_x.contiguous(), grad_bias]


@_bias_act_dropout_backward_op.register_fake
def _(grad, x, bias, state, activation, p):
    return [grad.new_empty(grad.shape)] + ([] if bias is None else [bias.new_empty(bias.shape)])


def _bias_act_dropout_setup_context(ctx, inputs, output):
    x, bias, activation, p = inputs
    ctx.save_for_backward(x, bias, output[1])
    ctx.activation, ctx.p = activation, p


def _bias_act_dropout_backward(ctx, grad, _grad_state):
    x, bias, state = ctx.saved_tensors
    # bias goes in even when frozen: act' needs x + bias.
    grads = torch.ops.lsmini.bias_act_dropout_backward.default(grad, x, bias, state, ctx.activation, ctx.p)
    grad_x, grad_bias = optional_outputs(grads, True, bias is not None)
    return grad_x, grad_bias if ctx.needs_input_grad[1] else None, None, None


_bias_act_dropout_op.register_autograd(_bias_act_dropout_backward, setup_context=_bias_act_dropout_setup_context)


def _check_args(x, bias, activation, dropout_p):
    op = "bias_act_dropout"
    check_x(op, x)
    check_bias(op, bias, x)
    allowed = ", ".join(repr(a) for a in ACTIVATIONS)
    if not isinstance(activation, str):
        raise TypeError(f"{op}: activation must be one of {allowed} (a str), got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r}, expected one of {allowed}")
    check_dropout_p(op, dropout_p)


def bias_act_dropout(x, bias, activation="relu", dropout_p=0.0, training=True):
    """``dropout(act(x + bias))`` for x [..., hidden] and bias [hidden] or None.

    activation: "relu", "gelu" (exact, erf-based) or "gelu_tanh" (tanh approximation). Calls
    ``torch.ops.lsmini.bias_act_dropout`` for float32/float16/bfloat16 x (bias in x's dtype or float32):
    the fused CUDA kernel for CUDA tensors, ``bias_act_dropout_ref`` (with a keep-mask drawn from torch's
    CPU generator) for CPU tensors; other dtypes and the forced reference run ``bias_act_dropout_ref``.
    Dropout applies when ``training`` and ``dropout_p > 0``; the output has x's dtype.
    """
    _check_args(x, bias, activation, dropout_p)
    p = float(dropout_p) if training else 0.0
    if _backend.force_reference() or x.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(x.device):
        return bias_act_dropout_ref(x, bias, activation, p, bool(training))
    out, _ = torch.ops.lsmini.bias_act_dropout.default(x.reshape(-1, x.shape[-1]).contiguous(), bias, activation, p)
    return out.view(x.shape)
