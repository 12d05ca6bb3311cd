"""Fused bias + activation + dropout, the step after the first FFN GEMM of a Transformer layer.

    out = dropout(act(x + bias)),   act ∈ {"relu", "gelu" (exact, erf), "gelu_tanh"}

Shapes: x [..., hidden]; bias [hidden] in x's dtype or float32, or None; out like x. The CUDA kernel
handles float32/float16/bfloat16 with fp32 math and one rounding.

Dropout (training and p > 0): element e of x, with flat index i = row * hidden + col of x viewed as
[rows, hidden], is kept iff its Philox word (keyed by the call's Philox state ``rng`` drawn from torch's
CUDA generator, see ``_backend.philox_seed_offset``, so ``torch.manual_seed`` reproduces it) passes the
threshold; kept values are scaled by 1 / (1 - p). The backward regenerates the mask from ``rng``. The
kernels read ``rng`` at run time, so the op can be captured in a CUDA graph and every replay draws a
fresh mask.

Backward: grad_x = act'(x + bias) · dropout backward of grad_out, recomputed from the saved input x
(and bias), not from a saved activation; grad_bias = grad_x summed over all rows (fp32 accumulation,
returned in bias's dtype).
"""
import torch
import torch.nn.functional as F

from lsmini import _backend
from lsmini.ops.bias_dropout_residual import _check_bias, _check_p, _check_x, _dropout_ref

ACTIVATIONS = ("relu", "gelu", "gelu_tanh")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    y = _dropout_ref(_act_ref(y, activation), dropout_p, training, mask)
    return y.to(x.dtype)


class BiasActDropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, activation, p):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        rng = _backend.dropout_rng(p, x.device)
        out = _backend.ext().bias_act_dropout_fwd(x2d, bias, activation, p, rng)
        ctx.save_for_backward(x2d, bias)
        ctx.activation, ctx.p, ctx.rng = activation, p, rng
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x2d, bias = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # bias goes in even when frozen: act' needs x + bias.
            grad_x, grad_bias = _backend.ext().bias_act_dropout_bwd(grad.reshape(x2d.shape), x2d, bias,
                                                                     ctx.activation, ctx.p, ctx.rng)
            grad_x = grad_x.view(grad.shape)
            if not ctx.needs_input_grad[1]:
                grad_bias = None
        return grad_x, grad_bias, None, None


def _check_args(x, bias, activation, dropout_p):
    op = "bias_act_dropout"
    _check_x(op, x)
    _check_bias(op, bias, x)
    allowed = ", ".join(repr(a) for a in ACTIVATIONS)
    if not isinstance(activation, str):
        raise TypeError(f"{op}: activation must be one of {allowed} (a str), got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: unknown activation {activation!r}, expected one of {allowed}")
    _check_p(op, dropout_p)


def bias_act_dropout(x, bias, activation="relu", dropout_p=0.0, training=True):
    """``dropout(act(x + bias))`` for x [..., hidden] and bias [hidden] or None.

    activation: "relu", "gelu" (exact, erf-based) or "gelu_tanh" (tanh approximation). Runs the fused
    CUDA kernel for CUDA tensors (float32/float16/bfloat16 x; bias in x's dtype or float32) and
    ``bias_act_dropout_ref`` elsewhere. Dropout applies when ``training`` and ``dropout_p > 0``; the
    output has x's dtype.
    """
    _check_args(x, bias, activation, dropout_p)
    p = float(dropout_p) if training else 0.0
    if x.dtype in _KERNEL_DTYPES and _backend.use_kernels(x, bias):
        return BiasActDropoutFunction.apply(x, bias, activation, p)
    return bias_act_dropout_ref(x, bias, activation, p, bool(training))
