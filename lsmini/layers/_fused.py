"""The fused Transformer layer: forward and a hand-written backward, one autograd Function per layer.

A layer is a list of sub-blocks ("self" attention, "cross" attention, "ffn"), each with the same six
parameters (W_in, b_in, W_out, b_out, ln_w, ln_b):

    self:   W_in = fused QKV [3H, H]   (b_in added by split_heads)   W_out = attention output [H, H]
    cross:  W_in = query     [H, H]    (K/V come from CrossKVFunction, see below)
    ffn:    W_in = [F, H]              (b_in added by bias_act_dropout) W_out = [H, F]
    b_out is added by bias_dropout_residual; ln_w/ln_b is the sub-block's LayerNorm.

    pre-LN:  r ← r + dropout(core(LN(r)) + b_out)          post-LN:  r ← LN(r + dropout(core(r) + b_out))

Attention core: QKᵀ·(1/sqrt(d)) in one baddbmm (the scale folded into the GEMM), attention_softmax
(masks and dropout fused), ·V, merge_heads, output GEMM. FFN core: GEMM, bias_act_dropout, GEMM.

Saved for backward (spec.recompute, the default): each block's input, Q/K/V, the merged attention
context, the first FFN GEMM's output, LayerNorm statistics, each dropout's Philox state ``rng``;
backward recomputes the attention probabilities (QKᵀ into scratch, then the softmax forward again with
the same ``rng``, so the very same dropout mask), the FFN activation (bias_act_dropout forward again,
same mask) and, for pre-LN, the LayerNorm outputs. spec.recompute = False saves those instead. Under
CUDA graph capture ``rng`` holds device pointers that each replay refills, so forward, recompute and
backward of one replay share one mask and every replay draws a new one.

Backward temporaries (attention-score gradient, Q/K/V gradients, FFN hidden gradient, the gradients
of each core's input) are views into the arena of (device, dtype) (``arena.py``), laid out per core:

    self:   [0, S)  recomputed scores, then dprobs → dscores in place (S = b·h·l·l, 64-aligned);
            [S, S + 3TH) dQ, dK, dV; [0, TH) also holds d(merged context) between the scores and
            dprobs, and d(core input) after dQKV is consumed.
    cross:  [0, S) dscores (S = b·h·lt·ls); [S, S + TH) dQ; [0, TH) as above. dK/dV go to KVGradSlots.
    ffn:    [0, TF) d(activation output), then [0, TH) d(core input).

Regions overlap only where one is dead before the other is written (stream order). Everything that
backward returns is a fresh tensor: the input gradient comes out of a LayerNorm backward (fresh) plus
an in-place residual add into it.

Cross-attention of a decoder stack: CrossKVFunction projects the encoder output with the K/V weights
of ALL layers at once ([b·ls, H] × [H, L·2H], one GEMM), and split_heads(parts = 2L) yields every
layer's K and V. In backward each layer writes its dK/dV straight into its slice of one
[2L, b, h, ls, d] buffer (KVGradSlots), so CrossKVFunction gets the stacked gradient without a copy
and runs one GEMM for d(encoder output) and one for d(weight).
"""
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lsmini.layers import _prims as P
from lsmini.layers.arena import align, get_arena, region
from lsmini.ops.attention_softmax import attention_softmax
from lsmini.ops.bias_act_dropout import bias_act_dropout
from lsmini.ops.bias_dropout_residual import bias_dropout_residual
from lsmini.ops.heads import merge_heads, split_heads
from lsmini.ops.layernorm import layer_norm

PARAMS_PER_BLOCK = 6


class LayerSpec:
    """Everything about one layer call that is not a tensor."""

    def __init__(self, kinds, config, training, causal, kernels, slots=None, index=0, recompute=True):
        self.kinds = tuple(kinds)
        self.recompute = bool(recompute)
        self.H, self.F = config.hidden_size, config.ffn_size
        self.heads, self.d = config.num_heads, config.head_dim
        self.scale = 1.0 / math.sqrt(self.d)
        self.eps = float(config.layer_norm_eps)
        self.pre_ln = config.pre_layer_norm
        self.act = config.activation
        self.training = bool(training)
        self.p_drop = float(config.dropout) if training else 0.0
        self.p_attn = float(config.attn_dropout) if training else 0.0
        self.p_act = float(config.activation_dropout) if training else 0.0
        self.causal = bool(causal)
        self.k = bool(kernels)
        self.slots, self.index = slots, index
        self.b = self.lq = self.ls = 0  # set by forward

    def scratch_numel(self, backward):
        """Arena elements one forward (scores) or backward (see the module docstring) needs."""
        b, lq, ls, h, H, F_ = self.b, self.lq, self.ls, self.heads, self.H, self.F
        t = b * lq
        need = 0
        for kind in self.kinds:
            if kind == "self":
                n = align(b * h * lq * lq) + 3 * t * H if backward else b * h * lq * lq
            elif kind == "cross":
                n = align(b * h * lq * ls) + t * H if backward else b * h * lq * ls
            else:
                n = t * max(F_, H) if backward else 0
            need = max(need, n)
        return need


class KVGradSlots:
    """The [2L, b, h, ls, d] gradient of the stacked cross-attention K/V, filled slice by slice by the
    layers' backward (layer i writes slices 2i and 2i+1) and handed whole to CrossKVFunction."""

    def __init__(self, parts):
        self.parts = parts
        self.shape = self.dtype = self.device = None
        self.buf = None

    def slot(self, index):
        """[2, b·h, ls, d] view for layer ``index`` (dK, dV)."""
        if self.buf is None:
            self.buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        parts, b, h, ls, d = self.shape
        return self.buf[2 * index:2 * index + 2].view(2, b * h, ls, d)

    def collect(self, grads):
        """The stacked gradient: slices a layer wrote are used as they are; parts that got no
        gradient are zeros; gradients that arrive elsewhere (the K/V also used outside) are copied in."""
        buf = self.buf if self.buf is not None else torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.buf = None
        for i, g in enumerate(grads):
            if g is None:
                buf[i].zero_()
            elif g.data_ptr() != buf[i].data_ptr() or g.stride() != buf[i].stride():
                buf[i].copy_(g)
        return buf


# ---- cores: forward (u → c, state) and backward (dc → du in scratch, grads) -------------------------
def _self_fwd(u, prm, spec, flat, ins):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    b, l, H, h, d = spec.b, spec.lq, spec.H, spec.heads, spec.d
    qkv5 = P.split_fwd(torch.mm(u, W_in.t()).view(b, l, 3 * H), b_in, h, 3, spec.k)
    q3, k3, v3 = (qkv5[i].view(b * h, l, d) for i in range(3))
    scores = region(flat, 0, (b * h, l, l))
    torch.baddbmm(scores, q3, k3.transpose(1, 2), beta=0.0, alpha=spec.scale, out=scores)
    probs, sst = P.softmax_fwd(scores.view(b, h, l, l), ins["kpm"], spec.causal, spec.p_attn, spec.k)
    ctx = torch.bmm(probs.view(b * h, l, l), v3)
    ctxm = P.merge_fwd(ctx.view(b, h, l, d), spec.k).view(b * l, H)
    if spec.recompute:
        sst = P.without(sst, "sm", "probs")
    return torch.mm(ctxm, W_out.t()), {"u": u, "qkv5": qkv5, "ctxm": ctxm, "softmax": sst, "kpm": ins["kpm"]}


def _softmax_state(st, q3, k3, shape, kpm, causal, spec, flat):
    """The forward's softmax state with "sm"/"probs": as saved, or recomputed — QKᵀ into scratch [0, S),
    then the softmax forward again with the saved dropout ``rng`` or mask, so the same probabilities
    come back."""
    sst = st["softmax"]
    if "sm" in sst:
        return sst
    bh, lq, lk = q3.shape[0], q3.shape[1], k3.shape[1]
    scores = region(flat, 0, (bh, lq, lk))
    torch.baddbmm(scores, q3, k3.transpose(1, 2), beta=0.0, alpha=spec.scale, out=scores)
    return P.softmax_fwd(scores.view(shape), kpm, causal, sst["p"], spec.k, replay=sst)[1]


def _self_bwd(dc, prm, st, spec, flat):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    b, l, H, h, d = spec.b, spec.lq, spec.H, spec.heads, spec.d
    t = b * l
    q3, k3, v3 = (st["qkv5"][i].view(b * h, l, d) for i in range(3))
    sst = _softmax_state(st, q3, k3, (b, h, l, l), st["kpm"], spec.causal, spec, flat)
    dW_out = torch.mm(dc.t(), st["ctxm"])
    dctxm = region(flat, 0, (t, H))
    torch.mm(dc, W_out, out=dctxm)
    dctx = P.merge_bwd(dctxm.view(b, l, H), h, spec.k).view(b * h, l, d)
    dprobs = region(flat, 0, (b * h, l, l))
    torch.bmm(dctx, v3.transpose(1, 2), out=dprobs)
    dqkv5 = region(flat, align(b * h * l * l), (3, b * h, l, d))
    dq, dk, dv = dqkv5[0], dqkv5[1], dqkv5[2]
    torch.bmm(P.softmax_probs(sst).view(b * h, l, l).transpose(1, 2), dctx, out=dv)
    ds = P.softmax_bwd_(dprobs.view(b, h, l, l), sst, spec.k).view(b * h, l, l)
    del sst
    torch.baddbmm(dq, ds, k3, beta=0.0, alpha=spec.scale, out=dq)
    torch.baddbmm(dk, ds.transpose(1, 2), q3, beta=0.0, alpha=spec.scale, out=dk)
    dqkv, db_in = P.split_bwd(dqkv5.view(3, b, h, l, d), b_in, spec.k)
    dqkv = dqkv.view(t, 3 * H)
    dW_in = torch.mm(dqkv.t(), st["u"])
    du = region(flat, 0, (t, H))
    torch.mm(dqkv, W_in, out=du)
    return du, dW_in, db_in, dW_out


def _cross_fwd(u, prm, spec, flat, ins):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    b, lt, ls, H, h, d = spec.b, spec.lq, spec.ls, spec.H, spec.heads, spec.d
    q5 = P.split_fwd(torch.mm(u, W_in.t()).view(b, lt, H), b_in, h, 1, spec.k)
    k_enc, v_enc = ins["k_enc"], ins["v_enc"]
    scores = region(flat, 0, (b * h, lt, ls))
    torch.baddbmm(scores, q5.view(b * h, lt, d), k_enc.reshape(b * h, ls, d).transpose(1, 2), beta=0.0,
                  alpha=spec.scale, out=scores)
    probs, sst = P.softmax_fwd(scores.view(b, h, lt, ls), ins["enc_kpm"], False, spec.p_attn, spec.k)
    ctx = torch.bmm(probs.view(b * h, lt, ls), v_enc.reshape(b * h, ls, d))
    ctxm = P.merge_fwd(ctx.view(b, h, lt, d), spec.k).view(b * lt, H)
    if spec.recompute:
        sst = P.without(sst, "sm", "probs")
    return torch.mm(ctxm, W_out.t()), {"u": u, "q5": q5, "k": k_enc, "v": v_enc, "ctxm": ctxm, "softmax": sst,
                                       "kpm": ins["enc_kpm"]}


def _cross_bwd(dc, prm, st, spec, flat):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    b, lt, ls, H, h, d = spec.b, spec.lq, spec.ls, spec.H, spec.heads, spec.d
    t = b * lt
    q3 = st["q5"].view(b * h, lt, d)
    k3, v3 = st["k"].reshape(b * h, ls, d), st["v"].reshape(b * h, ls, d)
    sst = _softmax_state(st, q3, k3, (b, h, lt, ls), st["kpm"], False, spec, flat)
    dW_out = torch.mm(dc.t(), st["ctxm"])
    dctxm = region(flat, 0, (t, H))
    torch.mm(dc, W_out, out=dctxm)
    dctx = P.merge_bwd(dctxm.view(b, lt, H), h, spec.k).view(b * h, lt, d)
    dprobs = region(flat, 0, (b * h, lt, ls))
    torch.bmm(dctx, v3.transpose(1, 2), out=dprobs)
    dkv = spec.slots.slot(spec.index)
    dk, dv = dkv[0], dkv[1]
    torch.bmm(P.softmax_probs(sst).view(b * h, lt, ls).transpose(1, 2), dctx, out=dv)
    ds = P.softmax_bwd_(dprobs.view(b, h, lt, ls), sst, spec.k).view(b * h, lt, ls)
    del sst
    dq5 = region(flat, align(b * h * lt * ls), (1, b, h, lt, d))
    dq = dq5.view(b * h, lt, d)
    torch.baddbmm(dq, ds, k3, beta=0.0, alpha=spec.scale, out=dq)
    torch.baddbmm(dk, ds.transpose(1, 2), q3, beta=0.0, alpha=spec.scale, out=dk)
    dcq, db_in = P.split_bwd(dq5, b_in, spec.k)
    dcq = dcq.view(t, H)
    dW_in = torch.mm(dcq.t(), st["u"])
    du = region(flat, 0, (t, H))
    torch.mm(dcq, W_in, out=du)
    return du, dW_in, db_in, dW_out


def _ffn_fwd(u, prm, spec, flat, ins):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    a, ast = P.bad_fwd(torch.mm(u, W_in.t()), b_in, spec.act, spec.p_act, spec.k)
    return torch.mm(a, W_out.t()), {"u": u, "a": None if spec.recompute else a, "act": ast}


def _ffn_bwd(dc, prm, st, spec, flat):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    t = dc.shape[0]
    a = st["a"]
    if a is None:  # recompute the activation from its saved input, same dropout mask
        a = P.bad_fwd(st["act"]["x"], b_in, spec.act, st["act"]["p"], spec.k, replay=st["act"])[0]
    dW_out = torch.mm(dc.t(), a)
    del a
    da = region(flat, 0, (t, spec.F))
    torch.mm(dc, W_out, out=da)
    dh, db_in = P.bad_bwd(da, b_in, spec.act, st["act"], spec.k)
    dW_in = torch.mm(dh.t(), st["u"])
    du = region(flat, 0, (t, spec.H))
    torch.mm(dh, W_in, out=du)
    return du, dW_in, db_in, dW_out


_CORES = {"self": (_self_fwd, _self_bwd), "cross": (_cross_fwd, _cross_bwd), "ffn": (_ffn_fwd, _ffn_bwd)}


# ---- sub-block: LayerNorm + core + bias/dropout/residual --------------------------------------------
def _block_fwd(kind, r, prm, spec, flat, ins):
    b_out, ln_w, ln_b = prm[3], prm[4], prm[5]
    core = _CORES[kind][0]
    if spec.pre_ln:
        u, lnst = P.ln_fwd(r, ln_w, ln_b, spec.eps, spec.k)
        c, cst = core(u, prm, spec, flat, ins)
        out, bst = P.bdr_fwd(c, b_out, r, spec.p_drop, spec.k)
        if spec.recompute:  # backward recomputes LN(r) from the saved r
            cst["u"] = None
    else:
        c, cst = core(r, prm, spec, flat, ins)
        s, bst = P.bdr_fwd(c, b_out, r, spec.p_drop, spec.k)
        out, lnst = P.ln_fwd(s, ln_w, ln_b, spec.eps, spec.k)
    return out, {"ln": lnst, "core": cst, "bdr": bst}


def _block_bwd(kind, g, prm, st, spec, flat):
    """g: gradient of the block output (not modified). Returns (fresh gradient of the block input,
    the six parameter gradients)."""
    b_out, ln_w, ln_b = prm[3], prm[4], prm[5]
    core = _CORES[kind][1]
    if spec.pre_ln:
        cst = st["core"]
        if cst["u"] is None:
            cst = dict(cst, u=P.ln_fwd(st["ln"]["x"], ln_w, ln_b, spec.eps, spec.k)[0])
        dc, db_out = P.bdr_bwd(g, b_out, st["bdr"], spec.k)
        du, dW_in, db_in, dW_out = core(dc, prm, cst, spec, flat)
        del cst
        dr, dln_w, dln_b = P.ln_bwd(du, ln_w, ln_b, spec.eps, st["ln"], spec.k)
        dr.add_(g)  # the residual path
    else:
        dr, dln_w, dln_b = P.ln_bwd(g, ln_w, ln_b, spec.eps, st["ln"], spec.k)
        # without dropout dc IS dr; the core has finished reading it before dr is updated below
        dc, db_out = P.bdr_bwd(dr, b_out, st["bdr"], spec.k)
        du, dW_in, db_in, dW_out = core(dc, prm, st["core"], spec, flat)
        dr.add_(du)
    return dr, (dW_in, db_in, dW_out, db_out, dln_w, dln_b)


# ---- saving nested states ----------------------------------------------------------------------------
class _Saved:
    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


def _pack(obj, tensors):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Saved(len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _pack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(v, tensors) for v in obj)
    return obj


def _unpack(obj, tensors):
    if isinstance(obj, _Saved):
        return tensors[obj.i]
    if isinstance(obj, dict):
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v, tensors) for v in obj)
    return obj


class LayerFunction(torch.autograd.Function):
    """apply(spec, x, kpm, k_enc, v_enc, enc_kpm, *params) → y, all [b, l, H]; 6 params per block.

    x contiguous; params already in x's dtype (GEMM weights) or float32/x's dtype (biases, LayerNorm).
    k_enc/v_enc [b, heads, ls, d] and enc_kpm only for layers with a "cross" block.
    """

    @staticmethod
    def forward(ctx, spec, x, kpm, k_enc, v_enc, enc_kpm, *params):
        b, l, H = x.shape
        spec.b, spec.lq = b, l
        spec.ls = 0 if k_enc is None else k_enc.shape[2]
        need = spec.scratch_numel(backward=False)
        if any(ctx.needs_input_grad):  # training: size the arena for the backward now, in one growth
            need = max(need, spec.scratch_numel(backward=True))
        flat = get_arena(x.device, x.dtype).take(need)
        ins = {"kpm": kpm, "k_enc": k_enc, "v_enc": v_enc, "enc_kpm": enc_kpm}
        r = x.view(b * l, H)
        states = []
        for i, kind in enumerate(spec.kinds):
            r, st = _block_fwd(kind, r, params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)], spec, flat, ins)
            states.append(st)
        tensors = []
        ctx.packed = _pack(states, tensors)
        ctx.n_state = len(tensors)
        ctx.spec = spec
        ctx.save_for_backward(*tensors, *params)
        return r.view(b, l, H)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        saved = ctx.saved_tensors  # first: a checkpointing recompute may use the arena while unpacking
        spec = ctx.spec
        states = _unpack(ctx.packed, saved[:ctx.n_state])
        params = saved[ctx.n_state:]
        b, l, H = spec.b, spec.lq, spec.H
        with torch.autocast(grad.device.type, enabled=False):
            flat = get_arena(grad.device, grad.dtype).take(spec.scratch_numel(backward=True))
            g = grad.contiguous().view(b * l, H)
            pgrads = [None] * len(params)
            for i in reversed(range(len(spec.kinds))):
                sl = slice(PARAMS_PER_BLOCK * i, PARAMS_PER_BLOCK * (i + 1))
                g, pgrads[sl] = _block_bwd(spec.kinds[i], g, params[sl], states[i], spec, flat)
        dk = dv = None
        if "cross" in spec.kinds:
            dkv = spec.slots.slot(spec.index)
            hd = (b, spec.heads, spec.ls, spec.d)
            dk, dv = dkv[0].view(hd), dkv[1].view(hd)
        return (None, g.view(b, l, H), None, dk, dv, None, *pgrads)


class CrossKVFunction(torch.autograd.Function):
    """apply(enc, weight [P·H, H], bias [P·H], heads, slots, kernels) → P tensors [b, heads, ls, d]:
    one GEMM over the encoder output and one split_heads for the K/V of every decoder layer."""

    @staticmethod
    def forward(ctx, enc, weight, bias, heads, slots, kernels):
        b, ls, H = enc.shape
        e2d = enc.reshape(b * ls, H)
        kv5 = P.split_fwd(torch.mm(e2d, weight.t()).view(b, ls, weight.shape[0]), bias, heads, slots.parts, kernels)
        slots.shape, slots.dtype, slots.device = kv5.shape, kv5.dtype, kv5.device
        ctx.save_for_backward(e2d, weight, bias)
        ctx.slots, ctx.k, ctx.enc_shape = slots, kernels, enc.shape
        ctx.set_materialize_grads(False)
        return kv5.unbind(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        e2d, weight, bias = ctx.saved_tensors
        if all(g is None for g in grads):
            return None, None, None, None, None, None
        with torch.autocast(e2d.device.type, enabled=False):
            g5 = ctx.slots.collect(grads)
            dkv, dbias = P.split_bwd(g5, bias, ctx.k)
            del g5
            dkv = dkv.view(e2d.shape[0], weight.shape[0])
            denc = torch.mm(dkv, weight).view(ctx.enc_shape) if ctx.needs_input_grad[0] else None
            dweight = torch.mm(dkv.t(), e2d) if ctx.needs_input_grad[1] else None
        return denc, dweight, dbias, None, None, None


# ---- incremental decoding: the same math through the functional ops (inference, no arena) ------------
def project_kv(enc, weight, bias, heads, parts):
    """The P K/V tensors [b, heads, ls, d] of CrossKVFunction, through the functional ops."""
    return split_heads(F.linear(enc, weight), bias, heads, parts)


def _attend(q, k, v, kpm, causal, W_out, spec):
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    probs = attention_softmax(scores, kpm, causal, spec.p_attn, spec.training)
    return F.linear(merge_heads(torch.matmul(probs, v)), W_out)


def incremental_layer(spec, x, params, kpm, enc_kv, enc_kpm, cache):
    """x [b, n, H]: the n newest positions. Self-attention keys/values are appended to cache["k"/"v"]
    ([b, heads, t, d]); kpm (if any) covers all t keys; the new queries see keys causally
    (bottom-right aligned: the last query sees every key)."""
    r = x
    for i, kind in enumerate(spec.kinds):
        W_in, b_in, W_out, b_out, ln_w, ln_b = params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)]
        u = layer_norm(r, ln_w, ln_b, spec.eps) if spec.pre_ln else r
        if kind == "self":
            q, k, v = split_heads(F.linear(u, W_in), b_in, spec.heads, 3)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            c = _attend(q, k, v, kpm, True, W_out, spec)
        elif kind == "cross":
            (q,) = split_heads(F.linear(u, W_in), b_in, spec.heads, 1)
            c = _attend(q, enc_kv[0], enc_kv[1], enc_kpm, False, W_out, spec)
        else:
            h = bias_act_dropout(F.linear(u, W_in), b_in, spec.act, spec.p_act, spec.training)
            c = F.linear(h, W_out)
        s = bias_dropout_residual(c, b_out, r, spec.p_drop, spec.training)
        r = s if spec.pre_ln else layer_norm(s, ln_w, ln_b, spec.eps)
    return r
