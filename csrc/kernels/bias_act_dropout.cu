/*
 * bias_act_dropout.cu — out = dropout(act(x + bias)), and its backward
 *
 *   forward : out[r, c]    = keep(r, c) · act(x[r, c] + bias[c]) / (1 − p)
 *   backward: grad_x[r, c] = keep(r, c) · grad_out[r, c] / (1 − p) · act'(x[r, c] + bias[c])
 *             grad_bias[c] = Σ_r grad_x[r, c]
 *   act: relu; gelu (exact): v · Φ(v) = ½v(1 + erf(v/√2)); gelu_tanh: ½v(1 + tanh(√(2/π)(v + 0.044715 v³))).
 *
 * The backward recomputes v = x + bias and act'(v) from the saved input instead of saving act(v):
 * the input is needed anyway for act', so this keeps one [rows, hidden] tensor alive instead of two.
 * For relu it can take the output instead (from_output): out > 0 exactly where the element was kept
 * and relu' = 1, so grad_x = grad_out / (1 − p) there and 0 elsewhere — no mask regeneration, and a
 * caller that keeps the output (the next GEMM's operand) needs neither the input nor a recompute.
 *
 * Layout: x, out, grad_out, grad_x are row-major [rows, hidden]; bias is [hidden] in T or fp32, or
 * absent. Math in fp32, one rounding per stored value. out may be x and grad_x may be grad_out or x
 * (in place: a thread reads each of its elements before it writes it, and no other thread touches
 * them), so those pointers are not __restrict__.
 *
 * Dropout: common.cuh's Philox convention with the flat element index i = r · hidden + c, keyed by
 * (seed, offset); the backward regenerates the same keep bits. p == 0 compiles to a variant with no
 * RNG at all; p == 1 keeps nothing (scale 0). Each kernel resolves its PhiloxArgs once on entry
 * (common.cuh), so under CUDA graph capture it reads the (seed, offset) that torch sets before each
 * replay.
 *
 * Work split: the same as bias_dropout_residual.cu (column_partials.cuh) — a thread owns V adjacent
 * columns (16 bytes of T when hidden % V == 0 and the pointers are 16-byte aligned, else 1) and walks
 * down the rows of its slab; the grid is one resident wave. The backward keeps fp32 column sums of
 * grad_x in registers during its single pass, folds the block's rows in shared memory into one row of
 * fp32 partials [slabs, hidden], and a second small kernel sums the partials per column (no atomics).
 *
 * Numerics: gelu and gelu_tanh come from activations.cuh (a short erfc approximation for Φ; gelu_tanh
 * as v·σ(2u)), as accurate as PyTorch's fp32 activations under --use_fast_math.
 *
 * Napkin math (H200, fp16, 65536 × 4096 = 2^28 elements): forward moves 1 GiB, backward 1.5 GiB;
 * Philox (≈ 12 instructions per element) plus gelu (≈ 15) come close to the ≈ 30 per element that
 * the memory time allows at full bandwidth, so the inner loop is kept lean: no branches, bias in
 * registers, one Philox call per 8 elements, one exponential per element for gelu and its derivative.
 * Because the loop is nearly compute-bound, each thread loads the next row before computing the
 * current one (software pipelining), so memory stays busy while it computes.
 */
#include "bias_act_dropout.h"

#include <algorithm>
#include <type_traits>

#include "activations.cuh"
#include "column_partials.cuh"
#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kFwdThreads = 256;
// The backward holds two prefetched packs, the bias and the column sums in registers (≈ 70-80 for
// fp16 gelu with dropout): 256-thread blocks with at least 3 resident per SM fit that without spills,
// where 512-thread blocks would drop to one per SM or spill.
constexpr int kBwdThreads = 256;
constexpr int kBwdMinBlocksPerSm = 3;
constexpr int kBwdMaxBlocksPerSm = 2048 / kBwdThreads;

// ---------------------------------------------------------------------------------------------
// Activations and their derivatives (fp32).
// ---------------------------------------------------------------------------------------------
// relu here; gelu and gelu_tanh from activations.cuh.
template <int ACT>
__device__ __forceinline__ float act_fwd(float v) {
  if (ACT == int(BiasAct::Relu)) {
    return v <= 0.f ? 0.f : v;  // NaN propagates, like torch.relu
  } else if (ACT == int(BiasAct::Gelu)) {
    return gelu(v);
  } else {
    return gelu_tanh(v);
  }
}

template <int ACT>
__device__ __forceinline__ float act_grad(float v) {
  if (ACT == int(BiasAct::Relu)) {
    return v <= 0.f ? 0.f : 1.f;  // torch: threshold_backward(grad, relu(v), 0), so NaN passes grad
  } else if (ACT == int(BiasAct::Gelu)) {
    return gelu_grad(v);
  } else {
    return gelu_tanh_grad(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Grid shape (see bias_dropout_residual.cu for the reasoning).
// ---------------------------------------------------------------------------------------------
// Calls f(std::integral_constant<int, act>{}) for a runtime activation id.
template <typename F>
cudaError_t with_act(int act, F&& f) {
  switch (act) {
    case int(BiasAct::Relu): return f(std::integral_constant<int, int(BiasAct::Relu)>{});
    case int(BiasAct::Gelu): return f(std::integral_constant<int, int(BiasAct::Gelu)>{});
    case int(BiasAct::GeluTanh): return f(std::integral_constant<int, int(BiasAct::GeluTanh)>{});
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
template <typename T, typename BT, int V, int ACT, bool DROPOUT>
__global__ void __launch_bounds__(kFwdThreads)
    bias_act_dropout_fwd_kernel(const T* x, const BT* __restrict__ bias, T* out,
                                int64_t rows, int64_t hidden, uint32_t threshold, float scale, PhiloxArgs rng) {
  begin_dependent_kernel();
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(rng) : PhiloxSeedOffset{0, 0};
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (col >= hidden) return;  // no block-wide sync follows
  float b[V];
#pragma unroll
  for (int k = 0; k < V; ++k) b[k] = bias != nullptr ? to_float(bias[col + k]) : 0.f;

  // Software pipelining: the next row's load is issued before this row's Philox and activation, so
  // every thread keeps a row of loads in flight even while it computes.
  walk_rows<T, V, 1, true>({x}, rows, hidden, col, [&](int64_t i, float (&in)[1][V]) {
    float(&v)[V] = in[0];
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = act_fwd<ACT>(v[k] + b[k]);
    // V ∈ {4, 8} has i % V == 0 (hidden % V == 0, col % V == 0): whole or half Philox groups.
    if (DROPOUT) dropout_apply<V>(v, philox.seed, philox.offset, uint64_t(i), threshold, scale);
    store_pack<T, V>(out + i, v);
  });
}

template <typename T, typename BT, int V, int ACT, bool DROPOUT>
cudaError_t fwd_impl(const T* x, const BT* bias, T* out, int64_t rows, int64_t hidden, float p, PhiloxArgs rng,
                     cudaStream_t stream) {
  uint32_t threshold;
  float scale;
  dropout_params(p, &threshold, &scale);
  Tiling t = column_tiling(rows, hidden / V, kFwdThreads);
  auto kernel = bias_act_dropout_fwd_kernel<T, BT, V, ACT, DROPOUT>;
  t.slabs = wave_slabs(t, rows, resident_blocks_per_sm(kernel, t.bx * t.by, 0), INT64_MAX);
  return launch_dependent(kernel, dim3(unsigned(t.tiles_x), unsigned(t.slabs)), dim3(t.bx, t.by), 0, stream, x, bias,
                          out, rows, hidden, threshold, scale, rng);
}

// ---------------------------------------------------------------------------------------------
// Backward: grad_x and per-slab column sums in one pass over grad_out and x.
// ---------------------------------------------------------------------------------------------
// FROM_OUT: x is relu's forward output (see the top of the file); bias and rng are not read.
template <typename T, typename BT, int V, int ACT, bool DROPOUT, bool FROM_OUT>
__global__ void __launch_bounds__(kBwdThreads, kBwdMinBlocksPerSm)
    bias_act_dropout_bwd_kernel(const T* grad_out, const T* x, const BT* __restrict__ bias, T* grad_x,
                                float* __restrict__ partials,
                                int64_t rows, int64_t hidden, uint32_t threshold, float scale, PhiloxArgs rng) {
  wait_for_previous_kernel();  // before any access to global memory
  extern __shared__ float fold[];  // [by][bx * V] column sums, only when partials && by > 1
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.f;

  // idle threads of the last column tile still take part in the fold below
  if (col < hidden) with_philox<DROPOUT && !FROM_OUT>(rng, [&](const PhiloxSeedOffset philox) {
    float b[V];
#pragma unroll
    for (int k = 0; k < V; ++k) b[k] = bias != nullptr && !FROM_OUT ? to_float(bias[col + k]) : 0.f;
    // Software pipelining as in the forward: the next row's loads are in flight during this row's math.
    walk_rows<T, V, 2, true>({grad_out, x}, rows, hidden, col, [&](int64_t i, float (&in)[2][V]) {
      float(&g)[V] = in[0];
      const float(&v)[V] = in[1];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (FROM_OUT) {
          g[k] = v[k] <= 0.f ? 0.f : g[k] * scale;  // NaN passes the gradient, as act_grad<Relu>
        } else {
          g[k] *= act_grad<ACT>(v[k] + b[k]);
        }
      }
      if (DROPOUT && !FROM_OUT) dropout_apply<V>(g, philox.seed, philox.offset, uint64_t(i), threshold, scale);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += g[k];
      store_pack<T, V>(grad_x + i, g);
    });
  });
  if (partials != nullptr) store_column_partials<V>(acc, fold, partials, hidden);  // uniform over the grid
}

template <typename T, typename BT, int V, int ACT, bool DROPOUT, bool FROM_OUT>
cudaError_t bwd_main_impl(const T* grad_out, const T* x, const BT* bias, T* grad_x, float* partials,
                          int64_t partial_slabs, int64_t rows, int64_t hidden, float p, PhiloxArgs rng,
                          int64_t* slabs_used, cudaStream_t stream) {
  uint32_t threshold;
  float scale;
  dropout_params(p, &threshold, &scale);
  Tiling t = column_tiling(rows, hidden / V, kBwdThreads);
  const size_t smem = (partials != nullptr && t.by > 1) ? size_t(t.by) * t.bx * V * sizeof(float) : 0;
  auto kernel = bias_act_dropout_bwd_kernel<T, BT, V, ACT, DROPOUT, FROM_OUT>;
  t.slabs = wave_slabs(t, rows, resident_blocks_per_sm(kernel, t.bx * t.by, smem),
                       partials != nullptr ? partial_slabs : INT64_MAX);
  *slabs_used = t.slabs;
  return launch_dependent(kernel, dim3(unsigned(t.tiles_x), unsigned(t.slabs)), dim3(t.bx, t.by), smem, stream,
                          grad_out, x, bias, grad_x, partials, rows, hidden, threshold, scale, rng);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
template <typename T, typename BT>
cudaError_t launch_bias_act_dropout_fwd(const T* x, const BT* bias, T* out, int64_t rows, int64_t hidden, int act,
                                        float p, PhiloxArgs rng, cudaStream_t stream) {
  if (act < 0 || act >= kBiasActCount) return cudaErrorInvalidValue;
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  constexpr int VW = Vec16<T>::value;
  const bool vec = hidden % VW == 0 && is_aligned(x, 16) && is_aligned(out, 16);
  const bool dropout = p > 0.f;
  return with_act(act, [&](auto a) -> cudaError_t {
    constexpr int ACT = decltype(a)::value;
    if (vec) {
      return dropout ? fwd_impl<T, BT, VW, ACT, true>(x, bias, out, rows, hidden, p, rng, stream)
                     : fwd_impl<T, BT, VW, ACT, false>(x, bias, out, rows, hidden, p, rng, stream);
    }
    return dropout ? fwd_impl<T, BT, 1, ACT, true>(x, bias, out, rows, hidden, p, rng, stream)
                   : fwd_impl<T, BT, 1, ACT, false>(x, bias, out, rows, hidden, p, rng, stream);
  });
}

int64_t bias_act_dropout_bwd_partial_slabs(int64_t rows, int64_t hidden) {
  return max_partial_slabs(rows, hidden, kBwdThreads, kBwdMaxBlocksPerSm);
}

template <typename T, typename BT>
cudaError_t launch_bias_act_dropout_bwd(const T* grad_out, const T* x, const BT* bias, T* grad_x, BT* grad_bias,
                                        float* partials, int64_t partial_slabs, int64_t rows, int64_t hidden,
                                        int act, float p, PhiloxArgs rng, bool from_output, ColumnSums* sums,
                                        cudaStream_t stream) {
  if (act < 0 || act >= kBiasActCount || (from_output && act != int(BiasAct::Relu))) return cudaErrorInvalidValue;
  if (hidden <= 0) return cudaSuccess;
  if (grad_bias == nullptr) partials = nullptr;
  if (grad_bias != nullptr && (partials == nullptr || partial_slabs < 1) && rows > 0) return cudaErrorInvalidValue;
  int64_t slabs = 0;
  if (rows > 0) {
    constexpr int VW = Vec16<T>::value;
    const bool vec =
        hidden % VW == 0 && is_aligned(grad_out, 16) && is_aligned(x, 16) && is_aligned(grad_x, 16);
    const bool dropout = p > 0.f;
    // V, ACT, DROPOUT and FROM_OUT as compile-time constants of the kernel
    auto run = [&](auto v, auto a, auto d, auto f) {
      return bwd_main_impl<T, BT, decltype(v)::value, decltype(a)::value, decltype(d)::value, decltype(f)::value>(
          grad_out, x, bias, grad_x, partials, partial_slabs, rows, hidden, p, rng, &slabs, stream);
    };
    using Yes = std::true_type;
    using No = std::false_type;
    using VecW = std::integral_constant<int, VW>;
    using One = std::integral_constant<int, 1>;
    cudaError_t err;
    if (from_output) {
      using Relu = std::integral_constant<int, int(BiasAct::Relu)>;
      err = vec ? run(VecW{}, Relu{}, No{}, Yes{}) : run(One{}, Relu{}, No{}, Yes{});
    } else {
      err = with_act(act, [&](auto a) -> cudaError_t {
        if (vec) return dropout ? run(VecW{}, a, Yes{}, No{}) : run(VecW{}, a, No{}, No{});
        return dropout ? run(One{}, a, Yes{}, No{}) : run(One{}, a, No{}, No{});
      });
    }
    if (err != cudaSuccess) return err;
  }
  if (grad_bias != nullptr) return finish_column_partials<BT>(partials, slabs, hidden, grad_bias, sums, stream);
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// Instantiations: x in fp32/fp16/bf16, bias in x's dtype or fp32.
// ---------------------------------------------------------------------------------------------
#define LSMINI_INSTANTIATE_BAD(T, BT)                                                                           \
  template cudaError_t launch_bias_act_dropout_fwd<T, BT>(const T*, const BT*, T*, int64_t, int64_t, int, float, \
                                                          PhiloxArgs, cudaStream_t);                            \
  template cudaError_t launch_bias_act_dropout_bwd<T, BT>(const T*, const T*, const BT*, T*, BT*, float*,        \
                                                          int64_t, int64_t, int64_t, int, float, PhiloxArgs,    \
                                                          bool, ColumnSums*, cudaStream_t);

LSMINI_INSTANTIATE_BAD(float, float)
LSMINI_INSTANTIATE_BAD(__half, __half)
LSMINI_INSTANTIATE_BAD(__half, float)
LSMINI_INSTANTIATE_BAD(__nv_bfloat16, __nv_bfloat16)
LSMINI_INSTANTIATE_BAD(__nv_bfloat16, float)
#undef LSMINI_INSTANTIATE_BAD

}  // namespace lsmini
