"""Fused bias + dropout + residual add, the step after each projection GEMM of a Transformer layer.

    out = residual + dropout(x + bias)

Shapes: x, residual [..., hidden] (same shape and dtype); bias [hidden] in x's dtype or float32, or
None; out like x. The CUDA kernel handles float32/float16/bfloat16 with fp32 math and one rounding.

Dropout (training and p > 0): element e of x, with flat index i = row * hidden + col of x viewed as
[rows, hidden], is kept iff its Philox word (keyed by the call's Philox state ``rng`` drawn from torch's
CUDA generator, see ``_backend.philox_seed_offset``, so ``torch.manual_seed`` reproduces it) passes the
threshold; kept values are scaled by 1 / (1 - p). The backward regenerates the mask from ``rng``;
nothing per element is saved. The kernels read ``rng`` at run time, so the op can be captured in a
CUDA graph and every replay draws a fresh mask.

Backward: grad_x = dropout backward of grad_out; grad_bias = grad_x summed over all rows (fp32
accumulation, returned in bias's dtype); grad_residual = grad_out (the same tensor).
"""
import numbers

import torch
import torch.nn.functional as F

from lsmini import _backend

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dropout_ref(y, p, training, mask):
    if not training or p == 0:
        return y
    if mask is None:
        return F.dropout(y, p, training=True)
    if p >= 1:
        return torch.zeros_like(y)
    return torch.where(mask, y * (1.0 / (1.0 - p)), torch.zeros_like(y))


def bias_dropout_residual_ref(x, bias, residual, dropout_p=0.0, training=True, mask=None):
    """Pure-PyTorch ``residual + dropout(x + bias)`` in fp32 math (the oracle and the CPU path);
    returns x's dtype. ``mask`` (bool, shaped like x, True = keep) replaces the random draw, so a
    caller can reproduce a given dropout pattern."""
    y = x.float()
    if bias is not None:
        y = y + bias.float()
    y = _dropout_ref(y, dropout_p, training, mask)
    return (residual.float() + y).to(x.dtype)


class BiasDropoutResidualFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, residual, p):
        hidden = x.shape[-1]
        rng = _backend.dropout_rng(p, x.device)
        out = _backend.ext().bias_dropout_residual_fwd(x.reshape(-1, hidden), bias, residual.reshape(-1, hidden),
                                                        p, rng)
        ctx.p, ctx.rng = p, rng
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            want_bias = ctx.needs_input_grad[1]
            grad_x, grad_bias = _backend.ext().bias_dropout_residual_bwd(
                grad.reshape(-1, grad.shape[-1]), ctx.p, ctx.rng, want_bias,
                ctx.bias_dtype if want_bias else None)
            grad_x = grad_x.view(grad.shape)
        return grad_x, grad_bias, grad, None


def _check_p(op, dropout_p):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{op}: dropout_p must be a float in [0, 1], got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) <= 1.0:
        raise ValueError(f"{op}: dropout_p must be in [0, 1], got {dropout_p}")


def _check_bias(op, bias, x):
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{op}: bias must be a Tensor or None, got {type(bias).__name__}")
    if bias.shape != x.shape[-1:]:
        raise ValueError(f"{op}: bias must have shape ({x.shape[-1]},) to match the last dimension of x, "
                         f"got {tuple(bias.shape)}")
    if bias.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{op}: bias must be {x.dtype} (x's dtype) or torch.float32, got {bias.dtype}")
    if bias.device != x.device:
        raise ValueError(f"{op}: bias is on {bias.device} but x is on {x.device}")


def _check_x(op, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension, got shape {tuple(x.shape)}")


def _check_args(x, bias, residual, dropout_p):
    op = "bias_dropout_residual"
    _check_x(op, x)
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{op}: residual must be a Tensor, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"{op}: residual must have x's dtype {x.dtype}, got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    _check_bias(op, bias, x)
    _check_p(op, dropout_p)


def bias_dropout_residual(x, bias, residual, dropout_p=0.0, training=True):
    """``residual + dropout(x + bias)`` for x, residual [..., hidden] and bias [hidden] or None.

    Runs the fused CUDA kernel for CUDA tensors (float32/float16/bfloat16 x; bias in x's dtype or
    float32) and ``bias_dropout_residual_ref`` elsewhere. Dropout applies when ``training`` and
    ``dropout_p > 0``; the output has x's dtype.
    """
    _check_args(x, bias, residual, dropout_p)
    p = float(dropout_p) if training else 0.0
    if x.dtype in _KERNEL_DTYPES and _backend.use_kernels(x, bias, residual):
        return BiasDropoutResidualFunction.apply(x, bias, residual, p)
    return bias_dropout_residual_ref(x, bias, residual, p, bool(training))
