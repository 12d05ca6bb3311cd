// column_sums: every queued second pass of a layer backward's column sums in one launch (column_sums.h). Block
// row blockIdx.y sums job blockIdx.y; its blocks take 32 columns each, 16 threads down the slabs of a column
// (thread y adds slabs y, y + 16, …, in order), folded in shared memory in the order y = 0 … 15: the order of
// column_partials.cuh's column_sum_partials_kernel and of the LayerNorm backward's reduce kernel.
#include "column_sums.h"

#include <algorithm>

#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kCols = 32;
constexpr int kRows = 16;

__global__ void __launch_bounds__(kCols* kRows) column_sums_kernel(ColumnSums sums) {
  __shared__ float fold[kRows][kCols + 1];
  const int j = blockIdx.y;
  const int64_t columns = sums.columns[j], slabs = sums.slabs[j];
  const int64_t c = int64_t(blockIdx.x) * kCols + threadIdx.x;
  if (int64_t(blockIdx.x) * kCols >= columns) return;  // a tile past this job's columns: the whole block leaves
  const float* __restrict__ partials = sums.partials[j];
  float s = 0.f;
  if (c < columns) {
#pragma unroll 4
    for (int64_t k = threadIdx.y; k < slabs; k += kRows) s += partials[k * columns + c];
  }
  fold[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < columns) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < kRows; ++y) t += fold[y][threadIdx.x];
    switch (sums.type[j]) {
      case 0: static_cast<float*>(sums.out[j])[c] = t; break;
      case 1: static_cast<__half*>(sums.out[j])[c] = from_float<__half>(t); break;
      default: static_cast<__nv_bfloat16*>(sums.out[j])[c] = from_float<__nv_bfloat16>(t); break;
    }
  }
}

}  // namespace

cudaError_t launch_column_sums(ColumnSums& sums, cudaStream_t stream) {
  const int count = sums.count;
  sums.count = 0;
  if (count <= 0) return cudaSuccess;
  if (count > kColumnSumJobs) return cudaErrorInvalidValue;
  int64_t tiles = 1;
  for (int j = 0; j < count; ++j) tiles = std::max<int64_t>(tiles, (sums.columns[j] + kCols - 1) / kCols);
  ColumnSums copy = sums;
  copy.count = count;
  column_sums_kernel<<<dim3(unsigned(tiles), unsigned(count)), dim3(kCols, kRows), 0, stream>>>(copy);
  return cudaGetLastError();
}

}  // namespace lsmini
