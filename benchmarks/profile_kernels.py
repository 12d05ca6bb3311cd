"""Run each benchmark row's lsmini call once inside a profiler range, for Nsight Compute.

    ncu --clock-control none --profile-from-start off -k regex:'^(layernorm|bias_)' \\
        --section SpeedOfLight --section WarpStateStats ... \\
        python benchmarks/profile_kernels.py --only layernorm bias_

The rows and their inputs are bench_kernels.py's (the modules in benchmarks/kernels/); instead of
timing, each wanted row calls its lsmini function twice outside the range (warm-up: allocations,
lazy initialisation) and once inside cudaProfilerStart/Stop, so the profiler sees exactly one call
of each row, in the order printed. `--copy` first adds a plain elementwise copy of 1 GiB (torch's
vectorized kernel) as the bandwidth reference the rows are compared with.

Where a kernel's issue slots go, per SASS instruction (executions and stall samples of each line):

    ncu --clock-control none --profile-from-start off --section SourceCounters -o /tmp/rows \
        python benchmarks/profile_kernels.py --only embedding_fwd
    ncu -i /tmp/rows.ncu-rep --page source --csv --print-source sass > rows_sass.csv
"""
import argparse
import importlib
import os
import pkgutil
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kernels  # noqa: E402


class ProfileContext:
    quick = True  # the quick-mode shapes, which the RESULTS tables report

    def __init__(self, only):
        self.only = only
        self.count = 0

    def wanted(self, name):
        return not self.only or any(name.startswith(p) for p in self.only)

    def row(self, name, dtype, shape, lsmini_fn, torch_fn, **_):
        if not self.wanted(name):
            return
        lsmini_fn()
        lsmini_fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        lsmini_fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        self.count += 1
        print(f"profiled {self.count}: {name} {str(dtype).replace('torch.', '')} {shape}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=[], help="row-name prefixes to run")
    ap.add_argument("--copy", action="store_true", help="first profile a 1 GiB elementwise copy")
    args = ap.parse_args()
    import lsmini

    if lsmini.backend() != "cuda":
        sys.exit(f"lsmini backend is {lsmini.backend()!r}: {lsmini.backend().reason}")
    ctx = ProfileContext(args.only)
    if args.copy:
        src = torch.randn(1 << 28, device="cuda")
        dst = torch.empty_like(src)
        ctx.only, only = [], ctx.only
        ctx.row("copy", src.dtype, "2^28 fp32", lambda: torch.mul(src, 1.0, out=dst), None)
        ctx.only = only
        del src, dst
    for m in pkgutil.iter_modules(kernels.__path__):
        # whole layers / compute-bound: not bandwidth rows, so only when --only names them
        if m.name in ("layers", "attention") and not any(p.startswith(m.name) for p in ctx.only):
            continue
        importlib.import_module(f"kernels.{m.name}").bench(ctx)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
