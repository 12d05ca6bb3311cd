/*
 * rms_norm_shapes.cu — RMSNorm forward and backward (bf16 rows, bf16 weight, 32768 rows, hidden 512-4096)
 * beside a device-to-device copy of the same bytes, and the backward in other kernel shapes beside lsmini's
 * launch_rms_norm_bwd, in one process. Not part of the build: a measurement to steer the kernels' changes
 * (docs/performance-notes.md says what such measurements decided).
 *
 *   nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
 *        -Icsrc/kernels benchmarks/probes/rms_norm_shapes.cu csrc/kernels/rms_norm.cu \
 *        csrc/kernels/rms_norm_bwd.cu csrc/kernels/column_sums.cu -o /tmp/rms_shapes
 *   /tmp/rms_shapes
 *
 * Times, each the median of 30: "single" is one call after a spin kernel has held the GPU long enough for the
 * host to queue it (what bench_kernels.py measures); "b2b" is 50 back-to-back calls over 50. Percentages are
 * of a 2 GiB device-to-device copy's bandwidth (bytes read + written), as bench_kernels.py reports them.
 * Bytes: forward x read, y written; backward x and dy read, dx written (rstd, the weight and the dweight
 * partials not counted).
 *
 * Backward shapes:
 *   lsmini      launch_rms_norm_bwd as built (its row shapes by row size, partials + column-sum kernel);
 *   warp V P    one warp a row, V vectors of 16 bytes a thread (hidden = 32·8·V), 8 rows a block, one
 *               resident wave walking the rows grid-stride with no block barrier in the walk; P: the next
 *               row loaded before this row's reduction; the same partials and column sums.
 *   bwd N warps a row, V vectors: rows of N·32·8·V elements held by N warps, which meet at a named barrier of
 *               their own row (not the block's) for the row's sum, the same walk, weight and partials (one
 *               kernel, bwd_rows_kernel, holds both shapes).
 * Forward shapes: "fwd warp V prefetch" and "fwd N warps a row, V vectors", the backward's row shapes and walk
 * for the forward (fwd_rows_kernel), beside lsmini's launch_rms_norm_fwd.
 */
#include "column_partials.cuh"
#include "rms_norm.cuh"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

using namespace lsmini;
using T = __nv_bfloat16;

#define CK(...)                                                                    \
  do {                                                                             \
    cudaError_t e_ = (__VA_ARGS__);                                                        \
    if (e_ != cudaSuccess) {                                                       \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #__VA_ARGS__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

__global__ void spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// The backward with NW warps a row, 256 / (32·NW) rows a block, VPT vectors of 8 a thread (hidden = 32·NW·8·VPT):
// each row's warps walk their rows grid-stride with no block barrier (NW = 1: none at all; NW > 1: the barrier
// of their own row, rms_norm.cuh's row_warps_sum), the weight in registers; PREFETCH: the next row loaded before
// this row's sum. Each block folds its rows' dweight sums into one partial row; sum_column_partials sums those.
template <int NW, int VPT, bool PREFETCH>
__global__ void __launch_bounds__(256) bwd_rows_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                                       const T* __restrict__ weight, const float* __restrict__ rstd,
                                                       T* __restrict__ dx, float* __restrict__ partials,
                                                       int64_t rows, int hidden) {
  constexpr int VEC = 8, G = 32 * NW, R = 256 / G;
  static_assert(NW == 1 || R <= 4, "named barriers 1-4: one a row");
  extern __shared__ float fold[];  // [R][hidden]
  __shared__ float slot[2][R][NW];
  const float inv_h = 1.f / hidden;
  float acc[VPT][VEC] = {};
  float w[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k) load_pack<T, VEC>(weight + (threadIdx.x + k * G) * VEC, w[k]);
  Pack<T, VEC> xv[VPT], dv[VPT];
  float r = 0.f;
  auto load_row = [&](int64_t row, Pack<T, VEC>(&xs)[VPT], Pack<T, VEC>(&ds)[VPT], float& rs) {
    if (row >= rows) return;
    rs = rstd[row];
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t i = row * hidden + (threadIdx.x + k * G) * VEC;
      xs[k] = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
      ds[k] = *reinterpret_cast<const Pack<T, VEC>*>(dy + i);
    }
  };
  const int64_t stride = int64_t(gridDim.x) * R;
  int64_t row = int64_t(blockIdx.x) * R + threadIdx.y;
  if constexpr (PREFETCH) load_row(row, xv, dv, r);
  for (int parity = 0; row < rows; row += stride, parity ^= 1) {
    Pack<T, VEC> xn[VPT], dn[VPT];
    float rn = 0.f;
    if constexpr (PREFETCH) {
      load_row(row + stride, xn, dn, rn);
    } else {
      load_row(row, xv, dv, r);
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float xf[VEC], df[VEC];
      unpack(xv[k], xf);
      unpack(dv[k], df);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float xh = xf[j] * r;
        s += df[j] * w[k][j] * xh;
        acc[k][j] += df[j] * xh;
      }
    }
    s = warp_sum(s);
    if constexpr (NW > 1) s = row_warps_sum<NW>(s, slot[parity]);
    const float c_b = -r * s * inv_h;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float xf[VEC], df[VEC], out[VEC];
      unpack(xv[k], xf);
      unpack(dv[k], df);
#pragma unroll
      for (int j = 0; j < VEC; ++j) out[j] = fmaf(r, df[j] * w[k][j], xf[j] * r * c_b);
      store_pack<T, VEC>(dx + row * hidden + (threadIdx.x + k * G) * VEC, out);
    }
    if constexpr (PREFETCH) {
#pragma unroll
      for (int k = 0; k < VPT; ++k) {
        xv[k] = xn[k];
        dv[k] = dn[k];
      }
      r = rn;
    }
  }
  allow_dependent_launch();
  float* dst = fold + threadIdx.y * hidden;
#pragma unroll
  for (int k = 0; k < VPT; ++k)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dst[(threadIdx.x + k * G) * VEC + j] = acc[k][j];
  __syncthreads();
  float* prow = partials + int64_t(blockIdx.x) * hidden;
  for (int col = threadIdx.y * G + threadIdx.x; col < hidden; col += 256) {
    float t = 0.f;
    for (int y = 0; y < R; ++y) t += fold[y * hidden + col];
    prow[col] = t;
  }
}

template <int NW, int VPT, bool PREFETCH>
void launch_rows(const T* dy, const T* x, const T* w, const float* rstd, T* dx, T* dw, float* partials, int64_t rows,
                 int hidden, cudaStream_t s) {
  constexpr int G = 32 * NW, R = 256 / G;
  auto kernel = bwd_rows_kernel<NW, VPT, PREFETCH>;
  const size_t smem = size_t(R) * hidden * sizeof(float);
  static int per_sm = 0;  // per instantiation, once: the timed calls are launches only
  if (per_sm == 0) {
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem));
    per_sm = std::max(per_sm, 1);
  }
  const int64_t grid = std::min<int64_t>(int64_t(sm_count()) * per_sm, rms_norm_bwd_partial_rows(rows));
  kernel<<<unsigned(grid), dim3(G, R), smem, s>>>(dy, x, w, rstd, dx, partials, rows, hidden);
  CK(cudaGetLastError());
  CK(sum_column_partials<T>(partials, grid, hidden, dw, s));
}

// The forward in the backward's row shapes: NW warps a row (row_warps_sum's barrier when NW > 1), 256 / (32·NW)
// rows a block, one resident wave walking the rows grid-stride, the next row's x loaded before this row's sum, the
// weight held in registers.
template <int NW, int VPT>
__global__ void __launch_bounds__(256) fwd_rows_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                                                       T* __restrict__ y, float* __restrict__ rstd_out, int64_t rows,
                                                       int hidden, float eps) {
  constexpr int VEC = 8, G = 32 * NW, R = 256 / G;
  static_assert(NW == 1 || R <= 4, "named barriers 1-4: one a row");
  __shared__ float slot[2][R][NW];
  float w[VPT][VEC];
#pragma unroll
  for (int k = 0; k < VPT; ++k) load_pack<T, VEC>(weight + (threadIdx.x + k * G) * VEC, w[k]);
  auto load_row = [&](int64_t r, Pack<T, VEC>(&xs)[VPT]) {
    if (r >= rows) return;
#pragma unroll
    for (int k = 0; k < VPT; ++k)
      xs[k] = *reinterpret_cast<const Pack<T, VEC>*>(x + r * hidden + (threadIdx.x + k * G) * VEC);
  };
  const int64_t stride = int64_t(gridDim.x) * R;
  int64_t row = int64_t(blockIdx.x) * R + threadIdx.y;
  Pack<T, VEC> xv[VPT];
  load_row(row, xv);
  for (int parity = 0; row < rows; row += stride, parity ^= 1) {
    Pack<T, VEC> xn[VPT];
    load_row(row + stride, xn);
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float f[VEC];
      unpack(xv[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) ss += f[j] * f[j];
    }
    ss = warp_sum(ss);
    if constexpr (NW > 1) ss = row_warps_sum<NW>(ss, slot[parity]);
    const float r = rsqrtf(ss * (1.f / hidden) + eps);
    if (threadIdx.x == 0) rstd_out[row] = r;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      float f[VEC];
      unpack(xv[k], f);
#pragma unroll
      for (int j = 0; j < VEC; ++j) f[j] = f[j] * r * w[k][j];
      store_pack<T, VEC>(y + row * hidden + (threadIdx.x + k * G) * VEC, f);
      xv[k] = xn[k];
    }
  }
}

template <int NW, int VPT>
void launch_fwd_rows(const T* x, const T* w, T* y, float* rstd, int64_t rows, int hidden, cudaStream_t s) {
  constexpr int G = 32 * NW, R = 256 / G;
  auto kernel = fwd_rows_kernel<NW, VPT>;
  static int per_sm = 0;  // per instantiation, once
  if (per_sm == 0) {
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, 0));
    per_sm = std::max(per_sm, 1);
  }
  const int64_t grid = std::min<int64_t>(int64_t(sm_count()) * per_sm, (rows + R - 1) / R);
  kernel<<<unsigned(grid), dim3(G, R), 0, s>>>(x, w, y, rstd, rows, hidden, 1e-6f);
  CK(cudaGetLastError());
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaStream_t s;
  cudaEvent_t a, b;
  Timer() {
    CK(cudaStreamCreate(&s));
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
  }
  float single(const std::function<void()>& f) {
    for (int i = 0; i < 5; ++i) f();
    std::vector<float> t;
    for (int i = 0; i < 30; ++i) {
      spin<<<1, 1, 0, s>>>(200000);  // ~100 µs
      CK(cudaEventRecord(a, s));
      f();
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms);
    }
    return median(t);
  }
  float b2b(const std::function<void()>& f) {
    std::vector<float> t;
    for (int rep = 0; rep < 7; ++rep) {
      CK(cudaEventRecord(a, s));
      for (int i = 0; i < 50; ++i) f();
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms = 0;
      CK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms / 50);
    }
    return median(t);
  }
};

std::vector<float> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

float max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

__global__ void fill(T* p, size_t n, uint32_t seed, float scale, float shift) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = __float2bfloat16(shift + scale * (float(h & 0xffff) / 65536.f - 0.5f));
  }
}

int main() {
  const int64_t rows = 32768;
  Timer tm;
  cudaStream_t s = tm.s;
  const size_t big = size_t(2) << 30;
  const double copy_gbs = [&] {
    void *a, *b;
    CK(cudaMalloc(&a, big));
    CK(cudaMalloc(&b, big));
    const float ms = tm.single([&] { CK(cudaMemcpyAsync(b, a, big, cudaMemcpyDeviceToDevice, s)); });
    CK(cudaFree(a));
    CK(cudaFree(b));
    return 2.0 * big / ms / 1e6;
  }();
  std::printf("copy 2 GiB: %.0f GB/s (read + written)\n", copy_gbs);
  auto pct = [&](double bytes, float ms) { return 100.0 * bytes / ms / 1e6 / copy_gbs; };
  std::printf("%-34s %10s %8s %10s %8s  %s\n", "row", "single ms", "%copy", "b2b ms", "%copy", "check");

  for (int hidden : {512, 768, 1024, 2048, 4096}) {
    const size_t n = size_t(rows) * hidden;
    T *x, *dy, *y, *dx, *dx2, *w, *dw, *dw2, *c0, *c1;
    float *rstd, *partials;
    CK(cudaMalloc(&x, n * sizeof(T)));
    CK(cudaMalloc(&dy, n * sizeof(T)));
    CK(cudaMalloc(&y, n * sizeof(T)));
    CK(cudaMalloc(&dx, n * sizeof(T)));
    CK(cudaMalloc(&dx2, n * sizeof(T)));
    CK(cudaMalloc(&c0, 2 * n * sizeof(T)));
    CK(cudaMalloc(&c1, 2 * n * sizeof(T)));
    CK(cudaMalloc(&w, hidden * sizeof(T)));
    CK(cudaMalloc(&dw, hidden * sizeof(T)));
    CK(cudaMalloc(&dw2, hidden * sizeof(T)));
    CK(cudaMalloc(&rstd, rows * sizeof(float)));
    CK(cudaMalloc(&partials, rms_norm_bwd_partial_rows(rows) * hidden * sizeof(float)));
    fill<<<1024, 256, 0, s>>>(x, n, 1, 4.f, 0.f);
    fill<<<1024, 256, 0, s>>>(dy, n, 2, 2.f, 0.f);
    fill<<<4, 256, 0, s>>>(w, hidden, 3, 0.2f, 1.f);
    const double sz = double(n) * sizeof(T);
    char name[64];
    auto row = [&](const char* label, double bytes, const std::function<void()>& f, const char* check) {
      const float a = tm.single(f), b = tm.b2b(f);
      std::snprintf(name, sizeof(name), "%s h%d", label, hidden);
      std::printf("%-34s %10.4f %8.1f %10.4f %8.1f  %s\n", name, a, pct(bytes, a), b, pct(bytes, b), check);
    };
    row("copy (fwd bytes)", 2 * sz, [&] { CK(cudaMemcpyAsync(c1, c0, n * sizeof(T), cudaMemcpyDeviceToDevice, s)); },
        "");
    row("copy (bwd bytes)", 3 * sz,
        [&] { CK(cudaMemcpyAsync(c1, c0, n * sizeof(T) * 3 / 2, cudaMemcpyDeviceToDevice, s)); }, "");
    row("fwd lsmini", 2 * sz,
        [&] { CK(launch_rms_norm_fwd<T, T>(x, nullptr, w, nullptr, y, rstd, rows, hidden, 1e-6f, s)); }, "");
    {
      CK(launch_rms_norm_fwd<T, T>(x, nullptr, w, nullptr, y, rstd, rows, hidden, 1e-6f, s));
      CK(cudaStreamSynchronize(s));
      const std::vector<float> ref_y = to_host(y, n);
      auto fwd = [&](auto nw, auto v) {  // NW warps a row, V vectors a thread: hidden = NW·256·V
        constexpr int NW = decltype(nw)::value, V = decltype(v)::value;
        auto f = [&] { launch_fwd_rows<NW, V>(x, w, dx2, rstd, rows, hidden, s); };
        f();
        CK(cudaStreamSynchronize(s));
        char check[64], label[40];
        std::snprintf(check, sizeof(check), "max|d y| %.3g", max_diff(to_host(dx2, n), ref_y));
        if (NW == 1) {
          std::snprintf(label, sizeof(label), "fwd warp %d prefetch", V);
        } else {
          std::snprintf(label, sizeof(label), "fwd %d warps a row, %d vectors", NW, V);
        }
        row(label, 2 * sz, f, check);
      };
      using J1 = std::integral_constant<int, 1>;
      using J2 = std::integral_constant<int, 2>;
      using J3 = std::integral_constant<int, 3>;
      using J4 = std::integral_constant<int, 4>;
      using J8 = std::integral_constant<int, 8>;
      switch (hidden) {
        case 512: fwd(J1{}, J2{}); fwd(J2{}, J1{}); break;
        case 768: fwd(J1{}, J3{}); break;
        case 1024: fwd(J1{}, J4{}); fwd(J2{}, J2{}); fwd(J4{}, J1{}); break;
        case 2048: fwd(J1{}, J8{}); fwd(J2{}, J4{}); fwd(J4{}, J2{}); break;
        case 4096: fwd(J4{}, J4{}); break;
      }
    }
    auto ours = [&] {
      CK(launch_rms_norm_bwd<T, T>(dy, x, w, rstd, nullptr, dx, dw, partials, rows, hidden, nullptr, s));
    };
    row("bwd lsmini", 3 * sz, ours, "");
    row("bwd lsmini no dw", 3 * sz, [&] {
      CK(launch_rms_norm_bwd<T, T>(dy, x, w, rstd, nullptr, dx, nullptr, partials, rows, hidden, nullptr, s));
    }, "");
    ours();
    CK(cudaStreamSynchronize(s));
    const std::vector<float> ref_dx = to_host(dx, n), ref_dw = to_host(dw, hidden);
    auto variant = [&](const char* label, const std::function<void()>& f) {
      CK(cudaMemset(dx2, 0, n * sizeof(T)));
      f();
      CK(cudaStreamSynchronize(s));
      char check[96];
      std::snprintf(check, sizeof(check), "max|d dx| %.3g max|d dw| %.3g", max_diff(to_host(dx2, n), ref_dx),
                    max_diff(to_host(dw2, hidden), ref_dw));
      row(label, 3 * sz, f, check);
    };
    const int vpt = hidden / 256;
    auto warp = [&](auto v, auto p) {
      constexpr int V = decltype(v)::value;
      constexpr bool P = decltype(p)::value;
      char label[32];
      std::snprintf(label, sizeof(label), "bwd warp %d%s", V, P ? " prefetch" : "");
      variant(label, [&] { launch_rows<1, V, P>(dy, x, w, rstd, dx2, dw2, partials, rows, hidden, s); });
    };
    using F = std::false_type;
    using Tr = std::true_type;
    switch (vpt) {
      case 2: warp(std::integral_constant<int, 2>{}, F{}); warp(std::integral_constant<int, 2>{}, Tr{}); break;
      case 3: warp(std::integral_constant<int, 3>{}, F{}); warp(std::integral_constant<int, 3>{}, Tr{}); break;
      case 4: warp(std::integral_constant<int, 4>{}, F{}); warp(std::integral_constant<int, 4>{}, Tr{}); break;
      case 8: warp(std::integral_constant<int, 8>{}, F{}); break;
    }
    // NW warps a row at 4 vectors a thread (2048: 2 warps, 4096: 4), 2 vectors (1024: 2 warps, 2048: 4) and one
    // vector (512: 2 warps, 1024: 4)
    auto group = [&](auto nw, auto v) {
      constexpr int NW = decltype(nw)::value, V = decltype(v)::value;
      char label[40];
      std::snprintf(label, sizeof(label), "bwd %d warps a row, %d vectors", NW, V);
      variant(label, [&] { launch_rows<NW, V, true>(dy, x, w, rstd, dx2, dw2, partials, rows, hidden, s); });
    };
    using I1 = std::integral_constant<int, 1>;
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    if (hidden == 512) group(I2{}, I1{});
    if (hidden == 1024) {
      group(I2{}, I2{});
      group(I4{}, I1{});
    }
    if (hidden == 2048) {
      group(I2{}, I4{});
      group(I4{}, I2{});
    }
    if (hidden == 4096) group(I4{}, I4{});
    for (void* p : {(void*)x, (void*)dy, (void*)y, (void*)dx, (void*)dx2, (void*)c0, (void*)c1, (void*)w, (void*)dw,
                    (void*)dw2, (void*)rstd, (void*)partials})
      CK(cudaFree(p));
  }
  return 0;
}
