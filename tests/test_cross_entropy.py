"""cross_entropy: the reference and the registered operators' CPU implementation against
torch.nn.functional (CPU), the CUDA kernels against the reference upcast to fp32 (forward loss/nll and
the logits gradient), in-place backward, alignment paths, special values and bad input."""
import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini import _backend
from lsmini.ops import cross_entropy, cross_entropy_ref
from util import LOWP, LsminiOps, assert_close_fp32, check

REDUCTIONS = ("mean", "sum", "none")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _targets(n, vocab, gen, ignore_index=-100, ignore_frac=0.2, device="cpu"):
    t = torch.randint(0, vocab, (n,), generator=gen)
    if n > 1:
        t[torch.rand(n, generator=gen) < ignore_frac] = ignore_index
    return t.to(device)


def _grad_out(loss, gen):
    return torch.randn(loss.shape, generator=gen).to(loss.device, loss.dtype)


# ------------------------------------------------------------------------------------------------
# CPU: the reference against plain PyTorch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_ref_matches_torch(reduction, eps, ignore_index):
    gen = torch.Generator().manual_seed(0)
    n, vocab = 37, 11
    x = (torch.randn(n, vocab, generator=gen) * 3).requires_grad_(True)
    t = _targets(n, vocab, gen, ignore_index=ignore_index)
    assert (t == ignore_index).any() and (t != ignore_index).any()

    loss = cross_entropy_ref(x, t, eps, ignore_index, reduction)
    expect = F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=eps)
    assert loss.dtype == torch.float32
    assert_close_fp32(loss, expect, name="loss")

    go = _grad_out(expect, gen)
    (g,) = torch.autograd.grad(loss, x, go)
    (ge,) = torch.autograd.grad(expect, x, go)
    assert_close_fp32(g, ge, name="grad")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_ref_nll_matches_nll_loss(reduction):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(29, 13, generator=gen).requires_grad_(True)
    t = _targets(29, 13, gen)
    loss, nll = cross_entropy_ref(x, t, 0.1, reduction=reduction, return_nll=True)
    assert not nll.requires_grad and loss.requires_grad
    expect = F.nll_loss(F.log_softmax(x.detach(), dim=-1), t, reduction=reduction)
    assert_close_fp32(nll, expect, name="nll")


def test_ref_all_ignored():
    x = torch.randn(6, 5, requires_grad=True)
    t = torch.full((6,), -100)
    for eps in (0.0, 0.1):
        mean = cross_entropy_ref(x, t, eps)
        assert torch.isnan(mean) and torch.isnan(F.cross_entropy(x, t, label_smoothing=eps))  # torch's 0/0
        (g,) = torch.autograd.grad(mean, x)
        (ge,) = torch.autograd.grad(F.cross_entropy(x, t, label_smoothing=eps), x)
        assert torch.equal(g, ge) and not g.any()
        assert cross_entropy_ref(x, t, eps, reduction="sum").item() == 0.0
        assert torch.equal(cross_entropy_ref(x, t, eps, reduction="none"), torch.zeros(6))


def test_ref_nd_shapes():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 9, generator=gen)
    t = _targets(10, 9, gen).view(2, 5)
    none = cross_entropy_ref(x, t, 0.1, reduction="none")
    assert none.shape == (2, 5)
    assert_close_fp32(none, F.cross_entropy(x.reshape(-1, 9), t.reshape(-1), label_smoothing=0.1,
                                            reduction="none").view(2, 5))
    # a single row: logits [V], target 0-d
    one = cross_entropy_ref(x[0, 0], t[0, 0].clone().fill_(4), 0.1, reduction="none")
    assert one.shape == ()


@pytest.mark.parametrize("dtype", LOWP)
def test_ref_low_precision_is_fp32_math(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 300, generator=gen).to(dtype).requires_grad_(True)
    t = _targets(16, 300, gen)
    loss = cross_entropy_ref(x, t, 0.1)
    assert loss.dtype == torch.float32
    assert_close_fp32(loss, F.cross_entropy(x.detach().float(), t, label_smoothing=0.1))
    (g,) = torch.autograd.grad(loss, x)
    assert g.dtype == dtype


def test_ref_special_values():
    gen = torch.Generator().manual_seed(4)
    # large offset: logsumexp must subtract the max
    x = 1000 + torch.randn(8, 50, generator=gen)
    t = _targets(8, 50, gen, ignore_frac=0.0)
    assert_close_fp32(cross_entropy_ref(x, t, 0.1, reduction="none"),
                      F.cross_entropy(x, t, label_smoothing=0.1, reduction="none"))
    # masked vocabulary entries (−inf): finite without smoothing (like torch), inf with it
    x = torch.randn(8, 50, generator=gen)
    x[:, 40:] = float("-inf")
    t = torch.randint(0, 40, (8,), generator=gen)
    assert_close_fp32(cross_entropy_ref(x, t, 0.0, reduction="none"), F.cross_entropy(x, t, reduction="none"))
    assert torch.isinf(cross_entropy_ref(x, t, 0.1)) and torch.isinf(F.cross_entropy(x, t, label_smoothing=0.1))


def test_ref_bad_target_row_is_nan():
    x = torch.randn(4, 6)
    t = torch.tensor([1, 6, -100, -3])
    rows = cross_entropy_ref(x, t, 0.1, reduction="none")
    assert torch.isnan(rows[1]) and torch.isnan(rows[3]) and rows[2] == 0
    assert_close_fp32(rows[0], F.cross_entropy(x[:1], t[:1], label_smoothing=0.1))


def test_ref_empty():
    x = torch.randn(0, 7)
    t = torch.zeros(0, dtype=torch.long)
    assert torch.isnan(cross_entropy_ref(x, t))
    assert cross_entropy_ref(x, t, reduction="sum").item() == 0.0
    assert cross_entropy_ref(x, t, reduction="none").shape == (0,)


def test_ref_float64_gradcheck():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64).requires_grad_(True)
    t = torch.tensor([0, 6, -100, 3, 3])
    assert torch.autograd.gradcheck(lambda v: cross_entropy_ref(v, t, 0.2, reduction="mean"), (x,))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 3])
@pytest.mark.parametrize("inplace", [False, True])
def test_op_on_cpu_matches_torch(inplace, ignore_index, eps, reduction, dtype):
    """The registered operators' CPU implementation against plain PyTorch: loss, nll and the logits'
    gradient with one random grad_output; fp32 against float64, fp16/bf16 by the 2x rule."""
    gen = torch.Generator().manual_seed(7)
    n, vocab = 37, 11
    logits = (torch.randn(n, vocab, generator=gen) * 3).to(dtype)
    t = _targets(n, vocab, gen, ignore_index=ignore_index)
    x = logits.clone().requires_grad_(True)
    with LsminiOps() as ops:
        loss, nll = cross_entropy(x, t, eps, ignore_index, reduction, return_nll=True, inplace_backward=inplace)
        go = _grad_out(loss, gen)
        (gx,) = torch.autograd.grad(loss, x, go)
    assert ops.names == ["cross_entropy", "cross_entropy_backward_" if inplace else "cross_entropy_backward"]
    assert loss.dtype == nll.dtype == torch.float32 and not nll.requires_grad and gx.dtype == dtype
    if inplace:
        assert torch.equal(x.detach(), gx), "in-place backward did not write into the logits"
    x64 = logits.double().requires_grad_(True)
    tl = F.cross_entropy(x64, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=eps)
    tn = F.nll_loss(F.log_softmax(x64.detach(), dim=-1), t, ignore_index=ignore_index, reduction=reduction)
    (tg,) = torch.autograd.grad(tl, x64, go.double())
    gscale = go.abs().max().item()  # |dx| is bounded by |grad_output| (÷ count for "mean")
    if reduction == "mean":
        gscale /= max(int((t != ignore_index).sum()), 1)
    if dtype == torch.float32:
        assert_close_fp32(loss, tl, name="loss")
        assert_close_fp32(nll, tn, name="nll")
        assert_close_fp32(gx, tg, atol=1e-5 * gscale, name="grad")
    else:
        ll, ln = _torch_lowp_loss(logits, t, eps, ignore_index, reduction)
        check(loss, tl, ll, dtype, name="loss")
        check(nll, tn, ln, dtype, name="nll")
        xl = logits.clone().requires_grad_(True)
        tll = F.cross_entropy(xl, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=eps)
        (tgl,) = torch.autograd.grad(tll, xl, go.to(dtype))
        check(gx, tg, tgl, dtype, atol_lowp=1e-5 * gscale, name="grad")


def test_op_on_cpu_nd_shapes_and_non_contiguous_logits():
    gen = torch.Generator().manual_seed(8)
    wide = torch.randn(2, 5, 12, generator=gen)
    x = wide[..., :9].detach().requires_grad_(True)  # [2, 5, 9], not contiguous
    t = _targets(10, 9, gen).view(2, 5)
    for inplace in (False, True):
        with LsminiOps() as ops:
            loss = cross_entropy(x, t, 0.1, reduction="none", inplace_backward=inplace)
        assert ops.names == ["cross_entropy"] and loss.shape == (2, 5)
        x2 = x.detach().reshape(10, 9).requires_grad_(True)
        want = F.cross_entropy(x2, t.reshape(-1), label_smoothing=0.1, reduction="none")
        assert_close_fp32(loss, want.view(2, 5))
        go = torch.randn(2, 5, generator=gen)
        (gx,) = torch.autograd.grad(loss, x, go)
        assert_close_fp32(gx, torch.autograd.grad(want, x2, go.reshape(-1))[0].view(2, 5, 9))
        assert torch.equal(wide[..., :9], x.detach())  # a copy took the in-place gradient, not x


def test_float64_and_forced_reference_call_the_reference_directly(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(10, 20, generator=gen)
    t = _targets(10, 20, gen)
    with LsminiOps() as ops:
        loss, nll = cross_entropy(x.double(), t, 0.1, return_nll=True)
    assert ops.names == [] and loss.dtype == torch.float64
    rl, rn = cross_entropy_ref(x.double(), t, 0.1, return_nll=True)
    assert torch.equal(loss, rl) and torch.equal(nll, rn)
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        loss, nll = cross_entropy(x, t, 0.1, return_nll=True)
    assert ops.names == []
    rl, rn = cross_entropy_ref(x, t, 0.1, return_nll=True)
    assert torch.equal(loss, rl) and torch.equal(nll, rn)


def _bad_input_cases(device):
    x = torch.randn(4, 10, device=device)
    t = torch.tensor([1, 2, 3, 4], device=device)
    return [
        ((x, t[:3]), {}, ValueError, "target must have shape"),
        ((x, t.float()), {}, TypeError, "int64"),
        ((x, t.int()), {}, TypeError, "int64"),
        ((x.long(), t), {}, TypeError, "floating-point"),
        ((x[:, :0], t), {}, ValueError, "vocab >= 1"),
        ((x, t), {"reduction": "avg"}, ValueError, "reduction"),
        ((x, t), {"label_smoothing": 1.5}, ValueError, "label_smoothing"),
        ((x, t), {"ignore_index": 1.0}, TypeError, "ignore_index"),
        ((x, torch.tensor([1, 10, 3, 4], device=device)), {}, ValueError, "target values must be in"),
        ((x, torch.tensor([1, -1, 3, 4], device=device)), {}, ValueError, "target values must be in"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_bad_inputs_cpu(case):
    args, kwargs, exc, msg = _bad_input_cases("cpu")[case]
    with pytest.raises(exc, match=msg):
        cross_entropy(*args, **kwargs)


def test_ignore_index_in_range_is_allowed():
    x = torch.randn(3, 5)
    t = torch.tensor([0, 2, 0])
    loss = cross_entropy(x, t, ignore_index=0, reduction="none")
    assert loss[0] == 0 and loss[2] == 0 and loss[1] > 0


# ------------------------------------------------------------------------------------------------
# CUDA: the kernels against the reference upcast to fp32
# ------------------------------------------------------------------------------------------------
def _cuda_inputs(n, vocab, dtype, seed, scale=2.0, ignore_index=-100, ignore_frac=0.2):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (torch.randn(n, vocab, device="cuda", generator=gen) * scale).to(dtype)
    t = _targets(n, vocab, torch.Generator().manual_seed(seed), ignore_index, ignore_frac, device="cuda")
    return logits, t


def _poison_allocator(*shapes_dtypes):
    """Hand NaN-filled blocks back to the caching allocator so the op's next at::empty of the same
    size most likely gets one: an element the kernel forgets to write then shows as NaN."""
    blocks = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del blocks


def _torch_lowp_loss(x, t, eps, ignore_index, reduction):
    """Plain PyTorch in x's precision. F.cross_entropy itself overflows to inf in float16 with
    smoothing (Σ_j log p_j is kept in fp16), which would make the 2x rule vacuous, so the log-softmax
    is taken in the low dtype and only the row sums are widened; results rounded to the low dtype."""
    lp = F.log_softmax(x, dim=-1)
    nll = F.nll_loss(lp, t, ignore_index=ignore_index, reduction="none").float()
    smooth = -lp.float().mean(dim=-1)
    rows = (1 - eps) * nll + eps * smooth if eps > 0 else nll
    rows = torch.where(t == ignore_index, torch.zeros_like(rows), rows)
    count = (t != ignore_index).sum()
    out = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / count}[reduction]
    nll = torch.where(t == ignore_index, torch.zeros_like(nll), nll)
    nll = {"none": nll, "sum": nll.sum(), "mean": nll.sum() / count}[reduction]
    return out.to(x.dtype), nll.to(x.dtype)


def _compare(logits, t, eps, reduction, ignore_index=-100, seed=0, inplace=False, x=None):
    """Run kernel, fp32 reference and (low precision) plain PyTorch on the same values; check loss,
    nll and the logits gradient with one shared random grad_output. x: the leaf the kernel gets
    (default: a contiguous copy of logits), for layouts a copy would not keep (storage offsets,
    strides); it may be overwritten (in place), so the reference works on its own copy."""
    logits = logits.detach().clone()
    dtype = logits.dtype
    n, vocab = logits.shape
    x = logits.clone().requires_grad_(True) if x is None else x
    _poison_allocator(((n,), torch.float32), ((n,), torch.float32), ((n,), torch.float32))
    loss, nll = cross_entropy(x, t, eps, ignore_index, reduction, return_nll=True, inplace_backward=inplace)
    assert loss.dtype == torch.float32 and nll.dtype == torch.float32 and not nll.requires_grad
    go = _grad_out(loss, torch.Generator().manual_seed(seed + 1))
    if not inplace:
        _poison_allocator(((n, vocab), dtype))
    (gx,) = torch.autograd.grad(loss, x, go)
    assert gx.dtype == dtype and gx.shape == logits.shape
    if inplace:
        assert torch.equal(x.detach(), gx), "in-place backward did not write into the logits"

    x32 = logits.float().requires_grad_(True)
    rl, rn = cross_entropy_ref(x32, t, eps, ignore_index, reduction, return_nll=True)
    (rg,) = torch.autograd.grad(rl, x32, go)
    # |dx| is bounded by |grad_output| (÷ count for "mean"): gradient tolerances follow that scale.
    gscale = go.abs().max().item() if go.numel() else 1.0
    if reduction == "mean":
        gscale /= max(int((t != ignore_index).sum()), 1)

    if dtype == torch.float32:
        check(loss, rl, name="loss")
        check(nll, rn, name="nll")
        check(gx, rg, atol32=1e-5 * gscale, rtol32=1e-5, name="grad")
    else:
        tl, tn = _torch_lowp_loss(logits, t, eps, ignore_index, reduction)
        check(loss, rl, tl, dtype, name="loss")
        check(nll, rn, tn, dtype, name="nll")
        xl = logits.clone().requires_grad_(True)
        tloss = F.cross_entropy(xl, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=eps)
        (tg,) = torch.autograd.grad(tloss, xl, go.to(dtype))
        check(gx.float(), rg, tg.float(), dtype, atol_lowp=1e-5 * gscale, name="grad")
    return gx


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 2, 7, 8, 1000, 32000, 50257, 256000])
@pytest.mark.parametrize("rows", [1, 3, 17, 1024])
def test_kernel_matches_reference(rows, vocab, dtype):
    logits, t = _cuda_inputs(rows, vocab, dtype, seed=rows * 7 + vocab)
    _compare(logits, t, 0.1, "none", seed=rows + vocab)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 50257])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_kernel_reductions(ignore_index, eps, reduction, vocab, dtype):
    logits, t = _cuda_inputs(257, vocab, dtype, seed=vocab + 3, ignore_index=ignore_index)
    _compare(logits, t, eps, reduction, ignore_index=ignore_index)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1000, 32000, 50257])
def test_kernel_inplace_backward(vocab, dtype):
    logits, t = _cuda_inputs(64, vocab, dtype, seed=11)
    x1 = logits.clone().requires_grad_(True)
    l1 = cross_entropy(x1, t, 0.1)
    (g1,) = torch.autograd.grad(l1, x1)
    # 3-D logits: the in-place write must land in the caller's storage through the 2-D view.
    x2 = logits.reshape(4, 16, vocab).clone().requires_grad_(True)
    l2 = cross_entropy(x2, t.view(4, 16), 0.1, inplace_backward=True)
    assert torch.equal(l1, l2)
    (g2,) = torch.autograd.grad(l2, x2)
    assert torch.equal(g2.reshape(64, vocab), g1)
    assert torch.equal(x2.detach().reshape(64, vocab), g1), "in-place backward did not write into the logits"
    _compare(logits, t, 0.1, "mean", inplace=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1000, 50257])
@pytest.mark.parametrize("inplace", [False, True])
def test_kernel_misaligned_logits(inplace, vocab, dtype):
    # A storage offset of one element puts every row (and, out of place, the gradient buffer)
    # off the 16-byte grid: forward peels a scalar head per row; backward peels in place and runs
    # all-scalar out of place (logits and gradient then differ modulo 16).
    rows = 33
    logits, t = _cuda_inputs(rows, vocab, dtype, seed=5)
    buf = torch.empty(rows * vocab + 1, dtype=dtype, device="cuda")
    buf[1:] = logits.reshape(-1)
    shifted = buf[1:].view(rows, vocab).detach().requires_grad_(True)
    assert shifted.data_ptr() % 16 != 0 and shifted.is_contiguous()
    _compare(logits, t, 0.1, "none", inplace=inplace, x=shifted)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_non_contiguous_logits(dtype):
    logits, t = _cuda_inputs(40, 1003, dtype, seed=8)
    wide = torch.randn(40, 1010, device="cuda").to(dtype)
    wide[:, 3:1006] = logits
    x = wide[:, 3:1006].detach().requires_grad_(True)
    assert not x.is_contiguous()
    _compare(logits, t, 0.1, "sum", x=x)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1000, 50257])
def test_kernel_reads_and_writes_rows_at_their_stride(vocab, dtype):
    """Logits as a view of wider rows (linear_cross_entropy's, against a weight padded to aligned rows): the
    bindings read them in place, without a copy, at their row stride; the backward writes a fresh contiguous
    gradient, or in place only the view's columns."""
    C = _backend.ext()
    rows, extra = 33, 9
    logits, t = _cuda_inputs(rows, vocab, dtype, seed=3)
    wide = torch.full((rows, vocab + extra), 7.0, dtype=dtype, device="cuda")
    wide[:, :vocab] = logits
    view = wide[:, :vocab]
    want = C.cross_entropy_fwd(logits, t, 0.1, -100)
    got = C.cross_entropy_fwd(view, t, 0.1, -100)
    for w, g in zip(want, got):  # the rows' 16-byte splits differ: the sums' order may
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    grad_rows = torch.rand(rows, device="cuda")
    expected = C.cross_entropy_bwd(grad_rows, logits, t, want[2], 0.1, -100, False)
    fresh = C.cross_entropy_bwd(grad_rows, view, t, got[2], 0.1, -100, False)
    assert fresh.is_contiguous()
    torch.testing.assert_close(fresh, expected, equal_nan=True)
    out = C.cross_entropy_bwd(grad_rows, view, t, got[2], 0.1, -100, True)
    assert out.data_ptr() == wide.data_ptr() and out.stride() == view.stride()
    assert torch.equal(wide[:, :vocab], fresh) and torch.all(wide[:, vocab:] == 7)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1000, 50257])
def test_kernel_forward_writes_the_gradient(vocab, dtype):
    """With grad_rows the forward also writes the backward's gradient over the logits (linear_cross_entropy's
    chunks): the same losses and the same gradient bit for bit as the forward then the in-place backward, ignored
    rows zero and a bad target's row NaN, the columns past the view untouched. Vocabularies of a warp a row and
    of a block a row."""
    C = _backend.ext()
    rows, extra = 37, 9
    logits, t = _cuda_inputs(rows, vocab, dtype, seed=12)
    t[5] = vocab + 3  # out of range: NaN row
    assert (t == -100).any()
    wide = torch.full((rows, vocab + extra), 7.0, dtype=dtype, device="cuda")
    wide[:, :vocab] = logits
    fused, split = wide.clone(), wide.clone()
    grad_rows = torch.rand(rows, device="cuda")
    want = C.cross_entropy_fwd(split[:, :vocab], t, 0.1, -100)
    C.cross_entropy_bwd(grad_rows, split[:, :vocab], t, want[2], 0.1, -100, True)
    got = C.cross_entropy_fwd(fused[:, :vocab], t, 0.1, -100, grad_rows)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(fused, split, rtol=0, atol=0, equal_nan=True)
    assert torch.all(fused[t == -100, :vocab] == 0) and torch.all(fused[5, :vocab].isnan())
    assert torch.all(fused[:, vocab:] == 7)
    assert not torch.equal(fused[:, :vocab], logits)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_large_offset_and_masked_vocab(dtype):
    # 1000 + N(0,1): the online max must carry the row (no overflow, no cancellation).
    logits, t = _cuda_inputs(64, 32000, torch.float32, seed=9, scale=1.0)
    _compare((logits + 1000).to(dtype), t, 0.1, "none")
    # −inf entries (a masked vocabulary), targets never masked: finite loss and zero gradient there
    # without smoothing; rows whose masked entries come first exercise the −inf start of the online max.
    logits, t = _cuda_inputs(64, 5000, dtype, seed=10, ignore_frac=0.0)
    logits[:, :2000] = float("-inf")
    logits[:32, 4000:] = float("-inf")
    t = 2000 + t % 2000
    gx = _compare(logits, t, 0.0, "none")
    assert not gx[:, :2000].any()
    loss = cross_entropy(logits, t, 0.1, reduction="none")
    assert torch.isinf(loss).all()  # torch agrees: ε·mean(log p) = −inf


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_nan_and_bad_target_rows(dtype):
    logits, t = _cuda_inputs(16, 1000, dtype, seed=12, ignore_frac=0.0)
    logits[3, 500] = float("nan")
    t[5] = 1000  # out of range, unchecked
    t[7] = -7
    t[9] = 1 << 40  # far outside the row: must not be read
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, t, 0.1, reduction="none", check_targets=False)
    (g,) = torch.autograd.grad(loss, x, torch.ones_like(loss))
    torch.cuda.synchronize()
    bad = torch.zeros(16, dtype=torch.bool, device="cuda")
    bad[[3, 5, 7, 9]] = True
    assert torch.isnan(loss[bad]).all() and torch.isfinite(loss[~bad]).all()
    assert torch.isnan(g[[5, 7, 9]].float()).all() and torch.isfinite(g[~bad].float()).all()
    good = ~bad
    rl = cross_entropy_ref(logits[good].float(), t[good], 0.1, reduction="none")
    check(loss[good], rl, rl.to(dtype), dtype, atol_lowp=1e-3, name="loss of good rows")
    assert torch.isnan(cross_entropy(logits, t, 0.1, check_targets=False))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_all_ignored_and_empty(dtype):
    logits, _ = _cuda_inputs(9, 300, dtype, seed=13)
    t = torch.full((9,), -100, device="cuda")
    x = logits.clone().requires_grad_(True)
    mean = cross_entropy(x, t, 0.1)
    assert torch.isnan(mean)
    (g,) = torch.autograd.grad(mean, x)
    assert not g.any()  # torch gives zeros too
    assert cross_entropy(logits, t, 0.1, reduction="sum").item() == 0.0
    empty = torch.randn(0, 300, device="cuda").to(dtype).requires_grad_(True)
    te = torch.zeros(0, dtype=torch.long, device="cuda")
    assert torch.isnan(cross_entropy(empty, te))
    s = cross_entropy(empty, te, reduction="sum")
    assert s.item() == 0.0
    (ge,) = torch.autograd.grad(s, empty)
    assert ge.shape == (0, 300)


@pytest.mark.cuda
def test_kernel_sync_free():
    logits, t = _cuda_inputs(128, 32000, torch.float16, seed=14)
    x = logits.requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for reduction in REDUCTIONS:
            loss, nll = cross_entropy(x, t, 0.1, reduction=reduction, return_nll=True, check_targets=False)
            torch.autograd.grad(loss, x, torch.ones_like(loss))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(10))
def test_bad_inputs_cuda(case):
    args, kwargs, exc, msg = _bad_input_cases("cuda")[case]
    with pytest.raises(exc, match=msg):
        cross_entropy(*args, **kwargs)


@pytest.mark.cuda
def test_bad_inputs_devices():
    x = torch.randn(4, 10)
    t = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="target is on cuda"):
        cross_entropy(x, t.cuda())
    with pytest.raises(ValueError, match="target is on cpu"):
        cross_entropy(x.cuda(), t)


@pytest.mark.cuda
def test_binding_checks():
    C = _backend.ext()
    x = torch.randn(4, 10, device="cuda")
    t = torch.tensor([1, 2, 3, 4], device="cuda")
    lse = torch.zeros(4, device="cuda")
    g = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="cross_entropy_fwd: logits must be 2-D"):
        C.cross_entropy_fwd(x[0], t[:1], 0.0, -100)
    with pytest.raises(RuntimeError, match="cross_entropy_fwd: target must be Long"):
        C.cross_entropy_fwd(x, t.int(), 0.0, -100)
    with pytest.raises(RuntimeError, match=r"cross_entropy_fwd: target must have shape \[4\]"):
        C.cross_entropy_fwd(x, t[:3], 0.0, -100)
    with pytest.raises(RuntimeError, match="cross_entropy_fwd: logits must be a CUDA tensor"):
        C.cross_entropy_fwd(x.cpu(), t, 0.0, -100)
    with pytest.raises(RuntimeError, match="cross_entropy_fwd: label_smoothing"):
        C.cross_entropy_fwd(x, t, -0.5, -100)
    with pytest.raises(RuntimeError, match="cross_entropy_bwd: grad_rows must be Float"):
        C.cross_entropy_bwd(g.half(), x, t, lse, 0.0, -100, False)
    with pytest.raises(RuntimeError, match="cross_entropy_bwd: inplace=True needs logits with contiguous rows"):
        C.cross_entropy_bwd(g, torch.randn(10, 4, device="cuda").t(), t, lse, 0.0, -100, True)
    with pytest.raises(RuntimeError, match="cross_entropy_fwd: grad_rows must be Float"):
        C.cross_entropy_fwd(x, t, 0.0, -100, g.half())
    with pytest.raises(RuntimeError, match=r"cross_entropy_fwd: grad_rows must have shape \[4\]"):
        C.cross_entropy_fwd(x, t, 0.0, -100, g[:3])
    with pytest.raises(RuntimeError, match="cross_entropy_fwd: grad_rows needs logits with contiguous rows"):
        C.cross_entropy_fwd(torch.randn(10, 4, device="cuda").t(), t, 0.0, -100, g)
