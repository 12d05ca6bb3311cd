"""lsmini.ops under torch.compile(fullgraph=True), and the registered operators' contracts.

Every public op calls its registered operator ``torch.ops.lsmini.<op>`` (CPU: the reference; CUDA: the
kernels) in eager and compiled code alike.
- CPU (CI): one function chaining the nine ops of the original Transformer and one chaining the ops of a
  Llama-style block (rms_norm, add_rms_norm, swiglu, geglu), each compiled with aot_eager and with inductor,
  against eager; dropout statistics under compile; bad input still names the problem;
  ``torch.library.opcheck`` of every operator (schema, fake implementation, autograd registration, eager
  against AOT-compiled with dynamic shapes, which reseeds torch before each call, so dropout draws the same
  masks).
- CUDA: opcheck of every operator, the compiled chains against eager bit for bit, and CUDA-graph
  (reduce-overhead) functions whose replays draw fresh masks that their backward reuses.
"""
import importlib
import os
import pkgutil
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import lsmini.ops
from lsmini.ops import (add_rms_norm, attention, attention_softmax, bias_act_dropout, bias_dropout_residual,
                        cross_entropy, embedding, geglu, layer_norm, merge_heads, rms_norm, rotary, split_heads,
                        swiglu)
from lsmini.ops.library import Operator
from util import assert_close_fp32, assert_dropout_keep_stats

OPS = torch.ops.lsmini

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


# ---- CPU: the operators' CPU implementations, eager and compiled ------------------------------------------
def test_chain_traces_to_one_graph_of_the_registered_operators():
    """Each public op calls its operator while torch.compile traces it: one graph holding every forward
    operator, none of the references' decomposed math."""
    called = set()

    def backend(gm, example_inputs):
        called.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    inputs, _ = chain_inputs("cpu", torch.bfloat16)
    torch.compile(chain, fullgraph=True, backend=backend)(*inputs.values(), 0.25)
    lsmini_ops = {name.split(".")[1] for name in called if name.startswith("lsmini.")}
    assert lsmini_ops == {"embedding", "layer_norm", "split_heads", "attention", "merge_heads", "attention_softmax",
                          "bias_dropout_residual", "bias_act_dropout", "cross_entropy"}
    assert not any("softmax" in name or "dropout" in name for name in called if not name.startswith("lsmini."))


@pytest.mark.parametrize("backend, dtype, p", [("aot_eager", torch.float32, 0.0), ("inductor", torch.float32, 0.0),
                                               ("aot_eager", torch.bfloat16, 0.25),
                                               ("inductor", torch.bfloat16, 0.25)])
def test_chain_compiles_whole_and_matches_eager(backend, dtype, p):
    """Compiled, the chain runs the operators the eager one runs, with the same draws (torch.manual_seed
    before each; the chain fixes their order): the operators' outputs bit for bit; the compiler composes
    (and, with inductor, fuses) the math between them differently, so the loss and the gradients that sum
    more than one use to a tolerance. (float32: attention runs its reference, which has no float32 operator.)"""
    inputs, grad_rows = chain_inputs("cpu", dtype)
    torch.manual_seed(0)
    eager_out, eager_grads = run_chain(chain, inputs, grad_rows, p)
    torch.manual_seed(0)
    out, grads = run_chain(torch.compile(chain, fullgraph=True, backend=backend), inputs, grad_rows, p)
    assert_close_fp32(out.pop("loss"), eager_out.pop("loss"), atol=1e-6, rtol=1e-5, name="loss")
    if dtype == torch.bfloat16:
        assert_all_equal(out, eager_out, "output")
    for name in eager_out:
        assert_close_fp32(out[name], eager_out[name], atol=1e-5, rtol=1e-4, name=name)
    for name in eager_grads:
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # one bfloat16 rounding of a sum apart
        assert_close_fp32(grads[name].float(), eager_grads[name].float(), atol=tol, rtol=tol, name=f"grad {name}")


# ---- one function that chains the ops of a Llama-style block ---------------------------------------------
# As in ``chain``: each dropout op's input depends on the previous one's output (one order of draws), and each
# intermediate is used once (gradients are not sums of several uses).
def llama_chain(x, res, norm_w, up, res2, final_w, p):
    s, y = add_rms_norm(x, res, norm_w)
    h = swiglu(y, s, p)
    g = geglu(torch.cat([h, up], -1), None, p)  # the fused form: [gate | up] in one tensor
    s2, z = add_rms_norm(g, res2, None, 1e-5)
    out = rms_norm(z, final_w)
    return {"swiglu": h, "geglu": g, "add_rms_norm": s2, "rms_norm": out}


def llama_inputs(device, dtype, seed=0):
    """({name: input of ``llama_chain``}, the gradients of its two outputs that are not used again)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, dt=dtype):
        return (scale * torch.randn(*shape, generator=g)).to(device, dt)

    inputs = {"x": rand(B, L, HIDDEN), "res": rand(B, L, HIDDEN), "norm_w": 1 + rand(HIDDEN, scale=0.2, dt=torch.float32),
              "up": rand(B, L, HIDDEN), "res2": rand(B, L, HIDDEN), "final_w": 1 + rand(HIDDEN, scale=0.2)}
    return inputs, (rand(B, L, HIDDEN), rand(B, L, HIDDEN))


def run_llama_chain(fn, inputs, grads, p):
    """fn's outputs (detached) and the gradients of every input, from one backward with grads on the two outputs
    that are not used again (add_rms_norm's s and rms_norm's y)."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    out = fn(*leaves.values(), p)
    torch.autograd.backward([out["add_rms_norm"], out["rms_norm"]], list(grads))
    return {n: t.detach() for n, t in out.items()}, {n: t.grad for n, t in leaves.items()}


def test_llama_chain_traces_to_one_graph_of_the_registered_operators():
    called = set()

    def backend(gm, example_inputs):
        called.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    inputs, _ = llama_inputs("cpu", torch.bfloat16)
    torch.compile(llama_chain, fullgraph=True, backend=backend)(*inputs.values(), 0.25)
    assert {name.split(".")[1] for name in called if name.startswith("lsmini.")} == {"add_rms_norm", "glu", "rms_norm"}
    assert not any(word in name for name in called if not name.startswith("lsmini.")
                   for word in ("silu", "gelu", "rsqrt", "dropout"))


@pytest.mark.parametrize("backend, dtype, p", [("aot_eager", torch.float32, 0.0), ("inductor", torch.float32, 0.0),
                                               ("aot_eager", torch.bfloat16, 0.25),
                                               ("inductor", torch.bfloat16, 0.25)])
def test_llama_chain_compiles_whole_and_matches_eager(backend, dtype, p):
    """Compiled, the Llama-style chain runs the operators the eager one runs, with the same draws: the operators'
    outputs bit for bit, the gradients to a tolerance (the compiler composes the concatenation's backward)."""
    inputs, grads = llama_inputs("cpu", dtype)
    torch.manual_seed(0)
    eager_out, eager_grads = run_llama_chain(llama_chain, inputs, grads, p)
    torch.manual_seed(0)
    out, out_grads = run_llama_chain(torch.compile(llama_chain, fullgraph=True, backend=backend), inputs, grads, p)
    assert_all_equal(out, eager_out, "output")
    for name in eager_grads:
        assert_close_fp32(out_grads[name].float(), eager_grads[name].float(), atol=1e-6, rtol=1e-6,
                          name=f"grad {name}")


def test_glu_dropout_under_compile_keeps_one_minus_p_and_its_gradient_uses_the_same_mask():
    p, n = 0.3, 64
    gate = torch.full((n, n), 20.0, requires_grad=True)  # silu(20)·up, gelu(20)·up: up, in float32
    up = torch.ones(n, n, requires_grad=True)
    compiled = torch.compile(lambda g, u: (swiglu(g, u, p), geglu(torch.cat([g, u], -1), None, p)), fullgraph=True,
                             backend="aot_eager")
    outs = compiled(gate, up)
    for name, out in zip(("swiglu", "geglu"), outs):
        kept = out != 0
        torch.testing.assert_close(out[kept], torch.full_like(out[kept], 20 / (1 - p)))
        assert_dropout_keep_stats(kept, p, name=name)
    assert not torch.equal(outs[0] != 0, outs[1] != 0), "two calls, two masks"
    outs[0].sum().backward()
    assert torch.equal(up.grad != 0, outs[0] != 0)


def dropout_ops(x, ones, zeros, tokens, p):
    """Each dropout op on inputs whose kept values are all the same number, so its output shows its mask."""
    hidden = x.shape[-1]
    return {"bias_dropout_residual": bias_dropout_residual(x, None, zeros[0], p),
            "bias_act_dropout": bias_act_dropout(x, None, "relu", p),
            "embedding": embedding(tokens, x.reshape(-1, hidden), zeros[0], scale=1.0, dropout_p=p),
            "attention_softmax": attention_softmax(zeros.view(-1, 1, hidden, hidden), None, False, p) * hidden,
            "attention": attention(zeros[:, None].to(ones.dtype), zeros[:, None].to(ones.dtype), ones[:, None], None,
                                   False, p)}


def test_dropout_under_compile_keeps_one_minus_p_and_its_gradient_uses_the_same_mask():
    p, n = 0.3, 64
    x = torch.ones(n, n, requires_grad=True)
    tokens = torch.arange(n * n).view(n, n) % n
    compiled = torch.compile(dropout_ops, fullgraph=True, backend="aot_eager")
    # bfloat16 for attention, whose operator takes float16/bfloat16
    out = compiled(x, torch.ones(n, n, n, dtype=torch.bfloat16), torch.zeros(n, n, n), tokens, p)
    for name in ("bias_dropout_residual", "bias_act_dropout", "embedding", "attention_softmax"):
        kept = out[name] != 0
        torch.testing.assert_close(out[name][kept], torch.full_like(out[name][kept], 1 / (1 - p)))
        assert_dropout_keep_stats(kept.reshape(-1, n), p, name=name)
    # attention: each output row averages n values of 1/(1 − p)·keep over n keys
    assert out["attention"].shape == (n, 1, n, n)
    assert abs(out["attention"].float().mean().item() - 1.0) < 0.05
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
    "rms_norm": (lambda x: rms_norm(x, torch.ones(7)), ValueError, "rms_norm: weight must have shape (8,)"),
    "add_rms_norm": (lambda x: add_rms_norm(x, x.t()), ValueError, "add_rms_norm: residual must have x's shape"),
    "swiglu": (lambda x: swiglu(x[:, :7]), ValueError, "swiglu: without up, gate holds [gate | up]"),
    "geglu": (lambda x: geglu(x, x[:2]), ValueError, "geglu: up must have gate's shape (3, 8), got (2, 8)"),
    "rotary": (lambda x: rotary(x[None, None], x[None, None], x[:, :5], x[:, :5]), ValueError,
               "rotary: rot_dim (the last dimension of cos and sin) must be even, got 5"),
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


# ---- every operator: opcheck ----------------------------------------------------------------------------
# Sizes of the samples: odd ones, and a single row / more queries than keys (causal rows that see no key).
SAMPLE_SIZES = [dict(rows=7, hidden=24, batch=3, heads=2, q_len=5, k_len=11, head_dim=16, vocab=37),
                dict(rows=1, hidden=130, batch=2, heads=3, q_len=17, k_len=9, head_dim=64, vocab=1001)]


def _layer_norm_samples(rand, device, dtype, p, rows, hidden, **_):
    x, w, b = rand(rows, hidden), rand(hidden, dt=torch.float32), rand(hidden, dt=torch.float32)
    y, mean, rstd = OPS.layer_norm(x, w, b, 1e-5)
    return [(OPS.layer_norm, (x, w, b, 1e-5)), (OPS.layer_norm, (x, None, None, 1e-5)),
            (OPS.layer_norm_backward, (rand(rows, hidden), x, w, b, mean, rstd, 1e-5)),
            (OPS.layer_norm_backward, (rand(rows, hidden), x, None, b, mean, rstd, 1e-5))]


def _heads_samples(rand, device, dtype, p, batch, heads, q_len, head_dim, **_):
    width = heads * head_dim
    qkv = rand(batch, q_len, 3 * width)
    return [(OPS.split_heads, (qkv, rand(3 * width), heads, 3)), (OPS.split_heads, (qkv, None, 3 * heads, 1)),
            (OPS.split_heads_backward, (rand(3, batch, heads, q_len, head_dim), True, False)),
            (OPS.split_heads_backward, (rand(3, batch, heads, q_len, head_dim), True, True)),
            (OPS.merge_heads, (rand(batch, heads, q_len, head_dim),)),
            (OPS.merge_heads, (rand(batch, q_len, heads, head_dim).transpose(1, 2),)),
            (OPS.merge_heads_backward, (rand(batch, q_len, width), heads))]


def _padding_mask(device, batch, k_len):
    mask = torch.zeros(batch, k_len, dtype=torch.bool, device=device)
    mask[-1, k_len // 2:] = True
    return mask


def _attention_softmax_samples(rand, device, dtype, p, batch, heads, q_len, k_len, **_):
    mask = _padding_mask(device, batch, k_len)
    scores = rand(batch, heads, q_len, k_len)
    probs, softmax, state = OPS.attention_softmax(scores, mask, True, p)
    return [(OPS.attention_softmax, (scores, mask, True, p)), (OPS.attention_softmax, (scores, None, False, p)),
            (OPS.attention_softmax_backward, (rand(batch, heads, q_len, k_len), softmax if p > 0 else probs, state,
                                             p))]


def _attention_samples(rand, device, dtype, p, batch, heads, q_len, k_len, head_dim, **_):
    if dtype == torch.float32:  # the fused attention kernel takes float16/bfloat16 only
        return []
    mask = _padding_mask(device, batch, k_len)
    q = rand(batch, heads, q_len, head_dim)
    k, v = rand(batch, heads, k_len, head_dim), rand(batch, heads, k_len, head_dim)
    out, lse, state, bits = OPS.attention(q, k, v, mask, False, p, 0.25)
    assert bits.dtype == torch.int32
    return [(OPS.attention, (q, k, v, mask, False, p, 0.25)), (OPS.attention, (q, k, v, None, True, p, 0.3)),
            (OPS.attention_backward, (rand(batch, heads, q_len, head_dim), q, k, v, out, lse, mask, state, bits, False,
                                     p, 0.25))]


def _cross_entropy_samples(rand, device, dtype, p, rows, vocab, **_):
    logits = rand(rows, vocab)
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1)).to(device)
    target[rows // 2] = -100
    loss, nll, lse = OPS.cross_entropy(logits, target, 0.1, -100, False)
    grad_rows = rand(rows, dt=torch.float32)
    return [(OPS.cross_entropy, (logits, target, 0.1, -100, False)),
            (OPS.cross_entropy, (logits, target, 0.0, -100, True)),
            (OPS.cross_entropy_backward, (grad_rows, logits, target, lse, 0.1, -100)),
            (OPS.cross_entropy_backward_, (grad_rows, logits.clone(), target, lse, 0.1, -100))]


def _linear_cross_entropy_samples(rand, device, dtype, p, rows, hidden, vocab, **_):
    x, weight = rand(rows, hidden), rand(vocab, hidden)
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(3)).to(device)
    target[0] = -100
    return [(OPS.linear_cross_entropy, (x, weight, target, 0.1, -100, 3, True))]


def _embedding_samples(rand, device, dtype, p, batch, q_len, hidden, vocab, **_):
    tokens = torch.randint(0, vocab, (batch, q_len), generator=torch.Generator().manual_seed(2)).to(device)
    weight, pos = rand(vocab, hidden), rand(q_len + 4, hidden)
    out, state = OPS.embedding(tokens, weight, pos, 2.0, 0, 3, p)
    return [(OPS.embedding, (tokens, weight, pos, 2.0, 0, 3, p)),
            (OPS.embedding_backward, (rand(batch, q_len, hidden), tokens, state, vocab, q_len + 4, True, True, 2.0, 0,
                                     3, p, None)),
            (OPS.embedding_backward, (rand(batch, q_len, hidden), tokens, state, vocab, q_len + 4, True, False, 2.0,
                                     -1, 3, p, None)),
            (OPS.embedding_backward, (rand(batch, q_len, hidden), tokens, state, vocab, q_len + 4, True, True, 2.0, 0,
                                     3, p, rand(vocab, hidden)))]


def _bias_dropout_residual_samples(rand, device, dtype, p, rows, hidden, **_):
    x, res, bias = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    out, state = OPS.bias_dropout_residual(x, bias, res, p)
    samples = [(OPS.bias_dropout_residual, (x, bias, res, p)), (OPS.bias_dropout_residual, (x, None, res, p)),
               (OPS.bias_dropout_residual_backward, (rand(rows, hidden), state, p, torch.float32)),
               (OPS.bias_dropout_residual_backward, (rand(rows, hidden), state, p, dtype))]
    if p > 0:
        samples.append((OPS.bias_dropout_residual_backward, (rand(rows, hidden), state, p, None)))
    return samples


def _bias_act_dropout_samples(rand, device, dtype, p, rows, hidden, **_):
    x, bias = rand(rows, hidden), rand(hidden)
    out, state = OPS.bias_act_dropout(x, bias, "gelu_tanh", p)
    return [(OPS.bias_act_dropout, (x, bias, "gelu_tanh", p)), (OPS.bias_act_dropout, (x, None, "relu", p)),
            (OPS.bias_act_dropout_backward, (rand(rows, hidden), x, bias, state, "gelu_tanh", p)),
            (OPS.bias_act_dropout_backward, (rand(rows, hidden), x, None, state, "gelu_tanh", p))]


def _rms_norm_samples(rand, device, dtype, p, rows, hidden, **_):
    x, res, w = rand(rows, hidden), rand(rows, hidden), rand(hidden, dt=torch.float32)
    _, rstd = OPS.rms_norm(x, w, 1e-6)
    s, _, s_rstd = OPS.add_rms_norm(x, res, None, 1e-5)
    return [(OPS.rms_norm, (x, w, 1e-6)), (OPS.rms_norm, (x, None, 1e-5)),
            (OPS.add_rms_norm, (x, res, w, 1e-6)), (OPS.add_rms_norm, (x, res, None, 1e-5)),
            (OPS.rms_norm_backward, (rand(rows, hidden), x, w, rstd, None, 1e-6)),
            (OPS.rms_norm_backward, (rand(rows, hidden), s, None, s_rstd, rand(rows, hidden), 1e-5))]


def _glu_samples(rand, device, dtype, p, rows, hidden, **_):
    gate, up, gate_up = rand(rows, hidden), rand(rows, hidden), rand(rows, 2 * hidden)
    _, state = OPS.glu(gate, up, "silu", p)
    _, fused_state = OPS.glu(gate_up, None, "gelu", p)
    return [(OPS.glu, (gate, up, "silu", p)), (OPS.glu, (gate_up, None, "gelu_tanh", p)),
            (OPS.glu_backward, (rand(rows, hidden), gate, up, state, "silu", p)),
            (OPS.glu_backward, (rand(rows, hidden), gate_up, None, fused_state, "gelu", p))]


def _rotary_samples(rand, device, dtype, p, batch, heads, q_len, head_dim, **_):
    q, k = rand(batch, heads, q_len, head_dim), rand(batch, 1, q_len, head_dim)
    q_bshd = rand(batch, q_len, heads, head_dim).transpose(1, 2)  # [batch, seq, heads, head_dim] memory
    cos, sin = rand(1, q_len, head_dim, dt=torch.float32), rand(1, q_len, head_dim, dt=torch.float32)
    half_cos, half_sin = rand(batch, q_len, head_dim // 2), rand(batch, q_len, head_dim // 2)
    return [(OPS.rotary, (q, k, cos, sin, False)), (OPS.rotary, (q_bshd, k, half_cos, half_sin, True)),
            (OPS.rotary_backward, (rand(batch, heads, q_len, head_dim), rand(batch, 1, q_len, head_dim), cos, sin,
                                   False)),
            (OPS.rotary_backward, (q_bshd, k, half_cos, half_sin, True))]


# op family -> its samples
SAMPLES = {"layer_norm": _layer_norm_samples, "heads": _heads_samples,
           "attention_softmax": _attention_softmax_samples, "attention": _attention_samples,
           "cross_entropy": _cross_entropy_samples, "linear_cross_entropy": _linear_cross_entropy_samples,
           "embedding": _embedding_samples,
           "bias_dropout_residual": _bias_dropout_residual_samples, "bias_act_dropout": _bias_act_dropout_samples,
           "rms_norm": _rms_norm_samples, "glu": _glu_samples, "rotary": _rotary_samples}


def op_samples(device, dtype, p, sizes):
    """[(operator, args)] covering every operator; a backward operator gets the state, saved tensors and
    gradients of a forward call on the same samples."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    return [sample for samples in SAMPLES.values() for sample in samples(rand, device, dtype, p, **sizes)]


def registered_operators():
    """The names of every operator that a module of lsmini.ops registers."""
    names = set()
    for module in pkgutil.iter_modules(lsmini.ops.__path__):
        for value in vars(importlib.import_module(f"lsmini.ops.{module.name}")).values():
            if isinstance(value, Operator):
                names.add(value.name)
    return names


def test_samples_cover_every_registered_operator():
    for dtype in (torch.bfloat16, torch.float32):
        sampled = {op.__name__ for op, _ in op_samples("cpu", dtype, 0.25, SAMPLE_SIZES[0])}
        attention_ops = {"attention", "attention_backward"}
        assert sampled == (registered_operators() - (attention_ops if dtype == torch.float32 else set()))


def _with_grad(op, args):
    """A forward operator's floating inputs require grad, so opcheck checks its autograd registration."""
    if "_backward" in op.__name__:
        return args
    return tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                 for a in args)


@pytest.mark.parametrize("sizes", range(len(SAMPLE_SIZES)))
@pytest.mark.parametrize("p", [0.0, 0.25])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_on_cpu(dtype, p, sizes):
    """Every test of opcheck on every operator's CPU implementation (the attention operators take
    float16/bfloat16 only and are left out for float32)."""
    for op, args in op_samples("cpu", dtype, p, SAMPLE_SIZES[sizes]):
        torch.library.opcheck(op, _with_grad(op, args))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
def test_calling_the_operators_does_not_import_dynamo(device):
    """A training step through the operators, forward and backward, leaves torch._dynamo unimported
    (seconds of start-up in a run that never compiles): they are registered without custom_op's
    dynamo-disabling wrapper."""
    code = f"""
import sys, torch
from lsmini.ops import bias_dropout_residual, cross_entropy, layer_norm
x = torch.randn(8, 16, device="{device}", requires_grad=True)
y = bias_dropout_residual(layer_norm(x), None, x, 0.1)
cross_entropy(y, torch.randint(0, 16, (8,), device="{device}"), 0.1, inplace_backward=True).backward()
assert x.grad is not None
print("torch._dynamo" in sys.modules)
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("device", DEVICES)
def test_a_backward_operator_refuses_a_second_backward(device):
    """create_graph=True through an op whose backward is an operator: the second backward reaches the
    backward operator, which says it is not differentiable (instead of a silently wrong gradient)."""
    x = torch.randn(4, 8, device=device, requires_grad=True)
    (gx,) = torch.autograd.grad(layer_norm(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="lsmini::layer_norm_backward is not differentiable"):
        gx.square().sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward_bumps_the_logits_version(device):
    """cross_entropy(inplace_backward=True) overwrites the logits in its backward: another backward that
    saved them fails autograd's version check instead of using the overwritten values."""
    w = torch.randn(8, 16, device=device, requires_grad=True)
    logits = torch.randn(4, 8, device=device) @ w
    target = torch.randint(0, 16, (4,), device=device)
    # square saves the logits; created first, its backward runs after the cross entropy's
    loss = logits.square().sum() + cross_entropy(logits, target, inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        torch.autograd.grad(cross_entropy(torch.randn(4, 8, device=device) @ w, target, inplace_backward=True),
                            w, create_graph=True)


# ---- kernel path on CUDA ----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("sizes", range(len(SAMPLE_SIZES)))
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_opcheck_on_cuda(dtype, p, sizes):
    """Every test of opcheck on every operator's CUDA implementation (the attention operators take
    float16/bfloat16 only and are left out for float32)."""
    for op, args in op_samples("cuda", dtype, p, SAMPLE_SIZES[sizes]):
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


@pytest.mark.cuda
@pytest.mark.parametrize("p", [0.0, 0.2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_llama_chain_matches_eager(dtype, p):
    """The compiled Llama-style chain runs the kernels the eager one runs, with the same draws: the same bits,
    outputs and gradients."""
    inputs, grads = llama_inputs("cuda", dtype)
    torch.manual_seed(0)
    eager_out, eager_grads = run_llama_chain(llama_chain, inputs, grads, p)
    torch.manual_seed(0)
    out, out_grads = run_llama_chain(torch.compile(llama_chain, fullgraph=True), inputs, grads, p)
    assert_all_equal(out, eager_out, "output")
    assert_all_equal(out_grads, eager_grads, "gradient of")


@pytest.mark.cuda
def test_reduce_overhead_glu_replays_draw_fresh_masks_and_backward_reuses_them():
    """Under CUDA graphs every replay of swiglu (separate and fused) draws a new mask, and each backward regenerates
    its own forward's: with gate, up > 0, grad_up = dout/(1 − p)·silu(gate) exactly where the output was kept,
    0 elsewhere; rms_norm and add_rms_norm run in the same graphs."""
    p = 0.3
    scale = 1 / (1 - p)

    def fn(gate, up, gate_up, x, res, w):
        s, y = add_rms_norm(x, res, w)
        return swiglu(gate, up, p), swiglu(gate_up, None, p), rms_norm(s, w) + y

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    gate = (torch.rand(64, 128, generator=g) + 0.5).cuda().half()
    up = (torch.rand(64, 128, generator=g) + 0.5).cuda().half()
    gate_up = torch.cat([gate, up], -1)
    x, res = torch.randn(64, 96, generator=g).cuda().half(), torch.randn(64, 96, generator=g).cuda().half()
    w = torch.randn(96, generator=g).cuda()
    dh = torch.randn(64, 128, generator=g).cuda().half()
    outs = []
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        leaves = [t.detach().clone().requires_grad_(True) for t in (gate, up, gate_up, x, res, w)]
        h, hf, z = compiled(*leaves)
        torch.autograd.backward([h, hf, z], [dh, dh, torch.ones_like(z)])
        h, hf = h.detach().clone(), hf.detach().clone()
        grad_up, grad_fused = leaves[1].grad, leaves[2].grad
        for out, grad in ((h, grad_up), (hf, grad_fused[:, 128:])):
            kept = out != 0
            assert 0.6 < kept.float().mean().item() < 0.8
            want = torch.where(kept, (dh.float() * scale * F.silu(gate.float())).half(), 0.0)
            torch.testing.assert_close(grad, want, atol=1e-3, rtol=1e-3)
            assert torch.equal(grad != 0, kept & (dh != 0))
        assert torch.isfinite(leaves[3].grad).all() and torch.isfinite(leaves[5].grad).all()
        outs.append((h, hf))
    for (a0, b0), (a1, b1) in zip(outs, outs[1:]):
        assert not torch.equal(a0, a1) and not torch.equal(b0, b1)
