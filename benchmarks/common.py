"""Timing helpers shared by the benchmarks: CUDA-event medians after warm-up, the device-to-device
copy bandwidth ceiling, and result tables (markdown + CSV) stamped with GPU, versions and date."""
import csv
import datetime
import statistics
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


def require_cuda_kernels(script):
    """Exit with the reason unless a CUDA device is there and lsmini runs its kernels on it."""
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA device")
    import lsmini

    if lsmini.backend() != "cuda":
        sys.exit(f"lsmini backend is {lsmini.backend()!r}: {lsmini.backend().reason}")


def environment():
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
    }


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
