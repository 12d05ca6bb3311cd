import importlib
import math

import pytest
import torch
import torch.nn.functional as F

import lsmini
from lsmini.ops.dropout import keep_mask
from lsmini.ops.embedding import embedding, embedding_ref, sinusoidal_positions
from util import LOWP, LsminiOps, assert_close_fp32, assert_dropout_keep_stats, assert_lowp_rule, philox_keep_mask

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(batch, length, hidden, vocab, dtype, device, pad=None, max_positions=None, learned=False, seed=0,
            token_dtype=torch.int64):
    """tokens [batch, len] (about 1 in 8 set to pad when pad is given), weight, pos_table, grad_out."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length), generator=g)
    if pad is not None:
        tokens[torch.rand(batch, length, generator=g) < 0.125] = pad
    weight = torch.randn(vocab, hidden, generator=g)
    max_positions = max_positions or length
    if learned:
        pos = 0.5 * torch.randn(max_positions, hidden, generator=g)
    else:
        pos = sinusoidal_positions(max_positions, hidden + hidden % 2)[:, :hidden]
    grad = torch.randn(batch, length, hidden, generator=g)
    to = dict(device=device, dtype=dtype)
    return (tokens.to(device=device, dtype=token_dtype), weight.to(**to), pos.to(**to), grad.to(**to))


def _plain(tokens, weight, pos, scale, pad, step):
    """What a PyTorch user writes, in the tensors' own dtype: nn.Embedding · scale + positions, pad → 0."""
    emb = torch.nn.Embedding(weight.shape[0], weight.shape[1], padding_idx=pad, device=weight.device,
                             dtype=weight.dtype)
    with torch.no_grad():
        emb.weight.copy_(weight)
    length = tokens.shape[1]
    pos = pos.detach().clone().requires_grad_(True)
    out = emb(tokens.long()) * scale + pos[step:step + length]
    if pad is not None:
        out = out.masked_fill(tokens.eq(pad).unsqueeze(-1), 0)
    return out, emb.weight, pos


def _run(fn, weight, pos, grad, learned=True):
    """Forward and backward through fn(weight, pos); returns (out, grad_weight, grad_pos)."""
    w = weight.detach().clone().requires_grad_(True)
    p = pos.detach().clone().requires_grad_(learned)
    out = fn(w, p)
    out.backward(grad)
    return out.detach(), w.grad, (p.grad if learned else None)


def _oracle(tokens, weight, pos, grad, pad, step, learned, mask=None, p=0.0):
    """float64 reference; with `mask` (bool, like the output) the given dropout mask is applied."""
    def fn(w, q):
        out = embedding_ref(tokens, w, q, padding_idx=pad, step=step)
        if mask is not None:
            out = out * mask.double() / (1.0 - p)
        return out
    return _run(fn, weight.double(), pos.double(), grad.double(), learned)


def _max_count(tokens, pad):
    t = tokens.flatten().long()
    if pad is not None:
        t = t[t != pad]
    return int(torch.bincount(t).max()) if t.numel() else 1


def _check_all(ours, oracle, plain, dtype, scale, count, batch):
    """out / grad_weight / grad_pos against the float64 oracle: fp32 tight, fp16/bf16 by the 2x rule.
    count = most occurrences of one counted id; batch = terms summed per positional row."""
    for name, a, r, t in zip(("out", "grad_weight", "grad_pos"), ours, oracle, plain):
        if a is None:
            assert r is None, name
            continue
        assert a.dtype == dtype and a.shape == r.shape, name
        term = max(scale, 1.0) if name != "grad_pos" else 1.0  # size of one summand
        if dtype in LOWP:
            # atol: a small fraction of one term (the outputs and token gradients carry the scale)
            assert_lowp_rule(a, r, t, atol=1e-3 * term, name=name)
        else:
            # Gradients sum up to `count` (or `batch`) terms in another order than the float64
            # oracle: allow a rounding error growing with the number of terms (a missed or extra
            # term, ~1 term in size, stays far outside).
            n = {"out": 0, "grad_weight": count, "grad_pos": batch}[name]
            atol = 1e-5 if n == 0 else max(1e-5, 2e-6 * term * n)
            assert_close_fp32(a, r, atol=atol, rtol=1e-5, name=name)


# ------------------------------------------------------------------------------------ CPU (CI) ---

@pytest.mark.parametrize("pad", [None, 3])
@pytest.mark.parametrize("step", [0, 5])
@pytest.mark.parametrize("learned", [False, True])
def test_reference_matches_plain_pytorch(pad, step, learned):
    tokens, weight, pos, grad = _inputs(3, 11, 16, 20, torch.float64, "cpu", pad=pad, max_positions=20,
                                        learned=learned)
    scale = math.sqrt(16)
    ours = _run(lambda w, q: embedding_ref(tokens, w, q, padding_idx=pad, step=step), weight, pos, grad, learned)
    out_t, w_t, p_t = _plain(tokens, weight, pos, scale, pad, step)
    out_t.backward(grad)
    theirs = (out_t.detach(), w_t.grad, p_t.grad if learned else None)
    for name, a, r in zip(("out", "grad_weight", "grad_pos"), ours, theirs):
        if a is None:
            continue
        assert_close_fp32(a, r, atol=1e-5, rtol=1e-5, name=name)
    if pad is not None:
        assert torch.equal(ours[0][tokens == pad], torch.zeros_like(ours[0][tokens == pad]))
        assert torch.equal(ours[1][pad], torch.zeros(16, dtype=torch.float64))


def test_reference_fp32_math_for_half_weights():
    tokens, weight, pos, _ = _inputs(2, 7, 32, 50, torch.bfloat16, "cpu", pad=0)
    out = embedding_ref(tokens, weight, pos, padding_idx=0)
    ref = embedding_ref(tokens, weight.double(), pos.double(), padding_idx=0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.bfloat16(), atol=0, rtol=0)  # fp32 math, one rounding at the end


def _plain_with_mask(tokens, weight, pos, grad, scale, pad, step, learned, keep, p):
    """_plain's forward and backward (out, grad_weight, grad_pos) with the given dropout keep-mask (None: no
    dropout), in the tensors' own dtype."""
    out, w, q = _plain(tokens, weight, pos, scale, pad, step)
    if keep is not None:
        out = torch.where(keep, out * (1.0 / (1.0 - p)), torch.zeros_like(out))
    out.backward(grad)
    return out.detach(), w.grad, (q.grad if learned else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pad", [None, 3])
@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_op_on_cpu_matches_plain_pytorch(p, learned, pad, dtype):
    """The registered operators' CPU implementation, forward and gradients with one random grad_output,
    against nn.Embedding · scale + positions with the mask the op draws: the reference's keep-mask
    (``lsmini.ops.dropout.keep_mask``) from torch's CPU generator, here drawn again under the same seed.
    fp32 against float64, fp16/bf16 by the 2x rule."""
    batch, length, hidden, vocab, step = 5, 11, 16, 20, 2
    tokens, weight, pos, grad = _inputs(batch, length, hidden, vocab, dtype, "cpu", pad=pad,
                                        max_positions=length + step + 1, learned=learned)
    scale = math.sqrt(hidden)
    torch.manual_seed(1)
    with LsminiOps() as ops:
        ours = _run(lambda w, q: embedding(tokens, w, q, padding_idx=pad, step=step, dropout_p=p,
                                           learned_positions=learned), weight, pos, grad, learned)
    assert ops.names == ["embedding", "embedding_backward"]
    torch.manual_seed(1)
    keep = keep_mask((batch, length, hidden), p, "cpu")
    truth = _plain_with_mask(tokens, weight.double(), pos.double(), grad.double(), scale, pad, step, learned, keep, p)
    plain = _plain_with_mask(tokens, weight, pos, grad, scale, pad, step, learned, keep, p)
    _check_all(ours, truth, plain, dtype, scale, _max_count(tokens, pad), batch)
    if pad is not None:
        assert torch.equal(ours[1][pad], torch.zeros_like(ours[1][pad]))


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_op_on_cpu_dropout_statistics_same_mask_and_seed(p):
    tokens, weight, pos, grad = _inputs(8, 64, 64, 100, torch.float32, "cpu", learned=True)
    weight = (weight.abs() + 1).requires_grad_(True)  # every row ≥ 1 + pos: kept ≠ 0
    pos = pos.abs().requires_grad_(True)
    torch.manual_seed(3)
    out = embedding(tokens, weight, pos, scale=1.0, dropout_p=p, learned_positions=True)
    (gp,) = torch.autograd.grad(out, pos, grad)
    keep = out != 0
    assert_dropout_keep_stats(keep.view(-1, 64), p, name=f"mask p={p}")
    # the backward applies the forward's mask: grad_pos sums the kept gradients over the batch
    assert_close_fp32(gp, torch.where(keep, grad / (1 - p), 0.0).sum(0), atol=1e-5, rtol=1e-5)
    torch.manual_seed(3)
    again = embedding(tokens, weight, pos, scale=1.0, dropout_p=p, learned_positions=True)
    assert torch.equal(again, out)
    assert not torch.equal(embedding(tokens, weight, pos, scale=1.0, dropout_p=p, learned_positions=True), out)


def test_float64_and_forced_reference_call_the_reference_directly(monkeypatch):
    tokens, weight, pos, _ = _inputs(2, 9, 24, 30, torch.float64, "cpu", pad=1)
    with LsminiOps() as ops:
        out = embedding(tokens, weight, pos, padding_idx=1)
    assert ops.names == [] and out.dtype == torch.float64
    torch.testing.assert_close(out, embedding_ref(tokens, weight, pos, padding_idx=1))
    monkeypatch.setattr(lsmini.config, "reference", True)
    with LsminiOps() as ops:
        out = embedding(tokens, weight.float(), pos.float(), padding_idx=1)
    assert ops.names == []
    torch.testing.assert_close(out, embedding_ref(tokens, weight.float(), pos.float(), padding_idx=1))


def test_functional_on_cpu_defaults():
    tokens, weight, pos, _ = _inputs(2, 9, 24, 30, torch.float32, "cpu", pad=1, max_positions=12)
    out = embedding(tokens, weight, pos, padding_idx=1, step=2)
    torch.testing.assert_close(out, embedding_ref(tokens, weight, pos, math.sqrt(24), 1, 2))
    # step offsets the positions: column j reads pos_table[step + j]
    manual = F.embedding(tokens, weight) * math.sqrt(24) + pos[2:11]
    manual[tokens == 1] = 0
    torch.testing.assert_close(out, manual)
    # explicit scale, negative padding_idx counts from the end (as nn.Embedding)
    torch.testing.assert_close(embedding(tokens, weight, pos, scale=1.5, padding_idx=-29),
                               embedding_ref(tokens, weight, pos, 1.5, 1))
    # int32 tokens
    torch.testing.assert_close(embedding(tokens.int(), weight, pos, padding_idx=1), embedding(tokens, weight, pos,
                                                                                             padding_idx=1))
    # pos_table None: the sinusoidal table
    torch.testing.assert_close(embedding(tokens, weight, None, step=3),
                               embedding_ref(tokens, weight, sinusoidal_positions(12, 24), step=3))


def test_pos_table_in_another_dtype():
    tokens, weight, pos, _ = _inputs(2, 5, 16, 10, torch.float32, "cpu")
    out = embedding(tokens, weight.half(), pos)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), embedding_ref(tokens, weight.half().float(), pos), atol=2e-2, rtol=1e-3)


def test_sinusoidal_positions_formula():
    table = sinusoidal_positions(7, 10, dtype=torch.float64)
    assert table.shape == (7, 10) and table.dtype == torch.float64
    for pos in range(7):
        for i in range(5):
            angle = pos / 10000 ** (2 * i / 10)
            assert abs(table[pos, i].item() - math.sin(angle)) < 1e-12
            assert abs(table[pos, 5 + i].item() - math.cos(angle)) < 1e-12
    assert sinusoidal_positions(3, 4, dtype=torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="even"):
        sinusoidal_positions(8, 7)
    with pytest.raises(ValueError, match="max_positions"):
        sinusoidal_positions(-1, 8)


def test_out_of_range_ids_raise():
    tokens, weight, pos, _ = _inputs(2, 4, 8, 10, torch.float32, "cpu")
    bad = tokens.clone()
    bad[1, 2] = 10
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\).*\[\d+, 10\]"):
        embedding(bad, weight, pos)
    bad[1, 2] = -3
    with pytest.raises(ValueError, match=r"\[-3, \d+\]"):
        embedding(bad, weight, pos)


def test_step_overflow_raises():
    tokens, weight, pos, _ = _inputs(2, 6, 8, 10, torch.float32, "cpu", max_positions=8)
    embedding(tokens, weight, pos, step=2)  # 2 + 6 = 8 fits exactly
    with pytest.raises(ValueError, match="max_positions = 8"):
        embedding(tokens, weight, pos, step=3)
    with pytest.raises(ValueError, match="step must be"):
        embedding(tokens, weight, pos, step=-1)


def test_bad_input_errors():
    tokens, weight, pos, _ = _inputs(2, 4, 8, 10, torch.float32, "cpu")
    with pytest.raises(TypeError, match="tokens must be int64 or int32"):
        embedding(tokens.float(), weight, pos)
    with pytest.raises(ValueError, match="tokens must be 2-D"):
        embedding(tokens.flatten(), weight, pos)
    with pytest.raises(ValueError, match=r"pos_table must have shape \[max_positions, 8\]"):
        embedding(tokens, weight, pos[:, :4])
    with pytest.raises(TypeError, match="weight must be a floating-point"):
        embedding(tokens, weight.long(), pos)
    with pytest.raises(ValueError, match="dropout_p must be in"):
        embedding(tokens, weight, pos, dropout_p=1.5)
    with pytest.raises(ValueError, match="padding_idx must be in"):
        embedding(tokens, weight, pos, padding_idx=10)
    with pytest.raises(ValueError, match="learned_positions=False"):
        embedding(tokens, weight, pos.clone().requires_grad_(True))
    with pytest.raises(ValueError, match="learned_positions=True needs"):
        embedding(tokens, weight, None, learned_positions=True)


def test_padding_row_gets_no_grad_and_learned_pos_grad():
    tokens, weight, pos, grad = _inputs(4, 6, 8, 5, torch.float32, "cpu", pad=2, learned=True)
    w = weight.clone().requires_grad_(True)
    p = pos.clone().requires_grad_(True)
    embedding(tokens, w, p, padding_idx=2, learned_positions=True).backward(grad)
    assert torch.equal(w.grad[2], torch.zeros(8))
    expected = (grad * tokens.ne(2).unsqueeze(-1)).sum(0)
    torch.testing.assert_close(p.grad, expected)


def test_backward_op_adds_into_a_given_gradient_on_cpu():
    tokens, weight, pos, grad = _inputs(3, 7, 8, 6, torch.float32, "cpu", pad=2)
    state = torch.empty(0, dtype=torch.bool)
    args = (grad, tokens, state, 6, 7, True, True, 2.0, 2, 0, 0.0)
    fresh, fresh_pos = torch.ops.lsmini.embedding_backward.default(*args, None)
    base = torch.randn(6, 8)
    into = base.clone()
    gw, gp = torch.ops.lsmini.embedding_backward.default(*args, into)
    assert gw.numel() == 0 and torch.equal(gp, fresh_pos)
    torch.testing.assert_close(into, base + fresh)
    with pytest.raises(ValueError, match="weight_grad_into given with need_weight_grad false"):
        torch.ops.lsmini.embedding_backward.default(*args[:5], False, *args[6:], into)


def test_reference_dropout():
    tokens, weight, pos, _ = _inputs(8, 64, 64, 100, torch.float32, "cpu")
    base = embedding(tokens, weight, pos)
    assert torch.equal(embedding(tokens, weight, pos, dropout_p=0.5, training=False), base)
    torch.manual_seed(0)
    out = embedding(tokens, weight, pos, dropout_p=0.5)
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.5) < 0.02
    torch.testing.assert_close(out[kept], 2 * base[kept])


# ---------------------------------------------------------------------------------------- CUDA ---

# (batch, len, hidden, vocab): single token, hidden not a multiple of the vector width (6, 12 for
# fp16), primes, 2^n+1 batch (positional gradient split over batch slices), hidden 1032 / 4104
# (vectors left over), and enough repeats that equal-id runs cross the 32-position chunks.
SHAPES = [(1, 1, 8, 3), (1, 7, 6, 5), (2, 13, 12, 7), (3, 97, 64, 31), (129, 3, 256, 50), (4, 31, 1032, 200),
          (2, 17, 4104, 1000), (8, 64, 1024, 37)]


def _cuda_case(shape, dtype, pad, step, learned, token_dtype=torch.int64):
    batch, length, hidden, vocab = shape
    tokens, weight, pos, grad = _inputs(batch, length, hidden, vocab, dtype, "cuda", pad=pad,
                                        max_positions=length + step, learned=learned, token_dtype=token_dtype)
    scale = math.sqrt(hidden)
    ours = _run(lambda w, q: embedding(tokens, w, q, padding_idx=pad, step=step, learned_positions=learned),
                weight, pos, grad, learned)
    oracle = _oracle(tokens, weight, pos, grad, pad, step, learned)
    out_t, w_t, p_t = _plain(tokens, weight, pos, scale, pad, step)
    out_t.backward(grad)
    plain = (out_t.detach(), w_t.grad, p_t.grad if learned else None)
    _check_all(ours, oracle, plain, dtype, scale, _max_count(tokens, pad), batch)
    if pad is not None:
        is_pad = tokens == pad
        assert torch.equal(ours[0][is_pad], torch.zeros_like(ours[0][is_pad]))
        assert torch.equal(ours[1][pad], torch.zeros_like(ours[1][pad]))
    return ours


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("learned", [False, True])
def test_kernel_matches_reference(shape, dtype, learned):
    _cuda_case(shape, dtype, pad=1 if shape[3] > 1 else None, step=0, learned=learned)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("step", [1, 7])
def test_kernel_step_offset_and_no_padding(dtype, step):
    _cuda_case((5, 23, 128, 40), dtype, pad=None, step=step, learned=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_int32_tokens_match_int64(dtype):
    a = _cuda_case((6, 41, 256, 60), dtype, pad=4, step=2, learned=True, token_dtype=torch.int32)
    b = _cuda_case((6, 41, 256, 60), dtype, pad=4, step=2, learned=True, token_dtype=torch.int64)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_repeated_ids(dtype):
    # One id makes up 7000 of 8192 tokens: a run over ~220 chunks, finished by one block, with pad
    # tokens (and a second frequent id) mixed in.
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (8192,), generator=g)
    tokens[:7000] = 5
    tokens[7000:7600] = 0  # pad
    tokens[7600:7900] = 6
    tokens = tokens[torch.randperm(8192, generator=g)].view(4, 2048).cuda()
    hidden, scale = 256, 16.0
    weight = torch.randn(100, hidden, generator=g).to("cuda", dtype)
    pos = (0.5 * torch.randn(2048, hidden, generator=g)).to("cuda", dtype)
    grad = torch.randn(4, 2048, hidden, generator=g).to("cuda", dtype)
    ours = _run(lambda w, q: embedding(tokens, w, q, padding_idx=0, learned_positions=True), weight, pos, grad)
    oracle = _oracle(tokens, weight, pos, grad, 0, 0, True)
    out_t, w_t, p_t = _plain(tokens, weight, pos, scale, 0, 0)
    out_t.backward(grad)
    _check_all(ours, oracle, (out_t.detach(), w_t.grad, p_t.grad), dtype, scale, 7000, 4)
    assert torch.equal(ours[1][0], torch.zeros_like(ours[1][0]))


@pytest.mark.cuda
@pytest.mark.parametrize("run", [1, 31, 32, 33, 64, 100, 1000])
def test_kernel_runs_at_chunk_boundaries(run):
    # Sorted runs of exactly `run` equal ids: runs that end on, just before or just after a
    # 32-position chunk boundary, and runs spanning many chunks.
    n_ids = max(2, 2048 // run)
    tokens = torch.arange(n_ids).repeat_interleave(run)
    tokens = tokens[torch.randperm(tokens.numel(), generator=torch.Generator().manual_seed(run))]
    tokens = tokens.view(1, -1).cuda()
    hidden = 64
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(n_ids, hidden, generator=g).cuda()
    pos = torch.randn(tokens.shape[1], hidden, generator=g).cuda()
    grad = torch.randn(1, tokens.shape[1], hidden, generator=g).cuda()
    ours = _run(lambda w, q: embedding(tokens, w, q), weight, pos, grad, learned=False)
    oracle = _oracle(tokens, weight, pos, grad, None, 0, False)
    _check_all(ours, oracle, (None, None, None), torch.float32, 8.0, run, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_single_id_everywhere_and_all_pad(dtype):
    tokens = torch.full((16, 2048), 3, device="cuda")
    weight = torch.randn(10, 128, device="cuda", dtype=dtype)
    pos = torch.randn(2048, 128, device="cuda", dtype=dtype)
    grad = torch.randn(16, 2048, 128, device="cuda", dtype=dtype)
    ours = _run(lambda w, q: embedding(tokens, w, q, learned_positions=True), weight, pos, grad)
    oracle = _oracle(tokens, weight, pos, grad, None, 0, True)
    out_t, w_t, p_t = _plain(tokens, weight, pos, math.sqrt(128), None, 0)
    out_t.backward(grad)
    _check_all(ours, oracle, (out_t.detach(), w_t.grad, p_t.grad), dtype, math.sqrt(128), 16 * 2048, 16)
    # every token is padding: zeros out, zero gradients
    out, gw, gp = _run(lambda w, q: embedding(tokens, w, q, padding_idx=3, learned_positions=True), weight, pos,
                       grad)
    assert not out.any() and not gw.any() and not gp.any()


def _spy_grad_into(monkeypatch):
    """Records what the embedding backward's grad_into returned, call by call."""
    module = importlib.import_module("lsmini.ops.embedding")  # lsmini.ops.embedding is also the function
    seen = []
    real = module.grad_into

    def spy(param, like):
        seen.append(real(param, like))
        return seen[-1]
    monkeypatch.setattr(module, "grad_into", spy)
    return seen


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_adds_into_the_existing_grad(dtype, monkeypatch):
    """A table whose .grad autograd would accumulate into gets its gradient added there by the kernels: the
    same tensor, the rows of ids that do not occur (and the padding row) untouched, the others the old value
    plus the gradient a fresh backward gives."""
    seen = _spy_grad_into(monkeypatch)
    tokens, weight, pos, grad = _inputs(4, 300, 256, 2000, dtype, "cuda", pad=1)
    fresh = _run(lambda w, q: embedding(tokens, w, q, padding_idx=1), weight, pos, grad, learned=False)[1]
    assert seen == [None]  # no .grad yet: a fresh table for autograd
    w = weight.clone().requires_grad_(True)
    base = torch.randn_like(weight)
    w.grad = base.clone()
    held = w.grad
    embedding(tokens, w, pos, padding_idx=1).backward(grad)
    assert seen[-1] is held and w.grad is held
    occurs = torch.zeros(2000, dtype=torch.bool, device="cuda")
    occurs[tokens.flatten()] = True
    occurs[1] = False
    assert torch.equal(w.grad[~occurs], base[~occurs])
    # one rounding of old + sum, against autograd's two (the sum's, then the add's): within a few rounding steps
    # of the largest summand (a missing or extra term, about 16 = the scale in size, stays far outside)
    atol = 4 * torch.finfo(dtype).eps * fresh.abs().max().item()
    torch.testing.assert_close(w.grad.float(), base.float() + fresh.float(), atol=atol, rtol=0)


@pytest.mark.cuda
def test_kernel_grad_into_keeps_autograd_semantics(monkeypatch):
    """torch.autograd.grad returns the gradient and leaves .grad alone; a hook on the table sees the gradient and
    autograd adds what it returns; a table tied to an output projection gets both gradients."""
    seen = _spy_grad_into(monkeypatch)
    tokens, weight, pos, grad = _inputs(2, 50, 64, 40, torch.float32, "cuda")
    fresh = _run(lambda w, q: embedding(tokens, w, q), weight, pos, grad, learned=False)[1]
    w = weight.clone().requires_grad_(True)
    base = torch.randn_like(weight)
    w.grad = base.clone()
    (g,) = torch.autograd.grad(embedding(tokens, w, pos), w, grad)
    assert seen[-1] is None and torch.equal(w.grad, base)
    torch.testing.assert_close(g, fresh)
    hooked = []
    handle = w.register_hook(lambda g: hooked.append(g) or 2 * g)
    embedding(tokens, w, pos).backward(grad)
    handle.remove()
    assert seen[-1] is None and len(hooked) == 1
    torch.testing.assert_close(w.grad, base + 2 * fresh)
    # (a tensor that ever had a hook keeps autograd's accumulation: a removed hook leaves an empty entry behind)
    tied = weight.clone().requires_grad_(True)
    tied.grad = base.clone()
    h = torch.randn(2, 50, 64, device="cuda")
    logits = F.linear(embedding(tokens, tied, pos) + h, tied)
    logits.backward(torch.ones_like(logits))
    assert seen[-1] is tied.grad
    v = weight.clone().requires_grad_(True)
    F.linear(embedding(tokens, v, pos) + h, v).backward(torch.ones_like(logits))
    torch.testing.assert_close(tied.grad, base + v.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
def test_kernel_backward_is_deterministic():
    tokens, weight, pos, grad = _inputs(32, 256, 512, 50, torch.float16, "cuda", pad=0, learned=True)
    f = lambda w, q: embedding(tokens, w, q, padding_idx=0, dropout_p=0.1, learned_positions=True)  # noqa: E731
    torch.manual_seed(3)
    a = _run(f, weight, pos, grad)
    torch.manual_seed(3)
    b = _run(f, weight, pos, grad)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _misaligned_copy(t):
    """Same values, stored one element into a fresh buffer: not 16-byte aligned."""
    out = torch.empty(t.numel() + 1, device=t.device, dtype=t.dtype)[1:].view_as(t).copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_unaligned_rows_use_the_scalar_path_bitwise(dtype):
    # Misaligned weight / table / grad_out send every kernel down its one-element-per-thread path,
    # which must give bitwise the output, mask and gradients of the vector path. (batch 4 and short
    # runs keep the fp32 summation order the same in both paths.)
    tokens, weight, pos, grad = _inputs(4, 37, 64, 30, dtype, "cuda", pad=2, learned=True)
    ext = lsmini._backend.ext()
    args = (8.0, 2, 0, 0.3, (1234, 8, 0, 0))
    aligned = ext.embedding_fwd(tokens, weight, pos, *args)
    scalar = ext.embedding_fwd(tokens, _misaligned_copy(weight), _misaligned_copy(pos), *args)
    assert torch.equal(aligned, scalar)
    bwd = (30, 37, True, True, 8.0, 2, 0, 0.3, (1234, 8, 0, 0))
    for a, b in zip(ext.embedding_bwd(grad, tokens, *bwd), ext.embedding_bwd(_misaligned_copy(grad), tokens, *bwd)):
        assert torch.equal(a, b)
    # and the vector path itself agrees with the float64 oracle under the same mask
    mask = (aligned != 0) & (tokens != 2).unsqueeze(-1)
    oracle = _oracle(tokens, weight, pos, grad, 2, 0, True, mask=mask, p=0.3)
    gw, gp = ext.embedding_bwd(grad, tokens, *bwd)
    if dtype == torch.float32:
        assert_close_fp32(aligned, oracle[0])
        assert_close_fp32(gw, oracle[1], atol=2e-6 * 8 / 0.7 * _max_count(tokens, 2), name="grad_weight")
        assert_close_fp32(gp, oracle[2], atol=1e-5, name="grad_pos")
    else:
        for name, a, r in zip(("out", "grad_weight", "grad_pos"), (aligned, gw, gp), oracle):
            torch.testing.assert_close(a.double(), r, atol=0.0, rtol=1e-2, msg=name)  # one rounding to dtype


@pytest.mark.cuda
def test_kernel_pos_table_dtype_differs_from_weight():
    tokens, weight, pos, grad = _inputs(3, 19, 64, 40, torch.float16, "cuda", pad=1, max_positions=25,
                                        learned=True)
    pos32 = pos.float()
    ours = _run(lambda w, q: embedding(tokens, w, q, padding_idx=1, step=4, learned_positions=True), weight, pos32,
                grad)
    assert ours[0].dtype == torch.float16 and ours[2].dtype == torch.float32
    oracle = _oracle(tokens, weight, pos32, grad, 1, 4, True)
    assert_lowp_rule(ours[0], oracle[0], _plain(tokens, weight, pos, 8.0, 1, 4)[0], atol=8e-3, name="out")
    torch.testing.assert_close(ours[2].double(), oracle[2], atol=1e-2, rtol=1e-2)  # fp16 grads summed, then fp32


@pytest.mark.cuda
def test_kernel_non_contiguous_inputs_and_grad():
    tokens, weight, pos, _ = _inputs(6, 20, 64, 30, torch.float32, "cuda", pad=0, learned=True)
    tok_t = tokens.t().contiguous().t()  # same values, column-major
    assert not tok_t.is_contiguous()
    w = weight.clone().requires_grad_(True)
    out = embedding(tok_t, w, pos, padding_idx=0)
    assert_close_fp32(out, embedding_ref(tokens, weight, pos, padding_idx=0))
    out.sum().backward()  # grad_out is an expanded (stride-0) tensor
    oracle = _oracle(tokens, weight, pos, torch.ones(6, 20, 64, device="cuda"), 0, 0, False)
    assert_close_fp32(w.grad, oracle[1], atol=2e-6 * 8 * _max_count(tokens, 0), name="grad_weight")


@pytest.mark.cuda
def test_kernel_empty_inputs():
    weight = torch.randn(10, 32, device="cuda", requires_grad=True)
    pos = torch.randn(8, 32, device="cuda", requires_grad=True)
    for shape in ((0, 5), (3, 0)):
        tokens = torch.zeros(shape, dtype=torch.int64, device="cuda")
        out = embedding(tokens, weight, pos, learned_positions=True, dropout_p=0.1)
        assert out.shape == (*shape, 32)
        out.sum().backward()
        assert not weight.grad.any() and not pos.grad.any()


@pytest.mark.cuda
def test_kernel_unchecked_bad_ids_are_skipped():
    tokens, weight, pos, grad = _inputs(3, 40, 64, 20, torch.float32, "cuda", learned=True)
    bad = tokens.clone()
    bad[0, 1], bad[1, 5], bad[2, 39] = -1, 20, 1 << 40
    with pytest.raises(ValueError, match="token ids must be in"):
        embedding(bad, weight, pos)
    out, gw, gp = _run(lambda w, q: embedding(bad, w, q, check_tokens=False, learned_positions=True), weight, pos,
                       grad)
    torch.cuda.synchronize()
    is_bad = (bad < 0) | (bad >= 20)
    assert torch.equal(out[is_bad], torch.zeros_like(out[is_bad]))
    good = tokens.masked_fill(is_bad, 0)
    ref = _oracle(good, weight, pos, grad * (~is_bad).unsqueeze(-1), None, 0, True)
    assert_close_fp32(out[~is_bad], ref[0][~is_bad])
    assert_close_fp32(gw, ref[1], atol=2e-6 * 8 * _max_count(tokens, None), name="grad_weight")
    assert_close_fp32(gp, ref[2], atol=1e-5, name="grad_pos")


@pytest.mark.cuda
def test_kernel_bad_input_errors():
    ext = lsmini._backend.ext()
    tokens, weight, pos, grad = _inputs(2, 5, 16, 10, torch.float32, "cuda")
    with pytest.raises(RuntimeError, match="embedding_fwd: tokens must be int64 or int32"):
        ext.embedding_fwd(tokens.float(), weight, pos, 4.0, -1, 0, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="embedding_fwd: tokens must be a CUDA tensor"):
        ext.embedding_fwd(tokens.cpu(), weight, pos, 4.0, -1, 0, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="embedding_fwd: pos_table must be"):
        ext.embedding_fwd(tokens, weight, pos.half(), 4.0, -1, 0, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"pos_table must have shape \[max_positions, 16\]"):
        ext.embedding_fwd(tokens, weight, pos[:, :8], 4.0, -1, 0, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="exceeds max_positions = 5"):
        ext.embedding_fwd(tokens, weight, pos, 4.0, -1, 1, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="padding_idx must be"):
        ext.embedding_fwd(tokens, weight, pos, 4.0, 10, 0, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match="weight must be float32, float16 or bfloat16"):
        ext.embedding_fwd(tokens, weight.double(), pos.double(), 4.0, -1, 0, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"embedding_bwd: grad_out must have shape \[2, 5, hidden\]"):
        ext.embedding_bwd(grad[:1], tokens, 10, 5, True, True, 4.0, -1, 0, 0.0, (0, 0, 0, 0))
    bwd = (10, 5, True, False, 4.0, -1, 0, 0.0, (0, 0, 0, 0))
    with pytest.raises(RuntimeError, match=r"embedding_bwd: vocab must be in \[0, 2\^32\)"):
        ext.embedding_bwd(grad, tokens, 1 << 32, *bwd[1:])
    with pytest.raises(RuntimeError, match="weight_grad_into given with need_weight_grad false"):
        ext.embedding_bwd(grad, tokens, 10, 5, False, True, *bwd[4:], torch.zeros_like(weight))
    with pytest.raises(RuntimeError, match="weight_grad_into must be Float, got Half"):
        ext.embedding_bwd(grad, tokens, *bwd, weight.half())
    with pytest.raises(RuntimeError, match=r"weight_grad_into must be a contiguous \[10, 16\] tensor"):
        ext.embedding_bwd(grad, tokens, *bwd, weight[:, :8])
    with pytest.raises(RuntimeError, match=r"\(not contiguous\)"):
        ext.embedding_bwd(grad, tokens, *bwd, torch.zeros(16, 10, device="cuda").t())
    with pytest.raises(RuntimeError, match=r"embedding_fwd: rng must be \(seed, offset, 0, 0\)"):
        ext.embedding_fwd(tokens, weight, pos, 4.0, -1, 0, 0.2, (1, 2, 0, 8))
    with pytest.raises(ValueError, match="weight is on cuda"):
        embedding(tokens.cpu(), weight, pos)
    with pytest.raises(ValueError, match="pos_table is on cpu"):
        embedding(tokens, weight, pos.cpu())
    with pytest.raises(ValueError, match="max_positions = 5"):
        embedding(tokens, weight, pos, step=1)


@pytest.mark.cuda
def test_kernel_writes_every_output():
    tokens, weight, pos, grad = _inputs(7, 33, 1032, 50, torch.float16, "cuda", pad=0)
    ext = lsmini._backend.ext()
    for _ in range(2):
        junk = torch.full((7 * 33 * 1032 * 4,), float("nan"), device="cuda", dtype=torch.float16)
        del junk
        out = ext.embedding_fwd(tokens, weight, pos, 8.0, 0, 0, 0.2, (1, 2, 0, 0))
        assert torch.isfinite(out).all()
        junk = torch.full((7 * 33 * 1032 * 8,), float("nan"), device="cuda", dtype=torch.float16)
        del junk
        gw, gp = ext.embedding_bwd(grad, tokens, 50, 33, True, True, 8.0, 0, 0, 0.2, (1, 2, 0, 0))
        assert torch.isfinite(gw).all() and torch.isfinite(gp).all()
        gw, gp = ext.embedding_bwd(grad, tokens, 50, 33, False, False, 8.0, 0, 0, 0.2, (1, 2, 0, 0))
        assert gw is None and gp is None


# ------------------------------------------------------------------------------- CUDA dropout ---

def _expected_keep(numel, p, seed, offset):
    """The common.cuh dropout convention, from the independent Python Philox in tests/util.py."""
    return philox_keep_mask(numel, p, seed, offset)


@pytest.mark.cuda
@pytest.mark.parametrize("hidden", [40, 6])  # vector path, scalar path
def test_dropout_mask_follows_the_philox_convention(hidden):
    tokens, weight, pos, _ = _inputs(2, 3, hidden, 10, torch.float32, "cuda")
    p = 0.3
    torch.manual_seed(123)
    seed, offset, seed_ptr, offset_ptr = lsmini._backend.philox_seed_offset()
    assert (seed_ptr, offset_ptr) == (0, 0)  # eager: the values themselves
    torch.manual_seed(123)
    out = embedding(tokens, weight, pos, dropout_p=p)
    keep = _expected_keep(out.numel(), p, seed, offset).view_as(out).cuda()
    base = embedding(tokens, weight, pos)
    assert torch.equal(out != 0, keep)
    assert_close_fp32(out[keep], base[keep] / (1 - p))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics_and_same_mask_in_backward(dtype, p):
    tokens, weight, pos, grad = _inputs(32, 128, 512, 1000, dtype, "cuda", pad=7, learned=True)
    torch.manual_seed(5)
    ours = _run(lambda w, q: embedding(tokens, w, q, padding_idx=7, dropout_p=p, learned_positions=True), weight,
                pos, grad)
    out = ours[0]
    not_pad = (tokens != 7).unsqueeze(-1).expand_as(out)
    mask = (out != 0) & not_pad
    rate = mask.sum().item() / not_pad.sum().item()
    n = not_pad.sum().item()
    assert abs(rate - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n), f"keep rate {rate} for p = {p}"
    assert not out[~not_pad].any()
    # masks differ from row to row and from column block to column block
    (b0, j0), (b1, j1) = (tokens != 7).nonzero()[:2].tolist()
    assert not torch.equal(mask[b0, j0], mask[b1, j1]) and not torch.equal(mask[b0, j0, :256], mask[b0, j0, 256:])
    # kept values are the no-dropout values / (1 − p), gradients use the same mask
    oracle = _oracle(tokens, weight, pos, grad, 7, 0, True, mask=mask, p=p)
    out_t, w_t, p_t = _plain(tokens, weight, pos, math.sqrt(512), 7, 0)
    scale_t = mask.to(dtype) / (1 - p)
    (out_t * scale_t).backward(grad)
    plain = ((out_t * scale_t).detach(), w_t.grad, p_t.grad)
    _check_all(ours, oracle, plain, dtype, math.sqrt(512) / (1 - p), _max_count(tokens, 7), 32)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_reproducible_and_p0_exact(dtype):
    tokens, weight, pos, _ = _inputs(4, 50, 96, 40, dtype, "cuda", pad=0)
    torch.manual_seed(9)
    a = embedding(tokens, weight, pos, padding_idx=0, dropout_p=0.2)
    torch.manual_seed(9)
    b = embedding(tokens, weight, pos, padding_idx=0, dropout_p=0.2)
    c = embedding(tokens, weight, pos, padding_idx=0, dropout_p=0.2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # p = 0 and eval mode: no RNG, exactly the no-dropout values
    base = embedding(tokens, weight, pos, padding_idx=0)
    assert torch.equal(embedding(tokens, weight, pos, padding_idx=0, dropout_p=0.0), base)
    assert torch.equal(embedding(tokens, weight, pos, padding_idx=0, dropout_p=0.7, training=False), base)
    # the mask depends on the element index only, not on the dtype
    torch.manual_seed(9)
    a32 = embedding(tokens, weight.float(), pos.float(), padding_idx=0, dropout_p=0.2)
    assert torch.equal(a32 != 0, a != 0)


@pytest.mark.cuda
def test_dropout_p1_gives_zeros():
    tokens, weight, pos, grad = _inputs(3, 9, 64, 20, torch.float16, "cuda", learned=True)
    out, gw, gp = _run(lambda w, q: embedding(tokens, w, q, dropout_p=1.0, learned_positions=True), weight, pos,
                       grad)
    assert not out.any() and not gw.any() and not gp.any()
    assert torch.isfinite(out).all() and torch.isfinite(gw).all()


@pytest.mark.cuda
def test_config_reference(monkeypatch):
    tokens, weight, pos, _ = _inputs(2, 8, 32, 10, torch.float32, "cuda")
    monkeypatch.setattr(lsmini.config, "reference", True)
    w = weight.clone().requires_grad_(True)
    with LsminiOps() as ops:
        y = embedding(tokens, w, pos)
    assert ops.names == [] and y.grad_fn is not None
    assert_close_fp32(y, embedding_ref(tokens, weight, pos))
