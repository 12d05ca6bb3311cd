"""What train_translation.py and train_lm.py share: data checks, the sentencepiece tokenizer, the token
cache, token-budget batching, precision and device set-up, multi-process (torchrun) set-up, the training
loop (gradient accumulation, progress bar, validation, checkpoints, exact resume) and metrics.json.

The loop follows the rules that keep a GPU fed on real data: text is tokenized once and the ids are
cached on disk; batches are built up front (length-bucketed, padded to a multiple of 8) and only their
order changes per epoch; host tensors are pinned and copied with non_blocking=True; nothing inside a step
reads a value back from the device (losses are summed on the device and read every --log-every steps);
the model's workspace is sized once, for the largest batch (--max-tokens) and the longest sequence.

Under torchrun (WORLD_SIZE > 1) every process trains on its share of each step's batches: the epoch's
batch order is the same on every rank (seeded), each optimizer step takes the next world × --update-freq
batches of it and rank r takes every world-th of them, so every rank does the same number of steps (the
remainder of an epoch that does not fill a step is left out of that epoch, a different remainder each
epoch). Gradients are averaged by lsmini.distributed.GradientReducer while backward runs. Each rank's loss
is its summed token losses divided by (the step's tokens on all ranks / world): after averaging this is
exactly the gradient of the whole step's mean token loss, whatever the ranks' batch sizes. Rank 0 alone
writes files (data, tokenizer, token cache, checkpoints, metrics.json) and prints; the others wait for it
and read what it wrote.
"""
import contextlib
import datetime
import hashlib
import io
import json
import math
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed
from tqdm import tqdm

from builtin_data import SplitMix64

PAD, UNK, BOS, EOS = 0, 1, 2, 3
PAD_MULTIPLE = 8  # fewer distinct shapes, tensor-core friendly
CHECKPOINT_NAME = "checkpoint_last.pt"
SPM_NAME = "spm.model"


class DataError(ValueError):
    """Bad input (files, their content, or flags that contradict them), reported before training starts."""


def round_up(n, multiple=PAD_MULTIPLE):
    return (n + multiple - 1) // multiple * multiple


# ---- text files ---------------------------------------------------------------------------------------
def decode_lines(data, what):
    """The lines of UTF-8 bytes (line endings and a leading BOM dropped); DataError naming `what`, the line
    and the byte when they are not valid UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise DataError(f"{what} is not valid UTF-8 text: line {line}, byte {column} is 0x{data[e.start]:02x} "
                        f"({e.reason}); convert it to UTF-8 (e.g. with iconv)") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [s[:-1] if s.endswith("\r") else s for s in lines]


def read_lines(path, what):
    """The lines of a UTF-8 text file. Raises DataError when the file is missing, is not a file, holds no
    non-blank line, or is not valid UTF-8 (naming the line and byte)."""
    if not os.path.exists(path):
        raise DataError(f"{what}: file not found: {path}")
    if not os.path.isfile(path):
        raise DataError(f"{what}: {path} is not a regular file")
    with open(path, "rb") as f:
        lines = decode_lines(f.read(), f"{what}: {path}")
    if not any(s.strip() for s in lines):
        raise DataError(f"{what}: {path} is empty (no non-blank line)")
    return lines


def file_digest(path):
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- tokenizer ----------------------------------------------------------------------------------------
def train_sentencepiece(lines, model_path, vocab_size, model_type, seed, max_sentences=2_000_000):
    """Train a sentencepiece model on `lines` and write it to `model_path`. Ids: pad 0, unk 1, bos 2, eos 3.
    `vocab_size` is an upper bound: a small corpus gets the vocabulary it supports."""
    import sentencepiece as spm

    if hasattr(spm, "set_random_generator_seed"):
        spm.set_random_generator_seed(seed)
    proto = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(s for s in lines if s.strip()), model_writer=proto, vocab_size=vocab_size,
            model_type=model_type, hard_vocab_limit=False, character_coverage=0.9995,
            pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, input_sentence_size=max_sentences,
            shuffle_input_sentence=True, num_threads=max(1, min(16, os.cpu_count() or 1)), minloglevel=2)
    except RuntimeError as e:
        raise DataError(f"sentencepiece could not build a vocabulary of at most {vocab_size} pieces from the training "
                        f"text: {e}") from None
    tmp = model_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(proto.getvalue())
    os.replace(tmp, model_path)


def load_sentencepiece(model_path):
    import sentencepiece as spm

    if not os.path.isfile(model_path):
        raise DataError(f"tokenizer model not found: {model_path}")
    sp = spm.SentencePieceProcessor(model_file=model_path)
    if (sp.pad_id(), sp.unk_id(), sp.bos_id(), sp.eos_id()) != (PAD, UNK, BOS, EOS):
        raise DataError(f"{model_path}: expected special ids pad={PAD} unk={UNK} bos={BOS} eos={EOS}")
    return sp


class TokenArray:
    """Token ids of many sentences in one flat int32 array: sentence i is flat[offsets[i]:offsets[i+1]]."""

    def __init__(self, flat, offsets):
        self.flat, self.offsets = flat, offsets
        self.lengths = np.diff(offsets)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    @classmethod
    def from_lists(cls, ids):
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(offsets[-1]))
        return cls(flat, offsets)

    def subset(self, keep):
        return TokenArray.from_lists([self[i] for i in keep])


def encode_cached(sp, spm_path, lines, text_path, cache_dir):
    """Token ids of `lines` (read from `text_path`), cached in `cache_dir` under a key made of the
    tokenizer and the file's content, so a resumed or repeated run does not tokenize again."""
    key = hashlib.sha1((file_digest(spm_path) + file_digest(text_path)).encode()).hexdigest()[:20]
    cache = os.path.join(cache_dir, f"{os.path.basename(text_path)}.{key}.npz")
    if os.path.isfile(cache):
        with np.load(cache) as z:
            return TokenArray(z["flat"], z["offsets"])
    arr = TokenArray.from_lists(sp.encode(lines))
    os.makedirs(cache_dir, exist_ok=True)
    tmp = cache + ".tmp.npz"
    np.savez(tmp, flat=arr.flat, offsets=arr.offsets)
    os.replace(tmp, cache)
    return arr


# ---- batching -----------------------------------------------------------------------------------------
def token_batches(lengths, max_tokens, sort_keys=None):
    """Group example indices into batches of at most `max_tokens` padded tokens (rows × the longest row,
    rounded up to a multiple of 8). Examples are sorted by `sort_keys` (default: `lengths`), so each batch
    holds similar lengths and little padding. Returns a list of int64 index arrays."""
    lengths = np.asarray(lengths)
    if sort_keys is None:
        sort_keys = (lengths,)
    order = np.lexsort(tuple(reversed([np.asarray(k) for k in sort_keys]))) if len(lengths) else []
    batches, current, width = [], [], 0
    for i in order:
        w = max(width, round_up(int(lengths[i])))
        if current and w * (len(current) + 1) > max_tokens:
            batches.append(np.array(current, dtype=np.int64))
            current, w = [], round_up(int(lengths[i]))
        current.append(int(i))
        width = w
    if current:
        batches.append(np.array(current, dtype=np.int64))
    return batches


def epoch_order(n, seed, epoch):
    """The order of the n batches in `epoch`: a Fisher-Yates shuffle keyed by (seed, epoch), identical
    on every machine, so a resumed run can rebuild it from the epoch number alone."""
    rng = SplitMix64(seed * 1_000_003 + epoch)
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def padded_tensor(rows, width, pin, prefix=None, suffix=None):
    """[len(rows), width] int64 tensor of the id rows (each optionally framed by prefix/suffix), PAD after."""
    out = torch.full((len(rows), width), PAD, dtype=torch.int64, pin_memory=pin)
    a = out.numpy()
    start = 0 if prefix is None else 1
    if prefix is not None:
        a[:, 0] = prefix
    for r, ids in enumerate(rows):
        a[r, start:start + len(ids)] = ids
        if suffix is not None:
            a[r, start + len(ids)] = suffix
    return out


# ---- arguments ----------------------------------------------------------------------------------------
def add_layer_args(g, label_smoothing):
    """The layer options both examples share, into the argument group g."""
    ln = g.add_mutually_exclusive_group()
    ln.add_argument("--pre-ln", dest="pre_ln", action="store_true", default=True,
                    help="LayerNorm before each block (default)")
    ln.add_argument("--post-ln", dest="pre_ln", action="store_false", help="LayerNorm after each residual add")
    g.add_argument("--dropout", type=float, default=None, help="residual/embedding dropout (default per --arch)")
    g.add_argument("--attn-dropout", type=float, default=0.0, help="dropout on attention probabilities (default 0)")
    g.add_argument("--activation-dropout", type=float, default=0.0, help="dropout after the FFN activation (default 0)")
    g.add_argument("--label-smoothing", type=float, default=label_smoothing, help=f"(default {label_smoothing:g})")


def layer_config(args, arch, activation, max_seq_len):
    """The TransformerConfig fields a checkpoint's model_config stores (max_batch_tokens is per run)."""
    return dict(hidden_size=arch["hidden"], num_heads=arch["heads"], ffn_size=arch["ffn"], dropout=args.dropout,
                attn_dropout=args.attn_dropout, activation_dropout=args.activation_dropout, activation=activation,
                pre_layer_norm=args.pre_ln, max_seq_len=max_seq_len)


def build_layer_config(mc, max_batch_tokens):
    from lsmini.layers import TransformerConfig

    try:
        return TransformerConfig(**mc["config"], max_batch_tokens=max_batch_tokens)
    except ValueError as e:
        raise DataError(f"model configuration: {e}") from None


def place_model(model, device, dtype):
    model = model.to(device=device, dtype=dtype)
    for m in model.modules():  # ids come from our own tokenizer: skip the per-call check (a host sync)
        if hasattr(m, "check_tokens"):
            m.check_tokens = False
    return model


def add_common_args(parser, default_save_dir):
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="sentencepiece vocabulary size, an upper bound for small corpora (default 8000; 2000 for "
                        "the built-in data)")
    g.add_argument("--spm-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece model type (default bpe)")

    g = parser.add_argument_group("training")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="padded tokens per batch (default per --arch: 2048 for tiny, 4096 otherwise)")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (default: no limit)")
    g.add_argument("--update-freq", type=int, default=1,
                   help="accumulate the gradients of N batches (per process) into each optimizer step (default 1)")
    g.add_argument("--epochs", type=int, default=None,
                   help="stop after this many passes over the training data (default 3 unless --max-steps is given)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default per --arch)")
    g.add_argument("--warmup", type=int, default=None,
                   help="linear warmup steps, then lr ∝ 1/sqrt(step) (default per --arch)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="decoupled (AdamW) weight decay (default 0)")
    g.add_argument("--clip-norm", type=float, default=1.0, help="clip the global gradient norm (default 1.0; 0: off)")
    g.add_argument("--seed", type=int, default=1, help="seeds initialisation, dropout and the batch order (default 1)")
    prec = g.add_mutually_exclusive_group()
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16",
                      help="fp16 parameters with fp32 master weights and dynamic loss scaling (default on CUDA)")
    prec.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                      help="bf16 parameters with fp32 master weights")
    prec.add_argument("--fp32", dest="precision", action="store_const", const="fp32", help="fp32 (default on CPU)")
    g.add_argument("--device", default=None, help="cuda, cuda:1, cpu, ... (default: cuda when available)")
    g.add_argument("--reference", action="store_true",
                   help="run the same model on lsmini's pure-PyTorch path instead of the fused kernels, for a "
                        "side-by-side comparison (its default --save-dir gets a _reference suffix)")
    g.add_argument("--cuda-graph", action="store_true",
                   help="replay each training step as one CUDA graph (lsmini.graph), recorded once per batch "
                        "shape: less launch overhead for small models; --update-freq 1, the kernels (under "
                        "torchrun the gradient all-reduces are recorded too)")

    g = parser.add_argument_group("progress, validation and checkpoints")
    g.add_argument("--save-dir", default=None,
                   help=f"tokenizer, checkpoints, metrics.json (default {default_save_dir})")
    g.add_argument("--resume", action="store_true", help="continue from <save-dir>/" + CHECKPOINT_NAME)
    g.add_argument("--eval-every", type=int, default=None,
                   help="validation loss/perplexity and a checkpoint every N steps (default: once per epoch)")
    g.add_argument("--log-every", type=int, default=50,
                   help="read the loss back from the device and refresh the progress bar every N steps (default 50)")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")


def resolve_common_args(parser, args, default_save_dir, builtin, arch, default_epochs):
    """Fill the defaults that depend on other flags (the --arch preset `arch` gives dropout, lr, warmup and
    max_tokens); reject values that make no sense."""
    if args.save_dir is None:
        args.save_dir = default_save_dir + ("_reference" if args.reference else "")
    if args.vocab_size is None:
        args.vocab_size = 2000 if builtin else 8000
    for name in ("dropout", "lr", "warmup", "max_tokens"):
        if getattr(args, name) is None:
            setattr(args, name, arch[name])
    if args.max_steps is None and args.epochs is None:
        args.epochs = default_epochs
    for name in ("max_tokens", "log_every", "lr", "update_freq"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("max_steps", "epochs", "eval_every", "warmup"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if args.vocab_size < 8:
        parser.error(f"--vocab-size must be at least 8, got {args.vocab_size}")
    for name in ("clip_norm", "weight_decay"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("dropout", "attn_dropout", "activation_dropout", "label_smoothing"):
        if not 0.0 <= getattr(args, name) < 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")


def setup_device(args, local_rank=None):
    """(device, parameter dtype) from --device and --fp16/--bf16/--fp32. In a torchrun job (`local_rank`
    given) a CUDA device is the GPU of the process's LOCAL_RANK."""
    if args.device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            raise DataError(f"--device {args.device!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DataError(f"--device {args.device}: no CUDA device is available (torch {torch.__version__})")
    if device.type == "cuda" and local_rank is not None:
        if device.index is not None:
            raise DataError(f"--device {args.device}: under torchrun each process uses the GPU of its LOCAL_RANK; "
                            "pass --device cuda (or nothing)")
        if local_rank >= torch.cuda.device_count():
            raise DataError(f"LOCAL_RANK {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                            "start at most that many processes per node")
        device = torch.device("cuda", local_rank)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if args.precision is None:
        args.precision = "fp16" if device.type == "cuda" else "fp32"
    if args.precision == "fp16" and device.type != "cuda":
        raise DataError("--fp16 needs a CUDA device (fp16 loss scaling targets GPUs); use --bf16 or --fp32 on "
                        f"{device.type}")
    if getattr(args, "cuda_graph", False):
        why = ("a CUDA device" if device.type != "cuda" else "the fused kernels, not --reference" if args.reference
               else "--update-freq 1" if args.update_freq != 1 else None)
        if why:
            raise DataError(f"--cuda-graph needs {why}")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    return device, dtype


# ---- multi-process (torchrun) -------------------------------------------------------------------------
# Rank 0 prepares the data, tokenizer and token cache while the others wait at a barrier; on a large corpus
# that outlasts NCCL's default 10-minute collective timeout.
DIST_TIMEOUT = datetime.timedelta(minutes=60)


class Distributed:
    """This process's place in a torchrun job. A plain run is rank 0 of 1, where every method is trivial."""

    def __init__(self, rank=0, world=1, local_rank=0):
        self.rank, self.world, self.local_rank = rank, world, local_rank

    @property
    def active(self):
        return self.world > 1

    @property
    def is_main(self):
        return self.rank == 0

    def barrier(self):
        if self.active:
            torch.distributed.barrier()

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (it writes files: tokenizer, token cache), the others after it
        (they read them). An error in the block ends that rank, and torchrun then stops the others."""
        if self.active and not self.is_main:
            torch.distributed.barrier()
        yield
        if self.active and self.is_main:
            torch.distributed.barrier()

    def from_main(self, make):
        """make() on rank 0, its (picklable) result on every rank."""
        if not self.active:
            return make()
        box = [make() if self.is_main else None]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj):
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if not self.active:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def sum_(self, tensor):
        """Sum a device tensor over the ranks, in place."""
        if self.active:
            torch.distributed.all_reduce(tensor)
        return tensor

    def close(self):
        """End of a successful run: wait for rank 0's last files, then leave the process group."""
        if self.active and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def start_distributed(args, single_process_mode=None):
    """(Distributed, device, dtype). Under torchrun (WORLD_SIZE > 1) this joins the process group: NCCL
    with the GPU of LOCAL_RANK, or gloo on CPU. `single_process_mode` names a flag that cannot run under
    torchrun (--translate, --generate)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        device, dtype = setup_device(args)
        return Distributed(), device, dtype
    if single_process_mode is not None:
        raise DataError(f"{single_process_mode} runs in one process: start it with python, not torchrun")
    try:
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    except KeyError as e:
        raise DataError(f"WORLD_SIZE is {world} but {e.args[0]} is not set: start multi-process runs with torchrun") \
            from None
    device, dtype = setup_device(args, local_rank=local_rank)
    if device.type == "cuda":
        torch.distributed.init_process_group("nccl", timeout=DIST_TIMEOUT, device_id=device)
    else:
        torch.distributed.init_process_group("gloo", timeout=DIST_TIMEOUT)
    return Distributed(rank, world, local_rank), device, dtype


def rank_seed(seed, rank):
    """The dropout seed of `rank` in a multi-process run (initialisation uses `seed` on every rank)."""
    return seed * 1_000_003 + 7919 * (rank + 1)


class RunSettings:
    """Process-wide settings of one run, undone on exit (so main() can be called in-process, e.g. by tests):
    LSMINI_FORCE_REFERENCE=1 with --reference, and flushing denormal floats to zero on the CPU: tiny
    gradients and Adam moments decay into denormals, which x86 CPUs process ~10x slower, so CPU training
    steps would stall at random; flushing them changes nothing that matters for training."""

    def __init__(self, force_reference):
        self.force_reference = force_reference
        self.saved_env = None

    def __enter__(self):
        if self.force_reference:
            self.saved_env = os.environ.get("LSMINI_FORCE_REFERENCE")
            os.environ["LSMINI_FORCE_REFERENCE"] = "1"
        torch.set_flush_denormal(True)
        return self

    def __exit__(self, *exc):
        torch.set_flush_denormal(False)
        if self.force_reference:
            if self.saved_env is None:
                os.environ.pop("LSMINI_FORCE_REFERENCE", None)
            else:
                os.environ["LSMINI_FORCE_REFERENCE"] = self.saved_env


def describe_backend(device):
    import lsmini

    b = lsmini.backend()
    if device.type != "cuda":
        return f"reference (PyTorch ops on {device.type})"
    return f"{b} ({b.reason})"


def prepare_save_dir(args, log):
    os.makedirs(args.save_dir, exist_ok=True)
    ckpt = os.path.join(args.save_dir, CHECKPOINT_NAME)
    if args.resume:
        if not os.path.isfile(ckpt):
            raise DataError(f"--resume: no checkpoint at {ckpt}")
    elif os.path.isfile(ckpt):
        log(f"note: {ckpt} exists and will be overwritten (pass --resume to continue from it)")
    return ckpt


# ---- learning rate ------------------------------------------------------------------------------------
class InverseSqrt:
    """lr factor for the optimizer step that follows `i` completed steps: linear warmup over `warmup`
    steps to 1, then sqrt(warmup/step). A class (not a lambda) so LambdaLR's state_dict records it."""

    def __init__(self, warmup):
        self.warmup = warmup

    def __call__(self, i):
        s = i + 1
        return min(s / self.warmup, math.sqrt(self.warmup / s))


# ---- checkpoints --------------------------------------------------------------------------------------
def rng_state(device):
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(path, state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


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


# ---- the training loop --------------------------------------------------------------------------------
class Trainer:
    """Optimizer (FusedAdam, betas 0.9/0.98), inverse-sqrt schedule, loss scaler and the step/epoch/batch
    position, with a loop that never waits for the device inside a step.

    `loss_fn(model, batch_on_device) -> (loss_sum, nll_sum)`: the training loss summed over the batch's
    target tokens (to backpropagate) and the summed negative log-likelihood (detached; stays on the device).
    `batches`: `len()`, `get(i, pin) -> tuple of CPU tensors`, `tokens(i) -> int` (target tokens of batch i).

    One optimizer step consumes world × --update-freq batches of the epoch's order; `batch_in_epoch`
    counts the batches consumed by all ranks, so a checkpoint also resumes under another world size.
    """

    def __init__(self, args, model, device, dtype, dist=None):
        from lsmini.optim import FusedAdam, LossScaler

        self.args, self.model, self.device, self.dtype = args, model, device, dtype
        self.dist = dist if dist is not None else Distributed()
        self.optimizer = FusedAdam(model, lr=args.lr, betas=(0.9, 0.98), eps=1e-8, weight_decay=args.weight_decay,
                                   adam_w_mode=True, max_grad_norm=args.clip_norm or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, InverseSqrt(args.warmup))
        self.scaler = LossScaler(enabled=dtype == torch.float16)
        self.reducer = None
        if self.dist.active:
            from lsmini.distributed import GradientReducer

            # after FusedAdam, which lays the workspace out; broadcasts rank 0's parameters
            self.reducer = GradientReducer(self.optimizer)
        # --cuda-graph: one recorded step per batch shape, all drawing temporaries from one memory pool
        self.graphs = {} if getattr(args, "cuda_graph", False) else None
        self.graph_pool = torch.cuda.graph_pool_handle() if self.graphs is not None else None
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
    def _graphed_step(self, loss_fn, batch, denominator):
        """The whole step (forward, backward, FusedAdam, loss scale) as a replay of the graph recorded for this
        batch shape; the first batch of a shape runs eagerly and the second records. Returns the summed NLL
        (the graph's output: consumed before the next replay). The denominator travels as a device tensor:
        a Python number would be frozen into the graph."""
        from lsmini.graph import CUDAGraphStep

        key = tuple(t.shape for t in batch)
        step = self.graphs.get(key)
        if step is None:
            def train_step(*inputs):
                loss, nll_sum = loss_fn(self.model, inputs[:-1])
                self.scaler.scale(loss * inputs[-1]).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad()
                return nll_sum

            step = self.graphs[key] = CUDAGraphStep(train_step, [self.optimizer], warmup=1, pool=self.graph_pool)
        inv_denominator = torch.full((), 1.0 / denominator, dtype=torch.float32, device=self.device)
        return step(*batch, inv_denominator)

    def train(self, batches, loss_fn, validate, save, log):
        """Train until --max-steps or --epochs; validate (and save) every --eval-every steps (default: at the
        end of each epoch) and at the end. `validate(model) -> mean NLL per token`; `save()` writes the
        checkpoint."""
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
            if self.graphs is not None:
                batch = tuple(t.to(device, non_blocking=True) for t in batches.get(step_batches[0], pin))
                loss_sum.add_(self._graphed_step(loss_fn, batch, denominator))
            else:
                for u in range(a.update_freq):
                    b = step_batches[u * world + rank]
                    batch = tuple(t.to(device, non_blocking=True) for t in batches.get(b, pin))
                    accumulate_only = u < a.update_freq - 1  # no communication before the step's last micro-batch
                    with self.reducer.no_sync() if self.reducer is not None and accumulate_only else \
                            contextlib.nullcontext():
                        loss, nll_sum = loss_fn(model, batch)
                        self.scaler.scale(loss / denominator).backward()
                    loss_sum.add_(nll_sum)
                self.scaler.step(self.optimizer)  # finishes the gradient reduction first
                self.scaler.update()
                self.optimizer.zero_grad()
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
        if self.graphs:  # free their memory; under torchrun the process group cannot shut down while they live
            for g in self.graphs.values():
                g.reset()
            self.graphs.clear()


def safe_exp(x):
    return math.exp(min(x, 700.0))


def write_metrics(save_dir, metrics):
    path = os.path.join(save_dir, "metrics.json")
    with open(path + ".tmp", "w") as f:
        json.dump(metrics, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def start_trainer(args, model, model_config, ckpt_path, device, dtype, log, dist=None):
    """A Trainer for `model`; with --resume, restored from the checkpoint (which must hold the same model).
    Under torchrun every rank restores from the same checkpoint file."""
    trainer = Trainer(args, model, device, dtype, dist)
    if trainer.dist.active:
        torch.manual_seed(rank_seed(args.seed, trainer.dist.rank))  # dropout differs per rank, init did not
    if args.resume:
        ckpt = load_checkpoint(ckpt_path)
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


def train_and_validate(trainer, args, model, model_config, ckpt_path, train_batches, valid_batches, loss_fn,
                       logits_and_target, nll_criterion, device, log):
    """Run the training loop (validating and checkpointing as configured) and make sure a validation loss
    exists at the end. logits_and_target(model, batch on device) -> (logits, target) for validation.
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
            save_checkpoint(ckpt_path, {"model_config": model_config, "trainer": state, "args": vars(args)})

    trainer.train(train_batches, loss_fn, validate, save, log)
    if trainer.valid_loss is None:
        trainer.valid_loss = validate(model)


def run_metrics(trainer, args, device, start, bleu, **extra):
    """The metrics.json fields every example writes (plus `extra`)."""
    return {
        "train_loss": trainer.train_loss, "valid_loss": trainer.valid_loss,
        "valid_ppl": safe_exp(trainer.valid_loss), "bleu": bleu,
        "tokens_per_s": trainer.session_tokens / trainer.session_time if trainer.session_time > 0 else None,
        "steps": trainer.step, "wall_s": time.perf_counter() - start,
        **extra, "arch": args.arch, "device": str(device), "precision": args.precision,
        "backend": str(describe_backend(device)), "world_size": trainer.dist.world, "update_freq": args.update_freq,
    }


def run_main(main):
    """Script entry: DataError and KeyboardInterrupt become a one-line message and a non-zero exit. In a
    torchrun job any error ends the process at once with a non-zero status (torchrun then stops the other
    ranks): leaving the process group cleanly could block on peers that wait in a collective."""
    try:
        main()
    except DataError as e:
        _exit(f"error: {e}", 2)
    except KeyboardInterrupt:
        _exit("interrupted", 130)
    except Exception:
        if not _in_process_group():
            raise
        traceback.print_exc()
        _exit(None, 1)


def _in_process_group():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _exit(message, code):
    job = _in_process_group()
    if message is not None:
        print((f"rank {torch.distributed.get_rank()}: " if job else "") + message, file=sys.stderr)
    if not job:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
