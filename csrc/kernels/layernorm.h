// LayerNorm launchers (see layernorm.cu for the math, layout and conventions).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "column_sums.h"
#include "norm_residual.h"

namespace lsmini {

// Largest hidden size the kernels hold in registers (32 fp32 values per thread × 1024 threads).
constexpr int kLayerNormMaxHidden = 32768;

// y = (x − mean)·rstd·weight + bias over rows of `hidden`; writes mean/rstd (fp32, one per row).
// weight/bias may be null (1 and 0). With add (non-null): its residual form (norm_residual.h), s normalized
// instead of x; add->residual and add->sum must then be non-null. T: float, __half, __nv_bfloat16; W: float or T.
template <typename T, typename W>
cudaError_t launch_layernorm_fwd(const T* x, const W* weight, const W* bias, T* y, float* mean, float* rstd,
                                 int64_t rows, int hidden, float eps, const NormResidual<T, W>* add,
                                 cudaStream_t stream);

// Rows of fp32 dγ/dβ partials launch_layernorm_bwd may write: its scratch holds
// 2·layernorm_bwd_partial_rows(rows)·hidden floats.
int64_t layernorm_bwd_partial_rows(int64_t rows);

// dx (+ add when non-null; add may be dx, in place), and dweight/dbias (when non-null, type W) from dy, x
// and the saved mean/rstd, their column sums' second pass queued on sums when non-null (column_sums.h), else
// launched. weight may be null.
template <typename T, typename W>
cudaError_t launch_layernorm_bwd(const T* dy, const T* x, const W* weight, const float* mean, const float* rstd,
                                 const T* add, T* dx, W* dweight, W* dbias, float* partials, int64_t rows,
                                 int hidden, ColumnSums* sums, cudaStream_t stream);

}  // namespace lsmini
