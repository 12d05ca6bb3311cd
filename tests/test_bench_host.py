"""benchmarks/bench_host.py's event helpers on the CPU (the script itself needs CUDA): host_events lists a call's
host events by own time, launches_per_call counts the launch calls among them."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_host  # noqa: E402


def test_host_events_and_launch_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    x = torch.ones(8)
    events = bench_host.host_events(lambda: torch.add(x, 1).mul_(2), calls=4)
    by_key = {key: (count, us) for key, count, us in events}
    assert by_key["aten::add"][0] == 1 and by_key["aten::mul_"][0] == 1  # counts are per call
    own = [us for _, _, us in events]
    assert own == sorted(own, reverse=True) and all(us >= 0 for us in own)
    assert bench_host.launches_per_call(events) == 0
    launches = [("cudaLaunchKernel", 3.0, 1.0), ("cuLaunchKernelEx", 2.0, 1.0), ("aten::mm", 4.0, 9.0)]
    assert bench_host.launches_per_call(events + launches) == 5.0
