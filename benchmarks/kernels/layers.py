"""encoder_layer / decoder_layer: one Transformer layer's forward + backward on 8192 tokens (64 × 128, padded
batch, pre-LN, dropout 0.1 everywhere) under AMP fp16, beside torch.nn.TransformerEncoderLayer /
TransformerDecoderLayer holding the same weights under the same AMP, eager and (outside quick mode)
torch.compile. Parameters are float32 in every variant (the AMP setup a PyTorch user has). The note gives
each variant's peak memory of one step above what was allocated before it (the lsmini arena is released
first, so its allocation is counted). The decoder rows attend over an encoder output of the same 64 × 128
shape; a standalone decoder layer projects its own cross-attention K/V (the stack-wide single K/V GEMM
shows in bench_training, not here).

The compiled variant is timed in a child process (`python benchmarks/kernels/layers.py --compiled ROW
HIDDEN`): compilation and autotuning leave threads and cached allocations behind that disturbed the
timing of every row measured after them in the same process.
"""
import json
import os
import subprocess
import sys

import torch
from torch import nn

if __name__ == "__main__":  # the child process: find lsmini in this checkout even when it is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from lsmini.layers import TransformerConfig, TransformerDecoderLayer, TransformerEncoderLayer, arena

_B, _L = 64, 128
_P = 0.1
_SHAPES = [(512, 8, 2048), (1024, 16, 4096)]  # hidden, heads, ffn


def _step(call, grad):
    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            y = call()
        y.backward(grad.to(y.dtype))
    return step


def _peak_mb(step):
    step()
    torch.cuda.synchronize()
    arena.release()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _setup(name, h, heads, ffn):
    """(lsmini layer, its torch.nn twin, torch_call(module) -> callable, lsmini callable, grad); seeded, so the
    parent and the child process build the same inputs."""
    torch.manual_seed(0)
    cfg = TransformerConfig(h, heads, ffn, dropout=_P, attn_dropout=_P, activation_dropout=_P, pre_layer_norm=True,
                            max_batch_tokens=_B * _L, max_seq_len=_L)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(_L // 2, _L + 1, (_B, 1), device="cuda", generator=gen)
    mask = torch.arange(_L, device="cuda").view(1, _L) >= lengths  # True = pad
    x = torch.randn(_B, _L, h, device="cuda", requires_grad=True)
    grad = torch.randn(_B, _L, h, device="cuda")
    if name == "encoder_layer":
        ours = TransformerEncoderLayer(cfg).cuda()
        return ours, ours.to_torch(), lambda m: lambda: m(x, src_key_padding_mask=mask), lambda: ours(x, mask), grad
    mem = torch.randn(_B, _L, h, device="cuda", requires_grad=True)
    causal = nn.Transformer.generate_square_subsequent_mask(_L, device="cuda")
    ours = TransformerDecoderLayer(cfg).cuda()
    return (ours, ours.to_torch(),
            lambda m: lambda: m(x, mem, tgt_mask=causal, memory_key_padding_mask=mask, tgt_is_causal=True),
            lambda: ours(x, mem, mask), grad)


def _compiled_child(name, h, iters):
    """Run in the child process: time the torch.compile variant; print {"ms", "peak_mb"} as JSON."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import common

    heads, ffn = next((hd, f) for hh, hd, f in _SHAPES if hh == h)
    _, theirs, torch_call, _, grad = _setup(name, h, heads, ffn)
    step = _step(torch_call(torch.compile(theirs, dynamic=False)), grad)
    step()  # compiles forward and backward
    peak = _peak_mb(step)
    print(json.dumps({"ms": common.time_ms(step, warmup=5, iters=iters), "peak_mb": peak}), flush=True)


def _time_compiled(name, h, iters):
    """(ms, peak MB) of the compiled variant from a child process, or (None, None) when it fails."""
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--compiled", name, str(h), str(iters)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        print(f"# {name}: torch.compile variant failed (exit {p.returncode}): "
              f"{' | '.join(p.stderr.strip().splitlines()[-3:])}")
        return None, None
    r = json.loads(lines[-1])
    return r["ms"], r["peak_mb"]


def bench(ctx):
    for h, heads, ffn in _SHAPES:
        shape = f"{_B}x{_L} h{h}/{heads} ffn{ffn} p{_P} AMP"
        for name in ("encoder_layer", "decoder_layer"):
            if not ctx.wanted(name):
                continue
            ours, theirs, torch_call, ours_call, grad = _setup(name, h, heads, ffn)
            mine, eager = _step(ours_call, grad), _step(torch_call(theirs), grad)
            c_ms, c_peak = (None, None) if ctx.quick else _time_compiled(name, h, 50)
            peaks = [_peak_mb(mine), _peak_mb(eager)]
            note = f"peak MB lsmini {peaks[0]:.0f} / eager {peaks[1]:.0f}" + \
                (f" / compiled {c_peak:.0f}" if c_peak is not None else "")
            ctx.row(name, torch.float16, shape, mine, eager, compiled_ms=c_ms, note=note)
            if not ctx.quick:  # lsmini without recomputation in backward: more memory, less work
                ours.recompute = False
                ctx.row(name, torch.float16, shape + " no-recompute", mine, eager,
                        note=f"peak MB lsmini {_peak_mb(mine):.0f} / eager {peaks[1]:.0f}")
            del ours, theirs, mine, eager
            arena.release()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--compiled":
        _compiled_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: layers.py --compiled encoder_layer|decoder_layer HIDDEN ITERS (benchmarks/bench_kernels.py "
                 "runs the rows)")
