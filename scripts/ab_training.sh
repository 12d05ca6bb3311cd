#!/usr/bin/env bash
# Same-run A/B of whole training steps: this tree against a base tree of the project, on one CUDA machine.
#
#   mkdir ab-base && git archive BASE_REV | tar -x -C ab-base   # here; ab-base is git-ignored: carry it along
#   scripts/ab_training.sh ab-base [-- BENCH_TRAINING_ARGS...]
#
# Both trees are built in place for one architecture (AB_ARCH, default 90a), side by side. Then AB_RUNS times
# (default 3), alternating base and this tree so that both see the same machine and clocks, each tree runs
# benchmarks/bench_training.py with the arguments after `--` (default: --configs base --variants lsmini
# lsmini+graph) and, unless AB_EXAMPLE_STEPS=0, the translation example on its built-in data without CUDA graphs
# for AB_EXAMPLE_STEPS steps (default 300; its tok/s is the median of its progress lines after the first), with
# AB_EXAMPLE_ARGS (default: --arch small --max-tokens 4096 --dropout 0.3, which both trees must accept: the
# defaults of the example change between trees, and so would the work being timed).
# Host-bound rows (no graph) are noisy: the medians of the runs are what to compare. Prints, per row, each
# run's figure per tree and the ratio of the medians (base time / new time: above 1 this tree is faster).
# Logs go to $LOG_DIR/ab_training (LOG_DIR defaults to $OUT when set, else ./gpu-logs); the benchmark's result
# rows too, not benchmarks/results: an A/B is not a result of this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ab_trees.sh
ab_args "scripts/ab_training.sh BASE_TREE [-- BENCH_TRAINING_ARGS...]" "$@"
[ ${#args[@]} -gt 0 ] || args=(--configs base --variants lsmini lsmini+graph)
log=${LOG_DIR:-${OUT:-gpu-logs}}/ab_training
mkdir -p "$log"
export MAX_JOBS=${MAX_JOBS:-16} LSMINI_CUDA_ARCHS=${AB_ARCH:-90a} LSMINI_RESULTS_DIR=$log/results PYTHONUNBUFFERED=1
runs=${AB_RUNS:-3}
steps=${AB_EXAMPLE_STEPS:-300}
# The example's model and batches, named: its defaults differ between trees of different dates.
read -r -a example <<< "${AB_EXAMPLE_ARGS:---arch small --max-tokens 4096 --dropout 0.3}"

ab_build "$base" "$log"

# Each tree's runs start from inside the tree, so its own lsmini (and _C) is the one imported.
for i in $(seq "$runs"); do
  for tree in base new; do
    dir=$PWD; [ "$tree" = base ] && dir=$base
    echo "== run $i, $tree"
    ab_in_tree "$dir" python benchmarks/bench_training.py "${args[@]}" >"$log/${tree}_$i.txt" 2>&1 ||
      { tail -20 "$log/${tree}_$i.txt"; exit 1; }
    if [ "$steps" -gt 0 ]; then
      ckpt=$(mktemp -d)  # the run's checkpoints: not kept, and not among the logs
      ab_in_tree "$dir" python examples/train_translation.py "${example[@]}" --no-cuda-graph --max-steps "$steps" \
        --no-progress --save-dir "$ckpt" >"$log/${tree}_${i}_example.txt" 2>&1 ||
        { tail -20 "$log/${tree}_${i}_example.txt"; exit 1; }
      rm -rf "$ckpt"
    fi
  done
done

python - "$log" "$runs" "$steps" <<'PY'
import re, statistics, sys
log, runs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
table = {}  # row -> {"base": [...], "new": [...]}, ms/step (the example: tok/s, higher is faster)
for tree in ("base", "new"):
    for i in range(1, runs + 1):
        for m in re.finditer(r"^# (\S+): ([\d.]+) ms/step", open(f"{log}/{tree}_{i}.txt").read(), re.M):
            table.setdefault(m.group(1), {"base": [], "new": []})[tree].append(float(m.group(2)))
        if steps:
            tps = [float(x.replace(",", "")) for x in
                   re.findall(r"\| ([\d,.]+) tok/s$", open(f"{log}/{tree}_{i}_example.txt").read(), re.M)]
            if len(tps) > 1:
                table.setdefault("translation example, no graph (tok/s)", {"base": [], "new": []})[tree].append(
                    statistics.median(tps[1:]))
print("| row | base | new | base/new time |")
print("|---|---|---|---|")
fmt = lambda xs: " / ".join(f"{x:,.2f}" for x in xs)
for row, t in table.items():
    if t["base"] and t["new"]:
        b, n = statistics.median(t["base"]), statistics.median(t["new"])
        ratio = n / b if "tok/s" in row else b / n
        print(f"| {row} | {fmt(t['base'])} | {fmt(t['new'])} | {ratio:.3f}× |")
PY
