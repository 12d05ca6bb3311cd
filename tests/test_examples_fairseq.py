"""The training examples as a fairseq user expects them (CPU, tiny runs): progress lines that agree,
--translate with blank and over-long lines, long validation/test lines, divergence that stops the run and
keeps the last good checkpoint, --patience, --max-time, --best-metric / checkpoint_best.pt, --keep-last,
--eval-bleu, --average-last and examples/average_checkpoints.py, train_log.jsonl and its plot, the warmup
rule, and the CUDA-graph decision."""
import io
import json
import os
import re
import sys

import pytest
import torch

from example_testing import builtin_pairs, run as run_main, write_corpus, write_lines
import average_checkpoints  # noqa: E402
import builtin_data  # noqa: E402
import train_lm  # noqa: E402
import train_translation  # noqa: E402
from training import cli, run as training_run, runtime  # noqa: E402
from training.data import DataError  # noqa: E402
from training.trainer import EXPLODE_WINDOWS, TrainingDiverged  # noqa: E402

# ~13 batches per epoch of the 400-pair corpus
SMALL = ["--arch", "tiny", "--vocab-size", "300", "--max-tokens", "1024", "--max-len", "64", "--log-every", "1",
         "--no-progress", "--beam", "1"]


def run(argv):
    return run_main(train_translation.main, argv)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    out = builtin_pairs((("train", 400, 501), ("valid", 16, 502), ("test", 10, 503)))
    return {"paths": write_corpus(d, out), "lines": out, "dir": d}


def data_args(paths):
    args = []
    for split, (src, tgt) in paths.items():
        args += [f"--{split}-src", src, f"--{split}-tgt", tgt]
    return args


def ckpt_step(path):
    return torch.load(path, map_location="cpu", weights_only=True)["trainer"]["step"]


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory):
    """One run with every checkpoint option: (save_dir, metrics, output)."""
    d = str(tmp_path_factory.mktemp("full"))
    out = io.StringIO()
    from contextlib import redirect_stdout
    with redirect_stdout(out):
        m = run(data_args(corpus["paths"]) + SMALL + [
            "--save-dir", d, "--max-steps", "6", "--eval-every", "2", "--keep-last", "2", "--average-last", "2",
            "--eval-bleu"])
    return d, m, out.getvalue()


# ---- 1. progress output -----------------------------------------------------------------------------
def test_log_and_validation_lines_agree_on_the_epoch(corpus, tmp_path, capsys):
    d = str(tmp_path)
    m = run(data_args(corpus["paths"]) + SMALL + ["--save-dir", d, "--epochs", "2"])
    out = capsys.readouterr().out
    log_epoch = {int(s): int(e) for s, e in re.findall(r"^step (\d+) \| epoch (\d+) \| loss", out, re.M)}
    valid = [(int(s), int(e)) for s, e in re.findall(r"^step (\d+) \| epoch (\d+) \| train loss", out, re.M)]
    assert [e for _, e in valid] == [1, 2]
    for s, e in valid:
        assert log_epoch[s] == e, f"step {s}: log line says epoch {log_epoch[s]}, validation line epoch {e}"
    assert "target tokens/s (average over all training steps)" in out
    # a resumed run with nothing left to do says where it is, never "epoch 0"
    m2 = run(data_args(corpus["paths"]) + SMALL + ["--save-dir", d, "--epochs", "2", "--resume"])
    out = capsys.readouterr().out
    assert "nothing to train: the run is at step" in out and "2 epoch(s) completed" in out and "epoch 0" not in out
    assert m2["steps"] == m["steps"]


# ---- 2. --translate and long lines ------------------------------------------------------------------
def translate(save_dir, text, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode()), encoding="utf-8"))
    capsys.readouterr()
    assert run(["--translate", "--save-dir", save_dir]) is None
    return capsys.readouterr()


def test_translate_blank_and_long_lines(full_run, monkeypatch, capsys):
    save_dir, _, _ = full_run
    long_line = " ".join(["The old king paints the tall foxes."] * 30)
    out = translate(save_dir, f"The dog runs.\n\n   \n{long_line}\nA cat sleeps.\n", monkeypatch, capsys)
    lines = out.out.split("\n")[:-1]
    assert len(lines) == 5
    assert lines[1] == "" and lines[2] == ""
    assert lines[0] and lines[3] and lines[4]
    assert "stdin line 4 has" in out.err and "translating its first 63" in out.err
    # the other lines translate as they do alone
    alone = translate(save_dir, "The dog runs.\n", monkeypatch, capsys).out
    assert alone == lines[0] + "\n"


def test_translate_interactive_blank_and_long_lines(full_run, monkeypatch, capsys):
    """A terminal on stdin: one line at a time, the same rules, the warning naming the line."""
    save_dir, _, _ = full_run
    long_line = " ".join(["The old king paints the tall foxes."] * 30)
    stdin = io.TextIOWrapper(io.BytesIO(f"The dog runs.\n\n{long_line}\n".encode()), encoding="utf-8")
    monkeypatch.setattr(stdin, "isatty", lambda: True)
    monkeypatch.setattr(sys, "stdin", stdin)
    capsys.readouterr()
    run(["--translate", "--save-dir", save_dir])
    out = capsys.readouterr()
    lines = out.out.split("\n")[:-1]
    assert len(lines) == 3 and lines[0] and lines[1] == "" and lines[2]
    assert "stdin line 3 has" in out.err


def test_long_validation_lines_are_skipped_and_long_test_lines_refused(corpus, tmp_path, capsys):
    long_src = " ".join(["The old king paints the tall foxes."] * 30)
    src, tgt = corpus["lines"]["valid"]
    paths = dict(corpus["paths"])
    paths["valid"] = (write_lines(tmp_path / "v.en", src[:5] + [long_src] + src[5:]),
                      write_lines(tmp_path / "v.zl", tgt[:5] + ["kurz"] + tgt[5:]))
    m = run(data_args(paths) + SMALL + ["--save-dir", str(tmp_path / "a"), "--max-steps", "1"])
    assert m["steps"] == 1
    out = capsys.readouterr().out
    assert f"valid: skipped 1 of {len(src) + 1} pairs longer than --max-len 64 tokens (the first: line 6 of" in out
    src, tgt = corpus["lines"]["test"]
    paths = dict(corpus["paths"])
    paths["test"] = (write_lines(tmp_path / "t.en", src[:2] + [long_src] + src[2:]),
                     write_lines(tmp_path / "t.zl", tgt[:2] + ["kurz"] + tgt[2:]))
    with pytest.raises(DataError, match=r"--test-src: .*t\.en line 3 has \d+ tokens, more than the 63"):
        run(data_args(paths) + SMALL + ["--save-dir", str(tmp_path / "b"), "--max-steps", "1"])
    assert not os.path.exists(tmp_path / "b" / "checkpoint_last.pt")


# ---- 3. divergence ----------------------------------------------------------------------------------
def poisoned_loss(monkeypatch, from_call, factor):
    """Make the task's loss (and its logged NLL) `factor` times the true one from the from_call-th step."""
    task = train_translation.TASK
    real = type(task).loss
    calls = [0]

    def loss(criterion, model, batch):
        calls[0] += 1
        lo, nll = real(task, criterion, model, batch)
        if calls[0] >= from_call:
            return lo * factor, nll * factor
        return lo, nll

    monkeypatch.setattr(task, "loss", loss)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    poisoned_loss(monkeypatch, 3, float("nan"))
    d = str(tmp_path)
    with pytest.raises(TrainingDiverged, match=r"training diverged at step 3: the training loss is nan.*"
                                               r"checkpoint_last.pt \(step 2\) keeps the last good state"):
        run(data_args(corpus["paths"]) + SMALL + ["--save-dir", d, "--max-steps", "8", "--eval-every", "2"])
    assert ckpt_step(os.path.join(d, "checkpoint_last.pt")) == 2
    records = [json.loads(s) for s in open(os.path.join(d, "train_log.jsonl"))]
    assert records[-1]["diverged"] is True and records[-1]["train_loss"] is None
    assert not os.path.exists(os.path.join(d, "metrics.json"))


def test_exploding_loss_stops_the_run(corpus, tmp_path, monkeypatch):
    poisoned_loss(monkeypatch, 3, 1000.0)
    d = str(tmp_path)
    with pytest.raises(TrainingDiverged, match=rf"above 10 x its lowest value .* for {EXPLODE_WINDOWS} log windows"):
        run(data_args(corpus["paths"]) + SMALL + ["--save-dir", d, "--max-steps", "12", "--eval-every", "2"])
    assert ckpt_step(os.path.join(d, "checkpoint_last.pt")) == 2  # step 4 was never saved: it diverged first


def test_loss_far_above_a_uniform_guess_stops_the_run(tmp_path, capsys):
    """--lr 50 without clipping is garbage from its first window on, so its lowest loss is garbage too and
    the relative check never fires: the absolute line (2 ln V + 4 nats, 15.4 at V = 300) stops it after
    3 windows, with what to try. A run too short for that prints its perplexity in exponent form. On the CPU in
    fp32, so that the loss stays finite and large (in fp16 it turns NaN, which the NaN check reports)."""
    lines = [s for s, _ in builtin_data.generate_pairs(300, 204)]
    common = ["--train", write_lines(tmp_path / "train.txt", lines[:270]),
              "--valid", write_lines(tmp_path / "valid.txt", lines[270:]), "--vocab-size", "300", "--block-size",
              "32", "--max-tokens", "256", "--no-progress", "--num-samples", "0", "--lr", "50", "--clip-norm", "0",
              "--warmup", "1", "--device", "cpu"]  # fp32: in fp16 on a GPU the loss turns NaN first
    d = str(tmp_path / "stopped")
    with pytest.raises(TrainingDiverged, match=r"training diverged at step 6: the training loss \(\d+\.\d+ nats/token\) "
                                               r"has been above 15\.4 for 3 log windows in a row, far worse than a "
                                               r"uniform guess .*Try a lower --lr \(this run: 50\), --clip-norm 1"):
        run_main(train_lm.main, common + ["--save-dir", d, "--max-steps", "12", "--log-every", "2"])
    assert not os.path.exists(os.path.join(d, "checkpoint_last.pt"))  # nothing diverged was saved
    capsys.readouterr()
    m = run_main(train_lm.main, common + ["--save-dir", str(tmp_path / "short"), "--max-steps", "2", "--log-every",
                                          "1"])
    assert m["valid_loss"] > 100
    out = capsys.readouterr().out
    assert re.search(r"valid ppl \d\.\d\de\+\d+ ", out) and re.search(r"\(ppl \d\.\d\de\+\d+\)", out), out
    assert not re.search(r"\d{12}", out), out


def test_divergence_exits_non_zero(capsys):
    def main():
        raise TrainingDiverged("training diverged at step 3: the training loss is nan")

    with pytest.raises(SystemExit) as e:
        training_run.run_main(main)
    assert e.value.code == 3
    assert "error: training diverged at step 3" in capsys.readouterr().err


# ---- 4. early stopping and budgets ------------------------------------------------------------------
def test_patience_stops_after_validations_without_improvement(corpus, tmp_path, capsys):
    # a learning rate too small to change any translation: BLEU never improves on the first validation
    m = run(data_args(corpus["paths"]) + SMALL + ["--save-dir", str(tmp_path), "--max-steps", "20", "--eval-every",
                                                  "1", "--lr", "1e-9", "--eval-bleu", "--best-metric", "bleu",
                                                  "--patience", "2"])
    assert m["steps"] == 3
    assert m["stop_reason"].startswith("early stop: bleu did not improve in 2 validations (--patience 2")
    assert "stopped at step 3: early stop" in capsys.readouterr().out
    assert ckpt_step(os.path.join(str(tmp_path), "checkpoint_best.pt")) == 1
    assert m["bleu"] is not None  # the test set is still scored


def test_max_time_stops_cleanly_and_scores_the_test_set(corpus, tmp_path):
    d = str(tmp_path)
    m = run(data_args(corpus["paths"]) + SMALL + ["--save-dir", d, "--max-steps", "50", "--max-time", "0.001"])
    assert m["steps"] == 1 and m["stop_reason"] == "--max-time 0.001s spent"
    assert ckpt_step(os.path.join(d, "checkpoint_last.pt")) == 1
    assert os.path.isfile(os.path.join(d, "hypotheses.test.txt")) and m["bleu"] is not None


# ---- 5./6. checkpoints, validation BLEU, averaging ---------------------------------------------------
def test_checkpoint_files_and_validation_bleu(full_run):
    d, m, out = full_run
    names = set(os.listdir(d))
    assert {"checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_4.pt", "checkpoint_6.pt",
            "checkpoint_average.pt"} <= names
    assert "checkpoint_2.pt" not in names  # --keep-last 2
    last = torch.load(os.path.join(d, "checkpoint_last.pt"), map_location="cpu", weights_only=True)
    for name in ("checkpoint_best.pt", "checkpoint_4.pt", "checkpoint_average.pt"):
        c = torch.load(os.path.join(d, name), map_location="cpu", weights_only=True)
        assert c["tokenizer"]["sha256"] == last["tokenizer"]["sha256"] and c["model_config"] == last["model_config"]
        assert {"optimizer", "scheduler", "rng", "step"} <= set(c["trainer"])
    assert len(re.findall(r"\| valid BLEU \d+\.\d\d", out)) == 3
    assert "checkpoint_average.pt" not in m  # metrics name what was averaged
    assert m["average"]["checkpoints"] == ["checkpoint_4.pt", "checkpoint_6.pt"]
    assert m["average"]["bleu"] is not None and m["bleu"] is not None
    assert "checkpoints compared: last (step 6)" in out and "average of the last 2 (steps 4, 6)" in out
    avg = torch.load(os.path.join(d, "checkpoint_average.pt"), map_location="cpu", weights_only=True)
    c4 = torch.load(os.path.join(d, "checkpoint_4.pt"), map_location="cpu", weights_only=True)
    k = next(iter(avg["trainer"]["model"]))
    expect = (c4["trainer"]["model"][k] + last["trainer"]["model"][k]) / 2
    assert torch.allclose(avg["trainer"]["model"][k], expect)


@pytest.mark.parametrize("links", [True, False])
def test_copied_checkpoint_keeps_its_state_when_the_source_is_saved_again(tmp_path, monkeypatch, links):
    from training.checkpoints import copy_checkpoint, save_checkpoint
    if not links:  # a file system without hard links: a plain copy
        monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError("no links here")))
    last, best = str(tmp_path / "checkpoint_last.pt"), str(tmp_path / "checkpoint_best.pt")
    save_checkpoint(last, {"step": 1})
    copy_checkpoint(last, best)
    save_checkpoint(last, {"step": 2})
    copy_checkpoint(last, str(tmp_path / "checkpoint_2.pt"))
    assert torch.load(best)["step"] == 1 and torch.load(last)["step"] == 2
    assert torch.load(str(tmp_path / "checkpoint_2.pt"))["step"] == 2
    assert os.path.samefile(last, str(tmp_path / "checkpoint_2.pt")) == links
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_checkpoint_writer_saves_the_state_as_it_was_and_reports_failures(tmp_path, device):
    from training.checkpoints import CheckpointWriter
    writer = CheckpointWriter()
    w = torch.arange(6.0, device=device)
    state = {"trainer": {"model": {"w": w, "v": w[2:4]}, "step": 3}, "rng": [torch.ones(2, dtype=torch.uint8)]}
    path, done = str(tmp_path / "checkpoint_last.pt"), []
    writer.save(path, state, then=lambda: done.append(os.path.getsize(path)))
    w.add_(100)  # training goes on while the file is written
    writer.wait()
    saved = torch.load(path)
    assert torch.equal(saved["trainer"]["model"]["w"], torch.arange(6.0))
    assert torch.equal(saved["trainer"]["model"]["v"], torch.tensor([2.0, 3.0])) and saved["trainer"]["step"] == 3
    assert done and done[0] > 0  # `then` ran once the file was complete
    writer.save(str(tmp_path / "missing" / "checkpoint_last.pt"), state)
    with pytest.raises(RuntimeError, match="cannot write checkpoint .*missing/checkpoint_last.pt: No such file"):
        writer.wait()
    writer.wait()  # the error is raised once


def test_eval_bleu_flags_are_checked(corpus, tmp_path, monkeypatch, capsys):
    base = data_args(corpus["paths"]) + SMALL + ["--save-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        train_translation.TASK.parse_args(base + ["--best-metric", "bleu"])
    assert "--best-metric bleu needs --eval-bleu" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "sacrebleu", None)
    with pytest.raises(SystemExit):
        train_translation.TASK.parse_args(base + ["--eval-bleu"])
    assert "--eval-bleu needs sacrebleu, which is not installed: pip install sacrebleu" in capsys.readouterr().err


def test_average_checkpoints_script(full_run, tmp_path, capsys):
    d, _, _ = full_run
    out = str(tmp_path / "avg.pt")
    average_checkpoints.main(["--last", "2", "--save-dir", d, "-o", out])
    a = torch.load(out, map_location="cpu", weights_only=True)
    b = torch.load(os.path.join(d, "checkpoint_average.pt"), map_location="cpu", weights_only=True)
    assert all(torch.equal(a["trainer"]["model"][k], b["trainer"]["model"][k]) for k in a["trainer"]["model"])
    # an existing output is not replaced unless asked
    stamp = os.stat(out).st_mtime_ns
    with pytest.raises(DataError, match=r"--output .*avg\.pt exists; pass --overwrite to replace it"):
        average_checkpoints.main(["--last", "2", "--save-dir", d, "-o", out])
    assert os.stat(out).st_mtime_ns == stamp
    average_checkpoints.main(["--last", "2", "--save-dir", d, "-o", out, "--overwrite"])
    # another model: refused, naming the files
    other = torch.load(os.path.join(d, "checkpoint_4.pt"), map_location="cpu", weights_only=True)
    other["model_config"] = dict(other["model_config"], encoder_layers=3)
    bad = str(tmp_path / "other.pt")
    torch.save(other, bad)
    with pytest.raises(DataError, match=r"cannot average .*other\.pt with .*checkpoint_6\.pt: they hold different "
                                        r"models \(model_config differs in encoder_layers\)"):
        average_checkpoints.main([os.path.join(d, "checkpoint_6.pt"), bad, "-o", str(tmp_path / "x.pt")])
    assert not os.path.exists(tmp_path / "x.pt")


# ---- 7. training log and plot -----------------------------------------------------------------------
def test_train_log(full_run):
    d, m, out = full_run
    records = [json.loads(s) for s in open(os.path.join(d, "train_log.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in valid] == [2, 4, 6]
    for r in train:
        assert {"epoch", "train_loss", "lr", "tokens_per_s", "wall_s"} <= set(r)
    for r in valid:
        assert {"epoch", "train_loss", "valid_loss", "valid_ppl", "bleu", "lr", "wall_s"} <= set(r)
        assert r["bleu"] is not None
    assert valid[-1]["valid_loss"] == pytest.approx(m["valid_loss"])
    png = os.path.join(d, "train_log.png")
    if os.path.isfile(png):
        assert f"plot: the training log drawn in {png}" in out.splitlines()
        return
    assert "install matplotlib (pip install matplotlib)" in out


def test_plot_is_written_with_matplotlib(full_run, tmp_path):
    pytest.importorskip("matplotlib")
    from training.trainlog import plot_log
    import shutil
    shutil.copy(os.path.join(full_run[0], "train_log.jsonl"), tmp_path)
    lines = []
    path = os.path.join(str(tmp_path), "train_log.png")
    assert plot_log(str(tmp_path), lines.append) == path and os.path.isfile(path)
    assert lines == [f"plot: the training log drawn in {path}"]  # a written plot is announced, with its path


def test_plot_without_matplotlib_says_how(full_run, tmp_path, monkeypatch):
    from training.trainlog import plot_log
    import shutil
    shutil.copy(os.path.join(full_run[0], "train_log.jsonl"), tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    lines = []
    assert plot_log(str(tmp_path), lines.append) is None
    assert len(lines) == 1 and "pip install matplotlib" in lines[0]


def test_resumed_log_drops_records_past_the_checkpoint(tmp_path):
    from training.trainlog import TrainLog, read_log
    log = TrainLog(str(tmp_path), 0.0)
    for step in (1, 2, 3, 4):
        log.write({"kind": "train", "step": step}, 1.0)
    TrainLog(str(tmp_path), 0.0, resume_step=2)
    assert [r["step"] for r in read_log(os.path.join(str(tmp_path), "train_log.jsonl"))] == [1, 2]


# ---- 8. warmup --------------------------------------------------------------------------------------
def test_warmup_adapts_to_planned_steps():
    args = train_translation.TASK.parse_args(["--arch", "small"])
    # 29k pairs in 143 batches per epoch, 20 epochs: 2860 steps; the --arch value 4000 is never reached
    warmup, how = cli.adapt_warmup(args, 20 * 143, 4000, 143)
    assert warmup == 572 and "a fifth of the 2860 planned steps" in how
    assert cli.adapt_warmup(args, 100_000, 4000, 5000)[0] == 4000
    assert cli.adapt_warmup(args, None, 4000, 143)[0] == 4000  # --max-steps runs keep the --arch value
    args = train_translation.TASK.parse_args(["--arch", "small", "--warmup", "3000"])
    assert cli.adapt_warmup(args, 2860, 4000, 143)[0] == 3000  # explicit wins
    # four epochs of 500 steps: one epoch, between the fifth (400) and the third (666)
    args = train_translation.TASK.parse_args(["--arch", "small"])
    warmup, how = cli.adapt_warmup(args, 2000, 4000, 500)
    assert warmup == 500 and "one epoch of 500 steps" in how
    # the CPU's default run, 3 epochs of 218 steps: a third (218), so it keeps the --arch value 200
    args = train_translation.TASK.parse_args([])
    assert cli.adapt_warmup(args, 654, 200, 218)[0] == 200
    assert cli.adapt_warmup(args, 654, 300, 218)[0] == 218


def test_warmup_of_an_early_stopped_run_is_at_most_two_epochs():
    """With --patience the planned steps are a ceiling: tinyshakespeare's 39 steps per epoch and 2028 planned
    give 78 warmup steps, not a fifth of 2028 (405), which the run would stop before reaching."""
    args = train_lm.TASK.parse_args(["--arch", "llama-small", "--patience", "2"])
    warmup, how = cli.adapt_warmup(args, 2028, 2000, 39)
    assert warmup == 78 and "two epochs of 39 steps" in how and "2028 planned" in how
    assert cli.adapt_warmup(args, 2028, 50, 39)[0] == 50  # a shorter --arch value stays
    assert cli.adapt_warmup(args, 30_000, 2000, 5000)[0] == 2000  # a large corpus: the --arch value
    assert cli.adapt_warmup(args, 800, 2000, 100)[0] == 160  # the fifth is the smaller cap
    args = train_lm.TASK.parse_args(["--arch", "llama-small"])  # without early stopping: the fifth
    assert cli.adapt_warmup(args, 2028, 2000, 39)[0] == 405


def test_cooldown_is_the_last_fifth_of_a_planned_run():
    args = train_translation.TASK.parse_args(["--arch", "small"])
    cooldown, how = cli.adapt_cooldown(args, 1530, 1530)
    assert cooldown == 306 and "a fifth of the 1530 planned steps" in how
    args = train_translation.TASK.parse_args(["--max-steps", "100"])
    cooldown, how = cli.adapt_cooldown(args, None, 100)
    assert cooldown == 0 and "no cooldown in a --max-steps run" in how
    args = train_lm.TASK.parse_args(["--patience", "2"])
    cooldown, how = cli.adapt_cooldown(args, 2028, 2028)
    assert cooldown == 0 and "early stopping" in how
    for flags, planned, total, expected in ((["--cooldown", "50"], 1530, 1530, 50),
                                            (["--cooldown", "0"], 1530, 1530, 0),
                                            (["--max-steps", "100", "--cooldown", "100"], None, 100, 100),
                                            (["--patience", "2", "--cooldown", "40"], 2028, 2028, 40)):
        args = train_lm.TASK.parse_args(flags)
        assert cli.adapt_cooldown(args, planned, total) == (expected, f"--cooldown {expected}")  # explicit wins
    args = train_translation.TASK.parse_args(["--max-steps", "100", "--cooldown", "101"])
    with pytest.raises(DataError, match="--cooldown 101 is longer than the run, 100 steps here"):
        cli.adapt_cooldown(args, None, 100)


def test_default_length_gives_the_larger_archs_their_steps():
    archs = train_translation.ARCHS
    args = train_translation.TASK.parse_args(["--arch", "small"])
    assert args.default_length and args.epochs == cli.DEFAULT_EPOCHS
    small, tiny = archs["small"], archs["tiny"]
    # a 30k-pair corpus in 51 batches of 8192 tokens: 30 epochs reach the 1500 steps
    epochs, how = cli.default_epochs(args, 51, small)
    assert epochs == 30 and "1530 steps" in how and "at least 6 epochs and 1500 steps" in how
    # 300k pairs, 508 batches: 3 epochs would reach the steps, small still takes its 6 epochs
    epochs, how = cli.default_epochs(args, 508, small)
    assert epochs == small["min_epochs"] == 6 and "3048 steps" in how
    # an arch row without min_epochs takes DEFAULT_EPOCHS
    assert cli.default_epochs(args, 1010, dict(small, min_epochs=cli.DEFAULT_EPOCHS))[0] == cli.DEFAULT_EPOCHS
    assert cli.default_epochs(args, 1010, {"min_steps": 2000})[0] == cli.DEFAULT_EPOCHS
    # tiny keeps its 3 epochs however small the corpus
    args = train_translation.TASK.parse_args([])
    assert cli.default_epochs(args, 5, tiny)[0] == cli.DEFAULT_EPOCHS
    for flags in (["--epochs", "2"], ["--max-steps", "7"]):
        assert not train_translation.TASK.parse_args(flags).default_length


def test_default_length_is_printed_and_used(corpus, tmp_path, capsys, monkeypatch):
    # the tiny model with a step floor that 3 epochs of this corpus do not reach: min_steps comes from --arch
    monkeypatch.setitem(train_translation.TASK.archs, "tiny", dict(train_translation.ARCHS["tiny"], min_steps=60))
    metrics = run(data_args(corpus["paths"]) + SMALL + ["--save-dir", str(tmp_path)])
    out = capsys.readouterr().out
    epochs = int(out.split("length: ")[1].split()[0])
    per_epoch = metrics["steps"] // epochs
    assert "at least 60 steps" in out and epochs > cli.DEFAULT_EPOCHS
    assert metrics["steps"] == epochs * per_epoch and metrics["steps"] >= 60 > metrics["steps"] - per_epoch


def test_warmup_is_printed_at_start(corpus, tmp_path, capsys):
    run(data_args(corpus["paths"]) + SMALL + ["--save-dir", str(tmp_path), "--epochs", "1", "--arch", "tiny"])
    out = capsys.readouterr().out
    # 13 batches, one epoch: 4 steps of warmup (a third), not the --arch value 200
    assert re.search(r"schedule: peak lr 0\.002, warmup \d+ steps: a third of the \d+ planned steps", out)
    ckpt = torch.load(os.path.join(str(tmp_path), "checkpoint_last.pt"), map_location="cpu", weights_only=True)
    assert ckpt["trainer"]["scheduler"]["lr_lambdas"][0]["warmup"] < 200


# ---- 9. CUDA graphs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("requested, device, reference, update_freq, backend, expect", [
    (None, "cuda", False, 1, "cuda", (True, None)),
    (True, "cuda", False, 1, "cuda", (True, None)),
    (False, "cuda", False, 1, "cuda", (False, None)),
    (None, "cpu", False, 1, "reference", (False, "a CUDA device")),
    (None, "cuda", True, 1, "cuda", (False, "the fused kernels, not --reference")),
    (None, "cuda", False, 1, "reference", (False, "the fused kernels (lsmini's backend here is the reference path)")),
    (None, "cuda", False, 2, "cuda", (False, "--update-freq 1")),
])
def test_cuda_graph_decision(requested, device, reference, update_freq, backend, expect):
    assert runtime.cuda_graph_decision(requested, device, reference, update_freq, backend) == expect


def test_cuda_graph_flags_on_cpu(corpus, tmp_path, capsys):
    args = train_translation.TASK.parse_args(["--no-cuda-graph"])
    assert args.cuda_graph is False
    assert train_translation.TASK.parse_args([]).cuda_graph is None
    assert train_translation.TASK.parse_args(["--cuda-graph"]).cuda_graph is True
    # on CPU also where a GPU is present: the line says why the default could not apply
    m = run(data_args(corpus["paths"]) + SMALL + ["--save-dir", str(tmp_path), "--max-steps", "1", "--device", "cpu"])
    assert m["steps"] == 1
    assert "CUDA graphs: off, they need a CUDA device" in capsys.readouterr().out
