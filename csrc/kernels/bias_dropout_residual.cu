/*
 * bias_dropout_residual.cu — out = residual + dropout(x + bias), and its backward
 *
 *   forward : out[r, c]    = residual[r, c] + keep(r, c) · (x[r, c] + bias[c]) / (1 − p)
 *   backward: grad_x[r, c] = keep(r, c) · grad_out[r, c] / (1 − p)
 *             grad_bias[c] = Σ_r grad_x[r, c]          grad_residual = grad_out (the binding's job)
 *
 * Layout: x, residual, out, grad_out, grad_x are row-major [rows, hidden]; bias is [hidden] in T or
 * fp32, or absent. Math in fp32, one rounding per stored value. A dropped element gives exactly
 * out = residual (residual + 0.0f is the residual), which the tests rely on.
 *
 * Dropout: common.cuh's Philox convention with the flat element index i = r · hidden + c, keyed by
 * (seed, offset). The backward regenerates the same keep bits, so only (p, seed, offset) are saved.
 * p == 0 compiles to a variant with no RNG at all; p == 1 keeps nothing (threshold 65536). Each kernel
 * resolves its PhiloxArgs once on entry (common.cuh), so under CUDA graph capture it reads the
 * (seed, offset) that torch sets before each replay.
 *
 * Work split (forward and backward; the walk and the column sums are column_partials.cuh's): a
 * thread owns V adjacent columns and walks down the rows.
 * V = 16 bytes of T (4 fp32 / 8 fp16/bf16) when hidden % V == 0 and the big pointers are 16-byte
 * aligned, else V = 1 (any hidden). A block is bx column groups × by rows; the grid is tiles_x column
 * tiles × `slabs` row slabs, sized to one resident wave so every block loops over its rows. Owning
 * columns means: the bias is read once per thread, the column needs no division, and the backward
 * keeps the grad_bias column sums in fp32 registers during its single pass over grad_out. Each
 * block folds its by rows of sums in shared memory and writes one row of fp32 partials
 * [slabs, hidden]; a second small kernel sums the partials per column. No atomics: the result is
 * deterministic for a given device.
 *
 * Napkin math (H200, fp16, 65536 × 1024): forward moves 3 · 128 MiB, backward 2 · 128 MiB plus
 * ≈ 2 · slabs · hidden · 4 B of partials (≈ 2 % here). Philox costs one call per 8 elements.
 */
#include "bias_dropout_residual.h"

#include <algorithm>

#include "column_partials.cuh"
#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kFwdThreads = 256;
constexpr int kFwdMinBlocksPerSm = 2048 / kFwdThreads;  // full occupancy: ≤ 32 registers (no spills)
constexpr int kBwdThreads = 512;
// The backward's partials buffer is sized for at most this many resident blocks per SM.
constexpr int kBwdMaxBlocksPerSm = 2048 / kBwdThreads;
// Three blocks an SM (≤ 40 registers, no spills since Philox has 7 rounds): the backward is latency-bound, and
// the fp16 dropout body at 42-44 registers fitted only two.
constexpr int kBwdMinBlocksPerSm = 3;

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------
template <typename T, typename BT, int V, bool DROPOUT>
__global__ void __launch_bounds__(kFwdThreads, kFwdMinBlocksPerSm)
    bias_dropout_residual_fwd_kernel(const T* __restrict__ x, const BT* __restrict__ bias,
                                     const T* __restrict__ residual, T* __restrict__ out, int64_t rows,
                                     int64_t hidden, uint32_t threshold, float scale, PhiloxArgs rng) {
  begin_dependent_kernel();
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(rng) : PhiloxSeedOffset{0, 0};
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (col >= hidden) return;  // no block-wide sync follows
  float b[V];
#pragma unroll
  for (int k = 0; k < V; ++k) b[k] = bias != nullptr ? to_float(bias[col + k]) : 0.f;

  // No prefetch here (unlike the backward): it would cost ≈ 18 registers and half the occupancy, and
  // this light kernel keeps enough loads in flight from 64 resident warps per SM.
  walk_rows<T, V, 2, false>({x, residual}, rows, hidden, col, [&](int64_t i, float (&in)[2][V]) {
    const float(&xv)[V] = in[0];
    const float(&rv)[V] = in[1];
    float o[V];
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] = xv[k] + b[k];
    // V ∈ {4, 8} has i % V == 0 (hidden % V == 0, col % V == 0): whole or half Philox groups.
    if (DROPOUT) dropout_apply<V>(o, philox.seed, philox.offset, uint64_t(i), threshold, scale);
#pragma unroll
    for (int k = 0; k < V; ++k) o[k] += rv[k];
    store_pack<T, V>(out + i, o);
  });
}

template <typename T, typename BT, int V, bool DROPOUT>
cudaError_t fwd_impl(const T* x, const BT* bias, const T* residual, T* out, int64_t rows, int64_t hidden,
                     float p, PhiloxArgs rng, cudaStream_t stream) {
  uint32_t threshold;
  float scale;
  dropout_params(p, &threshold, &scale);
  Tiling t = column_tiling(rows, hidden / V, kFwdThreads);
  auto kernel = bias_dropout_residual_fwd_kernel<T, BT, V, DROPOUT>;
  t.slabs = wave_slabs(t, rows, resident_blocks_per_sm(kernel, t.bx * t.by, 0), INT64_MAX);
  return launch_dependent(kernel, dim3(unsigned(t.tiles_x), unsigned(t.slabs)), dim3(t.bx, t.by), 0, stream, x, bias,
                          residual, out, rows, hidden, threshold, scale, rng);
}

// ---------------------------------------------------------------------------------------------
// Backward: grad_x and per-slab column sums in one pass over grad_out.
// ---------------------------------------------------------------------------------------------
template <typename T, int V, bool DROPOUT>
__global__ void __launch_bounds__(kBwdThreads, kBwdMinBlocksPerSm)
    bias_dropout_residual_bwd_kernel(const T* __restrict__ grad_out, T* __restrict__ grad_x,
                                     float* __restrict__ partials, int64_t rows, int64_t hidden,
                                     uint32_t threshold, float scale, PhiloxArgs rng) {
  wait_for_previous_kernel();  // before any access to global memory
  extern __shared__ float fold[];  // [by][bx * V] column sums, only when partials && by > 1
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(rng) : PhiloxSeedOffset{0, 0};
  const int64_t col = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  float acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = 0.f;

  if (col < hidden) {  // idle threads of the last column tile still take part in the fold below
    // Software pipelining: the next row's load is in flight during this row's Philox and math.
    walk_rows<T, V, 1, true>({grad_out}, rows, hidden, col, [&](int64_t i, float (&in)[1][V]) {
      float(&g)[V] = in[0];
      if (DROPOUT) dropout_apply<V>(g, philox.seed, philox.offset, uint64_t(i), threshold, scale);
      if (grad_x != nullptr) store_pack<T, V>(grad_x + i, g);
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] += g[k];
    });
  }
  if (partials != nullptr) store_column_partials<V>(acc, fold, partials, hidden);  // uniform over the grid
}

template <typename T, int V, bool DROPOUT>
cudaError_t bwd_main_impl(const T* grad_out, T* grad_x, float* partials, int64_t partial_slabs, int64_t rows,
                          int64_t hidden, float p, PhiloxArgs rng, int64_t* slabs_used, cudaStream_t stream) {
  uint32_t threshold;
  float scale;
  dropout_params(p, &threshold, &scale);
  Tiling t = column_tiling(rows, hidden / V, kBwdThreads);
  const size_t smem = (partials != nullptr && t.by > 1) ? size_t(t.by) * t.bx * V * sizeof(float) : 0;
  auto kernel = bias_dropout_residual_bwd_kernel<T, V, DROPOUT>;
  t.slabs = wave_slabs(t, rows, resident_blocks_per_sm(kernel, t.bx * t.by, smem),
                       partials != nullptr ? partial_slabs : INT64_MAX);
  *slabs_used = t.slabs;
  return launch_dependent(kernel, dim3(unsigned(t.tiles_x), unsigned(t.slabs)), dim3(t.bx, t.by), smem, stream,
                          grad_out, grad_x, partials, rows, hidden, threshold, scale, rng);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
template <typename T, typename BT>
cudaError_t launch_bias_dropout_residual_fwd(const T* x, const BT* bias, const T* residual, T* out, int64_t rows,
                                             int64_t hidden, float p, PhiloxArgs rng, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return cudaSuccess;
  constexpr int VW = Vec16<T>::value;
  const bool vec = hidden % VW == 0 && is_aligned(x, 16) && is_aligned(residual, 16) && is_aligned(out, 16);
  const bool dropout = p > 0.f;
  if (vec) {
    return dropout ? fwd_impl<T, BT, VW, true>(x, bias, residual, out, rows, hidden, p, rng, stream)
                   : fwd_impl<T, BT, VW, false>(x, bias, residual, out, rows, hidden, p, rng, stream);
  }
  return dropout ? fwd_impl<T, BT, 1, true>(x, bias, residual, out, rows, hidden, p, rng, stream)
                 : fwd_impl<T, BT, 1, false>(x, bias, residual, out, rows, hidden, p, rng, stream);
}

int64_t bias_dropout_residual_bwd_partial_slabs(int64_t rows, int64_t hidden) {
  return max_partial_slabs(rows, hidden, kBwdThreads, kBwdMaxBlocksPerSm);
}

template <typename T, typename BT>
cudaError_t launch_bias_dropout_residual_bwd(const T* grad_out, T* grad_x, BT* grad_bias, float* partials,
                                             int64_t partial_slabs, int64_t rows, int64_t hidden, float p,
                                             PhiloxArgs rng, ColumnSums* sums, cudaStream_t stream) {
  if (hidden <= 0) return cudaSuccess;
  // the mask must be applied somewhere (an empty tensor has a null data pointer: rows == 0 is fine)
  if (grad_x == nullptr && p > 0.f && rows > 0) return cudaErrorInvalidValue;
  if (grad_bias == nullptr) partials = nullptr;
  if (grad_bias != nullptr && (partials == nullptr || partial_slabs < 1) && rows > 0) return cudaErrorInvalidValue;
  int64_t slabs = 0;
  if (rows > 0 && (grad_x != nullptr || grad_bias != nullptr)) {
    constexpr int VW = Vec16<T>::value;
    const bool vec = hidden % VW == 0 && is_aligned(grad_out, 16) && (grad_x == nullptr || is_aligned(grad_x, 16));
    const bool dropout = p > 0.f;
    cudaError_t err;
    if (vec) {
      err = dropout ? bwd_main_impl<T, VW, true>(grad_out, grad_x, partials, partial_slabs, rows, hidden, p, rng,
                                                 &slabs, stream)
                    : bwd_main_impl<T, VW, false>(grad_out, grad_x, partials, partial_slabs, rows, hidden, p, rng,
                                                  &slabs, stream);
    } else {
      err = dropout ? bwd_main_impl<T, 1, true>(grad_out, grad_x, partials, partial_slabs, rows, hidden, p, rng,
                                                &slabs, stream)
                    : bwd_main_impl<T, 1, false>(grad_out, grad_x, partials, partial_slabs, rows, hidden, p, rng,
                                                 &slabs, stream);
    }
    if (err != cudaSuccess) return err;
  }
  if (grad_bias != nullptr) return finish_column_partials<BT>(partials, slabs, hidden, grad_bias, sums, stream);
  return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// Instantiations: x in fp32/fp16/bf16, bias in x's dtype or fp32.
// ---------------------------------------------------------------------------------------------
#define LSMINI_INSTANTIATE_BDR(T, BT)                                                                          \
  template cudaError_t launch_bias_dropout_residual_fwd<T, BT>(const T*, const BT*, const T*, T*, int64_t,     \
                                                               int64_t, float, PhiloxArgs, cudaStream_t);      \
  template cudaError_t launch_bias_dropout_residual_bwd<T, BT>(const T*, T*, BT*, float*, int64_t, int64_t,    \
                                                               int64_t, float, PhiloxArgs, ColumnSums*,        \
                                                               cudaStream_t);

LSMINI_INSTANTIATE_BDR(float, float)
LSMINI_INSTANTIATE_BDR(__half, __half)
LSMINI_INSTANTIATE_BDR(__half, float)
LSMINI_INSTANTIATE_BDR(__nv_bfloat16, __nv_bfloat16)
LSMINI_INSTANTIATE_BDR(__nv_bfloat16, float)
#undef LSMINI_INSTANTIATE_BDR

}  // namespace lsmini
