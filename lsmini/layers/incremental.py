"""Incremental decoding (inference): a layer's blocks on the newest positions only, with past self-attention
keys/values and the encoder K/V kept in a cache dict, and the reordering of such caches for beam search.

The same math as the fused layer (blocks.py), through the public functional ops: no saved state, no arena.
"""
import torch
import torch.nn.functional as F

from lsmini.layers.spec import PARAMS_PER_BLOCK
from lsmini.ops.attention_softmax import attention_softmax
from lsmini.ops.bias_act_dropout import bias_act_dropout
from lsmini.ops.bias_dropout_residual import bias_dropout_residual
from lsmini.ops.heads import merge_heads, split_heads
from lsmini.ops.layernorm import layer_norm


def project_kv(enc, weight, bias, heads, parts):
    """The ``parts`` K/V tensors [b, heads, ls, d] of a decoder stack (as CrossKVFunction computes them)."""
    return split_heads(F.linear(enc, weight), bias, heads, parts)


def _attend(q, k, v, key_padding_mask, causal, weight_out, options):
    scores = torch.matmul(q, k.transpose(-1, -2)) * options.scale
    probs = attention_softmax(scores, key_padding_mask, causal, options.attn_dropout, options.training)
    return F.linear(merge_heads(torch.matmul(probs, v)), weight_out)


def incremental_layer(options, x, params, key_padding_mask, encoder_kv, encoder_padding_mask, cache):
    """x [b, n, H]: the n newest positions. Self-attention keys/values are appended to cache["k"/"v"]
    ([b, heads, t, d]); key_padding_mask (if any) covers all t keys; the new queries see keys causally
    (bottom-right aligned: the last query sees every key). params: the blocks' parameters, already in the
    compute dtype (precision.cast_block)."""
    r = x
    for i, kind in enumerate(options.kinds):
        weight_in, bias_in, weight_out, bias_out, norm_weight, norm_bias = \
            params[PARAMS_PER_BLOCK * i:PARAMS_PER_BLOCK * (i + 1)]
        u = layer_norm(r, norm_weight, norm_bias, options.eps) if options.pre_ln else r
        if kind == "self":
            q, k, v = split_heads(F.linear(u, weight_in), bias_in, options.heads, 3)
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
            c = _attend(q, k, v, key_padding_mask, True, weight_out, options)
        elif kind == "cross":
            (q,) = split_heads(F.linear(u, weight_in), bias_in, options.heads, 1)
            c = _attend(q, encoder_kv[0], encoder_kv[1], encoder_padding_mask, False, weight_out, options)
        else:
            h = bias_act_dropout(F.linear(u, weight_in), bias_in, options.activation, options.activation_dropout,
                                 options.training)
            c = F.linear(h, weight_out)
        s = bias_dropout_residual(c, bias_out, r, options.dropout, options.training)
        r = s if options.pre_ln else layer_norm(s, norm_weight, norm_bias, options.eps)
    return r


def check_new_order(owner, new_order):
    if not isinstance(new_order, torch.Tensor) or new_order.dtype not in (torch.int64, torch.int32) \
            or new_order.dim() != 1:
        raise TypeError(f"{owner}: new_order must be a 1-D int64 tensor of batch indices, got "
                        f"{getattr(new_order, 'dtype', type(new_order).__name__)} "
                        f"{tuple(getattr(new_order, 'shape', ()))}")


def reorder(obj, new_order):
    """Index dim 0 (batch) of every tensor in a nested cache of dicts/lists/tuples, in place for dicts."""
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, new_order.to(obj.device))
    if isinstance(obj, dict):
        for k in list(obj):
            obj[k] = reorder(obj[k], new_order)
        return obj
    if isinstance(obj, list):
        obj[:] = [reorder(v, new_order) for v in obj]
        return obj
    if isinstance(obj, tuple):
        return tuple(reorder(v, new_order) for v in obj)
    return obj


def reorder_cache(owner, cache, new_order):
    """Reorder/select the batch entries of a cache (beam search): new_order [batch'] indices."""
    check_new_order(f"{owner}.reorder_cache", new_order)
    return reorder(cache, new_order)
