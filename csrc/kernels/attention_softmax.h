// Attention softmax launchers (see attention_softmax.cu for the math, layout and conventions).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "philox.h"

namespace lsmini {

// Longest key row the kernels hold in registers (32 values per thread × 512 threads).
constexpr int kAttentionSoftmaxMaxKeys = 16384;

// Softmax over the keys of scores [batch, heads, q_len, k_len] (contiguous), with the optional
// key-padding mask (bytes [batch, k_len], nonzero = pad; may be null), the optional bottom-right
// causal mask, and dropout. Writes the pre-dropout softmax always, and the dropped probabilities to
// `probs` when dropout_p > 0 (`probs` must then be a buffer distinct from `softmax`; it is not
// touched when dropout_p == 0). rng is not read when dropout_p == 0. T: float, __half, __nv_bfloat16.
template <typename T>
cudaError_t launch_attention_softmax_fwd(const T* scores, const uint8_t* key_padding_mask, T* softmax, T* probs,
                                         int64_t batch, int64_t heads, int64_t q_len, int64_t k_len, bool causal,
                                         float dropout_p, PhiloxArgs rng, cudaStream_t stream);

// grad_scores = y·(g − Σ y·g) with g = grad_probs·keep/(1 − p), rows of k_len; y = the saved softmax.
// grad_scores may be the same buffer as grad_probs (in-place backward).
template <typename T>
cudaError_t launch_attention_softmax_bwd(const T* grad_probs, const T* softmax, T* grad_scores, int64_t rows,
                                         int64_t k_len, float dropout_p, PhiloxArgs rng, cudaStream_t stream);

}  // namespace lsmini
