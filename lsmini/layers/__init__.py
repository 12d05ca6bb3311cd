"""nn.Modules built from lsmini's fused ops and its layer runtime.

The public modules (one file each): ``layernorm.LayerNorm`` and ``layernorm.RMSNorm``,
``embedding.TransformerEmbedding``, ``encoder.TransformerEncoder(Layer)``, ``decoder.TransformerDecoder(Layer)``,
``criterion.CrossEntropyLoss``, ``criterion.LinearCrossEntropyLoss`` and ``config.TransformerConfig``, the options
of an encoder/decoder layer.

How an encoder/decoder layer runs, a file each:
    spec.py         what a layer call is: its blocks, their parameters (BLOCK_PARAMS) and its LayerOptions
    runtime.py      which implementation runs a call, the autograd Function over the kernel path's operators
                    lsmini::layer / lsmini::layer_backward (csrc/layers/layer.cpp), a decoder stack's one
                    cross-attention K/V GEMM
    reference.py    the reference layer: plain differentiable PyTorch (CPU, float32, other head dims,
                    incremental decoding with a KV cache, the tests' oracle)
    base.py         what encoder and decoder share: parameter set-up, input checks, stacks, reorder_cache
    params.py       the parameter containers (torch.nn's names) and their initialisation
    interop.py      torch.nn conversions (from_torch / to_torch) and their checks
    precision.py    the compute dtype under autocast and the parameter casts of the reference path
"""
from lsmini.layers.layernorm import LayerNorm, RMSNorm
from lsmini.layers.config import TransformerConfig
from lsmini.layers.embedding import TransformerEmbedding
from lsmini.layers.encoder import TransformerEncoder, TransformerEncoderLayer
from lsmini.layers.decoder import TransformerDecoder, TransformerDecoderLayer
from lsmini.layers.criterion import CrossEntropyLoss, LinearCrossEntropyLoss

__all__ = ["LayerNorm", "RMSNorm", "TransformerConfig", "TransformerEmbedding", "TransformerEncoderLayer",
           "TransformerEncoder", "TransformerDecoderLayer", "TransformerDecoder", "CrossEntropyLoss",
           "LinearCrossEntropyLoss"]
