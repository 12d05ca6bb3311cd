"""Fused ops. Each ``lsmini.ops.<op>(...)`` runs the CUDA kernel for CUDA tensors when the extension is
built, and its pure-PyTorch reference ``<op>_ref`` otherwise."""
from lsmini.ops.layernorm import layer_norm, layer_norm_ref
