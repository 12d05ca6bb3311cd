"""The training examples (examples/train_translation.py, examples/train_lm.py) on CPU: short runs of a
tiny model that write metrics.json, exact resume, beam 1 = greedy, bad data rejected before training,
--translate and --generate. The scripts' main() runs in-process with small settings."""
import io
import json
import math
import os
import re
import select
import subprocess
import sys

import pytest
import torch

import lsmini
from example_testing import EXAMPLES, builtin_pairs, run, write_corpus, write_lines
import builtin_data  # noqa: E402  (after example_testing, which puts examples/ on sys.path)
import train_lm  # noqa: E402
import train_translation  # noqa: E402
from training import batching, cli, tokenizer  # noqa: E402
from training.data import DataError  # noqa: E402

METRIC_KEYS = ("train_loss", "valid_loss", "valid_ppl", "bleu", "tokens_per_s", "steps", "wall_s", "train_s")
# tiny settings: a few hundred pairs, a small vocabulary, a few steps
SMALL = ["--arch", "tiny", "--vocab-size", "300", "--max-tokens", "512", "--max-len", "64", "--log-every", "2",
         "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small parallel corpus from the built-in grammar: {split: (src_path, tgt_path)}."""
    return write_corpus(tmp_path_factory.mktemp("corpus"),
                        builtin_pairs((("train", 400, 101), ("valid", 24, 102), ("test", 12, 103))))


def data_args(corpus, test=True):
    args = []
    for split in ("train", "valid", "test") if test else ("train", "valid"):
        args += [f"--{split}-src", corpus[split][0], f"--{split}-tgt", corpus[split][1]]
    return args


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """One short translation run shared by several tests: (save_dir, metrics)."""
    d = str(tmp_path_factory.mktemp("mt"))
    metrics = run(train_translation.main, data_args(corpus) + SMALL + ["--save-dir", d, "--max-steps", "6",
                                                                       "--eval-every", "3", "--beam", "2"])
    return d, metrics


def check_metrics(save_dir, steps):
    with open(os.path.join(save_dir, "metrics.json")) as f:
        m = json.load(f)
    for k in METRIC_KEYS:
        assert k in m, f"metrics.json lacks {k}"
    assert m["steps"] == steps
    for k in ("train_loss", "valid_loss", "valid_ppl", "tokens_per_s", "wall_s", "train_s"):
        assert isinstance(m[k], float) and math.isfinite(m[k]) and m[k] > 0, (k, m[k])
    assert m["train_s"] < m["wall_s"]
    assert m["valid_ppl"] == pytest.approx(math.exp(m["valid_loss"]))
    return m


# ---- runs ---------------------------------------------------------------------------------------------
def test_translation_short_run_writes_metrics(trained):
    save_dir, metrics = trained
    m = check_metrics(save_dir, 6)
    assert m["bleu"] is None or 0.0 <= m["bleu"] <= 100.0
    assert metrics["steps"] == 6
    for name in ("spm.model", "checkpoint_last.pt", "hypotheses.test.txt"):
        assert os.path.isfile(os.path.join(save_dir, name)), name
    with open(os.path.join(save_dir, "hypotheses.test.txt"), encoding="utf-8") as f:
        assert len(f.read().split("\n")) - 1 == 12


def test_translation_without_sacrebleu_reports_loss_only(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu now raises ImportError
    m = run(train_translation.main, data_args(corpus) + SMALL + ["--save-dir", str(tmp_path), "--max-steps", "1",
                                                                 "--beam", "1"])
    assert m["bleu"] is None
    assert "sacrebleu is not installed" in capsys.readouterr().out
    check_metrics(str(tmp_path), 1)


def test_translation_bf16_and_reference_flags(corpus, tmp_path):
    """bf16 parameters (fp32 master weights in FusedAdam) train on CPU too; --reference only holds for the run."""
    before = lsmini.config.reference
    m = run(train_translation.main, data_args(corpus, test=False) + SMALL + [
        "--save-dir", str(tmp_path), "--max-steps", "2", "--beam", "1", "--bf16", "--reference"])
    assert m["precision"] == "bf16" and m["steps"] == 2
    assert math.isfinite(m["valid_loss"]) and math.isfinite(m["train_loss"])
    assert lsmini.config.reference == before
    ckpt = torch.load(os.path.join(str(tmp_path), "checkpoint_last.pt"), map_location="cpu", weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in ckpt["trainer"]["model"].values() if t.is_floating_point())


def test_lm_short_run_writes_metrics_and_generates(tmp_path, capsys):
    lines = [s for s, _ in builtin_data.generate_pairs(300, 201)]
    train = write_lines(tmp_path / "train.txt", lines[:270])
    valid = write_lines(tmp_path / "valid.txt", lines[270:])
    d = str(tmp_path / "run")
    argv = ["--arch", "tiny", "--train", train, "--valid", valid, "--save-dir", d, "--vocab-size", "300",
            "--block-size", "32", "--max-tokens", "256", "--max-steps", "4", "--log-every", "2", "--no-progress",
            "--num-samples", "1", "--max-new-tokens", "8"]
    run(train_lm.main, argv)
    m = check_metrics(d, 4)
    assert m["bleu"] is None
    capsys.readouterr()
    assert run(train_lm.main, ["--save-dir", d, "--generate", "The dog", "--num-samples", "2",
                               "--max-new-tokens", "5"]) is None
    out = [s for s in capsys.readouterr().out.splitlines() if s.startswith("sample: ")]
    assert len(out) == 2 and all(s.startswith("sample: The dog") for s in out)


def test_lm_of_the_default_length_stops_when_validation_stops_improving(tmp_path, capsys, monkeypatch):
    """A run of the default length on a small text ends when the validation loss has not improved for two
    epochs (the model memorises the few training lines long before the length the --arch calls for, here
    400 steps); the log says so. An explicit --epochs trains them all."""
    monkeypatch.setitem(train_lm.ARCHS["tiny"], "min_steps", 400)
    lines = [s for s, _ in builtin_data.generate_pairs(120, 7)]
    train = write_lines(tmp_path / "train.txt", lines[:100])
    valid = write_lines(tmp_path / "valid.txt", lines[100:])
    common = ["--arch", "tiny", "--train", train, "--valid", valid, "--vocab-size", "200", "--block-size", "32",
              "--max-tokens", "512", "--lr", "3e-3", "--warmup", "5", "--log-every", "50", "--no-progress",
              "--num-samples", "0"]
    m = run(train_lm.main, common + ["--save-dir", str(tmp_path / "default")])
    out = capsys.readouterr().out
    assert "early stop: after 2 validations without a better valid_loss" in out
    assert m["stop_reason"].startswith("early stop") and m["best"]["step"] < m["steps"]
    m = run(train_lm.main, common + ["--save-dir", str(tmp_path / "default"), "--overwrite", "--num-samples", "2"])
    out = capsys.readouterr().out.split("samples of the best checkpoint:\n")  # the last model's, then the best's
    assert len(out) == 2 and [len([s for s in part.splitlines() if s.startswith("sample: ")]) for part in out] == [2, 2]
    # --generate takes the best model, not the last one past it, and says so; --checkpoint picks another
    d = str(tmp_path / "default")
    generate = ["--save-dir", d, "--generate", "The dog", "--num-samples", "1", "--max-new-tokens", "3"]
    run(train_lm.main, generate)
    assert f"--generate: the model of {os.path.join(d, 'checkpoint_best.pt')} (step {m['best']['step']}, valid " \
           f"loss {m['best']['valid_loss']:.3f}; --checkpoint picks another)" in capsys.readouterr().err
    run(train_lm.main, generate + ["--checkpoint", "last"])
    assert f"checkpoint_last.pt (step {m['steps']}, valid loss {m['valid_loss']:.3f})" in capsys.readouterr().err
    with pytest.raises(DataError, match=r"--checkpoint average: no checkpoint_average.pt in .*--average-last N"):
        run(train_lm.main, generate + ["--checkpoint", "average"])
    with pytest.raises(SystemExit):  # a training run does not read it: refused, not ignored
        train_lm.TASK.parse_args(["--save-dir", d, "--checkpoint", "best"])
    assert "--checkpoint picks the model that --translate or --generate loads" in capsys.readouterr().err
    m = run(train_lm.main, common + ["--save-dir", str(tmp_path / "epochs"), "--epochs", "3"])
    assert "early stop" not in capsys.readouterr().out and m["stop_reason"] == "--epochs 3 done"


def test_log_lines_reach_a_pipe_as_they_are_printed(tmp_path):
    """With stdout a pipe (`| tee`), the first log line arrives while the run goes on, not when 8 KiB of
    output have piled up or the process ends. The run is far from done when the line is read."""
    lines = [s for s, _ in builtin_data.generate_pairs(200, 205)]
    argv = [sys.executable, os.path.join(EXAMPLES, "train_lm.py"), "--train", write_lines(tmp_path / "train.txt", lines),
            "--valid", write_lines(tmp_path / "valid.txt", lines[:20]), "--save-dir", str(tmp_path / "run"),
            "--vocab-size", "300", "--block-size", "32", "--max-tokens", "256", "--max-steps", "1000000",
            "--log-every", "100000", "--no-progress", "--num-samples", "0"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        # generous: Python and torch start slowly on a loaded 2-core machine
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        assert ready, "no output line within 180 s"
        first = proc.stdout.readline().decode()
        assert first.endswith("\n") and first.strip(), f"{first!r}; stderr:\n{err_path.read_text()[-2000:]}"
        assert proc.poll() is None  # the line came while the run was still going
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_builtin_corpus_is_deterministic_and_disjoint():
    a = builtin_data.generate_pairs(50, 11)
    assert a == builtin_data.generate_pairs(50, 11)
    assert a != builtin_data.generate_pairs(50, 12)
    # the first pairs of the built-in training split never change (the default run's numbers depend on them)
    assert a[0] == ("Five loud glasses laugh with that song.", "Oba plukiska shu kraisumar traigusne pen robint.")
    other = builtin_data.generate_pairs(200, 12, exclude={s for s, _ in a})
    assert not {s for s, _ in a} & {s for s, _ in other}
    assert len({s for s, _ in a}) == 50


def test_builtin_task_short_run(tmp_path, capsys):
    """The no-argument path (built-in corpus written to <save-dir>/data), cut to two steps; the model line says
    which --arch the device chose."""
    d = str(tmp_path)
    m = run(train_translation.main, ["--save-dir", d, "--max-steps", "2", "--beam", "1", "--no-progress"])
    arch, where = ("small", "a CUDA device") if torch.cuda.is_available() else ("tiny", "the CPU")
    assert f"model: {arch} Transformer (the default --arch on {where};" in capsys.readouterr().out
    assert m["steps"] == 2 and m["bleu_split"] == "test"
    for split, n in (("train", 30000), ("valid", 500), ("test", 500)):
        with open(os.path.join(d, "data", f"{split}.zl"), encoding="utf-8") as f:
            assert len(f.read().split("\n")) - 1 == n
    check_metrics(d, 2)


def test_builtin_lm_short_run(tmp_path):
    d = str(tmp_path)
    m = run(train_lm.main, ["--save-dir", d, "--max-steps", "2", "--no-progress", "--num-samples", "1",
                            "--max-new-tokens", "4"])
    assert m["steps"] == 2
    assert os.path.isfile(os.path.join(d, "data", "lm.train.txt"))
    check_metrics(d, 2)


def test_default_arguments_pick_the_builtin_task():
    args = train_translation.TASK.parse_args(["--device", "cpu"])
    assert args.builtin and args.arch == "tiny" and args.vocab_size == 2000 and args.epochs is not None
    args = train_lm.TASK.parse_args(["--device", "cpu"])
    assert args.builtin and args.arch == "tiny"


@pytest.mark.parametrize("example", [train_translation, train_lm])
def test_arch_not_given_follows_the_device(example):
    """Without --arch a run on a CUDA device takes small and its table row (batch, lr, dropout), one on the
    CPU tiny; the reason goes into the run's model line. A given --arch is kept, with no reason."""
    for device, arch in (("cpu", "tiny"), ("cuda", "small"), ("cuda:1", "small")):
        args = example.TASK.parse_args(["--device", device])
        row = example.ARCHS[arch]
        assert (args.arch, args.max_tokens, args.lr, args.dropout) == \
            (arch, row["max_tokens"], row["lr"], row["dropout"]), device
        assert args.arch_why.startswith(f"the default --arch on {'a CUDA device' if arch == 'small' else 'the CPU'}")
    args = example.TASK.parse_args(["--device", "cuda", "--arch", "tiny"])
    assert args.arch == "tiny" and args.arch_why is None
    assert cli.default_arch(None, True)[0] == "small" and cli.default_arch(None, False)[0] == "tiny"


# ---- resume -------------------------------------------------------------------------------------------
def checkpoint_params(save_dir):
    ckpt = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=True)
    return ckpt["trainer"]["model"], ckpt["trainer"]["step"]


def assert_same_params(a_dir, b_dir, steps):
    a, sa = checkpoint_params(a_dir)
    b, sb = checkpoint_params(b_dir)
    assert sa == sb == steps
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"


def test_translation_resume_gives_the_same_parameters(corpus, tmp_path):
    """A resumed run follows its own plan's cooldown: the first 11 steps (no cooldown; the straight run's
    cooldown of 6 starts falling at step 12) then 5 more resumed with --cooldown 6 end where the straight run
    does, the resumed step 12 included (its lr comes from the new plan, not the checkpoint's)."""
    # 400 pairs at 1024 tokens make ~12 batches per epoch: 11 + 5 steps cross an epoch boundary
    common = data_args(corpus, test=False) + SMALL + ["--beam", "1", "--eval-every", "5", "--dropout", "0.3",
                                                       "--max-tokens", "1024"]
    straight, halves = str(tmp_path / "straight"), str(tmp_path / "halves")
    run(train_translation.main, common + ["--save-dir", straight, "--max-steps", "16", "--cooldown", "6"])
    run(train_translation.main, common + ["--save-dir", halves, "--max-steps", "11"])
    m = run(train_translation.main, common + ["--save-dir", halves, "--max-steps", "16", "--cooldown", "6",
                                               "--resume"])
    assert m["steps"] == 16
    assert_same_params(straight, halves, 16)
    ckpt = torch.load(os.path.join(halves, "checkpoint_last.pt"), map_location="cpu", weights_only=True)
    assert ckpt["trainer"]["scheduler"]["lr_lambdas"] == [{"warmup": 200, "total": 16, "cooldown": 6}]


def test_lm_resume_gives_the_same_parameters(tmp_path):
    lines = [s for s, _ in builtin_data.generate_pairs(200, 202)]
    train = write_lines(tmp_path / "train.txt", lines[:180])
    valid = write_lines(tmp_path / "valid.txt", lines[180:])
    common = ["--arch", "tiny", "--train", train, "--valid", valid, "--vocab-size", "300", "--block-size", "32",
              "--max-tokens", "256", "--log-every", "2", "--no-progress", "--num-samples", "0", "--dropout", "0.3"]
    straight, halves = str(tmp_path / "straight"), str(tmp_path / "halves")
    run(train_lm.main, common + ["--save-dir", straight, "--max-steps", "6"])
    run(train_lm.main, common + ["--save-dir", halves, "--max-steps", "3"])
    run(train_lm.main, common + ["--save-dir", halves, "--max-steps", "6", "--resume"])
    assert_same_params(straight, halves, 6)


def test_llama_tiny_trains_resumes_and_generates(tmp_path, capsys):
    """The Llama-style preset: its options reach the checkpoint, the loss falls, a resumed run ends where a
    straight one does (resumed without --arch: it takes the checkpoint's), and --generate samples from it."""
    lines = [s for s, _ in builtin_data.generate_pairs(200, 203)]
    train = write_lines(tmp_path / "train.txt", lines[:180])
    valid = write_lines(tmp_path / "valid.txt", lines[180:])
    common = ["--arch", "llama-tiny", "--train", train, "--valid", valid, "--vocab-size", "300", "--block-size", "32",
              "--max-tokens", "256", "--log-every", "2", "--no-progress", "--num-samples", "0", "--dropout", "0.3",
              "--lr", "3e-3", "--warmup", "4"]
    straight, halves = str(tmp_path / "straight"), str(tmp_path / "halves")
    first = run(train_lm.main, common + ["--save-dir", straight, "--max-steps", "2"])
    m = run(train_lm.main, common + ["--save-dir", straight, "--max-steps", "12", "--resume"])
    assert m["valid_loss"] < first["valid_loss"]
    run(train_lm.main, common + ["--save-dir", halves, "--max-steps", "6"])
    capsys.readouterr()
    run(train_lm.main, common[2:] + ["--save-dir", halves, "--max-steps", "12", "--resume"])
    out = capsys.readouterr().out
    assert "model: llama-tiny TransformerLM (the --arch of the checkpoint --resume continues)" in out
    assert_same_params(straight, halves, 12)
    ckpt = torch.load(os.path.join(halves, "checkpoint_last.pt"), map_location="cpu", weights_only=True)
    config = ckpt["model_config"]["config"]
    assert (config["norm"], config["bias"], config["rotary"], config["num_kv_heads"], config["activation"]) == \
        ("rmsnorm", False, 10000.0, 2, "swiglu")
    assert not [k for k in ckpt["trainer"]["model"] if "bias" in k or "pos_" in k]
    capsys.readouterr()
    assert run(train_lm.main, ["--save-dir", halves, "--generate", "The dog", "--num-samples", "2",
                               "--max-new-tokens", "5"]) is None
    out = [s for s in capsys.readouterr().out.splitlines() if s.startswith("sample: ")]
    assert len(out) == 2 and all(s.startswith("sample: The dog") for s in out)


def test_resume_without_checkpoint_is_an_error(corpus, tmp_path):
    with pytest.raises(DataError, match="no checkpoint"):
        run(train_translation.main, data_args(corpus) + SMALL + ["--save-dir", str(tmp_path), "--resume"])


# ---- decoding -----------------------------------------------------------------------------------------
def small_model(seed=0):
    torch.manual_seed(seed)
    mc = {"arch": "tiny", "vocab_size": 50, "encoder_layers": 2, "decoder_layers": 2, "share_embeddings": True,
          "config": dict(hidden_size=32, num_heads=4, ffn_size=64, dropout=0.1, attn_dropout=0.0,
                         activation_dropout=0.0, activation="relu", pre_layer_norm=True, max_seq_len=64)}
    model = train_translation.TASK.build_model(mc, 4096, torch.device("cpu"), torch.float32)
    return model.eval()


def random_sources(n=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (n,), generator=g).tolist()
    rows = [torch.randint(4, 50, (k,), generator=g).tolist() for k in lengths]
    width = batching.round_up(max(lengths) + 1)
    return rows, batching.padded_tensor(rows, width, False, suffix=tokenizer.EOS)


def test_beam_1_equals_greedy():
    model = small_model()
    rows, src = random_sources()
    max_lens = [len(r) + 5 for r in rows]
    greedy = train_translation.greedy_search(model, src, max_lens)
    assert train_translation.beam_search(model, src, 1, max_lens) == greedy
    assert all(len(h) <= m for h, m in zip(greedy, max_lens))


@torch.no_grad()
def reference_beam_search(model, src, beam, max_lens, lenpen=1.0):
    """beam_search's rules written as a plain loop over each sentence's 2·beam best extensions."""
    EOS, PAD, BOS = tokenizer.EOS, tokenizer.PAD, tokenizer.BOS
    b = src.size(0)
    enc, enc_mask = model.encode(src)
    rows = torch.arange(b).repeat_interleave(beam)
    enc, enc_mask = enc.index_select(0, rows), enc_mask.index_select(0, rows)
    cache, alive = {}, list(range(b))
    history = torch.full((b * beam, 0), PAD, dtype=torch.long)
    last = torch.full((b * beam, 1), BOS, dtype=torch.long)
    scores = torch.zeros(b, beam, dtype=torch.float64)
    scores[:, 1:] = -math.inf
    finished, best = [[] for _ in range(b)], [None] * b
    for t in range(max(max_lens) + 1):
        limit = torch.tensor([max_lens[s] <= t for s in alive]).repeat_interleave(beam)
        lprobs = train_translation._next_log_probs(model, last, enc, enc_mask, cache, limit)
        enc, vocab, n = None, lprobs.size(1), len(alive)
        top_scores, top_index = (scores.view(-1, 1) + lprobs.double()).view(n, beam * vocab).topk(2 * beam, dim=1)
        keep_rows, keep_tok, keep_scores, still = [], [], [], []
        for j, s in enumerate(alive):
            picked = []
            for r in range(2 * beam):
                sc = top_scores[j, r].item()
                if sc == -math.inf:
                    break
                row, tok = j * beam + top_index[j, r].item() // vocab, top_index[j, r].item() % vocab
                if tok == EOS:
                    if r < beam:
                        finished[s].append((sc / (t + 1) ** lenpen, history[row].tolist()))
                elif len(picked) < beam:
                    picked.append((row, tok, sc))
            if len(finished[s]) >= beam or not picked:
                best[s] = max(finished[s], key=lambda h: h[0])[1] if finished[s] else []
                continue
            picked += [(picked[0][0], picked[0][1], -math.inf)] * (beam - len(picked))
            still.append(s)
            for row, tok, sc in picked:
                keep_rows.append(row)
                keep_tok.append(tok)
                keep_scores.append(sc)
        if not still:
            break
        order = torch.tensor(keep_rows)
        model.reorder_cache(cache, order)
        enc_mask = enc_mask.index_select(0, order)
        history = torch.cat([history.index_select(0, order), torch.tensor(keep_tok)[:, None]], dim=1)
        last = torch.tensor(keep_tok)[:, None]
        scores = torch.tensor(keep_scores, dtype=torch.float64).view(len(still), beam)
        alive = still
    return best


class EosBias(torch.nn.Module):
    """A model whose end-of-sentence logit is raised by `bias`, so that EOS lands at every rank of the
    candidates."""

    def __init__(self, model, bias):
        super().__init__()
        self.model, self.bias = model, bias

    def encode(self, src):
        return self.model.encode(src)

    def decode(self, tokens, enc, mask, cache):
        logits = self.model.decode(tokens, enc, mask, cache).clone()
        logits[..., tokenizer.EOS] += self.bias
        return logits

    def reorder_cache(self, cache, order):
        return self.model.reorder_cache(cache, order)


@pytest.mark.parametrize("beam,lenpen", [(2, 1.0), (3, 0.0), (4, 1.0), (5, 1.5)])
def test_beam_search_matches_reference(beam, lenpen):
    """Hypotheses as the per-candidate loop gives them, with EOS among the candidates at every rank (some
    sentences then have fewer live extensions than beams) and short length limits forcing ends."""
    for seed in range(3):
        for bias in (0.0, 2.0, 4.0):
            model = EosBias(small_model(seed), bias)
            rows, src = random_sources(9, seed + 10)
            max_lens = [max(1, len(r) + d) for r, d in zip(rows, [5, -3, 2, 0, 7, 1, -6, 4, 3])]
            expect = reference_beam_search(model, src, beam, max_lens, lenpen)
            assert train_translation.beam_search(model, src, beam, max_lens, lenpen) == expect, (seed, bias)
            assert all(len(h) <= m for h, m in zip(expect, max_lens))


def test_incremental_greedy_matches_full_recompute():
    """The decoder cache must give what decoding the whole prefix again gives."""
    model = small_model(3)
    rows, src = random_sources(5, 4)
    steps = 6
    cached = train_translation.greedy_search(model, src, [steps] * len(rows))
    with torch.no_grad():
        enc, mask = model.encode(src)
        prefix = torch.full((len(rows), 1), tokenizer.BOS, dtype=torch.long)
        for _ in range(steps):
            lp = torch.log_softmax(model.decode(prefix, enc, mask)[:, -1].float(), -1)
            lp[:, tokenizer.PAD] = lp[:, tokenizer.BOS] = -math.inf
            prefix = torch.cat([prefix, lp.argmax(-1, keepdim=True)], 1)
    for i, h in enumerate(cached):
        full = prefix[i, 1:].tolist()
        expect = full[:full.index(tokenizer.EOS)] if tokenizer.EOS in full else full
        assert h == expect[:len(h)] and (len(h) == len(expect) or len(h) == steps), (h, expect)


def test_translate_round_trip(trained, monkeypatch, capsys, corpus):
    """--translate on the test sources reproduces the hypotheses the training run wrote with the model it
    loads (the best checkpoint: its own file when it is not the last)."""
    save_dir, _ = trained
    with open(corpus["test"][0], "rb") as f:
        data = f.read()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    capsys.readouterr()
    assert run(train_translation.main, ["--translate", "--save-dir", save_dir, "--beam", "2", "--max-tokens", "512"]) \
        is None
    out = capsys.readouterr().out
    best = os.path.join(save_dir, "hypotheses.test.best.txt")
    with open(best if os.path.exists(best) else os.path.join(save_dir, "hypotheses.test.txt"), encoding="utf-8") as f:
        assert out == f.read()


def test_translate_rejects_undecodable_stdin(trained, monkeypatch):
    save_dir, _ = trained
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"The dog runs.\nA cat\xff sleeps.\n"),
                                                       encoding="utf-8"))
    with pytest.raises(DataError, match="stdin is not valid UTF-8 text: line 2, byte 6 is 0xff"):
        run(train_translation.main, ["--translate", "--save-dir", save_dir])


def test_translate_without_model_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\n"), encoding="utf-8"))
    with pytest.raises(DataError, match="no trained model"):
        run(train_translation.main, ["--translate", "--save-dir", str(tmp_path)])


# ---- bad data -----------------------------------------------------------------------------------------
def bad_case(kind, tmp_path, corpus):
    """Real-data arguments with one defect, and the message expected."""
    paths = {f"{split}_{side}": p for split, pair in corpus.items() for side, p in zip(("src", "tgt"), pair)}
    if kind == "missing":
        paths["valid_tgt"] = str(tmp_path / "nope.zl")
        expect = "--valid-tgt: file not found"
    elif kind == "empty":
        paths["train_src"] = write_lines(tmp_path / "empty.en", [])
        expect = "--train-src: .* is empty"
    elif kind == "blank":
        paths["test_tgt"] = write_lines(tmp_path / "blank.zl", ["", "  ", ""])
        expect = "--test-tgt: .* is empty"
    elif kind == "mismatch":
        with open(paths["train_tgt"], encoding="utf-8") as f:
            lines = f.read().split("\n")[:-1]
        paths["train_tgt"] = write_lines(tmp_path / "short.zl", lines[:-3])
        expect = "train data: .* has 400 lines but .* has 397"
    elif kind == "utf8":
        p = tmp_path / "latin1.en"
        p.write_bytes("Le chien dort.\nLe café est noir.\n".encode("latin-1"))
        paths["valid_src"] = str(p)
        expect = "--valid-src: .* is not valid UTF-8 text: line 2, byte 7 is 0xe9"
    else:
        raise AssertionError(kind)
    argv = []
    for key, p in paths.items():
        argv += ["--" + key.replace("_", "-"), p]
    return argv, expect


@pytest.mark.parametrize("kind", ["missing", "empty", "blank", "mismatch", "utf8"])
def test_translation_bad_data_is_rejected_before_training(kind, tmp_path, corpus):
    argv, expect = bad_case(kind, tmp_path, corpus)
    save_dir = tmp_path / "run"
    with pytest.raises(DataError, match=expect):
        run(train_translation.main, argv + SMALL + ["--save-dir", str(save_dir), "--max-steps", "1"])
    assert not (save_dir / "spm.model").exists() and not (save_dir / "checkpoint_last.pt").exists()


@pytest.mark.parametrize("kind", ["missing", "empty", "utf8"])
def test_lm_bad_data_is_rejected_before_training(kind, tmp_path):
    good = write_lines(tmp_path / "good.txt", ["The dog sleeps.", "A cat runs."])
    if kind == "missing":
        bad, expect = str(tmp_path / "nope.txt"), "--valid: file not found"
    elif kind == "empty":
        bad, expect = write_lines(tmp_path / "empty.txt", []), "--valid: .* is empty"
    else:
        p = tmp_path / "bad.txt"
        p.write_bytes(b"ok\n\xff\xfe broken\n")
        bad, expect = str(p), "--valid: .* is not valid UTF-8 text: line 2, byte 1 is 0xff"
    save_dir = tmp_path / "run"
    with pytest.raises(DataError, match=expect):
        run(train_lm.main, ["--train", good, "--valid", bad, "--save-dir", str(save_dir), "--max-steps", "1",
                            "--no-progress"])
    assert not (save_dir / "spm.model").exists()


def test_text_of_one_huge_line_is_refused_naming_the_file(tmp_path, capsys):
    """sentencepiece skips lines longer than its limit (4192 bytes) when it learns the vocabulary: a file that is
    all such lines gets a message naming it and what to do instead of sentencepiece's `!sentences_.empty()`; a
    file with some of them, a note."""
    sentences = [s for s, _ in builtin_data.generate_pairs(600, 206)]
    huge = " ".join(sentences)
    train = write_lines(tmp_path / "train.txt", [huge])
    valid = write_lines(tmp_path / "valid.txt", sentences[:20])
    common = ["--arch", "tiny", "--valid", valid, "--vocab-size", "300", "--block-size", "32", "--max-tokens", "256",
              "--max-steps", "1", "--no-progress", "--num-samples", "0"]
    with pytest.raises(DataError) as e:
        run(train_lm.main, ["--train", train, "--save-dir", str(tmp_path / "one"), *common])
    assert str(e.value) == (
        f"--train: {train} has no line short enough to learn the tokenizer from: sentencepiece skips lines longer "
        f"than 4192 bytes, and every line here is (line 1: {len(huge.encode()):,} bytes). Split the text into lines, "
        "e.g. one sentence or paragraph per line")
    mixed = write_lines(tmp_path / "mixed.txt", sentences[:300] + [huge] * 2)
    capsys.readouterr()
    assert run(train_lm.main, ["--train", mixed, "--save-dir", str(tmp_path / "mixed"), *common])["steps"] == 1
    assert (f"note: --train {mixed}: 2 of 302 lines are longer than 4192 bytes; the tokenizer learns its vocabulary "
            "without them") in capsys.readouterr().out.splitlines()


def test_vocabulary_smaller_than_the_characters_says_how_large_it_must_be(tmp_path):
    """Text of thousands of distinct characters with --vocab-size 300: a message naming the file and the least
    --vocab-size that holds its characters (not sentencepiece's advice of a --character_coverage flag the
    examples do not have); that size then trains."""
    g = torch.Generator().manual_seed(7)
    lines = ["".join(chr(0x4E00 + c) for c in torch.randint(0, 1500, (30,), generator=g).tolist()) for _ in range(300)]
    train = write_lines(tmp_path / "train.txt", lines[:280])
    valid = write_lines(tmp_path / "valid.txt", lines[280:])
    common = ["--arch", "tiny", "--train", train, "--valid", valid, "--block-size", "32", "--max-tokens", "256",
              "--max-steps", "1", "--no-progress", "--num-samples", "0"]
    with pytest.raises(DataError) as e:
        run(train_lm.main, common + ["--vocab-size", "300", "--save-dir", str(tmp_path / "small")])
    m = re.fullmatch(rf"--vocab-size 300 is too small for the training text \(--train {re.escape(train)}\): the "
                     r"vocabulary holds a piece for each character that makes up 99.95% of the text, ([\d,]+) "
                     r"characters here, plus 4 special pieces. Raise --vocab-size to at least (\d+) \(more, so "
                     r"that it also learns pieces of several characters\)", str(e.value))
    assert m, str(e.value)
    chars, needed = (int(x.replace(",", "")) for x in m.groups())
    assert needed == chars + 4 and 1000 < chars <= len(set("".join(lines[:280])))
    m = run(train_lm.main, common + ["--vocab-size", str(needed), "--save-dir", str(tmp_path / "enough")])
    assert m["steps"] == 1


def test_partial_data_flags_are_a_usage_error(corpus, capsys):
    with pytest.raises(SystemExit):
        train_translation.TASK.parse_args(["--train-src", corpus["train"][0], "--train-tgt", corpus["train"][1]])
    assert "--valid-src" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_lm.TASK.parse_args(["--train", corpus["train"][0]])


@pytest.mark.parametrize("flags,message", [
    (["--lenpen", "-5"], "--lenpen must be a finite number >= 0, got -5.0"),
    (["--max-len-a", "-1"], "--max-len-a must be a finite number >= 0, got -1.0"),
    (["--max-len-b", "-100"], r"--max-len-b must be >= 2 \(a word and the end of sentence\), got -100"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--clip-norm", "nan"], "--clip-norm must be a finite number >= 0, got nan"),
    (["--cooldown", "-1"], "--cooldown must be >= 0, got -1"),
])
def test_flags_that_make_no_sense_are_a_usage_error(corpus, capsys, flags, message):
    """Values decoding or training cannot use are refused up front with the flag named, in --translate mode
    too, instead of one-token translations or a traceback from the optimizer."""
    for extra in ([], ["--translate"]):
        if extra and flags[0] in ("--lr", "--clip-norm", "--cooldown"):
            continue
        with pytest.raises(SystemExit):
            train_translation.TASK.parse_args(data_args(corpus) + flags + extra)
        assert re.search(message, capsys.readouterr().err), message


def test_fp16_on_cpu_is_refused(corpus, tmp_path):
    with pytest.raises(DataError, match="--fp16 needs a CUDA device"):
        run(train_translation.main, data_args(corpus) + SMALL + ["--save-dir", str(tmp_path), "--fp16",
                                                                 "--device", "cpu"])


def test_cuda_graph_needs_cuda(corpus, tmp_path):
    with pytest.raises(DataError, match="--cuda-graph needs a CUDA device"):
        run(train_translation.main, data_args(corpus) + SMALL + ["--save-dir", str(tmp_path), "--cuda-graph",
                                                                 "--device", "cpu"])


@pytest.mark.cuda
def test_cuda_graph_run_follows_the_eager_run(corpus, tmp_path):
    """The graphed steps do what the eager steps do: the same TrainStep, data, dropout streams and loss
    normalisation (the loss times 1/tokens, a device scalar inside the graph)."""
    common = data_args(corpus, test=False) + SMALL + ["--beam", "1", "--max-steps", "24", "--eval-every", "24",
                                                       "--dropout", "0.1"]
    eager = run(train_translation.main, common + ["--save-dir", str(tmp_path / "eager"), "--no-cuda-graph"])
    graph = run(train_translation.main, common + ["--save-dir", str(tmp_path / "graph"), "--cuda-graph"])
    assert graph["steps"] == eager["steps"] == 24
    assert graph["valid_loss"] == pytest.approx(eager["valid_loss"], rel=0.02)
    assert graph["train_loss"] == pytest.approx(eager["train_loss"], rel=0.02)
    with pytest.raises(DataError, match="--update-freq 1"):
        run(train_translation.main, common + ["--save-dir", str(tmp_path / "x"), "--cuda-graph", "--update-freq", "2"])
