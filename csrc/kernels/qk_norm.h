// QK-norm launchers: an RMSNorm over head_dim of each attention head of Q or K, in place in a projection, and
// with rotary positions the rotation of the normalized rows in the same pass (see qk_norm.cu for the math and
// layout). The layer runtime (csrc/layers/layer.cpp) runs them on a self block's Q and K.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "column_sums.h"

namespace lsmini {

// Largest head_dim the kernels take (8 values a lane of a warp).
constexpr int kQkNormMaxHeadDim = 256;

// The rotary positions applied after the norm (rot_dim 0: none): rotate-half over the first rot_dim dimensions
// of every row, as launch_rotary_fwd does; token t = b·seq + s reads the float32 tables cos/sin at
// b·stride_batch + s·stride_seq (stride_batch 0: one table for the batch), one value per rotated dimension.
struct QkRotary {
  const float* cos = nullptr;
  const float* sin = nullptr;
  int64_t stride_batch = 0, stride_seq = 0, seq = 1;
  int rot_dim = 0;
};

// For each of tokens·heads rows of head_dim elements — row (t, j) at x + t·token_stride + j·head_dim —
// raw[(t·heads + j)·head_dim + c] = x (the row as it came), then x = rotary(x·rstd·weight), rstd =
// 1/sqrt(mean(x²) + eps). T: __half, __nv_bfloat16 or float; W: float or T. rot_dim must be 0 or even and in
// [2, head_dim] (cudaErrorInvalidValue otherwise, nothing launched).
template <typename T, typename W>
cudaError_t launch_qk_norm_fwd(T* x, int64_t token_stride, T* raw, const W* weight, int64_t tokens, int heads,
                               int head_dim, float eps, QkRotary rotary, cudaStream_t stream);

// Rows of fp32 dweight partials launch_qk_norm_bwd writes for `rows` = tokens·heads rows: its `partials`
// holds qk_norm_bwd_partial_rows(rows)·head_dim floats.
int64_t qk_norm_bwd_partial_rows(int64_t rows);

// The backward of launch_qk_norm_fwd, in place: dout (the gradient of its output rows, laid out as x was) is
// taken back through the rotation to dy, the gradient of the normalized rows, and becomes dx = rstd·(g −
// x̂·mean(g·x̂)), x̂ = raw·rstd, g = weight·dy; dweight = Σ_rows dy·x̂ through `partials`, its second pass queued on
// sums when non-null (column_sums.h), else launched. rotary: the forward's.
template <typename T, typename W>
cudaError_t launch_qk_norm_bwd(T* dout, int64_t token_stride, const T* raw, const W* weight, W* dweight,
                               float* partials, int64_t tokens, int heads, int head_dim, float eps, QkRotary rotary,
                               ColumnSums* sums, cudaStream_t stream);

}  // namespace lsmini
