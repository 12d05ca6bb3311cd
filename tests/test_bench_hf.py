"""CPU smoke run of benchmarks/bench_hf.py: tiny GPT-2, BERT and Llama models, one step of the eager variants
(compiling on the CPU would take minutes); the converted models start from the unconverted ones' loss. The
torch+liger variant cannot run here (Liger's kernels are Triton GPU kernels): it is reported as skipped, and a
stand-in for liger_kernel checks that its patch of transformers' modeling_llama is undone after it."""
import os
import sys
import types

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_hf  # noqa: E402


def test_eager_variants_run_on_the_cpu_and_agree():
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--variants", "torch,lsmini"])
    assert [(r["model"], r["variant"]) for r in rows] == [("gpt2", "torch"), ("gpt2", "lsmini"), ("bert", "torch"),
                                                          ("bert", "lsmini")]
    assert all("error" not in r for r in rows), rows
    for torch_row, lsmini_row in (rows[:2], rows[2:]):
        assert lsmini_row["kept"] == 0 and lsmini_row["replaced"] >= 3
        # the same weights and batch; the dropout draws (p = 0.1) and bf16 roundings differ
        assert abs(lsmini_row["loss_first"] - torch_row["loss_first"]) < 0.05


def test_llama_eager_variants_run_on_the_cpu_and_agree():
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--models", "llama,gpt2",
                          "--variants", "torch+liger,torch,lsmini"])
    assert [(r["model"], r["variant"]) for r in rows] == [("llama", "torch"), ("llama", "lsmini"),
                                                          ("llama", "torch+liger"), ("gpt2", "torch"),
                                                          ("gpt2", "lsmini"), ("gpt2", "torch+liger")]
    assert all("error" not in r for r in rows), rows
    torch_row, lsmini_row = rows[:2]
    assert lsmini_row["replaced"] == 3 and lsmini_row["kept"] == 0  # the loss and both decoder layers
    # the same weights and batch, no dropout in Llama: only bf16 roundings differ
    assert abs(lsmini_row["loss_first"] - torch_row["loss_first"]) < 0.05
    assert rows[2]["skipped"] and "ms_step" not in rows[2]  # no liger_kernel, or no CUDA, here
    assert "llama model only" in rows[5]["skipped"]


def test_the_tiny_llama_converts_every_decoder_layer():
    import lsmini
    model = bench_hf.build_model(bench_hf.parse_args(["--tiny", "--models", "llama"]), "llama")
    assert (model.config.num_key_value_heads, model.config.intermediate_size) == bench_hf.TINY_LLAMA_KV_FFN
    report = lsmini.convert(model)
    assert [(r.name, r.torch_type, r.lsmini_type) for r in report.replaced] == [
        ("", "LlamaForCausalLM", "fused linear + cross-entropy loss")] + [
        (f"model.layers.{i}", "LlamaDecoderLayer", "ConvertedLlamaDecoderLayer") for i in range(2)]
    assert not report.kept


def test_the_liger_patch_is_undone_after_its_variant(monkeypatch):
    from transformers.models.llama import modeling_llama
    original = modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm
    applied = []

    def apply_liger_kernel_to_llama(model=None):  # a stand-in: rebinds module names as Liger's does
        applied.append(model)
        modeling_llama.apply_rotary_pos_emb = lambda *a, **k: original[0](*a, **k)
        modeling_llama.LlamaRMSNorm = type("StandInRMSNorm", (original[1],), {})

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    monkeypatch.setattr(bench_hf, "liger_skip_reason", lambda name, device: None)  # as on CUDA
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--models", "llama",
                          "--variants", "torch+liger"])
    assert "error" not in rows[0] and "skipped" not in rows[0] and len(applied) == 1
    assert (modeling_llama.apply_rotary_pos_emb, modeling_llama.LlamaRMSNorm) == original


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--models", "t5"])
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--variants", "liger"])
    args = bench_hf.parse_args(["--steps", "2"])
    assert (args.warmup, args.iters) == (1, 2) and args.models == ["gpt2", "bert"]
    assert args.variants == list(bench_hf.VARIANTS)  # torch+liger only when asked for
    args = bench_hf.parse_args(["--models", "llama,llama", "--variants", "torch+liger,lsmini,torch"])
    assert args.models == ["llama"] and args.variants == ["lsmini", "torch", "torch+liger"]
