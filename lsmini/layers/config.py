"""TransformerConfig: the sizes and options of one Transformer layer, checked when it is built."""
import numbers
from dataclasses import dataclass

from lsmini import limits
from lsmini.ops.bias_act_dropout import ACTIVATIONS


def _check_int(name, v, lo=1, hi=None):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"TransformerConfig: {name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"TransformerConfig: {name} must be {bound}, got {v}")


def _check_prob(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"TransformerConfig: {name} must be a float, got {type(v).__name__}")
    if not 0.0 <= float(v) < 1.0:
        raise ValueError(f"TransformerConfig: {name} must be in [0, 1), got {v}")


@dataclass
class TransformerConfig:
    """Sizes and options shared by the encoder and decoder layers.

    hidden_size: model width H; num_heads divides it (head_dim = H / num_heads).
    ffn_size: width of the feed-forward block.
    dropout: on the output of each sub-block (attention, feed-forward) before the residual add.
    attn_dropout: on the attention probabilities. activation_dropout: after the FFN activation.
    activation: "relu", "gelu" (exact, erf) or "gelu_tanh".
    pre_layer_norm: LayerNorm before each sub-block (True) or after each residual add (False, the
        original Transformer). layer_norm_eps: as torch.nn.LayerNorm.
    max_batch_tokens, max_seq_len: the largest batch·len and len a layer accepts. Longer inputs raise
        ValueError; the shared backward scratch never grows past what these allow.
    """

    hidden_size: int
    num_heads: int
    ffn_size: int
    dropout: float = 0.1
    attn_dropout: float = 0.1
    activation_dropout: float = 0.1
    activation: str = "relu"
    pre_layer_norm: bool = True
    layer_norm_eps: float = 1e-5
    max_batch_tokens: int = 8192
    max_seq_len: int = 512

    def __post_init__(self):
        _check_int("hidden_size", self.hidden_size, 1, limits.LAYERNORM_MAX_HIDDEN)
        _check_int("num_heads", self.num_heads, 1)
        _check_int("ffn_size", self.ffn_size, 1)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"TransformerConfig: hidden_size ({self.hidden_size}) must be divisible by num_heads "
                             f"({self.num_heads})")
        for name in ("dropout", "attn_dropout", "activation_dropout"):
            _check_prob(name, getattr(self, name))
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise ValueError(f"TransformerConfig: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not isinstance(self.pre_layer_norm, bool):
            raise TypeError(f"TransformerConfig: pre_layer_norm must be a bool, got "
                            f"{type(self.pre_layer_norm).__name__}")
        if isinstance(self.layer_norm_eps, bool) or not isinstance(self.layer_norm_eps, numbers.Real) \
                or not self.layer_norm_eps > 0:
            raise ValueError(f"TransformerConfig: layer_norm_eps must be a float > 0, got {self.layer_norm_eps!r}")
        _check_int("max_batch_tokens", self.max_batch_tokens, 1)
        # the attention softmax kernel holds one row of keys in registers
        _check_int("max_seq_len", self.max_seq_len, 1, limits.ATTENTION_SOFTMAX_MAX_KEYS)

    @property
    def head_dim(self):
        return self.hidden_size // self.num_heads
