"""benchmarks/bench_training.py's llama config at a tiny size, through the functions the benchmark uses: the
plain PyTorch Llama (TorchLlama), the lsmini TransformerLM it maps to (lsmini_llama_state_dict) and transformers'
LlamaForCausalLM compute the same logits and loss from the same weights; the mapping places every parameter. On
the CPU lsmini runs its reference path; the CUDA test trains a few steps of the eager variants."""
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_training  # noqa: E402

# the llama config's options (rotary, RMSNorm eps, no dropout, ...) at a CPU size; head_dim 16 has a fused
# attention kernel, so on CUDA the lsmini layers take the kernel path
TINY = dict(bench_training.CONFIGS["llama"], layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=128, batch=2,
            len=16)


def perturbed_torch_model(cfg=TINY):
    """TorchLlama with every parameter random and large enough that attention, rotary and each norm weight
    change the logits (Llama's N(0, 0.02) initialisation leaves them near uniform)."""
    tm = bench_training.build_torch_model(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in tm.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if name.endswith("layernorm.weight") or name == "model.norm.weight"
                    else noise / math.sqrt(p.shape[-1]))
    return tm


def test_the_mapping_places_every_parameter_once():
    tm = bench_training.build_torch_model(TINY)
    sd = tm.state_dict()
    mapped = bench_training.lsmini_llama_state_dict(sd, TINY["layers"])
    lm = bench_training.build_lsmini_model(TINY, tm)
    assert set(mapped) == set(lm.state_dict())  # and build_lsmini_model loads them strictly
    for name, value in lm.state_dict().items():
        assert torch.equal(value, mapped[name]), name
    d, kv, h = TINY["hidden"] // TINY["heads"], TINY["kv_heads"], TINY["heads"]
    qkv = lm.decoder.layers[1].self_attn.in_proj_weight
    assert qkv.shape == ((h + 2 * kv) * d, TINY["hidden"])  # rows [Q | K | V]
    assert torch.equal(qkv[h * d:(h + kv) * d], sd["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(lm.decoder.layers[0].linear1.weight[TINY["ffn"]:], sd["model.layers.0.mlp.up_proj.weight"])
    assert lm.output_projection is not None and lm.embed.padding_idx is None and lm.embed.scale == 1.0

    with pytest.raises(ValueError, match="model.extra"):  # a parameter left over
        bench_training.lsmini_llama_state_dict(dict(sd, **{"model.extra": torch.zeros(1)}), TINY["layers"])
    with pytest.raises(KeyError):  # a parameter missing
        bench_training.lsmini_llama_state_dict({k: v for k, v in sd.items() if "up_proj" not in k}, TINY["layers"])


def test_plain_pytorch_and_lsmini_give_the_same_loss():
    tm = perturbed_torch_model()
    lm = bench_training.build_lsmini_model(TINY, tm)
    inputs, targets = bench_training.make_batches(TINY, 1)[0]
    torch_loss = bench_training.TorchLoss(tm, bench_training.label_smoothing(TINY))(inputs, targets)
    lsmini_loss = bench_training.lsmini_loss_fn(TINY, lm)(inputs, targets)
    assert bench_training.label_smoothing(TINY) == 0.0
    assert torch_loss.item() > 1.0  # the perturbed model is far from uniform and from the targets
    torch.testing.assert_close(lsmini_loss, torch_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm(inputs), tm(inputs), rtol=1e-4, atol=1e-4)
    # the same gradients too, in lsmini's fused layout
    torch_loss.backward()
    lsmini_loss.backward()
    attn = tm.model.layers[1].self_attn
    torch.testing.assert_close(lm.decoder.layers[1].self_attn.in_proj_weight.grad,
                               torch.cat([attn.q_proj.weight.grad, attn.k_proj.weight.grad, attn.v_proj.weight.grad]),
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(lm.embed.weight.grad, tm.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-5)


def test_transformers_llama_loads_the_plain_weights_and_agrees():
    pytest.importorskip("transformers")
    tm = perturbed_torch_model()
    hf = bench_training.build_hf_model(TINY, tm).train()
    assert hf.config._attn_implementation == "sdpa"
    inputs, targets = bench_training.make_batches(TINY, 1)[0]
    logits = tm(inputs)
    torch.testing.assert_close(hf(input_ids=inputs).logits, logits, rtol=1e-4, atol=1e-4)
    # HFLoss: Hugging Face shifts the labels itself, so its loss covers the first n − 1 targets
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, TINY["vocab"]), targets[:, :-1].reshape(-1))
    torch.testing.assert_close(bench_training.HFLoss(hf)(inputs, targets), expected, rtol=1e-4, atol=1e-4)


def test_hf_variants_are_skipped_where_they_cannot_run():
    lm_config = dict(bench_training.CONFIGS["lm"], layers=1, hidden=32, heads=2, ffn=64, vocab=64, batch=2, len=8)
    with pytest.raises(bench_training.SkipVariant, match="llama config only"):
        bench_training.make_trainer(lm_config, "hf-eager")
    try:
        import liger_kernel  # noqa: F401
    except Exception:
        with pytest.raises(bench_training.SkipVariant, match="liger_kernel does not import"):
            bench_training.build_hf_model(TINY, bench_training.build_torch_model(TINY), liger=True)


def test_the_llama_config_and_its_variants():
    cfg = bench_training.CONFIGS["llama"]
    assert (cfg["layers"], cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["ffn"], cfg["vocab"]) == \
        (12, 768, 12, 4, 2048, 32000)
    assert bench_training.tokens_per_step(cfg) == 8 * 1024
    assert bench_training.half_dtype(cfg) == torch.bfloat16 and bench_training.dropout(cfg) == 0.0
    assert bench_training.half_dtype(bench_training.CONFIGS["lm"]) == torch.float16  # the others unchanged
    assert "llama" not in bench_training.DEFAULT_CONFIGS
    assert bench_training.default_variants("base") == bench_training.VARIANTS
    assert set(bench_training.default_variants("llama")) >= {"lsmini", "lsmini+graph", "lsmini+compile", "eager",
                                                             "compiled", "compiled-graphs", "hf-eager", "hf-compiled",
                                                             "hf-compiled+skip-mask", "hf-liger"}
    # about 125M parameters: 12 layers of 6.3M (attention 1.6M with grouped K/V, SwiGLU 4.7M) + 2 × 24.6M tables
    with torch.device("meta"):  # shapes only
        n = sum(p.numel() for p in bench_training.TorchLlama(cfg).parameters())
    assert 124e6 < n < 126e6


@pytest.mark.cuda
def test_eager_variants_train_on_the_gpu_from_the_same_loss():
    """A few steps of each eager variant of the tiny llama on CUDA (the compiled ones take minutes to compile and
    hf-liger patches transformers' Llama for the whole process, so they are left to the benchmark itself)."""
    batches = [tuple(t.cuda() for t in b) for b in bench_training.make_batches(TINY, 6, seed=1)]
    curves = {}
    for variant in ("eager", "lsmini", "lsmini+graph", "hf-eager"):
        try:
            step = bench_training.make_trainer(TINY, variant)
        except bench_training.SkipVariant:  # hf-eager without transformers
            continue
        losses = [step(*b).clone().float().item() for b in batches]  # a graph step reuses its output tensor
        assert all(math.isfinite(v) for v in losses), (variant, losses)
        curves[variant] = losses
    # the same initial weights, batches and AdamW settings; bf16 roundings differ, and hf-eager's loss leaves
    # out the last position
    for variant, losses in curves.items():
        for i in (0, -1):
            assert abs(losses[i] - curves["eager"][i]) < 0.05 * curves["eager"][i], curves
