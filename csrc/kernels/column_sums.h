// column_sums: the second pass of several backward kernels' column sums in ONE launch. Each of those kernels
// leaves fp32 partial rows [slabs, columns] (column_partials.cuh); given a ColumnSums, its launcher queues the
// sum out[c] = Σ_s partials[s, c] here instead of launching it, and the layer runtime launches every queued sum
// of a layer's backward at its end (launch_column_sums): one launch instead of one per bias or norm gradient.
// The sums are added in the same order as the separate second passes add them, so the results are the same.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace lsmini {

// Sums one launch takes at most (a layer's backward queues up to four per block: a norm's two, two biases').
constexpr int kColumnSumJobs = 16;

struct ColumnSums {
  const float* partials[kColumnSumJobs];
  int64_t slabs[kColumnSumJobs];
  int64_t columns[kColumnSumJobs];
  void* out[kColumnSumJobs];
  int type[kColumnSumJobs];  // out's element type: 0 float, 1 __half, 2 __nv_bfloat16
  int count;
};

// Queues out[c] = Σ_s partials[s·columns + c], c < columns (zeros when slabs == 0); false when full.
template <typename W>
bool queue_column_sum(ColumnSums* sums, const float* partials, int64_t slabs, int64_t columns, W* out) {
  static_assert(std::is_same_v<W, float> || std::is_same_v<W, __half> || std::is_same_v<W, __nv_bfloat16>);
  if (sums->count >= kColumnSumJobs) return false;
  const int j = sums->count++;
  sums->partials[j] = partials;
  sums->slabs[j] = slabs;
  sums->columns[j] = columns;
  sums->out[j] = out;
  sums->type[j] = std::is_same_v<W, float> ? 0 : std::is_same_v<W, __half> ? 1 : 2;
  return true;
}

// Every queued sum, in one launch on stream (none queued: nothing). The sums is then empty.
cudaError_t launch_column_sums(ColumnSums& sums, cudaStream_t stream);

}  // namespace lsmini
