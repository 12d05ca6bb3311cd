"""The dtype a layer computes in, and the per-call casts of its parameters to it.

Under ``torch.autocast`` with float32 parameters a layer computes in the autocast dtype: the GEMM weights
are cast per call, biases and LayerNorm parameters stay float32 (the kernels read float32 or the
activations' dtype). With low-precision parameters the layer computes in theirs; without autocast the
input must match them. On the kernel path the operator casts (csrc/layers/layer.cpp); the reference layer
and a decoder stack's K/V GEMM take their casts from ``cast_block``.
"""
import contextlib

import torch

from lsmini.layers.spec import GEMM_WEIGHTS


def compute_dtype(owner, x, weight):
    """The dtype the layer computes in (see the module docstring); TypeError when x and the parameters
    disagree outside autocast."""
    dev = x.device.type
    autocast = dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev)
    if autocast and weight.dtype == torch.float32:
        return torch.get_autocast_dtype(dev)
    if autocast:
        return weight.dtype
    if x.dtype != weight.dtype:
        raise TypeError(f"{owner}: input dtype {x.dtype} does not match the parameters' dtype {weight.dtype}; "
                        f"convert one of them, or run under torch.autocast")
    return weight.dtype


def no_autocast(device_type):
    """The layers cast explicitly; autocast must not cast again inside them. (Nothing to turn off outside
    autocast: the context manager costs more host time than some kernels take.)"""
    if device_type in ("cuda", "cpu") and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _needs_cast(position, p, dtype):
    return p is not None and p.dtype != dtype and (position in GEMM_WEIGHTS or p.dtype != torch.float32)


def cast_block(block, dtype):
    """A block's parameters (spec.BLOCK_PARAMS order, or a prefix of it) with the GEMM weights in dtype;
    vectors cast only when they are neither float32 nor dtype (the kernels take float32 or the
    activations' dtype)."""
    return [p.to(dtype) if _needs_cast(i, p, dtype) else p for i, p in enumerate(block)]
