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
from lsmini.ops.attention import attention_ref
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
def ln_fwd(x2d, w, b, eps, k, out=None):
    """out: where to write the output (else fresh)."""
    if k:
        y, mean, rstd = _backend.ext().layernorm_fwd(x2d, w, b, eps, out)
        return y, {"x": x2d, "mean": mean, "rstd": rstd}
    y = layer_norm_ref(x2d, w, b, eps)
    return y if out is None else out.copy_(y), {"x": x2d}


def ln_bwd(dy, w, b, eps, st, k, add=None, out=None):
    """(dx, dw, db), fresh tensors; with add (a gradient of the same shape) dx is the input gradient plus
    add; dx goes into out when given (out may be add: in place)."""
    if k:
        dx, dw, db = _backend.ext().layernorm_bwd(dy, st["x"], w, b, st["mean"], st["rstd"], add, out)
        return dx, dw, db
    with torch.enable_grad():
        xs, ws, bs = _leaf(st["x"]), _leaf(w), _leaf(b)
        dx, dw, db = _grads(layer_norm_ref(xs, ws, bs, eps), [xs, ws, bs], dy)
    if add is not None:
        dx = dx + add
    return dx if out is None else out.copy_(dx), dw, db


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


def bdr_bwd(g2d, bias, st, k, out=None):
    """(grad_x, grad_bias); grad_residual is g2d itself. Without dropout grad_x IS g2d; with dropout it is
    written into out when given (else fresh)."""
    p = st["p"]
    if k:
        gx, gb = _backend.ext().bias_dropout_residual_bwd(g2d, p, st["rng"], True, bias.dtype, out)
        return gx, gb
    gx = g2d
    if p > 0:
        gx = torch.where(st["keep"], g2d.float() * (1.0 / (1.0 - p)), torch.zeros((), device=g2d.device)).to(g2d.dtype)
        gx = gx if out is None else out.copy_(gx)
    return gx, gx.float().sum(0).to(bias.dtype)


# ---- dropout(act(x + bias)): x2d [rows, ffn] ------------------------------------------------------
def bad_fwd(x2d, bias, act, p, k, replay=None, out=None):
    """replay: the state of an earlier call on the same x2d — recompute exactly that output (same
    dropout mask) instead of drawing a new one. out: where to write the output (else fresh)."""
    if k:
        rng = replay["rng"] if replay is not None else _backend.dropout_rng(p, x2d.device)
        y = _backend.ext().bias_act_dropout_fwd(x2d, bias, act, p, rng, out)
        return y, {"x": x2d, "p": p, "rng": rng}
    keep = replay["keep"] if replay is not None else _keep_mask(x2d.shape, p, x2d.device)
    y = bias_act_dropout_ref(x2d, bias, act, p, True, keep)
    return y if out is None else out.copy_(y), {"x": x2d, "p": p, "keep": keep}


def bad_bwd(g2d, bias, act, st, k, out=None):
    """(grad_x, grad_bias); grad_x into out when given (out may be g2d itself), else fresh. st: bad_fwd's
    state, or — relu only — {"y": the forward's output, "p": p}: relu's derivative read off the output
    (y > 0 exactly where the gradient passes), so neither the input nor the mask is needed."""
    if "y" in st:
        if k:
            return _backend.ext().bias_act_dropout_bwd(g2d, st["y"], bias, "relu", st["p"], _backend.NO_RNG, out,
                                                       True)
        scale = 1.0 / (1.0 - st["p"]) if st["p"] < 1 else 0.0
        gx = torch.where(st["y"] <= 0, 0.0, g2d.float() * scale).to(g2d.dtype)  # NaN passes, as the kernel
        return gx if out is None else out.copy_(gx), gx.float().sum(0).to(bias.dtype)
    if k:
        gx, gb = _backend.ext().bias_act_dropout_bwd(g2d, st["x"], bias, act, st["p"], st["rng"], out)
        return gx, gb
    with torch.enable_grad():
        xs, bs = _leaf(st["x"]), _leaf(bias)
        out_ = bias_act_dropout_ref(xs, bs, act, st["p"], True, st["keep"])
        gx, gb = _grads(out_, [xs, bs], g2d)
    return gx if out is None else out.copy_(gx), gb


def bias_grad(g2d, dtype, k):
    """Column sums of g2d [rows, n] accumulated in fp32, returned as dtype (a bias gradient), without
    an fp32 copy of g2d (``sum(dtype=float32)`` would make one)."""
    if k:
        return _backend.ext().bias_dropout_residual_bwd(g2d, 0.0, _backend.NO_RNG, True, dtype)[1]
    return g2d.float().sum(0).to(dtype)


# ---- attention core: q [b, h, lq, d], k/v [b, h, lk, d] (views into the projections) --------------------
def attn_fwd(q, k, v, kpm, causal, p, scale, fused):
    """(out [b, lq, h·d] contiguous, state). fused: the flash kernel (CUDA, fp16/bf16, a supported head_dim;
    out is its merged-heads buffer); otherwise attention_ref, with its dropout keep-mask in the state."""
    b, h, lq, d = q.shape
    st = {"q": q, "k": k, "v": v, "kpm": kpm, "causal": causal, "p": p, "scale": scale}
    if fused:
        st["rng"] = _backend.dropout_rng(p, q.device)
        out, st["lse"] = _backend.ext().attention_fwd(q, k, v, kpm, causal, p, scale, st["rng"])
    else:
        st["keep"] = _keep_mask((b, h, lq, k.shape[2]), p, q.device)
        out = attention_ref(q, k, v, kpm, causal, p, True, scale, st["keep"])
    out = out.transpose(1, 2).reshape(b, lq, h * d)  # free for the kernel's [b, lq, h, d] buffer
    st["out"] = out
    return out, st


def attn_bwd(dout, st, dq, dk, dv, fused):
    """Writes the gradients into dq/dk/dv (views shaped like q/k/v); dout [b, lq, h·d]."""
    b, h, lq, d = st["q"].shape
    heads = lambda t: t.view(b, lq, h, d).transpose(1, 2)  # noqa: E731
    if fused:
        _backend.ext().attention_bwd(heads(dout), st["q"], st["k"], st["v"], heads(st["out"]), st["lse"], st["kpm"],
                                     st["causal"], st["p"], st["scale"], st["rng"], dq, dk, dv)
        return
    with torch.enable_grad():
        qs, ks, vs = _leaf(st["q"]), _leaf(st["k"]), _leaf(st["v"])
        out = attention_ref(qs, ks, vs, st["kpm"], st["causal"], st["p"], True, st["scale"], st["keep"])
        for dst, g in zip((dq, dk, dv), torch.autograd.grad(out, (qs, ks, vs), heads(dout))):
            dst.copy_(g)
