/*
 * common.cuh — device helpers shared by every lsmini kernel.
 *
 *   - float conversion for the three element types (float, __half, __nv_bfloat16);
 *   - 16-byte vector packs (`Pack<T, N>`) for wide, coalesced loads and stores;
 *   - warp and block reductions in fp32;
 *   - Philox4x32-7, the counter-based RNG behind every fused dropout, and resolve_philox, which reads
 *     its (seed, offset) in eager mode and under CUDA graph capture alike.
 *
 * Conventions: no torch headers (each kernel file compiles with plain nvcc), launchers return the
 * cudaError_t of their launch so the binding can raise a Python exception naming the op.
 */
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include <type_traits>
#include <vector>

#include "philox.h"

namespace lsmini {

// ---------------------------------------------------------------------------------------------
// Element conversion. All math happens in fp32; these are the only casts kernels use.
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ---------------------------------------------------------------------------------------------
// Vector packs: N elements of T moved as one aligned load/store (16 bytes when N*sizeof(T) == 16).
// ---------------------------------------------------------------------------------------------
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements per 16-byte access.
template <typename T> struct Vec16 { static constexpr int value = 16 / sizeof(T); };

// Two-element conversions: one cvt instruction per pair on sm_80+ instead of one per element.
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
// bf16 → fp32 is exact: the 16 bits become the high half of the float. Written as bit operations (one
// instruction each) so the compiler sees conversions it may redo instead of keeping both floats live.
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) {
  const uint32_t u = *reinterpret_cast<const uint32_t*>(&v);
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xFFFF0000u));
}
template <typename T> struct Pair;
template <> struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2half2_rn(a, b); }
};
template <> struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ type make(float a, float b) { return __floats2bfloat162_rn(a, b); }
};

template <typename T, int N>
__device__ __forceinline__ void unpack(const Pack<T, N>& pk, float (&out)[N]) {
  if constexpr (N % 2 == 0 && (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>)) {
    const auto* p2 = reinterpret_cast<const typename Pair<T>::type*>(pk.v);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = to_float2(p2[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(pk.v[i]);
  }
}

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> pack(const float (&in)[N]) {
  Pack<T, N> pk;
  if constexpr (N % 2 == 0 && (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>)) {
    auto* p2 = reinterpret_cast<typename Pair<T>::type*>(pk.v);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) p2[i] = Pair<T>::make(in[2 * i], in[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = from_float<T>(in[i]);
  }
  return pk;
}

template <typename T, int N>
__device__ __forceinline__ void load_pack(const T* p, float (&out)[N]) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);  // by value: one wide load
  unpack(pk, out);
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const float (&in)[N]) {
  *reinterpret_cast<Pack<T, N>*>(p) = pack<T, N>(in);
}

__host__ __device__ __forceinline__ bool is_aligned(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// ---------------------------------------------------------------------------------------------
// Reductions (fp32). `width` lets a sub-warp group (a power of two ≤ 32) reduce on its own.
// ---------------------------------------------------------------------------------------------
template <int WIDTH = 32>
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o, WIDTH);
  return v;
}

template <int WIDTH = 32>
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, WIDTH));
  return v;
}

template <int WIDTH = 32>
__device__ __forceinline__ float2 warp_sum2(float2 v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) {
    v.x += __shfl_xor_sync(0xffffffffu, v.x, o, WIDTH);
    v.y += __shfl_xor_sync(0xffffffffu, v.y, o, WIDTH);
  }
  return v;
}

// Sum of a float2 over the threads threadIdx.x ∈ [0, blockDim.x) of row threadIdx.y (blockDim.x a
// multiple of 32, or ≤ 32). `smem` holds one float2 per warp of the block (≤ 32). Every thread of the
// block must call it (it syncs when a row spans several warps); the result reaches every thread of the
// row. Safe to call repeatedly: the first barrier keeps a previous call's readers ahead of the writers.
__device__ __forceinline__ float2 group_sum2(float2 v, float2* smem) {
  v = warp_sum2(v);
  if (blockDim.x <= 32) return v;
  const int warps_per_row = blockDim.x / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float2* row_smem = smem + threadIdx.y * warps_per_row;
  __syncthreads();
  if (lane == 0) row_smem[warp] = v;
  __syncthreads();
  float2 t = make_float2(0.f, 0.f);
  for (int w = 0; w < warps_per_row; ++w) {
    t.x += row_smem[w].x;
    t.y += row_smem[w].y;
  }
  return t;
}

// group_sum2 for one float: the sum over the threads of row threadIdx.y, smem one float per warp of the
// block (≤ 32), the same contract (every thread calls it; the result reaches every thread of the row).
__device__ __forceinline__ float group_sum(float v, float* smem) {
  v = warp_sum(v);
  if (blockDim.x <= 32) return v;
  const int warps_per_row = blockDim.x / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* row_smem = smem + threadIdx.y * warps_per_row;
  __syncthreads();
  if (lane == 0) row_smem[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int w = 0; w < warps_per_row; ++w) t += row_smem[w];
  return t;
}

// Block-wide sum / max over all threads of a 1-D block; smem holds ≥ 32 floats. The result is
// returned to every thread; smem may be reused after the call returns only behind a __syncthreads.
__device__ __forceinline__ float block_sum(float v, float* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  v = warp_sum(v);
  if (nwarps == 1) return v;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : 0.f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* smem) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = (blockDim.x + 31) / 32;
  v = warp_max(v);
  if (nwarps == 1) return v;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < nwarps ? smem[lane] : -INFINITY;
  return warp_max(v);
}

// ---------------------------------------------------------------------------------------------
// Philox4x32-7 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): the 4×32 Philox bijection
// with 7 rounds. The paper finds Philox4x32 passes TestU01's BigCrush from 7 rounds on (10 is its default, for
// margin), and PyTorch's flash-attention dropout draws with 7. Each round costs about five issue slots a call,
// and the draws are a large share of the dropout kernels' instructions (about a fifth of bias_act_dropout's per
// element, and a large part of the attention forward's issue slots per tile at 10 rounds), so the three rounds past the
// statistical bar are not spent.
//
// Dropout convention shared by every op: one Philox call yields 128 random bits, split into eight
// 16-bit values, one per element. Element i of a call keyed by (seed, offset) uses
//   r = philox(counter = {g lo, g hi, offset lo, offset hi}, key = {seed lo, seed hi}),  g = i / 8,
//   u = 16-bit half (i % 2) (low half first) of word (i % 8) / 2 of r,
// and is kept iff u ≥ dropout_threshold(p) = round(p · 65536), i.e. with probability 1 − t/65536 (p
// is quantized to 1/65536, an error ≤ 7.6e-6 in the rate). Eight elements per call instead of four
// halves the RNG cost, which bounds the speed of the memory-bound dropout kernels. Forward and
// backward regenerate the same bits from (seed, offset), so no mask is stored.
//
// Kernels receive (seed, offset) as a PhiloxArgs (philox.h) and call resolve_philox once, before their
// first Philox call; under CUDA graph capture that reads the values torch's generator writes before
// each replay, so every replay draws fresh masks. The helpers below take the resolved values.
// ---------------------------------------------------------------------------------------------
struct PhiloxSeedOffset {
  uint64_t seed;
  uint64_t offset;
};

// The same rule as torch's at::cuda::philox::unpack: eager values as given; captured, the seed and the
// base offset come from device memory and rng.offset is the call's part within the graph.
__device__ __forceinline__ PhiloxSeedOffset resolve_philox(const PhiloxArgs& rng) {
  if (rng.seed_ptr == nullptr) return {rng.seed, rng.offset};
  return {static_cast<uint64_t>(*rng.seed_ptr), static_cast<uint64_t>(*rng.offset_ptr) + rng.offset};
}

// body(philox) with resolve_philox's pair, its code compiled twice: in the eager form's copy the seed and the
// offset stay kernel parameters, which the compiler knows to be uniform (Philox's key schedule, for one); only
// the captured form's copy reads them from device memory. Worth the second copy where the kernel is issue-bound,
// as bias_act_dropout's backward is.
template <bool DROPOUT, typename F>
__device__ __forceinline__ void with_philox(const PhiloxArgs& rng, F&& body) {
  if (DROPOUT && rng.seed_ptr != nullptr) {
    body(resolve_philox(rng));
  } else {
    body(DROPOUT ? PhiloxSeedOffset{rng.seed, rng.offset} : PhiloxSeedOffset{0, 0});
  }
}

constexpr int kPhiloxRounds = 7;

__device__ __forceinline__ uint4 philox4x32(uint4 ctr, uint2 key) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
  for (int r = 0; r < kPhiloxRounds; ++r) {
    const uint32_t hi0 = __umulhi(M0, ctr.x), lo0 = M0 * ctr.x;
    const uint32_t hi1 = __umulhi(M1, ctr.z), lo1 = M1 * ctr.z;
    ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
    key.x += W0;
    key.y += W1;
  }
  return ctr;
}

// The 128 random bits for elements [8·group, 8·group + 8).
__device__ __forceinline__ uint4 dropout_bits(uint64_t seed, uint64_t offset, uint64_t group) {
  const uint4 ctr = make_uint4(static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32),
                               static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32));
  return philox4x32(ctr, make_uint2(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)));
}

__device__ __forceinline__ uint32_t word_of(const uint4& r, int k) {
  return k == 0 ? r.x : k == 1 ? r.y : k == 2 ? r.z : r.w;
}

// keep ⇔ u ≥ threshold. p = 0 gives 0: every element kept, exactly; p = 1 gives 65536: none kept.
__host__ __device__ __forceinline__ uint32_t dropout_threshold(float p) {
  const double t = static_cast<double>(p) * 65536.0 + 0.5;
  return t <= 0.0 ? 0u : t >= 65536.0 ? 65536u : static_cast<uint32_t>(t);
}

// p → (threshold, scale) of dropout_apply. p ≥ 1 keeps nothing: scale 0 makes even a passing word contribute 0.
inline void dropout_params(float p, uint32_t* threshold, float* scale) {
  *threshold = dropout_threshold(p);
  *scale = p < 1.f ? 1.f / (1.f - p) : 0.f;
}

// Single element (slow paths and tails).
__device__ __forceinline__ bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t i, uint32_t threshold) {
  const uint32_t v = word_of(dropout_bits(seed, offset, i / 8), int(i % 8) / 2);
  return ((i % 2) ? (v >> 16) : (v & 0xFFFFu)) >= threshold;
}

// Dropout applied in place to N consecutive elements starting at `first`: v[k] · scale where element
// first + k is kept, else 0.
// Contract: for N ≥ 4, first % min(N, 8) == 0 — true on every vector path, where `first` is the flat
// index of a 16-byte pack's first element and the row length is a multiple of the pack. No runtime
// fallback: a never-taken slow path here costs the fast callers registers (and spills).
// Each element compares its own 16-bit draw right where it selects. Packing the eight compares of a
// Philox call into a keep word and testing its bits again cost the elementwise kernels as many
// instructions as the Philox call itself.
template <int N>
__device__ __forceinline__ void dropout_apply(float (&v)[N], uint64_t seed, uint64_t offset, uint64_t first,
                                              uint32_t threshold, float scale) {
  static_assert(N == 1 || N == 2 || N == 4 || (N % 8 == 0 && N <= 32), "N must be 1, 2, 4, 8, 16 or 32");
  auto pair = [&](uint32_t word, int k) {  // word's low half draws element k, its high half k + 1
    v[k] = (word & 0xFFFFu) >= threshold ? v[k] * scale : 0.f;
    v[k + 1] = (word >> 16) >= threshold ? v[k + 1] * scale : 0.f;
  };
  if constexpr (N >= 8) {
#pragma unroll
    for (int g = 0; g < N / 8; ++g) {
      const uint4 r = dropout_bits(seed, offset, first / 8 + g);
      pair(r.x, 8 * g), pair(r.y, 8 * g + 2), pair(r.z, 8 * g + 4), pair(r.w, 8 * g + 6);
    }
  } else if constexpr (N == 4) {
    const uint4 r = dropout_bits(seed, offset, first / 8);  // first % 8 is 0 or 4
    const bool upper = first % 8 != 0;
    pair(upper ? r.z : r.x, 0), pair(upper ? r.w : r.y, 2);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = dropout_keep(seed, offset, first + k, threshold) ? v[k] * scale : 0.f;
  }
}

// Multiprocessor count of the current device, for sizing persistent grids (asked once per device and host
// thread: the launches that size their grids by it run several times per layer call).
inline int sm_count() {
  constexpr int kDevices = 64;
  thread_local int known[kDevices] = {};
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  const bool cached = dev >= 0 && dev < kDevices;
  if (cached && known[dev] > 0) return known[dev];
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  if (cached && n > 0) known[dev] = n;
  return n > 0 ? n : 1;
}

// Compute capability of the current device as major · 10 + minor, for launchers that pick kernels by
// architecture (asked once per device and host thread; 0 when no device answers).
inline int compute_capability() {
  constexpr int kDevices = 64;
  thread_local int known[kDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) return 0;
  if (known[dev] == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    known[dev] = major * 10 + minor;
  }
  return known[dev];
}

// ---- programmatic dependent launch (sm_90+) -------------------------------------------------------------
// Every kernel of the extension is launched by launch_dependent: it may be scheduled while the stream's previous
// kernel still runs, so that its launch and ramp-up hide under that kernel's tail. It calls
// wait_for_previous_kernel() before its first access to global memory (reads and writes alike: the previous kernel
// may still read what this one writes): griddepcontrol.wait returns once the previous kernel has finished and its
// writes are visible, so the order is that of a plain launch. A kernel lets the next one's blocks in early with
// allow_dependent_launch(): at its start (begin_dependent_kernel), or where only its own last writes are left for
// the kernels whose next launch is their own second pass. Below sm_90 all three are plain stream order.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// The first statement of a kernel: wait for the previous kernel, then let the next one's blocks be scheduled into
// the SM slots this grid's tail leaves free (they wait in turn before touching memory).
__device__ __forceinline__ void begin_dependent_kernel() {
  wait_for_previous_kernel();
  allow_dependent_launch();
}
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             Args... args) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = compute_capability() >= 90 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// cudaOccupancyMaxActiveBlocksPerMultiprocessor on the current device, remembered per (kernel, threads,
// dynamic shared bytes, device) and host thread once it succeeds: the query costs about a microsecond of
// host time, and the column-sum and LayerNorm backward launches size their grids with it on every call.
template <typename Kernel>
cudaError_t max_active_blocks(Kernel kernel, int threads, size_t smem, int* blocks) {
  struct Known {
    const void* kernel;
    int threads;
    size_t smem;
    int device, blocks;
  };
  thread_local std::vector<Known> known;
  const void* fn = reinterpret_cast<const void*>(kernel);
  int dev = 0;
  cudaGetDevice(&dev);
  for (const Known& k : known) {
    if (k.kernel == fn && k.threads == threads && k.smem == smem && k.device == dev) {
      *blocks = k.blocks;
      return cudaSuccess;
    }
  }
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, fn, threads, smem);
  if (err == cudaSuccess) known.push_back({fn, threads, smem, dev, *blocks});
  return err;
}

// cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), which a launch with more than
// 48 KB of dynamic shared memory needs: made once per (kernel, device) and host thread for the largest size asked
// so far, not a driver call on every launch (host time on every step that no CUDA graph replays).
template <typename Kernel>
cudaError_t allow_dynamic_smem(Kernel kernel, int bytes) {
  struct Known {
    const void* kernel;
    int device, bytes;
  };
  thread_local std::vector<Known> known;
  const void* fn = reinterpret_cast<const void*>(kernel);
  int dev = 0;
  cudaGetDevice(&dev);
  for (const Known& k : known) {
    if (k.kernel == fn && k.device == dev && k.bytes >= bytes) return cudaSuccess;
  }
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) known.push_back({fn, dev, bytes});
  return err;
}

}  // namespace lsmini
