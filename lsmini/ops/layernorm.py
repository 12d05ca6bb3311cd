"""LayerNorm over the last dimension: the public op, its reference, its registered operators and the
forward/backward primitives of the fused layers.

    y = (x − mean) · rstd · weight + bias,   rstd = 1 / sqrt(var + eps)   (biased variance)

Shapes: x [..., hidden]; weight, bias [hidden] or None; y like x. The kernel computes in fp32 for
fp32/fp16/bf16 inputs, with weight/bias in fp32 or in x's dtype, and saves per-row mean and rstd
(fp32) for backward.

- ``layer_norm(x, weight, bias, eps)``: the op: argument checks, then ``torch.ops.lsmini.layer_norm``.
- ``layer_norm_ref``: pure PyTorch in fp32 math, the oracle and the operators' CPU implementation.
- ``lsmini::layer_norm`` / ``lsmini::layer_norm_backward``: the op registered once (see
  ``lsmini.ops.library``): the kernels on CUDA, ``layer_norm_ref`` and its gradients by autograd on CPU,
  fake implementations for tracing, autograd saving x, the parameters and the row statistics.
- ``layer_norm_fwd`` / ``layer_norm_bwd``: the primitives a layer's hand-written backward is built on:
  a forward that returns its saved state and a backward that takes it, on the kernels or on the
  reference, with optional output buffers and a fused gradient add (the residual path).
"""
import torch
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_last_dim_vector, check_param_dtype, check_same_device, check_tensor, check_x
from lsmini.ops.library import operator, optional_outputs
from lsmini.ops.reference_grads import reference_grads


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5):
    """Pure-PyTorch LayerNorm in fp32 math (the oracle and the CPU path); returns x's dtype."""
    xf = x.float()
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def layer_norm_fwd(x2d, weight, bias, eps, kernels, out=None):
    """LayerNorm of x2d [rows, hidden] → (y, saved) for ``layer_norm_bwd``.

    kernels: run the CUDA kernel (else ``layer_norm_ref``). out: where to write y (else a fresh tensor).
    saved: {"x": x2d} plus, from the kernel, the per-row fp32 "mean" and "rstd".
    """
    if kernels:
        y, mean, rstd = _backend.ext().layernorm_fwd(x2d, weight, bias, eps, out)
        return y, {"x": x2d, "mean": mean, "rstd": rstd}
    y = layer_norm_ref(x2d, weight, bias, eps)
    return y if out is None else out.copy_(y), {"x": x2d}


def layer_norm_bwd(grad_y, weight, bias, eps, saved, kernels, add=None, out=None):
    """(grad_x, grad_weight, grad_bias) of LayerNorm from the gradient of its output and the forward's saved
    state; the parameter gradients are fresh tensors.

    add: a gradient shaped like x that is added to grad_x in the same pass (the residual path of a
    pre-LN block). out: where to write grad_x (else a fresh tensor); it may be add itself (in place).
    """
    if kernels:
        grad_x, grad_weight, grad_bias = _backend.ext().layernorm_bwd(grad_y, saved["x"], weight, bias, saved["mean"],
                                                                       saved["rstd"], add, out)
        return grad_x, grad_weight, grad_bias
    grad_x, grad_weight, grad_bias = reference_grads(lambda x, w, b: layer_norm_ref(x, w, b, eps),
                                                     [saved["x"], weight, bias], grad_y)
    if add is not None:
        grad_x = grad_x + add
    return grad_x if out is None else out.copy_(grad_x), grad_weight, grad_bias


@operator("lsmini::layer_norm")
def _layer_norm_op(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm of x [rows, hidden] → (y like x, contiguous; mean, rstd: float32 [rows]). This function
    is the CUDA implementation (the kernel), ``_layer_norm_cpu`` the CPU one."""
    y, mean, rstd = _backend.ext().layernorm_fwd(x, weight, bias, eps)
    return y, mean, rstd


@_layer_norm_op.register_kernel("cpu")
def _layer_norm_cpu(x, weight, bias, eps):
    """y by ``layer_norm_ref``; mean and rstd as the kernel's (the CPU backward does not read them)."""
    xf = x.float()
    mean = xf.mean(dim=-1)
    rstd = torch.rsqrt(xf.var(dim=-1, unbiased=False) + eps)
    return layer_norm_ref(x, weight, bias, eps).contiguous(), mean, rstd


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    rows = x.shape[0]
    return x.new_empty(x.shape), x.new_empty((rows,), dtype=torch.float32), x.new_empty((rows,), dtype=torch.float32)


@operator("lsmini::layer_norm_backward", differentiable=False)
def _layer_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor,
                            rstd: Tensor, eps: float) -> list[Tensor]:
    """[dx, dweight (when weight is given), dbias (when bias is given)]: dx like x, contiguous; the
    parameter gradients [hidden] in the parameters' dtype. The kernel (this function) reads mean and rstd,
    which hold eps; the CPU implementation differentiates ``layer_norm_ref`` at x with eps."""
    dx, dweight, dbias = _backend.ext().layernorm_bwd(dy, x, weight, bias, mean, rstd)
    return [g for g in (dx, dweight, dbias) if g is not None]


@_layer_norm_backward_op.register_kernel("cpu")
def _layer_norm_backward_cpu(dy, x, weight, bias, mean, rstd, eps):
    dx, dweight, dbias = reference_grads(lambda x, w, b: layer_norm_ref(x, w, b, eps), [x, weight, bias], dy)
    return [g for g in (dx.contiguous(), dweight, dbias) if g is not None]


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd, eps):
    return [x.new_empty(x.shape)] + [p.new_empty(p.shape) for p in (weight, bias) if p is not None]


def _layer_norm_setup_context(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.eps = eps


def _layer_norm_backward(ctx, dy, _grad_mean, _grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    grads = torch.ops.lsmini.layer_norm_backward.default(dy, x, weight, bias, mean, rstd, ctx.eps)
    dx, dweight, dbias = optional_outputs(grads, True, weight is not None, bias is not None)
    return dx, dweight, dbias, None


_layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup_context)


def _check_args(x, weight, bias):
    op = "layer_norm"
    check_x(op, x)
    for name, vector in (("weight", weight), ("bias", bias)):
        if vector is not None:
            check_tensor(op, name, vector)
            check_last_dim_vector(op, name, vector, x)
            check_param_dtype(op, name, vector, x)
            check_same_device(op, name, vector, "x", x.device)
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"{op}: weight and bias must have the same dtype, got weight {weight.dtype} and bias "
                        f"{bias.dtype}")


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the last dim of x [..., hidden] with optional weight/bias [hidden].

    Calls ``torch.ops.lsmini.layer_norm`` for float32/float16/bfloat16 x: the fused CUDA kernel for CUDA
    tensors, ``layer_norm_ref`` for CPU tensors. Other dtypes (float64) and the forced reference run
    ``layer_norm_ref`` directly. On every path, weight and bias must be float32 or x's dtype, and the same
    dtype when both are given (TypeError otherwise).
    """
    _check_args(x, weight, bias)
    if _backend.force_reference() or x.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(x.device):
        return layer_norm_ref(x, weight, bias, eps)
    y, _, _ = torch.ops.lsmini.layer_norm.default(x.reshape(-1, x.shape[-1]), weight, bias, float(eps))
    return y.view(x.shape)
