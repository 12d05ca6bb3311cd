"""TransformerConfig: the sizes and options of one Transformer layer, checked when it is built."""
import math
import numbers
from dataclasses import dataclass

from lsmini import limits
from lsmini.ops.bias_act_dropout import ACTIVATIONS as _POINTWISE

# relu/gelu/gelu_tanh act on one FFN GEMM output; swiglu/geglu gate it: their first GEMM has 2·ffn rows
GATED_ACTIVATIONS = ("swiglu", "geglu")
ACTIVATIONS = _POINTWISE + GATED_ACTIVATIONS
NORMS = ("layernorm", "rmsnorm")


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
    activation: "relu", "gelu" (exact, erf), "gelu_tanh", or a gated FFN: "swiglu" (silu(gate)·up) or
        "geglu" (gelu(gate)·up, exact erf), whose first GEMM has 2·ffn_size rows [gate | up].
    pre_layer_norm: the norm before each sub-block (True) or after each residual add (False, the
        original Transformer). layer_norm_eps: the eps of either norm.
    max_batch_tokens, max_seq_len: the largest batch·len and len a layer accepts. Longer inputs raise
        ValueError; the shared backward scratch never grows past what these allow.
    norm: "layernorm" (torch.nn.LayerNorm) or "rmsnorm" (x·rsqrt(mean(x²) + eps)·weight, no bias), for
        every sub-block's norm and a stack's final one.
    bias: False drops every bias: the GEMMs' and the LayerNorms'.
    num_kv_heads: K/V heads of the attentions (grouped-query attention), dividing num_heads; query head h
        uses K/V head h // (num_heads // num_kv_heads). None: num_heads.
    rotary: None (positions come from the embedding), or the rotary frequency base theta (e.g. 10000.0):
        rotary positions on the self-attention's Q and K (rotate-half, Hugging Face's convention), and the
        embeddings add no positions. rotary_dim: the rotated dimensions of each head, even, in
        [2, head_dim]; None: head_dim.
    qk_norm: an RMSNorm over head_dim on each self-attention head's Q and K (before rotary).
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
    norm: str = "layernorm"
    bias: bool = True
    num_kv_heads: int = None
    rotary: float = None
    rotary_dim: int = None
    qk_norm: bool = False

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
        if not isinstance(self.norm, str) or self.norm not in NORMS:
            raise ValueError(f"TransformerConfig: norm must be one of {NORMS}, got {self.norm!r}")
        for name in ("bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TransformerConfig: {name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.num_kv_heads is not None:
            _check_int("num_kv_heads", self.num_kv_heads, 1)
            if self.num_heads % self.num_kv_heads:
                raise ValueError(f"TransformerConfig: num_kv_heads ({self.num_kv_heads}) must divide num_heads "
                                 f"({self.num_heads})")
        if self.rotary is not None and (isinstance(self.rotary, bool) or not isinstance(self.rotary, numbers.Real)
                                        or not (math.isfinite(self.rotary) and self.rotary > 0)):
            raise ValueError(f"TransformerConfig: rotary must be None or the rotary theta, a finite float > 0, got "
                             f"{self.rotary!r}")
        if self.rotary_dim is not None:
            if self.rotary is None:
                raise ValueError(f"TransformerConfig: rotary_dim ({self.rotary_dim}) is set but rotary is None; set "
                                 f"rotary to the rotary theta (e.g. 10000.0)")
            _check_int("rotary_dim", self.rotary_dim, 2, self.head_dim)
            if self.rotary_dim % 2:
                raise ValueError(f"TransformerConfig: rotary_dim must be even, got {self.rotary_dim}")

    @property
    def head_dim(self):
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self):
        """The number of K/V heads: num_kv_heads, or num_heads when it is None."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def rotary_dims(self):
        """The rotated dimensions of each head: 0 without rotary, else rotary_dim or head_dim."""
        if self.rotary is None:
            return 0
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def gated(self):
        """True for a gated FFN (swiglu, geglu): its first GEMM has 2·ffn_size rows."""
        return self.activation in GATED_ACTIVATIONS
