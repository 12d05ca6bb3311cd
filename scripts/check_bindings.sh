#!/usr/bin/env bash
# Syntax-check the C++ that sees torch (csrc/bindings/*.cpp, csrc/layers/*.cpp) against the installed torch
# headers, without a CUDA build of torch: catches binding errors on machines that cannot build the extension.
set -euo pipefail
cd "$(dirname "$0")/.."
T=$(python -c "import torch, os; print(os.path.dirname(torch.__file__))")
PYINC=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
CUDA_INC=${CUDA_HOME:-/usr/local/cuda}/include
# A CPU build of torch ships c10/cuda headers but not the one CMake generates for CUDA builds.
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/c10/cuda/impl"
echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$SHIM/c10/cuda/impl/cuda_cmake_macros.h"
files=("$@")
[ ${#files[@]} -gt 0 ] || files=(csrc/bindings/*.cpp csrc/layers/*.cpp)
for f in "${files[@]}"; do
  echo "check_bindings: $f"
  g++ -std=c++20 -fsyntax-only -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
    -I"$T/include" -I"$SHIM" -I"$T/include/torch/csrc/api/include" -I"$PYINC" -I"$CUDA_INC" \
    -Icsrc/kernels -Icsrc/bindings -Icsrc/layers "$f"
done
