"""lsmini.ops.rms_norm and add_rms_norm: the references against torch.nn.functional.rms_norm, the registered
operators on CPU (CI) and the kernels on CUDA against the references, forward and backward, with one shared
random output gradient."""
import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini import limits
from lsmini.ops import add_rms_norm, add_rms_norm_ref, rms_norm, rms_norm_ref
from util import (LOWP, LsminiOps, assert_close_fp32, assert_column_sum_close, assert_lowp_rule,
                  assert_same_up_to_sum_order, max_err)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def _inputs(shape, dtype, device, weight_dtype="same", scale=1.0, seed=0):
    """x, residual, weight (or None), dy, ds: seeded, never zero."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = shape[-1]
    x = (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)
    res = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    w = (1 + 0.5 * torch.randn(hidden, generator=g))
    w = None if weight_dtype is None else w.to(device=device, dtype=dtype if weight_dtype == "same" else weight_dtype)
    dy = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    ds = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    return x, res, w, dy, ds


def _run(fn, inputs, grads):
    """fn(*inputs)'s outputs (a tuple, detached) and the gradients of every tensor input (None stays None), from
    one backward with `grads` on the outputs."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(out, grads)
    return tuple(o.detach() for o in out), tuple(None if t is None else t.grad for t in leaves)


def _up(t, dtype=torch.float32):
    return None if t is None else t.to(dtype)


def _torch_rms_norm(x, w, eps=EPS):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _torch_add_rms_norm(x, r, w, eps=EPS):
    s = x + r
    return s, _torch_rms_norm(s, w, eps)


def _check(ours, truth, plain, names, lowp, rows=1, atol_lowp=(2e-3, 1e-2)):
    """Each of ours against the truth: fp32 tight (parameter gradients by a summation bound on their rows);
    fp16/bf16 by the 2x rule, plain PyTorch in that precision being the yardstick."""
    for name, o, t, p in zip(names, ours, truth, plain):
        assert (o is None) == (t is None), name
        if o is None:
            continue
        is_param = name == "dw"
        if lowp:
            assert_lowp_rule(o, t, p, atol=atol_lowp[is_param], name=name)
        elif is_param:
            tol = 1e-5 * max(rows, 1) ** 0.5 * 4
            assert_close_fp32(o, t, atol=tol, rtol=1e-4, name=name)
        else:
            assert_close_fp32(o, t, atol=1e-5, rtol=1e-4, name=name)


def _backward_node(y):
    """The autograd node of the lsmini operator behind y (under the views the public op returns)."""
    node = y.grad_fn
    while "lsmini" not in type(node).__name__:
        node = node.next_functions[0][0]
    return node


# ------------------------------------------------------------------------------------ CPU (CI) ---

@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (3, 5, 127)])
def test_reference_matches_torch(shape, weight):
    """In float64 the references compute in float64: they match F.rms_norm to rounding, forward and backward,
    and the residual form matches x + residual followed by F.rms_norm."""
    x, r, w, dy, ds = _inputs(shape, torch.float64, "cpu", weight_dtype=torch.float64 if weight else None)
    ours = _run(lambda x, w: rms_norm_ref(x, w, EPS), (x, w), dy)
    theirs = _run(lambda x, w: _torch_rms_norm(x, w), (x, w), dy)
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    ours = _run(lambda x, r, w: add_rms_norm_ref(x, r, w, EPS), (x, r, w), (ds, dy))
    theirs = _run(lambda x, r, w: _torch_add_rms_norm(x, r, w), (x, r, w), (ds, dy))
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_computes_in_fp32_and_keeps_dtype(dtype):
    x, r, w, _, _ = _inputs((5, 12), dtype, "cpu", weight_dtype=torch.float32)
    y = rms_norm_ref(x, w)
    assert y.dtype == dtype
    assert torch.equal(y, _torch_rms_norm(x.float(), w).to(dtype))
    s, y = add_rms_norm_ref(x, r, w)
    assert s.dtype == y.dtype == dtype
    assert torch.equal(s, (x.float() + r.float()).to(dtype))
    assert torch.equal(y, rms_norm_ref(s, w))  # the rounded s is what is normalized


def _cpu_case(shape, dtype, weight_dtype="same", residual=False):
    """The op on CPU (the registered operators' CPU implementations) against plain PyTorch, forward and backward
    with random output gradients: fp32 tight against F.rms_norm; fp16/bf16 by the 2x rule against the float64
    truth, PyTorch's own RMSNorm in that precision being the yardstick."""
    x, r, w, dy, ds = _inputs(shape, dtype, "cpu", weight_dtype)
    rows = x.numel() // shape[-1]
    if residual:
        inputs, grads, names = (x, r, w), (ds, dy), ("s", "y", "dx", "dresidual", "dw")
        fn, plain_fn, want_ops = add_rms_norm, _torch_add_rms_norm, ["add_rms_norm", "rms_norm_backward"]
    else:
        inputs, grads, names = (x, w), dy, ("y", "dx", "dw")
        fn, plain_fn, want_ops = rms_norm, _torch_rms_norm, ["rms_norm", "rms_norm_backward"]
    with LsminiOps() as ops:
        out, gin = _run(fn, inputs, grads)
    assert ops.names == want_ops
    ours = out + gin
    for o in ours[:-1]:
        assert o.dtype == dtype
    if w is not None:
        assert ours[-1].dtype == w.dtype
    if residual:
        assert torch.equal(gin[0], gin[1]), "x and residual get the same gradient"
    if dtype == torch.float32:
        theirs = _run(plain_fn, inputs, grads)
        _check(ours, theirs[0] + theirs[1], [None] * len(names), names, lowp=False, rows=rows)
        return
    up64 = [_up(t, torch.float64) for t in inputs]
    grads64 = tuple(_up(g, torch.float64) for g in grads) if residual else grads.double()
    truth = _run(plain_fn, up64, grads64)
    plain = _run(plain_fn, [_up(t, dtype) for t in inputs], grads)
    _check(ours, truth[0] + truth[1], plain[0] + plain[1], names, lowp=True, rows=rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (3, 5, 127), (129, 64), (2, 1031)])
def test_op_on_cpu_matches_torch(shape, dtype):
    _cpu_case(shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 33), (3, 5, 127)])
def test_add_op_on_cpu_matches_torch(shape, dtype):
    _cpu_case(shape, dtype, residual=True)


@pytest.mark.parametrize("residual", [False, True])
def test_op_on_cpu_without_weight(residual):
    _cpu_case((9, 40), torch.float32, weight_dtype=None, residual=residual)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_op_on_cpu_fp32_weight_with_low_precision_input(dtype, residual):
    _cpu_case((17, 48), dtype, weight_dtype=torch.float32, residual=residual)


def test_add_rms_norm_with_one_output_used():
    """Only y used (s's gradient is zero) and only s used (y's is zero): the same gradients as plain PyTorch,
    except that the weight, an input of the one operator, gets zeros where PyTorch leaves it without one."""
    x, r, w, dy, _ = _inputs((6, 24), torch.float32, "cpu")
    for pick in (0, 1):
        ours = _run(lambda x, r, w: add_rms_norm(x, r, w)[pick], (x, r, w), dy)
        theirs = _run(lambda x, r, w: _torch_add_rms_norm(x, r, w)[pick], (x, r, w), dy)
        for a, b in zip(ours[1], theirs[1]):
            assert_close_fp32(a, torch.zeros_like(a) if b is None else b, atol=1e-5, rtol=1e-4)


def test_op_on_cpu_non_contiguous_input():
    x, r, w, _, _ = _inputs((6, 64), torch.float32, "cpu")
    xt = x.view(6, 2, 32).transpose(0, 1)  # [2, 6, 32], not contiguous
    rt = r.view(6, 2, 32).transpose(0, 1)
    with LsminiOps() as ops:
        y = rms_norm(xt, w[:32])
        s, y2 = add_rms_norm(xt, rt, w[:32])
    assert ops.names == ["rms_norm", "add_rms_norm"]
    torch.testing.assert_close(y, _torch_rms_norm(xt, w[:32]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, xt + rt)
    torch.testing.assert_close(y2, _torch_rms_norm(xt + rt, w[:32]), atol=1e-5, rtol=1e-5)


def test_empty_rows_on_cpu():
    x, r, w, dy, ds = _inputs((0, 16), torch.float32, "cpu")
    (y,), (dx, dw) = _run(rms_norm, (x, w), dy)
    assert y.shape == dx.shape == (0, 16) and torch.equal(dw, torch.zeros_like(dw))
    (s, y), (dx, dr, dw) = _run(add_rms_norm, (x, r, w), (ds, dy))
    assert s.shape == y.shape == dr.shape == (0, 16) and torch.equal(dw, torch.zeros_like(dw))


def test_backward_saves_the_normalized_input_weight_and_rstd():
    """rms_norm keeps x, weight and rstd [rows] (float32); add_rms_norm keeps s instead of x and residual."""
    x, r, w, _, _ = _inputs((4, 3, 16), torch.bfloat16, "cpu", weight_dtype=torch.float32)
    x.requires_grad_()
    y = rms_norm(x, w)
    saved = _backward_node(y).saved_tensors
    assert [t.shape for t in saved] == [(12, 16), (16,), (12,)] and saved[2].dtype == torch.float32
    assert saved[0].data_ptr() == x.data_ptr()
    s, y = add_rms_norm(x, r, w)
    saved = _backward_node(y).saved_tensors
    assert [t.shape for t in saved] == [(12, 16), (16,), (12,)]
    assert saved[0].data_ptr() == s.data_ptr()
    torch.testing.assert_close(saved[2], torch.rsqrt(s.float().pow(2).mean(-1) + EPS).view(-1))


def test_eps_default_and_none():
    x, _, w, _, _ = _inputs((3, 20), torch.float32, "cpu", scale=1e-3)  # eps matters at this scale
    torch.testing.assert_close(rms_norm(x, w), _torch_rms_norm(x, w, 1e-6), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rms_norm(x, w, eps=None), F.rms_norm(x, (20,), w), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(rms_norm(x, w, eps=1e-2), _torch_rms_norm(x, w, 1e-2), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(rms_norm(x, w, eps=1e-2), rms_norm(x, w))


def test_float64_large_hidden_and_forced_reference_call_the_reference_directly(monkeypatch):
    x, r, w, _, _ = _inputs((4, 16), torch.float64, "cpu")
    with LsminiOps() as ops:
        y = rms_norm(x, w)
        s, y2 = add_rms_norm(x, r, w)
    assert ops.names == [] and y.dtype == s.dtype == y2.dtype == torch.float64
    torch.testing.assert_close(y, _torch_rms_norm(x, w), atol=1e-12, rtol=1e-12)  # float64 math
    x, r, w = x.float(), r.float(), w.float()
    monkeypatch.setattr(limits, "RMS_NORM_MAX_HIDDEN", 8)  # longer rows than the kernel holds: the reference
    with LsminiOps() as ops:
        y = rms_norm(x, w)
        add_rms_norm(x, r, w)
    assert ops.names == []
    torch.testing.assert_close(y, rms_norm_ref(x, w, EPS))
    monkeypatch.setattr(limits, "RMS_NORM_MAX_HIDDEN", 16)
    with LsminiOps() as ops:
        rms_norm(x, w)
    assert ops.names == ["rms_norm"]
    monkeypatch.setattr(lsmini.config, "reference", True)
    x = x.requires_grad_()
    with LsminiOps() as ops:
        y = rms_norm(x, w)
        s, y2 = add_rms_norm(x, r, w)
        (y.sum() + s.sum() + y2.sum()).backward()
    assert ops.names == [] and x.grad is not None
    torch.testing.assert_close(y, rms_norm_ref(x, w))


BAD_CALLS = [
    (lambda x, r, w: rms_norm(x, w[:7]), ValueError, r"rms_norm: weight must have shape \(16,\)"),
    (lambda x, r, w: rms_norm(x, w.double()), TypeError, r"rms_norm: weight must be torch.float32 \(x's dtype\), "
                                                         "got torch.float64"),
    (lambda x, r, w: rms_norm(x.half(), w.bfloat16()), TypeError,
     r"rms_norm: weight must be torch.float16 \(x's dtype\) or torch.float32, got torch.bfloat16"),
    (lambda x, r, w: rms_norm(x, w.tolist()), TypeError, "rms_norm: weight must be a Tensor or None, got list"),
    (lambda x, r, w: rms_norm(x, w, eps=0.0), ValueError, "rms_norm: eps must be a finite float > 0, got 0.0"),
    (lambda x, r, w: rms_norm(x, w, eps=-1e-5), ValueError, "rms_norm: eps must be a finite float > 0, got -1e-05"),
    (lambda x, r, w: rms_norm(x, w, eps=float("nan")), ValueError, "eps must be a finite float > 0, got nan"),
    (lambda x, r, w: rms_norm(x, w, eps=float("inf")), ValueError, "eps must be a finite float > 0, got inf"),
    (lambda x, r, w: rms_norm(x, w, eps=True), TypeError, "rms_norm: eps must be a float > 0 or None, got bool"),
    (lambda x, r, w: rms_norm(x, w, eps="1e-6"), TypeError, "eps must be a float > 0 or None, got str"),
    (lambda x, r, w: rms_norm(x.int(), None), TypeError, "rms_norm: x must be a floating-point tensor"),
    (lambda x, r, w: rms_norm(x[:, :0], None), ValueError, "rms_norm: x must have a non-empty last dimension"),
    (lambda x, r, w: rms_norm(x.numpy(), None), TypeError, "rms_norm: x must be a Tensor, got ndarray"),
    (lambda x, r, w: add_rms_norm(x, r[:2], w), ValueError, r"add_rms_norm: residual must have x's shape \(4, 16\), "
                                                            r"got \(2, 16\)"),
    (lambda x, r, w: add_rms_norm(x, r.half(), w), TypeError,
     "add_rms_norm: residual must have x's dtype torch.float32, got torch.float16"),
    (lambda x, r, w: add_rms_norm(x, None, w), TypeError, "add_rms_norm: residual must be a Tensor, got NoneType"),
    (lambda x, r, w: add_rms_norm(x, r, w[:3]), ValueError, r"add_rms_norm: weight must have shape \(16,\)"),
    (lambda x, r, w: add_rms_norm(x, r, w, eps=0), ValueError, "add_rms_norm: eps must be a finite float > 0"),
]


@pytest.mark.parametrize("case", range(len(BAD_CALLS)))
def test_bad_input_errors_before_any_operator_runs(case):
    call, error, match = BAD_CALLS[case]
    x, r, w, _, _ = _inputs((4, 16), torch.float32, "cpu")
    with LsminiOps() as ops:
        with pytest.raises(error, match=match):
            call(x, r, w)
    assert ops.names == []


# ---------------------------------------------------------------------------------------- CUDA ---

def _cuda_case(shape, dtype, weight_dtype="same", residual=False, scale=1.0):
    """The kernels against the fp32 reference (the truth for inputs rounded to dtype), forward and backward:
    fp32 tight, with dweight by a summation bound; fp16/bf16 by the 2x rule, PyTorch's F.rms_norm in that
    precision (weight cast to it) the yardstick."""
    x, r, w, dy, ds = _inputs(shape, dtype, "cuda", weight_dtype, scale=scale)
    rows = x.numel() // shape[-1]
    if residual:
        inputs, grads, names = (x, r, w), (ds, dy), ("s", "y", "dx", "dresidual", "dw")
        ours = _run(add_rms_norm, inputs, grads)
        ref = _run(lambda x, r, w: add_rms_norm_ref(x, r, w, EPS), [_up(t) for t in inputs], tuple(_up(g) for g in grads))
        plain = _run(_torch_add_rms_norm, [_up(t, dtype) for t in inputs], grads) if dtype in LOWP else None
    else:
        inputs, grads, names = (x, w), dy, ("y", "dx", "dw")
        ours = _run(rms_norm, inputs, grads)
        ref = _run(lambda x, w: rms_norm_ref(x, w, EPS), [_up(t) for t in inputs], _up(grads))
        plain = _run(_torch_rms_norm, [_up(t, dtype) for t in inputs], grads) if dtype in LOWP else None
    ours, ref = ours[0] + ours[1], ref[0] + ref[1]
    for name, o in zip(names, ours):
        if o is not None:
            assert o.dtype == (w.dtype if name == "dw" else dtype), name
    if residual:
        assert torch.equal(ours[2], ours[3]), "x and residual get the same gradient"
    if dtype in LOWP:
        _check(ours, ref, plain[0] + plain[1], names, lowp=True, rows=rows)
        return
    for name, o, t in zip(names, ours, ref):
        if name != "dw":
            assert_close_fp32(o, t, atol=1e-5, rtol=1e-4, name=name)
        elif o is not None:
            # column sums of dy·x̂ over the rows, in another order than the reference's
            xn = (ours[0] if residual else x).double().reshape(-1, shape[-1])
            terms = dy.double().reshape(-1, shape[-1]) * xn * torch.rsqrt(xn.pow(2).mean(-1, keepdim=True) + EPS)
            assert_column_sum_close(o, terms.sum(0), terms.abs().sum(0), rows, name="dw")


# (rows, hidden): one row, odd row counts, the vector path from 8 to 16384 elements, the row sizes of the
# issue's benchmark (512-4096), the largest hidden, one row per warp and per block, and more rows than one
# wave of the backward's blocks holds (each warp walks several rows).
SHAPES = [(1, 8), (1, 1032), (7, 8), (31, 512), (127, 1024), (129, 4104), (257, 768), (3, 16384), (61, 2048),
          (1000, 8), (65, 4096), (2, 8192), (2, 32768), (3, 5, 1032), (9001, 768), (5003, 2048), (4001, 1024),
          (1001, 1536), (3001, 3072), (4001, 4096)]
# hidden sizes that are not a multiple of the vector width: the scalar path
ODD_SHAPES = [(3, 7), (17, 33), (5, 1001), (2, 4097), (9, 12), (2, 20000), (3, 9001), (3, 20001), (1, 1), (2, 32767)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + ODD_SHAPES)
def test_kernel_matches_reference(shape, dtype):
    _cuda_case(shape, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 8), (31, 512), (129, 4104), (3, 16384), (2, 32768), (3, 7), (17, 33),
                                   (5, 1001), (3, 20001), (3, 5, 1032), (9001, 768), (4001, 1024), (2003, 4096)])
def test_add_kernel_matches_reference(shape, dtype):
    _cuda_case(shape, dtype, residual=True)


@pytest.mark.cuda
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 8), (67, 1032), (2, 16384), (9, 1001), (2001, 1024), (5003, 2048)])
def test_kernel_fp32_weight_with_low_precision_input(shape, dtype, residual):
    _cuda_case(shape, dtype, weight_dtype=torch.float32, residual=residual)


@pytest.mark.cuda
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(33, 1024), (7, 33)])
def test_kernel_without_weight(shape, dtype, residual):
    _cuda_case(shape, dtype, weight_dtype=None, residual=residual)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1e-3, 300.0])
def test_kernel_small_and_large_magnitudes(dtype, scale):
    """Tiny rows (eps matters) and large ones (x² far past fp16's range): the sums are fp32."""
    _cuda_case((64, 1024), dtype, scale=scale)
    _cuda_case((64, 1024), dtype, scale=scale, residual=True)


@pytest.mark.cuda
def test_kernel_matches_torch_rms_norm_and_eps():
    x, _, w, _, _ = _inputs((37, 520), torch.float32, "cuda", scale=1e-2)
    for eps in (1e-6, 1e-3, None):
        torch.testing.assert_close(rms_norm(x, w, eps), F.rms_norm(x, (520,), w, eps), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_kernel_non_contiguous_input():
    x, r, w, _, _ = _inputs((64, 2 * 1024), torch.float16, "cuda")
    xs, rs = x[:, ::2], r[:, ::2]  # [64, 1024], stride 2
    assert not xs.is_contiguous()
    assert torch.equal(rms_norm(xs, w[:1024]), rms_norm(xs.contiguous(), w[:1024]))
    s, y = add_rms_norm(xs, rs, w[:1024])
    s2, y2 = add_rms_norm(xs.contiguous(), rs.contiguous(), w[:1024])
    assert torch.equal(s, s2) and torch.equal(y, y2)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_vector_and_scalar_paths_agree(dtype):
    """The same rows at a 16-byte-aligned and a misaligned address: the scalar fallback gives the same s, and y,
    rstd, dx and dw up to the order of the fp32 sums (the two paths split a row differently)."""
    ext = lsmini._backend.ext()
    rows, hidden = 77, 1032
    x, r, w, dy, ds = _inputs((rows, hidden), dtype, "cuda")
    n = rows * hidden
    buf = torch.empty(4 * n + 1, device="cuda", dtype=dtype)
    xs, rs, dys, dss = (buf[1 + k * n: 1 + (k + 1) * n].view(rows, hidden) for k in range(4))
    for dst, src in ((xs, x), (rs, r), (dys, dy), (dss, ds)):
        dst.copy_(src)
    assert xs.data_ptr() % 16 != 0
    ulp = {torch.float32: 1e-5, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]

    def close(a, b, rtol=ulp):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=rtol)

    _, y, rstd = ext.rms_norm_fwd(x, w, EPS)
    _, y2, rstd2 = ext.rms_norm_fwd(xs, w, EPS)
    close(y, y2)
    close(rstd, rstd2, rtol=1e-5)
    s, ys, rstds = ext.rms_norm_fwd(x, w, EPS, r)
    s2, ys2, rstds2 = ext.rms_norm_fwd(xs, w, EPS, rs)
    assert torch.equal(s, s2)
    close(ys, ys2)
    close(rstds, rstds2, rtol=1e-5)
    dx, dw = ext.rms_norm_bwd(dy, x, w, rstd, ds)
    dx2, dw2 = ext.rms_norm_bwd(dys, xs, w, rstd, dss)
    close(dx, dx2)
    close(dw, dw2)


@pytest.mark.cuda
def test_kernel_writes_every_output():
    """NaN-filled memory recycled through the allocator under the outputs: every element is written."""
    ext = lsmini._backend.ext()
    x, r, w, dy, ds = _inputs((257, 1032), torch.float16, "cuda")
    for _ in range(3):
        junk = torch.full((257 * 1032 * 6,), float("nan"), device="cuda", dtype=torch.float16)
        del junk
        s, y, rstd = ext.rms_norm_fwd(x, w, EPS, r)
        assert torch.isfinite(s).all() and torch.isfinite(y).all() and torch.isfinite(rstd).all()
        junk = torch.full((257 * 1032 * 6,), float("nan"), device="cuda", dtype=torch.float16)
        del junk
        dx, dw = ext.rms_norm_bwd(dy, s, w, rstd, ds)
        assert torch.isfinite(dx).all() and torch.isfinite(dw).all()


@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [520, 1024])  # a row group; four warps a row
def test_dweight_deterministic_over_many_rows(hidden):
    ext = lsmini._backend.ext()
    x, _, w, dy, _ = _inputs((20000, hidden), torch.float32, "cuda")
    _, _, rstd = ext.rms_norm_fwd(x, w, EPS)
    dx1, dw1 = ext.rms_norm_bwd(dy, x, w, rstd)
    dx2, dw2 = ext.rms_norm_bwd(dy, x, w, rstd)
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)
    terms = dy.double() * x.double() * rstd.double()[:, None]
    assert_column_sum_close(dw1, terms.sum(0), terms.abs().sum(0), 20000, name="dw")


@pytest.mark.cuda
@pytest.mark.parametrize("residual", [False, True])
def test_kernel_empty_batch(residual):
    x, r, w, dy, ds = _inputs((0, 64), torch.bfloat16, "cuda", weight_dtype=torch.float32)
    if residual:
        (s, y), (dx, dr, dw) = _run(add_rms_norm, (x, r, w), (ds, dy))
        assert s.shape == dr.shape == (0, 64)
    else:
        (y,), (dx, dw) = _run(rms_norm, (x, w), dy)
    assert y.shape == dx.shape == (0, 64)
    assert dw.dtype == torch.float32 and torch.equal(dw, torch.zeros_like(dw))


@pytest.mark.cuda
def test_binding_bad_input_errors():
    ext = lsmini._backend.ext()
    x, r, w, dy, _ = _inputs((4, 16), torch.float16, "cuda")
    _, _, rstd = ext.rms_norm_fwd(x, w, EPS)
    with pytest.raises(RuntimeError, match="rms_norm_fwd: x must be a CUDA tensor"):
        ext.rms_norm_fwd(x.cpu(), None, EPS)
    with pytest.raises(RuntimeError, match="rms_norm_fwd: x must be float32, float16 or bfloat16, got Double"):
        ext.rms_norm_fwd(x.double(), None, EPS)
    with pytest.raises(ValueError, match=r"rms_norm_fwd: x must be 2-D \[rows, hidden\]"):
        ext.rms_norm_fwd(x.view(2, 2, 16), None, EPS)
    with pytest.raises(ValueError, match=r"rms_norm_fwd: x's last dimension \(hidden\) must be in \[1, 32768\], got "
                                         "32769"):
        ext.rms_norm_fwd(torch.ones(1, 32769, device="cuda"), None, EPS)
    with pytest.raises(ValueError, match=r"rms_norm_fwd: weight must have shape \[16\]"):
        ext.rms_norm_fwd(x, w[:8], EPS)
    with pytest.raises(TypeError, match=r"rms_norm_fwd: weight must be Half \(x's dtype\) or float32, got BFloat16"):
        ext.rms_norm_fwd(x, w.bfloat16(), EPS)
    with pytest.raises(RuntimeError, match="rms_norm_fwd: weight must be a CUDA tensor"):
        ext.rms_norm_fwd(x, w.cpu(), EPS)
    for eps, shown in ((0.0, "0"), (-1e-9, "-1e-09"), (float("nan"), "nan"), (float("inf"), "inf")):
        with pytest.raises(ValueError, match=f"rms_norm_fwd: eps must be a finite float > 0, got {shown}"):
            ext.rms_norm_fwd(x, w, eps)
    with pytest.raises(RuntimeError, match=r"rms_norm_fwd: residual must have shape \[4, 16\]"):
        ext.rms_norm_fwd(x, w, EPS, r[:2])
    with pytest.raises(RuntimeError, match="rms_norm_fwd: residual must be Half"):
        ext.rms_norm_fwd(x, w, EPS, r.float())
    with pytest.raises(RuntimeError, match=r"rms_norm_bwd: dy must have shape \[4, 16\]"):
        ext.rms_norm_bwd(dy[:2], x, w, rstd)
    with pytest.raises(RuntimeError, match=r"rms_norm_bwd: rstd must have shape \[4\]"):
        ext.rms_norm_bwd(dy, x, w, rstd[:2])
    with pytest.raises(RuntimeError, match="rms_norm_bwd: rstd must be Float"):
        ext.rms_norm_bwd(dy, x, w, rstd.half())
    with pytest.raises(RuntimeError, match="rms_norm_bwd: add must be Half"):
        ext.rms_norm_bwd(dy, x, w, rstd, dy.float())
    with pytest.raises(ValueError, match="rms_norm: weight is on cpu but x is on cuda"):
        rms_norm(x, w.cpu())
    with pytest.raises(ValueError, match="add_rms_norm: residual is on cpu but x is on cuda"):
        add_rms_norm(x, r.cpu(), w)


@pytest.mark.cuda
def test_hidden_past_the_kernel_limit_runs_the_reference():
    x = torch.randn(2, limits.RMS_NORM_MAX_HIDDEN + 1, device="cuda")
    with LsminiOps() as ops:
        y = rms_norm(x)
    assert ops.names == []
    torch.testing.assert_close(y, _torch_rms_norm(x, None), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_config_reference(monkeypatch):
    x, r, w, _, _ = _inputs((8, 64), torch.float32, "cuda")
    with LsminiOps() as ops:
        rms_norm(x, w)
        add_rms_norm(x, r, w)
    assert ops.names == ["rms_norm", "add_rms_norm"]
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        y = rms_norm(x.requires_grad_(), w)
    assert ops.names == [] and y.grad_fn is not None
    torch.testing.assert_close(y, rms_norm_ref(x, w))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,weight_dtype", [(d, w) for d in DTYPES for w in ["same", torch.float32] if w != d])
@pytest.mark.parametrize("rows,hidden", [(257, 1032), (9, 1001), (33, 512), (5, 8192)])  # vector and scalar paths
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("has_bias", [True, False])
def test_kernel_residual_form_is_bias_dropout_residual_then_norm(dtype, weight_dtype, rows, hidden, p, has_bias):
    """The residual form with a bias and dropout, s = residual + dropout(x + x_bias) normalized in one kernel,
    gives the same bits of s as bias_dropout_residual_fwd, and y and rstd as rms_norm_fwd of that s up to the
    order of the row's fp32 sum (with dropout the residual form gives a thread at most 16 elements of the row, the
    plain kernel 32, so they may split a row over different thread counts)."""
    ext = lsmini._backend.ext()
    x, residual, w = _inputs((rows, hidden), dtype, "cuda", weight_dtype)[:3]
    x_bias = (0.5 * torch.randn(hidden, device="cuda")).to(w.dtype) if has_bias else None
    rng = (4321, 65, 0, 0)
    s_ref = ext.bias_dropout_residual_fwd(x, x_bias, residual, p, rng)
    _, y_ref, rstd_ref = ext.rms_norm_fwd(s_ref, w, EPS)
    s, y, rstd = ext.rms_norm_fwd(x, w, EPS, residual, x_bias, p, rng)
    assert torch.equal(s, s_ref)
    assert_same_up_to_sum_order(y, y_ref, rstd, rstd_ref)
    with pytest.raises(ValueError, match="rms_norm_fwd: x_bias and p are those of the residual form"):
        ext.rms_norm_fwd(x, w, EPS, None, x_bias, 0.1, rng)
