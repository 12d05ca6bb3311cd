"""The training loop both examples run: the Trainer (FusedAdam, the inverse-square-root schedule, loss
scaling, the position in the data; each step one lsmini.train.TrainStep over this rank's share of the step's
batches, so gradient accumulation, data parallelism and --cuda-graph are TrainStep's; the progress bar and
log lines, periodic validation and checkpoints), its state for an exact resume (also under another number
of processes), and the loss criteria it minimises and validates with."""
import math
import sys
import time

import torch
from tqdm import tqdm

from .batching import epoch_order
from .checkpoints import check_same_model, rng_state, save_checkpoint, set_rng_state
from .data import DataError
from .runtime import Distributed, rank_seed
from .tokenizer import PAD


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

    def __init__(self, args, model, device, dtype, dist=None):
        from lsmini.optim import FusedAdam, LossScaler
        from lsmini.train import inverse_sqrt_schedule

        self.args, self.model, self.device, self.dtype = args, model, device, dtype
        self.dist = dist if dist is not None else Distributed()
        self.optimizer = FusedAdam(model, lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=args.weight_decay,
                                   adam_w_mode=True, max_grad_norm=args.clip_norm or None)
        self.scheduler = inverse_sqrt_schedule(self.optimizer, args.warmup)
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
                 "train_loss": self.train_loss, "valid_loss": self.valid_loss, "rng": rng}
        if self.dist.active:
            state["rng_per_rank"] = self.dist.gather(rng)
        return state

    def load_state_dict(self, state):
        """Restore a checkpoint (of any world size). Returns a note when the RNG streams could not be
        restored per rank (another world size), else None."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch, self.batch_in_epoch = state["step"], state["epoch"], state["batch_in_epoch"]
        self.train_loss, self.valid_loss = state["train_loss"], state["valid_loss"]
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

    def finished(self, num_batches):
        a = self.args
        return ((a.max_steps is not None and self.step >= a.max_steps)
                or (a.epochs is not None and self.epoch >= a.epochs))

    def steps_per_epoch(self, num_batches):
        per_step = self.batches_per_step
        if num_batches < per_step:
            raise DataError(f"the training data makes {num_batches} batches, but one step takes {per_step} "
                            f"({self.dist.world} process(es) x --update-freq {self.args.update_freq}); lower "
                            "--max-tokens, --update-freq or the number of processes")
        return num_batches // per_step

    # -- loop --
    def train(self, batches, loss_fn, validate, save, log):
        """Train until --max-steps or --epochs; validate (and save) every --eval-every steps (default: at the
        end of each epoch) and at the end. `validate(model) -> mean NLL per token`; `save()` writes the
        checkpoint."""
        from lsmini.train import TrainStep

        a, model, device, dist = self.args, self.model, self.device, self.dist
        n = len(batches)
        per_step, world, rank = self.batches_per_step, dist.world, dist.rank
        steps_per_epoch = self.steps_per_epoch(n)
        pin = device.type == "cuda"
        total = a.max_steps if a.max_steps is not None else a.epochs * steps_per_epoch
        if a.max_steps is not None and a.epochs is not None:
            total = min(a.max_steps, a.epochs * steps_per_epoch)
        if self.finished(n):
            log(f"nothing to train: step {self.step}, epoch {self.epoch} already reached the limits")
            return
        bar = tqdm(total=total, initial=self.step, unit="step", dynamic_ncols=True,
                   disable=a.no_progress or not dist.is_main, file=sys.stderr, desc="train")
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        window_tokens, window_steps = 0, 0
        window_start = time.perf_counter()
        if self.batch_in_epoch + per_step > n:  # resumed under a larger world x update-freq: the epoch is done
            self.epoch += 1
            self.batch_in_epoch = 0
        order = epoch_order(n, a.seed, self.epoch)
        model.train()
        # --cuda-graph: the step is recorded once per batch shape, after one eager step of that shape
        train_step = TrainStep(lambda *batch: loss_fn(model, batch), self.optimizer, self.scaler,
                               cuda_graph=a.cuda_graph, graph_warmup=1)

        def flush():
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
            bar.set_postfix(loss=f"{self.train_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:,.0f}", refresh=False)
            if a.no_progress:
                log(f"step {self.step} | epoch {self.epoch + 1} | loss {self.train_loss:.3f} | lr {lr:.2e} | "
                    f"{tps:,.0f} tok/s")
            loss_sum.zero_()
            window_tokens, window_steps = 0, 0
            window_start = time.perf_counter()

        while not self.finished(n):
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
            bar.update(1)
            last = self.finished(n)
            evaluate = last or (a.eval_every is not None and self.step % a.eval_every == 0) or \
                (a.eval_every is None and epoch_done)
            if evaluate or self.step % a.log_every == 0:
                flush()
            if evaluate:
                self.valid_loss = validate(model)
                model.train()
                save()
                bar.refresh()
                log(f"step {self.step} | epoch {self.epoch + (0 if epoch_done else 1)} | train loss "
                    f"{self.train_loss:.3f} | valid loss {self.valid_loss:.3f} | "
                    f"valid ppl {safe_exp(self.valid_loss):.2f}")
                window_start = time.perf_counter()
        bar.close()
        # free the graphs' memory; under torchrun the process group cannot shut down while they live
        train_step.reset()


def safe_exp(x):
    return math.exp(min(x, 700.0))


def start_trainer(args, model, model_config, ckpt, ckpt_path, device, dtype, log, dist=None):
    """A Trainer for `model`; with --resume, restored from the checkpoint `ckpt` (loaded from ckpt_path; it
    must hold the same model). Under torchrun every rank restores from the same checkpoint file."""
    trainer = Trainer(args, model, device, dtype, dist)
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
                       loss_fn, logits_and_target, nll_criterion, device, log):
    """Run the training loop (validating and checkpointing as configured) and make sure a validation loss
    exists at the end. logits_and_target(model, batch on device) -> (logits, target) for validation;
    tokenizer: the checkpoints' record of the run's tokenizer (checkpoints.tokenizer_record).
    Under torchrun each rank validates every world-th batch and the sums are added up; rank 0 writes the
    checkpoints."""
    pin = device.type == "cuda"
    dist = trainer.dist

    @torch.no_grad()
    def validate(model):
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(dist.rank, len(valid_batches), dist.world):
            batch = tuple(t.to(device, non_blocking=True) for t in valid_batches.get(i, pin))
            total += nll_criterion(*logits_and_target(model, batch))
        tokens = sum(valid_batches.tokens(i) for i in range(len(valid_batches)))
        return dist.sum_(total).item() / tokens

    def save():
        state = trainer.state_dict()  # on every rank: it gathers the ranks' RNG states
        if dist.is_main:
            save_checkpoint(ckpt_path, {"model_config": model_config, "trainer": state, "args": vars(args),
                                        "tokenizer": tokenizer})

    trainer.train(train_batches, loss_fn, validate, save, log)
    if trainer.valid_loss is None:
        trainer.valid_loss = validate(model)
