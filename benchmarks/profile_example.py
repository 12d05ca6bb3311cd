"""Where a step of an example's training loop goes: the host's work against the GPU's.

    python benchmarks/profile_example.py [--example translation|lm] [--skip 60] [--steps 40] [--top 25]
                                         [-- EXAMPLE FLAGS...]

Runs examples/train_<example>.py in this process (default flags: the built-in task, ``--arch small
--no-cuda-graph``, 400 steps, validation only at the end, a save dir under /tmp) and watches its training loop's steps
(``lsmini.train.TrainStep`` calls) after the first --skip:
- the next --steps under torch.profiler: the GPU's kernel time per step by category, kernels per step and
  idle time (as ``bench_training.py --profile``), and the host's ATen operators and CUDA runtime calls by
  their own time;
- the next --steps under cProfile: the host's time by function (cumulative and own), for the steps and the
  loop's work between them (batches to the device, the scheduler, logging).
Also the median wall time from one step's start to the next's, over each window, and the example's own
tokens/s (metrics.json). Results go to stdout and, as JSON, to --out.
"""
import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from common import kernel_summary  # noqa: E402

DEFAULT_FLAGS = {name: ["--arch", "small", "--no-cuda-graph", "--max-steps", "400", "--eval-every", "1000000",
                        "--no-progress", "--overwrite", "--save-dir", f"/tmp/profile_example/{name}"]
                 for name in ("translation", "lm")}


class StepWatch:
    """Wraps TrainStep.__call__: counts the steps and opens/closes the two profiling windows between them."""

    def __init__(self, skip, steps):
        self.skip, self.steps, self.count = skip, steps, 0
        self.starts = []
        self.prof = self.cprof = None
        self.kernels = None

    def before(self):
        k = self.count - self.skip
        if k == 0:
            torch.cuda.synchronize()
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif k == self.steps:
            torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.kernels = kernel_summary(self.prof, self.steps)
            self.prof = None
            self.cprof = cProfile.Profile()
            self.cprof.enable()
        elif k == 2 * self.steps:
            torch.cuda.synchronize()
            self.cprof.disable()
        if 0 <= k <= 2 * self.steps:
            self.starts.append(time.perf_counter())
        self.count += 1

    def intervals_ms(self, window):
        """Start-to-start times of the window's steps (0: torch.profiler, 1: cProfile), the median."""
        t = self.starts[window * self.steps:(window + 1) * self.steps + 1]
        return statistics.median(b - a for a, b in zip(t, t[1:])) * 1e3 if len(t) > 1 else None


def host_report(cprof, steps, top):
    """The top functions by cumulative and by own time, in ms per step."""
    out = {}
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        stats = pstats.Stats(cprof, stream=buf)
        stats.sort_stats(key)
        rows = []
        for func in stats.fcn_list[:top]:
            cc, nc, tt, ct, _ = stats.stats[func]
            where = f"{os.path.relpath(func[0], ROOT) if func[0].startswith(ROOT) else func[0]}:{func[1]}({func[2]})"
            rows.append((where[-110:], nc / steps, tt * 1e3 / steps, ct * 1e3 / steps))
        out[key] = rows
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--example", choices=sorted(DEFAULT_FLAGS), default="translation")
    ap.add_argument("--skip", type=int, default=60, help="steps before the first window (warm-up)")
    ap.add_argument("--steps", type=int, default=40, help="steps in each window")
    ap.add_argument("--top", type=int, default=25, help="functions listed per host ranking")
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the example's flags (default: see above)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_example.py: needs a CUDA device (it profiles the GPU's kernels)")
    flags = [f for f in args.flags if f != "--"] or DEFAULT_FLAGS[args.example]

    import lsmini.train
    watch = StepWatch(args.skip, args.steps)
    call = lsmini.train.TrainStep.__call__

    def watched(self, *a, **k):
        watch.before()
        return call(self, *a, **k)

    lsmini.train.TrainStep.__call__ = watched
    example = __import__(f"train_{args.example}")
    metrics = example.main(flags)
    if watch.count < args.skip + 2 * args.steps + 1:
        sys.exit(f"profile_example.py: the run made {watch.count} steps, fewer than --skip + 2 x --steps + 1 "
                 f"({args.skip + 2 * args.steps + 1}); give it more steps (--max-steps) or smaller windows")
    report = {"example": args.example, "flags": flags, "steps_in_run": watch.count,
              "example_tokens_per_s": metrics.get("tokens_per_s"),
              "step_ms_profiled": watch.intervals_ms(0), "step_ms_cprofiled": watch.intervals_ms(1),
              "kernels": watch.kernels,
              "host": host_report(watch.cprof, args.steps, args.top)}
    k = report["kernels"]
    print(f"\n{args.example} {' '.join(flags)}: {watch.count} steps, example tokens/s "
          f"{report['example_tokens_per_s']:,.0f}")
    print(f"step start to start (median): {report['step_ms_profiled']:.2f} ms under torch.profiler, "
          f"{report['step_ms_cprofiled']:.2f} ms under cProfile")
    print(f"GPU per step: busy {k['busy_ms']:.2f} ms over a span of {k['gpu_span_ms']:.2f} ms "
          f"(idle {k['idle_ms']:.2f}), {k['kernels_per_step']:.0f} kernels")
    for cat, ms in k["categories_ms"].items():
        print(f"  {cat:<16} {ms:7.3f} ms")
    for name, calls, ms in k["top_kernels_ms"]:
        print(f"  {ms:7.3f} ms {calls:6.1f} calls  {name}")
    print("\nhost, ATen operators and CUDA runtime calls by own time (per step: calls, own ms)")
    for name, calls, own in k["host_ops_ms"]:
        print(f"  {calls:7.1f} {own:8.3f}  {name}")
    for key, rows in report["host"].items():
        print(f"\nhost, top by {key} (per step: calls, own ms, cumulative ms)")
        for where, calls, own, cum in rows:
            print(f"  {calls:7.1f} {own:8.3f} {cum:8.3f}  {where}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
