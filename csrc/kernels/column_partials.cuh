/*
 * column_partials.cuh — shared by the row-walking elementwise kernels whose backward also returns a
 * bias gradient (bias_dropout_residual, bias_act_dropout): the column/row tiling of the grid, the
 * sizing of the fp32 partials buffer, and the second-pass kernel that sums the partials per column.
 *
 * Layout: a thread owns V adjacent columns and walks down the rows of its slab; each block writes one
 * fp32 partial row per slab ([slabs, hidden]); column_sum_partials_kernel folds the slabs. No atomics.
 */
#pragma once

#include <algorithm>

#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kColsumCols = 32;
constexpr int kColsumRows = 16;

struct Tiling {
  int bx = 1, by = 1;
  int64_t tiles_x = 1, slabs = 1;
};

// Columns: ceil(nvec / max_threads) tiles of near-equal width, so the last tile is not mostly idle
// (hidden 1032 in fp16 = 129 groups → 2 tiles of 65, not 128 + 1). Rows: the rest of the block.
Tiling column_tiling(int64_t rows, int64_t nvec, int max_threads) {
  Tiling t;
  t.tiles_x = (nvec + max_threads - 1) / max_threads;
  t.bx = static_cast<int>((nvec + t.tiles_x - 1) / t.tiles_x);
  t.by = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_threads / t.bx, rows)));
  return t;
}

// Row slabs for one resident wave of blocks (fewer when the rows run out, at most `cap`).
int64_t wave_slabs(const Tiling& t, int64_t rows, int blocks_per_sm, int64_t cap) {
  const int64_t groups = (rows + t.by - 1) / t.by;
  const int64_t wave = std::max<int64_t>(1, int64_t(blocks_per_sm) * sm_count() / t.tiles_x);
  return std::max<int64_t>(1, std::min({groups, wave, cap, int64_t(65535)}));
}

// Upper bound on wave_slabs() over both paths and all element types, for sizing the partials
// buffer before the launch: the fewest column tiles any path uses is that of 8 columns per thread.
int64_t max_partial_slabs(int64_t rows, int64_t hidden, int max_threads, int max_blocks_per_sm) {
  if (rows <= 0 || hidden <= 0) return 0;
  const int64_t min_tiles = ((hidden + 7) / 8 + max_threads - 1) / max_threads;
  const int64_t wave = std::max<int64_t>(1, int64_t(max_blocks_per_sm) * sm_count() / min_tiles);
  return std::min(rows, wave);
}

template <typename Kernel>
int resident_blocks_per_sm(Kernel kernel, int threads, size_t smem) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; keep it from being reported as the launch's error
    n = 1;
  }
  return std::max(n, 1);
}

// p → (threshold, scale). p ≥ 1 keeps nothing: scale 0 makes even a passing word contribute 0.
void dropout_params(float p, uint32_t* threshold, float* scale) {
  *threshold = dropout_threshold(p);
  *scale = p < 1.f ? 1.f / (1.f - p) : 0.f;
}

// Raw 16-byte (or 1-element) load, kept packed until use (common.cuh's unpack) so a prefetched
// row costs V·sizeof(T) bytes of registers, not V floats.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> ld_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

// grad_bias[c] = Σ_s partials[s, c]: 32 columns per block (coalesced rows of partials), 16 threads
// down the slabs of each column, folded in shared memory. slabs == 0 writes zeros (0 rows).
template <typename BT>
__global__ void __launch_bounds__(kColsumCols* kColsumRows)
    column_sum_partials_kernel(const float* __restrict__ partials, int64_t slabs, int64_t hidden,
                                            BT* __restrict__ grad_bias) {
  __shared__ float fold[kColsumRows][kColsumCols + 1];
  const int64_t c = int64_t(blockIdx.x) * kColsumCols + threadIdx.x;
  float s = 0.f;
  if (c < hidden) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < slabs; k += kColsumRows) s += partials[k * hidden + c];
  }
  fold[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < hidden) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < kColsumRows; ++y) t += fold[y][threadIdx.x];
    grad_bias[c] = from_float<BT>(t);
  }
}

}  // namespace
}  // namespace lsmini
