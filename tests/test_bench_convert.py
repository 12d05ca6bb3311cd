"""CPU smoke run of benchmarks/bench_convert.py: tiny model, eager variants only (compiling on the CPU would
take minutes), checking that the table has the variants' rows and that they train to finite losses."""
import csv
import math
import os
import sys

import pytest
import torch

import lsmini

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_convert  # noqa: E402

TINY = ["--device", "cpu", "--layers", "1", "--d-model", "32", "--heads", "4", "--ffn", "64", "--vocab", "50",
        "--batch", "4", "--src-len", "8", "--tgt-len", "6", "--warmup", "1", "--iters", "2"]


def table_rows(text):
    """variant → the cells of its row in the printed markdown table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in bench_convert.KNOWN_VARIANTS:
            rows[cells[0]] = cells
    return rows


def check_trained(row):
    assert "error" not in row, row["error"]
    assert math.isfinite(row["loss_first"]) and math.isfinite(row["loss_final"])
    assert len(row["compile_steps"]) == 1 and row["compile_s"] == pytest.approx(sum(row["compile_steps"]))
    assert row["ms_step"] > 0 and row["tgt_tokens_s"] > 0


def test_torch_row_csv_and_graph_variant_skipped(tmp_path, capsys):
    path = tmp_path / "convert.csv"
    rows = bench_convert.main(TINY + ["--variants", "torch,torch+compile-graphs", "--csv", str(path), "--no-isolate"])
    assert [r["variant"] for r in rows] == ["torch"]  # CUDA graphs: skipped on the CPU, with a note
    check_trained(rows[0])
    out = capsys.readouterr().out
    assert "torch" in table_rows(out) and "skipped on CPU" in out
    with open(path) as f:
        written = list(csv.DictReader(f))
    assert [r["variant"] for r in written] == ["torch"] and float(written[0]["loss_final"]) == rows[0]["loss_final"]


def test_torch_and_lsmini_rows(capsys):  # each variant in its own process (the default)
    if not callable(getattr(lsmini, "convert", None)):  # the function, not only its module
        pytest.skip("lsmini.convert is not available")
    rows = bench_convert.main(TINY + ["--variants", "torch,lsmini"])
    by = {r["variant"]: r for r in rows}
    assert set(by) == {"torch", "lsmini"}
    for r in rows:
        check_trained(r)
    assert by["lsmini"]["replaced"] > 0
    assert by["lsmini"]["x_same_mode"] > 0
    table = table_rows(capsys.readouterr().out)
    assert {"torch", "lsmini"} <= set(table)


def test_per_model_masks(capsys):
    """--padding-masks per-model (the default): float masks for torch's model (so that torch.compile traces it
    whole), bool for lsmini's (which reads float masks in eager mode only). The float masks mean what the bool
    ones do: torch's model gives the same first loss with either (same weights, same dropout draws)."""
    if not callable(getattr(lsmini, "convert", None)):
        pytest.skip("lsmini.convert is not available")
    rows = bench_convert.main(TINY + ["--variants", "torch,lsmini", "--no-isolate"])  # per-model: the default
    by = {r["variant"]: r for r in rows}
    assert by["torch"]["masks"] == "float" and by["lsmini"]["masks"] == "bool"
    for r in rows:
        check_trained(r)
    assert "float (torch) / bool (lsmini) padding masks" in capsys.readouterr().out
    with_bool = bench_convert.main(TINY + ["--variants", "torch", "--padding-masks", "bool", "--no-isolate"])[0]
    assert with_bool["masks"] == "bool"
    assert with_bool["loss_first"] == pytest.approx(by["torch"]["loss_first"], rel=1e-5)


def test_mask_types_carry_the_same_padding():
    args = bench_convert.parse_args(TINY)
    bools = bench_convert.make_batches(args, torch.device("cpu"), "bool")
    floats = bench_convert.make_batches(args, torch.device("cpu"), "float")
    for (b, tb), (f, tf) in zip(bools, floats):  # ((src, tgt_in, src_padding, tgt_padding, tgt_mask), tgt_out)
        assert torch.equal(b[0], f[0]) and torch.equal(b[1], f[1]) and torch.equal(tb, tf)
        for mb, mf in zip(b[2:4], f[2:4]):
            assert mb.dtype == torch.bool and mf.dtype == torch.float32
            assert torch.equal(mb, mf == float("-inf")) and bool(((mf == 0) | mb).all())


def test_encoder_model_rows(capsys):
    """--model encoder: nn.TransformerEncoder alone, every layer converted, both variants training on the
    hidden tokens from the same first loss (same weights; the padding masks differ in type only)."""
    rows = bench_convert.main(TINY + ["--variants", "torch,lsmini", "--model", "encoder", "--no-isolate"])
    by = {r["variant"]: r for r in rows}
    for r in rows:
        check_trained(r)
    assert by["lsmini"]["replaced"] == 1 and by["lsmini"]["kept"] == 0
    assert "nn.TransformerEncoder 1 (masked tokens)" in capsys.readouterr().out
    with_bool = bench_convert.main(TINY + ["--variants", "torch", "--model", "encoder", "--padding-masks", "bool",
                                           "--no-isolate"])[0]
    assert with_bool["loss_first"] == pytest.approx(by["torch"]["loss_first"], rel=1e-5)


def test_fused_adam_variant_trains_as_adamw(capsys):
    """lsmini+adam: the converted model with AdamW swapped for lsmini.optim.FusedAdam. Same weights and dropout
    draws as lsmini, so the same first loss; after the optimizer steps the losses agree within the two
    optimizers' rounding (float32 updates summed in another order); its same-mode ratio is against torch."""
    rows = bench_convert.main(TINY + ["--variants", "torch,lsmini,lsmini+adam", "--no-isolate"])
    by = {r["variant"]: r for r in rows}
    for r in rows:
        check_trained(r)
    assert by["lsmini+adam"]["loss_first"] == by["lsmini"]["loss_first"]
    assert by["lsmini+adam"]["loss_final"] == pytest.approx(by["lsmini"]["loss_final"], rel=1e-4)
    assert by["lsmini+adam"]["x_same_mode"] > 0
    assert "lsmini+adam" in table_rows(capsys.readouterr().out)


def test_repeats_alternate_the_order_and_report_the_median_step(monkeypatch, capsys):
    """--repeats 3: rounds in alternating order; per variant the run with the median ms_step, every run's figures
    under the table and in the results note."""
    order, times = [], {"torch": iter([3.0, 1.0, 2.0]), "lsmini": iter([5.0, 6.0, 4.0])}

    def fake_run(variant, args, device):
        order.append(variant)
        ms = next(times[variant])
        return {"variant": variant, "ms_step": ms, "compile_s": 10 * ms, "compile_steps": [10 * ms],
                "tgt_tokens_s": 1000 / ms, "loss_first": 1.0, "loss_final": 0.5}

    monkeypatch.setattr(bench_convert, "run_here", fake_run)
    monkeypatch.setattr(bench_convert, "warm_up_process", lambda args, device: None)
    args_list = TINY + ["--variants", "torch,lsmini", "--no-isolate", "--repeats", "3"]
    rows = bench_convert.main(args_list)
    assert order == ["torch", "lsmini", "lsmini", "torch", "torch", "lsmini"]
    by = {r["variant"]: r for r in rows}
    assert by["torch"]["ms_step"] == 2.0 and by["torch"]["compile_s"] == 20.0
    assert by["lsmini"]["ms_step"] == 5.0
    assert by["lsmini"]["x_same_mode"] == pytest.approx(2.0 / 5.0)
    out = capsys.readouterr().out
    assert "torch: the median by ms/step of 3 runs in alternating order: ms/step 3.000, 1.000, 2.000" in out
    notes = [r["note"] for r in bench_convert.results_rows(bench_convert.parse_args(args_list), rows)]
    assert notes[1] == ("the median by ms/step of 3 runs in alternating order: ms/step 5.000, 6.000, 4.000; "
                        "compile s 50.0, 60.0, 40.0")
