"""split_heads / merge_heads: references vs independent plain-PyTorch formulations (CPU), the registered
operators on CPU vs the same formulations (forward and backward), and the CUDA kernels vs the references
(GPU)."""
import pytest
import torch

import lsmini
from lsmini import _backend
from lsmini.ops.heads import merge_heads, merge_heads_ref, split_heads, split_heads_ref
from util import LsminiOps, assert_close_fp32, assert_lowp_rule

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------
# Independent formulations: explicit column slices per (part, head), no 5-D view/permute.
# ----------------------------------------------------------------------------------------------------
def split_by_slicing(x, bias, num_heads, parts):
    """out[p][b, h, l, d] = x[b, l, p·hidden + h·head_dim + d] + bias[same], one slice per (p, h); the bias
    is added per slice in fp32 so its gradient is assembled from per-slice sums."""
    batch, length, width = x.shape
    hidden = width // parts
    head_dim = hidden // num_heads
    outs = []
    for p in range(parts):
        heads = []
        for h in range(num_heads):
            lo = p * hidden + h * head_dim
            s = x[:, :, lo:lo + head_dim].float()
            if bias is not None:
                s = s + bias[lo:lo + head_dim].float()
            heads.append(s.to(x.dtype))
        outs.append(torch.stack(heads, dim=1))  # [batch, num_heads, len, head_dim]
    return outs


def merge_by_slicing(x):
    batch, num_heads, length, head_dim = x.shape
    return torch.cat([x[:, h] for h in range(num_heads)], dim=-1)  # [batch, len, num_heads·head_dim]


def tokens_from_part_grads(grads):
    """grad_x[b, l, p·hidden + h·head_dim + d] = grads[p][b, h, l, d], assembled per (p, h)."""
    parts = len(grads)
    batch, num_heads, length, head_dim = grads[0].shape
    cols = [grads[p][:, h] for p in range(parts) for h in range(num_heads)]
    return torch.cat(cols, dim=-1)


def assert_views_of_one_buffer(outs, shape):
    """Each part has `shape`, is contiguous, and part i starts i·numel elements after part 0 in one storage."""
    base = outs[0]
    for i, o in enumerate(outs):
        assert tuple(o.shape) == tuple(shape), f"part {i}: shape {tuple(o.shape)} != {tuple(shape)}"
        assert o.is_contiguous(), f"part {i} is not contiguous"
        assert o.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), f"part {i}: another storage"
        assert o.data_ptr() == base.data_ptr() + i * base.numel() * base.element_size(), f"part {i}: wrong offset"


def colsum_tolerance(g_tokens):
    """fp32 column sums over batch·len: the rounding error of a sum grows with Σ|g| (and the kernel's
    summation order differs from any reference's), so the bound is 1e-6·Σ|g| + 1e-5 per column —
    still far below one dropped or doubled row (≈ |g| ~ 1)."""
    return 1e-5 + 1e-6 * g_tokens.double().abs().sum(dim=(0, 1))


def assert_colsum_close(out, truth64, tol, name):
    assert out.shape == truth64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(truth64.shape)}"
    diff = (out.double() - truth64).abs()
    bad = ~(diff <= tol)
    assert not bad.any(), f"{name}: {int(bad.sum())} columns off, max err {diff.max().item():.3g}"


# ----------------------------------------------------------------------------------------------------
# CPU: references
# ----------------------------------------------------------------------------------------------------
CPU_SPLIT_SHAPES = [  # (batch, len, num_heads, head_dim)
    (2, 3, 2, 4),
    (1, 1, 1, 1),
    (3, 5, 3, 7),
]


@pytest.mark.parametrize("parts", [1, 2, 3, 12])
@pytest.mark.parametrize("bias_kind", ["none", "same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", CPU_SPLIT_SHAPES, ids=lambda s: "b{}_l{}_h{}_d{}".format(*s))
def test_split_heads_ref_vs_slicing(shape, dtype, bias_kind, parts):
    torch.manual_seed(0)
    batch, length, num_heads, head_dim = shape
    width = parts * num_heads * head_dim
    x = torch.randn(batch, length, width, dtype=dtype, requires_grad=True)
    bias = None
    if bias_kind != "none":
        bias = torch.randn(width, dtype=torch.float32 if bias_kind == "fp32" else dtype, requires_grad=True)
    grads = [torch.randn(batch, num_heads, length, head_dim, dtype=dtype) for _ in range(parts)]

    outs = split_heads_ref(x, bias, num_heads, parts)
    expect = split_by_slicing(x, bias, num_heads, parts)
    assert isinstance(outs, tuple) and len(outs) == parts
    assert_views_of_one_buffer(outs, (batch, num_heads, length, head_dim))
    for p in range(parts):
        assert outs[p].dtype == dtype
        assert torch.equal(outs[p], expect[p]), f"part {p} differs"  # same fp32 add, one rounding

    inputs = [x] if bias is None else [x, bias]
    got = torch.autograd.grad(outs, inputs, grads)
    want = torch.autograd.grad(expect, inputs, grads)
    assert torch.equal(got[0], want[0]), "grad_x differs"
    assert torch.equal(got[0], tokens_from_part_grads(grads)), "grad_x is not the transposed grads"
    if bias is not None:
        assert got[1].dtype == bias.dtype
        g_tokens = tokens_from_part_grads(grads)
        tol = colsum_tolerance(g_tokens)
        if bias.dtype != torch.float32:  # plus one bf16 rounding of the result
            tol = tol + g_tokens.double().sum(dim=(0, 1)).abs() * 2.0 ** -8
        truth = g_tokens.double().sum(dim=(0, 1))
        assert_colsum_close(got[1], truth, tol, "grad_bias (ref)")
        assert_colsum_close(want[1], truth, tol, "grad_bias (slicing)")


def test_split_heads_ref_explicit_indices():
    """Every element against the formula, on a tiny shape with distinct values."""
    batch, length, parts, num_heads, head_dim = 2, 3, 3, 2, 2
    hidden = num_heads * head_dim
    x = torch.arange(batch * length * parts * hidden, dtype=torch.float32).view(batch, length, -1)
    bias = torch.arange(parts * hidden, dtype=torch.float32) * 1000
    outs = split_heads_ref(x, bias, num_heads, parts)
    for p in range(parts):
        for b in range(batch):
            for h in range(num_heads):
                for l in range(length):
                    for d in range(head_dim):
                        c = p * hidden + h * head_dim + d
                        assert outs[p][b, h, l, d].item() == x[b, l, c].item() + bias[c].item()


def test_split_heads_ref_does_not_alias_input():
    x = torch.randn(2, 5, 8)
    (out,) = split_heads_ref(x, None, 1, 1)
    assert torch.equal(out, x.view(2, 1, 5, 8))
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 1, 1, 1), (3, 4, 7, 7)],
                         ids=lambda s: "b{}_h{}_l{}_d{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contig", "strided"])
def test_merge_heads_ref_vs_slicing(shape, dtype, contiguous):
    torch.manual_seed(1)
    batch, num_heads, length, head_dim = shape
    if contiguous:
        x = torch.randn(batch, num_heads, length, head_dim, dtype=dtype, requires_grad=True)
        xin = x
    else:  # a [b, l, h, d] tensor seen as [b, h, l, d]
        x = torch.randn(batch, length, num_heads, head_dim, dtype=dtype, requires_grad=True)
        xin = x.transpose(1, 2)
    g = torch.randn(batch, length, num_heads * head_dim, dtype=dtype)
    out = merge_heads_ref(xin)
    expect = merge_by_slicing(xin)
    assert out.is_contiguous() and out.shape == (batch, length, num_heads * head_dim)
    assert torch.equal(out, expect)
    assert torch.equal(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(expect, x, g)[0])


def test_merge_of_split_is_identity():
    torch.manual_seed(2)
    x = torch.randn(3, 7, 3 * 4 * 5)
    outs = split_heads_ref(x, None, 4, 3)
    merged = torch.cat([merge_heads_ref(o) for o in outs], dim=-1)
    assert torch.equal(merged, x)


# ----------------------------------------------------------------------------------------------------
# CPU: argument validation (same on every backend)
# ----------------------------------------------------------------------------------------------------
def test_split_heads_bad_inputs():
    x = torch.randn(2, 3, 24)
    with pytest.raises(ValueError, match=r"divisible by parts\*num_heads"):
        split_heads(x, None, 5, 3)
    with pytest.raises(ValueError, match=r"divisible by parts\*num_heads"):
        split_heads(x, None, 2, 5)
    with pytest.raises(ValueError, match=r"bias must have shape \(24,\)"):
        split_heads(x, torch.randn(23), 2, 3)
    with pytest.raises(ValueError, match=r"bias must have shape \(24,\)"):
        split_heads(x, torch.randn(3, 8), 2, 3)
    with pytest.raises(TypeError, match="bias must be float32 or x's dtype"):
        split_heads(x.bfloat16(), torch.randn(24, dtype=torch.float16), 2, 3)
    with pytest.raises(TypeError, match="bias must be float32 or x's dtype"):
        split_heads(x, torch.randn(24, dtype=torch.float64), 2, 3)
    with pytest.raises(ValueError, match="x must be 3-D"):
        split_heads(torch.randn(6, 24), None, 2, 3)
    with pytest.raises(TypeError, match="floating-point"):
        split_heads(torch.ones(2, 3, 24, dtype=torch.int32), None, 2, 3)
    with pytest.raises(TypeError, match="x must be a Tensor"):
        split_heads([[1.0]], None, 1, 1)
    with pytest.raises(ValueError, match="num_heads must be >= 1"):
        split_heads(x, None, 0, 3)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_heads(x, None, 2, 0)
    with pytest.raises(TypeError, match="num_heads must be an int"):
        split_heads(x, None, 2.0, 3)
    with pytest.raises(TypeError, match="parts must be an int"):
        split_heads(x, None, 2, True)
    with pytest.raises(TypeError, match="bias must be a Tensor or None"):
        split_heads(x, 1.0, 2, 3)


def test_merge_heads_bad_inputs():
    with pytest.raises(ValueError, match="x must be 4-D"):
        merge_heads(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="floating-point"):
        merge_heads(torch.ones(1, 2, 3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a Tensor"):
        merge_heads(None)


def test_public_exports():
    assert lsmini.ops.split_heads is split_heads and lsmini.ops.split_heads_ref is split_heads_ref
    assert lsmini.ops.merge_heads is merge_heads and lsmini.ops.merge_heads_ref is merge_heads_ref


# ----------------------------------------------------------------------------------------------------
# CPU: the registered operators (their CPU implementations) against the slicing formulations
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("grad_kind", ["separate", "one_buffer", "some_none"])
@pytest.mark.parametrize("bias_kind", ["none", "same", "fp32", "frozen"])
def test_split_heads_op_on_cpu(bias_kind, grad_kind, dtype):
    torch.manual_seed(3)
    batch, length, parts, num_heads, head_dim = 2, 5, 3, 2, 4
    width = parts * num_heads * head_dim
    x = torch.randn(batch, length, width, dtype=dtype, requires_grad=True)
    bias = None
    if bias_kind != "none":
        bias = torch.randn(width, dtype=torch.float32 if bias_kind == "fp32" else dtype,
                           requires_grad=bias_kind != "frozen")
    with LsminiOps() as ops:
        outs = split_heads(x, bias, num_heads, parts)
    assert ops.names == ["split_heads"]
    assert isinstance(outs, tuple) and len(outs) == parts
    assert_views_of_one_buffer(outs, (batch, num_heads, length, head_dim))
    for o, e in zip(outs, split_by_slicing(x.detach(), bias, num_heads, parts)):
        assert torch.equal(o, e)

    g5 = torch.randn(parts, batch, num_heads, length, head_dim, dtype=dtype)
    if grad_kind == "one_buffer":
        grads, used = g5.unbind(0), outs
    elif grad_kind == "separate":
        grads, used = [g.clone() for g in g5.unbind(0)], outs
    else:  # part 1 does not reach the loss: its gradient counts as zeros
        g5[1].zero_()
        grads, used = [g5[0].clone(), g5[2].clone()], (outs[0], outs[2])
    inputs = [x] if bias is None or bias_kind == "frozen" else [x, bias]
    with LsminiOps() as ops:
        got = torch.autograd.grad(used, inputs, grads)
    assert ops.names == ["split_heads_backward"]
    g_tokens = tokens_from_part_grads(g5.unbind(0))
    assert torch.equal(got[0], g_tokens)
    if len(inputs) == 2:
        assert got[1].dtype == bias.dtype
        truth = g_tokens.double().sum(dim=(0, 1))
        tol = colsum_tolerance(g_tokens)
        if bias.dtype != torch.float32:  # plus one rounding of the result
            tol = tol + truth.abs() * 2.0 ** (-8 if bias.dtype == torch.bfloat16 else -11)
        assert_colsum_close(got[1], truth, tol, "grad_bias")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contig", "strided"])
def test_merge_heads_op_on_cpu(dtype, contiguous):
    torch.manual_seed(4)
    if contiguous:
        leaf = torch.randn(2, 3, 5, 4, dtype=dtype, requires_grad=True)
        x = leaf
    else:
        leaf = torch.randn(2, 5, 3, 4, dtype=dtype, requires_grad=True)
        x = leaf.transpose(1, 2)
    with LsminiOps() as ops:
        out = merge_heads(x)
    assert ops.names == ["merge_heads"]
    assert out.is_contiguous() and torch.equal(out, merge_by_slicing(x.detach()))
    g = torch.randn_like(out)
    with LsminiOps() as ops:
        (gx,) = torch.autograd.grad(out, leaf, g)
    assert ops.names == ["merge_heads_backward"]
    assert torch.equal(gx, torch.autograd.grad(merge_by_slicing(x), leaf, g)[0])


def test_float64_and_forced_reference_call_the_references_directly(monkeypatch):
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    with LsminiOps() as ops:
        outs = split_heads(x, None, 2, 3)
        merged = merge_heads(outs[0])
    assert ops.names == []
    assert torch.equal(merged, x[..., :4])
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        outs = split_heads(x.float(), None, 2, 3)
        merge_heads(outs[0])
    assert ops.names == []


# ----------------------------------------------------------------------------------------------------
# CUDA: kernels vs references
# ----------------------------------------------------------------------------------------------------
def poison_allocator():
    """Fill the caching allocator's free memory with 0xFF bytes (NaN in float32/float16/bfloat16), so an
    output element a kernel fails to write shows up: empty the cache, then allocate, fill and free one
    block in the large pool and a few in the small pool (≤ 1 MiB requests); the outputs the op
    allocates next are carved from them."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    blocks = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda")]
    blocks += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
    for b in blocks:
        b.fill_(0xFF)
    del blocks


SPLIT_SHAPES = [  # (batch, len, parts, num_heads, head_dim)
    (1, 1, 3, 1, 8),  # one token, one head
    (2, 7, 3, 4, 64),
    (3, 13, 2, 2, 16),  # primes; K/V (parts 2)
    (1, 31, 12, 2, 16),  # K/V of six decoder layers at once
    (2, 5, 3, 3, 7),  # odd head_dim: scalar path in every dtype
    (5, 11, 3, 1, 1),  # head_dim 1
    (4, 9, 2, 3, 12),  # 24-byte heads in 16-bit (scalar), 48-byte in fp32 (vector)
    (2, 17, 3, 16, 128),  # hidden 2048
    (1, 3, 3, 32, 128),  # hidden 4096
    (2, 33, 1, 8, 64),  # parts 1; 2^5 + 1 tokens
    (1, 127, 3, 8, 8),  # 2^7 − 1 tokens; 16-byte heads in 16-bit
    (4, 1000, 3, 16, 64),  # more token rows than one wave of blocks: the row loop runs several steps
]


def _shape_id(s):
    return "b{}_l{}_p{}_h{}_d{}".format(*s)


def _split_cases():
    cases = []
    for dtype in DTYPES:
        kinds = ["none", "same"] + (["fp32"] if dtype != torch.float32 else [])
        for kind in kinds:
            cases.append(pytest.param(dtype, kind, id=f"{str(dtype).replace('torch.', '')}-bias_{kind}"))
    return cases


def _plain_torch_split(x, bias, num_heads, parts):
    """The plain PyTorch op in x's precision (the low-precision yardstick of the 2x rule)."""
    batch, length, width = x.shape
    head_dim = width // (parts * num_heads)
    y = x if bias is None else x + bias.to(x.dtype)
    return y.view(batch, length, parts, num_heads, head_dim).permute(2, 0, 3, 1, 4).contiguous()


def _run_split_case(shape, dtype, bias_kind, x=None):
    torch.manual_seed(5)
    batch, length, parts, num_heads, head_dim = shape
    width = parts * num_heads * head_dim
    dev = "cuda"
    if x is None:
        x = torch.randn(batch, length, width, dtype=dtype, device=dev)
    x = x.requires_grad_()
    bias = None
    if bias_kind != "none":
        bias = torch.randn(width, dtype=torch.float32 if bias_kind == "fp32" else dtype, device=dev,
                           requires_grad=True)
    grads = [torch.randn(batch, num_heads, length, head_dim, dtype=dtype, device=dev) for _ in range(parts)]

    poison_allocator()
    with LsminiOps() as ops:
        outs = split_heads(x, bias, num_heads, parts)
    assert ops.names == ["split_heads"], "the operator was not called"
    assert len(outs) == parts
    assert_views_of_one_buffer(outs, (batch, num_heads, length, head_dim))

    xd = x.detach()
    if bias is None:  # a pure layout change: bit-exact
        want = split_heads_ref(xd, None, num_heads, parts)
        for p in range(parts):
            assert outs[p].dtype == dtype
            assert torch.equal(outs[p], want[p]), f"part {p} differs from the reference"
    else:
        ref32 = split_heads_ref(xd.float(), bias.detach().float(), num_heads, parts)
        plain = _plain_torch_split(xd, bias.detach(), num_heads, parts)
        for p in range(parts):
            if dtype == torch.float32:
                assert_close_fp32(outs[p], ref32[p], name=f"part {p}")
            else:
                assert_lowp_rule(outs[p], ref32[p], plain[p], name=f"part {p}")

    inputs = [x] if bias is None else [x, bias]
    poison_allocator()
    got = torch.autograd.grad(outs, inputs, grads)
    g_tokens = tokens_from_part_grads(grads)
    assert got[0].dtype == dtype and got[0].shape == x.shape
    assert torch.equal(got[0], g_tokens), "grad_x is not the exact transpose of the part grads"
    if bias is not None:
        gb = got[1]
        assert gb.dtype == bias.dtype and gb.shape == bias.shape
        truth = g_tokens.double().sum(dim=(0, 1))
        if gb.dtype == torch.float32:
            assert_colsum_close(gb, truth, colsum_tolerance(g_tokens), "grad_bias")
        else:
            assert_lowp_rule(gb, truth.float(), g_tokens.sum(dim=(0, 1)), name="grad_bias")
    return x, bias, outs, got


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, bias_kind", _split_cases())
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=_shape_id)
def test_split_heads_cuda(shape, dtype, bias_kind):
    _run_split_case(shape, dtype, bias_kind)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_heads_cuda_misaligned_and_strided_input(dtype):
    """16-byte-eligible head_dim but x not 16-byte aligned (scalar fallback), and a strided x."""
    shape = (2, 9, 3, 4, 64)
    batch, length, parts, num_heads, head_dim = shape
    width = parts * num_heads * head_dim
    flat = torch.randn(batch * length * width + 1, dtype=dtype, device="cuda")
    misaligned = flat[1:].view(batch, length, width)
    assert misaligned.data_ptr() % 16 != 0
    _run_split_case(shape, dtype, "same", x=misaligned.detach().clone()[:, :, :])  # aligned copy: control
    _run_split_case(shape, dtype, "same", x=misaligned)
    wide = torch.randn(batch, length, width + 8, dtype=dtype, device="cuda")
    _run_split_case(shape, dtype, "none", x=wide[:, :, :width])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_heads_cuda_unused_parts_and_one_buffer_grads(dtype):
    torch.manual_seed(6)
    batch, length, parts, num_heads, head_dim = 2, 7, 3, 4, 16
    width = parts * num_heads * head_dim
    x = torch.randn(batch, length, width, dtype=dtype, device="cuda", requires_grad=True)
    bias = torch.randn(width, dtype=dtype, device="cuda", requires_grad=True)
    g5 = torch.randn(parts, batch, num_heads, length, head_dim, dtype=dtype, device="cuda")
    outs = split_heads(x, bias, num_heads, parts)

    gx, gb = torch.autograd.grad(outs, [x, bias], g5.unbind(0), retain_graph=True)
    g_tokens = tokens_from_part_grads(g5.unbind(0))
    assert torch.equal(gx, g_tokens)
    gb_again = torch.autograd.grad(outs, [bias], [g.clone() for g in g5.unbind(0)], retain_graph=True)[0]
    assert torch.equal(gb, gb_again), "grad_bias is not deterministic / differs between the two grad layouts"

    # part 1 unused: its gradient is zero
    gx, gb = torch.autograd.grad((outs[0], outs[2]), [x, bias], (g5[0], g5[2]))
    g5z = g5.clone()
    g5z[1].zero_()
    g_tokens = tokens_from_part_grads(g5z.unbind(0))
    assert torch.equal(gx, g_tokens)
    truth = g_tokens.double().sum(dim=(0, 1))
    if dtype == torch.float32:
        assert_colsum_close(gb, truth, colsum_tolerance(g_tokens), "grad_bias")
    else:
        assert_lowp_rule(gb, truth.float(), g_tokens.sum(dim=(0, 1)), name="grad_bias")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_heads_cuda_bwd_binding_misaligned_grad(dtype):
    """split_heads_bwd on a grad buffer that is contiguous but not 16-byte aligned (scalar path)."""
    torch.manual_seed(7)
    parts, batch, num_heads, length, head_dim = 3, 2, 4, 9, 32
    n = parts * batch * num_heads * length * head_dim
    flat = torch.randn(n + 1, dtype=dtype, device="cuda")
    g5 = flat[1:].view(parts, batch, num_heads, length, head_dim)
    assert g5.data_ptr() % 16 != 0
    poison_allocator()
    gx, gb = _backend.ext().split_heads_bwd(g5, True, True)
    g_tokens = tokens_from_part_grads(g5.unbind(0))
    assert torch.equal(gx, g_tokens)
    assert gb.dtype == torch.float32
    assert_colsum_close(gb, g_tokens.double().sum(dim=(0, 1)), colsum_tolerance(g_tokens), "grad_bias")
    gx2, gb2 = _backend.ext().split_heads_bwd(g5, False)
    assert gb2 is None and torch.equal(gx2, g_tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("empty", ["batch0", "len0"])
def test_split_heads_cuda_empty(dtype, empty):
    batch, length = (0, 5) if empty == "batch0" else (3, 0)
    parts, num_heads, head_dim = 3, 2, 8
    width = parts * num_heads * head_dim
    x = torch.randn(batch, length, width, dtype=dtype, device="cuda", requires_grad=True)
    bias = torch.randn(width, dtype=dtype, device="cuda", requires_grad=True)
    outs = split_heads(x, bias, num_heads, parts)
    assert [tuple(o.shape) for o in outs] == [(batch, num_heads, length, head_dim)] * parts
    grads = [torch.randn(batch, num_heads, length, head_dim, dtype=dtype, device="cuda") for _ in range(parts)]
    poison_allocator()
    gx, gb = torch.autograd.grad(outs, [x, bias], grads)
    assert gx.shape == x.shape
    assert torch.equal(gb, torch.zeros_like(bias)), "grad_bias over no rows must be zeros"


MERGE_SHAPES = [  # (batch, num_heads, len, head_dim)
    (1, 1, 1, 8),
    (2, 4, 7, 64),
    (3, 2, 13, 7),  # odd head_dim
    (1, 16, 33, 128),  # hidden 2048
    (2, 32, 5, 128),  # hidden 4096
    (5, 3, 11, 1),
    (2, 8, 127, 8),
    (4, 16, 1000, 64),  # several row steps
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=lambda s: "b{}_h{}_l{}_d{}".format(*s))
@pytest.mark.parametrize("layout", ["contig", "strided", "misaligned"])
def test_merge_heads_cuda(shape, dtype, layout):
    torch.manual_seed(8)
    batch, num_heads, length, head_dim = shape
    if layout == "contig":
        leaf = torch.randn(batch, num_heads, length, head_dim, dtype=dtype, device="cuda", requires_grad=True)
        x = leaf
    elif layout == "strided":  # attention output stored [b, l, h, d], seen as [b, h, l, d]
        leaf = torch.randn(batch, length, num_heads, head_dim, dtype=dtype, device="cuda", requires_grad=True)
        x = leaf.transpose(1, 2)
    else:
        n = batch * num_heads * length * head_dim
        leaf = torch.randn(n + 1, dtype=dtype, device="cuda", requires_grad=True)
        x = leaf[1:].view(batch, num_heads, length, head_dim)
    poison_allocator()
    with LsminiOps() as ops:
        out = merge_heads(x)
    assert ops.names == ["merge_heads"], "the operator was not called"
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, merge_heads_ref(x.detach()))
    g = torch.randn(batch, length, num_heads * head_dim, dtype=dtype, device="cuda")
    poison_allocator()
    (gx,) = torch.autograd.grad(out, leaf, g)
    (want,) = torch.autograd.grad(merge_by_slicing(x), leaf, g)
    assert torch.equal(gx, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_heads_cuda_bwd_binding_misaligned(dtype):
    torch.manual_seed(9)
    batch, length, num_heads, head_dim = 2, 9, 4, 32
    n = batch * length * num_heads * head_dim
    g = torch.randn(n + 1, dtype=dtype, device="cuda")[1:].view(batch, length, num_heads * head_dim)
    poison_allocator()
    gx = _backend.ext().merge_heads_bwd(g, num_heads)
    assert torch.equal(gx, g.view(batch, length, num_heads, head_dim).transpose(1, 2))
    assert gx.is_contiguous()


@pytest.mark.cuda
def test_merge_heads_cuda_empty():
    x = torch.randn(0, 4, 5, 8, device="cuda", requires_grad=True)
    out = merge_heads(x)
    assert out.shape == (0, 5, 32)
    (gx,) = torch.autograd.grad(out, x, torch.randn(0, 5, 32, device="cuda"))
    assert gx.shape == x.shape


@pytest.mark.cuda
def test_heads_cuda_bad_inputs():
    ext = _backend.ext()
    x = torch.randn(2, 3, 24, device="cuda", dtype=torch.float16)
    # Python-level checks on CUDA tensors
    with pytest.raises(ValueError, match=r"divisible by parts\*num_heads"):
        split_heads(x, None, 5, 3)
    with pytest.raises(ValueError, match=r"bias must have shape \(24,\)"):
        split_heads(x, torch.randn(12, device="cuda", dtype=torch.float16), 2, 3)
    with pytest.raises(TypeError, match="bias must be float32 or x's dtype"):
        split_heads(x, torch.randn(24, device="cuda", dtype=torch.bfloat16), 2, 3)
    with pytest.raises(ValueError, match="bias is on cpu but x is on cuda"):
        split_heads(x, torch.randn(24, dtype=torch.float16), 2, 3)
    # binding-level checks name the op and the argument
    with pytest.raises(RuntimeError, match="split_heads_fwd: the last dimension of x \\(24\\) must be divisible"):
        ext.split_heads_fwd(x, None, 5, 3)
    with pytest.raises(RuntimeError, match="split_heads_fwd: bias must have shape"):
        ext.split_heads_fwd(x, torch.randn(12, device="cuda", dtype=torch.float16), 2, 3)
    with pytest.raises(RuntimeError, match="split_heads_fwd: bias must be float32 or x's dtype"):
        ext.split_heads_fwd(x, torch.randn(24, device="cuda", dtype=torch.bfloat16), 2, 3)
    with pytest.raises(RuntimeError, match="split_heads_fwd: bias must be a CUDA tensor"):
        ext.split_heads_fwd(x, torch.randn(24, dtype=torch.float16), 2, 3)
    with pytest.raises(RuntimeError, match="split_heads_fwd: x must be a CUDA tensor"):
        ext.split_heads_fwd(x.cpu(), None, 2, 3)
    with pytest.raises(RuntimeError, match="split_heads_fwd: x must be float32, float16 or bfloat16"):
        ext.split_heads_fwd(x.double(), None, 2, 3)
    with pytest.raises(RuntimeError, match="split_heads_fwd: x must be 3-D"):
        ext.split_heads_fwd(x.view(6, 24), None, 2, 3)
    with pytest.raises(RuntimeError, match="split_heads_fwd: num_heads must be >= 1"):
        ext.split_heads_fwd(x, None, 0, 3)
    with pytest.raises(RuntimeError, match="split_heads_bwd: grad must be 5-D"):
        ext.split_heads_bwd(x, True)
    with pytest.raises(RuntimeError, match="split_heads_bwd: grad must be float32, float16 or bfloat16"):
        ext.split_heads_bwd(torch.randn(3, 1, 2, 3, 4, device="cuda", dtype=torch.float64), True)
    with pytest.raises(RuntimeError, match="merge_heads_fwd: x must be 4-D"):
        ext.merge_heads_fwd(x)
    with pytest.raises(RuntimeError, match="merge_heads_fwd: x must be a CUDA tensor"):
        ext.merge_heads_fwd(torch.randn(1, 2, 3, 4))
    with pytest.raises(RuntimeError, match=r"merge_heads_bwd: the last dimension of grad \(24\) must be divisible"):
        ext.merge_heads_bwd(x, 5)
    with pytest.raises(RuntimeError, match="merge_heads_bwd: grad must be 3-D"):
        ext.merge_heads_bwd(x.view(6, 24), 2)
