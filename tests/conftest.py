import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import lsmini  # noqa: E402


def _cuda_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    b = lsmini.backend()
    if b != "cuda":
        return f"lsmini backend is reference: {b.reason}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _cuda_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"CUDA test skipped: {reason}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
