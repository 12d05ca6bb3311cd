"""The training loop both examples run: the Trainer (FusedAdam, the inverse-square-root schedule, loss
scaling, the position in the data; each step one lsmini.train.TrainStep over this rank's share of the step's
batches, so gradient accumulation, data parallelism and --cuda-graph are TrainStep's; the progress bar and
log lines, periodic validation and checkpoints, the best checkpoint and --keep-last, early stopping by
--patience and --max-time, the divergence check), its state for an exact resume (also under another number
of processes), and the loss criteria it minimises and validates with."""
import math
import os
import signal
import sys
import time

import torch
from tqdm import tqdm

from .batching import epoch_order
from .checkpoints import (BEST_NAME, CheckpointWriter, check_same_model, copy_checkpoint, keep_periodic, rng_state,
                          set_rng_state)
from .data import DataError
from .interrupt import StopSignals, exit_status
from .runtime import Distributed, rank_seed
from .tokenizer import PAD
from .trainlog import TrainLog


class Trainer:
    """Optimizer (FusedAdam, betas 0.9/0.98), inverse-sqrt schedule, loss scaler and the step/epoch/batch
    position, with a loop that never waits for the device inside a step. Each optimizer step is one
    lsmini.train.TrainStep call over this rank's micro-batches of the step (gradient accumulation, the
    data-parallel reduction and the --cuda-graph recording happen there).

    `loss_fn(model, batch_on_device) -> (loss_sum, nll_sum)`: the training loss summed over the batch's
    target tokens (to backpropagate) and the summed negative log-likelihood (detached; stays on the device).
    `batches`: `len()`, `get(i, pin) -> tuple of CPU tensors`, `tokens(i) -> int` (target tokens of batch i).

    One optimizer step consumes world × --update-freq batches of the epoch's order; `batch_in_epoch`
    counts the batches consumed by all ranks, so a checkpoint also resumes under another world size.
    """

    def __init__(self, args, model, device, dtype, dist=None, vocab_size=None):
        from lsmini.optim import FusedAdam, LossScaler
        from lsmini.train import inverse_sqrt_schedule

        self.args, self.model, self.device, self.dtype = args, model, device, dtype
        self.dist = dist if dist is not None else Distributed()
        self.optimizer = FusedAdam(model, lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=args.weight_decay,
                                   adam_w_mode=True, max_grad_norm=args.clip_norm or None)
        self.scheduler = inverse_sqrt_schedule(self.optimizer, args.warmup, args.total_steps, args.cooldown)
        self.scaler = LossScaler(enabled=dtype == torch.float16)
        if self.dist.active:
            from lsmini.distributed import GradientReducer

            # after FusedAdam, which lays the workspace out; broadcasts rank 0's parameters. The workspace
            # keeps the reducer, and each TrainStep reduces through it.
            GradientReducer(self.optimizer)
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.train_loss = None  # mean NLL per target token over the latest logging window (all ranks)
        self.valid_loss = None
        self.session_tokens = 0  # target tokens trained on in this run, all ranks together
        self.session_time = 0.0  # seconds spent in training steps in this run (validation excluded)
        self.valid_bleu = None  # validation BLEU of the latest validation (--eval-bleu)
        self.best = None  # {"metric", "value", "step"} of the best validation so far (--best-metric)
        self.bad_validations = 0  # validations since the best one (--patience)
        self.loss_min = None  # the lowest window training loss so far (divergence check)
        self.exploding = 0  # log windows in a row with a training loss above EXPLODE_FACTOR x loss_min
        # the loss no model should reach (absurd_loss_limit) for this vocabulary, and the log windows in a
        # row above it; None: no vocabulary given, no absolute check
        self.loss_limit = absurd_loss_limit(vocab_size) if vocab_size else None
        self.vocab_size = vocab_size
        self.absurd = 0
        self.saved_step = None  # step of the latest checkpoint this run wrote
        self.train_log = TrainLog(None, 0.0, enabled=False)  # train_and_validate sets the run's log
        self.time_budget_start = None  # --max-time counts from here (the start of the training loop)
        self.stopped_by = None  # why the training loop of this run ended
        # the log window a signal stopped the run in ({"nll", "tokens", "steps", "seconds"}; None when it
        # stopped at a window's end): a resumed run goes on summing it, so its log lines are the straight run's
        self.window = None

    @property
    def batches_per_step(self):
        return self.dist.world * self.args.update_freq

    # -- state --
    def state_dict(self):
        """The checkpoint's trainer state. Under torchrun every rank must call it (it gathers each rank's
        RNG state, so dropout continues exactly on resume)."""
        rng = rng_state(self.device)
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                 "step": self.step, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                 "train_loss": self.train_loss, "valid_loss": self.valid_loss, "valid_bleu": self.valid_bleu,
                 "best": self.best, "bad_validations": self.bad_validations, "loss_min": self.loss_min,
                 "exploding": self.exploding, "absurd": self.absurd, "window": self.window, "rng": rng}
        if self.dist.active:
            state["rng_per_rank"] = self.dist.gather(rng)
        return state

    def load_state_dict(self, state):
        """Restore a checkpoint (of any world size). Returns a note when the RNG streams could not be
        restored per rank (another world size), else None."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # the checkpoint's warmup, the cooldown of this run's plan (a resumed run may plan more steps)
        schedule = self.scheduler.lr_lambdas[0]
        schedule.total, schedule.cooldown = self.args.total_steps, self.args.cooldown
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["lr"] = base * schedule(self.scheduler.last_epoch)
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.train_loss, self.valid_loss = state["train_loss"], state["valid_loss"]
        # absent from checkpoints written before early stopping and divergence checks existed
        self.valid_bleu, self.best = state.get("valid_bleu"), state.get("best")
        self.bad_validations, self.loss_min = state.get("bad_validations", 0), state.get("loss_min")
        self.exploding, self.absurd = state.get("exploding", 0), state.get("absurd", 0)
        self.window = state.get("window")
        if self.best is not None and self.best.get("metric") != self.args.best_metric:
            self.best, self.bad_validations = None, 0  # another --best-metric: start its record afresh
        per_rank = state.get("rng_per_rank")
        if not self.dist.active:
            set_rng_state(state["rng"], self.device)
        elif per_rank is not None and len(per_rank) == self.dist.world:
            set_rng_state(per_rank[self.dist.rank], self.device)
        else:
            torch.manual_seed(rank_seed(self.args.seed + self.step, self.dist.rank))
            return (f"the checkpoint was written by {len(per_rank) if per_rank else 1} process(es), this run has "
                    f"{self.dist.world}: dropout continues from fresh per-rank seeds")
        return None

    def stop_reason(self):
        """Why training must not go on (--max-steps, --epochs, --patience), or None."""
        a = self.args
        if a.max_steps is not None and self.step >= a.max_steps:
            return f"--max-steps {a.max_steps} reached"
        if a.epochs is not None and self.epoch >= a.epochs:
            return f"--epochs {a.epochs} done"
        if a.patience is not None and self.bad_validations >= a.patience:
            best = self.best or {}
            return (f"early stop: {a.best_metric} did not improve in {self.bad_validations} validations "
                    f"(--patience {a.patience}; best {best.get('value', float('nan')):.3f} at step "
                    f"{best.get('step')})")
        return None

    def finished(self, num_batches=None):
        return self.stop_reason() is not None

    def update_best(self, valid_loss, bleu):
        """Record this validation against the best one of --best-metric; True when it improved."""
        metric = self.args.best_metric
        value = valid_loss if metric == "valid_loss" else bleu
        if value is None:
            return False
        best = self.best["value"] if self.best else None
        improved = best is None or (value < best if metric == "valid_loss" else value > best)
        if improved:
            self.best = {"metric": metric, "value": float(value), "step": self.step}
            self.bad_validations = 0
        else:
            self.bad_validations += 1
        return improved

    def check_divergence(self, loss, what):
        """Stop the run (TrainingDiverged) when `loss` is not finite, or when the training loss has stayed
        above EXPLODE_FACTOR x its running minimum, or above the absolute limit of the vocabulary
        (absurd_loss_limit), for EXPLODE_WINDOWS log windows in a row. The relative check alone misses a run
        that is garbage from its first window on (its minimum is garbage too)."""
        if not math.isfinite(loss):
            raise TrainingDiverged(f"training diverged at step {self.step}: the {what} is {loss}")
        if what != "training loss":
            return
        if self.loss_min is None or loss < self.loss_min:
            self.loss_min = loss
        self.exploding = self.exploding + 1 if loss > EXPLODE_FACTOR * self.loss_min else 0
        self.absurd = self.absurd + 1 if self.loss_limit is not None and loss > self.loss_limit else 0
        if self.exploding >= EXPLODE_WINDOWS:
            raise TrainingDiverged(
                f"training diverged at step {self.step}: the training loss ({loss:.3f}) has been above "
                f"{EXPLODE_FACTOR:g} x its lowest value ({self.loss_min:.3f}) for {self.exploding} log windows in a "
                "row")
        if self.absurd >= EXPLODE_WINDOWS:
            raise TrainingDiverged(
                f"training diverged at step {self.step}: the training loss ({loss:.3f} nats/token) has been above "
                f"{self.loss_limit:.1f} for {self.absurd} log windows in a row, far worse than a uniform guess over "
                f"the {self.vocab_size} tokens of the vocabulary (ln {self.vocab_size} = "
                f"{math.log(self.vocab_size):.2f})")

    def watch_note(self):
        """Why the current state may be diverging (no checkpoint may replace the last good one), or None."""
        if self.absurd and not self.exploding:
            return (f"the training loss is above {self.loss_limit:.1f}, far worse than a uniform guess "
                    f"(divergence watch, {self.absurd} of {EXPLODE_WINDOWS} windows)")
        if self.exploding:
            return (f"the training loss is above {EXPLODE_FACTOR:g} x its lowest value (divergence watch, "
                    f"{self.exploding} of {EXPLODE_WINDOWS} windows)")
        return None

    def steps_per_epoch(self, num_batches):
        per_step = self.batches_per_step
        if num_batches < per_step:
            raise DataError(f"the training data makes {num_batches} batches, but one step takes {per_step} "
                            f"({self.dist.world} process(es) x --update-freq {self.args.update_freq}); lower "
                            "--max-tokens, --update-freq or the number of processes")
        return num_batches // per_step

    # -- loop --
    def train(self, batches, loss_fn, validate, save, log, signals=None):
        """Train until --max-steps, --epochs, --patience or --max-time; validate (and save) every --eval-every
        steps (default: at the end of each epoch) and at the end. `validate(model) -> (mean NLL per token,
        BLEU or None)`; `save(improved, validated=True)` writes the checkpoints (improved: the best validation
        so far; validated False: checkpoint_last.pt alone, of a step that was not validated).
        Raises TrainingDiverged (before saving anything of the diverged state) when the loss diverges, and
        TrainingInterrupted when `signals` (interrupt.StopSignals) received a signal: after the step it arrived
        in, with that step's state saved (validated first when the step is due for validation, as the last one
        is). One arriving during the last validation is left to the caller (the run has ended as it would have)."""
        from lsmini.train import TrainStep

        a, model, device, dist = self.args, self.model, self.device, self.dist
        n = len(batches)
        per_step, world, rank = self.batches_per_step, dist.world, dist.rank
        steps_per_epoch = self.steps_per_epoch(n)
        pin = device.type == "cuda"
        total = a.max_steps if a.max_steps is not None else a.epochs * steps_per_epoch
        if a.max_steps is not None and a.epochs is not None:
            total = min(a.max_steps, a.epochs * steps_per_epoch)
        reason = self.stop_reason()
        if reason is not None:
            self.stopped_by = reason
            log(f"nothing to train: the run is at step {self.step} ({self.epoch} epoch(s) completed) and {reason}")
            return
        bar = tqdm(total=total, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=a.no_progress or not dist.is_main, file=sys.stderr,
                   desc=f"epoch {self.epoch + 1}")
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        window_tokens, window_steps = 0, 0
        window_start = time.perf_counter()
        self.time_budget_start = window_start
        if self.window is not None:  # resumed inside the log window a signal stopped the run in
            if dist.is_main:  # the sum over all ranks: once
                loss_sum.fill_(self.window["nll"])
            window_tokens, window_steps = self.window["tokens"], self.window["steps"]
            window_start -= self.window["seconds"]
            self.window = None
        if self.batch_in_epoch + per_step > n:  # resumed under a larger world x update-freq: the epoch is done
            self.epoch += 1
            self.batch_in_epoch = 0
        order = epoch_order(n, a.seed, self.epoch)
        model.train()
        # the step is recorded as a CUDA graph once per batch shape, after one eager step of that shape
        train_step = TrainStep(lambda *batch: loss_fn(model, batch), self.optimizer, self.scaler,
                               cuda_graph=a.cuda_graph, graph_warmup=1)

        def flush(step_epoch):
            nonlocal window_tokens, window_steps, window_start
            if window_steps == 0:
                return
            total_nll = dist.sum_(loss_sum).item()  # the one device read-back per window
            elapsed = time.perf_counter() - window_start
            self.train_loss = float(total_nll / max(window_tokens, 1))
            self.session_tokens += window_tokens
            self.session_time += elapsed
            lr = self.optimizer.param_groups[0]["lr"]
            tps = window_tokens / max(elapsed, 1e-9)
            record = {"kind": "train", "step": self.step, "epoch": step_epoch, "train_loss": self.train_loss,
                      "lr": lr, "tokens_per_s": tps}
            try:
                self.check_divergence(self.train_loss, "training loss")
            except TrainingDiverged:
                self.train_log.write({**record, "diverged": True}, time.perf_counter())
                raise
            self.train_log.write(record, time.perf_counter())
            bar.set_postfix(loss=f"{self.train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
            if a.no_progress:
                log(f"step {self.step} | epoch {step_epoch} | loss {self.train_loss:.3f} | lr {lr:.2e} | "
                    f"{tps:,.0f} tok/s")
            loss_sum.zero_()
            window_tokens, window_steps = 0, 0
            window_start = time.perf_counter()

        stop = None
        while stop is None:
            step_epoch = self.epoch + 1  # the epoch this step belongs to, as every line about it says
            step_batches = order[self.batch_in_epoch:self.batch_in_epoch + per_step]
            step_tokens = sum(int(batches.tokens(b)) for b in step_batches)
            # summed token losses / (all ranks' tokens / world): the reducer's average over the ranks then
            # is the gradient of the step's mean token loss (in one process: sum / tokens = the mean)
            denominator = max(step_tokens, 1) / world
            micro_batches = [tuple(t.to(device, non_blocking=True) for t in batches.get(b, pin))
                             for b in step_batches[rank::world]]
            loss_sum.add_(train_step(*micro_batches, loss_weight=1.0 / denominator))
            self.scheduler.step()
            window_tokens += step_tokens
            window_steps += 1
            self.step += 1
            self.batch_in_epoch += per_step
            epoch_done = self.batch_in_epoch + per_step > n
            if epoch_done:
                self.epoch += 1
                self.batch_in_epoch = 0
                order = epoch_order(n, a.seed, self.epoch)
            bar.set_description(f"epoch {step_epoch}", refresh=False)
            bar.update(1)
            stop = self.stop_reason() or self.out_of_time()
            evaluate = stop is not None or (a.eval_every is not None and self.step % a.eval_every == 0) or \
                (a.eval_every is None and epoch_done)
            if evaluate or self.step % a.log_every == 0:
                flush(step_epoch)
            signum = signals.received_by_any() if signals is not None else None
            if signum is not None and not evaluate:  # save this step as it is, unvalidated, and stop
                if window_steps:
                    self.window = {"nll": dist.sum_(loss_sum).item(), "tokens": window_tokens, "steps": window_steps,
                                   "seconds": time.perf_counter() - window_start}
                watch = self.watch_note()
                if not watch:  # as at a validation: a state that may be diverging replaces no good checkpoint
                    save(False, validated=False)
                    self.saved_step = self.step
                bar.close()
                train_step.reset()
                raise TrainingInterrupted(signum, self.step, watch)
            if evaluate:
                self.valid_loss, self.valid_bleu = validate(model)
                self.check_divergence(self.valid_loss, "validation loss")
                improved = self.update_best(self.valid_loss, self.valid_bleu)
                model.train()
                watch = self.watch_note()
                if watch:  # a state that may be diverging must not replace the last good checkpoint
                    log(f"step {self.step}: no checkpoint written: {watch}")
                else:
                    save(improved)
                    self.saved_step = self.step
                self.train_log.write({"kind": "valid", "step": self.step, "epoch": step_epoch,
                                      "train_loss": self.train_loss, "valid_loss": self.valid_loss,
                                      "valid_ppl": safe_exp(self.valid_loss), "bleu": self.valid_bleu,
                                      "lr": self.optimizer.param_groups[0]["lr"]}, time.perf_counter())
                bar.refresh()
                log(f"step {self.step} | epoch {step_epoch} | train loss {self.train_loss:.3f} | valid loss "
                    f"{self.valid_loss:.3f} | valid ppl {format_ppl(self.valid_loss)}" +
                    (f" | valid BLEU {self.valid_bleu:.2f}" if self.valid_bleu is not None else "") +
                    (" | best" if improved else ""))
                if stop is None:
                    stop = self.stop_reason()  # --patience is decided by this validation
                window_start = time.perf_counter()
                # a signal in a step due for validation stops the run once that validation is done and saved:
                # the resumed run's validations, best checkpoint and --patience are then the straight run's
                if signum is not None:
                    bar.close()
                    train_step.reset()
                    raise TrainingInterrupted(signum, self.step, watch)
        bar.close()
        self.stopped_by = stop
        if not stop.startswith(("--max-steps", "--epochs")):
            log(f"stopped at step {self.step}: {stop}")
        # free the graphs' memory; under torchrun the process group cannot shut down while they live
        train_step.reset()

    def out_of_time(self):
        """The --max-time reason when the training loop's wall-clock budget is spent, else None. Every rank
        takes rank 0's decision, so all stop at the same step."""
        a = self.args
        if a.max_time is None:
            return None
        spent = time.perf_counter() - self.time_budget_start >= a.max_time
        if self.dist.active:
            flag = torch.tensor([1.0 if spent else 0.0], device=self.device)
            torch.distributed.broadcast(flag, src=0)
            spent = bool(flag.item())
        return f"--max-time {a.max_time:g}s spent" if spent else None


class TrainingDiverged(RuntimeError):
    """The loss became non-finite or exploded; the run stops without saving the diverged state."""


class TrainingInterrupted(Exception):
    """SIGINT or SIGTERM (`signum`) stopped the run after `step`; `watch`: why that step's state was not
    saved (the divergence watch), else None. `message`: the line to print (None: print nothing, ranks > 0);
    `exit_status`: 128 + the signal's number."""

    def __init__(self, signum, step, watch=None, message=None):
        super().__init__(message or f"{signal.Signals(signum).name} after step {step}")
        self.signum, self.step, self.watch, self.message = signum, step, watch, message
        self.exit_status = exit_status(signum)


# A training loss above EXPLODE_FACTOR x its lowest window value for EXPLODE_WINDOWS log windows in a row
# counts as divergence: a single noisy window (a batch of rare long sentences) is not enough, but a run
# whose loss has blown up stops within a few --log-every intervals instead of training on garbage.
EXPLODE_FACTOR = 10.0
EXPLODE_WINDOWS = 3
# The absolute line, for a run that is garbage from its first window (its lowest value is garbage too): a
# uniform guess over a vocabulary of V tokens scores ln V nats per token, and a freshly initialised model
# scores about that (ln V + 2 for the tiny LM at V = 300: its initial logits have a spread of a few units).
# A mean loss of 2 ln V gives the right token probability 1/V^2 on average, V times less than guessing:
# no model that learns gets there. The 4 nats on top (a factor e^4 ~ 55 in probability) keep a small
# vocabulary, where 2 ln V is only a few nats above ln V, clear of the first windows of a healthy run.
ABSURD_LOSS_FACTOR = 2.0
ABSURD_LOSS_MARGIN = 4.0


def absurd_loss_limit(vocab_size):
    """The training loss (nats/token) above which a model over `vocab_size` tokens is diverging."""
    return ABSURD_LOSS_FACTOR * math.log(vocab_size) + ABSURD_LOSS_MARGIN


def safe_exp(x):
    return math.exp(min(x, 700.0))


def format_ppl(loss):
    """The perplexity exp(loss) for a log line: two decimals up to 1e6, above that in exponent form computed
    from the loss itself (a diverged loss of 1e5 nats is e^100000, far past what a float holds; printed
    whole it would be hundreds of digits)."""
    if not math.isfinite(loss):
        return str(math.exp(loss))
    if loss < math.log(1e6):
        return f"{math.exp(loss):.2f}"
    exponent = loss / math.log(10)
    whole = math.floor(exponent)
    mantissa = 10 ** (exponent - whole)
    if mantissa >= 9.995:  # rounds up to 10.0: carry into the exponent
        mantissa, whole = 1.0, whole + 1
    return f"{mantissa:.2f}e+{whole}"


def divergence_advice(args):
    """What to try after a diverged run, with this run's values."""
    clip = ("--clip-norm 1 (gradient clipping is off in this run)" if not args.clip_norm
            else f"a lower --clip-norm (this run: {args.clip_norm:g})")
    return f"Try a lower --lr (this run: {args.lr:g}), {clip}, or a longer --warmup"


def start_trainer(args, model, model_config, ckpt, ckpt_path, device, dtype, log, dist=None):
    """A Trainer for `model`; with --resume, restored from the checkpoint `ckpt` (loaded from ckpt_path; it
    must hold the same model). Under torchrun every rank restores from the same checkpoint file."""
    trainer = Trainer(args, model, device, dtype, dist, vocab_size=model_config.get("vocab_size"))
    if trainer.dist.active:
        torch.manual_seed(rank_seed(args.seed, trainer.dist.rank))  # dropout differs per rank, init did not
    if args.resume:
        check_same_model(ckpt["model_config"], model_config, ckpt_path)
        note = trainer.load_state_dict(ckpt["trainer"])
        log(f"resumed from {ckpt_path} at step {trainer.step} (epoch {trainer.epoch + 1}, batch "
            f"{trainer.batch_in_epoch})")
        if note:
            log(f"note: {note}")
    return trainer


def interrupted_message(e, ckpt_path, saved_step, resumed):
    """The line a run stopped by a signal (TrainingInterrupted `e`) ends with: where its state is."""
    head = f"interrupted by {signal.Signals(e.signum).name} after step {e.step}: "
    if e.watch is None:
        return head + f"checkpoint written to {ckpt_path} (step {e.step}); continue with the same command and --resume"
    kept = (f"{ckpt_path} (step {saved_step}) keeps the last good state" if saved_step is not None
            else "no checkpoint of this run was written" + (f"; {ckpt_path} is the resumed one, unchanged"
                                                              if resumed else ""))
    return head + f"no checkpoint of this step was written ({e.watch}); {kept}"


def make_criteria(label_smoothing):
    """(training criterion, summed plain-NLL criterion for validation), both on lsmini's fused loss and
    summed over the tokens (the training loop divides by the step's token count)."""
    from lsmini.layers import CrossEntropyLoss

    # the logits' producer (the output projection) does not need them in backward: the criterion's
    # gradient may overwrite them in place
    criterion = CrossEntropyLoss(label_smoothing=label_smoothing, ignore_index=PAD, reduction="sum",
                                 check_targets=False, inplace_backward=True)
    nll_criterion = CrossEntropyLoss(ignore_index=PAD, reduction="sum", check_targets=False)
    return criterion, nll_criterion


def train_and_validate(trainer, args, model, model_config, tokenizer, ckpt_path, train_batches, valid_batches,
                       loss_fn, logits_and_target, nll_criterion, device, log, eval_bleu=None, start_time=None,
                       record=None):
    """Run the training loop (validating and checkpointing as configured) and make sure a validation loss
    exists at the end. logits_and_target(model, batch on device) -> (logits, target) for validation;
    tokenizer: the checkpoints' record of the run's tokenizer (checkpoints.tokenizer_record); eval_bleu(model)
    -> validation BLEU (--eval-bleu; on every rank, the same value); record: more fields of the checkpoints
    (the example that wrote them, "task"; the run's data files, "data"). Under torchrun each rank validates
    every world-th batch and the sums are added up; rank 0 writes the checkpoints and the training log.

    Every validation writes checkpoint_last.pt (on a background thread: checkpoints.CheckpointWriter), then
    copies it to checkpoint_best.pt when --best-metric improved and to checkpoint_<step>.pt under --keep-last
    (the oldest beyond N removed); all are on disk when this returns or raises. Returns
    validate(model) -> mean NLL per token, for scoring other parameters (the best, the average)."""
    pin = device.type == "cuda"
    dist = trainer.dist
    save_dir = os.path.dirname(ckpt_path)
    trainer.train_log = TrainLog(save_dir, start_time if start_time is not None else time.perf_counter(),
                                 enabled=dist.is_main, resume_step=trainer.step if args.resume else None)

    @torch.no_grad()
    def validate_loss(model):
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(dist.rank, len(valid_batches), dist.world):
            batch = tuple(t.to(device, non_blocking=True) for t in valid_batches.get(i, pin))
            total += nll_criterion(*logits_and_target(model, batch))
        tokens = sum(valid_batches.tokens(i) for i in range(len(valid_batches)))
        return dist.sum_(total).item() / tokens

    def validate(model):
        loss = validate_loss(model)
        return loss, (eval_bleu(model) if eval_bleu is not None and math.isfinite(loss) else None)

    writer = CheckpointWriter()

    def save(improved, validated=True):
        state = trainer.state_dict()  # on every rank: it gathers the ranks' RNG states
        if not dist.is_main:
            return
        step = trainer.step

        def copies():  # on the writer's thread, once checkpoint_last.pt is complete
            if improved:
                copy_checkpoint(ckpt_path, os.path.join(save_dir, BEST_NAME))
            if args.keep_last:  # the checkpoints of validations (--average-last averages them)
                copy_checkpoint(ckpt_path, os.path.join(save_dir, f"checkpoint_{step}.pt"))
                keep_periodic(save_dir, args.keep_last)

        writer.save(ckpt_path, {**(record or {}), "model_config": model_config, "trainer": state, "args": vars(args),
                                "tokenizer": tokenizer}, copies if validated else None)

    try:
        try:
            # SIGINT/SIGTERM while training: stop after the step, save it, exit (interrupt.py)
            announce = None if not dist.is_main else "" if args.no_progress else "\n"
            with StopSignals(dist, announce) as signals:
                trainer.train(train_batches, loss_fn, validate, save, log, signals)
                # one that came in the last validation: the run ended as it would have, its last step saved
                signum = signals.received_by_any()
                if signum is not None:
                    raise TrainingInterrupted(signum, trainer.step, None if trainer.saved_step == trainer.step else
                                              trainer.watch_note())
        finally:
            writer.wait()  # every checkpoint on disk before anything reads it, or the run ends
    except TrainingInterrupted as e:
        raise TrainingInterrupted(e.signum, e.step, e.watch,
                                  interrupted_message(e, ckpt_path, trainer.saved_step, args.resume)
                                  if dist.is_main else None) from None
    except TrainingDiverged as e:
        kept = (f"{ckpt_path} (step {trainer.saved_step}) keeps the last good state" if trainer.saved_step is not None
                else "no checkpoint of this run was written" + (f"; {ckpt_path} is the resumed one, unchanged"
                                                                  if args.resume else ""))
        raise TrainingDiverged(f"{e}. Stopped without saving the diverged state: {kept}. {divergence_advice(args)}") \
            from None
    if trainer.valid_loss is None:
        trainer.valid_loss, trainer.valid_bleu = validate(model)
    return validate_loss
