/*
 * row_groups.cuh — the layout of the row-wise kernels that hold a whole row in registers (LayerNorm in
 * layernorm.cu, RMSNorm in rms_norm.cu): its configuration, the dispatch over the vectors each thread
 * owns, and the load of an optional parameter vector.
 *
 * Layout: a row of `hidden` elements is owned by a group of G threads (blockDim.x = G, a power of two
 * from 32 up: one warp for short rows, a whole block for long ones); a block holds R such rows
 * (blockDim.y = R, so that a block has at least 256 threads). The row is cut into nvec = hidden / VEC
 * vectors of VEC elements (16 bytes of T on the vector path, 1 element on the scalar one); thread x of a
 * group owns the vectors c = x + k·G, k < VPT, so every load of the group is coalesced. A row's sums then
 * take one group reduction: warp shuffles, plus one trip through shared memory when G > 32.
 */
#pragma once

#include "common.cuh"

#include <type_traits>

namespace lsmini {
namespace {

struct RowGroups {
  int G;    // threads per row (blockDim.x)
  int R;    // rows per block (blockDim.y)
  int vpt;  // vectors per thread, a power of two: G·vpt ≥ nvec
};

// The smallest group (at most max_g threads) that gives each thread about `elems` elements, enough loads in
// flight to cover the memory latency without running out of registers; R fills the block to 256 threads.
inline RowGroups row_groups(int hidden, int vec, int max_g, int elems) {
  const int nvec = hidden / vec;
  const int pref = vec >= elems ? 1 : elems / vec;
  int G = 32;
  while (G < max_g && nvec > G * pref) G *= 2;
  int vpt = 1;
  while (vpt * G < nvec) vpt *= 2;
  return {G, G >= 256 ? 1 : 256 / G, vpt};
}

// out = p[c·VEC … c·VEC + VEC) in fp32, or `fill` everywhere when p is null (an absent weight or bias).
template <typename W, int VEC>
__device__ __forceinline__ void load_or(const W* p, int c, float fill, float (&out)[VEC]) {
  if (p) {
    load_pack<W, VEC>(p + c * VEC, out);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = fill;
  }
}

// The residual form's s (norm_residual.h) in place of the thread's packs of x: `first` is the row's first element,
// threshold/scale dropout_params's of p (DROPOUT: p > 0), philox resolved. Vectors past the row (clamped onto its
// last one, as the loads are) compute a value no one reads.
template <typename T, typename W, int VEC, int VPT, bool DROPOUT>
__device__ __forceinline__ void residual_sum(Pack<T, VEC> (&xv)[VPT], const T* __restrict__ residual,
                                             const W* __restrict__ bias, int64_t first, int nvec, uint32_t threshold,
                                             float scale, PhiloxSeedOffset philox) {
  Pack<T, VEC> rv[VPT];
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = min(int(threadIdx.x + k * blockDim.x), nvec - 1);
    rv[k] = *reinterpret_cast<const Pack<T, VEC>*>(residual + first + c * VEC);
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int c = min(int(threadIdx.x + k * blockDim.x), nvec - 1);
    float a[VEC], r[VEC], b[VEC];
    unpack(xv[k], a);
    unpack(rv[k], r);
    load_or<W, VEC>(bias, c, 0.f, b);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a[j] += b[j];
    if constexpr (DROPOUT)
      dropout_apply<VEC>(a, philox.seed, philox.offset, uint64_t(first + c * VEC), threshold, scale);
#pragma unroll
    for (int j = 0; j < VEC; ++j) a[j] += r[j];
    xv[k] = pack<T, VEC>(a);  // s rounded to T: what is stored is what is normalized
  }
}

// Calls f(std::integral_constant<int, VPT>) for the power of two vpt ≤ MAXV (cudaErrorInvalidValue for any
// other vpt), so that each vectors-per-thread count is its own kernel with its row in registers.
template <int VPT, int MAXV, typename F>
inline cudaError_t with_vpt(int vpt, F&& f) {
  if constexpr (VPT >= MAXV) {
    return vpt == VPT ? f(std::integral_constant<int, VPT>{}) : cudaErrorInvalidValue;
  } else {
    return vpt == VPT ? f(std::integral_constant<int, VPT>{}) : with_vpt<VPT * 2, MAXV>(vpt, f);
  }
}

// Calls f(std::integral_constant<int, N>) for the count n in [N, MAXN] (cudaErrorInvalidValue outside it).
template <int N, int MAXN, typename F>
inline cudaError_t with_count(int n, F&& f) {
  if constexpr (N >= MAXN) {
    return n == N ? f(std::integral_constant<int, N>{}) : cudaErrorInvalidValue;
  } else {
    return n == N ? f(std::integral_constant<int, N>{}) : with_count<N + 1, MAXN>(n, f);
  }
}

}  // namespace
}  // namespace lsmini
