"""LayerNorm over the last dimension.

    y = (x − mean) · rstd · weight + bias,   rstd = 1 / sqrt(var + eps)   (biased variance)

Shapes: x [..., hidden]; weight, bias [hidden] or None; y like x. The kernel computes in fp32 for
fp32/fp16/bf16 inputs, with weight/bias in fp32 or in x's dtype, and saves per-row mean and rstd
(fp32) for backward.
"""
import torch

from lsmini import _backend


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


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        y, mean, rstd = _backend.ext().layernorm_fwd(x2d, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backend.ext().layernorm_bwd(dy.reshape(x2d.shape), x2d, weight, bias, mean, rstd)
        return dx.view(dy.shape), dw, db, None


def _check_args(x, weight, bias):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"layer_norm: x must be a Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"layer_norm: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"layer_norm: x must be a floating-point tensor, got {x.dtype}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.shape != x.shape[-1:]:
            raise ValueError(f"layer_norm: {name} must have shape ({x.shape[-1]},) to match the last "
                             f"dimension of x, got {tuple(p.shape)}")
        if p.device != x.device:
            raise ValueError(f"layer_norm: {name} is on {p.device} but x is on {x.device}")


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the last dim of x [..., hidden] with optional weight/bias [hidden].

    Runs the fused CUDA kernel for CUDA tensors (float32/float16/bfloat16 x; weight/bias float32 or
    x's dtype) and ``layer_norm_ref`` elsewhere.
    """
    _check_args(x, weight, bias)
    if _backend.use_kernels(x, weight, bias):
        return LayerNormFunction.apply(x, weight, bias, float(eps))
    return layer_norm_ref(x, weight, bias, eps)
