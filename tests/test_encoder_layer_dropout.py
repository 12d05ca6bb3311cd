"""TransformerEncoderLayer's three dropouts (CPU: the reference layer; CUDA: the kernel path, float16 under
autocast): residual, activation and attention dropout keep rates, the backward using the forward's mask,
reproducibility under torch.manual_seed, nothing dropped in eval. Weights are set so that a dropout's mask
shows in the layer's output. Inputs are float16 values, so that on CUDA only the output's rounding differs."""
import contextlib

import pytest
import torch

from layer_testing import DEVICES, _one_thread, _poison_freed_memory, perturb_  # noqa: F401  (fixtures)
from lsmini.layers import TransformerConfig, TransformerEncoderLayer
from util import assert_dropout_keep_stats


TOL = {"cpu": 1e-5, "cuda": 5e-3}  # CUDA: the output is rounded to float16


def _run(m, x):
    """m(x) in float32: on CUDA through the kernel path (float16 under autocast)."""
    with torch.autocast("cuda", dtype=torch.float16) if x.is_cuda else contextlib.nullcontext():
        return m(x).float()


def _randn(*shape, device):
    return torch.randn(*shape).half().float().to(device)


def _zeroed(device, **drop):
    """A training-mode layer (head_dim 16) with every parameter zero except the LayerNorm weights (one): the
    output is the input until a test sets the weights that carry one dropout's mask to the output."""
    cfg = TransformerConfig(32, 2, 64, **{"dropout": 0.0, "attn_dropout": 0.0, "activation_dropout": 0.0, **drop})
    m = TransformerEncoderLayer(cfg).to(device)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.norm1.weight.fill_(1.0)
        m.norm2.weight.fill_(1.0)
    return m.train()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_residual_dropout_statistics_and_backward_mask(device, p):
    """Only the attention output bias is 1: out − x = dropout(1) elementwise, so the mask is visible; the
    bias gradient of sum(out) counts the kept elements — the backward uses the forward's mask."""
    m = _zeroed(device, dropout=p)
    with torch.no_grad():
        m.self_attn.out_proj.bias.fill_(1.0)
    x = _randn(16, 64, 32, device=device)
    y = _run(m, x)
    keep = (y - x).detach() > 0.5 / (1 - p)
    assert_dropout_keep_stats(keep.view(-1, 32), p)
    kept_vals = (y - x)[keep]
    torch.testing.assert_close(kept_vals, torch.full_like(kept_vals, 1 / (1 - p)), atol=TOL[device], rtol=1e-5)
    y.sum().backward()
    expect = keep.view(-1, 32).float().sum(0) / (1 - p)
    torch.testing.assert_close(m.self_attn.out_proj.bias.grad, expect, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_activation_dropout_statistics_and_backward_mask(device, p):
    """linear1.bias = 1 so act = 1 everywhere; linear2 copies hidden units f < 32 to the output: out − x
    shows the activation-dropout mask; linear1.bias's gradient counts what backward kept."""
    m = _zeroed(device, activation_dropout=p)
    with torch.no_grad():
        m.linear1.bias.fill_(1.0)
        m.linear2.weight[:, :32].copy_(torch.eye(32))
    x = _randn(16, 64, 32, device=device)
    y = _run(m, x)
    keep = (y - x).detach() > 0.5 / (1 - p)
    assert_dropout_keep_stats(keep.view(-1, 32), p)
    y.sum().backward()
    expect = keep.view(-1, 32).float().sum(0) / (1 - p)
    torch.testing.assert_close(m.linear1.bias.grad[:32], expect, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_attention_dropout_statistics(device, p):
    """Q = K = 0 and V = 1: the softmax is uniform (1/len), so each output is (#kept keys)/(len·(1 − p));
    the overall keep rate must be 1 − p."""
    m = _zeroed(device, attn_dropout=p)
    h = 32
    with torch.no_grad():
        m.self_attn.in_proj_bias[2 * h:].fill_(1.0)
        m.self_attn.out_proj.weight.copy_(torch.eye(h))
    b, l = 32, 64
    x = _randn(b, l, h, device=device)
    y = _run(m, x)
    kept = ((y - x) * l * (1 - p)).round()  # [b, l, h]: per (row, head) the count, repeated over head_dim
    per_head = kept.view(b, l, 2, 16)[..., 0]
    assert (per_head >= 0).all() and (per_head <= l).all()
    n = per_head.numel() * l
    rate = per_head.sum().item() / n
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) <= 5 * sd, (rate, 1 - p, sd)
    # different rows/heads drop different keys
    assert per_head.float().std() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_reproducible_and_off_in_eval(device):
    cfg = TransformerConfig(32, 2, 64, dropout=0.2, attn_dropout=0.2, activation_dropout=0.2)
    torch.manual_seed(0)
    m = perturb_(TransformerEncoderLayer(cfg)).to(device)
    x = _randn(2, 9, 32, device=device)
    torch.manual_seed(123)
    a = _run(m, x)
    torch.manual_seed(123)
    b = _run(m, x)
    c = _run(m, x)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (a - c).abs().max() > 1e-3
    m.eval()
    ref = TransformerEncoderLayer(TransformerConfig(32, 2, 64, dropout=0.0, attn_dropout=0.0,
                                                    activation_dropout=0.0)).to(device)
    ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(_run(m, x), _run(ref, x), atol=0, rtol=0)
