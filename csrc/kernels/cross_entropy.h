// Cross-entropy launchers (see cross_entropy.cu for the math, layout and conventions).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace lsmini {

// Largest vocabulary the launchers accept: keeps every in-row index arithmetic (j + threads) in int.
constexpr int kCrossEntropyMaxVocab = 1 << 30;

// Per-row label-smoothed cross-entropy of logits [rows, vocab] (row r at element r·row_stride, row_stride ≥
// vocab; any element alignment) against target [rows] (int64 class ids). Writes, per row (fp32):
//   loss_rows = (1 − ε)·(lse − x[t]) + ε·(lse − mean_j x[j]),  nll_rows = lse − x[t],  lse_rows = lse.
// Rows whose target is ignore_index get 0 in all three; rows whose target is outside [0, vocab)
// get NaN in all three (the target logit is never read for them).
// grad_rows non-null: also the gradient of launch_cross_entropy_bwd with these grad_rows, written over the
// logits (in place); logits is only read otherwise.
// T: float, __half, __nv_bfloat16. vocab ≥ 1.
template <typename T>
cudaError_t launch_cross_entropy_fwd(T* logits, const int64_t* target, float* loss_rows, float* nll_rows,
                                     float* lse_rows, const float* grad_rows, int64_t rows, int vocab,
                                     int64_t row_stride, float label_smoothing, int64_t ignore_index,
                                     cudaStream_t stream);

// grad_logits[r, j] = grad_rows[r] · (exp(x[r, j] − lse[r]) − (1 − ε)·[j == t_r] − ε/vocab);
// 0 for rows whose target is ignore_index, NaN for rows whose target is outside [0, vocab).
// grad_logits' row r at element r·grad_stride (≥ vocab); it may equal logits (in-place backward, the same
// stride), and must not overlap it in any other way.
template <typename T>
cudaError_t launch_cross_entropy_bwd(const float* grad_rows, const T* logits, const int64_t* target,
                                     const float* lse_rows, T* grad_logits, int64_t rows, int vocab,
                                     int64_t row_stride, int64_t grad_stride, float label_smoothing,
                                     int64_t ignore_index, cudaStream_t stream);

}  // namespace lsmini
