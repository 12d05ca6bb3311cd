"""Timing helpers shared by the benchmarks: CUDA-event medians after warm-up, the device-to-device
copy bandwidth ceiling, result tables (markdown + CSV), and the results record: every benchmark appends
its rows to a CSV under benchmarks/results/, each stamped with GPU, torch, CUDA, commit and date, from
which benchmarks/report.py writes benchmarks/RESULTS.md; and where a training step's time goes (profile_step:
kernel time by category, idle gaps, the host's own time by operator); and skip_masks_as_in_eager, which keeps
a Hugging Face model's compiled PyTorch baseline on SDPA's flash kernel."""
import csv
import datetime
import os
import re
import statistics
import subprocess
import sys
import time

import torch


def time_ms(fn, warmup=10, iters=50):
    """Median device milliseconds of fn() over `iters` calls (CUDA events), after `warmup` calls.

    Before each timed call the GPU is held busy long enough for the host to enqueue the whole call, so the
    events measure device time only — not the Python/launch overhead of small ops, which would otherwise
    show up as idle gaps inside the timed region for both lsmini and the baseline alike. One call at a
    time: queued behind a single wait, 50 launch-heavy calls (a layer's forward + backward is ~100
    kernels) measured up to 3× slower than 10 calls did — the host was pacing the GPU again, most likely
    because the launch queue filled.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    host_s = (time.perf_counter() - t0) / 3  # upper bound on the host cost of one call
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(min(2e9, 1.5 * host_s * 2e9)))  # ~2 GHz cycles
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes=2 << 30):
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), warmup=5, iters=20)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / ms / 1e6


def compiled_or_none(fn, label):
    """torch.compile(fn) of a no-argument fn, compiled now by one call (outside any timed region), or None where
    compiling fails, with the reason printed under `label`: a row's compiled column is optional. Dynamo is
    reset first, so a benchmark that compiles one graph per shape stays clear of the recompile limit."""
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn)
        compiled()
        return compiled
    except Exception as e:  # noqa: BLE001 - the compiled column is optional
        print(f"# {label}: torch.compile baseline skipped: {type(e).__name__}: {e}")
        return None


def skip_masks_as_in_eager():
    """Patch transformers (this process only) to skip the attention mask while compiling when eager mode would.

    Eagerly, with no padding mask and position ids that are not packed sequences, transformers passes SDPA no
    mask (is_causal for a causal model), and SDPA may run its flash kernel. While tracing it cannot read the
    position ids (to rule out packing) and, under torch < 2.14, cannot tell compiling from exporting, so it
    builds the full mask, which keeps SDPA off the flash kernel (BERT, with dropout, then runs its float32 math
    path). The batches here have no padding and positions 0 .. length-1 in every row, so the patched model
    computes what it computes eagerly; only the choice of kernel changes. A transformers without these
    functions raises AttributeError.
    """
    import inspect

    import transformers.masking_utils as masking

    def eager_rule(original, causal):
        params = list(inspect.signature(original).parameters)

        def ignore_mask(*args, **kwargs):
            a = dict(zip(params, args), **kwargs)
            if a["padding_mask"] is not None or a.get("local_attention_size") is not None:
                return original(*args, **kwargs)
            return not causal or a["q_length"] == a["kv_length"]
        return ignore_mask

    for name, replacement in (("_ignore_causal_mask_sdpa", lambda f: eager_rule(f, causal=True)),
                              ("_ignore_bidirectional_mask_sdpa", lambda f: eager_rule(f, causal=False)),
                              ("find_packed_sequence_indices", lambda f: lambda position_ids: None)):
        setattr(masking, name, replacement(getattr(masking, name)))  # getattr names a function that is missing


def require_cuda_kernels(script):
    """Exit with the reason unless a CUDA device is there and lsmini runs its kernels on it."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA device")
    import lsmini

    if lsmini.backend() != "cuda":
        sys.exit(f"lsmini backend is {lsmini.backend()!r}: {lsmini.backend().reason}")


def environment(gpu=None):
    """Where and what a run measures: GPU name (`gpu` overrides it, e.g. for a CPU run or N GPUs), torch and
    CUDA versions, the date, the commit of this tree, and `run`, the id every row of one invocation shares."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "gpu": gpu if gpu is not None else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "date": now.date().isoformat(),
        "commit": commit(),
        "run": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


# ---- the results record ---------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
# Every results CSV starts with these columns; the benchmark's figures follow. `kind` says whose code a row
# times: "lsmini", or "pytorch" for the baselines that report.py compares lsmini against.
STAMP = ["date", "gpu", "torch", "cuda", "commit", "run"]
KEY = ["benchmark", "config", "variant", "kind"]
KINDS = ("lsmini", "pytorch")


def commit():
    """The commit of this tree (12 hex digits, "+dirty" when tracked files outside benchmarks/results differ
    from it); $LSMINI_COMMIT when set (a tree without git metadata); "unknown" when neither tells."""
    if os.environ.get("LSMINI_COMMIT"):
        return os.environ["LSMINI_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", ":(exclude)benchmarks/results"],
                               cwd=ROOT, capture_output=True, timeout=30).returncode != 0
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def add_results_arguments(ap):
    """--results DIR / --no-results on a benchmark's command line."""
    ap.add_argument("--results", metavar="DIR", default=os.environ.get("LSMINI_RESULTS_DIR") or RESULTS_DIR,
                    help="append this run's rows to the CSV files in DIR (default: $LSMINI_RESULTS_DIR, else "
                         "benchmarks/results; benchmarks/report.py makes RESULTS.md from them)")
    ap.add_argument("--no-results", dest="results", action="store_const", const=None,
                    help="record nothing (a trial run)")


def _cell(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return format(v, ".6g")
    return str(v)


def append_results(directory, name, env, rows):
    """Append `rows` to <directory>/<name>.csv, each stamped with `env` (see environment()). A row is a dict
    holding benchmark, config, variant and kind, then its figures (numbers or short strings). Columns the file
    does not have yet are added at its end (the file is rewritten with the wider header); a row leaves the
    columns it does not fill empty. Returns the file's path, or None when `directory` is None."""
    if directory is None or not rows:
        return None
    for r in rows:
        missing = [k for k in KEY if not r.get(k)]
        if missing:
            raise ValueError(f"a results row needs {KEY}; {missing} missing in {r}")
        if r["kind"] not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {r['kind']!r}")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.csv")
    old_rows, columns = [], STAMP + KEY
    if os.path.exists(path):
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or columns)
            old_rows = list(reader)
    new_columns = [k for r in rows for k in r if k not in columns and k not in STAMP]
    new_columns = list(dict.fromkeys(new_columns))
    stamped = [{**{k: env[k] for k in STAMP}, **r} for r in rows]
    if new_columns or not os.path.exists(path):
        columns += new_columns
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            for r in old_rows + stamped:
                w.writerow({k: _cell(r.get(k)) for k in columns})
    else:
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            for r in stamped:
                w.writerow({k: _cell(r.get(k)) for k in columns})
    print(f"# {len(rows)} rows appended to {os.path.relpath(path)}", flush=True)
    return path


def write_csv(path, rows, columns):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in columns})


def fmt(v, nd=3):
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def markdown_table(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


# ---- profile: where a training step's time goes--------------------------------------------------------------------
_CATEGORIES = [  # first match wins; names as the profiler reports the kernels
    ("optimizer", re.compile(r"adam|multi_tensor|amp_|unscale|grad_scale|non_finite|inf_and_scale", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm\d+_.*tensorop|s\d+gemm|ampere_|hopper_", re.I)),
    ("attention", re.compile(r"flash|fmha|attention_kernel|efficient_attention|sdpa", re.I)),
    ("lsmini fused", re.compile(r"lsmini::", re.I)),
    ("copy/fill", re.compile(r"memcpy|memset|copy_kernel|fill_kernel|CatArray", re.I)),
]


def _category(name):
    for cat, rx in _CATEGORIES:
        if rx.search(name):
            return cat
    return "other kernels"


def profile_step(step, batches, steps=5):
    """Kernel time per category, kernel count and the idle share of the GPU timeline over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
    return kernel_summary(prof, steps)


def kernel_summary(prof, steps):
    """profile_step's report from a finished torch.profiler `prof` that spanned `steps` steps; with the host's
    ATen operators and CUDA runtime calls by own CPU time (what a C++ layer call spends its time in)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Optimizer.", "ProfilerStep"))]  # annotations, not kernels
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:  # union of kernel intervals (overlapping streams count once)
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    wall = (spans[-1][1] - spans[0][0]) if spans else 0.0
    cats, names, calls = {}, {}, {}
    for e in kernels:
        dur = e.time_range.end - e.time_range.start
        c = _category(e.name)
        cats[c] = cats.get(c, 0.0) + dur
        names[e.name] = names.get(e.name, 0.0) + dur
        calls[e.name] = calls.get(e.name, 0) + 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:20]
    host = sorted(((e.key[:80], e.count / steps, e.self_cpu_time_total / 1e3 / steps) for e in prof.key_averages()),
                  key=lambda r: -r[2])[:30]
    return {"steps": steps, "kernels_per_step": len(kernels) / steps, "gpu_span_ms": wall / 1e3 / steps,
            "busy_ms": busy / 1e3 / steps, "idle_ms": (wall - busy) / 1e3 / steps,
            "categories_ms": {k: v / 1e3 / steps for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": [(n[:110], calls[n] / steps, v / 1e3 / steps) for n, v in top], "host_ops_ms": host}


def profile_report(results):
    """profile_step's results of the rows that have one (under "profile"), as markdown: a section a row, named by
    its "config" (or "model") and "variant"."""
    out = []
    for r in results:
        p = r.get("profile")
        if not p:
            continue
        out.append(f"### {r.get('config', r.get('model'))} / {r['variant']}: {r['ms_step']:.2f} ms per step, "
                   f"{p['kernels_per_step']:.0f} kernels per step")
        out.append(f"GPU timeline per step {p['gpu_span_ms']:.2f} ms: busy {p['busy_ms']:.2f} ms, idle between "
                   f"kernels {p['idle_ms']:.2f} ms\n")
        out.append("| where | ms per step | share of busy |\n|---|---|---|")
        for k, v in p["categories_ms"].items():
            out.append(f"| {k} | {v:.2f} | {100 * v / max(p['busy_ms'], 1e-9):.0f}% |")
        out.append("\n| top kernels | calls per step | ms per step | µs a call |\n|---|---|---|---|")
        for n, calls, v in p["top_kernels_ms"]:
            out.append(f"| `{n}` | {calls:.1f} | {v:.3f} | {1e3 * v / max(calls, 1e-9):.1f} |")
        out.append("\n| host: ATen operators, CUDA runtime calls | calls per step | own ms per step |\n|---|---|---|")
        for n, calls, v in p["host_ops_ms"][:15]:
            out.append(f"| `{n}` | {calls:.1f} | {v:.3f} |")
        out.append("")
    return "\n".join(out)
