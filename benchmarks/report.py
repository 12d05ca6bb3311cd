"""Write benchmarks/RESULTS.md, and the README's tables of headline numbers and of the examples' defaults, from
benchmarks/results/*.csv.

    python benchmarks/report.py [--results DIR] [--out PATH] [--readme PATH] [--check]

Each benchmark appends its rows to a CSV under benchmarks/results/ (benchmarks/common.append_results), and
scripts/check_gpu.sh appends the test suite's counts to gpu_tests.csv. This script shows, per benchmark and
GPU, the latest row of every (config, variant): the one of the latest date, and of two rows of one date the
later in its file. Beside each row that has a time (`ms`), its ratio to the strongest PyTorch variant of the same
run and config, that is the fastest row of kind "pytorch" with the same `run`: above 1 is faster than PyTorch.
A row without times may carry that ratio as measured (`vs_pytorch`). --check writes nothing and exits 1 when
the files differ from what it would write (tests/test_report.py checks the committed ones).
"""
import argparse
import csv
import glob
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import KEY, RESULTS_DIR, ROOT, STAMP  # noqa: E402

RESULTS_MD = os.path.join(ROOT, "benchmarks", "RESULTS.md")
README = os.path.join(ROOT, "README.md")
README_BEGIN = "<!-- headline results: written by benchmarks/report.py from benchmarks/results/*.csv -->"
README_END = "<!-- end of headline results -->"
DEFAULTS_BEGIN = "<!-- defaults: written by benchmarks/report.py from benchmarks/results/defaults.csv -->"
DEFAULTS_END = "<!-- end of defaults -->"

SECTIONS = {  # benchmark: (title, script, what a row is)
    "training": ("Whole training steps", "bench_training.py",
                 "forward, backward and optimizer step of a whole model; median ms per step, peak memory from "
                 "the first step on; each variant in its own process"),
    "training_multi_gpu": ("Data-parallel scaling", "bench_training.py --nproc N",
                           "the same step on one GPU and on N (each GPU with the config's batch); `× 1 GPU` is "
                           "the N-GPU tokens/s over one GPU's"),
    "convert": ("A torch.nn.Transformer training script, converted", "bench_convert.py",
                "the script as written (torch) and with `lsmini.convert(model)` (lsmini), eager and under "
                "torch.compile; compile s is the first step's wall time (reduce-overhead: the first three)"),
    "hf": ("Hugging Face training steps, converted", "bench_hf.py",
           "GPT2LMHeadModel (GPT-2 small, 8 × 1024 tokens), BertForMaskedLM (BERT base, 32 × 128) and "
           "LlamaForCausalLM (125M, 4 K/V heads, 8 × 1024) as transformers builds them (torch) and with "
           "`lsmini.convert(model)` (lsmini), eager and under torch.compile, Llama also with Liger's kernels "
           "(torch+liger); bf16 autocast, fused AdamW. The +skip-mask variants keep transformers' eager mask rule "
           "while compiling, the stronger PyTorch baselines ([docs/compile-and-convert.md]"
           "(../docs/compile-and-convert.md) says why)"),
    "attention": ("Fused attention over sequence lengths", "bench_attention.py",
                  "forward + backward at 16,384 tokens a row, hidden 1024, dropout 0.1, beside the fastest SDPA "
                  "backend; `lsmini bits=always` keeps the dropout bits at every length"),
    "kernels": ("Kernels", "bench_kernels.py",
                "one op beside its plain PyTorch equivalent; memory-bound rows also as GB/s, % of the "
                "device-to-device copy bandwidth measured in the same run, and % of a copy of the row's bytes "
                "timed as the row is"),
    "host": ("Host time per call", "bench_host.py",
             "µs of host time per eager call on tiny inputs (best of 5 repeats), and the call's device time"),
    "defaults": ("The examples' defaults against tuned flags", "bench_defaults.py",
                 "the example with only the data flags and --arch (defaults) beside a grid of tuned flags, on the "
                 "built-in corpora and on real text: test BLEU (sacreBLEU, beam 4) or validation perplexity, and "
                 "the whole command's wall time"),
}
LABELS = {"ms": "ms", "tokens_s": "tokens/s", "peak_mb": "peak MB", "scaling": "× 1 GPU", "gbs": "GB/s",
          "pct_copy": "% of copy", "copy_gbs": "copy GB/s", "pct_copy_same": "% of a same-size copy",
          "fwd_ms": "fwd ms", "tflops": "TFLOP/s",
          "compile_s": "compile s", "tgt_tokens_s": "target tokens/s", "loss_first": "first loss",
          "loss_final": "final loss", "us": "µs", "device_us": "device µs", "valid_loss": "valid loss",
          "command_s": "command s", "train_s": "training s", "duration_s": "duration s", "bleu": "BLEU",
          "ppl": "perplexity"}
MS_LABELS = {"training": "ms/step", "training_multi_gpu": "ms/step", "convert": "ms/step", "hf": "ms/step",
             "attention": "fwd+bwd ms"}
HIDDEN = set(STAMP) | set(KEY) | {"note", "vs_pytorch"}

# The README's headline numbers: (benchmark, config, variant, GPU, what it is).
HEADLINES = [
    ("training", "base", "lsmini+graph", "NVIDIA H200",
     "Training step, Transformer-base (6+6 layers, hidden 512), one CUDA graph"),
    ("training", "base-long", "lsmini+graph", "NVIDIA H200", "Training step, Transformer-base on 256-token pairs"),
    ("training", "lm", "lsmini+graph", "NVIDIA H200", "Training step, 12-layer decoder-only model, 512 tokens"),
    ("convert", "nn.Transformer 6+6 d512 h8 ffn2048 vocab8000 post-LN bf16 b128 64/64 masks=per-model cached-compiles",
     "lsmini+compile-graphs", "NVIDIA H200",
     "An nn.Transformer script with `lsmini.convert`, `torch.compile(mode=\"reduce-overhead\")`"),
    ("training", "llama", "lsmini+graph+saved", "NVIDIA H200",
     "Training step, Llama-style 125M (RMSNorm, RoPE, SwiGLU, 4 K/V heads), 8 × 1024 tokens, one CUDA graph, "
     "activations saved (recompute=False)"),
    ("hf", "LlamaForCausalLM 12L d768 h12 kv4 ffn2048 vocab32000 bf16 b8x1024 attn=sdpa", "lsmini+compile-graphs",
     "NVIDIA H200",
     "Hugging Face LlamaForCausalLM 125M with `lsmini.convert`, `torch.compile(mode=\"reduce-overhead\")`"),
    ("hf", "GPT2LMHeadModel 12L d768 h12 vocab50257 bf16 b8x1024 attn=sdpa", "lsmini+compile-graphs", "NVIDIA H200",
     "Hugging Face GPT2LMHeadModel (GPT-2 small) with `lsmini.convert`, `torch.compile(mode=\"reduce-overhead\")`"),
    ("hf", "BertForMaskedLM 12L d768 h12 vocab30522 bf16 b32x128 attn=sdpa", "lsmini+compile-graphs", "NVIDIA H200",
     "Hugging Face BertForMaskedLM (BERT base) with `lsmini.convert`, `torch.compile(mode=\"reduce-overhead\")`"),
    ("kernels", "attention_bwd float16 64x8x128x64 pad p=0.1", "lsmini", "NVIDIA H200",
     "Fused attention forward + backward, 128 tokens, padding"),
    ("kernels", "attention_bwd float16 8x16x1024x64 causal p=0.1", "lsmini", "NVIDIA H200",
     "Fused attention forward + backward, 1024 tokens, causal"),
    ("kernels", "layernorm_fwd float16 65536x1024", "lsmini", "NVIDIA H200", "LayerNorm forward, 65536 × 1024"),
    ("kernels", "cross_entropy_fwd_bwd float16 16384x32000", "lsmini", "NVIDIA H200",
     "Label-smoothed cross-entropy forward + backward, 16384 × 32000"),
    ("kernels", "adam float16 89.2M params in 258 tensors", "lsmini", "NVIDIA H200",
     "FusedAdam step, 89.2M fp16 parameters (fp32 master weights)"),
]


# ---- reading and selecting ------------------------------------------------------------------------------
def load(directory):
    """Every row of every CSV in `directory`, in file order, each with its file's name under "_file" and its
    position under "_pos"."""
    rows = []
    for path in sorted(glob.glob(os.path.join(directory, "*.csv"))):
        with open(path, newline="") as f:
            for i, r in enumerate(csv.DictReader(f)):
                missing = [k for k in STAMP + KEY if k not in r]
                if missing:
                    raise ValueError(f"{path}: row {i + 2} lacks the columns {missing}")
                rows.append({**r, "_file": os.path.basename(path), "_pos": i})
    return rows


def key(row):
    return row["benchmark"], row["config"], row["variant"], row["gpu"]


def latest(rows):
    """{(benchmark, config, variant, gpu): the latest row}: latest date; of one date, the later in its file."""
    out = {}
    for r in rows:
        k = key(r)
        if k not in out or (r["date"], r["_pos"]) >= (out[k]["date"], out[k]["_pos"]):
            out[k] = r
    return out


def number(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def baseline(rows, row):
    """The strongest PyTorch row of `row`'s run and config (the lowest ms of kind "pytorch"), or None."""
    same = [r for r in rows if r["_file"] == row["_file"] and r["run"] == row["run"] and r["kind"] == "pytorch"
            and r["benchmark"] == row["benchmark"] and r["config"] == row["config"] and number(r.get("ms"))]
    return min(same, key=lambda r: number(r["ms"]), default=None)


def ratio(rows, row):
    """(ratio, baseline row): the strongest PyTorch variant's ms of the same run over this row's, or, for a row
    without times, the ratio it records (`vs_pytorch`, baseline None); (None, None) when neither is there."""
    base, ms = baseline(rows, row), number(row.get("ms"))
    if base is not None and ms:
        return number(base["ms"]) / ms, base
    recorded = number(row.get("vs_pytorch"))
    return (recorded, None) if recorded is not None else (None, None)


# ---- formatting ------------------------------------------------------------------------------------------
_DECIMAL = re.compile(r"^-?\d+(\.\d+)?$")


def fmt(v):
    """A cell: numbers of 10,000 and more as whole numbers with thousands separators; a plain decimal of up to
    4 significant digits as written ("11.00" stays); other numbers to 4 significant digits."""
    x = number(v)
    if x is None:
        return str(v or "").replace("|", "\\|")
    if abs(x) >= 10000:
        return f"{x:,.0f}"
    s = str(v).strip()
    if _DECIMAL.match(s) and len(s.lstrip("-").replace(".", "").lstrip("0")) <= 4:
        return s
    return f"{x:.4g}"


def natural(text):
    """A sort key that orders the numbers inside text by value (len128 before len1024)."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _ordered(selected):
    """Rows by config, then lsmini's variants before PyTorch's, each in natural order."""
    return sorted(selected, key=lambda r: (natural(r["config"]), r["kind"] != "lsmini", natural(r["variant"])))


def section(benchmark, rows, selected):
    title, script, what = SECTIONS.get(benchmark, (benchmark, "", ""))
    out = [f"## {title}", ""]
    if script:
        out += [f"`benchmarks/{script.split()[0]}`{script[len(script.split()[0]):]}: {what}.", ""]
    mine = [r for r in rows if r["benchmark"] == benchmark]
    for gpu in sorted({r["gpu"] for r in selected}):
        chosen = _ordered([r for r in selected if r["gpu"] == gpu])
        figures = [c for c in _columns(mine) if any(r.get(c) for r in chosen)]
        ratios = [ratio(rows, r)[0] for r in chosen]
        show_ratio = any(x is not None for x in ratios)
        notes = any(r.get("note") for r in chosen)
        header = (["config", "variant"] + [MS_LABELS.get(benchmark, "ms") if c == "ms" else LABELS.get(c, c)
                                           for c in figures]
                  + (["× PyTorch"] if show_ratio else []) + ["date", "commit"] + (["note"] if notes else []))
        body = []
        for i, (r, x) in enumerate(zip(chosen, ratios)):
            repeated = i > 0 and chosen[i - 1]["config"] == r["config"]  # the config cell once per group
            cells = ["" if repeated else fmt(r["config"]), fmt(r["variant"])] + [fmt(r.get(c)) for c in figures]
            cells += ([f"{x:.2f}×" if x is not None else ""] if show_ratio else []) + [r["date"], r["commit"]]
            same_note = repeated and chosen[i - 1].get("note") == r.get("note")  # said once per group
            cells += ["" if same_note else fmt(r.get("note"))] if notes else []
            body.append(cells)
        out += [f"### {gpu}", "", table(header, body), ""]
    return out


def _columns(rows):
    cols = []
    for r in rows:
        for c in r:
            if c not in HIDDEN and not c.startswith("_") and c not in cols:
                cols.append(c)
    return cols


def gpu_tests_section(selected):
    chosen = sorted((r for r in selected if r["benchmark"] == "gpu_tests"), key=lambda r: (r["date"], r["gpu"]),
                    reverse=True)
    out = ["## The test suite on a GPU", "",
           "`scripts/check_gpu.sh` builds the extension, runs `python -m pytest -q -rs tests` and records the counts "
           "(`benchmarks/gpu_tests.py`). The latest run per GPU and target:", ""]
    body = [[r["gpu"], r["date"], r["commit"], r["torch"], r["cuda"], fmt(r["config"]), fmt(r.get("result")),
             fmt(r.get("passed")), fmt(r.get("failed")), fmt(r.get("skipped")), fmt(r.get("errors")),
             fmt(r.get("duration_s")), fmt(r.get("note"))] for r in chosen]
    out += [table(["GPU", "date", "commit", "torch", "CUDA", "target", "result", "passed", "failed", "skipped",
                   "errors", "duration s", "note"], body), ""]
    return out


HOW_MEASURED = """## How measured

- Times are medians after warm-up, from CUDA events (`benchmarks/common.time_ms`). For single ops and layers
  the GPU is held busy before each timed call, so that the host has queued the whole call: the figure is
  device time, for lsmini and PyTorch alike. Whole training steps run as in training, the host running
  ahead, so launch gaps count; each (config, variant) runs in a process of its own.
- The PyTorch side of every comparison runs in the same process or run as lsmini's, on the same inputs:
  eager, `torch.compile` and, for whole steps, `torch.compile(mode="reduce-overhead")` (CUDA graphs), the
  strongest PyTorch variant. `× PyTorch` is the strongest PyTorch variant's time of the same run and config
  over the row's: above 1, lsmini is faster. A row measured without its own times carries the ratio as
  measured then.
- GB/s counts each input read once and each output written once, over lsmini's time; `% of copy` divides it
  by the device-to-device copy bandwidth measured in the same run (`copy GB/s`).
- Peak memory is `torch.cuda.max_memory_allocated` from the first step on, CUDA-graph recording included.
- Each row is the latest measurement of its (benchmark, config, variant, GPU); rows of one table can come
  from different runs and commits, so compare the ratios, which come from one run each. A commit `unknown`
  was not recorded with the row. Host-bound figures (steps without a CUDA graph, host µs) follow the speed of
  the host at the time and move by tens of percent between runs.
- Reproduce a row with the benchmark's script (its docstring gives the command; `--help` the options); each
  run appends to `benchmarks/results/*.csv`, and `python benchmarks/report.py` rewrites this file. Ideas that
  were measured and not kept are in `docs/performance-notes.md`.
"""


def render(rows):
    """RESULTS.md's text for `rows` (load()'s)."""
    selected = list(latest(rows).values())
    out = ["# Benchmark results", "",
           "Written by `benchmarks/report.py` from `benchmarks/results/*.csv`; do not edit by hand. Every row is "
           "the latest measurement of its benchmark, config, variant and GPU, with its date and commit.", ""]
    if any(r["benchmark"] == "gpu_tests" for r in selected):
        out += gpu_tests_section(selected)
    names = list(SECTIONS) + sorted({r["benchmark"] for r in selected} - set(SECTIONS) - {"gpu_tests"})
    for name in names:
        if any(r["benchmark"] == name for r in selected):
            out += section(name, rows, [r for r in selected if r["benchmark"] == name])
    out.append(HOW_MEASURED)
    return "\n".join(out)


def headline_table(rows, headlines=HEADLINES):
    """The README's table: each headline's latest row beside the strongest PyTorch variant of its run."""
    chosen = latest(rows)
    body = []
    for benchmark, config, variant, gpu, what in headlines:
        r = chosen.get((benchmark, config, variant, gpu))
        if r is None:
            raise KeyError(f"headline row {benchmark} / {config} / {variant} / {gpu} is not in the results")
        x, base = ratio(rows, r)
        unit = "ms/step" if benchmark in ("training", "convert", "hf") else "ms"
        ours = f"{fmt(r['ms'])} {unit}" if number(r.get("ms")) else f"{fmt(r['pct_copy'])}% of copy bandwidth"
        if base is not None:
            theirs = f"{fmt(base['ms'])} {unit} ({base['variant']})"
        else:
            theirs = "ratio recorded without times" if x is not None else "—"
        body.append([what, ours, theirs, f"**{x:.2f}×**" if x is not None else "", gpu, r["date"]])
    return table(["", "lsmini", "strongest PyTorch variant, same run", "lsmini vs PyTorch", "GPU", "date"], body)


SEED_FLAG = re.compile(r"(?:^|\s)--seed (\d+)(?=\s|$)")


def configuration_and_seed(variant):
    """(flags, seed) of a defaults.csv variant: its flags without --seed (\"\" for the defaults' configuration:
    "defaults", or a bare "--seed N") and the seed it ran at (1, the examples' default, when none is given)."""
    m = SEED_FLAG.search(variant)
    flags = " ".join(SEED_FLAG.sub(" ", variant).split())
    return ("" if flags == "defaults" else flags), int(m.group(1)) if m else 1


def defaults_table(rows):
    """The README's table of the examples' defaults: per corpus and GPU, the latest run of the defaults beside
    the best tuned configuration of the same corpus (bench_defaults.py): BLEU higher or perplexity lower is
    better. Where the defaults also ran at other seeds (bench_defaults.py --seeds; runs with the warmup,
    cooldown and lr the latest defaults' run chose), both sides are the means over those seeds, and only
    configurations that ran at all of them are compared: one configuration's runs differ by about a BLEU point
    from seed to seed, so the best of many single runs would mostly measure the luck of its seed."""
    chosen = sorted((r for r in latest(rows).values() if r["benchmark"] == "defaults"),
                    key=lambda r: (r["date"], r["_pos"]))
    body = []
    runs = sorted((r for r in chosen if r["variant"] == "defaults"), key=lambda r: (r["gpu"], natural(r["config"])))
    for d in runs:
        lm = bool(number(d.get("ppl")))
        name, better = ("ppl", min) if lm else ("bleu", max)
        schedule = lambda r: (r["warmup"], number(r.get("cooldown")) or 0, r["lr"])  # noqa: E731 (none: 0)
        by_config = {}  # flags -> {seed: quality}, the later row of two for one seed
        for r in chosen:
            q = number(r.get(name))
            if (r["config"], r["gpu"]) == (d["config"], d["gpu"]) and r is not d and q is not None:
                flags, seed = configuration_and_seed(r["variant"])
                if flags or schedule(r) == schedule(d):
                    by_config.setdefault(flags, {})[seed] = q
        mine = {**by_config.pop("", {}), 1: number(d[name])}
        seeds = sorted(mine)
        mean = lambda qs: sum(qs[s] for s in seeds) / len(seeds)  # noqa: E731
        tuned = [(flags, mean(qs)) for flags, qs in by_config.items() if set(seeds) <= set(qs)]
        best = better(tuned, key=lambda t: t[1], default=None)
        ours = mean(mine)
        show = (lambda v: f"{v:.1f}") if lm else (lambda v: f"{v:.2f}")  # noqa: E731
        over = f" (mean of seeds {seeds[0]}-{seeds[-1]})" if len(seeds) > 1 else ""
        gap = ""
        if best is not None:
            gap = f"{(ours / best[1] - 1) * 100:+.1f}%" if lm else f"{ours - best[1]:+.2f}"
        cooldown = f", cooldown {fmt(d['cooldown'])}" if number(d.get("cooldown")) else ""
        chose = f"{fmt(d['steps'])} steps, warmup {fmt(d['warmup'])}{cooldown}, lr {fmt(d['lr'])}"
        body.append([fmt(d["config"]), chose, f"{'perplexity' if lm else 'BLEU'} {show(ours)}{over}",
                     f"{show(best[1])} (`{best[0]}`)" if best else "—", gap, f"{fmt(d['command_s'])} s", d["gpu"],
                     d["date"]])
    return table(["example, corpus", "what the defaults chose", "defaults", "best tuned configuration", "gap",
                  "whole command", "GPU", "date"], body)


def with_tables(readme, rows):
    """The README's text with its headline and defaults blocks rewritten."""
    for (begin_marker, end_marker), make in (((README_BEGIN, README_END), headline_table),
                                             ((DEFAULTS_BEGIN, DEFAULTS_END), defaults_table)):
        begin, end = readme.find(begin_marker), readme.find(end_marker)
        if begin < 0 or end < begin:
            raise ValueError(f"README.md lacks the markers {begin_marker!r} ... {end_marker!r}")
        readme = readme[:begin] + begin_marker + "\n" + make(rows) + "\n" + readme[end:]
    return readme


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=RESULTS_DIR, help="the CSV directory (default benchmarks/results)")
    ap.add_argument("--out", default=RESULTS_MD, help="the file to write (default benchmarks/RESULTS.md)")
    ap.add_argument("--readme", default=README, help="the README whose tables to rewrite ('' for none)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is not up to date")
    args = ap.parse_args(argv)
    rows = load(args.results)
    outputs = {args.out: render(rows)}
    if args.readme:
        with open(args.readme) as f:
            outputs[args.readme] = with_tables(f.read(), rows)
    stale = []
    for path, text in outputs.items():
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            stale.append(path)
            if not args.check:
                with open(path, "w") as f:
                    f.write(text)
    for path in stale:
        print(f"{'out of date' if args.check else 'wrote'}: {os.path.relpath(path)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
