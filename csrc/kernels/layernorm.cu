/*
 * layernorm.cu — LayerNorm over the last dimension, forward and backward.
 *
 *   forward:  y = (x − μ)·r·γ + β,  r = 1/sqrt(σ² + eps)  (biased σ²), saves μ and r (fp32) per row
 *             residual form (norm_residual.h): s = residual + dropout(x + bias) (rounded to T, written
 *             out), then y = LayerNorm(s) — the add & norm between two blocks
 *   backward: x̂ = (x − μ)·r,  g = γ·dy
 *             dx = r·(g − mean(g) − x̂·mean(g·x̂)) [+ add, a residual branch's gradient, when given]
 *             dγ = Σ_rows dy·x̂,  dβ = Σ_rows dy
 *
 * Layout: x, y, dy, dx, add are row-major [rows, hidden]; γ/β/dγ/dβ are [hidden] of type W (float or
 * the element type T); either of γ/β may be null (1 and 0). add may be dx itself (dx += in place: each
 * element is read by the thread that then writes it), so neither is __restrict__.
 *
 * How: a row is owned by a group of G threads (blockDim.x = G, a multiple of 32; blockDim.y = R rows
 * per block) that holds the whole row in registers as packed T — one read of x in forward, one read of
 * x and dy in backward. Each thread owns the 16-byte vectors c = threadIdx.x + k·G, k < VPT.
 *   - Forward takes Σ(x − s) and Σ(x − s)² around s = x[row, 0]: one pass, one reduction, and no
 *     catastrophic cancellation when the row mean is large next to its spread (x = 1000 + N(0,1)),
 *     which the plain E[x²] − E[x]² rewrite suffers from.
 *   - Backward takes both row sums Σg and Σg·x̂ in the same single reduction, then dx elementwise.
 *     dγ/dβ accumulate in fp32 registers over the rows a block visits (grid-stride), are folded over
 *     the block's R rows in shared memory, written as one fp32 partial row per block, and summed by a
 *     small second kernel — no atomics.
 * A scalar variant (VEC = 1) serves hidden sizes that are not a multiple of the vector width or
 * pointers that are not 16-byte aligned.
 *
 * Files: this one holds the forward; layernorm_bwd.cu the backward; layernorm.cuh what both use (the
 * block sizes, the vector-path test, the type list); row_groups.cuh the row-group configuration and the
 * dispatch over VPT, which RMSNorm shares. Two translation units halve the compile time of the many VPT
 * instantiations and let them build in parallel.
 */
#include "layernorm.cuh"

namespace lsmini {
namespace {

// ADD: the residual form (norm_residual.h: residual read, s written and normalized); DROPOUT: its p > 0.
template <typename T, typename W, int VEC, int VPT, bool ADD, bool DROPOUT>
__device__ __forceinline__ void layernorm_fwd_rows(const T* __restrict__ x, const W* __restrict__ weight,
                                                   const W* __restrict__ bias, T* __restrict__ y,
                                                   float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                                   int64_t rows, int hidden, float eps, const NormResidual<T, W>& add,
                                                   uint32_t threshold, float scale) {
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(add.rng) : PhiloxSeedOffset{0, 0};
  __shared__ float2 smem[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const int nvec = hidden / VEC;
  const int64_t first = (valid ? row : 0) * hidden;
  const T* xr = x + first;

  // All of the row's loads are issued before the first sum waits on one. Indices past the row are clamped
  // onto its last vector (and not counted) rather than guarded: a guarded load is a branch, and the compiler
  // issues no load past one until the arithmetic before it is done, a full memory round trip per vector.
  Pack<T, VEC> xv[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = min(int(threadIdx.x + k * blockDim.x), nvec - 1);
    xv[k] = *reinterpret_cast<const Pack<T, VEC>*>(xr + c * VEC);
  }
  // The shift: the row's first element (of s in the residual form, which every thread computes for itself).
  float shift;
  if constexpr (ADD) {
    residual_sum<T, W, VEC, VPT, DROPOUT>(xv, add.residual, add.bias, first, nvec, threshold, scale, philox);
    float s0[1] = {to_float(xr[0]) + (add.bias != nullptr ? to_float(add.bias[0]) : 0.f)};
    if constexpr (DROPOUT) dropout_apply<1>(s0, philox.seed, philox.offset, uint64_t(first), threshold, scale);
    s0[0] += to_float(add.residual[first]);
    unpack(pack<T, 1>(s0), s0);
    shift = s0[0];
  } else {
    shift = to_float(xr[0]);
  }
  float2 s = make_float2(0.f, 0.f);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const bool in = int(threadIdx.x + k * blockDim.x) < nvec;
    float f[VEC];
    unpack(xv[k], f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = in ? f[j] - shift : 0.f;
      s.x += d;
      s.y += d * d;
    }
  }
  s = group_sum2(s, smem);  // the kernel's only barrier: every thread gets here
  if (!valid) return;

  const float inv_h = 1.f / hidden;
  const float mu_s = s.x * inv_h;  // mean − shift
  const float var = fmaxf(s.y * inv_h - mu_s * mu_s, 0.f);
  const float rstd = rsqrtf(var + eps);
  if (threadIdx.x == 0) {
    mean_out[row] = shift + mu_s;
    rstd_out[row] = rstd;
  }
  T* yr = y + first;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nvec) {
      if constexpr (ADD) *reinterpret_cast<Pack<T, VEC>*>(add.sum + first + c * VEC) = xv[k];
      float f[VEC], w[VEC], b[VEC];
      unpack(xv[k], f);
      load_or<W, VEC>(weight, c, 1.f, w);
      load_or<W, VEC>(bias, c, 0.f, b);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = ((f[j] - shift) - mu_s) * rstd * w[j] + b[j];
      store_pack<T, VEC>(yr + c * VEC, f);
    }
  }
}

template <typename T, typename W, int VEC, int VPT, bool ADD, bool DROPOUT>
__global__ void __launch_bounds__(kFwdMaxThreads)
layernorm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ weight, const W* __restrict__ bias,
                     T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                     int hidden, float eps, NormResidual<T, W> add, uint32_t threshold, float scale) {
  begin_dependent_kernel();
  layernorm_fwd_rows<T, W, VEC, VPT, ADD, DROPOUT>(x, weight, bias, y, mean_out, rstd_out, rows, hidden, eps, add,
                                                   threshold, scale);
}

// 16-bit rows of 16 elements a thread: at most 40 registers, so that six blocks of 256 threads fit an SM instead of
// four or five at the 42-52 the compiler picks on its own; that helps most at hidden 512 with fp32 weights. At 32
// elements a thread the same cap spills hundreds of bytes and runs at less than half the speed, so there, and
// everywhere else (the residual form too), the kernel above runs.
// __maxnreg__ exists from CUDA 12.4 on; older toolkits build this kernel at the registers the compiler picks.
#if __CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 4)
#define LSMINI_FWD_40_REGISTERS __maxnreg__(40)
#else
#define LSMINI_FWD_40_REGISTERS __launch_bounds__(kFwdMaxThreads)
#endif
template <typename T, typename W, int VEC, int VPT>
__global__ void LSMINI_FWD_40_REGISTERS
layernorm_fwd_kernel_40_registers(const T* __restrict__ x, const W* __restrict__ weight,
                                  const W* __restrict__ bias, T* __restrict__ y, float* __restrict__ mean_out,
                                  float* __restrict__ rstd_out, int64_t rows, int hidden, float eps) {
  begin_dependent_kernel();
  layernorm_fwd_rows<T, W, VEC, VPT, false, false>(x, weight, bias, y, mean_out, rstd_out, rows, hidden, eps,
                                                   NormResidual<T, W>{}, 0u, 1.f);
}

template <typename T, typename W, int VEC, bool ADD, bool DROPOUT>
cudaError_t fwd_dispatch(const T* x, const W* w, const W* b, T* y, float* mean, float* rstd, int64_t rows,
                         int hidden, float eps, const NormResidual<T, W>& add, cudaStream_t stream) {
  // the residual form holds x's and the residual's vectors at once: half as many elements a thread
  const RowGroups cfg = row_groups(hidden, VEC, kFwdMaxThreads, ADD ? 16 : 32);
  const dim3 block(cfg.G, cfg.R);
  const int64_t grid = (rows + cfg.R - 1) / cfg.R;
  uint32_t threshold = 0;
  float scale = 1.f;
  if (DROPOUT) dropout_params(add.p, &threshold, &scale);
  return with_vpt<1, (VEC == 1 ? 32 : 32 / VEC)>(cfg.vpt, [&](auto vpt) {
    constexpr int V = decltype(vpt)::value;
    if constexpr (VEC == 8 && V == 2 && !ADD) {  // 16-bit T, 16 elements a thread
      return launch_dependent(layernorm_fwd_kernel_40_registers<T, W, VEC, V>, dim3(unsigned(grid)), block, 0, stream,
                              x, w, b, y, mean, rstd, rows, hidden, eps);
    } else {
      return launch_dependent(layernorm_fwd_kernel<T, W, VEC, V, ADD, DROPOUT>, dim3(unsigned(grid)), block, 0,
                              stream, x, w, b, y, mean, rstd, rows, hidden, eps, add, threshold, scale);
    }
  });
}

template <typename T, typename W, bool ADD, bool DROPOUT>
cudaError_t fwd_path(const T* x, const W* w, const W* b, T* y, float* mean, float* rstd, int64_t rows, int hidden,
                     float eps, const NormResidual<T, W>& add, cudaStream_t stream) {
  if (vectorizable<T, W>(x, y, w, b, hidden) && (!ADD || (vectorizable<T, W>(add.residual, add.sum, add.bias,
                                                                              nullptr, hidden))))
    return fwd_dispatch<T, W, Vec16<T>::value, ADD, DROPOUT>(x, w, b, y, mean, rstd, rows, hidden, eps, add, stream);
  return fwd_dispatch<T, W, 1, ADD, DROPOUT>(x, w, b, y, mean, rstd, rows, hidden, eps, add, stream);
}

}  // namespace

template <typename T, typename W>
cudaError_t launch_layernorm_fwd(const T* x, const W* weight, const W* bias, T* y, float* mean, float* rstd,
                                 int64_t rows, int hidden, float eps, const NormResidual<T, W>* add,
                                 cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;  // before the pointer checks: an empty tensor's data pointer may be null
  if (hidden <= 0 || hidden > kLayerNormMaxHidden || (add && (!add->residual || !add->sum)))
    return cudaErrorInvalidValue;
  if (add && add->p > 0.f)
    return fwd_path<T, W, true, true>(x, weight, bias, y, mean, rstd, rows, hidden, eps, *add, stream);
  if (add) return fwd_path<T, W, true, false>(x, weight, bias, y, mean, rstd, rows, hidden, eps, *add, stream);
  return fwd_path<T, W, false, false>(x, weight, bias, y, mean, rstd, rows, hidden, eps, NormResidual<T, W>{},
                                      stream);
}

#define LSMINI_INSTANTIATE_LN_FWD(T, W)                                                                      \
  template cudaError_t launch_layernorm_fwd<T, W>(const T*, const W*, const W*, T*, float*, float*, int64_t, \
                                                  int, float, const NormResidual<T, W>*, cudaStream_t);
LSMINI_FOR_LN_TYPES(LSMINI_INSTANTIATE_LN_FWD)

}  // namespace lsmini
