#!/usr/bin/env bash
# Build one shared library of the attention kernels per tree, for a same-process A/B of them
# (benchmarks/probes/attention_ab.py: bitwise checks against the first, and timings):
#
#   scripts/ab_attention.sh DIR BASE_REV REV[,NVCC_FLAG...] ...    # here, with nvcc (no GPU needed)
#   python benchmarks/probes/attention_ab.py DIR/*.so                # on an H100/H200 (DIR carried along)
#
# Each REV (a commit, branch or tag) gives DIR/<i>_<REV>.so from `git archive REV csrc/kernels` and this
# tree's benchmarks/probes/attention_ab.cu; flags after a comma go to nvcc (e.g. a -D of an experiment's
# variant), so one revision can appear with several. The libraries sort in argument order (the base first).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 3 ] || { echo "usage: scripts/ab_attention.sh DIR BASE_REV REV[,NVCC_FLAG...] ..." >&2; exit 2; }
out=$1
shift
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
    "$src"/attention{,_bwd,_bwd_short,_sm90,_sm90_bwd}.cu benchmarks/probes/attention_ab.cu \
    -o "$out/${names[$i]}.so" &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
[ "$status" = 0 ] || { echo "ab_attention.sh: a build failed" >&2; exit 1; }
ls "$out"/*.so
