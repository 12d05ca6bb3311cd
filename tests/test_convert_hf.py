"""lsmini.convert on Hugging Face transformers models (lsmini/convert_hf.py): small random GPT-2, BERT, Llama
(grouped K/V heads), Mistral and Qwen2 (Q/K/V biases) models built in code, converted against their unconverted
copies — logits, loss and every parameter gradient (float32 on CPU, eager and sdpa attention, no / left / right
padding), generate() token for token, hidden states, gradient checkpointing, save_pretrained / from_pretrained
both ways, unconvert, the configs and calls that are kept or refused and the report. On CUDA: bf16/fp16
autocast accuracy against float64 on the kernel path (grouped K/V heads too), generate() and
torch.compile. Skipped when transformers is not installed."""
import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lsmini  # noqa: E402
from layer_testing import _one_thread, _poison_freed_memory, perturb_  # noqa: E402,F401  (fixtures)
from lsmini import convert_hf  # noqa: E402
from lsmini.layers import runtime  # noqa: E402
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, BertModel,  # noqa: E402
                          GPT2Config, GPT2LMHeadModel, GPT2Model, LlamaConfig, LlamaForCausalLM, LlamaModel,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

VOCAB = 61
IMPLS = ["sdpa", "eager"]
PADDINGS = ["none", "left", "right"]


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers logs about padding side and token ids of these tiny configs; nothing here depends on it."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    yield
    transformers.logging.set_verbosity(verbosity)


def gpt2_config(**kw):
    base = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2Config(**{**base, **kw})


def bert_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                pad_token_id=0)
    return BertConfig(**{**base, **kw})


def decoder_config(family, **kw):
    """Llama with grouped K/V heads (4 → 2), Mistral with one K/V head per query head (no sliding window),
    Qwen2 (biases on Q/K/V) with 4 → 1."""
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, rms_norm_eps=1e-5, attention_dropout=0.0, pad_token_id=0,
                bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**{**base, "num_key_value_heads": 2, **kw})
    if family == "mistral":
        return MistralConfig(**{**base, "num_key_value_heads": 4, "sliding_window": None, **kw})
    return Qwen2Config(**{**base, "num_key_value_heads": 1, **kw})


DECODERS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}
CONVERTED = {"llama": "ConvertedLlamaDecoderLayer", "mistral": "ConvertedMistralDecoderLayer",
             "qwen2": "ConvertedQwen2DecoderLayer"}


def build(cls, config, impl="sdpa", seed=0):
    torch.manual_seed(seed)
    model = perturb_(cls(config), seed)
    model.set_attn_implementation(impl)
    return model


def converted_copy(model):
    new = copy.deepcopy(model)
    report = lsmini.convert(new)
    return new, report


def batch(padding, b=3, l=10, seed=1):
    """Token ids and the attention mask (1 = token): row 0 padded on the chosen side, row 1 less so."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (b, l), generator=g)
    mask = torch.ones(b, l, dtype=torch.long)
    if padding == "left":
        mask[0, :4], mask[1, :1] = 0, 0
    elif padding == "right":
        mask[0, 6:], mask[1, 9:] = 0, 0
    return ids.masked_fill(mask == 0, 0), mask


def causal_labels(ids, mask):
    """Labels whose every predicting position (the one before) is a real token: outputs at padded positions
    are unspecified in lsmini (and a left-padded row's last pad would predict its first token)."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return labels


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def forward_backward(model, ids, mask, labels, **kw):
    """(output, parameter gradients) of one forward with labels and its backward. A converted causal LM's
    fused loss forms no logits: they come from a call without labels (the models here have no dropout)."""
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=labels, **kw)
    out.loss.backward()
    if out.logits is None:
        with torch.no_grad():
            out.logits = model(ids, attention_mask=mask, **kw).logits
    return out, grads(model)


def assert_same_grads(ours, want, rtol=1e-4, atol=1e-6):
    assert ours.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(ours[name], want[name], rtol=rtol, atol=atol, msg=name)


# ---- GPT-2 ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padding", PADDINGS)
def test_gpt2_logits_loss_and_gradients(impl, padding):
    ref = build(GPT2LMHeadModel, gpt2_config(), impl)
    model, report = converted_copy(ref)
    assert [type(b).__name__ for b in model.transformer.h] == ["ConvertedGPT2Block"] * 2
    ids, mask = batch(padding)
    labels = causal_labels(ids, mask)
    want, want_grads = forward_backward(ref, ids, mask, labels, use_cache=False)
    ours, our_grads = forward_backward(model, ids, mask, labels, use_cache=False)
    real = mask.bool()
    torch.testing.assert_close(ours.logits[real], want.logits[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)


def test_gpt2_scale_by_inverse_layer_idx_and_unscaled_attention():
    """scale_attn_by_inverse_layer_idx divides the scale by layer_idx + 1; scale_attn_weights=False drops
    head_dim^-0.5: both reach the layer's options (a wrong scale fails the comparison)."""
    for cfg in (dict(scale_attn_by_inverse_layer_idx=True), dict(scale_attn_weights=False),
                dict(activation_function="relu", n_inner=48)):
        ref = build(GPT2LMHeadModel, gpt2_config(**cfg))
        model, report = converted_copy(ref)
        assert len(report) == 4, report  # the loss, two blocks, the final LayerNorm
        ids, mask = batch("left")
        labels = causal_labels(ids, mask)
        want, want_grads = forward_backward(ref, ids, mask, labels)
        ours, our_grads = forward_backward(model, ids, mask, labels)
        torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
        assert_same_grads(our_grads, want_grads)


def test_gpt2_training_with_the_default_cache_matches():
    """use_cache defaults to True: a training forward fills a DynamicCache (the layer runs as usual and also
    writes K/V); loss and gradients as without."""
    ref = build(GPT2LMHeadModel, gpt2_config())
    model, _ = converted_copy(ref)
    ids, mask = batch("right")
    labels = causal_labels(ids, mask)
    want, want_grads = forward_backward(ref, ids, mask, labels)
    ours, our_grads = forward_backward(model, ids, mask, labels)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)
    for (k, v), (k_want, v_want) in zip([(la.keys, la.values) for la in ours.past_key_values.layers],
                                        [(la.keys, la.values) for la in want.past_key_values.layers]):
        torch.testing.assert_close(k, k_want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, v_want.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padding", ["none", "left"])
def test_gpt2_generate_is_token_identical(impl, padding):
    ref = build(GPT2LMHeadModel, gpt2_config(), impl).eval()
    model, _ = converted_copy(ref)
    ids, mask = batch(padding, l=8)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, **kw)
    ours = model.generate(ids, **kw)
    assert torch.equal(ours, want)
    assert torch.equal(model.generate(ids, num_beams=3, **kw), ref.generate(ids, num_beams=3, **kw))


def test_gpt2_model_hidden_states_and_gradient_checkpointing():
    """Also after a call with output_hidden_states before convert: transformers then hooks every block and
    attention module for the outputs it can record, which convert leaves in place."""
    ref = build(GPT2Model, gpt2_config(n_layer=3))
    ids, mask = batch("left")
    ref(ids, attention_mask=mask, output_hidden_states=True)
    model, report = converted_copy(ref)
    assert len(report) == 4 and not report.kept, report
    want = ref(ids, attention_mask=mask, output_hidden_states=True)
    ours = model(ids, attention_mask=mask, output_hidden_states=True)
    assert len(ours.hidden_states) == len(want.hidden_states) == 4
    real = mask.bool()
    for a, b in zip(ours.hidden_states, want.hidden_states):
        torch.testing.assert_close(a[real], b[real], rtol=1e-4, atol=1e-5)
    lm_ref = build(GPT2LMHeadModel, gpt2_config())
    lm, _ = converted_copy(lm_ref)
    for m in (lm_ref, lm):
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        m.train()
    labels = causal_labels(ids, mask)
    want, want_grads = forward_backward(lm_ref, ids, mask, labels, use_cache=False)
    ours, our_grads = forward_backward(lm, ids, mask, labels, use_cache=False)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)


# ---- BERT -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padding", PADDINGS)
def test_bert_masked_lm_logits_loss_and_gradients(impl, padding):
    ref = build(BertForMaskedLM, bert_config(), impl)
    model, report = converted_copy(ref)
    assert [type(b).__name__ for b in model.bert.encoder.layer] == ["ConvertedBertLayer"] * 2
    ids, mask = batch(padding)
    labels = ids.masked_fill(mask == 0, -100)
    want, want_grads = forward_backward(ref, ids, mask, labels)
    ours, our_grads = forward_backward(model, ids, mask, labels)
    real = mask.bool()
    torch.testing.assert_close(ours.logits[real], want.logits[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)


@pytest.mark.parametrize("padding", ["none", "right"])
def test_bert_sequence_classification(padding):
    """(Right padding only: the pooler reads position 0, a pad in a left-padded row.)"""
    ref = build(BertForSequenceClassification, bert_config(num_labels=3, hidden_act="gelu_new"), "eager")
    model, report = converted_copy(ref)
    assert len(report) == 3, report  # two layers and the embeddings' LayerNorm
    ids, mask = batch(padding)
    labels = torch.tensor([0, 2, 1])
    want, want_grads = forward_backward(ref, ids, mask, labels)
    ours, our_grads = forward_backward(model, ids, mask, labels)
    torch.testing.assert_close(ours.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)


def test_bert_model_without_mask_and_with_a_4d_mask():
    ref = build(BertModel, bert_config())
    model, _ = converted_copy(ref)
    ids, mask = batch("none")
    torch.testing.assert_close(model(ids).last_hidden_state, ref(ids).last_hidden_state, rtol=1e-4, atol=1e-5)
    causal = torch.tril(torch.ones(10, 10, dtype=torch.bool))[None, None].expand(3, 1, 10, 10)
    with pytest.raises(ValueError, match="attention_mask is not key padding"):
        model.encoder(model.embeddings(ids), attention_mask=causal)


# ---- Llama, Mistral, Qwen2 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("family", list(DECODERS))
def test_decoder_logits_loss_and_gradients(family, impl, padding):
    ref = build(DECODERS[family], decoder_config(family), impl)
    model, report = converted_copy(ref)
    assert [type(b).__name__ for b in model.model.layers] == [CONVERTED[family]] * 2 and not report.kept, report
    ids, mask = batch(padding)
    labels = causal_labels(ids, mask)
    want, want_grads = forward_backward(ref, ids, mask, labels, use_cache=False)
    ours, our_grads = forward_backward(model, ids, mask, labels, use_cache=False)
    real = mask.bool()
    torch.testing.assert_close(ours.logits[real], want.logits[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)
    if family == "qwen2":  # the Q/K/V biases are there and learn through the joined bias
        assert model.model.layers[0].self_attn.k_proj.bias is not None
        assert our_grads["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0


@pytest.mark.parametrize("config", [dict(attention_bias=True, mlp_bias=True), dict(num_key_value_heads=4),
                                    dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=500.0)),
                                    dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                              original_max_position_embeddings=16)),
                                    dict(rope_parameters=dict(rope_type="llama3", factor=8.0, rope_theta=10000.0,
                                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                                              original_max_position_embeddings=8))],
                         ids=["biases", "mha", "rope-linear", "rope-yarn", "rope-llama3"])
def test_llama_biases_and_rope_scaling(config):
    """Every bias Llama can have (attention_bias: Q/K/V and O; mlp_bias: gate/up and down) is a bias of the
    layer; scaled rotary positions arrive in the cos/sin the model computes (yarn also scales them)."""
    ref = build(LlamaForCausalLM, decoder_config("llama", **config))
    model, report = converted_copy(ref)
    assert len(report) == 3 and not report.kept, report  # the loss and two blocks
    ids, mask = batch("left", l=24)
    labels = causal_labels(ids, mask)
    want, want_grads = forward_backward(ref, ids, mask, labels, use_cache=False)
    ours, our_grads = forward_backward(model, ids, mask, labels, use_cache=False)
    real = mask.bool()
    torch.testing.assert_close(ours.logits[real], want.logits[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)


def test_llama_training_with_the_default_cache_matches():
    """use_cache defaults to True: the first call writes K/V (after rotary, grouped heads) into the DynamicCache
    as the unconverted model does."""
    ref = build(LlamaForCausalLM, decoder_config("llama"))
    model, _ = converted_copy(ref)
    ids, mask = batch("right")
    labels = causal_labels(ids, mask)
    want, want_grads = forward_backward(ref, ids, mask, labels)
    ours, our_grads = forward_backward(model, ids, mask, labels)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)
    for ours_layer, want_layer in zip(ours.past_key_values.layers, want.past_key_values.layers):
        assert ours_layer.keys.shape == (3, 2, 10, 8)
        torch.testing.assert_close(ours_layer.keys, want_layer.keys.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours_layer.values, want_layer.values.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("family", list(DECODERS))
def test_decoder_generate_is_token_identical(family, impl, padding):
    ref = build(DECODERS[family], decoder_config(family), impl).eval()
    model, _ = converted_copy(ref)
    ids, mask = batch(padding, l=8)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, **kw)
    ours = model.generate(ids, **kw)
    assert torch.equal(ours, want)
    assert torch.equal(model.generate(ids, num_beams=3, **kw), ref.generate(ids, num_beams=3, **kw))


def test_llama_dropout_hidden_states_and_gradient_checkpointing():
    """attention_dropout reaches the layer in training (two calls differ), not in eval; hidden states of
    LlamaModel and gradient checkpointing as unconverted."""
    ref = build(LlamaForCausalLM, decoder_config("llama", attention_dropout=0.2))
    model, _ = converted_copy(ref)
    ids, mask = batch("left")
    labels = causal_labels(ids, mask)
    first, second = (model(ids, attention_mask=mask, labels=labels, use_cache=False).loss for _ in range(2))
    assert first != second
    ref.eval(), model.eval()
    torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).loss,
                               ref(ids, attention_mask=mask, labels=labels).loss, rtol=1e-5, atol=1e-6)
    base = build(LlamaModel, decoder_config("llama", num_hidden_layers=3))
    converted, report = converted_copy(base)
    assert len(report) == 3 and not report.kept, report
    want = base(ids, attention_mask=mask, output_hidden_states=True)
    ours = converted(ids, attention_mask=mask, output_hidden_states=True)
    assert len(ours.hidden_states) == len(want.hidden_states) == 4
    real = mask.bool()
    for a, b in zip(ours.hidden_states, want.hidden_states):
        torch.testing.assert_close(a[real], b[real], rtol=1e-4, atol=1e-5)
    lm_ref = build(LlamaForCausalLM, decoder_config("llama"))
    lm, _ = converted_copy(lm_ref)
    for m in (lm_ref, lm):
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        m.train()
    want, want_grads = forward_backward(lm_ref, ids, mask, labels, use_cache=False)
    ours, our_grads = forward_backward(lm, ids, mask, labels, use_cache=False)
    torch.testing.assert_close(ours.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(our_grads, want_grads)


@pytest.mark.parametrize("case, family, config, reason", [
    ("mistral-window", "mistral", dict(sliding_window=4096), "sliding-window attention"),
    ("qwen2-window", "qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
     "sliding-window attention"),
    ("activation", "llama", dict(hidden_act="gelu"), "GELUActivation"),
    ("head-dim", "llama", dict(head_dim=16), "heads · head_dim = 4 · 16 != hidden size 32"),
    ("pretraining-tp", "llama", dict(pretraining_tp=2), "pretraining_tp is 2"),
])
def test_unconvertible_decoder_configs_are_kept_whole(case, family, config, reason):
    model = build(DECODERS[family], decoder_config(family, **config))
    before = {n: type(m) for n, m in model.named_modules()}
    report, kept = _kept(model)
    assert sorted(kept) == ["model.layers.0", "model.layers.1"] and all(reason in r for r in kept.values()), kept
    assert not report.replaced
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_decoder_kept_for_attention_implementation_partial_biases_and_norm_eps():
    model = build(Qwen2ForCausalLM, decoder_config("qwen2", num_hidden_layers=3))
    layers = model.model.layers
    layers[0].self_attn.config = copy.copy(layers[0].self_attn.config)
    layers[0].self_attn.config._attn_implementation = "flex_attention"
    layers[1].self_attn.k_proj.bias = None
    layers[2].post_attention_layernorm.variance_epsilon = 1e-3
    report, kept = _kept(model)
    assert "flex_attention" in kept["model.layers.0"]
    assert "q_proj, k_proj and v_proj do not all have a bias" in kept["model.layers.1"]
    assert "RMSNorms' eps differ" in kept["model.layers.2"]
    assert not report.replaced


def test_qwen2_sliding_window_kept_only_where_it_binds():
    """max_window_layers = 1: layer 0 attends fully (converted), layer 1 through a window (kept)."""
    ref = build(Qwen2ForCausalLM, decoder_config("qwen2", use_sliding_window=True, sliding_window=4,
                                                 max_window_layers=1), "eager")
    model, report = converted_copy(ref)
    assert [type(b).__name__ for b in model.model.layers] == ["ConvertedQwen2DecoderLayer", "Qwen2DecoderLayer"]
    assert [k.name for k in report.kept] == ["model.layers.1"]
    ids, mask = batch("right")
    real = mask.bool()
    torch.testing.assert_close(model(ids, attention_mask=mask, use_cache=False).logits[real],
                               ref(ids, attention_mask=mask, use_cache=False).logits[real], rtol=1e-4, atol=1e-5)


# ---- checkpoints and unconvert --------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "bert", *DECODERS])
def test_save_pretrained_and_from_pretrained_both_ways(family, tmp_path):
    cls, config = {"gpt2": (GPT2LMHeadModel, gpt2_config()), "bert": (BertForMaskedLM, bert_config())}.get(
        family) or (DECODERS[family], decoder_config(family))
    ref = build(cls, config)
    model, _ = converted_copy(ref)
    assert list(model.state_dict()) == list(ref.state_dict())
    model.save_pretrained(tmp_path / "converted")
    plain = cls.from_pretrained(tmp_path / "converted")
    for name, value in ref.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name
    # the other way: a fresh model's weights into the converted one, through from_pretrained's files
    other = build(cls, config, seed=7)
    other.save_pretrained(tmp_path / "plain")
    loaded = cls.from_pretrained(tmp_path / "plain")
    lsmini.convert(loaded)
    ids, mask = batch("right")
    real = mask.bool()
    torch.testing.assert_close(loaded(ids, attention_mask=mask).logits[real],
                               other(ids, attention_mask=mask).logits[real], rtol=1e-4, atol=1e-5)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(model(ids, attention_mask=mask).logits[real],
                               other(ids, attention_mask=mask).logits[real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm_loss_is_fused_with_labels_while_training(family, tmp_path):
    """With labels while autograd records, a converted causal LM's loss is the fused output projection +
    cross-entropy: Hugging Face's loss and gradients (labels shifted, ignore_index, num_items_in_batch,
    shift_labels), no logits in the output. Without labels, under no_grad or with return_dict=False it is the
    model's own forward; the class, and so save_pretrained's config, stay."""
    ref = build(GPT2LMHeadModel, gpt2_config()) if family == "gpt2" else build(LlamaForCausalLM,
                                                                               decoder_config("llama"))
    model, report = converted_copy(ref)
    assert report.replaced[0] == (("", type(ref).__name__, "fused linear + cross-entropy loss"))
    ids, mask = batch("right")
    labels = causal_labels(ids, mask)
    for kw in ({}, {"num_items_in_batch": torch.tensor(11)}, {"shift_labels": labels.roll(-1, 1)}):
        out, our_grads = forward_backward(model, ids, mask, labels, use_cache=False, **kw)
        want, want_grads = forward_backward(ref, ids, mask, labels, use_cache=False, **kw)
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        assert_same_grads(our_grads, want_grads)
    assert model(ids, attention_mask=mask, labels=labels, use_cache=False).logits is None
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
        want = ref(ids, attention_mask=mask, labels=labels, use_cache=False)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert out.logits is not None
    as_tuple = model(ids, attention_mask=mask, labels=labels, use_cache=False, return_dict=False)
    assert isinstance(as_tuple, tuple) and as_tuple[1].shape == (*ids.shape, VOCAB)
    twin = copy.deepcopy(model)
    assert type(model) is type(ref) and twin.forward.model is twin
    model.save_pretrained(tmp_path)
    assert type(ref).from_pretrained(tmp_path).config.architectures == [type(ref).__name__]


def test_unconvert_restores_the_hugging_face_classes():
    ref = build(GPT2LMHeadModel, gpt2_config())
    model, _ = converted_copy(ref)
    params = [id(p) for p in model.parameters()]
    report = lsmini.unconvert(model)
    assert sorted(r.torch_type for r in report.replaced) == ["GPT2Block", "GPT2Block", "GPT2LMHeadModel", "LayerNorm"]
    assert [type(b) for b in model.transformer.h] == [transformers.models.gpt2.modeling_gpt2.GPT2Block] * 2
    assert [id(p) for p in model.parameters()] == params
    ids, mask = batch("left")
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    assert len(lsmini.convert(model)) == 4  # and again


def test_unconvert_restores_the_llama_classes():
    ref = build(LlamaForCausalLM, decoder_config("llama"))
    model, _ = converted_copy(ref)
    params = [id(p) for p in model.parameters()]
    report = lsmini.unconvert(model)
    assert [r.torch_type for r in report.replaced] == ["LlamaForCausalLM"] + ["LlamaDecoderLayer"] * 2
    assert [type(b) for b in model.model.layers] == [transformers.models.llama.modeling_llama.LlamaDecoderLayer] * 2
    assert "forward" not in model.__dict__  # the fused-loss forward is gone: the class's again
    assert [id(p) for p in model.parameters()] == params
    ids, mask = batch("left")
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits)
    assert len(lsmini.convert(model)) == 3


def test_convert_reuses_the_parameters_and_skips_converted_blocks():
    model = build(BertForMaskedLM, bert_config())
    params = {n: id(p) for n, p in model.named_parameters()}
    lsmini.convert(model)
    assert {n: id(p) for n, p in model.named_parameters()} == params
    again = lsmini.convert(model)
    assert len(again) == 0 and not again.kept


def test_recompute_is_a_block_attribute():
    """A converted block recomputes by default; recompute = False, set on one block, reaches that block's layer
    options only, and unconvert leaves the Hugging Face block working."""
    for model in (build(GPT2LMHeadModel, gpt2_config()), build(BertForMaskedLM, bert_config()),
                  build(LlamaForCausalLM, decoder_config("llama"))):
        lsmini.convert(model)
        blocks = [m for m in model.modules() if convert_hf.is_converted(m)]
        assert len(blocks) == 2 and all(b.recompute and b._lsmini_options().recompute for b in blocks)
        blocks[0].recompute = False
        assert [b._lsmini_options().recompute for b in blocks] == [False, True]
        lsmini.unconvert(model)
        ids, mask = batch("right")
        model(ids, attention_mask=mask)


# ---- what is kept, what raises, the report --------------------------------------------------------------------
def _kept(model):
    report = lsmini.convert(model)
    return report, {k.name: k.reason for k in report.kept}


@pytest.mark.parametrize("case, cls, config, reason", [
    ("cross-attention", GPT2LMHeadModel, gpt2_config(add_cross_attention=True), "cross-attention"),
    ("activation", GPT2LMHeadModel, gpt2_config(activation_function="gelu_fast"), "FastGELUActivation"),
    ("decoder", BertForMaskedLM, bert_config(is_decoder=True), "decoder"),
    ("activation", BertModel, bert_config(hidden_act="silu"), "SiLU"),
])
def test_unconvertible_configs_are_kept_whole_and_reported(case, cls, config, reason):
    model = build(cls, config)
    before = {n: type(m) for n, m in model.named_modules()}
    report, kept = _kept(model)
    blocks = [n for n, t in before.items() if t.__name__ in ("GPT2Block", "BertLayer")]
    assert sorted(kept) == sorted(blocks) and all(reason in kept[n] for n in blocks), kept
    for name in blocks:  # kept whole: nothing inside them replaced
        assert all(type(m) is before[f"{name}.{n}" if n else name]
                   for n, m in model.get_submodule(name).named_modules())


def test_kept_for_attention_implementation_dropouts_hooks_and_dtypes():
    model = build(GPT2LMHeadModel, gpt2_config(n_layer=5))
    h = model.transformer.h
    h[0].attn.config = copy.copy(h[0].attn.config)
    h[0].attn.config._attn_implementation = "flash_attention_2"
    h[1].mlp.dropout.p = 0.3
    h[2].mlp.c_fc.register_forward_hook(lambda *a: None)
    h[3].ln_1.to(torch.float64)
    h[4].attn.forward = lambda *args, **kwargs: None
    report, kept = _kept(model)
    assert "attn forward is replaced on the instance" in kept["transformer.h.4"]
    assert "flash_attention_2" in kept["transformer.h.0"]
    assert "residual dropouts differ" in kept["transformer.h.1"]
    assert "mlp.c_fc has forward_hooks" in kept["transformer.h.2"]
    assert "mix dtypes" in kept["transformer.h.3"]
    assert [r.name for r in report.replaced] == ["transformer.ln_f"]


def test_transformers_older_than_5_keeps_every_block(monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    model = build(BertModel, bert_config())
    report, kept = _kept(model)
    assert sorted(kept) == ["encoder.layer.0", "encoder.layer.1"]
    assert all("transformers 4.57.1 is installed" in r and ">= 5" in r for r in kept.values())


def test_the_report():
    model = build(GPT2LMHeadModel, gpt2_config(n_layer=2))
    model.transformer.h[1].mlp.dropout.p = 0.1
    report = lsmini.convert(model)
    assert report.replaced == [("transformer.h.0", "GPT2Block", "ConvertedGPT2Block"),
                               ("transformer.ln_f", "LayerNorm", "ConvertedLayerNorm")]
    assert [(k.name, k.type) for k in report.kept] == [("transformer.h.1", "GPT2Block")]
    text = str(report)
    assert "2 module(s) replaced, 1 kept" in text and "GPT2Block -> ConvertedGPT2Block" in text
    assert "transformer.h.1" in text and "residual dropouts differ" in text


def test_dropout_in_training_and_none_in_eval():
    """The config's dropouts reach the layer in training mode (two calls differ) and not in eval mode."""
    ref = build(GPT2LMHeadModel, gpt2_config(resid_pdrop=0.1, attn_pdrop=0.1))
    model, _ = converted_copy(ref)
    ids, mask = batch("right")
    labels = causal_labels(ids, mask)
    first, second = (model(ids, attention_mask=mask, labels=labels).loss for _ in range(2))
    assert first != second
    ref.eval(), model.eval()
    torch.testing.assert_close(model(ids, attention_mask=mask, labels=labels).loss,
                               ref(ids, attention_mask=mask, labels=labels).loss, rtol=1e-5, atol=1e-6)


def test_calls_a_converted_block_cannot_compute_raise():
    model, _ = converted_copy(build(GPT2LMHeadModel, gpt2_config()))
    ids, mask = batch("left")
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(ids, attention_mask=mask, output_attentions=True)
    bert, _ = converted_copy(build(BertModel, bert_config()))
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        bert(ids, attention_mask=mask, output_attentions=True)
    model.transformer.h[0].attn.resid_dropout.p = 0.2
    with pytest.raises(ValueError, match="differ; lsmini's layer applies one residual dropout"):
        model(ids, attention_mask=mask)
    model.eval()  # dropouts are not read in eval mode
    model(ids, attention_mask=mask)
    block = model.transformer.h[1]
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="attention_mask holds values other than 0"):
        block(x, attention_mask=torch.full((2, 1, 5, 5), -1.0))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \[2 or 1, heads or 1, 5, 5\]"):
        block(x, attention_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match="supports a DynamicCache"):
        block(x, cache=transformers.StaticCache(config=model.config, max_cache_len=16))


def test_decoder_calls_it_cannot_compute_raise():
    model, _ = converted_copy(build(LlamaForCausalLM, decoder_config("llama")))
    ids, mask = batch("left")
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(ids, attention_mask=mask, output_attentions=True)
    layer = model.model.layers[0]
    x = torch.randn(2, 5, 32)
    cos = sin = torch.ones(1, 5, 8)
    with pytest.raises(ValueError, match="position_embeddings must be the \\(cos, sin\\) tensors"):
        layer(x)
    with pytest.raises(ValueError, match=r"must both be \[2 or 1, 5, rotary dims\]"):
        layer(x, position_embeddings=(cos[:, :4], sin[:, :4]))
    with pytest.raises(ValueError, match=r"hidden_states must be a \[batch, len, 32\] tensor"):
        layer(x[0], position_embeddings=(cos, sin))
    with pytest.raises(ValueError, match="attention_mask is not padding with causal attention"):
        window = torch.tril(torch.ones(5, 5, dtype=torch.bool)) & ~torch.tril(torch.ones(5, 5, dtype=torch.bool), -2)
        layer(x, attention_mask=window[None, None].expand(2, 1, 5, 5), position_embeddings=(cos, sin))


def test_a_mask_is_checked_once_per_tensor(monkeypatch):
    """The blocks of one forward share the model's mask tensor: the first checks it (one read from the device),
    the others reuse its verdict; a write into the mask, or other sizes, check it again; inference tensors (no
    version counter) are checked every time."""
    model, _ = converted_copy(build(LlamaForCausalLM, decoder_config("llama")))
    ids, mask = batch("left")
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    model(ids, attention_mask=mask, use_cache=False)
    assert reads == [(3,)]  # one verdict read for the model's layers (more than one) together
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None, None].expand(2, 1, 5, 5).clone()
    causal[0, :, :, :2] = False  # left padding: row 0's first two keys
    causal[0, :, :2, :] = True   # transformers' form for the padded queries: every key
    pad = convert_hf.key_padding_mask("m", causal, 2, 5, 5, True)
    assert pad.tolist() == [[True, True, False, False, False], [False] * 5]
    reads.clear()
    assert convert_hf.key_padding_mask("m", causal, 2, 5, 5, True) is pad and reads == []
    assert convert_hf.key_padding_mask("m", causal[:, :, 1:], 2, 4, 5, True) is not pad  # another view, sizes
    causal[1, 0, 4, 0] = False  # no longer padding: the write is seen
    with pytest.raises(ValueError, match="attention_mask is not padding with causal attention"):
        convert_hf.key_padding_mask("m", causal, 2, 5, 5, True)
    with torch.inference_mode():
        frozen = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
        reads.clear()
        assert convert_hf.key_padding_mask("m", frozen, 2, 5, 5, True) is None
        assert convert_hf.key_padding_mask("m", frozen, 2, 5, 5, True) is None and len(reads) == 2
        assert not hasattr(frozen, "_lsmini_padding")


PACKED = [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]  # two sequences in each row of 10 tokens


@pytest.mark.parametrize("family", ["gpt2", *DECODERS])
def test_packed_sequences_are_refused(family):
    """Position ids that restart within a row, with no attention mask and no cache, make transformers build a
    packed-sequence mask, which lsmini's attention cannot follow: refused (a row's first sequence would pass for
    left padding if the padded queries' rows went unchecked)."""
    model, _ = converted_copy(build(GPT2LMHeadModel, gpt2_config()) if family == "gpt2"
                              else build(DECODERS[family], decoder_config(family)))
    ids, _ = batch("none")
    model(ids, position_ids=torch.arange(10).expand(len(ids), -1), use_cache=False)  # one sequence a row
    with pytest.raises(ValueError, match="packed sequences"):
        model(ids, position_ids=torch.tensor(PACKED).expand(len(ids), -1), use_cache=False)


_PACKED_COMPILED = """
import sys, torch, transformers
sys.path.insert(0, "tests")
from test_convert_hf import DECODERS, PACKED, batch, build, converted_copy, decoder_config
transformers.logging.set_verbosity_error()
device = sys.argv[1]
model, _ = converted_copy(build(DECODERS["llama"], decoder_config("llama")))
model = torch.compile(model.to(device), fullgraph=True)
ids = batch("none")[0].to(device)
model(ids, use_cache=False)
print("one sequence a row: ran", flush=True)
model(ids, position_ids=torch.tensor(PACKED, device=device).expand(len(ids), -1), use_cache=False)
if device == "cuda":
    torch.cuda.synchronize()
print("packed: ran", flush=True)
"""


def packed_compiled(device):
    """The packed-sequence call under torch.compile, in a process of its own: the check on the device stops
    that process."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _PACKED_COMPILED, device], capture_output=True, text=True,
                         cwd=root, timeout=600)
    assert "one sequence a row: ran" in out.stdout, out.stderr[-3000:]
    assert "packed: ran" not in out.stdout and out.returncode != 0
    return out.stderr


def test_packed_sequences_stop_a_compiled_model():
    assert "attention_mask is not padding with causal attention (packed sequences" in packed_compiled("cpu")


def test_convert_hf_needs_no_transformers_for_torch_models():
    assert convert_hf.transformers_loaded()
    assert not convert_hf.hf_block(torch.nn.Linear(2, 2))


# ---- CUDA -----------------------------------------------------------------------------------------------------
CUDA_H, CUDA_HEADS = 64, 4  # head_dim 16: the fused attention kernel


def _cuda_models(family):
    """"llama-mha": one K/V head per query head; "llama-gqa": grouped K/V heads (4 → 2); "qwen2": one K/V head,
    with Q/K/V biases. All on the kernel path."""
    if family == "gpt2":
        return build(GPT2LMHeadModel, gpt2_config(n_embd=CUDA_H, n_head=CUDA_HEADS)), causal_labels
    if family in ("llama-mha", "llama-gqa", "qwen2"):
        name = family.split("-")[0]
        kv_heads = {"llama-mha": CUDA_HEADS, "llama-gqa": CUDA_HEADS // 2, "qwen2": 1}[family]
        config = decoder_config(name, hidden_size=CUDA_H, num_attention_heads=CUDA_HEADS, num_key_value_heads=kv_heads,
                                intermediate_size=3 * CUDA_H)
        return build(DECODERS[name], config), causal_labels
    return build(BertForMaskedLM, bert_config(hidden_size=CUDA_H, num_attention_heads=CUDA_HEADS,
                                              intermediate_size=4 * CUDA_H)), \
        (lambda ids, mask: ids.masked_fill(mask == 0, -100))


def _cuda_run(model, ids, mask, labels, autocast=None):
    module = getattr(model, "_orig_mod", model)  # torch.compile's wrapper holds the model there
    module.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
        out = model(ids, attention_mask=mask, labels=labels) if "Bert" in type(module).__name__ \
            else model(ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    logits = out.logits
    if logits is None:  # a converted causal LM's fused loss: the logits from a call without labels
        with torch.no_grad(), torch.autocast("cuda", dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(ids, attention_mask=mask, use_cache=False).logits
    return logits.detach().double(), {n: p.grad.double() for n, p in module.named_parameters()}


def _error(a, b):
    return (a - b).abs().max().item()


def _grad_error(grads, want):
    return sum(((grads[n] - w) ** 2).sum() for n, w in want.items()).sqrt().item()


# the families on the GPU, and whether their layers take the kernel path
CUDA_FAMILIES = {"gpt2": True, "bert": True, "llama-mha": True, "llama-gqa": True, "qwen2": True}


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(CUDA_FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_autocast_on_the_gpu_within_twice_the_unconverted_error(family, dtype, padding, monkeypatch):
    """Against the unconverted model in float64, the converted model under autocast has logits and gradients
    (all together, as one vector) within twice the error of the unconverted model in that dtype (cast to it).
    The unconverted model in that dtype is the yardstick, not the unconverted model under autocast: a converted
    layer keeps its residual stream and LayerNorm outputs in the autocast dtype, as the model cast to it does,
    where autocast keeps them in float32 (docs/compile-and-convert.md). Compared at the real tokens: a padded
    query's output is unspecified (with left padding a causal one sees no key at all)."""
    ref, make_labels = _cuda_models(family)
    ref = ref.cuda()
    model, report = converted_copy(ref)
    assert len(report) >= 2 and not report.kept
    ids, mask = batch(padding, b=4, l=24)
    ids, mask = ids.cuda(), mask.cuda()
    labels = make_labels(ids, mask)
    real = mask.bool()
    want, want_grads = _cuda_run(copy.deepcopy(ref).double(), ids, mask, labels)
    cast, cast_grads = _cuda_run(copy.deepcopy(ref).to(dtype), ids, mask, labels)
    paths = []

    def kernel_path(options, x):  # which path each layer call takes
        paths.append(real_kernel_path(options, x))
        return paths[-1]

    real_kernel_path = runtime.kernel_path
    monkeypatch.setattr(runtime, "kernel_path", kernel_path)
    ours, our_grads = _cuda_run(model, ids, mask, labels, dtype)
    # both layers on the kernel path, or both not; twice over where the fused loss needs a call for the logits
    calls = 2 if convert_hf.has_fused_loss(model) else 1
    assert paths == [CUDA_FAMILIES[family]] * 2 * calls, paths
    assert all(torch.isfinite(g).all() for g in our_grads.values())
    err_ours, err_cast = _error(ours[real], want[real]), _error(cast[real], want[real])
    assert err_ours <= 2 * err_cast, (err_ours, err_cast)
    g_ours, g_cast = _grad_error(our_grads, want_grads), _grad_error(cast_grads, want_grads)
    assert g_ours <= 2 * g_cast, (g_ours, g_cast)


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(CUDA_FAMILIES))
@pytest.mark.parametrize("padding", ["right", "left"])
def test_bf16_parameters_on_the_gpu_within_twice_the_unconverted_error(family, padding):
    """A model cast to bf16 (no autocast), converted: the layers take the weights as they are (GPT-2's as
    transposed views, no cast copy); logits and gradients within twice the unconverted bf16 model's error
    against float64."""
    ref, make_labels = _cuda_models(family)
    ref = ref.cuda()
    ids, mask = batch(padding, b=4, l=24)
    ids, mask = ids.cuda(), mask.cuda()
    labels = make_labels(ids, mask)
    real = mask.bool()
    want, want_grads = _cuda_run(copy.deepcopy(ref).double(), ids, mask, labels)
    cast = copy.deepcopy(ref).to(torch.bfloat16)
    model, report = converted_copy(cast)
    assert not report.kept
    theirs, their_grads = _cuda_run(cast, ids, mask, labels)
    ours, our_grads = _cuda_run(model, ids, mask, labels)
    assert all(torch.isfinite(g).all() for g in our_grads.values())
    assert _error(ours[real], want[real]) <= 2 * _error(theirs[real], want[real])
    assert _grad_error(our_grads, want_grads) <= 2 * _grad_error(their_grads, want_grads)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama-mha", "llama-gqa"])
@pytest.mark.parametrize("padding", ["none", "right"])
def test_torch_compile_on_the_gpu(family, padding):
    """A converted model under torch.compile gives its eager self's loss and gradients (bf16 autocast)."""
    ref, make_labels = _cuda_models(family)
    model, _ = converted_copy(ref.cuda())
    ids, mask = batch(padding, b=4, l=24)
    ids, mask = ids.cuda(), mask.cuda()
    labels = make_labels(ids, mask)
    torch.manual_seed(3)
    eager_logits, eager_grads = _cuda_run(model, ids, mask, labels, torch.bfloat16)
    compiled = torch.compile(model)
    logits, grads_ = _cuda_run(compiled, ids, mask, labels, torch.bfloat16)
    real = mask.bool()
    # The layers run the same operators compiled and eager; the code around them (embeddings, LayerNorms, the
    # head, the loss) Inductor fuses, rounding to bf16 at other places: bf16-sized differences (2^-8 relative).
    torch.testing.assert_close(logits[real], eager_logits[real], rtol=2e-2, atol=2e-2)
    norm = _grad_error(eager_grads, {n: torch.zeros_like(g) for n, g in eager_grads.items()})
    assert _grad_error(grads_, eager_grads) <= 2e-2 * norm


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["gpt2", "bert", "llama-gqa"])
def test_saved_activations_give_the_same_bits_on_the_gpu(family):
    """recompute = False (the FFN activation and the pre-norm outputs saved, not recomputed) gives the same
    loss and gradients, bit for bit, as the default: the backward reads what the same kernels computed. With
    dropout: both runs draw from the same seed."""
    ref, make_labels = _cuda_models(family)
    for m in ref.modules():  # the blocks' dropouts (Llama has none)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    ids, mask = batch("right", b=4, l=24)
    ids, mask = ids.cuda(), mask.cuda()
    labels = make_labels(ids, mask)
    runs = []
    for recompute in (True, False):
        model, report = converted_copy(ref.cuda())
        assert not report.kept
        for block in model.modules():
            if convert_hf.is_converted(block):
                block.recompute = recompute
        model.train()
        torch.manual_seed(5)
        runs.append(_cuda_run(model, ids, mask, labels, torch.bfloat16))
    (logits, grads_), (saved_logits, saved_grads) = runs
    assert torch.equal(saved_logits, logits)
    assert saved_grads.keys() == grads_.keys() and all(torch.equal(saved_grads[n], g) for n, g in grads_.items())


@pytest.mark.cuda
@pytest.mark.parametrize("autocast", [True, False])
def test_gpt2_conv1d_gradients_reach_the_parameters_uncopied(autocast):
    """GPT-2's Conv1D weights go to the layer as weight.t(); their gradients come back in the weights' own
    layout, so that autograd hands the layer's gradient buffer to .grad as it is: a block's four weight
    gradients lie in one buffer (with float32 parameters under autocast, and with bf16 parameters)."""
    ref = build(GPT2LMHeadModel, gpt2_config(n_embd=CUDA_H, n_head=CUDA_HEADS)).cuda()
    model, _ = converted_copy(ref if autocast else ref.to(torch.bfloat16))
    ids, mask = batch("none", b=4, l=24)
    _cuda_run(model, ids.cuda(), mask.cuda(), causal_labels(ids, mask).cuda(), torch.bfloat16 if autocast else None)
    for block in model.transformer.h:
        a, m = block.attn, block.mlp
        params = [a.c_attn.weight, a.c_proj.weight, m.c_fc.weight, m.c_proj.weight]
        assert all(p.grad.is_contiguous() for p in params)
        assert len({p.grad.untyped_storage().data_ptr() for p in params}) == 1


@pytest.mark.cuda
def test_gpt2_generate_on_the_gpu_is_token_identical_in_float32():
    ref = build(GPT2LMHeadModel, gpt2_config(n_embd=CUDA_H, n_head=CUDA_HEADS)).cuda().eval()
    model, _ = converted_copy(ref)
    ids, mask = batch("left", l=8)
    kw = dict(attention_mask=mask.cuda(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids.cuda(), **kw), ref.generate(ids.cuda(), **kw))


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llama-mha", "llama-gqa", "qwen2"])
def test_decoder_generate_on_the_gpu_is_token_identical_in_float32(family):
    ref = _cuda_models(family)[0].cuda().eval()
    model, _ = converted_copy(ref)
    ids, mask = batch("left", l=8)
    kw = dict(attention_mask=mask.cuda(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids.cuda(), **kw), ref.generate(ids.cuda(), **kw))


@pytest.mark.cuda
def test_packed_sequences_stop_a_compiled_model_on_the_gpu():
    assert "device-side assert" in packed_compiled("cuda")
