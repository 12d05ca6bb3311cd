"""What the same-process A/B probes (attention_ab.py, glu_ab.py) share: timing several libraries side by side."""
import torch


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
