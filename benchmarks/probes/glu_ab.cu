/*
 * glu_ab.cu — a C entry to one tree's GLU launchers (launch_glu_fwd / launch_glu_bwd, as the extension calls
 * them), so that several trees' kernels load into one process side by side (benchmarks/probes/glu_ab.py). Not part
 * of the build: scripts/ab_probe.sh glu compiles it with each tree's kernel files below into a shared library.
 *
 * glu_run(backward, grad_out, gate, up, in_stride, out, grad_gate, grad_up, rows, cols, act, p, stream): bf16;
 * gate and up [rows, cols] with row stride in_stride (2·cols: the halves of one [rows, 2·cols] tensor), out and
 * grad_out contiguous [rows, cols], grad_gate and grad_up in gate's and up's layout; act as GluAct; dropout p
 * with a fixed seed. The forward when backward is 0 (writes out), else the backward (writes grad_gate, grad_up).
 * Returns the launchers' cudaError_t.
 */
// ab-sources: glu.cu
#include <cuda_bf16.h>

#include <cstdint>

#include "glu.h"

extern "C" __attribute__((visibility("default"))) int glu_run(int backward, const void* grad_out, const void* gate,
                                                               const void* up, int64_t in_stride, void* out,
                                                               void* grad_gate, void* grad_up, int64_t rows,
                                                               int64_t cols, int act, float p, void* stream) {
  using T = __nv_bfloat16;
  const lsmini::PhiloxArgs rng{1234u, 5678u, nullptr, nullptr};
  auto s = static_cast<cudaStream_t>(stream);
  auto g = static_cast<const T*>(gate), u = static_cast<const T*>(up);
  if (!backward) {
    return int(lsmini::launch_glu_fwd<T>(g, u, in_stride, static_cast<T*>(out), rows, cols, act, p, rng, s));
  }
  return int(lsmini::launch_glu_bwd<T>(static_cast<const T*>(grad_out), g, u, in_stride, static_cast<T*>(grad_gate),
                                       static_cast<T*>(grad_up), rows, cols, act, p, rng, s));
}
