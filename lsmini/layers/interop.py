"""torch.nn interop of the encoder and decoder layers: the TransformerConfig of a torch.nn layer, an empty
torch.nn layer of a config, the checks that a torch.nn layer is one lsmini can represent, and parameter
copies by name."""
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
    raise ValueError(f"from_torch: unsupported activation {act!r}; lsmini layers support relu, gelu and "
                     f"gelu with approximate='tanh'")


def torch_activation(name):
    return {"relu": "relu", "gelu": "gelu", "gelu_tanh": nn.GELU(approximate="tanh")}[name]


def config_from_torch(layer, max_batch_tokens, max_seq_len):
    """The TransformerConfig of a torch.nn.TransformerEncoderLayer / DecoderLayer. Dropouts map as:
    dropout1 → dropout, self_attn.dropout → attn_dropout, the FFN's inner dropout → activation_dropout."""
    sa = layer.self_attn
    return TransformerConfig(
        hidden_size=sa.embed_dim, num_heads=sa.num_heads, ffn_size=layer.linear1.out_features,
        dropout=layer.dropout1.p, attn_dropout=float(sa.dropout), activation_dropout=layer.dropout.p,
        activation=torch_activation_name(layer), pre_layer_norm=bool(layer.norm_first),
        layer_norm_eps=layer.norm1.eps, max_batch_tokens=max_batch_tokens, max_seq_len=max_seq_len)


def torch_layer(torch_cls, config, like):
    """An empty torch_cls (nn.TransformerEncoderLayer / DecoderLayer, batch_first) with config's sizes and
    dropouts, on like's device and dtype."""
    c = config
    t = torch_cls(c.hidden_size, c.num_heads, c.ffn_size, dropout=c.dropout, activation=torch_activation(c.activation),
                  layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=c.pre_layer_norm, device=like.device,
                  dtype=like.dtype)
    t.self_attn.dropout = c.attn_dropout
    if hasattr(t, "multihead_attn"):
        t.multihead_attn.dropout = c.attn_dropout
    t.dropout.p = c.activation_dropout
    return t


def check_torch_attention(mha, what):
    if not mha._qkv_same_embed_dim:
        raise ValueError(f"from_torch: {what} must have kdim == vdim == embed_dim")
    if mha.in_proj_bias is None or mha.out_proj.bias is None:
        raise ValueError(f"from_torch: {what} has no biases (bias=False); lsmini layers always have them")
    if getattr(mha, "bias_k", None) is not None or getattr(mha, "add_zero_attn", False):
        raise ValueError(f"from_torch: {what} uses add_bias_kv / add_zero_attn, which lsmini layers do not support")


def check_torch_linear_norm(layer, norms):
    for name in ("linear1", "linear2"):
        if getattr(layer, name).bias is None:
            raise ValueError(f"from_torch: {name} has no bias (bias=False); lsmini layers always have them")
    for name in norms:
        n = getattr(layer, name)
        if n.weight is None or n.bias is None:
            raise ValueError(f"from_torch: {name} has no affine weight/bias; lsmini layers always have them")


def copy_params(dst, src):
    """dst.named_parameters() ← the same names in the dict src (tensors), shapes checked."""
    with torch.no_grad():
        for name, p in dst.named_parameters():
            s = src[name]
            if s.shape != p.shape:
                raise ValueError(f"copy: {name} has shape {tuple(p.shape)}, source {tuple(s.shape)}")
            p.copy_(s)
