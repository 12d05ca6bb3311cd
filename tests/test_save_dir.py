"""A save directory belongs to one run (examples/training/checkpoints.py): checkpoints carry the run's
tokenizer and its hash; --resume, --translate and --generate refuse a tokenizer on disk that is not the
checkpoint's; a new run refuses a directory holding a checkpoint unless --overwrite; an interrupted
--overwrite run leaves nothing of two runs mixed; stale *.tmp files go when a run starts."""
import errno
import hashlib
import io
import os
import re
import sys

import pytest
import torch

from example_testing import builtin_pairs, run, write_corpus, write_lines
import builtin_data  # noqa: E402  (after example_testing, which puts examples/ on sys.path)
import train_lm  # noqa: E402
import train_translation  # noqa: E402
from training import checkpoints, run as training_run, tokenizer  # noqa: E402
from training.data import DataError  # noqa: E402

SMALL = ["--arch", "tiny", "--vocab-size", "300", "--max-tokens", "512", "--max-len", "64", "--log-every", "2",
         "--no-progress", "--beam", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Data flags of a small parallel corpus from the built-in grammar (train 300, valid 16, test 8)."""
    paths = write_corpus(tmp_path_factory.mktemp("corpus"),
                         builtin_pairs((("train", 300, 301), ("valid", 16, 302), ("test", 8, 303))))
    return [arg for split, (src, tgt) in paths.items() for arg in (f"--{split}-src", src, f"--{split}-tgt", tgt)]


def train(data, save_dir, *extra):
    return run(train_translation.main, data + SMALL + ["--save-dir", str(save_dir), "--max-steps", "2", *extra])


def read(path):
    with open(path, "rb") as f:
        return f.read()


def translate(save_dir, monkeypatch, text=b"The dog sleeps.\n"):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text), encoding="utf-8"))
    return run(train_translation.main, ["--translate", "--save-dir", str(save_dir), "--beam", "1"])


def replace_tokenizer(save_dir, vocab_size=200):
    """What a later run into the same directory does first: train another tokenizer over spm.model."""
    lines = [s for pair in builtin_data.generate_pairs(200, 999) for s in pair]
    tokenizer.train_sentencepiece(lines, os.path.join(save_dir, tokenizer.SPM_NAME), vocab_size, "bpe", 1)


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    train(data, d)
    return d


def copy_run(src, dst):
    os.makedirs(dst)
    for name in (checkpoints.CHECKPOINT_NAME, tokenizer.SPM_NAME):
        with open(os.path.join(dst, name), "wb") as f:
            f.write(read(os.path.join(src, name)))
    return dst


# ---- the checkpoint carries the tokenizer -------------------------------------------------------------
def test_checkpoint_holds_the_tokenizer_and_its_hash(trained):
    ckpt = torch.load(os.path.join(trained, checkpoints.CHECKPOINT_NAME), map_location="cpu", weights_only=True)
    spm = read(os.path.join(trained, tokenizer.SPM_NAME))
    assert ckpt["tokenizer"]["model"] == spm
    assert ckpt["tokenizer"]["sha256"] == hashlib.sha256(spm).hexdigest()


# ---- a tokenizer that is not the checkpoint's ---------------------------------------------------------
def test_translate_refuses_another_tokenizer(trained, tmp_path, monkeypatch):
    d = copy_run(trained, str(tmp_path / "mixed"))
    assert translate(d, monkeypatch) is None  # the matching pair works
    replace_tokenizer(d)
    with pytest.raises(DataError, match=r"--translate: .*spm.model is not the tokenizer the model in .* was trained "
                                        r"with \(sha256 \w{12} on disk, \w{12} in the checkpoint\).*--overwrite"):
        translate(d, monkeypatch)


def test_resume_refuses_another_tokenizer_before_touching_anything(trained, data, tmp_path):
    d = copy_run(trained, str(tmp_path / "mixed"))
    replace_tokenizer(d)
    before = {name: read(os.path.join(d, name)) for name in os.listdir(d)}
    with pytest.raises(DataError, match="--resume: .*spm.model is not the tokenizer the model in"):
        train(data, d, "--resume", "--max-steps", "4")
    assert {name: read(os.path.join(d, name)) for name in os.listdir(d)} == before


def test_missing_tokenizer_is_named(trained, tmp_path, monkeypatch):
    d = copy_run(trained, str(tmp_path / "no_spm"))
    os.remove(os.path.join(d, tokenizer.SPM_NAME))
    with pytest.raises(DataError, match="--translate: the tokenizer .*spm.model of the model in .* is missing"):
        translate(d, monkeypatch)


def test_checkpoint_without_tokenizer_record_still_loads(trained, tmp_path, monkeypatch, capsys):
    """Checkpoints written before the record existed: used as they are, with a note."""
    d = copy_run(trained, str(tmp_path / "old"))
    path = os.path.join(d, checkpoints.CHECKPOINT_NAME)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    del ckpt["tokenizer"]
    torch.save(ckpt, path)
    assert translate(d, monkeypatch) is None
    assert "does not record its tokenizer" in capsys.readouterr().err


def _one_step_lm(tmp_path, seed):
    """The save directory of a one-step train_lm.py run on generated sentences (tmp_path/lm)."""
    lines = [s for s, _ in builtin_data.generate_pairs(120, seed)]
    d = str(tmp_path / "lm")
    run(train_lm.main, ["--arch", "tiny", "--train", write_lines(tmp_path / "train.txt", lines[:100]),
                        "--valid", write_lines(tmp_path / "valid.txt", lines[100:]), "--save-dir", d,
                        "--vocab-size", "300", "--block-size", "32", "--max-tokens", "256", "--max-steps", "1",
                        "--no-progress", "--num-samples", "0"])
    return d


def test_generate_refuses_another_tokenizer(tmp_path):
    d = _one_step_lm(tmp_path, 304)
    replace_tokenizer(d)
    with pytest.raises(DataError, match="--generate: .*spm.model is not the tokenizer the model in"):
        run(train_lm.main, ["--save-dir", d, "--generate", "The dog", "--num-samples", "1"])


# ---- a save directory of the other example ------------------------------------------------------------
def test_the_other_examples_save_dir_is_named(trained, tmp_path, monkeypatch):
    """--generate on a translation run, --translate on a language-model run and --resume across the two say
    which example wrote the checkpoint (instead of KeyError: 'layers'); checkpoints written before the
    "task" field are told apart by their model configuration."""
    lm = _one_step_lm(tmp_path, 305)
    mt = copy_run(trained, str(tmp_path / "mt"))
    old = copy_run(trained, str(tmp_path / "old"))
    path = os.path.join(old, checkpoints.CHECKPOINT_NAME)
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    assert ckpt.pop("task") == "translation"
    torch.save(ckpt, path)
    for d in (mt, old):
        with pytest.raises(DataError, match=r"^--generate: .*checkpoint_last.pt holds a translation model, written by "
                                            r"train_translation.py, not a language model of train_lm.py: use it with "
                                            r"train_translation.py --translate, or give train_lm.py the --save-dir "
                                            r"of one of its own runs$") as e:
            run(train_lm.main, ["--save-dir", d, "--generate", "The dog", "--num-samples", "1"])
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"^--translate: .*checkpoint_best.pt holds a language model, written by "
                                        r"train_lm.py, not a translation model of train_translation.py: use it with "
                                        r"train_lm.py --generate"):
        translate(lm, monkeypatch)
    before = {name: read(os.path.join(mt, name)) for name in os.listdir(mt)}
    with pytest.raises(DataError, match=r"^--resume: .* holds a translation model, written by train_translation.py, "
                                        r"not a language model of train_lm.py: continue that run with "
                                        r"train_translation.py --resume"):
        run(train_lm.main, ["--save-dir", mt, "--resume", "--max-steps", "2", "--no-progress"])
    assert {name: read(os.path.join(mt, name)) for name in os.listdir(mt)} == before


# ---- other data on --resume, text the tokenizer does not cover ---------------------------------------
def test_resume_on_other_data_says_what_changed_and_unknown_text_is_warned(trained, tmp_path, monkeypatch, capsys):
    """--resume names the data files that are not the checkpoint's run's; text the tokenizer was not trained
    on (here: Greek vowels in English) is warned about with its share of unknown pieces when training, with
    --generate and with --translate."""
    lines = [s for s, _ in builtin_data.generate_pairs(120, 306)]
    greek = str.maketrans("aeo", "αεο")
    train_txt = write_lines(tmp_path / "train.txt", lines[:100])
    other_txt = write_lines(tmp_path / "other.txt", [s.translate(greek) for s in lines[:100]])
    valid_txt = write_lines(tmp_path / "valid.txt", lines[100:])
    d = str(tmp_path / "lm")
    common = ["--arch", "tiny", "--valid", valid_txt, "--save-dir", d, "--vocab-size", "300", "--block-size", "32",
              "--max-tokens", "256", "--no-progress", "--num-samples", "0"]
    run(train_lm.main, ["--train", train_txt, "--max-steps", "1"] + common)
    assert "warning" not in capsys.readouterr().out
    run(train_lm.main, ["--train", other_txt, "--max-steps", "2", "--resume"] + common)
    out = capsys.readouterr().out
    changed = [s for s in out.splitlines() if s.startswith("warning: --resume with other data")]
    assert changed == [f"warning: --resume with other data than the checkpoint's run: --train {other_txt}: other "
                       f"content than the checkpoint's run's {train_txt}. Training goes on from the checkpoint's "
                       "step and place in its epoch over the batches of this data, with the checkpoint's tokenizer"]
    assert re.search(rf"warning: --train {re.escape(other_txt)}: [\d,]+ of [\d,]+ tokens \((\d\d|[2-9])\.\d%\) are "
                     r"unknown to the tokenizer: it was not trained on text like this", out), out
    run(train_lm.main, ["--train", other_txt, "--max-steps", "3", "--resume"] + common)
    assert "--resume with other data" not in capsys.readouterr().out  # the checkpoint's data now
    run(train_lm.main, ["--save-dir", d, "--generate", "Thε dαg", "--num-samples", "1", "--max-new-tokens", "2"])
    assert re.search(r"warning: --generate: the prompt: 2 of \d+ tokens .* unknown to the tokenizer \('ε' 'α'\)",
                     capsys.readouterr().err)
    translate(trained, monkeypatch, "Thε dαg slεεps.\n".encode())
    assert re.search(r"warning: stdin line 1: \d+ of \d+ tokens .* unknown to the tokenizer \('ε' 'α'\)",
                     capsys.readouterr().err)


# ---- a new run into a used directory ------------------------------------------------------------------
def test_new_run_refuses_a_directory_with_a_checkpoint(trained, data, tmp_path):
    d = copy_run(trained, str(tmp_path / "used"))
    before = {name: read(os.path.join(d, name)) for name in os.listdir(d)}
    with pytest.raises(DataError, match=r"holds the checkpoint of an earlier run .*Pass --resume to continue that run, "
                                        r"--overwrite to delete its files and start afresh"):
        train(data, d, "--vocab-size", "200")
    assert {name: read(os.path.join(d, name)) for name in os.listdir(d)} == before


def test_overwrite_replaces_the_run(trained, data, tmp_path, capsys):
    d = copy_run(trained, str(tmp_path / "used"))
    old = read(os.path.join(d, tokenizer.SPM_NAME))
    capsys.readouterr()
    m = train(data, d, "--vocab-size", "200", "--overwrite")
    assert m["steps"] == 2
    assert "--overwrite: removed the earlier run's checkpoint_last.pt, spm.model" in capsys.readouterr().out
    new = read(os.path.join(d, tokenizer.SPM_NAME))
    ckpt = torch.load(os.path.join(d, checkpoints.CHECKPOINT_NAME), map_location="cpu", weights_only=True)
    assert new != old and ckpt["tokenizer"]["model"] == new


def test_interrupted_overwrite_leaves_no_mixed_run(trained, data, tmp_path, monkeypatch):
    """The issue's case: a new run into a used directory, stopped after writing its tokenizer and before its
    first checkpoint. The earlier model is gone with its tokenizer, so --translate and --resume say there is
    nothing to use instead of pairing the new tokenizer with the old model."""
    d = copy_run(trained, str(tmp_path / "used"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(training_run, "start_trainer", interrupted)
        with pytest.raises(KeyboardInterrupt):
            train(data, d, "--vocab-size", "200", "--overwrite")
    assert os.path.isfile(os.path.join(d, tokenizer.SPM_NAME))
    assert not os.path.exists(os.path.join(d, checkpoints.CHECKPOINT_NAME))
    with pytest.raises(DataError, match="no trained model"):
        translate(d, monkeypatch)
    with pytest.raises(DataError, match="--resume: no checkpoint"):
        train(data, d, "--resume")


def test_resume_and_overwrite_together_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        train_translation.TASK.parse_args(["--resume", "--overwrite"])
    assert "--resume continues the run in --save-dir, --overwrite replaces it" in capsys.readouterr().err


# ---- files an interrupted run left half-written -------------------------------------------------------
def test_stale_tmp_files_are_removed_when_a_run_starts(data, tmp_path, capsys):
    d = tmp_path / "run"
    (d / "cache").mkdir(parents=True)
    stale = [d / "checkpoint_last.pt.tmp", d / "metrics.json.tmp", d / "cache" / "train.en.0123.npz.tmp"]
    for p in stale:
        p.write_bytes(b"half written")
    keep = d / "notes.txt"
    keep.write_text("mine")
    train(data, d)
    assert not any(p.exists() for p in stale) and keep.read_text() == "mine"
    assert "removed 3 unfinished file(s) of an interrupted run" in capsys.readouterr().out
    assert not [p for p in d.rglob("*.tmp")]


# ---- a disk that refuses the checkpoint ---------------------------------------------------------------
def refusing_open(monkeypatch, error, after_bytes):
    """Make the checkpoint module's writes of *.tmp files fail with OSError `error` once `after_bytes` bytes
    are written (0: at open), the way a full disk (ENOSPC midway) or a read-only directory (EACCES) does."""
    real_open = open

    class Refusing:
        def __init__(self, f):
            self.f, self.written = f, 0

        def write(self, data):
            if self.written + len(data) > after_bytes:
                keep = max(0, after_bytes - self.written)
                self.f.write(bytes(data)[:keep])  # the part that fit
                self.written += keep
                raise OSError(error, os.strerror(error))
            self.written += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(".tmp") and "w" in mode:
            if after_bytes == 0:
                raise OSError(error, os.strerror(error), str(path))
            return Refusing(real_open(path, mode, *args, **kwargs))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoints, "open", fake_open, raising=False)


@pytest.mark.parametrize("error,after_bytes,cause", [
    (errno.ENOSPC, 5000, r"No space left on device \(free space on that disk, or use a --save-dir on another one\)"),
    (errno.EACCES, 0, "Permission denied"),
])
def test_refused_checkpoint_write_is_one_line_and_keeps_the_last_checkpoint(trained, data, tmp_path, monkeypatch,
                                                                           capsys, error, after_bytes, cause):
    """A full disk midway through the file (torch reports it as "unexpected pos") or a directory that refuses
    it: one line naming the file and the cause, exit status 1, no *.tmp left, checkpoint_last.pt still the
    last good one, and --resume carries on from it once the disk takes files again."""
    d = copy_run(trained, str(tmp_path / "run"))
    path = os.path.join(d, checkpoints.CHECKPOINT_NAME)
    before = read(path)
    capsys.readouterr()
    with monkeypatch.context() as m:
        refusing_open(m, error, after_bytes)
        with pytest.raises(SystemExit) as e:
            training_run.run_main(lambda: train(data, d, "--resume", "--max-steps", "4"))
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(rf"error: cannot write checkpoint {re.escape(path)}: {cause}; the "
                                          r"checkpoint_last.pt there is unchanged", err[0]), err
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]
    assert read(path) == before
    assert train(data, d, "--resume", "--max-steps", "4")["steps"] == 4


def test_refused_checkpoint_copy_leaves_no_partial_file(tmp_path, monkeypatch):
    """checkpoint_best.pt on a file system without hard links is a copy: a full disk midway leaves no
    *.tmp and names the copy."""
    last, best = str(tmp_path / "checkpoint_last.pt"), str(tmp_path / "checkpoint_best.pt")
    checkpoints.save_checkpoint(last, {"w": torch.arange(4096.0)})
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "no links here")))
    refusing_open(monkeypatch, errno.ENOSPC, 1000)
    with pytest.raises(checkpoints.SaveError, match=rf"cannot write checkpoint {re.escape(best)}: No space left"):
        checkpoints.copy_checkpoint(last, best)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_last.pt"]
    assert torch.equal(torch.load(last)["w"], torch.arange(4096.0))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root writes into a read-only directory anyway (the patched variant above covers it)")
def test_read_only_save_dir_is_one_line(trained, data, tmp_path, capsys):
    d = copy_run(trained, str(tmp_path / "run"))
    before = read(os.path.join(d, checkpoints.CHECKPOINT_NAME))
    os.chmod(d, 0o555)
    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            training_run.run_main(lambda: train(data, d, "--resume", "--max-steps", "4"))
        assert e.value.code == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and d in err[0] and "Permission denied" in err[0], err
        assert read(os.path.join(d, checkpoints.CHECKPOINT_NAME)) == before
    finally:
        os.chmod(d, 0o755)
