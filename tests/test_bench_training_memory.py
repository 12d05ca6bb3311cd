"""benchmarks/bench_training.py --memory: the allocations alive at the peak of an allocator trace, by site."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_training  # noqa: E402

MB = 2 ** 20


def alloc(addr, mb, filename, line=1, name="f"):
    return {"action": "alloc", "addr": addr, "size": mb * MB,
            "frames": [{"filename": filename, "line": line, "name": name}] if filename else []}


def free(addr, action="free_requested"):
    return {"action": action, "addr": addr, "size": 0}


def test_peak_breakdown_sums_what_is_alive_at_the_peak_by_site():
    layer = os.path.join(ROOT, "lsmini", "layers", "runtime.py")
    trace = [
        alloc(1, 100, layer, 150, "forward"),
        alloc(2, 50, layer, 150, "forward"),
        alloc(3, 300, "/venv/site-packages/torch/nn/functional.py", 7, "linear"),
        free(3), free(3, "free_completed"),  # both events of one deferred free count once
        alloc(4, 200, None),  # the peak: 100 + 50 + 200 = 350 < 450, so the peak is before it
        free(1),
        {"action": "segment_alloc", "addr": 9, "size": 10 * MB},  # segment events are not allocations
    ]
    sites, peak = bench_training.peak_breakdown(trace)
    assert peak == pytest.approx(450)
    assert sites == [("torch/nn/functional.py:7 (linear)", 300, 1), ("lsmini/layers/runtime.py:150 (forward)", 150, 2)]

    trace.append(alloc(5, 400, None))  # 50 + 200 + 400 = 650: a new peak, after the frees
    sites, peak = bench_training.peak_breakdown(trace)
    assert peak == pytest.approx(650)
    assert sites == [("(no Python frame)", 600, 2), ("lsmini/layers/runtime.py:150 (forward)", 50, 1)]
