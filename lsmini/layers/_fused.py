"""The fused Transformer layer: forward and a hand-written backward, one autograd Function per layer.

A layer is a list of sub-blocks ("self" attention, "cross" attention, "ffn"), each with the same six
parameters (W_in, b_in, W_out, b_out, ln_w, ln_b):

    self:   W_in = fused QKV [3H, H]     W_out = attention output [H, H]
    cross:  W_in = query     [H, H]     (K/V come from CrossKVFunction, see below)
    ffn:    W_in = [F, H]               (b_in added by bias_act_dropout) W_out = [H, F]
    b_out is added by bias_dropout_residual; ln_w/ln_b is the sub-block's LayerNorm.

    pre-LN:  r ← r + dropout(core(LN(r)) + b_out)          post-LN:  r ← LN(r + dropout(core(r) + b_out))

Attention core: the input projection with its bias in the GEMM (addmm), then the fused attention kernel
(lsmini.ops.attention: QKᵀ, masks, softmax, dropout and ·V without writing the [len, len] scores)
reading Q/K/V as per-head views of the projection output and writing the context in the merged
[tokens, H] layout, then the output GEMM. fp32 and head dims the kernel lacks run attention_ref instead
(its backward by autograd, its dropout mask kept). FFN core: GEMM, bias_act_dropout, GEMM.

Saved for backward (spec.recompute, the default): each block's input, the Q/K/V projection, the attention
context and its per-row log-sum-exp, the first FFN GEMM's output, LayerNorm statistics, each dropout's
Philox state ``rng``; backward recomputes the FFN activation (bias_act_dropout forward again, same
mask) and, for pre-LN, the LayerNorm outputs. spec.recompute = False saves those instead. With relu
the FFN keeps its activation instead of the GEMM output either way (same size): relu's derivative and
the dropout mask can be read off it, so there is nothing to recompute. Under CUDA graph capture
``rng`` holds device pointers that each replay refills, so forward, recompute and backward of one
replay share one mask and every replay draws a new one.

Backward temporaries are views into the arena of (device, dtype) (``arena.py``), laid out per core:

    self:   [0, TH) d(context), then the recomputed pre-LN input, then d(core input);
            [TH', TH' + 3TH) d(core output) (dc: bias_dropout_residual's input gradient), then
            d(QKV projection) (TH' = TH aligned)
    cross:  [0, TH) as above; [TH', TH' + TH) dc, then d(Q projection). dK/dV go to KVGradSlots.
    ffn:    [0, TF) the recomputed activation (not with relu), then its gradient, then (in place)
            d(first GEMM output); its [t, H] temporaries are fresh (see _ffn_bwd).

Regions overlap only where one is dead before the other is written (stream order). Everything that
backward returns is a fresh tensor: the input gradient comes out of a LayerNorm backward plus the
residual branch's gradient (pre-LN: added inside the LayerNorm backward, written into the gradient the
block above produced once that is backward's own tensor; post-LN: an in-place add).

Cross-attention of a decoder stack: CrossKVFunction projects the encoder output with the K/V weights
of ALL layers at once ([b·ls, H] × [H, L·2H], one GEMM) and hands each layer its K and V as views. In
backward each layer's attention writes its dK/dV straight into its columns of one [b·ls, L·2H] buffer
(KVGradSlots), so CrossKVFunction gets the stacked gradient without a copy and runs one GEMM for
d(encoder output) and one for d(weight).
"""
import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from lsmini.layers import _prims as P
from lsmini.layers._common import PARAMS_PER_BLOCK, cast_block, cast_blocks_batched
from lsmini.layers.arena import align, get_arena, region
from lsmini.ops.attention_softmax import attention_softmax
from lsmini.ops.bias_act_dropout import bias_act_dropout
from lsmini.ops.bias_dropout_residual import bias_dropout_residual
from lsmini.ops.attention import fused_attention_supported
from lsmini.ops.heads import merge_heads, split_heads
from lsmini.ops.layernorm import layer_norm


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
        self.fused = False  # flash-attention kernel: set by forward from the compute dtype

    def scratch_numel(self, backward):
        """Arena elements one backward needs (see the module docstring); forward needs none."""
        if not backward:
            return 0
        t, H = self.b * self.lq, self.H
        parts = {"self": 3, "cross": 1}
        return max(align(t * H) + parts[k] * t * H if k in parts else t * self.F for k in self.kinds)


class KVGradSlots:
    """The [b·ls, L·2H] gradient of the stacked cross-attention K/V projection, filled slice by slice by the
    layers' backward (layer i writes parts 2i and 2i+1) and handed whole to CrossKVFunction."""

    def __init__(self, parts):
        self.parts = parts
        self.dims = self.dtype = self.device = None  # (b, ls, heads, d), set by CrossKVFunction.forward
        self.buf = None

    def _views(self, buf):
        return heads_of(buf, *self.dims[:2], self.parts, *self.dims[2:])

    def slot(self, index):
        """(dK, dV) [b, heads, ls, d] views for layer ``index``."""
        if self.buf is None:
            b, ls, h, d = self.dims
            self.buf = torch.empty(b * ls, self.parts * h * d, dtype=self.dtype, device=self.device)
        views = self._views(self.buf)
        return views[2 * index], views[2 * index + 1]

    def collect(self, grads):
        """The stacked gradient: parts a layer wrote are used as they are; parts that got no gradient are
        zeros; gradients that arrive elsewhere (the K/V also used outside) are copied in."""
        if self.buf is None:
            self.slot(0)
        buf, self.buf = self.buf, None
        for view, g in zip(self._views(buf), grads):
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
                view.copy_(g)
        return buf


def heads_of(x2d, b, l, parts, h, d):
    """The ``parts`` [b, h, l, d] views of a projection output x2d [b·l, parts·h·d] (columns part-major,
    then head): what the attention kernel reads and its gradients are written into, no copies."""
    return x2d.view(b, l, parts, h, d).permute(2, 0, 3, 1, 4).unbind(0)


# ---- cores: forward (u → c, state) and backward (dc → du in scratch, grads) -------------------------
def _proj(u, W, bias):
    """u·Wᵀ + bias in one GEMM (the bias in the GEMM's epilogue)."""
    return torch.addmm(bias.to(u.dtype), u, W.t())


def _wgrad(a, b, dtype):
    """a·b, a weight gradient, in the parameter's dtype: with fp16/bf16 operands and float32 parameters
    (autocast) the GEMM writes float32 itself on CUDA, instead of a half-precision result plus a cast pass."""
    if dtype == torch.float32 and a.dtype != dtype and a.is_cuda:
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a, b).to(dtype)


def _attn_block_fwd(u, q, k, v, kpm, causal, W_out, spec):
    ctxm, ast = P.attn_fwd(q, k, v, kpm, causal, spec.p_attn, spec.scale, spec.fused)
    ctxm = ctxm.view(u.shape[0], spec.H)
    return torch.mm(ctxm, W_out.t()), {"u": u, "attn": ast, "ctxm": ctxm}


def _self_fwd(u, prm, spec, flat, ins):
    q, k, v = heads_of(_proj(u, prm[0], prm[1]), spec.b, spec.lq, 3, spec.heads, spec.d)
    return _attn_block_fwd(u, q, k, v, ins["kpm"], spec.causal, prm[2], spec)


def _cross_fwd(u, prm, spec, flat, ins):
    (q,) = heads_of(_proj(u, prm[0], prm[1]), spec.b, spec.lq, 1, spec.heads, spec.d)
    return _attn_block_fwd(u, q, ins["k_enc"], ins["v_enc"], ins["enc_kpm"], False, prm[2], spec)


def _attn_block_bwd(dc, prm, st, spec, flat, u_of, parts, kv_grads):
    """Backward of an attention block whose input projection has ``parts`` parts (3: QKV, 1: Q). The
    projection's gradient [t, parts·H] lives in scratch after d(context); kv_grads: where dK/dV go
    (None: the projection's own K/V parts). u_of(out): the core's input (recomputed into out, or saved)."""
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    t, H = dc.shape[0], spec.H
    dW_out = _wgrad(dc.t(), st["ctxm"], spec.wdtype)
    dctxm = region(flat, 0, (t, H))
    torch.mm(dc, W_out, out=dctxm)
    dproj = region(flat, align(t * H), (t, parts * H))
    views = heads_of(dproj, spec.b, spec.lq, parts, spec.heads, spec.d)
    dq, dk, dv = views if kv_grads is None else (views[0], *kv_grads)
    P.attn_bwd(dctxm, st["attn"], dq, dk, dv, spec.fused)
    db_in = P.bias_grad(dproj, b_in.dtype, spec.k)
    dW_in = _wgrad(dproj.t(), u_of(region(flat, 0, (t, H))), spec.wdtype)  # d(context) is dead
    du = region(flat, 0, (t, H))  # so is a recomputed input, once dW_in's GEMM has read it
    torch.mm(dproj, W_in, out=du)
    return du, dW_in, db_in, dW_out


def _self_bwd(dc, prm, st, spec, flat, u_of):
    return _attn_block_bwd(dc, prm, st, spec, flat, u_of, 3, None)


def _cross_bwd(dc, prm, st, spec, flat, u_of):
    return _attn_block_bwd(dc, prm, st, spec, flat, u_of, 1, spec.slots.slot(spec.index))


def _ffn_fwd(u, prm, spec, flat, ins):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    a, ast = P.bad_fwd(torch.mm(u, W_in.t()), b_in, spec.act, spec.p_act, spec.k)
    if spec.act == "relu":  # relu's derivative is read off its output: keep that, not the GEMM output
        ast, keep_a = {"y": a, "p": ast["p"]}, None
    else:
        keep_a = None if spec.recompute else a
    return torch.mm(a, W_out.t()), {"u": u, "a": keep_a, "act": ast}


def _ffn_bwd(dc, prm, st, spec, flat, u_of):
    W_in, b_in, W_out = prm[0], prm[1], prm[2]
    t = dc.shape[0]
    # The arena holds the activation (recomputed, unless kept), then its gradient, then — in place — the
    # gradient of the first GEMM's output: each is dead before the next is written (stream order). The
    # [t, H] temporaries are fresh: that keeps the arena at t·F, and they are freed before the attention
    # blocks' backward, where a layer's memory peaks.
    act = region(flat, 0, (t, spec.F))
    a = st["act"]["y"] if "y" in st["act"] else st["a"]
    if a is None:  # recompute the activation from its saved input, same dropout mask
        a = P.bad_fwd(st["act"]["x"], b_in, spec.act, st["act"]["p"], spec.k, replay=st["act"], out=act)[0]
    dW_out = _wgrad(dc.t(), a, spec.wdtype)
    del a
    torch.mm(dc, W_out, out=act)
    dh, db_in = P.bad_bwd(act, b_in, spec.act, st["act"], spec.k, out=act)
    dW_in = _wgrad(dh.t(), u_of(None), spec.wdtype)
    return torch.mm(dh, W_in), dW_in, db_in, dW_out


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


def _block_bwd(kind, g, prm, st, spec, flat, own_g):
    """g: gradient of the block output; own_g: g is this backward's own tensor, which may become the
    result (else it is not modified). Returns (the gradient of the block input — g itself or a fresh
    tensor —, the six parameter gradients)."""
    b_out, ln_w, ln_b = prm[3], prm[4], prm[5]
    core = _CORES[kind][1]
    cst = st["core"]
    # An attention core's dc goes into its projection-gradient region, not written before dc is dead.
    dc_out = None if kind == "ffn" else region(flat, align(g.shape[0] * spec.H), g.shape)
    if spec.pre_ln:
        def u_of(out):  # the core's input: saved, or LN(block input) recomputed when the core needs it
            u = cst["u"]
            return P.ln_fwd(st["ln"]["x"], ln_w, ln_b, spec.eps, spec.k, out=out)[0] if u is None else u

        dc, db_out = P.bdr_bwd(g, b_out, st["bdr"], spec.k, out=dc_out)
        du, dW_in, db_in, dW_out = core(dc, prm, cst, spec, flat, u_of)
        # the residual path: g added to LN's input gradient in the same kernel, into g when it is ours
        dr, dln_w, dln_b = P.ln_bwd(du, ln_w, ln_b, spec.eps, st["ln"], spec.k, add=g, out=g if own_g else None)
    else:
        dr, dln_w, dln_b = P.ln_bwd(g, ln_w, ln_b, spec.eps, st["ln"], spec.k)
        # without dropout dc IS dr; the core has finished reading it before dr is updated below
        dc, db_out = P.bdr_bwd(dr, b_out, st["bdr"], spec.k, out=dc_out)
        du, dW_in, db_in, dW_out = core(dc, prm, cst, spec, flat, lambda out: cst["u"])
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

    x contiguous, in the compute dtype; params as the module holds them (e.g. float32 under autocast):
    forward casts the GEMM weights itself and backward returns every gradient in its parameter's dtype —
    the weight gradients straight out of their GEMMs (``_wgrad``), so no cast pass runs either way.
    k_enc/v_enc [b, heads, ls, d] and enc_kpm only for layers with a "cross" block.
    """

    @staticmethod
    def forward(ctx, spec, x, kpm, k_enc, v_enc, enc_kpm, *params):
        b, l, H = x.shape
        spec.b, spec.lq = b, l
        spec.ls = 0 if k_enc is None else k_enc.shape[2]
        spec.fused = spec.k and fused_attention_supported(x.dtype, spec.d)
        spec.wdtype = params[0].dtype
        ctx.param_dtypes = [p.dtype for p in params]
        params = cast_blocks_batched(params, x.dtype)  # as the kernels and GEMMs take them
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
                own = i < len(spec.kinds) - 1  # the incoming gradient is autograd's, the others ours
                g, pgrads[sl] = _block_bwd(spec.kinds[i], g, params[sl], states[i], spec, flat, own)
            pgrads = [g_.to(dt) for g_, dt in zip(pgrads, ctx.param_dtypes)]  # no-ops but for mixed dtypes
        dk = dv = None
        if "cross" in spec.kinds:
            dk, dv = spec.slots.slot(spec.index)
        return (None, g.view(b, l, H), None, dk, dv, None, *pgrads)


class CrossKVFunction(torch.autograd.Function):
    """apply(enc, weight [P·H, H], bias [P·H], heads, slots, kernels) → P views [b, heads, ls, d] of ONE
    [b·ls, P·H] GEMM over the encoder output: the K/V of every decoder layer. weight/bias as the module
    holds them (cast here, gradients in their dtypes, as LayerFunction)."""

    @staticmethod
    def forward(ctx, enc, weight, bias, heads, slots, kernels):
        b, ls, H = enc.shape
        e2d = enc.reshape(b * ls, H)
        w, bias_c = cast_block((weight, bias), enc.dtype)
        kv = _proj(e2d, w, bias_c)
        slots.dims, slots.dtype, slots.device = (b, ls, heads, H // heads), kv.dtype, kv.device
        ctx.save_for_backward(e2d, w)
        ctx.dtypes = weight.dtype, bias.dtype, bias_c.dtype
        ctx.slots, ctx.k, ctx.enc_shape = slots, kernels, enc.shape
        ctx.set_materialize_grads(False)
        return heads_of(kv, b, ls, slots.parts, heads, H // heads)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        e2d, w = ctx.saved_tensors
        if all(g is None for g in grads):
            return None, None, None, None, None, None
        w_dtype, b_dtype, bc_dtype = ctx.dtypes
        with torch.autocast(e2d.device.type, enabled=False):
            dkv = ctx.slots.collect(grads)
            dbias = P.bias_grad(dkv, bc_dtype, ctx.k).to(b_dtype)
            denc = torch.mm(dkv, w).view(ctx.enc_shape) if ctx.needs_input_grad[0] else None
            dweight = _wgrad(dkv.t(), e2d, w_dtype) if ctx.needs_input_grad[1] else None
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
