"""Hugging Face training steps, as written and with lsmini.convert(model): GPT2LMHeadModel (GPT-2 small),
BertForMaskedLM (BERT base) and LlamaForCausalLM (a small Llama), each eager and under torch.compile.

    python benchmarks/bench_hf.py [--models gpt2,bert,llama] [--variants torch,torch+compile,lsmini,lsmini+compile]
                                  [--iters 20] [--warmup 5] [--attn sdpa|eager] [--padding] [--profile]
                                  [--results DIR | --no-results]
    python benchmarks/bench_hf.py --models llama --variants torch,torch+compile,lsmini,lsmini+compile,torch+liger
    python benchmarks/bench_hf.py --variants torch+compile-graphs,lsmini+compile-graphs   # CUDA graphs
    python benchmarks/bench_hf.py --device cpu --tiny --steps 1      # a smoke run: a tiny model, one step

Models, built from their configs with random weights (nothing downloaded), seeded alike in every variant:
    gpt2   GPT2LMHeadModel, 12 layers, hidden 768, 12 heads, vocab 50257, batch 8 × 1024 tokens, the labels
           the inputs (transformers shifts them), use_cache=False.
    bert   BertForMaskedLM, 12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522, batch 32 × 128 tokens,
           15% of the tokens replaced by [MASK] and predicted (the other labels -100).
    llama  LlamaForCausalLM, 12 layers, hidden 768, 12 heads, 4 key/value heads, intermediate 2048 (SwiGLU),
           vocab 32000, 2048 positions, RMSNorm eps 1e-6, rope theta 10000, untied embeddings, batch
           8 × 1024 tokens, the labels the inputs (transformers shifts them), use_cache=False.
gpt2 and bert with the configs' dropouts (0.1), llama with none (attention_dropout 0, as Llama has). No padding
(so the models' sdpa masks are None) unless --padding: then each row is right-padded from a random length between
half and all of the length (attention_mask given, padded positions' labels -100, as a fine-tuning batch of
sentences is; tokens_s still counts the padded shape). bf16 autocast, AdamW(fused=True). The default --models is
gpt2,bert.
A step: zero_grad(set_to_none=True), forward with the loss, backward, optimizer step.

Variants (each in a process of its own, so that one variant's allocations, compiled code and patches never
touch another's timing):
    torch           the model as transformers builds it (attention: --attn, default sdpa), eager.
    torch+compile   the step's forward and loss under torch.compile (default mode).
    torch+compile-graphs  only when asked for: the same with mode="reduce-overhead" (forward and backward
                    replayed as CUDA graphs; CUDA only, skipped elsewhere).
    torch+compile+skip-mask, torch+compile-graphs+skip-mask, lsmini+compile+skip-mask,
    lsmini+compile-graphs+skip-mask  only when asked for: the compiled variants with transformers' eager-mode
                    mask rule kept while compiling (common.skip_masks_as_in_eager says why).
    lsmini          lsmini.convert(model) first (every GPT2Block / BertLayer / LlamaDecoderLayer one lsmini layer
                    call), eager.
    lsmini+compile  convert, then torch.compile.
    lsmini+compile-graphs  only when asked for: convert, then torch.compile(mode="reduce-overhead").
    lsmini+saved, lsmini+compile+saved, lsmini+compile-graphs+saved  only when asked for: the lsmini variants with
                    every converted block's recompute = False (its backward reads the FFN activation and the
                    pre-norm outputs saved, as the Hugging Face block's does, instead of recomputing them).
    lsmini+adam, lsmini+compile+adam, lsmini+compile-graphs+adam  only when asked for: the lsmini variants with
                    AdamW swapped for lsmini.optim.FusedAdam too.
    torch+liger     only when asked for in --variants: the model with Liger's Triton kernels, eager —
                    liger_kernel.transformers.apply_liger_kernel_to_llama(model=model) with its defaults (RMSNorm,
                    SwiGLU MLP, rotary embedding, and lm_head + loss as one fused linear cross entropy, the logits
                    never materialized). llama on CUDA only, and only when liger_kernel imports: otherwise the row
                    says skipped, and why. (Liger patches transformers' modeling_llama module globally: its own
                    process keeps that from the other variants.)
Reported per variant: ms_step (median over --iters steps after --warmup, CUDA events around each step with the
host running ahead, as in bench_convert.py; wall time on CPU), tokens_s (batch × length / ms_step), peak_mb
(torch.cuda.max_memory_allocated from the first step on), compile_s (the first step's wall time), the first and
last losses (variants start from the same weights; their dropout draws differ) and the report's replaced/kept.
--profile (CUDA) adds, per variant, where the time of a step goes, as bench_training.py --profile reports it:
kernel time by category (GEMMs, attention, lsmini's fused kernels, ...), the idle gaps between kernels and the
host's own time by operator.
On CUDA the rows are appended to benchmarks/results/hf.csv (benchmarks/report.py writes RESULTS.md from it;
torch+liger is of kind "pytorch" there, a baseline, and skipped rows are not recorded); CPU runs are smoke runs
and record nothing.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import lsmini  # noqa: E402
from lsmini.optim import FusedAdam  # noqa: E402

SEED, DATA_SEED = 1234, 7
N_BATCHES = 4
MASK_FRACTION = 0.15
LR, BETAS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 0.01
VARIANTS = ("torch", "torch+compile", "lsmini", "lsmini+compile")  # the default --variants
GRAPH_VARIANTS = ("torch+compile-graphs", "lsmini+compile-graphs")  # asked for by name: CUDA only
# asked for by name: the converted blocks with recompute = False (lsmini.convert_hf's "Memory")
SAVED_VARIANTS = ("lsmini+saved", "lsmini+compile+saved", "lsmini+compile-graphs+saved")
# asked for by name: the optimizer swapped too (lsmini.optim.FusedAdam)
ADAM_VARIANTS = ("lsmini+adam", "lsmini+compile+adam", "lsmini+compile-graphs+adam")
LIGER = "torch+liger"  # asked for by name only; see the module docstring
# asked for by name: the compiled variants without the masks transformers builds while tracing
SKIP_MASK_VARIANTS = ("torch+compile+skip-mask", "torch+compile-graphs+skip-mask", "lsmini+compile+skip-mask",
                      "lsmini+compile-graphs+skip-mask")
KNOWN_VARIANTS = VARIANTS + GRAPH_VARIANTS + SAVED_VARIANTS + ADAM_VARIANTS + SKIP_MASK_VARIANTS + (LIGER,)
GRAPH_READY_STEPS = 3  # reduce-overhead: compile + warm-up run, recording, first replay
MODELS = {  # name: (layers, hidden, heads, vocab, batch, length)
    "gpt2": (12, 768, 12, 50257, 8, 1024),
    "bert": (12, 768, 12, 30522, 32, 128),
    "llama": (12, 768, 12, 32000, 8, 1024),
}
TINY = {"gpt2": (2, 64, 4, 101, 2, 16), "bert": (2, 64, 4, 101, 2, 16), "llama": (2, 64, 4, 1000, 2, 16)}
# llama's key/value heads and intermediate (SwiGLU) size, which the shapes above do not hold: full, then --tiny
LLAMA_KV_FFN, TINY_LLAMA_KV_FFN = (4, 2048), (2, 128)
LLAMA_POSITIONS, LLAMA_RMS_EPS, LLAMA_ROPE_THETA = 2048, 1e-6, 10000.0
COLUMNS = ["model", "variant", "compile_s", "ms_step", "tokens_s", "peak_mb", "loss_first", "loss_final",
           "replaced", "kept", "error"]


def shape(args, name):
    return (TINY if args.tiny else MODELS)[name]


def llama_kv_ffn(args):
    return TINY_LLAMA_KV_FFN if args.tiny else LLAMA_KV_FFN


def build_model(args, name):
    """The model with random weights, in training mode (transformers is imported here: optional for lsmini)."""
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    layers, hidden, heads, vocab, _, length = shape(args, name)
    torch.manual_seed(SEED)
    if name == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_positions=max(length, 1024), n_embd=hidden, n_layer=layers,
                            n_head=heads, use_cache=False)
        model = GPT2LMHeadModel(config)
    elif name == "llama":
        kv_heads, ffn = llama_kv_ffn(args)
        # rope_theta as a keyword: transformers 5 folds it into rope_parameters, older versions keep it as is
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=max(length, LLAMA_POSITIONS), rms_norm_eps=LLAMA_RMS_EPS,
                             rope_theta=LLAMA_ROPE_THETA, tie_word_embeddings=False, attention_dropout=0.0,
                             use_cache=False)
        model = LlamaForCausalLM(config)
    else:
        config = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            intermediate_size=4 * hidden, max_position_embeddings=max(length, 512))
        model = BertForMaskedLM(config)
    model.set_attn_implementation(args.attn)
    return model.train()


def make_batches(args, name, device):
    """N_BATCHES (inputs, labels, attention mask or None): random tokens; gpt2's and llama's labels are their
    inputs, bert's the masked tokens; with --padding, rows right-padded (token 0, label -100)."""
    _, _, _, vocab, batch, length = shape(args, name)
    g = torch.Generator().manual_seed(DATA_SEED)
    batches = []
    for _ in range(N_BATCHES):
        ids = torch.randint(5, vocab, (batch, length), generator=g)
        if name in ("gpt2", "llama"):
            labels = ids.clone()
        else:
            hidden = torch.rand(ids.shape, generator=g) < MASK_FRACTION
            hidden[:, 0] = True
            labels = ids.masked_fill(~hidden, -100)
            ids = ids.masked_fill(hidden, 4)  # 4: a stand-in [MASK] id
        mask = None
        if args.padding:
            lengths = torch.randint(length // 2, length + 1, (batch, 1), generator=g)
            mask = (torch.arange(length)[None, :] < lengths).long()
            ids, labels = ids.masked_fill(mask == 0, 0), labels.masked_fill(mask == 0, -100)
            mask = mask.to(device)
        batches.append((ids.to(device), labels.to(device), mask))
    return batches


class Timer:
    """Per-step ms: CUDA events read after the loop (the host runs ahead), wall time on the CPU."""

    def __init__(self, device):
        self.cuda, self.spans = device.type == "cuda", []

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


def liger_skip_reason(name, device):
    """Why the torch+liger variant cannot run for model `name` here, or None when it can."""
    if name != "llama":
        return "Liger's kernels are applied to the llama model only"
    try:
        import liger_kernel.transformers  # noqa: F401 - optional; it also needs triton
    except Exception as e:  # noqa: BLE001 - not installed, or triton / its CUDA driver failing to load
        first = (str(e).strip().splitlines() or [""])[0]
        return f"liger_kernel does not import ({type(e).__name__}: {first})"[:300]
    if device.type != "cuda":
        return "Liger's kernels are Triton GPU kernels: CUDA only"
    return None


def apply_liger(model):
    """Liger's kernels in the llama model, as Liger documents for a model already built: its defaults (rope,
    rms_norm, swiglu and fused_linear_cross_entropy on, the plain cross_entropy off)."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    apply_liger_kernel_to_llama(model=model)


def run_variant(args, name, variant, device, row):
    parts = variant.split("+")
    use_lsmini, graphs = parts[0] == "lsmini", "compile-graphs" in parts
    compiled = graphs or "compile" in parts
    batches = make_batches(args, name, device)
    model = build_model(args, name).to(device)
    if variant == LIGER:
        apply_liger(model)
    if "skip-mask" in parts:
        common.skip_masks_as_in_eager()
    if use_lsmini:
        report = lsmini.convert(model)
        row["replaced"], row["kept"] = len(report.replaced), len(report.kept)
        if report.kept:
            print(report)
        if "saved" in parts:
            for block in model.modules():
                if lsmini.convert_hf.is_converted(block):
                    block.recompute = False

    def loss_fn(ids, labels, mask):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model(ids, attention_mask=mask, labels=labels).loss

    if compiled:
        loss_fn = torch.compile(loss_fn, mode="reduce-overhead" if graphs else "default")
    if "adam" in parts:  # the converted model's parameters move into the optimizer's workspace
        opt = FusedAdam(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                                fused=device.type == "cuda")

    def step(ids, labels, mask):
        if graphs:  # a new iteration: the graphs may overwrite the previous step's outputs
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ids, labels, mask)
        loss.backward()
        opt.step()
        return loss.detach().clone()  # a graph's output is overwritten by its next replay

    torch.manual_seed(SEED)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(max(args.warmup, GRAPH_READY_STEPS if graphs else 1)):
        loss = step(*batches[i % N_BATCHES])
        if i == 0:
            row["loss_first"] = loss.item()
            row["compile_s"] = time.perf_counter() - t0
    synchronize(device)
    timer, losses = Timer(device), []
    for i in range(args.iters):
        timer.start()
        losses.append(step(*batches[i % N_BATCHES]))
        timer.stop()
    ms = statistics.median(timer.times_ms())
    _, _, _, _, batch, length = shape(args, name)
    row["ms_step"], row["tokens_s"] = ms, batch * length / ms * 1e3
    if device.type == "cuda":
        row["peak_mb"] = torch.cuda.max_memory_allocated() / 2 ** 20
    row["loss_final"] = torch.stack(losses).float().mean().item()
    if args.profile and device.type == "cuda":
        row["profile"] = common.profile_step(step, batches)


ROW_MARK = "bench_hf row: "  # how a variant's process hands its row back (one stdout line, JSON)


def run_here(args, name, variant, device):
    """One variant in this process: its row, with "error" when it failed."""
    row = {"model": name, "variant": variant}
    try:
        run_variant(args, name, variant, device, row)
    except Exception as e:  # noqa: BLE001 - a failed variant is a result too; the others still run
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        row = {k: v for k, v in row.items() if k in ("model", "variant", "replaced", "kept")}
        row["error"] = f"{type(e).__name__}: {first}"[:300]
    return row


def run(args, name, variant, device):
    """One variant in a process of its own (this script with --one): its row."""
    if variant == LIGER:
        reason = liger_skip_reason(name, device)
        if reason is not None:
            return {"model": name, "variant": variant, "skipped": reason}
    if "compile-graphs" in variant.split("+") and device.type != "cuda":
        return {"model": name, "variant": variant, "skipped": "CUDA graphs need a CUDA device"}
    cmd = [sys.executable, os.path.abspath(__file__), "--one", "--models", name, "--variants", variant, "--iters",
           str(args.iters), "--warmup", str(args.warmup), "--attn", args.attn, "--device", args.device]
    cmd += (["--tiny"] if args.tiny else []) + (["--padding"] if args.padding else [])
    cmd += ["--profile"] if args.profile else []
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    row = None
    for line in done.stdout.splitlines():
        if line.startswith(ROW_MARK):
            row = json.loads(line[len(ROW_MARK):])
        else:
            print(line)
    if row is None:
        row = {"model": name, "variant": variant, "error": f"its process exited with status {done.returncode}"}
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,bert", help=f"comma-separated, of {','.join(MODELS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of {','.join(KNOWN_VARIANTS)} ({LIGER}: llama on CUDA, liger_kernel "
                         "installed; always run last)")
    ap.add_argument("--iters", type=int, default=20, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (the first one compiles)")
    ap.add_argument("--steps", type=int, help="shorthand: --warmup 1 --iters STEPS (smoke runs)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="the models' attention implementation")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="two-layer models of width 64 on 2 × 16 tokens (smoke runs)")
    ap.add_argument("--padding", action="store_true",
                    help="right-pad each row from a random length between half and all of it (attention_mask)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile where a step's time goes (CUDA): kernel time by category, the idle gaps "
                         "between kernels, the host's own time by operator")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a variant's own process (see run)
    common.add_results_arguments(ap)
    args = ap.parse_args(argv)
    if args.steps is not None:
        args.warmup, args.iters = 1, args.steps
    # each model and variant once, in the order given
    args.models = list(dict.fromkeys(m.strip() for m in args.models.split(",") if m.strip()))
    args.variants = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    for what, chosen, known in (("models", args.models, MODELS), ("variants", args.variants, KNOWN_VARIANTS)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            ap.error(f"unknown {what} {unknown}; choose from {','.join(known)}")
    if args.iters < 1 or args.warmup < 1:
        ap.error("--iters and --warmup must be at least 1")
    return args


def config_label(args, name):
    layers, hidden, heads, vocab, batch, length = shape(args, name)
    padded = " padded" if args.padding else ""
    if name == "llama":
        kv_heads, ffn = llama_kv_ffn(args)
        return (f"LlamaForCausalLM {layers}L d{hidden} h{heads} kv{kv_heads} ffn{ffn} vocab{vocab} bf16 "
                f"b{batch}x{length}{padded} attn={args.attn}")
    model = "GPT2LMHeadModel" if name == "gpt2" else "BertForMaskedLM"
    return f"{model} {layers}L d{hidden} h{heads} vocab{vocab} bf16 b{batch}x{length}{padded} attn={args.attn}"


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.one:
        print(ROW_MARK + json.dumps(run_here(args, args.models[0], args.variants[0], device)), flush=True)
        return None
    if device.type == "cuda":
        common.require_cuda_kernels("bench_hf.py")
    rows = []
    for name in args.models:
        for variant in args.variants:
            rows.append(run(args, name, variant, device))
            r = rows[-1]
            if "skipped" in r:
                outcome = f"skipped — {r['skipped']}"
            elif "error" in r:
                outcome = f"FAILED — {r['error']}"
            else:
                outcome = f"{r['ms_step']:.2f} ms/step, {r['tokens_s']:,.0f} tokens/s"
            print(f"# {name} {variant}: {outcome}", flush=True)
    print()
    # a skipped column only when a row was skipped (a variant asked for where it cannot run)
    print(common.markdown_table(rows, COLUMNS + (["skipped"] if any("skipped" in r for r in rows) else [])))
    if any("profile" in r for r in rows):
        print("\n" + common.profile_report(rows))
    if device.type == "cuda":
        env = common.environment()
        common.append_results(args.results, "hf", env, [
            {"benchmark": "hf", "config": config_label(args, r["model"]), "variant": r["variant"],
             "kind": "lsmini" if r["variant"].startswith("lsmini") else "pytorch", "ms": r.get("ms_step"),
             "tokens_s": r.get("tokens_s"), "peak_mb": r.get("peak_mb"), "compile_s": r.get("compile_s"),
             "loss_first": r.get("loss_first"), "loss_final": r.get("loss_final"), "note": r.get("error")}
            for r in rows if "skipped" not in r])  # a skipped variant measured nothing
    return rows


if __name__ == "__main__":
    main()
