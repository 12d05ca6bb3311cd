"""lsmini: a mini Transformer training engine for PyTorch.

Fused CUDA kernels (``lsmini.ops``), Transformer layers built from them (``lsmini.layers``), a fused
mixed-precision Adam over one contiguous parameter workspace (``lsmini.optim``), data-parallel
gradient reduction over that workspace (``lsmini.distributed``) and the training step that puts them
together, optionally replayed as a CUDA graph (``lsmini.train``). Every op has a
pure-PyTorch reference that runs wherever the kernels cannot; ``lsmini.backend()`` says which is active.
"""
from lsmini._backend import backend
from lsmini import ops, layers, optim, distributed, train

__version__ = "0.1.0"
__all__ = ["backend", "ops", "layers", "optim", "distributed", "train", "__version__"]
