"""benchmarks/bench_defaults.py's comparison over seeds (--seeds N), on rows as its runs return them."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_defaults  # noqa: E402

TRANSLATION = bench_defaults.Corpus("train_translation.py", "corpus", [])
LM = bench_defaults.Corpus("train_lm.py", "text", [])


def rows(results, figure="bleu"):
    """Rows of runs from {flags: {seed: quality or None (a failed run)}}."""
    return [{"run": f"r{i}", "config_flags": flags, "seed": seed, **({figure: q} if q is not None else {})}
            for i, (flags, seeds) in enumerate(results.items()) for seed, q in seeds.items()]


def test_seeded_flags():
    assert bench_defaults.seeded("", 1) == ""
    assert bench_defaults.seeded("", 2) == "--seed 2"
    assert bench_defaults.seeded("--lr 1e-3", 3) == "--lr 1e-3 --seed 3"


def test_defaults_against_the_best_mean_on_the_same_seeds(capsys):
    """The best configuration is the one whose mean beats the defaults' most on the seeds both ran: a single
    lucky seed of another configuration does not count against the defaults' other seeds."""
    got = bench_defaults.seed_table(TRANSLATION, rows({
        "": {1: 45.82, 2: 44.48, 3: 44.56},
        "--lr 1e-3": {1: 46.68, 2: 45.65, 3: 45.70},
        "--epochs 30": {1: 47.00, 2: 43.00, 3: 44.00},  # best single run, worse mean
        "--lr 2e-3": {1: 46.50, 2: None},  # only seed 1 scored: compared on seed 1 alone (-0.68)
        "--warmup 800": {1: 46.00, 4: 50.00},  # seed 4 has no defaults' run: compared on seed 1 alone (-0.18)
    }))
    flags, gap, seeds = got
    assert flags == "--lr 1e-3" and seeds == [1, 2, 3]
    assert abs(gap - ((45.82 + 44.48 + 44.56) - (46.68 + 45.65 + 45.70)) / 3) < 1e-9
    out = capsys.readouterr().out
    assert "| --lr 1e-3 | 1,2,3 | 46.01 | 45.65 | 46.68 |" in out
    assert "| --lr 2e-3 | 1 | 46.50 | 46.50 | 46.50 |" in out
    assert "(1,2,3): -1.06 (--lr 1e-3)" in out


def test_perplexity_gap_is_relative_and_lower_is_better(capsys):
    flags, gap, seeds = bench_defaults.seed_table(LM, rows({
        "": {1: 165.0, 2: 167.0}, "--lr 1e-3": {1: 160.0, 2: 162.0}, "--lr 5e-4": {1: 170.0, 2: 171.0},
    }, figure="ppl"))
    assert flags == "--lr 1e-3" and seeds == [1, 2]
    assert abs(gap - (166.0 / 161.0 - 1)) < 1e-12
    assert "+3.1% (--lr 1e-3)" in capsys.readouterr().out


def test_without_the_defaults_nothing_is_compared():
    assert bench_defaults.seed_table(TRANSLATION, rows({"--lr 1e-3": {1: 46.0, 2: 45.0}})) is None


def test_timed_defaults_report_the_median_and_every_time():
    def run(seconds, bleu=45.76, rc=0):
        return {"run": "defaults", "rc": rc, "command_s": seconds, "train_s": seconds - 10, "bleu": bleu,
                "steps": 1500}

    one = run(30.0)
    assert bench_defaults.timed_row(TRANSLATION, [one]) is one
    row = bench_defaults.timed_row(TRANSLATION, [run(32.5), run(28.1), run(31.2)])
    assert row["command_s"] == 31.2 and row["train_s"] == 21.2 and row["bleu"] == 45.76 and row["steps"] == 1500
    assert row["note"] == "whole command: median of 3 runs alone (32.5, 28.1, 31.2 s)"
    row = bench_defaults.timed_row(TRANSLATION, [run(30.0), run(29.0, bleu=45.5)])
    assert row["command_s"] == 29.5 and row["note"].endswith("; their BLEU: 45.76, 45.5")
    failed = {"run": "defaults", "rc": 1, "command_s": 3.0, "error": "boom"}
    assert bench_defaults.timed_row(TRANSLATION, [run(30.0), failed]) is failed


def test_a_run_gives_its_row(tmp_path):
    """One real command, sized for a CPU: the row carries what its log and metrics.json say, and the part of the
    whole command's time its training steps took."""
    corpus = bench_defaults.translation_corpus("tiny", bench_defaults.builtin_corpus(str(tmp_path), 300))
    row = bench_defaults.run_one(corpus, "defaults", "tiny", "--max-steps 4 --eval-every 4 --beam 1 --cooldown 2",
                                 str(tmp_path / "run"))
    assert row["rc"] == 0, row
    assert row["steps"] == 4 and row["lr"] == "0.002" and row["warmup"] == 200 and row["cooldown"] == 2
    assert isinstance(row["bleu"], float) and row["valid_loss"] > 0 and row["tokens_per_s"] > 0
    assert 0 < row["train_s"] < row["command_s"]
