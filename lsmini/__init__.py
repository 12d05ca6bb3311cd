"""lsmini: a mini Transformer training engine for PyTorch.

Fused CUDA kernels (``lsmini.ops``), Transformer layers built from them (``lsmini.layers``), a fused
mixed-precision Adam over one contiguous parameter workspace (``lsmini.optim``), data-parallel
gradient reduction over that workspace (``lsmini.distributed``) and the training step that puts them
together, optionally replayed as a CUDA graph (``lsmini.train``). Every op has a
pure-PyTorch reference that runs wherever the kernels cannot; ``lsmini.backend()`` says which is active.
User-facing settings are in ``lsmini.config``.
``lsmini.convert(model)`` swaps the torch.nn Transformer modules of an existing model for lsmini's, in place,
and the GPT2Block / BertLayer blocks of a Hugging Face model for one-call lsmini layers
(``lsmini.unconvert(model)`` swaps them back).
"""
from lsmini.config import config
from lsmini._backend import backend
from lsmini import ops, layers, optim, distributed, train
# the functions, not the module of the same name (``from lsmini.convert import ConversionReport`` reaches it)
from lsmini.convert import ConversionReport, convert, unconvert

__version__ = "0.1.0"
__all__ = ["config", "backend", "ops", "layers", "optim", "distributed", "train", "convert", "unconvert", "ConversionReport",
           "__version__"]
