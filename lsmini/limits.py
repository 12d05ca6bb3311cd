"""The dtypes the CUDA kernels take and the size limits they have, in one place.

The limits are properties of the kernels (a LayerNorm row lives in registers, the attention kernel is
instantiated per head_dim, ...), so the C++ code is their source: where the extension is built, they are
read from it (``lsmini._C.limits()``). The pure-Python install has no kernels to ask and uses
``PYTHON_LIMITS``, the same table kept here by hand; ``tests/test_limits.py`` checks on a CUDA machine
that the two agree. The Python checks (ops, TransformerConfig, FusedAdam) read these constants, so an
input a kernel cannot take is rejected in Python with a clear message, on every backend alike.
"""
import torch

from lsmini import _backend

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # every kernel but attention's
ATTENTION_DTYPES = (torch.float16, torch.bfloat16)  # the fused attention kernel (tensor-core MMA)

PYTHON_LIMITS = {
    "layernorm_max_hidden": 32768,  # a row in registers: 32 fp32 values per thread × 1024 threads
    "rms_norm_max_hidden": 32768,  # the same: a row in registers
    "attention_softmax_max_keys": 16384,  # a row of keys in registers: 32 values per thread × 512 threads
    "attention_head_dims": [16, 32, 64, 128],  # the head_dims with a fused attention kernel instantiation
    "adam_max_groups": 16,  # the groups' hyperparameters travel by value, as a kernel argument
    "cross_entropy_max_vocab": 1 << 30,  # keeps the in-row index arithmetic in int
}


def _read_limits():
    ext = _backend.ext_or_none()
    return PYTHON_LIMITS if ext is None else ext.limits()


_LIMITS = _read_limits()
LAYERNORM_MAX_HIDDEN = _LIMITS["layernorm_max_hidden"]
RMS_NORM_MAX_HIDDEN = _LIMITS["rms_norm_max_hidden"]
ATTENTION_SOFTMAX_MAX_KEYS = _LIMITS["attention_softmax_max_keys"]
ATTENTION_HEAD_DIMS = tuple(_LIMITS["attention_head_dims"])
ADAM_MAX_GROUPS = _LIMITS["adam_max_groups"]
CROSS_ENTROPY_MAX_VOCAB = _LIMITS["cross_entropy_max_vocab"]
