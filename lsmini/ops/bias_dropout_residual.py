"""Fused bias + dropout + residual add, the step after each projection GEMM of a Transformer layer: the
public op, its reference, its registered operators and the forward/backward primitives of the fused layers.

    out = residual + dropout(x + bias)

Shapes: x, residual [..., hidden] (same shape and dtype); bias [hidden] in x's dtype or float32, or
None; out like x. The CUDA kernel handles float32/float16/bfloat16 with fp32 math and one rounding.

Dropout (training and p > 0): element e of x, with flat index i = row * hidden + col of x viewed as
[rows, hidden], is kept iff its Philox word (keyed by the call's Philox state ``rng`` drawn from torch's
CUDA generator, see ``_backend.philox_seed_offset``, so ``torch.manual_seed`` reproduces it) passes the
threshold; kept values are scaled by 1 / (1 - p). The backward regenerates the mask from ``rng``;
nothing per element is saved. The kernels read ``rng`` at run time, so the op can be captured in a
CUDA graph and every replay draws a fresh mask. On CPU the reference's bool keep-mask, drawn from
torch's CPU generator, is what the backward gets instead.

Backward: grad_x = dropout backward of grad_out; grad_bias = grad_x summed over all rows (fp32
accumulation, returned in bias's dtype); grad_residual = grad_out (the same tensor).

- ``bias_dropout_residual(x, bias, residual, dropout_p, training)``: the op: argument checks, then
  ``torch.ops.lsmini.bias_dropout_residual``.
- ``bias_dropout_residual_ref``: pure PyTorch in fp32 math, the oracle and the operators' CPU
  implementation.
- ``lsmini::bias_dropout_residual`` / ``lsmini::bias_dropout_residual_backward``: the op registered once
  (see ``lsmini.ops.library``): the kernels on CUDA, the reference and its gradients by autograd on CPU,
  fake implementations for tracing, autograd saving only the dropout state.
- ``bias_dropout_residual_fwd`` / ``bias_dropout_residual_bwd``: the primitives a layer's hand-written
  backward is built on (forward returns its saved state, backward takes it; kernels or reference), and
  ``bias_grad``: a bias gradient (fp32 column sums) on its own, from this op's backward kernel.
"""
import torch
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_bias, check_dropout_p, check_same_device, check_tensor, check_x
from lsmini.ops.dropout import dropout_ref, keep_mask
from lsmini.ops.library import (RANDOM_TAGS, draw_dropout_state, draw_keep_mask, fake_dropout_state, keep_mask_or_none,
                                operator, optional_outputs, state_rng)
from lsmini.ops.reference_grads import reference_grads


def bias_dropout_residual_ref(x, bias, residual, dropout_p=0.0, training=True, mask=None):
    """Pure-PyTorch ``residual + dropout(x + bias)`` in fp32 math (the oracle and the CPU path);
    returns x's dtype. ``mask`` (bool, shaped like x, True = keep) replaces the random draw, so a
    caller can reproduce a given dropout pattern."""
    y = x.float()
    if bias is not None:
        y = y + bias.float()
    y = dropout_ref(y, dropout_p, training, mask)
    return (residual.float() + y).to(x.dtype)


def bias_dropout_residual_fwd(x2d, bias, residual2d, dropout_p, kernels):
    """``residual2d + dropout(x2d + bias)`` for x2d, residual2d [rows, hidden] → (out, saved) for
    ``bias_dropout_residual_bwd``; always draws a dropout mask when dropout_p > 0 (training).

    kernels: run the CUDA kernel (else the reference). saved: {"p": dropout_p} plus the kernel's Philox
    state "rng" or the reference's bool keep-mask "keep" (None without dropout).
    """
    if kernels:
        rng = _backend.dropout_rng(dropout_p, x2d.device)
        out = _backend.ext().bias_dropout_residual_fwd(x2d, bias, residual2d, dropout_p, rng)
        return out, {"p": dropout_p, "rng": rng}
    keep = keep_mask(x2d.shape, dropout_p, x2d.device)
    return bias_dropout_residual_ref(x2d, bias, residual2d, dropout_p, True, keep), {"p": dropout_p, "keep": keep}


def bias_dropout_residual_bwd(grad2d, bias, saved, kernels, out=None):
    """(grad_x, grad_bias) from the gradient grad2d [rows, hidden] of the output and the forward's saved
    state; grad_residual is grad2d itself. grad_bias is fresh, in bias's dtype.

    Without dropout grad_x IS grad2d; with dropout it is written into out when given (else fresh).
    """
    dropout_p = saved["p"]
    if kernels:
        grad_x, grad_bias = _backend.ext().bias_dropout_residual_bwd(grad2d, dropout_p, saved["rng"], True,
                                                                     bias.dtype, out)
        return grad_x, grad_bias
    grad_x = grad2d
    if dropout_p > 0:
        grad_x = dropout_ref(grad2d.float(), dropout_p, True, saved["keep"]).to(grad2d.dtype)
        grad_x = grad_x if out is None else out.copy_(grad_x)
    return grad_x, bias_grad(grad_x, bias.dtype, kernels=False)


def bias_grad(grad2d, dtype, kernels):
    """Column sums of grad2d [rows, n] accumulated in fp32, returned as dtype (a bias gradient), without
    an fp32 copy of grad2d on the kernel path (``sum(dtype=float32)`` would make one)."""
    if kernels:
        return _backend.ext().bias_dropout_residual_bwd(grad2d, 0.0, _backend.NO_RNG, True, dtype)[1]
    return grad2d.float().sum(0).to(dtype)


@operator("lsmini::bias_dropout_residual", tags=RANDOM_TAGS)
def _bias_dropout_residual_op(x: Tensor, bias: Tensor | None, residual: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """(out [rows, hidden] contiguous like x, dropout state) for x, residual [rows, hidden]. This function
    is the CUDA implementation (the kernel; the state is the call's Philox state)."""
    rng, state = draw_dropout_state(p, x.device)
    return _backend.ext().bias_dropout_residual_fwd(x, bias, residual, p, rng), state


@_bias_dropout_residual_op.register_kernel("cpu")
def _bias_dropout_residual_cpu(x, bias, residual, p):
    state = draw_keep_mask(x.shape, p, x.device)
    out = bias_dropout_residual_ref(x, bias, residual, p, True, keep_mask_or_none(state, p))
    return out.contiguous(), state


@_bias_dropout_residual_op.register_fake
def _(x, bias, residual, p):
    return x.new_empty(x.shape), fake_dropout_state(x, x.shape, p)


@operator("lsmini::bias_dropout_residual_backward", differentiable=False)
def _bias_dropout_residual_backward_op(grad: Tensor, state: Tensor, p: float,
                                       bias_dtype: torch.dtype | None) -> list[Tensor]:
    """[grad_x (only when p > 0), grad_bias [hidden] in bias_dtype (only when bias_dtype is given)] from
    grad [rows, hidden]. With p == 0 grad_x is grad itself, which an operator may not return: the caller
    takes grad."""
    grad_x, grad_bias = _backend.ext().bias_dropout_residual_bwd(grad, p, state_rng(state, p), bias_dtype is not None,
                                                                 bias_dtype)
    return ([grad_x] if p > 0 else []) + ([grad_bias] if grad_bias is not None else [])


@_bias_dropout_residual_backward_op.register_kernel("cpu")
def _bias_dropout_residual_backward_cpu(grad, state, p, bias_dtype):
    # The op is linear in x and bias: its gradient is the same at every point, so zeros stand in for x,
    # bias and the residual (a constant here).
    zeros = grad.new_zeros(grad.shape)
    bias = None if bias_dtype is None else grad.new_zeros(grad.shape[1:], dtype=bias_dtype)
    keep = keep_mask_or_none(state, p)
    grad_x, grad_bias = reference_grads(lambda x, b: bias_dropout_residual_ref(x, b, zeros, p, True, keep),
                                        [zeros, bias], grad)
    return ([grad_x.contiguous()] if p > 0 else []) + ([grad_bias] if grad_bias is not None else [])


@_bias_dropout_residual_backward_op.register_fake
def _(grad, state, p, bias_dtype):
    grads = [grad.new_empty(grad.shape)] if p > 0 else []
    if bias_dtype is not None:
        grads.append(grad.new_empty(grad.shape[1:], dtype=bias_dtype))
    return grads


def _bias_dropout_residual_setup_context(ctx, inputs, output):
    _, bias, _, p = inputs
    ctx.save_for_backward(output[1])
    ctx.p = p
    ctx.bias_dtype = None if bias is None else bias.dtype


def _bias_dropout_residual_backward(ctx, grad, _grad_state):
    (state,) = ctx.saved_tensors
    want_x, bias_dtype = ctx.needs_input_grad[0], ctx.bias_dtype if ctx.needs_input_grad[1] else None
    grad_x = grad if want_x and ctx.p == 0 else None  # without dropout the gradient passes through
    grad_bias = None
    if (want_x and ctx.p > 0) or bias_dtype is not None:
        grads = torch.ops.lsmini.bias_dropout_residual_backward.default(grad, state, ctx.p, bias_dtype)
        dropped, grad_bias = optional_outputs(grads, ctx.p > 0, bias_dtype is not None)
        if want_x and ctx.p > 0:
            grad_x = dropped
    return grad_x, grad_bias, grad, None


_bias_dropout_residual_op.register_autograd(_bias_dropout_residual_backward,
                                           setup_context=_bias_dropout_residual_setup_context)


def _check_args(x, bias, residual, dropout_p):
    op = "bias_dropout_residual"
    check_x(op, x)
    check_tensor(op, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"{op}: residual must have x's dtype {x.dtype}, got {residual.dtype}")
    check_same_device(op, "residual", residual, "x", x.device)
    check_bias(op, bias, x)
    check_dropout_p(op, dropout_p)


def bias_dropout_residual(x, bias, residual, dropout_p=0.0, training=True):
    """``residual + dropout(x + bias)`` for x, residual [..., hidden] and bias [hidden] or None.

    Calls ``torch.ops.lsmini.bias_dropout_residual`` for float32/float16/bfloat16 x (bias in x's dtype
    or float32): the fused CUDA kernel for CUDA tensors, ``bias_dropout_residual_ref`` (with a keep-mask
    drawn from torch's CPU generator) for CPU tensors; other dtypes and the forced reference run
    ``bias_dropout_residual_ref``. Dropout applies when ``training`` and ``dropout_p > 0``; the output has
    x's dtype.
    """
    _check_args(x, bias, residual, dropout_p)
    p = float(dropout_p) if training else 0.0
    if _backend.force_reference() or x.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(x.device):
        return bias_dropout_residual_ref(x, bias, residual, p, bool(training))
    hidden = x.shape[-1]
    out, _ = torch.ops.lsmini.bias_dropout_residual.default(x.reshape(-1, hidden), bias, residual.reshape(-1, hidden),
                                                            p)
    return out.view(x.shape)
