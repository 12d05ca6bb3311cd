// Fused bias + dropout + residual add, the step after every projection GEMM in a Transformer layer:
//   out = residual + dropout(x + bias)
// Layout: x, residual, out, grad_out, grad_x row-major [rows, hidden]; bias [hidden] in T or float,
// or nullptr. Dropout element index = row * hidden + col (see bias_dropout_residual.cu).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "column_sums.h"
#include "philox.h"

namespace lsmini {

// T ∈ {float, __half, __nv_bfloat16}; BT = T or float. p ∈ [0, 1]; p == 0 draws no random numbers
// (rng is not read).
template <typename T, typename BT>
cudaError_t launch_bias_dropout_residual_fwd(const T* x, const BT* bias, const T* residual, T* out, int64_t rows,
                                             int64_t hidden, float p, PhiloxArgs rng, cudaStream_t stream);

// Rows of the fp32 scratch `partials` [partial_slabs, hidden] that the backward may use for a
// [rows, hidden] input (the caller allocates it; only needed when grad_bias is requested).
int64_t bias_dropout_residual_bwd_partial_slabs(int64_t rows, int64_t hidden);

// grad_x = dropout backward of grad_out (mask regenerated from rng); grad_x may be nullptr only
// when p == 0 (then grad_x is grad_out itself and only the column sums run).
// grad_bias[c] = sum over rows of grad_x[:, c] (skipped when grad_bias == nullptr); its second pass queued
// on sums when non-null (column_sums.h), else launched.
template <typename T, typename BT>
cudaError_t launch_bias_dropout_residual_bwd(const T* grad_out, T* grad_x, BT* grad_bias, float* partials,
                                             int64_t partial_slabs, int64_t rows, int64_t hidden, float p,
                                             PhiloxArgs rng, ColumnSums* sums, cudaStream_t stream);

}  // namespace lsmini
