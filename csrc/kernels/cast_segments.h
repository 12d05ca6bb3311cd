// cast_segments: up to kCastSegments contiguous arrays converted to another floating dtype in ONE launch
// (dst[j][i] = src[j][i]), for the layer runtime's per-call copies of float32 GEMM weights in the activations'
// dtype. See cast_segments.cu.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace lsmini {

// Arrays one launch converts at most (a layer's GEMM weights and attention biases: 4 per block).
constexpr int kCastSegments = 16;

struct CastSegments {
  const void* src[kCastSegments];
  void* dst[kCastSegments];
  int64_t numel[kCastSegments];
  int count;
};

// S, D: float, __half or __nv_bfloat16 (instantiated for float/__half/__nv_bfloat16 → __half/__nv_bfloat16).
template <typename S, typename D>
cudaError_t launch_cast_segments(const CastSegments& segments, cudaStream_t stream);

}  // namespace lsmini
