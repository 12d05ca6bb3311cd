/*
 * layernorm_bwd.cu — LayerNorm backward: dx (with an optional residual gradient added) and the fp32
 * partials of dγ/dβ per block, then the small kernel that sums them. The math, layout and work split
 * are described at the top of layernorm.cu.
 */
#include "layernorm.cuh"

namespace lsmini {
namespace {

// part_g/part_b: [gridDim.x, hidden] fp32, or null when neither dγ nor dβ is wanted.
template <typename T, typename W, int VEC, int VPT>
__global__ void __launch_bounds__(kBwdMaxThreads)
layernorm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const W* __restrict__ weight,
                     const float* __restrict__ mean, const float* __restrict__ rstd, const T* add, T* dx,
                     float* __restrict__ part_g, float* __restrict__ part_b, int64_t rows, int hidden) {
  wait_for_previous_kernel();  // before any access to global memory
  __shared__ float2 smem[32];
  extern __shared__ float fold[];  // [2][R][hidden] when R > 1 and partials are wanted
  const int nvec = hidden / VEC;
  const float inv_h = 1.f / hidden;
  // The scalar path's long rows (hidden > 8192 not a multiple of the vector width, or unaligned: a
  // rare fallback) keep their loops rolled, arrays in local memory: fully unrolled, their 32-64
  // elements per thread spill anyway and take most of this file's compile time.
  constexpr int kUnrollRow = (VEC == 1 && VPT > 16) ? 1 : VPT;

  float acc_g[VPT][VEC], acc_b[VPT][VEC];
#pragma unroll kUnrollRow
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc_g[k][j] = acc_b[k][j] = 0.f;

  // The loop bound is uniform over the block (group_sum2 has barriers); rows past the end idle.
  // Rows of ≤ 16 elements a thread load the next row's x/dy before this row's reduction, so that the loads
  // overlap it; long rows already keep enough bytes in flight and would run out of registers.
  // The kernel is bound by instruction issue. Where registers allow (16-bit vectors of short
  // rows), γ stays in fp32 registers over all the rows, and x̂ of the sums' pass is kept for dx: no reload
  // and unpack of γ a row, no second x̂. g = γ·dy costs one unpack and one multiply, so it is formed again
  // (keeping it as well would spill). The gain is largest at hidden 512-1024.
  constexpr bool kPrefetch = VPT * VEC <= 16;
  constexpr bool kKeep = kPrefetch && VEC == 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.y;
  Pack<T, VEC> xv[VPT], dv[VPT];
  float mu = 0.f, rs = 0.f;
  auto load_row = [&](int64_t row, Pack<T, VEC>(&xs)[VPT], Pack<T, VEC>(&ds)[VPT], float& m, float& r) {
    if (row >= rows) return;
    m = mean[row];
    r = rstd[row];
#pragma unroll kUnrollRow
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (c < nvec) {
        xs[k] = *reinterpret_cast<const Pack<T, VEC>*>(x + row * hidden + c * VEC);
        ds[k] = *reinterpret_cast<const Pack<T, VEC>*>(dy + row * hidden + c * VEC);
      }
    }
  };
  if constexpr (kPrefetch) load_row(int64_t(blockIdx.x) * blockDim.y + threadIdx.y, xv, dv, mu, rs);
  // γ of the thread's vectors in fp32 (kKeep).
  float wf[kKeep ? VPT : 1][VEC];
  if constexpr (kKeep) {
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (c < nvec) load_or<W, VEC>(weight, c, 1.f, wf[k]);
    }
  }
  // g = γ·dy and dy of the thread's k-th vector of the current row.
  auto grad_terms = [&](int k, int c, float(&g)[VEC], float(&df)[VEC]) {
    float w[VEC];
    if constexpr (kKeep) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[j] = wf[k][j];
    } else {
      load_or<W, VEC>(weight, c, 1.f, w);
    }
    unpack(dv[k], df);
#pragma unroll
    for (int j = 0; j < VEC; ++j) g[j] = df[j] * w[j];
  };
  // x̂ = (x − μ)·r of the thread's k-th vector of the current row.
  auto x_hat = [&](int k, float(&xh)[VEC]) {
    unpack(xv[k], xh);
#pragma unroll
    for (int j = 0; j < VEC; ++j) xh[j] = (xh[j] - mu) * rs;
  };

  for (int64_t base = int64_t(blockIdx.x) * blockDim.y; base < rows; base += stride) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < rows;
    Pack<T, VEC> xn[VPT], dn[VPT];
    float mu_n = 0.f, rs_n = 0.f;
    if constexpr (kPrefetch) {
      load_row(row + stride, xn, dn, mu_n, rs_n);
    } else {
      load_row(row, xv, dv, mu, rs);
    }

    float2 s = make_float2(0.f, 0.f);
    float xh[kKeep ? VPT : 1][VEC];  // x̂, kept for dx (kKeep)
#pragma unroll kUnrollRow
    for (int k = 0; k < VPT; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (valid && c < nvec) {
        float g[VEC], df[VEC];
        float(&xk)[VEC] = xh[kKeep ? k : 0];
        x_hat(k, xk);
        grad_terms(k, c, g, df);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          s.x += g[j];
          s.y += g[j] * xk[j];
          acc_g[k][j] += df[j] * xk[j];
          acc_b[k][j] += df[j];
        }
      }
    }
    s = group_sum2(s, smem);
    if (valid) {
      // dx = r·(g − a − x̂·b) + add, with a = mean(g), b = mean(g·x̂).
      const float c_a = -rs * s.x * inv_h, c_b = -rs * s.y * inv_h;
      T* dxr = dx + row * hidden;
      const T* addr = add + row * hidden;
#pragma unroll kUnrollRow
      for (int k = 0; k < VPT; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        if (c < nvec) {
          float af[VEC], g[VEC], df[VEC];
          float(&xk)[VEC] = xh[kKeep ? k : 0];
          if constexpr (!kKeep) x_hat(k, xk);
          grad_terms(k, c, g, df);
          load_or<T, VEC>(add ? addr : nullptr, c, 0.f, af);
#pragma unroll
          for (int j = 0; j < VEC; ++j) af[j] += fmaf(rs, g[j], fmaf(xk[j], c_b, c_a));
          store_pack<T, VEC>(dxr + c * VEC, af);
        }
      }
    }
    if constexpr (kPrefetch) {
#pragma unroll kUnrollRow
      for (int k = 0; k < VPT; ++k) {
        xv[k] = xn[k];
        dv[k] = dn[k];
      }
      mu = mu_n;
      rs = rs_n;
    }
  }

  if (part_g == nullptr) return;
  allow_dependent_launch();  // what is left is the partial rows: the reduce kernel may be scheduled
  // The thread's sums go straight into the block's partial row when the block holds one row, else into
  // shared memory, to be folded over its R rows.
  const int R = blockDim.y;
  float* pg = part_g + int64_t(blockIdx.x) * hidden;
  float* pb = part_b + int64_t(blockIdx.x) * hidden;
  float* sg = R == 1 ? pg : fold + threadIdx.y * hidden;
  float* sb = R == 1 ? pb : fold + (R + threadIdx.y) * hidden;
#pragma unroll kUnrollRow
  for (int k = 0; k < VPT; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nvec)
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        sg[c * VEC + j] = acc_g[k][j];
        sb[c * VEC + j] = acc_b[k][j];
      }
  }
  if (R == 1) return;
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
  begin_dependent_kernel();  // the backward kernel, which wrote the partials
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

template <typename T, typename W, int VEC>
cudaError_t bwd_dispatch(const T* dy, const T* x, const W* w, const float* mean, const float* rstd, const T* add,
                         T* dx, float* part_g, float* part_b, int64_t rows, int hidden, int64_t max_parts,
                         int64_t* parts_used, cudaStream_t stream) {
  const RowGroups cfg = row_groups(hidden, VEC, kBwdMaxThreads, 16);
  const dim3 block(cfg.G, cfg.R);
  const size_t fold_bytes = (part_g && cfg.R > 1) ? size_t(2) * cfg.R * hidden * sizeof(float) : 0;
  return with_vpt<1, (VEC == 1 ? 64 : 64 / VEC)>(cfg.vpt, [&](auto vpt) {
    auto kernel = layernorm_bwd_kernel<T, W, VEC, decltype(vpt)::value>;
    int per_sm = 0;
    max_active_blocks(kernel, cfg.G * cfg.R, fold_bytes, &per_sm);
    int64_t grid = int64_t(sm_count()) * (per_sm > 0 ? per_sm : 1);
    grid = grid < max_parts ? grid : max_parts;
    const int64_t need = (rows + cfg.R - 1) / cfg.R;
    grid = grid < need ? grid : need;
    *parts_used = grid;
    return launch_dependent(kernel, dim3(unsigned(grid)), block, fold_bytes, stream, dy, x, w, mean, rstd, add, dx,
                            part_g, part_b, rows, hidden);
  });
}

}  // namespace

int64_t layernorm_bwd_partial_rows(int64_t rows) {
  const int64_t cap = int64_t(8) * sm_count();  // ≥ resident blocks: G·R ≥ 256 threads, ≤ 2048 per SM
  return rows < cap ? rows : cap;
}

template <typename T, typename W>
cudaError_t launch_layernorm_bwd(const T* dy, const T* x, const W* weight, const float* mean, const float* rstd,
                                 const T* add, T* dx, W* dweight, W* dbias, float* partials, int64_t rows, int hidden,
                                 ColumnSums* sums, cudaStream_t stream) {
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
  if (sums != nullptr) {  // the reduce kernel's sums, in its order, queued (column_sums.h)
    const bool queued = (!dweight || queue_column_sum(sums, part_g, parts, hidden, dweight)) &&
                        (!dbias || queue_column_sum(sums, part_b, parts, hidden, dbias));
    return queued ? cudaSuccess : cudaErrorInvalidValue;
  }
  return launch_dependent(layernorm_bwd_reduce_kernel<W>, dim3((hidden + 31) / 32), dim3(32, 16), 0, stream,
                          static_cast<const float*>(part_g), static_cast<const float*>(part_b), parts, hidden, dweight,
                          dbias);
}

#define LSMINI_INSTANTIATE_LN_BWD(T, W)                                                                     \
  template cudaError_t launch_layernorm_bwd<T, W>(const T*, const T*, const W*, const float*, const float*, \
                                                  const T*, T*, W*, W*, float*, int64_t, int, ColumnSums*,   \
                                                  cudaStream_t);
LSMINI_FOR_LN_TYPES(LSMINI_INSTANTIATE_LN_BWD)

}  // namespace lsmini
