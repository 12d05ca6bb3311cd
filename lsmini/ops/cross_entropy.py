"""Softmax cross-entropy with label smoothing over the last dimension of the logits: the public op, its
reference and its registered operators.

For logits x [..., V] (rows x_i, i < N = prod(...)) and class ids t [...] (int64), ε = label_smoothing:

    lse_i  = log Σ_j exp(x_ij)
    nll_i  = lse_i − x_i[t_i]                                   (plain negative log-likelihood)
    loss_i = (1 − ε)·nll_i + ε·(lse_i − mean_j x_ij)            (= nll_i when ε = 0)
    ∂loss_i/∂x_ij = softmax(x_i)_j − ((1 − ε)·[j = t_i] + ε/V)

Rows whose target equals ``ignore_index`` contribute 0 and get a zero gradient. Reductions follow
``torch.nn.functional.cross_entropy``: ``"mean"`` = Σ_i loss_i / (number of non-ignored rows) (NaN
when every row is ignored, torch's 0/0), ``"sum"`` = Σ_i loss_i, ``"none"`` = loss_i with target's
shape.

Differences from ``F.cross_entropy``: the class dimension is the LAST one (torch: dim 1); no class
weights and no probability targets; the loss is float32 for float32/float16/bfloat16 logits (float64
for float64 logits) — torch returns the logits' dtype, which for float16 overflows to inf once
ε·Σ_j log p_j exceeds 65504 (V ≳ 6000 with smoothing); with ``return_nll=True`` the plain NLL (same
reduction, detached) comes back as well, for logging.

CUDA kernel (float32/float16/bfloat16 logits, fp32 math): the forward streams each row once with an
online log-sum-exp and never writes log-probabilities; it saves only lse [N] (fp32) for backward. The
backward reads the logits once and writes (softmax − smoothed one-hot)·grad once — into the logits'
own storage with ``inplace_backward=True``.

The op is registered once (see ``lsmini.ops.library``): ``lsmini::cross_entropy`` gives the per-row
losses (the reduction is plain PyTorch around it, which the compiler sees), ``lsmini::cross_entropy_backward``
the logits' gradient and ``lsmini::cross_entropy_backward_`` the same written over the logits; the
kernels on CUDA, ``cross_entropy_ref`` and its gradient by autograd on CPU, fake implementations for
tracing, autograd saving the logits, the targets and lse. ``cross_entropy`` checks its arguments and
calls it in eager and compiled code alike; other dtypes (float64) and the forced reference run
``cross_entropy_ref`` directly.
"""
import numbers

import torch
from torch import Tensor

from lsmini import _backend, limits
from lsmini.ops.checks import check_floating, check_same_device, check_tensor
from lsmini.ops.library import operator
from lsmini.ops.reference_grads import reference_grads

REDUCTIONS = ("mean", "sum", "none")


def _reduce(rows, count, reduction, shape):
    """rows [N] → the requested reduction; count = non-ignored rows (a device tensor, for "mean")."""
    if reduction == "none":
        return rows.view(shape)
    total = rows.sum()
    return total if reduction == "sum" else total / count


def cross_entropy_ref(logits, target, label_smoothing=0.0, ignore_index=-100, reduction="mean", return_nll=False):
    """Pure-PyTorch cross-entropy in fp32 math (the oracle and the CPU path), with the semantics of
    ``cross_entropy``: returns the loss in float32 (float64 for float64 logits), or ``(loss, nll)``
    with ``return_nll=True``. Targets outside [0, V) that are not ``ignore_index`` give a NaN row,
    as the kernel does (``cross_entropy`` rejects them first unless ``check_targets=False``)."""
    loss, nll, _ = _cross_entropy_rows_ref(logits, target, label_smoothing, ignore_index)
    count = (target.reshape(-1) != ignore_index).sum()
    out = _reduce(loss, count, reduction, target.shape)
    return (out, _reduce(nll.detach(), count, reduction, target.shape)) if return_nll else out


def _cross_entropy_rows_ref(logits, target, label_smoothing, ignore_index):
    """(loss, nll, lse) of each row of logits viewed as [N, V], in fp32 math (float64 for float64 logits):
    0 in the rows whose target is ignore_index, NaN in those whose target is outside [0, V); lse the
    rows' log-sum-exp."""
    vocab = logits.shape[-1]
    x = logits.reshape(-1, vocab)
    x = x if x.dtype == torch.float64 else x.float()
    t = target.reshape(-1)
    ignored = t == ignore_index
    in_range = (t >= 0) & (t < vocab)
    bad = ~ignored & ~in_range
    safe_t = torch.where(in_range & ~ignored, t, torch.zeros_like(t))

    # log_softmax rather than logsumexp: the same math, and far faster on CPU for confident logits
    # (torch's CPU exp slows down badly on inputs far below −87).
    logp = torch.log_softmax(x, dim=-1)
    nll = -logp.gather(1, safe_t.unsqueeze(1)).squeeze(1)
    if label_smoothing > 0:
        loss = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(dim=-1)
    else:  # no smoothing term at all: with a −inf logit it would be inf, and 0·inf = NaN
        loss = nll
    lse = x.amax(dim=-1) - logp.amax(dim=-1)  # at a row's largest logit, log p = x − lse

    zero = x.new_zeros(())
    nan = x.new_full((), float("nan"))

    def finish(rows):
        return torch.where(bad, nan, torch.where(ignored, zero, rows))

    return finish(loss), finish(nll), lse


@operator("lsmini::cross_entropy")
def _cross_entropy_op(logits: Tensor, target: Tensor, label_smoothing: float, ignore_index: int,
                      inplace_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss_rows, nll_rows, lse), each float32 [rows], for logits [rows, vocab] and target int64 [rows].
    inplace_backward: the backward writes the logits' gradient into the logits (the forward does not
    read it). This function is the CUDA implementation (the kernel)."""
    loss_rows, nll_rows, lse = _backend.ext().cross_entropy_fwd(logits, target, label_smoothing, ignore_index)
    return loss_rows, nll_rows, lse


@_cross_entropy_op.register_kernel("cpu")
def _cross_entropy_cpu(logits, target, label_smoothing, ignore_index, inplace_backward):
    return _cross_entropy_rows_ref(logits, target, label_smoothing, ignore_index)


@_cross_entropy_op.register_fake
def _(logits, target, label_smoothing, ignore_index, inplace_backward):
    rows = logits.shape[0]
    return tuple(logits.new_empty((rows,), dtype=torch.float32) for _ in range(3))


@operator("lsmini::cross_entropy_backward", differentiable=False)
def _cross_entropy_backward_op(grad_rows: Tensor, logits: Tensor, target: Tensor, lse: Tensor, label_smoothing: float,
                               ignore_index: int) -> Tensor:
    """grad_logits [rows, vocab] (fresh, contiguous, logits' dtype) from the float32 gradient of loss_rows."""
    return _backend.ext().cross_entropy_bwd(grad_rows, logits, target, lse, label_smoothing, ignore_index, False)


@_cross_entropy_backward_op.register_kernel("cpu")
def _cross_entropy_backward_cpu(grad_rows, logits, target, lse, label_smoothing, ignore_index):
    return _cross_entropy_grad_ref(grad_rows, logits, target, label_smoothing, ignore_index)


@_cross_entropy_backward_op.register_fake
def _(grad_rows, logits, target, lse, label_smoothing, ignore_index):
    return logits.new_empty(logits.shape)


@operator("lsmini::cross_entropy_backward_", mutates_args=("logits",), differentiable=False)
def _cross_entropy_backward_inplace_op(grad_rows: Tensor, logits: Tensor, target: Tensor, lse: Tensor,
                                       label_smoothing: float, ignore_index: int) -> None:
    """``cross_entropy_backward`` written over the logits themselves (contiguous), which saves one
    [rows, vocab] buffer: the backward of ``inplace_backward=True``. Bumps the logits' version, so that
    autograd refuses a later backward that saved them (see ``library.Operator``)."""
    _backend.ext().cross_entropy_bwd(grad_rows, logits, target, lse, label_smoothing, ignore_index, True)
    torch.autograd.graph.increment_version(logits)


@_cross_entropy_backward_inplace_op.register_kernel("cpu")
def _cross_entropy_backward_inplace_cpu(grad_rows, logits, target, lse, label_smoothing, ignore_index):
    grad = _cross_entropy_grad_ref(grad_rows, logits, target, label_smoothing, ignore_index)
    with torch.no_grad():
        logits.copy_(grad)  # copy_ bumps the version itself


@_cross_entropy_backward_inplace_op.register_fake
def _(grad_rows, logits, target, lse, label_smoothing, ignore_index):
    return None


def _cross_entropy_grad_ref(grad_rows, logits, target, label_smoothing, ignore_index):
    """The gradient of ``cross_entropy_ref``'s per-row losses with respect to logits [rows, vocab], by
    autograd, in logits' dtype."""
    (grad,) = reference_grads(lambda x: cross_entropy_ref(x, target, label_smoothing, ignore_index, "none"), [logits],
                              grad_rows.float())
    return grad.contiguous()


def _cross_entropy_setup_context(ctx, inputs, output):
    logits, target, label_smoothing, ignore_index, inplace_backward = inputs
    _, nll_rows, lse = output
    ctx.mark_non_differentiable(nll_rows, lse)
    ctx.save_for_backward(logits, target, lse)
    ctx.label_smoothing, ctx.ignore_index, ctx.inplace_backward = label_smoothing, ignore_index, inplace_backward


def _cross_entropy_backward(ctx, grad_loss_rows, _grad_nll_rows, _grad_lse):
    logits, target, lse = ctx.saved_tensors
    if ctx.inplace_backward:
        if torch.is_grad_enabled():
            raise RuntimeError("cross_entropy: a loss with inplace_backward=True cannot be differentiated twice "
                               "(create_graph=True): its backward overwrites the logits")
        torch.ops.lsmini.cross_entropy_backward_.default(grad_loss_rows.float(), logits, target, lse,
                                                         ctx.label_smoothing, ctx.ignore_index)
        return logits.detach(), None, None, None, None
    grad = torch.ops.lsmini.cross_entropy_backward.default(grad_loss_rows.float(), logits, target, lse,
                                                           ctx.label_smoothing, ctx.ignore_index)
    return grad, None, None, None, None


_cross_entropy_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup_context)


def _check_args(logits, target, label_smoothing, ignore_index, reduction):
    op = "cross_entropy"
    check_tensor(op, "logits", logits)
    check_tensor(op, "target", target)
    check_floating(op, "logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"cross_entropy: logits must have shape [..., vocab] with vocab >= 1, got shape "
                         f"{tuple(logits.shape)}")
    if target.dtype != torch.int64:
        raise TypeError(f"cross_entropy: target must hold class indices as torch.int64, got {target.dtype} "
                        f"(class-probability targets are not supported)")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: target must have shape {tuple(logits.shape[:-1])} (logits' shape without "
                         f"its last, class dimension), got {tuple(target.shape)}")
    check_same_device(op, "target", target, "logits", logits.device)
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _check_smoothing_and_ignore_index(op, label_smoothing, ignore_index)


def _check_smoothing_and_ignore_index(op, label_smoothing, ignore_index):
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"{op}: label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__}")


def _check_target_values(target, vocab, ignore_index, op="cross_entropy"):
    """Raise when a target is outside [0, vocab) and not ignore_index. Costs one device→host sync, so it
    skips itself while torch.compile traces the op (the sync would break the graph) and while the
    current CUDA stream is capturing a graph (it would abort the capture). Those calls are not checked: a
    bad target gives a NaN loss row there (on the CPU reference path, gather's index error), never an
    out-of-bounds read."""
    if torch.compiler.is_compiling() or (target.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        first = bad.reshape(-1).nonzero()[0, 0].item()
        raise ValueError(f"{op}: target values must be in [0, {vocab}) or equal ignore_index "
                         f"({ignore_index}); {int(bad.sum())} are not, the first is {target.reshape(-1)[first].item()} "
                         f"at flat position {first}")


def cross_entropy(logits, target, label_smoothing=0.0, ignore_index=-100, reduction="mean", return_nll=False,
                  inplace_backward=False, check_targets=True):
    """Label-smoothed softmax cross-entropy, ``F.cross_entropy`` semantics with classes last.

    Args:
        logits: [..., V] float tensor (the kernel takes float32/float16/bfloat16).
        target: [...] int64 class ids in [0, V), or ``ignore_index``.
        label_smoothing: ε in [0, 1]; the target distribution is (1 − ε)·one_hot + ε/V.
        ignore_index: target value whose rows contribute nothing (loss 0, gradient 0).
        reduction: "mean" (over non-ignored rows), "sum" or "none" (loss with target's shape).
        return_nll: also return the plain negative log-likelihood, same reduction, detached.
        inplace_backward: the backward writes the logits' gradient into the logits' own storage
            (saves one [N, V] buffer). Only when nothing else needs the logits after this loss (their
            producer's backward must not use them) and they are contiguous (otherwise the internal
            contiguous copy is overwritten instead); the graph cannot be backpropagated twice. Ignored
            while torch.compile traces the op: a compiled graph may not write into a tensor it saved.
        check_targets: validate target values (one device→host sync). Set False on the training hot
            path once the data is known to be valid: an out-of-range target then gives a NaN loss row
            (and NaN gradient row) instead of an error — never an out-of-bounds read. Not checked while
            torch.compile traces the op, nor during a CUDA graph capture (no sync is possible there).

    Returns:
        loss (float32; float64 for float64 logits): 0-d for "mean"/"sum", target's shape for "none";
        or ``(loss, nll)`` when ``return_nll``.
    """
    _check_args(logits, target, label_smoothing, ignore_index, reduction)
    if check_targets:
        _check_target_values(target, logits.shape[-1], ignore_index)
    label_smoothing, ignore_index = float(label_smoothing), int(ignore_index)
    if (_backend.force_reference() or logits.dtype not in limits.KERNEL_DTYPES
            or not _backend.has_op_impl(logits.device)):
        return cross_entropy_ref(logits, target, label_smoothing, ignore_index, reduction, return_nll)
    logits2d = logits.reshape(-1, logits.shape[-1])
    inplace = bool(inplace_backward) and not torch.compiler.is_compiling()
    if inplace and not logits2d.is_contiguous():  # one copy, saved; the backward writes into it
        logits2d = logits2d.contiguous()
    target1d = target.reshape(-1)
    loss_rows, nll_rows, _ = torch.ops.lsmini.cross_entropy.default(logits2d, target1d, label_smoothing, ignore_index,
                                                                     inplace)
    count = (target1d != ignore_index).sum() if reduction == "mean" else None  # on the device: no sync
    loss = _reduce(loss_rows, count, reduction, target.shape)
    return (loss, _reduce(nll_rows, count, reduction, target.shape)) if return_nll else loss
