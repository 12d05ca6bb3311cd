"""TransformerEncoderLayer / TransformerEncoder: against torch.nn.TransformerEncoderLayer (via from_torch,
dropout off) forward and every gradient, pre-/post-LN, relu/gelu, padding; padding invariance,
causality, incremental decoding, use inside another model, dropout statistics, the backward arena,
bad input. The CPU cases run the same hand-written backward as CUDA, on the PyTorch references.
CUDA: fp32 (TF32 off), fp16/bf16 and autocast by the 2x-PyTorch rule, peak memory vs torch.nn,
no new allocations after the first training step."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import lsmini.layers.decoder
import lsmini.layers.encoder
from lsmini import _backend
from lsmini.layers import TransformerConfig, TransformerEncoder, TransformerEncoderLayer, arena
from layer_testing import DEVICES, _one_thread, _poison_arena, no_tf32  # noqa: F401  (fixtures)
from util import assert_close_fp32, assert_dropout_keep_stats, assert_lowp_rule, philox_keep_mask



# ---------------------------------------------------------------------------------------------- helpers ---
def perturb_(module, seed=0, scale=0.2):
    """Move every parameter off its init (LayerNorm ≠ identity, biases ≠ 0), seeded; matrices by
    scale·N(0, 1/fan_in) so activations stay O(1) at any width."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            noise = scale * torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                noise /= p.shape[1] ** 0.5
            p.add_(noise.to(p.device, p.dtype))
    return module


def padding_mask(b, l, kind, seed=0):
    """bool [b, l], True = pad; never a fully padded row (torch.nn gives NaN there)."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.zeros(b, l, dtype=torch.bool)
    if kind == "suffix":
        for i in range(1, b):
            m[i, int(torch.randint(1, l + 1, (1,), generator=gen)):] = True
    elif kind == "random":
        m = torch.rand(b, l, generator=gen) < 0.3
        m[:, int(torch.randint(0, l, (1,), generator=gen))] = False
    return m


def run(fn, inputs, grad):
    """(out, [grads of inputs]) of fn(*inputs) with one backward of grad; inputs are cloned leaves."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves if t.is_floating_point()]


def param_grads(module):
    return {n: p.grad for n, p in module.named_parameters()}


def assert_close_scaled(out, ref, tol, name):
    """fp32 rule with tolerances scaled by the reference's magnitude (gradients of weights sum over
    tokens and reach values far from 1)."""
    scale = max(1.0, ref.abs().max().item())
    assert_close_fp32(out, ref, atol=tol * scale, rtol=10 * tol, name=name)


def torch_encoder_layer(h, heads, ffn, act, pre, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    t = nn.TransformerEncoderLayer(h, heads, ffn, dropout=0.0, activation=act, batch_first=True, norm_first=pre,
                                   device=device, dtype=dtype)
    return perturb_(t, seed)


def compare_with_torch(t, m, x, mask, g, tol, causal=False):
    """Forward and every gradient of our layer m vs torch layer t (same weights) run in float64 — an
    oracle more accurate than either float32 implementation."""
    t = copy.deepcopy(t).double()
    t.zero_grad(set_to_none=True)
    m.zero_grad(set_to_none=True)
    attn_mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device,
                                                              dtype=torch.float64) if causal else None
    y_t, (dx_t,) = run(lambda a: t(a.double(), src_mask=attn_mask, src_key_padding_mask=mask, is_causal=causal),
                       [x], g.double())
    y_m, (dx_m,) = run(lambda a: m(a, mask, causal=causal), [x], g)
    assert_close_scaled(y_m, y_t, tol, "output")
    assert_close_scaled(dx_m, dx_t, tol, "grad x")
    gm = param_grads(m)
    for n, gt in param_grads(t).items():
        assert_close_scaled(gm[n], gt, tol, f"grad {n}")
    return t


CASES = [(3, 7, 32, 4, 64), (1, 1, 16, 2, 32), (4, 13, 24, 3, 40), (2, 17, 8, 1, 24)]  # batch, len, H, heads, ffn


# ------------------------------------------------- a stand-in for the CUDA extension (kernel-path glue) ---
class FakeExt:
    """The bindings the layers call, in plain PyTorch on CPU, with the contracts of csrc/ops/*.cpp: argument
    shapes/dtypes checked as the bindings check them, fresh outputs, the same return tuples, the aliasing
    the bindings do (bias_dropout_residual_bwd returns grad_out itself when p == 0; attention_softmax_fwd
    returns one tensor twice when p == 0; attention_softmax_bwd with inplace=True writes into grad_probs
    and returns it) and dropout masks regenerated from the rng tuple (seed, offset, seed_ptr, offset_ptr)
    with the Philox oracle of util."""

    def __init__(self):
        self.offset = 0
        self.calls = []

    def philox_seed_offset(self):
        self.offset += 1000
        return 1234, self.offset, 0, 0

    @staticmethod
    def _keep(shape, p, rng):
        n = 1
        for s_ in shape:
            n *= s_
        seed, offset, seed_ptr, offset_ptr = rng
        assert (seed_ptr, offset_ptr) == (0, 0), rng  # eager: the oracle needs the values themselves
        return philox_keep_mask(n, p, seed, offset).view(shape)

    @staticmethod
    def _drop(y, p, rng):
        assert isinstance(rng, tuple) and len(rng) == 4 and all(isinstance(v, int) for v in rng), rng
        if p == 0:
            assert rng == _backend.NO_RNG, rng
            return y
        return torch.where(FakeExt._keep(y.shape, p, rng), y * (1.0 / (1.0 - p)), torch.zeros_like(y))

    @staticmethod
    def _vec(v, x, name):
        assert v.shape == (x.shape[-1],), f"{name} shape {tuple(v.shape)}"
        assert v.dtype in (torch.float32, x.dtype), f"{name} dtype {v.dtype} with x {x.dtype}"

    def layernorm_fwd(self, x, w, b, eps, out=None):
        self.calls.append("layernorm_fwd")
        assert x.dim() == 2
        self._vec(w, x, "weight"), self._vec(b, x, "bias")
        xf = x.float()
        mean = xf.mean(1)
        rstd = (xf.var(1, unbiased=False) + eps).rsqrt()
        y = (xf - mean[:, None]) * rstd[:, None] * w.float() + b.float()
        if out is not None:
            assert out.data_ptr() != x.data_ptr()
        return [self._into(out, y.to(x.dtype), x), mean, rstd]

    def layernorm_bwd(self, dy, x, w, b, mean, rstd, add=None, out=None):
        self.calls.append("layernorm_bwd")
        assert dy.shape == x.shape and dy.dtype == x.dtype and x.dim() == 2
        xhat = (x.float() - mean[:, None]) * rstd[:, None]
        g = dy.float() * w.float()
        dx = rstd[:, None] * (g - g.mean(1, keepdim=True) - xhat * (g * xhat).mean(1, keepdim=True))
        if add is not None:
            assert add.shape == x.shape and add.dtype == x.dtype
            dx = dx + add.float()
        if out is not None:
            assert out.data_ptr() not in (dy.data_ptr(), x.data_ptr())
        return [self._into(out, dx.to(x.dtype), x), (dy.float() * xhat).sum(0).to(w.dtype),
                dy.float().sum(0).to(b.dtype)]

    def bias_dropout_residual_fwd(self, x, bias, residual, p, rng):
        assert x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
        self._vec(bias, x, "bias")
        return (residual.float() + self._drop(x.float() + bias.float(), p, rng)).to(x.dtype)

    def bias_dropout_residual_bwd(self, g, p, rng, has_bias, bias_dtype=None, grad_x=None):
        assert g.dim() == 2
        if grad_x is not None:
            assert grad_x.data_ptr() != g.data_ptr()
        gx = g if p == 0 else self._into(grad_x, self._drop(g.float(), p, rng).to(g.dtype), g)
        return gx, (gx.float().sum(0).to(bias_dtype or g.dtype) if has_bias else None)

    @staticmethod
    def _act(y, act):
        return {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act](y)

    @staticmethod
    def _into(out, y, like):
        """y written into out (the bindings' optional output: like's shape and dtype, contiguous)."""
        if out is None:
            return y
        assert out.shape == like.shape and out.dtype == like.dtype and out.is_contiguous()
        return out.copy_(y)

    def bias_act_dropout_fwd(self, x, bias, act, p, rng, out=None):
        assert x.dim() == 2
        self._vec(bias, x, "bias")
        return self._into(out, self._drop(self._act(x.float() + bias.float(), act), p, rng).to(x.dtype), x)

    def bias_act_dropout_bwd(self, g, x, bias, act, p, rng, grad_x=None, from_output=False):
        assert g.shape == x.shape and g.dtype == x.dtype and x.dim() == 2
        if from_output:  # x is relu's output: the gradient passes where it is > 0, scaled as the dropout
            assert act == "relu"
            gy = torch.where(x > 0, g.float() / (1 - p), 0.0)
            return self._into(grad_x, gy.to(x.dtype), g), gy.sum(0).to(bias.dtype)
        y = (x.float() + bias.float()).requires_grad_(True)
        with torch.enable_grad():
            (gy,) = torch.autograd.grad(self._act(y, act), y, self._drop(g.float(), p, rng))
        return self._into(grad_x, gy.to(x.dtype), g), gy.sum(0).to(bias.dtype)

    def split_heads_fwd(self, x, bias, heads, parts):
        assert x.dim() == 3 and x.shape[2] % (parts * heads) == 0
        self._vec(bias, x, "bias")
        b, l, w = x.shape
        y = (x.float() + bias.float()).to(x.dtype)
        return y.view(b, l, parts, heads, w // (parts * heads)).permute(2, 0, 3, 1, 4).contiguous()

    def split_heads_bwd(self, g5, has_bias, bias_fp32=False):
        assert g5.dim() == 5
        parts, b, h, l, d = g5.shape
        gx = g5.permute(1, 3, 0, 2, 4).contiguous().view(b, l, parts * h * d)
        return gx, (gx.float().sum((0, 1)).to(torch.float32 if bias_fp32 else g5.dtype) if has_bias else None)

    def merge_heads_fwd(self, x):
        assert x.dim() == 4
        b, h, l, d = x.shape
        return x.transpose(1, 2).contiguous().view(b, l, h * d)

    def merge_heads_bwd(self, g, heads):
        assert g.dim() == 3
        b, l, w = g.shape
        return g.view(b, l, heads, w // heads).transpose(1, 2).contiguous()

    def attention_softmax_fwd(self, scores, kpm, causal, p, rng):
        assert scores.dim() == 4
        b, _, q, k = scores.shape
        if kpm is not None:
            assert kpm.dtype == torch.bool and kpm.shape == (b, k), tuple(kpm.shape)
        from lsmini.ops.attention_softmax import attention_softmax_ref
        sm = attention_softmax_ref(scores, kpm, causal, 0.0, False)
        if p == 0:
            self._drop(sm, p, rng)  # checks the rng of a call without dropout
            return sm, sm
        return self._drop(sm.float(), p, rng).to(sm.dtype), sm

    def attention_softmax_bwd(self, gp, sm, p, rng, inplace=False):
        assert gp.shape == sm.shape and gp.dtype == sm.dtype
        g = self._drop(gp.float(), p, rng)
        y = sm.float()
        ds = (y * (g - (y * g).sum(-1, keepdim=True))).to(sm.dtype)
        if inplace:
            assert gp.is_contiguous()
            return gp.copy_(ds)
        return ds


@pytest.fixture
def fake_kernels(monkeypatch):
    """The layers take their kernel path on CPU, through FakeExt."""
    fake = FakeExt()
    monkeypatch.setattr(_backend, "ext", lambda: fake)
    monkeypatch.setattr(_backend, "dropout_rng",
                        lambda p, device: fake.philox_seed_offset() if p > 0 else _backend.NO_RNG)
    for mod in (lsmini.layers.encoder, lsmini.layers.decoder):
        monkeypatch.setattr(mod, "use_kernels", lambda x: True)
    return fake


# ------------------------------------------------------------------------------------------ config ---
def test_config_validation():
    TransformerConfig(64, 8, 256)
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(30, 4, 64)
    with pytest.raises(ValueError, match="activation"):
        TransformerConfig(32, 4, 64, activation="swish")
    with pytest.raises(ValueError, match="dropout"):
        TransformerConfig(32, 4, 64, dropout=1.0)
    with pytest.raises(ValueError, match="max_seq_len"):
        TransformerConfig(32, 4, 64, max_seq_len=20000)
    with pytest.raises(ValueError, match="hidden_size"):
        TransformerConfig(65536, 4, 64)
    with pytest.raises(ValueError, match="ffn_size"):
        TransformerConfig(32, 4, 0)
    with pytest.raises(TypeError, match="num_heads"):
        TransformerConfig(32, 4.0, 64)
    with pytest.raises(ValueError, match="layer_norm_eps"):
        TransformerConfig(32, 4, 64, layer_norm_eps=0.0)
    with pytest.raises(TypeError, match="TransformerConfig"):
        TransformerEncoderLayer({"hidden_size": 32})


# -------------------------------------------------------------------------------- vs torch.nn (CPU) ---
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "suffix", "random"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_matches_torch_cpu(pre, act, case, mask_kind, recompute):
    b, l, h, heads, ffn = case
    t = torch_encoder_layer(h, heads, ffn, act, pre)
    m = TransformerEncoderLayer.from_torch(t)
    m.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, l, h, generator=gen)
    g = torch.randn(b, l, h, generator=gen)
    mask = None if mask_kind == "none" else padding_mask(b, l, mask_kind)
    compare_with_torch(t, m, x, mask, g, tol=2e-5)


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_kernel_path_glue_matches_torch(fake_kernels, pre, act, recompute):
    """The kernel path of the layer (binding calls, returned tuples, aliasing, scratch layout) against
    torch.nn, with the extension replaced by a CPU stand-in that follows the bindings' contracts."""
    t = torch_encoder_layer(24, 3, 40, act, pre)
    m = TransformerEncoderLayer.from_torch(t)
    m.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(4, 9, 24, generator=gen), torch.randn(4, 9, 24, generator=gen)
    compare_with_torch(t, m, x, padding_mask(4, 9, "random"), g, tol=2e-5)
    compare_with_torch(t, m, x, None, g, tol=2e-5, causal=True)
    assert "layernorm_bwd" in fake_kernels.calls


@pytest.mark.parametrize("pre", [True, False])
def test_kernel_path_glue_dropout_recompute(fake_kernels, pre):
    """With dropout on, the kernel path's recompute (same seed/offset) gives what saving gives."""
    cfg = TransformerConfig(32, 4, 64, dropout=0.2, attn_dropout=0.3, activation_dropout=0.25, pre_layer_norm=pre)
    torch.manual_seed(0)
    a = perturb_(TransformerEncoderLayer(cfg))
    b = TransformerEncoderLayer(cfg)
    b.load_state_dict(a.state_dict())
    b.recompute = False
    x, g = torch.randn(3, 8, 32), torch.randn(3, 8, 32)
    mask = padding_mask(3, 8, "suffix")
    fake_kernels.offset = 0
    torch.manual_seed(5)  # the reference attention (fp32) draws its dropout mask from torch's generator
    ya, (dxa,) = run(lambda u: a(u, mask), [x], g)
    fake_kernels.offset = 0
    torch.manual_seed(5)  # the reference attention (fp32) draws its dropout mask from torch's generator
    yb, (dxb,) = run(lambda u: b(u, mask), [x], g)
    torch.testing.assert_close(ya, yb, atol=0, rtol=0)
    torch.testing.assert_close(dxa, dxb, atol=1e-6, rtol=1e-5)
    gb = param_grads(b)
    for n, gr in param_grads(a).items():
        torch.testing.assert_close(gr, gb[n], atol=1e-6, rtol=1e-5, msg=lambda msg: f"{n}: {msg}")
    assert (ya - a.eval()(x, mask)).abs().max() > 1e-3  # dropout did act


@pytest.mark.parametrize("pre", [True, False])
def test_matches_torch_causal_and_gelu_tanh_cpu(pre):
    t = torch_encoder_layer(32, 4, 48, nn.GELU(approximate="tanh"), pre)
    m = TransformerEncoderLayer.from_torch(t)
    assert m.config.activation == "gelu_tanh"
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(3, 9, 32, generator=gen), torch.randn(3, 9, 32, generator=gen)
    compare_with_torch(t, m, x, padding_mask(3, 9, "suffix"), g, tol=2e-5, causal=True)


def test_state_dict_and_to_torch_roundtrip():
    t = torch_encoder_layer(32, 4, 64, "gelu", False)
    m = TransformerEncoderLayer(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0,
                                                  activation="gelu", pre_layer_norm=False))
    m.load_state_dict(t.state_dict())  # same names and shapes as torch.nn
    assert set(m.state_dict()) == set(t.state_dict())
    back = m.to_torch()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(back(x), t(x))
    torch.testing.assert_close(m(x), t(x), atol=2e-5, rtol=1e-4)


def test_from_torch_rejects_unsupported():
    t = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, bias=False)
    with pytest.raises(ValueError, match="bias"):
        TransformerEncoderLayer.from_torch(t)
    t = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, activation=torch.tanh)
    with pytest.raises(ValueError, match="activation"):
        TransformerEncoderLayer.from_torch(t)
    with pytest.raises(TypeError, match="TransformerEncoderLayer"):
        TransformerEncoderLayer.from_torch(nn.Linear(4, 4))


# ----------------------------------------------------------------------------- properties (CPU + CUDA) ---
def _layer(device, pre=True, h=32, heads=4, ffn=64, **kw):
    cfg = TransformerConfig(h, heads, ffn, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0, pre_layer_norm=pre,
                            **kw)
    torch.manual_seed(0)
    return perturb_(TransformerEncoderLayer(cfg)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_padding_invariance(device, pre):
    m = _layer(device, pre)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 11, 32, generator=gen).to(device)
    mask = padding_mask(4, 11, "random", seed=4).to(device)
    x2 = torch.where(mask.unsqueeze(-1), 100 * torch.randn(x.shape, generator=gen).to(device), x)
    y1, y2 = m(x, mask), m(x2, mask)
    real = ~mask
    torch.testing.assert_close(y1[real], y2[real], atol=1e-6, rtol=1e-6)
    assert torch.isfinite(y1).all() and torch.isfinite(y2).all()


@pytest.mark.parametrize("device", DEVICES)
def test_fully_padded_row_is_finite(device):
    m = _layer(device)
    x = torch.randn(3, 6, 32, device=device, requires_grad=True)
    mask = torch.zeros(3, 6, dtype=torch.bool, device=device)
    mask[1] = True
    y = m(x, mask)
    y.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_causality(device):
    m = _layer(device)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 10, 32, generator=gen).to(device)
    t = 6
    x2 = x.clone()
    x2[:, t + 1:] = torch.randn(2, 10 - t - 1, 32, generator=gen).to(device)
    y1, y2 = m(x, causal=True), m(x2, causal=True)
    torch.testing.assert_close(y1[:, :t + 1], y2[:, :t + 1], atol=1e-6, rtol=1e-6)
    assert (y1[:, t + 1:] - y2[:, t + 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_incremental_equals_full(device, pre):
    enc = TransformerEncoder(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=0.0, activation_dropout=0.0,
                                               pre_layer_norm=pre), 2)
    torch.manual_seed(0)
    perturb_(enc).to(device).eval()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 8, 32, generator=gen).to(device)
    mask = torch.zeros(3, 8, dtype=torch.bool, device=device)
    mask[2, 0] = True  # a left-padded row
    full = enc(x, mask, causal=True)
    cache = {}
    steps = [enc(x[:, i:i + 1], mask[:, :i + 1], causal=True, cache=cache) for i in range(8)]
    assert cache["step"] == 8
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-4)
    # two new positions at once continue the same sequence
    cache = {}
    part = [enc(x[:, :5], mask[:, :5], causal=True, cache=cache), enc(x[:, 5:], mask, causal=True, cache=cache)]
    torch.testing.assert_close(torch.cat(part, 1), full, atol=2e-5, rtol=1e-4)


def test_reorder_cache():
    enc = perturb_(TransformerEncoder(TransformerConfig(16, 2, 32, dropout=0.0, attn_dropout=0.0,
                                                         activation_dropout=0.0), 2)).eval()
    x = torch.randn(3, 5, 16)
    cache = {}
    for i in range(4):
        enc(x[:, i:i + 1], causal=True, cache=cache)
    order = torch.tensor([2, 0, 0])
    enc.reorder_cache(cache, order)
    last = enc(x[order, 4:5], causal=True, cache=cache)
    full = enc(x[order], causal=True)
    torch.testing.assert_close(last, full[:, 4:5], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_trains_inside_another_model(device):
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=0.0,
                                                      activation_dropout=0.0))
    model = nn.Sequential(nn.Linear(8, 32), layer, nn.Linear(32, 8)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 6, 8, generator=gen).to(device)
    target = torch.roll(x, 1, dims=1) * 0.5
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------------------------------------- dropout ---
def _zeroed(device, **drop):
    cfg = TransformerConfig(32, 4, 64, **{"dropout": 0.0, "attn_dropout": 0.0, "activation_dropout": 0.0, **drop})
    m = TransformerEncoderLayer(cfg).to(device)
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
        m.norm1.weight.fill_(1.0)
        m.norm2.weight.fill_(1.0)
    return m.train()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_residual_dropout_statistics_and_backward_mask(device, p):
    """Only the attention output bias is 1: out − x = dropout(1) elementwise, so the mask is visible; the
    bias gradient of sum(out) counts the kept elements — the backward uses the forward's mask."""
    m = _zeroed(device, dropout=p)
    with torch.no_grad():
        m.self_attn.out_proj.bias.fill_(1.0)
    x = torch.randn(16, 64, 32, device=device)
    y = m(x)
    keep = (y - x).detach() > 0.5 / (1 - p)
    assert_dropout_keep_stats(keep.view(-1, 32), p)
    kept_vals = (y - x)[keep]
    torch.testing.assert_close(kept_vals, torch.full_like(kept_vals, 1 / (1 - p)), atol=1e-5, rtol=1e-5)
    y.sum().backward()
    expect = keep.view(-1, 32).float().sum(0) / (1 - p)
    torch.testing.assert_close(m.self_attn.out_proj.bias.grad, expect, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_activation_dropout_statistics_and_backward_mask(device, p):
    """linear1.bias = 1 so act = 1 everywhere; linear2 copies hidden units f < 32 to the output: out − x
    shows the activation-dropout mask; linear1.bias's gradient counts what backward kept."""
    m = _zeroed(device, activation_dropout=p)
    with torch.no_grad():
        m.linear1.bias.fill_(1.0)
        m.linear2.weight[:, :32].copy_(torch.eye(32))
    x = torch.randn(16, 64, 32, device=device)
    y = m(x)
    keep = (y - x).detach() > 0.5 / (1 - p)
    assert_dropout_keep_stats(keep.view(-1, 32), p)
    y.sum().backward()
    expect = keep.view(-1, 32).float().sum(0) / (1 - p)
    torch.testing.assert_close(m.linear1.bias.grad[:32], expect, atol=1e-3, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_attention_dropout_statistics(device, p):
    """Q = K = 0 and V = 1: the softmax is uniform (1/len), so each output is (#kept keys)/(len·(1 − p));
    the overall keep rate must be 1 − p."""
    m = _zeroed(device, attn_dropout=p)
    h = 32
    with torch.no_grad():
        m.self_attn.in_proj_bias[2 * h:].fill_(1.0)
        m.self_attn.out_proj.weight.copy_(torch.eye(h))
    b, l = 32, 64
    x = torch.randn(b, l, h, device=device)
    y = m(x)
    kept = ((y - x) * l * (1 - p)).round()  # [b, l, h]: per (row, head) the count, repeated over head_dim
    per_head = kept.view(b, l, 4, 8)[..., 0]
    assert (per_head >= 0).all() and (per_head <= l).all()
    n = per_head.numel() * l
    rate = per_head.sum().item() / n
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(rate - (1 - p)) <= 5 * sd, (rate, 1 - p, sd)
    # different rows/heads drop different keys
    assert per_head.float().std() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_reproducible_and_off_in_eval(device):
    cfg = TransformerConfig(32, 4, 64, dropout=0.2, attn_dropout=0.2, activation_dropout=0.2)
    torch.manual_seed(0)
    m = perturb_(TransformerEncoderLayer(cfg)).to(device)
    x = torch.randn(2, 9, 32, device=device)
    torch.manual_seed(123)
    a = m(x)
    torch.manual_seed(123)
    b = m(x)
    c = m(x)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (a - c).abs().max() > 1e-3
    m.eval()
    ref = TransformerEncoderLayer(TransformerConfig(32, 4, 64, dropout=0.0, attn_dropout=0.0,
                                                    activation_dropout=0.0)).to(device)
    ref.load_state_dict(m.state_dict())
    torch.testing.assert_close(m(x), ref(x), atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------- arena ---
@pytest.mark.parametrize("device", DEVICES)
def test_arena_sized_once_and_returns_fresh_grads(device):
    """After the first step the arena does not grow or move; returned gradients never alias it."""
    arena.release()
    enc = TransformerEncoder(TransformerConfig(32, 4, 64, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                                               max_batch_tokens=4096), 3).to(device)
    x = torch.randn(4, 12, 32, device=device, requires_grad=True)
    mask = padding_mask(4, 12, "suffix").to(device)
    seen = []
    for _ in range(4):
        x.grad = None
        enc(x, mask).square().mean().backward()
        (a,) = [s for s in arena.stats() if s["device"].type == torch.device(device).type]
        buf = arena.get_arena(x.device, x.dtype).buffer
        seen.append((a["numel"], a["grows"], buf.data_ptr()))
        base = buf.untyped_storage().data_ptr()
        for g in [x.grad] + [p.grad for p in enc.parameters()]:
            assert g.untyped_storage().data_ptr() != base
    assert seen[0][1] == 1 and all(s == seen[0] for s in seen), seen
    need = enc.scratch_numel(4, 12)
    assert seen[0][0] >= need


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("pre", [True, False])
@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_saves_only_what_backward_needs(device, pre, recompute, act):
    """The bytes a layer saves for backward (parameters aside), counted with saved-tensor hooks, are
    exactly: input, Q/K/V, attention context, the second block's input (pre-LN) or the two residual
    sums and the first LayerNorm's output (post-LN), the first FFN GEMM's output — relu: its activation
    instead —, the padding mask (+ per-row LayerNorm statistics on the kernel path); without recompute
    also the LayerNorm outputs (pre-LN) and (gelu) the FFN activation. Attention saves no [len, len]
    tensor at all."""
    b, l, h, heads, ffn = 4, 16, 32, 4, 64
    m = _layer(device, pre, h, heads, ffn, activation=act)
    m.recompute = recompute
    x = torch.randn(b, l, h, device=device, requires_grad=True)
    mask = padding_mask(b, l, "suffix").to(device)
    params = {p.data_ptr() for p in m.parameters()}
    seen = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x, mask)
    t, e = b * l, 4
    units = (6 if pre else 8) * t * h + t * ffn  # x, qkv (3), ctx, r1 | x, qkv, ctx, s1, ln1 out, s2; + f1
    if not recompute:
        units += (2 * t * h if pre else 0) + (t * ffn if act != "relu" else 0)  # LN outputs, activation
    expect = units * e + b * l  # + the bool mask
    if device == "cuda":
        expect += 2 * 2 * t * 4  # mean and rstd of two LayerNorms, float32
    assert sum(seen.values()) == expect, (sum(seen.values()), expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_blocks_batched_equals_cast_block(device, dtype):
    """The layer's one-launch parameter cast gives what cast_block gives per tensor: GEMM weights in the
    compute dtype, float32 vectors as they are (the same tensors), others cast; on CUDA every cast
    lands 128-byte aligned in one buffer."""
    from lsmini.layers._common import cast_block, cast_blocks_batched

    m = TransformerEncoderLayer(TransformerConfig(32, 4, 72)).to(device)
    params = [p for blk in m.blocks() for p in blk]
    params[3] = params[3].double()  # a vector neither float32 nor dtype: cast too
    got = cast_blocks_batched(params, dtype)
    want = cast_block(params[:6], dtype) + cast_block(params[6:], dtype)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and torch.equal(g, w), i
        if w is params[i]:
            assert g is params[i], i
        elif device == "cuda":
            assert g.data_ptr() % 128 == 0 and g.untyped_storage().data_ptr() == got[0].untyped_storage().data_ptr()


# ------------------------------------------------------------------------------------------- bad input ---
def test_bad_inputs():
    m = _layer("cpu", max_seq_len=16, max_batch_tokens=40)
    with pytest.raises(ValueError, match="hidden_size=32"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="max_seq_len = 16"):
        m(torch.randn(1, 17, 32))
    with pytest.raises(ValueError, match="max_batch_tokens = 40"):
        m(torch.randn(3, 14, 32))
    with pytest.raises(TypeError, match="torch.bool"):
        m(torch.randn(2, 5, 32), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"\(batch, len\) = \(2, 5\)"):
        m(torch.randn(2, 5, 32), torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.randn(2, 5, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="len >= 1"):
        m(torch.randn(2, 0, 32))
    with pytest.raises(ValueError, match="causal=True"):
        m(torch.randn(2, 1, 32), cache={})
    with pytest.raises(ValueError, match="cached 16"):
        cache = {}
        m.eval()
        m(torch.randn(1, 16, 32), causal=True, cache=cache)
        m(torch.randn(1, 1, 32), causal=True, cache=cache)


def test_autocast_cpu_bf16():
    """fp32 parameters under CPU autocast compute in bfloat16 and return bfloat16; fp32 gradients."""
    m = _layer("cpu")
    x = torch.randn(2, 7, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and m.linear1.weight.grad.dtype == torch.float32
    ref = m(x.detach())
    assert (y.float() - ref).abs().max() < 0.1


# ================================================================================================= CUDA ===
def _lowp_setup(pre, act, dtype, case, seed=0, autocast=False):
    """(torch fp32 oracle with the weights rounded to dtype, torch.nn in dtype, ours, x, mask, g).
    Ours holds dtype parameters, or — with autocast — the same values in float32 (it is then run under
    torch.autocast and computes in dtype as well)."""
    b, l, h, heads, ffn = case
    t32 = torch_encoder_layer(h, heads, ffn, act, pre, device="cuda", seed=seed)
    with torch.no_grad():
        for p in t32.parameters():
            p.copy_(p.to(dtype).float())
    t_lp = torch_encoder_layer(h, heads, ffn, act, pre, device="cuda", seed=seed)
    t_lp.load_state_dict(t32.state_dict())
    m = TransformerEncoderLayer.from_torch(t_lp if autocast else t_lp.to(dtype))
    t_lp = t_lp.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, l, h, generator=gen).to("cuda", dtype).float()
    g = torch.randn(b, l, h, generator=gen).to("cuda", dtype).float()
    mask = padding_mask(b, l, "suffix", seed).cuda()
    return t32, t_lp, m, x, mask, g


CUDA_CASES = [(3, 7, 64, 4, 256), (8, 128, 256, 8, 1024), (5, 33, 96, 3, 160), (2, 257, 128, 2, 512)]


@pytest.mark.cuda
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("case", CUDA_CASES)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_matches_torch_fp32(pre, act, case, recompute, no_tf32):
    b, l, h, heads, ffn = case
    t = torch_encoder_layer(h, heads, ffn, act, pre, device="cuda")
    m = TransformerEncoderLayer.from_torch(t)
    m.recompute = recompute
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(b, l, h, generator=gen).cuda(), torch.randn(b, l, h, generator=gen).cuda()
    compare_with_torch(t, m, x, padding_mask(b, l, "random").cuda(), g, tol=5e-5)
    compare_with_torch(t, m, x, None, g, tol=5e-5, causal=True)


def plain_attention():
    """torch.nn's attention through PyTorch's unfused math backend: the 'plain PyTorch in the same low
    precision' of the 2x rule. Flash / memory-efficient SDPA keep the scores in fp32 registers — a
    fused kernel, not the plain reference; lsmini (like plain PyTorch) materialises the scores and
    probabilities in the activation dtype between its GEMMs and the softmax kernel."""
    return sdpa_kernel(SDPBackend.MATH)


def _lowp_compare(t32, t_lp, m, x, mask, g, dtype, autocast=False):
    """The 2x rule on the output and every gradient: ours (dtype parameters, or float32 ones under
    autocast) vs torch.nn in dtype with plain attention, both against the fp32 oracle; atol is 1e-3 of
    the quantity's magnitude."""
    y32, (dx32,) = run(lambda a: t32(a, src_key_padding_mask=mask), [x], g)
    with plain_attention():
        yt, (dxt,) = run(lambda a: t_lp(a.to(dtype), src_key_padding_mask=mask), [x], g.to(dtype))
    with torch.autocast("cuda", dtype=dtype, enabled=autocast):
        ym, (dxm,) = run(lambda a: m(a if autocast else a.to(dtype), mask), [x], g.to(dtype))
    assert ym.dtype == dtype
    scale = lambda r: 1e-3 * max(1.0, r.abs().max().item())  # noqa: E731 - atol relative to the magnitude
    assert_lowp_rule(ym.float(), y32, yt.float(), atol=scale(y32), name="output")
    assert_lowp_rule(dxm.float(), dx32, dxt.float(), atol=scale(dx32), name="grad x")
    g32, gt, gm = param_grads(t32), param_grads(t_lp), param_grads(m)
    for n in g32:
        assert_lowp_rule(gm[n].float(), g32[n], gt[n].float(), atol=scale(g32[n]), name=f"grad {n}")


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES[:3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_lowp_2x_torch_rule(pre, dtype, case, no_tf32):
    _lowp_compare(*_lowp_setup(pre, "gelu", dtype, case), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_autocast_2x_torch_rule(pre, dtype, no_tf32):
    """fp32 parameters under torch.autocast: the layer computes in dtype (activations included, unlike
    torch's autocast, which keeps LayerNorm and the residual stream in fp32), so the rule compares it with
    torch.nn run in dtype; parameter gradients come back in fp32."""
    setup = _lowp_setup(pre, "relu", dtype, (4, 64, 128, 4, 512), autocast=True)
    _lowp_compare(*setup, dtype, autocast=True)
    assert setup[2].linear1.weight.grad.dtype == torch.float32


@pytest.mark.cuda
def test_cuda_kernels_match_reference_path(monkeypatch, no_tf32):
    """The same layer through the kernels and through LSMINI_FORCE_REFERENCE (PyTorch ops on CUDA)."""
    m = _layer("cuda", pre=True, h=64, heads=4, ffn=128)
    x = torch.randn(3, 20, 64, device="cuda")
    g = torch.randn_like(x)
    mask = padding_mask(3, 20, "suffix").cuda()
    y_k, (dx_k,) = run(lambda a: m(a, mask), [x], g)
    gk = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    monkeypatch.setenv("LSMINI_FORCE_REFERENCE", "1")
    y_r, (dx_r,) = run(lambda a: m(a, mask), [x], g)
    assert_close_scaled(y_k, y_r, 5e-5, "output")
    assert_close_scaled(dx_k, dx_r, 5e-5, "grad x")
    for n, p in m.named_parameters():
        assert_close_scaled(gk[n], p.grad, 5e-5, f"grad {n}")


def _step_peak_bytes(step):
    """Peak bytes above the starting allocation of one training step (after a warm-up step); the
    lsmini arena is released first so that its allocation counts inside the step."""
    step()
    torch.cuda.synchronize()
    arena.release()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.cuda
def test_cuda_peak_memory_below_torch_6_layers(monkeypatch):
    """A 6-layer pre-LN stack's training step (AMP fp16, dropout 0.1) peaks below torch.nn's in eager."""
    arena.set_poison(False)
    h, heads, ffn, b, l = 512, 8, 2048, 32, 128
    cfg = TransformerConfig(h, heads, ffn, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                            max_batch_tokens=b * l, max_seq_len=l)
    ours = TransformerEncoder(cfg, 6).cuda()
    layer = nn.TransformerEncoderLayer(h, heads, ffn, dropout=0.1, batch_first=True, norm_first=True, device="cuda")
    theirs = nn.TransformerEncoder(layer, 6, norm=nn.LayerNorm(h, device="cuda"), enable_nested_tensor=False)
    x = torch.randn(b, l, h, device="cuda")
    mask = padding_mask(b, l, "suffix").cuda()

    def step(model, call):
        def f():
            for p in model.parameters():
                p.grad = None
            with torch.autocast("cuda", dtype=torch.float16):
                y = call(model)
            y.float().square().mean().backward()
        return f

    ours_peak = _step_peak_bytes(step(ours, lambda mdl: mdl(x, mask)))
    torch_peak = _step_peak_bytes(step(theirs, lambda mdl: mdl(x, src_key_padding_mask=mask)))
    print(f"peak MB: lsmini {ours_peak / 2**20:.1f}, torch.nn {torch_peak / 2**20:.1f}")
    assert ours_peak < torch_peak, (ours_peak, torch_peak)


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_no_new_allocations_after_first_step(autocast):
    """The arena is sized in step 1 and never regrows or moves. From step 3 on, training calls cudaMalloc
    zero times (the allocator's segment count is stable), reserves no more memory and ends each step
    with the same bytes allocated (nothing leaks). Step 2 may still settle the caching allocator's pool
    (its first step starts from an empty pool, the second from step 1's cached blocks)."""
    arena.set_poison(False)
    arena.release()
    cfg = TransformerConfig(256, 8, 1024, dropout=0.1, attn_dropout=0.1, activation_dropout=0.1,
                            max_batch_tokens=4096, max_seq_len=128)
    model = TransformerEncoder(cfg, 3).cuda()
    if not autocast:
        model = model.half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = torch.float16
    x = torch.randn(16, 128, 256, device="cuda", dtype=torch.float32 if autocast else dtype)
    mask = padding_mask(16, 128, "suffix").cuda()
    allocator, arenas = [], []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            y = model(x, mask)
        y.float().square().mean().backward()
        opt.step()
        del y
        torch.cuda.synchronize()
        s = torch.cuda.memory_stats()
        (a,) = [r for r in arena.stats() if r["device"].type == "cuda" and r["dtype"] == dtype]
        arenas.append((a["numel"], a["grows"], arena.get_arena(x.device, dtype).buffer.data_ptr()))
        allocator.append((s["segment.all.allocated"], torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))
    assert arenas[0][1] == 1 and all(r == arenas[0] for r in arenas), arenas
    assert all(r == allocator[1] for r in allocator[2:]), allocator
