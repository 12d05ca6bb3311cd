"""lsmini.ops.rotary and rotary_cos_sin: the reference against plain implementations of Hugging Face's
apply_rotary_pos_emb (rotate-half), GPT-J's rotate-every-two and the complex-number form, the registered operators
on CPU (CI) and the kernel on CUDA against the reference, forward and backward with shared random output gradients:
grouped K/V heads, partial rotary, interleaved pairs, the table shapes, tables that need gradients, positions with an
offset (one decoded token against the whole sequence), memory layouts, and bad input."""
import pytest
import torch

import lsmini
from lsmini.ops import rotary, rotary_cos_sin, rotary_ref
from util import LOWP, LsminiOps, assert_close_fp32, assert_lowp_rule

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


# ---- plain implementations, written independently of lsmini/ops/rotary.py ------------------------------------
def _hf_rotate_half(x):
    """transformers' rotate_half, as Llama's modeling code writes it."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def _gptj_rotate_every_two(x):
    """GPT-J's rotate_every_two."""
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _plain(q, k, cos, sin, interleaved=False):
    """Hugging Face's apply_rotary_pos_emb (unsqueeze_dim=1 for [batch, seq, rot_dim] tables) with partial rotary as
    GPT-NeoX and Phi split it (the first rot_dim dimensions rotated, the rest passed through); GPT-J's
    rotate_every_two when interleaved. In the inputs' dtypes."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot_dim = cos.shape[-1]
    rotate = _gptj_rotate_every_two if interleaved else _hf_rotate_half

    def apply(x):
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)

    return apply(q), apply(k)


def _complex_rotation(x, angles, interleaved):
    """x's first 2·angles.shape[-1] dimensions turned by the angles [batch or 1, 1, seq, rot_dim/2] as complex
    numbers: pair i is (x_i, x_i+rot_dim/2) (rotate-half) or (x_2i, x_2i+1) (interleaved), times e^(i·angle)."""
    half = angles.shape[-1]
    x64 = x.double()
    if interleaved:
        z = torch.view_as_complex(x64[..., :2 * half].reshape(*x.shape[:-1], half, 2).contiguous())
    else:
        z = torch.complex(x64[..., :half], x64[..., half:2 * half])
    z = z * torch.polar(torch.ones_like(angles), angles)
    rot = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rot, x64[..., 2 * half:]), dim=-1)


def _hf_default_tables(position_ids, dim, base=10000.0):
    """transformers' default rotary embedding: float32 inv_freq and freqs, emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


# ---- inputs --------------------------------------------------------------------------------------------------
TABLE_FORMS = ("batch", "shared", "2d", "4d")  # [b, s, r]; [1, s, r]; [s, r]; [b, 1, s, r]


def _inputs(batch, heads, kv_heads, seq, head_dim, rot_dim, dtype, device, interleaved=False, table="batch",
            table_dtype=torch.float32, seed=0):
    """q, k, cos, sin, dq, dk: seeded, never zero; each sequence starts at its own random position (so the angles are
    far from 0), the tables made by rotary_cos_sin in the given form."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, head_dim, generator=g).to(device, dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(device, dtype)
    dq = torch.randn(batch, heads, seq, head_dim, generator=g).to(device, dtype)
    dk = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(device, dtype)
    starts = torch.randint(0, 5000, (max(batch, 1), 1), generator=g)[:batch]
    if table == "batch" or table == "4d":
        cos, sin = rotary_cos_sin(starts + torch.arange(seq), rot_dim, interleaved=interleaved, dtype=table_dtype)
        if table == "4d":
            cos, sin = cos[:, None], sin[:, None]
    else:
        offset = int(torch.randint(0, 5000, (1,), generator=g))
        cos, sin = rotary_cos_sin(seq, rot_dim, offset=offset, interleaved=interleaved, dtype=table_dtype)
        if table == "shared":
            cos, sin = cos[None], sin[None]
    return q, k, cos.to(device), sin.to(device), dq, dk


def _random_tables(batch, seq, rot_dim, dtype, device, seed=1):
    """cos and sin that are not rotations at all (no shared angle per pair): the op must apply its formula as written
    and its backward must be that formula's transpose."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, rot_dim, generator=g).to(device, dtype) for _ in range(2))


def _run(fn, inputs, grads):
    """fn(*inputs)'s outputs (detached) and the gradients of the inputs that are floating tensors (others: None), from
    one backward with `grads` on the outputs."""
    leaves = [t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) else t for t in inputs]
    out = fn(*leaves)
    torch.autograd.backward(out, grads)
    return tuple(o.detach() for o in out), tuple(t.grad if isinstance(t, torch.Tensor) else None for t in leaves)


def _up(t, dtype=torch.float32):
    return t.to(dtype)


# ------------------------------------------------------------------------------------ CPU (CI) ---

# (batch, heads, kv_heads, seq, head_dim, rot_dim): full and partial rotary, grouped K/V heads, one token, odd sizes
SHAPES_CPU = [(2, 4, 2, 7, 16, 16), (1, 3, 1, 1, 8, 8), (3, 2, 2, 5, 12, 4), (2, 6, 3, 9, 20, 10), (1, 1, 1, 4, 2, 2)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table", TABLE_FORMS)
@pytest.mark.parametrize("shape", SHAPES_CPU)
def test_reference_matches_plain_formula(shape, table, interleaved):
    """In float64 the reference matches Hugging Face's formula (GPT-J's when interleaved) to rounding, forward and
    backward, gradients of the tables included."""
    q, k, cos, sin, dq, dk = _inputs(*shape, torch.float64, "cpu", interleaved, table, torch.float64)
    ours = _run(lambda q, k, c, s: rotary_ref(q, k, c, s, interleaved), (q, k, cos, sin), (dq, dk))
    theirs = _run(lambda q, k, c, s: _plain(q, k, c, s, interleaved), (q, k, cos, sin), (dq, dk))
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES_CPU)
def test_reference_turns_each_pair_by_its_angle(shape, interleaved):
    """With rotary_cos_sin's tables, the rotation is the complex product (x_a + i·x_b)·e^(i·angle) per pair, angle =
    position · theta^(−2i/rot_dim): a formulation that shares no code with the reference's."""
    batch, heads, kv_heads, seq, head_dim, rot_dim = shape
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 100000, (batch, seq), generator=g)
    cos, sin = rotary_cos_sin(pos, rot_dim, theta=500000.0, interleaved=interleaved, dtype=torch.float64)
    angles = pos[:, None, :, None].double() * 500000.0 ** (-torch.arange(0, rot_dim, 2).double() / rot_dim)
    q_rot, k_rot = rotary_ref(q, k, cos, sin, interleaved)
    # angles up to 1e5 rad: an ulp of a float64 angle is ≈ 1.5e-11
    torch.testing.assert_close(q_rot, _complex_rotation(q, angles, interleaved), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(k_rot, _complex_rotation(k, angles, interleaved), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_computes_in_fp32_and_keeps_dtype(dtype):
    q, k, cos, sin, _, _ = _inputs(2, 4, 2, 5, 16, 12, dtype, "cpu")
    q_rot, k_rot = rotary_ref(q, k, cos, sin)
    assert q_rot.dtype == k_rot.dtype == dtype
    want_q, want_k = _plain(q.float(), k.float(), cos, sin)
    assert torch.equal(q_rot, want_q.to(dtype)) and torch.equal(k_rot, want_k.to(dtype))
    assert torch.equal(q_rot[..., 12:], q[..., 12:]), "the dimensions past rot_dim pass through"


def test_rotary_cos_sin_layouts_and_hugging_face_values():
    """Rotate-half tables hold each angle at i and i + rot_dim/2 and equal transformers' default rotary embedding
    (computed there in float32, here in float64: equal to float32 rounding of the angle); interleaved tables hold the
    same angles at 2i and 2i + 1; an int length with an offset is the arange of position ids."""
    pos = torch.tensor([[0, 1, 2, 1000, 4095], [7, 8, 9, 10, 11]])
    cos, sin = rotary_cos_sin(pos, 64)
    assert cos.shape == sin.shape == (2, 5, 64) and cos.dtype == torch.float32
    assert torch.equal(cos[..., :32], cos[..., 32:]) and torch.equal(sin[..., :32], sin[..., 32:])
    hf_cos, hf_sin = _hf_default_tables(pos, 64)
    # float32 angles up to 4095 rad (inv_freq and the product each rounded) are off by up to ≈ 5e-4
    torch.testing.assert_close(cos, hf_cos, atol=1e-3, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-3, rtol=0)
    icos, isin = rotary_cos_sin(pos, 64, interleaved=True)
    assert torch.equal(icos, cos[..., :32].repeat_interleave(2, -1))
    assert torch.equal(isin, sin[..., :32].repeat_interleave(2, -1))
    lcos, lsin = rotary_cos_sin(5, 64, offset=7)
    assert lcos.shape == (5, 64)
    assert torch.equal(lcos, cos[1]) and torch.equal(lsin, sin[1])
    ocos, _ = rotary_cos_sin(pos, 64, offset=3)
    assert torch.equal(ocos, rotary_cos_sin(pos + 3, 64)[0])
    hcos, hsin = rotary_cos_sin(pos[1], 16, theta=500000.0, dtype=torch.bfloat16)
    assert hcos.shape == (5, 16) and hcos.dtype == hsin.dtype == torch.bfloat16
    assert torch.equal(hcos, rotary_cos_sin(pos[1], 16, theta=500000.0, dtype=torch.float64)[0].to(torch.bfloat16))
    assert rotary_cos_sin(0, 8)[0].shape == (0, 8)


def _cpu_case(shape, dtype, interleaved=False, table="batch", table_dtype=torch.float32):
    """The op on CPU (the registered operators' CPU implementations) against the plain formula, forward and backward
    with random output gradients: fp32 tight; fp16/bf16 by the 2x rule against the float64 truth, the plain formula
    in that precision (tables cast to it, as transformers does) being the yardstick."""
    q, k, cos, sin, dq, dk = _inputs(*shape, dtype, "cpu", interleaved, table, table_dtype)
    with LsminiOps() as ops:
        out, grads = _run(lambda q, k: rotary(q, k, cos, sin, interleaved=interleaved), (q, k), (dq, dk))
    assert ops.names == ["rotary", "rotary_backward"]
    ours = out + grads
    assert all(t.dtype == dtype for t in ours)
    names = ("q_out", "k_out", "dq", "dk")
    if dtype == torch.float32:
        theirs = _run(lambda q, k: _plain(q, k, cos, sin, interleaved), (q, k), (dq, dk))
        for name, o, t in zip(names, ours, theirs[0] + theirs[1]):
            assert_close_fp32(o, t, atol=1e-5, rtol=1e-5, name=name)
        return
    c64, s64 = cos.double(), sin.double()
    truth = _run(lambda q, k: _plain(q, k, c64, s64, interleaved), (q.double(), k.double()), (dq.double(), dk.double()))
    plain = _run(lambda q, k: _plain(q, k, cos.to(dtype), sin.to(dtype), interleaved), (q, k), (dq, dk))
    for name, o, t, p in zip(names, ours, truth[0] + truth[1], plain[0] + plain[1]):
        assert_lowp_rule(o, t, p, atol=1e-3, name=name)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES_CPU)
def test_operator_on_cpu_matches_plain_formula(shape, dtype, interleaved):
    _cpu_case(shape, dtype, interleaved)


@pytest.mark.parametrize("table", TABLE_FORMS)
@pytest.mark.parametrize("table_dtype", ["same", torch.float32])
def test_operator_on_cpu_table_forms_and_dtypes(table, table_dtype):
    dtype = torch.bfloat16
    _cpu_case((2, 4, 2, 7, 16, 8), dtype, False, table, dtype if table_dtype == "same" else table_dtype)
    _cpu_case((2, 4, 2, 7, 16, 8), dtype, True, table, dtype if table_dtype == "same" else table_dtype)


@pytest.mark.parametrize("interleaved", [False, True])
def test_any_tables_get_the_formula_and_its_transpose(interleaved):
    """Random tables (no shared angle per pair): the forward is the elementwise formula as written and the backward its
    exact transpose, the tables' gradients included."""
    q, k, _, _, dq, dk = _inputs(2, 3, 1, 5, 12, 8, torch.float32, "cpu")
    cos, sin = _random_tables(2, 5, 8, torch.float32, "cpu")
    inputs = (q, k, cos, sin)
    with LsminiOps() as ops:
        ours = _run(lambda q, k, c, s: rotary(q, k, c, s, interleaved=interleaved), inputs, (dq, dk))
    assert ops.names == ["rotary", "rotary_backward"]
    theirs = _run(lambda q, k, c, s: _plain(q, k, c, s, interleaved), inputs, (dq, dk))
    for name, o, t in zip(("q_out", "k_out", "dq", "dk", "dcos", "dsin"), ours[0] + ours[1], theirs[0] + theirs[1]):
        assert_close_fp32(o, t, atol=1e-5, rtol=1e-5, name=name)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table", TABLE_FORMS)
@pytest.mark.parametrize("which", ["cos", "sin", "both"])
def test_tables_that_require_grad_get_their_gradient(which, table, interleaved):
    """cos/sin requiring a gradient get it (summed over heads, and over the batch for a shared table), equal to
    autograd through the plain formula; q and k still get theirs from the operators."""
    q, k, cos, sin, dq, dk = _inputs(3, 4, 2, 6, 16, 12, torch.float32, "cpu", interleaved, table)
    cos = cos.requires_grad_(which in ("cos", "both"))
    sin = sin.requires_grad_(which in ("sin", "both"))
    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
    with LsminiOps() as ops:
        torch.autograd.backward(rotary(qs, ks, cos, sin, interleaved=interleaved), (dq, dk))
    assert ops.names == ["rotary", "rotary_backward"]
    ours = (qs.grad, ks.grad, cos.grad, sin.grad)
    cos2 = cos.detach().clone().requires_grad_(cos.requires_grad)
    sin2 = sin.detach().clone().requires_grad_(sin.requires_grad)
    qp, kp = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward(_plain(qp, kp, cos2, sin2, interleaved), (dq, dk))
    for name, o, t in zip(("dq", "dk", "dcos", "dsin"), ours, (qp.grad, kp.grad, cos2.grad, sin2.grad)):
        assert (o is None) == (t is None), name
        if o is not None:
            assert o.shape == t.shape, name
            assert_close_fp32(o, t, atol=1e-5, rtol=1e-5, name=name)


def test_table_gradients_in_low_precision_keep_the_table_dtype():
    q, k, cos, sin, dq, dk = _inputs(2, 4, 2, 6, 16, 16, torch.bfloat16, "cpu", table_dtype=torch.bfloat16)
    (_, (gq, gk, gc, gs)) = _run(lambda q, k, c, s: rotary(q, k, c, s), (q, k, cos, sin), (dq, dk))
    assert gq.dtype == gk.dtype == gc.dtype == gs.dtype == torch.bfloat16
    truth = _run(lambda q, k, c, s: _plain(q, k, c, s), (q.double(), k.double(), cos.double(), sin.double()),
                 (dq.double(), dk.double()))[1]
    plain = _run(lambda q, k, c, s: _plain(q, k, c, s), (q, k, cos, sin), (dq, dk))[1]
    for name, o, t, p in zip(("dcos", "dsin"), (gc, gs), truth[2:], plain[2:]):
        assert_lowp_rule(o, t, p, atol=1e-2, name=name)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("positions", ["length", "ids"])
def test_one_decoded_token_equals_its_row_of_the_whole_sequence(positions, interleaved):
    """Incremental decoding: the tables of one token at position p (an offset, or its position id) rotate it exactly
    as row p of the whole sequence is rotated, bit for bit; so does a chunk of tokens p…p+2."""
    batch, heads, kv_heads, seq, head_dim, rot_dim = 2, 4, 2, 11, 16, 8
    g = torch.Generator().manual_seed(5)
    q = torch.randn(batch, heads, seq, head_dim, generator=g, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g, dtype=torch.bfloat16)
    start = torch.tensor([[0], [300]])  # the second sequence's positions start at 300 (ids form)
    if positions == "length":
        cos, sin = rotary_cos_sin(seq, rot_dim, offset=20, interleaved=interleaved)
    else:
        cos, sin = rotary_cos_sin(start + torch.arange(seq), rot_dim, interleaved=interleaved)
    full_q, full_k = rotary(q, k, cos, sin, interleaved=interleaved)
    for p, n in ((0, 1), (6, 1), (seq - 1, 1), (4, 3)):
        if positions == "length":
            c, s = rotary_cos_sin(n, rot_dim, offset=20 + p, interleaved=interleaved)
        else:
            c, s = rotary_cos_sin(start + torch.arange(p, p + n), rot_dim, interleaved=interleaved)
        step_q, step_k = rotary(q[:, :, p:p + n], k[:, :, p:p + n], c, s, interleaved=interleaved)
        assert torch.equal(step_q, full_q[:, :, p:p + n]) and torch.equal(step_k, full_k[:, :, p:p + n])


def _head_dim_stride_2(x):
    """x's values in a view whose head_dim has stride 2."""
    wide = x.new_zeros(*x.shape[:-1], 2 * x.shape[-1])
    wide[..., ::2] = x
    return wide[..., ::2]


def test_batch_first_layout_and_non_contiguous_inputs():
    """A [batch, seq, heads, head_dim] tensor passed as its transpose: the same values as the contiguous input, and
    the output keeps the input's memory order; slices of a fused QKV tensor and a head_dim with stride 2 work too,
    and gradients flow back to the fused buffer."""
    b, s, h, hk, d = 2, 7, 4, 2, 16
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(b, s, h + 2 * hk, d, generator=g)
    q, k = qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:h + hk].transpose(1, 2)
    cos, sin = rotary_cos_sin(s, 12, offset=9)
    want_q, want_k = _plain(q.contiguous(), k.contiguous(), cos, sin)
    bshd_q = qkv[:, :, :h].contiguous().transpose(1, 2)
    for qi, ki in ((q, k), (bshd_q, k.contiguous()), (_head_dim_stride_2(q), _head_dim_stride_2(k))):
        out_q, out_k = rotary(qi, ki, cos, sin)
        assert_close_fp32(out_q, want_q, name="q_out")
        assert_close_fp32(out_k, want_k, name="k_out")
    assert rotary(bshd_q, k, cos, sin)[0].transpose(1, 2).is_contiguous()
    assert rotary(q.contiguous(), k, cos, sin)[0].is_contiguous()
    leaf = qkv.clone().requires_grad_()
    out = rotary(leaf[:, :, :h].transpose(1, 2), leaf[:, :, h:h + hk].transpose(1, 2), cos, sin)
    dq, dk = torch.randn_like(out[0]), torch.randn_like(out[1])
    torch.autograd.backward(out, (dq, dk))
    plain = _run(lambda q, k: _plain(q, k, cos, sin), (q.contiguous(), k.contiguous()), (dq, dk))[1]
    assert_close_fp32(leaf.grad[:, :, :h].transpose(1, 2), plain[0], name="dq")
    assert_close_fp32(leaf.grad[:, :, h:h + hk].transpose(1, 2), plain[1], name="dk")
    assert torch.equal(leaf.grad[:, :, h + hk:], torch.zeros_like(leaf.grad[:, :, h + hk:]))
    # output gradients with stride 0: a sum's (every stride), one row per head_dim broadcast (all but head_dim's)
    for g_out in (torch.ones(()), torch.randn(d, generator=g)):
        qs, ks = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        torch.autograd.backward(rotary(qs, ks, cos, sin), (g_out.expand(q.shape), g_out.expand(k.shape)))
        plain = _run(lambda q, k: _plain(q, k, cos, sin), (q, k), (g_out.expand(q.shape), g_out.expand(k.shape)))[1]
        assert_close_fp32(qs.grad, plain[0], name="dq")
        assert_close_fp32(ks.grad, plain[1], name="dk")


def test_float64_and_the_forced_reference_run_the_reference(monkeypatch):
    q, k, cos, sin, dq, dk = _inputs(2, 4, 2, 5, 16, 16, torch.float64, "cpu", table_dtype=torch.float64)
    with LsminiOps() as ops:
        out = rotary(q, k, cos, sin)
    assert ops.names == []
    want = _plain(q, k, cos, sin)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    monkeypatch.setattr(lsmini.config, "reference", True)
    q = q.float().requires_grad_()
    with LsminiOps() as ops:
        out = rotary(q, k.float(), cos.float(), sin.float())
        out[0].sum().backward()
    assert ops.names == [] and q.grad is not None


def test_empty_batch_and_sequence():
    for b, s in ((0, 5), (2, 0)):
        q, k, cos, sin, dq, dk = _inputs(b, 4, 2, s, 16, 16, torch.bfloat16, "cpu", table="2d")
        out, grads = _run(lambda q, k: rotary(q, k, cos, sin), (q, k), (dq, dk))
        assert out[0].shape == grads[0].shape == q.shape and out[1].shape == grads[1].shape == k.shape


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_to_the_registered_operators_and_matches_eager(backend):
    """torch.compile(fullgraph=True) traces the public op to the operator (no decomposed rotation) and gives eager's
    outputs and gradients."""
    torch._dynamo.reset()
    called = set()

    def record(gm, example_inputs):
        called.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def fn(q, k, cos, sin):
        return rotary(q, k, cos, sin, interleaved=True)

    q, k, cos, sin, dq, dk = _inputs(2, 4, 2, 7, 16, 12, torch.bfloat16, "cpu", True, "shared")
    torch.compile(fn, fullgraph=True, backend=record)(q, k, cos, sin)
    assert any(name.startswith("lsmini.rotary") for name in called)
    assert not any(word in name for name in called for word in ("cat", "mul", "neg"))
    torch._dynamo.reset()
    eager = _run(fn, (q, k, cos, sin), (dq, dk))
    compiled = _run(torch.compile(fn, fullgraph=True, backend=backend), (q, k, cos, sin), (dq, dk))
    for a, b in zip(eager[0] + eager[1][:2], compiled[0] + compiled[1][:2]):
        assert torch.equal(a, b)
    for a, b in zip(eager[1][2:], compiled[1][2:]):  # the tables' gradients: sums the compiler may reorder
        assert_close_fp32(a.float(), b.float(), atol=1e-2, rtol=1e-2)
    torch._dynamo.reset()


def _bad_inputs():
    q, k, cos, sin, _, _ = _inputs(2, 4, 2, 5, 16, 16, torch.float32, "cpu")
    return q, k, cos, sin


BAD_CALLS = [
    (lambda q, k, c, s: rotary(q[0], k, c, s), ValueError,
     r"rotary: q must be 4-D \[batch, heads, seq, head_dim\], got shape \(4, 5, 16\)"),
    (lambda q, k, c, s: rotary(q, k[:1], c, s), ValueError,
     r"rotary: k must be 4-D \[batch, kv_heads, seq, head_dim\] with q's batch = 2, seq = 5 and head_dim = 16, got "
     r"shape \(1, 2, 5, 16\)"),
    (lambda q, k, c, s: rotary(q, k[..., :8], c, s), ValueError, "rotary: k must be 4-D"),
    (lambda q, k, c, s: rotary(q, k.half(), c, s), TypeError, "rotary: k must have q's dtype torch.float32, got "
                                                               "torch.float16"),
    (lambda q, k, c, s: rotary(q, k.int(), c, s), TypeError, "rotary: k must be a floating-point tensor"),
    (lambda q, k, c, s: rotary(q.tolist(), k, c, s), TypeError, "rotary: q must be a Tensor, got list"),
    (lambda q, k, c, s: rotary(q, k, None, s), TypeError, "rotary: cos must be a Tensor, got NoneType"),
    (lambda q, k, c, s: rotary(q, k, c[:, :4], s[:, :4]), ValueError,
     r"rotary: cos must have shape \[seq, rot_dim\], \[batch or 1, seq, rot_dim\] or \[batch or 1, 1, seq, rot_dim\] "
     r"with q's batch = 2 and seq = 5, got \(2, 4, 16\)"),
    (lambda q, k, c, s: rotary(q, k, c.repeat(2, 1, 1), s.repeat(2, 1, 1)), ValueError, "got \\(4, 5, 16\\)"),
    (lambda q, k, c, s: rotary(q, k, c[:, None].expand(2, 3, 5, 16), s[:, None].expand(2, 3, 5, 16)), ValueError,
     "rotary: cos must have shape"),
    (lambda q, k, c, s: rotary(q, k, c[0, 0], s[0, 0]), ValueError, r"rotary: cos must have shape .* got \(16,\)"),
    (lambda q, k, c, s: rotary(q, k, c, s[:1]), ValueError, r"rotary: sin must have cos's shape \(2, 5, 16\), got "
                                                            r"\(1, 5, 16\)"),
    (lambda q, k, c, s: rotary(q, k, c[..., :5], s[..., :5]), ValueError,
     r"rotary: rot_dim \(the last dimension of cos and sin\) must be even, got 5"),
    (lambda q, k, c, s: rotary(q, k, torch.cat([c, c], -1), torch.cat([s, s], -1)), ValueError,
     r"rotary: rot_dim \(the last dimension of cos and sin\) must be in \[2, head_dim = 16\], got 32"),
    (lambda q, k, c, s: rotary(q, k, c[..., :0], s[..., :0]), ValueError, r"must be in \[2, head_dim = 16\], got 0"),
    (lambda q, k, c, s: rotary(q, k, c.double(), s.double()), TypeError,
     "rotary: cos must be torch.float32 \\(q's dtype\\), got torch.float64"),
    (lambda q, k, c, s: rotary(q.half(), k.half(), c.bfloat16(), s.bfloat16()), TypeError,
     "rotary: cos must be torch.float16 \\(q's dtype\\) or torch.float32, got torch.bfloat16"),
    (lambda q, k, c, s: rotary(q.half(), k.half(), c, s.half()), TypeError,
     "rotary: sin must have cos's dtype torch.float32, got torch.float16"),
    (lambda q, k, c, s: rotary(q, k, c.to("meta"), s), ValueError, "rotary: cos is on meta but q is on cpu"),
    (lambda q, k, c, s: rotary(q, k, c, s.to("meta")), ValueError, "rotary: sin is on meta but q is on cpu"),
    (lambda q, k, c, s: rotary(q, k.to("meta"), c, s), ValueError, "rotary: k is on meta but q is on cpu"),
    (lambda q, k, c, s: rotary(q, k, c, s, interleaved=1), TypeError, "rotary: interleaved must be a bool, got int"),
    (lambda q, k, c, s: rotary(q, k, c, s, True), TypeError, "positional argument"),
    (lambda q, k, c, s: rotary_cos_sin(5, 7), ValueError, "rotary_cos_sin: rot_dim must be an even int ≥ 2, got 7"),
    (lambda q, k, c, s: rotary_cos_sin(5, 0), ValueError, "rotary_cos_sin: rot_dim must be an even int ≥ 2, got 0"),
    (lambda q, k, c, s: rotary_cos_sin(5, 8, theta=0.0), ValueError,
     "rotary_cos_sin: theta must be a finite float > 0"),
    (lambda q, k, c, s: rotary_cos_sin(5, 8, offset=1.5), TypeError,
     "rotary_cos_sin: offset must be an int, got float"),
    (lambda q, k, c, s: rotary_cos_sin(-1, 8), ValueError, "rotary_cos_sin: the number of positions must be ≥ 0"),
    (lambda q, k, c, s: rotary_cos_sin(torch.ones(3), 8), TypeError,
     "rotary_cos_sin: positions must be an int or an integer tensor of position ids, got a tensor of torch.float32"),
    (lambda q, k, c, s: rotary_cos_sin(torch.ones(1, 2, 3, dtype=torch.long), 8), ValueError,
     r"rotary_cos_sin: position ids must be \[batch, seq\] or \[seq\], got shape \(1, 2, 3\)"),
    (lambda q, k, c, s: rotary_cos_sin(2.0, 8), TypeError, "positions must be an int or an integer tensor of position "
                                                           "ids, got float"),
    (lambda q, k, c, s: rotary_cos_sin(4, 8, dtype=torch.int32), TypeError,
     "rotary_cos_sin: dtype must be a floating-point torch.dtype, got torch.int32"),
]


@pytest.mark.parametrize("case", range(len(BAD_CALLS)))
def test_bad_input_errors_before_any_operator_runs(case):
    call, error, match = BAD_CALLS[case]
    with LsminiOps() as ops:
        with pytest.raises(error, match=match):
            call(*_bad_inputs())
    assert ops.names == []


# ---------------------------------------------------------------------------------------- CUDA ---

def _cuda_case(shape, dtype, interleaved=False, table="batch", table_dtype=torch.float32, tables=None):
    """The kernel against the fp32 reference (the truth for inputs rounded to dtype), forward and backward: fp32
    tight; fp16/bf16 by the 2x rule, the plain formula in that precision (tables cast to it) the yardstick."""
    q, k, cos, sin, dq, dk = _inputs(*shape, dtype, "cuda", interleaved, table, table_dtype)
    if tables is not None:
        cos, sin = tables
    with LsminiOps() as ops:
        ours = _run(lambda q, k: rotary(q, k, cos, sin, interleaved=interleaved), (q, k), (dq, dk))
    assert ops.names == ["rotary", "rotary_backward"]
    ref = _run(lambda q, k: rotary_ref(q, k, cos.float(), sin.float(), interleaved), (_up(q), _up(k)),
               (_up(dq), _up(dk)))
    ours, ref = ours[0] + ours[1], ref[0] + ref[1]
    names = ("q_out", "k_out", "dq", "dk")
    assert all(o.dtype == dtype for o in ours)
    if dtype in LOWP:
        plain = _run(lambda q, k: _plain(q, k, cos.to(dtype), sin.to(dtype), interleaved), (q, k), (dq, dk))
        for name, o, t, p in zip(names, ours, ref, plain[0] + plain[1]):
            assert_lowp_rule(o, t, p, atol=1e-3, name=name)
    else:
        for name, o, t in zip(names, ours, ref):
            assert_close_fp32(o, t, atol=1e-5, rtol=1e-5, name=name)
    rot_dim = cos.shape[-1]
    assert torch.equal(ours[0][..., rot_dim:], q[..., rot_dim:]), "the dimensions past rot_dim are copied"
    assert torch.equal(ours[2][..., rot_dim:], dq[..., rot_dim:])


# (batch, heads, kv_heads, seq, head_dim, rot_dim): one token; odd sequence lengths; grouped K/V heads (and more K/V
# heads than query heads); head counts that do not fill the 4 heads a thread takes; partial rotary (Phi's 32 of 80,
# a quarter of 64); head_dims whose rotated halves are not a multiple of 16 bytes (the scalar path: 34, 40 / 24 in
# 16-bit types, 6); and sizes of real models (Llama 32/8 × 128, the 12/4 × 64).
SHAPES = [(1, 1, 1, 1, 64, 64), (2, 4, 2, 7, 64, 64), (3, 8, 8, 33, 128, 128), (2, 12, 4, 129, 64, 32),
          (1, 3, 1, 17, 80, 32), (2, 5, 5, 31, 96, 96), (2, 2, 1, 9, 6, 4), (1, 2, 3, 5, 40, 24), (2, 3, 3, 5, 34, 34),
          (2, 32, 8, 65, 128, 128), (1, 7, 1, 3, 256, 256), (4, 12, 4, 1000, 64, 64), (1, 1, 1, 257, 128, 16)]


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_reference(shape, dtype, interleaved):
    _cuda_case(shape, dtype, interleaved)


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table", TABLE_FORMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_tables_in_q_dtype_and_every_table_form(dtype, table, interleaved):
    for shape in ((2, 4, 2, 7, 64, 64), (2, 3, 1, 5, 34, 20)):
        _cuda_case(shape, dtype, interleaved, table, dtype)
        _cuda_case(shape, dtype, interleaved, table, torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_any_tables_get_the_formula_and_its_transpose(dtype, interleaved):
    """Random tables (no shared angle per pair): the kernel applies the elementwise formula as written and its exact
    transpose backward, on the vector and the scalar path."""
    for shape in ((2, 4, 2, 9, 64, 48), (2, 3, 1, 5, 34, 20)):
        tables = _random_tables(shape[0], shape[3], shape[5], torch.float32, "cuda")
        _cuda_case(shape, dtype, interleaved, tables=tables)


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_layouts_and_non_contiguous_inputs(dtype, interleaved):
    """[batch, seq, heads, head_dim] memory (passed transposed), slices of a fused QKV tensor (rows far apart), a
    head_dim stride of 2 (copied first), expanded K/V heads (stride 0) and misaligned storage (the scalar path): the
    same values as contiguous inputs, outputs in the inputs' memory order, gradients to the fused buffer."""
    b, s, h, hk, d = 2, 37, 8, 2, 64
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(b, s, h + 2 * hk, d, generator=g).to("cuda", dtype)
    q, k = qkv[:, :, :h].transpose(1, 2), qkv[:, :, h:h + hk].transpose(1, 2)
    cos, sin = rotary_cos_sin(s, 48, offset=100, interleaved=interleaved, device="cuda")
    want_q, want_k = rotary(q.contiguous(), k.contiguous(), cos, sin, interleaved=interleaved)
    assert want_q.is_contiguous()
    got_q, got_k = rotary(q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    bshd_q = qkv[:, :, :h].contiguous().transpose(1, 2)
    out_q, _ = rotary(bshd_q, k, cos, sin, interleaved=interleaved)
    assert torch.equal(out_q, want_q) and out_q.transpose(1, 2).is_contiguous()
    wide = _head_dim_stride_2(q)
    assert wide.stride(-1) == 2
    assert torch.equal(rotary(wide, k, cos, sin, interleaved=interleaved)[0], want_q)
    k1 = k[:, :1].contiguous()
    exp_q, exp_k = rotary(q, k1.expand(b, 3, s, d), cos, sin, interleaved=interleaved)
    _, want_k1 = rotary(q, k1.expand(b, 3, s, d).contiguous(), cos, sin, interleaved=interleaved)
    assert torch.equal(exp_k, want_k1) and torch.equal(exp_q, want_q)
    n = q.numel()
    buf = torch.empty(n + 1, device="cuda", dtype=dtype)
    mis = buf[1:].view(q.shape).copy_(q)
    assert mis.data_ptr() % 16 != 0
    mis_q, _ = rotary(mis, k, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(mis_q.float(), want_q.float(), atol=1e-6, rtol=ULP[dtype])
    # gradients to the fused buffer, from output gradients with stride 0: a sum's (every stride, copied first) and
    # one row broadcast (all but head_dim's, read in place)
    for g_out in (torch.ones((), device="cuda", dtype=dtype), torch.randn(d, generator=g).to("cuda", dtype)):
        leaf = qkv.clone().requires_grad_()
        out = rotary(leaf[:, :, :h].transpose(1, 2), leaf[:, :, h:h + hk].transpose(1, 2), cos, sin,
                     interleaved=interleaved)
        torch.autograd.backward(out, (g_out.expand(out[0].shape), g_out.expand(out[1].shape)))
        ref_grads = _run(lambda q, k: rotary_ref(q, k, cos, sin, interleaved), (q.float(), k.float()),
                         (g_out.float().expand(q.shape), g_out.float().expand(k.shape)))[1]
        torch.testing.assert_close(leaf.grad[:, :, :h].transpose(1, 2).float(), ref_grads[0], atol=1e-5,
                                   rtol=2 * ULP[dtype])
        torch.testing.assert_close(leaf.grad[:, :, h:h + hk].transpose(1, 2).float(), ref_grads[1], atol=1e-5,
                                   rtol=2 * ULP[dtype])
        assert torch.equal(leaf.grad[:, :, h + hk:], torch.zeros_like(leaf.grad[:, :, h + hk:]))


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_in_place_and_every_output_written(dtype, interleaved):
    """The binding's in-place form (outputs = inputs) gives the out-of-place result, backward too; outputs over
    NaN-filled recycled memory are written everywhere."""
    ext = lsmini._backend.ext()
    for shape in ((2, 8, 2, 33, 128, 96), (2, 3, 1, 5, 34, 20)):
        q, k, cos, sin, dq, dk = _inputs(*shape, dtype, "cuda", interleaved)
        cos, sin = cos.contiguous(), sin.contiguous()
        for op in (ext.rotary_fwd, ext.rotary_bwd):
            junk = torch.full((4 * (q.numel() + k.numel()),), float("nan"), device="cuda", dtype=dtype)
            del junk
            want_q, want_k = op(q, k, cos, sin, interleaved)
            assert torch.isfinite(want_q).all() and torch.isfinite(want_k).all()
            q2, k2 = q.clone(), k.clone()
            got_q, got_k = op(q2, k2, cos, sin, interleaved, q2, k2)
            assert got_q.data_ptr() == q2.data_ptr() and got_k.data_ptr() == k2.data_ptr()
            assert torch.equal(q2, want_q) and torch.equal(k2, want_k)


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table", TABLE_FORMS)
def test_kernel_tables_that_require_grad_get_their_gradient(table, interleaved):
    q, k, cos, sin, dq, dk = _inputs(3, 8, 2, 19, 64, 48, torch.float32, "cuda", interleaved, table)
    cos, sin = cos.requires_grad_(), sin.requires_grad_()
    qs, ks = q.clone().requires_grad_(), k.clone().requires_grad_()
    with LsminiOps() as ops:
        torch.autograd.backward(rotary(qs, ks, cos, sin, interleaved=interleaved), (dq, dk))
    assert ops.names == ["rotary", "rotary_backward"]
    cos2, sin2 = cos.detach().clone().requires_grad_(), sin.detach().clone().requires_grad_()
    qp, kp = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward(_plain(qp, kp, cos2, sin2, interleaved), (dq, dk))
    assert_close_fp32(qs.grad, qp.grad, name="dq")
    assert_close_fp32(ks.grad, kp.grad, name="dk")
    # sums over heads (and batch) in another order: a few fp32 roundings of |terms| ≤ 10 apart
    assert_close_fp32(cos.grad, cos2.grad, atol=1e-4, rtol=1e-5, name="dcos")
    assert_close_fp32(sin.grad, sin2.grad, atol=1e-4, rtol=1e-5, name="dsin")


@pytest.mark.cuda
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_one_decoded_token_equals_its_row_of_the_whole_sequence(dtype, interleaved):
    batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 50, 128
    g = torch.Generator().manual_seed(6)
    q = torch.randn(batch, heads, seq, head_dim, generator=g).to("cuda", dtype)
    k = torch.randn(batch, kv_heads, seq, head_dim, generator=g).to("cuda", dtype)
    cos, sin = rotary_cos_sin(seq, head_dim, offset=1000, interleaved=interleaved, device="cuda")
    full_q, full_k = rotary(q, k, cos, sin, interleaved=interleaved)
    ids = torch.tensor([[1000], [1000]], device="cuda")
    for p in (0, 17, seq - 1):
        c, s = rotary_cos_sin(1, head_dim, offset=1000 + p, interleaved=interleaved, device="cuda")
        step_q, step_k = rotary(q[:, :, p:p + 1], k[:, :, p:p + 1], c, s, interleaved=interleaved)
        assert torch.equal(step_q, full_q[:, :, p:p + 1]) and torch.equal(step_k, full_k[:, :, p:p + 1])
        c, s = rotary_cos_sin(ids + p, head_dim, interleaved=interleaved)
        assert c.device.type == "cuda"
        step_q, _ = rotary(q[:, :, p:p + 1], k[:, :, p:p + 1], c, s, interleaved=interleaved)
        assert torch.equal(step_q, full_q[:, :, p:p + 1])


@pytest.mark.cuda
def test_kernel_empty_batch_and_sequence():
    for b, s in ((0, 5), (2, 0)):
        q, k, cos, sin, dq, dk = _inputs(b, 4, 2, s, 64, 64, torch.bfloat16, "cuda", table="2d")
        out, grads = _run(lambda q, k: rotary(q, k, cos, sin), (q, k), (dq, dk))
        assert out[0].shape == grads[0].shape == q.shape and out[1].shape == grads[1].shape == k.shape


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_path_matches_eager(dtype):
    torch._dynamo.reset()

    def fn(q, k, cos, sin):
        return rotary(q, k, cos, sin)

    q, k, cos, sin, dq, dk = _inputs(2, 8, 2, 33, 64, 64, dtype, "cuda")
    eager = _run(fn, (q, k, cos, sin), (dq, dk))
    compiled = _run(torch.compile(fn, fullgraph=True), (q, k, cos, sin), (dq, dk))
    for a, b in zip(eager[0] + eager[1][:2], compiled[0] + compiled[1][:2]):
        assert torch.equal(a, b)
    torch._dynamo.reset()


@pytest.mark.cuda
def test_binding_bad_input_errors():
    ext = lsmini._backend.ext()
    q, k, cos, sin, _, _ = _inputs(2, 4, 2, 5, 64, 64, torch.float16, "cuda")
    with pytest.raises(RuntimeError, match="rotary_fwd: q must be a CUDA tensor"):
        ext.rotary_fwd(q.cpu(), k, cos, sin)
    with pytest.raises(RuntimeError, match="rotary_fwd: q must be float32, float16 or bfloat16, got Double"):
        ext.rotary_fwd(q.double(), k, cos, sin)
    with pytest.raises(ValueError, match=r"rotary_fwd: q must be 4-D \[batch, heads, seq, head_dim\]"):
        ext.rotary_fwd(q[0], k, cos, sin)
    with pytest.raises(TypeError, match="rotary_fwd: k must have q's dtype Half, got BFloat16"):
        ext.rotary_fwd(q, k.bfloat16(), cos, sin)
    with pytest.raises(ValueError, match=r"rotary_fwd: k must be 4-D \[batch, kv_heads, seq, head_dim\] with q's "
                                         r"batch = 2, seq = 5 and head_dim = 64, got shape \[2, 2, 4, 64\]"):
        ext.rotary_fwd(q, k[:, :, :4], cos, sin)
    with pytest.raises(ValueError, match=r"rotary_fwd: cos must be 3-D \[batch or 1, seq, rot_dim\]"):
        ext.rotary_fwd(q, k, cos[0], sin[0])
    with pytest.raises(ValueError, match=r"rotary_fwd: rot_dim \(the last dimension of cos and sin\) must be even and "
                                         r"in \[2, head_dim = 64\], got 7"):
        ext.rotary_fwd(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match=r"must be even and in \[2, head_dim = 64\], got 128"):
        ext.rotary_fwd(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    with pytest.raises(TypeError, match=r"rotary_fwd: cos must be Half \(q's dtype\) or float32, got BFloat16"):
        ext.rotary_fwd(q, k, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(TypeError, match="rotary_fwd: sin must have cos's dtype Float, got Half"):
        ext.rotary_fwd(q, k, cos, sin.half())
    with pytest.raises(ValueError, match=r"rotary_fwd: sin must have cos's shape \[2, 5, 64\], got \[1, 5, 64\]"):
        ext.rotary_fwd(q, k, cos, sin[:1])
    with pytest.raises(RuntimeError, match="rotary_fwd: cos must be a CUDA tensor"):
        ext.rotary_fwd(q, k, cos.cpu(), sin)
    with pytest.raises(RuntimeError, match="rotary_bwd: grad_k must be a CUDA tensor"):
        ext.rotary_bwd(q, k.cpu(), cos, sin)
    with pytest.raises(RuntimeError, match=r"rotary_fwd: q_out must have shape \[2, 4, 5, 64\]"):
        ext.rotary_fwd(q, k, cos, sin, False, q[:1])
    with pytest.raises(RuntimeError, match="rotary_fwd: q_out must have stride 1 along head_dim"):
        ext.rotary_fwd(q, k, cos, sin, False, torch.empty(2, 4, 5, 128, device="cuda", dtype=q.dtype)[..., ::2])
    with pytest.raises(RuntimeError, match="rotary_fwd: k_out overlaps q"):
        ext.rotary_fwd(q, k, cos, sin, False, None, q[:, :2])
    with pytest.raises(ValueError, match="rotary: cos is on cpu but q is on cuda"):
        rotary(q, k, cos.cpu(), sin)
    with pytest.raises(ValueError, match="rotary: k is on cpu but q is on cuda"):
        rotary(q, k.cpu(), cos, sin)


@pytest.mark.cuda
def test_config_reference(monkeypatch):
    q, k, cos, sin, _, _ = _inputs(2, 4, 2, 5, 64, 64, torch.float32, "cuda")
    with LsminiOps() as ops:
        rotary(q, k, cos, sin)
    assert ops.names == ["rotary"]
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        out = rotary(q.requires_grad_(), k, cos, sin)
    assert ops.names == [] and out[0].grad_fn is not None
    torch.testing.assert_close(out, rotary_ref(q, k, cos, sin))
