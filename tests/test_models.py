"""lsmini.models: Transformer (encoder-decoder) and TransformerLM — shapes, shared/tied embeddings, training on a
toy task, causality, incremental decoding equal to full decoding (with beam-style reorder_cache), autocast;
CUDA: kernels vs the reference path end to end, fp16/bf16 parameters, no new allocations after step 1."""
import pytest
import torch

import lsmini
from lsmini.layers import CrossEntropyLoss, TransformerConfig
from lsmini.models import Transformer, TransformerLM
from layer_testing import DEVICES, _one_thread, _poison_freed_memory  # noqa: F401  (fixtures)


def cfg(pre=True, p=0.0, **kw):
    return TransformerConfig(32, 4, 64, dropout=p, attn_dropout=p, activation_dropout=p, pre_layer_norm=pre, **kw)


def tokens(b, l, vocab, seed=0, pad_tail=True):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(3, vocab, (b, l), generator=gen)
    if pad_tail and b > 1 and l > 2:
        t[1, -2:] = 0
    return t


def test_construction():
    m = Transformer(40, 40, cfg(), 2, 2, share_embeddings=True)
    assert m.src_embed is m.tgt_embed and m.output_weight() is m.tgt_embed.weight
    m = Transformer(40, 50, cfg(), 1, 1, tie_output=False)
    assert m.output_projection.weight.shape == (50, 32)
    with pytest.raises(ValueError, match="share_embeddings"):
        Transformer(40, 50, cfg(), share_embeddings=True)
    with pytest.raises(TypeError, match="TransformerConfig"):
        TransformerLM(40, None, 2)
    lm = TransformerLM(40, cfg(), 2)
    assert lm(tokens(2, 5, 40)).shape == (2, 5, 40)
    with pytest.raises(TypeError, match="int64"):
        lm(torch.randn(2, 5))
    with pytest.raises(ValueError, match="max_seq_len"):
        TransformerLM(40, cfg(max_seq_len=8), 1)(tokens(1, 9, 40))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pre", [True, False])
def test_transformer_learns_copy_task(device, pre):
    torch.manual_seed(0)
    model = Transformer(20, 20, cfg(pre, p=0.1), 2, 2, share_embeddings=True).to(device)
    crit = CrossEntropyLoss(label_smoothing=0.1, ignore_index=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    src = tokens(16, 9, 20, seed=1).to(device)
    bos = torch.full((16, 1), 1, device=device)
    tgt_in, tgt_out = torch.cat([bos, src[:, :-1]], 1), src
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = crit(model(src, tgt_in), tgt_out)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("device", DEVICES)
def test_transformer_incremental_decoding_equals_full(device):
    torch.manual_seed(0)
    model = Transformer(30, 25, cfg(), 2, 3).to(device).eval()
    src = tokens(3, 7, 30, seed=2).to(device)
    tgt = tokens(3, 6, 25, seed=3, pad_tail=False).to(device)
    enc, mask = model.encode(src)
    full = model.decode(tgt, enc, mask)
    cache = {}
    steps = [model.decode(tgt[:, i:i + 1], enc, mask, cache=cache) for i in range(4)]
    torch.testing.assert_close(torch.cat(steps, 1), full[:, :4], atol=3e-5, rtol=1e-4)
    order = torch.tensor([2, 2, 0], device=device)
    model.reorder_cache(cache, order)
    enc, mask = enc[order], mask[order]
    rest = [model.decode(tgt[order, i:i + 1], enc, mask, cache=cache) for i in range(4, 6)]
    torch.testing.assert_close(torch.cat(rest, 1), model.decode(tgt[order], enc, mask)[:, 4:], atol=3e-5, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_lm_causal_and_incremental(device):
    torch.manual_seed(0)
    lm = TransformerLM(30, cfg(), 2, tie_output=False, learned_positions=True).to(device).eval()
    x = tokens(3, 8, 30, seed=4).to(device)
    full = lm(x)
    x2 = x.clone()
    x2[:, 5:] = 7
    torch.testing.assert_close(lm(x2)[:, :5], full[:, :5], atol=1e-6, rtol=1e-6)
    cache = {}
    steps = [lm(x[:, i:i + 1], cache=cache) for i in range(8)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=3e-5, rtol=1e-4)
    assert cache["padding_mask"].shape == (3, 8)
    cache = {}
    lm(x[:, :5], cache=cache)
    lm.reorder_cache(cache, torch.tensor([0, 0, 2], device=device))
    last = lm(x[[0, 0, 2], 5:6], cache=cache)
    torch.testing.assert_close(last, full[[0, 0, 2], 5:6], atol=3e-5, rtol=1e-4)


def test_autocast_cpu_bf16_training_step():
    torch.manual_seed(0)
    model = Transformer(30, 30, cfg(p=0.1), 1, 1)
    src, tgt = tokens(2, 6, 30), tokens(2, 5, 30, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
        loss = CrossEntropyLoss(ignore_index=0)(logits, tgt)
    assert logits.dtype == torch.bfloat16
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters())


# ================================================================================================= CUDA ===
@pytest.mark.cuda
@pytest.mark.parametrize("pre", [True, False])
def test_cuda_kernels_match_reference_path_end_to_end(pre, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    torch.manual_seed(0)
    model = Transformer(500, 600, TransformerConfig(128, 4, 256, dropout=0.0, attn_dropout=0.0,
                                                    activation_dropout=0.0, pre_layer_norm=pre), 2, 3).cuda()
    src, tgt = tokens(6, 37, 500).cuda(), tokens(6, 29, 600, seed=1).cuda()

    def step():
        model.zero_grad()
        logits = model(src, tgt)
        CrossEntropyLoss(label_smoothing=0.1, ignore_index=0)(logits, tgt).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lk, gk = step()
    monkeypatch.setattr(lsmini.config, "reference", True)
    lr, gr = step()
    torch.testing.assert_close(lk, lr, atol=1e-4, rtol=1e-4)
    for n in gk:
        scale = max(1e-3, gr[n].abs().max().item())
        torch.testing.assert_close(gk[n], gr[n], atol=1e-4 * scale, rtol=1e-3, msg=lambda m: f"{n}: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_lowp_parameters_train(dtype):
    torch.manual_seed(0)
    model = Transformer(100, 100, cfg(p=0.1, max_batch_tokens=4096), 2, 2, share_embeddings=True).cuda().to(dtype)
    src = tokens(16, 20, 100).cuda()
    tgt_in = torch.cat([torch.ones(16, 1, dtype=torch.long, device="cuda"), src[:, :-1]], 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = CrossEntropyLoss(ignore_index=0)(model(src, tgt_in), src)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


@pytest.mark.cuda
def test_cuda_transformer_no_new_allocations_after_first_step():
    """A full encoder-decoder AMP training step: from step 3 on no cudaMalloc, no new reserved memory, the same
    bytes allocated after each step (see the encoder test for why step 2 may still settle the allocator's
    pool)."""
    torch.manual_seed(0)
    model = Transformer(1000, 1000, TransformerConfig(256, 8, 1024, max_batch_tokens=4096, max_seq_len=128),
                        3, 3, share_embeddings=True).cuda()
    model.src_embed.check_tokens = False
    crit = CrossEntropyLoss(label_smoothing=0.1, ignore_index=0, check_targets=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    src, tgt = tokens(32, 100, 1000).cuda(), tokens(32, 90, 1000, seed=1).cuda()
    records = []
    for _ in range(5):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = crit(model(src, tgt), tgt)
        loss.backward()
        opt.step()
        del loss
        torch.cuda.synchronize()
        s = torch.cuda.memory_stats()
        records.append((s["segment.all.allocated"], torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))
    for r in records[2:]:
        assert r == records[1], records
