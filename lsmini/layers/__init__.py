"""nn.Modules built from lsmini's fused ops and torch GEMMs.

The public modules (one file each): ``layernorm.LayerNorm``, ``embedding.TransformerEmbedding``,
``encoder.TransformerEncoder(Layer)``, ``decoder.TransformerDecoder(Layer)``, ``criterion.CrossEntropyLoss``,
``criterion.LinearCrossEntropyLoss`` and ``config.TransformerConfig``, the options of an encoder/decoder layer;
``set_layer_graphs`` / ``layer_graph_counts``, the switch and counts of the compiled layers' CUDA graphs.

How an encoder/decoder layer is put together, a room each:
    base.py         what encoder and decoder share: parameter set-up, input checks, stacks, reorder_cache
    params.py       the parameter containers (torch.nn's names) and their initialisation
    interop.py      torch.nn conversions (from_torch / to_torch) and their checks
    precision.py    the compute dtype under autocast and the per-call parameter casts
    spec.py         a call's immutable LayerOptions and its CallShape; the arena size a backward needs
    blocks.py       the attention and FFN sub-blocks: forward and hand-written backward over the op primitives
    function.py     the autograd Functions: one per layer call, one for a decoder stack's cross-attention K/V
    compiled.py     a layer call under torch.compile: the custom operators lsmini::layer / lsmini::layer_backward
    arena.py        the scratch memory shared by every layer's backward
    incremental.py  incremental decoding (inference) and cache reordering
"""
from lsmini.layers.layernorm import LayerNorm
from lsmini.layers.config import TransformerConfig
from lsmini.layers.embedding import TransformerEmbedding
from lsmini.layers.encoder import TransformerEncoder, TransformerEncoderLayer
from lsmini.layers.decoder import TransformerDecoder, TransformerDecoderLayer
from lsmini.layers.criterion import CrossEntropyLoss, LinearCrossEntropyLoss
from lsmini.layers.compiled import layer_graph_counts, set_layer_graphs
from lsmini.layers import arena

__all__ = ["LayerNorm", "TransformerConfig", "TransformerEmbedding", "TransformerEncoderLayer", "TransformerEncoder",
           "TransformerDecoderLayer", "TransformerDecoder", "CrossEntropyLoss", "LinearCrossEntropyLoss",
           "set_layer_graphs", "layer_graph_counts", "arena"]
