/*
 * qk_norm.cu — QK-norm: an RMSNorm over head_dim of each attention head of Q or K, in place, and the rotary
 * positions of the normalized rows in the same pass.
 *
 *   forward:  raw = x, then y = x·r·w,  r = 1/sqrt(mean(x²) + eps) per (token, head) row;
 *             x = rot(y): y_c·cos_c − y_{c+h}·sin_c (c < h), y_c·cos_c + y_{c−h}·sin_c (h ≤ c < rot_dim), y_c
 *             past rot_dim; h = rot_dim/2 (rotate-half, as rotary.cu; rot_dim 0: x = y)
 *   backward: dy = rotᵀ(dout): dout_c·cos_c + dout_{c+h}·sin_{c+h} (c < h), dout_c·cos_c − dout_{c−h}·sin_{c−h}
 *             (h ≤ c < rot_dim); r recomputed from raw, x̂ = raw·r, g = w·dy
 *             dx = r·(g − x̂·mean(g·x̂)), written over dout;  dw = Σ_rows dy·x̂
 *
 * Layout: the rows lie in a projection [tokens, columns] (the Q or the K heads of a fused QKV projection, or of
 * its gradient): row (t, j) at t·token_stride + j·head_dim. raw is contiguous [tokens·heads, head_dim]. T is
 * __half, __nv_bfloat16 or float; w/dw [head_dim] of type W (float or T). Math in fp32, one rounding per stored
 * value. The backward reads the rows as the forward received them (raw), not its output: the output is the
 * weighted x̂, from which x̂ could only be had by dividing by w.
 *
 * How: one warp a row, each lane holding head_dim/32 (at most 8) elements in registers, one warp reduction forward
 * and two backward; a rotation exchanges the row's values through the warp's row of shared memory (the partner of
 * element c is h away, in another lane unless h is a multiple of 32). Backward walks the rows grid-stride over a
 * fixed grid (qk_norm_bwd_partial_rows) and keeps each lane's dw sums in registers; each block folds its warps'
 * sums in shared memory, in warp order, into one partial row, and column_partials.cuh sums those rows per column
 * (no atomics: deterministic for a given device). The pass moves (heads + kv_heads)·head_dim columns of a
 * projection, small beside the GEMMs around it, so it is plain scalar code.
 */
#include "qk_norm.h"

#include "column_partials.cuh"
#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kWarps = 8;                          // rows in flight per block, one warp each
constexpr int kPerLane = kQkNormMaxHeadDim / 32;  // elements of a row per lane, at most
constexpr int kBwdBlocksPerSm = 3;                // the backward's resident blocks: at most 80 registers a thread

// The tables' row of the (token, head) row `row`: token t = b·seq + s.
__device__ __forceinline__ int64_t table_offset(const QkRotary& rot, int64_t row, int heads) {
  const int64_t t = row / heads;
  return (t / rot.seq) * rot.stride_batch + (t % rot.seq) * rot.stride_seq;
}

// The rotation (transpose: its transpose) of the row whose element c = lane + 32k the lane holds in v[k], in place,
// with the row's tables cs/sn (the formulas at the top). stage: the warp's row of shared memory.
__device__ __forceinline__ void rotate_row(float (&v)[kPerLane], float* stage, const float* __restrict__ cs,
                                           const float* __restrict__ sn, int rot_dim, int lane, bool transpose) {
  const int h = rot_dim / 2;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c < rot_dim) stage[c] = v[k];
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c < rot_dim) {
      const bool first = c < h;
      const int p = first ? c + h : c - h;  // the pair's other element
      const float sign = first != transpose ? -1.f : 1.f;
      v[k] = v[k] * cs[c] + sign * stage[p] * sn[transpose ? p : c];
    }
  }
  __syncwarp();  // the stage is free for the warp's next row
}

template <typename T, typename W>
__global__ void __launch_bounds__(kWarps * 32)
qk_norm_fwd_kernel(T* __restrict__ x, int64_t token_stride, T* __restrict__ raw, const W* __restrict__ weight,
                   int64_t rows, int heads, int head_dim, float eps, QkRotary rot) {
  begin_dependent_kernel();
  __shared__ float stage[kWarps][kQkNormMaxHeadDim];
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.y;
  if (row >= rows) return;  // a whole warp: no shuffle is left without its partners
  const int lane = threadIdx.x;
  T* xr = x + (row / heads) * token_stride + (row % heads) * int64_t(head_dim);
  T* rr = raw + row * head_dim;
  float v[kPerLane];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    v[k] = 0.f;
    if (c < head_dim) {
      const T e = xr[c];
      rr[c] = e;
      v[k] = to_float(e);
      ss += v[k] * v[k];
    }
  }
  const float r = rsqrtf(warp_sum(ss) / float(head_dim) + eps);
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c < head_dim) v[k] *= r * to_float(weight[c]);
  }
  if (rot.rot_dim) {
    const int64_t at = table_offset(rot, row, heads);
    rotate_row(v, stage[threadIdx.y], rot.cos + at, rot.sin + at, rot.rot_dim, lane, false);
  }
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c < head_dim) xr[c] = from_float<T>(v[k]);
  }
}

template <typename T, typename W>
__global__ void __launch_bounds__(kWarps * 32, kBwdBlocksPerSm)
qk_norm_bwd_kernel(T* __restrict__ dout, int64_t token_stride, const T* __restrict__ raw, const W* __restrict__ weight,
                   float* __restrict__ partials, int64_t rows, int heads, int head_dim, float eps, QkRotary rot) {
  begin_dependent_kernel();
  __shared__ float fold[kWarps][kQkNormMaxHeadDim];
  __shared__ float stage[kWarps][kQkNormMaxHeadDim];
  const int lane = threadIdx.x;
  float w[kPerLane], acc[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    w[k] = c < head_dim ? to_float(weight[c]) : 0.f;
    acc[k] = 0.f;
  }
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.y; row < rows; row += step) {
    T* dr = dout + (row / heads) * token_stride + (row % heads) * int64_t(head_dim);
    const T* rr = raw + row * head_dim;
    float xv[kPerLane], gv[kPerLane];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int c = lane + 32 * k;
      xv[k] = c < head_dim ? to_float(rr[c]) : 0.f;
      gv[k] = c < head_dim ? to_float(dr[c]) : 0.f;
      ss += xv[k] * xv[k];
    }
    if (rot.rot_dim) {  // the gradient of the rotated rows → that of the normalized ones
      const int64_t at = table_offset(rot, row, heads);
      rotate_row(gv, stage[threadIdx.y], rot.cos + at, rot.sin + at, rot.rot_dim, lane, true);
    }
    const float r = rsqrtf(warp_sum(ss) / float(head_dim) + eps);
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      xv[k] *= r;               // x̂
      acc[k] += gv[k] * xv[k];  // dw: dy·x̂
      gv[k] *= w[k];            // g = w·dy
      dot += gv[k] * xv[k];
    }
    const float m = warp_sum(dot) / float(head_dim);
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int c = lane + 32 * k;
      if (c < head_dim) dr[c] = from_float<T>(r * (gv[k] - xv[k] * m));
    }
  }
  // the block's partial row: its warps' sums folded in warp order
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int c = lane + 32 * k;
    if (c < head_dim) fold[threadIdx.y][c] = acc[k];
  }
  __syncthreads();
  for (int c = threadIdx.y * 32 + lane; c < head_dim; c += kWarps * 32) {
    float t = 0.f;
#pragma unroll
    for (int y = 0; y < kWarps; ++y) t += fold[y][c];
    partials[int64_t(blockIdx.x) * head_dim + c] = t;
  }
}

bool rotary_valid(const QkRotary& rot, int head_dim) {
  return rot.rot_dim == 0 ||
         (rot.rot_dim % 2 == 0 && rot.rot_dim >= 2 && rot.rot_dim <= head_dim && rot.cos && rot.sin && rot.seq > 0);
}

}  // namespace

int64_t qk_norm_bwd_partial_rows(int64_t rows) {
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  const int64_t cap = int64_t(kBwdBlocksPerSm) * sm_count();  // one resident wave
  return blocks < cap ? blocks : cap;
}

template <typename T, typename W>
cudaError_t launch_qk_norm_fwd(T* x, int64_t token_stride, T* raw, const W* weight, int64_t tokens, int heads,
                               int head_dim, float eps, QkRotary rotary, cudaStream_t stream) {
  if (head_dim <= 0 || head_dim > kQkNormMaxHeadDim || heads <= 0 || tokens < 0 || !weight ||
      !rotary_valid(rotary, head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = tokens * heads;
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  return launch_dependent(qk_norm_fwd_kernel<T, W>, dim3(unsigned(blocks)), dim3(32, kWarps), 0, stream, x,
                          token_stride, raw, weight, rows, heads, head_dim, eps, rotary);
}

template <typename T, typename W>
cudaError_t launch_qk_norm_bwd(T* dout, int64_t token_stride, const T* raw, const W* weight, W* dweight,
                               float* partials, int64_t tokens, int heads, int head_dim, float eps, QkRotary rotary,
                               ColumnSums* sums, cudaStream_t stream) {
  if (head_dim <= 0 || head_dim > kQkNormMaxHeadDim || heads <= 0 || tokens < 0 || !weight || !dweight ||
      !rotary_valid(rotary, head_dim)) {
    return cudaErrorInvalidValue;
  }
  const int64_t rows = tokens * heads;
  const int64_t parts = qk_norm_bwd_partial_rows(rows);  // 0 rows: none, and the column sums write zeros
  if (rows > 0) {
    if (!partials) return cudaErrorInvalidValue;
    const cudaError_t err = launch_dependent(qk_norm_bwd_kernel<T, W>, dim3(unsigned(parts)), dim3(32, kWarps), 0,
                                             stream, dout, token_stride, raw, weight, partials, rows, heads, head_dim,
                                             eps, rotary);
    if (err != cudaSuccess) return err;
  }
  return finish_column_partials<W>(partials, parts, head_dim, dweight, sums, stream);
}

#define LSMINI_INSTANTIATE_QK_NORM(T, W)                                                                         \
  template cudaError_t launch_qk_norm_fwd<T, W>(T*, int64_t, T*, const W*, int64_t, int, int, float, QkRotary, \
                                                cudaStream_t);                                                   \
  template cudaError_t launch_qk_norm_bwd<T, W>(T*, int64_t, const T*, const W*, W*, float*, int64_t, int, int, \
                                                float, QkRotary, ColumnSums*, cudaStream_t);
LSMINI_INSTANTIATE_QK_NORM(float, float)
LSMINI_INSTANTIATE_QK_NORM(__half, __half)
LSMINI_INSTANTIATE_QK_NORM(__half, float)
LSMINI_INSTANTIATE_QK_NORM(__nv_bfloat16, __nv_bfloat16)
LSMINI_INSTANTIATE_QK_NORM(__nv_bfloat16, float)

}  // namespace lsmini
