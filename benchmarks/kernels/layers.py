"""encoder_layer / decoder_layer: one Transformer layer's training step (forward + backward) on 8192 tokens
(64 × 128, padded batch, pre-LN, dropout 0.1 everywhere) under AMP fp16, beside torch.nn.TransformerEncoderLayer
/ TransformerDecoderLayer holding the same weights under the same AMP, eager and (outside quick mode)
torch.compile. Parameters are float32 in every variant (the AMP setup a PyTorch user has).

What one step is: the step of one layer inside a stack of its kind. Gradients are reset as
``zero_grad(set_to_none=True)`` does before every step (autograd hands each new gradient over; nothing
is added to the last step's). The layer input (and the decoder's encoder output) and the output
gradient come in the dtype that such a stack passes between its layers: float32 for torch.nn under AMP
(its residual stream stays float32: input + fp16 branch output is float32), the autocast dtype for
lsmini (its layers compute and return fp16 under autocast). Same values in every variant. The note
gives each variant's peak memory of one step above what was allocated before it (gradients reset first,
so the step's gradients are counted; lsmini's backward scratch is an ordinary allocation of the step, so
it is counted too). The decoder rows attend over an encoder output of the same 64 × 128 shape; a
standalone decoder layer projects its own cross-attention K/V (the stack-wide single K/V GEMM shows in
bench_training, not here).

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
from lsmini.layers import TransformerConfig, TransformerDecoderLayer, TransformerEncoderLayer

_B, _L = 64, 128
_P = 0.1
_SHAPES = [(512, 8, 2048), (1024, 16, 4096)]  # hidden, heads, ffn


def _step(call, grads, leaves):
    """One training step: leaves' gradients reset (set to None), forward under AMP, backward from the
    output gradient of the output's dtype (grads: dtype → tensor)."""
    def step():
        for t in leaves:
            t.grad = None
        with torch.autocast("cuda", dtype=torch.float16):
            y = call()
        y.backward(grads[y.dtype])
    step.leaves = leaves
    return step


def _peak_mb(step):
    step()
    torch.cuda.synchronize()
    for t in step.leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def _setup(name, h, heads, ffn):
    """(lsmini layer, its torch.nn twin, torch_step(module) -> step, lsmini step); seeded, so the parent and
    the child process build the same inputs."""
    torch.manual_seed(0)
    cfg = TransformerConfig(h, heads, ffn, dropout=_P, attn_dropout=_P, activation_dropout=_P, pre_layer_norm=True,
                            max_batch_tokens=_B * _L, max_seq_len=_L)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.randint(_L // 2, _L + 1, (_B, 1), device="cuda", generator=gen)
    mask = torch.arange(_L, device="cuda").view(1, _L) >= lengths  # True = pad
    grad = torch.randn(_B, _L, h, device="cuda")
    grads = {torch.float32: grad, torch.float16: grad.half()}

    def inputs(dtype):  # the same values in each variant's stack dtype, as fresh leaves
        torch.manual_seed(1)
        return [torch.randn(_B, _L, h, device="cuda").to(dtype).requires_grad_() for _ in range(2)]

    (x, mem), (x16, mem16) = inputs(torch.float32), inputs(torch.float16)
    if name == "encoder_layer":
        ours = TransformerEncoderLayer(cfg).cuda()
        theirs = ours.to_torch()
        return (ours, theirs,
                lambda m: _step(lambda: m(x, src_key_padding_mask=mask), grads, [*m.parameters(), x]),
                _step(lambda: ours(x16, mask), grads, [*ours.parameters(), x16]))
    causal = nn.Transformer.generate_square_subsequent_mask(_L, device="cuda")
    ours = TransformerDecoderLayer(cfg).cuda()
    theirs = ours.to_torch()
    return (ours, theirs,
            lambda m: _step(lambda: m(x, mem, tgt_mask=causal, memory_key_padding_mask=mask, tgt_is_causal=True),
                            grads, [*m.parameters(), x, mem]),
            _step(lambda: ours(x16, mem16, mask), grads, [*ours.parameters(), x16, mem16]))


def _compiled_child(name, h, iters):
    """Run in the child process: time the torch.compile variant; print {"ms", "peak_mb"} as JSON."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import common

    heads, ffn = next((hd, f) for hh, hd, f in _SHAPES if hh == h)
    _, theirs, torch_step, _ = _setup(name, h, heads, ffn)
    step = torch_step(torch.compile(theirs, dynamic=False))
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
            ours, theirs, torch_step, mine = _setup(name, h, heads, ffn)
            eager = torch_step(theirs)
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
            torch.cuda.empty_cache()


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--compiled":
        _compiled_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        sys.exit("usage: layers.py --compiled encoder_layer|decoder_layer HIDDEN ITERS (benchmarks/bench_kernels.py "
                 "runs the rows)")
