"""The layer options of Llama-style models (TransformerConfig: norm="rmsnorm", bias=False, num_kv_heads, rotary,
rotary_dim, qk_norm, activation="swiglu"/"geglu"): encoder and decoder layers, their stacks and TransformerLM
against a plain-PyTorch Llama-style block written here from torch ops (F.linear, a hand-written RMSNorm, Hugging
Face's rotate_half rotary, repeat_kv, an explicit softmax, silu(gate)·up), in float64, forward and every
gradient, and TransformerLM against Hugging Face's LlamaForCausalLM; incremental decoding against the full causal
forward; bad input; the parameters and state_dict; which options the kernel path names as unsupported; torch.nn
interop. CUDA: the same layers in bfloat16, eager and compiled, within 2x of plain PyTorch's own bfloat16 error,
and the warning of calls the kernels do not cover."""
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from layer_testing import (_one_thread, _poison_freed_memory, assert_close_scaled,  # noqa: F401  (fixtures)
                           padding_mask, param_grads, perturb_, run)
from lsmini.layers import (RMSNorm, TransformerConfig, TransformerDecoder, TransformerDecoderLayer,
                           TransformerEncoder, TransformerEncoderLayer)
from lsmini.models import TransformerLM
from util import assert_lowp_rule

LLAMA = {"norm": "rmsnorm", "rotary": 10000.0, "activation": "swiglu", "num_kv_heads": 2, "bias": False}
OPTIONS = {
    "rmsnorm": {"norm": "rmsnorm"},
    "swiglu": {"activation": "swiglu"},
    "geglu": {"activation": "geglu"},
    "no_bias": {"bias": False},
    "gqa_4_2": {"num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "rotary": {"rotary": 10000.0},
    "partial_rotary": {"rotary": 10000.0, "rotary_dim": 4},
    "qk_norm": {"qk_norm": True},
    "qk_norm_rotary": {"qk_norm": True, "rotary": 500000.0},
    "llama": LLAMA,
    "llama_qk_norm": {**LLAMA, "qk_norm": True},
    "llama_6_2": {**LLAMA, "num_heads": 6, "hidden_size": 48},
}
TOL = 2e-5  # float32 layer against the float64 oracle, as the torch.nn comparisons of the layer tests


def config(**kw):
    base = {"hidden_size": 32, "num_heads": 4, "ffn_size": 48, "dropout": 0.0, "attn_dropout": 0.0,
            "activation_dropout": 0.0}
    return TransformerConfig(**{**base, **kw})


# ---- the plain-PyTorch Llama-style oracle ------------------------------------------------------------------------
def _norm(cfg, norm, x):
    if cfg.norm == "rmsnorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_eps) * norm.weight
    return F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, cfg.layer_norm_eps)


def _rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _tables(cfg, positions):
    """Hugging Face's default rotary tables, float64: cat(freqs, freqs) of position·theta^(−2i/r)."""
    r = cfg.rotary_dims
    inv_freq = 1.0 / cfg.rotary ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    angles = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _rope(t, cos, sin):
    r = cos.shape[-1]
    rot = t[..., :r]
    cos, sin = cos.to(t.device, t.dtype), sin.to(t.device, t.dtype)  # in t's dtype: plain PyTorch in bf16 stays bf16
    return torch.cat((rot * cos + _rotate_half(rot) * sin, t[..., r:]), dim=-1)


def _repeat_kv(t, groups):
    b, kv, l, d = t.shape
    return t[:, :, None].expand(b, kv, groups, l, d).reshape(b, kv * groups, l, d)


def _attend(q, k, v, key_mask, causal):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if key_mask is not None:
        s = s.masked_fill(key_mask[:, None, None, :].to(s.device), float("-inf"))
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(lk - lq + 1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _split_heads(t, n):
    b, l, _ = t.shape
    return t.view(b, l, n, -1).transpose(1, 2)


def _self_attention(cfg, sa, x, mask, causal, positions):
    h, kv, d = cfg.num_heads, cfg.kv_heads, cfg.head_dim
    q, k, v = F.linear(x, sa.in_proj_weight, sa.in_proj_bias).split([h * d, kv * d, kv * d], dim=-1)
    q, k, v = _split_heads(q, h), _split_heads(k, kv), _split_heads(v, kv)
    if cfg.qk_norm:
        q, k = _rms(q, sa.q_norm_weight, cfg.layer_norm_eps), _rms(k, sa.k_norm_weight, cfg.layer_norm_eps)
    if cfg.rotary is not None:
        cos, sin = _tables(cfg, positions)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    o = _attend(q, _repeat_kv(k, h // kv), _repeat_kv(v, h // kv), mask, causal)
    return F.linear(o.transpose(1, 2).flatten(2), sa.out_proj.weight, sa.out_proj.bias)


def _cross_attention(cfg, ca, kv_weight, kv_bias, x, enc, enc_mask):
    h, kv = cfg.num_heads, cfg.kv_heads
    q = _split_heads(F.linear(x, ca.q_proj_weight, ca.q_proj_bias), h)
    k, v = (_split_heads(t, kv) for t in F.linear(enc, kv_weight, kv_bias).chunk(2, dim=-1))
    o = _attend(q, _repeat_kv(k, h // kv), _repeat_kv(v, h // kv), enc_mask, False)
    return F.linear(o.transpose(1, 2).flatten(2), ca.out_proj.weight, ca.out_proj.bias)


def _ffn(cfg, layer, x):
    hidden = F.linear(x, layer.linear1.weight, layer.linear1.bias)
    if cfg.activation in ("swiglu", "geglu"):
        gate, up = hidden[..., :cfg.ffn_size], hidden[..., cfg.ffn_size:]
        hidden = (F.silu(gate) if cfg.activation == "swiglu" else F.gelu(gate)) * up
    elif cfg.activation == "relu":
        hidden = F.relu(hidden)
    else:
        hidden = F.gelu(hidden, approximate="tanh" if cfg.activation == "gelu_tanh" else "none")
    return F.linear(hidden, layer.linear2.weight, layer.linear2.bias)


def oracle_layer(layer, x, mask, causal, positions, enc=None, enc_mask=None, kv=None):
    """One encoder (enc None) or decoder layer of lsmini's parameters in plain PyTorch."""
    cfg = layer.config
    blocks = [lambda u: _self_attention(cfg, layer.self_attn, u, mask, causal, positions)]
    if enc is not None:
        ca = layer.multihead_attn
        kv_weight, kv_bias = kv if kv is not None else (ca.kv_proj_weight, ca.kv_proj_bias)
        blocks.append(lambda u: _cross_attention(cfg, ca, kv_weight, kv_bias, u, enc, enc_mask))
    blocks.append(lambda u: _ffn(cfg, layer, u))
    r = x
    for i, block in enumerate(blocks):
        norm = getattr(layer, f"norm{i + 1}")
        r = r + block(_norm(cfg, norm, r)) if cfg.pre_layer_norm else _norm(cfg, norm, r + block(r))
    return r


def oracle_encoder(stack, x, mask, causal):
    for layer in stack.layers:
        x = oracle_layer(layer, x, mask, causal, range(x.shape[1]))
    return x if stack.norm is None else _norm(stack.config, stack.norm, x)


def oracle_decoder(stack, y, enc, enc_mask):
    for i, layer in enumerate(stack.layers):
        y = oracle_layer(layer, y, None, True, range(y.shape[1]), enc, enc_mask, stack.layer_kv(i))
    return y if stack.norm is None else _norm(stack.config, stack.norm, y)


def oracle_lm(lm, tokens):
    emb = lm.embed
    x = emb.weight[tokens] * emb.scale + emb.pos_table[:tokens.shape[1]].to(emb.weight.dtype)
    pad = tokens.eq(emb.padding_idx)
    x = x.masked_fill(pad[..., None], 0.0)
    h = oracle_encoder(lm.decoder, x, pad, True)
    return F.linear(h, lm.output_weight())


# ---- comparisons ----------------------------------------------------------------------------------------------
def compare(module, ours, oracle, inputs, grad, tol=TOL):
    """ours(module, *inputs) in float32 against oracle(float64 copy, *float64 inputs): the output, the
    gradient of every floating input and of every parameter."""
    ref = copy.deepcopy(module).double()
    module.zero_grad(set_to_none=True)
    out, grads = run(lambda *a: ours(module, *a), inputs, grad)
    out_r, grads_r = run(lambda *a: oracle(ref, *a), [t.double() if t.is_floating_point() else t for t in inputs],
                         grad.double())
    assert_close_scaled(out, out_r, tol, "output")
    for i, (g, g_r) in enumerate(zip(grads, grads_r)):
        assert_close_scaled(g, g_r, tol, f"grad input {i}")
    ours_grads, ref_grads = param_grads(module), param_grads(ref)
    assert ours_grads.keys() == ref_grads.keys()
    for n, g_r in ref_grads.items():
        assert g_r is not None and ours_grads[n] is not None, n
        assert_close_scaled(ours_grads[n], g_r, tol, f"grad {n}")


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def encoder_layer(pre=True, **kw):
    torch.manual_seed(0)
    return perturb_(TransformerEncoderLayer(config(pre_layer_norm=pre, **kw)))


@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("name", OPTIONS)
def test_encoder_layer_matches_plain_torch(name, pre):
    """Full attention with random padding, and causal attention with suffix padding."""
    m = encoder_layer(pre, **OPTIONS[name])
    b, l, h = 3, 7, m.config.hidden_size
    x, g = randn(b, l, h), randn(b, l, h, seed=2)
    for mask, causal in ((padding_mask(b, l, "random"), False), (padding_mask(b, l, "suffix"), True)):
        compare(m, lambda mod, a: mod(a, mask, causal=causal),
                lambda mod, a: oracle_layer(mod, a, mask, causal, range(l)), [x], g)


@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("name", ["rmsnorm", "geglu", "no_bias", "gqa_4_2", "rotary", "qk_norm_rotary", "llama",
                                  "llama_qk_norm"])
def test_decoder_layer_matches_plain_torch(name, pre):
    """Causal self-attention (rotary, QK-norm) and cross-attention (grouped K/V, no rotary) over an encoder
    output with padding."""
    torch.manual_seed(0)
    m = perturb_(TransformerDecoderLayer(config(pre_layer_norm=pre, **OPTIONS[name])))
    b, lt, ls, h = 3, 6, 5, m.config.hidden_size
    y, enc, g = randn(b, lt, h), randn(b, ls, h, seed=3), randn(b, lt, h, seed=2)
    mask = padding_mask(b, ls, "suffix")
    compare(m, lambda mod, a, e: mod(a, e, mask),
            lambda mod, a, e: oracle_layer(mod, a, None, True, range(lt), e, mask), [y, enc], g)


@pytest.mark.parametrize("name", ["llama", "llama_qk_norm", "partial_rotary", "geglu"])
def test_encoder_stack_matches_plain_torch(name):
    torch.manual_seed(0)
    m = perturb_(TransformerEncoder(config(**OPTIONS[name]), 2))
    b, l, h = 2, 6, m.config.hidden_size
    x, g = randn(b, l, h), randn(b, l, h, seed=2)
    mask = padding_mask(b, l, "suffix")
    compare(m, lambda mod, a: mod(a, mask, causal=True), lambda mod, a: oracle_encoder(mod, a, mask, True), [x], g)


@pytest.mark.parametrize("name", ["llama", "llama_qk_norm", "gqa_4_2", "no_bias"])
def test_decoder_stack_matches_plain_torch(name):
    """The stacked cross K/V projection holds 2·kv_heads·head_dim rows per layer."""
    torch.manual_seed(0)
    m = perturb_(TransformerDecoder(config(**OPTIONS[name]), 2))
    c = m.config
    assert m.cross_attn_kv_weight.shape == (2 * 2 * c.kv_heads * c.head_dim, c.hidden_size)
    assert (m.cross_attn_kv_bias is None) == (not c.bias)
    b, lt, ls, h = 2, 5, 4, c.hidden_size
    y, enc, g = randn(b, lt, h), randn(b, ls, h, seed=3), randn(b, lt, h, seed=2)
    mask = padding_mask(b, ls, "suffix")
    compare(m, lambda mod, a, e: mod(a, e, mask), lambda mod, a, e: oracle_decoder(mod, a, e, mask), [y, enc], g)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("name", ["llama", "llama_qk_norm"])
def test_lm_matches_plain_torch(name, tie):
    """TransformerLM, Llama-style: no position embedding (rotary in the layers), padded tokens masked."""
    torch.manual_seed(0)
    lm = perturb_(TransformerLM(50, config(**OPTIONS[name]), 2, tie_output=tie))
    assert not lm.embed.pos_table.any()
    tokens = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    tokens[1, -2:] = 0
    g = randn(2, 7, 50, seed=5)
    compare(lm, lambda mod, t: mod(t), oracle_lm, [tokens], g)


# ---- incremental decoding ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "llama_qk_norm", "partial_rotary", "mqa"])
def test_incremental_layer_equals_full_causal(name):
    """Step by step (1, then 2, then 1... positions) with the cache equals the full causal forward; the cache
    holds kv_heads heads of rotated keys."""
    m = encoder_layer(**OPTIONS[name]).eval()
    x = randn(2, 6, m.config.hidden_size)
    full = m(x, causal=True)
    cache, outs, i = {}, [], 0
    for n in (1, 2, 1, 2):
        outs.append(m(x[:, i:i + n], causal=True, cache=cache))
        i += n
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=2e-5, rtol=1e-4)
    assert cache["k"].shape == (2, m.config.kv_heads, 6, m.config.head_dim)


@pytest.mark.parametrize("name", ["llama", "llama_qk_norm"])
def test_incremental_lm_equals_full(name):
    torch.manual_seed(0)
    lm = perturb_(TransformerLM(50, config(**OPTIONS[name]), 2)).eval()
    tokens = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(4))
    full = lm(tokens)
    cache = {}
    steps = [lm(tokens[:, j:j + 1], cache=cache) for j in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-4)


def test_incremental_decoder_equals_full():
    torch.manual_seed(0)
    m = perturb_(TransformerDecoder(config(**OPTIONS["llama_qk_norm"]), 2)).eval()
    y, enc = randn(2, 5, 32), randn(2, 4, 32, seed=3)
    mask = padding_mask(2, 4, "suffix")
    full = m(y, enc, mask)
    cache = {}
    steps = [m(y[:, j:j + 1], enc if j == 0 else None, mask, cache=cache) for j in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-4)


def test_rotary_tables_can_be_passed():
    """A layer given the tables of other positions (here 3…) equals one decoding after 3 cached positions."""
    from lsmini.ops.rotary import rotary_cos_sin
    m = encoder_layer(**OPTIONS["llama"]).eval()
    x = randn(2, 5, 32)
    cache = {}
    m(x[:, :3], causal=True, cache=cache)
    stepped = m(x[:, 3:], causal=True, cache=cache)
    torch.testing.assert_close(m(x, causal=True)[:, 3:], stepped, atol=2e-5, rtol=1e-4)
    shifted = m(x[:, 3:], causal=True, rotary=rotary_cos_sin(2, 8, 10000.0, offset=3))
    ref = oracle_layer(copy.deepcopy(m).double(), x[:, 3:].double(), None, True, range(3, 5))
    assert_close_scaled(shifted, ref, TOL, "output")
    with pytest.raises(ValueError, match="rotary cos must be float32"):
        m(x, rotary=rotary_cos_sin(4, 8, 10000.0))
    with pytest.raises(ValueError, match="no rotary"):
        encoder_layer()(x, rotary=rotary_cos_sin(5, 8, 10000.0))


# ---- parameters -------------------------------------------------------------------------------------------------
def test_parameter_shapes_and_state_dict():
    c = config(**OPTIONS["llama_qk_norm"])
    enc = TransformerEncoderLayer(c)
    sd = enc.state_dict()
    assert not [k for k in sd if "bias" in k]
    assert sd["self_attn.in_proj_weight"].shape == ((4 + 2 * 2) * 8, 32)
    assert sd["linear1.weight"].shape == (96, 32) and sd["linear2.weight"].shape == (32, 48)
    assert sd["self_attn.q_norm_weight"].shape == (8,) and sd["self_attn.k_norm_weight"].shape == (8,)
    assert isinstance(enc.norm1, RMSNorm) and isinstance(enc.norm2, RMSNorm)
    dec = TransformerDecoder(c, 2)
    assert not [k for k in dec.state_dict() if "bias" in k]
    assert isinstance(dec.norm, RMSNorm)
    layer = TransformerDecoderLayer(c)
    assert layer.multihead_attn.kv_proj_weight.shape == (2 * 2 * 8, 32)
    ln = TransformerEncoderLayer(config(bias=False))
    assert ln.norm1.bias is None and not [k for k in ln.state_dict() if "bias" in k]
    # the default layer keeps torch.nn's parameters
    assert sorted(TransformerEncoderLayer(config()).state_dict()) == sorted(
        torch.nn.TransformerEncoderLayer(32, 4, 48, batch_first=True).state_dict())


def test_rms_norm_module_matches_torch():
    x = randn(3, 5, 16).double().requires_grad_()
    for eps in (None, 1e-5):
        ours, theirs = RMSNorm(16, eps=eps, dtype=torch.float64), torch.nn.RMSNorm(16, eps=eps, dtype=torch.float64)
        with torch.no_grad():
            ours.weight.copy_(randn(16, seed=7))
            theirs.weight.copy_(ours.weight)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        g = randn(3, 5, 16, seed=2).double()
        y, (gx,) = run(ours, [x], g)
        y_t, (gx_t,) = run(theirs, [x], g)
        torch.testing.assert_close(y, y_t)
        torch.testing.assert_close(gx, gx_t)
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
    assert RMSNorm(16, elementwise_affine=False).weight is None
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(16, eps=-1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["rmsnorm", "swiglu", "geglu", "no_bias", "gqa_4_2", "rotary", "qk_norm",
                                  "qk_norm_rotary", "llama", "llama_qk_norm"])
def test_cuda_calls_run_the_operators_silently(name):
    """On CUDA every option runs the lsmini::layer operator, with no warning."""
    from util import LsminiOps
    layer = encoder_layer(hidden_size=64, **OPTIONS[name]).to("cuda", torch.float16)  # head_dim 16: fused attention
    x = randn(2, 5, 64).to("cuda", torch.float16)
    with warnings.catch_warnings(record=True) as caught, LsminiOps() as ops:
        warnings.simplefilter("always")
        layer(x)
    assert not [str(w.message) for w in caught if "lsmini" in str(w.message)]
    assert "layer" in ops.names


def test_no_warning_off_cuda():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        encoder_layer(**OPTIONS["llama"])(randn(2, 5, 32))


def test_options_of_the_config():
    layer = TransformerDecoderLayer(config(**OPTIONS["llama_qk_norm"], rotary_dim=6))
    o = layer.options(True)
    assert (o.norm, o.activation, o.kv_heads, o.rotary_dim, o.qk_norm) == ("rms_norm", "swiglu", 2, 6, True)
    assert len(layer.layer_params()) == 3 * 6 + 2
    o = TransformerEncoderLayer(config()).options(False)
    assert (o.norm, o.kv_heads, o.rotary_dim, o.qk_norm) == ("layer_norm", 4, 0, False)


# ---- bad input --------------------------------------------------------------------------------------------------
BAD = [
    ({"num_kv_heads": 3}, ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    ({"num_kv_heads": 0}, ValueError, "num_kv_heads must be >= 1"),
    ({"num_kv_heads": 2.0}, TypeError, "num_kv_heads must be an int"),
    ({"rotary": 10000.0, "rotary_dim": 5}, ValueError, "rotary_dim must be even"),
    ({"rotary": 10000.0, "rotary_dim": 0}, ValueError, r"rotary_dim must be in \[2, 8\]"),
    ({"rotary": 10000.0, "rotary_dim": 10}, ValueError, r"rotary_dim must be in \[2, 8\]"),
    ({"rotary_dim": 8}, ValueError, "rotary_dim .* is set but rotary is None"),
    ({"rotary": 0.0}, ValueError, "rotary must be None or the rotary theta"),
    ({"rotary": -1.0}, ValueError, "rotary must be None or the rotary theta"),
    ({"rotary": float("inf")}, ValueError, "rotary must be None or the rotary theta"),
    ({"rotary": float("nan")}, ValueError, "rotary must be None or the rotary theta"),
    ({"rotary": True}, ValueError, "rotary must be None or the rotary theta"),
    ({"norm": "batchnorm"}, ValueError, "norm must be one of"),
    ({"norm": "rms_norm"}, ValueError, "norm must be one of"),
    ({"bias": 0}, TypeError, "bias must be a bool"),
    ({"qk_norm": "yes"}, TypeError, "qk_norm must be a bool"),
    ({"activation": "silu"}, ValueError, "activation must be one of"),
]


@pytest.mark.parametrize("kw,error,message", BAD, ids=[f"{next(iter(kw))}={list(kw.values())[-1]!r}"
                                                        for kw, _, _ in BAD])
def test_bad_config_names_the_argument(kw, error, message):
    with pytest.raises(error, match=f"TransformerConfig: {message}"):
        config(**kw)


def test_lm_refuses_learned_positions_with_rotary():
    with pytest.raises(ValueError, match="learned_positions"):
        TransformerLM(50, config(rotary=10000.0), 1, learned_positions=True)


# ---- CUDA: bfloat16 within 2x of plain PyTorch's own error -------------------------------------------------------
def _cuda_bf16_check(module, ours, oracle, inputs, grad, compiled):
    """ours on CUDA in bfloat16 (eager or torch.compile) against the float64 oracle, by the 2x rule with the
    oracle run in bfloat16 as plain PyTorch's error; every output, input and parameter gradient."""
    ref64 = copy.deepcopy(module).to("cuda", torch.float64)
    ref16 = copy.deepcopy(module).to("cuda", torch.bfloat16)
    mod = copy.deepcopy(module).to("cuda", torch.bfloat16)
    fn = torch.compile(lambda *a: ours(mod, *a)) if compiled else (lambda *a: ours(mod, *a))
    cuda = [t.cuda() for t in inputs]
    out64, grads64 = run(lambda *a: oracle(ref64, *a), [t.double() if t.is_floating_point() else t for t in cuda],
                         grad.cuda().double())
    out16, grads16 = run(lambda *a: oracle(ref16, *a),
                         [t.bfloat16() if t.is_floating_point() else t for t in cuda], grad.cuda().bfloat16())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the options the kernel path lacks run the reference, with a warning
        out, grads = run(fn, [t.bfloat16() if t.is_floating_point() else t for t in cuda], grad.cuda().bfloat16())
    assert out.dtype == torch.bfloat16

    def scale(r):
        return 1e-3 * max(1.0, r.abs().max().item())

    assert_lowp_rule(out.float(), out64, out16.float(), atol=scale(out64), name="output")
    for i, (g, g64, g16) in enumerate(zip(grads, grads64, grads16)):
        assert_lowp_rule(g.float(), g64, g16.float(), atol=scale(g64), name=f"grad input {i}")
    p64, p16, p = param_grads(ref64), param_grads(ref16), param_grads(mod)
    for n in p64:
        assert_lowp_rule(p[n].float(), p64[n], p16[n].float(), atol=scale(p64[n]), name=f"grad {n}")


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("name", ["rmsnorm", "swiglu", "no_bias", "gqa_4_2", "rotary", "qk_norm", "llama",
                                  "llama_qk_norm"])
def test_cuda_bf16_encoder_layer(name, compiled):
    torch.manual_seed(0)
    m = perturb_(TransformerEncoderLayer(config(hidden_size=128, num_heads=8, ffn_size=256, **{
        **OPTIONS[name], **({"num_kv_heads": 4} if "num_kv_heads" in OPTIONS[name] else {})})))
    b, l = 4, 33
    mask = padding_mask(b, l, "suffix").cuda()
    _cuda_bf16_check(m, lambda mod, a: mod(a, mask, causal=True),
                     lambda mod, a: oracle_layer(mod, a, mask, True, range(l)), [randn(b, l, 128)],
                     randn(b, l, 128, seed=2), compiled)


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_bf16_decoder_stack(compiled):
    torch.manual_seed(0)
    m = perturb_(TransformerDecoder(config(hidden_size=128, num_heads=8, ffn_size=256,
                                           **{**OPTIONS["llama_qk_norm"], "num_kv_heads": 4}), 2))
    b, lt, ls = 3, 17, 9
    mask = padding_mask(b, ls, "suffix").cuda()
    _cuda_bf16_check(m, lambda mod, a, e: mod(a, e, mask), lambda mod, a, e: oracle_decoder(mod, a, e, mask),
                     [randn(b, lt, 128), randn(b, ls, 128, seed=3)], randn(b, lt, 128, seed=2), compiled)


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_bf16_lm(compiled):
    torch.manual_seed(0)
    lm = perturb_(TransformerLM(300, config(hidden_size=128, num_heads=8, ffn_size=256,
                                            **{**OPTIONS["llama"], "num_kv_heads": 4}), 2))
    tokens = torch.randint(1, 300, (3, 20), generator=torch.Generator().manual_seed(4))
    tokens[1, -3:] = 0
    _cuda_bf16_check(lm, lambda mod, t: mod(t), oracle_lm, [tokens], randn(3, 20, 300, seed=5), compiled)


def test_compiled_lm_matches_eager_cpu():
    """The Llama-style model traces whole (fullgraph) and computes what eager does, forward and backward."""
    torch.manual_seed(0)
    lm = perturb_(TransformerLM(50, config(**OPTIONS["llama_qk_norm"]), 2))
    tokens = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(4))
    g = randn(2, 7, 50, seed=5)
    out, _ = run(lambda t: lm(t), [tokens], g)
    eager = {n: p.grad.clone() for n, p in lm.named_parameters()}
    lm.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    out_c, _ = run(torch.compile(lm, fullgraph=True, backend="aot_eager"), [tokens], g)
    torch.testing.assert_close(out_c, out, atol=1e-5, rtol=1e-5)
    for n, p in lm.named_parameters():
        torch.testing.assert_close(p.grad, eager[n], atol=1e-5, rtol=1e-5, msg=lambda m: f"{n}: {m}")


# ---- torch.nn interop ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [TransformerEncoderLayer, TransformerDecoderLayer])
def test_to_torch_and_back_with_rms_norm_and_no_bias(cls):
    """torch.nn's layers built with bias=False and nn.RMSNorm norms are what these options are in torch."""
    torch.manual_seed(0)
    m = perturb_(cls(config(norm="rmsnorm", bias=False, pre_layer_norm=False)))
    t = m.to_torch()
    assert isinstance(t.norm1, torch.nn.RMSNorm) and t.linear1.bias is None and t.self_attn.in_proj_bias is None
    x, enc = randn(2, 5, 32), randn(2, 4, 32, seed=3)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    if cls is TransformerEncoderLayer:
        torch.testing.assert_close(m(x), t(x), atol=2e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(m(x, enc), t(x, enc, tgt_mask=causal, tgt_is_causal=True), atol=2e-5, rtol=1e-4)
    back = cls.from_torch(t)
    assert back.config == m.config
    for (n, p), (_, q) in zip(m.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("name", ["swiglu", "gqa_4_2", "rotary", "qk_norm"])
def test_to_torch_refuses_options_torch_lacks(name):
    with pytest.raises(ValueError, match="to_torch: torch.nn.TransformerEncoderLayer has no equivalent of"):
        encoder_layer(**OPTIONS[name]).to_torch()


def test_encoder_decoder_model_with_llama_options():
    """lsmini.models.Transformer with the options: no position embeddings, and step-by-step decoding equals
    the full forward."""
    from lsmini.models import Transformer
    torch.manual_seed(0)
    model = perturb_(Transformer(40, 40, config(**OPTIONS["llama_qk_norm"]), 2, 2)).eval()
    assert not model.src_embed.pos_table.any()
    src = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    src[1, -2:] = 0
    tgt = torch.randint(1, 40, (2, 5), generator=torch.Generator().manual_seed(2))
    full = model(src, tgt)
    enc, mask = model.encode(src)
    cache = {}
    steps = [model.decode(tgt[:, j:j + 1], enc, mask, cache) for j in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-4)


def test_lm_matches_hugging_face_llama():
    """TransformerLM with the Llama options computes what transformers' LlamaForCausalLM does (its weights
    copied: Q/K/V rows stacked, [gate | up] stacked, the embedding divided by lsmini's sqrt(hidden) scale),
    forward and every gradient, in float64."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hc = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                                  attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                                  max_position_embeddings=64)
    hc._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hc).double()
    lm = TransformerLM(50, config(**OPTIONS["llama"], ffn_size=48), 2, padding_idx=None, tie_output=False,
                       dtype=torch.float64)
    pairs = [(lm.embed.weight, [hf.model.embed_tokens.weight], 1 / math.sqrt(32)),
             (lm.decoder.norm.weight, [hf.model.norm.weight], 1.0),
             (lm.output_projection.weight, [hf.lm_head.weight], 1.0)]
    for ours, theirs in zip(lm.decoder.layers, hf.model.layers):
        a, m = theirs.self_attn, theirs.mlp
        pairs += [(ours.self_attn.in_proj_weight, [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 1.0),
                  (ours.self_attn.out_proj.weight, [a.o_proj.weight], 1.0),
                  (ours.linear1.weight, [m.gate_proj.weight, m.up_proj.weight], 1.0),
                  (ours.linear2.weight, [m.down_proj.weight], 1.0),
                  (ours.norm1.weight, [theirs.input_layernorm.weight], 1.0),
                  (ours.norm2.weight, [theirs.post_attention_layernorm.weight], 1.0)]
    assert len(pairs) == len(list(lm.parameters()))
    assert sum(len(theirs) for _, theirs, _ in pairs) == len(list(hf.parameters()))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
        for ours, theirs, scale in pairs:
            ours.copy_(torch.cat(theirs) * scale)
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    g = randn(2, 9, 50, seed=2).double()
    out = lm(tokens)
    out.backward(g)
    out_hf = hf(tokens).logits
    out_hf.backward(g)
    assert_close_scaled(out.detach(), out_hf.detach(), TOL, "logits")
    for ours, theirs, scale in pairs:
        assert_close_scaled(ours.grad, torch.cat([t.grad for t in theirs]) / scale, TOL, f"grad of {theirs[0].shape}")
