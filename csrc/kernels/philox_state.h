// philox_state: the Philox (seed, offset) of dropout calls written into device memory, so that a later
// kernel (a backward) can read them through PhiloxArgs' pointers. See philox_state.cu.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "philox.h"

namespace lsmini {

// Draws one launch writes at most (the dropout calls of one decoder layer fit with room to spare).
constexpr int kPhiloxStateMaxDraws = 8;

struct PhiloxStateDraws {
  PhiloxArgs draw[kPhiloxStateMaxDraws];
};

// out[2i] = seed, out[2i + 1] = offset of draw i (i < n ≤ kPhiloxStateMaxDraws), resolved on the device
// as the dropout kernels resolve them (eager values, or the captured graph's words at replay time).
cudaError_t launch_philox_state_fwd(const PhiloxStateDraws& draws, int n, int64_t* out, cudaStream_t stream);

}  // namespace lsmini
