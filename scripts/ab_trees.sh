# What the same-run A/B scripts (ab_kernels.sh, ab_training.sh) share; sourced, not run.
#   ab_args USAGE ARGS...  base = ARGS' first (absolute, checked with ab_check_tree), args = what follows it and
#                          an optional `--`; a missing base exits with USAGE
#   ab_check_tree DIR      exit 2 unless DIR is a tree of the project
#   ab_build BASE LOG      build BASE and this tree in place side by side (LSMINI_CUDA_ARCHS, MAX_JOBS), logs in
#                          LOG/build_base.log and LOG/build_new.log; exit 1 with the failing log's tail
#   ab_in_tree DIR CMD...  run CMD inside DIR with DIR first on PYTHONPATH (a script's own directory, not the
#                          working directory, starts sys.path), once DIR's lsmini (and _C) is what imports there

ab_args() {
  local usage=$1
  shift
  base=$(cd "${1:?usage: $usage}" && pwd)
  shift
  [ "${1:-}" = "--" ] && shift
  args=("$@")
  ab_check_tree "$base"
}

ab_check_tree() {
  [ -f "$1/setup.py" ] && [ -d "$1/csrc" ] || { echo "$1 is not a tree of the project" >&2; exit 2; }
}

ab_build() {
  local base=$1 log=$2 pid
  echo "== build, both trees (LSMINI_CUDA_ARCHS=$LSMINI_CUDA_ARCHS)"
  (cd "$base" && python setup.py build_ext --inplace >"$log/build_base.log" 2>&1) & pid=$!
  python setup.py build_ext --inplace >"$log/build_new.log" 2>&1 || { tail -30 "$log/build_new.log"; exit 1; }
  wait "$pid" || { tail -30 "$log/build_base.log"; exit 1; }
}

ab_in_tree() {
  local dir=$1
  shift
  (cd "$dir" && export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" &&
    python -c "import lsmini, lsmini._C, os; assert lsmini.__file__.startswith(os.getcwd())" && "$@")
}
