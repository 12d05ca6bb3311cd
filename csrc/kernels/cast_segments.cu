// cast_segments: several contiguous arrays converted in one launch. Block row blockIdx.y converts array
// blockIdx.y, its blocks striding over it; the conversion goes through float32 (exact for every source here)
// and rounds to nearest. Memory-bound; the point is one launch and no host work per array.
#include "cast_segments.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace lsmini {

constexpr int kCastThreads = 256;

template <typename S, typename D>
__global__ void cast_segments_kernel(CastSegments s) {
  const int j = blockIdx.y;
  const S* __restrict__ src = static_cast<const S*>(s.src[j]);
  D* __restrict__ dst = static_cast<D*>(s.dst[j]);
  const int64_t n = s.numel[j];
  for (int64_t i = int64_t(blockIdx.x) * kCastThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kCastThreads) {
    dst[i] = from_float<D>(to_float(src[i]));
  }
}

template <typename S, typename D>
cudaError_t launch_cast_segments(const CastSegments& segments, cudaStream_t stream) {
  if (segments.count <= 0) return cudaSuccess;
  if (segments.count > kCastSegments) return cudaErrorInvalidValue;
  int64_t most = 0;
  for (int j = 0; j < segments.count; ++j) most = segments.numel[j] > most ? segments.numel[j] : most;
  if (most == 0) return cudaSuccess;
  // enough blocks per array to fill the device a few times over with all arrays together, no more
  const int64_t wanted = (most + kCastThreads - 1) / kCastThreads;
  const int64_t cap = (int64_t(4) * sm_count() + segments.count - 1) / segments.count;
  const dim3 grid(unsigned(wanted < cap ? wanted : cap), unsigned(segments.count));
  cast_segments_kernel<S, D><<<grid, kCastThreads, 0, stream>>>(segments);
  return cudaGetLastError();
}

#define LSMINI_CAST_SEGMENTS(S, D) template cudaError_t launch_cast_segments<S, D>(const CastSegments&, cudaStream_t);
LSMINI_CAST_SEGMENTS(float, __half)
LSMINI_CAST_SEGMENTS(float, __nv_bfloat16)
LSMINI_CAST_SEGMENTS(__half, __nv_bfloat16)
LSMINI_CAST_SEGMENTS(__nv_bfloat16, __half)
#undef LSMINI_CAST_SEGMENTS

}  // namespace lsmini
