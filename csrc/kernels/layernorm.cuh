// layernorm.cuh — what LayerNorm's forward (layernorm.cu) and backward (layernorm_bwd.cu) share: the
// row-group configuration, the vector-path test, the dispatch over VPT and the instantiated types.
// layernorm.cu's opening comment describes the kernels.
#pragma once

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

}  // namespace
}  // namespace lsmini

// The (element, parameter) type pairs both directions are instantiated for.
#define LSMINI_FOR_LN_TYPES(X) \
  X(float, float)              \
  X(__half, __half)            \
  X(__half, float)             \
  X(__nv_bfloat16, __nv_bfloat16) \
  X(__nv_bfloat16, float)
