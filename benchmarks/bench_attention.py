"""The fused attention op over sequence lengths, beside the fastest of PyTorch's SDPA backends, in one run.

    python benchmarks/bench_attention.py [--lengths 128 ... 8192] [--head-dims 64 128] [--dtypes fp16 bf16]
                                         [--masks causal padding] [--tokens 16384] [--dropout 0.1]
                                         [--heads H --kv-heads HK] [--csv PATH] [--results DIR | --no-results]

Each row: batch = tokens / length sequences (the same work per row up to the length's quadratic term),
hidden 1024 (16 heads of 64, or 8 of 128), dropout 0.1 as in training (--dropout 0 shows what the draws
cost). --heads sets the query heads instead (at every head dim) and --kv-heads the K/V heads (grouped-query
attention: SDPA is then timed with enable_gqa=True and on K/V repeated to every query head, the repeat
counted, each backend that takes the row; the fastest is the baseline). `padding` gives each sequence a
random length in [length/2, length] and passes SDPA the equivalent boolean attn_mask; `causal` passes is_causal=True. Every SDPA backend (flash, memory-efficient, cuDNN) that
accepts the row is timed, and the fastest fwd+bwd is the baseline (`sdpa_best`, which one in `backend`).
Times are device milliseconds (benchmarks/common.time_ms); TFLOP/s counts the nominal GEMM work (causal:
half), 4·b·h·L²·d forward and 2.5 times that backward. Where the Hopper kernels run (sm_90a build on a compute
capability 9.0 device), `lsmini_sm80_ms` is the same row on the sm_80 kernels (`lsmini._debug.sm90_attention(False)`). Past
16·d keys, where by default the backward draws the dropout mask again, `lsmini_kept_ms` is the row with the
mask's bits kept at every length (`lsmini.config.attention_dropout_bits = "always"`), and `kept_speedup` its ratio to SDPA.
Every row is appended to benchmarks/results/attention.csv as one line per variant (lsmini, lsmini sm_80,
lsmini bits=always, sdpa with its backend), from which benchmarks/report.py writes RESULTS.md.
"""
import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402
from kernels.attention import fwd_bwd, inputs  # noqa: E402
import lsmini  # noqa: E402
from lsmini._debug import sm90_attention  # noqa: E402
from lsmini.ops.attention import attention, keeps_bits, sm90_kernels_available  # noqa: E402

_HIDDEN = 1024
_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION}
COLUMNS = ["dtype", "d", "mask", "batch×heads×len", "lsmini_fwd_ms", "sdpa_fwd_ms", "lsmini_ms", "lsmini_sm80_ms",
           "lsmini_kept_ms", "sdpa_best_ms", "backend", "speedup", "kept_speedup", "lsmini_TFLOP/s", "sdpa_TFLOP/s"]


def _time_backend(backend, fn, iters):
    """(fwd ms, fwd+bwd ms) of fn under one SDPA backend, or None when the backend refuses the inputs."""
    try:
        with sdpa_kernel(backend), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a refusing backend warns why before it raises
            fwd, step = fn()
            return common.time_ms(fwd, warmup=3, iters=iters), common.time_ms(step, warmup=3, iters=iters)
    except RuntimeError:  # "No available kernel" and the like: this backend does not take the row
        return None


def row(dtype, d, mask, length, tokens, dropout, iters, heads=None, kv_heads=None):
    b, h = max(1, tokens // length), heads or _HIDDEN // d
    hk = kv_heads or h
    q, k, v, grad, kpm, causal, sdpa_kw = inputs(b, h, length, d, dtype, mask == "padding", hk)
    ours = lambda: attention(q, k, v, kpm, causal, dropout)  # noqa: E731
    sdpas = {"": lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, enable_gqa=hk != h, **sdpa_kw)}
    if hk != h:
        sdpas["+repeat_kv"] = lambda: F.scaled_dot_product_attention(  # noqa: E731
            q, k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1), dropout_p=dropout, **sdpa_kw)
    shape = f"{b}×{h}×{length}" + (f" kv{hk}" if hk != h else "")
    r = {"dtype": str(dtype).replace("torch.", ""), "d": d, "mask": mask, "batch×heads×len": shape,
         "lsmini_fwd_ms": common.time_ms(ours, warmup=3, iters=iters),
         "lsmini_ms": common.time_ms(fwd_bwd(ours, q, k, v, grad), warmup=3, iters=iters)}
    if sm90_kernels_available():
        with sm90_attention(False):
            r["lsmini_sm80_ms"] = common.time_ms(fwd_bwd(ours, q, k, v, grad), warmup=3, iters=iters)
    if dropout > 0 and not keeps_bits(dropout, length, d):
        with lsmini.config.override(attention_dropout_bits="always"):
            r["lsmini_kept_ms"] = common.time_ms(fwd_bwd(ours, q, k, v, grad), warmup=3, iters=iters)
    best = None
    for name, backend in _BACKENDS.items():
        for how, sdpa in sdpas.items():
            t = _time_backend(backend, lambda: (sdpa, fwd_bwd(sdpa, q, k, v, grad)), iters)
            if t is not None and (best is None or t[1] < best[2]):
                best = (name + how, t[0], t[1])
    flops = 4 * b * h * length * length * d * (0.5 if causal else 1.0) * 3.5  # forward + backward
    r["lsmini_TFLOP/s"] = flops / r["lsmini_ms"] / 1e9
    if best is not None:
        r["backend"], r["sdpa_fwd_ms"], r["sdpa_best_ms"] = best
        r["speedup"] = best[2] / r["lsmini_ms"]
        if "lsmini_kept_ms" in r:
            r["kept_speedup"] = best[2] / r["lsmini_kept_ms"]
        r["sdpa_TFLOP/s"] = flops / best[2] / 1e9
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--dtypes", nargs="+", choices=["fp16", "bf16"], default=["fp16", "bf16"])
    ap.add_argument("--masks", nargs="+", choices=["causal", "padding"], default=["causal", "padding"])
    ap.add_argument("--tokens", type=int, default=16384, help="batch × length of every row")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--heads", type=int, help="query heads of every row (default: 1024 / head dim)")
    ap.add_argument("--kv-heads", type=int, help="K/V heads, dividing the query heads (default: as many)")
    ap.add_argument("--csv", help="also write the rows to this CSV file")
    common.add_results_arguments(ap)
    args = ap.parse_args()
    common.require_cuda_kernels("bench_attention.py")
    env = common.environment()
    print(f"# {env['gpu']}, torch {env['torch']}, CUDA {env['cuda']}, {env['date']}; dropout {args.dropout}, "
          f"{args.tokens} tokens a row, hidden {_HIDDEN}")
    print("| " + " | ".join(COLUMNS) + " |")
    rows = []
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    for dtype in args.dtypes:
        for d in args.head_dims:
            for mask in args.masks:
                for length in args.lengths:
                    rows.append(row(dtypes[dtype], d, mask, length, args.tokens, args.dropout, args.iters,
                                    args.heads, args.kv_heads))
                    print(common.markdown_table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
                    torch.cuda.empty_cache()
    common.append_results(args.results, "attention", env, [x for r in rows for x in results_rows(r, args.dropout)])
    if args.csv:
        common.write_csv(args.csv, rows, COLUMNS)


def results_rows(r, dropout):
    """One benchmark row as results rows, one per variant timed."""
    b, h, rest = r["batch×heads×len"].split("×")
    length, _, kv = rest.partition(" ")
    config = f"{r['dtype']} d{r['d']} {r['mask']} len{length} b{b}xh{h}{'x' + kv if kv else ''} p={dropout}"
    out = [{"variant": "lsmini", "kind": "lsmini", "ms": r["lsmini_ms"], "fwd_ms": r["lsmini_fwd_ms"],
            "tflops": r["lsmini_TFLOP/s"]}]
    if "lsmini_sm80_ms" in r:
        out.append({"variant": "lsmini sm_80", "kind": "lsmini", "ms": r["lsmini_sm80_ms"]})
    if "lsmini_kept_ms" in r:
        out.append({"variant": "lsmini bits=always", "kind": "lsmini", "ms": r["lsmini_kept_ms"]})
    if "sdpa_best_ms" in r:
        out.append({"variant": "sdpa", "kind": "pytorch", "ms": r["sdpa_best_ms"], "fwd_ms": r["sdpa_fwd_ms"],
                    "tflops": r["sdpa_TFLOP/s"], "note": f"{r['backend']} backend"})
    return [{"benchmark": "attention", "config": config, **x} for x in out]


if __name__ == "__main__":
    main()
