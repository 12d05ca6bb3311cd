"""Speed up an existing PyTorch model in one call, and go back.

    report = lsmini.convert(model, max_batch_tokens=8192, max_seq_len=512)
    print(report)             # what was replaced, what was kept and why
    lsmini.unconvert(model)   # torch.nn modules again, same weights

``convert`` walks ``model`` (through any nn.Module, Sequential, ModuleList, ModuleDict) and replaces, in place,
every torch.nn.TransformerEncoder, TransformerDecoder, TransformerEncoderLayer, TransformerDecoderLayer,
LayerNorm and RMSNorm that lsmini can represent with an lsmini-backed module that keeps torch's forward signature,
layout (``batch_first`` or not, unbatched inputs), mask arguments, training mode, device, dtype and state_dict keys.
An nn.Transformer keeps its class (its forward only checks shapes and calls its encoder and decoder): its
encoder and decoder are converted. The replacements reuse the original nn.Parameter objects wherever
lsmini's layout is torch's, so tied weights stay tied; a decoder's cross-attention ``in_proj`` is the one
exception (lsmini splits it into a query projection and one K/V projection for the whole stack), so build the
optimizer after converting.

Masks: lsmini supports key padding masks and causal self-attention, nothing else.
- ``*_key_padding_mask``: bool (True = pad), or float holding only 0 and -inf (read by value: eager only).
- Self-attention masks (``src_mask``, ``mask``, ``tgt_mask``): None (full attention), or causal: the
  ``is_causal`` / ``tgt_is_causal`` flag is True, or (eager only, at the cost of one host sync, as in torch's
  own detection) the mask equals ``nn.Transformer.generate_square_subsequent_mask(len)`` or its bool form.
- A decoder's self-attention is always causal in lsmini: a converted decoder called without a causal tgt_mask
  raises.
- ``memory_mask`` and ``memory_is_causal=True`` raise ValueError.
Outputs at padded positions are unspecified (torch's own inference fast path returns zeros there, lsmini
does not); compare and use the unpadded ones.

Layers built with bias=False, and layers whose norms were replaced by nn.RMSNorm (all of a layer's norms one
kind; a stack's final norm either kind), become lsmini layers with bias=False / norm="rmsnorm". nn.RMSNorm's
eps=None is torch.finfo(dtype).eps of the module's dtype at conversion.

Hugging Face transformers models (transformers >= 5): every GPT2Block, BertLayer and Llama / Mistral / Qwen2
DecoderLayer lsmini can represent is replaced by a subclass of its class around the same submodules and
parameters, and a causal LM all of whose blocks were converted gets the fused output projection + cross-entropy
loss (lsmini/convert_hf.py, which says what it reads from the masks and the KV cache, and what it keeps).

A module convert cannot represent is left as it is, whole (a stack with one unsupported layer keeps all of
them), and listed in the report with the reason; nothing is replaced before every module is decided.
"""
import dataclasses
import inspect
import warnings
from collections import Counter
from typing import NamedTuple

import torch
from torch import nn

from lsmini import convert_hf
from lsmini.layers import (LayerNorm, RMSNorm, TransformerConfig, TransformerDecoder, TransformerDecoderLayer,
                           TransformerEncoder, TransformerEncoderLayer)
from lsmini.layers.interop import (check_torch_attention, check_torch_linear_norm, config_from_torch,
                                   key_padding_mask_from_torch, norm_eps, self_attention_is_causal, torch_layer)

__all__ = ["convert", "unconvert", "ConversionReport", "ConvertedLayerNorm", "ConvertedRMSNorm",
           "ConvertedTransformerEncoderLayer", "ConvertedTransformerDecoderLayer", "ConvertedTransformerEncoder",
           "ConvertedTransformerDecoder"]


# ---- inputs in torch's conventions → lsmini's -----------------------------------------------------------------
def _to_lsmini(owner, name, x, batch_first, config):
    """x as torch takes it ([len, batch, H], [batch, len, H] when batch_first, or unbatched [len, H]) →
    ([batch, len, H], unbatched), within the limits convert was given."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: {name} must be a Tensor, got {type(x).__name__}")
    h = config.hidden_size
    if x.dim() not in (2, 3) or x.shape[-1] != h:
        layout = "[batch, len, hidden]" if batch_first else "[len, batch, hidden]"
        raise ValueError(f"{owner}: {name} must have shape {layout} or [len, hidden] with hidden = {h}, got "
                         f"{tuple(x.shape)}")
    unbatched = x.dim() == 2
    x = x.unsqueeze(0) if unbatched else x if batch_first else x.transpose(0, 1)
    b, l = x.shape[0], x.shape[1]
    if l > config.max_seq_len:
        raise ValueError(f"{owner}: {name} has length {l} > max_seq_len = {config.max_seq_len} (an argument of "
                         f"lsmini.convert)")
    if b * l > config.max_batch_tokens:
        raise ValueError(f"{owner}: {name} has batch*len = {b}*{l} = {b * l} tokens > max_batch_tokens = "
                         f"{config.max_batch_tokens} (an argument of lsmini.convert)")
    return x, unbatched


def _to_torch(y, batch_first, unbatched):
    if unbatched:
        return y.squeeze(0)
    return y if batch_first else y.transpose(0, 1).contiguous()  # torch's output is contiguous; callers .view it


def _padding_mask(owner, name, mask, x, unbatched):
    if unbatched and isinstance(mask, torch.Tensor) and mask.dim() == 1:
        mask = mask.unsqueeze(0)
    return key_padding_mask_from_torch(owner, name, mask, x.shape[0], x.shape[1])


def _decoder_call(module, run, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
                  tgt_is_causal, memory_is_causal):
    """A torch decoder (layer or stack) call on lsmini's: run(y, encoder_out, encoder_padding_mask=,
    padding_mask=) in lsmini's terms; ValueError where the call means something lsmini's decoder does not
    compute."""
    owner = type(module).__name__
    if memory_mask is not None:
        raise ValueError(f"{owner}: memory_mask must be None; lsmini supports only key padding masks and causal "
                         f"self-attention (use memory_key_padding_mask)")
    if memory_is_causal:
        raise ValueError(f"{owner}: memory_is_causal=True is not supported; lsmini supports only key padding masks "
                         f"and causal self-attention")
    y, unbatched = _to_lsmini(owner, "tgt", tgt, module.batch_first, module.config)
    if isinstance(memory, torch.Tensor) and memory.dim() != tgt.dim():
        raise ValueError(f"{owner}: tgt and memory must both be batched (3-D) or both unbatched (2-D), got "
                         f"{tgt.dim()}-D and {memory.dim()}-D")
    enc, _ = _to_lsmini(owner, "memory", memory, module.batch_first, module.config)
    if not self_attention_is_causal(owner, "tgt_mask", tgt_mask, "tgt_is_causal", tgt_is_causal, y.shape[1]):
        raise ValueError(f"{owner}: lsmini's decoder self-attention is always causal; pass the causal tgt_mask "
                         f"(nn.Transformer.generate_square_subsequent_mask(tgt_len)) and/or tgt_is_causal=True. A "
                         f"decoder called without one attends to later positions, which lsmini cannot compute: "
                         f"unconvert it (lsmini.unconvert) to run it that way")
    pad = _padding_mask(owner, "tgt_key_padding_mask", tgt_key_padding_mask, y, unbatched)
    enc_pad = _padding_mask(owner, "memory_key_padding_mask", memory_key_padding_mask, enc, unbatched)
    return _to_torch(run(y, enc, encoder_padding_mask=enc_pad, padding_mask=pad), module.batch_first, unbatched)


def _encoder_call(module, run, src, mask_name, mask, src_key_padding_mask, is_causal):
    """A torch encoder (layer or stack) call on lsmini's: run(x, padding_mask=, causal=) in lsmini's terms."""
    owner = type(module).__name__
    x, unbatched = _to_lsmini(owner, "src", src, module.batch_first, module.config)
    causal = self_attention_is_causal(owner, mask_name, mask, "is_causal", is_causal, x.shape[1])
    pad = _padding_mask(owner, "src_key_padding_mask", src_key_padding_mask, x, unbatched)
    return _to_torch(run(x, padding_mask=pad, causal=causal), module.batch_first, unbatched)


# ---- the replacements -------------------------------------------------------------------------------------------
class ConvertedLayerNorm(LayerNorm):
    """lsmini.layers.LayerNorm in the place of a torch.nn.LayerNorm: same arguments, forward and state_dict
    (a class of its own so that ``unconvert`` knows what to put back)."""


class ConvertedRMSNorm(RMSNorm):
    """lsmini.layers.RMSNorm in the place of a torch.nn.RMSNorm: same arguments, forward and state_dict."""


class ConvertedTransformerEncoderLayer(TransformerEncoderLayer):
    """An lsmini TransformerEncoderLayer with torch.nn.TransformerEncoderLayer's forward:

    forward(src, src_mask=None, src_key_padding_mask=None, is_causal=False): src [len, batch, hidden] (or
    [batch, len, hidden] when ``batch_first``; or unbatched [len, hidden]) → the same shape. Masks as the
    module docstring of lsmini.convert says. Parameter names and state_dict as torch's layer.
    """

    def __init__(self, config, batch_first=False, device=None, dtype=None):
        super().__init__(config, device=device, dtype=dtype)
        self.batch_first = batch_first

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal=False):
        return _encoder_call(self, super().forward, src, "src_mask", src_mask, src_key_padding_mask, is_causal)

    def extra_repr(self):
        return f"{super().extra_repr()}, batch_first={self.batch_first}"


class ConvertedTransformerEncoder(TransformerEncoder):
    """An lsmini TransformerEncoder with torch.nn.TransformerEncoder's forward and structure:

    forward(src, mask=None, src_key_padding_mask=None, is_causal=None) → like src (see
    ConvertedTransformerEncoderLayer). ``norm`` is torch's optional final norm (pre- or post-LN alike),
    applied after the last layer; ``enable_nested_tensor`` / ``mask_check`` are kept for ``unconvert``.
    """

    def __init__(self, config, num_layers, norm=None, batch_first=False, enable_nested_tensor=True, mask_check=True,
                 device=None, dtype=None):
        super().__init__(config, num_layers, device=device, dtype=dtype)
        self.norm = norm
        self.batch_first = batch_first
        self.enable_nested_tensor, self.mask_check = enable_nested_tensor, mask_check

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        return _encoder_call(self, super().forward, src, "mask", mask, src_key_padding_mask, is_causal)

    def extra_repr(self):
        return f"batch_first={self.batch_first}"


# The decoder's state_dict in torch's names. lsmini splits each cross-attention ``multihead_attn.in_proj_weight``
# [3H, H] (rows Q, K, V) into ``multihead_attn.q_proj_weight`` [H, H] and K/V rows kept elsewhere: a standalone
# layer's ``multihead_attn.kv_proj_weight`` [2H, H], a stack's ``cross_attn_kv_weight`` [L·2H, H] (rows 2H·i on
# for layer i); the same for the biases. The hooks below join them on save and split them on load, so a
# checkpoint moves between the converted and the torch model both ways.
_CROSS = "multihead_attn."


def _decoder_state_dict_to_torch(module, state_dict, prefix, local_metadata):
    """state_dict post-hook: this module's entries (the last ones added, so re-adding them in order keeps the
    dict's order) rewritten in torch's names and order."""
    keys = [k for k in state_dict if k.startswith(prefix)]
    local = {k[len(prefix):]: state_dict.pop(k) for k in keys}
    joined, dropped = {}, set()
    for layer, kv_weight, kv_bias, rows in module._cross_kv_rows():
        dropped.update((kv_weight, kv_bias))
        for kind, kv in (("weight", kv_weight), ("bias", kv_bias)):
            q = f"{layer}{_CROSS}q_proj_{kind}"
            if q not in local:  # bias=False
                continue
            with torch.no_grad():
                joined[q] = f"{layer}{_CROSS}in_proj_{kind}", torch.cat([local[q], local[kv][rows]])
    for name, value in local.items():
        if name not in dropped:
            name, value = joined.get(name, (name, value))
            state_dict[prefix + name] = value


def _decoder_state_dict_from_torch(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                   error_msgs):
    """load_state_dict pre-hook: torch's ``multihead_attn.in_proj_*`` entries split into lsmini's. A checkpoint in
    lsmini's own names loads as it is. Errors in torch's names: an absent in_proj is a missing key (its
    parameters keep their values), one of the wrong shape a size mismatch."""
    rows = module._cross_kv_rows()
    if any(f"{prefix}{layer}{_CROSS}q_proj_weight" in state_dict for layer, *_ in rows):
        return
    h = module.config.hidden_size
    current = dict(module.named_parameters())
    for kind, shape in (("weight", (3 * h, h)), ("bias", (3 * h,))):
        if not module.config.bias and kind == "bias":
            continue
        kv_parts = {}
        for layer, kv_weight, kv_bias, layer_rows in rows:
            kv_name = kv_weight if kind == "weight" else kv_bias
            key = f"{prefix}{layer}{_CROSS}in_proj_{kind}"
            value = state_dict.pop(key, None)
            if value is None:
                if strict:
                    missing_keys.append(key)
            elif tuple(value.shape) != shape:
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from "
                                  f"checkpoint, the shape in current model is {shape}.")
                value = None
            if value is None:
                q = current[f"{layer}{_CROSS}q_proj_{kind}"].detach()
                kv = current[kv_name].detach()[layer_rows]
            else:
                q, kv = value[:h], value[h:]
            state_dict[f"{prefix}{layer}{_CROSS}q_proj_{kind}"] = q
            kv_parts.setdefault(kv_name, []).append(kv)
        for kv_name, parts in kv_parts.items():
            state_dict[prefix + kv_name] = parts[0] if len(parts) == 1 else torch.cat(parts)


def _torch_state_dict_hooks(module):
    module.register_state_dict_post_hook(_decoder_state_dict_to_torch)
    module.register_load_state_dict_pre_hook(_decoder_state_dict_from_torch)


class ConvertedTransformerDecoderLayer(TransformerDecoderLayer):
    """A standalone lsmini TransformerDecoderLayer with torch.nn.TransformerDecoderLayer's forward:

    forward(tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
    memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False) → like tgt. tgt [len, batch,
    hidden] (or [batch, len, hidden] when ``batch_first``, or unbatched), memory likewise. The self-attention
    is causal: tgt_mask must be the causal mask (or tgt_is_causal=True). The state_dict is torch's
    (``multihead_attn.in_proj_weight`` / ``in_proj_bias`` joined from the query and K/V projections).
    """

    def __init__(self, config, batch_first=False, device=None, dtype=None):
        super().__init__(config, own_kv=True, device=device, dtype=dtype)
        self.batch_first = batch_first
        _torch_state_dict_hooks(self)

    def _cross_kv_rows(self):
        """Per layer: (its state_dict prefix, the names of the K/V weight and bias holding its rows, the rows)."""
        return [("", f"{_CROSS}kv_proj_weight", f"{_CROSS}kv_proj_bias", slice(None))]

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=False, memory_is_causal=False):
        return _decoder_call(self, super().forward, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                             memory_key_padding_mask, tgt_is_causal, memory_is_causal)

    def extra_repr(self):
        return f"{super().extra_repr()}, batch_first={self.batch_first}"


class ConvertedTransformerDecoder(TransformerDecoder):
    """An lsmini TransformerDecoder (every layer's cross-attention K/V in one GEMM) with
    torch.nn.TransformerDecoder's forward and structure:

    forward(tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
    memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False) → like tgt (see
    ConvertedTransformerDecoderLayer). ``norm`` is torch's optional final norm. The state_dict is torch's:
    each ``layers.i.multihead_attn.in_proj_weight`` / ``in_proj_bias`` joined from the layer's query projection
    and its rows of ``cross_attn_kv_weight`` / ``cross_attn_kv_bias``.
    """

    def __init__(self, config, num_layers, norm=None, batch_first=False, device=None, dtype=None):
        super().__init__(config, num_layers, device=device, dtype=dtype)
        self.norm = norm
        self.batch_first = batch_first
        _torch_state_dict_hooks(self)

    def _cross_kv_rows(self):
        h2 = 2 * self.config.hidden_size
        return [(f"layers.{i}.", "cross_attn_kv_weight", "cross_attn_kv_bias", slice(i * h2, (i + 1) * h2))
                for i in range(len(self.layers))]

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, tgt_is_causal=None, memory_is_causal=False):
        return _decoder_call(self, super().forward, tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                             memory_key_padding_mask, tgt_is_causal, memory_is_causal)

    def extra_repr(self):
        return f"batch_first={self.batch_first}"


# ---- building a module around existing parameters ---------------------------------------------------------------
def _adopt(dst, sources):
    """Give dst (built on the meta device) the parameters of sources (name → nn.Parameter) under the same
    names: the same objects, so nothing is copied and ties stay."""
    for name, _ in list(dst.named_parameters(remove_duplicate=False)):
        if name not in sources:
            raise RuntimeError(f"lsmini.convert: no source for {type(dst).__name__}'s parameter {name}")
        owner, _, attr = name.rpartition(".")
        setattr(dst.get_submodule(owner), attr, sources[name])
    unset = [n for n, b in dst.named_buffers() if b.is_meta]
    if unset:
        raise RuntimeError(f"lsmini.convert: {type(dst).__name__} has buffers with no source: {unset}")
    return dst


def _new_parameter(tensor, requires_grad):
    return nn.Parameter(tensor.detach().clone(), requires_grad=requires_grad)


def _cross_sources_to_lsmini(torch_layers, prefixes, stacked):
    """lsmini's cross-attention parameters from torch's in_proj of each layer: the query rows per layer, the
    K/V rows per layer (standalone) or stacked over the layers (a decoder stack)."""
    sources, kv = {}, {"weight": [], "bias": []}
    h = torch_layers[0].multihead_attn.embed_dim
    for layer, prefix in zip(torch_layers, prefixes):
        mha = layer.multihead_attn
        for kind in kv:
            p = getattr(mha, f"in_proj_{kind}")
            if p is None:  # bias=False
                continue
            sources[f"{prefix}{_CROSS}q_proj_{kind}"] = _new_parameter(p[:h], p.requires_grad)
            kv[kind].append(p[h:])
            if not stacked:
                sources[f"{prefix}{_CROSS}kv_proj_{kind}"] = _new_parameter(p[h:], p.requires_grad)
    if stacked:
        for kind, parts in kv.items():
            if not parts:
                continue
            grad = getattr(torch_layers[0].multihead_attn, f"in_proj_{kind}").requires_grad
            sources[f"cross_attn_kv_{kind}"] = _new_parameter(torch.cat(parts), grad)
    return sources


def _cross_sources_to_torch(module):
    """torch's ``multihead_attn.in_proj_*`` of every layer of a converted decoder (layer or stack), joined."""
    params = dict(module.named_parameters())
    sources = {}
    for layer, kv_weight, kv_bias, rows in module._cross_kv_rows():
        for kind, kv in (("weight", kv_weight), ("bias", kv_bias)):
            q = params.get(f"{layer}{_CROSS}q_proj_{kind}")
            if q is None:  # bias=False
                continue
            sources[f"{layer}{_CROSS}in_proj_{kind}"] = _new_parameter(torch.cat([q, params[kv][rows]]),
                                                                      q.requires_grad)
    return sources


# ---- what convert can represent ---------------------------------------------------------------------------------
_STRUCTURE = {  # the children a torch layer has (its activation may be a module too), and the kinds of them
    nn.TransformerEncoderLayer: {"attention": ("self_attn",), "norms": ("norm1", "norm2"),
                                 "dropouts": ("dropout1", "dropout2")},
    nn.TransformerDecoderLayer: {"attention": ("self_attn", "multihead_attn"), "norms": ("norm1", "norm2", "norm3"),
                                 "dropouts": ("dropout1", "dropout2", "dropout3")},
}
_HARMLESS_OVERRIDES = {"__init__", "__setstate__", "reset_parameters", "_reset_parameters", "extra_repr"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


class _Unsupported(Exception):
    """Why a module stays as it is."""


def _require(ok, reason):
    if not ok:
        raise _Unsupported(reason)


def _check_class(module, torch_cls):
    """A subclass is converted only when it changes none of torch's behaviour (methods)."""
    cls = type(module)
    if cls is torch_cls:
        return
    changed = [n for n, v in vars(torch_cls).items()
               if callable(v) and n not in _HARMLESS_OVERRIDES and inspect.getattr_static(cls, n) is not v]
    _require(not changed, f"{cls.__name__} overrides {', '.join(changed)} of torch.nn.{torch_cls.__name__}")


def _check_plain(module):
    """No hooks anywhere inside (the replacement would not run them), one dtype, device and training mode."""
    for name, m in module.named_modules():
        hooks = [h.strip("_") for h in _HOOKS if getattr(m, h, None)]
        _require(not hooks, f"{name or 'it'} has {', '.join(hooks)}, which the lsmini module would not run")
    tensors = list(module.parameters()) + list(module.buffers())
    dtypes = sorted({str(t.dtype) for t in tensors})
    _require(len(dtypes) <= 1, f"its parameters mix dtypes ({', '.join(dtypes)})")
    devices = sorted({str(t.device) for t in tensors})
    _require(len(devices) <= 1, f"its parameters are on several devices ({', '.join(devices)})")
    _require(len({m.training for m in module.modules()}) == 1, "its submodules mix training and eval mode")


def _check_norm(norm, name, hidden=None):
    if isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
        _check_class(norm, nn.LayerNorm if isinstance(norm, nn.LayerNorm) else nn.RMSNorm)
    else:
        _require(type(norm) in (LayerNorm, RMSNorm),
                 f"{name} is {type(norm).__name__}, not torch.nn.LayerNorm or torch.nn.RMSNorm")
    shape = tuple(norm.normalized_shape)
    kind = "RMSNorm" if isinstance(norm, (nn.RMSNorm, RMSNorm)) else "LayerNorm"
    _require(len(shape) == 1, f"{name} normalizes over the last {len(shape)} dimensions {shape}; lsmini's {kind} "
                              f"normalizes the last one only")
    _require(hidden is None or shape == (hidden,), f"{name} normalizes {shape[0]} features, the layer has {hidden}")


def _layer_config(layer, torch_cls, limits):
    """The TransformerConfig of a torch layer lsmini can represent (else _Unsupported)."""
    _check_class(layer, torch_cls)
    parts = _STRUCTURE[torch_cls]
    for name in parts["attention"]:
        _require(type(getattr(layer, name, None)) is nn.MultiheadAttention,
                 f"{name} is {type(getattr(layer, name, None)).__name__}, not torch.nn.MultiheadAttention")
    for name in ("linear1", "linear2"):
        _require(type(getattr(layer, name, None)) is nn.Linear,
                 f"{name} is {type(getattr(layer, name, None)).__name__}, not torch.nn.Linear")
    for name in ("dropout",) + parts["dropouts"]:
        _require(type(getattr(layer, name, None)) is nn.Dropout,
                 f"{name} is {type(getattr(layer, name, None)).__name__}, not torch.nn.Dropout")
    try:
        for name in parts["attention"]:
            check_torch_attention(layer, name)
        check_torch_linear_norm(layer, parts["norms"])
        config = config_from_torch(layer, *limits)
    except (ValueError, TypeError) as e:
        raise _Unsupported(str(e).removeprefix("from_torch: ")) from None
    h = config.hidden_size
    for name in parts["norms"]:
        norm = getattr(layer, name)
        _check_norm(norm, name, h)
        eps = norm_eps(norm, layer.self_attn.in_proj_weight.dtype)
        _require(eps == config.layer_norm_eps, f"its norms' eps differ ({name}.eps = {norm.eps}, norm1.eps = "
                                               f"{config.layer_norm_eps}); lsmini's layer has one")
    probs = ", ".join(f"{name}.p={getattr(layer, name).p}" for name in parts["dropouts"])
    _require(len({getattr(layer, name).p for name in parts["dropouts"]}) == 1,
             f"its dropouts differ ({probs}); lsmini's layer applies one dropout after every sub-block")
    _require(layer.linear1.in_features == h and layer.linear2.out_features == h
             and layer.linear2.in_features == config.ffn_size, "linear1/linear2 do not map hidden → ffn → hidden")
    if torch_cls is nn.TransformerDecoderLayer:
        sa, ca = layer.self_attn, layer.multihead_attn
        _require(ca.embed_dim == h and ca.num_heads == sa.num_heads,
                 "multihead_attn's width or heads differ from self_attn's")
        _require(float(ca.dropout) == float(sa.dropout), f"its attention dropouts differ (self_attn {sa.dropout}, "
                                                         f"multihead_attn {ca.dropout}); lsmini's layer has one")
        _require(ca.batch_first == sa.batch_first, "self_attn and multihead_attn differ in batch_first")
    return config


def _check_cross_parameters(layers, names, uses):
    """The cross-attention in_proj becomes new parameters (split, stacked): they must be used nowhere else,
    and the stacked ones must agree in requires_grad."""
    for kind in ("weight", "bias"):
        params = [getattr(layer.multihead_attn, f"in_proj_{kind}") for layer in layers]
        if params[0] is None:  # bias=False (the same in every layer: their configs agree)
            continue
        for p, name in zip(params, names):
            _require(uses[id(p)] == 1, f"{name}multihead_attn.in_proj_{kind} is also used elsewhere; lsmini replaces "
                                       f"it with new parameters, which would untie it")
        _require(len({p.requires_grad for p in params}) == 1,
                 f"its layers' multihead_attn.in_proj_{kind} differ in requires_grad; lsmini stacks their K/V rows "
                 f"into one parameter")


def _convert_layer(layer, torch_cls, limits, uses):
    config = _layer_config(layer, torch_cls, limits)
    _check_plain(layer)
    batch_first = bool(layer.self_attn.batch_first)
    sources = dict(layer.named_parameters(remove_duplicate=False))
    if torch_cls is nn.TransformerEncoderLayer:
        new = ConvertedTransformerEncoderLayer(config, batch_first=batch_first, device="meta")
    else:
        _check_cross_parameters([layer], [""], uses)
        new = ConvertedTransformerDecoderLayer(config, batch_first=batch_first, device="meta")
        sources.update(_cross_sources_to_lsmini([layer], [""], stacked=False))
    return _adopt(new, sources)


def _convert_stack(stack, torch_cls, limits, uses):
    _check_class(stack, torch_cls)
    layer_cls = nn.TransformerEncoderLayer if torch_cls is nn.TransformerEncoder else nn.TransformerDecoderLayer
    layers = getattr(stack, "layers", None)
    _require(isinstance(layers, nn.ModuleList) and len(layers) > 0, "it has no layers (a non-empty ModuleList)")
    extra = sorted(set(stack._modules) - {"layers", "norm"}) + sorted(stack._parameters) + sorted(stack._buffers)
    _require(not extra, f"it has members torch.nn.{torch_cls.__name__} does not: {', '.join(extra)}")
    configs = []
    for i, layer in enumerate(layers):
        _require(isinstance(layer, layer_cls),
                 f"layers.{i} is {type(layer).__name__}, not torch.nn.{layer_cls.__name__}")
        try:
            configs.append(_layer_config(layer, layer_cls, limits))
        except _Unsupported as e:
            raise _Unsupported(f"layers.{i}: {e}") from None
        if configs[i] != configs[0]:
            pairs = [(f.name, getattr(configs[0], f.name), getattr(configs[i], f.name))
                     for f in dataclasses.fields(TransformerConfig)]
            diff = [f"{name} {a!r} vs {b!r}" for name, a, b in pairs if a != b]
            raise _Unsupported(f"its layers differ (layers.0 and layers.{i}: {', '.join(diff)}); an lsmini stack "
                               f"shares one config")
        _require(layer.self_attn.batch_first == layers[0].self_attn.batch_first, "its layers differ in batch_first")
    _check_plain(stack)
    norm = getattr(stack, "norm", None)
    if norm is not None:
        _check_norm(norm, "norm", configs[0].hidden_size)
    config, n, batch_first = configs[0], len(layers), bool(layers[0].self_attn.batch_first)
    sources = dict(stack.named_parameters(remove_duplicate=False))
    new_norm = None if norm is None else _lsmini_norm(norm)
    if torch_cls is nn.TransformerEncoder:
        new = ConvertedTransformerEncoder(config, n, norm=new_norm, batch_first=batch_first,
                                          enable_nested_tensor=getattr(stack, "enable_nested_tensor", True),
                                          mask_check=getattr(stack, "mask_check", True), device="meta")
    else:
        names = [f"layers.{i}." for i in range(n)]
        _check_cross_parameters(list(layers), names, uses)
        new = ConvertedTransformerDecoder(config, n, norm=new_norm, batch_first=batch_first, device="meta")
        sources.update(_cross_sources_to_lsmini(list(layers), names, stacked=True))
    return _adopt(new, sources)


def _lsmini_norm(norm, converted=False):
    """The lsmini LayerNorm / RMSNorm (Converted* when ``converted``) of a torch one, on the meta device."""
    affine = norm.weight is not None
    if isinstance(norm, (nn.RMSNorm, RMSNorm)):
        return (ConvertedRMSNorm if converted else RMSNorm)(norm.normalized_shape, eps=norm.eps,
                                                            elementwise_affine=affine, device="meta")
    return (ConvertedLayerNorm if converted else LayerNorm)(norm.normalized_shape, eps=norm.eps,
                                                            elementwise_affine=affine, bias=norm.bias is not None,
                                                            device="meta")


def _convert_norm(norm):
    _check_norm(norm, "it")
    _check_plain(norm)
    return _adopt(_lsmini_norm(norm, converted=True), dict(norm.named_parameters(remove_duplicate=False)))


_TORCH_CLASSES = (nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer,
                  nn.LayerNorm, nn.RMSNorm)


def _state_dict_layout(module):
    return [(k, tuple(v.shape)) for k, v in module.state_dict().items()]


def _converted(module, limits, uses):
    """(the replacement, None) or (None, why not)."""
    torch_cls = next(c for c in _TORCH_CLASSES if isinstance(module, c))
    try:
        if torch_cls in (nn.LayerNorm, nn.RMSNorm):
            new = _convert_norm(module)
        elif torch_cls in (nn.TransformerEncoder, nn.TransformerDecoder):
            new = _convert_stack(module, torch_cls, limits, uses)
        else:
            new = _convert_layer(module, torch_cls, limits, uses)
    except _Unsupported as e:
        return None, str(e)
    before, after = _state_dict_layout(module), _state_dict_layout(new)
    if before != after:  # something no check above knows of (a parameter a subclass added, say)
        odd = sorted(set(before) ^ set(after)) or "the order"
        return None, f"its state_dict would change ({odd})"
    if not module.training:  # lsmini builds modules in training mode, as torch does
        new.eval()
    return new, None


# ---- the report ---------------------------------------------------------------------------------------------------
class Replaced(NamedTuple):
    name: str  # qualified name in the model ("" for the model itself)
    torch_type: str
    lsmini_type: str


class Kept(NamedTuple):
    name: str
    type: str
    reason: str


class ConversionReport:
    """What ``convert`` (or ``unconvert``) did.

    ``replaced``: [Replaced(name, torch_type, lsmini_type)], the modules swapped, by qualified name (for
    unconvert too: torch_type is what the module became). ``kept``: [Kept(name, type, reason)], the modules
    convert found but left as they are. ``model``: the model, converted in place — or, when the model
    itself was replaced (it has no parent to hold the new module), the replacement. ``len(report)`` and
    ``bool(report)`` count the replaced modules; ``str(report)`` is a readable table.
    """

    def __init__(self, action, model):
        self.action, self.model = action, model
        self.replaced, self.kept = [], []

    def __len__(self):
        return len(self.replaced)

    def __bool__(self):
        return bool(self.replaced)

    def __repr__(self):
        return f"ConversionReport({self.action}: {len(self.replaced)} replaced, {len(self.kept)} kept)"

    def __str__(self):
        def name(n):
            return n or "(the model)"

        verb = "put back" if self.action == "unconvert" else "replaced"
        lines = [f"lsmini.{self.action}: {len(self.replaced)} module(s) {verb}, {len(self.kept)} kept"]
        width = max([len(name(r.name)) for r in self.replaced + self.kept] + [0])
        for r in self.replaced:
            old, new = (r.lsmini_type, r.torch_type) if self.action == "unconvert" else (r.torch_type, r.lsmini_type)
            lines.append(f"  {verb:9} {name(r.name):{width}}  {old} -> {new}")
        for k in self.kept:
            lines.append(f"  {'kept':9} {name(k.name):{width}}  {k.type}: {k.reason}")
        return "\n".join(lines)


# ---- walking the model --------------------------------------------------------------------------------------------
def _is_lsmini(module):
    return type(module).__module__.split(".")[0] == "lsmini"


_DESCEND = object()  # what a walk's decide returns to look inside a module


def _walk(model, decide):
    """decide(name, module) → a replacement, None (leave it, don't look inside) or ``_DESCEND``, once per
    module object; returns [(parent, key, module, replacement)] for every place a replaced module sits
    (a module shared by several parents is replaced by one new module everywhere)."""
    decided, places = {}, []

    def visit(name, module, parent, key):
        if id(module) not in decided:
            decided[id(module)] = decide(name, module)
            if decided[id(module)] is _DESCEND:
                for child_key, child in module._modules.items():
                    if child is not None:
                        visit(f"{name}.{child_key}" if name else child_key, child, module, child_key)
                return
        new = decided[id(module)]
        if new is not None and new is not _DESCEND:
            places.append((parent, key, module, new))

    visit("", model, None, None)
    return places


def _parameter_uses(model):
    """How many (module, attribute) places hold each parameter (by id)."""
    uses = Counter()
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                uses[id(p)] += 1
    return uses


def _swap(report, places):
    for parent, key, _, new in places:
        if parent is None:
            report.model = new
        else:
            setattr(parent, key, new)


def convert(model, max_batch_tokens=8192, max_seq_len=512):
    """Replace, in place, the torch.nn Transformer modules and norms of ``model`` that lsmini can represent
    with lsmini-backed modules that keep torch's forward signatures, masks, layout and state_dict keys (see
    this module's docstring for the mask rules). Returns a ``ConversionReport`` of what was replaced and of
    what was kept, with the reason.

    max_batch_tokens, max_seq_len: the largest batch·len and len the converted torch.nn layers accept (lsmini's
    TransformerConfig); longer inputs raise ValueError. Hugging Face blocks (convert_hf) take what their model
    takes. Convert before wrapping the model in
    DistributedDataParallel, and build the optimizer afterwards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"lsmini.convert: model must be an nn.Module, got {type(model).__name__}")
    try:
        TransformerConfig(1, 1, 1, max_batch_tokens=max_batch_tokens, max_seq_len=max_seq_len)
    except (TypeError, ValueError) as e:
        raise type(e)(f"lsmini.convert: {str(e).removeprefix('TransformerConfig: ')}") from None
    limits = (max_batch_tokens, max_seq_len)
    uses = _parameter_uses(model)
    report = ConversionReport("convert", model)

    def decide(name, module):
        if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise TypeError(f"lsmini.convert: {name or 'the model'} is wrapped in {type(module).__name__}; convert "
                            f"the model first, then wrap it")
        if _is_lsmini(module):
            return None
        if convert_hf.causal_lm(module) and not convert_hf.has_fused_loss(module):
            heads.append((name, module))  # its loss is fused below, when all its blocks were converted
            return _DESCEND
        if convert_hf.hf_block(module):
            new, reason = convert_hf.converted(module)
        elif not isinstance(module, _TORCH_CLASSES):
            return _DESCEND
        else:
            new, reason = _converted(module, limits, uses)
        if new is None:
            report.kept.append(Kept(name, type(module).__name__, reason))
        else:
            report.replaced.append(Replaced(name, type(module).__name__, type(new).__name__))
        return new

    heads = []
    _swap(report, _walk(model, decide))
    for name, module in reversed(heads):  # a model half converted is not what the fused loss is for
        inside = [k for k in report.kept if not name or k.name.startswith(name + ".")]
        if not inside:
            convert_hf.fuse_loss(module)
            report.replaced.insert(0, Replaced(name, type(module).__name__, "fused linear + cross-entropy loss"))
    return report


# ---- going back -----------------------------------------------------------------------------------------------
def _torch_norm(norm, device="meta"):
    if isinstance(norm, RMSNorm):
        return nn.RMSNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.weight is not None,
                          device=device)
    return nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.weight is not None,
                        bias=norm.bias is not None, device=device)


def _unconverted(module):
    """The torch.nn module a converted one came from, around the same parameters (the decoder's cross-attention
    in_proj joined anew)."""
    sources = dict(module.named_parameters(remove_duplicate=False))
    if isinstance(module, (ConvertedLayerNorm, ConvertedRMSNorm)):
        return _adopt(_torch_norm(module), sources).train(module.training)
    if isinstance(module, (ConvertedTransformerDecoderLayer, ConvertedTransformerDecoder)):
        sources.update(_cross_sources_to_torch(module))
    encoder = isinstance(module, (ConvertedTransformerEncoderLayer, ConvertedTransformerEncoder))
    layer_cls = nn.TransformerEncoderLayer if encoder else nn.TransformerDecoderLayer
    lsmini_layers = [module] if isinstance(module, (ConvertedTransformerEncoderLayer,
                                                     ConvertedTransformerDecoderLayer)) else list(module.layers)
    layer = torch_layer(layer_cls, lsmini_layers[0].current_config(), next(module.parameters()),
                        batch_first=module.batch_first, device="meta")
    if isinstance(module, (ConvertedTransformerEncoderLayer, ConvertedTransformerDecoderLayer)):
        new = layer
    else:
        norm = None if module.norm is None else _torch_norm(module.norm)
        with warnings.catch_warnings():  # torch's warning about nested tensors was given when the model was built
            warnings.simplefilter("ignore", UserWarning)
            if encoder:
                new = nn.TransformerEncoder(layer, len(module.layers), norm=norm, mask_check=module.mask_check,
                                            enable_nested_tensor=module.enable_nested_tensor)
            else:
                new = nn.TransformerDecoder(layer, len(module.layers), norm=norm)
        for torch_layer_i, lsmini_layer in zip(new.layers, lsmini_layers):  # each with the dropouts it holds now
            _copy_dropouts(torch_layer_i, lsmini_layer)
    return _adopt(new, sources).train(module.training)


def _copy_dropouts(dst, src):
    """dst (a torch.nn layer) gets the dropout probabilities src (an lsmini layer) holds: the modules and
    attributes of the same names."""
    for name, module in src.named_modules():
        if isinstance(module, nn.Dropout):
            dst.get_submodule(name).p = module.p
    for name in ("self_attn", "multihead_attn"):
        if hasattr(src, name):
            getattr(dst, name).dropout = getattr(src, name).dropout


_CONVERTED = (ConvertedLayerNorm, ConvertedRMSNorm, ConvertedTransformerEncoderLayer, ConvertedTransformerDecoderLayer,
              ConvertedTransformerEncoder, ConvertedTransformerDecoder)


def unconvert(model):
    """Put the torch.nn modules back in place of what ``convert`` replaced in ``model``, around the same
    parameters (the decoder's cross-attention in_proj joined anew from lsmini's split projections). Returns a
    ``ConversionReport`` of the modules put back; ``report.model`` is the model (or, when the model itself was
    a converted module, its torch.nn replacement)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"lsmini.unconvert: model must be an nn.Module, got {type(model).__name__}")
    report = ConversionReport("unconvert", model)

    def decide(name, module):
        if convert_hf.has_fused_loss(module):
            convert_hf.unfuse_loss(module)
            report.replaced.append(Replaced(name, type(module).__name__, "fused linear + cross-entropy loss"))
            return _DESCEND
        if convert_hf.is_converted(module):
            new = convert_hf.unconverted(module)
            report.replaced.append(Replaced(name, type(new).__name__, type(module).__name__))
            return new
        if isinstance(module, _CONVERTED):
            new = _unconverted(module)
            report.replaced.append(Replaced(name, type(new).__name__, type(module).__name__))
            return new
        return None if _is_lsmini(module) else _DESCEND

    _swap(report, _walk(model, decide))
    return report
