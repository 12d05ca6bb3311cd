"""Transformer encoder layer and stack on lsmini's layer runtime (runtime.py: the kernel path or the
reference; base.py: what the encoder shares with the decoder)."""
from torch import nn

from lsmini.layers.base import (TransformerLayerBase, TransformerStackBase, check_cache, check_mask, check_states,
                                layer_rotary, rotary_tables)
from lsmini.layers.interop import (check_torch_attention, check_torch_linear_norm, config_from_torch, copy_params,
                                   torch_layer)
from lsmini.layers.precision import compute_dtype, no_autocast
from lsmini.layers.runtime import run_layer


def _check_causal(owner, causal, cache):
    if not isinstance(causal, bool):
        raise TypeError(f"{owner}: causal must be a bool, got {type(causal).__name__}")
    check_cache(owner, cache)
    if cache is not None and not causal:
        raise ValueError(f"{owner}: incremental decoding (cache) needs causal=True: with full attention the "
                         f"cached positions would have to see the new ones")


class TransformerEncoderLayer(TransformerLayerBase):
    """One Transformer encoder layer (self-attention + feed-forward), pre- or post-LayerNorm.

    forward(x [batch, len, hidden], padding_mask [batch, len] bool (True = pad) or None, causal=False)
    → [batch, len, hidden]. ``causal=True`` makes position i attend to positions ≤ i (decoder-only LMs);
    then ``cache`` (a dict, start with {}) switches to incremental decoding: x holds only the newest
    positions, past keys/values are kept in the cache and padding_mask covers all positions so far.
    With rotary positions (config.rotary) ``rotary`` may pass the (cos, sin) tables of x's positions
    (lsmini.ops.rotary.rotary_cos_sin, float32); by default the layer makes those of positions past … past +
    len − 1 (past: the cached length).

    The config's options (TransformerConfig: norm, bias, num_kv_heads, rotary, qk_norm, gated activations)
    shape the parameters: no bias parameters with bias=False, RMSNorm norms, a [(heads + 2·kv_heads)·
    head_dim, hidden] in_proj_weight, a [2·ffn, hidden] linear1 for swiglu/geglu, self_attn.q_norm_weight /
    k_norm_weight with qk_norm; torch.nn's names are kept.

    Parameter names and the state_dict match ``torch.nn.TransformerEncoderLayer`` (self_attn.in_proj_weight,
    self_attn.out_proj, linear1, linear2, norm1, norm2); ``from_torch`` / ``to_torch`` convert. On CUDA
    with float16/bfloat16 activations forward and backward of the whole layer are one call each into the
    extension (fused kernels between cuBLAS GEMMs); elsewhere, and for incremental decoding, the reference
    layer runs (plain PyTorch).

    Dtypes: parameters float32, float16 or bfloat16. Under ``torch.autocast`` with float32 parameters the
    layer computes in the autocast dtype (GEMM weights cast per call; biases and LayerNorm stay float32);
    without autocast the input must have the parameters' dtype.

    Memory (kernel path): with ``recompute = True`` (attribute, the default) forward keeps per layer only
    its input, Q/K/V, the attention context, the FFN input and the first FFN GEMM's output — with relu its
    activation instead — (≈ 10·tokens·hidden elements at ffn = 4·hidden); backward recomputes the
    attention probabilities (the fused attention never stores them), the FFN activation (gelu) and the
    pre-LN LayerNorm outputs. ``recompute = False`` saves the latter two instead (+ tokens·(ffn + 2·hidden)
    elements), for a little less time.
    """

    KINDS = ("self", "ffn")

    def __init__(self, config, device=None, dtype=None):
        super().__init__(config, device, dtype)
        self._add_ffn_and_norms(device, dtype)

    def blocks(self):
        return [self._self_block(), self._ffn_block()]

    def forward(self, x, padding_mask=None, causal=False, cache=None, rotary=None):
        owner = "TransformerEncoderLayer"
        _check_causal(owner, causal, cache)
        w = self.self_attn.in_proj_weight
        past = cache["k"].shape[2] if cache is not None and "k" in cache else 0
        check_states(owner, "x", x, self.config, w, past)
        check_mask(owner, "padding_mask", padding_mask, x.shape[0], past + x.shape[1], x.device)
        rotary = layer_rotary(owner, self.config, rotary, x, past)
        dtype = compute_dtype(owner, x, w)
        with no_autocast(x.device.type):
            x = x.to(dtype).contiguous()
            return run_layer(self.options(causal), x, padding_mask, None, None, None, self.layer_params(), cache=cache,
                             rotary=rotary)

    @classmethod
    def from_torch(cls, layer, max_batch_tokens=8192, max_seq_len=512):
        """A layer computing the same function as ``layer`` (a torch.nn.TransformerEncoderLayer), with its
        weights copied, on its device and dtype. Dropouts map as: dropout1 → dropout, self_attn.dropout →
        attn_dropout, the FFN's inner dropout → activation_dropout. lsmini layers are batch-first: feed
        [batch, len, hidden] whatever ``layer.batch_first`` says."""
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(f"from_torch: expected torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
        sa = layer.self_attn
        check_torch_attention(layer, "self_attn")
        check_torch_linear_norm(layer, ("norm1", "norm2"))
        config = config_from_torch(layer, max_batch_tokens, max_seq_len)
        new = cls(config, device=sa.in_proj_weight.device, dtype=sa.in_proj_weight.dtype)
        copy_params(new, dict(layer.named_parameters()))
        return new.train(layer.training)

    def to_torch(self):
        """The equivalent torch.nn.TransformerEncoderLayer (batch_first=True), weights copied."""
        t = torch_layer(nn.TransformerEncoderLayer, self.current_config(), self.self_attn.in_proj_weight)
        copy_params(t, dict(self.named_parameters()))
        return t.train(self.training)


class TransformerEncoder(TransformerStackBase):
    """``num_layers`` TransformerEncoderLayers, plus a final norm when pre_layer_norm.

    forward(x [batch, len, hidden], padding_mask [batch, len] bool (True = pad) or None, causal=False,
    cache=None) → [batch, len, hidden]. With causal=True and a cache dict (start with {}) it decodes
    incrementally: x holds the newest positions, padding_mask covers every position so far,
    cache["step"] counts the positions already processed. With rotary positions the stack makes the tables
    of the call's positions (offset by cache["step"]) once for all its layers.
    """

    def __init__(self, config, num_layers, device=None, dtype=None):
        super().__init__(config, num_layers, lambda: TransformerEncoderLayer(config, device=device, dtype=dtype))
        self._add_final_norm(device, dtype)

    def forward(self, x, padding_mask=None, causal=False, cache=None):
        _check_causal("TransformerEncoder", causal, cache)
        layer_caches = [None] * len(self.layers)
        if cache is not None:
            layer_caches = cache.setdefault("layers", [{} for _ in self.layers])
        past = cache.get("step", 0) if cache is not None else 0
        rotary = rotary_tables(self.config, x.shape[1], past, x.device)
        for layer, c in zip(self.layers, layer_caches):
            x = layer(x, padding_mask, causal, c, rotary)
        if cache is not None:
            cache["step"] = cache.get("step", 0) + x.shape[1]
        return self._final_norm(x)
