#!/usr/bin/env bash
# Same-run A/B of the kernel benchmarks: this tree against a base tree of the project, on one CUDA machine.
#
#   mkdir ab-base && git archive BASE_REV | tar -x -C ab-base   # here; ab-base is git-ignored: carry it along
#   scripts/ab_kernels.sh ab-base [-- BENCH_KERNELS_ARGS...]
#
# Both trees are built in place for one architecture (AB_ARCH, default 90a: half the build of the default
# pair), side by side. bench_kernels.py then runs AB_RUNS times (default 2) per tree, alternating base and
# this tree, so that both see the same machine and clocks; each run imports its own tree's lsmini. The
# arguments after `--` go to every run (default: --quick). Prints, per row, lsmini's time in every run of
# each tree, torch's (as a check that the machine did not move) and the base/new ratio of the medians.
# Logs and each run's kernels.csv go to $LOG_DIR/ab (LOG_DIR defaults to $OUT when set, else ./gpu-logs); the
# runs' results rows too ($LOG_DIR/ab/results), not benchmarks/results: an A/B is not a result of this tree.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ab_trees.sh
ab_args "scripts/ab_kernels.sh BASE_TREE [-- BENCH_KERNELS_ARGS...]" "$@"
[ ${#args[@]} -gt 0 ] || args=(--quick)
log=${LOG_DIR:-${OUT:-gpu-logs}}/ab
mkdir -p "$log"
export MAX_JOBS=${MAX_JOBS:-16} LSMINI_CUDA_ARCHS=${AB_ARCH:-90a} LSMINI_RESULTS_DIR=$log/results
runs=${AB_RUNS:-2}

ab_build "$base" "$log"

# Each tree's benchmark runs from inside the tree, so its own lsmini (and _C) is the one imported.
for i in $(seq "$runs"); do
  for tree in base new; do
    dir=$PWD; [ "$tree" = base ] && dir=$base
    ab_in_tree "$dir" python benchmarks/bench_kernels.py "${args[@]}" --out "$log/${tree}_$i" \
      >"$log/${tree}_$i.txt" 2>&1 ||
      { tail -20 "$log/${tree}_$i.txt"; exit 1; }
  done
done

python - "$log" "$runs" <<'PY'
import csv, statistics, sys
log, runs = sys.argv[1], int(sys.argv[2])
table = {}
for tree in ("base", "new"):
    for i in range(1, runs + 1):
        for r in csv.DictReader(open(f"{log}/{tree}_{i}/kernels.csv")):
            t = table.setdefault((r["row"], r["dtype"], r["shape"]), {"base": [], "new": [], "torch": []})
            t[tree].append(float(r["lsmini_ms"]))
            t["torch"].append(float(r["torch_ms"]))
print("| row | dtype | shape | base ms | new ms | torch ms | base/new |")
print("|---|---|---|---|---|---|---|")
fmt = lambda xs: " / ".join(f"{x:.3f}" for x in xs)
for (row, dtype, shape), t in table.items():
    if t["base"] and t["new"]:
        ratio = statistics.median(t["base"]) / statistics.median(t["new"])
        print(f"| {row} | {dtype} | {shape} | {fmt(t['base'])} | {fmt(t['new'])} | "
              f"{min(t['torch']):.3f}–{max(t['torch']):.3f} | {ratio:.2f}× |")
PY
