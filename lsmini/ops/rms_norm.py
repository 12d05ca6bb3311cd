"""RMSNorm over the last dimension, and its residual-add form: the public ops, their references and their
registered operators.

    y = x · rstd · weight,   rstd = 1 / sqrt(mean(x², last dim) + eps)
    add_rms_norm:  s = x + residual,  y = RMSNorm(s)   →  (s, y)

The residual-add form is the "add & norm" of a pre-norm block (Llama and its kin): s is the new residual
stream, y the next sub-block's input. Its backward takes the gradients of both outputs: x and residual both
get ds + (RMSNorm's input gradient at s).

Shapes: x, residual [..., hidden]; weight [hidden] or None (no scaling); y, s like x. The same semantics as
``torch.nn.functional.rms_norm(x, (hidden,), weight, eps)``. Dtypes: x float32, float16 or bfloat16 (on
CUDA, the kernel); weight in x's dtype or float32 (mixed precision's float32 parameters on 16-bit
activations), as ``layer_norm`` takes them; residual in x's dtype. y and s have x's dtype; the statistics
and the whole row's math are fp32, and s is rounded to x's dtype before it is normalized (y normalizes
exactly the s that is returned). float64 inputs run the reference, in float64.

The backward keeps only the normalized input (x, or s of the residual form), the weight and the per-row
rstd (float32): dx = rstd·(g − x̂·mean(g·x̂)) with x̂ = x·rstd, g = weight·dy; dweight = Σ_rows dy·x̂
(fp32 column sums, returned in weight's dtype).

- ``rms_norm(x, weight, eps)`` / ``add_rms_norm(x, residual, weight, eps)``: the ops: argument checks, then
  ``torch.ops.lsmini.rms_norm`` / ``torch.ops.lsmini.add_rms_norm``.
- ``rms_norm_ref`` / ``add_rms_norm_ref``: pure PyTorch in fp32 math, the oracles and the operators' CPU
  implementations.
- ``lsmini::rms_norm``, ``lsmini::add_rms_norm`` and their one backward ``lsmini::rms_norm_backward``: the
  ops registered once (see ``lsmini.ops.library``): the kernels on CUDA, the references and their
  gradients by autograd on CPU, fake implementations for tracing, autograd saving the normalized input,
  the weight and rstd.
"""
import math
import numbers

import torch
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_last_dim_vector, check_param_dtype, check_same_device, check_tensor, check_x
from lsmini.ops.library import operator, optional_outputs
from lsmini.ops.reference_grads import reference_grads


def _math_dtype(dtype):
    """The dtype the references compute in: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm_ref(x, weight=None, eps=1e-6):
    """Pure-PyTorch RMSNorm over the last dim in fp32 math (the oracle and the CPU path); returns x's dtype."""
    xf = x.to(_math_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(x.dtype)


def add_rms_norm_ref(x, residual, weight=None, eps=1e-6):
    """Pure-PyTorch ``s = x + residual`` (one rounding to x's dtype) and ``y = rms_norm_ref(s)``: (s, y)."""
    dt = _math_dtype(x.dtype)
    s = (x.to(dt) + residual.to(dt)).to(x.dtype)
    return s, rms_norm_ref(s, weight, eps)


def _rstd(x, eps):
    """The per-row rstd the kernels save: float32 [rows]."""
    return torch.rsqrt(x.float().pow(2).mean(dim=-1) + eps)


# ---- the registered operators ---------------------------------------------------------------------------
@operator("lsmini::rms_norm")
def _rms_norm_op(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm of x [rows, hidden] → (y like x, contiguous; rstd float32 [rows]). This function is the CUDA
    implementation (the kernel), ``_rms_norm_cpu`` the CPU one."""
    _, y, rstd = _backend.ext().rms_norm_fwd(x, weight, eps)
    return y, rstd


@_rms_norm_op.register_kernel("cpu")
def _rms_norm_cpu(x, weight, eps):
    """y by ``rms_norm_ref``; rstd as the kernel's (the CPU backward does not read it)."""
    return rms_norm_ref(x, weight, eps).contiguous(), _rstd(x, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty((x.shape[0],), dtype=torch.float32)


@operator("lsmini::add_rms_norm")
def _add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """s = x + residual and RMSNorm of s, for x, residual [rows, hidden] → (s, y like x, contiguous; rstd
    float32 [rows]). This function is the CUDA implementation (the kernel)."""
    s, y, rstd = _backend.ext().rms_norm_fwd(x, weight, eps, residual)
    return s, y, rstd


@_add_rms_norm_op.register_kernel("cpu")
def _add_rms_norm_cpu(x, residual, weight, eps):
    s, y = add_rms_norm_ref(x, residual, weight, eps)
    return s.contiguous(), y.contiguous(), _rstd(s, eps)


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty((x.shape[0],), dtype=torch.float32)


@operator("lsmini::rms_norm_backward", differentiable=False)
def _rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, add: Tensor | None,
                          eps: float) -> list[Tensor]:
    """[dx, dweight (when weight is given)] of RMSNorm at x (the normalized input: x, or s of the residual
    form), plus add (the gradient s gets from its other uses) in dx when given: dx like x, contiguous;
    dweight [hidden] in weight's dtype. The kernel (this function) reads rstd, which holds eps; the CPU
    implementation differentiates ``rms_norm_ref`` at x with eps."""
    dx, dweight = _backend.ext().rms_norm_bwd(dy, x, weight, rstd, add)
    return [dx] if dweight is None else [dx, dweight]


@_rms_norm_backward_op.register_kernel("cpu")
def _rms_norm_backward_cpu(dy, x, weight, rstd, add, eps):
    # fp32 input gradient, plus add, rounded once to x's dtype: as the kernel does
    dx, dweight = reference_grads(lambda x, w: rms_norm_ref(x, w, eps), [x.float(), weight], dy.float())
    if add is not None:
        dx = dx + add.float()
    dx = dx.to(x.dtype).contiguous()
    return [dx] if dweight is None else [dx, dweight]


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, add, eps):
    return [x.new_empty(x.shape)] + ([] if weight is None else [weight.new_empty(weight.shape)])


def _rms_norm_setup_context(ctx, inputs, output):
    x, weight, eps = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.eps = eps


def _rms_norm_backward(ctx, dy, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    grads = torch.ops.lsmini.rms_norm_backward.default(dy, x, weight, rstd, None, ctx.eps)
    dx, dweight = optional_outputs(grads, True, weight is not None)
    return dx, dweight, None


_rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup_context)


def _add_rms_norm_setup_context(ctx, inputs, output):
    _, _, weight, eps = inputs
    s, _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(s, weight, rstd)  # s, not x and residual: one tensor instead of two
    ctx.eps = eps


def _add_rms_norm_backward(ctx, ds, dy, _grad_rstd):
    s, weight, rstd = ctx.saved_tensors
    grads = torch.ops.lsmini.rms_norm_backward.default(dy, s, weight, rstd, ds, ctx.eps)
    dx, dweight = optional_outputs(grads, True, weight is not None)
    return dx, dx, dweight, None  # s = x + residual: both get the gradient of s


_add_rms_norm_op.register_autograd(_add_rms_norm_backward, setup_context=_add_rms_norm_setup_context)


# ---- the public ops -------------------------------------------------------------------------------------
def _check_eps(op, eps):
    """eps: a finite real number > 0 (a bool is not one)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{op}: eps must be a float > 0 or None, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{op}: eps must be a finite float > 0, got {eps!r}")


def _check_args(op, x, weight, eps):
    check_x(op, x)
    check_tensor(op, "weight", weight, or_none=True)
    if weight is not None:
        check_last_dim_vector(op, "weight", weight, x)
        check_param_dtype(op, "weight", weight, x)
        check_same_device(op, "weight", weight, "x", x.device)
    if eps is not None:
        _check_eps(op, eps)


def _eps_value(x, eps):
    """eps as a float; None is torch.finfo(x.dtype).eps, as torch.nn.functional.rms_norm takes it."""
    return torch.finfo(x.dtype).eps if eps is None else float(eps)


def _use_reference(x):
    """The inputs the operators do not take, and the forced reference, run the reference directly."""
    return (_backend.force_reference() or x.dtype not in limits.KERNEL_DTYPES
            or x.shape[-1] > limits.RMS_NORM_MAX_HIDDEN or not _backend.has_op_impl(x.device))


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dim of x [..., hidden] with an optional weight [hidden]:
    ``y = x / sqrt(mean(x², -1) + eps) · weight``, like ``torch.nn.functional.rms_norm(x, (hidden,), weight,
    eps)``; eps=None is ``torch.finfo(x.dtype).eps``, as there.

    Calls ``torch.ops.lsmini.rms_norm`` for float32/float16/bfloat16 x with hidden ≤
    ``lsmini.limits.RMS_NORM_MAX_HIDDEN``: the fused CUDA kernel for CUDA tensors, ``rms_norm_ref`` for CPU
    tensors. Other dtypes (float64), longer rows and the forced reference run ``rms_norm_ref`` directly.
    weight must be float32 or x's dtype (TypeError otherwise); y has x's dtype.
    """
    op = "rms_norm"
    _check_args(op, x, weight, eps)
    eps = _eps_value(x, eps)
    if _use_reference(x):
        return rms_norm_ref(x, weight, eps)
    y, _ = torch.ops.lsmini.rms_norm.default(x.reshape(-1, x.shape[-1]).contiguous(), weight, eps)
    return y.view(x.shape)


def add_rms_norm(x, residual, weight=None, eps=1e-6):
    """The residual add and RMSNorm of a pre-norm block in one pass: ``s = x + residual`` and ``y =
    rms_norm(s, weight, eps)``, returned as ``(s, y)``; x and residual [..., hidden] of one shape, dtype and
    device, weight [hidden] or None. Gradients flow into x and residual from both s and y.

    s is computed in fp32 and rounded once to x's dtype; y normalizes that rounded s. The same operators,
    dtypes and fallbacks as ``rms_norm``.
    """
    op = "add_rms_norm"
    _check_args(op, x, weight, eps)
    check_tensor(op, "residual", residual)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"{op}: residual must have x's dtype {x.dtype}, got {residual.dtype}")
    check_same_device(op, "residual", residual, "x", x.device)
    eps = _eps_value(x, eps)
    if _use_reference(x):
        return add_rms_norm_ref(x, residual, weight, eps)
    hidden = x.shape[-1]
    s, y, _ = torch.ops.lsmini.add_rms_norm.default(x.reshape(-1, hidden).contiguous(),
                                                     residual.reshape(-1, hidden).contiguous(), weight, eps)
    return s.view(x.shape), y.view(x.shape)
