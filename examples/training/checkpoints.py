"""Checkpoints and the save directory of a run.

<save-dir>/checkpoint_last.pt holds the example that wrote it ("task": a key of TASKS), the model
configuration, the trainer's state (model, optimizer, schedule, loss scale, position in the data, every
rank's RNG streams, so a resumed run continues exactly), the flags, the run's data files (path and sha1:
--resume says which changed) and its tokenizer (the sentencepiece model and its sha256); written
atomically (by a background thread during training: CheckpointWriter), read on CPU, refused when it holds
another model. A write the disk refuses (full, read-only) stops the run with one line (SaveError) and
leaves no partial file, the previous checkpoint intact.
checkpoint_best.pt (the best validation so far, --best-metric) and the periodic checkpoint_<step>.pt
(--keep-last) are copies (hard links where possible) of checkpoint_last.pt made right after it is written,
so each of them carries everything it does. average_state_dicts averages the parameters of several
checkpoints of one model (--average-last, examples/average_checkpoints.py).

A save directory belongs to one run. A new run refuses a directory that holds a checkpoint unless told to
--overwrite it (then the earlier run's files go first, so an interrupted new run never leaves its
tokenizer beside the old model); --resume, --translate and --generate refuse a tokenizer on disk that is
not the checkpoint's and a checkpoint of the other example (naming it); files a killed run left
half-written (*.tmp) are removed when a run starts.
"""
import errno
import glob
import hashlib
import os
import re
import shutil
import threading

import torch

from .data import DataError, file_digest
from .tokenizer import SPM_NAME

CHECKPOINT_NAME = "checkpoint_last.pt"
BEST_NAME = "checkpoint_best.pt"
AVERAGE_NAME = "checkpoint_average.pt"
METRICS_NAME = "metrics.json"
TRAIN_LOG_NAME = "train_log.jsonl"
PLOT_NAME = "train_log.png"
PERIODIC_PATTERN = re.compile(r"checkpoint_(\d+)\.pt$")
# what a run writes at the top of its save directory besides data/ and cache/ (content-addressed: they hold
# nothing of one run that another could mistake for its own)
RUN_FILES = (CHECKPOINT_NAME, BEST_NAME, AVERAGE_NAME, "checkpoint_[0-9]*.pt", SPM_NAME, METRICS_NAME,
             TRAIN_LOG_NAME, PLOT_NAME, "hypotheses.*.txt")
# where runs write files atomically through a *.tmp sibling
TMP_DIRS = (".", "cache", "data")


def remove_stale_tmp(save_dir):
    """Delete the *.tmp files a killed run left in save_dir (and its cache/ and data/); their names."""
    removed = []
    for d in TMP_DIRS:
        for path in sorted(glob.glob(os.path.join(save_dir, d, "*.tmp"))):
            if os.path.isfile(path):
                os.remove(path)
                removed.append(os.path.normpath(path))
    return removed


def prepare_save_dir(args, log, is_main=True):
    """Create --save-dir for a training run and return the path of its checkpoint. --resume needs the
    checkpoint; a new run refuses a directory that holds one unless --overwrite is given, and then removes
    the earlier run's files. Rank 0 (is_main) also removes stale *.tmp files."""
    os.makedirs(args.save_dir, exist_ok=True)
    ckpt = os.path.join(args.save_dir, CHECKPOINT_NAME)
    if args.resume:
        if not os.path.isfile(ckpt):
            raise DataError(f"--resume: no checkpoint at {ckpt}")
    elif os.path.isfile(ckpt) and not args.overwrite:
        raise DataError(f"{args.save_dir} holds the checkpoint of an earlier run ({ckpt}); a new run would replace "
                        "its model and tokenizer. Pass --resume to continue that run, --overwrite to delete its "
                        "files and start afresh in this directory, or another --save-dir")
    if not is_main:
        return ckpt
    removed = remove_stale_tmp(args.save_dir)
    if removed:
        log(f"note: removed {len(removed)} unfinished file(s) of an interrupted run: {', '.join(removed)}")
    if args.overwrite and not args.resume:
        earlier = sorted(p for pattern in RUN_FILES for p in glob.glob(os.path.join(args.save_dir, pattern)))
        for path in earlier:
            os.remove(path)
        if earlier:
            log(f"--overwrite: removed the earlier run's {', '.join(os.path.basename(p) for p in earlier)}")
    return ckpt


def tokenizer_record(spm_path):
    """What a checkpoint stores of the run's tokenizer: the sentencepiece model itself and its sha256."""
    with open(spm_path, "rb") as f:
        model = f.read()
    return {"name": os.path.basename(spm_path), "sha256": hashlib.sha256(model).hexdigest(), "model": model}


def check_tokenizer(ckpt, spm_path, ckpt_path, flag, log):
    """The tokenizer on disk must be the one the checkpoint's model was trained with: the same ids mean
    the same pieces. DataError otherwise (a later run into the same directory replaced it)."""
    record = ckpt.get("tokenizer")
    if record is None:
        log(f"note: {ckpt_path} does not record its tokenizer (an older checkpoint): {spm_path} is used unchecked")
        return
    if not os.path.isfile(spm_path):
        raise DataError(f"{flag}: the tokenizer {spm_path} of the model in {ckpt_path} is missing")
    on_disk = file_digest(spm_path, "sha256")
    if on_disk != record["sha256"]:
        raise DataError(f"{flag}: {spm_path} is not the tokenizer the model in {ckpt_path} was trained with "
                        f"(sha256 {on_disk[:12]} on disk, {record['sha256'][:12]} in the checkpoint): the directory "
                        "mixes two runs, e.g. a later run that stopped before its first checkpoint. Train again "
                        "with --overwrite, or use another --save-dir")


# The examples whose runs write checkpoints, by the "task" field a checkpoint names its example with: the
# script, what its model is, the flag that uses a trained one, and a model_config key only that example's
# models have (to tell which example wrote a checkpoint older than the "task" field).
TASKS = {
    "translation": dict(script="train_translation.py", model="a translation model", infer="--translate",
                        config_key="encoder_layers"),
    "lm": dict(script="train_lm.py", model="a language model", infer="--generate", config_key="layers"),
}


def checkpoint_task(ckpt):
    """The name of the example that wrote `ckpt` (a key of TASKS), None when it cannot be told."""
    task = ckpt.get("task")
    if task is None:  # written before the field existed: the model configuration tells
        config = ckpt.get("model_config") or {}
        task = next((name for name, t in TASKS.items() if t["config_key"] in config), None)
    return task


def check_task(ckpt, task, ckpt_path, flag):
    """The checkpoint must hold a model of the example `task` (a TASKS key) that reads it with `flag`:
    DataError naming the example that wrote it otherwise."""
    wrote = checkpoint_task(ckpt)
    if wrote is None or wrote == task:
        return
    this = TASKS[task]
    other = TASKS.get(wrote, dict(script=f"the {wrote!r} example", model="another kind of model", infer=flag))
    use = "continue that run with" if flag == "--resume" else "use it with"
    other_flag = "--resume" if flag == "--resume" else other["infer"]
    raise DataError(f"{flag}: {ckpt_path} holds {other['model']}, written by {other['script']}, not {this['model']} "
                    f"of {this['script']}: {use} {other['script']} {other_flag}, or give {this['script']} the "
                    "--save-dir of one of its own runs")


def data_record(files):
    """What a checkpoint stores of the run's data files: {flag: {"path": absolute path, "sha1": digest}} for
    `files`, {flag: path}."""
    return {flag: {"path": os.path.abspath(path), "sha1": file_digest(path)} for flag, path in files.items()}


def data_changes(saved, now):
    """The data files of this run (a data_record) that are not the checkpoint's (`saved`; None for a
    checkpoint written before the record existed: nothing can be told), in words. A file moved without a
    change of content is the same file."""
    if saved is None:
        return []
    out = []
    for flag in list(now) + [f for f in saved if f not in now]:
        before, after = saved.get(flag), now.get(flag)
        if after is None:
            out.append(f"{flag}: none now, the checkpoint's run read {before['path']}")
        elif before is None:
            out.append(f"{flag} {after['path']}: the checkpoint's run had none")
        elif before["sha1"] != after["sha1"]:
            out.append(f"{flag} {after['path']}: changed since the checkpoint's run" if before["path"] == after["path"]
                       else f"{flag} {after['path']}: other content than the checkpoint's run's {before['path']}")
    return out


def rng_state(device):
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


class SaveError(RuntimeError):
    """A file of the run could not be written (a full disk, a read-only or missing directory, no
    permission). The one-line message names the file and the cause; the partial file is removed and the
    file it was to replace is unchanged."""


# what to do about the usual reasons a run's file cannot be written
_OS_ERROR_HINTS = {
    errno.ENOSPC: "free space on that disk, or use a --save-dir on another one",
    errno.EDQUOT: "free space within the disk quota, or use a --save-dir on another disk",
    errno.EROFS: "the file system is read-only: use a --save-dir you can write to",
}


def os_error_cause(e):
    """The cause of an OSError in words, with what to do about the usual ones."""
    hint = _OS_ERROR_HINTS.get(e.errno)
    return (e.strerror or str(e)) + (f" ({hint})" if hint else "")


class _RecordingWriter:
    """The file torch.save writes to, keeping the first OSError of its writes: torch's writer turns it into
    an opaque RuntimeError ("unexpected pos ..."), which would hide that the disk is full."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data):
        try:
            return self._f.write(data)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise

    def flush(self):
        self._f.flush()


def write_atomically(path, write, what):
    """write(f) into path + ".tmp" (a binary file), then rename it over `path`: readers see the old file or
    the new one, never half of one. When the disk or the directory refuses (OSError), the partial *.tmp is
    removed, `path` stays as it was, and SaveError names `what` (e.g. "checkpoint"), the path and the cause.
    Other errors propagate unchanged (the *.tmp removed too)."""
    tmp = path + ".tmp"
    recorder = None
    try:
        if os.path.lexists(tmp):  # never write through a stale *.tmp: it may be a hard link to a checkpoint
            os.remove(tmp)
        with open(tmp, "wb") as f:
            recorder = _RecordingWriter(f)
            write(recorder)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass  # not created, or the directory refuses that too; a later run removes stale *.tmp files
        cause = recorder.error if recorder is not None and recorder.error is not None else e
        if not isinstance(cause, OSError):
            raise
        kept = f"; the {os.path.basename(path)} there is unchanged" if os.path.isfile(path) else ""
        raise SaveError(f"cannot write {what} {path}: {os_error_cause(cause)}{kept}") from None


def save_checkpoint(path, state):
    write_atomically(path, lambda f: torch.save(state, f), "checkpoint")


def cpu_snapshot(obj):
    """`obj` (nested dicts, lists, tuples of tensors and plain values) with every tensor copied to CPU
    memory that nothing else holds: training may go on changing the originals in place. CUDA tensors go to
    pinned memory with one wait at the end, not one per tensor."""
    streams = set()

    def copy(x):
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if x.device.type != "cuda":
                return x.to("cpu", copy=True)
            out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            out.copy_(x, non_blocking=True)
            streams.add(torch.cuda.current_stream(x.device))
            return out
        if isinstance(x, dict):
            return type(x)((k, copy(v)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
            return type(x)(*(copy(v) for v in x))
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    out = copy(obj)
    for stream in streams:
        stream.synchronize()
    return out


class CheckpointWriter:
    """Writes checkpoints on a background thread, so that training does not wait for the disk: save() takes
    a CPU snapshot of the state (fast: a device-to-host copy), then a thread writes it through
    save_checkpoint and runs `then` (the copies to checkpoint_best.pt and checkpoint_<step>.pt) after it.
    One write at a time: save() and wait() first wait for the previous one and raise its error, if it had
    one, so a failed write stops the run at the next validation or at the end. The thread is not a daemon:
    an interrupted run still finishes the file it was writing (a killed one leaves a *.tmp, removed by the
    next run, and the previous checkpoint_last.pt intact)."""

    def __init__(self):
        self._thread = None
        self._error = None

    def save(self, path, state, then=None):
        self.wait()
        snapshot = cpu_snapshot(state)
        self._thread = threading.Thread(target=self._write, args=(path, snapshot, then),
                                        name="checkpoint-writer")
        self._thread.start()

    def _write(self, path, state, then):
        try:
            save_checkpoint(path, state)
            if then is not None:
                then()
        except BaseException as e:  # raised again in the training thread by wait()
            self._error = e

    def wait(self):
        """Block until the last save() is on disk; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, SaveError):  # says what and why already
                raise e
            raise RuntimeError(f"writing a checkpoint failed: {e}") from e


def copy_checkpoint(src, dst):
    """Copy a checkpoint file atomically (through a *.tmp sibling, like save_checkpoint). The copy is a hard
    link where the file system has them: checkpoint files are only ever replaced whole (save_checkpoint
    writes a new file and renames it over the old one), never changed in place, so a link is as good as a
    copy, and it is free where copying a checkpoint costs about as much as writing it (every validation of
    a small corpus writes checkpoint_best.pt)."""
    tmp = dst + ".tmp"
    try:
        if os.path.lexists(tmp):
            os.remove(tmp)
        os.link(src, tmp)
        os.replace(tmp, dst)
        return
    except OSError:  # no hard links here (another device, FAT, some network file systems): copy
        pass
    with open(src, "rb") as f:
        write_atomically(dst, lambda out: shutil.copyfileobj(f, out), "checkpoint")


def periodic_checkpoints(save_dir):
    """[(step, path)] of the periodic checkpoint_<step>.pt files in save_dir, oldest first."""
    found = []
    for name in os.listdir(save_dir):
        m = PERIODIC_PATTERN.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(save_dir, name)))
    return sorted(found)


def keep_periodic(save_dir, keep):
    """Remove all but the `keep` newest periodic checkpoints; the removed paths."""
    found = periodic_checkpoints(save_dir)
    removed = [path for _, path in found[:max(0, len(found) - keep)]]
    for path in removed:
        os.remove(path)
    return removed


def average_state_dicts(ckpts, paths):
    """The element-wise mean of the model parameters of the checkpoints `ckpts` (loaded from `paths`),
    computed in fp32 and returned in each tensor's dtype. DataError when they do not hold the same model
    (configuration, tokenizer, parameter names or shapes)."""
    if not ckpts:
        raise DataError("no checkpoint to average")
    first, first_path = ckpts[0], paths[0]
    for ckpt, path in zip(ckpts[1:], paths[1:]):
        if ckpt.get("model_config") != first.get("model_config"):
            diffs = [k for k in sorted(set(ckpt["model_config"]) | set(first["model_config"]))
                     if ckpt["model_config"].get(k) != first["model_config"].get(k)]
            raise DataError(f"cannot average {path} with {first_path}: they hold different models "
                            f"(model_config differs in {', '.join(diffs)})")
        sha = [(c.get("tokenizer") or {}).get("sha256") for c in (first, ckpt)]
        if sha[0] != sha[1]:
            raise DataError(f"cannot average {path} with {first_path}: they were trained with different "
                            "tokenizers (their ids mean different pieces)")
        a, b = first["trainer"]["model"], ckpt["trainer"]["model"]
        if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
            raise DataError(f"cannot average {path} with {first_path}: their parameter names or shapes differ")
    out = {}
    for k, t in first["trainer"]["model"].items():
        if not t.is_floating_point():  # integer buffers (if any) are taken from the first checkpoint
            out[k] = t.clone()
            continue
        total = torch.zeros(t.shape, dtype=torch.float32)
        for ckpt in ckpts:
            total += ckpt["trainer"]["model"][k].float()
        out[k] = (total / len(ckpts)).to(t.dtype)
    return out


def checkpoint_arch(path):
    """The --arch of the model a checkpoint holds; None where the file is missing or unreadable (resuming from it
    then says why) or names none. The file is memory-mapped: its tensors' bytes are not read."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return None
    config = ckpt.get("model_config") if isinstance(ckpt, dict) else None
    return config.get("arch") if isinstance(config, dict) else None


def load_checkpoint(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(f"cannot read checkpoint {path}: {e}") from None


def check_same_model(saved, current, path):
    """Resuming with a different model (or tokenizer) would silently load mismatched weights: refuse."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, now {current.get(k)!r}" for k in sorted(set(saved) | set(current))
             if saved.get(k) != current.get(k)]
    if diffs:
        raise DataError(f"--resume: {path} holds a different model; " + "; ".join(diffs) +
                        ". Use the flags of the original run, or another --save-dir")
