"""The label-smoothed softmax cross-entropy criteria on lsmini's fused kernel: CrossEntropyLoss (of logits) and
LinearCrossEntropyLoss (of the features before the output projection, never holding all the logits)."""
import numbers

from torch import nn

from lsmini.ops.cross_entropy import REDUCTIONS, cross_entropy
from lsmini.ops.linear_cross_entropy import REDUCTIONS as LINEAR_REDUCTIONS, check_chunk_tokens, linear_cross_entropy


def _set_options(module, owner, label_smoothing, ignore_index, reduction, reductions):
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) \
            or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{owner}: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"{owner}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if reduction not in reductions:
        raise ValueError(f"{owner}: reduction must be one of {reductions}, got {reduction!r}")
    module.label_smoothing = float(label_smoothing)
    module.ignore_index = int(ignore_index)
    module.reduction = reduction


class CrossEntropyLoss(nn.Module):
    """Label-smoothed cross-entropy with the class dimension LAST (logits [..., V], target [...] int64).

    Semantics of ``torch.nn.functional.cross_entropy`` otherwise (see ``lsmini.ops.cross_entropy``):
    ``reduction`` "mean" averages over non-ignored targets, "sum", or "none" (target's shape); targets
    equal to ``ignore_index`` contribute nothing. The loss is float32 (float64 for float64 logits).

    forward(logits, target, return_nll=False) → loss, or (loss, nll) with the plain negative
    log-likelihood (same reduction, detached) for logging.

    Attributes a training loop may set: ``check_targets`` (default True: validate target ids, one host
    sync per call) and ``inplace_backward`` (default False: the CUDA backward writes the logits'
    gradient into the logits' storage; only when nothing else needs the logits after the loss).
    """

    def __init__(self, label_smoothing=0.0, ignore_index=-100, reduction="mean", inplace_backward=False,
                 check_targets=True):
        super().__init__()
        _set_options(self, "CrossEntropyLoss", label_smoothing, ignore_index, reduction, REDUCTIONS)
        self.inplace_backward = bool(inplace_backward)
        self.check_targets = bool(check_targets)

    def forward(self, logits, target, return_nll=False):
        return cross_entropy(logits, target, self.label_smoothing, self.ignore_index, self.reduction, return_nll,
                             inplace_backward=self.inplace_backward, check_targets=self.check_targets)

    def extra_repr(self):
        return f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, reduction={self.reduction!r}"


class LinearCrossEntropyLoss(nn.Module):
    """The output projection and CrossEntropyLoss in one: ``forward(features, weight, target)`` equals
    ``CrossEntropyLoss(...)(F.linear(features, weight), target)`` and never holds more than one chunk of the
    logits (``lsmini.ops.linear_cross_entropy``: the logits' gradient is computed in the forward, chunk by
    chunk). With lsmini's models: ``crit(model(src, tgt_in, features_only=True), model.output_weight(), tgt_out)``.

    forward(features, weight, target, return_nll=False) → loss, or (loss, nll). ``reduction`` is "mean" or
    "sum" (per-row losses need the logits: CrossEntropyLoss); ``chunk_tokens`` rows per chunk (None:
    ``lsmini.ops.linear_cross_entropy.default_chunk_tokens``); ``check_targets`` as in CrossEntropyLoss.
    """

    def __init__(self, label_smoothing=0.0, ignore_index=-100, reduction="mean", check_targets=True,
                 chunk_tokens=None):
        super().__init__()
        _set_options(self, "LinearCrossEntropyLoss", label_smoothing, ignore_index, reduction, LINEAR_REDUCTIONS)
        check_chunk_tokens("LinearCrossEntropyLoss", chunk_tokens)
        self.chunk_tokens = chunk_tokens
        self.check_targets = bool(check_targets)

    def forward(self, features, weight, target, return_nll=False):
        return linear_cross_entropy(features, weight, target, self.label_smoothing, self.ignore_index, self.reduction,
                                    return_nll, check_targets=self.check_targets, chunk_tokens=self.chunk_tokens)

    def extra_repr(self):
        return (f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, "
                f"reduction={self.reduction!r}, chunk_tokens={self.chunk_tokens}")
