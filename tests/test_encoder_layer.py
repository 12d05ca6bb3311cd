"""TransformerEncoderLayer / TransformerEncoder on CPU: config validation and bad input; against
torch.nn.TransformerEncoderLayer (via from_torch, dropout off) forward and every gradient, pre-/post-LN,
relu/gelu/gelu_tanh, padding, causal; from_torch / to_torch / state_dict interop; padding invariance,
causality, incremental decoding, use inside another model, CPU autocast. On CPU the layer runs the reference
layer (lsmini/layers/reference.py).

The rest of the encoder's tests: test_encoder_layer_kernels.py (CUDA: the kernel path against torch.nn and the
reference), test_encoder_layer_dropout.py, test_encoder_layer_memory.py (saved tensors, peak memory,
allocations), test_layer_runtime.py (which path runs, gradients only where autograd asks)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layer_testing import (DEVICES, ENCODER_CASES, _one_thread, _poison_freed_memory,  # noqa: F401  (fixtures)
                           compare_encoder_with_torch, encoder_layer, padding_mask, perturb_, torch_encoder_layer)
from lsmini.layers import TransformerConfig, TransformerEncoder, TransformerEncoderLayer


# ------------------------------------------------------------------------------- config and bad input ---
def test_config_validation():
    TransformerConfig(64, 8, 256)
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(30, 4, 64)
    with pytest.raises(ValueError, match="activation"):
        TransformerConfig(32, 4, 64, activation="swish")
    with pytest.raises(ValueError, match="dropout"):
        TransformerConfig(32, 4, 64, dropout=1.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        TransformerConfig(32, 4, 64, max_seq_len=20000)
    with pytest.raises(ValueError, match="hidden_size"):
        TransformerConfig(65536, 4, 64)
    with pytest.raises(ValueError, match="ffn_size"):
        TransformerConfig(32, 4, 0)
    with pytest.raises(TypeError, match="num_heads"):
        TransformerConfig(32, 4.0, 64)
    with pytest.raises(ValueError, match="layer_norm_eps"):
        TransformerConfig(32, 4, 64, layer_norm_eps=0.0)
    with pytest.raises(TypeError, match="TransformerConfig"):
        TransformerEncoderLayer({"hidden_size": 32})


def test_layer_norm_module_refuses_a_negative_eps():
    """A negative (or NaN) eps would give NaN outputs: refused when the module is built and when a changed
    one is used."""
    from lsmini.layers import LayerNorm
    for eps in (-1e-5, float("nan"), "1e-5"):
        with pytest.raises(ValueError, match="LayerNorm: eps must be a number >= 0"):
            LayerNorm(8, eps=eps)
    norm = LayerNorm(8, eps=0.0)
    assert torch.isfinite(norm(torch.randn(2, 8))).all()
    norm.eps = -1.0
    with pytest.raises(ValueError, match="got -1.0"):
        norm(torch.randn(2, 8))


def test_bad_inputs():
    m = encoder_layer("cpu", max_seq_len=16, max_batch_tokens=40)
    with pytest.raises(ValueError, match="hidden_size=32"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="max_seq_len = 16"):
        m(torch.randn(1, 17, 32))
    with pytest.raises(ValueError, match="max_batch_tokens = 40"):
        m(torch.randn(3, 14, 32))
    with pytest.raises(TypeError, match="torch.bool"):
        m(torch.randn(2, 5, 32), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"\(batch, len\) = \(2, 5\)"):
        m(torch.randn(2, 5, 32), torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.randn(2, 5, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="len >= 1"):
        m(torch.randn(2, 0, 32))
    with pytest.raises(ValueError, match="causal=True"):
        m(torch.randn(2, 1, 32), cache={})
    with pytest.raises(ValueError, match="cached 16"):
        cache = {}
        m.eval()
        m(torch.randn(1, 16, 32), causal=True, cache=cache)
        m(torch.randn(1, 1, 32), causal=True, cache=cache)


# -------------------------------------------------------------------------------- vs torch.nn (CPU) ---
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "suffix", "random"])
@pytest.mark.parametrize("case", ENCODER_CASES)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_matches_torch_cpu(pre, act, case, mask_kind, recompute):
    b, l, h, heads, ffn = case
    t = torch_encoder_layer(h, heads, ffn, act, pre)
    m = TransformerEncoderLayer.from_torch(t)
    m.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, l, h, generator=gen)
    g = torch.randn(b, l, h, generator=gen)
    mask = None if mask_kind == "none" else padding_mask(b, l, mask_kind)
    compare_encoder_with_torch(t, m, x, mask, g, tol=2e-5)


@pytest.mark.parametrize("pre", [True, False])
def test_matches_torch_causal_and_gelu_tanh_cpu(pre):
    t = torch_encoder_layer(32, 4, 48, nn.GELU(approximate="tanh"), pre)
    m = TransformerEncoderLayer.from_torch(t)
    assert m.config.activation == "gelu_tanh"
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(3, 9, 32, generator=gen), torch.randn(3, 9, 32, generator=gen)
    compare_encoder_with_torch(t, m, x, padding_mask(3, 9, "suffix"), g, tol=2e-5, causal=True)


def test_autocast_cpu_bf16():
    """fp32 parameters under CPU autocast compute in bfloat16 and return bfloat16; fp32 gradients."""
    m = encoder_layer("cpu")
    x = torch.randn(2, 7, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.linear1.weight.grad.dtype == torch.float32
    ref = m(x.detach())
    assert (y.float() - ref).abs().max() < 0.1


# --------------------------------------------------------------------------- interop with torch.nn ---
def test_state_dict_and_to_torch_roundtrip():
    t = torch_encoder_layer(32, 4, 64, "gelu", False)
    m = TransformerEncoderLayer(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0,
                                                  activation="gelu", pre_layer_norm=False))
    m.load_state_dict(t.state_dict())  # same names and shapes as torch.nn
    assert set(m.state_dict()) == set(t.state_dict())
    back = m.to_torch()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(back(x), t(x))
    torch.testing.assert_close(m(x), t(x), atol=2e-5, rtol=1e-4)


def test_from_torch_rejects_unsupported():
    t = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, bias=False)
    t.linear2 = nn.Linear(32, 16)
    with pytest.raises(ValueError, match="biases everywhere or nowhere"):
        TransformerEncoderLayer.from_torch(t)
    t = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, activation=torch.tanh)
    with pytest.raises(ValueError, match="activation"):
        TransformerEncoderLayer.from_torch(t)
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        TransformerEncoderLayer.from_torch(nn.Linear(4, 4))


# ----------------------------------------------------------------------------- properties (CPU + CUDA) ---
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_padding_invariance(device, pre):
    m = encoder_layer(device, pre)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 11, 32, generator=gen).to(device)
    mask = padding_mask(4, 11, "random", seed=4).to(device)
    x2 = torch.where(mask.unsqueeze(-1), 100 * torch.randn(x.shape, generator=gen).to(device), x)
    y1, y2 = m(x, mask), m(x2, mask)
    real = ~mask
    torch.testing.assert_close(y1[real], y2[real], atol=1e-6, rtol=1e-6)
    assert torch.isfinite(y1).all() and torch.isfinite(y2).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fully_padded_row_is_finite(device):
    m = encoder_layer(device)
    x = torch.randn(3, 6, 32, device=device, requires_grad=True)
    mask = torch.zeros(3, 6, dtype=torch.bool, device=device)
    mask[1] = True
    y = m(x, mask)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_causality(device):
    m = encoder_layer(device)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 10, 32, generator=gen).to(device)
    t = 6
    x2 = x.clone()
    x2[:, t + 1:] = torch.randn(2, 10 - t - 1, 32, generator=gen).to(device)
    y1, y2 = m(x, causal=True), m(x2, causal=True)
    torch.testing.assert_close(y1[:, :t + 1], y2[:, :t + 1], atol=1e-6, rtol=1e-6)
    assert (y1[:, t + 1:] - y2[:, t + 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_trains_inside_another_model(device):
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=0.0,
                                                      activation_dropout=0.0))
    model = nn.Sequential(nn.Linear(8, 32), layer, nn.Linear(32, 8)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 6, 8, generator=gen).to(device)
    target = torch.roll(x, 1, dims=1) * 0.5
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], losses


# ----------------------------------------------------------------------------------- incremental decoding ---
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_incremental_equals_full(device, pre):
    enc = TransformerEncoder(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0,
                                               pre_layer_norm=pre), 2)
    torch.manual_seed(0)
    perturb_(enc).to(device).eval()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 8, 32, generator=gen).to(device)
    mask = torch.zeros(3, 8, dtype=torch.bool, device=device)
    mask[2, 0] = True  # a left-padded row
    full = enc(x, mask, causal=True)
    cache = {}
    steps = [enc(x[:, i:i + 1], mask[:, :i + 1], causal=True, cache=cache) for i in range(8)]
    assert cache["step"] == 8
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-4)
    # two new positions at once continue the same sequence
    cache = {}
    part = [enc(x[:, :5], mask[:, :5], causal=True, cache=cache), enc(x[:, 5:], mask, causal=True, cache=cache)]
    torch.testing.assert_close(torch.cat(part, 1), full, atol=2e-5, rtol=1e-4)


def test_reorder_cache():
    enc = perturb_(TransformerEncoder(TransformerConfig(16, 2, 32, dropout=0.0, attn_dropout=0.0,
                                                         activation_dropout=0.0), 2)).eval()
    x = torch.randn(3, 5, 16)
    cache = {}
    for i in range(4):
        enc(x[:, i:i + 1], causal=True, cache=cache)
    order = torch.tensor([2, 0, 0])
    enc.reorder_cache(cache, order)
    last = enc(x[order, 4:5], causal=True, cache=cache)
    full = enc(x[order], causal=True)
    torch.testing.assert_close(last, full[:, 4:5], atol=2e-5, rtol=1e-4)
