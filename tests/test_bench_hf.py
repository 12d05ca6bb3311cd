"""CPU smoke run of benchmarks/bench_hf.py: tiny GPT-2, BERT and Llama models, one step of the eager variants
(compiling on the CPU would take minutes), each variant in a process of its own; the converted models start from
the unconverted ones' loss. The torch+liger variant cannot run here (Liger's kernels are Triton GPU kernels): it
is reported as skipped."""
import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_hf  # noqa: E402
import common  # noqa: E402


def test_eager_variants_run_on_the_cpu_and_agree():
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--variants", "torch,lsmini"])
    assert [(r["model"], r["variant"]) for r in rows] == [("gpt2", "torch"), ("gpt2", "lsmini"), ("bert", "torch"),
                                                          ("bert", "lsmini")]
    assert all("error" not in r for r in rows), rows
    for torch_row, lsmini_row in (rows[:2], rows[2:]):
        assert lsmini_row["kept"] == 0 and lsmini_row["replaced"] >= 3
        # the same weights and batch; the dropout draws (p = 0.1) and bf16 roundings differ
        assert abs(lsmini_row["loss_first"] - torch_row["loss_first"]) < 0.05


def test_padded_batches_run_and_agree():
    """--padding: right-padded rows with an attention mask; the converted models take it and start from the
    unconverted ones' loss; the rows' config says padded."""
    args = bench_hf.parse_args(["--tiny", "--padding", "--models", "bert"])
    ids, labels, mask = bench_hf.make_batches(args, "bert", bench_hf.torch.device("cpu"))[0]
    lengths = mask.sum(1)
    assert lengths.min() >= 8 and lengths.max() <= 16 and lengths.unique().numel() > 1, lengths
    assert (ids[mask == 0] == 0).all() and (labels[mask == 0] == -100).all()
    assert "b2x16 padded attn=sdpa" in bench_hf.config_label(args, "bert")
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--padding", "--models", "bert,llama",
                          "--variants", "torch,lsmini"])
    assert all("error" not in r for r in rows), rows
    for torch_row, lsmini_row in (rows[:2], rows[2:]):
        assert lsmini_row["kept"] == 0 and lsmini_row["replaced"] >= 3
        assert abs(lsmini_row["loss_first"] - torch_row["loss_first"]) < 0.05


def test_llama_eager_variants_run_on_the_cpu_and_agree():
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--models", "llama,gpt2",
                          "--variants", "torch+liger,torch,lsmini"])
    assert [(r["model"], r["variant"]) for r in rows] == [("llama", "torch+liger"), ("llama", "torch"),
                                                          ("llama", "lsmini"), ("gpt2", "torch+liger"),
                                                          ("gpt2", "torch"), ("gpt2", "lsmini")]
    assert all("error" not in r for r in rows), rows
    torch_row, lsmini_row = rows[1:3]
    assert lsmini_row["replaced"] == 3 and lsmini_row["kept"] == 0  # the loss and both decoder layers
    # the same weights and batch, no dropout in Llama: only bf16 roundings differ
    assert abs(lsmini_row["loss_first"] - torch_row["loss_first"]) < 0.05
    assert rows[0]["skipped"] and "ms_step" not in rows[0]  # no liger_kernel, or no CUDA, here
    assert "llama model only" in rows[3]["skipped"]


def test_the_tiny_llama_converts_every_decoder_layer():
    import lsmini
    model = bench_hf.build_model(bench_hf.parse_args(["--tiny", "--models", "llama"]), "llama")
    assert (model.config.num_key_value_heads, model.config.intermediate_size) == bench_hf.TINY_LLAMA_KV_FFN
    report = lsmini.convert(model)
    assert [(r.name, r.torch_type, r.lsmini_type) for r in report.replaced] == [
        ("", "LlamaForCausalLM", "fused linear + cross-entropy loss")] + [
        (f"model.layers.{i}", "LlamaDecoderLayer", "ConvertedLlamaDecoderLayer") for i in range(2)]
    assert not report.kept


def test_a_failing_variant_is_a_row_with_its_error():
    """A variant whose process ends without a row (here: a device that does not exist) is reported, and the
    run goes on."""
    args = bench_hf.parse_args(["--device", "cpu", "--tiny", "--steps", "1", "--models", "gpt2"])
    args.device = "no-such-device"
    row = bench_hf.run(args, "gpt2", "torch", None)
    assert row["model"] == "gpt2" and row["variant"] == "torch" and "error" in row


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--models", "t5"])
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--variants", "liger"])
    args = bench_hf.parse_args(["--steps", "2"])
    assert (args.warmup, args.iters) == (1, 2) and args.models == ["gpt2", "bert"]
    assert args.variants == list(bench_hf.VARIANTS)  # torch+liger only when asked for
    args = bench_hf.parse_args(["--models", "llama,llama", "--variants", "torch+liger,lsmini,torch,lsmini"])
    assert args.models == ["llama"] and args.variants == ["torch+liger", "lsmini", "torch"]


def test_graph_variants_are_skipped_without_cuda():
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--models", "bert",
                          "--variants", "torch+compile-graphs,lsmini+compile-graphs"])
    assert [r["variant"] for r in rows] == ["torch+compile-graphs", "lsmini+compile-graphs"]
    assert all(r["skipped"] == "CUDA graphs need a CUDA device" and "ms_step" not in r for r in rows)


def test_profile_is_reported_by_model_and_variant():
    import common
    profile = {"steps": 5, "kernels_per_step": 40.0, "gpu_span_ms": 2.0, "busy_ms": 1.5, "idle_ms": 0.5,
               "categories_ms": {"gemm": 1.0, "lsmini fused": 0.5}, "top_kernels_ms": [("gemm_kernel", 4.0, 1.0)],
               "host_ops_ms": [("aten::mm", 4.0, 0.2)]}
    text = common.profile_report([{"model": "llama", "variant": "lsmini", "ms_step": 2.5, "profile": profile},
                                  {"model": "llama", "variant": "torch", "ms_step": 3.0}])
    assert text.startswith("### llama / lsmini: 2.50 ms per step, 40 kernels per step")
    assert "| gemm | 1.00 | 67% |" in text and "| `aten::mm` | 4.0 | 0.200 |" in text
    assert "| `gemm_kernel` | 4.0 | 1.000 | 250.0 |" in text
    assert "torch" not in text  # a row without a profile has no section
    args = bench_hf.parse_args(["--profile"])
    assert args.profile


@pytest.mark.cuda
def test_profile_on_cuda():
    rows = bench_hf.main(["--tiny", "--steps", "1", "--models", "llama", "--variants", "lsmini", "--profile",
                          "--no-results"])
    p = rows[0]["profile"]
    assert p["kernels_per_step"] > 0 and p["busy_ms"] > 0 and "gemm" in p["categories_ms"]


def test_saved_variants_run_and_match_the_default():
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--steps", "1", "--models", "llama",
                          "--variants", "lsmini,lsmini+saved,lsmini+compile-graphs+saved"])
    assert all("error" not in r for r in rows), rows
    assert rows[1]["loss_first"] == rows[0]["loss_first"]  # no dropout in Llama: recompute changes no value
    assert rows[2]["skipped"] == "CUDA graphs need a CUDA device"


def test_adam_variants_run_and_train_as_adamw():
    # FusedAdam in place of AdamW: the same first loss (same weights), and after the steps the same loss within
    # the two optimizers' rounding (float32 updates summed in another order); GPT-2 ties its embedding and head
    rows = bench_hf.main(["--device", "cpu", "--tiny", "--warmup", "1", "--iters", "2", "--models", "gpt2",
                          "--variants", "lsmini,lsmini+adam,lsmini+compile-graphs+adam"])
    assert all("error" not in r for r in rows), rows
    assert rows[1]["loss_first"] == rows[0]["loss_first"]
    assert rows[1]["loss_final"] == pytest.approx(rows[0]["loss_final"], rel=1e-4)
    assert rows[2]["skipped"] == "CUDA graphs need a CUDA device"


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_skip_mask_passes_sdpa_no_mask_while_compiling(name, monkeypatch):
    """common.skip_masks_as_in_eager: traced by torch.compile, the model calls SDPA with no mask (is_causal for the
    causal models), as eagerly, and computes the same loss as the unpatched model eagerly."""
    import torch
    import transformers.masking_utils as masking
    for attr in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa", "find_packed_sequence_indices"):
        monkeypatch.setattr(masking, attr, getattr(masking, attr))  # restored after the test
    args = bench_hf.parse_args(["--device", "cpu", "--tiny", "--models", name])
    model = bench_hf.build_model(args, name).eval()  # no dropout: the losses compare exactly
    ids, labels, _ = bench_hf.make_batches(args, name, torch.device("cpu"))[0]  # no padding: no mask
    with torch.no_grad():
        expected = model(ids, labels=labels).loss
    common.skip_masks_as_in_eager()
    calls = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.target is torch._C._nn.scaled_dot_product_attention:
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                calls.append((mask, node.kwargs.get("is_causal", False)))
        return gm

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            loss = torch.compile(lambda i, l: model(i, labels=l).loss, backend=backend)(ids, labels)
    finally:
        torch._dynamo.reset()
    assert calls == [(None, name != "bert")] * 2  # the tiny models' two layers
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
