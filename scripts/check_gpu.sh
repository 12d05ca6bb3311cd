#!/usr/bin/env bash
# On a CUDA machine: build the extension, run the whole test suite (failing if any test failed or was
# skipped, except the multi-GPU tests on a one-GPU machine), then the kernel benchmarks in quick mode.
# The suite's counts (passed, failed, skipped, errors), its duration, the GPU, torch, CUDA and commit are
# appended to benchmarks/results/gpu_tests.csv and the benchmark rows to benchmarks/results/kernels.csv;
# `python benchmarks/report.py` then brings RESULTS.md up to date (commit the CSVs and RESULTS.md).
#
#   scripts/check_gpu.sh [--jobs N] [--sanitize] [--no-bench] [--bench-only PREFIX...] [-- PYTEST_ARGS...]
#   (PYTEST_ARGS replace the default target `tests`; LSMINI_RESULTS_DIR=DIR records into DIR instead)
#
#   --jobs N     run the suite in N pytest worker processes side by side, all on the current GPU
#                (pytest-xdist, in the test extra; tests are handed out one at a time, so a file's slow
#                tests spread over the workers). The suite's time is mostly host work (compiling, references,
#                subprocesses), so N up to about the number of CPU cores pays.
#   --sanitize   also run the CUDA op tests under compute-sanitizer (memcheck, racecheck, initcheck, side
#                by side, each one process per test file); any error fails; SANITIZE_TOOLS="memcheck ..."
#                runs a subset of the tools, SANITIZE_FILES="tests/a.py tests/b.py" a subset of the test
#                files. SANITIZE_NO_CACHING=1 turns torch's caching allocator off for memcheck and
#                initcheck, so that each tensor is its own allocation and an access just past its end is
#                seen too (much slower). On an H200 the three take 10-12 minutes side by side (racecheck on
#                test_attention.py alone: 5 min 20 s).
#   --no-bench   skip the benchmarks
# Logs go to $LOG_DIR (default: $OUT when set, else ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/.."

SANITIZE=0; BENCH=1; BENCH_ONLY=(); PYTEST_ARGS=(); JOBS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) shift; JOBS=${1:-}
            [[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "--jobs takes a number of workers >= 1, got '$JOBS'" >&2; exit 2; } ;;
    --sanitize) SANITIZE=1 ;;
    --no-bench) BENCH=0 ;;
    --bench-only) shift; while [ $# -gt 0 ] && [ "$1" != "--" ]; do BENCH_ONLY+=("$1"); shift; done; continue ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
LOG_DIR=${LOG_DIR:-${OUT:-gpu-logs}}
mkdir -p "$LOG_DIR"
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
fail=0

echo "== build (MAX_JOBS=$MAX_JOBS)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
start=$(date +%s)
if ! python -m pip install --no-build-isolation --no-deps -e . >"$LOG_DIR/build.log" 2>&1; then
  tail -50 "$LOG_DIR/build.log"; echo "BUILD FAILED"; exit 1
fi
if ! python -c "import lsmini._C" 2>/dev/null; then  # editable installs that do not place the module in-tree
  python setup.py build_ext --inplace >>"$LOG_DIR/build.log" 2>&1 || { tail -50 "$LOG_DIR/build.log"; echo "BUILD FAILED"; exit 1; }
fi
echo "build: $(( $(date +%s) - start )) s"
python -c "import lsmini, torch; b = lsmini.backend(); print('backend:', repr(b), 'torch', torch.__version__); assert b == 'cuda'" || exit 1

echo "== tests"
[ ${#PYTEST_ARGS[@]} -gt 0 ] || PYTEST_ARGS=(tests)
WORKERS=()
if [ "$JOBS" -gt 1 ]; then
  python -c "import xdist" 2>/dev/null || { echo "--jobs needs pytest-xdist: pip install pytest-xdist"; exit 1; }
  WORKERS=(-n "$JOBS" --dist load)
fi
start=$(date +%s)
# --durations: the slowest tests, listed in the log, are what decides the suite's time in workers
python -m pytest -q -rs --durations=30 ${WORKERS[@]+"${WORKERS[@]}"} "${PYTEST_ARGS[@]}" 2>&1 | tee "$LOG_DIR/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "TESTS FAILED"; fail=1; }
# Counts from pytest's summary line, recorded with the GPU and commit. The multi-GPU tests skip on a
# one-GPU machine (allowed); any other skip, failure or error fails the check.
python benchmarks/gpu_tests.py "$LOG_DIR/tests.log" --seconds $(( $(date +%s) - start )) \
  --target "${PYTEST_ARGS[*]}" || fail=1

if [ "$SANITIZE" -eq 1 ]; then
  OP_TESTS=(tests/test_layernorm.py tests/test_rms_norm.py tests/test_embedding.py tests/test_attention_softmax.py
            tests/test_attention.py tests/test_bias_dropout_residual.py tests/test_bias_act_dropout.py tests/test_glu.py
            tests/test_heads.py tests/test_cross_entropy.py tests/test_adam.py tests/test_dropout_graph.py)
  [ -n "${SANITIZE_FILES:-}" ] && read -r -a OP_TESTS <<< "$SANITIZE_FILES"
  # The tools run side by side: each is bound by its own instrumentation on the host far more than by the
  # GPU, so three at once take about as long as the slowest alone.
  start=$(date +%s); pids=(); tools=(${SANITIZE_TOOLS:-memcheck racecheck initcheck})
  for tool in "${tools[@]}"; do : > "$LOG_DIR/sanitize_$tool.log"; done
  for tool in "${tools[@]}"; do
    envs=()  # the variable is set only when wanted, never to 0
    [ "${SANITIZE_NO_CACHING:-0}" = 1 ] && [ "$tool" != racecheck ] && envs=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    # memcheck and racecheck check only lsmini's kernels (--kernel-name): under racecheck torch's own
    # reductions, which the tests' references run, report shared-memory hazards of their own, and checking
    # them costs time. initcheck instruments every kernel: restricted, it does not record the writes of
    # torch's kernels and reports every read of their results (lsmini's kernels reading their inputs
    # included).
    filter=(--kernel-name kns=lsmini); select=()
    # Under racecheck cuBLAS's fp16/bf16 batched GEMMs (test_attention.py's references) raise a hardware
    # exception the tool cannot handle, also with no kernel instrumented; the references' GEMMs then run in
    # float32 (LSMINI_TEST_FP32_GEMM, see test_attention._matmul). initcheck needs the same: it does not see
    # cuBLAS's fp16 GEMMs write their outputs ((a @ a) * 0.5 on a 64×64 fp16 a, torch alone: 512 reports).
    [ "$tool" != memcheck ] && envs+=(LSMINI_TEST_FP32_GEMM=1)
    if [ "$tool" = initcheck ]; then
      # Two more reports initcheck makes about torch alone (H200, torch 2.11, compute-sanitizer 2025.3.1):
      # - a device-to-device memcpy node of a CUDA graph, on replay, reads "uninitialized" memory whatever
      #   wrote it (a graph of y = x * 2; z.copy_(y), torch alone: 66 reports): --check-api-memory-access
      #   no leaves the host API's copies unchecked; every kernel's reads are still checked;
      # - torch's dim-0 sum of a [20000, 520] float64 tensor reads its own cross-block partials as
      #   uninitialized (torch alone: 37,560 reports). The two tests named
      #   `grad_bias_deterministic_and_many_rows` take that sum as their reference, so initcheck deselects
      #   them; memcheck and racecheck run them.
      filter=(--check-api-memory-access no); select=(-k "not grad_bias_deterministic_and_many_rows")
    fi
    # One process per test file, in turn: each file starts from a fresh allocator, so a report cannot depend
    # on what earlier files left in the memory it reuses, and the GPU memory a process has cached goes back
    # between files (three tools side by side over all files in one process each ran out of memory).
    (
      rc=0
      for file in "${OP_TESTS[@]}"; do
        echo "== $file" >> "$LOG_DIR/sanitize_$tool.log"
        env "${envs[@]}" compute-sanitizer --tool "$tool" "${filter[@]}" --error-exitcode 99 --print-limit 20 \
          python -m pytest -q -m cuda -x -p no:cacheprovider "${select[@]}" "$file" \
          >> "$LOG_DIR/sanitize_$tool.log" 2>&1 || rc=1
      done
      exit $rc
    ) &
    pids+=($!)
  done
  for i in "${!tools[@]}"; do
    wait "${pids[$i]}"; rc=$?
    echo "== compute-sanitizer --tool ${tools[$i]} on ${#OP_TESTS[@]} CUDA op test files: exit $rc"
    grep -E "^== tests/| in [0-9.]+s|SUMMARY" "$LOG_DIR/sanitize_${tools[$i]}.log" | grep -v "SUMMARY: 0 "
    [ "$rc" -eq 0 ] || { echo "SANITIZER (${tools[$i]}) FAILED"; fail=1; }
  done
  echo "sanitizers: $(( $(date +%s) - start )) s"
fi

if [ "$BENCH" -eq 1 ]; then
  echo "== kernel benchmarks (quick)"
  python benchmarks/bench_kernels.py --quick --out "$LOG_DIR" ${BENCH_ONLY[@]+--only "${BENCH_ONLY[@]}"} 2>&1 \
    | tee "$LOG_DIR/bench.log" || fail=1
fi

[ "$fail" -eq 0 ] && echo "check_gpu: OK" || echo "check_gpu: FAILED"
exit $fail
