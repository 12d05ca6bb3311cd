"""split_heads / merge_heads beside plain PyTorch (view/permute/contiguous and its autograd backward).

Sizes: split_heads at 65536 tokens (512 × 128) × 3·hidden, merge_heads at 131072 tokens (1024 × 128) ×
hidden, hidden ∈ {512 (8 heads), 1024 (16 heads)}, head_dim 64: every input is ≥ 2× the 60 MB L2 (at the
8192 tokens of a typical training batch, x would fit in L2 and the numbers would measure the cache).
Bytes: each input read once + each output written once (bias and grad_bias included; the grad_bias
partials, ≤ 1% of the traffic, are not counted). The PyTorch backward rows end with `.contiguous()`
on grad_x: autograd of a permute alone returns a strided view that the next GEMM would copy anyway.
"""
import torch

import lsmini

SPLIT_TOKENS = (512, 128)
MERGE_TOKENS = (1024, 128)
PARTS = 3


def _compiled(fn):
    """torch.compile'd fn, or None where compile is unavailable here."""
    try:
        c = torch.compile(fn, dynamic=False)
        c()
        torch.cuda.synchronize()
        return c
    except Exception:  # inductor/triton missing or failing: the row simply has no compiled column
        return None


def _split_rows(ctx, dtype, hidden, heads):
    batch, length = SPLIT_TOKENS
    head_dim, width = hidden // heads, PARTS * hidden
    shape = f"{batch}x{length}x{PARTS}*{hidden} h{heads}"
    note = f"{batch * length} tokens"
    x = torch.randn(batch, length, width, device="cuda", dtype=dtype)
    bias = torch.randn(width, device="cuda", dtype=dtype)
    nbytes = 2 * x.numel() * x.element_size() + bias.numel() * bias.element_size()

    def torch_fwd():
        return (x + bias).view(batch, length, PARTS, heads, head_dim).permute(2, 0, 3, 1, 4).contiguous()

    ctx.row("split_heads_fwd", dtype, shape, lambda: lsmini.ops.split_heads(x, bias, heads, PARTS), torch_fwd,
            nbytes=nbytes, compiled_fn=None if ctx.quick or not ctx.wanted("split_heads_fwd") else _compiled(torch_fwd),
            note=note)

    if ctx.wanted("split_heads_bwd"):
        xg, bg = x.detach().requires_grad_(), bias.detach().requires_grad_()
        outs = lsmini.ops.split_heads(xg, bg, heads, PARTS)
        t_out = (xg + bg).view(batch, length, PARTS, heads, head_dim).permute(2, 0, 3, 1, 4).contiguous()
        g5 = torch.randn(PARTS, batch, heads, length, head_dim, device="cuda", dtype=dtype)
        grads = g5.unbind(0)  # how a fused attention backward hands them over: one buffer

        def lsmini_bwd():
            return torch.autograd.grad(outs, (xg, bg), grads, retain_graph=True)

        def torch_bwd():
            gx, gb = torch.autograd.grad(t_out, (xg, bg), g5, retain_graph=True)
            return gx.contiguous(), gb

        ctx.row("split_heads_bwd", dtype, shape, lsmini_bwd, torch_bwd, nbytes=nbytes, note=note)
        del outs, t_out, g5, grads, xg, bg


def _merge_rows(ctx, dtype, hidden, heads):
    batch, length = MERGE_TOKENS
    head_dim = hidden // heads
    shape = f"{batch}x{heads}x{length}x{head_dim}"
    note = f"{batch * length} tokens"
    x = torch.randn(batch, heads, length, head_dim, device="cuda", dtype=dtype)
    nbytes = 2 * x.numel() * x.element_size()

    def torch_fwd():
        return x.transpose(1, 2).reshape(batch, length, hidden)

    ctx.row("merge_heads_fwd", dtype, shape, lambda: lsmini.ops.merge_heads(x), torch_fwd, nbytes=nbytes,
            compiled_fn=None if ctx.quick or not ctx.wanted("merge_heads_fwd") else _compiled(torch_fwd), note=note)

    if ctx.wanted("merge_heads_bwd"):
        xg = x.detach().requires_grad_()
        out = lsmini.ops.merge_heads(xg)
        t_out = xg.transpose(1, 2).reshape(batch, length, hidden)
        g = torch.randn(batch, length, hidden, device="cuda", dtype=dtype)

        def lsmini_bwd():
            return torch.autograd.grad(out, xg, g, retain_graph=True)

        def torch_bwd():
            return torch.autograd.grad(t_out, xg, g, retain_graph=True)[0].contiguous()

        ctx.row("merge_heads_bwd", dtype, shape, lsmini_bwd, torch_bwd, nbytes=nbytes, note=note)
        del out, t_out, g, xg


def bench(ctx):
    configs = [(1024, 16)] if ctx.quick else [(512, 8), (1024, 16)]
    for dtype in (torch.float16, torch.bfloat16):
        for hidden, heads in configs:
            if ctx.wanted("split_heads_fwd") or ctx.wanted("split_heads_bwd"):
                _split_rows(ctx, dtype, hidden, heads)
            if ctx.wanted("merge_heads_fwd") or ctx.wanted("merge_heads_bwd"):
                _merge_rows(ctx, dtype, hidden, heads)
            torch.cuda.empty_cache()
