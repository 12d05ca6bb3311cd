"""Where the host time of a converted model's training step goes: bench_convert.py's nn.Transformer (or, with
--model encoder, its nn.TransformerEncoder model) after lsmini.convert, eager and under torch.compile (default
mode), in one process.

    python benchmarks/profile_convert.py [--out DIR] [--steps 20] [--modes eager default torch] [--model encoder]

Modes: eager and default (the converted model, uncompiled and under torch.compile's default mode), torch (the
unconverted model under the default mode, with the float padding masks with which it compiles whole).
Per mode, after 5 warm-up steps (the compile): the synced wall time per step over --steps steps; the host's
time per step in each phase of the step (zero_grad, forward, backward, optimizer step; perf_counter, unsynced:
where the GPU waits on the host, as here, this is where the step's time goes); a cProfile of
--steps more steps into DIR/<mode>.pstats (read with python -m pstats: the per-call times of the layer operators
lsmini::layer and lsmini::layer_backward, the Python around them, lsmini.layers.runtime.LayerFunction eagerly),
and torch.profiler's host operators over 5 steps, most self time first (the counts of view operators and
launches). Bool padding masks, bf16 autocast, fused AdamW, as bench_convert.py.
"""
import argparse
import cProfile
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_convert  # noqa: E402
import lsmini  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".", help="directory for the .pstats files")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", nargs="+", default=["eager", "default"], choices=["eager", "default", "torch"])
    ap.add_argument("--model", default="transformer", choices=["transformer", "encoder"])
    cli = ap.parse_args()
    os.makedirs(cli.out, exist_ok=True)
    args = bench_convert.parse_args(["--quick", "--model", cli.model])
    device = torch.device("cuda")
    for mode in cli.modes:
        batches = bench_convert.make_batches(args, device, "float" if mode == "torch" else "bool")
        model = bench_convert.build_model(args).to(device).train()
        n = max(args.src_len, args.tgt_len)
        if mode != "torch":
            lsmini.convert(model, max_batch_tokens=args.batch * n, max_seq_len=n)
        loss_fn = bench_convert.loss_function(model, device, torch.bfloat16)
        if mode != "eager":
            loss_fn = torch.compile(loss_fn, fullgraph=mode == "default")
        opt = torch.optim.AdamW(model.parameters(), lr=bench_convert.LR, fused=True)

        def steps(k):
            for i in range(k):
                opt.zero_grad(set_to_none=True)
                loss_fn(*batches[i % len(batches)]).backward()
                opt.step()
            torch.cuda.synchronize()

        steps(5)
        t0 = time.perf_counter()
        steps(cli.steps)
        print(f"# {mode}: {(time.perf_counter() - t0) / cli.steps * 1e3:.2f} ms/step (synced at the end)")
        phases = dict.fromkeys(("zero_grad", "forward", "backward", "step"), 0.0)
        for i in range(cli.steps):
            t = [time.perf_counter()]
            opt.zero_grad(set_to_none=True)
            t.append(time.perf_counter())
            loss = loss_fn(*batches[i % len(batches)])
            t.append(time.perf_counter())
            loss.backward()
            t.append(time.perf_counter())
            opt.step()
            t.append(time.perf_counter())
            for k, (a, b) in zip(phases, zip(t, t[1:])):
                phases[k] += b - a
        torch.cuda.synchronize()
        print(f"# {mode}: host ms per step by phase: " +
              ", ".join(f"{k} {v / cli.steps * 1e3:.2f}" for k, v in phases.items()))
        prof = cProfile.Profile()
        prof.enable()
        steps(cli.steps)
        prof.disable()
        prof.dump_stats(os.path.join(cli.out, f"{mode}.pstats"))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            steps(5)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
