"""The reference layer: a whole layer's forward as plain differentiable PyTorch, built from the ops'
references (``lsmini.ops.<op>_ref``); autograd derives its backward. It is the one other implementation of
a layer beside the kernel path (csrc/layers/layer.cpp): it runs where the kernels do not (CPU, float32,
head dims the fused attention lacks, ``lsmini.config.reference``), it is what incremental decoding runs
(with a KV cache), torch.compile traces it like any PyTorch code, and the tests compare the kernel path
against it.

Blocks and parameters as spec.py describes them:

    pre-norm:  r ← r + dropout(core(norm(r)) + bias_out)     post-norm:  r ← norm(r + dropout(core(r) + bias_out))
    norm:   LayerNorm (weight, bias) or RMSNorm (weight), options.norm
    self:   [Q | K | V] = x·weight_inᵀ + bias_in (heads, kv_heads, kv_heads heads) → QK-norm (qk_norm) →
            rotary on Q and K (rotary_dim) → attention, query head h on K/V head h // (heads / kv_heads)
            → ·weight_outᵀ
    cross:  Q = x·weight_inᵀ + bias_in, K/V given ([b, ls, kv_heads·d]) → attention → ·weight_outᵀ
    ffn:    dropout(act(x·weight_inᵀ + bias_in)) → ·weight_outᵀ; gated (swiglu, geglu):
            [gate | up] = x·weight_inᵀ + bias_in → dropout(act(gate)·up) → ·weight_outᵀ
Any bias may be None (absent).

Incremental decoding (``cache``, a dict): x holds the newest positions; the self-attention block appends
its keys and values (after QK-norm and rotary) to ``cache["k"/"v"]`` ([b, kv_heads, t, d]; a layer has one
self-attention block) and its queries attend causally, bottom-right aligned (the last query sees every
key); ``key_padding_mask`` covers all t keys; the rotary tables are those of the new positions.
"""
import torch
import torch.nn.functional as F

from lsmini.layers.spec import GATED, PARAMS_PER_BLOCK
from lsmini.ops.attention import attention_ref
from lsmini.ops.bias_act_dropout import bias_act_dropout_ref
from lsmini.ops.bias_dropout_residual import bias_dropout_residual_ref
from lsmini.ops.glu import glu_ref
from lsmini.ops.layernorm import layer_norm_ref
from lsmini.ops.rms_norm import rms_norm_ref
from lsmini.ops.rotary import rotary_ref


def heads(t, count):
    """[b, l, count·d] → the [b, count, l, d] view."""
    b, l, width = t.shape
    return t.view(b, l, count, width // count).transpose(1, 2)


def _norm(o, x, weight, bias):
    if o.norm == "rms_norm":
        return rms_norm_ref(x, weight, o.eps)
    return layer_norm_ref(x, weight, bias, o.eps)


def _ffn(x, w_in, b_in, w_out, o):
    h = F.linear(x, w_in)
    if o.activation in GATED:
        dt = torch.promote_types(h.dtype, torch.float32)
        h = h.to(dt) if b_in is None else h.to(dt) + b_in.to(dt)  # the bias add in fp32, rounded once by glu_ref
        hidden = glu_ref(h, None, GATED[o.activation], o.activation_dropout, o.training).to(x.dtype)
    else:
        hidden = bias_act_dropout_ref(h, b_in, o.activation, o.activation_dropout, o.training)
    return F.linear(hidden, w_out)


def _core(kind, x, p, o, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, cache, rotary, qk):
    w_in, b_in, w_out = p[0], p[1], p[2]
    if kind == "ffn":
        return _ffn(x, w_in, b_in, w_out, o)
    projection = F.linear(x, w_in, None if b_in is None else b_in.to(x.dtype))
    d = o.head_dim
    if kind == "self":
        qkv = projection.split([o.heads * d, o.kv_heads * d, o.kv_heads * d], dim=-1)
        q, k, v = heads(qkv[0], o.heads), heads(qkv[1], o.kv_heads), heads(qkv[2], o.kv_heads)
        if o.qk_norm:
            q, k = rms_norm_ref(q, qk[0], o.eps), rms_norm_ref(k, qk[1], o.eps)
        if o.rotary_dim:
            q, k = rotary_ref(q, k, *rotary)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        mask, causal = key_padding_mask, o.causal
    else:
        q, k, v = heads(projection, o.heads), heads(encoder_k, o.kv_heads), heads(encoder_v, o.kv_heads)
        mask, causal = encoder_padding_mask, False
    context = attention_ref(q, k, v, mask, causal, o.attn_dropout, o.training, o.scale)
    b, _, l, _ = context.shape
    return F.linear(context.transpose(1, 2).reshape(b, l, o.heads * d), w_out)


def reference_layer(o, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, cache=None,
                    rotary=None):
    """One layer: x [b, l, H] in the compute dtype → [b, l, H]. params: every block's six parameters
    (spec.BLOCK_PARAMS) with the GEMM weights in x's dtype (precision.cast_block), then with qk_norm the
    Q and K norm weights (spec.QK_NORM_PARAMS); encoder_k/encoder_v [b, ls, kv_heads·head_dim] for a layer
    with a cross block; cache: a dict for incremental decoding (see the module docstring), or None; rotary:
    (cos, sin) [l, rotary_dim] or [b, l, rotary_dim] for x's positions when o.rotary_dim, else None."""
    if o.rotary_dim and rotary is None:
        raise ValueError(f"reference_layer: rotary_dim = {o.rotary_dim} needs the rotary (cos, sin) tables")
    n = PARAMS_PER_BLOCK * len(o.kinds)
    qk = params[n:n + 2]
    r = x
    for i, kind in enumerate(o.kinds):
        p = params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)]
        bias_out, norm_weight, norm_bias = p[3], p[4], p[5]
        u = _norm(o, r, norm_weight, norm_bias) if o.pre_ln else r
        c = _core(kind, u, p, o, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, cache, rotary, qk)
        s = bias_dropout_residual_ref(c, bias_out, r, o.dropout, o.training)
        r = s if o.pre_ln else _norm(o, s, norm_weight, norm_bias)
    return r
