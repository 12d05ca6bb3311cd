// Fused bias + activation + dropout, the step after the first FFN GEMM in a Transformer layer:
//   out = dropout(act(x + bias)),   act ∈ {relu, gelu (exact, erf), gelu_tanh}
// Layout: x, out, grad_out, grad_x row-major [rows, hidden]; bias [hidden] in T or float, or nullptr.
// Dropout element index = row * hidden + col (see bias_act_dropout.cu).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "column_sums.h"
#include "philox.h"

namespace lsmini {

// Activation ids shared with the binding (and the Python names "relu", "gelu", "gelu_tanh").
enum class BiasAct : int { Relu = 0, Gelu = 1, GeluTanh = 2 };
constexpr int kBiasActCount = 3;

// T ∈ {float, __half, __nv_bfloat16}; BT = T or float. p ∈ [0, 1]; p == 0 draws no random numbers
// (rng is not read).
// An unknown act returns cudaErrorInvalidValue without launching.
template <typename T, typename BT>
cudaError_t launch_bias_act_dropout_fwd(const T* x, const BT* bias, T* out, int64_t rows, int64_t hidden, int act,
                                        float p, PhiloxArgs rng, cudaStream_t stream);

// Rows of the fp32 scratch `partials` [partial_slabs, hidden] that the backward may use for a
// [rows, hidden] input (the caller allocates it; only needed when grad_bias is requested).
int64_t bias_act_dropout_bwd_partial_slabs(int64_t rows, int64_t hidden);

// grad_x = act'(x + bias) · dropout backward of grad_out (mask regenerated from rng);
// grad_bias[c] = sum over rows of grad_x[:, c] (skipped when grad_bias == nullptr); its second pass queued on
// sums when non-null (column_sums.h), else launched.
// from_output (relu only, else cudaErrorInvalidValue): x is the forward's output instead of its input,
// grad_x = grad_out / (1 − p) where x > 0, else 0; bias and rng are not read.
template <typename T, typename BT>
cudaError_t launch_bias_act_dropout_bwd(const T* grad_out, const T* x, const BT* bias, T* grad_x, BT* grad_bias,
                                        float* partials, int64_t partial_slabs, int64_t rows, int64_t hidden,
                                        int act, float p, PhiloxArgs rng, bool from_output, ColumnSums* sums,
                                        cudaStream_t stream);

}  // namespace lsmini
