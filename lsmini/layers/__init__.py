"""nn.Modules built from lsmini's fused ops and torch GEMMs."""
from lsmini.layers.layernorm import LayerNorm
from lsmini.layers.config import TransformerConfig
from lsmini.layers.embedding import TransformerEmbedding
from lsmini.layers.encoder import TransformerEncoder, TransformerEncoderLayer
from lsmini.layers.decoder import TransformerDecoder, TransformerDecoderLayer
from lsmini.layers.criterion import CrossEntropyLoss
from lsmini.layers import arena

__all__ = ["LayerNorm", "TransformerConfig", "TransformerEmbedding", "TransformerEncoderLayer", "TransformerEncoder",
           "TransformerDecoderLayer", "TransformerDecoder", "CrossEntropyLoss", "arena"]
