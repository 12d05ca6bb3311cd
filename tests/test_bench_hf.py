"""CPU smoke run of benchmarks/bench_hf.py: tiny GPT-2 and BERT models, one step of the eager variants
(compiling on the CPU would take minutes); the converted models start from the unconverted ones' loss."""
import os
import sys

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


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        bench_hf.parse_args(["--models", "llama"])
    args = bench_hf.parse_args(["--steps", "2"])
    assert (args.warmup, args.iters) == (1, 2) and args.models == ["gpt2", "bert"]
