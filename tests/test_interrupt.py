"""SIGINT and SIGTERM during training (CPU, tiny runs): the run finishes the optimizer step the signal came in,
writes a checkpoint of it, says where and at which step, and exits with 130 (SIGINT) or 143 (SIGTERM); a
second signal is not caught; --resume from that checkpoint ends where the uninterrupted run ends (the same
parameters, losses and training log); under torchrun a signal to one rank stops every rank after the same step.

The signals come from outside (a running script, whatever step it is in) and from inside a step
(signal.raise_signal in the loss, so the step is known). The in-process tests first put handlers of their
own on both signals, which fail the test instead of ending pytest should the run not handle the signal."""
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from example_testing import EXAMPLES, builtin_pairs, run, write_corpus, write_lines
import builtin_data  # noqa: E402  (after example_testing, which puts examples/ on sys.path)
import train_lm  # noqa: E402
import train_translation  # noqa: E402
from training import interrupt, runtime  # noqa: E402
from training.trainer import TrainingInterrupted  # noqa: E402

ROOT = os.path.dirname(EXAMPLES)
CHECKPOINT = "checkpoint_last.pt"
# the line a run stopped by a signal ends with
STOPPED = re.compile(r"interrupted by (SIG[A-Z]+) after step (\d+): checkpoint written to (.+) \(step (\d+)\); "
                     r"continue with the same command and --resume")


class SignalReachedTheTest(Exception):
    """A signal the run under test did not handle, or a second one it must not catch."""


@contextlib.contextmanager
def guarded_signals():
    """Handlers of the test on SIGINT and SIGTERM (raising SignalReachedTheTest) while the block runs."""
    def reached(signum, frame):
        raise SignalReachedTheTest(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, reached) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield reached
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def signal_in_micro_batch(monkeypatch, task, n, sig, times=1):
    """Make the task's loss raise `sig` (`times` times) in its n-th call, i.e. inside the step of that micro-batch.
    Returns the handlers found on the signal right after it, one list per raise."""
    loss = type(task).loss
    calls, seen = [], []

    def loss_with_signal(criterion, model, batch):
        calls.append(1)
        if len(calls) == n:
            for _ in range(times):
                signal.raise_signal(sig)  # its Python handler runs before this returns
                seen.append(signal.getsignal(sig))
        return loss(task, criterion, model, batch)

    monkeypatch.setattr(task, "loss", loss_with_signal)
    return seen


def checkpoint(save_dir):
    return torch.load(os.path.join(str(save_dir), CHECKPOINT), map_location="cpu", weights_only=True)


def log_records(save_dir):
    """train_log.jsonl without the fields that measure time."""
    with open(os.path.join(str(save_dir), "train_log.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("wall_s", "tokens_per_s")} for line in f]


def assert_same_run(a_dir, a_metrics, b_dir, b_metrics, steps):
    """Two runs that ended at the same place: parameters, optimizer, losses, BLEU and the training log."""
    a, b = checkpoint(a_dir)["trainer"], checkpoint(b_dir)["trainer"]
    assert a["step"] == b["step"] == steps
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"{k} differs after the interrupted run's resume"
    for k, v in a["optimizer"]["state"].items():
        for name, t in v.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, b["optimizer"]["state"][k][name]), f"optimizer {k} {name}"
    for k in ("train_loss", "valid_loss", "bleu", "steps"):
        assert a_metrics[k] == b_metrics[k], k
    assert log_records(a_dir) == log_records(b_dir)


# ---- the language model, signalled from outside ----------------------------------------------------------
@pytest.fixture(scope="module")
def lm_text(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    lines = [s for s, _ in builtin_data.generate_pairs(200, 202)]
    return ["--train", write_lines(d / "train.txt", lines[:180]), "--valid", write_lines(d / "valid.txt", lines[180:])]


def lm_args(lm_text):
    return lm_text + ["--arch", "tiny", "--vocab-size", "300", "--block-size", "32", "--max-tokens", "256",
                      "--log-every", "2", "--eval-every", "3", "--no-progress", "--num-samples", "0", "--dropout",
                      "0.3"]


# The script as a terminal starts it: with Python's own SIGINT handler even when pytest itself was started in
# the background of a shell script (which starts it, and so its children, with SIGINT ignored).
LAUNCH = """
import runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_the_run_with_a_checkpoint_that_resumes_exactly(lm_text, tmp_path, sig, status):
    """A signal sent to a running train_lm.py once it trains: exit status 128 + the signal, the last line says
    where the checkpoint is and at which step, and --resume from it ends where the uninterrupted run ends,
    whatever step the signal came in (within a log window or not, at a validation or not)."""
    stopped = str(tmp_path / "stopped")
    argv = [sys.executable, "-c", LAUNCH, os.path.join(EXAMPLES, "train_lm.py")] + lm_args(lm_text) + [
        "--save-dir", stopped, "--max-steps", "1000"]
    path = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    # the threads of this process: the runs resumed and compared in-process round their sums the same way
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(torch.get_num_threads()))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = ""
        while not line.startswith("step "):  # a log line: the run is training
            # generous: Python and torch start slowly on a loaded 2-core machine
            ready, _, _ = select.select([proc.stdout], [], [], 180)
            assert ready, "no training log line within 180 s"
            line = proc.stdout.readline()
            assert line, f"the run ended before training: {proc.stderr.read()[-3000:]}"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, f"exit status {proc.returncode}\n{err[-3000:]}"
    last = err.strip().splitlines()[-1]
    m = STOPPED.fullmatch(last)
    assert m, last
    name, step, where, step_again = m.groups()
    assert name == sig.name and step == step_again and where == os.path.join(stopped, CHECKPOINT)
    assert f"{sig.name} received: stopping after the current step" in err
    steps = int(step)
    assert checkpoint(stopped)["trainer"]["step"] == steps
    assert not os.path.exists(os.path.join(stopped, "metrics.json"))  # the run did not end

    end = steps + 3
    resumed = run(train_lm.main, lm_args(lm_text) + ["--save-dir", stopped, "--max-steps", str(end), "--resume"])
    straight_dir = str(tmp_path / "straight")
    straight = run(train_lm.main, lm_args(lm_text) + ["--save-dir", straight_dir, "--max-steps", str(end)])
    assert_same_run(stopped, resumed, straight_dir, straight, end)


# ---- translation, signalled inside a known step -----------------------------------------------------------
@pytest.fixture(scope="module")
def mt_data(tmp_path_factory):
    paths = write_corpus(tmp_path_factory.mktemp("mt"),
                         builtin_pairs((("train", 300, 701), ("valid", 16, 702), ("test", 8, 703))))
    return [arg for split, (src, tgt) in paths.items() for arg in (f"--{split}-src", src, f"--{split}-tgt", tgt)]


def mt_args(mt_data, eval_every):
    return mt_data + ["--arch", "tiny", "--vocab-size", "300", "--max-tokens", "512", "--max-len", "64", "--log-every",
                      "4", "--no-progress", "--beam", "1", "--dropout", "0.3", "--update-freq", "2", "--keep-last", "3",
                      "--eval-every", str(eval_every)]


@pytest.mark.parametrize("eval_every", [3, 2])
def test_signal_inside_a_step_saves_that_whole_step(mt_data, tmp_path, monkeypatch, eval_every):
    """SIGINT in the third micro-batch of a --update-freq 2 run, the first of step 2: step 2 is finished, saved
    and the run stops (TrainingInterrupted, exit status 130); the handlers found before are back, from the
    moment the signal came. Step 2 is validated first when it is due for validation (--eval-every 2), so that
    the resumed run's validations and best checkpoint are the straight run's; otherwise it is saved as it is,
    without a periodic checkpoint (--keep-last counts validations), in the middle of a log window."""
    stopped = tmp_path / "stopped"
    seen = signal_in_micro_batch(monkeypatch, train_translation.TASK, 3, signal.SIGINT)
    with guarded_signals() as guard:
        with pytest.raises(TrainingInterrupted) as e:
            run(train_translation.main, mt_args(mt_data, eval_every) + ["--save-dir", str(stopped), "--max-steps", "5"])
        assert signal.getsignal(signal.SIGINT) is guard and signal.getsignal(signal.SIGTERM) is guard
    assert seen == [guard]  # a second SIGINT would have gone to the handler found before
    assert e.value.exit_status == 130
    assert e.value.message == (f"interrupted by SIGINT after step 2: checkpoint written to {stopped / CHECKPOINT} "
                               "(step 2); continue with the same command and --resume")
    state = checkpoint(stopped)["trainer"]
    assert state["step"] == 2 and state["batch_in_epoch"] == 4
    validated = eval_every == 2
    assert os.path.exists(stopped / "checkpoint_2.pt") == validated
    assert (state["window"] is None) == validated  # unvalidated, step 2 is inside a log window (--log-every 4)
    monkeypatch.undo()

    resumed = run(train_translation.main, mt_args(mt_data, eval_every) + ["--save-dir", str(stopped), "--max-steps",
                                                                          "5", "--resume"])
    straight = tmp_path / "straight"
    m = run(train_translation.main, mt_args(mt_data, eval_every) + ["--save-dir", str(straight), "--max-steps", "5"])
    assert_same_run(stopped, resumed, straight, m, 5)
    assert sorted(os.listdir(stopped)) == sorted(os.listdir(straight))  # the same periodic and best checkpoints


def test_a_second_signal_is_not_caught(lm_text, tmp_path, monkeypatch):
    """After the first SIGTERM the handler found before is back: a second one reaches it at once, in the middle
    of the step (from the shell, SIGTERM's default ends the process; a second Ctrl-C raises KeyboardInterrupt)."""
    seen = signal_in_micro_batch(monkeypatch, train_lm.TASK, 2, signal.SIGTERM, times=2)
    with guarded_signals() as guard:
        with pytest.raises(SignalReachedTheTest, match="SIGTERM"):
            run(train_lm.main, lm_args(lm_text) + ["--save-dir", str(tmp_path), "--max-steps", "5"])
    assert seen == [guard]  # the first raise returned; the second raised in the test's handler
    assert not os.path.exists(tmp_path / CHECKPOINT)


# ---- the handlers ------------------------------------------------------------------------------------------
def test_handlers_are_only_installed_from_the_main_thread_and_not_over_an_ignored_signal():
    single = runtime.Distributed()
    with guarded_signals() as guard:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `cmd &` in a script starts a command
        with interrupt.StopSignals(single) as s:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == s._handle
        assert signal.getsignal(signal.SIGTERM) is guard and signal.getsignal(signal.SIGINT) is signal.SIG_IGN

        found = []

        def in_a_thread():
            with interrupt.StopSignals(single):
                found.append(signal.getsignal(signal.SIGTERM))

        t = threading.Thread(target=in_a_thread)
        t.start()
        t.join()
        assert found == [guard]
    assert interrupt.exit_status(signal.SIGINT) == 130 and interrupt.exit_status(signal.SIGTERM) == 143


# ---- torchrun: a signal to one rank stops every rank after the same step -----------------------------------
ONE_RANK_SIGNALLED = """
import os, signal, sys, time
sys.path.insert(0, {examples!r})
import train_lm
from training import checkpoints, run, trainer

argv = sys.argv[1:]
rank = os.environ["RANK"]
train = trainer.Trainer.train
save = checkpoints.save_checkpoint


def slow_save(path, state):  # the interrupted step's checkpoint takes a while to write, as a large model's does
    if state["trainer"]["step"] == 5:
        time.sleep(2)
    save(path, state)


def reporting_train(self, batches, loss_fn, *rest, **kw):
    calls = []

    def loss(model, batch):
        calls.append(1)
        if rank == "1" and len(calls) == 5:  # inside step 5, on rank 1 alone
            signal.raise_signal(signal.SIGTERM)
        return loss_fn(model, batch)
    try:
        return train(self, batches, loss, *rest, **kw)
    finally:
        print(f"rank {{rank}} left training at step {{self.step}}", flush=True)


trainer.Trainer.train = reporting_train
checkpoints.save_checkpoint = slow_save
run.run_main(lambda: train_lm.main(argv))
"""


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="torch.distributed with gloo is not available")
def test_signal_to_one_rank_stops_every_rank_after_the_same_step(lm_text, tmp_path):
    """SIGTERM to rank 1 alone, inside step 5: both ranks leave training after step 5, rank 0 writes its
    checkpoint (with both ranks' RNG states and the log window) and alone says where, and rank 1 ends only
    after that: torchrun stops the job's other processes as soon as one ends."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(ONE_RANK_SIGNALLED.format(examples=EXAMPLES))
    save_dir = tmp_path / "run"
    path = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.5", str(launcher)] + lm_args(lm_text) + [
        "--max-steps", "20", "--device", "cpu", "--save-dir", str(save_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path))
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"torchrun did not finish within 180 s (ranks waiting for each other?)\n{err.stderr}")
    assert proc.returncode != 0
    assert "rank 0 left training at step 5" in proc.stdout and "rank 1 left training at step 5" in proc.stdout, \
        proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (f"rank 0: interrupted by SIGTERM after step 5: checkpoint written to {save_dir / CHECKPOINT} (step 5)"
            in proc.stderr), proc.stderr[-3000:]
    assert "rank 1: " not in proc.stderr  # rank 0 alone says where the checkpoint is
    state = checkpoint(save_dir)["trainer"]
    assert state["step"] == 5 and state["window"]["steps"] == 1 and len(state["rng_per_rank"]) == 2
