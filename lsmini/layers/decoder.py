"""Transformer decoder layer and stack on lsmini's layer runtime (runtime.py: the kernel path or the
reference, and the stack's one cross-attention K/V GEMM; base.py: what the decoder shares with the encoder).

A TransformerDecoder holds the cross-attention K/V projections of all its layers as ONE parameter
``cross_attn_kv_weight`` [num_layers·2·W, hidden], W = kv_heads·head_dim (= hidden without grouped K/V;
rows of layer i: K at [2i·W, (2i+1)·W), V at [(2i+1)·W, (2i+2)·W)) with ``cross_attn_kv_bias`` (None with
bias=False): one GEMM over the encoder output gives every layer's K and V, and backward needs one GEMM for
the encoder-output gradient and one for the weight gradient. A standalone TransformerDecoderLayer holds its
own [2W, H] projection instead (``multihead_attn.kv_proj_weight``). Cross-attention has no rotary and no
QK-norm: its queries come from the decoder, its keys from the encoder output.
"""
import torch
from torch import nn

from lsmini.layers.base import (TransformerLayerBase, TransformerStackBase, check_cache, check_mask, check_states,
                                norm_params, rotary_tables)
from lsmini.layers.interop import (check_torch_attention, check_torch_linear_norm, config_from_torch, copy_params,
                                   torch_layer)
from lsmini.layers.params import CrossAttentionParams, uniform_
from lsmini.layers.precision import compute_dtype, no_autocast
from lsmini.layers.runtime import KVGradSlots, cross_kv, kernel_path, run_layer


def _check_encoder(owner, encoder_out, mask, batch, config, ref, cached_kv):
    """Checks encoder_out (may be None once its K/V are cached) and the mask; returns the source length."""
    if encoder_out is None:
        if cached_kv is None:
            raise ValueError(f"{owner}: encoder_out is required (it is optional only once the cache holds the "
                             f"encoder keys/values)")
        ls = cached_kv[0].shape[1]
    else:
        check_states(owner, "encoder_out", encoder_out, config, ref)
        ls = encoder_out.shape[1]
        if encoder_out.shape[0] != batch:
            raise ValueError(f"{owner}: encoder_out has batch {encoder_out.shape[0]} but the decoder input has "
                             f"batch {batch}")
    if cached_kv is not None and (cached_kv[0].shape[0] != batch or cached_kv[0].shape[1] != ls):
        raise ValueError(f"{owner}: the cached encoder keys have batch {cached_kv[0].shape[0]} and length "
                         f"{cached_kv[0].shape[1]}, the call has batch {batch} and length {ls} (reorder_cache the "
                         f"cache when the batch changes)")
    check_mask(owner, "encoder_padding_mask", mask, batch, ls, ref.device)
    return ls


def _check_padding_mask(owner, mask, y, cache):
    """The self-attention padding mask: None, or bool [batch, tgt_len] (True = pad); not with a cache."""
    if mask is not None and cache is not None:
        raise ValueError(f"{owner}: padding_mask is for full-sequence calls; incremental decoding (cache) takes "
                         f"none (every cached position is a real one)")
    check_mask(owner, "padding_mask", mask, y.shape[0], y.shape[1], y.device)


def _encoder_kv(layer, y, encoder_out, weight, bias, parts):
    """The [b, ls, W] K/V of every layer from one GEMM over the encoder output, and the slots their gradient
    is gathered in (eager kernel path; else None and plain PyTorch, whose backward autograd derives)."""
    on_kernels = kernel_path(layer.options(True), y)
    slots = KVGradSlots(parts) if on_kernels and not torch.compiler.is_compiling() else None
    return cross_kv(encoder_out.to(y.dtype).contiguous(), weight, bias, parts, slots), slots


class TransformerDecoderLayer(TransformerLayerBase):
    """One Transformer decoder layer: causal self-attention, cross-attention over the encoder output,
    feed-forward; pre- or post-LayerNorm.

    forward(y [batch, tgt_len, hidden], encoder_out [batch, src_len, hidden], encoder_padding_mask
    [batch, src_len] bool (True = pad) or None, cache=None, padding_mask=None) → [batch, tgt_len, hidden].
    padding_mask [batch, tgt_len] bool (True = pad) masks padded target positions as keys of the causal
    self-attention (right padding needs none: causal attention never looks ahead to it).
    With ``cache`` (a dict, start with {}) it decodes incrementally for inference: y holds only the
    newest position(s); the encoder K/V are computed once and kept in the cache with the past
    self-attention keys/values.

    Parameter names follow torch.nn.TransformerDecoderLayer (self_attn, multihead_attn, linear1/2,
    norm1/2/3), except that the cross-attention's fused in_proj is split into
    ``multihead_attn.q_proj_weight`` [H, H] and ``multihead_attn.kv_proj_weight`` [2W, H], W =
    kv_heads·head_dim (absent when the layer belongs to a TransformerDecoder). ``from_torch`` / ``to_torch``
    convert. The config's options shape the parameters as TransformerEncoderLayer says; the cross-attention
    has grouped K/V heads too, but no rotary and no QK-norm.
    Dtypes and the ``recompute`` attribute as TransformerEncoderLayer.
    """

    KINDS = ("self", "cross", "ffn")

    def __init__(self, config, own_kv=True, device=None, dtype=None):
        super().__init__(config, device, dtype)
        self.multihead_attn = CrossAttentionParams(config.hidden_size, own_kv=own_kv, dropout=config.attn_dropout,
                                                   kv_width=config.kv_heads * config.head_dim, bias=config.bias,
                                                   device=device, dtype=dtype)
        self._add_ffn_and_norms(device, dtype)

    def _attentions(self):
        return self.self_attn, self.multihead_attn

    def blocks(self):
        ca = self.multihead_attn
        cross = (ca.q_proj_weight, ca.q_proj_bias, ca.out_proj.weight, ca.out_proj.bias, *norm_params(self.norm2))
        return [self._self_block(), cross, self._ffn_block()]

    def _run(self, y, padding_mask, encoder_kv, encoder_padding_mask, kv_slots=None, index=0, cache=None,
             rotary=None):
        """The layer once the K/V of the encoder output (and the rotary tables) exist (the decoder stack calls
        it too)."""
        return run_layer(self.options(True), y, padding_mask, encoder_kv[0], encoder_kv[1], encoder_padding_mask,
                         self.layer_params(), kv_slots, index, cache, rotary)

    def forward(self, y, encoder_out, encoder_padding_mask=None, cache=None, padding_mask=None):
        owner = "TransformerDecoderLayer"
        ca = self.multihead_attn
        if not ca.owns_kv:
            raise RuntimeError(f"{owner}: this layer belongs to a TransformerDecoder, which holds its cross-attention "
                               f"K/V projection; run the decoder, or build a standalone layer")
        check_cache(owner, cache)
        w = self.self_attn.in_proj_weight
        past = cache["k"].shape[2] if cache is not None and "k" in cache else 0
        check_states(owner, "y", y, self.config, w, past)
        _check_padding_mask(owner, padding_mask, y, cache)
        cached_kv = cache.get("encoder_kv") if cache is not None else None
        _check_encoder(owner, encoder_out, encoder_padding_mask, y.shape[0], self.config, w, cached_kv)
        dtype = compute_dtype(owner, y, w)
        rotary = rotary_tables(self.config, y.shape[1], past, y.device)
        with no_autocast(y.device.type):
            y = y.to(dtype).contiguous()
            if cache is None:
                kv, slots = _encoder_kv(self, y, encoder_out, ca.kv_proj_weight, ca.kv_proj_bias, 2)
                return self._run(y, padding_mask, kv, encoder_padding_mask, slots, rotary=rotary)
            if cached_kv is None:
                cached_kv = cache["encoder_kv"] = cross_kv(encoder_out.to(dtype), ca.kv_proj_weight, ca.kv_proj_bias, 2)
            return self._run(y, None, cached_kv, encoder_padding_mask, cache=cache, rotary=rotary)

    @classmethod
    def from_torch(cls, layer, max_batch_tokens=8192, max_seq_len=512):
        """A layer computing the same function as ``layer`` (a torch.nn.TransformerDecoderLayer called with a
        causal tgt_mask and memory_key_padding_mask), weights copied, on its device and dtype. Dropouts map
        as: dropout1 → dropout, self_attn.dropout → attn_dropout, the FFN's inner dropout →
        activation_dropout. lsmini layers are batch-first."""
        if not isinstance(layer, nn.TransformerDecoderLayer):
            raise TypeError(f"from_torch: expected torch.nn.TransformerDecoderLayer, got {type(layer).__name__}")
        sa, mha = layer.self_attn, layer.multihead_attn
        check_torch_attention(layer, "self_attn")
        check_torch_attention(layer, "multihead_attn")
        check_torch_linear_norm(layer, ("norm1", "norm2", "norm3"))
        config = config_from_torch(layer, max_batch_tokens, max_seq_len)
        new = cls(config, device=sa.in_proj_weight.device, dtype=sa.in_proj_weight.dtype)
        h = config.hidden_size
        src = dict(layer.named_parameters())
        for kind in ("weight", "bias"):
            p = getattr(mha, f"in_proj_{kind}")
            if p is not None:
                src[f"multihead_attn.q_proj_{kind}"], src[f"multihead_attn.kv_proj_{kind}"] = p[:h], p[h:]
        copy_params(new, src)
        return new.train(layer.training)

    def to_torch(self, kv_weight=None, kv_bias=None):
        """The equivalent torch.nn.TransformerDecoderLayer (batch_first=True), weights copied. A layer of a
        TransformerDecoder has no K/V projection of its own: pass ``decoder.layer_kv(i)`` as kv_weight,
        kv_bias."""
        ca = self.multihead_attn
        if kv_weight is None:
            if not ca.owns_kv:
                raise ValueError("to_torch: this layer belongs to a TransformerDecoder; pass kv_weight, kv_bias = "
                                 "decoder.layer_kv(i)")
            kv_weight, kv_bias = ca.kv_proj_weight, ca.kv_proj_bias
        t = torch_layer(nn.TransformerDecoderLayer, self.current_config(), self.self_attn.in_proj_weight)
        src = dict(self.named_parameters())
        with torch.no_grad():
            src["multihead_attn.in_proj_weight"] = torch.cat([ca.q_proj_weight, kv_weight])
            if kv_bias is not None:
                src["multihead_attn.in_proj_bias"] = torch.cat([ca.q_proj_bias, kv_bias])
        copy_params(t, src)
        return t.train(self.training)

    def extra_repr(self):
        return f"{super().extra_repr()}, own_kv={self.multihead_attn.owns_kv}"


class TransformerDecoder(TransformerStackBase):
    """``num_layers`` TransformerDecoderLayers sharing one cross-attention K/V projection parameter
    (``cross_attn_kv_weight`` [num_layers·2·W, hidden], W = kv_heads·head_dim, ``cross_attn_kv_bias``), plus a
    final norm when pre_layer_norm. With rotary positions the stack makes the tables of the call's positions
    (offset by cache["step"]) once for all its layers.

    forward(y [batch, tgt_len, hidden], encoder_out [batch, src_len, hidden], encoder_padding_mask
    [batch, src_len] bool (True = pad) or None, cache=None, padding_mask=None) → [batch, tgt_len, hidden].
    padding_mask [batch, tgt_len] bool (True = pad) masks padded target positions as keys of the causal
    self-attention (right padding needs none: causal attention never looks ahead to it).
    With ``cache`` (a dict, start with {}): incremental decoding, y [batch, 1, hidden] (or a few newest
    positions); the cache keeps the encoder K/V of every layer ("encoder_kv"), each layer's past
    self-attention K/V ("layers") and the number of positions so far ("step").
    ``reorder_cache(cache, new_order)`` selects/reorders its batch entries (beam search).
    """

    def __init__(self, config, num_layers, device=None, dtype=None):
        kw = {"device": device, "dtype": dtype}
        super().__init__(config, num_layers, lambda: TransformerDecoderLayer(config, own_kv=False, **kw))
        h, rows = config.hidden_size, num_layers * 2 * config.kv_heads * config.head_dim
        self.cross_attn_kv_weight = nn.Parameter(torch.empty(rows, h, **kw))
        if config.bias:
            self.cross_attn_kv_bias = nn.Parameter(torch.zeros(rows, **kw))
        else:
            self.register_parameter("cross_attn_kv_bias", None)
        uniform_(self.cross_attn_kv_weight, h, 3 * h)
        self._add_final_norm(device, dtype)

    def layer_kv(self, i):
        """(weight [2W, H], bias [2W] or None): views of layer i's rows of the stacked K/V projection (W =
        kv_heads·head_dim)."""
        h2 = 2 * self.config.kv_heads * self.config.head_dim
        bias = self.cross_attn_kv_bias
        return self.cross_attn_kv_weight[i * h2:(i + 1) * h2], None if bias is None else bias[i * h2:(i + 1) * h2]

    @classmethod
    def from_layers(cls, layers):
        """A decoder from standalone layers (e.g. from ``TransformerDecoderLayer.from_torch``), their weights
        copied and their K/V projections stacked into cross_attn_kv_weight/bias; no final LayerNorm weights
        to copy (a pre-LN decoder's final norm starts as identity)."""
        layers = list(layers)
        if not layers or not all(isinstance(l, TransformerDecoderLayer) and l.multihead_attn.owns_kv for l in layers):
            raise ValueError("from_layers: expected a non-empty list of standalone TransformerDecoderLayers")
        config = layers[0].config
        if any(l.config != config for l in layers):
            raise ValueError("from_layers: all layers must have the same config")
        w = layers[0].self_attn.in_proj_weight
        dec = cls(config, len(layers), device=w.device, dtype=w.dtype)
        with torch.no_grad():
            for i, (dst, src) in enumerate(zip(dec.layers, layers)):
                copy_params(dst, dict(src.named_parameters()))
                kw, kb = dec.layer_kv(i)
                kw.copy_(src.multihead_attn.kv_proj_weight)
                if kb is not None:
                    kb.copy_(src.multihead_attn.kv_proj_bias)
        return dec.train(layers[0].training)

    def forward(self, y, encoder_out, encoder_padding_mask=None, cache=None, padding_mask=None):
        owner = "TransformerDecoder"
        check_cache(owner, cache)
        w = self.cross_attn_kv_weight
        past = cache.get("step", 0) if cache is not None else 0
        check_states(owner, "y", y, self.config, w, past)
        _check_padding_mask(owner, padding_mask, y, cache)
        cached_kv = cache.get("encoder_kv") if cache is not None else None
        _check_encoder(owner, encoder_out, encoder_padding_mask, y.shape[0], self.config, w, cached_kv)
        dtype = compute_dtype(owner, y, w)
        parts = 2 * len(self.layers)
        rotary = rotary_tables(self.config, y.shape[1], past, y.device)
        with no_autocast(y.device.type):
            y = y.to(dtype).contiguous()
            if cache is None:
                kv, slots = _encoder_kv(self.layers[0], y, encoder_out, w, self.cross_attn_kv_bias, parts)
                for i, layer in enumerate(self.layers):
                    y = layer._run(y, padding_mask, kv[2 * i:2 * i + 2], encoder_padding_mask, slots, i, rotary=rotary)
            else:
                if cached_kv is None:
                    cached_kv = cache["encoder_kv"] = cross_kv(encoder_out.to(dtype), w, self.cross_attn_kv_bias,
                                                               parts)
                layer_caches = cache.setdefault("layers", [{} for _ in self.layers])
                for i, layer in enumerate(self.layers):
                    y = layer._run(y, None, cached_kv[2 * i:2 * i + 2], encoder_padding_mask, cache=layer_caches[i],
                                   rotary=rotary)
                cache["step"] = past + y.shape[1]
        return self._final_norm(y)
