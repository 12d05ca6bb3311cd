"""linear_cross_entropy (the output projection and the label-smoothed criterion in chunks of rows): the
reference and the registered operator's CPU implementation against F.linear + F.cross_entropy, the CUDA
chunks against the float64 reference (loss, nll and both gradients) over chunk sizes, dtypes, reductions and
ignored rows, its operator on CUDA (opcheck, torch.compile, a CUDA graph), LinearCrossEntropyLoss with the
models' features_only, and bad input."""
import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini.layers import LinearCrossEntropyLoss
from lsmini.models import Transformer, TransformerLM
from lsmini.layers import TransformerConfig
from lsmini.ops import cross_entropy, linear_cross_entropy, linear_cross_entropy_ref
from lsmini.ops.linear_cross_entropy import default_chunk_tokens
from util import LOWP, LsminiOps, assert_close_fp32, check

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(rows, hidden, vocab, seed, device="cpu", dtype=torch.float32, ignore_index=-100, ignore_frac=0.2,
            lead=()):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, rows, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5 * 3).to(device, dtype)
    t = torch.randint(0, vocab, (*lead, rows), generator=gen)
    if rows > 1:
        t[torch.rand(t.shape, generator=gen) < ignore_frac] = ignore_index
    return x.requires_grad_(), w.requires_grad_(), t.to(device)


def _torch_loss(x, w, t, eps, ignore_index, reduction):
    logits = F.linear(x, w)  # in x's dtype, as PyTorch would run it; the loss in float32 (or float64)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits.reshape(-1, w.shape[0]), t.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=eps)


# ------------------------------------------------------------------------------------------------
# CPU: the reference path against plain PyTorch
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cpu_path_matches_torch(reduction, eps):
    x, w, t = _inputs(23, 8, 13, seed=0, dtype=torch.float64, ignore_index=5, lead=(2,))
    loss, nll = linear_cross_entropy(x, w, t, eps, 5, reduction, return_nll=True)
    expect = _torch_loss(x.double(), w.double(), t, eps, 5, reduction)
    assert loss.dtype == torch.float64 and not nll.requires_grad
    assert_close_fp32(loss, expect, atol=1e-10, rtol=1e-10, name="loss")
    assert_close_fp32(nll, _torch_loss(x, w, t, 0.0, 5, reduction), atol=1e-10, rtol=1e-10, name="nll")
    gx, gw = torch.autograd.grad(loss, (x, w))
    ex, ew = torch.autograd.grad(expect, (x, w))
    assert_close_fp32(gx, ex, atol=1e-10, rtol=1e-10, name="grad x")
    assert_close_fp32(gw, ew, atol=1e-10, rtol=1e-10, name="grad weight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_op_on_cpu_matches_torch(eps, reduction, dtype):
    """The registered operator's CPU implementation: loss, nll and both gradients with a random incoming
    gradient, against F.linear + F.cross_entropy; fp32 against float64, fp16/bf16 by the 2x rule."""
    x, w, t = _inputs(23, 8, 13, seed=2, dtype=dtype, ignore_index=5, lead=(2,))
    with LsminiOps() as ops:
        loss, nll = linear_cross_entropy(x, w, t, eps, 5, reduction, return_nll=True)
        go = torch.tensor(0.75)
        gx, gw = torch.autograd.grad(loss, (x, w), go)
    assert ops.names == ["linear_cross_entropy"]  # the backward scales the forward's gradients
    assert loss.dtype == nll.dtype == torch.float32 and not nll.requires_grad
    assert gx.dtype == gw.dtype == dtype
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    expect = _torch_loss(x64, w64, t, eps, 5, reduction)
    expect_nll = _torch_loss(x64, w64, t, 0.0, 5, reduction).detach()
    ex, ew = torch.autograd.grad(expect, (x64, w64), go.double())
    if dtype == torch.float32:
        assert_close_fp32(loss, expect, atol=1e-5, rtol=1e-5, name="loss")
        assert_close_fp32(nll, expect_nll, atol=1e-5, rtol=1e-5, name="nll")
        assert_close_fp32(gx, ex, atol=1e-6, rtol=1e-4, name="grad x")
        assert_close_fp32(gw, ew, atol=1e-6, rtol=1e-4, name="grad weight")
        return
    lowp = _torch_loss(x, w, t, eps, 5, reduction)
    tx, tw = torch.autograd.grad(lowp, (x, w), go)
    check(loss, expect, lowp.detach(), dtype, name="loss")
    check(nll, expect_nll, _torch_loss(x, w, t, 0.0, 5, reduction).detach(), dtype, name="nll")
    check(gx, ex, tx, dtype, name="grad x")
    check(gw, ew, tw, dtype, name="grad weight")


def test_op_on_cpu_without_grad_computes_the_loss_alone(monkeypatch):
    x, w, t = _inputs(40, 16, 50, 0, dtype=torch.bfloat16)
    with torch.no_grad(), LsminiOps() as ops:
        loss = linear_cross_entropy(x, w, t, 0.1, chunk_tokens=8)
        loss_sum, nll_sum, gx, gw = torch.ops.lsmini.linear_cross_entropy(x, w, t, 0.1, -100, 8, False)
    assert ops.names == ["linear_cross_entropy"] * 2
    assert gx.numel() == 0 and gw.numel() == 0 and not loss.requires_grad
    assert torch.equal(loss_sum / (t != -100).sum(), loss)
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        forced = linear_cross_entropy(x, w, t, 0.1)
    assert ops.names == [] and torch.equal(forced.detach(), loss)


def test_default_chunk_is_4096_rows_or_64_mib_of_logits_where_that_is_more():
    assert default_chunk_tokens(32000, torch.float16) == 4096
    assert default_chunk_tokens(128256, torch.bfloat16) == 4096
    assert default_chunk_tokens(1 << 30, torch.float32) == 4096
    assert default_chunk_tokens(4000, torch.float16) == (64 << 20) // (4000 * 2)  # 8388 rows


@pytest.mark.parametrize("kind", ["seq2seq", "lm"])
def test_models_features_only_then_projection_gives_the_logits(kind):
    torch.manual_seed(0)
    config = TransformerConfig(16, 2, 32, dropout=0.0, max_batch_tokens=64, max_seq_len=8)
    src = torch.randint(1, 50, (2, 6))
    tgt = torch.randint(1, 50, (2, 5))
    if kind == "seq2seq":
        model = Transformer(50, 50, config, 1, 1).eval()
        logits, features = model(src, tgt), model(src, tgt, features_only=True)
    else:
        model = TransformerLM(50, config, 2).eval()
        logits, features = model(tgt), model(tgt, features_only=True)
    assert features.shape == (*tgt.shape, 16)
    assert torch.equal(F.linear(features, model.output_weight()), logits)
    crit = LinearCrossEntropyLoss(0.1, ignore_index=0)
    loss = crit(features, model.output_weight(), tgt)
    assert_close_fp32(loss, cross_entropy(logits, tgt, 0.1, ignore_index=0), name="loss")


def _raises(error, match, *args, **kw):
    with pytest.raises(error, match=match):
        linear_cross_entropy(*args, **kw)


def test_bad_input_names_the_problem():
    x, w, t = _inputs(6, 4, 9, seed=1)
    _raises(ValueError, r"linear_cross_entropy: weight must have shape \[vocab, 4\]", x, w[:, :3], t)
    _raises(ValueError, r"linear_cross_entropy: target must have shape \(6,\)", x, w, t[:5])
    _raises(TypeError, r"linear_cross_entropy: target must hold class indices as torch.int64", x, w, t.int())
    _raises(TypeError, r"linear_cross_entropy: weight must be in x's dtype", x, w.double(), t)
    _raises(TypeError, r"linear_cross_entropy: x must be a floating-point tensor", t.unsqueeze(-1), w, t)
    _raises(ValueError, r"linear_cross_entropy: reduction must be one of .*cross_entropy", x, w, t, reduction="none")
    _raises(ValueError, r"linear_cross_entropy: label_smoothing must be in \[0, 1\]", x, w, t, 1.5)
    _raises(ValueError, r"linear_cross_entropy: chunk_tokens must be an int >= 1", x, w, t, chunk_tokens=0)
    bad = t.clone()
    bad[2] = 9
    _raises(ValueError, r"linear_cross_entropy: target values must be in \[0, 9\).* the first is 9 at flat position 2",
            x, w, bad)
    with pytest.raises(ValueError, match="LinearCrossEntropyLoss: reduction must be one of"):
        LinearCrossEntropyLoss(reduction="none")
    with pytest.raises(ValueError, match="LinearCrossEntropyLoss: chunk_tokens must be an int >= 1"):
        LinearCrossEntropyLoss(chunk_tokens=-1)


# ------------------------------------------------------------------------------------------------
# CUDA: the chunked kernel path
# ------------------------------------------------------------------------------------------------
def _compare(dtype, rows, hidden, vocab, chunk, eps, reduction, ignore_index=-100, ignore_frac=0.2, seed=0):
    x, w, t = _inputs(rows, hidden, vocab, seed, "cuda", dtype, ignore_index, ignore_frac)
    loss, nll = linear_cross_entropy(x, w, t, eps, ignore_index, reduction, return_nll=True, chunk_tokens=chunk)
    assert loss.dtype == torch.float32 and nll.dtype == torch.float32 and loss.shape == ()
    go = torch.tensor(0.75, device="cuda")
    gx, gw = torch.autograd.grad(loss, (x, w), go)
    assert gx.dtype == dtype and gw.dtype == dtype

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref, ref_nll = linear_cross_entropy_ref(x64, w64, t, eps, ignore_index, reduction, return_nll=True)
    rx, rw = torch.autograd.grad(ref, (x64, w64), go.double())
    lowp = _torch_loss(x, w, t, eps, ignore_index, reduction) if dtype in LOWP else None
    tx, tw = torch.autograd.grad(lowp, (x, w), go) if lowp is not None else (None, None)
    check(loss, ref, lowp, dtype, atol32=1e-4, rtol32=1e-5, name="loss")
    check(nll, ref_nll, lowp, dtype, atol32=1e-4, rtol32=1e-5, atol_lowp=0.05, name="nll")
    check(gx, rx, tx, dtype, atol32=1e-5, rtol32=1e-4, name="grad x")
    check(gw, rw, tw, dtype, atol32=1e-5, rtol32=1e-4, name="grad weight")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [None, 1, 7, 64, 129])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunks_match_the_reference(dtype, chunk, reduction):
    _compare(dtype, 129, 64, 1000, chunk, 0.1, reduction)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,vocab", [(1, 32, 7), (31, 8, 5), (257, 128, 32000), (1031, 48, 333),
                                               (129, 64, 50257)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_odd_shapes_match_the_reference(dtype, rows, hidden, vocab, eps):
    _compare(dtype, rows, hidden, vocab, 100, eps, "mean", ignore_index=1)


@pytest.mark.cuda
def test_every_row_ignored_gives_nan_mean_and_zero_gradients():
    x, w, t = _inputs(9, 16, 11, 0, "cuda", torch.float16, ignore_frac=1.0)
    assert (t == -100).all()
    loss = linear_cross_entropy(x, w, t, 0.1, chunk_tokens=4)
    assert torch.isnan(loss)
    gx, gw = torch.autograd.grad(loss, (x, w))
    assert not gx.any() and not gw.any()
    assert linear_cross_entropy(x, w, t, 0.1, reduction="sum").item() == 0.0


@pytest.mark.cuda
def test_without_grad_computes_the_loss_alone():
    x, w, t = _inputs(40, 16, 50, 0, "cuda", torch.float16)
    with torch.no_grad():
        loss = linear_cross_entropy(x, w, t, 0.1, chunk_tokens=8)
        loss_sum, nll_sum, gx, gw = torch.ops.lsmini.linear_cross_entropy(x, w, t, 0.1, -100, 8, False)
    assert gx.numel() == 0 and gw.numel() == 0 and not loss.requires_grad
    assert torch.equal(loss, linear_cross_entropy(x, w, t, 0.1, chunk_tokens=8).detach())
    assert torch.equal(loss_sum / (t != -100).sum(), loss)


@pytest.mark.cuda
def test_equals_projection_then_cross_entropy_in_fp32():
    x, w, t = _inputs(300, 64, 500, 3, "cuda", torch.float32)
    loss = linear_cross_entropy(x, w, t, 0.1, chunk_tokens=128)
    expect = cross_entropy(F.linear(x, w), t, 0.1)
    assert_close_fp32(loss, expect, atol=1e-5, rtol=1e-5, name="loss")
    g = torch.autograd.grad(loss, (x, w))
    e = torch.autograd.grad(expect, (x, w))
    for a, b, name in zip(g, e, ("grad x", "grad weight")):
        assert_close_fp32(a, b, atol=1e-6, rtol=1e-4, name=name)


@pytest.mark.cuda
def test_autocast_casts_features_and_weight_as_linear_does():
    x, w, t = _inputs(33, 16, 40, 4, "cuda", torch.float32)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = linear_cross_entropy(x, w, t, 0.1)
    expect = linear_cross_entropy(x.half(), w.half(), t, 0.1)
    assert torch.equal(loss, expect)
    gx, gw = torch.autograd.grad(loss, (x, w))
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_opcheck(device):
    x, w, t = _inputs(50, 32, 70, 5, device, torch.float16)
    op = torch.ops.lsmini.linear_cross_entropy
    torch.library.opcheck(op, (x, w, t, 0.1, -100, 16, True))
    torch.library.opcheck(op, (x.detach(), w.detach(), t, 0.1, -100, 16, False))


@pytest.mark.cuda
def test_fullgraph_compile_matches_eager():
    ignored = 0
    x, w, t = _inputs(64, 32, 300, 6, "cuda", torch.float16, ignore_index=ignored)
    assert (t == ignored).any() and torch.isfinite(linear_cross_entropy(x, w, t, 0.1, ignored))

    def f(x, w, t):
        loss, nll = linear_cross_entropy(x, w, t, 0.1, ignored, return_nll=True, check_targets=False)
        return loss * 2, nll

    compiled = torch.compile(f, fullgraph=True)
    loss, nll = compiled(x, w, t)
    eloss, enll = f(x, w, t)
    # the same chunks and sums; Inductor fuses the mean's division with the doubling, which may round the last
    # bit differently, hence a tolerance of a few float32 ulps
    assert_close_fp32(loss, eloss, atol=0, rtol=1e-6, name="loss")
    assert_close_fp32(nll, enll, atol=0, rtol=1e-6, name="nll")
    g = torch.autograd.grad(loss, (x, w))
    e = torch.autograd.grad(eloss, (x, w))
    for a, b, name in zip(g, e, ("grad x", "grad weight")):
        assert_close_fp32(a, b, atol=1e-7, rtol=2e-3, name=name)  # a float16 rounding or two apart


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager():
    x, w, t = _inputs(96, 32, 200, 7, "cuda", torch.float16)
    xs, ts = x.detach().clone(), t.clone()

    def step():
        xg = xs.detach().requires_grad_()
        loss = linear_cross_entropy(xg, w, ts, 0.1, chunk_tokens=40, check_targets=False)
        return (loss,) + torch.autograd.grad(loss, (xg, w))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x2, _, t2 = _inputs(96, 32, 200, 8, "cuda", torch.float16)
    xs.copy_(x2.detach())
    ts.copy_(t2)
    graph.replay()
    expect = step()
    assert all(torch.equal(a, b) for a, b in zip(out, expect))


@pytest.mark.cuda
def test_cuda_bad_input():
    x, w, t = _inputs(6, 4, 9, seed=1, device="cuda", dtype=torch.float16)
    _raises(ValueError, r"linear_cross_entropy: weight is on cpu but x is on cuda", x, w.detach().cpu(), t)
    _raises(ValueError, r"linear_cross_entropy: target is on cpu but x is on cuda", x, w, t.cpu())
    bad = t.clone()
    bad[0] = -1
    _raises(ValueError, r"linear_cross_entropy: target values must be in \[0, 9\)", x, w, bad)


@pytest.mark.cuda
def test_backward_twice_with_retain_graph_gives_the_same_gradients():
    x, w, t = _inputs(50, 16, 70, 9, "cuda", torch.float16)
    loss = linear_cross_entropy(x, w, t, 0.1, chunk_tokens=16)
    first = torch.autograd.grad(loss, (x, w), retain_graph=True)
    second = torch.autograd.grad(loss, (x, w))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
