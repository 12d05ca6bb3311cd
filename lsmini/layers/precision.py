"""The dtype a layer computes in, and the per-call casts of its parameters to it.

Under ``torch.autocast`` with float32 parameters a layer computes in the autocast dtype: the GEMM weights
are cast per call, biases and LayerNorm parameters stay float32 (the kernels read float32 or the
activations' dtype). With low-precision parameters the layer computes in theirs; without autocast the
input must match them.
"""
import contextlib

import torch

from lsmini.layers.arena import align
from lsmini.layers.spec import GEMM_WEIGHTS, PARAMS_PER_BLOCK


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


def cast_plan(params, dtype):
    """Where the cast copies of params go in one buffer (cast_blocks_batched's, and the compiled layer's
    state: csrc/layers/layer.cpp, cast_weights): (the positions in params that are cast, each copy's offset
    into the buffer, then the buffer's numel). Each copy starts 128-byte aligned, for the GEMMs."""
    todo = [i for i, p in enumerate(params) if _needs_cast(i % PARAMS_PER_BLOCK, p, dtype)]
    starts = [0]
    for i in todo:
        starts.append(starts[-1] + align(params[i].numel()))
    return todo, starts


def cast_blocks_batched(params, dtype):
    """cast_block over consecutive blocks, for use without autograd (inside an autograd Function's
    forward): on CUDA one multi-tensor copy into one buffer — one launch per layer instead of one per weight."""
    todo, starts = cast_plan(params, dtype)
    out = list(params)
    if len(todo) >= 2 and params[todo[0]].is_cuda:
        buffer = torch.empty(starts[-1], dtype=dtype, device=params[0].device)
        for i, s in zip(todo, starts):
            out[i] = buffer[s:s + params[i].numel()].view(params[i].shape)
        torch._foreach_copy_([out[i] for i in todo], [params[i] for i in todo])
        return out
    for i in todo:
        out[i] = params[i].to(dtype)
    return out
