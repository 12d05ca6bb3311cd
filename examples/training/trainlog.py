"""The training log of a run: <save-dir>/train_log.jsonl, one JSON object per line, written by rank 0 as
the run goes (so a killed run keeps its log up to its last line), and at the end a plot of it,
<save-dir>/train_log.png, when matplotlib is installed (`pip install matplotlib`, or lsmini's plot extra:
`pip install --no-build-isolation -e ".[plot]"` in the lsmini clone).

Two kinds of records, both with "step", "epoch" (the epoch the step belongs to, counted from 1), "lr" and
"wall_s" (seconds since the run started):
    {"kind": "train", ..., "train_loss", "tokens_per_s"}      every --log-every steps
    {"kind": "valid", ..., "train_loss", "valid_loss", "valid_ppl", "bleu"}   at every validation
Losses are NLL per target token in nats; "bleu" is null unless --eval-bleu. A resumed run appends, after
dropping the records of steps past the checkpoint it resumes from (a killed run may have logged them).
"""
import json
import math
import os

from .checkpoints import PLOT_NAME, TRAIN_LOG_NAME


def _finite_or_none(x):
    return x if x is None or not isinstance(x, float) or math.isfinite(x) else None


class TrainLog:
    """Appends records to <save_dir>/train_log.jsonl; does nothing when `enabled` is False (ranks > 0)."""

    def __init__(self, save_dir, start_time, enabled=True, resume_step=None):
        self.path = os.path.join(save_dir, TRAIN_LOG_NAME) if enabled else None
        self.start_time, self.enabled = start_time, enabled
        if enabled and resume_step is not None and os.path.isfile(self.path):
            kept = [r for r in read_log(self.path) if r.get("step", 0) <= resume_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.path + ".tmp", self.path)
        elif enabled and resume_step is None and os.path.exists(self.path):
            os.remove(self.path)  # a new run starts a new log

    def write(self, record, now):
        if not self.enabled:
            return
        # JSON has no NaN/inf: a diverged value is written as null (the record says "diverged")
        record = {k: _finite_or_none(v) for k, v in record.items()}
        record["wall_s"] = round(now - self.start_time, 3)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read_log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_log(save_dir, log):
    """Draw train/valid loss, the learning rate and (when computed) BLEU over the steps into
    <save_dir>/train_log.png and say where in one line; without matplotlib, say in one line how to get the
    plot. Returns the path or None."""
    path = os.path.join(save_dir, TRAIN_LOG_NAME)
    if not os.path.isfile(path):
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"plot: the training log is in {path}; for a plot of it (train_log.png) install matplotlib "
            "(pip install matplotlib)")
        return None
    records = read_log(path)
    train = [r for r in records if r.get("kind") == "train" and r.get("train_loss") is not None]
    valid = [r for r in records if r.get("kind") == "valid" and r.get("valid_loss") is not None]
    bleu = [r for r in valid if r.get("bleu") is not None]
    panels = 3 if bleu else 2
    fig, axes = plt.subplots(panels, 1, figsize=(8, 2.6 * panels), sharex=True)
    axes[0].plot([r["step"] for r in train], [r["train_loss"] for r in train], label="train loss")
    axes[0].plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="valid loss")
    axes[0].set_ylabel("NLL / token")
    axes[0].legend()
    lr = [r for r in records if r.get("lr") is not None]
    axes[1].plot([r["step"] for r in lr], [r["lr"] for r in lr])
    axes[1].set_ylabel("learning rate")
    if bleu:
        axes[2].plot([r["step"] for r in bleu], [r["bleu"] for r in bleu], "o-")
        axes[2].set_ylabel("valid BLEU")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = os.path.join(save_dir, PLOT_NAME)
    fig.savefig(out + ".tmp.png", dpi=100)
    plt.close(fig)
    os.replace(out + ".tmp.png", out)
    log(f"plot: the training log drawn in {out}")
    return out
