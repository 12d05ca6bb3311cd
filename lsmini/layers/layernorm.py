import numbers

import torch
from torch import nn

from lsmini.ops.layernorm import layer_norm
from lsmini.ops.rms_norm import rms_norm


def _checked_eps(eps):
    """eps as the module holds it (also after a change by hand); ValueError unless a real number >= 0 (a
    negative one would take the square root of a negative variance: NaN)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"LayerNorm: eps must be a number >= 0, got {eps!r}")
    return eps


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dimension, on lsmini's fused kernel.

    Same constructor, parameter names (``weight``, ``bias``) and state_dict as torch's module.
    Input [..., hidden] → output of the same shape and dtype. Only the last dimension can be
    normalized (the fused kernel works on rows).
    """

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        normalized_shape = tuple(normalized_shape)
        if len(normalized_shape) != 1:
            raise ValueError(f"LayerNorm: lsmini normalizes the last dimension only; normalized_shape must "
                             f"have one entry, got {normalized_shape}")
        if normalized_shape[0] <= 0:
            raise ValueError(f"LayerNorm: normalized_shape must be positive, got {normalized_shape}")
        self.normalized_shape = normalized_shape
        self.eps = _checked_eps(eps)
        self.elementwise_affine = elementwise_affine
        kw = {"device": device, "dtype": dtype}
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(normalized_shape, **kw))
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(normalized_shape, **kw))
        else:
            self.register_parameter("bias", None)

    def forward(self, x):
        if x.shape[-1:] != self.normalized_shape:
            raise ValueError(f"LayerNorm: expected input with last dimension {self.normalized_shape[0]}, "
                             f"got shape {tuple(x.shape)}")
        return layer_norm(x, self.weight, self.bias, _checked_eps(self.eps))

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(nn.Module):
    """Drop-in for ``torch.nn.RMSNorm`` over the last dimension, on lsmini's fused kernel:
    ``y = x · rsqrt(mean(x², -1) + eps) · weight``.

    Same constructor, parameter name (``weight``; None with elementwise_affine=False) and state_dict as
    torch's module; eps=None is ``torch.finfo(x.dtype).eps``, as there. Only the last dimension can be
    normalized.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (int(normalized_shape),)
        normalized_shape = tuple(normalized_shape)
        if len(normalized_shape) != 1:
            raise ValueError(f"RMSNorm: lsmini normalizes the last dimension only; normalized_shape must have one "
                             f"entry, got {normalized_shape}")
        if normalized_shape[0] <= 0:
            raise ValueError(f"RMSNorm: normalized_shape must be positive, got {normalized_shape}")
        self.normalized_shape = normalized_shape
        self.eps = None if eps is None else _checked_rms_eps(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self):
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x):
        if x.shape[-1:] != self.normalized_shape:
            raise ValueError(f"RMSNorm: expected input with last dimension {self.normalized_shape[0]}, got shape "
                             f"{tuple(x.shape)}")
        return rms_norm(x, self.weight, None if self.eps is None else _checked_rms_eps(self.eps))

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


def _checked_rms_eps(eps):
    """RMSNorm's eps: a real number > 0 (the op's rule; None means torch.finfo(x.dtype).eps)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
        raise ValueError(f"RMSNorm: eps must be a number > 0 or None, got {eps!r}")
    return eps
