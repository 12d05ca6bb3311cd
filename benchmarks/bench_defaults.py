"""The examples' defaults against tuned runs, on the built-in corpora and on real text passed by path.

    python benchmarks/bench_defaults.py [--pairs 30000,300000] [--arch small]
                                        [--files NAME TRAIN_SRC TRAIN_TGT VALID_SRC VALID_TGT TEST_SRC TEST_TGT]
                                        [--lm-text NAME FILE] [--lm-arch small]
                                        [--tuned "FLAGS" ...] [--lm-tuned "FLAGS" ...] [--seeds 1] [--parallel 3]
                                        [--timed 1] [--skip-defaults | --skip-tuned] [--work DIR] [--json PATH]
                                        [--results DIR | --no-results]

Corpora (each one a table):
    --pairs N,..     the built-in en→zl translation task with N training pairs (valid and test: 500 pairs each;
                     examples/builtin_data.py --train-pairs N), written under --work once; "" for none.
    --files NAME ..  a real translation corpus, six line-parallel files (repeatable).
    --lm-text NAME FILE
                     a real text for the language model (repeatable): its last 10% of lines is the validation
                     text (the usual split of tinyshakespeare), both written under --work.

On each corpus:
    defaults  the example with the data files and --arch only, as a new user runs it; run alone, so that its
              wall time is the whole command's (Python start, tokenizer, training, validation, checkpoints and,
              for translation, the test set's beam search and BLEU). --timed N runs it N times, one after
              another, and reports the median time (each run's time in the row's note).
    tuned     the same command plus each flag string of the grid (--tuned / --lm-tuned; default: the grids
              below), --parallel at a time on the same GPU: their quality is what the flags give, their wall
              times are not comparable with the defaults' run.

Seeds (--seeds N): every configuration, the defaults too, runs at seeds 1..N (seed 1 is the examples' default
and adds no flag; the others add --seed S, and the defaults' go with the tuned runs). Runs of one configuration
differ by about a BLEU point from seed to seed on a small corpus, so with N > 1 a second table compares the
configurations by their mean over the seeds, and the defaults with the best configuration on the seeds both ran.

Every run gets its own --save-dir and --no-progress; its log goes beside it. Each table gives, per run: steps,
the warmup, cooldown and peak lr it used (from its log), the quality (translation: test BLEU, sacreBLEU beam 4;
LM: validation perplexity of the run's best checkpoint, the model it leaves), the last step's valid loss, the
whole command's wall seconds, the part of them spent in training steps and the run's average tokens/s
(metrics.json); then the defaults' quality against the best tuned run's. Every run is also appended to
benchmarks/results/defaults.csv (config: the example, --arch and corpus; variant: "defaults" or the flags), from
which benchmarks/report.py writes RESULTS.md.
"""
import argparse
import concurrent.futures
import itertools
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import builtin_data  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import common  # noqa: E402


def grid(**axes):
    """Flag strings of the product of the axes' values: grid(lr=("1e-3", "2e-3")) → ["--lr 1e-3", "--lr 2e-3"]."""
    names = list(axes)
    return [" ".join(f"--{n.replace('_', '-')} {v}" for n, v in zip(names, values))
            for values in itertools.product(*(axes[n] for n in names))]


# learning rate, warmup and run length, then dropout and label smoothing around a run tuned by hand on a real
# caption corpus (--lr 1e-3 --warmup 800 --epochs 20 at 4096 tokens a batch), and the schedule without its
# cooldown; each string adds to the --arch defaults (small translation: 8192 tokens), and defaults.csv rows of
# runs at other defaults spell them out
TRANSLATION_TUNED = ["--cooldown 0"] + grid(lr=("5e-4", "1e-3", "2e-3"), warmup=(400, 800), epochs=(10, 20)) + [
    "--lr 1e-3 --warmup 800 --epochs 20 --dropout 0.1",
    "--lr 1e-3 --warmup 800 --epochs 20 --dropout 0.2",
    "--lr 1e-3 --warmup 800 --epochs 20 --label-smoothing 0.2",
]
LM_TUNED = grid(lr=("5e-4", "1e-3", "2e-3"), warmup=(200, 500), epochs=(10, 20)) + [
    "--lr 1e-3 --warmup 200 --epochs 20 --dropout 0.2",
    "--lr 1e-3 --warmup 200 --epochs 20 --dropout 0.3",
    "--lr 1e-3 --warmup 200 --epochs 20 --vocab-size 4000",
]


def builtin_corpus(work, pairs):
    """{split: (src, tgt)} of the built-in corpus with `pairs` training pairs, written once under `work`."""
    d = os.path.join(work, f"data_{pairs}")
    done = os.path.join(d, "done")
    if not os.path.exists(done):
        builtin_data.write_translation_corpus(d, builtin_data.translation_splits(pairs))
        open(done, "w").close()
    return {s: (os.path.join(d, f"{s}.en"), os.path.join(d, f"{s}.zl")) for s in ("train", "valid", "test")}


def split_text(work, name, path, valid_fraction=0.1):
    """(train, valid) files under `work`: the text's lines, the last `valid_fraction` of them the validation."""
    d = os.path.join(work, f"lm_{name}")
    os.makedirs(d, exist_ok=True)
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    if len(lines) < 10:
        raise SystemExit(f"bench_defaults: {path} has {len(lines)} lines; the LM split needs at least 10")
    cut = len(lines) - max(1, int(len(lines) * valid_fraction))
    out = (os.path.join(d, "train.txt"), os.path.join(d, "valid.txt"))
    for p, part in zip(out, (lines[:cut], lines[cut:])):
        with open(p, "w", encoding="utf-8") as f:
            f.writelines(part)
    return out


class Corpus:
    """One table: an example, its data flags and the label of its rows."""

    def __init__(self, example, label, data_flags):
        self.example, self.label, self.data_flags = example, label, data_flags

    @property
    def is_lm(self):
        return self.example == "train_lm.py"


def translation_corpus(label, paths):
    flags = []
    for split, (src, tgt) in paths.items():
        flags += [f"--{split}-src", src, f"--{split}-tgt", tgt]
    return Corpus("train_translation.py", label, flags)


def run_one(corpus, name, arch, extra, save_dir):
    cmd = [sys.executable, os.path.join(ROOT, "examples", corpus.example), "--arch", arch, "--save-dir", save_dir,
           "--overwrite", "--no-progress", *corpus.data_flags, *shlex.split(extra)]
    os.makedirs(save_dir, exist_ok=True)
    t0 = time.perf_counter()
    with open(save_dir + ".log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    row = {"run": name, "flags": extra, "rc": rc, "command_s": round(wall, 1)}
    text = open(save_dir + ".log").read()
    m = re.search(r"schedule: peak lr (\S+), warmup (\d+)", text)
    if m:
        row.update(lr=m.group(1).rstrip(","), warmup=int(m.group(2)))
        c = re.search(r"falling linearly to 0 over the last (\d+) steps", text)
        row["cooldown"] = int(c.group(1)) if c else 0
    if rc == 0:
        with open(os.path.join(save_dir, "metrics.json")) as f:
            metrics = json.load(f)
        row.update(steps=metrics["steps"], valid_loss=round(metrics["valid_loss"], 3),
                   tokens_per_s=round(metrics["tokens_per_s"] or 0), train_s=round(metrics["train_s"], 1))
        if corpus.is_lm:  # the model the run leaves to use: its best checkpoint
            best = (metrics.get("best") or {}).get("valid_loss", metrics["valid_loss"])
            row["ppl"] = round(math.exp(min(best, metrics["valid_loss"])), 2)
        else:
            row["bleu"] = metrics["bleu"]
    else:
        row["error"] = text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"
    print(json.dumps(row), flush=True)
    return row


def timed_row(corpus, runs):
    """The defaults' row from `runs`, the rows of one command run alone one after another (--timed N): the
    first run's figures with the median whole-command time, and a note giving each time (a run's time varies
    by seconds with the machine's state: the first command on a fresh machine is the slowest) and each run's
    quality where they differ. A failed run's row is returned as it is."""
    failed = [r for r in runs if r["rc"] != 0]
    if failed or len(runs) == 1:
        return (failed or runs)[0]
    row = dict(runs[0])
    times = [r["command_s"] for r in runs]
    row["command_s"] = round(statistics.median(times), 1)
    row["train_s"] = round(statistics.median(r["train_s"] for r in runs), 1)
    row["note"] = f"whole command: median of {len(runs)} runs alone ({', '.join(f'{t:g}' for t in times)} s)"
    name, _, _ = quality(corpus, row)
    qualities = [quality(corpus, r)[1] for r in runs]
    if len(set(qualities)) > 1:
        row["note"] += f"; their {name}: {', '.join(f'{q:g}' for q in qualities)}"
    return row


def quality(corpus, row):
    """(name, value, better-is-higher) of a run's quality figure, value None when it failed."""
    if corpus.is_lm:
        return "ppl", row.get("ppl"), False
    return "BLEU", row.get("bleu"), True


def mean(values):
    return sum(values) / len(values)


def seeded(flags, seed):
    """flags at seed `seed`: seed 1 is the examples' default and adds nothing."""
    return flags if seed == 1 else f"{flags} --seed {seed}".strip()


def seed_means(corpus, rows):
    """{configuration's flags: {seed: quality}} of the runs that scored ("" = the defaults), from rows that
    carry "config_flags" and "seed"."""
    out = {}
    for r in rows:
        q = quality(corpus, r)[1]
        if q is not None:
            out.setdefault(r["config_flags"], {})[r["seed"]] = q
    return out


def seed_table(corpus, rows):
    """The configurations by their mean over the seeds, and the defaults against the best one on the seeds both
    ran (paired: the same seed draws the same initialisation and batch order). Returns (flags, gap, seeds) of
    that best configuration (gap: BLEU difference, or the perplexity's relative one), or None."""
    name, _, higher = quality(corpus, rows[0])
    by_config = seed_means(corpus, rows)
    print(f"| flags | seeds | mean {name} | min | max |")
    print("|---|---|---|---|---|")
    order = sorted(by_config.items(), key=lambda kv: mean(list(kv[1].values())), reverse=higher)
    for flags, qs in order:
        v = list(qs.values())
        print(f"| {flags or '(defaults)'} | {','.join(map(str, sorted(qs)))} | {mean(v):.2f} | {min(v):.2f} | "
              f"{max(v):.2f} |")
    mine = by_config.get("")
    if not mine:
        return None
    best = None
    for flags, qs in by_config.items():
        both = sorted(set(qs) & set(mine))
        if not flags or not both:
            continue
        ours, theirs = mean([mine[s] for s in both]), mean([qs[s] for s in both])
        gap = ours / theirs - 1 if corpus.is_lm else ours - theirs
        if best is None or (gap < best[1] if higher else gap > best[1]):
            best = (flags, gap, both)
    if best is not None:
        flags, gap, both = best
        shown = f"{gap * 100:+.1f}%" if corpus.is_lm else f"{gap:+.2f}"
        print(f"defaults against the best configuration on the same seeds ({','.join(map(str, both))}): {shown} "
              f"({flags})", flush=True)
    return best


def table(corpus, arch, rows, has_defaults):
    what = "perplexity" if corpus.is_lm else "BLEU"
    print(f"\n{corpus.example} --arch {arch}, {corpus.label}", flush=True)
    print(f"| run | flags | steps | warmup | cooldown | lr | {what} | valid loss | command s | training s | "
          "tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        _, q, _ = quality(corpus, r)
        cell = f"{q:.2f}" if q is not None else r.get("error", "")
        print(f"| {r['run']} | {r['flags'] or '(none)'} | {r.get('steps', '')} | {r.get('warmup', '')} | "
              f"{r.get('cooldown', '')} | {r.get('lr', '')} | {cell} | {r.get('valid_loss', '')} | "
              f"{r['command_s']} | {r.get('train_s', '')} | {r.get('tokens_per_s', '')} |")
    if has_defaults and rows[0].get("note"):
        print(f"defaults: {rows[0]['note']}")
    scored = [r for r in rows if r["config_flags"] and quality(corpus, r)[1] is not None]
    name, _, higher = quality(corpus, rows[0])
    best = (max if higher else min)(scored, key=lambda r: quality(corpus, r)[1], default=None)
    d = rows[0] if has_defaults else None
    if best is not None and d is not None and quality(corpus, d)[1] is not None:
        dq, bq = quality(corpus, d)[1], quality(corpus, best)[1]
        rel = f" ({(dq / bq - 1) * 100:+.1f}%)" if corpus.is_lm else ""
        print(f"defaults {name} {dq:.2f} vs best tuned {bq:.2f} ({best['flags']}): {dq - bq:+.2f}{rel}; "
              f"defaults' whole command {d['command_s']} s", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="30000,300000", help="built-in corpus sizes, comma-separated (\"\": none)")
    ap.add_argument("--arch", default="small", help="the translation runs' --arch (default small)")
    ap.add_argument("--files", nargs=7, action="append", default=[],
                    metavar=("NAME", "TRAIN_SRC", "TRAIN_TGT", "VALID_SRC", "VALID_TGT", "TEST_SRC", "TEST_TGT"),
                    help="a real translation corpus (repeatable)")
    ap.add_argument("--lm-text", nargs=2, action="append", default=[], metavar=("NAME", "FILE"),
                    help="a real text for the language model, last 10%% of its lines as validation (repeatable)")
    ap.add_argument("--lm-arch", default="small", help="the LM runs' --arch (default small)")
    ap.add_argument("--tuned", action="append", default=None, metavar="FLAGS",
                    help="flags of one tuned translation run (repeat; default: TRANSLATION_TUNED)")
    ap.add_argument("--lm-tuned", action="append", default=None, metavar="FLAGS",
                    help="flags of one tuned LM run (repeat; default: LM_TUNED)")
    ap.add_argument("--seeds", type=int, default=1, help="run every configuration at seeds 1..N (default 1)")
    ap.add_argument("--parallel", type=int, default=3, help="tuned runs at a time (default 3)")
    ap.add_argument("--timed", type=int, default=1, metavar="N",
                    help="run the defaults' seed-1 command N times alone; its row's time is their median (default 1)")
    ap.add_argument("--skip-defaults", action="store_true", help="only the tuned runs")
    ap.add_argument("--skip-tuned", action="store_true", help="only the defaults' runs")
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "bench_defaults"))
    ap.add_argument("--json", default=None, help="write all rows here")
    common.add_results_arguments(ap)
    a = ap.parse_args()
    if a.skip_defaults and a.skip_tuned:
        ap.error("--skip-defaults and --skip-tuned together leave nothing to run")
    if a.seeds < 1:
        ap.error(f"--seeds must be at least 1, got {a.seeds}")
    if a.timed < 1:
        ap.error(f"--timed must be at least 1, got {a.timed}")
    seeds = range(1, a.seeds + 1)

    corpora = [(translation_corpus(f"built-in task, {p} pairs", builtin_corpus(a.work, p)), a.arch)
               for p in (int(p) for p in a.pairs.split(",") if p.strip())]
    for name, *paths in a.files:
        pairs = dict(zip(("train", "valid", "test"), zip(paths[0::2], paths[1::2])))
        corpora.append((translation_corpus(name, pairs), a.arch))
    for name, path in a.lm_text:
        train, valid = split_text(a.work, name, path)
        corpora.append((Corpus("train_lm.py", name, ["--train", train, "--valid", valid]), a.lm_arch))

    rows = []
    for corpus, arch in corpora:
        tuned = [] if a.skip_tuned else (a.lm_tuned if a.lm_tuned is not None else LM_TUNED) if corpus.is_lm else \
            (a.tuned if a.tuned is not None else TRANSLATION_TUNED)
        base = os.path.join(a.work, re.sub(r"[^\w.-]+", "_", f"{corpus.example[:-3]}_{arch}_{corpus.label}"))
        # (run name, configuration's flags, seed): the defaults' seed-1 run alone, the rest `--parallel` at a time
        jobs = [(f"tuned{i}" + (f"_seed{s}" if s > 1 else ""), flags, s)
                for i, flags in enumerate(tuned) for s in seeds]
        if not a.skip_defaults:
            jobs = [(f"defaults_seed{s}", "", s) for s in seeds if s > 1] + jobs
        corpus_rows = []
        if not a.skip_defaults:
            runs = [run_one(corpus, "defaults", arch, "", base + "_defaults") for _ in range(a.timed)]
            corpus_rows.append({**timed_row(corpus, runs), "config_flags": "", "seed": 1})
        with concurrent.futures.ThreadPoolExecutor(max(1, a.parallel)) as pool:
            futures = [(flags, s, pool.submit(run_one, corpus, name, arch, seeded(flags, s), f"{base}_{name}"))
                       for name, flags, s in jobs]
            corpus_rows += [{**f.result(), "config_flags": flags, "seed": s} for flags, s, f in futures]
        table(corpus, arch, corpus_rows, not a.skip_defaults)
        if a.seeds > 1:
            seed_table(corpus, corpus_rows)
        for r in corpus_rows:
            r["config"] = f"{corpus.example} --arch {arch}, {corpus.label}"
            if r["run"] != "defaults":  # every run but the defaults' seed-1 one ran beside others
                r["note"] = r.get("error") or f"run {a.parallel} at a time on the GPU: command_s not comparable"
        rows += corpus_rows
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    import torch

    env = common.environment(gpu=None if torch.cuda.is_available() else "CPU")
    common.append_results(a.results, "defaults", env, [
        {"benchmark": "defaults", "config": r["config"],
         "variant": r["flags"] if r["run"] != "defaults" and r["flags"] else r["run"], "kind": "lsmini",
         "steps": r.get("steps"), "warmup": r.get("warmup"), "cooldown": r.get("cooldown"),
         "lr": r.get("lr"), "bleu": r.get("bleu"), "ppl": r.get("ppl"), "valid_loss": r.get("valid_loss"),
         "command_s": r["command_s"], "train_s": r.get("train_s"), "tokens_s": r.get("tokens_per_s"),
         "note": r.get("note", r.get("error"))}
        for r in rows])


if __name__ == "__main__":
    main()
