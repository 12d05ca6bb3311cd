"""lsmini.limits: the kernels' dtypes and size limits in one place. The Python table matches what the
extension reports, and the Python checks (ops, TransformerConfig, FusedAdam) use the limits module's values."""
import pathlib
import re

import pytest
import torch
from torch import nn

import lsmini
from lsmini import _backend, limits
from lsmini.layers.config import TransformerConfig
from lsmini.ops import attention_softmax, fused_attention_supported
from lsmini.optim import FusedAdam, adam

LIMIT_CONSTANTS = {
    "layernorm_max_hidden": "LAYERNORM_MAX_HIDDEN",
    "rms_norm_max_hidden": "RMS_NORM_MAX_HIDDEN",
    "attention_softmax_max_keys": "ATTENTION_SOFTMAX_MAX_KEYS",
    "attention_head_dims": "ATTENTION_HEAD_DIMS",
    "adam_max_groups": "ADAM_MAX_GROUPS",
    "cross_entropy_max_vocab": "CROSS_ENTROPY_MAX_VOCAB",
}


@pytest.mark.cuda
def test_python_table_matches_the_extension():
    assert _backend.ext().limits() == limits.PYTHON_LIMITS


def test_constants_are_the_active_table():
    ext = _backend.ext_or_none()
    table = limits.PYTHON_LIMITS if ext is None else ext.limits()
    assert set(table) == set(LIMIT_CONSTANTS)
    for key, name in LIMIT_CONSTANTS.items():
        value = table[key]
        assert getattr(limits, name) == (tuple(value) if isinstance(value, list) else value), name
    assert isinstance(limits.ATTENTION_HEAD_DIMS, tuple)


def test_dtypes():
    assert limits.KERNEL_DTYPES == (torch.float32, torch.float16, torch.bfloat16)
    assert limits.ATTENTION_DTYPES == (torch.float16, torch.bfloat16)


def test_no_other_module_spells_the_kernel_dtypes():
    package = pathlib.Path(lsmini.__file__).parent
    spelled = re.compile(r"\(\s*torch\.float32,\s*torch\.float16,\s*torch\.bfloat16\s*\)")
    copies = [str(path.relative_to(package)) for path in package.rglob("*.py")
              if path.name != "limits.py" and spelled.search(path.read_text())]
    assert copies == [], f"use lsmini.limits.KERNEL_DTYPES instead of a copy in {copies}"


def test_attention_softmax_checks_the_key_limit(monkeypatch):
    max_keys = limits.ATTENTION_SOFTMAX_MAX_KEYS
    assert attention_softmax(torch.randn(1, 1, 1, max_keys)).shape[-1] == max_keys
    with pytest.raises(ValueError, match=f"at most {max_keys}, got {max_keys + 1}"):
        attention_softmax(torch.randn(1, 1, 1, max_keys + 1))
    monkeypatch.setattr(limits, "ATTENTION_SOFTMAX_MAX_KEYS", 8)  # read at the call, not copied at import
    with pytest.raises(ValueError, match="at most 8, got 9"):
        attention_softmax(torch.randn(1, 1, 1, 9))


def test_fused_attention_supported_follows_the_limits(monkeypatch):
    for dtype in limits.ATTENTION_DTYPES:
        for head_dim in limits.ATTENTION_HEAD_DIMS:
            assert fused_attention_supported(dtype, head_dim)
        assert not fused_attention_supported(dtype, max(limits.ATTENTION_HEAD_DIMS) + 1)
    assert not fused_attention_supported(torch.float32, limits.ATTENTION_HEAD_DIMS[0])
    monkeypatch.setattr(limits, "ATTENTION_HEAD_DIMS", (24,))
    assert fused_attention_supported(torch.float16, 24)
    assert not fused_attention_supported(torch.float16, 64)


def _config(**sizes):
    return TransformerConfig(**{"hidden_size": 8, "num_heads": 1, "ffn_size": 8, **sizes})


def test_config_checks_the_limits(monkeypatch):
    _config(hidden_size=limits.LAYERNORM_MAX_HIDDEN, max_seq_len=limits.ATTENTION_SOFTMAX_MAX_KEYS)
    with pytest.raises(ValueError, match=f"hidden_size must be in \\[1, {limits.LAYERNORM_MAX_HIDDEN}\\]"):
        _config(hidden_size=limits.LAYERNORM_MAX_HIDDEN + 1)
    with pytest.raises(ValueError, match=f"max_seq_len must be in \\[1, {limits.ATTENTION_SOFTMAX_MAX_KEYS}\\]"):
        _config(max_seq_len=limits.ATTENTION_SOFTMAX_MAX_KEYS + 1)
    monkeypatch.setattr(limits, "LAYERNORM_MAX_HIDDEN", 4)
    monkeypatch.setattr(limits, "ATTENTION_SOFTMAX_MAX_KEYS", 16)
    with pytest.raises(ValueError, match="hidden_size must be in \\[1, 4\\], got 8"):
        _config()
    with pytest.raises(ValueError, match="max_seq_len must be in \\[1, 16\\], got 17"):
        _config(hidden_size=4, max_seq_len=17)


def test_fused_adam_checks_the_group_limit():
    assert adam.MAX_GROUPS == limits.ADAM_MAX_GROUPS
    params = [nn.Parameter(torch.randn(3)) for _ in range(limits.ADAM_MAX_GROUPS + 1)]
    FusedAdam([{"params": [p]} for p in params[:-1]])
    with pytest.raises(ValueError, match=f"at most {limits.ADAM_MAX_GROUPS} param groups"):
        FusedAdam([{"params": [p]} for p in params])
