"""The description of one layer call: its blocks and parameters, and the options both implementations of a
layer read — the kernel path (the operators ``lsmini::layer`` / ``lsmini::layer_backward``,
csrc/layers/layer.cpp) and the reference (reference.py).

A layer is a sequence of blocks — "self" attention, "cross" attention, "ffn" — each with the six
parameters of ``BLOCK_PARAMS``: its core's input and output GEMM weights and biases, then its norm's
weight and bias. ``LayerOptions`` holds everything else a call needs. Block kinds of newer models are new
values of these fields, not new code paths: ``norm`` ("layer_norm" or "rms_norm": x·rsqrt(mean(x²) + eps)·weight,
no bias), ``activation`` ("relu", "gelu", "gelu_tanh", or a gated FFN "swiglu"/"geglu" whose first GEMM has
2·ffn rows [gate | up]: dropout(act(gate)·up), act silu or erf gelu), ``kv_heads`` (dividing ``heads``: a QKV
weight of (heads + 2·kv_heads)·head_dim rows [Q | K | V], query head h reading K/V head h // (heads //
kv_heads)), ``rotary_dim`` (0, or rotary positions, rotate-half, on the first rotary_dim dims of each head of the
self-attention's Q and K, from cos/sin tables the caller passes), ``qk_norm`` (an RMSNorm over head_dim on each
head of the self-attention's Q and K before rotary, its two weights [head_dim] after every block's parameters:
``QK_NORM_PARAMS``) and absent biases (None entries). Both implementations implement every option.
"""
import math
from typing import NamedTuple

# The parameters of every block, in the order the layer passes them.
BLOCK_PARAMS = ("weight_in", "bias_in", "weight_out", "bias_out", "norm_weight", "norm_bias")
PARAMS_PER_BLOCK = len(BLOCK_PARAMS)
GEMM_WEIGHTS = (0, 2)  # positions of the GEMM weights within a block's parameters
# After every block's parameters, with qk_norm: the RMSNorm weights [head_dim] of the self-attention's Q and K.
QK_NORM_PARAMS = ("q_norm_weight", "k_norm_weight")
# TransformerConfig.norm → LayerOptions.norm
NORMS = {"layernorm": "layer_norm", "rmsnorm": "rms_norm"}
GATED = {"swiglu": "silu", "geglu": "gelu"}  # gated activations → the activation of their gate


class LayerOptions(NamedTuple):
    """The immutable options of one layer call: its blocks, sizes, numerics, dropout probabilities (0 when
    not training) and whether backward recomputes instead of saving. (A NamedTuple: built on every layer
    call, it costs a microsecond where a frozen dataclass costs seven.)"""

    kinds: tuple
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    eps: float
    norm: str
    pre_ln: bool
    activation: str
    training: bool
    dropout: float
    attn_dropout: float
    activation_dropout: float
    causal: bool
    recompute: bool
    rotary_dim: int
    qk_norm: bool

    @classmethod
    def of(cls, kinds, config, training, causal, recompute=True, dropouts=None):
        """dropouts: (residual, attention, activation) probabilities, else the config's."""
        training = bool(training)
        if dropouts is None:
            dropouts = (config.dropout, config.attn_dropout, config.activation_dropout)
        dropout, attn_dropout, activation_dropout = (float(p) if training else 0.0 for p in dropouts)
        return cls(kinds=tuple(kinds), hidden=config.hidden_size, ffn=config.ffn_size, heads=config.num_heads,
                   kv_heads=config.kv_heads, head_dim=config.head_dim, scale=1.0 / math.sqrt(config.head_dim),
                   eps=float(config.layer_norm_eps), norm=NORMS[config.norm], pre_ln=config.pre_layer_norm,
                   activation=config.activation, training=training, dropout=dropout, attn_dropout=attn_dropout,
                   activation_dropout=activation_dropout, causal=bool(causal), recompute=bool(recompute),
                   rotary_dim=config.rotary_dims, qk_norm=config.qk_norm)

    def op_args(self):
        """The options as the operators' schemas take them (after the tensors)."""
        return (",".join(self.kinds), self.hidden, self.ffn, self.heads, self.kv_heads, self.scale, self.eps,
                self.norm, self.pre_ln, self.activation, self.dropout, self.attn_dropout, self.activation_dropout,
                self.causal, self.recompute, self.rotary_dim, self.qk_norm)
