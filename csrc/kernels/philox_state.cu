// philox_state: writes the resolved Philox (seed, offset) of up to kPhiloxStateMaxDraws dropout calls into a
// device int64 buffer [n, 2]. A backward that must regenerate a forward's dropout masks then passes
// PhiloxArgs{0, 0, &out[2i], &out[2i + 1]}, which resolve_philox turns back into exactly the forward's
// (seed, offset).
//
// Why the values go through device memory: under torch.compile the state of a dropout call travels from
// the forward op to the backward op as a tensor output, and it must stay right when the compiled step is
// replayed as a CUDA graph — then the forward's seed and base offset are device words torch's generator
// refills before each replay, which only a kernel running inside the replay can read. One thread per draw.
#include "philox_state.h"

#include "common.cuh"

namespace lsmini {

__global__ void philox_state_fwd_kernel(PhiloxStateDraws draws, int n, int64_t* out) {
  begin_dependent_kernel();
  const int i = threadIdx.x;
  if (i >= n) return;
  const PhiloxSeedOffset so = resolve_philox(draws.draw[i]);
  out[2 * i] = static_cast<int64_t>(so.seed);
  out[2 * i + 1] = static_cast<int64_t>(so.offset);
}

cudaError_t launch_philox_state_fwd(const PhiloxStateDraws& draws, int n, int64_t* out, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  return launch_dependent(philox_state_fwd_kernel, dim3(1), dim3(kPhiloxStateMaxDraws), 0, stream, draws, n, out);
}

}  // namespace lsmini
