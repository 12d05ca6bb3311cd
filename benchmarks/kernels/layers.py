"""encoder_layer / decoder_layer: one Transformer layer's forward + backward on 8192 tokens (64 × 128, padded
batch, pre-LN, dropout 0.1 everywhere) under AMP fp16, beside torch.nn.TransformerEncoderLayer /
TransformerDecoderLayer holding the same weights under the same AMP, eager and torch.compile, in the same
run. Parameters are float32 in every variant (the AMP setup a PyTorch user has). The note gives each
variant's peak memory of one step above what was allocated before it (the lsmini arena is released first,
so its allocation is counted). The decoder rows attend over an encoder output of the same 64 × 128 shape;
a standalone decoder layer projects its own cross-attention K/V (the stack-wide single K/V GEMM shows in
bench_training, not here).
"""
import torch
from torch import nn

from lsmini.layers import TransformerConfig, TransformerDecoderLayer, TransformerEncoderLayer, arena

_B, _L = 64, 128
_P = 0.1
_SHAPES = [(512, 8, 2048), (1024, 16, 4096)]  # hidden, heads, ffn


def _compiled(module):
    """torch.compile(module), or None where compile is unavailable."""
    try:
        torch._dynamo.reset()  # one graph per row: stay clear of the recompile limit
        return torch.compile(module, dynamic=False)
    except Exception as e:  # noqa: BLE001 - the eager comparison still stands
        print(f"# layers: torch.compile unavailable ({type(e).__name__}: {e})")
        return None


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


def _row(ctx, name, shape, ours, theirs, compiled, layer=None):
    """Warm up the compiled variant (compilation happens on its first forward and backward), measure
    peak memory of each, then time all three. Outside quick mode a second row times lsmini without
    recomputation in backward (``layer.recompute = False``: more memory, less work)."""
    if compiled is not None:
        try:
            compiled()
        except Exception as e:  # noqa: BLE001
            print(f"# {name}: torch.compile failed ({type(e).__name__}: {e})")
            compiled = None
    peaks = [_peak_mb(f) for f in (ours, theirs)] + ([_peak_mb(compiled)] if compiled else [])
    note = f"peak MB lsmini {peaks[0]:.0f} / eager {peaks[1]:.0f}" + (f" / compiled {peaks[2]:.0f}" if compiled else "")
    ctx.row(name, torch.float16, shape, ours, theirs, compiled_fn=compiled, note=note)
    if layer is not None and not ctx.quick:
        layer.recompute = False
        ctx.row(name, torch.float16, shape + " no-recompute", ours, theirs,
                note=f"peak MB lsmini {_peak_mb(ours):.0f} / eager {peaks[1]:.0f}")
        layer.recompute = True


def bench(ctx):
    for h, heads, ffn in _SHAPES:
        shape = f"{_B}x{_L} h{h}/{heads} ffn{ffn} p{_P} AMP"
        cfg = TransformerConfig(h, heads, ffn, dropout=_P, attn_dropout=_P, activation_dropout=_P, pre_layer_norm=True,
                                max_batch_tokens=_B * _L, max_seq_len=_L)
        gen = torch.Generator(device="cuda").manual_seed(0)
        lengths = torch.randint(_L // 2, _L + 1, (_B, 1), device="cuda", generator=gen)
        mask = torch.arange(_L, device="cuda").view(1, _L) >= lengths  # True = pad
        x = torch.randn(_B, _L, h, device="cuda", requires_grad=True)
        grad = torch.randn(_B, _L, h, device="cuda")

        if ctx.wanted("encoder_layer"):
            ours = TransformerEncoderLayer(cfg).cuda()
            theirs = ours.to_torch()
            comp = None if ctx.quick else _compiled(theirs)
            _row(ctx, "encoder_layer", shape, _step(lambda: ours(x, mask), grad),
                 _step(lambda: theirs(x, src_key_padding_mask=mask), grad),
                 _step(lambda: comp(x, src_key_padding_mask=mask), grad) if comp is not None else None, ours)
            del ours, theirs, comp

        if ctx.wanted("decoder_layer"):
            mem = torch.randn(_B, _L, h, device="cuda", requires_grad=True)
            causal = nn.Transformer.generate_square_subsequent_mask(_L, device="cuda")
            ours = TransformerDecoderLayer(cfg).cuda()
            theirs = ours.to_torch()
            comp = None if ctx.quick else _compiled(theirs)

            def torch_call(module):
                return lambda: module(x, mem, tgt_mask=causal, memory_key_padding_mask=mask, tgt_is_causal=True)

            _row(ctx, "decoder_layer", shape, _step(lambda: ours(x, mem, mask), grad), _step(torch_call(theirs), grad),
                 _step(torch_call(comp), grad) if comp is not None else None, ours)
            del ours, theirs, comp, mem
        del x, grad, mask
        arena.release()
        torch.cuda.empty_cache()
