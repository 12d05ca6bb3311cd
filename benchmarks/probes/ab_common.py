"""What the same-process A/B probes (attention_ab.py, glu_ab.py) share: their libraries' arguments and loading,
and timing the libraries side by side."""
import os
import sys

import torch


def add_library_arguments(ap):
    ap.add_argument("libs", nargs="+", help="shared libraries from scripts/ab_probe.sh; the first is the base")
    ap.add_argument("--no-timing", action="store_true", help="the checks only")


def load_libraries(ap, paths, load, script):
    """{file name without extension: load(path)} for the libraries at paths, the base first; the parser ap reports
    what is wrong with the arguments."""
    if len(paths) < 2:
        ap.error("give the base and at least one library to compare with it")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit(f"{script}: the libraries hold sm_90a code; run it on a compute capability 9.0 device")
    libs = {os.path.splitext(os.path.basename(p))[0]: load(p) for p in paths}
    if len(libs) != len(paths):
        ap.error("give the libraries distinct file names: they name the columns")
    return libs


def medians(libs, ways, call, iters, rounds, flush=None):
    """{(library name, way): ms a call}: call(lib, way) timed with CUDA events around `iters` calls (after 3
    untimed), the median of `rounds` rounds that alternate the libraries and ways. With flush, each call is timed
    on its own after flush() and the round's mean taken."""
    times = {}
    for _ in range(rounds):
        for name, lib in libs.items():
            for way in ways:
                for _ in range(3):
                    call(lib, way)
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(iters if flush else 1)]
                for start, end in events:
                    if flush:
                        flush()
                    start.record()
                    for _ in range(1 if flush else iters):
                        call(lib, way)
                    end.record()
                torch.cuda.synchronize()
                times.setdefault((name, way), []).append(sum(s.elapsed_time(e) for s, e in events) / iters)
    return {key: sorted(v)[len(v) // 2] for key, v in times.items()}
