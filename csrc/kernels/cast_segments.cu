// cast_segments: several contiguous arrays converted in one launch. The arrays' elements form one index space
// of 8-element chunks (array j's chunks follow array j − 1's), which a grid of resident blocks strides over, so
// every array gets threads in proportion to its size: a layer's cast is a few large weights and several small
// biases, and splitting the grid evenly between arrays left most of it idle while the large ones ran.
// A chunk of an array whose source and copy are both 16-byte aligned moves as 16-byte loads and one 16-byte
// store; an array's last partial chunk, and every chunk of an unaligned array, element by element. The
// conversion goes through float32 (exact for every source here) and rounds to nearest. Memory-bound; the
// point is one launch, no host work per array, and the copy bandwidth.
#include "cast_segments.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace lsmini {

constexpr int kCastThreads = 256;
constexpr int kCastChunk = 8;  // elements a thread converts at a time: one 16-byte store of D

// The launch's view of the arrays: chunk index space and which arrays take the vector path.
struct CastChunks {
  CastSegments s;
  int64_t first[kCastSegments + 1];  // first[j]: array j's first chunk; first[count]: the total
  uint32_t vector;                   // bit j: array j's source and copy are 16-byte aligned
};

// No __launch_bounds__: with it ptxas aims at 32 registers (a full SM) and spills; at about 40, six blocks an SM
// are resident, and the grid is as many.
template <typename S, typename D>
__global__ void cast_segments_kernel(CastChunks c) {
  static_assert(sizeof(D) * kCastChunk == 16, "a chunk is one 16-byte store of the copy");
  constexpr int kSrcVec = 16 / int(sizeof(S));  // elements a 16-byte load of the source holds
  const int64_t total = c.first[c.s.count];
  int j = 0;  // the array of chunk g; g only grows, so the search goes on from the last one
  for (int64_t g = int64_t(blockIdx.x) * kCastThreads + threadIdx.x; g < total;
       g += int64_t(gridDim.x) * kCastThreads) {
    while (g >= c.first[j + 1]) ++j;
    const S* __restrict__ src = static_cast<const S*>(c.s.src[j]);
    D* __restrict__ dst = static_cast<D*>(c.s.dst[j]);
    const int64_t i = (g - c.first[j]) * kCastChunk;
    const int64_t n = c.s.numel[j];
    if (((c.vector >> j) & 1u) && i + kCastChunk <= n) {
      float v[kCastChunk];
#pragma unroll
      for (int h = 0; h < kCastChunk / kSrcVec; ++h) {
        float part[kSrcVec];
        load_pack<S, kSrcVec>(src + i + h * kSrcVec, part);
#pragma unroll
        for (int k = 0; k < kSrcVec; ++k) v[h * kSrcVec + k] = part[k];
      }
      store_pack<D, kCastChunk>(dst + i, v);
    } else {
      const int64_t end = i + kCastChunk < n ? i + kCastChunk : n;
      for (int64_t e = i; e < end; ++e) dst[e] = from_float<D>(to_float(src[e]));
    }
  }
}

template <typename S, typename D>
cudaError_t launch_cast_segments(const CastSegments& segments, cudaStream_t stream) {
  if (segments.count <= 0) return cudaSuccess;
  if (segments.count > kCastSegments) return cudaErrorInvalidValue;
  CastChunks c{};
  c.s = segments;
  for (int j = 0; j < segments.count; ++j) {
    if (segments.numel[j] < 0) return cudaErrorInvalidValue;
    c.first[j + 1] = c.first[j] + (segments.numel[j] + kCastChunk - 1) / kCastChunk;
    const bool aligned = reinterpret_cast<uintptr_t>(segments.src[j]) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(segments.dst[j]) % 16 == 0;
    c.vector |= uint32_t(aligned) << j;
  }
  const int64_t total = c.first[segments.count];
  if (total == 0) return cudaSuccess;
  auto kernel = cast_segments_kernel<S, D>;
  int per_sm = 0;
  if (max_active_blocks(kernel, kCastThreads, 0, &per_sm) != cudaSuccess || per_sm < 1) {
    (void)cudaGetLastError();  // not sticky; the launch reports its own errors
    per_sm = 1;
  }
  const int64_t wanted = (total + kCastThreads - 1) / kCastThreads;
  const int64_t resident = int64_t(per_sm) * sm_count();  // one wave: every block strides to the end
  kernel<<<unsigned(wanted < resident ? wanted : resident), kCastThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

#define LSMINI_CAST_SEGMENTS(S, D) template cudaError_t launch_cast_segments<S, D>(const CastSegments&, cudaStream_t);
LSMINI_CAST_SEGMENTS(float, __half)
LSMINI_CAST_SEGMENTS(float, __nv_bfloat16)
LSMINI_CAST_SEGMENTS(__half, __nv_bfloat16)
LSMINI_CAST_SEGMENTS(__nv_bfloat16, __half)
#undef LSMINI_CAST_SEGMENTS

}  // namespace lsmini
