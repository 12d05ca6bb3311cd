"""TransformerEncoderLayer on CUDA: float32 (the reference layer, TF32 off) against torch.nn in float64, the
kernel path in fp16/bf16 and under autocast by the 2x-PyTorch rule, and the kernel path against the reference
layer on the same device."""
import pytest
import torch

from layer_testing import (_one_thread, _poison_freed_memory, no_tf32,  # noqa: F401  (fixtures)
                           assert_close_scaled, compare_encoder_with_torch, encoder_layer, padding_mask, param_grads,
                           perturb_, plain_attention, run, torch_encoder_layer)
import lsmini
from lsmini.layers import TransformerConfig, TransformerEncoderLayer
from util import assert_lowp_rule


CUDA_CASES = [(3, 7, 64, 4, 256), (8, 128, 256, 8, 1024), (5, 33, 96, 3, 160), (2, 257, 128, 2, 512)]


@pytest.mark.cuda
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("case", CUDA_CASES)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_matches_torch_fp32(pre, act, case, recompute, no_tf32):
    b, l, h, heads, ffn = case
    t = torch_encoder_layer(h, heads, ffn, act, pre, device="cuda")
    m = TransformerEncoderLayer.from_torch(t)
    m.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(b, l, h, generator=gen).cuda(), torch.randn(b, l, h, generator=gen).cuda()
    compare_encoder_with_torch(t, m, x, padding_mask(b, l, "random").cuda(), g, tol=5e-5)
    compare_encoder_with_torch(t, m, x, None, g, tol=5e-5, causal=True)


def _lowp_setup(pre, act, dtype, case, seed=0, autocast=False):
    """(torch fp32 oracle with the weights rounded to dtype, torch.nn in dtype, ours, x, mask, g).
    Ours holds dtype parameters, or — with autocast — the same values in float32 (it is then run under
    torch.autocast and computes in dtype as well)."""
    b, l, h, heads, ffn = case
    t32 = torch_encoder_layer(h, heads, ffn, act, pre, device="cuda", seed=seed)
    with torch.no_grad():
        for p in t32.parameters():
            p.copy_(p.to(dtype).float())
    t_lp = torch_encoder_layer(h, heads, ffn, act, pre, device="cuda", seed=seed)
    t_lp.load_state_dict(t32.state_dict())
    m = TransformerEncoderLayer.from_torch(t_lp if autocast else t_lp.to(dtype))
    t_lp = t_lp.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, l, h, generator=gen).to("cuda", dtype).float()
    g = torch.randn(b, l, h, generator=gen).to("cuda", dtype).float()
    mask = padding_mask(b, l, "suffix", seed).cuda()
    return t32, t_lp, m, x, mask, g


def _lowp_compare(t32, t_lp, m, x, mask, g, dtype, autocast=False):
    """The 2x rule on the output and every gradient: ours (dtype parameters, or float32 ones under
    autocast) vs torch.nn in dtype with plain attention, both against the fp32 oracle; atol is 1e-3 of
    the quantity's magnitude."""
    y32, (dx32,) = run(lambda a: t32(a, src_key_padding_mask=mask), [x], g)
    with plain_attention():
        yt, (dxt,) = run(lambda a: t_lp(a.to(dtype), src_key_padding_mask=mask), [x], g.to(dtype))
    with torch.autocast("cuda", dtype=dtype, enabled=autocast):
        ym, (dxm,) = run(lambda a: m(a if autocast else a.to(dtype), mask), [x], g.to(dtype))
    assert ym.dtype == dtype
    scale = lambda r: 1e-3 * max(1.0, r.abs().max().item())  # noqa: E731 - atol relative to the magnitude
    assert_lowp_rule(ym.float(), y32, yt.float(), atol=scale(y32), name="output")
    assert_lowp_rule(dxm.float(), dx32, dxt.float(), atol=scale(dx32), name="grad x")
    g32, gt, gm = param_grads(t32), param_grads(t_lp), param_grads(m)
    for n in g32:
        assert_lowp_rule(gm[n].float(), g32[n], gt[n].float(), atol=scale(g32[n]), name=f"grad {n}")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES[:3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_lowp_2x_torch_rule(pre, dtype, case, no_tf32):
    _lowp_compare(*_lowp_setup(pre, "gelu", dtype, case), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_autocast_2x_torch_rule(pre, dtype, no_tf32):
    """fp32 parameters under torch.autocast: the layer computes in dtype (activations included, unlike
    torch's autocast, which keeps LayerNorm and the residual stream in fp32), so the rule compares it with
    torch.nn run in dtype; parameter gradients come back in fp32."""
    setup = _lowp_setup(pre, "relu", dtype, (4, 64, 128, 4, 512), autocast=True)
    _lowp_compare(*setup, dtype, autocast=True)
    assert setup[2].linear1.weight.grad.dtype == torch.float32


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_kernels_match_reference_path(monkeypatch, dtype, no_tf32):
    """The kernel path against the reference layer: the same float16/bfloat16 layer through the kernels and
    through the reference (lsmini.config.reference), both against the reference in float32, by the 2x rule
    (the reference in the low precision is the 'plain PyTorch' side)."""
    m = encoder_layer("cuda", pre=True, h=64, heads=4, ffn=128)
    x = torch.randn(3, 20, 64, device="cuda").to(dtype).float()
    g = torch.randn_like(x).to(dtype).float()
    mask = padding_mask(3, 20, "suffix").cuda()

    def step(model, lowp):
        model.zero_grad(set_to_none=True)
        y, (dx,) = run(lambda a: model(a.to(dtype) if lowp else a, mask), [x], g.to(dtype) if lowp else g)
        return [y.float(), dx.float()] + [p.grad.float() for p in model.parameters()]

    oracle = step(m, False)  # float32: the reference layer
    low = m.to(dtype)
    kernels = step(low, True)
    monkeypatch.setattr(lsmini.config, "reference", True)
    reference = step(low, True)
    names = ["output", "grad x"] + [f"grad {n}" for n, _ in m.named_parameters()]
    for k, o, r, name in zip(kernels, oracle, reference, names):
        assert_lowp_rule(k, o, r, atol=1e-3 * max(1.0, o.abs().max().item()), name=name)
