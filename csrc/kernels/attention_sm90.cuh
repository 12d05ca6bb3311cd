// attention_sm90.cuh — what the Hopper attention kernels (attention_sm90.cu, attention_sm90_bwd.cu) add to
// attention.cuh: warpgroup MMAs (wgmma) that read their shared-memory operands through matrix descriptors,
// and the 128-byte-swizzled tile layout those descriptors describe.
//
// Why: mma.sync needs every B fragment in registers (one ldmatrix per two MMAs of a 16-row warp tile), so
// the tiled sm_80 kernels are bound by shared-memory loads and issue slots at about half of cuDNN's speed.
// wgmma multiplies a 64-row warpgroup tile straight out of shared memory,
// asynchronously: the same kernels, with their masks, dropout bits and pipeline unchanged, issue a
// handful of instructions per tile product instead of dozens.
//
// The instructions exist on sm_90a only (architecture-specific features): the code using them is compiled
// where __CUDA_ARCH_FEAT_SM90_ALL is defined, and the launchers (attention_sm90.cu) run the kernels only
// when the build holds sm_90a code (LSMINI_SM90A, set by setup.py) and the device is compute capability 9.0.
#pragma once

#include <cuda.h>  // CUtensorMap (the type only: the launchers encode maps through the runtime's driver entry point)
#include <type_traits>

#include "attention.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LSMINI_SM90A_DEVICE 1
#endif

namespace lsmini {
namespace {

// ---- the swizzled tile -------------------------------------------------------------------------------
// A [64 rows × D] tile of 2-byte elements as D/64 blocks of [64 rows][64 elements]: 128-byte rows, 8-row
// groups of 1 KB, the 16-byte chunk j of row r stored at chunk j ^ (r % 8) (the 128-byte swizzle, as the TMA unit
// writes a box of a map with CU_TENSOR_MAP_SWIZZLE_128B, so that the tensor cores' reads meet no bank conflicts).
// Blocks start 1 KB aligned.
// The same bytes serve as a K-major operand (rows are the M or N index: Q, K in S = QKᵀ) and as an
// MN-major one (rows are the k index: V in O = P̃V).
template <int D>
constexpr int kSwTileBytes = kBlock * D * 2;
constexpr int kSwBlockBytes = kBlock * 128;

// Byte offset of element (r, col) of a swizzled tile; col a multiple of 8.
__device__ __forceinline__ uint32_t sw_offset(int r, int col) {
  return (col >> 6) * kSwBlockBytes + r * 128 + ((((col & 63) >> 3) ^ (r & 7)) << 4);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- descriptors (PTX ISA, "matrix descriptor") ------------------------------------------------------
// Start address, leading and stride byte offsets (each >> 4), swizzle mode 1 (128 bytes) in bits 62-63.
// The stride byte offset is 1 KB for both majors here: the distance between 8-row groups. The start field (14
// bits) takes the address's low 18 bits (masked: without the mask the clustered dK/dV kernel read wrong tiles), and
// the CTA's shared memory lies below 256 KB, so a descriptor moves to an address `bytes` further (a multiple of 16)
// by adding bytes >> 4 to its low word (at). The high word is a constant, so the products' descriptors cost one
// 32-bit add each, not a rebuild.
struct SwDesc {
  uint32_t lo;
  __device__ __forceinline__ SwDesc(uint32_t addr, uint32_t leading_bytes)
      : lo((addr & 0x3FFFF) >> 4 | (leading_bytes >> 4) << 16) {}
  __device__ __forceinline__ uint64_t at(uint32_t bytes) const {
    return uint64_t((1u << 30) | (1024 >> 4)) << 32 | (lo + (bytes >> 4));
  }
};
// K-major: the 16 columns [16kk, 16kk + 16) of a swizzled tile, 32 bytes into its 128-byte rows (the
// hardware applies the swizzle to the address it computes, so the start moves like an unswizzled one). A tile of
// more than 64 rows (a stage of the warp-specialized forward) has blocks of `block` bytes.
__device__ __forceinline__ uint64_t desc_k(const SwDesc& tile, int kk, uint32_t block = kSwBlockBytes) {
  return tile.at((kk >> 2) * block + (kk & 3) * 32);
}
// MN-major: the 16 rows [16kk, 16kk + 16) of a swizzled tile; the next 64 columns lie one block further.
__device__ __forceinline__ uint64_t desc_mn(const SwDesc& tile, int kk) { return tile.at(kk * 16 * 128); }

#if defined(LSMINI_SM90A_DEVICE)
// ---- warpgroup MMA ----------------------------------------------------------------------------------
// The accumulator of m64nNk16 is, per warp w of the warpgroup, the warp's rows [16w, 16w + 16) in the
// mma.m16n8 C layout repeated over N / 8 column tiles: float d[N/8][4], as the sm_80 kernels hold theirs.
// A from registers has the mma.m16n8k16 A layout of the warp's 16 rows (c_to_a builds it).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// After a wait the compiler must not move reads of the accumulators above it (the MMA's asm statement is where
// it thinks they were written).
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}
// wgmma_commit makes the MMAs issued since the last commit one group; wgmma_wait waits for every group and
// fences the accumulators. Work between the two runs while the MMAs do; wgmma_sync is both at once.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <typename... Acc>
__device__ __forceinline__ void wgmma_wait(Acc&... acc) {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  (fence_acc(acc), ...);
}
template <typename... Acc>
__device__ __forceinline__ void wgmma_sync(Acc&... acc) {
  wgmma_commit();
  wgmma_wait(acc...);
}

#define LSMINI_D32                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define LSMINI_D64                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "  \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define LSMINI_ACC4(d, n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define LSMINI_ACC32(d)                                                                                      \
  LSMINI_ACC4(d, 0), LSMINI_ACC4(d, 1), LSMINI_ACC4(d, 2), LSMINI_ACC4(d, 3), LSMINI_ACC4(d, 4),            \
      LSMINI_ACC4(d, 5), LSMINI_ACC4(d, 6), LSMINI_ACC4(d, 7)
#define LSMINI_ACC64(d)                                                                                      \
  LSMINI_ACC32(d), LSMINI_ACC4(d, 8), LSMINI_ACC4(d, 9), LSMINI_ACC4(d, 10), LSMINI_ACC4(d, 11),            \
      LSMINI_ACC4(d, 12), LSMINI_ACC4(d, 13), LSMINI_ACC4(d, 14), LSMINI_ACC4(d, 15)

// Wgmma<T, N>::ss: d (+)= A·B, both from shared memory (descriptors a, b), A K-major (kTransA 0) or M-major
// (1), B K-major (kTransB 0) or N-major (1); rs: A from registers. accumulate 0 ignores d's old values.
// The operand numbers after the accumulators (A, B, the predicate's source, the immediates) are spelled
// per N.
template <typename T, int N>
struct Wgmma;

#define LSMINI_WGMMA(TT, TY, N, DREGS, ACC, A, B, P, TA, TB, RA, RB, RP, RTB)                                  \
  template <>                                                                                                \
  struct Wgmma<TT, N> {                                                                                      \
    template <int kTransA, int kTransB>                                                                      \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) { \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" P ", 0;\n"                                           \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", %" A ", %" B     \
                   ", p, 1, 1, %" TA ", %" TB ";\n}\n"                                                       \
                   : ACC(d)                                                                                  \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));                          \
    }                                                                                                        \
    template <int kTransB>                                                                                   \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b,      \
                                              int accumulate) {                                              \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" RP ", 0;\n"                                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " " DREGS ", " RA ", %" RB    \
                   ", p, 1, 1, %" RTB ";\n}\n"                                                               \
                   : ACC(d)                                                                                  \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB));     \
    }                                                                                                        \
  };

LSMINI_WGMMA(__half, "f16", 64, LSMINI_D32, LSMINI_ACC32, "32", "33", "34", "35", "36", "{%32, %33, %34, %35}",
             "36", "37", "38")
LSMINI_WGMMA(__nv_bfloat16, "bf16", 64, LSMINI_D32, LSMINI_ACC32, "32", "33", "34", "35", "36",
             "{%32, %33, %34, %35}", "36", "37", "38")
LSMINI_WGMMA(__half, "f16", 128, LSMINI_D64, LSMINI_ACC64, "64", "65", "66", "67", "68", "{%64, %65, %66, %67}",
             "68", "69", "70")
LSMINI_WGMMA(__nv_bfloat16, "bf16", 128, LSMINI_D64, LSMINI_ACC64, "64", "65", "66", "67", "68",
             "{%64, %65, %66, %67}", "68", "69", "70")

#undef LSMINI_WGMMA
#undef LSMINI_ACC64
#undef LSMINI_ACC32
#undef LSMINI_ACC4
#undef LSMINI_D64
#undef LSMINI_D32

// The tile products. Each issues its MMAs after a wgmma.fence; the caller waits with wgmma_sync (so that
// several products can go in one group).
// acc = the [64 × D] tile at a × (N rows of the tile at b)ᵀ over D columns: both K-major, e.g. S = Q·Kᵀ. b's
// blocks lie b_block bytes apart (a tile of more rows than N, or of 128 rows read as one N = 128 product).
template <typename T, int D, int N = 64>
__device__ __forceinline__ void wg_abt(float (&acc)[N / 8][4], uint32_t a, uint32_t b,
                                       uint32_t b_block = kSwBlockBytes) {
  const SwDesc da(a, 16), db(b, 16);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    Wgmma<T, N>::template ss<0, 0>(acc, desc_k(da, kk), desc_k(db, kk, b_block), kk > 0);
}

// acc += X·(64 rows × D at b), X the warpgroup's 64×64 tile held as C tiles x: B MN-major, e.g. O += P̃V. b's
// 64-column blocks lie b_block bytes apart.
template <typename T, int D>
__device__ __forceinline__ void wg_xb(float (&acc)[D / 8][4], const float (&x)[8][4], uint32_t b,
                                      uint32_t b_block = kSwBlockBytes) {
  uint32_t xa[kBlock / 16][4];
#pragma unroll
  for (int kk = 0; kk < kBlock / 16; ++kk) c_to_a<T>(xa[kk], x, kk);
  const SwDesc db(b, b_block);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlock / 16; ++kk) Wgmma<T, D>::template rs<1>(acc, xa[kk], desc_mn(db, kk), 1);
}
#endif  // LSMINI_SM90A_DEVICE

// ---- tensor memory access (PTX ISA, "cp.async.bulk.tensor") ------------------------------------------
// The operands as tensor maps: Q and dO [batch][heads][q_len][D], K and V [batch][kv_heads][k_len][D] in their
// strides, boxes of one swizzled block (64 rows × 64 elements, 128-byte swizzle; K and V of the warp-specialized
// forward 128 rows). The forward has no dO map.
struct AttentionMaps {
  CUtensorMap q, k, v, dout;
};

// cuTensorMapEncodeTiled, from the driver through the runtime (no link against the driver library); null where the
// driver lacks it.
using EncodeTiled = decltype(&cuTensorMapEncodeTiled);
inline EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiled>(p) : nullptr;
  }();
  return fn;
}

// The map of one operand ([batch][heads][rows][D] in s's strides), boxes of box_rows rows. The base and strides must
// be 16-byte multiples, as the binding checks; false where the driver refuses the map.
template <typename T>
bool encode_map(CUtensorMap* map, const Strided<const T>& s, int batch, int heads, int rows, int d,
                int box_rows = kBlock) {
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  // Extents of at least 1 (no CTA copies rows of an empty operand); a dimension of extent 1 is never stepped
  // along, so its stride only has to be a valid one.
  const cuuint64_t dims[4] = {cuuint64_t(d), cuuint64_t(rows > 1 ? rows : 1), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(s.row) * sizeof(T), heads > 1 ? cuuint64_t(s.head) * sizeof(T) : 16,
                                 batch > 1 ? cuuint64_t(s.batch) * sizeof(T) : 16};
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1}, unit[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  return encode(map, type, 4, const_cast<T*>(s.ptr), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The maps of a's q, k and v (boxes of kv_rows rows), and of dout for the backward; false where one is refused.
template <typename T>
bool encode_maps(AttentionMaps* m, const AttentionArgs<T>& a, bool backward, int kv_rows = kBlock) {
  const int d = a.head_dim;
  return encode_map(&m->q, a.q, a.batch, a.heads, a.q_len, d) &&
         encode_map(&m->k, a.k, a.batch, a.kv_heads, a.k_len, d, kv_rows) &&
         encode_map(&m->v, a.v, a.batch, a.kv_heads, a.k_len, d, kv_rows) &&
         (!backward || encode_map(&m->dout, a.dout, a.batch, a.heads, a.q_len, d));
}

// The launch (attention.cuh) of a kernel that also takes the maps.
template <typename Kernel, typename T>
cudaError_t launch_with_maps(Kernel kernel, int64_t blocks, size_t bytes, const AttentionArgs<T>& a,
                             const AttentionMaps& maps, cudaStream_t stream, int threads = kThreads,
                             int cluster = 1) {
  return launch_kernel(kernel, blocks, bytes, stream, threads, cluster, a, maps);
}

#if defined(LSMINI_SM90A_DEVICE)
// One box of a 4-D tensor map (coordinates: element, row, head, batch; boxes of 64 elements × the map's rows) into
// shared memory at dst, 1 KB aligned, with the map's 128-byte swizzle: one swizzled block. The bytes count toward
// bar's transaction count; rows past the tensor's end arrive as zeros.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int col, int row, int head, int batch,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(batch), "r"(bar)
      : "memory");
}
// A swizzled tile at dst (D / 64 boxes, `block` bytes apart): the map's box rows from row on, of one head of one
// batch.
template <int D>
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap* map, int row, int head, int batch,
                                         uint32_t bar, uint32_t block = kSwBlockBytes) {
#pragma unroll
  for (int col = 0; col < D; col += 64) tma_load(dst + col / 64 * block, map, col, row, head, batch, bar);
}
#endif  // LSMINI_SM90A_DEVICE

// ---- mbarriers (PTX ISA, "mbarrier"): the hand-off of shared tiles between warpgroups -----------------
#if defined(LSMINI_SM90A_DEVICE)
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrive once and expect `bytes` more of copies (tma_load) before the barrier's phase completes.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// This thread's mbarrier inits visible to the async proxy (the copies that complete on them).
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Wait for the completion of the barrier's phase of this parity (phase k has parity k & 1).
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Thread 0 (the caller sees to it): n mbarriers of one arrival each from `first` on, 8 bytes apart, initialized and
// visible to the copies that complete on them.
__device__ __forceinline__ void mbar_init_copies(uint32_t first, int n) {
  for (int i = 0; i < n; ++i) mbar_init(first + 8 * i, 1);
  fence_mbar_init();
}

// Key tile t of the CTA's K/V head into buffer t & 1 of the double-buffered K and V tiles at k and v (the forward
// and the dQ kernel): thread 0 has the TMA unit copy both, completing on the buffer's mbarrier bar_kv + 8·(t & 1);
// the first 64 threads write the tile's key bias into bias + 64·(t & 1) (visible after the next __syncthreads).
template <typename T, int D>
__device__ __forceinline__ void issue_kv_tile(int t, uint32_t k, uint32_t v, float* bias, uint32_t bar_kv,
                                              const AttentionMaps& maps, const Setup<T>& st, int h_kv) {
  const int kt = t * kBlock, buf = t & 1;
  if (threadIdx.x == 0) {
    const uint32_t bar = bar_kv + 8 * buf;
    mbar_expect_tx(bar, 2 * kSwTileBytes<D>);
    tma_tile<D>(k + buf * kSwTileBytes<D>, &maps.k, kt, h_kv, st.b, bar);
    tma_tile<D>(v + buf * kSwTileBytes<D>, &maps.v, kt, h_kv, st.b, bar);
  }
  st.vis.fill_key_bias(bias + buf * kBlock, kt);
}
#endif  // LSMINI_SM90A_DEVICE

// The dynamic shared memory, which the swizzled tiles need on the swizzle's 1 KB period. The kernels declare it
// __align__(1024), which the toolchain honours, so the launches ask for no slack to round up into (at d 128 that
// kilobyte held the dK/dV kernel to one CTA an SM). A base off the period would garble every tile: trap instead.
__device__ __forceinline__ unsigned char* smem_1k(unsigned char* raw) {
  if (smem_u32(raw) & 1023) __trap();
  return raw;
}

}  // namespace
}  // namespace lsmini
