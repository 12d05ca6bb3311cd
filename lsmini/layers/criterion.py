"""CrossEntropyLoss: the label-smoothed softmax cross-entropy criterion on lsmini's fused kernel."""
import numbers

from torch import nn

from lsmini.ops.cross_entropy import REDUCTIONS, cross_entropy


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
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real) \
                or not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be a float in [0, 1], got {label_smoothing!r}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
            raise TypeError(f"CrossEntropyLoss: ignore_index must be an int, got {type(ignore_index).__name__}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"CrossEntropyLoss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = int(ignore_index)
        self.reduction = reduction
        self.inplace_backward = bool(inplace_backward)
        self.check_targets = bool(check_targets)

    def forward(self, logits, target, return_nll=False):
        return cross_entropy(logits, target, self.label_smoothing, self.ignore_index, self.reduction, return_nll,
                             inplace_backward=self.inplace_backward, check_targets=self.check_targets)

    def extra_repr(self):
        return f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, reduction={self.reduction!r}"
