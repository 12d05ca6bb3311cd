// Gated linear units, the FFN activation of Llama-style blocks (SwiGLU, GeGLU):
//   out = dropout(act(gate)·up),   act ∈ {silu, gelu (exact, erf), gelu_tanh}
// Layout: gate and up are [rows, cols] with a row stride of in_stride elements: cols for two tensors of their
// own, 2·cols for the two halves of one [rows, 2·cols] tensor (one GEMM produced both; up = gate + cols).
// out and grad_out are contiguous [rows, cols]; grad_gate and grad_up have gate's and up's layout.
// Dropout element index = row * cols + col of out (see glu.cu).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "philox.h"

namespace lsmini {

// Activation ids shared with the binding (and the Python names "silu", "gelu", "gelu_tanh").
enum class GluAct : int { Silu = 0, Gelu = 1, GeluTanh = 2 };
constexpr int kGluActCount = 3;

// T ∈ {float, __half, __nv_bfloat16}. p ∈ [0, 1]; p == 0 draws no random numbers (rng is not read).
// An unknown act, or in_stride < cols, returns cudaErrorInvalidValue without launching.
template <typename T>
cudaError_t launch_glu_fwd(const T* gate, const T* up, int64_t in_stride, T* out, int64_t rows, int64_t cols,
                           int act, float p, PhiloxArgs rng, cudaStream_t stream);

// grad_gate = dropout backward of grad_out · up · act'(gate),  grad_up = dropout backward of grad_out · act(gate),
// the forward's mask regenerated from rng.
template <typename T>
cudaError_t launch_glu_bwd(const T* grad_out, const T* gate, const T* up, int64_t in_stride, T* grad_gate,
                           T* grad_up, int64_t rows, int64_t cols, int act, float p, PhiloxArgs rng,
                           cudaStream_t stream);

}  // namespace lsmini
