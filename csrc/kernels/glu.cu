/*
 * glu.cu — out = dropout(act(gate)·up), the gated FFN activation (SwiGLU: act = silu; GeGLU: act = gelu),
 * and its backward
 *
 *   forward : out[r, c]       = keep(r, c) · act(gate[r, c]) · up[r, c] / (1 − p)
 *   backward: d[r, c]         = keep(r, c) · grad_out[r, c] / (1 − p)
 *             grad_up[r, c]   = d · act(gate[r, c])
 *             grad_gate[r, c] = d · up[r, c] · act'(gate[r, c])
 *   act: silu, gelu (exact), gelu_tanh — activations.cuh, which also gives their derivatives.
 *
 * The backward recomputes act and act' from the saved gate and up (the inputs, needed anyway) instead of
 * saving act(gate): nothing but the inputs stays alive between the passes.
 *
 * Layout: gate and up are [rows, cols] with row stride in_stride: cols for two tensors of their own, 2·cols
 * for the two halves of one [rows, 2·cols] tensor, the output of one GEMM (gate the first half, up the
 * second). out and grad_out are contiguous [rows, cols]; grad_gate and grad_up are written in gate's and
 * up's layout, so the fused form's gradient is again one [rows, 2·cols] tensor. Math in fp32, one rounding
 * per stored value.
 *
 * Dropout: common.cuh's Philox convention with the flat index i = r · cols + c of out, keyed by (seed,
 * offset); the backward regenerates the same keep bits. p == 0 compiles to a variant with no RNG; p == 1
 * keeps nothing (scale 0). The kernels resolve their PhiloxArgs on entry, so under CUDA graph capture they
 * read the (seed, offset) that torch sets before each replay.
 *
 * Work split (column_partials.cuh's tiling, no column sums here): a thread owns V adjacent columns (16
 * bytes of T when cols % V == 0 and the pointers are 16-byte aligned, else 1) of one row group's rows; the
 * grid has a block for every tile of columns and group of rows (up to 65535 groups, then the blocks walk on
 * down the rows), so blocks start as others end and keep memory busy while they run the activation.
 *
 * Napkin math (H100, bf16, 32768 × 4096 outputs = 256 MiB a tensor): forward moves 3 tensors, backward 5
 * (grad_out, gate, up in; grad_gate, grad_up out) — 0.27 and 0.45 ms at ≈ 3 TB/s. Per element: one
 * exponential and ≈ 8 other operations for silu (gelu ≈ 15), 1/8 of a Philox call (≈ 12 operations an
 * element) with dropout: below the ≈ 30 operations an element the memory time allows.
 */
#include "glu.h"

#include <algorithm>
#include <type_traits>

#include "activations.cuh"
#include "column_partials.cuh"
#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kGluThreads = 256;

template <int ACT>
__device__ __forceinline__ float glu_act(float v) {
  if (ACT == int(GluAct::Silu)) return silu(v);
  if (ACT == int(GluAct::Gelu)) return gelu(v);
  return gelu_tanh(v);
}

template <int ACT>
__device__ __forceinline__ float glu_act_and_grad(float v, float* grad) {
  if (ACT == int(GluAct::Silu)) return silu_and_grad(v, grad);
  if (ACT == int(GluAct::Gelu)) return gelu_and_grad(v, grad);
  return gelu_tanh_and_grad(v, grad);
}

// Calls f(std::integral_constant<int, act>{}) for a runtime activation id.
template <typename F>
cudaError_t with_glu_act(int act, F&& f) {
  switch (act) {
    case int(GluAct::Silu): return f(std::integral_constant<int, int(GluAct::Silu)>{});
    case int(GluAct::Gelu): return f(std::integral_constant<int, int(GluAct::Gelu)>{});
    case int(GluAct::GeluTanh): return f(std::integral_constant<int, int(GluAct::GeluTanh)>{});
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
template <typename T, int V, int ACT, bool DROPOUT>
__global__ void __launch_bounds__(kGluThreads)
    glu_fwd_kernel(const T* __restrict__ gate, const T* __restrict__ up, int64_t in_stride, T* __restrict__ out,
                   int64_t rows, int64_t cols, uint32_t threshold, float scale, PhiloxArgs rng) {
  begin_dependent_kernel();
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(rng) : PhiloxSeedOffset{0, 0};
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  const int64_t step = int64_t(gridDim.y) * blockDim.y;
  int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  if (col >= cols) return;  // no block-wide sync follows
  for (; r < rows; r += step) {
    float g[V], u[V];
    unpack(ld_pack<T, V>(gate + r * in_stride + col), g);
    unpack(ld_pack<T, V>(up + r * in_stride + col), u);
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = glu_act<ACT>(g[k]) * u[k];
    const int64_t i = r * cols + col;
    // V ∈ {4, 8} has i % V == 0 (cols % V == 0, col % V == 0): whole or half Philox groups.
    if (DROPOUT) dropout_apply<V>(g, philox.seed, philox.offset, uint64_t(i), threshold, scale);
    store_pack<T, V>(out + i, g);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------
template <typename T, int V, int ACT, bool DROPOUT>
__global__ void __launch_bounds__(kGluThreads)
    glu_bwd_kernel(const T* __restrict__ grad_out, const T* __restrict__ gate, const T* __restrict__ up,
                   int64_t in_stride, T* __restrict__ grad_gate, T* __restrict__ grad_up, int64_t rows, int64_t cols,
                   uint32_t threshold, float scale, PhiloxArgs rng) {
  begin_dependent_kernel();
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  const int64_t step = int64_t(gridDim.y) * blockDim.y;
  int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y;
  if (col >= cols || r >= rows) return;
  with_philox<DROPOUT>(rng, [&](const PhiloxSeedOffset philox) {
    for (; r < rows; r += step) {
      float d[V], g[V], u[V];
      unpack(ld_pack<T, V>(grad_out + r * cols + col), d);
      unpack(ld_pack<T, V>(gate + r * in_stride + col), g);
      unpack(ld_pack<T, V>(up + r * in_stride + col), u);
      if (DROPOUT) dropout_apply<V>(d, philox.seed, philox.offset, uint64_t(r * cols + col), threshold, scale);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        float da;
        const float a = glu_act_and_grad<ACT>(g[k], &da);
        g[k] = d[k] * u[k] * da;  // grad_gate
        u[k] = d[k] * a;          // grad_up
      }
      const int64_t i = r * in_stride + col;
      store_pack<T, V>(grad_gate + i, g);
      store_pack<T, V>(grad_up + i, u);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Launch: a block for every tile of columns and group of rows (up to 65535 groups).
// ---------------------------------------------------------------------------------------------
template <typename Kernel, typename... Args>
cudaError_t launch_grid(Kernel kernel, int64_t rows, int64_t nvec, cudaStream_t stream, Args... args) {
  Tiling t = column_tiling(rows, nvec, kGluThreads);
  t.slabs = std::min<int64_t>((rows + t.by - 1) / t.by, 65535);
  return launch_dependent(kernel, dim3(unsigned(t.tiles_x), unsigned(t.slabs)), dim3(t.bx, t.by), 0, stream, args...);
}

// Calls f(V, ACT, DROPOUT) as compile-time constants for the runtime vector width, activation and rate.
template <typename T, typename F>
cudaError_t with_variant(bool vec, int act, float p, F&& f) {
  using VecW = std::integral_constant<int, Vec16<T>::value>;
  using One = std::integral_constant<int, 1>;
  return with_glu_act(act, [&](auto a) -> cudaError_t {
    if (vec) return p > 0.f ? f(VecW{}, a, std::true_type{}) : f(VecW{}, a, std::false_type{});
    return p > 0.f ? f(One{}, a, std::true_type{}) : f(One{}, a, std::false_type{});
  });
}

}  // namespace

template <typename T>
cudaError_t launch_glu_fwd(const T* gate, const T* up, int64_t in_stride, T* out, int64_t rows, int64_t cols,
                           int act, float p, PhiloxArgs rng, cudaStream_t stream) {
  if (act < 0 || act >= kGluActCount || in_stride < cols) return cudaErrorInvalidValue;
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  constexpr int VW = Vec16<T>::value;
  const bool vec = cols % VW == 0 && in_stride % VW == 0 && is_aligned(gate, 16) && is_aligned(up, 16) &&
                   is_aligned(out, 16);
  uint32_t threshold;
  float scale;
  dropout_params(p, &threshold, &scale);
  return with_variant<T>(vec, act, p, [&](auto v, auto a, auto d) {
    constexpr int V = decltype(v)::value;
    return launch_grid(glu_fwd_kernel<T, V, decltype(a)::value, decltype(d)::value>, rows, cols / V, stream, gate, up,
                       in_stride, out, rows, cols, threshold, scale, rng);
  });
}

template <typename T>
cudaError_t launch_glu_bwd(const T* grad_out, const T* gate, const T* up, int64_t in_stride, T* grad_gate,
                           T* grad_up, int64_t rows, int64_t cols, int act, float p, PhiloxArgs rng,
                           cudaStream_t stream) {
  if (act < 0 || act >= kGluActCount || in_stride < cols) return cudaErrorInvalidValue;
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  constexpr int VW = Vec16<T>::value;
  const bool vec = cols % VW == 0 && in_stride % VW == 0 && is_aligned(grad_out, 16) && is_aligned(gate, 16) &&
                   is_aligned(up, 16) && is_aligned(grad_gate, 16) && is_aligned(grad_up, 16);
  uint32_t threshold;
  float scale;
  dropout_params(p, &threshold, &scale);
  return with_variant<T>(vec, act, p, [&](auto v, auto a, auto d) {
    constexpr int V = decltype(v)::value;
    return launch_grid(glu_bwd_kernel<T, V, decltype(a)::value, decltype(d)::value>, rows, cols / V, stream,
                       grad_out, gate, up, in_stride, grad_gate, grad_up, rows, cols, threshold, scale, rng);
  });
}

#define LSMINI_INSTANTIATE_GLU(T)                                                                               \
  template cudaError_t launch_glu_fwd<T>(const T*, const T*, int64_t, T*, int64_t, int64_t, int, float,        \
                                         PhiloxArgs, cudaStream_t);                                            \
  template cudaError_t launch_glu_bwd<T>(const T*, const T*, const T*, int64_t, T*, T*, int64_t, int64_t, int, \
                                         float, PhiloxArgs, cudaStream_t);
LSMINI_INSTANTIATE_GLU(float)
LSMINI_INSTANTIATE_GLU(__half)
LSMINI_INSTANTIATE_GLU(__nv_bfloat16)
#undef LSMINI_INSTANTIATE_GLU

}  // namespace lsmini
