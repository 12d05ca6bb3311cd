"""What a fused layer call knows besides its tensors: the layer's options (fixed when the call is set up)
and the call's shapes (known once the input arrives), kept apart.

A layer is a sequence of sub-blocks ("self" attention, "cross" attention, "ffn"), each with the same six
parameters in the order of ``BLOCK_PARAMS`` (see blocks.py for what each is in each kind of block).
"""
import math
from typing import NamedTuple

from lsmini.layers.arena import align

# The parameters of every sub-block, in the order the layer passes them: the core's input and output GEMM
# weights and biases, then the sub-block's LayerNorm.
BLOCK_PARAMS = ("weight_in", "bias_in", "weight_out", "bias_out", "norm_weight", "norm_bias")
PARAMS_PER_BLOCK = len(BLOCK_PARAMS)
GEMM_WEIGHTS = (0, 2)  # positions of the GEMM weights within a block's parameters


class LayerOptions(NamedTuple):
    """The immutable options of one layer call: its blocks, sizes, numerics, dropout probabilities (0 when
    not training), whether the kernels run, and whether backward recomputes instead of saving. (A
    NamedTuple: built on every layer call, it costs a microsecond where a frozen dataclass costs seven.)"""

    kinds: tuple
    hidden: int
    ffn: int
    heads: int
    head_dim: int
    scale: float
    eps: float
    pre_ln: bool
    activation: str
    training: bool
    dropout: float
    attn_dropout: float
    activation_dropout: float
    causal: bool
    kernels: bool
    recompute: bool

    @classmethod
    def of(cls, kinds, config, training, causal, kernels, recompute=True):
        training = bool(training)
        return cls(kinds=tuple(kinds), hidden=config.hidden_size, ffn=config.ffn_size, heads=config.num_heads,
                   head_dim=config.head_dim, scale=1.0 / math.sqrt(config.head_dim),
                   eps=float(config.layer_norm_eps), pre_ln=config.pre_layer_norm, activation=config.activation,
                   training=training, dropout=float(config.dropout) if training else 0.0,
                   attn_dropout=float(config.attn_dropout) if training else 0.0,
                   activation_dropout=float(config.activation_dropout) if training else 0.0,
                   causal=bool(causal), kernels=bool(kernels), recompute=bool(recompute))


class CallShape(NamedTuple):
    """The shapes of one call and what follows from its input: batch, query (and for cross-attention,
    source) length, whether the flash-attention kernel runs (CUDA, fp16/bf16, a supported head_dim) and
    the dtype of the parameters, in which backward returns the weight gradients."""

    batch: int
    q_len: int
    src_len: int = 0
    fused: bool = False
    weight_dtype: object = None  # a torch.dtype

    @property
    def tokens(self):
        return self.batch * self.q_len


def scratch_numel(options, batch, q_len):
    """Arena elements one backward of a layer with these options needs for [batch, q_len] inputs: the
    largest block's layout (blocks.py); forward needs none."""
    t, hidden = batch * q_len, options.hidden
    hidden_parts = {"self": 3, "cross": 1}  # the projection-gradient regions after d(context)
    return max(align(t * hidden) + hidden_parts[kind] * t * hidden if kind in hidden_parts else t * options.ffn
               for kind in options.kinds)
