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


class SelfAttentionParams(nn.Module):
    """Parameters of a self-attention block, named as in torch.nn.MultiheadAttention: in_proj_weight
    [3H, H] (rows: Q, K, V), in_proj_bias [3H], out_proj (Linear H → H), and ``dropout``, the probability of
    the attention-probability dropout (a float, as MultiheadAttention's; the layer reads it at every call).
    Holds weights only; the layer computes with them."""

    def __init__(self, hidden, dropout=0.0, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.dropout = float(dropout)
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden, **kw))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * hidden, **kw))
        self.out_proj = nn.Linear(hidden, hidden, **kw)
        self.reset_parameters()

    def reset_parameters(self):
        h = self.out_proj.in_features
        uniform_(self.in_proj_weight, h, 3 * h)
        nn.init.zeros_(self.in_proj_bias)
        uniform_(self.out_proj.weight, h, h)
        nn.init.zeros_(self.out_proj.bias)


class CrossAttentionParams(nn.Module):
    """Parameters of a cross-attention block: q_proj_weight [H, H], q_proj_bias, out_proj, and — unless
    the layer belongs to a TransformerDecoder, which holds the K/V projections of all its layers in one
    parameter — kv_proj_weight [2H, H] (rows: K, V) and kv_proj_bias [2H]; ``dropout`` as
    SelfAttentionParams'."""

    def __init__(self, hidden, own_kv=True, dropout=0.0, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.dropout = float(dropout)
        self.q_proj_weight = nn.Parameter(torch.empty(hidden, hidden, **kw))
        self.q_proj_bias = nn.Parameter(torch.empty(hidden, **kw))
        if own_kv:
            self.kv_proj_weight = nn.Parameter(torch.empty(2 * hidden, hidden, **kw))
            self.kv_proj_bias = nn.Parameter(torch.empty(2 * hidden, **kw))
        else:
            self.register_parameter("kv_proj_weight", None)
            self.register_parameter("kv_proj_bias", None)
        self.out_proj = nn.Linear(hidden, hidden, **kw)
        self.reset_parameters()

    @property
    def owns_kv(self):
        return self.kv_proj_weight is not None

    def reset_parameters(self):
        h = self.out_proj.in_features
        # fans of torch.nn.MultiheadAttention's fused [3H, H] in_proj, which these rows replace
        uniform_(self.q_proj_weight, h, 3 * h)
        nn.init.zeros_(self.q_proj_bias)
        if self.owns_kv:
            uniform_(self.kv_proj_weight, h, 3 * h)
            nn.init.zeros_(self.kv_proj_bias)
        uniform_(self.out_proj.weight, h, h)
        nn.init.zeros_(self.out_proj.bias)


def reset_ffn(linear1, linear2):
    uniform_(linear1.weight, linear1.in_features, linear1.out_features)
    nn.init.zeros_(linear1.bias)
    uniform_(linear2.weight, linear2.in_features, linear2.out_features)
    nn.init.zeros_(linear2.bias)
