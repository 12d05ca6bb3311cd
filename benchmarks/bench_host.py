"""Host time of eager op calls: what a training step pays per lsmini op before any kernel runs.

    python benchmarks/bench_host.py [--calls N] [--events N] [--results DIR | --no-results]

Each dropout op is called with dropout 0.1 and with dropout 0 on tiny inputs, without autograd; the wall time
per call is the host's where the device time (timed too, with dropout) is shorter. The difference
is what dropout adds to a call's host time: drawing its Philox state (``_backend.dropout_rng``, timed alone
too) and whatever else the op and its launch do differently with dropout. Best of 5 repeats of --calls calls,
µs per call.

Then the layer operators, ``lsmini::layer`` and ``lsmini::layer_backward`` (csrc/layers/layer.cpp), called
directly through ``torch.ops.lsmini`` for a post-LN encoder layer (self, ffn) and decoder layer (self, cross,
ffn) of the base shape (hidden 512, 8 heads, FFN 2048, dropout 0.1) on a [2, 8] bf16 input with float32
parameters, as under autocast: the host time of one layer call, without autograd or any wrapper around it
(both eager and compiled steps call these operators), and the kernel launches one call makes (torch.profiler's
count of launch calls: they are most of a layer call's host time; --events N prints the N host events
with the most own time in each layer row's call). The decoder layer's cross-attention K/V are
the two [b, ls, H] column blocks of one [b, ls, 2H] tensor, as a decoder stack hands them over. Last, per layer, one
whole eager call through the module under autocast, forward and backward (input checks, autograd,
``LayerFunction``; for the standalone decoder layer its own cross-attention K/V GEMM too; the input requires
grad, the gradients accumulate into .grad), synchronised after each: host and device time together, the
host's where it is the longer, as on this tiny input.

Every figure is also appended to benchmarks/results/host.csv (config: the op or call and its input; variant:
with or without dropout; figures: us, device_us for the ops, launches for the layer operators), from which
benchmarks/report.py writes RESULTS.md.
"""
import argparse
import os
import sys
import timeit

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
from lsmini import _backend  # noqa: E402
from lsmini.layers import TransformerConfig, TransformerDecoderLayer, TransformerEncoderLayer  # noqa: E402
from lsmini.ops import (attention, attention_softmax, bias_act_dropout, bias_dropout_residual, embedding,  # noqa: E402
                        sinusoidal_positions)

P = 0.1


# The CUDA driver and runtime calls that launch work on a stream: a layer call's host time is mostly these.
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync")


def host_events(fn, calls=10):
    """torch.profiler's host events of `calls` calls of fn: [(key, count a call, own µs a call)], most own time
    first (the profiler's own overhead included)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [(e.key, e.count / calls, e.self_cpu_time_total / calls) for e in prof.key_averages()]
    return sorted(events, key=lambda e: -e[2])


def launches_per_call(events):
    """The launches (LAUNCHES) one call makes, from its host_events."""
    return sum(count for key, count, _ in events if key in LAUNCHES)


def host_us(fn, calls):
    fn()
    torch.cuda.synchronize()
    best = min(timeit.repeat(fn, number=calls, repeat=5)) / calls
    torch.cuda.synchronize()
    return best * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--events", type=int, default=0, metavar="N",
                    help="also print the N host events (ATen operators, CUDA runtime calls) with the most own time "
                         "in each layer call row, from torch.profiler (its overhead included)")
    common.add_results_arguments(ap)
    args = ap.parse_args()
    common.require_cuda_kernels("bench_host.py")
    env = common.environment()
    print(f"# {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}: host µs per eager call")
    dev, half = torch.device("cuda"), torch.float16
    # tiny inputs: a few µs of device time a call, well under the host's
    x = torch.randn(16, 64, device=dev, dtype=half)
    bias = torch.randn(64, device=dev, dtype=half)
    q = torch.randn(1, 2, 16, 64, device=dev, dtype=half)
    scores = torch.randn(1, 2, 16, 16, device=dev, dtype=half)
    tokens = torch.randint(4, 100, (2, 8), device=dev)
    weight = torch.randn(100, 64, device=dev, dtype=half)
    positions = sinusoidal_positions(8, 64).to(dev, half)
    ops = {  # op: (call, its input in the results' config)
        "bias_dropout_residual": (lambda p: bias_dropout_residual(x, bias, x, p), "16x64 fp16"),
        "bias_act_dropout": (lambda p: bias_act_dropout(x, bias, "gelu", p), "gelu 16x64 fp16"),
        "attention_softmax": (lambda p: attention_softmax(scores, None, True, p), "1x2x16x16 causal fp16"),
        "attention": (lambda p: attention(q, q, q, None, True, p), "1x2x16x64 causal fp16"),
        "embedding": (lambda p: embedding(tokens, weight, positions, dropout_p=p, check_tokens=False),
                      "2x8 hidden 64 fp16"),
    }
    rows = [{"op": "dropout_rng", "p 0.1 µs": host_us(lambda: _backend.dropout_rng(P, dev), args.calls)}]
    results = [{"config": "dropout_rng", "variant": "lsmini", "us": rows[0]["p 0.1 µs"]}]
    for name, (call, shape) in ops.items():
        with_p, without = host_us(lambda: call(P), args.calls), host_us(lambda: call(0.0), args.calls)
        device = common.time_ms(lambda: call(P), warmup=5, iters=20) * 1e3
        rows.append({"op": name, "p 0.1 µs": with_p, "p 0 µs": without, "dropout's share": 1 - without / with_p,
                     "device µs (p 0.1)": device})
        results += [{"config": f"{name} {shape}", "variant": f"dropout {P}", "us": with_p, "device_us": device},
                    {"config": f"{name} {shape}", "variant": "dropout 0", "us": without}]
    shown = [{k: (f"{v:.1%}" if k == "dropout's share" else f"{v:.2f}") if isinstance(v, float) else v
              for k, v in r.items()} for r in rows]
    print(common.markdown_table(shown, ["op", "p 0.1 µs", "p 0 µs", "dropout's share", "device µs (p 0.1)"]))
    print()
    layers = layer_rows(dev, args.calls // 10)
    layer_shown = [{**r, "µs": f"{r['µs']:.1f}", "launches": f"{r['launches']:g}" if "launches" in r else ""}
                   for r in layers]
    print(common.markdown_table(layer_shown, ["call", "layer", "µs", "launches"]))
    for r in layers:
        if args.events and "events" in r:
            print(f"\n{r['call']} {r['layer']}: host events with the most own time, a call (under the profiler)")
            print(common.markdown_table([{"event": key[:90], "calls": f"{count:g}", "own µs": f"{us:.1f}"}
                                         for key, count, us in r["events"][:args.events]],
                                        ["event", "calls", "own µs"]))
    results += [{"config": f"{r['call']} {r['layer']}", "variant": "lsmini", "us": r["µs"],
                 "launches": r.get("launches")} for r in layers]
    common.append_results(args.results, "host", env,
                          [{"benchmark": "host", "kind": "lsmini", **r} for r in results])


def layer_rows(dev, calls):
    """Host µs per call of lsmini::layer and lsmini::layer_backward, and µs per synchronised eager forward +
    backward through the module, encoder and decoder layer."""
    config = TransformerConfig(hidden_size=512, num_heads=8, ffn_size=2048, dropout=0.1, attn_dropout=0.1,
                               activation_dropout=0.1)
    x = torch.randn(2, 8, 512, device=dev, dtype=torch.bfloat16)
    enc = torch.randn(2, 8, 512, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(2, 8, 1024, device=dev, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    layer_op, backward_op = torch.ops.lsmini.layer.default, torch.ops.lsmini.layer_backward.default
    rows = []
    for name, layer in (("encoder", TransformerEncoderLayer(config)), ("decoder", TransformerDecoderLayer(config))):
        layer = layer.to(dev).train()
        decoder = name == "decoder"
        options = layer.options(decoder).op_args()
        params = [p.detach() for p in layer.layer_params()]
        encoder_kv = kv.view(2, 8, 2, 512).unbind(2) if decoder else (None, None)
        inputs = (x, None, *encoder_kv, None, params)
        with torch.no_grad():  # the operators alone, outside autograd
            y, state = layer_op(*inputs, *options)  # backward reads this state every time
            forward = host_us(lambda: layer_op(*inputs, *options), calls)
            backward = host_us(lambda: backward_op(grad, state, *inputs, [], [], [], *options), calls)
            forward_events = host_events(lambda: layer_op(*inputs, *options))
            backward_events = host_events(lambda: backward_op(grad, state, *inputs, [], [], [], *options))
        x_leaf = x.detach().requires_grad_()
        args = (x_leaf, enc) if decoder else (x_leaf,)

        def whole():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = layer(*args)
            out.backward(grad)
            torch.cuda.synchronize()

        rows += [{"call": "lsmini::layer", "layer": name, "µs": forward,
                  "launches": launches_per_call(forward_events), "events": forward_events},
                 {"call": "lsmini::layer_backward", "layer": name, "µs": backward,
                  "launches": launches_per_call(backward_events), "events": backward_events},
                 {"call": "module forward + backward, synchronised", "layer": name, "µs": host_us(whole, calls),
                  "events": host_events(whole)}]
    return rows


if __name__ == "__main__":
    main()
