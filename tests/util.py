"""Helpers shared by the op tests."""
import torch

LOWP = (torch.float16, torch.bfloat16)


def poison(t):
    """Fill with NaN (so an unwritten element shows) and return it."""
    return t.fill_(float("nan"))


def max_err(a, ref):
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def assert_close_fp32(out, ref, atol=1e-5, rtol=1e-5, name="output"):
    """fp32 rule: |out − ref| ≤ atol + rtol·|ref| everywhere; NaN never passes."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all() or not torch.isfinite(ref).all(), f"{name}: non-finite values"
    diff = (out.double() - ref.double()).abs()
    bound = atol + rtol * ref.double().abs()
    bad = ~(diff <= bound)
    assert not bad.any(), f"{name}: {int(bad.sum())} elements off, max err {diff.max().item():.3g}"


def assert_lowp_rule(out, ref32, torch_lowp, atol=1e-3, name="output"):
    """fp16/bf16 rule: the kernel's max error against the fp32 reference must be at most twice the
    max error of plain PyTorch run in the same low precision, plus a small atol."""
    assert out.shape == ref32.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref32.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    e_k = max_err(out, ref32)
    e_t = max_err(torch_lowp, ref32)
    assert e_k <= 2 * e_t + atol, f"{name}: kernel max err {e_k:.3g} > 2 x torch max err {e_t:.3g} + {atol}"


def check(out, ref32, torch_lowp=None, dtype=torch.float32, atol32=1e-5, rtol32=1e-5, atol_lowp=1e-3, name="output"):
    """fp32: tight elementwise rule; fp16/bf16: the 2x-PyTorch-error rule."""
    if dtype in LOWP:
        assert_lowp_rule(out, ref32, torch_lowp, atol=atol_lowp, name=name)
    else:
        assert_close_fp32(out, ref32, atol=atol32, rtol=rtol32, name=name)
