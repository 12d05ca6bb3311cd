/*
 * rms_norm.cu — RMSNorm over the last dimension, forward (this file) and backward (rms_norm_bwd.cu).
 *
 *   forward:  y = x·r·w,  r = 1/sqrt(mean(x²) + eps), saves r (fp32) per row
 *             residual form: s = residual + dropout(x + bias) (rounded to T, written out), y = RMSNorm(s)
 *   backward: x̂ = x·r,  g = w·dy
 *             dx = r·(g − x̂·mean(g·x̂)) [+ add, the gradient of s from its other uses]
 *             dw = Σ_rows dy·x̂
 *
 * The residual form (norm_residual.h) is the "add & norm" of a pre-norm block: s is the new residual stream, y
 * the input of the next sub-block. Its backward is the plain backward at x = s with add = the gradient of s,
 * whose dx is then the gradient of residual, and bias_dropout_residual's backward of it that of x and bias. The
 * statistics of the residual form come from s as stored (rounded to T), so the forward normalizes exactly the
 * tensor its backward reads.
 *
 * Layout: x, residual, s, y, dy, dx, add are row-major [rows, hidden] in T (float, __half,
 * __nv_bfloat16); w/dw are [hidden] of type W (float or T), w may be null (1). Math in fp32, one rounding
 * per stored value.
 *
 * How (row_groups.cuh): a row is owned by a group of G threads (a warp for short rows, up to a block of
 * 1024 for long ones; R rows per block) that holds the whole row in registers as packed T: one read of x
 * (and residual) in forward, one read of x and dy in backward, one group reduction per row each way
 * (Σx² forward, Σg·x̂ backward). Forward issues all of a row's loads before the first sum waits on one.
 * Backward walks the rows grid-stride with a grid of one resident wave and keeps its dw column sums in
 * fp32 registers over the rows it visits; each block folds its R rows in shared memory into one fp32
 * partial row, and column_partials.cuh's sum_column_partials sums those rows per column (no atomics).
 * Backward rows of 1, 2 or 4 warps at up to 4 vectors a thread take rows of warps (rms_norm.cuh,
 * bwd_row_warps: hidden 512 and 768 one warp, 1024 two, 2048 and 4096 four in 16-bit types): as many vectors
 * a thread as the row needs, no bounds checks, the weight held in registers, and a resident wave of blocks
 * whose rows of warps each walk their rows, the warps of a row meeting at a named barrier of their own for
 * its sum, not the block's (a row group wider than a warp waits on a block barrier a row). Short rows load
 * the next row before this row's reduction, so the loads overlap it.
 * A scalar variant (VEC = 1) serves hidden sizes that are not a multiple of the vector width or pointers
 * that are not 16-byte aligned.
 *
 * Napkin math (H100, bf16, 32768 × 4096): forward moves 2 · 256 MiB (3 · in the residual form, 4 with s
 * written), backward 3 · 256 MiB (4 with add) — at ≈ 3 TB/s about 0.18 and 0.27 ms; the math is a few fp32
 * operations an element each way, far below what that time allows, so both are bound by memory as long as
 * enough loads are in flight.
 */
#include "rms_norm.cuh"

namespace lsmini {
namespace {

// ADD: the residual form (norm_residual.h: residual read, s written and normalized); DROPOUT: its p > 0.
template <typename T, typename W, int VEC, int VPT, bool ADD, bool DROPOUT>
__global__ void __launch_bounds__(kRmsFwdMaxThreads)
rms_norm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ weight, T* __restrict__ y,
                    float* __restrict__ rstd_out, int64_t rows, int hidden, float eps, NormResidual<T, W> add,
                    uint32_t threshold, float scale) {
  begin_dependent_kernel();
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(add.rng) : PhiloxSeedOffset{0, 0};
  __shared__ float smem[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const int nvec = hidden / VEC;
  const int64_t first = (valid ? row : 0) * hidden;

  // All of the row's loads are issued before the first sum waits on one. Indices past the row are clamped onto
  // its last vector (and not counted) rather than guarded: a guarded load is a branch, and the compiler issues
  // no load past one until the arithmetic before it is done, a memory round trip per vector.
  Pack<T, VEC> sv[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = min(int(threadIdx.x + k * blockDim.x), nvec - 1);
    sv[k] = *reinterpret_cast<const Pack<T, VEC>*>(x + first + c * VEC);
  }
  if constexpr (ADD) residual_sum<T, W, VEC, VPT, DROPOUT>(sv, add.residual, add.bias, first, nvec, threshold, scale,
                                                         philox);
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const bool in = int(threadIdx.x + k * blockDim.x) < nvec;
    float f[VEC];
    unpack(sv[k], f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) ss += in ? f[j] * f[j] : 0.f;
  }
  ss = group_sum(ss, smem);  // the kernel's only barrier: every thread gets here
  if (!valid) return;

  const float rstd = rsqrtf(ss * (1.f / hidden) + eps);
  if (threadIdx.x == 0) rstd_out[row] = rstd;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nvec) {
      if constexpr (ADD) *reinterpret_cast<Pack<T, VEC>*>(add.sum + first + c * VEC) = sv[k];
      float f[VEC], w[VEC];
      unpack(sv[k], f);
      load_or<W, VEC>(weight, c, 1.f, w);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = f[j] * rstd * w[j];
      store_pack<T, VEC>(y + first + c * VEC, f);
    }
  }
}

template <typename T, typename W, int VEC, bool ADD, bool DROPOUT>
cudaError_t fwd_dispatch(const T* x, const W* w, T* y, float* rstd, int64_t rows, int hidden, float eps,
                         const NormResidual<T, W>& add, cudaStream_t stream) {
  // with dropout the residual form holds x's and the residual's vectors and Philox's state at once: half as many
  // elements a thread
  const RowGroups cfg = row_groups(hidden, VEC, kRmsFwdMaxThreads, DROPOUT ? 16 : 32);
  const dim3 block(cfg.G, cfg.R);
  const int64_t grid = (rows + cfg.R - 1) / cfg.R;
  uint32_t threshold = 0;
  float scale = 1.f;
  if (DROPOUT) dropout_params(add.p, &threshold, &scale);
  return with_vpt<1, (VEC == 1 ? 32 : 32 / VEC)>(cfg.vpt, [&](auto vpt) {
    return launch_dependent(rms_norm_fwd_kernel<T, W, VEC, decltype(vpt)::value, ADD, DROPOUT>, dim3(unsigned(grid)),
                            block, 0, stream, x, w, y, rstd, rows, hidden, eps, add, threshold, scale);
  });
}

template <typename T, typename W, bool ADD, bool DROPOUT>
cudaError_t fwd_path(const T* x, const W* w, T* y, float* rstd, int64_t rows, int hidden, float eps,
                     const NormResidual<T, W>& add, cudaStream_t stream) {
  if (rms_norm_vectorizable<T, W>(hidden, w, {x, add.residual, add.sum, y}) &&
      rms_norm_vectorizable<T, W>(hidden, add.bias, {}))
    return fwd_dispatch<T, W, Vec16<T>::value, ADD, DROPOUT>(x, w, y, rstd, rows, hidden, eps, add, stream);
  return fwd_dispatch<T, W, 1, ADD, DROPOUT>(x, w, y, rstd, rows, hidden, eps, add, stream);
}

}  // namespace

template <typename T, typename W>
cudaError_t launch_rms_norm_fwd(const T* x, const W* weight, T* y, float* rstd, int64_t rows, int hidden, float eps,
                                const NormResidual<T, W>* add, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;  // before the pointer checks: an empty tensor's data pointer may be null
  if (hidden <= 0 || hidden > kRmsNormMaxHidden || (add && (!add->residual || !add->sum))) return cudaErrorInvalidValue;
  if (add && add->p > 0.f) return fwd_path<T, W, true, true>(x, weight, y, rstd, rows, hidden, eps, *add, stream);
  if (add) return fwd_path<T, W, true, false>(x, weight, y, rstd, rows, hidden, eps, *add, stream);
  return fwd_path<T, W, false, false>(x, weight, y, rstd, rows, hidden, eps, NormResidual<T, W>{}, stream);
}

#define LSMINI_INSTANTIATE_RMS_NORM_FWD(T, W)                                                                  \
  template cudaError_t launch_rms_norm_fwd<T, W>(const T*, const W*, T*, float*, int64_t, int, float,          \
                                                 const NormResidual<T, W>*, cudaStream_t);
LSMINI_FOR_RMS_NORM_TYPES(LSMINI_INSTANTIATE_RMS_NORM_FWD)

}  // namespace lsmini
