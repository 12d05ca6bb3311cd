#!/usr/bin/env bash
# The translation example on the built-in task, --arch small with --no-cuda-graph, twice in one run: the
# layers' blocks issued from Python one kernel at a time (lsmini.layers.function.ONE_CALL = False), then
# each layer as one extension call. Prints each run's metrics.json (target tokens/s, losses, BLEU).
#   scripts/compare_layer_calls.sh [OUT_DIR] [extra train_translation.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-logs}/layer_calls}
shift || true
mkdir -p "$out"
for one_call in False True; do
  python - "$out/one_call_$one_call" "$one_call" "$@" <<'PY'
import json, os, runpy, sys
import lsmini.layers.function as function
save_dir, one_call, extra = sys.argv[1], sys.argv[2] == "True", sys.argv[3:]
function.ONE_CALL = one_call
sys.argv = ["examples/train_translation.py", "--arch", "small", "--save-dir", save_dir, "--overwrite",
            "--no-progress", "--no-cuda-graph", *extra]
runpy.run_path("examples/train_translation.py", run_name="__main__")
print(f"ONE_CALL={one_call}:", json.dumps(json.load(open(os.path.join(save_dir, "metrics.json")))))
PY
done
