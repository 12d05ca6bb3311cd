"""Head transforms on both sides of attention: the public ops ``split_heads`` and ``merge_heads``, their
references and their autograd Functions.

split_heads — bias add + split of a fused projection into per-head tensors:

    x     [batch, len, parts·hidden]   columns part-major, then head, then head_dim:
                                        c = p·hidden + h·head_dim + d,  hidden = num_heads·head_dim
    bias  [parts·hidden] or None
    out[p][b, h, l, d] = x[b, l, c] + bias[c]        (fp32 add, rounded once to x's dtype)

It returns a tuple of ``parts`` tensors, each [batch, num_heads, len, head_dim] and contiguous, all views
of ONE [parts, batch, num_heads, len, head_dim] buffer (QKV: parts = 3; the cross-attention K/V of a
whole decoder stack: parts = 2·layers). Backward writes grad_x in one pass and grad_bias as fp32
column sums over batch·len, in bias's dtype. Because the parts are views of one buffer made inside an
autograd Function, modifying one in place while autograd records is an error: clone it first.

merge_heads — the inverse layout for the attention output:

    x [batch, num_heads, len, head_dim]  →  out [batch, len, num_heads·head_dim],
    out[b, l, h·head_dim + d] = x[b, h, l, d].

The CUDA kernels take float32/float16/bfloat16 (bias float32 or x's dtype); without a bias both ops
move the data bit-exactly.

While torch.compile traces them, the ops run the kernels through the custom operators
``lsmini::split_heads`` / ``lsmini::split_heads_backward`` and ``lsmini::merge_heads`` /
``lsmini::merge_heads_backward`` instead of the autograd Functions.
"""
import torch
from torch import Tensor

from lsmini import _backend
from lsmini.ops.checks import check_floating, check_last_dim_vector, check_same_device, check_tensor
from lsmini.ops.library import optional_outputs


# ----------------------------------------------------------------------------------------------------
# References (the oracle and the CPU path)
# ----------------------------------------------------------------------------------------------------
def split_heads_ref(x, bias, num_heads, parts=3):
    """Pure-PyTorch split_heads (bias add in fp32 math, x's dtype out): a tuple of ``parts`` views of one
    contiguous [parts, batch, num_heads, len, head_dim] tensor."""
    batch, length, width = x.shape
    head_dim = width // (parts * num_heads)
    y = x if bias is None else (x.float() + bias.float()).to(x.dtype)
    y = y.view(batch, length, parts, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    # clone, not contiguous(): with parts = num_heads = 1 the permute is already contiguous and the
    # result would alias x, unlike the kernel's fresh buffer.
    return y.clone(memory_format=torch.contiguous_format).unbind(0)


def merge_heads_ref(x):
    """Pure-PyTorch merge_heads: [batch, num_heads, len, head_dim] → a new [batch, len, num_heads·head_dim]."""
    batch, num_heads, length, head_dim = x.shape
    y = x.transpose(1, 2).clone(memory_format=torch.contiguous_format)
    return y.view(batch, length, num_heads * head_dim)


# ----------------------------------------------------------------------------------------------------
# Autograd Functions over the CUDA kernels
# ----------------------------------------------------------------------------------------------------
def _as_one_buffer(grads):
    """The [parts, ...] tensor that the gradients are consecutive slices of, or None.

    True when every grad is contiguous, of one shape/dtype/device and storage, and grad i starts
    exactly i·numel elements after grad 0 — e.g. the unbind views of one buffer — so reading them
    as one tensor reads exactly their elements and nothing else; no copy is needed."""
    g0 = grads[0]
    if any(g is None for g in grads) or g0.numel() == 0 or not g0.is_contiguous():
        return None
    n, step = g0.numel(), g0.numel() * g0.element_size()
    storage = g0.untyped_storage().data_ptr()
    for i, g in enumerate(grads):
        if (g.shape != g0.shape or g.dtype != g0.dtype or g.device != g0.device or not g.is_contiguous()
                or g.untyped_storage().data_ptr() != storage or g.data_ptr() != g0.data_ptr() + i * step):
            return None
    return g0.as_strided((len(grads),) + tuple(g0.shape), (n,) + tuple(g0.stride()), g0.storage_offset())


def _stack_grads(grads, shape, dtype, device):
    """grads of the parts (None = zero) as one contiguous [parts, *shape] tensor."""
    one = _as_one_buffer(grads)
    if one is not None:
        return one
    if all(g is not None for g in grads):
        return torch.stack(grads)
    out = torch.zeros((len(grads),) + tuple(shape), dtype=dtype, device=device)
    for i, g in enumerate(grads):
        if g is not None:
            out[i].copy_(g)
    return out


class SplitHeadsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, num_heads, parts):
        out = _backend.ext().split_heads_fwd(x, bias, num_heads, parts)
        ctx.set_materialize_grads(False)  # unused parts arrive as None: no zero tensors to allocate
        ctx.has_bias = bias is not None
        ctx.bias_fp32 = bias is not None and bias.dtype == torch.float32
        ctx.part_shape, ctx.part_dtype, ctx.part_device = out.shape[1:], out.dtype, out.device
        return out.unbind(0)

    @staticmethod
    def backward(ctx, *grads):
        if all(g is None for g in grads):
            return None, None, None, None
        g5 = _stack_grads(grads, ctx.part_shape, ctx.part_dtype, ctx.part_device)
        want_bias = ctx.has_bias and ctx.needs_input_grad[1]
        grad_x, grad_bias = _backend.ext().split_heads_bwd(g5, want_bias, ctx.bias_fp32)
        return grad_x, grad_bias, None, None


class MergeHeadsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.num_heads = x.shape[1]
        return _backend.ext().merge_heads_fwd(x)

    @staticmethod
    def backward(ctx, grad):
        return _backend.ext().merge_heads_bwd(grad, ctx.num_heads)


# ----------------------------------------------------------------------------------------------------
# Custom operators over the CUDA kernels (what torch.compile traces)
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("lsmini::split_heads", mutates_args=(), device_types="cuda")
def split_heads_op(x: Tensor, bias: Tensor | None, num_heads: int, parts: int) -> Tensor:
    """x [batch, len, parts·hidden] → one contiguous [parts, batch, num_heads, len, head_dim] tensor (the
    public op unbinds it)."""
    return _backend.ext().split_heads_fwd(x, bias, num_heads, parts)


@split_heads_op.register_fake
def _(x, bias, num_heads, parts):
    batch, length, width = x.shape
    return x.new_empty((parts, batch, num_heads, length, width // (parts * num_heads)))


@torch.library.custom_op("lsmini::split_heads_backward", mutates_args=(), device_types="cuda")
def split_heads_backward_op(grad: Tensor, has_bias: bool, bias_fp32: bool) -> list[Tensor]:
    """grad [parts, batch, num_heads, len, head_dim] → [grad_x [batch, len, parts·hidden], grad_bias
    [parts·hidden] (only when has_bias; float32 when bias_fp32, else grad's dtype)]."""
    grad_x, grad_bias = _backend.ext().split_heads_bwd(grad, has_bias, bias_fp32)
    return [grad_x] if grad_bias is None else [grad_x, grad_bias]


@split_heads_backward_op.register_fake
def _(grad, has_bias, bias_fp32):
    parts, batch, num_heads, length, head_dim = grad.shape
    width = parts * num_heads * head_dim
    grads = [grad.new_empty((batch, length, width))]
    if has_bias:
        grads.append(grad.new_empty((width,), dtype=torch.float32 if bias_fp32 else grad.dtype))
    return grads


def _split_heads_setup_context(ctx, inputs, output):
    _, bias, _, _ = inputs
    ctx.has_bias = bias is not None
    ctx.bias_fp32 = bias is not None and bias.dtype == torch.float32


def _split_heads_backward(ctx, grad):
    want_bias = ctx.has_bias and ctx.needs_input_grad[1]
    grad_x, grad_bias = optional_outputs(split_heads_backward_op(grad, want_bias, ctx.bias_fp32), True, want_bias)
    return grad_x, grad_bias, None, None


split_heads_op.register_autograd(_split_heads_backward, setup_context=_split_heads_setup_context)


@torch.library.custom_op("lsmini::merge_heads", mutates_args=(), device_types="cuda")
def merge_heads_op(x: Tensor) -> Tensor:
    """x [batch, num_heads, len, head_dim] (any strides) → contiguous [batch, len, num_heads·head_dim]."""
    return _backend.ext().merge_heads_fwd(x)


@merge_heads_op.register_fake
def _(x):
    batch, num_heads, length, head_dim = x.shape
    return x.new_empty((batch, length, num_heads * head_dim))


@torch.library.custom_op("lsmini::merge_heads_backward", mutates_args=(), device_types="cuda")
def merge_heads_backward_op(grad: Tensor, num_heads: int) -> Tensor:
    """grad [batch, len, num_heads·head_dim] → contiguous [batch, num_heads, len, head_dim]."""
    return _backend.ext().merge_heads_bwd(grad, num_heads)


@merge_heads_backward_op.register_fake
def _(grad, num_heads):
    batch, length, width = grad.shape
    return grad.new_empty((batch, num_heads, length, width // num_heads))


def _merge_heads_setup_context(ctx, inputs, output):
    ctx.num_heads = inputs[0].shape[1]


def _merge_heads_backward(ctx, grad):
    return merge_heads_backward_op(grad, ctx.num_heads)


merge_heads_op.register_autograd(_merge_heads_backward, setup_context=_merge_heads_setup_context)


# ----------------------------------------------------------------------------------------------------
# Public ops
# ----------------------------------------------------------------------------------------------------
def _check_positive_int(name, v, op):
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    if v < 1:
        raise ValueError(f"{op}: {name} must be >= 1, got {v}")


def _check_split_args(x, bias, num_heads, parts):
    op = "split_heads"
    check_tensor(op, "x", x)
    check_floating(op, "x", x)
    if x.dim() != 3:
        raise ValueError(f"{op}: x must be 3-D [batch, len, parts*hidden], got shape {tuple(x.shape)}")
    _check_positive_int("num_heads", num_heads, op)
    _check_positive_int("parts", parts, op)
    width = x.shape[-1]
    if width % (parts * num_heads) != 0:
        raise ValueError(f"{op}: the last dimension of x ({width}) must be divisible by parts*num_heads = "
                         f"{parts}*{num_heads} = {parts * num_heads}")
    check_tensor(op, "bias", bias, or_none=True)
    if bias is None:
        return
    check_last_dim_vector(op, "bias", bias, x)
    if bias.dtype not in (torch.float32, x.dtype):
        raise TypeError(f"{op}: bias must be float32 or x's dtype ({x.dtype}), got {bias.dtype}")
    check_same_device(op, "bias", bias, "x", x.device)


def split_heads(x, bias, num_heads, parts=3):
    """Add ``bias`` to a fused projection and split it into per-head tensors.

    x [batch, len, parts·hidden] (columns: part, then head, then head_dim), bias [parts·hidden] or None
    → a tuple of ``parts`` tensors [batch, num_heads, len, head_dim], views of one contiguous
    [parts, batch, num_heads, len, head_dim] buffer. Runs the CUDA kernel for CUDA tensors
    (float32/float16/bfloat16; bias float32 or x's dtype) and ``split_heads_ref`` elsewhere.
    """
    _check_split_args(x, bias, num_heads, parts)
    if _backend.use_kernels(x, bias):
        if torch.compiler.is_compiling():
            return split_heads_op(x, bias, num_heads, parts).unbind(0)
        return SplitHeadsFunction.apply(x, bias, num_heads, parts)
    return split_heads_ref(x, bias, num_heads, parts)


def merge_heads(x):
    """[batch, num_heads, len, head_dim] → a new contiguous [batch, len, num_heads·head_dim] tensor.

    Any strides are accepted (the kernel path makes x contiguous first). Runs the CUDA kernel for CUDA
    tensors (float32/float16/bfloat16) and ``merge_heads_ref`` elsewhere.
    """
    op = "merge_heads"
    check_tensor(op, "x", x)
    check_floating(op, "x", x)
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D [batch, num_heads, len, head_dim], got shape {tuple(x.shape)}")
    if _backend.use_kernels(x):
        if torch.compiler.is_compiling():
            return merge_heads_op(x)
        return MergeHeadsFunction.apply(x)
    return merge_heads_ref(x)
