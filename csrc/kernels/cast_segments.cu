// cast_segments: several contiguous arrays converted in one launch. The arrays' elements form one index space
// of 8-element chunks (array j's chunks follow array j − 1's), cut into consecutive spans of kCastSpan chunks, one a
// block: every array gets threads in proportion to its size (a layer's cast is a few large weights and several
// small biases), and the blocks, scheduled in order, sweep memory front to back. (A grid of resident blocks
// striding over the whole space moves about half the bytes a second: each wave's loads lie a stride apart,
// spread over all the arrays.) A thread loads its chunks before it stores any.
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
constexpr int kCastPerThread = 2;
constexpr int kCastSpan = kCastThreads * kCastPerThread;  // chunks a block converts

// The launch's view of the arrays: chunk index space and which arrays take the vector path.
struct CastChunks {
  CastSegments s;
  int64_t first[kCastSegments + 1];  // first[j]: array j's first chunk; first[count]: the total
  uint32_t vector;                   // bit j: array j's source and copy are 16-byte aligned
};

template <typename S, typename D>
__global__ void __launch_bounds__(kCastThreads) cast_segments_kernel(CastChunks c) {
  begin_dependent_kernel();
  static_assert(sizeof(D) * kCastChunk == 16, "a chunk is one 16-byte store of the copy");
  constexpr int kSrcVec = 16 / int(sizeof(S));  // elements a 16-byte load of the source holds
  const int64_t total = c.first[c.s.count];
  const int64_t base = int64_t(blockIdx.x) * kCastSpan + threadIdx.x;
  float v[kCastPerThread][kCastChunk];
  int array[kCastPerThread];
  bool loaded[kCastPerThread];  // taken the vector path: v holds the chunk
  int j = 0;  // the array of chunk g; g only grows, so the search goes on from the last one
#pragma unroll
  for (int u = 0; u < kCastPerThread; ++u) {
    const int64_t g = base + u * kCastThreads;
    array[u] = 0;
    loaded[u] = false;
    if (g >= total) continue;
    while (g >= c.first[j + 1]) ++j;
    array[u] = j;
    const int64_t i = (g - c.first[j]) * kCastChunk;
    if (((c.vector >> j) & 1u) && i + kCastChunk <= c.s.numel[j]) {
      const S* __restrict__ src = static_cast<const S*>(c.s.src[j]) + i;
#pragma unroll
      for (int h = 0; h < kCastChunk / kSrcVec; ++h) {
        float part[kSrcVec];
        load_pack<S, kSrcVec>(src + h * kSrcVec, part);
#pragma unroll
        for (int k = 0; k < kSrcVec; ++k) v[u][h * kSrcVec + k] = part[k];
      }
      loaded[u] = true;
    }
  }
#pragma unroll
  for (int u = 0; u < kCastPerThread; ++u) {
    const int64_t g = base + u * kCastThreads;
    if (g >= total) break;
    const int a = array[u];
    const int64_t i = (g - c.first[a]) * kCastChunk;
    D* __restrict__ dst = static_cast<D*>(c.s.dst[a]);
    if (loaded[u]) {
      store_pack<D, kCastChunk>(dst + i, v[u]);
    } else {
      const S* __restrict__ src = static_cast<const S*>(c.s.src[a]);
      const int64_t n = c.s.numel[a];
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
  const int64_t blocks = (total + kCastSpan - 1) / kCastSpan;
  if (blocks > 0x7FFFFFFF) return cudaErrorInvalidValue;
  return launch_dependent(cast_segments_kernel<S, D>, dim3(unsigned(blocks)), dim3(kCastThreads), 0, stream, c);
}

#define LSMINI_CAST_SEGMENTS(S, D) template cudaError_t launch_cast_segments<S, D>(const CastSegments&, cudaStream_t);
LSMINI_CAST_SEGMENTS(float, __half)
LSMINI_CAST_SEGMENTS(float, __nv_bfloat16)
LSMINI_CAST_SEGMENTS(__half, __nv_bfloat16)
LSMINI_CAST_SEGMENTS(__nv_bfloat16, __half)
#undef LSMINI_CAST_SEGMENTS

}  // namespace lsmini
