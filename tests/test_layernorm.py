import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini.ops.layernorm import layer_norm, layer_norm_ref
from util import LOWP, LsminiOps, assert_close_fp32, assert_lowp_rule, assert_same_up_to_sum_order, max_err

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(rows, hidden, dtype, device, mean=0.0, seed=0, param_dtype=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) + mean).to(device=device, dtype=dtype)
    pd = param_dtype or dtype
    w = (1 + 0.5 * torch.randn(hidden, generator=g)).to(device=device, dtype=pd)
    b = (0.5 * torch.randn(hidden, generator=g)).to(device=device, dtype=pd)
    dy = torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    return x, w, b, dy


def _grads(fn, x, w, b, dy):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True) if w is not None else None
    b = b.detach().clone().requires_grad_(True) if b is not None else None
    y = fn(x, w, b)
    y.backward(dy)
    return y.detach(), x.grad, (w.grad if w is not None else None), (b.grad if b is not None else None)


# ------------------------------------------------------------------------------------ CPU (CI) ---

@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (64, 512), (3, 5, 1032)])
def test_reference_matches_torch(shape):
    hidden = shape[-1]
    x, w, b, dy = _inputs(int(torch.tensor(shape[:-1]).prod()), hidden, torch.float64, "cpu")
    x, dy = x.view(shape), dy.view(shape)
    ours = _grads(lambda x, w, b: layer_norm_ref(x, w, b, 1e-5), x, w, b, dy)
    theirs = _grads(lambda x, w, b: F.layer_norm(x, (hidden,), w, b, 1e-5), x, w, b, dy)
    for name, a, r in zip(("y", "dx", "dw", "db"), ours, theirs):
        # the reference computes in fp32 by design; compare at fp32 accuracy
        assert_close_fp32(a, r, atol=1e-5, rtol=1e-4, name=name)


def test_reference_without_affine_and_large_mean():
    x, _, _, _ = _inputs(16, 256, torch.float64, "cpu", mean=1000.0)
    ref = F.layer_norm(x, (256,), eps=1e-5)
    assert_close_fp32(layer_norm_ref(x.float(), None, None), ref.float(), atol=1e-4, rtol=1e-4)


def _cpu_case(shape, dtype, param_dtype=None, affine=(True, True)):
    """The op on CPU (the registered operator's CPU implementation) against plain PyTorch, forward and
    backward with one random dy: fp32 tight against F.layer_norm; fp16/bf16 by the 2x rule against the
    float64 truth, PyTorch's own LayerNorm in that precision being the yardstick."""
    hidden = shape[-1]
    rows = int(torch.tensor(shape[:-1]).prod())
    x, w, b, dy = _inputs(rows, hidden, dtype, "cpu", param_dtype=param_dtype)
    x, dy = x.view(shape), dy.view(shape)
    w, b = (w if affine[0] else None), (b if affine[1] else None)
    with LsminiOps() as ops:
        ours = _grads(lambda x, w, b: layer_norm(x, w, b), x, w, b, dy)
    assert ops.names == ["layer_norm", "layer_norm_backward"]
    up = lambda t, dt: None if t is None else t.to(dt)  # noqa: E731
    if dtype == torch.float32:
        theirs = _grads(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), x, w, b, dy)
        for name, o, t in zip(("y", "dx", "dw", "db"), ours, theirs):
            assert (o is None) == (t is None), name
            if o is not None:
                assert_close_fp32(o, t, atol=1e-5, rtol=1e-4, name=name)
        return
    truth = _grads(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), x.double(), up(w, torch.float64),
                   up(b, torch.float64), dy.double())
    plain = _grads(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), x, up(w, dtype), up(b, dtype), dy)
    for i, (name, o, t, p) in enumerate(zip(("y", "dx", "dw", "db"), ours, truth, plain)):
        assert (o is None) == (t is None), name
        if o is None:
            continue
        assert o.dtype == (dtype if i < 2 else (param_dtype or dtype)), name
        # the parameter gradients sum `rows` terms: the low-precision yardstick rounds them once too
        assert_lowp_rule(o, t, p, atol=2e-3 if i < 2 else 1e-2, name=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (3, 5, 127), (129, 64)])
def test_op_on_cpu_matches_torch(shape, dtype):
    _cpu_case(shape, dtype)


@pytest.mark.parametrize("affine", [(False, False), (True, False), (False, True)])
def test_op_on_cpu_without_weight_or_bias(affine):
    _cpu_case((9, 40), torch.float32, affine=affine)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_op_on_cpu_fp32_params_with_low_precision_input(dtype):
    _cpu_case((17, 48), dtype, param_dtype=torch.float32)


def test_op_on_cpu_non_contiguous_input():
    x, w, b, dy = _inputs(6, 64, torch.float32, "cpu")
    xt = x.view(6, 2, 32).transpose(0, 1)  # [2, 6, 32], not contiguous
    with LsminiOps() as ops:
        y = layer_norm(xt, w[:32], b[:32])
    assert ops.names == ["layer_norm"]
    torch.testing.assert_close(y, F.layer_norm(xt, (32,), w[:32], b[:32]), atol=1e-5, rtol=1e-5)


def test_float64_and_forced_reference_call_the_reference_directly(monkeypatch):
    x, w, b, _ = _inputs(4, 16, torch.float64, "cpu")
    with LsminiOps() as ops:
        y = layer_norm(x, w, b)
    assert ops.names == [] and y.dtype == torch.float64
    torch.testing.assert_close(y, layer_norm_ref(x, w, b))
    monkeypatch.setattr(lsmini.config, "reference", True)
    x = x.float().requires_grad_()
    with LsminiOps() as ops:
        y = layer_norm(x, w.float(), b.float())
        y.sum().backward()
    assert ops.names == [] and x.grad is not None
    torch.testing.assert_close(y, layer_norm_ref(x, w.float(), b.float()))


def test_layer_is_a_drop_in_for_torch():
    torch.manual_seed(0)
    theirs = torch.nn.LayerNorm(48)
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.bias.normal_()
    ours = lsmini.layers.LayerNorm(48)
    ours.load_state_dict(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == ["weight", "bias"]
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(2, 3, 48)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
    theirs.load_state_dict(ours.state_dict())
    assert "48" in repr(ours) and "eps=1e-05" in repr(ours)


def test_layer_without_affine_or_bias():
    x = torch.randn(3, 40)
    ln = lsmini.layers.LayerNorm(40, elementwise_affine=False)
    assert ln.weight is None and ln.bias is None and len(list(ln.parameters())) == 0
    torch.testing.assert_close(ln(x), F.layer_norm(x, (40,)), atol=1e-5, rtol=1e-5)
    ln = lsmini.layers.LayerNorm(40, bias=False)
    assert ln.bias is None and ln.weight is not None
    torch.testing.assert_close(ln(x), F.layer_norm(x, (40,), ln.weight), atol=1e-5, rtol=1e-5)


def test_bad_input_errors():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="weight must have shape"):
        layer_norm(x, torch.ones(15), None)
    with pytest.raises(ValueError, match="bias must have shape"):
        layer_norm(x, None, torch.ones(4, 4))
    with pytest.raises(TypeError, match="floating-point"):
        layer_norm(torch.ones(4, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="last dimension 32"):
        lsmini.layers.LayerNorm(32)(x)
    with pytest.raises(ValueError, match="last dimension only"):
        lsmini.layers.LayerNorm((4, 16))


# x dtype, weight dtype, bias dtype (None: not given) -> the message, or None where the kernel takes them
DTYPE_CASES = [
    (torch.float32, torch.float64, None, "weight must be torch.float32 \\(x's dtype\\), got torch.float64"),
    (torch.float32, None, torch.float16, "bias must be torch.float32 \\(x's dtype\\), got torch.float16"),
    (torch.float16, torch.bfloat16, torch.bfloat16,
     "weight must be torch.float16 \\(x's dtype\\) or torch.float32, got torch.bfloat16"),
    (torch.bfloat16, torch.float32, torch.bfloat16,
     "weight and bias must have the same dtype, got weight torch.float32 and bias torch.bfloat16"),
    (torch.float64, torch.float16, torch.float16, "weight must be torch.float64 \\(x's dtype\\) or torch.float32"),
    (torch.bfloat16, torch.float32, torch.float32, None),
    (torch.float16, torch.float16, None, None),
    (torch.float64, torch.float32, torch.float32, None),
]


@pytest.mark.parametrize("x_dtype, w_dtype, b_dtype, error", DTYPE_CASES)
def test_dtype_mismatch_raises_before_dispatch(x_dtype, w_dtype, b_dtype, error):
    """weight/bias must be float32 or x's dtype, and one dtype: the kernel's rule, checked in Python before
    any operator runs (float64 x, which the kernel does not take, runs the reference directly)."""
    x = torch.randn(3, 8).to(x_dtype)
    w = None if w_dtype is None else torch.ones(8, dtype=w_dtype)
    b = None if b_dtype is None else torch.zeros(8, dtype=b_dtype)
    with LsminiOps() as ops:
        if error is not None:
            with pytest.raises(TypeError, match=f"^layer_norm: {error}"):
                layer_norm(x, w, b)
        else:
            y = layer_norm(x, w, b)
            assert y.dtype == x_dtype and y.shape == x.shape
    assert ops.names == ([] if error is not None or x_dtype == torch.float64 else ["layer_norm"])


def test_layer_module_with_mixed_parameter_dtypes_raises():
    ln = lsmini.layers.LayerNorm(8)
    ln.bias.data = ln.bias.data.double()
    with pytest.raises(TypeError, match="layer_norm: bias must be torch.float32 \\(x's dtype\\), got torch.float64"):
        ln(torch.randn(2, 8))


def test_backend_reports_reason(monkeypatch):
    b = lsmini.backend()
    assert b in ("cuda", "reference") and b.reason
    monkeypatch.setattr(lsmini.config, "reference", True)
    b = lsmini.backend()
    assert b == "reference" and "lsmini.config.reference" in b.reason


# ---------------------------------------------------------------------------------------- CUDA ---

def _cuda_case(rows, hidden, dtype, param_dtype=None, mean=0.0, affine=True):
    x, w, b, dy = _inputs(rows, hidden, dtype, "cuda", mean=mean, param_dtype=param_dtype)
    if not affine:
        w = b = None
    ours = _grads(lambda x, w, b: layer_norm(x, w, b), x, w, b, dy)
    up = lambda t: t.float() if t is not None else None  # noqa: E731
    ref = _grads(lambda x, w, b: layer_norm_ref(x, w, b), up(x), up(w), up(b), dy.float())
    if dtype in LOWP:
        pt = _grads(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), x,
                    None if w is None else w.to(dtype), None if b is None else b.to(dtype), dy)
    for i, name in enumerate(("y", "dx", "dw", "db")):
        if ours[i] is None:
            assert ref[i] is None
            continue
        assert ours[i].dtype == (x.dtype if i < 2 else (param_dtype or dtype)), name
        if dtype in LOWP:
            assert_lowp_rule(ours[i], ref[i], pt[i], atol=2e-3 if i < 2 else 1e-2, name=name)
        else:
            # dw/db sum `rows` terms: fp32 summation order differs from torch's
            tol = 1e-5 if i < 2 else 1e-5 * max(rows, 1) ** 0.5 * 4
            assert_close_fp32(ours[i], ref[i], atol=tol, rtol=1e-4, name=name)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 8), (1, 1032), (7, 8), (31, 512), (127, 1024), (129, 4104),
                                         (257, 768), (3, 16384), (61, 2048), (1000, 8)])
def test_kernel_matches_reference(rows, hidden, dtype):
    _cuda_case(rows, hidden, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(5, 8), (67, 1032), (2, 16384)])
def test_kernel_fp32_params_with_low_precision_input(rows, hidden, dtype):
    _cuda_case(rows, hidden, dtype, param_dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(3, 7), (17, 33), (5, 1001), (2, 4097), (9, 12), (2, 20000), (3, 9001),
                                         (3, 20001)])
def test_kernel_hidden_not_multiple_of_8(rows, hidden, dtype):
    _cuda_case(rows, hidden, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_without_affine(dtype):
    _cuda_case(33, 1024, dtype, affine=False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_large_mean(dtype):
    # x = 1000 + N(0, 1): E[x²] − E[x]² would cancel away the unit variance. Truth: float64 on the same
    # (rounded) inputs; the kernel must be within 2x of torch's own CUDA LayerNorm (Welford) at x's dtype.
    rows, hidden = 64, 1024
    x, w, b, dy = _inputs(rows, hidden, dtype, "cuda", mean=1000.0)
    ours = _grads(lambda x, w, b: layer_norm(x, w, b), x, w, b, dy)
    truth = _grads(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), x.double(), w.double(), b.double(),
                   dy.double())
    theirs = _grads(lambda x, w, b: F.layer_norm(x, (hidden,), w, b), x, w, b, dy)
    for name, o, t, p in zip(("y", "dx", "dw", "db"), ours, truth, theirs):
        assert_lowp_rule(o, t, p, atol=1e-4 if dtype == torch.float32 else 1e-2, name=name)
    if dtype == torch.float32:
        assert max_err(ours[0], truth[0]) < 1e-4


@pytest.mark.cuda
def test_kernel_non_contiguous_input():
    x, w, b, dy = _inputs(64, 2 * 1024, torch.float16, "cuda")
    xs = x[:, ::2]  # [64, 1024], stride 2
    assert not xs.is_contiguous()
    torch.testing.assert_close(layer_norm(xs, w[:1024], b[:1024]), layer_norm(xs.contiguous(), w[:1024], b[:1024]))
    xt = x.view(64, 2, 1024).transpose(0, 1)  # [2, 64, 1024] non-contiguous, 3-D
    torch.testing.assert_close(layer_norm(xt, w[:1024], b[:1024]).float(),
                               layer_norm_ref(xt.float(), w[:1024].float(), b[:1024].float()), atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_kernel_writes_every_output():
    # Poisoned outputs: call the binding directly with NaN-filled memory recycled through the allocator.
    x, w, b, dy = _inputs(257, 1032, torch.float16, "cuda")
    for _ in range(3):
        junk = torch.full((257 * 1032 * 4,), float("nan"), device="cuda", dtype=torch.float16)
        del junk
        y, mean, rstd = lsmini._backend.ext().layernorm_fwd(x, w, b, 1e-5)
        assert torch.isfinite(y).all() and torch.isfinite(mean).all() and torch.isfinite(rstd).all()
        junk = torch.full((257 * 1032 * 4,), float("nan"), device="cuda", dtype=torch.float16)
        del junk
        dx, dw, db = lsmini._backend.ext().layernorm_bwd(dy, x, w, b, mean, rstd)
        assert torch.isfinite(dx).all() and torch.isfinite(dw).all() and torch.isfinite(db).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(257, 1032), (9, 1001)])  # vectorized and scalar kernels
def test_kernel_out_and_add(rows, hidden, dtype):
    """forward's out; backward's add and out: dx = the input gradient plus add (a residual branch's
    gradient), rounded once, into a fresh tensor, a given buffer or add itself (in place); dw/db
    unchanged."""
    ext = lsmini._backend.ext()
    x, w, b, dy = _inputs(rows, hidden, dtype, "cuda")
    y, mean, rstd = ext.layernorm_fwd(x, w, b, 1e-5)
    buf = torch.full_like(x, float("nan"))  # forward's out: the same bits, written there
    y2, mean2, rstd2 = ext.layernorm_fwd(x, w, b, 1e-5, out=buf)
    assert y2.data_ptr() == buf.data_ptr() and torch.equal(y2, y) and torch.equal(rstd2, rstd)
    with pytest.raises(RuntimeError, match="layernorm_fwd: out overlaps x"):
        ext.layernorm_fwd(x, w, b, 1e-5, out=x)
    stats = torch.full((2, rows), float("nan"), device="cuda")  # the row statistics into given tensors too
    _, mean3, rstd3 = ext.layernorm_fwd(x, w, b, 1e-5, mean_out=stats[0], rstd_out=stats[1])
    assert mean3.data_ptr() == stats[0].data_ptr() and rstd3.data_ptr() == stats[1].data_ptr()
    assert torch.equal(stats[0], mean) and torch.equal(stats[1], rstd)
    with pytest.raises(RuntimeError, match="layernorm_fwd: mean_out must be Float"):
        ext.layernorm_fwd(x, w, b, 1e-5, mean_out=stats[0].double())
    with pytest.raises(RuntimeError, match="layernorm_fwd: rstd_out must be contiguous"):
        ext.layernorm_fwd(x, w, b, 1e-5, rstd_out=torch.empty(rows, 2, device="cuda")[:, 0])
    dx, dw, db = ext.layernorm_bwd(dy, x, w, b, mean, rstd)
    res = torch.randn(rows, hidden, device="cuda").to(dtype)
    fresh, dw2, db2 = ext.layernorm_bwd(dy, x, w, b, mean, rstd, add=res)
    assert torch.equal(dw2, dw) and torch.equal(db2, db)
    ref = _grads(lambda x, w, b: layer_norm_ref(x, w, b), x.float(), w.float(), b.float(), dy.float())[1]
    want = ref + res.float()
    tol = 1e-5 if dtype == torch.float32 else (4e-3 if dtype == torch.float16 else 3e-2)
    assert max_err(fresh, want) <= tol * (1 + want.abs().max().item())
    # dx + res in the output dtype: at most one rounding apart from the fused sum
    assert max_err(fresh, (dx.float() + res.float())) <= 2 * tol * (1 + want.abs().max().item())
    into = torch.full_like(x, float("nan"))
    acc, res0 = res.clone(), res.clone()
    for dst, add in ((into, res), (acc, acc)):
        got = ext.layernorm_bwd(dy, x, w, b, mean, rstd, add=add, out=dst)[0]
        assert got.data_ptr() == dst.data_ptr() and torch.equal(got, fresh)
    assert torch.equal(res, res0)  # add is only read unless it is out
    with pytest.raises(RuntimeError, match="layernorm_bwd: out overlaps dy"):
        ext.layernorm_bwd(dy, x, w, b, mean, rstd, add=res, out=dy)
    with pytest.raises(RuntimeError, match="layernorm_bwd: out partially overlaps add"):
        flat = torch.empty(rows * hidden + 1, dtype=dtype, device="cuda")
        ext.layernorm_bwd(dy, x, w, b, mean, rstd, add=flat[1:].view(rows, hidden), out=flat[:-1].view(rows, hidden))
    with pytest.raises(RuntimeError, match=r"layernorm_bwd: out must have shape"):
        ext.layernorm_bwd(dy, x, w, b, mean, rstd, out=acc[:1])
    with pytest.raises(RuntimeError, match=r"layernorm_bwd: add must have shape"):
        ext.layernorm_bwd(dy, x, w, b, mean, rstd, add=acc[:1])
    with pytest.raises(RuntimeError, match="layernorm_bwd: out must be contiguous"):
        ext.layernorm_bwd(dy, x, w, b, mean, rstd, out=torch.empty(hidden, rows, dtype=dtype, device="cuda").t())


@pytest.mark.cuda
def test_kernel_empty_batch():
    x = torch.randn(0, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    y = layer_norm(x, w, None)
    assert y.shape == (0, 64)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.cuda
def test_layer_on_cuda_matches_torch():
    torch.manual_seed(0)
    theirs = torch.nn.LayerNorm(512).cuda()
    ours = lsmini.layers.LayerNorm(512).cuda()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(8, 16, 512, device="cuda")
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_kernel_bad_input_errors():
    ext = lsmini._backend.ext()
    x = torch.randn(4, 16, device="cuda")
    w = torch.ones(16, device="cuda")
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        ext.layernorm_fwd(x.cpu(), None, None, 1e-5)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        ext.layernorm_fwd(x, torch.ones(8, device="cuda"), None, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be a CUDA tensor"):
        ext.layernorm_fwd(x, w.cpu(), None, 1e-5)
    with pytest.raises(RuntimeError, match="unsupported dtype|must be float32, float16 or bfloat16"):
        ext.layernorm_fwd(x.double(), None, None, 1e-5)
    with pytest.raises(RuntimeError, match="weight must be float32 or the dtype of x"):
        ext.layernorm_fwd(x.half(), w.bfloat16(), None, 1e-5)
    with pytest.raises(ValueError, match="weight is on cpu"):
        layer_norm(x, w.cpu(), None)


@pytest.mark.cuda
def test_config_reference(monkeypatch):
    x, w, b, _ = _inputs(8, 64, torch.float32, "cuda")
    with LsminiOps() as ops:
        layer_norm(x, w, b)
    assert ops.names == ["layer_norm"]
    monkeypatch.setattr(lsmini.config, "reference", True)
    assert lsmini.backend() == "reference"
    with LsminiOps() as ops:
        y = layer_norm(x.requires_grad_(), w, b)
    assert ops.names == [] and y.grad_fn is not None
    torch.testing.assert_close(y, layer_norm_ref(x, w, b))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,param_dtype", [(d, w) for d in DTYPES for w in [None, torch.float32] if w != d])
@pytest.mark.parametrize("rows,hidden", [(257, 1032), (9, 1001), (33, 512), (5, 8192)])  # vector and scalar paths
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("has_bias", [True, False])
def test_kernel_residual_form_is_bias_dropout_residual_then_norm(dtype, param_dtype, rows, hidden, p, has_bias):
    """The residual form, s = residual + dropout(x + x_bias) normalized in one kernel, gives the same bits of s as
    bias_dropout_residual_fwd, and y, mean and rstd as layernorm_fwd of that s up to the order of the row's fp32
    sums (the residual form gives a thread at most 16 elements of the row, the plain kernel 32, so they may split
    a row over different thread counts): within one rounding of T; into sum_out and over x itself too."""
    ext = lsmini._backend.ext()
    x, w, b, residual = _inputs(rows, hidden, dtype, "cuda", param_dtype=param_dtype)
    x_bias = (0.5 * torch.randn(hidden, device="cuda")).to(param_dtype or dtype) if has_bias else None
    rng = (1234, 56, 0, 0)
    s_ref = ext.bias_dropout_residual_fwd(x, x_bias, residual, p, rng)
    y_ref, mean_ref, rstd_ref = ext.layernorm_fwd(s_ref, w, b, 1e-5)
    y, mean, rstd, s = ext.layernorm_fwd(x, w, b, 1e-5, residual=residual, x_bias=x_bias, p=p, rng=rng)
    assert torch.equal(s, s_ref)
    assert_same_up_to_sum_order(y, y_ref, mean, mean_ref, rstd, rstd_ref)
    over_x = x.clone()
    y2, _, _, s2 = ext.layernorm_fwd(over_x, w, b, 1e-5, residual=residual, x_bias=x_bias, p=p, rng=rng,
                                     sum_out=over_x)
    assert s2.data_ptr() == over_x.data_ptr() and torch.equal(over_x, s_ref) and torch.equal(y2, y)



@pytest.mark.cuda
def test_kernel_residual_form_bad_input_errors():
    ext = lsmini._backend.ext()
    x, w, b, residual = _inputs(4, 64, torch.bfloat16, "cuda")
    with pytest.raises(RuntimeError, match="layernorm_fwd: x_bias, p and sum_out are those of the residual form"):
        ext.layernorm_fwd(x, w, b, 1e-5, p=0.1, rng=(1, 2, 0, 0))
    with pytest.raises(RuntimeError, match="layernorm_fwd: x_bias must have the weight and bias's dtype"):
        ext.layernorm_fwd(x, w, b, 1e-5, residual=residual, x_bias=torch.zeros(64, device="cuda"))
    with pytest.raises(RuntimeError, match="layernorm_fwd: residual must"):
        ext.layernorm_fwd(x, w, b, 1e-5, residual=residual[:, :32])
    rows_5 = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="layernorm_fwd: sum_out partially overlaps x"):
        ext.layernorm_fwd(rows_5[:4], w, b, 1e-5, residual=residual, sum_out=rows_5[1:])
    with pytest.raises(RuntimeError, match="layernorm_fwd: sum_out overlaps residual"):
        ext.layernorm_fwd(x, w, b, 1e-5, residual=residual, sum_out=residual)
