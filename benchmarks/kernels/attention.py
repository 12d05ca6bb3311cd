"""attention_fwd / attention_bwd: the fused attention op beside torch's eager scaled_dot_product_attention
(what torch.nn.MultiheadAttention runs) and beside lsmini's unfused path, in the same run.

fp16, dropout 0.1 as in training. Key-padding rows pass torch the equivalent boolean attn_mask (True =
attend); the causal row passes is_causal=True. The attention_bwd rows time forward + backward. Each
shape has two rows: "torch" is F.scaled_dot_product_attention, then (note "vs unfused") lsmini's
QKᵀ GEMM + attention_softmax + ·V GEMM. Attention is compute-bound: no GB/s.
"""
import math

import torch
import torch.nn.functional as F

from lsmini.ops.attention import attention
from lsmini.ops.attention_softmax import attention_softmax

_P = 0.1
_SHAPES = [(64, 8, 128, 64, "pad"), (64, 16, 128, 64, "pad"), (8, 16, 1024, 64, "pad"), (8, 16, 1024, 64, "causal")]


def _unfused(q, k, v, kpm, causal):
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    return torch.matmul(attention_softmax(scores, kpm, causal, _P), v)


def fwd_bwd(fn, q, k, v, grad):
    def step():
        torch.autograd.grad(fn(), (q, k, v), grad)  # no .grad accumulation inside the timed region
    return step


def inputs(b, h, l, d, dtype, padded, hk=None):
    """q, k, v (leaves; k and v with hk heads, default h), the output gradient, and the mask three ways: lsmini's
    key_padding_mask and causal flag, and SDPA's keyword arguments. padded: random lengths in [l/2, l]; else
    causal."""
    q = torch.randn(b, h, l, d, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn(b, hk or h, l, d, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(b, h, l, d, device="cuda", dtype=dtype)
    if padded:
        lengths = torch.randint(l // 2, l + 1, (b, 1), device="cuda")
        kpm = torch.arange(l, device="cuda").view(1, l) >= lengths
        return q, k, v, grad, kpm, False, {"attn_mask": ~kpm.view(b, 1, 1, l)}
    return q, k, v, grad, None, True, {"is_causal": True}


def bench(ctx):
    dtype = torch.float16
    shapes = [_SHAPES[0], _SHAPES[-1]] if ctx.quick else _SHAPES
    for b, h, l, d, setup in shapes:
        shape = f"{b}x{h}x{l}x{d} {setup} p={_P}"
        q, k, v, grad, kpm, causal, sdpa_kw = inputs(b, h, l, d, dtype, setup == "pad")
        ours = lambda: attention(q, k, v, kpm, causal, _P)  # noqa: E731
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=_P, **sdpa_kw)  # noqa: E731
        unfused = lambda: _unfused(q, k, v, kpm, causal)  # noqa: E731
        rows = (("attention_fwd", "", lambda fn: fn),
                ("attention_bwd", "fwd+bwd; ", lambda fn: fwd_bwd(fn, q, k, v, grad)))
        for name, what, wrap in rows:
            ctx.row(name, dtype, shape, wrap(ours), wrap(sdpa), note=what + "torch = eager SDPA", baseline="torch sdpa")
            ctx.row(name, dtype, shape, wrap(ours), wrap(unfused),
                    note=what + "vs unfused: matmul + attention_softmax + matmul",
                    baseline="lsmini unfused", baseline_kind="lsmini")
