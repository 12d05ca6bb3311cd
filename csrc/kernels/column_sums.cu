// column_sums: every queued second pass of a layer backward's column sums in one launch (column_sums.h). Block
// row blockIdx.y sums job blockIdx.y, each block 32 of its columns, in column_partials.cuh's fold_column_sum
// order: that of column_sum_partials_kernel and of the LayerNorm backward's reduce kernel.
#include "column_sums.h"

#include <algorithm>

#include "column_partials.cuh"
#include "common.cuh"

namespace lsmini {
namespace {

__global__ void __launch_bounds__(kColsumCols* kColsumRows) column_sums_kernel(ColumnSums sums) {
  begin_dependent_kernel();
  const int j = blockIdx.y;
  const int64_t columns = sums.columns[j];
  if (int64_t(blockIdx.x) * kColsumCols >= columns) return;  // a tile past this job's columns: the whole block leaves
  const int64_t c = int64_t(blockIdx.x) * kColsumCols + threadIdx.x;
  const float t = fold_column_sum(sums.partials[j], sums.slabs[j], columns, c);
  if (threadIdx.y == 0 && c < columns) {
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
  for (int j = 0; j < count; ++j) tiles = std::max<int64_t>(tiles, (sums.columns[j] + kColsumCols - 1) / kColsumCols);
  ColumnSums copy = sums;
  copy.count = count;
  return launch_dependent(column_sums_kernel, dim3(unsigned(tiles), unsigned(count)), dim3(kColsumCols, kColsumRows), 0,
                          stream, copy);
}

}  // namespace lsmini
