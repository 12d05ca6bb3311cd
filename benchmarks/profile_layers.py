"""Where a layer step's device time and memory go: lsmini beside torch.nn eager and torch.compile.

    python benchmarks/profile_layers.py [encoder_layer|decoder_layer] [HIDDEN] [--top N]

Same setup as the encoder_layer / decoder_layer benchmark rows (benchmarks/kernels/layers.py). For each
variant: the kernels of one forward + backward by total device time (torch.profiler, averaged over a few
steps), the step's summed kernel time, the bytes autograd saves for backward (saved-tensor hooks,
counting each storage once) and what is alive at the step's memory peak (the allocator's trace).
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kernels import layers  # noqa: E402

_STEPS = 5
_OURS = ("lsmini/layers/", "lsmini/ops/", "benchmarks/kernels/")


def saved_mb(step):
    """MB of distinct storages autograd saves during one forward (the backward is run to free them)."""
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values()) / 2 ** 20


def peak_breakdown(step, top):
    """What is alive at the peak of one step, above what was allocated before it: the allocator's trace
    replayed, live blocks grouped by the innermost frame in lsmini/ or benchmarks/."""
    step()
    for t in step.leaves:  # as the step's own reset, before the trace starts
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, cur, peak, at_peak = {}, 0, 0, {}
    for ev in trace:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
        elif ev["action"] == "free_completed":
            cur -= ev["size"]
            live.pop(ev["addr"], None)
        if cur > peak:
            peak, at_peak = cur, dict(live)
    groups = {}
    for ev in at_peak.values():
        where = next((f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} "
                      f"{f['name']}" for f in ev["frames"] if any(m in f["filename"] for m in _OURS)), "(no frame)")
        n, b = groups.get(where, (0, 0))
        groups[where] = (n + 1, b + ev["size"])
    lines = [f"  peak {peak / 2 ** 20:.0f} MB above the step's start; alive then:"]
    for where, (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {b / 2 ** 20:7.1f} MB {n:3d}×  {where}")
    return "\n".join(lines)


def kernel_table(step, top):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(_STEPS):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows) / _STEPS / 1e3
    lines = [f"  kernels: {total:.3f} ms per step, {sum(e.count for e in rows) // _STEPS} launches"]
    for e in rows[:top]:
        lines.append(f"  {e.self_device_time_total / _STEPS / 1e3:7.3f} ms  {e.count // _STEPS:3d}×  {e.key[:110]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("row", nargs="?", default="encoder_layer", choices=["encoder_layer", "decoder_layer"])
    ap.add_argument("hidden", nargs="?", type=int, default=1024)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-compiled", action="store_true")
    args = ap.parse_args()
    heads, ffn = next((hd, f) for h, hd, f in layers._SHAPES if h == args.hidden)
    _, theirs, torch_step, ours_step = layers._setup(args.row, args.hidden, heads, ffn)
    variants = [("lsmini", ours_step), ("eager", torch_step(theirs))]
    if not args.no_compiled:
        variants.append(("compiled", torch_step(torch.compile(theirs, dynamic=False))))
    for name, step in variants:
        step()
        print(f"== {name}: {args.row} h{args.hidden}, saved for backward {saved_mb(step):.0f} MB")
        print(kernel_table(step, args.top), flush=True)
        print(peak_breakdown(step, args.top), flush=True)


if __name__ == "__main__":
    main()
