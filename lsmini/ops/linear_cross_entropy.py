"""The output projection and the label-smoothed cross-entropy as one op, without materialising the logits:
``linear_cross_entropy(x, weight, target) == cross_entropy(F.linear(x, weight), target)``.

For features x [..., H], the projection weight [V, H] (an ``nn.Linear(H, V, bias=False)``'s weight or a tied
embedding table) and class ids target [...] (int64), the loss is ``cross_entropy``'s (see
``lsmini.ops.cross_entropy`` for the formula, ``label_smoothing`` and ``ignore_index``), reduced by "mean"
(over non-ignored rows) or "sum". A model's logits [N, V] are its largest activation (8192 tokens × 32000
classes in fp16: 500 MB) and live from the end of the forward to the start of the backward, where the
activation memory peaks. This op never holds more than one chunk of them.

CUDA path (float32/float16/bfloat16): the rows go in chunks of ``chunk_tokens`` (default
``default_chunk_tokens``: 4096 rows, more where the logits of more fit 64 MiB). Per chunk, in the forward: the
logits GEMM (against the weight with zero rows appended up to a 16-byte multiple, so that every GEMM runs
aligned), the cross-entropy kernel's forward (per-row losses and log-sum-exp) — which, when a gradient will be
needed, writes the backward's gradient into the chunk's logits right after each row's log-sum-exp, while the
row is still in L2 — then the two gradient GEMMs: d x = d logits · W into the chunk's rows of a float32 [N, H]
buffer, d W += d logitsᵀ · x into a float32 [V, H] buffer (cuBLAS accumulates in place, so the sum over chunks
is rounded once, to float32). The logits' gradient is that of the *summed* loss; it is written scaled by
``GRAD_SCALE`` (2¹⁵: each entry is softmax − target distribution, in [−1, 1]), so that float16 keeps the small
entries that an unscaled gradient would flush to zero, and the GEMMs divide it back out in their epilogue
(alpha = 1/2¹⁵, exact). The backward only multiplies the two float32 sums by the incoming gradient (÷ the row
count for "mean") and rounds them to the parameters' dtypes: no GEMM runs there. The cost is the float32 sums,
alive in place of the logits: [N, H] + [V, H] floats. Without a gradient (``torch.no_grad``, inputs that do not
require grad) only the loss is computed.

The op is registered once (see ``lsmini.ops.library``) as ``lsmini::linear_cross_entropy``, which returns
the two sums and the two float32 gradients: the chunks above on CUDA; on CPU ``linear_cross_entropy_ref``
(the projection, then ``cross_entropy_ref``) summed, and its gradients by autograd; a fake implementation
for tracing; autograd saving the gradients, whose backward is the scaling above (no operator of its own).
``linear_cross_entropy`` checks its arguments and calls it in eager and compiled code alike; float64 and
the forced reference run ``linear_cross_entropy_ref`` directly.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_floating, check_same_device, check_tensor
from lsmini.ops.cross_entropy import _check_smoothing_and_ignore_index, _check_target_values, cross_entropy_ref
from lsmini.ops.library import operator
from lsmini.ops.reference_grads import reference_grads

REDUCTIONS = ("mean", "sum")
GRAD_SCALE = 2.0 ** 15  # |softmax − target distribution| <= 1, so the scaled gradient stays below 65504
# Each chunk adds its d W into the float32 [V, H] sum (8·V·H bytes read and written, against its GEMMs' 6·rows·V·H
# flops) and runs its own launches and a d x GEMM ([rows, V] · [V, H]) that fills the GPU only with enough rows. At
# 2048 rows these cost about a tenth of the op at language-model shapes (V 32000-50257, H 768), at 4096 rows a few
# percent, for twice the logits alive at once (4096 · V · 2 bytes: 400 MB at V = 50257 in bf16, still a fraction of
# the full logits and their gradient). Fewer rows save memory and spend the time on the sum.
CHUNK_TOKENS = 4096
CHUNK_BYTES = 64 << 20  # small vocabularies: rows up to this much logits a chunk


def default_chunk_tokens(vocab, dtype):
    """Rows per chunk when ``chunk_tokens`` is not given: CHUNK_TOKENS, or as many as keep a chunk's logits within
    CHUNK_BYTES where that is more."""
    return max(CHUNK_TOKENS, CHUNK_BYTES // (vocab * dtype.itemsize))


def linear_cross_entropy_ref(x, weight, target, label_smoothing=0.0, ignore_index=-100, reduction="mean",
                             return_nll=False):
    """Pure-PyTorch oracle and CPU path: ``cross_entropy_ref(F.linear(x, weight), ...)``."""
    return cross_entropy_ref(F.linear(x, weight), target, label_smoothing, ignore_index, reduction, return_nll)


def _gemm_into(out, a, b, accumulate):
    """out (float32) = a · b / GRAD_SCALE, or += with accumulate; a and b in one floating dtype. float16 and
    bfloat16 GEMMs write their float32 result directly (out_dtype): no rounding to the inputs' dtype."""
    beta = 1.0 if accumulate else 0.0  # beta 0: out's old contents are not read
    if a.dtype == torch.float32:
        torch.addmm(out, a, b, beta=beta, alpha=1.0 / GRAD_SCALE, out=out)
    else:
        torch.addmm(out, a, b, out_dtype=torch.float32, beta=beta, alpha=1.0 / GRAD_SCALE, out=out)


def _chunks(x, weight, target, label_smoothing, ignore_index, chunk_tokens, with_grad):
    """(loss_sum, nll_sum, grad_x, grad_weight) for x [rows, H], weight [V, H], target int64 [rows]:
    the float32 sums over rows of the loss and of the plain NLL, and with ``with_grad`` the float32
    gradients of loss_sum with respect to x and weight ([rows, H], [V, H]); without, two empty tensors."""
    ext = _backend.ext()
    rows, hidden = x.shape
    vocab = weight.shape[0]
    weight = _aligned_rows(weight)
    loss_sum = x.new_zeros((), dtype=torch.float32)
    nll_sum = x.new_zeros((), dtype=torch.float32)
    grad_x = x.new_empty((rows, hidden) if with_grad else (0,), dtype=torch.float32)
    grad_weight = x.new_empty((weight.shape[0], hidden) if with_grad else (0,), dtype=torch.float32)
    scale = x.new_full((min(chunk_tokens, rows),), GRAD_SCALE, dtype=torch.float32)  # per-row gradient
    for start in range(0, rows, chunk_tokens):
        x_c = x[start:start + chunk_tokens]
        t_c = target[start:start + chunk_tokens]
        wide = torch.mm(x_c, weight.t())  # [chunk, padded vocab]: the padding columns are x·0 = 0
        logits = wide[:, :vocab]  # the kernels read rows at wide's stride
        # With the gradient rows' scale, the kernel also writes the gradient into the logits' storage, right after
        # each row's log-sum-exp (the padding columns keep their zeros).
        loss_rows, nll_rows, _ = ext.cross_entropy_fwd(logits, t_c, label_smoothing, ignore_index,
                                                       scale[:x_c.shape[0]] if with_grad else None)
        loss_sum += loss_rows.sum()
        nll_sum += nll_rows.sum()
        if with_grad:
            _gemm_into(grad_x[start:start + chunk_tokens], wide, weight, False)
            _gemm_into(grad_weight, wide.t(), x_c, start > 0)
    return loss_sum, nll_sum, grad_x, grad_weight[:vocab] if with_grad else grad_weight


def _aligned_rows(weight):
    """weight [V, H], or a copy with zero rows appended up to a 16-byte multiple of rows: the logits' row length
    is the GEMMs' leading dimension, and cuBLAS runs a vocabulary such as GPT-2's 50257 on its slow
    unaligned kernels (several times the time of the aligned ones)."""
    pad = -weight.shape[0] % (16 // weight.element_size())
    return weight if pad == 0 else torch.cat([weight, weight.new_zeros(pad, weight.shape[1])])


def _scaled(grad_sum, grad_loss, dtype):
    """The gradient of the summed loss times the loss's incoming gradient, in the input's dtype."""
    return grad_sum.mul(grad_loss.float()).to(dtype)


@operator("lsmini::linear_cross_entropy")
def _linear_cross_entropy_op(x: Tensor, weight: Tensor, target: Tensor, label_smoothing: float, ignore_index: int,
                             chunk_tokens: int, with_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss_sum, nll_sum, grad_x, grad_weight), float32, for x [rows, H], weight [V, H], target int64
    [rows]: the sums over rows of the loss and of the plain NLL, and with ``with_grad`` the gradients of
    loss_sum with respect to x and weight ([rows, H], [V, H]); without, two empty tensors. This function
    is the CUDA implementation (``_chunks``)."""
    return _chunks(x, weight, target, label_smoothing, ignore_index, chunk_tokens, with_grad)


@_linear_cross_entropy_op.register_kernel("cpu")
def _linear_cross_entropy_cpu(x, weight, target, label_smoothing, ignore_index, chunk_tokens, with_grad):
    loss_sum, nll_sum = linear_cross_entropy_ref(x, weight, target, label_smoothing, ignore_index, "sum", True)
    if not with_grad:
        return loss_sum, nll_sum, x.new_empty((0,), dtype=torch.float32), x.new_empty((0,), dtype=torch.float32)
    grad_x, grad_weight = reference_grads(
        lambda x, w: linear_cross_entropy_ref(x, w, target, label_smoothing, ignore_index, "sum"), [x, weight],
        loss_sum.new_ones(()))
    return loss_sum, nll_sum, grad_x.float().contiguous(), grad_weight.float().contiguous()


@_linear_cross_entropy_op.register_fake
def _(x, weight, target, label_smoothing, ignore_index, chunk_tokens, with_grad):
    shapes = ((), (), x.shape, weight.shape) if with_grad else ((), (), (0,), (0,))
    return tuple(x.new_empty(shape, dtype=torch.float32) for shape in shapes)


def _setup_context(ctx, inputs, output):
    x, weight, _target, _label_smoothing, _ignore_index, _chunk_tokens, with_grad = inputs
    _, nll_sum, grad_x, grad_weight = output
    ctx.mark_non_differentiable(nll_sum, grad_x, grad_weight)
    ctx.save_for_backward(grad_x, grad_weight)
    ctx.with_grad = with_grad
    ctx.dtypes = (x.dtype, weight.dtype)


def _backward(ctx, grad_loss, _grad_nll, _grad_grad_x, _grad_grad_weight):
    if not ctx.with_grad:
        raise RuntimeError("linear_cross_entropy: backward through a call made with with_grad=False (the "
                           "gradients were not computed); call it with with_grad=True")
    grad_x, grad_weight = ctx.saved_tensors
    return (_scaled(grad_x, grad_loss, ctx.dtypes[0]), _scaled(grad_weight, grad_loss, ctx.dtypes[1]),
            None, None, None, None, None)


_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


def _check_args(x, weight, target, label_smoothing, ignore_index, reduction, chunk_tokens):
    op = "linear_cross_entropy"
    for name, value in (("x", x), ("weight", weight), ("target", target)):
        check_tensor(op, name, value)
    check_floating(op, "x", x)
    check_floating(op, "weight", weight)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must have shape [..., hidden] with hidden >= 1, got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.shape[0] < 1:
        raise ValueError(f"{op}: weight must have shape [vocab, {x.shape[-1]}] (vocab >= 1; the hidden size is x's "
                         f"last dimension), got shape {tuple(weight.shape)}")
    if target.dtype != torch.int64:
        raise TypeError(f"{op}: target must hold class indices as torch.int64, got {target.dtype}")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"{op}: target must have shape {tuple(x.shape[:-1])} (x's shape without its last, hidden "
                         f"dimension), got {tuple(target.shape)}")
    check_same_device(op, "weight", weight, "x", x.device)
    check_same_device(op, "target", target, "x", x.device)
    if reduction not in REDUCTIONS:
        hint = " (for per-row losses, project the features and call cross_entropy)" if reduction == "none" else ""
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}{hint}")
    _check_smoothing_and_ignore_index(op, label_smoothing, ignore_index)
    check_chunk_tokens(op, chunk_tokens)


def check_chunk_tokens(op, chunk_tokens):
    """chunk_tokens is None or an int >= 1 (LinearCrossEntropyLoss checks it when built)."""
    if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                     or chunk_tokens < 1):
        raise ValueError(f"{op}: chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")


def linear_cross_entropy(x, weight, target, label_smoothing=0.0, ignore_index=-100, reduction="mean",
                         return_nll=False, check_targets=True, chunk_tokens=None):
    """``cross_entropy(F.linear(x, weight), target, ...)`` computed in chunks of rows, never holding all the
    logits (see the module doc for how, and what it costs).

    Args:
        x: [..., H] features (the last layer's output).
        weight: [V, H] projection weight (no bias), in x's dtype. Under ``torch.autocast`` both are cast to
            the autocast dtype first, as ``F.linear`` would.
        target: [...] int64 class ids in [0, V), or ``ignore_index``.
        label_smoothing, ignore_index, check_targets: as in ``cross_entropy``.
        reduction: "mean" (over non-ignored rows; NaN when every row is ignored) or "sum". Per-row losses
            ("none") need the logits: project and call ``cross_entropy``.
        return_nll: also return the plain negative log-likelihood, same reduction, detached.
        chunk_tokens: rows per chunk (default: ``default_chunk_tokens``).

    Returns:
        the 0-d float32 loss (float64 for float64 inputs), or ``(loss, nll)`` with ``return_nll``.
    """
    _check_args(x, weight, target, label_smoothing, ignore_index, reduction, chunk_tokens)
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    if weight.dtype != x.dtype:
        raise TypeError(f"linear_cross_entropy: weight must be in x's dtype {x.dtype}, got {weight.dtype}")
    if check_targets:
        _check_target_values(target, weight.shape[0], ignore_index, op="linear_cross_entropy")
    if _backend.force_reference() or x.dtype not in limits.KERNEL_DTYPES or not _backend.has_op_impl(x.device):
        return linear_cross_entropy_ref(x, weight, target, float(label_smoothing), int(ignore_index), reduction,
                                        return_nll)
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    target1d = target.reshape(-1).contiguous()
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], x.dtype)
    with_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    loss, nll, _, _ = torch.ops.lsmini.linear_cross_entropy.default(x2d, weight.contiguous(), target1d,
                                                                     float(label_smoothing), int(ignore_index), chunk,
                                                                     with_grad)
    if reduction == "mean":  # NaN when every row is ignored, as cross_entropy; the clamp keeps the gradient 0
        count = (target1d != ignore_index).sum()  # on the device: no sync
        nan = loss.new_full((), float("nan"))
        loss, nll = (torch.where(count > 0, v / count.clamp(min=1), nan) for v in (loss, nll))
    return (loss, nll.detach()) if return_nll else loss
