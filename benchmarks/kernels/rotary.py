"""rotary_fwd / rotary_bwd beside PyTorch in the same run: eager Hugging Face ``apply_rotary_pos_emb`` (``q·cos +
rotate_half(q)·sin`` on cos, sin [batch, seq, rot_dim] unsqueezed over the heads, in q's dtype as transformers casts
them; partial rotary split off and concatenated back; GPT-J's rotate_every_two for the interleaved row) and
torch.compile of the same function (outside --quick).

Shapes (the shape column: batch×seq, query heads/K/V heads×head_dim, then the variant): the issue's Llama-style 125M
model (8×1024, 12/4×64) and a Llama-8B-sized attention (4×4096, 32/8×128); at the larger one also q and k in
[batch, seq, heads, head_dim] memory (a QKV projection's output viewed per head, passed transposed), half of head_dim
rotated (partial), interleaved pairs, and float32 tables.

Bytes (the minimum each op must move): q and k read, q' and k' written (backward: their gradients), plus cos and sin
read once:   2 · (|q| + |k|) · s + 2 · |cos| · s_table.
Backward rows time autograd's backward only, on every side: torch.autograd.grad(outputs, (q, k), grads,
retain_graph=True) on a graph built once.
"""
import torch

import common
from lsmini.ops import rotary, rotary_cos_sin


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _torch_rotary(q, k, cos, sin, interleaved):
    """Hugging Face's apply_rotary_pos_emb (GPT-J's rotation when interleaved), partial rotary as GPT-NeoX splits it."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot_dim = cos.shape[-1]
    rotate = _rotate_every_two if interleaved else _rotate_half

    def apply(x):
        if rot_dim == x.shape[-1]:
            return x * cos + rotate(x) * sin
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)

    return apply(q), apply(k)


# (batch, seq, heads, kv_heads, head_dim)
MODELS = {"125M": (8, 1024, 12, 4, 64), "8B": (4, 4096, 32, 8, 128)}
# (model, variant): variant ∈ "", "bshd", "partial", "interleaved", "fp32 tables"
VARIANTS = [("125M", ""), ("8B", ""), ("8B", "bshd"), ("8B", "partial"), ("8B", "interleaved"), ("8B", "fp32 tables")]


def bench(ctx):
    if not (ctx.wanted("rotary_fwd") or ctx.wanted("rotary_bwd")):
        return
    dtypes = [torch.bfloat16] if ctx.quick else [torch.bfloat16, torch.float16]
    variants = [("8B", "")] if ctx.quick else VARIANTS
    for dtype in dtypes:
        for model, variant in variants:
            batch, seq, heads, kv_heads, head_dim = MODELS[model]
            rot_dim = head_dim // 2 if variant == "partial" else head_dim
            interleaved = variant == "interleaved"
            table_dtype = torch.float32 if variant == "fp32 tables" else dtype
            if variant == "bshd":
                q = torch.randn(batch, seq, heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
                k = torch.randn(batch, seq, kv_heads, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
            else:
                q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype)
                k = torch.randn(batch, kv_heads, seq, head_dim, device="cuda", dtype=dtype)
            q.requires_grad_()
            k.requires_grad_()
            positions = torch.arange(seq, device="cuda").expand(batch, seq)
            cos, sin = rotary_cos_sin(positions, rot_dim, interleaved=interleaved, dtype=table_dtype)
            cos_t, sin_t = cos.to(dtype), sin.to(dtype)  # what the baselines take (transformers casts to q's dtype)
            dq, dk = torch.randn(q.shape, device="cuda", dtype=dtype), torch.randn(k.shape, device="cuda", dtype=dtype)
            nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
            shape = f"{batch}x{seq} {heads}/{kv_heads}x{head_dim}" + (f" {variant}" if variant else "")

            def ours_fn():
                return rotary(q, k, cos, sin, interleaved=interleaved)

            def torch_fn():
                return _torch_rotary(q, k, cos_t, sin_t, interleaved)

            compiled = None if ctx.quick else common.compiled_or_none(torch_fn, "rotary")
            ctx.row("rotary_fwd", dtype, shape, ours_fn, torch_fn, nbytes=nbytes, compiled_fn=compiled)
            ours, theirs = ours_fn(), torch_fn()
            theirs_compiled = compiled() if compiled is not None else None
            ctx.row("rotary_bwd", dtype, shape,
                    lambda: torch.autograd.grad(ours, (q, k), (dq, dk), retain_graph=True),
                    lambda: torch.autograd.grad(theirs, (q, k), (dq, dk), retain_graph=True),
                    nbytes=nbytes,
                    compiled_fn=None if theirs_compiled is None else (
                        lambda: torch.autograd.grad(theirs_compiled, (q, k), (dq, dk), retain_graph=True)),
                    note="autograd backward only")
            del compiled, ours, theirs, theirs_compiled, q, k, dq, dk, cos, sin, cos_t, sin_t
            torch.cuda.empty_cache()
