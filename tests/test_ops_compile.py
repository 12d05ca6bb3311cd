"""lsmini.ops under torch.compile(fullgraph=True): every public op traces without a graph break and computes
what it computes eagerly.

- Reference path (CPU, CI): one function chaining all nine ops, compiled with aot_eager and with inductor,
  against eager; dropout statistics under compile; bad input still names the problem.
- Kernel path through the custom operators lsmini::<op> / lsmini::<op>_backward, on CPU (CI) with fake_ext's
  stand-in for lsmini._C (extended here by the bindings the operators add: the dropout state tensor,
  attention, cross_entropy): the compiled chain equals the eager autograd Functions bit for bit, dropout
  included, and opcheck passes (its eager-against-compiled test without dropout: the stand-in's draws do not
  follow torch.manual_seed).
- Kernel path on CUDA: opcheck of every operator with every test, the compiled chain against eager, and a
  CUDA-graph (reduce-overhead) function whose replays draw fresh masks that their backward reuses.
"""
import ctypes
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from fake_ext import FakeExt, _binding, _check, _masked_softmax, fake_kernels  # noqa: F401  (fixture)
from lsmini.ops import (attention, attention_softmax, bias_act_dropout, bias_dropout_residual, cross_entropy,
                        embedding, layer_norm, merge_heads, split_heads)
from lsmini.ops.attention import attention_backward_op, attention_op, keep_numel
from lsmini.ops.attention_softmax import attention_softmax_backward_op, attention_softmax_op
from lsmini.ops.bias_act_dropout import bias_act_dropout_backward_op, bias_act_dropout_op
from lsmini.ops.bias_dropout_residual import bias_dropout_residual_backward_op, bias_dropout_residual_op
from lsmini.ops.cross_entropy import cross_entropy_backward_op, cross_entropy_op
from lsmini.ops.embedding import embedding_backward_op, embedding_op
from lsmini.ops.heads import merge_heads_backward_op, merge_heads_op, split_heads_backward_op, split_heads_op
from lsmini.ops.layernorm import layer_norm_backward_op, layer_norm_op
from util import assert_close_fp32, assert_dropout_keep_stats

FORWARD_OPS = (layer_norm_op, split_heads_op, merge_heads_op, attention_softmax_op, attention_op, cross_entropy_op,
               embedding_op, bias_dropout_residual_op, bias_act_dropout_op)
BACKWARD_OPS = (layer_norm_backward_op, split_heads_backward_op, merge_heads_backward_op,
                attention_softmax_backward_op, attention_backward_op, cross_entropy_backward_op, embedding_backward_op,
                bias_dropout_residual_backward_op, bias_act_dropout_backward_op)
CUSTOM_OPS = FORWARD_OPS + BACKWARD_OPS

# The chain's sizes: scores for attention_softmax are merge_heads' output viewed as [B, HEADS, L, L], so
# HIDDEN = HEADS·L; head_dim 16 is one the fused attention kernel has.
B, L, HIDDEN, HEADS, VOCAB, PAD, STEP = 3, 16, 32, 2, 50, 1, 2


@pytest.fixture(autouse=True)
def _fresh_compile():
    """Each test compiles anew: what one test compiled (kernel or reference path) is not reused by the next."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---- one function that chains all nine ops ---------------------------------------------------------------
# Each op's output feeds the next one, so the dropout calls draw in one order whatever the compiler
# schedules. Only h is used twice: a gradient summed from more uses could round differently compiled.
def chain(tokens, emb, pos, ln_w, ln_b, qkv_k, qkv_v, qkv_bias, mask, res, res_bias, act_bias, target, p):
    e = embedding(tokens, emb, pos, padding_idx=PAD, step=STEP, dropout_p=p, learned_positions=True)
    y = layer_norm(e, ln_w, ln_b)
    q, k, v = split_heads(torch.cat([y, qkv_k, qkv_v], -1), qkv_bias, HEADS)
    a = attention(q, k, v, mask, False, p)
    m = merge_heads(a)
    probs = attention_softmax(m.view(B, HEADS, L, L), mask, True, p)
    r = bias_dropout_residual(probs.reshape(B, L, HIDDEN), res_bias, res, p)
    h = bias_act_dropout(r, act_bias, "gelu", p)
    rows = cross_entropy(h, target, 0.1, reduction="none")
    loss = cross_entropy(h, target, 0.1)
    return {"embedding": e, "layer_norm": y, "split_heads": q, "attention": a, "merge_heads": m,
            "attention_softmax": probs, "bias_dropout_residual": r, "bias_act_dropout": h, "cross_entropy": rows,
            "loss": loss}


def chain_inputs(device, dtype, seed=0):
    """({name: tensor input of ``chain``}, in chain's order; the gradient of its per-row losses)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=g)).to(device, dt)

    tokens = torch.randint(0, VOCAB, (B, L), generator=g)
    tokens[0, :3] = PAD
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, L - 5:] = True
    mask[2, 1::3] = True
    target = torch.randint(0, HIDDEN, (B, L), generator=g)
    target[2, :4] = -100
    inputs = {"tokens": tokens.to(device), "emb": rand(VOCAB, HIDDEN, scale=0.2),
              "pos": rand(L + STEP + 3, HIDDEN, scale=0.2), "ln_w": 1 + rand(HIDDEN, scale=0.2, dt=torch.float32),
              "ln_b": rand(HIDDEN, scale=0.2, dt=torch.float32), "qkv_k": rand(B, L, HIDDEN),
              "qkv_v": rand(B, L, HIDDEN), "qkv_bias": rand(3 * HIDDEN, scale=0.2, dt=torch.float32),
              "mask": mask.to(device), "res": rand(B, L, HIDDEN), "res_bias": rand(HIDDEN, scale=0.2),
              "act_bias": rand(HIDDEN, scale=0.2), "target": target.to(device)}
    grad_rows = torch.randn(B, L, generator=g).to(device)
    return inputs, grad_rows


def run_chain(fn, inputs, grad_rows, p):
    """fn's outputs (detached) and the gradients of every floating input, from one backward with grad_rows
    on the per-row losses and 1 on the mean loss."""
    leaves = {n: t.detach().clone().requires_grad_(t.is_floating_point()) for n, t in inputs.items()}
    out = fn(*leaves.values(), p)
    torch.autograd.backward([out["cross_entropy"], out["loss"]], [grad_rows, torch.ones_like(out["loss"])])
    grads = {n: t.grad for n, t in leaves.items() if t.is_floating_point()}
    return {n: t.detach() for n, t in out.items()}, grads


def assert_all_equal(a, b, what):
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{what} {name}: {m}")


# ---- reference path (CPU) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_reference_path_compiles_whole_and_matches_eager(backend):
    inputs, grad_rows = chain_inputs("cpu", torch.float32)
    eager_out, eager_grads = run_chain(chain, inputs, grad_rows, 0.0)
    out, grads = run_chain(torch.compile(chain, fullgraph=True, backend=backend), inputs, grad_rows, 0.0)
    # the compiler composes (and, with inductor, fuses) the references' fp32 math differently
    for name in eager_out:
        assert_close_fp32(out[name], eager_out[name], atol=1e-5, rtol=1e-4, name=name)
    for name in eager_grads:
        assert_close_fp32(grads[name], eager_grads[name], atol=1e-5, rtol=1e-4, name=f"grad {name}")


def dropout_ops(x, ones, zeros, tokens, p):
    """Each dropout op on inputs whose kept values are all the same number, so its output shows its mask."""
    hidden = x.shape[-1]
    return {"bias_dropout_residual": bias_dropout_residual(x, None, zeros[0], p),
            "bias_act_dropout": bias_act_dropout(x, None, "relu", p),
            "embedding": embedding(tokens, x.reshape(-1, hidden), zeros[0], scale=1.0, dropout_p=p),
            "attention_softmax": attention_softmax(zeros.view(-1, 1, hidden, hidden), None, False, p) * hidden,
            "attention": attention(zeros[:, None], zeros[:, None], ones[:, None], None, False, p)}


def test_reference_dropout_under_compile_keeps_one_minus_p_and_its_gradient_uses_the_same_mask():
    p, n = 0.3, 64
    x = torch.ones(n, n, requires_grad=True)
    tokens = torch.arange(n * n).view(n, n) % n
    compiled = torch.compile(dropout_ops, fullgraph=True, backend="aot_eager")
    out = compiled(x, torch.ones(n, n, n), torch.zeros(n, n, n), tokens, p)
    for name in ("bias_dropout_residual", "bias_act_dropout", "embedding", "attention_softmax"):
        kept = out[name] != 0
        torch.testing.assert_close(out[name][kept], torch.full_like(out[name][kept], 1 / (1 - p)))
        assert_dropout_keep_stats(kept.reshape(-1, n), p, name=name)
    # attention: each output row averages n values of 1/(1 − p)·keep over n keys
    assert out["attention"].shape == (n, 1, n, n)
    assert abs(out["attention"].mean().item() - 1.0) < 0.05
    mask_before = out["bias_act_dropout"] != 0
    (out["bias_act_dropout"].sum()).backward()
    assert torch.equal(x.grad != 0, mask_before)


BAD_CALLS = {
    "layer_norm": (lambda x: layer_norm(x, torch.ones(7)), ValueError, "layer_norm: weight must have shape (8,)"),
    "split_heads": (lambda x: split_heads(x.view(3, 2, 4), None, 3), ValueError,
                    "must be divisible by parts*num_heads = 3*3 = 9"),
    "merge_heads": (lambda x: merge_heads(x), ValueError, "merge_heads: x must be 4-D"),
    "attention_softmax": (lambda x: attention_softmax(x.view(1, 1, 4, 6), None, True, 1.5), ValueError,
                          "dropout_p must be in [0, 1]"),
    "attention": (lambda x: attention(x[None, None], x[None, None].half(), x[None, None]), TypeError,
                  "attention: k must have q's dtype"),
    "cross_entropy": (lambda x: cross_entropy(x, torch.zeros(3, dtype=torch.int64), reduction="avg"), ValueError,
                      "reduction must be one of"),
    "embedding": (lambda x: embedding(torch.zeros(2, 3, dtype=torch.int64), x, x[:2]), ValueError,
                  "exceeds max_positions = 2"),
    "bias_dropout_residual": (lambda x: bias_dropout_residual(x, None, x.t()), ValueError,
                              "residual must have x's shape"),
    "bias_act_dropout": (lambda x: bias_act_dropout(x, None, "tanh"), ValueError, "unknown activation 'tanh'"),
}


@pytest.mark.parametrize("op", list(BAD_CALLS))
def test_bad_input_under_compile_names_the_problem(op):
    """Compiled, the op's own error comes out (the compiler stops tracing at the raise and runs the call
    eagerly); with fullgraph=True the compiler reports that same error as the reason it could not trace."""
    call, error, message = BAD_CALLS[op]
    x = torch.randn(3, 8)
    with pytest.raises(error, match=re.escape(message)):
        torch.compile(call, backend="aot_eager")(x)
    with pytest.raises(Exception, match=re.escape(message)):
        torch.compile(call, fullgraph=True, backend="aot_eager")(x)


# ---- kernel path on CPU, through the stand-in extension -----------------------------------------------------
class CompileFakeExt(FakeExt):
    """fake_ext's stand-in plus the bindings the custom operators call beyond the autograd Functions'."""

    @_binding
    def philox_state_fwd(self, rngs, out):
        """Writes the resolved (seed, offset) of each rng into out [len(rngs), 2] (int64)."""
        op = "philox_state_fwd"
        _check(out.dtype == torch.int64 and tuple(out.shape) == (len(rngs), 2) and out.is_contiguous(), op,
               f"out must be a contiguous int64 [{len(rngs)}, 2] tensor, got {out.dtype} {list(out.shape)}")
        for i, rng in enumerate(rngs):
            self._check_rng(rng, op)
            for j, word in enumerate(self._resolve(rng, op)):
                out[i, j] = word - (word >> 63 << 64)  # the same 64 bits, as int64

    def _resolve(self, rng, op):
        """Pointers other than the stand-in's generator words point into a dropout state tensor
        (``_backend.rng_in``); read the words there, as the kernels do."""
        _, offset, seed_ptr, offset_ptr = rng
        if seed_ptr in (0, self.SEED_WORD, self.OFFSET_WORD):
            return super()._resolve(rng, op)
        seed, base = (ctypes.c_uint64.from_address(ptr).value for ptr in (seed_ptr, offset_ptr))
        return seed, (base + offset) & ((1 << 64) - 1)

    def _attention(self, q, k, v, key_padding_mask, causal, p, scale, rng, op):
        """(out, lse) in fp32 for [b, h, len, d] operands, dropout over the flat [b, h, lq, lk] index."""
        s = q.float() @ k.float().transpose(-1, -2) * scale
        probs = _masked_softmax(s, key_padding_mask, causal)
        lse = torch.where(probs > 0, s, float("-inf")).logsumexp(-1)
        return self._dropout(probs, p, rng, op) @ v.float(), lse

    def _check_keep(self, keep, q, k, op):
        """The keep-bits buffer's contract. The stand-in writes no bits: its backward draws the mask from rng
        again, which gives what reading the forward's bits gives."""
        if keep is not None:
            numel = keep_numel(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            _check(keep.dtype == torch.int32 and keep.shape == (numel,), op,
                   f"keep must be a contiguous int32 [{numel}] tensor")

    @_binding
    def attention_fwd(self, q, k, v, key_padding_mask, causal, p, scale, rng, keep=None):
        """(out [b, h, lq, d] as a view of a contiguous [b, lq, h, d] buffer, lse float32 [b, h, lq])."""
        op = "attention_fwd"
        for t, name in ((q, "q"), (k, "k"), (v, "v")):
            _check(t.dtype in (torch.float16, torch.bfloat16), op,
                   f"{name} must be float16 or bfloat16, got {t.dtype}")
        self._check_rng(rng, op)
        self._check_keep(keep, q, k, op)
        out, lse = self._attention(q, k, v, key_padding_mask, causal, p, scale, rng, op)
        buffer = torch.empty(out.shape[0], out.shape[2], out.shape[1], out.shape[3], dtype=q.dtype)
        buffer.transpose(1, 2).copy_(out)
        return buffer.transpose(1, 2), lse

    @_binding
    def attention_bwd(self, dout, q, k, v, out, lse, key_padding_mask, causal, p, scale, rng, dq=None, dk=None,
                      dv=None, keep=None):
        """(dq, dk, dv), fresh and contiguous: the fp32 forward differentiated with the same mask."""
        op = "attention_bwd"
        self._check_rng(rng, op)
        self._check_keep(keep, q, k, op)
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            o, _ = self._attention(*leaves, key_padding_mask, causal, p, scale, rng, op)
            grads = torch.autograd.grad(o, leaves, dout.float())
        return tuple(g.to(q.dtype).contiguous() for g in grads)

    @_binding
    def cross_entropy_fwd(self, logits, target, label_smoothing, ignore_index):
        """(loss_rows, nll_rows, lse), float32 [rows]; 0 for ignored rows."""
        x = logits.float()
        lse = x.logsumexp(-1)
        ignored = target == ignore_index
        nll = lse - x.gather(1, torch.where(ignored, 0, target)[:, None])[:, 0]
        loss = (1 - label_smoothing) * nll + label_smoothing * (lse - x.mean(-1))
        return torch.where(ignored, 0.0, loss), torch.where(ignored, 0.0, nll), lse

    @_binding
    def cross_entropy_bwd(self, grad_rows, logits, target, lse, label_smoothing, ignore_index, inplace):
        """grad_rows · (softmax − smoothed one-hot), zero rows for ignored targets; into logits when inplace."""
        x = logits.float()
        ignored = target == ignore_index
        onehot = F.one_hot(torch.where(ignored, 0, target), x.shape[1]).float()
        grad = grad_rows[:, None] * ((x - lse[:, None]).exp() - (1 - label_smoothing) * onehot
                                     - label_smoothing / x.shape[1])
        grad = torch.where(ignored[:, None], 0.0, grad)
        return logits.copy_(grad) if inplace else grad.to(logits.dtype)


def _in_worker_thread(impl):
    """impl as a CPU kernel that runs in a worker thread, without grad mode. The stand-in differentiates
    with autograd inside some bindings, and a kernel runs with autograd's dispatch keys excluded, a
    thread-local setting that a fresh thread does not inherit."""
    def kernel(*args):
        def run():
            with torch.no_grad():
                return impl(*args)

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(run).result()

    return kernel


_cpu_kernels_registered = False


@pytest.fixture
def kernels_on_cpu(fake_kernels, monkeypatch):
    """The kernel path on CPU: fake_kernels' routing with the extended stand-in, and the custom operators'
    own implementations registered for CPU tensors too (they call ``_backend.ext()``, the stand-in)."""
    global _cpu_kernels_registered
    if not _cpu_kernels_registered:
        for op in CUSTOM_OPS:
            op.register_kernel("cpu", _in_worker_thread(op._init_fn))  # _init_fn: the function it was made from
        _cpu_kernels_registered = True
    fake = CompileFakeExt()
    monkeypatch.setattr("lsmini._backend.ext", lambda: fake)
    return fake


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_custom_ops_on_the_stand_in_match_the_autograd_functions(p, kernels_on_cpu):
    """Compiled, the chain runs the custom operators (the dropout state goes through philox_state_fwd);
    eagerly, the autograd Functions. Same bindings, same draws: the same bits, forward and backward."""
    fake = kernels_on_cpu
    inputs, grad_rows = chain_inputs("cpu", torch.bfloat16)
    eager_out, eager_grads = run_chain(chain, inputs, grad_rows, p)
    assert "philox_state_fwd" not in {name for name, _ in fake.calls}
    fake.offset, fake.calls = 0, []
    out, grads = run_chain(torch.compile(chain, fullgraph=True, backend="aot_eager"), inputs, grad_rows, p)
    called = [name for name, _ in fake.calls]
    assert called.count("philox_state_fwd") == 5 and "attention_bwd" in called and "embedding_bwd" in called
    assert_all_equal(out, eager_out, "output")
    assert_all_equal(grads, eager_grads, "gradient of")


# Sizes of op_samples: odd ones, and a single row / more queries than keys (causal rows that see no key).
SAMPLE_SIZES = [dict(rows=7, hidden=24, batch=3, heads=2, q_len=5, k_len=11, head_dim=16, vocab=37),
                dict(rows=1, hidden=130, batch=2, heads=3, q_len=17, k_len=9, head_dim=64, vocab=1001)]


def op_samples(device, dtype, p, rows, hidden, batch, heads, q_len, k_len, head_dim, vocab):
    """[(operator, args)] covering every custom operator; the backward ones get the state, saved tensors
    and gradients of a forward call on the same samples."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    samples = []
    x, w, b = rand(rows, hidden), rand(hidden, dt=torch.float32), rand(hidden, dt=torch.float32)
    y, mean, rstd = layer_norm_op(x, w, b, 1e-5)
    samples += [(layer_norm_op, (x, w, b, 1e-5)), (layer_norm_op, (x, None, None, 1e-5)),
                (layer_norm_backward_op, (rand(rows, hidden), x, w, b, mean, rstd)),
                (layer_norm_backward_op, (rand(rows, hidden), x, None, b, mean, rstd))]
    width = heads * head_dim
    qkv = rand(batch, q_len, 3 * width)
    samples += [(split_heads_op, (qkv, rand(3 * width), heads, 3)), (split_heads_op, (qkv, None, 3 * heads, 1)),
                (split_heads_backward_op, (rand(3, batch, heads, q_len, head_dim), True, False)),
                (split_heads_backward_op, (rand(3, batch, heads, q_len, head_dim), True, True)),
                (merge_heads_op, (rand(batch, heads, q_len, head_dim),)),
                (merge_heads_op, (rand(batch, q_len, heads, head_dim).transpose(1, 2),)),
                (merge_heads_backward_op, (rand(batch, q_len, width), heads))]
    mask = torch.zeros(batch, k_len, dtype=torch.bool, device=device)
    mask[-1, k_len // 2:] = True
    scores = rand(batch, heads, q_len, k_len)
    probs, softmax, state = attention_softmax_op(scores, mask, True, p)
    samples += [(attention_softmax_op, (scores, mask, True, p)), (attention_softmax_op, (scores, None, False, p)),
                (attention_softmax_backward_op, (rand(batch, heads, q_len, k_len), softmax if p > 0 else probs,
                                                 state, p))]
    if dtype != torch.float32:
        q = rand(batch, heads, q_len, head_dim)
        k, v = rand(batch, heads, k_len, head_dim), rand(batch, heads, k_len, head_dim)
        out, lse, state, bits = attention_op(q, k, v, mask, False, p, 0.25)
        assert (bits.numel() > 0) == (p > 0) and bits.dtype == torch.int32
        samples += [(attention_op, (q, k, v, mask, False, p, 0.25)), (attention_op, (q, k, v, None, True, p, 0.3)),
                    (attention_backward_op, (rand(batch, heads, q_len, head_dim), q, k, v, out, lse, mask, state,
                                             bits, False, p, 0.25))]
    logits, target = rand(rows, vocab), torch.randint(0, vocab, (rows,), generator=g).to(device)
    target[rows // 2] = -100
    loss, nll, lse = cross_entropy_op(logits, target, 0.1, -100)
    samples += [(cross_entropy_op, (logits, target, 0.1, -100)),
                (cross_entropy_backward_op, (rand(rows, dt=torch.float32), logits, target, lse, 0.1, -100))]
    tokens = torch.randint(0, vocab, (batch, q_len), generator=g).to(device)
    weight, pos = rand(vocab, hidden), rand(q_len + 4, hidden)
    out, state = embedding_op(tokens, weight, pos, 2.0, 0, 3, p)
    samples += [(embedding_op, (tokens, weight, pos, 2.0, 0, 3, p)),
                (embedding_backward_op, (rand(batch, q_len, hidden), tokens, state, vocab, q_len + 4, True, True, 2.0,
                                         0, 3, p)),
                (embedding_backward_op, (rand(batch, q_len, hidden), tokens, state, vocab, q_len + 4, True, False,
                                         2.0, -1, 3, p))]
    x, res, bias = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    out, state = bias_dropout_residual_op(x, bias, res, p)
    samples += [(bias_dropout_residual_op, (x, bias, res, p)), (bias_dropout_residual_op, (x, None, res, p)),
                (bias_dropout_residual_backward_op, (rand(rows, hidden), state, p, torch.float32)),
                (bias_dropout_residual_backward_op, (rand(rows, hidden), state, p, dtype))]
    if p > 0:
        samples.append((bias_dropout_residual_backward_op, (rand(rows, hidden), state, p, None)))
    out, state = bias_act_dropout_op(x, bias, "gelu_tanh", p)
    samples += [(bias_act_dropout_op, (x, bias, "gelu_tanh", p)), (bias_act_dropout_op, (x, None, "relu", p)),
                (bias_act_dropout_backward_op, (rand(rows, hidden), x, bias, state, "gelu_tanh", p)),
                (bias_act_dropout_backward_op, (rand(rows, hidden), x, None, state, "gelu_tanh", p))]
    return samples


def _with_grad(op, args):
    """A forward operator's floating inputs require grad, so opcheck checks its autograd registration."""
    if op in BACKWARD_OPS:
        return args
    return tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


@pytest.mark.parametrize("p", [0.0, 0.25])
def test_opcheck_on_the_stand_in(p, kernels_on_cpu):
    """Schemas, fake implementations (shapes, dtypes, strides against the stand-in's, which follow the
    bindings'), autograd registration and, without dropout, eager against AOT-compiled with dynamic
    shapes. With dropout that comparison needs draws that follow torch.manual_seed, as the kernels' do
    and the stand-in's do not: the CUDA test makes it."""
    samples = op_samples("cpu", torch.bfloat16, p, **SAMPLE_SIZES[0])
    assert {op for op, _ in samples} == set(CUSTOM_OPS)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    if p == 0:
        utils += ("test_aot_dispatch_dynamic",)
    for op, args in samples:
        torch.library.opcheck(op, _with_grad(op, args), test_utils=utils)


# ---- kernel path on CUDA ----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("sizes", range(len(SAMPLE_SIZES)))
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_opcheck_custom_ops(dtype, p, sizes):
    """Every test of opcheck on every operator; its compiled-vs-eager comparisons reseed torch before each
    call, so dropout draws the same masks and the outputs must agree exactly. The attention operators
    take float16/bfloat16 only and are left out for float32."""
    for op, args in op_samples("cuda", dtype, p, **SAMPLE_SIZES[sizes]):
        torch.library.opcheck(op, _with_grad(op, args))


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_kernel_path_matches_eager(dtype, p):
    """The compiled chain runs the kernels the eager one runs, with the same draws (torch.manual_seed
    before each; the chain fixes their order): the same bits, except the mean loss, whose sum over the rows
    the compiler generates itself (fp32 rounding)."""
    inputs, grad_rows = chain_inputs("cuda", dtype)
    torch.manual_seed(0)
    eager_out, eager_grads = run_chain(chain, inputs, grad_rows, p)
    torch.manual_seed(0)
    out, grads = run_chain(torch.compile(chain, fullgraph=True), inputs, grad_rows, p)
    assert_close_fp32(out.pop("loss"), eager_out.pop("loss"), atol=1e-6, rtol=1e-5, name="loss")
    assert_all_equal(out, eager_out, "output")
    assert_all_equal(grads, eager_grads, "gradient of")


@pytest.mark.cuda
def test_reduce_overhead_replays_draw_fresh_masks_and_backward_reuses_them():
    """Under CUDA graphs every replay draws new masks (the state is resolved on the device), and each
    backward regenerates its own forward's mask: with v the identity, attention's output IS its dropped
    probabilities P, so grad_v must be Pᵀ·dout; with x + bias > 0, bias_act_dropout's (relu) grad_x is
    dout/(1 − p) exactly where the output was kept and 0 elsewhere."""
    p, d = 0.3, 16
    scale = 1 / (1 - p)

    def fn(q, k, v, x, bias):
        return attention(q, k, v, None, False, p), bias_act_dropout(x, bias, "relu", p)

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 8, d, generator=g).cuda().half()
    k = torch.randn(2, 2, d, d, generator=g).cuda().half()
    v = torch.eye(d).expand(2, 2, d, d).cuda().half()
    x = (torch.rand(64, 128, generator=g) + 0.5).cuda().half()
    bias = (torch.rand(128, generator=g) + 0.5).cuda().half()
    dout = torch.randn(2, 2, 8, d, generator=g).cuda().half()
    dh = torch.randn(64, 128, generator=g).cuda().half()
    outs = []
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, x, bias)]
        a, h = compiled(*leaves)
        torch.autograd.backward([a, h], [dout, dh])
        a, h = a.detach().clone(), h.detach().clone()
        grad_q, grad_k, grad_v, grad_x = (t.grad for t in leaves[:4])
        assert all(torch.isfinite(t).all() for t in (grad_q, grad_k, grad_v, grad_x))
        expected_v = a.float().transpose(-1, -2) @ dout.float()
        torch.testing.assert_close(grad_v.float(), expected_v, atol=2e-2, rtol=1e-2)
        kept = h != 0
        assert 0.6 < kept.float().mean().item() < 0.8
        torch.testing.assert_close(grad_x, torch.where(kept, (dh.float() * scale).half(), 0.0), atol=1e-3, rtol=1e-3)
        assert torch.equal(grad_x != 0, kept & (dh != 0))
        outs.append((a, h))
    for (a0, h0), (a1, h1) in zip(outs, outs[1:]):
        assert not torch.equal(a0, a1) and not torch.equal(h0, h1)
