"""``lsmini.convert`` for Hugging Face transformers models: every ``GPT2Block`` (GPT2Model, GPT2LMHeadModel, ...),
``BertLayer`` (BertModel, BertForMaskedLM, BertForSequenceClassification, ...) and ``LlamaDecoderLayer`` /
``MistralDecoderLayer`` / ``Qwen2DecoderLayer`` (LlamaModel, LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, ...) lsmini can represent becomes ``ConvertedGPT2Block`` / ``ConvertedBertLayer`` /
``Converted<Family>DecoderLayer``: a subclass of the Hugging Face class around the SAME
submodules and parameters (state_dict keys, ``save_pretrained`` / ``from_pretrained`` files, hooks on the block
and ``output_hidden_states`` unchanged) whose forward is ONE ``run_layer`` call for the whole block (the
kernel path on CUDA, the reference elsewhere). ``lsmini.unconvert`` puts the Hugging Face classes back.

The blocks as lsmini layers (spec.BLOCK_PARAMS per block, views of the block's own parameters):
- GPT2Block: pre-LN ("self" with ln_1, "ffn" with ln_2), causal. Its Conv1D weights are [in, out], so the
  layer takes their transposes (views, no copies); attention scale head_dim^-0.5 (1 when
  ``scale_attn_weights`` is False), divided by layer_idx + 1 with ``scale_attn_by_inverse_layer_idx``.
- BertLayer: post-LN, full attention; the QKV weight is the rows of query, key and value joined per call
  (each cast to the dtype the layer computes in, then ``torch.cat``; differentiable: their gradients reach the
  three Linear layers).
- Llama / Mistral / Qwen2 DecoderLayer: pre-norm RMSNorm ("self" with input_layernorm, "ffn" with
  post_attention_layernorm, no norm biases), causal, grouped K/V heads; the [Q | K | V] weight (and bias, where
  q/k/v have one) and the SwiGLU [gate | up] weight (and bias, with mlp_bias) joined per call like BERT's;
  o_proj / down_proj biases where present. Rotary positions: the (cos, sin) [b or 1, l, head_dim] the model
  computes once and passes each layer (rotate-half; rope scaling and left-padded position ids are already in
  them) become the layer's float32 rotary tables. Attention dropout config.attention_dropout, no other.
Activations: gelu (exact), gelu_new / gelu_pytorch_tanh (tanh GELU), relu; the decoders: silu (swiglu).

Masks: a block gets Hugging Face's 4-D attention mask ([batch or 1, 1, q_len, k_len]; additive float, 0 =
attend, or bool, True = attend) or None (sdpa's causal / no-padding shortcut). lsmini takes a key padding mask
and a causal flag instead: the keys the last query may not see are the padding (left or right), and the whole
mask is checked against it: every query must see exactly the non-padded keys (causal: those not after it), and
one left none may see every key instead (transformers' form for a padded query). A mask of another form (packed
sequences, a custom 4-D mask, a sliding window) raises ValueError eagerly (one host synchronisation a mask,
which the blocks of one forward share); while compiling, the check runs on the device (torch._assert_async: on
CUDA a device-side assert with that message). Outputs at padded positions are unspecified.

The causal LMs (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel) also get, on the
instance, a forward whose loss goes through lsmini's fused output projection + cross-entropy
(``lsmini.ops.linear_cross_entropy``): with ``labels`` while autograd records (training), the [tokens, vocab]
logits are never all in memory, and the output's ``logits`` is None (call without labels, or under
``torch.no_grad``, for them); the loss is Hugging Face's ForCausalLMLoss (labels shifted, ``ignore_index``,
``num_items_in_batch``, ``shift_labels``). Otherwise, with ``return_dict=False``, ``logits_to_keep`` or another
loss_type, it is the model's own forward. ``lsmini.unconvert`` removes it.

Memory: as lsmini's own layers, a converted block keeps for its backward the tensors the fused kernels need and
recomputes the FFN activation (gelu, SwiGLU) and the pre-norm outputs there (``recompute = True``, a class
attribute); ``block.recompute = False`` saves those instead, as the Hugging Face block does: more memory, a
little less time.

KV cache (``use_cache=True``, ``generate()``): a DynamicCache only. A block with no cached positions yet runs
the layer as usual and also writes its K/V into the cache (computed apart, without gradient: no gradient
flows through a cache); later calls (one new token at a time in generate) run the reference layer over the
cached K/V. Training with a cache therefore spends one extra K/V projection per block: pass use_cache=False.

Kept as they are, with the reason in the report: transformers < 5, attention implementations other than
eager / sdpa, GPT-2 with cross-attention (``add_cross_attention``), BERT as a decoder (``is_decoder``),
sliding-window attention (Mistral with sliding_window set; Qwen2 layers whose layer type is sliding), heads ·
head_dim != hidden size, pretraining_tp > 1, q/k/v or gate/up of which only some have a bias, other
activations, differing dropouts or LayerNorm eps, subclasses or replaced submodules, hooks on submodules
(transformers' own output-capturing hooks aside), mixed dtypes, devices or training modes.
``output_attentions=True`` raises (the fused layer never forms the attention probabilities).

transformers is an optional dependency: nothing here imports it unless it is already loaded (a model of its
classes exists only then).
"""
import functools
import importlib
import inspect
import sys

import torch
import torch.nn.functional as F
from torch import nn

from lsmini.layers.precision import cast_block, compute_dtype, no_autocast
from lsmini.layers.reference import heads
from lsmini.layers.runtime import run_layer
from lsmini.layers.spec import LayerOptions
from lsmini.ops.layernorm import layer_norm_ref
from lsmini.ops.linear_cross_entropy import linear_cross_entropy
from lsmini.ops.rms_norm import rms_norm_ref
from lsmini.ops.rotary import rotary_ref

__all__ = ["ConvertedGPT2Block", "ConvertedBertLayer", "ConvertedLlamaDecoderLayer", "ConvertedMistralDecoderLayer",
           "ConvertedQwen2DecoderLayer"]
# The decoder families sharing Llama's layer: (module under transformers.models, class prefix).
_DECODERS = (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"))

MIN_TRANSFORMERS = 5

# Hugging Face's activation modules by class name → lsmini's activation.
_ACTIVATIONS = {"GELUActivation": "gelu", "NewGELUActivation": "gelu_tanh", "PytorchGELUTanh": "gelu_tanh",
                "GELUTanh": "gelu_tanh", "ReLU": "relu"}
_ATTENTION_IMPLEMENTATIONS = (None, "eager", "sdpa")


class Unsupported(Exception):
    """Why a block stays as it is."""


def _require(ok, reason):
    if not ok:
        raise Unsupported(reason)


def transformers_loaded():
    return "transformers" in sys.modules


@functools.cache
def _hf():
    """The transformers classes used here, and the converted classes built on them."""
    from transformers.cache_utils import DynamicCache, DynamicLayer
    from transformers.models.bert import modeling_bert as bert
    from transformers.models.gpt2 import modeling_gpt2 as gpt2
    from transformers.pytorch_utils import Conv1D
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        _active_collector = None
    from transformers import activations
    silu = getattr(activations, "SiLUActivation", nn.SiLU)  # transformers' own SiLU module, where it has one
    ns = dict(gpt2=gpt2, bert=bert, Conv1D=Conv1D, DynamicCache=DynamicCache, DynamicLayer=DynamicLayer,
              collector=_active_collector, SiLUActivation=silu)
    ns["ConvertedGPT2Block"] = type("ConvertedGPT2Block", (_GPT2Forward, gpt2.GPT2Block),
                                    {"__module__": __name__, "__doc__": _GPT2Forward.__doc__})
    ns["ConvertedBertLayer"] = type("ConvertedBertLayer", (_BertForward, bert.BertLayer),
                                    {"__module__": __name__, "__doc__": _BertForward.__doc__})
    pairs = [(gpt2.GPT2Block, ns["ConvertedGPT2Block"]), (bert.BertLayer, ns["ConvertedBertLayer"])]
    for module, prefix in _DECODERS:
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        hf_cls = getattr(modeling, f"{prefix}DecoderLayer")
        name = f"Converted{prefix}DecoderLayer"
        ns[name] = type(name, (_DecoderForward, hf_cls), {"__module__": __name__, "__doc__": _DecoderForward.__doc__,
                                                         "_LSMINI_FAMILY": (modeling, prefix)})
        pairs.append((hf_cls, ns[name]))
    ns["pairs"] = tuple(pairs)
    for _, cls in ns["pairs"]:  # what a forward reads, as class attributes (no call into this cached builder)
        cls._lsmini_collector, cls._lsmini_cache_types = _active_collector, (DynamicCache, DynamicLayer)
    return ns


def __getattr__(name):
    """The Converted* classes are built on transformers' classes when first asked for."""
    if name in __all__:
        return _hf()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- calls: Hugging Face's arguments → lsmini's ------------------------------------------------------------------
def _check_call(owner, block, kwargs):
    """What a converted block cannot compute raises before anything runs."""
    collector = block._lsmini_collector
    collected = collector.get() if collector is not None else None
    if kwargs.get("output_attentions") or (collected and ("attentions" in collected or
                                                          "cross_attentions" in collected)):
        raise ValueError(f"{owner}: output_attentions=True is not supported: lsmini's fused attention never forms "
                         f"the attention probabilities (lsmini.unconvert the model to get them)")
    if kwargs.get("head_mask") is not None:
        raise ValueError(f"{owner}: head_mask is not supported (lsmini.unconvert the model to use one)")
    impl = getattr(block._lsmini_attention().config, "_attn_implementation", None)
    if impl not in _ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{owner}: the model's attention implementation is {impl!r}; a converted block runs "
                         f"lsmini's attention and reads eager/sdpa masks only (set 'sdpa' or 'eager', or "
                         f"lsmini.unconvert the model)")


def key_padding_mask(owner, mask, batch, q_len, k_len, causal):
    """Hugging Face's 4-D attention mask (module docstring) → lsmini's key padding mask: None or bool
    [batch, k_len], True = pad. ValueError for a mask that is not padding (+ causal when ``causal``).

    Eagerly the check reads its verdict from the device once, and a model's blocks, which all get the same mask
    tensor, check it once: the result is kept on the mask tensor itself (its ``_version`` tells whether it was
    written since), so it lives exactly as long as the mask. Inference tensors have no version: theirs is not
    kept."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{owner}: attention_mask must be a 4-D tensor or None, got {type(mask).__name__} (a "
                        f"converted block reads eager/sdpa masks only)")
    if mask.dim() != 4 or mask.shape[0] not in (1, batch) or tuple(mask.shape[2:]) != (q_len, k_len):
        raise ValueError(f"{owner}: attention_mask must have shape [{batch} or 1, heads or 1, {q_len}, {k_len}], "
                         f"got {tuple(mask.shape)}")
    keep = not torch.compiler.is_compiling() and not mask.is_inference()
    key = (mask._version, batch, q_len, k_len, causal) if keep else None
    checked = getattr(mask, "_lsmini_padding", None) if keep else None
    if checked is not None and checked[0] == key:
        return checked[1]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    pad = (~allowed[:, 0, -1, :]).expand(batch, k_len).contiguous()
    expected = (~pad)[:, None, None, :]
    if causal:
        q = torch.arange(q_len, device=mask.device)[:, None] + (k_len - q_len)
        expected = expected & (torch.arange(k_len, device=mask.device)[None, :] <= q)
    # every query sees the keys that padding (+ causal) leaves it; one left none may see every key instead
    # (transformers' form for a padded query that would see no key). xor, not ==: Inductor's value-range
    # analysis fails on == between two boolean tensors.
    fits = (~(allowed ^ expected)).all(-1) | (allowed.all(-1) & ~expected.any(-1))
    fits = fits.all()
    values = (torch.ones((), dtype=torch.bool, device=mask.device) if mask.dtype == torch.bool
              else ((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all())
    what = "padding with causal attention" if causal else "key padding"
    not_padding = (f"{owner}: attention_mask is not {what} (packed sequences, a custom 4-D mask or a sliding "
                   f"window?); lsmini supports key padding masks (left or right) only")
    if torch.compiler.is_compiling():  # values cannot be read while tracing: checked on the device
        torch._assert_async(fits & values, not_padding)
        return pad
    values, fits, padded = torch.stack((values, fits, pad.any())).tolist()  # one read from the device
    if not values:
        raise ValueError(f"{owner}: attention_mask holds values other than 0 and the masked value; lsmini supports "
                         f"key padding (and GPT-2's causal attention) only")
    if not fits:
        raise ValueError(not_padding)
    result = pad if padded else None
    if keep:
        mask._lsmini_padding = (key, result)
    return result


def _cache_state(owner, block, cache, layer_idx):
    """(cached length, the layer's cached K/V or None) of a DynamicCache."""
    dynamic_cache, dynamic_layer = block._lsmini_cache_types
    if not isinstance(cache, dynamic_cache) or getattr(cache, "offloading", False):
        raise ValueError(f"{owner}: the cache is {type(cache).__name__}; a converted block supports a DynamicCache "
                         f"(without offloading) only (lsmini.unconvert the model for other caches)")
    if layer_idx is None:
        raise ValueError(f"{owner}: a block used with a cache needs its layer_idx")
    if layer_idx >= len(cache.layers):
        return 0, None
    layer = cache.layers[layer_idx]
    if type(layer) is not dynamic_layer:
        raise ValueError(f"{owner}: the cache's layer {layer_idx} is {type(layer).__name__}; a converted block "
                         f"supports plain DynamicLayer entries only")
    past = cache.get_seq_length(layer_idx)
    return past, ((layer.keys, layer.values) if past else None)


def _run(block, owner, x, attention_mask, cache, kwargs, rotary=None):
    """The block's forward: one run_layer call (see the module docstring for masks and the cache); rotary: the
    float32 (cos, sin) tables of x's positions for a layer with rotary_dim, else None."""
    _check_call(owner, block, kwargs)
    weight, hidden = block.get_parameter(block._LSMINI_WEIGHT), block.get_parameter(block._LSMINI_NORM).shape[0]
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != hidden:
        raise ValueError(f"{owner}: hidden_states must be a [batch, len, {hidden}] tensor, got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    causal = block._LSMINI_CAUSAL
    past, cached = (0, None) if cache is None else _cache_state(owner, block, cache, block._lsmini_layer_idx())
    b, l = x.shape[0], x.shape[1]
    pad = key_padding_mask(owner, attention_mask, b, l, past + l, causal)
    options = block._lsmini_options() if rotary is None else block._lsmini_options(rotary[0].shape[-1])
    dtype = compute_dtype(owner, x, weight)
    params = block._lsmini_params(dtype)
    with no_autocast(x.device.type):
        x = x.to(dtype).contiguous()
        if cached is None:
            y = run_layer(options, x, pad, None, None, None, params, rotary=rotary)
            if cache is not None:
                with torch.no_grad():
                    k, v = _new_kv(options, x, params, rotary)
                cache.update(k, v, block._lsmini_layer_idx())
            return y
        kv = {"k": cached[0], "v": cached[1]}
        y = run_layer(options, x, pad, None, None, None, params, cache=kv, rotary=rotary)
        cache.update(kv["k"][:, :, past:], kv["v"][:, :, past:], block._lsmini_layer_idx())
        return y


def _joined(weights, dtype):
    """GEMM weights joined by rows in the dtype the layer computes in: each cast first, so the join moves the
    narrower copies and the layer has nothing left to cast (the same values as casting the join)."""
    return torch.cat([w.to(dtype) for w in weights])


def _new_kv(options, x, params, rotary=None):
    """The self-attention K/V of x ([b, kv_heads, l, d] each, K after rotary), as the layer computes them: for
    the cache."""
    w_in, b_in, _, _, norm_weight, norm_bias = cast_block(params[:6], x.dtype)
    if not options.pre_ln:
        u = x
    elif options.norm == "rms_norm":
        u = rms_norm_ref(x, norm_weight, options.eps)
    else:
        u = layer_norm_ref(x, norm_weight, norm_bias, options.eps)
    q_rows, width = options.heads * options.head_dim, options.kv_heads * options.head_dim
    kv = F.linear(u, w_in[q_rows:], None if b_in is None else b_in[q_rows:].to(x.dtype))
    k, v = heads(kv[..., :width], options.kv_heads), heads(kv[..., width:], options.kv_heads)
    if options.rotary_dim:
        k = rotary_ref(k, k, *rotary)[1]
    return k, v


def _dropouts(owner, residual, attention):
    """(residual, attention, activation) dropout probabilities from the modules' names and values; ValueError
    when the residual ones differ."""
    values = list(residual.values())
    if any(p != values[0] for p in values):
        listed = ", ".join(f"{name} = {p}" for name, p in residual.items())
        raise ValueError(f"{owner}: {listed} differ; lsmini's layer applies one residual dropout: set them equal")
    return values[0], attention, 0.0


def _options(block, config, kinds, causal, scale, dropouts):
    """LayerOptions of a Hugging Face block (config: a _LayerShape), with its training mode and recompute."""
    return LayerOptions.of(kinds, config, block.training, causal, block.recompute,
                           dropouts if block.training else None)._replace(scale=float(scale))


class _Recompute:
    """What a converted block's backward recomputes (the module docstring's "Memory")."""

    recompute = True


class _LayerShape:
    """The TransformerConfig fields LayerOptions.of reads, for a Hugging Face block."""

    def __init__(self, hidden, ffn, heads_, eps, pre_ln, activation, kv_heads=None, norm="layernorm", rotary_dims=0):
        self.hidden_size, self.ffn_size, self.num_heads, self.head_dim = hidden, ffn, heads_, hidden // heads_
        self.layer_norm_eps, self.pre_layer_norm, self.activation = eps, pre_ln, activation
        self.dropout = self.attn_dropout = self.activation_dropout = 0.0
        self.kv_heads = heads_ if kv_heads is None else kv_heads
        self.norm, self.rotary_dims, self.qk_norm = norm, rotary_dims, False


# ---- GPT-2 ----------------------------------------------------------------------------------------------------
class _GPT2Forward(_Recompute):
    """A transformers GPT2Block whose forward is one lsmini layer call (lsmini.convert_hf): same submodules,
    parameters and state_dict; forward(hidden_states, cache=None, attention_mask=None, ...) → hidden_states.
    No cross-attention, no output_attentions; the cache must be a DynamicCache."""

    _LSMINI_CAUSAL = True
    _LSMINI_WEIGHT, _LSMINI_NORM = "attn.c_attn.weight", "ln_1.weight"

    def forward(self, hidden_states, cache=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        owner = type(self).__name__
        cache = kwargs.pop("past_key_values", None) if cache is None else cache  # the argument's older name
        if encoder_hidden_states is not None:
            raise ValueError(f"{owner}: encoder_hidden_states given, but the block has no cross-attention")
        return _run(self, owner, hidden_states, attention_mask, cache, kwargs)

    def _lsmini_attention(self):
        return self.attn

    def _lsmini_layer_idx(self):
        return self.attn.layer_idx

    def _lsmini_params(self, dtype):
        a, m = self.attn, self.mlp
        return [a.c_attn.weight.t(), a.c_attn.bias, a.c_proj.weight.t(), a.c_proj.bias, self.ln_1.weight,
                self.ln_1.bias, m.c_fc.weight.t(), m.c_fc.bias, m.c_proj.weight.t(), m.c_proj.bias, self.ln_2.weight,
                self.ln_2.bias]

    def _lsmini_options(self):
        a = self.attn
        shape = _LayerShape(a.embed_dim, self.mlp.c_fc.nf, a.num_heads, self.ln_1.eps, True,
                            _ACTIVATIONS[type(self.mlp.act).__name__])
        scale = a.head_dim ** -0.5 if a.scale_attn_weights else 1.0
        if a.scale_attn_by_inverse_layer_idx:
            scale /= float(a.layer_idx + 1)
        dropouts = None
        if self.training:
            dropouts = _dropouts(type(self).__name__, {"attn.resid_dropout.p": a.resid_dropout.p,
                                                       "mlp.dropout.p": self.mlp.dropout.p}, a.attn_dropout.p)
        return _options(self, shape, ("self", "ffn"), True, scale, dropouts)


def _check_gpt2(block, hf):
    gpt2, conv = hf["gpt2"], hf["Conv1D"]
    _require(not hasattr(block, "crossattention"), "it has cross-attention (add_cross_attention=True), which a "
                                                   "converted GPT-2 block does not compute")
    _require(type(block.attn) is gpt2.GPT2Attention, f"attn is {type(block.attn).__name__}, not GPT2Attention")
    _require(type(block.mlp) is gpt2.GPT2MLP, f"mlp is {type(block.mlp).__name__}, not GPT2MLP")
    a, m = block.attn, block.mlp
    for name, mod in (("attn.c_attn", a.c_attn), ("attn.c_proj", a.c_proj), ("mlp.c_fc", m.c_fc),
                      ("mlp.c_proj", m.c_proj)):
        _require(type(mod) is conv and mod.bias is not None, f"{name} is not a Conv1D with a bias")
    _require(not a.is_cross_attention, "attn is a cross-attention")
    h, ffn = a.embed_dim, m.c_fc.nf
    _require(tuple(a.c_attn.weight.shape) == (h, 3 * h) and tuple(a.c_proj.weight.shape) == (h, h)
             and tuple(m.c_fc.weight.shape) == (h, ffn) and tuple(m.c_proj.weight.shape) == (ffn, h),
             "its projections do not map hidden → 3·hidden, hidden → hidden, hidden → ffn → hidden")
    _check_norms(block, ("ln_1", "ln_2"), h)
    _check_activation(m.act, "mlp.act")
    _check_dropouts({"attn.resid_dropout": a.resid_dropout, "mlp.dropout": m.dropout},
                    {"attn.attn_dropout": a.attn_dropout})
    _require(not a.scale_attn_by_inverse_layer_idx or a.layer_idx is not None,
             "scale_attn_by_inverse_layer_idx is set but the block has no layer_idx")
    return a


# ---- BERT ---------------------------------------------------------------------------------------------------------
class _BertForward(_Recompute):
    """A transformers BertLayer whose forward is one lsmini layer call (lsmini.convert_hf): same submodules,
    parameters and state_dict; forward(hidden_states, attention_mask=None, ...) → hidden_states. An encoder
    layer only (no cross-attention, no cache), no output_attentions."""

    _LSMINI_CAUSAL = False
    _LSMINI_WEIGHT, _LSMINI_NORM = "attention.self.query.weight", "attention.output.LayerNorm.weight"

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                cache=None, **kwargs):
        owner = type(self).__name__
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if encoder_hidden_states is not None or cache is not None:
            raise ValueError(f"{owner}: encoder_hidden_states / a cache given, but a converted BERT layer is an "
                             f"encoder layer (no cross-attention, no cache)")
        return _run(self, owner, hidden_states, attention_mask, None, kwargs)

    def _lsmini_attention(self):
        return self.attention.self

    def _lsmini_layer_idx(self):
        return self.attention.self.layer_idx

    def _lsmini_params(self, dtype):
        s, o = self.attention.self, self.attention.output
        return [_joined([s.query.weight, s.key.weight, s.value.weight], dtype),
                torch.cat([s.query.bias, s.key.bias, s.value.bias]), o.dense.weight, o.dense.bias, o.LayerNorm.weight,
                o.LayerNorm.bias, self.intermediate.dense.weight, self.intermediate.dense.bias,
                self.output.dense.weight, self.output.dense.bias, self.output.LayerNorm.weight,
                self.output.LayerNorm.bias]

    def _lsmini_options(self):
        s = self.attention.self
        shape = _LayerShape(s.all_head_size, self.intermediate.dense.out_features, s.num_attention_heads,
                            self.output.LayerNorm.eps, False,
                            _ACTIVATIONS[type(self.intermediate.intermediate_act_fn).__name__])
        dropouts = None
        if self.training:
            dropouts = _dropouts(type(self).__name__, {"attention.output.dropout.p": self.attention.output.dropout.p,
                                                       "output.dropout.p": self.output.dropout.p}, s.dropout.p)
        return _options(self, shape, ("self", "ffn"), False, s.attention_head_size ** -0.5, dropouts)


def _check_bert(layer, hf):
    bert = hf["bert"]
    _require(not getattr(layer, "is_decoder", False) and not hasattr(layer, "crossattention"),
             "it is a decoder layer (is_decoder / add_cross_attention): a converted BERT layer is an encoder layer")
    for name, cls in (("attention", bert.BertAttention), ("attention.self", bert.BertSelfAttention),
                      ("attention.output", bert.BertSelfOutput), ("intermediate", bert.BertIntermediate),
                      ("output", bert.BertOutput)):
        mod = layer.get_submodule(name)
        _require(type(mod) is cls, f"{name} is {type(mod).__name__}, not {cls.__name__}")
    s = layer.attention.self
    _require(not getattr(s, "is_causal", False) and not getattr(s, "is_decoder", False),
             "its self-attention is causal (a decoder)")
    position = getattr(s, "position_embedding_type", getattr(s.config, "position_embedding_type", "absolute"))
    _require(position in (None, "absolute"), f"position_embedding_type is {position!r}; lsmini's attention has no "
                                             f"relative position terms")
    h = s.all_head_size
    names = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "intermediate.dense", "output.dense")
    for name in names:
        mod = layer.get_submodule(name)
        _require(type(mod) is nn.Linear and mod.bias is not None, f"{name} is not an nn.Linear with a bias")
    ffn = layer.intermediate.dense.out_features
    _require(all(layer.get_submodule(n).in_features == h and layer.get_submodule(n).out_features == h
                 for n in names[:4]) and layer.intermediate.dense.in_features == h
             and layer.output.dense.in_features == ffn and layer.output.dense.out_features == h,
             "its projections do not map hidden → hidden (attention) and hidden → ffn → hidden")
    _check_norms(layer, ("attention.output.LayerNorm", "output.LayerNorm"), h)
    _check_activation(layer.intermediate.intermediate_act_fn, "intermediate.intermediate_act_fn")
    _check_dropouts({"attention.output.dropout": layer.attention.output.dropout,
                     "output.dropout": layer.output.dropout}, {"attention.self.dropout": s.dropout})
    return s


# ---- Llama, Mistral, Qwen2 ----------------------------------------------------------------------------------------
class _DecoderForward(_Recompute):
    """A transformers Llama / Mistral / Qwen2 decoder layer whose forward is one lsmini layer call
    (lsmini.convert_hf): same submodules, parameters and state_dict; forward(hidden_states, attention_mask=None,
    position_ids=None, cache=None, use_cache=False, position_embeddings=(cos, sin), ...) → hidden_states. No
    output_attentions; the cache must be a DynamicCache."""

    _LSMINI_CAUSAL = True
    _LSMINI_WEIGHT, _LSMINI_NORM = "self_attn.q_proj.weight", "input_layernorm.weight"

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        owner = type(self).__name__
        cache = kwargs.pop("past_key_values", None) if cache is None else cache  # the argument's older name
        rotary = None  # a hidden_states that is not [b, l, H] raises in _run, before the tables are read
        if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 3:
            rotary = _rotary_tables(owner, position_embeddings, hidden_states, self.self_attn.head_dim)
        return _run(self, owner, hidden_states, attention_mask, cache, kwargs, rotary)

    def _lsmini_attention(self):
        return self.self_attn

    def _lsmini_layer_idx(self):
        return self.self_attn.layer_idx

    def _lsmini_params(self, dtype):
        a, m = self.self_attn, self.mlp
        qkv_bias = None if a.q_proj.bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        gate_up_bias = None if m.gate_proj.bias is None else torch.cat([m.gate_proj.bias, m.up_proj.bias])
        return [_joined([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], dtype), qkv_bias, a.o_proj.weight,
                a.o_proj.bias, self.input_layernorm.weight, None,
                _joined([m.gate_proj.weight, m.up_proj.weight], dtype), gate_up_bias, m.down_proj.weight,
                m.down_proj.bias, self.post_attention_layernorm.weight, None]

    def _lsmini_options(self, rotary_dim=None):
        a = self.self_attn
        heads_ = a.q_proj.out_features // a.head_dim
        shape = _LayerShape(a.o_proj.out_features, self.mlp.gate_proj.out_features, heads_,
                            self.input_layernorm.variance_epsilon, True, "swiglu",
                            kv_heads=a.k_proj.out_features // a.head_dim, norm="rmsnorm",
                            rotary_dims=a.head_dim if rotary_dim is None else rotary_dim)
        dropouts = (0.0, float(a.attention_dropout), 0.0) if self.training else None
        return _options(self, shape, ("self", "ffn"), True, a.scaling, dropouts)


def _rotary_tables(owner, position_embeddings, x, head_dim):
    """Hugging Face's (cos, sin) [b or 1, l, r] (rotate-half layout) → run_layer's float32 tables: [l, r] when
    shared by the batch, else [b, l, r]."""
    if not (isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2
            and all(isinstance(t, torch.Tensor) for t in position_embeddings)):
        raise ValueError(f"{owner}: position_embeddings must be the (cos, sin) tensors the model's rotary "
                         f"embedding computes, got {type(position_embeddings).__name__}")
    cos, sin = position_embeddings
    b, l = x.shape[0], x.shape[1]
    if cos.shape != sin.shape or cos.dim() not in (2, 3) or cos.shape[-2] != l \
            or (cos.dim() == 3 and cos.shape[0] not in (1, b)) or cos.shape[-1] % 2 or cos.shape[-1] > head_dim:
        raise ValueError(f"{owner}: position_embeddings (cos, sin) must both be [{b} or 1, {l}, rotary dims] with "
                         f"even rotary dims <= head_dim {head_dim}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.dim() == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    return cos.float().contiguous(), sin.float().contiguous()


def _family(block, hf):
    """(the modeling module, the class prefix) of a Llama / Mistral / Qwen2 decoder layer."""
    return next(new_cls._LSMINI_FAMILY for hf_cls, new_cls in hf["pairs"] if type(block) is hf_cls)


def _check_decoder(block, hf):
    modeling, prefix = _family(block, hf)
    for name, cls in (("self_attn", f"{prefix}Attention"), ("mlp", f"{prefix}MLP"),
                      ("input_layernorm", f"{prefix}RMSNorm"), ("post_attention_layernorm", f"{prefix}RMSNorm")):
        mod = block.get_submodule(name)
        _require(type(mod) is getattr(modeling, cls), f"{name} is {type(mod).__name__}, not {cls}")
    a, m, config = block.self_attn, block.mlp, block.self_attn.config
    linears = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")
    for name in linears:
        _require(type(block.get_submodule(name)) is nn.Linear, f"{name} is not an nn.Linear")
    d, hidden = a.head_dim, a.o_proj.out_features
    q, k, v, o = a.q_proj, a.k_proj, a.v_proj, a.o_proj
    _require(q.out_features % d == 0 and k.out_features % d == 0, f"its q/k projections are not whole heads of "
                                                                  f"head_dim {d}")
    heads_, kv_heads = q.out_features // d, k.out_features // d
    _require(heads_ * d == hidden, f"heads · head_dim = {heads_} · {d} != hidden size {hidden}; lsmini's layer "
                                   f"maps the attention output back from hidden features")
    _require(kv_heads > 0 and heads_ % kv_heads == 0, f"its {heads_} query heads are not a multiple of its "
                                                      f"{kv_heads} K/V heads")
    ffn = m.gate_proj.out_features
    _require(q.in_features == k.in_features == v.in_features == hidden and v.out_features == kv_heads * d
             and o.in_features == heads_ * d and m.gate_proj.in_features == m.up_proj.in_features == hidden
             and m.up_proj.out_features == ffn and m.down_proj.in_features == ffn
             and m.down_proj.out_features == hidden,
             "its projections do not map hidden → [Q | K | V] → hidden and hidden → 2 × ffn → hidden")
    _require(len({q.bias is None, k.bias is None, v.bias is None}) == 1, "q_proj, k_proj and v_proj do not all "
                                                                         "have a bias or all lack one")
    _require((m.gate_proj.bias is None) == (m.up_proj.bias is None), "gate_proj and up_proj do not both have a "
                                                                     "bias or both lack one")
    _require(type(m.act_fn) in (hf["SiLUActivation"], nn.SiLU),
             f"mlp.act_fn is {type(m.act_fn).__name__} (hidden_act {getattr(config, 'hidden_act', '?')!r}); lsmini's "
             f"gated FFN has SiLU (swiglu)")
    eps = []
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = block.get_submodule(name)
        _require(tuple(norm.weight.shape) == (hidden,), f"{name} does not normalise the {hidden} features")
        eps.append(norm.variance_epsilon)
    _require(eps[0] == eps[1], f"its RMSNorms' eps differ ({eps[0]}, {eps[1]}); lsmini's layer has one")
    window = getattr(a, "sliding_window", getattr(config, "sliding_window", None))
    layer_types = getattr(config, "layer_types", None)
    layer_type = layer_types[a.layer_idx] if layer_types and a.layer_idx is not None \
        and a.layer_idx < len(layer_types) else None
    _require(window is None and layer_type in (None, "full_attention"),
             f"it uses sliding-window attention (sliding_window {getattr(config, 'sliding_window', None)}, layer "
             f"type {layer_type!r}); lsmini's attention has no window")
    tp = getattr(config, "pretraining_tp", 1) or 1
    _require(tp == 1, f"pretraining_tp is {tp}; lsmini converts layers with pretraining_tp = 1")
    return a


# ---- what convert can represent -------------------------------------------------------------------------------
def _check_norms(block, names, hidden):
    eps = []
    for name in names:
        norm = block.get_submodule(name)
        _require(type(norm) is nn.LayerNorm, f"{name} is {type(norm).__name__}, not torch.nn.LayerNorm")
        _require(tuple(norm.normalized_shape) == (hidden,) and norm.weight is not None and norm.bias is not None,
                 f"{name} is not an affine LayerNorm over the {hidden} features, with a bias")
        eps.append(norm.eps)
    _require(len(set(eps)) == 1, f"its LayerNorms' eps differ ({', '.join(map(str, eps))}); lsmini's layer has one")


def _check_activation(act, name):
    _require(type(act).__name__ in _ACTIVATIONS and type(act).__module__.split(".")[0] in ("transformers", "torch"),
             f"{name} is {type(act).__name__}; lsmini's layer has gelu, gelu_new (tanh) and relu")


def _check_dropouts(residual, attention):
    for group in (residual, attention):
        for name, mod in group.items():
            _require(type(mod) is nn.Dropout, f"{name} is {type(mod).__name__}, not torch.nn.Dropout")
    ps = {name: mod.p for name, mod in residual.items()}
    listed = ", ".join(f"{n}.p={p}" for n, p in ps.items())
    _require(len(set(ps.values())) == 1, f"its residual dropouts differ ({listed}); lsmini's layer applies one after "
                                         f"every sub-block")


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _is_output_capturing(hook):
    return getattr(hook, "__module__", "") == "transformers.utils.output_capturing"


def _check_plain(block):
    """No forward replaced on an instance, no hooks on the submodules (the block no longer calls them;
    transformers' output-capturing hooks aside, as output_attentions raises at call time), one dtype, device and
    training mode."""
    for name, m in block.named_modules():
        _require("forward" not in vars(m), f"{name or 'its'} forward is replaced on the instance (a wrapper such as "
                                           f"accelerate's hooks), which the converted block would not run")
        if not name:
            continue  # the block itself is still called: its hooks run
        hooks = [h.strip("_") for h in _HOOKS
                 if any(not _is_output_capturing(f) for f in getattr(m, h, {}).values())]
        _require(not hooks, f"{name} has {', '.join(hooks)}, which the converted block would not run")
    tensors = list(block.parameters()) + list(block.buffers())
    dtypes = sorted({str(t.dtype) for t in tensors})
    _require(len(dtypes) <= 1, f"its parameters mix dtypes ({', '.join(dtypes)})")
    _require(len({str(t.device) for t in tensors}) <= 1, "its parameters are on several devices")
    _require(len({m.training for m in block.modules()}) == 1, "its submodules mix training and eval mode")


def _with_class(module, cls):
    """A new object of class cls over module's state: the same submodules, parameters, buffers and hooks (the
    dicts themselves, shared), so nothing is copied and handles keep working."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    return new


def hf_block(module):
    """True for the transformers blocks convert considers (GPT2Block, BertLayer, Llama/Mistral/Qwen2
    DecoderLayer and subclasses)."""
    if not transformers_loaded():
        return False
    return isinstance(module, _hf_classes())


@functools.cache
def _hf_classes():
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    decoders = tuple(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                             f"{prefix}DecoderLayer") for module, prefix in _DECODERS)
    return (GPT2Block, BertLayer) + decoders


def converted(module):
    """(the converted block, None) or (None, why not), for a module hf_block accepted."""
    try:
        version = getattr(sys.modules["transformers"], "__version__", "0")
        _require(int(version.split(".")[0]) >= MIN_TRANSFORMERS, f"transformers {version} is installed; lsmini "
                                                                f"converts the blocks of transformers >= "
                                                                f"{MIN_TRANSFORMERS}")
        hf = _hf()
        family = next(((hf_cls, new_cls) for hf_cls, new_cls in hf["pairs"] if type(module) is hf_cls), None)
        _require(family is not None, f"{type(module).__name__} is a subclass of a transformers block; lsmini "
                                     f"converts GPT2Block, BertLayer and the Llama, Mistral and Qwen2 "
                                     f"DecoderLayer themselves")
        hf_cls, new_cls = family
        check = {hf["gpt2"].GPT2Block: _check_gpt2, hf["bert"].BertLayer: _check_bert}.get(hf_cls, _check_decoder)
        attention = check(module, hf)
        impl = getattr(attention.config, "_attn_implementation", None)
        _require(impl in _ATTENTION_IMPLEMENTATIONS, f"the attention implementation is {impl!r}; lsmini converts "
                                                     f"blocks running 'eager' or 'sdpa'")
        _check_plain(module)
        new = _with_class(module, new_cls)
        new._lsmini_options()  # every option readable (activation known, dropouts agree)
    except Unsupported as e:
        return None, str(e)
    return new, None


def is_converted(module):
    return type(module).__module__ == __name__ and type(module).__name__ in __all__


def unconverted(module):
    """The Hugging Face block around the same state."""
    hf_cls = next(hf_cls for hf_cls, new_cls in _hf()["pairs"] if type(module) is new_cls)
    return _with_class(module, hf_cls)


# ---- the causal LMs' loss: output projection and cross-entropy fused ---------------------------------------------
@functools.cache
def _causal_lm_classes():
    from transformers.models.gpt2.modeling_gpt2 import GPT2LMHeadModel
    heads = tuple(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                          f"{prefix}ForCausalLM") for module, prefix in _DECODERS)
    return heads + (GPT2LMHeadModel,)


def causal_lm(module):
    """True for the causal-LM models whose loss convert fuses (the classes themselves, not subclasses)."""
    return transformers_loaded() and type(module) in _causal_lm_classes()


class FusedLossForward:
    """A causal LM's forward with the fused loss (``_fused_loss_forward``), set on the instance: its class, and so
    what save_pretrained records, stays. It shows the class forward's signature, which generate() reads to
    know the arguments it may pass."""

    def __init__(self, model):
        from transformers.loss.loss_utils import ForCausalLMLoss
        self.model = model
        self.causal_lm_loss = ForCausalLMLoss  # the loss this forward computes fused (another loss_type: not)
        self.hf_signature = inspect.signature(type(model).forward)  # read once, not at every call

    @property
    def __signature__(self):
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args, **kwargs):
        return _fused_loss_forward(self.model, self.causal_lm_loss, self.hf_signature, *args, **kwargs)


def fuse_loss(model):
    model.forward = FusedLossForward(model)


def has_fused_loss(module):
    return isinstance(module.__dict__.get("forward"), FusedLossForward)


def unfuse_loss(module):
    del module.forward


def _fused_loss_forward(self, causal_lm_loss, hf_signature, *args, **kwargs):
    """The model's forward, except that with labels while autograd records, the loss is
    linear_cross_entropy over the last hidden states and the output projection's weight (Hugging Face's
    ForCausalLMLoss, never forming the logits) and the output's logits is None."""
    hf_forward = type(self).forward
    call = hf_signature.bind(self, *args, **kwargs).arguments
    call.pop("self")
    call.update(call.pop("kwargs", {}))
    labels = call.pop("labels", None)
    if (labels is None or not torch.is_grad_enabled() or call.get("return_dict") is False
            or call.get("logits_to_keep", 0) not in (0, None) or self.lm_head.bias is not None
            or self.loss_function is not causal_lm_loss):
        return hf_forward(self, *args, **kwargs)
    call.pop("logits_to_keep", None)
    outputs = self.base_model(**call)  # the model's own call, less what only the head reads
    hidden = outputs.last_hidden_state
    ignore_index = call.get("ignore_index", -100)
    shift_labels = call.get("shift_labels")
    if shift_labels is None:  # position i predicts token i + 1; the last position predicts nothing
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(hidden.device)
    num_items = call.get("num_items_in_batch")
    loss = linear_cross_entropy(hidden, self.lm_head.weight, shift_labels, ignore_index=ignore_index,
                                reduction="mean" if num_items is None else "sum")
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    out_cls = hf_signature.return_annotation
    fields = {k: v for k, v in outputs.items() if k != "last_hidden_state" and k in out_cls.__dataclass_fields__}
    return out_cls(loss=loss, logits=None, **fields)

