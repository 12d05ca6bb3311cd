"""What the layer and model tests share: the device list, the fixtures (imported into each test module,
which activates them), and the helpers that build torch.nn counterparts with perturbed weights, run a
forward and backward, and compare every gradient."""
import copy

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lsmini.layers import TransformerConfig, TransformerEncoderLayer
from util import assert_close_fp32

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
DEVICES = ["cpu", CUDA]


# ---------------------------------------------------------------------------------------------- fixtures ---
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The CPU cases are tiny: one intra-op thread avoids thread wake-ups that cost more than the math."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _poison_freed_memory():
    """On CUDA, hand NaN-filled blocks of many sizes back to the caching allocator before each test, so that a
    layer's scratch and outputs most likely start as NaN: a read of memory nobody wrote shows in the results."""
    if torch.cuda.is_available():
        blocks = [torch.full((1 << n,), float("nan"), dtype=torch.float16, device="cuda") for n in range(10, 24)]
        del blocks
    yield


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


# ---------------------------------------------------------------------------------------------- helpers ---
def perturb_(module, seed=0, scale=0.2):
    """Move every parameter off its init (LayerNorm ≠ identity, biases ≠ 0), seeded; matrices by
    scale·N(0, 1/fan_in) so activations stay O(1) at any width."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = scale * torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                noise /= p.shape[1] ** 0.5
            p.add_(noise.to(p.device, p.dtype))
    return module


def padding_mask(b, l, kind, seed=0):
    """bool [b, l], True = pad; never a fully padded row (torch.nn gives NaN there)."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.zeros(b, l, dtype=torch.bool)
    if kind == "suffix":
        for i in range(1, b):
            m[i, int(torch.randint(1, l + 1, (1,), generator=gen)):] = True
    elif kind == "random":
        m = torch.rand(b, l, generator=gen) < 0.3
        m[:, int(torch.randint(0, l, (1,), generator=gen))] = False
    return m


def run(fn, inputs, grad):
    """(out, [grads of inputs]) of fn(*inputs) with one backward of grad; inputs are cloned leaves."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()]


def param_grads(module):
    return {n: p.grad for n, p in module.named_parameters()}


def assert_close_scaled(out, ref, tol, name):
    """fp32 rule with tolerances scaled by the reference's magnitude (gradients of weights sum over
    tokens and reach values far from 1)."""
    scale = max(1.0, ref.abs().max().item())
    assert_close_fp32(out, ref, atol=tol * scale, rtol=10 * tol, name=name)


def plain_attention():
    """torch.nn's attention through PyTorch's unfused math backend: the 'plain PyTorch in the same low
    precision' of the 2x rule. Flash / memory-efficient SDPA keep the scores in fp32 registers — a
    fused kernel, not the plain reference; lsmini (like plain PyTorch) materialises the scores and
    probabilities in the activation dtype between its GEMMs and the softmax kernel."""
    return sdpa_kernel(SDPBackend.MATH)


# ------------------------------------------------------------------------------------ the encoder layer ---
# batch, len, hidden, heads, ffn
ENCODER_CASES = [(3, 7, 32, 4, 64), (1, 1, 16, 2, 32), (4, 13, 24, 3, 40), (2, 17, 8, 1, 24)]


def torch_encoder_layer(h, heads, ffn, act, pre, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    t = nn.TransformerEncoderLayer(h, heads, ffn, dropout=0.0, activation=act, batch_first=True, norm_first=pre,
                                   device=device, dtype=dtype)
    return perturb_(t, seed)


def encoder_layer(device, pre=True, h=32, heads=4, ffn=64, **config):
    """A perturbed TransformerEncoderLayer without dropout on device."""
    cfg = TransformerConfig(h, heads, ffn, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0, pre_layer_norm=pre,
                            **config)
    torch.manual_seed(0)
    return perturb_(TransformerEncoderLayer(cfg)).to(device)


def compare_encoder_with_torch(t, m, x, mask, g, tol, causal=False):
    """Forward and every gradient of our encoder layer m vs torch layer t (same weights) run in float64 —
    an oracle more accurate than either float32 implementation."""
    t = copy.deepcopy(t).double()
    t.zero_grad(set_to_none=True)
    m.zero_grad(set_to_none=True)
    attn_mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device,
                                                              dtype=torch.float64) if causal else None
    y_t, (dx_t,) = run(lambda a: t(a.double(), src_mask=attn_mask, src_key_padding_mask=mask, is_causal=causal),
                       [x], g.double())
    y_m, (dx_m,) = run(lambda a: m(a, mask, causal=causal), [x], g)
    assert_close_scaled(y_m, y_t, tol, "output")
    assert_close_scaled(dx_m, dx_t, tol, "grad x")
    gm = param_grads(m)
    for n, gt in param_grads(t).items():
        assert_close_scaled(gm[n], gt, tol, f"grad {n}")
    return t
