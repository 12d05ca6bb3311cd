/*
 * column_partials.cuh — the column-owning row walk and the fp32 column sums built on it.
 *
 * Used by the row-wise kernels on [rows, hidden] (bias_dropout_residual, bias_act_dropout: forward and
 * backward), whose backward also returns grad_bias[c] = Σ_r grad_x[r, c]; and split_heads' backward
 * (heads.cu), which walks its rows its own way but sums its bias gradient through the same partials.
 *
 * Layout: a thread owns V adjacent columns (16 bytes of T, or 1) and walks down the rows of its slab
 * (walk_rows); a backward keeps its fp32 column sums in registers. A block is bx column groups × by
 * rows; the grid is tiles_x column tiles × `slabs` row slabs. At the end each block folds its by rows
 * of sums in shared memory, in the order y = 0, 1, …, into one fp32 partial row per slab ([slabs,
 * columns], store_column_partials); a second small kernel sums the slabs per column, again in a fixed
 * order (sum_column_partials). No atomics: the result is deterministic for a given grid.
 */
#pragma once

#include <algorithm>

#include "column_sums.h"
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
  if (max_active_blocks(kernel, threads, smem, &n) != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; keep it from being reported as the launch's error
    n = 1;
  }
  return std::max(n, 1);
}

// Raw 16-byte (or 1-element) load, kept packed until use (common.cuh's unpack) so a prefetched
// row costs V·sizeof(T) bytes of registers, not V floats.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> ld_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

// The row walk: the thread owning the V columns at `col` visits rows r = blockIdx.y·blockDim.y +
// threadIdx.y, then every gridDim.y·blockDim.y rows, and calls body(i, in) with i = r·hidden + col (the
// flat index of its first element of row r) and in[n][k] = inputs[n][i + k] in fp32 (16-byte packs when
// V = Vec16<T>::value: the caller checked hidden % V == 0 and the alignment). PREFETCH issues the next
// row's loads before body runs on this row (software pipelining: memory stays busy while the thread
// computes) for N more packs of registers.
template <typename T, int V, int N, bool PREFETCH, typename Body>
__device__ __forceinline__ void walk_rows(const T* const (&inputs)[N], int64_t rows, int64_t hidden, int64_t col,
                                          Body&& body) {
  const int64_t row_step = int64_t(gridDim.y) * blockDim.y;
  int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  float in[N][V];
  if constexpr (PREFETCH) {
    const int64_t step = row_step * hidden;
    Pack<T, V> next[N];
    if (r < rows) {
#pragma unroll
      for (int n = 0; n < N; ++n) next[n] = ld_pack<T, V>(inputs[n] + r * hidden + col);
    }
    for (; r < rows; r += row_step) {
      const int64_t i = r * hidden + col;
#pragma unroll
      for (int n = 0; n < N; ++n) unpack(next[n], in[n]);
      if (r + row_step < rows) {
#pragma unroll
        for (int n = 0; n < N; ++n) next[n] = ld_pack<T, V>(inputs[n] + i + step);
      }
      body(i, in);
    }
  } else {
    for (; r < rows; r += row_step) {
      const int64_t i = r * hidden + col;
#pragma unroll
      for (int n = 0; n < N; ++n) load_pack<T, V>(inputs[n] + i, in[n]);
      body(i, in);
    }
  }
}

// The block's row of fp32 partials: partials[blockIdx.y, c] = Σ_y (column c's sum held by thread (x, y)),
// for the columns c = (blockIdx.x·blockDim.x + x)·V + k < columns that the block's threads own, summed
// over y = 0, 1, … in order. Every thread of the block must call it (it syncs when blockDim.y > 1), also
// threads past the last column (acc = 0). fold: dynamic shared memory of blockDim.y·blockDim.x·V floats,
// not touched when blockDim.y == 1.
template <int V>
__device__ __forceinline__ void store_column_partials(const float (&acc)[V], float* fold, float* partials,
                                                      int64_t columns) {
  allow_dependent_launch();  // what is left is this fold: the column sums may be scheduled
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  float* prow = partials + int64_t(blockIdx.y) * columns;
  if (blockDim.y == 1) {
    if (col < columns) {
#pragma unroll
      for (int k = 0; k < V; ++k) prow[col + k] = acc[k];
    }
    return;
  }
  const int width = blockDim.x * V;
#pragma unroll
  for (int k = 0; k < V; ++k) fold[threadIdx.y * width + threadIdx.x * V + k] = acc[k];
  __syncthreads();
  // Element j of the block's column span is column tile_col + j (thread x holds elements x·V … x·V + V − 1).
  const int64_t tile_col = int64_t(blockIdx.x) * width;
  for (int j = threadIdx.y * blockDim.x + threadIdx.x; j < width && tile_col + j < columns;
       j += blockDim.x * blockDim.y) {
    float s = 0.f;
    for (int y = 0; y < int(blockDim.y); ++y) s += fold[y * width + j];
    prow[tile_col + j] = s;
  }
}

// Σ_s partials[s, c] of a [slabs, columns] array for column c = tile · 32 + threadIdx.x, in a block of
// kColsumCols × kColsumRows threads: 32 columns per block (coalesced rows of partials), 16 threads down the
// slabs of each column (thread y sums slabs y, y + 16, …), folded in shared memory in the order y = 0 … 15.
// The sum is valid in thread row 0 (threadIdx.y == 0) where c < columns. slabs == 0 gives zeros (0 rows).
__device__ __forceinline__ float fold_column_sum(const float* __restrict__ partials, int64_t slabs,
                                                 int64_t columns, int64_t c) {
  __shared__ float fold[kColsumRows][kColsumCols + 1];
  float s = 0.f;
  if (c < columns) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < slabs; k += kColsumRows) s += partials[k * columns + c];
  }
  fold[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  float t = 0.f;
  if (threadIdx.y == 0) {
#pragma unroll
    for (int y = 0; y < kColsumRows; ++y) t += fold[y][threadIdx.x];
  }
  return t;
}

// grad_bias[c] = Σ_s partials[s, c] (fold_column_sum).
template <typename BT>
__global__ void __launch_bounds__(kColsumCols* kColsumRows)
    column_sum_partials_kernel(const float* __restrict__ partials, int64_t slabs, int64_t columns,
                               BT* __restrict__ grad_bias) {
  const int64_t c = int64_t(blockIdx.x) * kColsumCols + threadIdx.x;
  begin_dependent_kernel();  // the pass that wrote the partials
  const float t = fold_column_sum(partials, slabs, columns, c);
  if (threadIdx.y == 0 && c < columns) grad_bias[c] = from_float<BT>(t);
}

// The second pass over the partials that store_column_partials wrote: [slabs, columns] → grad_bias, as a dependent
// launch (common.cuh) of the kernel that wrote them.
template <typename BT>
cudaError_t sum_column_partials(const float* partials, int64_t slabs, int64_t columns, BT* grad_bias,
                                cudaStream_t stream) {
  const unsigned blocks = unsigned((columns + kColsumCols - 1) / kColsumCols);
  return launch_dependent(column_sum_partials_kernel<BT>, dim3(blocks), dim3(kColsumCols, kColsumRows), 0, stream,
                          partials, slabs, columns, grad_bias);
}

// That second pass queued on `sums` when given (column_sums.h: one launch later for a layer's backward), else
// launched now.
template <typename BT>
cudaError_t finish_column_partials(const float* partials, int64_t slabs, int64_t columns, BT* grad_bias,
                                   ColumnSums* sums, cudaStream_t stream) {
  if (sums != nullptr) {
    return queue_column_sum(sums, partials, slabs, columns, grad_bias) ? cudaSuccess : cudaErrorInvalidValue;
  }
  return sum_column_partials<BT>(partials, slabs, columns, grad_bias, stream);
}

}  // namespace
}  // namespace lsmini
