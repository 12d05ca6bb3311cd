"""torch.nn interop of the encoder and decoder layers: the TransformerConfig of a torch.nn layer, an empty
torch.nn layer of a config, the checks that a torch.nn layer is one lsmini can represent, parameter
copies by name, and torch's attention masks read as what lsmini takes (a key padding mask, causal or not)."""
import torch
import torch.nn.functional as F
from torch import nn

from lsmini.layers.config import TransformerConfig


def torch_activation_name(layer):
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    name = getattr(act, "__qualname__", None) or repr(act)  # torch.tanh's repr carries a memory address
    raise ValueError(f"from_torch: unsupported activation {name}; lsmini layers support relu, gelu and "
                     f"gelu with approximate='tanh'")


def torch_activation(name):
    return {"relu": "relu", "gelu": "gelu", "gelu_tanh": nn.GELU(approximate="tanh")}[name]


def norm_eps(norm, dtype):
    """A torch norm's eps as a number: nn.RMSNorm's eps=None is torch.finfo(dtype).eps of its input."""
    return torch.finfo(dtype).eps if norm.eps is None else norm.eps


def config_from_torch(layer, max_batch_tokens, max_seq_len):
    """The TransformerConfig of a torch.nn.TransformerEncoderLayer / DecoderLayer (its norms nn.LayerNorm or
    nn.RMSNorm, built with bias=True or bias=False). Dropouts map as: dropout1 → dropout, self_attn.dropout →
    attn_dropout, the FFN's inner dropout → activation_dropout."""
    sa = layer.self_attn
    return TransformerConfig(
        hidden_size=sa.embed_dim, num_heads=sa.num_heads, ffn_size=layer.linear1.out_features,
        dropout=layer.dropout1.p, attn_dropout=float(sa.dropout), activation_dropout=layer.dropout.p,
        activation=torch_activation_name(layer), pre_layer_norm=bool(layer.norm_first),
        layer_norm_eps=norm_eps(layer.norm1, sa.in_proj_weight.dtype), max_batch_tokens=max_batch_tokens,
        max_seq_len=max_seq_len, norm="rmsnorm" if isinstance(layer.norm1, nn.RMSNorm) else "layernorm",
        bias=layer.linear1.bias is not None)


def torch_layer(torch_cls, config, like, batch_first=True, device=None):
    """An empty torch_cls (nn.TransformerEncoderLayer / DecoderLayer) with config's sizes and dropouts, on
    like's dtype and device (or on ``device``: "meta" gives a shell whose parameters the caller sets); its
    norms nn.RMSNorm for norm="rmsnorm". ValueError for the options torch's layers lack (gated FFN, grouped
    K/V, rotary, QK-norm)."""
    c = config
    lacking = [f"{name}={getattr(c, name)!r}" for name, default in
               (("num_kv_heads", None), ("rotary", None), ("qk_norm", False)) if getattr(c, name) != default]
    if c.gated:
        lacking.insert(0, f"activation={c.activation!r}")
    if lacking:
        raise ValueError(f"to_torch: torch.nn.{torch_cls.__name__} has no equivalent of {', '.join(lacking)}")
    kw = {"device": like.device if device is None else device, "dtype": like.dtype}
    t = torch_cls(c.hidden_size, c.num_heads, c.ffn_size, dropout=c.dropout, activation=torch_activation(c.activation),
                  layer_norm_eps=c.layer_norm_eps, batch_first=batch_first, norm_first=c.pre_layer_norm,
                  bias=c.bias, **kw)
    if c.norm == "rmsnorm":
        for name in ("norm1", "norm2", "norm3"):
            if hasattr(t, name):
                setattr(t, name, nn.RMSNorm(c.hidden_size, eps=c.layer_norm_eps, **kw))
    t.self_attn.dropout = c.attn_dropout
    if hasattr(t, "multihead_attn"):
        t.multihead_attn.dropout = c.attn_dropout
    t.dropout.p = c.activation_dropout
    return t


def _bias_rule(layer):
    """Whether the torch layer has biases: those of linear1 (lsmini has them everywhere or nowhere)."""
    return layer.linear1.bias is not None


def check_torch_attention(layer, what):
    """The torch layer's attention ``what`` as lsmini represents it: kdim == vdim == embed_dim, no add_bias_kv /
    add_zero_attn, biases present exactly when the layer's linear1 has one."""
    mha, bias = getattr(layer, what), _bias_rule(layer)
    if not mha._qkv_same_embed_dim:
        raise ValueError(f"from_torch: {what} must have kdim == vdim == embed_dim")
    if (mha.in_proj_bias is not None, mha.out_proj.bias is not None) != (bias, bias):
        raise ValueError(f"from_torch: {what}'s biases differ from linear1's (bias={bias}); lsmini layers have "
                         f"biases everywhere or nowhere")
    if getattr(mha, "bias_k", None) is not None or getattr(mha, "add_zero_attn", False):
        raise ValueError(f"from_torch: {what} uses add_bias_kv / add_zero_attn, which lsmini layers do not support")


def check_torch_linear_norm(layer, norms):
    """linear1/linear2 biases both present or both absent; the norms all nn.LayerNorm (a weight, and a bias
    exactly when the linears have them) or all nn.RMSNorm (a weight)."""
    bias = _bias_rule(layer)
    if (layer.linear2.bias is not None) != bias:
        raise ValueError("from_torch: one of linear1 and linear2 has a bias, the other none; lsmini layers have "
                         "biases everywhere or nowhere")
    kinds = {type(getattr(layer, name)).__name__ for name in norms}
    if len(kinds) > 1:
        raise ValueError(f"from_torch: its norms mix {' and '.join(sorted(kinds))}; an lsmini layer has one kind")
    for name in norms:
        n = getattr(layer, name)
        if isinstance(n, nn.RMSNorm):
            if n.weight is None:
                raise ValueError(f"from_torch: {name} has no weight (elementwise_affine=False); lsmini layers' "
                                 f"RMSNorms have one")
        elif not isinstance(n, nn.LayerNorm):
            raise ValueError(f"from_torch: {name} is {type(n).__name__}, not torch.nn.LayerNorm or torch.nn.RMSNorm")
        elif n.weight is None:
            raise ValueError(f"from_torch: {name} has no affine weight; lsmini layers' LayerNorms have one")
        elif (n.bias is not None) != bias:
            raise ValueError(f"from_torch: {name}'s bias differs from linear1's (bias={bias}); lsmini layers have "
                             f"biases everywhere or nowhere")


def copy_params(dst, src):
    """dst.named_parameters() ← the same names in the dict src (tensors), shapes checked."""
    with torch.no_grad():
        for name, p in dst.named_parameters():
            s = src[name]
            if s.shape != p.shape:
                raise ValueError(f"copy: {name} has shape {tuple(p.shape)}, source {tuple(s.shape)}")
            p.copy_(s)


# ---- torch's attention masks ------------------------------------------------------------------------------
# lsmini's layers take a bool key padding mask (True = pad) and a causal flag, nothing else. torch's take
# additive float masks too; those that mean the same as lsmini's arguments are read as them (by value: one
# host sync, the cost torch's own causal-mask detection has), any other raises ValueError. Values cannot be
# read while torch.compile traces, so then only what needs no values is accepted.
MASK_RULE = "lsmini supports only key padding masks and causal self-attention"


def causal_mask_like(length, mask):
    """torch's causal mask (nn.Transformer.generate_square_subsequent_mask) in mask's dtype and device:
    −inf (float) or True (bool) above the diagonal, 0 / False elsewhere."""
    above = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu(1)
    if mask.dtype == torch.bool:
        return above
    return torch.zeros(length, length, dtype=mask.dtype, device=mask.device).masked_fill_(above, float("-inf"))


def self_attention_is_causal(owner, name, mask, flag_name, is_causal, length):
    """Whether a torch self-attention call with attention mask ``mask`` [length, length] and hint
    ``is_causal`` (True, False or None) is causal. Causal when is_causal is True (torch's hint that mask is
    the causal mask); full attention when mask is None; otherwise mask must equal torch's causal mask."""
    if is_causal is not None and not isinstance(is_causal, bool):
        raise TypeError(f"{owner}: {flag_name} must be a bool or None, got {type(is_causal).__name__}")
    if mask is None:
        return bool(is_causal)
    if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise TypeError(f"{owner}: {name} must be None or a bool or float Tensor, got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if tuple(mask.shape) != (length, length):
        raise ValueError(f"{owner}: {name} must be None or the causal mask of shape [len, len] = [{length}, {length}], "
                         f"got {tuple(mask.shape)}; {MASK_RULE}")
    if is_causal:
        return True
    if torch.compiler.is_compiling():
        raise ValueError(f"{owner}: under torch.compile lsmini cannot read {name} to see that it is the causal mask; "
                         f"pass {flag_name}=True with it ({MASK_RULE})")
    if not torch.equal(mask, causal_mask_like(length, mask)):
        raise ValueError(f"{owner}: {name} is not the causal mask (nn.Transformer.generate_square_subsequent_mask"
                         f"({length}), or its bool equivalent); {MASK_RULE}")
    return True


def key_padding_mask_from_torch(owner, name, mask, batch, length):
    """torch's key padding mask [batch, length] as lsmini takes it: bool, True = pad. torch adds a float
    mask to the attention scores; one holding only 0 (attend) and −inf (pad) means the same as a bool mask
    and is converted."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise TypeError(f"{owner}: {name} must be None or a bool (True = pad) or float Tensor, got "
                        f"{getattr(mask, 'dtype', type(mask).__name__)}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"{owner}: {name} must have shape [batch, len] = [{batch}, {length}], got {tuple(mask.shape)}")
    if mask.dtype == torch.bool:
        return mask
    if torch.compiler.is_compiling():
        raise ValueError(f"{owner}: under torch.compile lsmini cannot read the values of the float {name}; pass a "
                         f"bool mask (True = pad)")
    pad = mask == float("-inf")
    if not bool((pad | (mask == 0)).all()):
        raise ValueError(f"{owner}: a float {name} may hold only 0 (attend) and -inf (pad), as a bool mask would; "
                         f"{MASK_RULE}, not additive attention biases")
    return pad
