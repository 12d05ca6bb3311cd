"""TransformerEmbedding: against an independent formulation (float64 sinusoids, plain indexing), gradients,
padding, positions offset by step, learned positions, dropout statistics, bad input; CUDA kernel vs the
reference path (fp32 tight, fp16/bf16 by the 2x-PyTorch rule)."""
import math

import pytest
import torch

import lsmini
from lsmini.layers import TransformerEmbedding
from util import assert_close_fp32, assert_dropout_keep_stats, assert_lowp_rule

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
DEVICES = ["cpu", CUDA]


def sinusoids(n, h):
    """[n, h] float64: column i < h/2 is sin(pos·10000^(−2i/h)), column h/2 + i the cosine."""
    pos = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(h // 2, dtype=torch.float64)
    angle = pos / torch.pow(10000.0, 2 * i / h)
    return torch.cat([angle.sin(), angle.cos()], 1)


def expected(emb, tokens, step=0):
    """Plain formulation in float64 of sqrt(h)·W[t] + pos[step + j], pads zero."""
    w = emb.weight.detach().double().cpu()
    h = w.shape[1]
    pos = emb.pos_embedding.detach().double().cpu() if emb.learned_positions else sinusoids(emb.max_seq_len, h)
    t = tokens.cpu()
    out = w[t] * math.sqrt(h) + pos[step:step + t.shape[1]].unsqueeze(0)
    if emb.padding_idx is not None:
        out[t == emb.padding_idx] = 0
    return out


def tokens_with_pads(b, l, vocab, pad, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (b, l), generator=gen)
    t[t == pad] = (pad + 1) % vocab
    if l > 2:
        t[0, -2:] = pad
    return t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("shape", [(3, 7), (1, 1), (2, 33)])
def test_forward_backward(device, learned, shape):
    b, l = shape
    torch.manual_seed(0)
    emb = TransformerEmbedding(50, 16, padding_idx=1, max_seq_len=64, dropout=0.0, learned_positions=learned).to(device)
    tokens = tokens_with_pads(b, l, 50, 1).to(device)
    for step in (0, 5):
        y = emb(tokens, step)
        assert y.shape == (b, l, 16) and y.dtype == torch.float32
        assert_close_fp32(y.cpu(), expected(emb, tokens, step).float(), atol=1e-5, rtol=1e-5)
    emb.zero_grad()
    g = torch.randn(b, l, 16, device=device)
    emb(tokens, 3).backward(g)
    gw = torch.zeros(50, 16, dtype=torch.float64)
    real = tokens.cpu() != 1
    gw.index_add_(0, tokens.cpu()[real], g.cpu().double()[real] * 4.0)
    assert_close_fp32(emb.weight.grad.cpu(), gw.float(), atol=1e-5, rtol=1e-5, name="weight grad")
    assert (emb.weight.grad[1] == 0).all()
    if learned:
        gp = torch.zeros(64, 16, dtype=torch.float64)
        gp[3:3 + l] = (g.cpu().double() * real.unsqueeze(-1)).sum(0)
        assert_close_fp32(emb.pos_embedding.grad.cpu(), gp.float(), atol=1e-5, rtol=1e-5, name="position grad")


def test_module_properties():
    emb = TransformerEmbedding(30, 8, padding_idx=0, max_seq_len=12, dropout=0.1)
    assert (emb.weight[0] == 0).all()
    assert "pos_table" not in emb.state_dict() and list(emb.state_dict()) == ["weight"]
    half = TransformerEmbedding(30, 8, padding_idx=None, max_seq_len=12, dropout=0.0).half()
    assert half(torch.tensor([[3, 4]])).dtype == torch.float16
    assert "padding_idx=0" in repr(emb)
    emb2 = TransformerEmbedding(30, 8, padding_idx=-1, max_seq_len=12, dropout=0.0)
    assert emb2.padding_idx == 29


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout(device, p):
    emb = TransformerEmbedding(100, 64, padding_idx=None, max_seq_len=128, dropout=p).to(device)
    tokens = torch.randint(0, 100, (16, 128), device=device)
    emb.eval()
    clean = emb(tokens)
    emb.train()
    torch.manual_seed(5)
    y = emb(tokens)
    keep = y != 0
    assert_dropout_keep_stats(keep.view(-1, 64), p)
    torch.testing.assert_close(y[keep], (clean / (1 - p))[keep], atol=1e-5, rtol=1e-5)
    torch.manual_seed(5)
    torch.testing.assert_close(emb(tokens), y, atol=0, rtol=0)


def test_bad_inputs():
    with pytest.raises(ValueError, match="even hidden_size"):
        TransformerEmbedding(10, 7, 0, 16, 0.0)
    TransformerEmbedding(10, 7, 0, 16, 0.0, learned_positions=True)
    with pytest.raises(ValueError, match="dropout"):
        TransformerEmbedding(10, 8, 0, 16, 1.0)
    with pytest.raises(ValueError, match="padding_idx"):
        TransformerEmbedding(10, 8, 10, 16, 0.0)
    emb = TransformerEmbedding(10, 8, 0, 16, 0.0)
    with pytest.raises(ValueError, match="max_seq_len = 16"):
        emb(torch.zeros(1, 10, dtype=torch.long), step=7)
    with pytest.raises(ValueError, match=r"\[batch, len\]"):
        emb(torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        emb(torch.tensor([[3, 10]]))
    with pytest.raises(TypeError, match="int64 or int32"):
        emb(torch.zeros(1, 3))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_kernel_vs_reference(dtype, monkeypatch):
    torch.manual_seed(0)
    emb = TransformerEmbedding(1000, 256, padding_idx=0, max_seq_len=256, dropout=0.0).cuda()
    tokens = tokens_with_pads(8, 200, 1000, 0).cuda()
    g = torch.randn(8, 200, 256, device="cuda")
    emb32 = emb
    ref = expected(emb32, tokens)
    emb_lp = TransformerEmbedding(1000, 256, padding_idx=0, max_seq_len=256, dropout=0.0).cuda().to(dtype)
    emb_lp.load_state_dict(emb32.state_dict())
    y = emb_lp(tokens)
    y.backward(g.to(dtype))
    monkeypatch.setattr(lsmini.config, "reference", True)
    emb_ref = TransformerEmbedding(1000, 256, padding_idx=0, max_seq_len=256, dropout=0.0).cuda().to(dtype)
    emb_ref.load_state_dict(emb32.state_dict())
    y_ref = emb_ref(tokens)
    y_ref.backward(g.to(dtype))
    if dtype == torch.float32:
        assert_close_fp32(y.cpu(), ref.float(), atol=1e-5, rtol=1e-5)
        assert_close_fp32(emb_lp.weight.grad, emb_ref.weight.grad, atol=1e-4, rtol=1e-5, name="weight grad")
    else:
        # plain PyTorch in the same precision: the reference path's ops on low-precision tensors
        plain = (emb_lp.weight.detach()[tokens] * math.sqrt(256) + emb_lp.pos_table[:200]).masked_fill(
            (tokens == 0).unsqueeze(-1), 0)
        assert_lowp_rule(y.float().cpu(), ref.float(), plain.float().cpu(), atol=1e-3)
        gw = torch.zeros(1000, 256, dtype=torch.float64, device="cuda")
        real = tokens != 0
        gw.index_add_(0, tokens[real], g.double()[real] * 16.0)
        plain_gw = torch.zeros(1000, 256, dtype=dtype, device="cuda").index_add_(0, tokens[real],
                                                                                  g.to(dtype)[real] * 16.0)
        assert_lowp_rule(emb_lp.weight.grad.float(), gw.float(), plain_gw.float(), atol=1e-2, name="weight grad")
