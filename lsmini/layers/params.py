"""Parameter containers of the encoder and decoder layers, named as in torch.nn (so state_dicts and
``from_torch`` / ``to_torch`` line up), and their initialisation. They hold weights only; the layer computes
with them (runtime.py)."""
import math

import torch
from torch import nn


def uniform_(t, fan_in, fan_out):
    """Xavier-uniform with explicit fans (a slice of a fused projection keeps the fused init)."""
    a = math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        return t.uniform_(-a, a)


def _maybe_bias(owner, name, shape, bias, kw):
    if bias:
        setattr(owner, name, nn.Parameter(torch.empty(shape, **kw)))
    else:
        owner.register_parameter(name, None)


def _zero(t):
    if t is not None:
        nn.init.zeros_(t)


class SelfAttentionParams(nn.Module):
    """Parameters of a self-attention block, named as in torch.nn.MultiheadAttention: in_proj_weight
    [(heads + 2·kv_heads)·head_dim, H] (rows: Q, K, V; [3H, H] without grouped K/V), in_proj_bias (None
    with bias=False), out_proj (Linear H → H), with qk_norm q_norm_weight and k_norm_weight [head_dim]
    (RMSNorm weights of each head's Q and K), and ``dropout``, the probability of the attention-probability
    dropout (a float, as MultiheadAttention's; the layer reads it at every call). Holds weights only; the
    layer computes with them."""

    def __init__(self, hidden, dropout=0.0, heads=1, kv_heads=None, bias=True, qk_norm=False, device=None,
                 dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.dropout = float(dropout)
        head_dim = hidden // heads
        rows = (heads + 2 * (heads if kv_heads is None else kv_heads)) * head_dim
        self.in_proj_weight = nn.Parameter(torch.empty(rows, hidden, **kw))
        _maybe_bias(self, "in_proj_bias", rows, bias, kw)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias, **kw)
        if qk_norm:
            self.q_norm_weight = nn.Parameter(torch.ones(head_dim, **kw))
            self.k_norm_weight = nn.Parameter(torch.ones(head_dim, **kw))
        else:
            self.register_parameter("q_norm_weight", None)
            self.register_parameter("k_norm_weight", None)
        self.reset_parameters()

    def reset_parameters(self):
        h = self.out_proj.in_features
        uniform_(self.in_proj_weight, h, self.in_proj_weight.shape[0])
        _zero(self.in_proj_bias)
        uniform_(self.out_proj.weight, h, h)
        _zero(self.out_proj.bias)
        for w in (self.q_norm_weight, self.k_norm_weight):
            if w is not None:
                nn.init.ones_(w)


class CrossAttentionParams(nn.Module):
    """Parameters of a cross-attention block: q_proj_weight [H, H], q_proj_bias, out_proj, and — unless
    the layer belongs to a TransformerDecoder, which holds the K/V projections of all its layers in one
    parameter — kv_proj_weight [2·kv_heads·head_dim, H] (rows: K, V; [2H, H] without grouped K/V) and
    kv_proj_bias; biases None with bias=False; ``dropout`` as SelfAttentionParams'."""

    def __init__(self, hidden, own_kv=True, dropout=0.0, kv_width=None, bias=True, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        kv_width = hidden if kv_width is None else kv_width
        self.dropout = float(dropout)
        self.q_proj_weight = nn.Parameter(torch.empty(hidden, hidden, **kw))
        _maybe_bias(self, "q_proj_bias", hidden, bias, kw)
        if own_kv:
            self.kv_proj_weight = nn.Parameter(torch.empty(2 * kv_width, hidden, **kw))
            _maybe_bias(self, "kv_proj_bias", 2 * kv_width, bias, kw)
        else:
            self.register_parameter("kv_proj_weight", None)
            self.register_parameter("kv_proj_bias", None)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias, **kw)
        self.reset_parameters()

    @property
    def owns_kv(self):
        return self.kv_proj_weight is not None

    def reset_parameters(self):
        h = self.out_proj.in_features
        # fans of torch.nn.MultiheadAttention's fused [3H, H] in_proj, which these rows replace
        uniform_(self.q_proj_weight, h, 3 * h)
        _zero(self.q_proj_bias)
        if self.owns_kv:
            uniform_(self.kv_proj_weight, h, 3 * h)
            _zero(self.kv_proj_bias)
        uniform_(self.out_proj.weight, h, h)
        _zero(self.out_proj.bias)


def reset_ffn(linear1, linear2):
    uniform_(linear1.weight, linear1.in_features, linear1.out_features)
    _zero(linear1.bias)
    uniform_(linear2.weight, linear2.in_features, linear2.out_features)
    _zero(linear2.bias)
