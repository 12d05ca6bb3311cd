"""The translation example's defaults against hand-tuned runs, on the built-in task at two corpus sizes.

    python benchmarks/bench_defaults.py [--pairs 30000,300000] [--arch small] [--parallel 3]
                                        [--tuned "FLAGS" ...] [--work DIR] [--json PATH] [--skip-defaults]
                                        [--results DIR | --no-results]

For each size N in --pairs, the built-in en→zl corpus with N training pairs (valid and test: 500 pairs each;
examples/builtin_data.py --train-pairs N) is written under --work once. Then:

    defaults  python examples/train_translation.py --train-src .. --train-tgt .. --valid-src .. --valid-tgt ..
              --test-src .. --test-tgt .. --arch ARCH
              the data files and --arch only, as a new user runs it; run alone, so that its wall time is the
              whole command's (Python start, tokenizer, training, validation, checkpoints, test-set beam
              search and BLEU).
    tuned     the same command plus each --tuned flag string (default: a grid over --lr, --warmup and
              --epochs around a hand-tuned run), --parallel at a time on the same GPU: their BLEU
              is what the flags give, their wall times are not comparable with the defaults' run.

Every run gets its own --save-dir and --no-progress; its log goes beside it. The table gives, per run: steps,
the warmup and peak lr it used (from its log), test BLEU (sacreBLEU, beam 4), valid loss, the whole command's
wall seconds and the run's average target tokens/s (metrics.json); and per size, the defaults' BLEU minus the
best tuned BLEU. Every run is also appended to benchmarks/results/defaults.csv (config: the --arch and corpus
size; variant: "defaults" or the tuned flags), from which benchmarks/report.py writes RESULTS.md.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import builtin_data  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import common  # noqa: E402

# around the hand-tuned run a user needed before the defaults adapted (--warmup 800 --lr 1e-3, 20 epochs)
DEFAULT_TUNED = [f"--lr {lr} --warmup {w} --epochs {e}" for e in (10, 20) for lr in ("5e-4", "1e-3", "2e-3")
                 for w in (400, 800)]


def corpus(work, pairs):
    """{split: (src, tgt)} of the built-in corpus with `pairs` training pairs, written once under `work`."""
    d = os.path.join(work, f"data_{pairs}")
    done = os.path.join(d, "done")
    if not os.path.exists(done):
        builtin_data.write_translation_corpus(d, builtin_data.translation_splits(pairs))
        open(done, "w").close()
    return {s: (os.path.join(d, f"{s}.en"), os.path.join(d, f"{s}.zl")) for s in ("train", "valid", "test")}


def run_one(name, paths, arch, extra, save_dir):
    cmd = [sys.executable, os.path.join(ROOT, "examples", "train_translation.py"), "--arch", arch,
           "--save-dir", save_dir, "--overwrite", "--no-progress"]
    for split, (src, tgt) in paths.items():
        cmd += [f"--{split}-src", src, f"--{split}-tgt", tgt]
    cmd += shlex.split(extra)
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
    if rc == 0:
        with open(os.path.join(save_dir, "metrics.json")) as f:
            metrics = json.load(f)
        row.update(steps=metrics["steps"], bleu=metrics["bleu"], valid_loss=round(metrics["valid_loss"], 3),
                   tokens_per_s=round(metrics["tokens_per_s"] or 0))
    else:
        row["error"] = text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"
    print(json.dumps(row), flush=True)
    return row


def _bleu(row):
    return f"{row['bleu']:.2f}" if row.get("bleu") is not None else row.get("error", "")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", default="30000,300000", help="training-corpus sizes, comma-separated")
    ap.add_argument("--arch", default="small")
    ap.add_argument("--tuned", action="append", default=None, metavar="FLAGS",
                    help="flags of one hand-tuned run (repeat; default: a grid over --lr, --warmup, --epochs)")
    ap.add_argument("--parallel", type=int, default=3, help="tuned runs at a time (default 3)")
    ap.add_argument("--skip-defaults", action="store_true", help="only the tuned runs")
    ap.add_argument("--work", default=os.path.join(ROOT, "runs", "bench_defaults"))
    ap.add_argument("--json", default=None, help="write all rows here")
    common.add_results_arguments(ap)
    a = ap.parse_args()
    tuned = a.tuned if a.tuned is not None else DEFAULT_TUNED
    rows = []
    for pairs in (int(p) for p in a.pairs.split(",")):
        paths = corpus(a.work, pairs)
        base = os.path.join(a.work, f"{a.arch}_{pairs}")
        size_rows = []
        if not a.skip_defaults:
            size_rows.append(run_one("defaults", paths, a.arch, "", base + "_defaults"))
        with concurrent.futures.ThreadPoolExecutor(max(1, a.parallel)) as pool:
            futures = [pool.submit(run_one, f"tuned{i}", paths, a.arch, flags, f"{base}_tuned{i}")
                       for i, flags in enumerate(tuned)]
            size_rows += [f.result() for f in futures]
        for r in size_rows:
            r["pairs"] = pairs
        rows += size_rows
        scored = [r for r in size_rows if r["run"] != "defaults" and r.get("bleu") is not None]
        best = max(scored, key=lambda r: r["bleu"], default=None)
        print(f"\n{a.arch}, {pairs} pairs", flush=True)
        print("| run | flags | steps | warmup | lr | BLEU | valid loss | command s | tokens/s |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in size_rows:
            print(f"| {r['run']} | {r['flags'] or '(none)'} | {r.get('steps', '')} | {r.get('warmup', '')} | "
                  f"{r.get('lr', '')} | {_bleu(r)} | {r.get('valid_loss', '')} | "
                  f"{r['command_s']} | {r.get('tokens_per_s', '')} |")
        d = size_rows[0] if not a.skip_defaults else None
        if best is not None and d is not None and d.get("bleu") is not None:
            print(f"defaults BLEU {d['bleu']:.2f} vs best tuned {best['bleu']:.2f} ({best['flags']}): "
                  f"{d['bleu'] - best['bleu']:+.2f}; defaults' whole command {d['command_s']} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    import torch

    env = common.environment(gpu=None if torch.cuda.is_available() else "CPU")
    common.append_results(a.results, "defaults", env, [
        {"benchmark": "defaults", "config": f"--arch {a.arch}, built-in task, {r['pairs']} pairs",
         "variant": r["flags"] if r["run"] != "defaults" and r["flags"] else r["run"], "kind": "lsmini",
         "steps": r.get("steps"), "warmup": r.get("warmup"), "lr": r.get("lr"), "bleu": r.get("bleu"), "valid_loss": r.get("valid_loss"),
         "command_s": r["command_s"], "tokens_s": r.get("tokens_per_s"), "note": r.get("error")} for r in rows])


if __name__ == "__main__":
    main()
