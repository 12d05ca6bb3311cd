// RMSNorm launchers (see rms_norm.cu for the math, layout and conventions).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "column_sums.h"
#include "norm_residual.h"

namespace lsmini {

// Largest hidden size the kernels hold in registers (32 fp32 values per thread × 1024 threads).
constexpr int kRmsNormMaxHidden = 32768;

// y = x·rstd·weight over rows of `hidden`, rstd = 1/sqrt(mean(x²) + eps) written per row (fp32).
// With add (non-null): its residual form (norm_residual.h), s normalized instead of x; add->residual and add->sum
// must then be non-null. weight may be null (1). T: float, __half, __nv_bfloat16; W: float or T.
template <typename T, typename W>
cudaError_t launch_rms_norm_fwd(const T* x, const W* weight, T* y, float* rstd, int64_t rows, int hidden, float eps,
                                const NormResidual<T, W>* add, cudaStream_t stream);

// Rows of fp32 dweight partials launch_rms_norm_bwd may write: its scratch holds
// rms_norm_bwd_partial_rows(rows)·hidden floats.
int64_t rms_norm_bwd_partial_rows(int64_t rows);

// dx = RMSNorm's input gradient at x (the forward's normalized input: x, or the sum s of the residual form)
// from dy and the saved rstd, plus add when non-null (the gradient of s from its other uses: dx is then
// the gradient of both x and residual). dweight (type W, when non-null; weight must then be non-null) =
// Σ_rows dy·x·rstd through `partials`, its second pass queued on sums when non-null (column_sums.h), else
// launched. weight may be null (1).
template <typename T, typename W>
cudaError_t launch_rms_norm_bwd(const T* dy, const T* x, const W* weight, const float* rstd, const T* add, T* dx,
                                W* dweight, float* partials, int64_t rows, int hidden, ColumnSums* sums,
                                cudaStream_t stream);

}  // namespace lsmini
