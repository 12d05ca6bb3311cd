"""Fixtures shared by the layer and model tests (imported into each test module, which activates them)."""
import pytest
import torch

from lsmini.layers import arena

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
DEVICES = ["cpu", CUDA]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The CPU cases are tiny: one intra-op thread avoids thread wake-ups that cost more than the math."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _poison_arena():
    """Every arena view starts as NaN: a read of scratch that no one wrote shows up in the results."""
    arena.set_poison(True)
    yield
    arena.set_poison(False)


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
