"""A plain torch.nn.Transformer training script, timed as written and with one added line, lsmini.convert(model),
each eager and under torch.compile.

    python benchmarks/bench_convert.py [--variants torch,lsmini,...] [--iters 30] [--warmup 10] [--quick]
                                       [--model transformer|encoder] [--norm-first] [--dtype bf16|fp16] [--no-fullgraph] [--repeats N]
                                       [--padding-masks per-model|bool|float] [--no-isolate] [--csv PATH]
                                       [--results DIR | --no-results]
    python benchmarks/bench_convert.py --device cpu --quick --layers 1 --d-model 32 --heads 4 --ffn 64 \\
                                       --vocab 50 --batch 4 --src-len 8 --tgt-len 8 --variants torch,lsmini

The script is what a user writes: nn.Embedding shared by source and target (scaled by sqrt(d_model), plus a
sinusoidal position table and dropout), nn.Transformer (6+6 layers, d_model 512, 8 heads, FFN 2048, dropout
0.1, batch_first, post-LN unless --norm-first), an nn.Linear to the vocabulary (8000), F.cross_entropy with
label smoothing 0.1 ignoring padding, AdamW(fused=True), torch.autocast in bf16 (--dtype fp16: float16 with
a GradScaler). A batch is 128 rows of 64 source and 64 target tokens, the end of each row padded (a quarter
of the row at most), with src/tgt/memory key padding masks and the causal target mask
nn.Transformer.generate_square_subsequent_mask(L) passed with tgt_is_causal=True. One training step:
zero_grad(set_to_none=True), forward, loss, backward, optimizer step.

--model encoder: the same script around nn.TransformerEncoder alone (6 layers, the same widths; a final
LayerNorm when pre-LN), a masked-token model: 15% of each row's tokens replaced by a mask id, the loss over
them (the target tokens of the columns below), one src_key_padding_mask.

Padding masks (--padding-masks). Most scripts pass bool masks. PyTorch then warns that they and the float causal
mask differ in type, and under torch.compile that warning breaks the graph inside nn.Transformer's loop over
its layers: Dynamo then runs the transformer eagerly and compiles only the embedding, the output projection and
the loss (the graphs column counts the pieces, the captured column the operations they hold). With float masks
(0 / -inf, the causal mask's type) torch.compile traces torch's whole model in one graph. lsmini's converted
modules read float padding masks by value, in eager mode only, so under torch.compile they need bool masks. The
default, per-model, gives each model the masks with which it compiles whole, float to torch's and bool to
lsmini's: the strongest torch.compile baseline beside lsmini. bool (the script as most users write it) and float
give every variant the same masks.

Variants, each on a fresh model built from the same seed, each in a fresh Python process (--no-isolate: all in
this one, where the first compiled variant pays several seconds of compiler start-up that later ones do not):
    torch                  the script as written (eager).
    torch+compile          loss_fn = torch.compile(loss_fn).
    torch+compile-graphs   the same with mode="reduce-overhead" (forward and backward replayed as CUDA graphs).
    lsmini                 lsmini.convert(model) after building the model, eager.
    lsmini+compile         convert, then torch.compile(loss_fn).
    lsmini+compile-graphs  convert, then torch.compile(loss_fn, mode="reduce-overhead").
    lsmini+adam, lsmini+compile+adam, lsmini+compile-graphs+adam  only when asked for: the same with AdamW
                           swapped for lsmini.optim.FusedAdam too (and GradScaler for lsmini.optim.LossScaler
                           with --dtype fp16), the script's second changed line.
What is compiled is loss_fn(src, tgt_in, tgt_out, masks): autocast, the model's forward and the loss. The
backward runs as torch.compile produces it; the optimizer step stays outside, as in most scripts. The lsmini
variants compile with fullgraph=True (--no-fullgraph turns it off), so that a graph break fails loudly; any
variant that fails is reported as a row carrying the first line of its error, and the run goes on.

--repeats N runs every variant N times, in rounds whose order alternates, and reports per variant the run with
the median ms_step (all runs' figures go under the table and into the results row's note): where the host
bounds a step, as in the compiled default mode, ms_step moves by tens of percent from process to process.

Reported per variant:
    masks         the padding masks its model was given (bool or float; --padding-masks).
    compile_s     wall time (synchronised) from the start of the first step to the end of the first step that
                  runs the way every later step does: step 1 for eager and default-mode variants (its
                  forward call traces and compiles the forward and runs it, its backward compiles and runs
                  the backward, its optimizer step creates the AdamW state); steps 1-3 for the reduce-overhead
                  variants (step 1 compiles and runs a warm-up, step 2 records the CUDA graphs, step 3 is the
                  first replay). For eager variants it is the first step's time, the floor the compiled ones
                  add to; it includes reading step 1's loss. Each compile is cold: Inductor's
                  caches are off (--compile-cache keeps them), and process-wide one-time costs (CUDA context,
                  cuBLAS, loading the kernels the eager steps run — torch's, and lsmini's for its variants —,
                  Inductor's compile workers) are paid by an untimed warm-up before the first variant.
                  The per-variant line printed as it finishes splits compile_s into its steps.
    ms_step       median wall time of one step over --iters steps after --warmup steps (at least the steps
                  compile_s spans), CUDA events around each step with the host running ahead as in real
                  training, so launch gaps count (on CPU: time.perf_counter around each step).
    tgt_tokens_s  non-pad target tokens per second: the timed steps' mean non-pad target tokens / ms_step.
    peak_mb       torch.cuda.max_memory_allocated from the first step on (warm-up, compilation, graph
                  recording, timed steps): a CUDA graph's memory is allocated while it records and replays
                  allocate nothing the allocator sees, so a reset after the warm-up would leave it out.
                  Parameters, gradients, AdamW state and activations; blank on CPU.
    loss_first    the loss of step 1 (the same initial weights in every variant; the dropout draws differ).
    loss_final    the mean loss of the last (up to 10) timed steps: the variants train alike if these agree.
    graphs        graphs Dynamo captured (1: no graph break and no recompilation).
    captured      operations Dynamo captured into those graphs (the rest of the model runs eagerly).
    replaced/kept the lengths of lsmini.convert's report lists.
    x_torch_compile  tgt_tokens_s over torch+compile's; x_same_mode: over the unconverted model's under the
                  same compile mode (lsmini / torch, lsmini+compile / torch+compile, ...); mem_vs_torch:
                  peak_mb over the eager torch variant's.
The data are Zipf-distributed random tokens: the loss falls as the model learns the token frequencies.

On CUDA every variant's row is appended to benchmarks/results/convert.csv (config: the model and its settings;
figures: compile_s, ms per step, target tokens/s, peak MB, losses, graphs, captured; an error as the note),
from which benchmarks/report.py writes RESULTS.md. CPU runs are smoke runs and record nothing.
"""
import argparse
import cProfile
import datetime
import gc
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import lsmini  # noqa: E402
from lsmini.optim import FusedAdam, LossScaler  # noqa: E402

PAD, MASK, BOS = 0, 1, 2
MASK_FRACTION = 0.15  # --model encoder: the share of tokens hidden for the model to predict
FIRST_TOKEN = 4  # ids below are special (pad, unk, bos, eos)
SEED = 1234
DATA_SEED = 7
N_BATCHES = 4  # batches cycled through the steps
MIN_ROW_FRACTION = 0.75  # each row keeps at least this share of its tokens before the padding
LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.98), 0.01
LOSS_WINDOW = 10  # timed steps averaged into loss_final
GRAPH_READY_STEPS = 3  # reduce-overhead: compile + warm-up run, recording, first replay

VARIANTS = ("torch", "torch+compile", "torch+compile-graphs", "lsmini", "lsmini+compile", "lsmini+compile-graphs")
# asked for by name: the lsmini variants with the optimizer swapped too (lsmini.optim.FusedAdam)
ADAM_VARIANTS = ("lsmini+adam", "lsmini+compile+adam", "lsmini+compile-graphs+adam")
KNOWN_VARIANTS = VARIANTS + ADAM_VARIANTS
COMPILE_MODES = {"": None, "compile": "default", "compile-graphs": "reduce-overhead"}
COLUMNS = ["variant", "masks", "compile_s", "ms_step", "tgt_tokens_s", "peak_mb", "loss_first", "loss_final",
           "graphs", "captured", "replaced", "kept", "x_torch_compile", "x_same_mode", "mem_vs_torch",
           "error"]
FORMATS = {"compile_s": "{:.2f}", "ms_step": "{:.2f}", "tgt_tokens_s": "{:,.0f}", "peak_mb": "{:,.0f}",
           "loss_first": "{:.4f}", "loss_final": "{:.4f}", "x_torch_compile": "{:.2f}×", "x_same_mode": "{:.2f}×",
           "mem_vs_torch": "{:.2f}"}


def split_variant(variant):
    """'lsmini+compile-graphs' → (True, 'reduce-overhead'); 'torch' → (False, None); a +adam suffix aside."""
    base, _, mode = fused_adam_aside(variant).partition("+")
    return base == "lsmini", COMPILE_MODES[mode]


def fused_adam_aside(variant):
    """The variant without its +adam suffix: 'lsmini+compile+adam' → 'lsmini+compile'."""
    return variant.removesuffix("+adam")


# ---- the user's model -------------------------------------------------------------------------------------
def sinusoidal_positions(max_len, d_model):
    """sin in the first half of the columns, cos in the second, wavelengths from 2π to 10000·2π."""
    half = d_model // 2
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    freq = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64) / half)
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], 1).float()


class Seq2Seq(nn.Module):
    def __init__(self, vocab, d_model, heads, layers, ffn, dropout, norm_first, max_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)  # unit scale once multiplied by sqrt(d_model)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.scale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ffn, dropout, batch_first=True,
                                          norm_first=norm_first)
        self.out = nn.Linear(d_model, vocab)

    def embed_tokens(self, tokens):
        return self.dropout(self.embed(tokens) * self.scale + self.positions[:tokens.shape[1]])

    def forward(self, src, tgt_in, src_padding, tgt_padding, tgt_mask):
        y = self.transformer(self.embed_tokens(src), self.embed_tokens(tgt_in), tgt_mask=tgt_mask,
                             src_key_padding_mask=src_padding, tgt_key_padding_mask=tgt_padding,
                             memory_key_padding_mask=src_padding, tgt_is_causal=True)
        return self.out(y)


class MaskedLM(nn.Module):
    """--model encoder: the embedding as in Seq2Seq, nn.TransformerEncoder alone, an nn.Linear to the vocabulary
    (a BERT-style masked-token model)."""

    def __init__(self, vocab, d_model, heads, layers, ffn, dropout, norm_first, max_len):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.register_buffer("positions", sinusoidal_positions(max_len, d_model), persistent=False)
        self.scale = math.sqrt(d_model)
        self.dropout = nn.Dropout(dropout)
        layer = nn.TransformerEncoderLayer(d_model, heads, ffn, dropout, batch_first=True, norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model) if norm_first else None)
        self.out = nn.Linear(d_model, vocab)

    def forward(self, src, src_padding):
        x = self.dropout(self.embed(src) * self.scale + self.positions[:src.shape[1]])
        return self.out(self.encoder(x, src_key_padding_mask=src_padding))


def build_model(args):
    torch.manual_seed(SEED)  # on the CPU, so every variant starts from the same weights
    cls = Seq2Seq if args.model == "transformer" else MaskedLM
    return cls(args.vocab, args.d_model, args.heads, args.layers, args.ffn, 0.1, args.norm_first,
               max(args.src_len, args.tgt_len))


# ---- data -------------------------------------------------------------------------------------------------
def padded_rows(g, weights, rows, length):
    """Zipf-distributed tokens, each row cut at a random length in [MIN_ROW_FRACTION·length, length] and
    padded after it; also the padding mask (True at padding)."""
    tokens = torch.multinomial(weights, rows * length, replacement=True, generator=g).view(rows, length)
    tokens += FIRST_TOKEN
    lengths = torch.randint(math.ceil(MIN_ROW_FRACTION * length), length + 1, (rows, 1), generator=g)
    padding = torch.arange(length).unsqueeze(0) >= lengths
    return tokens.masked_fill(padding, PAD), padding


def mask_type(args, variant):
    """The padding masks a variant's model is given: "bool" or "float" (--padding-masks)."""
    if args.padding_masks == "per-model":
        return "bool" if split_variant(variant)[0] else "float"
    return args.padding_masks


def make_batches(args, device, masks):
    """N_BATCHES batches of (inputs, targets) on device: the model's forward arguments, with padding masks of
    type masks ("bool" or "float"), and the target tokens (PAD where the loss reads nothing); the same tokens
    whatever the masks.
    transformer: inputs (src, tgt_in, src_padding, tgt_padding, tgt_mask), targets tgt_out.
    encoder: inputs (src with MASK_FRACTION of its tokens replaced by MASK, src_padding), targets the replaced
    tokens."""
    g = torch.Generator().manual_seed(DATA_SEED)
    weights = 1.0 / (torch.arange(args.vocab - FIRST_TOKEN, dtype=torch.float64) + 10.0)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(args.tgt_len, device=device)

    def as_masks(*paddings):
        if masks == "float":  # additive, of the causal mask's type: 0 to keep, -inf at padding
            paddings = [torch.zeros(m.shape).masked_fill(m, -math.inf) for m in paddings]
        return [m.to(device) for m in paddings]

    batches = []
    for _ in range(N_BATCHES):
        src, src_padding = padded_rows(g, weights, args.batch, args.src_len)
        if args.model == "encoder":
            hidden = (torch.rand(src.shape, generator=g) < MASK_FRACTION) & ~src_padding
            hidden[:, 0] = True  # at least one token a row, so that tiny smoke runs have a loss too
            targets = src.masked_fill(~hidden, PAD)
            batches.append(((src.masked_fill(hidden, MASK).to(device), *as_masks(src_padding)), targets.to(device)))
            continue
        tgt_out, tgt_padding = padded_rows(g, weights, args.batch, args.tgt_len)
        # Teacher forcing: the decoder reads BOS and the target shifted right; position t predicts tgt_out[t],
        # so the input's padding starts where the target's does.
        tgt_in = torch.cat([torch.full((args.batch, 1), BOS), tgt_out[:, :-1]], 1).masked_fill(tgt_padding, PAD)
        batches.append(((src.to(device), tgt_in.to(device), *as_masks(src_padding, tgt_padding), tgt_mask),
                        tgt_out.to(device)))
    return batches


# ---- one variant ------------------------------------------------------------------------------------------
def describe_kept(entry):
    """'name (type: reason)' for a report entry that carries them, else its str()."""
    if all(hasattr(entry, a) for a in ("name", "type", "reason")):
        return f"{entry.name or '(the model)'} ({entry.type}: {entry.reason})"
    return str(entry)


class Timer:
    """Per-step times in ms: CUDA events on a GPU (read after the loop, so the host runs ahead), wall time on
    the CPU, where every op runs synchronously."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.spans = []

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self):
        self.spans.append([self.mark(), None])

    def stop(self):
        self.spans[-1][1] = self.mark()

    def times_ms(self):
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self.spans]
        return [(e - s) * 1e3 for s, e in self.spans]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def loss_function(model, device, dtype):
    """The script's loss_fn(inputs, targets): under autocast in dtype, the model's forward and the
    label-smoothed loss over the non-pad targets."""
    def loss_fn(inputs, targets):
        with torch.autocast(device.type, dtype=dtype):
            logits = model(*inputs)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=PAD,
                                   label_smoothing=0.1)

    return loss_fn


def run_variant(variant, args, device, row):
    """Fills row (a dict holding "variant") with the variant's measurements."""
    use_lsmini, mode = split_variant(variant)
    row["masks"] = mask_type(args, variant)
    batches = make_batches(args, device, row["masks"])
    model = build_model(args).to(device).train()
    if use_lsmini:
        # The one line the script gains. The optimizer is created after it, over the converted parameters.
        n = max(args.src_len, args.tgt_len)
        report = lsmini.convert(model, max_batch_tokens=args.batch * n, max_seq_len=n)
        row["replaced"], row["kept"] = len(report.replaced), len(report.kept)
        row["kept_names"] = [describe_kept(k) for k in report.kept]
    loss_fn = loss_function(model, device, torch.float16 if args.dtype == "fp16" else torch.bfloat16)
    if mode is not None:
        loss_fn = torch.compile(loss_fn, mode=mode, fullgraph=use_lsmini and args.fullgraph)
    if variant.endswith("+adam"):  # the optimizer swapped too: the converted parameters move into its workspace
        opt = FusedAdam(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
        scaler = LossScaler() if args.dtype == "fp16" else None
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, fused=True)
        scaler = torch.amp.GradScaler(device.type) if args.dtype == "fp16" else None
    graphs = mode == "reduce-overhead"

    def step(inputs, targets):
        if graphs:  # a new iteration: the graphs may overwrite the previous step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(inputs, targets)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        return loss.detach().clone()  # a graph's output is overwritten by its next replay

    ready_steps = GRAPH_READY_STEPS if graphs else 1
    warmup = max(args.warmup, ready_steps)
    torch.manual_seed(SEED)  # the same dropout stream for variants that draw it the same way
    torch._dynamo.utils.counters.clear()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    profiler = cProfile.Profile() if args.cprofile else None
    t0 = time.perf_counter()
    marks = [t0]
    for i in range(warmup):
        if profiler is not None and i < ready_steps:
            profiler.enable()
        loss = step(*batches[i % len(batches)])
        if i == 0:
            row["loss_first"] = loss.item()  # synchronises; inside compile_s, as in any script that logs it
        if i < ready_steps:
            synchronize(device)
            marks.append(time.perf_counter())
            if profiler is not None:
                profiler.disable()
    if profiler is not None:
        os.makedirs(args.cprofile, exist_ok=True)
        profiler.dump_stats(os.path.join(args.cprofile, variant.replace("+", "_") + ".pstats"))
    synchronize(device)
    row["compile_s"] = marks[-1] - t0
    row["compile_steps"] = [b - a for a, b in zip(marks, marks[1:])]

    # Counted before the timed loop: reading a count off the device inside it would stop the host running ahead.
    batch_tokens = [int((b[1] != PAD).sum()) for b in batches]
    timed = [i % len(batches) for i in range(warmup, warmup + args.iters)]
    timer, losses = Timer(device), []
    for b in timed:
        timer.start()
        losses.append(step(*batches[b]))
        timer.stop()
    ms = statistics.median(timer.times_ms())
    row["ms_step"] = ms
    row["tgt_tokens_s"] = statistics.fmean(batch_tokens[b] for b in timed) / ms * 1e3
    if device.type == "cuda":
        row["peak_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    row["loss_final"] = torch.stack(losses[-LOSS_WINDOW:]).float().mean().item()
    if mode is not None:
        row["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        row["captured"] = torch._dynamo.utils.counters["stats"]["calls_captured"]


def release(device):
    """Drop the previous variant's compiled code, CUDA graphs and cached blocks before the next one."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def disable_compile_caches():
    """Every compile cold, as on a first run: Inductor then compiles into a fresh cache directory each time."""
    config = getattr(torch.compiler, "config", None)
    if config is not None and hasattr(config, "force_disable_caches"):
        config.force_disable_caches = True
    else:  # older releases keep the switch in Inductor's own config
        importlib.import_module("torch._inductor.config").force_disable_caches = True


def warm_up_process(args, device):
    """One-time costs outside every variant's numbers: CUDA context, cuBLAS handles and kernel loading (eager
    steps of a one-layer model of the same widths: torch's as written, and converted when an lsmini variant
    is to run, so that each variant finds its own kernels loaded) and Inductor's start-up (imports and its
    pool of compile workers, by compiling a one-line function)."""
    small = argparse.Namespace(**{**vars(args), "layers": 1, "warmup": 2, "iters": 1, "cprofile": None})
    run_variant("torch", small, device, {})
    if any(split_variant(v)[0] for v in args.variants):
        run_variant("lsmini", small, device, {})
    if any(split_variant(v)[1] is not None for v in args.variants):
        f = torch.compile(lambda x: x * 2 + 1)
        f(torch.ones(8, device=device))
    release(device)


# ---- report -----------------------------------------------------------------------------------------------
def compile_phases():
    """torch's own timings of its compile phases (seconds per call, by phase), accumulated process-wide."""
    return torch._dynamo.utils.compilation_time_metrics


def print_compile_profile(variant, top=20):
    phases = sorted(((sum(v), len(v), k) for k, v in compile_phases().items()), reverse=True)
    print(f"# {variant}: compile phases, seconds (calls), nested phases counted in their callers too")
    for total, calls, name in phases[:top]:
        print(f"#   {total:8.3f} ({calls:3d})  {name}")


def add_ratios(rows):
    by = {r["variant"]: r for r in rows if "error" not in r}
    for r in rows:
        if r["variant"] not in by:
            continue
        use_lsmini, _ = split_variant(r["variant"])
        if use_lsmini:
            if "torch+compile" in by:
                r["x_torch_compile"] = r["tgt_tokens_s"] / by["torch+compile"]["tgt_tokens_s"]
            same = by.get(fused_adam_aside(r["variant"]).replace("lsmini", "torch", 1))
            if same is not None:
                r["x_same_mode"] = r["tgt_tokens_s"] / same["tgt_tokens_s"]
        if "peak_mb" in r and "torch" in by and "peak_mb" in by["torch"]:
            r["mem_vs_torch"] = r["peak_mb"] / by["torch"]["peak_mb"]
    return rows


def display(rows):
    out = []
    for r in rows:
        d = {}
        for k, v in r.items():
            if isinstance(v, float):
                d[k] = FORMATS.get(k, "{:.3f}").format(v)
            elif isinstance(v, str):
                d[k] = v.replace("|", "\\|")  # error lines may contain the table's separator
            else:
                d[k] = v
        out.append(d)
    return out


def header_line(args, device):
    if device.type == "cuda":
        env = common.environment()
    else:
        env = {"gpu": f"CPU ({platform.processor() or platform.machine()})", "torch": torch.__version__,
               "cuda": torch.version.cuda, "date": datetime.date.today().isoformat()}
    layout = "pre-LN" if args.norm_first else "post-LN"
    masks = "float (torch) / bool (lsmini)" if args.padding_masks == "per-model" else args.padding_masks
    if args.model == "transformer":
        model = f"nn.Transformer {args.layers}+{args.layers}"
        tokens = f"batch {args.batch} × {args.src_len}/{args.tgt_len} tokens"
    else:
        model = f"nn.TransformerEncoder {args.layers} (masked tokens)"
        tokens = f"batch {args.batch} × {args.src_len} tokens"
    return (f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']} — {model}, d_model "
            f"{args.d_model}, {args.heads} heads, FFN {args.ffn}, vocab {args.vocab}, {layout}, {tokens}, {masks} "
            f"padding masks, {args.dtype}, "
            f"{args.warmup} warm-up + {args.iters} timed steps, {'cached' if args.compile_cache else 'cold'} "
            f"compiles, lsmini compiled with fullgraph={args.fullgraph}, lsmini backend {lsmini.backend()}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated subset of " + ",".join(KNOWN_VARIANTS) + " (the +adam ones only when named)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"],
                    help="autocast dtype; fp16 adds a GradScaler")
    ap.add_argument("--iters", type=int, default=30, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    ap.add_argument("--quick", action="store_true", help="3 warm-up and 10 timed steps")
    ap.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                    help="compile the lsmini variants with fullgraph=True (a failure becomes an error row)")
    ap.add_argument("--compile-cache", action="store_true",
                    help="keep Inductor's caches on (warm compile times) instead of compiling cold")
    ap.add_argument("--padding-masks", default="per-model", choices=["per-model", "bool", "float"],
                    help="per-model (default: float for torch's model, bool for lsmini's, so each compiles "
                         "whole), bool (True at padding, as most scripts pass them: torch.compile then runs "
                         "torch's transformer eagerly) or float (0 / -inf, the causal mask's type; lsmini reads "
                         "float masks by value, eagerly only)")
    ap.add_argument("--model", default="transformer", choices=["transformer", "encoder"],
                    help="nn.Transformer (translation), or nn.TransformerEncoder alone (a masked-token model)")
    ap.add_argument("--norm-first", action="store_true", help="pre-LN layers (norm_first=True)")
    ap.add_argument("--layers", type=int, default=6, help="encoder layers, and as many decoder layers")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--src-len", type=int, default=64)
    ap.add_argument("--tgt-len", type=int, default=64)
    ap.add_argument("--csv", metavar="PATH", help="also write the rows to this CSV file")
    common.add_results_arguments(ap)
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                    help="run each variant in a fresh Python process (default), so that none inherits compiled "
                         "code, caches or warmed-up compiler state from the one before; --no-isolate runs all "
                         "in this process, where the first compiled variant pays several seconds the later "
                         "ones do not")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every variant this many times, in rounds whose order alternates (every second "
                         "round runs the variants in reverse), and report, per variant, the run with the median "
                         "ms_step; every run's ms_step and compile time are listed under the table and in the "
                         "results row's note")
    ap.add_argument("--row-json", metavar="PATH", help=argparse.SUPPRESS)  # --isolate's child writes its row here
    ap.add_argument("--compile-profile", action="store_true",
                    help="after each compiled variant, print where its compile time went: the phases torch "
                         "times itself (torch._dynamo.utils.compile_times), longest first")
    ap.add_argument("--cprofile", metavar="DIR",
                    help="profile the steps compile_s spans with cProfile, into DIR/<variant, + as _>.pstats (read "
                         "them with python -m pstats); the profiler slows the host, so compile_s is not comparable")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.iters = 3, 10
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in KNOWN_VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {','.join(KNOWN_VARIANTS)}")
    if args.iters < 1:
        ap.error("--iters must be at least 1")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def run_here(variant, args, device):
    """One variant in this process: its row (an error row if it fails)."""
    row = {"variant": variant}
    compile_phases().clear()
    try:
        run_variant(variant, args, device, row)
    except Exception as e:  # noqa: BLE001 — a failed variant is a result too; the others still run
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        # What convert reported stays; measurements cut short do not.
        row = {k: v for k, v in row.items() if k in ("variant", "masks", "replaced", "kept", "kept_names")}
        row["error"] = f"{type(e).__name__}: {first}"[:300]
    if args.compile_profile and split_variant(variant)[1] is not None:
        print_compile_profile(variant)  # before release: torch._dynamo.reset() clears the timings
    release(device)
    return row


def run_isolated(variant, argv):
    """One variant in a fresh Python process (this script, --no-isolate, that variant only): its row."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--variants", variant, "--no-isolate",
               "--repeats", "1", "--row-json", path]
        done = subprocess.run(cmd)
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    return {"variant": variant, "error": f"its process exited with code {done.returncode} before reporting"}


def median_run(rows):
    """Of one variant's runs, the row of the run with the median ms_step (an error row if any failed), with
    every run's ms_step and compile time in ms_runs and compile_runs."""
    failed = [r for r in rows if "error" in r]
    if failed:
        return failed[0]
    row = sorted(rows, key=lambda r: r["ms_step"])[(len(rows) - 1) // 2]
    return {**row, "ms_runs": [r["ms_step"] for r in rows], "compile_runs": [r["compile_s"] for r in rows]}


def runs_note(row):
    """What --repeats leaves in a row's note: every run's ms_step and compile time, in run order."""
    ms, compiles = row.get("ms_runs", []), row.get("compile_runs", [])
    if len(ms) < 2:
        return None
    return (f"the median by ms/step of {len(ms)} runs in alternating order: ms/step "
            f"{', '.join(f'{m:.3f}' for m in ms)}; compile s {', '.join(f'{c:.1f}' for c in compiles)}")


def report_line(row):
    if "error" in row:
        return f"# {row['variant']}: FAILED — {row['error']}"
    steps = " + ".join(f"{s:.1f}" for s in row["compile_steps"])
    return (f"# {row['variant']}: {row['ms_step']:.2f} ms/step, {row['tgt_tokens_s']:,.0f} target tokens/s, "
            f"compile {row['compile_s']:.1f} s ({len(row['compile_steps'])} steps: {steps}), "
            f"loss {row['loss_first']:.3f} → {row['loss_final']:.3f}")


def main(argv=None):
    """Runs the variants, prints the markdown table (and writes --csv); returns the rows."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    device = torch.device(args.device)
    notes = []
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("no CUDA device; use --device cpu for a smoke run")
        if any(split_variant(v)[0] for v in args.variants) and lsmini.backend() != "cuda":
            sys.exit(f"lsmini backend is {lsmini.backend()!r}: {lsmini.backend().reason}")
    else:
        skipped = [v for v in args.variants if split_variant(v)[1] == "reduce-overhead"]
        if skipped:
            notes.append(f"skipped on CPU (CUDA graphs need a CUDA device): {', '.join(skipped)}")
        args.variants = [v for v in args.variants if v not in skipped]
    if not args.compile_cache:
        disable_compile_caches()

    if args.row_json is None:
        print(f"# {header_line(args, device)}", flush=True)
    if not args.isolate:
        warm_up_process(args, device)
    runs = {v: [] for v in args.variants}
    for round_ in range(args.repeats):  # rounds of alternating order: a slow spell or a warm machine is shared out
        for variant in args.variants if round_ % 2 == 0 else args.variants[::-1]:
            if args.isolate:  # the child prints its report line
                runs[variant].append(run_isolated(variant, argv))
            else:
                runs[variant].append(run_here(variant, args, device))
                print(report_line(runs[variant][-1]), flush=True)
    rows = [median_run(runs[v]) for v in args.variants]
    if args.row_json is not None:  # a child of run_isolated: its one row goes back to the parent
        with open(args.row_json, "w") as f:
            json.dump(rows[0], f)
        return rows
    add_ratios(rows)
    for r in rows:
        note = runs_note(r)
        if note:
            notes.append(f"{r['variant']}: {note} (the table shows that run)")
        kept = r.pop("kept_names", None)
        if kept:
            shown = ", ".join(kept[:8]) + (f", … ({len(kept)} in all)" if len(kept) > 8 else "")
            notes.append(f"{r['variant']}: lsmini.convert kept {shown}")
    print()
    print(common.markdown_table(display(rows), COLUMNS))
    for n in notes:
        print(f"\n{n}")
    if args.csv:
        common.write_csv(args.csv, rows, COLUMNS)
    if device.type == "cuda":
        common.append_results(args.results, "convert", common.environment(), results_rows(args, rows))
    return rows


def results_config(args):
    """The model and settings of a run, as the config of its results rows."""
    layout = "pre-LN" if args.norm_first else "post-LN"
    if args.model == "transformer":
        model, tokens = f"nn.Transformer {args.layers}+{args.layers}", f"b{args.batch} {args.src_len}/{args.tgt_len}"
    else:
        model, tokens = f"nn.TransformerEncoder {args.layers}", f"b{args.batch} {args.src_len}"
    extra = ("" if args.fullgraph else " no-fullgraph") + (" cached-compiles" if args.compile_cache else "")
    return (f"{model} d{args.d_model} h{args.heads} ffn{args.ffn} vocab{args.vocab} {layout} {args.dtype} {tokens} "
            f"masks={args.padding_masks}{extra}")


def results_rows(args, rows):
    config = results_config(args)
    out = []
    for r in rows:
        out.append({"benchmark": "convert", "config": config, "variant": r["variant"],
                    "kind": "lsmini" if split_variant(r["variant"])[0] else "pytorch",
                    "ms": r.get("ms_step"), "compile_s": r.get("compile_s"), "tgt_tokens_s": r.get("tgt_tokens_s"),
                    "peak_mb": r.get("peak_mb"), "loss_first": r.get("loss_first"), "loss_final": r.get("loss_final"),
                    "graphs": r.get("graphs"), "captured": r.get("captured"), "masks": r.get("masks"),
                    "note": r.get("error") or runs_note(r)})
    return out


if __name__ == "__main__":
    main()
