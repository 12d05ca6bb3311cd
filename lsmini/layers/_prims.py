"""Forward/backward primitives of the fused layers: each runs the CUDA binding (``k=True``) or the
pure-PyTorch reference with a hand-written or autograd-derived backward (``k=False``).

The layers' manual backward is written once over these primitives, so the same layer code runs on the
kernels (CUDA) and on the references (CPU, ``LSMINI_FORCE_REFERENCE=1``) — the CPU tests exercise the
hand-written backward against torch.nn. Each ``*_fwd`` returns (output, state); the matching ``*_bwd``
takes the state. States hold tensors and plain values only.

Dropout: the kernels take the call's Philox state ``rng`` (``_backend.dropout_rng``, drawn
from torch's CUDA generator; graph-safe) and regenerate the mask in backward; the references draw a
bool keep-mask with torch's generator of the tensor's device and keep it in the state (reference path
only).
"""
import torch

from lsmini import _backend
from lsmini.ops.attention_softmax import attention_softmax_ref
from lsmini.ops.bias_act_dropout import bias_act_dropout_ref
from lsmini.ops.layernorm import layer_norm_ref


def _keep_mask(shape, p, device):
    return None if p <= 0 else torch.rand(shape, device=device) >= p


def _grads(out, inputs, grad_out):
    """Gradients of out w.r.t. inputs (None entries skipped) through a reference, recomputed here."""
    live = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(out, live, grad_out))
    return [None if t is None else next(got) for t in inputs]


def _leaf(t):
    return None if t is None else t.detach().requires_grad_(True)


# ---- LayerNorm over rows: x2d [rows, hidden] ------------------------------------------------------
def ln_fwd(x2d, w, b, eps, k):
    if k:
        y, mean, rstd = _backend.ext().layernorm_fwd(x2d, w, b, eps)
        return y, {"x": x2d, "mean": mean, "rstd": rstd}
    return layer_norm_ref(x2d, w, b, eps), {"x": x2d}


def ln_bwd(dy, w, b, eps, st, k):
    """(dx, dw, db), all fresh tensors."""
    if k:
        dx, dw, db = _backend.ext().layernorm_bwd(dy, st["x"], w, b, st["mean"], st["rstd"])
        return dx, dw, db
    with torch.enable_grad():
        xs, ws, bs = _leaf(st["x"]), _leaf(w), _leaf(b)
        return tuple(_grads(layer_norm_ref(xs, ws, bs, eps), [xs, ws, bs], dy))


# ---- residual + dropout(x + bias): x2d, res2d [rows, hidden] ---------------------------------------
def bdr_fwd(x2d, bias, res2d, p, k):
    if k:
        rng = _backend.dropout_rng(p, x2d.device)
        out = _backend.ext().bias_dropout_residual_fwd(x2d, bias, res2d, p, rng)
        return out, {"p": p, "rng": rng}
    keep = _keep_mask(x2d.shape, p, x2d.device)
    y = x2d.float() + bias.float()
    if keep is not None:
        y = torch.where(keep, y * (1.0 / (1.0 - p)), torch.zeros_like(y))
    return (res2d.float() + y).to(x2d.dtype), {"p": p, "keep": keep}


def bdr_bwd(g2d, bias, st, k):
    """(grad_x, grad_bias); grad_residual is g2d itself. Without dropout grad_x may BE g2d."""
    p = st["p"]
    if k:
        gx, gb = _backend.ext().bias_dropout_residual_bwd(g2d, p, st["rng"], True, bias.dtype)
        return gx, gb
    gx = g2d
    if st["keep"] is not None:
        gx = torch.where(st["keep"], g2d.float() * (1.0 / (1.0 - p)), torch.zeros((), device=g2d.device)).to(g2d.dtype)
    return gx, gx.float().sum(0).to(bias.dtype)


# ---- dropout(act(x + bias)): x2d [rows, ffn] ------------------------------------------------------
def bad_fwd(x2d, bias, act, p, k, replay=None):
    """replay: the state of an earlier call on the same x2d — recompute exactly that output (same
    dropout mask) instead of drawing a new one."""
    if k:
        rng = replay["rng"] if replay is not None else _backend.dropout_rng(p, x2d.device)
        out = _backend.ext().bias_act_dropout_fwd(x2d, bias, act, p, rng)
        return out, {"x": x2d, "p": p, "rng": rng}
    keep = replay["keep"] if replay is not None else _keep_mask(x2d.shape, p, x2d.device)
    return bias_act_dropout_ref(x2d, bias, act, p, True, keep), {"x": x2d, "p": p, "keep": keep}


def bad_bwd(g2d, bias, act, st, k):
    """(grad_x fresh, grad_bias)."""
    if k:
        gx, gb = _backend.ext().bias_act_dropout_bwd(g2d, st["x"], bias, act, st["p"], st["rng"])
        return gx, gb
    with torch.enable_grad():
        xs, bs = _leaf(st["x"]), _leaf(bias)
        out = bias_act_dropout_ref(xs, bs, act, st["p"], True, st["keep"])
        gx, gb = _grads(out, [xs, bs], g2d)
    return gx, gb


# ---- split_heads: x [b, l, parts·H] (+ bias) → [parts, b, heads, l, head_dim] -----------------------
def split_fwd(x3d, bias, heads, parts, k):
    if k:
        return _backend.ext().split_heads_fwd(x3d, bias, heads, parts)
    b, l, w = x3d.shape
    y = (x3d.float() + bias.float()).to(x3d.dtype)
    return y.view(b, l, parts, heads, w // (parts * heads)).permute(2, 0, 3, 1, 4).contiguous()


def split_bwd(g5, bias, k):
    """g5 [parts, b, heads, l, d] (contiguous) → (grad_x [b, l, parts·H] fresh, grad_bias)."""
    if k:
        gx, gb = _backend.ext().split_heads_bwd(g5, True, bias.dtype == torch.float32)
        return gx, gb
    parts, b, h, l, d = g5.shape
    # clone, not reshape: with one part and one head the permute is a view of g5, which is scratch
    gx = g5.permute(1, 3, 0, 2, 4).clone(memory_format=torch.contiguous_format).view(b, l, parts * h * d)
    return gx, gx.float().sum((0, 1)).to(bias.dtype)


# ---- merge_heads: [b, heads, l, d] ↔ [b, l, heads·d] ------------------------------------------------
def merge_fwd(x4d, k):
    if k:
        return _backend.ext().merge_heads_fwd(x4d)
    b, h, l, d = x4d.shape
    return x4d.transpose(1, 2).reshape(b, l, h * d)


def merge_bwd(g3d, heads, k):
    """[b, l, heads·d] → fresh [b, heads, l, d]."""
    if k:
        return _backend.ext().merge_heads_bwd(g3d, heads)
    b, l, w = g3d.shape
    # clone, not contiguous(): with one head the transpose is a view of g3d, which is scratch
    return g3d.view(b, l, heads, w // heads).transpose(1, 2).clone(memory_format=torch.contiguous_format)


# ---- attention softmax: scores [b, heads, q, k] → probs (dropped), saved softmax ---------------------
def softmax_fwd(scores, kpm, causal, p, k, replay=None):
    """(probs, state); probs is a fresh tensor (the scores may be scratch). replay: the state of an
    earlier call on the same scores — recompute exactly its output (same dropout mask)."""
    if k:
        rng = replay["rng"] if replay is not None else _backend.dropout_rng(p, scores.device)
        probs, sm = _backend.ext().attention_softmax_fwd(scores, kpm, causal, p, rng)
        return probs, {"sm": sm, "probs": probs if p > 0 else None, "p": p, "rng": rng}
    sm = attention_softmax_ref(scores, kpm, causal, 0.0, False)
    keep = replay["keep"] if replay is not None else _keep_mask(scores.shape, p, scores.device)
    probs = sm
    if keep is not None:
        probs = torch.where(keep, sm.float() * (1.0 / (1.0 - p)), torch.zeros((), device=sm.device)).to(sm.dtype)
    return probs, {"sm": sm, "probs": probs if p > 0 else None, "p": p, "keep": keep}


def without(st, *names):
    """st without the named entries (what a recomputing layer does not save)."""
    return {k: v for k, v in st.items() if k not in names}


def softmax_probs(st):
    return st["sm"] if st["probs"] is None else st["probs"]


def softmax_bwd_(gprobs, st, k):
    """Score gradient written over gprobs (contiguous scratch), which is returned."""
    if k:
        return _backend.ext().attention_softmax_bwd(gprobs, st["sm"], st["p"], st["rng"], True)
    g = gprobs.float()
    if st["keep"] is not None:
        g = torch.where(st["keep"], g * (1.0 / (1.0 - st["p"])), torch.zeros((), device=g.device))
    y = st["sm"].float()
    gprobs.copy_(y * (g - (y * g).sum(-1, keepdim=True)))
    return gprobs
