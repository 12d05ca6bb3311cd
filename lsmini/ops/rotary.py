"""Rotary position embedding (RoPE) of queries and keys: the public op ``rotary``, its reference, its registered
operators, and ``rotary_cos_sin``, the cos/sin tables for given positions.

    q' = q·cos + rot(q)·sin,   k' = k·cos + rot(k)·sin      on the first rot_dim dimensions of every head;
                                                            the other head_dim − rot_dim pass through unchanged
    rot(x) = cat(−x2, x1)   (rotate-half: x1, x2 the two halves of the rotated dimensions), or, with
             interleaved=True, (−x1, x0, −x3, x2, …)   (rotate-every-two: pairs (x0, x1), (x2, x3), …)

The default is Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)`` (unsqueeze_dim=1), argument for argument:
``rotary(q, k, cos, sin)`` takes the cos and sin a Hugging Face rotary embedding module returns and gives the same
(q', k').

Shapes: q [batch, heads, seq, head_dim], k [batch, kv_heads, seq, head_dim] (kv_heads may differ from heads:
grouped K/V); cos and sin of one shape, broadcast over the heads: [seq, rot_dim], [batch or 1, seq, rot_dim] (Hugging
Face's) or [batch or 1, 1, seq, rot_dim] (already unsqueezed). rot_dim (their last dimension) is even and at most
head_dim; rot_dim < head_dim is partial rotary (GPT-NeoX's rotary_pct, Phi's partial_rotary_factor).

Tables: each pair of rotated dimensions turns by one angle, and the tables hold that angle's cos and sin at both of
the pair's dimensions. Rotate-half pairs dimension i with i + rot_dim/2, so cos[..., i] = cos[..., i + rot_dim/2]:
Hugging Face's ``emb = cat(freqs, freqs)``. Interleaved pairs 2i with 2i + 1, so its tables hold each angle twice in
place, cos[..., 2i] = cos[..., 2i + 1] = cos(angle_i) (``freqs.repeat_interleave(2, -1)``; GPT-J's layout, and the
complex form (x_2i + i·x_2i+1)·e^(i·angle_i) of Meta's Llama code). ``rotary_cos_sin(..., interleaved=...)`` makes
either. The op applies the elementwise formula above to whatever tables it gets; its backward is that map's exact
transpose (the inverse rotation, sin → −sin, for such tables).

Dtypes: q and k of one dtype: float32, float16 or bfloat16 (the CUDA kernel), or float64 (the reference, in
float64); cos and sin of one dtype: float32 or q's. Math in fp32, one rounding to q's dtype.

Layout: q and k may have any strides. The kernel reads them through their strides (only a head_dim stride other
than 1 costs a copy), so a [batch, seq, heads, head_dim] tensor — a QKV projection's output viewed per head — is
passed as ``x.transpose(1, 2)`` without a copy, and the outputs keep each input's memory order: [batch, seq, heads,
head_dim] memory for such an input (``out.transpose(1, 2)`` is then contiguous), contiguous [batch, heads, seq,
head_dim] otherwise (``_empty_in_order``; the binding follows the same rule).

Backward: the gradients of q and k by the kernel (the transposed map), from the output gradients and the tables
alone. When cos or sin requires a gradient, theirs come from the formula in plain PyTorch — dcos = Σ_heads g·x and
dsin = Σ_heads g·rot(x) on the rotated dimensions (summed over the batch too for a shared table) — and only then are
q and k saved for it.

Incremental decoding: ``rotary_cos_sin(length, rot_dim, offset=past)`` gives the tables of positions past, …, past +
length − 1, so a token decoded at position p is rotated exactly as row p of the whole sequence would be;
``rotary_cos_sin(position_ids, rot_dim)`` takes explicit positions [batch, seq] (left-padded batches, packed
sequences).

- ``rotary(q, k, cos, sin, *, interleaved)``: the op: argument checks, then ``torch.ops.lsmini.rotary``.
- ``rotary_ref``: pure PyTorch in fp32 math, the oracle and the operator's CPU implementation.
- ``lsmini::rotary`` / ``lsmini::rotary_backward``: registered once (see ``lsmini.ops.library``): the kernel on
  CUDA, the reference and its gradients by autograd on CPU, fake implementations for tracing, autograd saving the
  tables (and q and k only when a table needs a gradient).
"""
import math
import numbers

import torch
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_floating, check_same_device, check_tensor
from lsmini.ops.library import operator
from lsmini.ops.reference_grads import reference_grads


def _math_dtype(*dtypes):
    """The dtype the reference computes in: float32, or float64 when an input is float64."""
    dt = torch.float32
    for d in dtypes:
        dt = torch.promote_types(dt, d)
    return dt


def _rotate(x, interleaved):
    """rot(x) over x's last dimension: cat(−x2, x1) of its halves, or (−x1, x0, −x3, x2, …) when interleaved."""
    if interleaved:
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _tables_4d(t):
    """A table of any accepted shape as [batch or 1, 1, seq, rot_dim], broadcastable against q and k."""
    if t.dim() == 2:
        return t[None, None]
    return t[:, None] if t.dim() == 3 else t


def _tables_3d(t):
    """A table of any accepted shape as [batch or 1, seq, rot_dim], the operators' layout (a view)."""
    if t.dim() == 2:
        return t[None]
    return t[:, 0] if t.dim() == 4 else t


def _rotate_heads(x, cos, sin, interleaved):
    """x·cos + rot(x)·sin on x's first rot_dim dimensions (cos, sin 4-D, in the math dtype), the rest as is."""
    r = cos.shape[-1]
    xf = x.to(cos.dtype)
    out = xf[..., :r] * cos + _rotate(xf[..., :r], interleaved) * sin
    if r < x.shape[-1]:
        out = torch.cat((out, xf[..., r:]), dim=-1)
    return out.to(x.dtype)


def rotary_ref(q, k, cos, sin, interleaved=False):
    """Pure-PyTorch rotary embedding of q and k (the oracle and the CPU path): ``(q·cos + rot(q)·sin, k·cos +
    rot(k)·sin)`` on the first rot_dim dimensions, in fp32 math (float64 when an input is float64); returns q's and
    k's dtypes. Shapes and conventions as ``rotary``."""
    dt = _math_dtype(q.dtype, k.dtype, cos.dtype, sin.dtype)
    cos, sin = _tables_4d(cos).to(dt), _tables_4d(sin).to(dt)
    return _rotate_heads(q, cos, sin, interleaved), _rotate_heads(k, cos, sin, interleaved)


def _empty_in_order(x):
    """A fresh tensor of x's shape [batch, heads, seq, head_dim] in x's memory order: over [batch, seq, heads,
    head_dim] memory when x is stored that way (heads inside seq: stride(1) < stride(2)), else contiguous. The
    binding (csrc/bindings/rotary.cpp) allocates its outputs by the same rule, which the fake implementations
    state."""
    if x.stride(1) < x.stride(2):
        b, h, s, d = x.shape
        return x.new_empty((b, s, h, d)).transpose(1, 2)
    return x.new_empty(x.shape)


def _table_grads(grad_q, grad_k, q, k, cos, interleaved):
    """The gradients of the tables [batch or 1, seq, rot_dim] (the operators' layout): Σ over heads of g·x (cos) and
    of g·rot(x) (sin) on the rotated dimensions, over q and k, and over the batch for a shared table; fp32 math,
    returned in cos's dtype."""
    r = cos.shape[-1]
    dt = _math_dtype(q.dtype, cos.dtype)
    dcos = dsin = 0
    for g, x in ((grad_q, q), (grad_k, k)):
        g, x = g[..., :r].to(dt), x[..., :r].to(dt)
        dcos = dcos + (g * x).sum(dim=1)
        dsin = dsin + (g * _rotate(x, interleaved)).sum(dim=1)
    if cos.shape[0] != dcos.shape[0]:  # one table for the whole batch
        dcos, dsin = dcos.sum(dim=0, keepdim=True), dsin.sum(dim=0, keepdim=True)
    return dcos.to(cos.dtype), dsin.to(cos.dtype)


# ---- the registered operators ---------------------------------------------------------------------------
@operator("lsmini::rotary")
def _rotary_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> tuple[Tensor, Tensor]:
    """(q rotated, k rotated) for q [batch, heads, seq, head_dim], k [batch, kv_heads, seq, head_dim] and cos, sin
    [batch or 1, seq, rot_dim], each output in its input's memory order (``_empty_in_order``). This function is the
    CUDA implementation (the kernel, one launch for both), ``_rotary_cpu`` the CPU one."""
    return _backend.ext().rotary_fwd(q, k, cos, sin, interleaved)


@_rotary_op.register_kernel("cpu")
def _rotary_cpu(q, k, cos, sin, interleaved):
    q_out, k_out = rotary_ref(q, k, cos, sin, interleaved)
    return _empty_in_order(q).copy_(q_out), _empty_in_order(k).copy_(k_out)


@_rotary_op.register_fake
def _(q, k, cos, sin, interleaved):
    return _empty_in_order(q), _empty_in_order(k)


@operator("lsmini::rotary_backward", differentiable=False)
def _rotary_backward_op(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor,
                        interleaved: bool) -> tuple[Tensor, Tensor]:
    """The gradients of q and k from those of the outputs (grad_q, grad_k): the transpose of the forward's map, in
    the gradients' dtype and memory order. The kernel (this function) applies it directly; the CPU implementation
    differentiates ``rotary_ref``, which is linear in q and k, so only their shapes matter."""
    return _backend.ext().rotary_bwd(grad_q, grad_k, cos, sin, interleaved)


@_rotary_backward_op.register_kernel("cpu")
def _rotary_backward_cpu(grad_q, grad_k, cos, sin, interleaved):
    # fp32 gradients rounded once to the gradients' dtype, as the kernel does
    dt = _math_dtype(grad_q.dtype, cos.dtype)
    at = [torch.zeros(g.shape, dtype=dt, device=g.device) for g in (grad_q, grad_k)]
    dq, dk = reference_grads(lambda q, k: rotary_ref(q, k, cos, sin, interleaved), at,
                             (grad_q.to(dt), grad_k.to(dt)))
    return _empty_in_order(grad_q).copy_(dq), _empty_in_order(grad_k).copy_(dk)


@_rotary_backward_op.register_fake
def _(grad_q, grad_k, cos, sin, interleaved):
    return _empty_in_order(grad_q), _empty_in_order(grad_k)


def _rotary_setup_context(ctx, inputs, output):
    q, k, cos, sin, interleaved = inputs
    tables_need_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
    # q and k only for the tables' gradients: those of q and k need the tables alone
    ctx.save_for_backward(cos, sin, q if tables_need_grad else None, k if tables_need_grad else None)
    ctx.interleaved = interleaved


def _rotary_backward(ctx, grad_q, grad_k):
    cos, sin, q, k = ctx.saved_tensors
    dq, dk = torch.ops.lsmini.rotary_backward.default(grad_q, grad_k, cos, sin, ctx.interleaved)
    dcos = dsin = None
    if q is not None:
        dcos, dsin = _table_grads(grad_q, grad_k, q, k, cos, ctx.interleaved)
        dcos = dcos if ctx.needs_input_grad[2] else None
        dsin = dsin if ctx.needs_input_grad[3] else None
    return dq, dk, dcos, dsin, None


_rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


# ---- the public op --------------------------------------------------------------------------------------
def _check_args(op, q, k, cos, sin, interleaved):
    for name, x in (("q", q), ("k", k)):
        check_tensor(op, name, x)
        check_floating(op, name, x)
    if q.dim() != 4:
        raise ValueError(f"{op}: q must be 4-D [batch, heads, seq, head_dim], got shape {tuple(q.shape)}")
    batch, _, seq, head_dim = q.shape
    if k.dim() != 4 or k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != head_dim:
        raise ValueError(f"{op}: k must be 4-D [batch, kv_heads, seq, head_dim] with q's batch = {batch}, seq = {seq} "
                         f"and head_dim = {head_dim}, got shape {tuple(k.shape)}")
    if k.dtype != q.dtype:
        raise TypeError(f"{op}: k must have q's dtype {q.dtype}, got {k.dtype}")
    check_same_device(op, "k", k, "q", q.device)
    check_tensor(op, "cos", cos)
    check_tensor(op, "sin", sin)
    shape = tuple(cos.shape)
    lead = {2: (), 3: shape[:1], 4: shape[:2]}.get(len(shape))
    if lead is None or shape[-2] != seq or (lead and lead[0] not in (1, batch)) or lead[1:] not in ((), (1,)):
        raise ValueError(f"{op}: cos must have shape [seq, rot_dim], [batch or 1, seq, rot_dim] or [batch or 1, 1, "
                         f"seq, rot_dim] with q's batch = {batch} and seq = {seq}, got {shape}")
    if sin.shape != cos.shape:
        raise ValueError(f"{op}: sin must have cos's shape {shape}, got {tuple(sin.shape)}")
    rot_dim = shape[-1]
    if rot_dim % 2:
        raise ValueError(f"{op}: rot_dim (the last dimension of cos and sin) must be even, got {rot_dim}")
    if not 2 <= rot_dim <= head_dim:
        raise ValueError(f"{op}: rot_dim (the last dimension of cos and sin) must be in [2, head_dim = {head_dim}], "
                         f"got {rot_dim}")
    if cos.dtype not in (q.dtype, torch.float32):
        allowed = f"{q.dtype} (q's dtype)" + ("" if q.dtype == torch.float32 else " or torch.float32")
        raise TypeError(f"{op}: cos must be {allowed}, got {cos.dtype}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"{op}: sin must have cos's dtype {cos.dtype}, got {sin.dtype}")
    check_same_device(op, "cos", cos, "q", q.device)
    check_same_device(op, "sin", sin, "q", q.device)
    if not isinstance(interleaved, bool):
        raise TypeError(f"{op}: interleaved must be a bool, got {type(interleaved).__name__}")


def _use_reference(q):
    """The inputs the operators do not take (float64), and the forced reference, run the reference directly."""
    return _backend.force_reference() or q.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(q.device)


def rotary(q, k, cos, sin, *, interleaved=False):
    """Rotary position embedding of queries and keys: ``(q·cos + rot(q)·sin, k·cos + rot(k)·sin)`` on the first
    rot_dim dimensions of every head, the rest unchanged — Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin)``.

    Args:
        q: [batch, heads, seq, head_dim]. A [batch, seq, heads, head_dim] tensor is passed as ``x.transpose(1, 2)``
            (no copy; the output is then stored the same way).
        k: [batch, kv_heads, seq, head_dim], q's dtype and device; kv_heads may differ from heads.
        cos, sin: [seq, rot_dim], [batch or 1, seq, rot_dim] or [batch or 1, 1, seq, rot_dim], broadcast over the
            heads; float32 or q's dtype. rot_dim is even and ≤ head_dim. Rotate-half tables hold each angle at i and
            i + rot_dim/2 (Hugging Face's cat(freqs, freqs)); interleaved ones at 2i and 2i + 1. ``rotary_cos_sin``
            makes either.
        interleaved: rot pairs (x0, x1), (x2, x3), … (GPT-J) instead of the two halves (Hugging Face, GPT-NeoX).

    Returns:
        (q', k') in q's and k's shapes and dtype, each in its input's memory order.

    Calls ``torch.ops.lsmini.rotary`` for float32/float16/bfloat16 q: one fused CUDA kernel for both tensors,
    ``rotary_ref`` for CPU tensors; float64 and the forced reference run ``rotary_ref`` directly. q and k get their
    gradients from the kernel; cos and sin, when they require one, from the formula in plain PyTorch.
    """
    op = "rotary"
    _check_args(op, q, k, cos, sin, interleaved)
    if _use_reference(q):
        return rotary_ref(q, k, cos, sin, interleaved)
    return torch.ops.lsmini.rotary.default(q, k, _tables_3d(cos), _tables_3d(sin), interleaved)


def rotary_cos_sin(positions, rot_dim, theta=10000.0, *, offset=0, interleaved=False, device=None,
                   dtype=torch.float32):
    """The cos and sin tables ``rotary`` takes, for the given positions: angle(p, i) = p · theta^(−2i/rot_dim) for
    the rot_dim/2 frequencies i (Hugging Face's default rotary embedding), each angle at dimensions i and i +
    rot_dim/2 (``cat(freqs, freqs)``), or with interleaved at 2i and 2i + 1.

    Args:
        positions: an int L: positions offset, …, offset + L − 1 → cos, sin [L, rot_dim], one table for the whole
            batch; or an integer tensor of position ids [batch, seq] (or [seq]) → [batch, seq, rot_dim] ([seq,
            rot_dim]), offset added to them.
        rot_dim: the number of rotated dimensions, even and ≥ 2 (head_dim for full rotary).
        theta: the frequency base (Llama 2: 10000, Llama 3: 500000).
        offset: added to every position: the number of tokens already decoded, so that a step's tables are rows
            offset… of the whole sequence's.
        interleaved: the tables for ``rotary(..., interleaved=True)``.
        device: where the tables live (default: positions' device for a tensor, else the CPU).
        dtype: of cos and sin: float32 (default) or q's dtype.

    The angles are computed in float64 and cos and sin rounded once to dtype, so a position's row is the same
    whichever call and however many other positions produce it.
    """
    op = "rotary_cos_sin"
    if isinstance(rot_dim, bool) or not isinstance(rot_dim, numbers.Integral) or rot_dim < 2 or rot_dim % 2:
        raise ValueError(f"{op}: rot_dim must be an even int ≥ 2, got {rot_dim!r}")
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not (math.isfinite(theta) and theta > 0):
        raise ValueError(f"{op}: theta must be a finite float > 0, got {theta!r}")
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"{op}: offset must be an int, got {type(offset).__name__}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{op}: dtype must be a floating-point torch.dtype, got {dtype!r}")
    if isinstance(positions, torch.Tensor):
        if positions.dtype.is_floating_point or positions.dtype.is_complex or positions.dtype == torch.bool:
            raise TypeError(f"{op}: positions must be an int or an integer tensor of position ids, got a tensor of "
                            f"{positions.dtype}")
        if positions.dim() not in (1, 2):
            raise ValueError(f"{op}: position ids must be [batch, seq] or [seq], got shape {tuple(positions.shape)}")
        device = positions.device if device is None else torch.device(device)
        pos = positions.to(device=device, dtype=torch.float64) + offset
    elif isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
        if positions < 0:
            raise ValueError(f"{op}: the number of positions must be ≥ 0, got {positions}")
        device = torch.device("cpu") if device is None else torch.device(device)
        pos = torch.arange(offset, offset + positions, dtype=torch.float64, device=device)
    else:
        raise TypeError(f"{op}: positions must be an int or an integer tensor of position ids, got "
                        f"{type(positions).__name__}")
    inv_freq = theta ** -(torch.arange(0, rot_dim, 2, dtype=torch.float64, device=device) / rot_dim)
    angles = pos[..., None] * inv_freq  # [..., rot_dim / 2]
    angles = angles.repeat_interleave(2, dim=-1) if interleaved else torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)
