"""TransformerDecoderLayer / TransformerDecoder: against torch.nn.TransformerDecoderLayer (via from_torch,
dropout off) forward and every gradient (target, encoder output, parameters), pre-/post-LN, relu/gelu,
padding; the layer-batched cross-attention K/V (one GEMM) equals per-layer projections; GEMM launch
count; causality, padding invariance, incremental decoding with reorder_cache, dropout statistics, bad
input. CUDA: fp32 (TF32 off), fp16/bf16 and autocast by the 2x-PyTorch rule, GEMM count."""
import copy

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from layer_testing import (DEVICES, _one_thread, _poison_arena, no_tf32,  # noqa: F401  (fixtures)
                           assert_close_scaled, padding_mask, param_grads, perturb_, plain_attention, run)
from lsmini.layers import TransformerConfig, TransformerDecoder, TransformerDecoderLayer
from util import assert_dropout_keep_stats, assert_lowp_rule

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def no_dropout(h, heads, ffn, **kw):
    return TransformerConfig(h, heads, ffn, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0, **kw)


def torch_decoder_layer(h, heads, ffn, act, pre, device="cpu", seed=0):
    torch.manual_seed(seed)
    t = nn.TransformerDecoderLayer(h, heads, ffn, dropout=0.0, activation=act, batch_first=True, norm_first=pre,
                                   device=device)
    return perturb_(t, seed)


def torch_decoder_grads(t):
    """torch's parameter gradients under lsmini's names (the cross-attention in_proj split into q and kv)."""
    g = param_grads(t)
    h = t.self_attn.embed_dim
    w, b = g.pop("multihead_attn.in_proj_weight"), g.pop("multihead_attn.in_proj_bias")
    g["multihead_attn.q_proj_weight"], g["multihead_attn.kv_proj_weight"] = w[:h], w[h:]
    g["multihead_attn.q_proj_bias"], g["multihead_attn.kv_proj_bias"] = b[:h], b[h:]
    return g


def compare_decoder_with_torch(t, m, y, mem, mask, g, tol):
    """Forward and every gradient of our layer m vs torch layer t (same weights) run in float64."""
    t = copy.deepcopy(t).double()
    t.zero_grad(set_to_none=True)
    m.zero_grad(set_to_none=True)
    causal = nn.Transformer.generate_square_subsequent_mask(y.shape[1], device=y.device, dtype=torch.float64)
    out_t, (dy_t, dm_t) = run(lambda a, e: t(a.double(), e.double(), tgt_mask=causal, memory_key_padding_mask=mask,
                                             tgt_is_causal=True), [y, mem], g.double())
    out_m, (dy_m, dm_m) = run(lambda a, e: m(a, e, mask), [y, mem], g)
    assert_close_scaled(out_m, out_t, tol, "output")
    assert_close_scaled(dy_m, dy_t, tol, "grad y")
    assert_close_scaled(dm_m, dm_t, tol, "grad encoder_out")
    gm = param_grads(m)
    for n, gt in torch_decoder_grads(t).items():
        assert_close_scaled(gm[n], gt, tol, f"grad {n}")


# batch, tgt_len, src_len, H, heads, ffn
CASES = [(3, 6, 7, 32, 4, 64), (1, 1, 1, 16, 2, 32), (4, 9, 13, 24, 3, 40), (2, 17, 5, 8, 1, 24)]


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "suffix", "random"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_matches_torch_cpu(pre, act, case, mask_kind, recompute):
    b, lt, ls, h, heads, ffn = case
    t = torch_decoder_layer(h, heads, ffn, act, pre)
    m = TransformerDecoderLayer.from_torch(t)
    m.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    y, mem, g = (torch.randn(b, n, h, generator=gen) for n in (lt, ls, lt))
    mask = None if mask_kind == "none" else padding_mask(b, ls, mask_kind)
    compare_decoder_with_torch(t, m, y, mem, mask, g, tol=2e-5)


def test_to_torch_roundtrip_and_layer_kv():
    t = torch_decoder_layer(32, 4, 64, "relu", True)
    m = TransformerDecoderLayer.from_torch(t)
    back = m.to_torch()
    y, mem = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    torch.testing.assert_close(back(y, mem, tgt_mask=causal), t(y, mem, tgt_mask=causal))
    dec = TransformerDecoder.from_layers([m, m])
    kw, kb = dec.layer_kv(1)
    torch.testing.assert_close(kw, m.multihead_attn.kv_proj_weight, atol=0, rtol=0)
    back2 = dec.layers[1].to_torch(kw, kb)
    torch.testing.assert_close(back2(y, mem, tgt_mask=causal), t(y, mem, tgt_mask=causal))
    with pytest.raises(ValueError, match="layer_kv"):
        dec.layers[0].to_torch()
    with pytest.raises(RuntimeError, match="belongs to a TransformerDecoder"):
        dec.layers[0](y, mem)


# ------------------------------------------------------------- layer-batched cross-attention K/V ---
def _stack_and_layers(device, pre, num_layers=3, h=32, heads=4, ffn=48):
    cfg = no_dropout(h, heads, ffn, pre_layer_norm=pre)
    torch.manual_seed(0)
    layers = [perturb_(TransformerDecoderLayer(cfg), seed=i).to(device) for i in range(num_layers)]
    dec = TransformerDecoder.from_layers(layers)
    return dec, layers


def _one_by_one(dec, layers, mask):
    """The stack's function computed by its separate layers (each with its own K/V projection)."""
    def sequential(a, e):
        for layer in layers:
            a = layer(a, e, mask)
        return a if dec.norm is None else dec.norm(a)
    return sequential


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_batched_cross_attention_equals_per_layer(device, pre):
    """A stack with one stacked K/V parameter computes what its layers do with their own projections:
    output, gradients of target and encoder output, and each layer's rows of the stacked K/V gradient."""
    dec, layers = _stack_and_layers(device, pre)
    gen = torch.Generator().manual_seed(2)
    y, mem, g = (torch.randn(3, n, 32, generator=gen).to(device) for n in (5, 9, 5))
    mask = padding_mask(3, 9, "suffix").to(device)

    out_s, (dy_s, dm_s) = run(_one_by_one(dec, layers, mask), [y, mem], g)
    out_d, (dy_d, dm_d) = run(lambda a, e: dec(a, e, mask), [y, mem], g)
    tol = 2e-5 if device == "cpu" else 5e-5
    assert_close_scaled(out_d, out_s, tol, "output")
    assert_close_scaled(dy_d, dy_s, tol, "grad y")
    assert_close_scaled(dm_d, dm_s, tol, "grad encoder_out")
    for i, layer in enumerate(layers):
        h2 = 64
        assert_close_scaled(dec.cross_attn_kv_weight.grad[i * h2:(i + 1) * h2],
                            layer.multihead_attn.kv_proj_weight.grad, tol, f"layer {i} kv weight grad")
        assert_close_scaled(dec.cross_attn_kv_bias.grad[i * h2:(i + 1) * h2], layer.multihead_attn.kv_proj_bias.grad,
                            tol, f"layer {i} kv bias grad")
        gl = param_grads(layer)
        for n, gd in param_grads(dec.layers[i]).items():
            assert_close_scaled(gd, gl[n], tol, f"layer {i} {n}")


def count_gemms(fn):
    """The GEMM ops fn() launches (forward and backward), with their operand shapes."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = [e for e in prof.events() if e.name in GEMM_OPS]
    return events


def _gemm_count_check(device, num_layers, recompute=True):
    dec, _ = _stack_and_layers(device, True, num_layers=num_layers)
    for layer in dec.layers:
        layer.recompute = recompute
    y = torch.randn(2, 5, 32, device=device, requires_grad=True)
    mem = torch.randn(2, 7, 32, device=device, requires_grad=True)

    def step():
        dec(y, mem).square().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up outside the profile
    events = count_gemms(step)
    width = num_layers * 2 * 32
    kv = [e for e in events if any(width in s for s in e.input_shapes if s)]
    # H = 32, FFN 48: only a per-layer K/V projection would have a 2H = 64 operand dimension
    per_layer_kv = [e for e in events if any(64 in s for s in e.input_shapes if s)]
    # forward: 10 per layer (self: QKV, QKᵀ, ·V, out; cross: Q, QKᵀ, ·V, out; FFN: 2) + 1 stacked K/V;
    # backward: 24 per layer (each attention block: out-projection 2, its fp32 reference attention
    # recomputed 2 + differentiated 4, input projection 2; FFN 4) + 2 for the stacked K/V (encoder-output
    # gradient, weight gradient). fp32 runs the reference attention; fp16/bf16 on CUDA the fused kernel.
    per_layer = 34
    assert len(events) == per_layer * num_layers + 3, [(e.name, e.input_shapes) for e in events]
    assert len(kv) == 3, [(e.name, e.input_shapes) for e in kv]
    assert not per_layer_kv, [(e.name, e.input_shapes) for e in per_layer_kv]


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("num_layers", [2, 3])
def test_gemm_count_cpu(num_layers, recompute):
    _gemm_count_check("cpu", num_layers, recompute)


@pytest.mark.cuda
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("num_layers", [2, 6])
def test_gemm_count_cuda(num_layers, recompute):
    _gemm_count_check("cuda", num_layers, recompute)


# ------------------------------------------------------------------------------------------- properties ---
@pytest.mark.parametrize("device", DEVICES)
def test_causality_and_padding_invariance(device):
    dec, _ = _stack_and_layers(device, True, num_layers=2)
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(3, 8, 32, generator=gen).to(device)
    mem = torch.randn(3, 6, 32, generator=gen).to(device)
    mask = padding_mask(3, 6, "random", seed=5).to(device)
    base = dec(y, mem, mask)
    y2 = y.clone()
    y2[:, 5:] = torch.randn(3, 3, 32, generator=gen).to(device)
    out = dec(y2, mem, mask)
    torch.testing.assert_close(out[:, :5], base[:, :5], atol=1e-6, rtol=1e-6)
    assert (out[:, 5:] - base[:, 5:]).abs().max() > 1e-3
    mem2 = torch.where(mask.unsqueeze(-1), 100 * torch.randn(mem.shape, generator=gen).to(device), mem)
    torch.testing.assert_close(dec(y, mem2, mask), base, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_incremental_equals_full_and_reorder(device, pre):
    dec, layers = _stack_and_layers(device, pre, num_layers=2)
    dec.eval()
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(3, 7, 32, generator=gen).to(device)
    mem = torch.randn(3, 5, 32, generator=gen).to(device)
    mask = padding_mask(3, 5, "suffix").to(device)
    full = dec(y, mem, mask)
    cache = {}
    steps = [dec(y[:, i:i + 1], mem, mask, cache=cache) for i in range(4)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, :4], atol=2e-5, rtol=1e-4)
    assert cache["step"] == 4 and len(cache["encoder_kv"]) == 4
    order = torch.tensor([1, 1, 0, 2], device=device)  # beam-style: batch grows to 4
    dec.reorder_cache(cache, order)
    rest = dec(y[order, 4:], None, mask[order], cache=cache)
    torch.testing.assert_close(rest, dec(y[order], mem[order], mask[order])[:, 4:], atol=2e-5, rtol=1e-4)
    # a standalone layer decodes incrementally as well
    layer = layers[0].eval()
    c2 = {}
    inc = torch.cat([layer(y[:, i:i + 1], mem, mask, cache=c2) for i in range(7)], 1)
    torch.testing.assert_close(inc, layer(y, mem, mask), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_cross_block_dropout_statistics(device, p):
    """Zero weights, cross-attention output bias 1: out − y = dropout(1), the cross block's residual
    dropout mask; its bias gradient counts what backward kept. Then attention dropout: Q = 0 gives a
    uniform softmax over the real keys, V = 1, so each output is (#kept keys)/(real keys·(1 − p))."""
    m = TransformerDecoderLayer(TransformerConfig(32, 4, 64, dropout=p, attn_dropout=0.0,
                                                  activation_dropout=0.0)).to(device)
    with torch.no_grad():
        for prm in m.parameters():
            prm.zero_()
        for n in (m.norm1, m.norm2, m.norm3):
            n.weight.fill_(1.0)
        m.multihead_attn.out_proj.bias.fill_(1.0)
    y, mem = torch.randn(8, 32, 32, device=device), torch.randn(8, 16, 32, device=device)
    out = m(y, mem)
    keep = (out - y).detach() > 0.5 / (1 - p)
    assert_dropout_keep_stats(keep.view(-1, 32), p)
    out.sum().backward()
    torch.testing.assert_close(m.multihead_attn.out_proj.bias.grad, keep.view(-1, 32).float().sum(0) / (1 - p),
                               atol=1e-3, rtol=1e-5)

    m2 = TransformerDecoderLayer(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=p,
                                                   activation_dropout=0.0)).to(device)
    with torch.no_grad():
        m2.load_state_dict(m.state_dict())
        m2.multihead_attn.out_proj.bias.zero_()
        m2.multihead_attn.out_proj.weight.copy_(torch.eye(32))
        m2.multihead_attn.kv_proj_bias[32:].fill_(1.0)
    b, lt, ls = 16, 32, 64
    lengths = torch.randint(ls // 2, ls + 1, (b,))
    mask = (torch.arange(ls).view(1, ls) >= lengths.view(b, 1)).to(device)
    y, mem = torch.randn(b, lt, 32, device=device), torch.randn(b, ls, 32, device=device)
    kept = ((m2(y, mem, mask) - y) * lengths.view(b, 1, 1).to(device) * (1 - p)).round()
    per_head = kept.view(b, lt, 4, 8)[..., 0]
    n = (lengths.view(b, 1, 1) * torch.ones(1, lt, 4)).sum().item()
    rate = per_head.sum().item() / n
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) <= 5 * sd, (rate, 1 - p, sd)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_recompute_with_dropout_equals_saving(device, pre):
    """With every dropout on, recomputing the attention probabilities / activation / LayerNorm outputs in
    backward (same dropout masks) gives the same gradients as saving them."""
    cfg = TransformerConfig(32, 4, 64, dropout=0.2, attn_dropout=0.3, activation_dropout=0.25, pre_layer_norm=pre)
    torch.manual_seed(0)
    a = perturb_(TransformerDecoderLayer(cfg)).to(device)
    b = TransformerDecoderLayer(cfg).to(device)
    b.load_state_dict(a.state_dict())
    b.recompute = False
    gen = torch.Generator().manual_seed(8)
    y, mem, g = (torch.randn(3, n, 32, generator=gen).to(device) for n in (6, 9, 6))
    mask = padding_mask(3, 9, "suffix").to(device)
    torch.manual_seed(11)
    out_a, grads_a = run(lambda u, e: a(u, e, mask), [y, mem], g)
    torch.manual_seed(11)
    out_b, grads_b = run(lambda u, e: b(u, e, mask), [y, mem], g)
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    for x_a, x_b in zip(grads_a, grads_b):
        torch.testing.assert_close(x_a, x_b, atol=1e-6, rtol=1e-5)
    gb = param_grads(b)
    for n, gr in param_grads(a).items():
        torch.testing.assert_close(gr, gb[n], atol=1e-6, rtol=1e-5, msg=lambda m: f"{n}: {m}")


# ------------------------------------------------------------------------------------------- bad input ---
def test_bad_inputs():
    dec = TransformerDecoder(no_dropout(32, 4, 64, max_seq_len=10, max_batch_tokens=64), 2)
    y, mem = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    with pytest.raises(ValueError, match="batch 3"):
        dec(y, torch.randn(3, 7, 32))
    with pytest.raises(ValueError, match="encoder_out must have shape"):
        dec(y, torch.randn(2, 7, 16))
    with pytest.raises(ValueError, match=r"\(batch, len\) = \(2, 7\)"):
        dec(y, mem, torch.zeros(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_seq_len = 10"):
        dec(torch.randn(2, 11, 32), mem)
    with pytest.raises(ValueError, match="max_batch_tokens = 64"):
        dec(torch.randn(8, 10, 32), torch.randn(8, 7, 32))
    with pytest.raises(ValueError, match="encoder_out is required"):
        dec(y, None)
    with pytest.raises(TypeError, match="dict"):
        dec(y, mem, cache=[])
    with pytest.raises(TypeError, match="new_order"):
        dec.reorder_cache({}, [0, 1])
    with pytest.raises(ValueError, match="standalone"):
        TransformerDecoder.from_layers(list(dec.layers))


# ================================================================================================= CUDA ===
CUDA_CASES = [(3, 6, 7, 64, 4, 256), (8, 64, 128, 256, 8, 1024), (5, 33, 17, 96, 3, 160)]


@pytest.mark.cuda
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("case", CUDA_CASES)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_matches_torch_fp32(pre, act, case, recompute, no_tf32):
    b, lt, ls, h, heads, ffn = case
    t = torch_decoder_layer(h, heads, ffn, act, pre, device="cuda")
    m = TransformerDecoderLayer.from_torch(t)
    m.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    y, mem, g = (torch.randn(b, n, h, generator=gen).cuda() for n in (lt, ls, lt))
    compare_decoder_with_torch(t, m, y, mem, padding_mask(b, ls, "random").cuda(), g, tol=5e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_lowp_2x_torch_rule(pre, dtype, autocast, no_tf32):
    """fp16/bf16 parameters (or fp32 parameters under autocast, where the layer computes in dtype too):
    error vs the fp32 torch.nn oracle at most 2x that of torch.nn run in dtype with plain (math) attention
    (+ an atol of 1e-3 of the quantity's magnitude)."""
    b, lt, ls, h, heads, ffn = 4, 48, 40, 128, 4, 512
    t32 = torch_decoder_layer(h, heads, ffn, "gelu", pre, device="cuda")
    with torch.no_grad():
        for p in t32.parameters():
            p.copy_(p.to(dtype).float())
    t_lp = torch_decoder_layer(h, heads, ffn, "gelu", pre, device="cuda")
    t_lp.load_state_dict(t32.state_dict())
    m_lp = TransformerDecoderLayer.from_torch(t_lp if autocast else t_lp.to(dtype))
    t_lp = t_lp.to(dtype)
    gen = torch.Generator().manual_seed(2)
    y, mem, g = (torch.randn(b, n, h, generator=gen).to("cuda", dtype).float() for n in (lt, ls, lt))
    mask = padding_mask(b, ls, "suffix").cuda()
    causal = nn.Transformer.generate_square_subsequent_mask(lt, device="cuda")
    out32, (dy32, dm32) = run(lambda a, e: t32(a, e, tgt_mask=causal, memory_key_padding_mask=mask,
                                               tgt_is_causal=True), [y, mem], g)
    cast = (lambda a: a) if autocast else (lambda a: a.to(dtype))
    with plain_attention():
        out_t, (dy_t, dm_t) = run(lambda a, e: t_lp(a.to(dtype), e.to(dtype), tgt_mask=causal.to(dtype),
                                                    memory_key_padding_mask=mask, tgt_is_causal=True), [y, mem],
                                  g.to(dtype))
    with torch.autocast("cuda", dtype=dtype, enabled=autocast):
        out_m, (dy_m, dm_m) = run(lambda a, e: m_lp(cast(a), cast(e), mask), [y, mem], g.to(dtype))
    assert out_m.dtype == dtype
    scale = lambda r: 1e-3 * max(1.0, r.abs().max().item())  # noqa: E731
    for name, a, ref, tt in (("output", out_m, out32, out_t), ("grad y", dy_m, dy32, dy_t),
                             ("grad encoder_out", dm_m, dm32, dm_t)):
        assert_lowp_rule(a.float(), ref, tt.float(), atol=scale(ref), name=name)
    g32, gt, gm = torch_decoder_grads(t32), torch_decoder_grads(t_lp), param_grads(m_lp)
    for n in g32:
        assert_lowp_rule(gm[n].float(), g32[n], gt[n].float(), atol=scale(g32[n]), name=f"grad {n}")
