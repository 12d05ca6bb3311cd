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

// The sum over the NW warps of this thread's row (row y = threadIdx.y of the block) of each warp's sum v: lane 0
// of each warp leaves v in the row's slot, the row's warps meet at named barrier 1 + y (32·NW threads, not the
// block), and each thread adds the slots in warp order (the same sum in every thread, deterministic). The caller
// alternates two slots by row: a slot is written again two rows later, after the next row's barrier, which no
// warp passes before every warp of the row has read this one.
template <int NW>
__device__ __forceinline__ float row_warps_sum(float v, float (*slot)[NW]) {
  if ((threadIdx.x & 31) == 0) slot[threadIdx.y][threadIdx.x >> 5] = v;
  switch (threadIdx.y) {  // constant barrier ids: with a register id ptxas reserves all 16
    case 0: asm volatile("bar.sync 1, %0;" ::"n"(32 * NW) : "memory"); break;
    case 1: asm volatile("bar.sync 2, %0;" ::"n"(32 * NW) : "memory"); break;
    case 2: asm volatile("bar.sync 3, %0;" ::"n"(32 * NW) : "memory"); break;
    default: asm volatile("bar.sync 4, %0;" ::"n"(32 * NW) : "memory"); break;
  }
  float s = 0.f;
#pragma unroll
  for (int q = 0; q < NW; ++q) s += slot[threadIdx.y][q];
  return s;
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
