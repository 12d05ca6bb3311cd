/*
 * layernorm.cu — LayerNorm over the last dimension, forward and backward.
 *
 *   forward:  y = (x − μ)·r·γ + β,  r = 1/sqrt(σ² + eps)  (biased σ²), saves μ and r (fp32) per row
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
 */
#include "common.cuh"
#include "layernorm.h"

#include <type_traits>

namespace lsmini {
namespace {

constexpr int kFwdMaxThreads = 1024;
constexpr int kBwdMaxThreads = 512;  // backward holds 4 arrays per thread: cap G so registers fit

struct LnConfig {
  int G, R, vpt;
};

// Smallest row group with about `elems` elements per thread (enough loads in flight), at most `max_g`
// threads.
inline LnConfig ln_config(int hidden, int vec, int max_g, int elems) {
  const int nvec = hidden / vec;
  const int pref = vec >= elems ? 1 : elems / vec;
  int G = 32;
  while (G < max_g && nvec > G * pref) G *= 2;
  int vpt = 1;
  while (vpt * G < nvec) vpt *= 2;
  return {G, G >= 256 ? 1 : 256 / G, vpt};
}

template <typename W, int VEC>
__device__ __forceinline__ void load_or(const W* p, int c, float fill, float (&out)[VEC]) {
  if (p) {
    load_pack<W, VEC>(p + c * VEC, out);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = fill;
  }
}

template <typename T, typename W, int VEC, int VPT>
__global__ void __launch_bounds__(kFwdMaxThreads)
layernorm_fwd_kernel(const T* __restrict__ x, const W* __restrict__ weight, const W* __restrict__ bias,
                     T* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                     int hidden, float eps) {
  __shared__ float2 smem[32];
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const int nvec = hidden / VEC;
  const T* xr = x + (valid ? row : 0) * hidden;

  Pack<T, VEC> xv[VPT];
  const float shift = valid ? to_float(xr[0]) : 0.f;
  float2 s = make_float2(0.f, 0.f);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (valid && c < nvec) {
      xv[k] = *reinterpret_cast<const Pack<T, VEC>*>(xr + c * VEC);
      float f[VEC];
      unpack(xv[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = f[j] - shift;
        s.x += d;
        s.y += d * d;
      }
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
  T* yr = y + row * hidden;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nvec) {
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

// part_g/part_b: [gridDim.x, hidden] fp32, or null when neither dγ nor dβ is wanted.
template <typename T, typename W, int VEC, int VPT>
__global__ void __launch_bounds__(kBwdMaxThreads)
layernorm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                     const float* __restrict__ mean, const float* __restrict__ rstd, const T* add, T* dx,
                     float* __restrict__ part_g, float* __restrict__ part_b, int64_t rows, int hidden) {
  __shared__ float2 smem[32];
  extern __shared__ float fold[];  // [2][R][hidden] when R > 1 and partials are wanted
  const int nvec = hidden / VEC;
  const float inv_h = 1.f / hidden;

  float acc_g[VPT][VEC], acc_b[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = 0.f;

  // The loop bound is uniform over the block (group_sum2 has barriers); rows past the end idle.
  // The next row's x/dy are loaded before this row's reduction so that the loads overlap it (skipped
  // for long rows, which already keep enough bytes in flight and would run out of registers).
  constexpr bool kPrefetch = VPT * VEC <= 16;
  const int64_t stride = int64_t(gridDim.x) * blockDim.y;
  Pack<T, VEC> xv[VPT], dv[VPT];
  float mu = 0.f, rs = 0.f;
  auto load_row = [&](int64_t row, Pack<T, VEC>(&xs)[VPT], Pack<T, VEC>(&ds)[VPT], float& m, float& r) {
    if (row >= rows) return;
    m = mean[row];
    r = rstd[row];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (c < nvec) {
        xs[k] = *reinterpret_cast<const Pack<T, VEC>*>(x + row * hidden + c * VEC);
        ds[k] = *reinterpret_cast<const Pack<T, VEC>*>(dy + row * hidden + c * VEC);
      }
    }
  };
  if (kPrefetch) load_row(int64_t(blockIdx.x) * blockDim.y + threadIdx.y, xv, dv, mu, rs);

  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    Pack<T, VEC> xn[VPT], dn[VPT];
    float mu_n = 0.f, rs_n = 0.f;
    if (kPrefetch) {
      load_row(row + stride, xn, dn, mu_n, rs_n);
    } else {
      load_row(row, xv, dv, mu, rs);
    }

    float2 s = make_float2(0.f, 0.f);
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (valid && c < nvec) {
        float xf[VEC], df[VEC], w[VEC];
        unpack(xv[k], xf);
        unpack(dv[k], df);
        load_or<W, VEC>(weight, c, 1.f, w);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xh = (xf[j] - mu) * rs;
          const float g = df[j] * w[j];
          s.x += g;
          s.y += g * xh;
          acc_g[k][j] += df[j] * xh;
          acc_b[k][j] += df[j];
        }
      }
    }
    s = group_sum2(s, smem);
    if (valid) {
      const float a = s.x * inv_h, b = s.y * inv_h;
      T* dxr = dx + row * hidden;
      const T* addr = add + row * hidden;
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < nvec) {
          float xf[VEC], df[VEC], w[VEC], af[VEC];
          unpack(xv[k], xf);
          unpack(dv[k], df);
          load_or<W, VEC>(weight, c, 1.f, w);
          load_or<T, VEC>(add ? addr : nullptr, c, 0.f, af);
#pragma unroll
          for (int j = 0; j < VEC; ++j) xf[j] = rs * (df[j] * w[j] - a - (xf[j] - mu) * rs * b) + af[j];
          store_pack<T, VEC>(dxr + c * VEC, xf);
        }
      }
    }
    if (kPrefetch) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        xv[k] = xn[k];
        dv[k] = dn[k];
      }
      mu = mu_n;
      rs = rs_n;
    }
  }

  if (part_g == nullptr) return;
  const int R = blockDim.y;
  float* pg = part_g + int64_t(blockIdx.x) * hidden;
  float* pb = part_b + int64_t(blockIdx.x) * hidden;
  if (R == 1) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (c < nvec)
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          pg[c * VEC + j] = acc_g[k][j];
          pb[c * VEC + j] = acc_b[k][j];
        }
    }
    return;
  }
  // Fold the R rows of the block in shared memory, then write one partial row.
  float* fg = fold + threadIdx.y * hidden;
  float* fb = fold + (R + threadIdx.y) * hidden;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nvec)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        fg[c * VEC + j] = acc_g[k][j];
        fb[c * VEC + j] = acc_b[k][j];
      }
  }
  __syncthreads();
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int col = tid; col < hidden; col += blockDim.x * R) {
    float g = 0.f, b = 0.f;
    for (int r = 0; r < R; ++r) {
      g += fold[r * hidden + col];
      b += fold[(R + r) * hidden + col];
    }
    pg[col] = g;
    pb[col] = b;
  }
}

// dγ[col] = Σ_p part_g[p, col] (same for dβ). Block (32, 16): 32 columns, 16 partial rows at a time.
// A few blocks walk a few hundred partial rows, so the sum is bound by load latency: unrolled, each
// thread has four loads of each array in flight (the adds keep their order).
template <typename W>
__global__ void layernorm_bwd_reduce_kernel(const float* __restrict__ part_g, const float* __restrict__ part_b,
                                            int64_t parts, int hidden, W* __restrict__ dweight,
                                            W* __restrict__ dbias) {
  __shared__ float sg[16][33], sb[16][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float g = 0.f, b = 0.f;
  if (col < hidden) {
#pragma unroll 4
    for (int64_t p = threadIdx.y; p < parts; p += 16) {
      g += part_g[p * hidden + col];
      b += part_b[p * hidden + col];
    }
  }
  sg[threadIdx.y][threadIdx.x] = g;
  sb[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    for (int r = 1; r < 16; ++r) {
      g += sg[r][threadIdx.x];
      b += sb[r][threadIdx.x];
    }
    if (dweight) dweight[col] = from_float<W>(g);
    if (dbias) dbias[col] = from_float<W>(b);
  }
}

template <typename T, typename W>
inline bool vectorizable(const void* a, const void* b, const void* w, const void* bias, int hidden) {
  constexpr int V = Vec16<T>::value;
  return hidden % V == 0 && is_aligned(a, 16) && is_aligned(b, 16) && (!w || is_aligned(w, V * sizeof(W))) &&
         (!bias || is_aligned(bias, V * sizeof(W)));
}

// Calls f(std::integral_constant<int, VPT>) for the power of two vpt ≤ MAXV.
template <int VPT, int MAXV, typename F>
inline cudaError_t with_vpt(int vpt, F&& f) {
  if constexpr (VPT >= MAXV) {
    return vpt == VPT ? f(std::integral_constant<int, VPT>{}) : cudaErrorInvalidValue;
  } else {
    return vpt == VPT ? f(std::integral_constant<int, VPT>{}) : with_vpt<VPT * 2, MAXV>(vpt, f);
  }
}

template <typename T, typename W, int VEC>
cudaError_t fwd_dispatch(const T* x, const W* w, const W* b, T* y, float* mean, float* rstd, int64_t rows,
                         int hidden, float eps, cudaStream_t stream) {
  const LnConfig cfg = ln_config(hidden, VEC, kFwdMaxThreads, 32);
  const dim3 block(cfg.G, cfg.R);
  const int64_t grid = (rows + cfg.R - 1) / cfg.R;
  return with_vpt<1, (VEC == 1 ? 32 : 32 / VEC)>(cfg.vpt, [&](auto vpt) {
    layernorm_fwd_kernel<T, W, VEC, decltype(vpt)::value>
        <<<grid, block, 0, stream>>>(x, w, b, y, mean, rstd, rows, hidden, eps);
    return cudaGetLastError();
  });
}

template <typename T, typename W, int VEC>
cudaError_t bwd_dispatch(const T* dy, const T* x, const W* w, const float* mean, const float* rstd, const T* add,
                         T* dx, float* part_g, float* part_b, int64_t rows, int hidden, int64_t max_parts,
                         int64_t* parts_used, cudaStream_t stream) {
  const LnConfig cfg = ln_config(hidden, VEC, kBwdMaxThreads, 16);
  const dim3 block(cfg.G, cfg.R);
  const size_t fold_bytes = (part_g && cfg.R > 1) ? size_t(2) * cfg.R * hidden * sizeof(float) : 0;
  return with_vpt<1, (VEC == 1 ? 64 : 64 / VEC)>(cfg.vpt, [&](auto vpt) {
    auto kernel = layernorm_bwd_kernel<T, W, VEC, decltype(vpt)::value>;
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, cfg.G * cfg.R, fold_bytes);
    int64_t grid = int64_t(sm_count()) * (per_sm > 0 ? per_sm : 1);
    grid = grid < max_parts ? grid : max_parts;
    const int64_t need = (rows + cfg.R - 1) / cfg.R;
    grid = grid < need ? grid : need;
    *parts_used = grid;
    kernel<<<grid, block, fold_bytes, stream>>>(dy, x, w, mean, rstd, add, dx, part_g, part_b, rows, hidden);
    return cudaGetLastError();
  });
}

}  // namespace

int64_t layernorm_bwd_partial_rows(int64_t rows) {
  const int64_t cap = int64_t(8) * sm_count();  // ≥ resident blocks: G·R ≥ 256 threads, ≤ 2048 per SM
  return rows < cap ? rows : cap;
}

template <typename T, typename W>
cudaError_t launch_layernorm_fwd(const T* x, const W* weight, const W* bias, T* y, float* mean, float* rstd,
                                 int64_t rows, int hidden, float eps, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  if (hidden <= 0 || hidden > kLayerNormMaxHidden) return cudaErrorInvalidValue;
  if (vectorizable<T, W>(x, y, weight, bias, hidden))
    return fwd_dispatch<T, W, Vec16<T>::value>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
  return fwd_dispatch<T, W, 1>(x, weight, bias, y, mean, rstd, rows, hidden, eps, stream);
}

template <typename T, typename W>
cudaError_t launch_layernorm_bwd(const T* dy, const T* x, const W* weight, const float* mean, const float* rstd,
                                 const T* add, T* dx, W* dweight, W* dbias, float* partials, int64_t rows, int hidden,
                                 cudaStream_t stream) {
  if (hidden <= 0 || hidden > kLayerNormMaxHidden) return cudaErrorInvalidValue;
  const bool want_params = dweight || dbias;
  if (rows == 0) {  // empty batch: parameter gradients are zero
    if (dweight) cudaMemsetAsync(dweight, 0, sizeof(W) * hidden, stream);
    if (dbias) cudaMemsetAsync(dbias, 0, sizeof(W) * hidden, stream);
    return cudaGetLastError();
  }
  const int64_t max_parts = layernorm_bwd_partial_rows(rows);
  float* part_g = want_params ? partials : nullptr;
  float* part_b = want_params ? partials + max_parts * hidden : nullptr;
  int64_t parts = 0;
  const bool vec = vectorizable<T, W>(dy, x, weight, nullptr, hidden) && is_aligned(dx, 16) &&
                   (!add || is_aligned(add, 16));
  cudaError_t err =
      vec ? bwd_dispatch<T, W, Vec16<T>::value>(dy, x, weight, mean, rstd, add, dx, part_g, part_b, rows, hidden,
                                                max_parts, &parts, stream)
          : bwd_dispatch<T, W, 1>(dy, x, weight, mean, rstd, add, dx, part_g, part_b, rows, hidden, max_parts,
                                  &parts, stream);
  if (err != cudaSuccess || !want_params) return err;
  layernorm_bwd_reduce_kernel<W><<<(hidden + 31) / 32, dim3(32, 16), 0, stream>>>(part_g, part_b, parts, hidden,
                                                                                  dweight, dbias);
  return cudaGetLastError();
}

#define LSMINI_INSTANTIATE_LN(T, W)                                                                          \
  template cudaError_t launch_layernorm_fwd<T, W>(const T*, const W*, const W*, T*, float*, float*, int64_t, \
                                                  int, float, cudaStream_t);                                 \
  template cudaError_t launch_layernorm_bwd<T, W>(const T*, const T*, const W*, const float*, const float*,  \
                                                  const T*, T*, W*, W*, float*, int64_t, int, cudaStream_t);

LSMINI_INSTANTIATE_LN(float, float)
LSMINI_INSTANTIATE_LN(__half, __half)
LSMINI_INSTANTIATE_LN(__half, float)
LSMINI_INSTANTIATE_LN(__nv_bfloat16, __nv_bfloat16)
LSMINI_INSTANTIATE_LN(__nv_bfloat16, float)

}  // namespace lsmini
