"""Head transforms on both sides of attention: the public ops ``split_heads`` and ``merge_heads``, their
references and their registered operators.

split_heads — bias add + split of a fused projection into per-head tensors:

    x     [batch, len, parts·hidden]   columns part-major, then head, then head_dim:
                                        c = p·hidden + h·head_dim + d,  hidden = num_heads·head_dim
    bias  [parts·hidden] or None
    out[p][b, h, l, d] = x[b, l, c] + bias[c]        (fp32 add, rounded once to x's dtype)

It returns a tuple of ``parts`` tensors, each [batch, num_heads, len, head_dim] and contiguous, all views
of ONE [parts, batch, num_heads, len, head_dim] buffer (QKV: parts = 3; the cross-attention K/V of a
whole decoder stack: parts = 2·layers). Backward writes grad_x in one pass and grad_bias as fp32
column sums over batch·len, in bias's dtype. Because the parts are views of one buffer, unbound from it
while autograd records, modifying one in place then is an error: clone it first.

merge_heads — the inverse layout for the attention output:

    x [batch, num_heads, len, head_dim]  →  out [batch, len, num_heads·head_dim],
    out[b, l, h·head_dim + d] = x[b, h, l, d].

The CUDA kernels take float32/float16/bfloat16 (bias float32 or x's dtype); without a bias both ops
move the data bit-exactly.

Each op is registered once (see ``lsmini.ops.library``): ``lsmini::split_heads`` /
``lsmini::split_heads_backward`` (the operator returns the one [parts, ...] buffer, which ``split_heads``
unbinds) and ``lsmini::merge_heads`` / ``lsmini::merge_heads_backward``: the kernels on CUDA, the
references (and their gradients by autograd) on CPU, fake implementations for tracing, registered
autograd. The public ops check their arguments and call them in eager and compiled code alike.
"""
import torch
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_floating, check_last_dim_vector, check_same_device, check_tensor
from lsmini.ops.library import operator, optional_outputs
from lsmini.ops.reference_grads import reference_grads


# ----------------------------------------------------------------------------------------------------
# References (the oracle and the CPU path)
# ----------------------------------------------------------------------------------------------------
def split_heads_ref(x, bias, num_heads, parts=3):
    """Pure-PyTorch split_heads (bias add in fp32 math, x's dtype out): a tuple of ``parts`` views of one
    contiguous [parts, batch, num_heads, len, head_dim] tensor."""
    return _split_heads_buffer_ref(x, bias, num_heads, parts).unbind(0)


def _split_heads_buffer_ref(x, bias, num_heads, parts):
    """The one new contiguous [parts, batch, num_heads, len, head_dim] tensor of ``split_heads_ref``."""
    batch, length, width = x.shape
    head_dim = width // (parts * num_heads)
    y = x if bias is None else (x.float() + bias.float()).to(x.dtype)
    y = y.view(batch, length, parts, num_heads, head_dim).permute(2, 0, 3, 1, 4)
    # clone, not contiguous(): with parts = num_heads = 1 the permute is already contiguous and the
    # result would alias x, unlike the kernel's fresh buffer.
    return y.clone(memory_format=torch.contiguous_format)


def merge_heads_ref(x):
    """Pure-PyTorch merge_heads: [batch, num_heads, len, head_dim] → a new [batch, len, num_heads·head_dim]."""
    batch, num_heads, length, head_dim = x.shape
    y = x.transpose(1, 2).clone(memory_format=torch.contiguous_format)
    return y.view(batch, length, num_heads * head_dim)


# ----------------------------------------------------------------------------------------------------
# The registered operators: the kernels on CUDA, the references on CPU
# ----------------------------------------------------------------------------------------------------
@operator("lsmini::split_heads")
def _split_heads_op(x: Tensor, bias: Tensor | None, num_heads: int, parts: int) -> Tensor:
    """x [batch, len, parts·hidden] → one contiguous [parts, batch, num_heads, len, head_dim] tensor (the
    public op unbinds it). This function is the CUDA implementation (the kernel)."""
    return _backend.ext().split_heads_fwd(x, bias, num_heads, parts)


@_split_heads_op.register_kernel("cpu")
def _split_heads_cpu(x, bias, num_heads, parts):
    return _split_heads_buffer_ref(x, bias, num_heads, parts)


@_split_heads_op.register_fake
def _(x, bias, num_heads, parts):
    batch, length, width = x.shape
    return x.new_empty((parts, batch, num_heads, length, width // (parts * num_heads)))


@operator("lsmini::split_heads_backward", differentiable=False)
def _split_heads_backward_op(grad: Tensor, has_bias: bool, bias_fp32: bool) -> list[Tensor]:
    """grad [parts, batch, num_heads, len, head_dim] → [grad_x [batch, len, parts·hidden], grad_bias
    [parts·hidden] (only when has_bias; float32 when bias_fp32, else grad's dtype)]."""
    grad_x, grad_bias = _backend.ext().split_heads_bwd(grad, has_bias, bias_fp32)
    return [grad_x] if grad_bias is None else [grad_x, grad_bias]


@_split_heads_backward_op.register_kernel("cpu")
def _split_heads_backward_cpu(grad, has_bias, bias_fp32):
    # split_heads is linear in x and bias: its gradient is the same at every point, zeros included
    parts, batch, num_heads, length, head_dim = grad.shape
    width = parts * num_heads * head_dim
    x = grad.new_zeros((batch, length, width))
    bias = grad.new_zeros((width,), dtype=torch.float32 if bias_fp32 else grad.dtype) if has_bias else None
    grad_x, grad_bias = reference_grads(lambda x, b: _split_heads_buffer_ref(x, b, num_heads, parts), [x, bias], grad)
    return [grad_x.contiguous()] if grad_bias is None else [grad_x.contiguous(), grad_bias]


@_split_heads_backward_op.register_fake
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
    grads = torch.ops.lsmini.split_heads_backward.default(grad, want_bias, ctx.bias_fp32)
    grad_x, grad_bias = optional_outputs(grads, True, want_bias)
    return grad_x, grad_bias, None, None


_split_heads_op.register_autograd(_split_heads_backward, setup_context=_split_heads_setup_context)


@operator("lsmini::merge_heads")
def _merge_heads_op(x: Tensor) -> Tensor:
    """x [batch, num_heads, len, head_dim] (any strides) → contiguous [batch, len, num_heads·head_dim]. This
    function is the CUDA implementation (the kernel)."""
    return _backend.ext().merge_heads_fwd(x)


@_merge_heads_op.register_kernel("cpu")
def _merge_heads_cpu(x):
    return merge_heads_ref(x)


@_merge_heads_op.register_fake
def _(x):
    batch, num_heads, length, head_dim = x.shape
    return x.new_empty((batch, length, num_heads * head_dim))


@operator("lsmini::merge_heads_backward", differentiable=False)
def _merge_heads_backward_op(grad: Tensor, num_heads: int) -> Tensor:
    """grad [batch, len, num_heads·head_dim] → contiguous [batch, num_heads, len, head_dim]."""
    return _backend.ext().merge_heads_bwd(grad, num_heads)


@_merge_heads_backward_op.register_kernel("cpu")
def _merge_heads_backward_cpu(grad, num_heads):
    # merge_heads is linear: its gradient is the same at every point, zeros included
    batch, length, width = grad.shape
    (grad_x,) = reference_grads(merge_heads_ref, [grad.new_zeros((batch, num_heads, length, width // num_heads))],
                                grad)
    return grad_x.contiguous()


@_merge_heads_backward_op.register_fake
def _(grad, num_heads):
    batch, length, width = grad.shape
    return grad.new_empty((batch, num_heads, length, width // num_heads))


def _merge_heads_setup_context(ctx, inputs, output):
    ctx.num_heads = inputs[0].shape[1]


def _merge_heads_backward(ctx, grad):
    return torch.ops.lsmini.merge_heads_backward.default(grad, ctx.num_heads)


_merge_heads_op.register_autograd(_merge_heads_backward, setup_context=_merge_heads_setup_context)


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
    [parts, batch, num_heads, len, head_dim] buffer. Calls ``torch.ops.lsmini.split_heads`` for
    float32/float16/bfloat16 x (bias float32 or x's dtype): the CUDA kernel for CUDA tensors,
    ``split_heads_ref`` for CPU tensors; other dtypes and the forced reference run ``split_heads_ref``.
    """
    _check_split_args(x, bias, num_heads, parts)
    if _backend.force_reference() or x.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(x.device):
        return split_heads_ref(x, bias, num_heads, parts)
    return torch.ops.lsmini.split_heads.default(x, bias, num_heads, parts).unbind(0)


def merge_heads(x):
    """[batch, num_heads, len, head_dim] → a new contiguous [batch, len, num_heads·head_dim] tensor.

    Any strides are accepted (the kernel makes x contiguous first). Calls ``torch.ops.lsmini.merge_heads``
    for float32/float16/bfloat16 x: the CUDA kernel for CUDA tensors, ``merge_heads_ref`` for CPU tensors;
    other dtypes and the forced reference run ``merge_heads_ref``.
    """
    op = "merge_heads"
    check_tensor(op, "x", x)
    check_floating(op, "x", x)
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D [batch, num_heads, len, head_dim], got shape {tuple(x.shape)}")
    if _backend.force_reference() or x.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(x.device):
        return merge_heads_ref(x)
    return torch.ops.lsmini.merge_heads.default(x)
