"""attention_softmax_fwd / attention_softmax_bwd beside PyTorch's masked_fill + softmax + dropout (same run).

Each shape has 2^27 scores (256 MB in fp16/bf16, several times the L2), q_len = k_len up to 1024,
dropout 0.1 as in training. Two mask setups: key padding (encoder self-attention) and causal
(decoder self-attention; the kernel does not read scores above the diagonal, so its GB/s counts
bytes it skipped).
"""
import torch
import torch.nn.functional as F

import lsmini
from lsmini.ops.attention_softmax import attention_softmax

_NUMEL = 1 << 27
_P = 0.1
aten = torch.ops.aten


def _shape(k):
    q = min(k, 1024)
    h = max(1, min(16, _NUMEL // (q * k)))
    return _NUMEL // (h * q * k), h, q, k


def _compiled(fn, *args):
    """torch.compile(fn) warmed up on args, or None where compile is unavailable."""
    try:
        torch._dynamo.reset()  # one graph per row: stay clear of the recompile limit
        c = torch.compile(fn, dynamic=False)
        c(*args)
        return c
    except Exception as e:  # noqa: BLE001 - the eager comparison still stands
        print(f"# attention_softmax: torch.compile unavailable ({type(e).__name__}: {e})")
        return None


def _torch_fwd(scores, masked, p):
    return F.dropout(torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1), p=p, training=True)


def _torch_bwd(dy, dmask, y, masked, p):
    # what autograd runs for masked_fill → softmax → dropout
    g = aten.native_dropout_backward(dy, dmask, 1.0 / (1.0 - p))
    return aten._softmax_backward_data(g, y, -1, y.dtype).masked_fill(masked, 0.0)


def _math_bwd(dy, dmask, y, masked, p):
    g = dy * dmask * (1.0 / (1.0 - p))
    return (y * (g - (y * g).sum(-1, keepdim=True))).masked_fill(masked, 0.0)


def bench(ctx):
    ext = lsmini._backend.ext()
    ks = [128, 1024, 4096] if ctx.quick else [64, 128, 256, 512, 1024, 4096]
    setups = ["pad"] if ctx.quick else ["pad", "causal"]
    for dtype in (torch.float16, torch.bfloat16):
        for k in ks:
            for setup in setups:
                b, h, q, _ = _shape(k)
                shape = f"{b}x{h}x{q}x{k} {setup} p={_P}"
                scores = torch.randn(b, h, q, k, device="cuda", dtype=dtype)
                dy = torch.randn_like(scores)
                if setup == "pad":
                    lengths = torch.randint(k // 2, k + 1, (b, 1), device="cuda")
                    kpm = torch.arange(k, device="cuda").view(1, k) >= lengths
                    masked, causal = kpm.view(b, 1, 1, k), False
                else:
                    kpm, causal = None, True
                    masked = ~torch.ones(q, k, dtype=torch.bool, device="cuda").tril(diagonal=k - q)
                e = scores.element_size()
                mask_bytes = kpm.numel() if kpm is not None else 0
                # forward: read scores (+ mask), write probs and softmax; backward: read dprobs and
                # softmax, write dscores
                fwd_bytes = 3 * scores.numel() * e + mask_bytes
                bwd_bytes = 3 * scores.numel() * e
                note = "upper triangle not read" if causal else ""

                compiled = None if ctx.quick else _compiled(_torch_fwd, scores, masked, _P)
                ctx.row("attention_softmax_fwd", dtype, shape,
                        lambda: attention_softmax(scores, kpm, causal, _P),
                        lambda: _torch_fwd(scores, masked, _P), nbytes=fwd_bytes, compiled_fn=(
                            (lambda: compiled(scores, masked, _P)) if compiled else None), note=note)
                del compiled

                rng = lsmini._backend.philox_seed_offset()
                _, sm = ext.attention_softmax_fwd(scores, kpm, causal, _P, rng)
                y = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1)
                _, dmask = aten.native_dropout(y, _P, True)
                compiled = None if ctx.quick else _compiled(_math_bwd, dy, dmask, y, masked, _P)
                ctx.row("attention_softmax_bwd", dtype, shape,
                        lambda: ext.attention_softmax_bwd(dy, sm, _P, rng, False),
                        lambda: _torch_bwd(dy, dmask, y, masked, _P), nbytes=bwd_bytes, compiled_fn=(
                            (lambda: compiled(dy, dmask, y, masked, _P)) if compiled else None))
                del scores, dy, kpm, masked, sm, y, dmask, compiled
                torch.cuda.empty_cache()
