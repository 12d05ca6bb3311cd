"""Kernel benchmarks: every fused op beside its plain PyTorch equivalent, in the same run.

    python benchmarks/bench_kernels.py [--quick] [--only PREFIX] [--out DIR] [--results DIR | --no-results]

Each op family has a module in benchmarks/kernels/ with a function `bench(ctx)` that calls
`ctx.row(...)` once per (op, dtype, shape). Memory-bound rows report GB/s (bytes each input read once
plus each output written once, over the lsmini time), the percentage of the device-to-device copy
bandwidth measured at the start of this run (2 GiB), and the percentage of a copy that moves the row's bytes,
timed as the row is (what the size itself allows: a small call does not reach the large copy's rate).
Results: a table on stdout; rows appended to benchmarks/results/kernels.csv (one row per variant: lsmini,
torch, torch+compile where timed), from which benchmarks/report.py writes RESULTS.md; with --out, this run's
table as kernels.csv and kernels.md in DIR.
"""
import argparse
import importlib
import os
import pkgutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
import kernels  # noqa: E402

COLUMNS = ["row", "dtype", "shape", "lsmini_ms", "torch_ms", "compiled_ms", "speedup", "speedup_compiled",
           "GB/s", "%copy", "%copy_same", "note"]


class Context:
    def __init__(self, quick, only):
        self.quick = quick
        self.only = only
        self.rows = []
        self.results = []  # one row per (config, variant), for benchmarks/results/kernels.csv
        self.copy_gbs = common.copy_bandwidth_gbs()
        self._same_copy_ms = {}  # bytes moved → ms of a device-to-device copy moving as many

    def same_copy_ms(self, nbytes, iters):
        """ms of a device-to-device copy that reads nbytes / 2 and writes as many, timed as the rows are."""
        half = nbytes // 2
        if half not in self._same_copy_ms:
            src = torch.empty(half, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            self._same_copy_ms[half] = common.time_ms(lambda: dst.copy_(src), warmup=5, iters=iters)
        return self._same_copy_ms[half]

    def wanted(self, name):
        return not self.only or any(name.startswith(p) for p in self.only)

    def row(self, name, dtype, shape, lsmini_fn, torch_fn, nbytes=None, compiled_fn=None, compiled_ms=None, note="",
            variant="lsmini", baseline="torch", baseline_kind="pytorch"):
        """Time lsmini_fn beside torch_fn (and compiled_fn if given, or take compiled_ms measured elsewhere);
        nbytes = bytes the op must move. variant names lsmini_fn's row in the results, baseline torch_fn's
        (baseline_kind "lsmini" where the comparison is another lsmini path, not PyTorch)."""
        if not self.wanted(name):
            return
        iters = 10 if self.quick else 50
        ms = common.time_ms(lsmini_fn, warmup=5, iters=iters)
        t_ms = common.time_ms(torch_fn, warmup=5, iters=iters)
        c_ms = common.time_ms(compiled_fn, warmup=5, iters=iters) if compiled_fn else compiled_ms
        r = {"row": name, "dtype": str(dtype).replace("torch.", ""), "shape": shape, "lsmini_ms": ms,
             "torch_ms": t_ms, "speedup": t_ms / ms, "note": note}
        if c_ms is not None:
            r["compiled_ms"] = c_ms
            r["speedup_compiled"] = c_ms / ms
        if nbytes:
            r["GB/s"] = nbytes / ms / 1e6
            r["%copy"] = 100.0 * r["GB/s"] / self.copy_gbs
            r["%copy_same"] = 100.0 * self.same_copy_ms(nbytes, iters) / ms
        self.rows.append(r)
        self._record(r, variant, baseline, baseline_kind, c_ms)
        print(common.markdown_table([r], COLUMNS).splitlines()[-1], flush=True)

    def _record(self, r, variant, baseline, baseline_kind, c_ms):
        config = f"{r['row']} {r['dtype']} {r['shape']}"
        seen = {(x["config"], x["variant"]) for x in self.results}
        timed = [(variant, "lsmini", r["lsmini_ms"], r.get("GB/s"), r.get("%copy"), r.get("%copy_same")),
                 (baseline, baseline_kind, r["torch_ms"], None, None, None)]
        if c_ms is not None:
            timed.append(("torch+compile", "pytorch", c_ms, None, None, None))
        for v, kind, ms, gbs, pct, pct_same in timed:
            if (config, v) in seen:  # the same lsmini call timed again beside another baseline
                continue
            self.results.append({"benchmark": "kernels", "config": config, "variant": v, "kind": kind, "ms": ms,
                                 "gbs": gbs, "pct_copy": pct, "copy_gbs": self.copy_gbs,
                                 "pct_copy_same": pct_same, "note": r["note"]})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (for scripts/check_gpu.sh)")
    ap.add_argument("--only", nargs="*", default=[], help="row-name prefixes to run")
    ap.add_argument("--out", help="also write this run's table to DIR/kernels.csv and DIR/kernels.md")
    common.add_results_arguments(ap)
    args = ap.parse_args()
    common.require_cuda_kernels("bench_kernels.py")
    env = common.environment()
    ctx = Context(args.quick, args.only)
    print(f"# {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}; "
          f"device-to-device copy {ctx.copy_gbs:.0f} GB/s")
    print("| " + " | ".join(COLUMNS) + " |")
    for m in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"kernels.{m.name}").bench(ctx)
        torch.cuda.empty_cache()
    common.append_results(args.results, "kernels", env, ctx.results)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        common.write_csv(os.path.join(args.out, "kernels.csv"), ctx.rows, COLUMNS)
        with open(os.path.join(args.out, "kernels.md"), "w") as f:
            f.write(f"{env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}; "
                    f"copy bandwidth {ctx.copy_gbs:.0f} GB/s\n\n")
            f.write(common.markdown_table(ctx.rows, COLUMNS) + "\n")


if __name__ == "__main__":
    main()
