"""The one main() both examples run, and Task: what an example adds to it.

run_task(task, argv) parses the command line, then either loads the trained model for the task's
inference mode (--translate, --generate; its tokenizer checked against the checkpoint's) or trains: seed,
save directory (one run's: checkpoints.prepare_save_dir), the task's data, the tokenizer (rank 0 first),
the task's batches and model, the Trainer (resumed with --resume), training with validation and checkpoints,
the task's work after training (translating and scoring, sampling), the best and the averaged checkpoints
scored beside the last (--average-last), metrics.json and the plot of the training log. A Task subclass holds
only what differs between the examples: its --arch table, its options, data, model, loss and decoding.
run_main wraps a script's main() into exit codes.
"""
import argparse
import dataclasses
import errno
import functools
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed
from tqdm import tqdm

from . import cli
from .checkpoints import (AVERAGE_NAME, BEST_NAME, CHECKPOINT_NAME, SaveError, average_state_dicts, check_task,
                          check_tokenizer, checkpoint_arch, data_changes, data_record, load_checkpoint, os_error_cause,
                          periodic_checkpoints, prepare_save_dir, save_checkpoint, tokenizer_record, write_atomically)
from .data import DataError
from .runtime import RunSettings, describe_backend, place_model, start_distributed
from .tokenizer import SPM_NAME, load_sentencepiece, unknown_pieces_note
from .trainer import TrainingDiverged, TrainingInterrupted, make_criteria, safe_exp, start_trainer, train_and_validate
from .trainlog import plot_log


@dataclasses.dataclass
class TaskData:
    """What a task's make_batches hook prepared: the tokenizer (a sentencepiece processor), the training
    and validation batches (`len()`, `get(i, pin) -> tuple of CPU tensors`, `tokens(i)`: the target tokens
    of batch i) and the longest sequence the model must take. A task may subclass it with more fields for
    its later hooks."""
    tokenizer: object
    train: object
    valid: object
    max_seq_len: int


class Task:
    """One example, as the hooks run_task calls. Subclasses set the class attributes and implement every
    hook that raises NotImplementedError here."""

    name = None  # the example's name in its checkpoints ("task"; a key of checkpoints.TASKS)
    description = None  # what the script does, for --help
    # the --arch table: name -> layers, hidden, heads, ffn, the defaults of --dropout --lr --warmup --max-tokens,
    # min_steps and (optional) min_epochs, the least steps and epochs of a run without --epochs and --max-steps
    # (cli.default_epochs)
    archs = None
    arch_sizes = None  # the rows of the table in words, for --help
    label_smoothing = None  # the default of --label-smoothing
    default_save_dir = None
    best_metrics = ("valid_loss",)  # the choices of --best-metric
    # the --patience of a run of the default length (None: the whole length): validation after every epoch
    # tells when a small corpus starts to be memorised
    default_patience = None

    # -- command line --
    def add_data_args(self, parser):
        """The data options, in an argument group of their own."""
        raise NotImplementedError

    def add_model_args(self, group):
        """Model options besides --arch and the layer options, into the "model" group."""

    def add_mode_args(self, parser):
        """The options of decoding and of the inference mode, in an argument group of their own."""
        raise NotImplementedError

    def check_data_flags(self, parser, args):
        """Reject an incomplete set of data flags (parser.error); return True when none is given (the
        built-in corpus)."""
        raise NotImplementedError

    def check_args(self, parser, args):
        """Reject task option values that make no sense, once the defaults are filled in (parser.error)."""
        raise NotImplementedError

    def build_parser(self):
        parser = argparse.ArgumentParser(description=self.description)
        self.add_data_args(parser)
        group = parser.add_argument_group("model")
        cli.add_arch_arg(group, self.archs, self.arch_sizes)
        self.add_model_args(group)
        cli.add_layer_args(group, self.label_smoothing, self.archs)
        cli.add_common_args(parser, self.default_save_dir, self.archs, self.best_metrics)
        self.add_mode_args(parser)
        return parser

    def parse_args(self, argv=None):
        """The command line (sys.argv when argv is None), with every default filled in and checked."""
        parser = self.build_parser()
        args = parser.parse_args(argv)
        args.builtin = self.check_data_flags(parser, args)
        args.arch_why = None
        if args.arch is None:
            args.arch, args.arch_why = self.default_arch(args)
        cli.resolve_common_args(parser, args, self.default_save_dir, args.builtin, self.archs[args.arch])
        self.check_args(parser, args)
        if args.checkpoint is not None and self.inference_mode(args) is None:
            parser.error("--checkpoint picks the model that --translate or --generate loads; a training run does "
                         "not read it (--resume continues from checkpoint_last.pt)")
        return args

    def default_arch(self, args):
        """(--arch, why) of a run that names none: with --resume the checkpoint's, else by device
        (cli.default_arch)."""
        if args.resume:
            arch = checkpoint_arch(os.path.join(cli.save_dir(args, self.default_save_dir), CHECKPOINT_NAME))
            if arch in self.archs:
                return arch, "the --arch of the checkpoint --resume continues"
        return cli.default_arch(args.device, torch.cuda.is_available())

    # -- inference mode --
    def inference_mode(self, args):
        """The flag of the inference mode when args ask for it ("--translate"), else None."""
        raise NotImplementedError

    def decoding_rows(self, args):
        """How many sequences decoding runs side by side for one input (beams, samples): the model's batch
        budget covers that many batches of --max-tokens (or of one sequence of max_seq_len positions)."""
        raise NotImplementedError

    def infer(self, args, model, tokenizer, max_seq_len, device):
        """The inference mode, with the trained model of --save-dir (in eval mode)."""
        raise NotImplementedError

    # -- data --
    def read_data(self, args, log, dist):
        """(lines, paths) of every split, read and checked (DataError before anything is trained); the
        built-in corpus is written by rank 0 alone (dist.from_main)."""
        raise NotImplementedError

    def tokenize(self, args, lines, paths, log, train):
        """(sentencepiece processor, token ids of every split); trains the tokenizer when `train`
        (tokenizer.train_or_load). Runs on rank 0 first: the others then read its tokenizer and cache."""
        raise NotImplementedError

    def make_batches(self, args, lines, paths, tokenizer, ids, log):
        """The TaskData (batches built once, up front) for training."""
        raise NotImplementedError

    def data_files(self, paths, ids):
        """[(flag, path, token ids)] of every data file read_data and tokenize gave (the ids: an int array, the
        special ids included or not): the checkpoint records the files (--resume says which changed) and
        a file the tokenizer does not cover is warned about."""
        raise NotImplementedError

    # -- model --
    def model_config(self, args, vocab_size, max_seq_len):
        """The dict a checkpoint stores to rebuild the model; its "config" holds the TransformerConfig fields
        (cli.layer_config)."""
        raise NotImplementedError

    def make_model(self, model_config, layer_config):
        """The model (on CPU, fp32) of model_config, its layers built with the TransformerConfig layer_config."""
        raise NotImplementedError

    def build_model(self, model_config, max_batch_tokens, device, dtype):
        """The model of model_config on `device` in `dtype`, its layers sized for max_batch_tokens tokens."""
        from lsmini.layers import TransformerConfig

        try:
            config = TransformerConfig(**model_config["config"], max_batch_tokens=max_batch_tokens)
        except ValueError as e:
            raise DataError(f"model configuration: {e}") from None
        return place_model(self.make_model(model_config, config), device, dtype)

    # -- loss --
    def logits_and_target(self, model, batch):
        """(logits, target) of a batch on the device; validation scores them."""
        raise NotImplementedError

    def loss(self, criterion, model, batch):
        """(training loss, plain NLL) of a batch, both summed over its target tokens; the NLL detached."""
        return criterion(*self.logits_and_target(model, batch), return_nll=True)

    def validation_scorer(self, args, data, device, dist):
        """None, or scorer(model) -> a validation score computed at every validation besides the loss
        (--eval-bleu: BLEU), the same value on every rank."""
        return None

    # -- after training --
    def after_training(self, args, model, data, device, dist, log):
        """Use the trained model (on every rank); returns the metrics.json fields it adds (rank 0)."""
        raise NotImplementedError

    def score(self, args, model, data, device, dist, log, label):
        """Score other parameters in `model` (label: "best", "average") the way after_training scores the
        last ones, on every rank; returns {metric: value} (rank 0). Default: nothing beyond the valid loss."""
        return {}

    def summary(self, metrics):
        """The results on the last line of a run ("done: N steps, <summary>, <seconds> -> metrics.json")."""
        raise NotImplementedError


def run_task(task, argv=None):
    """Run the example `task` with the command line argv; returns the metrics dict (None in the inference
    mode). Under torchrun every rank runs it; rank 0 prints and writes the files."""
    start = time.perf_counter()
    args = task.parse_args(argv)

    with RunSettings(args.reference):
        inference = task.inference_mode(args)
        dist, device, dtype = start_distributed(args, inference)

        def log(msg):
            if dist.is_main:
                tqdm.write(msg)

        if inference is not None:
            model, sp, max_seq_len = load_trained_model(task, args, inference, device, dtype)
            task.infer(args, model, sp, max_seq_len, device)
            return None
        torch.manual_seed(args.seed)
        ckpt_path = prepare_save_dir(args, log, dist.is_main)
        spm_path = os.path.join(args.save_dir, SPM_NAME)
        ckpt = None
        if args.resume:  # before anything is read or written: the tokenizer must be the checkpoint's
            ckpt = load_checkpoint(ckpt_path)
            check_task(ckpt, task.name, ckpt_path, "--resume")
            check_tokenizer(ckpt, spm_path, ckpt_path, "--resume", log)
        lines, paths = task.read_data(args, log, dist)
        with dist.main_first():  # rank 0 trains the tokenizer and fills the token cache, the others read them
            sp, ids = task.tokenize(args, lines, paths, log, train=dist.is_main)
        files = task.data_files(paths, ids)
        for flag, path, file_ids in files:
            note = unknown_pieces_note(file_ids)
            if note:
                log(f"warning: {flag} {path}: {note}")
        # rank 0 writes the checkpoints and prints
        data_files = data_record({flag: path for flag, path, _ in files}) if dist.is_main else None
        if args.resume and dist.is_main:
            changed = data_changes(ckpt.get("data"), data_files)
            if changed:
                log(f"warning: --resume with other data than the checkpoint's run: {'; '.join(changed)}. Training "
                    "goes on from the checkpoint's step and place in its epoch over the batches of this data, with "
                    "the checkpoint's tokenizer")
        data = task.make_batches(args, lines, paths, sp, ids, log)

        model_config = task.model_config(args, sp.get_piece_size(), data.max_seq_len)
        model = task.build_model(model_config, batch_budget(task, args, data.max_seq_len), device, dtype)
        log(f"model: {args.arch} {type(model).__name__}" + (f" ({args.arch_why})" if args.arch_why else "") +
            f", {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {args.precision} on {device}; "
            f"backend {describe_backend(device)}" + (f"; {dist.world} processes" if dist.active else ""))
        log(args.cuda_graph_note)
        per_epoch = steps_per_epoch(args, len(data.train), dist.world)
        if args.default_length:
            args.epochs, how = cli.default_epochs(args, per_epoch, task.archs[args.arch])
            log(how)
            if args.patience is None and task.default_patience is not None and args.eval_every is None:
                args.patience = task.default_patience
                log(f"early stop: after {args.patience} validations without a better {args.best_metric} (the "
                    f"length above is a ceiling: a small corpus is memorised before it; --patience, --epochs or "
                    f"--max-steps sets it)")
        planned = None if args.max_steps is not None else args.epochs * per_epoch
        args.total_steps = args.max_steps if planned is None else planned
        # the cooldown follows this run's plan, also on --resume (which may plan more steps than the checkpoint)
        args.cooldown, cooldown_how = cli.adapt_cooldown(args, planned, args.total_steps)
        cooldown = (f", falling linearly to 0 over the last {args.cooldown} steps ({cooldown_how})" if args.cooldown
                    else f"; {cooldown_how}")
        if args.resume:  # the warmup continues from the checkpoint
            warmup = _checkpoint_warmup(ckpt)
            log(f"schedule: peak lr {args.lr:g}" +
                (f", warmup {warmup} steps (the checkpoint's run)" if warmup else "") + cooldown)
        else:
            args.warmup, how = cli.adapt_warmup(args, planned, task.archs[args.arch]["warmup"], per_epoch)
            log(f"schedule: peak lr {args.lr:g}, {how}, then lr ∝ 1/sqrt(step){cooldown}")
        trainer = start_trainer(args, model, model_config, ckpt, ckpt_path, device, dtype, log, dist)
        ckpt = None  # restored: free it
        criterion, nll_criterion = make_criteria(args.label_smoothing)
        validate_loss = train_and_validate(
            trainer, args, model, model_config, tokenizer_record(spm_path), ckpt_path, data.train, data.valid,
            functools.partial(task.loss, criterion), task.logits_and_target, nll_criterion, device, log,
            eval_bleu=task.validation_scorer(args, data, device, dist), start_time=start,
            record={"task": task.name, "data": data_files})
        results = task.after_training(args, model, data, device, dist, log)
        results.update(score_other_checkpoints(task, args, model, data, device, dist, log, trainer, validate_loss,
                                               results))
        metrics = None
        if dist.is_main:
            metrics = run_metrics(trainer, args, device, start, **results)
            path = write_metrics(args.save_dir, metrics)
            plot_log(args.save_dir, log)
            log(f"done: {trainer.step} steps, {task.summary(metrics)}, {metrics['wall_s']:.0f}s "
                f"(training steps {metrics['train_s']:.0f}s) -> {path}")
        dist.close()
        return metrics


def batch_budget(task, args, max_seq_len):
    """The model's max_batch_tokens: a training batch (--max-tokens, at least one max_seq_len sequence), and
    decoding's copies of one (beams, samples; Task.decoding_rows)."""
    return max(1, task.decoding_rows(args)) * max(args.max_tokens, max_seq_len)


def _checkpoint_warmup(ckpt):
    """The warmup the checkpoint's schedule was built with (None when it does not say)."""
    try:
        return ckpt["trainer"]["scheduler"]["lr_lambdas"][0]["warmup"]
    except (KeyError, IndexError, TypeError):
        return None


def steps_per_epoch(args, num_batches, world):
    """Optimizer steps per epoch: each takes world × --update-freq batches. The planned steps of a run are
    epochs × this, except under --max-steps (None there), whose runs are continued with --resume and a larger
    --max-steps: the warmup must not depend on where a part stops."""
    return max(1, num_batches // (world * args.update_freq))


def score_other_checkpoints(task, args, model, data, device, dist, log, trainer, validate_loss, last):
    """Score the best checkpoint (when it is not the last one) and, with --average-last N, the average of
    the last N periodic checkpoints (saved as checkpoint_average.pt) the way the last model was scored;
    one line compares them. Returns the metrics.json fields {"best": {...}, "average": {...}} (rank 0).
    Leaves the scored parameters in `model`."""
    out = {}
    best_path = os.path.join(args.save_dir, BEST_NAME)
    best = trainer.best
    if best is not None and best["step"] != trainer.step and os.path.isfile(best_path):
        model.load_state_dict(load_checkpoint(best_path)["trainer"]["model"])
        out["best"] = {"step": best["step"], "valid_loss": validate_loss(model),
                       **task.score(args, model, data, device, dist, log, "best")}
    if args.average_last:
        found = [p for _, p in periodic_checkpoints(args.save_dir)][-args.average_last:]
        if len(found) < 2:
            log(f"--average-last {args.average_last}: {len(found)} periodic checkpoint(s) in {args.save_dir}, "
                "nothing to average (validate more often: --eval-every)")
        else:
            ckpts = [load_checkpoint(p) for p in found]
            averaged = average_state_dicts(ckpts, found)
            model.load_state_dict(averaged)
            if dist.is_main:
                last_ckpt = ckpts[-1]
                last_ckpt["trainer"]["model"] = averaged
                last_ckpt["averaged"] = [os.path.basename(p) for p in found]
                save_checkpoint(os.path.join(args.save_dir, AVERAGE_NAME), last_ckpt)
            ckpts = None
            out["average"] = {"checkpoints": [os.path.basename(p) for p in found], "valid_loss": validate_loss(model),
                              **task.score(args, model, data, device, dist, log, "average")}
    if out and dist.is_main:
        def describe(name, where, fields):
            text = f"{name} ({where}): valid loss {fields['valid_loss']:.3f}"
            return text + (f", BLEU {fields['bleu']:.2f}" if fields.get("bleu") is not None else "")

        parts = [describe("last", f"step {trainer.step}", {"valid_loss": trainer.valid_loss, "bleu": last.get("bleu")})]
        if "best" in out:
            parts.append(describe("best", f"step {out['best']['step']}", out["best"]))
        if "average" in out:
            n = len(out["average"]["checkpoints"])
            parts.append(describe(f"average of the last {n}", "steps " + ", ".join(
                c[len("checkpoint_"):-len(".pt")] for c in out["average"]["checkpoints"]), out["average"]))
        log("checkpoints compared: " + "; ".join(parts))
    return out


def load_trained_model(task, args, mode, device, dtype):
    """(model in eval mode, tokenizer, max_seq_len) of the run in --save-dir, for the inference mode `mode`:
    the --checkpoint one, by default checkpoint_best.pt where the run wrote one (after an early stop the last
    model is past the best), else checkpoint_last.pt. Says on stderr which it loaded."""
    last_path = os.path.join(args.save_dir, CHECKPOINT_NAME)
    if not os.path.isfile(last_path):
        raise DataError(f"{mode}: no trained model at {last_path}; train one first (same --save-dir)")
    names = {"best": BEST_NAME, "last": CHECKPOINT_NAME, "average": AVERAGE_NAME}
    which = args.checkpoint or ("best" if os.path.isfile(os.path.join(args.save_dir, BEST_NAME)) else "last")
    ckpt_path = os.path.join(args.save_dir, names[which])
    if not os.path.isfile(ckpt_path):
        how = " (a run with --average-last N writes it)" if which == "average" else ""
        raise DataError(f"{mode} --checkpoint {which}: no {names[which]} in {args.save_dir}{how}")
    ckpt = load_checkpoint(ckpt_path)
    check_task(ckpt, task.name, ckpt_path, mode)
    state = ckpt["trainer"]
    # the average's trainer state is the last checkpoint's: its valid loss is not the average's
    valid = f", valid loss {state['valid_loss']:.3f}" if which != "average" and state.get("valid_loss") is not None \
        else ""
    print(f"{mode}: the model of {ckpt_path} (step {state['step']}{valid}" +
          ("" if args.checkpoint else "; --checkpoint picks another") + ")", file=sys.stderr)
    spm_path = os.path.join(args.save_dir, SPM_NAME)
    check_tokenizer(ckpt, spm_path, ckpt_path, mode, lambda msg: print(msg, file=sys.stderr))
    sp = load_sentencepiece(spm_path)
    model_config = ckpt["model_config"]
    max_seq_len = model_config["config"]["max_seq_len"]
    model = task.build_model(model_config, batch_budget(task, args, max_seq_len), device, dtype)
    model.load_state_dict(ckpt["trainer"]["model"])
    model.eval()
    return model, sp, max_seq_len


def run_metrics(trainer, args, device, start, bleu=None, **extra):
    """The metrics.json fields every example writes (plus `extra`)."""
    return {
        "train_loss": trainer.train_loss, "valid_loss": trainer.valid_loss,
        "valid_ppl": safe_exp(trainer.valid_loss), "bleu": bleu,
        # the whole run's average: all training steps' target tokens over their time (validation excluded)
        "tokens_per_s": trainer.session_tokens / trainer.session_time if trainer.session_time > 0 else None,
        "steps": trainer.step, "wall_s": time.perf_counter() - start,
        "train_s": trainer.session_time,  # of wall_s, the training steps' (the rest: start-up, validation, test)
        "best": (None if trainer.best is None
                 else {"step": trainer.best["step"], args.best_metric: trainer.best["value"]}),
        "stop_reason": trainer.stopped_by,
        **extra, "arch": args.arch, "device": str(device), "precision": args.precision,
        "backend": str(describe_backend(device)), "world_size": trainer.dist.world, "update_freq": args.update_freq,
    }


def write_metrics(save_dir, metrics):
    path = os.path.join(save_dir, "metrics.json")
    write_atomically(path, lambda f: f.write((json.dumps(metrics, indent=2) + "\n").encode()), "metrics")
    return path


# OSErrors that say the machine refused a file (space, permissions), not that the code is wrong: one line
# naming the file and the cause, no traceback
_REFUSED_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def run_main(main):
    """Script entry: DataError and KeyboardInterrupt become a one-line message and a non-zero exit, and so
    does a file the machine refuses to write (SaveError, or an OSError for a full disk or a read-only or
    forbidden path: exit status 1). A run stopped by SIGINT or SIGTERM after saving its step
    (TrainingInterrupted) prints where the checkpoint is and exits with 128 + the signal's number: 130 for
    SIGINT, 143 for SIGTERM. In a torchrun job any error ends the process at once with a non-zero
    status (torchrun then stops the other ranks): leaving the process group cleanly could block on peers
    that wait in a collective."""
    line_buffered_output()
    try:
        main()
    except DataError as e:
        _exit(f"error: {e}", 2)
    except TrainingDiverged as e:
        _exit(f"error: {e}", 3)
    except TrainingInterrupted as e:
        # no message on ranks > 0: rank 0 says where the checkpoint is. In a torchrun job every rank ends
        # after rank 0 has written it and said so: torchrun stops the remaining processes as soon as one ends
        _exit(e.message, e.exit_status, together=True)
    except SaveError as e:
        _exit(f"error: {e}", 1)
    except KeyboardInterrupt:
        _exit("interrupted", 130)
    except OSError as e:
        if e.errno in _REFUSED_ERRNOS and e.filename is not None:
            _exit(f"error: {e.filename}: {os_error_cause(e)}", 1)
        _unexpected()
    except Exception:
        _unexpected()


def _unexpected():
    """A bug or an unforeseen failure, called while it is handled: the traceback (the error raised again
    outside a torchrun job)."""
    if not _in_process_group():
        raise
    traceback.print_exc()
    _exit(None, 1)


def line_buffered_output():
    """Make every line printed reach stdout (and stderr) as it is printed. Python buffers a pipe or a file
    in 8 KiB blocks, so `| tee run.log` or a batch job's log would show nothing of a run for minutes;
    the examples print a few lines per log window, so flushing each costs nothing."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # absent on a replaced stream (io.StringIO)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


def _in_process_group():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _exit(message, code, together=False):
    """Print `message` (prefixed with the rank in a torchrun job) and exit with `code`; in a job at once,
    after every rank got here when `together`."""
    job = _in_process_group()
    if message is not None:
        print((f"rank {torch.distributed.get_rank()}: " if job else "") + message, file=sys.stderr)
    if not job:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    if together:
        torch.distributed.barrier()
    os._exit(code)
