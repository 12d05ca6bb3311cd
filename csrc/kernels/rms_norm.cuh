// rms_norm.cuh — what RMSNorm's forward (rms_norm.cu) and backward (rms_norm_bwd.cu) share: the block
// sizes of their row groups (row_groups.cuh), the vector-path test and the instantiated types.
// rms_norm.cu's opening comment describes the kernels.
#pragma once

#include "common.cuh"
#include "rms_norm.h"
#include "row_groups.cuh"

#include <initializer_list>

namespace lsmini {
namespace {

constexpr int kRmsFwdMaxThreads = 1024;
constexpr int kRmsBwdMaxThreads = 512;  // backward holds x, dy and the dweight sums per thread: cap G for registers

// The backward's warp rows: rows of 32·VPT vectors, VPT ≤ kWarpRowMaxVpt, take one warp each, kWarpRows rows a
// block, in one resident wave of blocks whose warps walk the rows grid-stride. Longer rows take rows of several
// warps (below) or row groups: a warp holding 64 elements of x, dy, the weight and the dw sums spills.
constexpr int kWarpRowMaxVpt = 4;
constexpr int kWarpRows = 8;
inline bool is_warp_row(int nvec) { return nvec % 32 == 0 && nvec <= 32 * kWarpRowMaxVpt; }

// The backward's rows of warps: NW = 4 or 2 warps a row (kWarpRows / NW rows a block, the row's warps meeting
// at a named barrier of their own for its sum) where that leaves each thread 2 to kWarpRowMaxVpt vectors, else
// one warp a row (warp rows), else 0: row groups. Fewer vectors a thread leave registers for more rows in flight,
// and a row's own barrier keeps its warps from waiting on the block's other rows.
inline int bwd_row_warps(int nvec) {
  for (int nw : {4, 2}) {
    if (nvec % (32 * nw) == 0 && nvec / (32 * nw) >= 2 && nvec / (32 * nw) <= kWarpRowMaxVpt) return nw;
  }
  return is_warp_row(nvec) ? 1 : 0;
}

// The 16-byte path: hidden a multiple of the vector width, every row pointer 16-byte aligned (null ones
// ignored), the weight aligned to its own vector of VEC elements.
template <typename T, typename W>
inline bool rms_norm_vectorizable(int hidden, const W* weight, std::initializer_list<const void*> rows) {
  constexpr int V = Vec16<T>::value;
  if (hidden % V != 0 || (weight && !is_aligned(weight, V * sizeof(W)))) return false;
  for (const void* p : rows) {
    if (p && !is_aligned(p, 16)) return false;
  }
  return true;
}

}  // namespace
}  // namespace lsmini

// The (element, weight) type pairs both directions are instantiated for.
#define LSMINI_FOR_RMS_NORM_TYPES(X) \
  X(float, float)                    \
  X(__half, __half)                  \
  X(__half, float)                   \
  X(__nv_bfloat16, __nv_bfloat16)    \
  X(__nv_bfloat16, float)
