"""The command-line options both examples take (model size and layers, tokenizer, training, progress and
checkpoints), the defaults that depend on other flags (an --arch table row gives --dropout, --lr, --warmup
and --max-tokens), the checks that reject values making no sense, and the layer configuration those flags
describe (what a checkpoint stores to rebuild the model)."""
import math

from .checkpoints import CHECKPOINT_NAME
from .data import DataError

DEFAULT_EPOCHS = 3


# the --arch of a run that names none: the size the defaults were tuned at on real corpora where the run
# trains on a GPU, the one that trains the built-in task in a few minutes on a CPU
GPU_ARCH, CPU_ARCH = "small", "tiny"


def add_arch_arg(group, archs, sizes):
    """--arch, one of the rows of the `archs` table; `sizes` describes them for --help."""
    group.add_argument("--arch", choices=sorted(archs), default=None,
                       help=f"model size (default {GPU_ARCH} on a CUDA device, {CPU_ARCH} on the CPU): " + sizes)


def save_dir(args, default_save_dir):
    """--save-dir, or the example's default (with a _reference suffix under --reference)."""
    if args.save_dir is not None:
        return args.save_dir
    return default_save_dir + ("_reference" if args.reference else "")


def default_arch(device, cuda_available):
    """(--arch, why) for a run that names none: GPU_ARCH where it trains on a CUDA device (`device`, the
    --device string, or None for cuda when `cuda_available`), else CPU_ARCH."""
    on_cuda = device.split(":")[0] == "cuda" if device is not None else cuda_available
    if on_cuda:
        return GPU_ARCH, f"the default --arch on a CUDA device; {CPU_ARCH} on the CPU, --arch sets it"
    return CPU_ARCH, f"the default --arch on the CPU; {GPU_ARCH} on a CUDA device, --arch sets it"


def per_arch(archs, name):
    """The --arch table's defaults of one flag, for --help: "tiny 2048, small 8192, ..."."""
    return ", ".join(f"{arch} {row[name]:g}" for arch, row in archs.items())


def add_layer_args(g, label_smoothing, archs):
    """The layer options both examples share, into the argument group g."""
    ln = g.add_mutually_exclusive_group()
    ln.add_argument("--pre-ln", dest="pre_ln", action="store_true", default=True,
                    help="LayerNorm before each block (default)")
    ln.add_argument("--post-ln", dest="pre_ln", action="store_false", help="LayerNorm after each residual add")
    g.add_argument("--dropout", type=float, default=None,
                   help=f"residual/embedding dropout (default per --arch: {per_arch(archs, 'dropout')})")
    g.add_argument("--attn-dropout", type=float, default=0.0, help="dropout on attention probabilities (default 0)")
    g.add_argument("--activation-dropout", type=float, default=0.0, help="dropout after the FFN activation (default 0)")
    g.add_argument("--label-smoothing", type=float, default=label_smoothing, help=f"(default {label_smoothing:g})")


def add_common_args(parser, default_save_dir, archs, best_metrics=("valid_loss",)):
    """The tokenizer, training and progress/checkpoint options, each group in the parser."""
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="sentencepiece vocabulary size, an upper bound for small corpora (default 8000; 2000 for "
                        "the built-in data)")
    g.add_argument("--spm-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece model type (default bpe)")

    g = parser.add_argument_group("training")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"padded tokens per batch (default per --arch: {per_arch(archs, 'max_tokens')})")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps in total (default: no limit)")
    g.add_argument("--update-freq", type=int, default=1,
                   help="accumulate the gradients of N batches (per process) into each optimizer step (default 1)")
    g.add_argument("--epochs", type=int, default=None,
                   help=f"stop after this many passes over the training data (default unless --max-steps is "
                        f"given: {DEFAULT_EPOCHS}, or more where the --arch asks for more epochs or more steps "
                        f"than {DEFAULT_EPOCHS} epochs give)")
    g.add_argument("--max-time", type=float, default=None, metavar="SECONDS",
                   help="wall-clock budget of the training loop: stop at the first step boundary after it, "
                        "validate, save and still score the test set (default: none)")
    g.add_argument("--patience", type=int, default=None, metavar="N",
                   help="stop early after N validations in a row without improvement of --best-metric "
                        "(default: never)")
    g.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default per --arch: {per_arch(archs, 'lr')})")
    g.add_argument("--warmup", type=int, default=None,
                   help="linear warmup steps, then lr ∝ 1/sqrt(step) (default: the --arch value; in a run "
                        "without --max-steps at most one epoch, kept between a fifth and a third of the steps "
                        "its --epochs plan)")
    g.add_argument("--cooldown", type=int, default=None, metavar="N",
                   help="the lr falls linearly to 0 over the run's last N steps (default: a fifth of the steps its "
                        "--epochs plan; none in a --max-steps run or one with --patience; 0: off)")
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
    graph = g.add_mutually_exclusive_group()
    graph.add_argument("--cuda-graph", dest="cuda_graph", action="store_true", default=None,
                       help="replay each training step as one CUDA graph (lsmini.graph), recorded once per batch "
                            "shape: less launch overhead for small models (default on where it applies: CUDA, the "
                            "fused kernels, --update-freq 1; under torchrun the gradient all-reduces are recorded "
                            "too); given explicitly, a run where it cannot apply is refused")
    graph.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                       help="run each training step eagerly")

    g = parser.add_argument_group("progress, validation and checkpoints")
    g.add_argument("--save-dir", default=None,
                   help=f"tokenizer, checkpoints, metrics.json (default {default_save_dir})")
    g.add_argument("--resume", action="store_true", help="continue from <save-dir>/" + CHECKPOINT_NAME)
    g.add_argument("--overwrite", action="store_true",
                   help="start a new run in a --save-dir that holds an earlier run's checkpoint, deleting its "
                        "checkpoint, tokenizer, metrics and translations first (without it such a run is refused)")
    g.add_argument("--eval-every", type=int, default=None,
                   help="validation loss/perplexity and a checkpoint every N steps (default: once per epoch)")
    g.add_argument("--best-metric", choices=best_metrics, default="valid_loss",
                   help="the validation metric that picks checkpoint_best.pt and that --patience watches "
                        "(default valid_loss" + (", bleu needs --eval-bleu" if "bleu" in best_metrics else "") + ")")
    g.add_argument("--keep-last", type=int, default=0, metavar="N",
                   help="also keep the checkpoints of the last N validations as checkpoint_<step>.pt (default 0)")
    g.add_argument("--average-last", type=int, default=None, metavar="N",
                   help="at the end, average the parameters of the last N periodic checkpoints (keeps at least "
                        "N of them) and score the average beside the last and the best checkpoint")
    g.add_argument("--checkpoint", choices=("best", "last", "average"), default=None,
                   help="the model the inference mode (--translate, --generate) loads from --save-dir: best "
                        "(checkpoint_best.pt, the best validation; the default where the run wrote one), last "
                        "(checkpoint_last.pt, the default otherwise) or average (checkpoint_average.pt, from "
                        "--average-last)")
    g.add_argument("--log-every", type=int, default=50,
                   help="read the loss back from the device and refresh the progress bar every N steps (default 50)")
    g.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")


def resolve_common_args(parser, args, default_save_dir, builtin, arch):
    """Fill the defaults that depend on other flags (the --arch table row `arch` gives dropout, lr, warmup
    and max_tokens); reject values that make no sense (parser.error names the flag)."""
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --save-dir, --overwrite replaces it: give one of them")
    args.save_dir = save_dir(args, default_save_dir)
    if args.vocab_size is None:
        args.vocab_size = 2000 if builtin else 8000
    # an explicit --warmup wins; the --arch value is capped once the planned steps are known (adapt_warmup)
    args.warmup_given = args.warmup is not None
    for name in ("dropout", "lr", "warmup", "max_tokens"):
        if getattr(args, name) is None:
            setattr(args, name, arch[name])
    # neither --epochs nor --max-steps: the length is the default, fixed once the batches are known
    args.default_length = args.max_steps is None and args.epochs is None
    if args.default_length:
        args.epochs = DEFAULT_EPOCHS
    for name in ("max_tokens", "log_every", "lr", "update_freq"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v > 0):  # nan compares false both ways
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
    for name in ("max_steps", "epochs", "eval_every", "warmup", "patience", "max_time", "average_last"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    for name in ("keep_last", "cooldown"):
        v = getattr(args, name)
        if v is not None and v < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    if args.average_last is not None and args.keep_last < args.average_last:
        args.keep_last = args.average_last  # the checkpoints to average must be there at the end
    if args.vocab_size < 8:
        parser.error(f"--vocab-size must be at least 8, got {args.vocab_size}")
    for name in ("clip_norm", "weight_decay"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
    for name in ("dropout", "attn_dropout", "activation_dropout", "label_smoothing"):
        if not 0.0 <= getattr(args, name) < 1.0:
            parser.error(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(args, name)}")


def default_epochs(args, steps_per_epoch, arch):
    """The --epochs of a run given neither --epochs nor --max-steps, and a line saying why: the --arch table
    row's `min_epochs` (DEFAULT_EPOCHS where it has none), or as many more as its `min_steps` need at
    `steps_per_epoch`. Three epochs of a 30k-pair corpus are ~150 steps of 8192 tokens: enough for the tiny
    model, far too few for the 6+6-layer ones, which reach their quality after ~1500-2000 steps; a large
    corpus reaches those steps within its first epochs but still gains from more passes (--arch small on
    300k generated pairs: 6 epochs, not 3; benchmarks/bench_defaults.py)."""
    min_epochs, min_steps = arch.get("min_epochs", DEFAULT_EPOCHS), arch["min_steps"]
    epochs = max(min_epochs, -(-min_steps // steps_per_epoch))
    if epochs == DEFAULT_EPOCHS:
        return epochs, f"length: {epochs} epochs ({epochs * steps_per_epoch} steps; --epochs or --max-steps sets it)"
    least = f"at least {min_steps} steps" if min_epochs == DEFAULT_EPOCHS else \
        f"at least {min_epochs} epochs and {min_steps} steps"
    return epochs, (f"length: {epochs} epochs ({epochs * steps_per_epoch} steps): --arch {args.arch} trains for "
                    f"{least}, at {steps_per_epoch} per epoch here (--epochs or --max-steps sets it)")


def adapt_warmup(args, planned_steps, arch_warmup, steps_per_epoch):
    """The warmup of a new run, and a line saying where it comes from. An explicit --warmup wins; otherwise
    the --arch value, capped for an --epochs run (planned_steps None: --max-steps sets the length, the --arch
    value stays): the arch tables assume long runs (4000 steps), and a small corpus trained for tens of epochs
    would otherwise spend most of its run warming up and never reach the decay the inverse-square-root
    schedule relies on. The cap is one epoch, kept between a fifth and a third of the planned steps: a fifth
    for runs of five epochs and more (a third left --arch small 0.35 BLEU under its tuned runs on 30k pairs;
    a fifth came within 0.3 on every corpus tried), a third for runs of three or fewer (the CPU's 3-epoch
    default lost about 3 BLEU warming up for less than an epoch). With early stopping (--patience) the
    planned steps are only a ceiling: a small corpus reaches its best validation a few epochs in and the run
    stops there, so the warmup is also capped at two epochs, for the peak to come before the best."""
    if args.warmup_given:
        return args.warmup, f"warmup {args.warmup} steps (--warmup)"
    if planned_steps is None:
        return arch_warmup, f"warmup {arch_warmup} steps (--arch {args.arch}; a --max-steps run keeps it)"
    third, fifth = max(1, planned_steps // 3), max(1, planned_steps // 5)
    cap = min(third, max(fifth, steps_per_epoch))
    if cap == third:
        why = f"a third of the {planned_steps} planned steps"
    elif cap == fifth:
        why = f"a fifth of the {planned_steps} planned steps"
    else:
        why = f"one epoch of {steps_per_epoch} steps (between a fifth and a third of the {planned_steps} planned)"
    if args.patience is not None and 2 * steps_per_epoch < cap:
        cap = 2 * steps_per_epoch
        why = (f"two epochs of {steps_per_epoch} steps: early stopping ends a small corpus's run a few epochs in, "
               f"long before the {planned_steps} planned steps")
    if arch_warmup <= cap:
        return arch_warmup, f"warmup {arch_warmup} steps (--arch {args.arch}; {planned_steps} steps planned)"
    return cap, f"warmup {cap} steps: {why} (--arch {args.arch} gives {arch_warmup}, too long for this run; " \
                f"--warmup sets it)"


def adapt_cooldown(args, planned, total):
    """The cooldown of a run of `total` steps (its last steps, over which the lr falls linearly to 0) and a
    line saying where it comes from. An explicit --cooldown wins (DataError when it is longer than the run);
    otherwise a fifth of the planned steps. The inverse-square-root decay alone ends a run at about half its
    peak lr; falling to 0 over the last fifth gained 0.15-0.17 BLEU on each corpus tried (the built-in 30k and
    300k pairs, a real 29k-pair one; benchmarks/bench_defaults.py) and 0.6 on the CPU's default run. None by
    default where the plan is not the run's end: a --max-steps run (planned None; continued with --resume and a larger
    --max-steps) and an early-stopping one (--patience: the planned steps are only a ceiling)."""
    if args.cooldown is not None:
        if args.cooldown > total:
            raise DataError(f"--cooldown {args.cooldown} is longer than the run, {total} steps here")
        return args.cooldown, f"--cooldown {args.cooldown}"
    if planned is None:
        return 0, "no cooldown in a --max-steps run (--cooldown sets one)"
    if args.patience is not None:
        return 0, "no cooldown with early stopping: the planned steps are only a ceiling (--cooldown sets one)"
    return planned // 5, f"a fifth of the {planned} planned steps; --cooldown sets it"


def layer_config(args, arch, activation, max_seq_len):
    """The TransformerConfig fields a checkpoint's model_config stores (max_batch_tokens is per run), from
    the layer flags and the --arch table row `arch` (its `options`, if any: further TransformerConfig fields,
    e.g. norm, rotary, num_kv_heads, activation)."""
    return {**dict(hidden_size=arch["hidden"], num_heads=arch["heads"], ffn_size=arch["ffn"], dropout=args.dropout,
                   attn_dropout=args.attn_dropout, activation_dropout=args.activation_dropout, activation=activation,
                   pre_layer_norm=args.pre_ln, max_seq_len=max_seq_len), **arch.get("options", {})}
