"""benchmarks/report.py, the results record and the GPU test-suite record (CPU only).

The committed RESULTS.md and the README's tables (headlines, defaults) must be exactly what report.py writes
from the committed CSVs; report.py's selection (the latest row of each key) and its ratios (against the strongest
PyTorch variant of the same run) are checked on small CSVs written here; so are benchmarks/common's
append_results and the parsing of pytest's output in benchmarks/gpu_tests.py."""
import csv
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import common  # noqa: E402
import gpu_tests  # noqa: E402
import report  # noqa: E402


def test_committed_results_md_is_what_report_writes():
    rows = report.load(common.RESULTS_DIR)
    with open(report.RESULTS_MD) as f:
        assert f.read() == report.render(rows), "run `python benchmarks/report.py` and commit RESULTS.md"


def test_committed_readme_tables_are_what_report_writes():
    rows = report.load(common.RESULTS_DIR)
    with open(report.README) as f:
        readme = f.read()
    assert report.with_tables(readme, rows) == readme, "run `python benchmarks/report.py` and commit README.md"


def test_every_committed_row_is_the_latest_of_its_key():
    rows = report.load(common.RESULTS_DIR)
    keys = [report.key(r) for r in rows]
    assert len(keys) == len(set(keys))
    assert {r["kind"] for r in rows} <= set(common.KINDS)


ENV = {"gpu": "GPU A", "torch": "2.11", "cuda": "13.0", "commit": "abc"}


def write(directory, name, runs):
    """runs: [(date, run id, rows)] appended in order through common.append_results."""
    for date, run, rows in runs:
        common.append_results(str(directory), name, {**ENV, "date": date, "run": run}, rows)
    return report.load(str(directory))


def step(config, variant, ms, kind=None, **figs):
    return {"benchmark": "training", "config": config, "variant": variant,
            "kind": kind or ("lsmini" if variant.startswith("lsmini") else "pytorch"), "ms": ms, **figs}


def test_latest_row_per_key_and_ratio_against_the_strongest_pytorch_variant_of_its_run(tmp_path):
    rows = write(tmp_path, "training", [
        ("2026-01-01", "r1", [step("base", "lsmini", 10.0), step("base", "eager", 40.0),
                              step("base", "compiled", 20.0), step("big", "lsmini", 30.0)]),
        ("2026-01-03", "r2", [step("base", "lsmini", 8.0), step("base", "eager", 30.0),
                              step("base", "compiled-graphs", 12.0)]),
        ("2026-01-02", "r3", [step("big", "lsmini", 99.0), step("big", "eager", 60.0)]),  # older date, later in file
        ("2026-01-03", "r4", [step("base", "compiled", 16.0)]),  # same date as r2: later in the file wins
    ])
    chosen = report.latest(rows)
    assert chosen[("training", "base", "lsmini", "GPU A")]["ms"] == "8"
    assert chosen[("training", "base", "eager", "GPU A")]["run"] == "r2"
    assert chosen[("training", "base", "compiled", "GPU A")]["run"] == "r4"
    assert chosen[("training", "big", "lsmini", "GPU A")]["run"] == "r3"  # 2026-01-02 is later than 01-01
    # the baseline is the fastest PyTorch row of the same run, not the fastest ever measured
    x, base = report.ratio(rows, chosen[("training", "base", "lsmini", "GPU A")])
    assert base["variant"] == "compiled-graphs" and x == pytest.approx(12.0 / 8.0)
    x, base = report.ratio(rows, chosen[("training", "big", "lsmini", "GPU A")])
    assert base["variant"] == "eager" and x == pytest.approx(60.0 / 99.0)
    x, base = report.ratio(rows, chosen[("training", "base", "compiled", "GPU A")])  # r4 has no other row
    assert x == pytest.approx(1.0) and base["run"] == "r4"

    text = report.render(rows)
    assert text.count("| base |") == 1  # the config cell once per group
    lines = [l for l in text.splitlines() if l.startswith("|  | ") or l.startswith("| base |")]
    assert [l.split(" | ")[1] for l in lines[:4]] == ["lsmini", "compiled", "compiled-graphs", "eager"]
    assert "| 8 | 1.50× | 2026-01-03 | abc |" in text  # lsmini base: 12 / 8
    assert "r1" not in text and "| 10.0 |" not in text  # superseded rows are not shown


def test_recorded_ratio_other_gpus_and_rows_without_baseline(tmp_path):
    rows = write(tmp_path, "kernels", [
        ("2026-01-01", "k1", [{"benchmark": "kernels", "config": "op float16 8x8", "variant": "lsmini",
                               "kind": "lsmini", "pct_copy": 90.5, "vs_pytorch": 2.5},
                              {"benchmark": "kernels", "config": "op float16 8x8", "variant": "lsmini unfused",
                               "kind": "lsmini", "ms": 3.0}]),
    ])
    chosen = report.latest(rows)
    assert report.ratio(rows, chosen[("kernels", "op float16 8x8", "lsmini", "GPU A")]) == (2.5, None)
    assert report.ratio(rows, chosen[("kernels", "op float16 8x8", "lsmini unfused", "GPU A")]) == (None, None)
    common.append_results(str(tmp_path), "kernels", {**ENV, "gpu": "GPU B", "date": "2026-01-01", "run": "k2"},
                          [{"benchmark": "kernels", "config": "op float16 8x8", "variant": "lsmini", "kind": "lsmini",
                            "ms": 1.0}])
    text = report.render(report.load(str(tmp_path)))
    assert "### GPU A" in text and "### GPU B" in text and "| 2.50× |" in text


def test_headline_table_and_readme_block(tmp_path):
    rows = write(tmp_path, "training", [("2026-01-01", "r1", [step("base", "lsmini+graph", 5.0, peak_mb=100),
                                                              step("base", "compiled-graphs", 10.0)])])
    heads = [("training", "base", "lsmini+graph", "GPU A", "Training step")]
    table = report.headline_table(rows, heads)
    assert "| Training step | 5 ms/step | 10 ms/step (compiled-graphs) | **2.00×** | GPU A | 2026-01-01 |" in table
    with pytest.raises(KeyError, match="not in the results"):
        report.headline_table(rows, [("training", "lm", "lsmini", "GPU A", "missing")])
    with pytest.raises(ValueError, match="markers"):
        report.with_tables("no markers here", rows)


def test_defaults_table_sets_the_defaults_beside_the_best_tuned_run(tmp_path):
    def run(config, variant, **figs):
        return {"benchmark": "defaults", "config": config, "variant": variant, "kind": "lsmini", "steps": 100,
                "warmup": 10, "lr": 0.001, "command_s": 20.5, **figs}

    rows = write(tmp_path, "defaults", [("2026-01-01", "r1", [
        run("mt", "defaults", bleu=40.25, cooldown=20), run("mt", "--lr 2e-3", bleu=41.75),
        run("mt", "--lr 5e-4", bleu=39.5), run("lm", "defaults", ppl=110.5, cooldown=0),
        run("lm", "--warmup 5", ppl=100.5), run("lm", "--warmup 50", ppl=120.5),
        run("lm", "--broken", note="failed")])])
    table = report.defaults_table(rows)
    assert "| mt | 100 steps, warmup 10, cooldown 20, lr 0.001 | BLEU 40.25 | 41.75 (`--lr 2e-3`) | -1.50 | 20.5 s |" \
        in table
    assert "| lm | 100 steps, warmup 10, lr 0.001 | perplexity 110.5 | 100.5 (`--warmup 5`) | +10.0% |" in table


def test_defaults_table_compares_means_over_the_defaults_seeds(tmp_path):
    def run(variant, bleu, warmup=10, cooldown=None):
        return {"benchmark": "defaults", "config": "mt", "variant": variant, "kind": "lsmini", "steps": 100,
                "warmup": warmup, "cooldown": cooldown, "lr": 0.001, "command_s": 20.5, "bleu": bleu}

    rows = write(tmp_path, "defaults", [("2026-01-01", "r1", [
        run("--seed 3", 10.0, warmup=99),  # another schedule's defaults (an earlier commit's): not these
        run("--seed 3", 10.0, cooldown=20),  # nor these (no cooldown and 0 are the same schedule)
        run("--lr 2e-3", 40.5),  # a later row of seed 1 of the same configuration wins
        run("defaults", 40.0, cooldown=0), run("--seed 2", 41.0),
        run("--lr 2e-3 --seed 1", 41.5), run("--lr 2e-3 --seed 2", 42.5),
        run("--lr 5e-4 --seed 2", 39.0), run("--lr 5e-4", 40.0),
        run("--warmup 5", 45.0)])])  # one seed only: a lucky draw is not compared with a two-seed mean
    assert report.configuration_and_seed("--lr 2e-3 --seed 12 --epochs 3") == ("--lr 2e-3 --epochs 3", 12)
    assert report.configuration_and_seed("--seed 2") == ("", 2)
    assert report.configuration_and_seed("defaults") == ("", 1)
    table = report.defaults_table(rows)
    assert "| BLEU 40.50 (mean of seeds 1-2) | 42.00 (`--lr 2e-3`) | -1.50 | 20.5 s |" in table


def test_append_results_stamps_rows_and_widens_the_header(tmp_path):
    env = {**ENV, "date": "2026-01-01", "run": "r1"}
    path = common.append_results(str(tmp_path), "x", env, [step("base", "lsmini", 1.5)])
    common.append_results(str(tmp_path), "x", {**env, "run": "r2"}, [step("base", "lsmini", 1.25, peak_mb=7)])
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == common.STAMP + common.KEY + ["ms", "peak_mb"]
    assert [(r["run"], r["ms"], r["peak_mb"], r["gpu"]) for r in rows] == [("r1", "1.5", "", "GPU A"),
                                                                         ("r2", "1.25", "7", "GPU A")]
    assert common.append_results(None, "x", env, [step("base", "lsmini", 1.0)]) is None  # --no-results
    with pytest.raises(ValueError, match="kind"):
        common.append_results(str(tmp_path), "x", env, [step("base", "lsmini", 1.0, kind="mine")])
    with pytest.raises(ValueError, match="missing"):
        common.append_results(str(tmp_path), "x", env, [{"benchmark": "training", "config": "base", "ms": 1.0}])


# ---- benchmarks/gpu_tests.py: pytest's output -------------------------------------------------------------
LOG = """\
........................s..F......
=========================== short test summary info ============================
SKIPPED [3] tests/test_distributed.py:31: needs 2 CUDA devices
SKIPPED [1] tests/test_graph.py:12: something else
FAILED tests/test_x.py::test_y - assert 0
= 1 failed, 2935 passed, 4 skipped, 2 deselected, 3 warnings, 1 error in 812.34s (0:13:32) =
"""


@pytest.mark.parametrize("line, expected", [
    ("2939 passed, 1 skipped in 812.34s (0:13:32)", dict(passed=2939, skipped=1, seconds=812.34)),
    ("===== 10 passed, 1 warning in 0.50s =====", dict(passed=10, warnings=1, seconds=0.5)),
    ("\x1b[31m1 failed, 2 errors in 5.1s\x1b[0m", dict(failed=1, errors=2, seconds=5.1)),
    ("3 passed, 1 xfailed, 2 rerun in 1.00s", dict(passed=3, xfailed=1, seconds=1.0)),
    ("no tests ran in 0.01s", dict(seconds=0.01)),
])
def test_pytest_summary_line(line, expected):
    counts = gpu_tests.parse_summary("collecting ...\nsome output in 3s of text\n" + line + "\n")
    assert counts == {**dict.fromkeys(gpu_tests.COUNTS, 0), **expected}


def test_pytest_log_counts_skips_and_verdict():
    counts = gpu_tests.parse_summary(LOG)
    assert (counts["passed"], counts["failed"], counts["skipped"], counts["errors"]) == (2935, 1, 4, 1)
    skips = gpu_tests.parse_skips(LOG)
    assert skips == [(3, "tests/test_distributed.py:31: needs 2 CUDA devices"),
                     (1, "tests/test_graph.py:12: something else")]
    assert gpu_tests.verdict(counts, skips)[0] == 1
    ok = {**counts, "failed": 0, "errors": 0, "skipped": 3}
    assert gpu_tests.verdict(ok, skips[:1]) == (0, "OK: 2935 passed, 0 failed, 0 errors, 3 skipped (3 allowed)")
    assert gpu_tests.verdict({**ok, "skipped": 4}, skips)[0] == 1  # a skip for another reason fails the check
    assert gpu_tests.verdict(None, [])[0] == 2
    assert gpu_tests.parse_summary("Traceback (most recent call last):\nKilled\n") is None


def test_gpu_tests_records_a_row(tmp_path, capsys):
    log = tmp_path / "tests.log"
    log.write_text(LOG)
    assert gpu_tests.main([str(log), "--seconds", "815.6", "--results", str(tmp_path / "results")]) == 1
    assert "FAILED: 2935 passed, 1 failed, 1 errors, 4 skipped (3 allowed)" in capsys.readouterr().out
    with open(tmp_path / "results" / "gpu_tests.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["benchmark"], row["config"], row["result"], row["passed"], row["failed"], row["skipped"],
            row["errors"], row["duration_s"]) == ("gpu_tests", "tests", "failed", "2935", "1", "4", "1", "816")
    assert row["commit"] and row["torch"] and row["date"]
    log.write_text("collected 10 items\nSegmentation fault\n")
    assert gpu_tests.main([str(log), "--no-results"]) == 2
