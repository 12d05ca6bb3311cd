"""The reference layer: a whole layer's forward as plain differentiable PyTorch, built from the ops'
references (``lsmini.ops.<op>_ref``); autograd derives its backward. It is the one other implementation of
a layer beside the kernel path (csrc/layers/layer.cpp): it runs where the kernels do not (CPU, float32,
head dims the fused attention lacks, ``lsmini.config.reference``), it is what incremental decoding runs
(with a KV cache), torch.compile traces it like any PyTorch code, and the tests compare the kernel path
against it.

Blocks and parameters as spec.py describes them:

    pre-norm:  r ← r + dropout(core(norm(r)) + bias_out)     post-norm:  r ← norm(r + dropout(core(r) + bias_out))
    self:   QKV = x·weight_inᵀ + bias_in → attention over its heads → ·weight_outᵀ
    cross:  Q = x·weight_inᵀ + bias_in, K/V given ([b, ls, H]) → attention → ·weight_outᵀ
    ffn:    dropout(act(x·weight_inᵀ + bias_in)) → ·weight_outᵀ

Incremental decoding (``cache``, a dict): x holds the newest positions; the self-attention block appends
its keys and values to ``cache["k"/"v"]`` ([b, heads, t, d]; a layer has one self-attention block) and its
queries attend causally, bottom-right aligned (the last query sees every key); ``key_padding_mask`` covers
all t keys.
"""
import torch
import torch.nn.functional as F

from lsmini.layers.spec import PARAMS_PER_BLOCK
from lsmini.ops.attention import attention_ref
from lsmini.ops.bias_act_dropout import bias_act_dropout_ref
from lsmini.ops.bias_dropout_residual import bias_dropout_residual_ref
from lsmini.ops.layernorm import layer_norm_ref


def heads(t, count):
    """[b, l, count·d] → the [b, count, l, d] view."""
    b, l, width = t.shape
    return t.view(b, l, count, width // count).transpose(1, 2)


def _core(kind, x, p, o, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, cache):
    w_in, b_in, w_out = p[0], p[1], p[2]
    if kind == "ffn":
        hidden = bias_act_dropout_ref(F.linear(x, w_in), b_in, o.activation, o.activation_dropout, o.training)
        return F.linear(hidden, w_out)
    projection = F.linear(x, w_in, None if b_in is None else b_in.to(x.dtype))
    if kind == "self":
        q, k, v = (heads(t, o.heads) for t in projection.chunk(3, dim=-1))
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        mask, causal = key_padding_mask, o.causal
    else:
        q, k, v = heads(projection, o.heads), heads(encoder_k, o.heads), heads(encoder_v, o.heads)
        mask, causal = encoder_padding_mask, False
    context = attention_ref(q, k, v, mask, causal, o.attn_dropout, o.training, o.scale)
    b, _, l, _ = context.shape
    return F.linear(context.transpose(1, 2).reshape(b, l, o.hidden), w_out)


def reference_layer(o, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, cache=None):
    """One layer: x [b, l, H] in the compute dtype → [b, l, H]. params: every block's six parameters
    (spec.BLOCK_PARAMS) with the GEMM weights in x's dtype (precision.cast_block); encoder_k/encoder_v
    [b, ls, H] for a layer with a cross block; cache: a dict for incremental decoding (see the module
    docstring), or None."""
    r = x
    for i, kind in enumerate(o.kinds):
        p = params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)]
        bias_out, norm_weight, norm_bias = p[3], p[4], p[5]
        u = layer_norm_ref(r, norm_weight, norm_bias, o.eps) if o.pre_ln else r
        c = _core(kind, u, p, o, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, cache)
        s = bias_dropout_residual_ref(c, bias_out, r, o.dropout, o.training)
        r = s if o.pre_ln else layer_norm_ref(s, norm_weight, norm_bias, o.eps)
    return r
