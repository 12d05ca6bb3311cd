"""CrossEntropyLoss (the module): against torch.nn.functional.cross_entropy (classes moved to dim 1) for every
reduction, label smoothing and ignore_index, forward and gradient; return_nll; bad input. CUDA: fp32
tight, fp16/bf16 by the 2x-PyTorch rule."""
import pytest
import torch
import torch.nn.functional as F

from lsmini.layers import CrossEntropyLoss
from util import assert_close_fp32, assert_lowp_rule

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)


def torch_ce(logits, target, eps, ignore, reduction):
    return F.cross_entropy(logits.movedim(-1, 1), target, label_smoothing=eps, ignore_index=ignore,
                           reduction=reduction)


def inputs(shape, vocab, device, dtype=torch.float32, ignore=-100, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*shape, vocab, generator=gen)).to(device, dtype)
    target = torch.randint(0, vocab, shape, generator=gen)
    target[torch.rand(shape, generator=gen) < 0.2] = ignore
    return logits, target.to(device)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("shape,vocab", [((4, 7), 11), ((13,), 1000), ((1, 1), 3)])
def test_matches_torch(shape, vocab, eps, reduction, device):
    logits, target = inputs(shape, vocab, device, ignore=0)
    target[(0,) * len(shape)] = 1  # at least one row counts
    crit = CrossEntropyLoss(label_smoothing=eps, ignore_index=0, reduction=reduction)
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss = crit(a, target)
    ref = torch_ce(b, target, eps, 0, reduction)
    g = torch.rand_like(ref)
    loss.backward(g)
    ref.backward(g)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close_fp32(loss, ref, atol=1e-5, rtol=1e-5)
    assert_close_fp32(a.grad, b.grad, atol=1e-6, rtol=1e-5, name="grad")


def test_return_nll_and_repr():
    logits, target = inputs((5, 6), 9, "cpu")
    loss, nll = CrossEntropyLoss(label_smoothing=0.2)(logits, target, return_nll=True)
    assert_close_fp32(nll, torch_ce(logits, target, 0.0, -100, "mean"), atol=1e-5, rtol=1e-5)
    assert_close_fp32(loss, torch_ce(logits, target, 0.2, -100, "mean"), atol=1e-5, rtol=1e-5)
    assert not nll.requires_grad
    assert "label_smoothing=0.2" in repr(CrossEntropyLoss(label_smoothing=0.2))


def test_bad_inputs():
    with pytest.raises(ValueError, match="label_smoothing"):
        CrossEntropyLoss(label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropyLoss(reduction="avg")
    with pytest.raises(TypeError, match="ignore_index"):
        CrossEntropyLoss(ignore_index=0.5)
    crit = CrossEntropyLoss()
    with pytest.raises(ValueError, match="target must have shape"):
        crit(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        crit(torch.randn(3, 5), torch.tensor([0, 5, 1]))
    with pytest.raises(TypeError, match="int64"):
        crit(torch.randn(3, 5), torch.zeros(3))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_lowp_2x_torch_rule(dtype):
    # V = 1000 keeps torch's own fp16 loss finite (its smoothing sum overflows fp16 from V of a few thousand)
    logits, target = inputs((64, 33), 1000, "cuda", dtype)
    crit = CrossEntropyLoss(label_smoothing=0.1)
    a = logits.clone().requires_grad_()
    t_lp = logits.clone().requires_grad_()
    t32 = logits.float().requires_grad_()
    crit(a, target).backward()
    torch_ce(t_lp, target, 0.1, -100, "mean").backward()
    ref = torch_ce(t32, target, 0.1, -100, "mean")
    ref.backward()
    loss = crit(logits, target)
    assert_lowp_rule(loss.reshape(1), ref.detach().reshape(1), torch_ce(logits, target, 0.1, -100, "mean").float()
                     .reshape(1), atol=1e-4, name="loss")
    assert_lowp_rule(a.grad.float(), t32.grad, t_lp.grad.float(), atol=1e-6, name="grad")
