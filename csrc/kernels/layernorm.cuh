// layernorm.cuh — what LayerNorm's forward (layernorm.cu) and backward (layernorm_bwd.cu) share: the
// block sizes of their row groups (row_groups.cuh), the vector-path test and the instantiated types.
// layernorm.cu's opening comment describes the kernels.
#pragma once

#include "common.cuh"
#include "layernorm.h"
#include "row_groups.cuh"

namespace lsmini {
namespace {

constexpr int kFwdMaxThreads = 1024;
constexpr int kBwdMaxThreads = 512;  // backward holds 4 arrays per thread: cap G so registers fit

template <typename T, typename W>
inline bool vectorizable(const void* a, const void* b, const void* w, const void* bias, int hidden) {
  constexpr int V = Vec16<T>::value;
  return hidden % V == 0 && is_aligned(a, 16) && is_aligned(b, 16) && (!w || is_aligned(w, V * sizeof(W))) &&
         (!bias || is_aligned(bias, V * sizeof(W)));
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
