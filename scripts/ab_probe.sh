#!/usr/bin/env bash
# Build one shared library of a kernel family per tree, for a same-process A/B of them
# (benchmarks/probes/PROBE_ab.py: bitwise checks against the first, and timings):
#
#   scripts/ab_probe.sh PROBE DIR BASE_REV REV[,NVCC_FLAG...] ...    # here, with nvcc (no GPU needed)
#   python benchmarks/probes/PROBE_ab.py DIR/*.so                      # on an H100/H200 (DIR carried along)
#
# PROBE names benchmarks/probes/PROBE_ab.cu (attention, glu), whose `// ab-sources:` line lists the kernel files
# it needs. Each REV (a commit, branch or tag) gives DIR/<i>_<REV>.so from `git archive REV csrc/kernels` and
# this tree's probe; flags after a comma go to nvcc (e.g. a -D of an experiment's variant), so one revision can
# appear with several. The libraries sort in argument order (the base first).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/ab_probe.sh PROBE DIR BASE_REV REV[,NVCC_FLAG...] ..."
[ $# -ge 4 ] || { echo "$usage" >&2; exit 2; }
probe=benchmarks/probes/$1_ab.cu
[ -f "$probe" ] || { echo "ab_probe.sh: no $probe" >&2; exit 2; }
read -r -a sources <<< "$(sed -n 's|^// ab-sources: *||p' "$probe")"
[ ${#sources[@]} -gt 0 ] || { echo "ab_probe.sh: $probe has no '// ab-sources:' line" >&2; exit 2; }
out=$2
shift 2
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Every revision's sources first (an unknown one stops here), then the builds side by side.
names=()
for spec in "$@"; do
  IFS=, read -r -a parts <<< "$spec"
  name="${#names[@]}_$(echo "$spec" | tr -c 'A-Za-z0-9._=-' '_' | sed 's/_*$//')"
  mkdir -p "$work/$name"
  git archive "${parts[0]}" csrc/kernels | tar -x -C "$work/$name"
  names+=("$name")
done
pids=()
for i in "${!names[@]}"; do
  IFS=, read -r -a parts <<< "${@:$((i + 1)):1}"
  src=$work/${names[$i]}/csrc/kernels
  nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -Xcompiler -fPIC,-fvisibility=hidden -shared \
    -gencode arch=compute_90a,code=sm_90a -DLSMINI_SM90A "${parts[@]:1}" -I"$src" \
    "${sources[@]/#/$src/}" "$probe" -o "$out/${names[$i]}.so" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ "$status" = 0 ] || { echo "ab_probe.sh: a build failed" >&2; exit 1; }
ls "$out"/*.so
