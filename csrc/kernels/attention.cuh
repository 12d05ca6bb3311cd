// attention.cuh — what the fused attention forward (attention.cu) and backward (attention_bwd.cu,
// attention_bwd_short.cu) share: tensor-core fragments, the cp.async tile pipeline, masks, dropout bits,
// the per-(batch, head) setup and the launch helper. attention.cu's opening comment describes the
// kernels, their layout and conventions.
#pragma once

#include "common.cuh"
#include "attention.h"

namespace lsmini {
namespace {

constexpr int kBlock = 64;  // rows of a CTA's block and of a streamed tile
constexpr int kThreads = 128;
constexpr int kPad = 8;     // elements of padding per shared-memory row
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = __builtin_huge_valf();

// ---- tensor-core fragments (PTX ISA, mma.m16n8k16; g = lane / 4, c = lane % 4) --------------------
// A 16×16 row-major: a0 (g, 2c..2c+1), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
// B 16×8:            b0 (k = 2c..2c+1, n = g), b1 (k = 2c+8.., n = g)
// C 16×8 fp32:       c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  typename Pair<T>::type v = Pair<T>::make(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// ldmatrix: four 8×8 b16 matrices from shared memory; lanes 8m..8m+7 give the row addresses of matrix m
// and register m receives it as an mma fragment: (row lane/4, columns 2·(lane%4)..+1), or transposed
// with .trans: (rows 2·(lane%4)..+1, column lane/4).
template <bool kTrans>
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* row_address) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  }
}

// A fragment of rows [r0, r0+16) × columns [k0, k0+16) of a row-major shared tile.
template <typename T>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const T* s, int ld, int r0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm4<false>(a, s + (r0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
}

// A fragment of the TRANSPOSE of a row-major shared tile: A[m][k] = s[k][m], m ∈ [m0, m0+16), k ∈ [k0, k0+16).
template <typename T>
__device__ __forceinline__ void frag_a_t(uint32_t (&a)[4], const T* s, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm4<true>(a, s + (k0 + (lane & 7) + ((lane >> 4) << 3)) * ld + m0 + ((lane >> 3) & 1) * 8);
}

// B fragments (b0, b1 of n-tile n0, then of n0 + 8) with B[k][n] = s[n][k]: rows of s are the n index
// (K rows for S = QKᵀ); k ∈ [k0, k0+16).
template <typename T>
__device__ __forceinline__ void frag_b_rows(uint32_t (&b)[4], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm4<false>(b, s + (n0 + (lane & 7) + ((lane >> 4) << 3)) * ld + k0 + ((lane >> 3) & 1) * 8);
}

// B fragments (n-tiles n0 and n0 + 8) with B[k][n] = s[k][n]: rows of s are the k index (V rows for O = PV).
template <typename T>
__device__ __forceinline__ void frag_b_cols(uint32_t (&b)[4], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm4<true>(b, s + (k0 + (lane & 15)) * ld + n0 + (lane >> 4) * 8);
}

// The A fragments of a 16×64 probability tile held as 8 C tiles (FlashAttention-2's register reuse):
// columns [16·kk, 16·kk + 16) are C tiles 2kk and 2kk+1.
template <typename T>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&x)[8][4], int kk) {
  a[0] = pack2<T>(x[2 * kk][0], x[2 * kk][1]);
  a[1] = pack2<T>(x[2 * kk][2], x[2 * kk][3]);
  a[2] = pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
  a[3] = pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
}

// acc[8][4] += rows [r0, r0+16) of sa × (rows of sb)ᵀ: a 16×64 tile of A·Bᵀ over D columns.
template <typename T, int D>
__device__ __forceinline__ void tile_abt(float (&acc)[8][4], const uint32_t (&a)[D / 16][4], const T* sb) {
  constexpr int ld = D + kPad;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
    for (int n = 0; n < 8; n += 2) {
      uint32_t b[4];
      frag_b_rows(b, sb, ld, n * 8, kk * 16);
      mma16816<T>(acc[n], a[kk], b[0], b[1]);
      mma16816<T>(acc[n + 1], a[kk], b[2], b[3]);
    }
}

// acc[D/8][4] += X·sb, X the 16×64 tile held as C tiles x (converted to A fragments), sb [64][D] rows.
template <typename T, int D>
__device__ __forceinline__ void tile_xb(float (&acc)[D / 8][4], const float (&x)[8][4], const T* sb) {
  constexpr int ld = D + kPad;
#pragma unroll
  for (int kk = 0; kk < kBlock / 16; ++kk) {
    uint32_t a[4];
    c_to_a<T>(a, x, kk);
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t b[4];
      frag_b_cols(b, sb, ld, n * 8, kk * 16);
      mma16816<T>(acc[n], a, b[0], b[1]);
      mma16816<T>(acc[n + 1], a, b[2], b[3]);
    }
  }
}

// s = rows [r0, r0+16) of Q·Kᵀ and dp = the same rows of dO·Vᵀ: the two 16×64 score tiles of the backward.
template <typename T, int D>
__device__ __forceinline__ void tile_s_dp(float (&s)[8][4], float (&dp)[8][4], const T* sQ, const T* sdO, int r0,
                                          const T* sK, const T* sV) {
  constexpr int ld = D + kPad;
  uint32_t fa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) frag_a(fa[kk], sQ, ld, r0, kk * 16);
  tile_abt<T, D>(s, fa, sK);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) frag_a(fa[kk], sdO, ld, r0, kk * 16);
  tile_abt<T, D>(dp, fa, sV);
}

// The warp's 16 keys (columns [m0, m0+16) of the [64 queries][lds] tiles sP/sdS): dV += p̃ᵀ·dO, dK += dSᵀ·Q
// over a query tile's 64 rows.
template <typename T, int D>
__device__ __forceinline__ void tile_dkv(float (&dk)[D / 8][4], float (&dv)[D / 8][4], const T* sP, const T* sdS,
                                         int lds, int m0, const T* sQ, const T* sdO) {
  constexpr int ld = D + kPad;
#pragma unroll
  for (int kk = 0; kk < kBlock / 16; ++kk) {
    uint32_t pa[4], sa[4];
    frag_a_t(pa, sP, lds, m0, kk * 16);
    frag_a_t(sa, sdS, lds, m0, kk * 16);
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      uint32_t b[4];
      frag_b_cols(b, sdO, ld, n * 8, kk * 16);
      mma16816<T>(dv[n], pa, b[0], b[1]);
      mma16816<T>(dv[n + 1], pa, b[2], b[3]);
      frag_b_cols(b, sQ, ld, n * 8, kk * 16);
      mma16816<T>(dk[n], sa, b[0], b[1]);
      mma16816<T>(dk[n + 1], sa, b[2], b[3]);
    }
  }
}

// Rows [i0, i0+16) (those < rows) × columns [col, col + 8N) of a row-major output with `stride`, from a warp's
// m16n8 accumulators, times scale.
template <typename T, int N>
__device__ __forceinline__ void store_tile(T* out, int64_t stride, int i0, int rows, int col, const float (&acc)[N][4],
                                           float scale) {
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + g + 8 * r;
    if (i >= rows) continue;
#pragma unroll
    for (int n = 0; n < N; ++n)
      *reinterpret_cast<uint32_t*>(out + int64_t(i) * stride + col + n * 8 + 2 * c) =
          pack2<T>(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale);
  }
}

// store_tile of a warp's whole rows (columns [0, D)) where the call folds rotary positions into its stores
// (AttentionArgs::rot, dim > 0): the warp's rows, times scale, go through `stage` (the warp's own [16][D + 4]
// floats of shared memory, since a rotated column's partner may sit in another lane), then each lane writes 8
// columns of a row at a time, the first rot.dim through the transpose of the rotation. Row i has position i of
// batch b. Without rotary positions, store_tile.
template <typename T, int D>
__device__ __forceinline__ void store_rows(T* out, int64_t stride, int i0, int rows, const float (&acc)[D / 8][4],
                                           float scale, const AttentionRotary& rot, int b, float* stage) {
  if (rot.dim == 0) {
    store_tile<T, D / 8>(out, stride, i0, rows, 0, acc, scale);
    return;
  }
  const bool pairs = (reinterpret_cast<uintptr_t>(rot.cos) | reinterpret_cast<uintptr_t>(rot.sin) |
                      uintptr_t(rot.stride_batch | rot.stride_seq) * 4) % 8 == 0;
  if (rot.dim == D && pairs) {
    // Over the whole head dim each column's partner (j ± D/2) is D/16 of the lane's 8-column tiles away, in the
    // lane's own registers: the rotation needs no staging. Same arithmetic as below, tables read as pairs.
    constexpr int kHalf = D / 16;
    const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    float y[D / 8][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = min(i0 + g + 8 * r, rows - 1);  // a row past the end is not stored: any row's tables do
      const int64_t at = b * rot.stride_batch + int64_t(i) * rot.stride_seq + 2 * c;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int m = n < kHalf ? n + kHalf : n - kHalf;
        const float2 cs = __ldg(reinterpret_cast<const float2*>(rot.cos + at + 8 * n));
        const float2 sn = __ldg(reinterpret_cast<const float2*>(rot.sin + at + 8 * m));
        const float t0 = acc[m][2 * r] * scale * sn.x, t1 = acc[m][2 * r + 1] * scale * sn.y;
        y[n][2 * r] = fmaf(acc[n][2 * r] * scale, cs.x, n < kHalf ? t0 : -t0);
        y[n][2 * r + 1] = fmaf(acc[n][2 * r + 1] * scale, cs.y, n < kHalf ? t1 : -t1);
      }
    }
    store_tile<T, D / 8>(out, stride, i0, rows, 0, y, 1.f);
    return;
  }
  constexpr int ld = D + 4;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      *reinterpret_cast<float2*>(stage + (g + 8 * r) * ld + n * 8 + 2 * c) =
          make_float2(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale);
  __syncwarp();
  const int half = rot.dim / 2;
  for (int item = lane; item < 16 * (D / 8); item += 32) {
    const int row = item / (D / 8), col = item % (D / 8) * 8, i = i0 + row;
    if (i >= rows) continue;
    const float* x = stage + row * ld;
    const int64_t at = b * rot.stride_batch + int64_t(i) * rot.stride_seq;
    uint32_t packed[4];
#pragma unroll
    for (int e = 0; e < 8; e += 2) {
      float y[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int j = col + e + u;
        y[u] = x[j];
        if (j < rot.dim) {  // dx_a = g_a·cos_a + g_b·sin_b, dx_b = g_b·cos_b − g_a·sin_a (rotary.cu)
          const int p = j < half ? j + half : j - half;
          const float t = x[p] * rot.sin[at + p];
          y[u] = fmaf(x[j], rot.cos[at + j], j < half ? t : -t);
        }
      }
      packed[e / 2] = pack2<T>(y[0], y[1]);
    }
    *reinterpret_cast<uint4*>(out + int64_t(i) * stride + col) =
        make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

// ---- asynchronous global → shared copies (cp.async, sm_80+) ------------------------------------------
// The copies bypass registers, so a thread issues every chunk of a tile back-to-back (no load → store
// dependency per chunk) and goes on computing on the other buffer while they land. Each thread waits for
// its own groups only (cp.async.wait_group); a __syncthreads after the wait publishes all threads' chunks.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Block until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The tile pipeline of the sm_80 kernels, two buffers: issue(t) starts the copies (and plain shared-memory stores)
// of tile t into buffer t & 1. Every step commits one group of copies, empty when there is no tile to issue, so
// that group t is tile t's. Start: what the caller issued before, plus tile 0 when there is one, is group 0, tile 1
// group 1; returns once group 0 is visible to all threads, group 1 still in flight. (The Hopper kernels have the
// TMA unit copy their tiles instead: attention_sm90.cuh.)
template <typename Issue>
__device__ __forceinline__ void pipeline_start(int n_tiles, Issue&& issue) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    if (s < n_tiles) issue(s);
    cp_async_commit();
  }
  cp_async_wait<1>();
  __syncthreads();
}

// End of iteration t (block-uniform): tile t + 1 becomes visible to all, and no thread reads buffer t & 1 — nor
// anything else iteration t read — any more, so tile t + 2 goes there, in flight while tile t + 1 is computed on.
// After the last tile shared memory is no longer touched.
template <typename Issue>
__device__ __forceinline__ void pipeline_next(int t, int n_tiles, Issue&& issue) {
  if (t + 1 < n_tiles) {
    cp_async_wait<0>();
    __syncthreads();
    if (t + 2 < n_tiles) issue(t + 2);
    cp_async_commit();
  }
}

// Issue (not wait for) the copy of a [64 × D] tile of a strided operand into shared memory (pitch
// D + kPad); rows ≥ valid are zero-filled (src-size 0: nothing is read, but the source operand must still
// be a valid global address, so those rows name the tile's base row, which callers guarantee exists).
// The copy is made by the 128 threads tid ∈ [0, kThreads) (threadIdx.x, or one 128-thread group's index).
template <typename T, int D>
__device__ __forceinline__ void load_tile_async(T* s, const T* g, int64_t row_stride, int valid,
                                                int tid = threadIdx.x) {
  constexpr int kChunks = D / 8;                 // 16-byte chunks per row
  constexpr int kRowsPerPass = kThreads / kChunks;  // rows one pass of the block covers
  static_assert(kThreads % kChunks == 0 && kBlock % kRowsPerPass == 0, "every thread issues the same chunks");
  // A thread copies column chunk tid % kChunks of rows r, r + kRowsPerPass, ...: one source
  // pointer stepped by a row stride multiple (not one 64-bit offset per chunk, which the compiler would
  // keep live across the whole key loop).
  const int r = tid / kChunks, col = (tid % kChunks) * 8;
  const T* src = g + r * row_stride + col;
  const int64_t step = kRowsPerPass * row_stride;
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(s + r * (D + kPad) + col));
#pragma unroll
  for (int it = 0; it < kBlock / kRowsPerPass; ++it, src += step) {
    const bool in = r + it * kRowsPerPass < valid;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                     dst + static_cast<uint32_t>(it * kRowsPerPass * (D + kPad) * sizeof(T))),
                 "l"(in ? src : g), "r"(in ? 16 : 0)
                 : "memory");
  }
}

// Masks of one (batch, head).
struct Visibility {
  const uint8_t* pad;  // this batch's row of the key-padding mask, or null
  int q_len, k_len;
  bool causal;
  // 0 for a visible key, −inf for a padded one or one past k_len: added to the scaled score. Threads
  // [0, kBlock) fill the block of keys [k0, k0 + kBlock).
  __device__ __forceinline__ float key_bias(int j) const {
    return j >= k_len || (pad != nullptr && pad[j]) ? -kInf : 0.f;
  }
  __device__ __forceinline__ void fill_key_bias(float* bias, int k0) const {
    if (threadIdx.x < kBlock) bias[threadIdx.x] = key_bias(k0 + threadIdx.x);
  }
  // Some (query, key) of the rows [i0, i0 + 16) × keys [k0, k0 + kBlock) is above the causal diagonal.
  __device__ __forceinline__ bool crosses_diagonal(int i0, int k0) const {
    return causal && k0 + kBlock - 1 > i0 + k_len - q_len;
  }
  // Keys [0, end) can be visible to some query of the block [q0, q0 + kBlock).
  __device__ __forceinline__ int key_end(int q0) const {
    return causal ? max(0, min(k_len, q0 + kBlock + k_len - q_len)) : k_len;
  }
  // Keys [k0, k0 + kBlock) all have key bias 0 (no padding mask, none past k_len).
  __device__ __forceinline__ bool plain_keys(int k0) const { return pad == nullptr && k0 + kBlock <= k_len; }
  // Queries [begin, q_len) can see some key of the block [k0, k0 + kBlock); begin is a block start.
  __device__ __forceinline__ int query_begin(int k0) const {
    return causal ? max(0, k0 - (k_len - q_len)) / kBlock * kBlock : 0;
  }
};

// s ← −inf where the key has key bias −inf or lies above the causal diagonal: the masked raw scores of a 16×64
// tile (rows i0 + g, i0 + g + 8; keys k0 + column). The scores stay unscaled: the exp2 that follows takes
// scale2·s − (max or lse) in one FFMA (a key bias is 0 or −inf, so masking it is adding it).
__device__ __forceinline__ void mask_scores(float (&s)[8][4], const float* bias, const Visibility& vis, int i0,
                                            int k0) {
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  if (!vis.plain_keys(k0)) {
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      const float2 kb = *reinterpret_cast<const float2*>(bias + n * 8 + 2 * c);
      if (kb.x != 0.f) s[n][0] = s[n][2] = -kInf;
      if (kb.y != 0.f) s[n][1] = s[n][3] = -kInf;
    }
  }
  if (vis.crosses_diagonal(i0, k0)) {
    const int shift = vis.k_len - vis.q_len;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (k0 + n * 8 + 2 * c + (e & 1) > i0 + g + 8 * (e >> 1) + shift) s[n][e] = -kInf;
  }
}

// Where element e of a lane's C tile n sits in the lane's keep word (see keep_bits): byte 2·(n & 1) + (e >> 1),
// bit 2·(n >> 1) + (e & 1) of it. The byte is the quad lane that drew the element, so keep_bits gathers the words
// with two shuffles.
__host__ __device__ constexpr int keep_bit(int n, int e) {
  return 8 * (2 * (n & 1) + (e >> 1)) + 2 * (n >> 1) + (e & 1);
}

// Dropout of a 16×64 tile (rows row0 + g and row0 + g + 8 of the flat [batch·heads·q_len] rows, keys
// [j0, j0 + 64)): bit keep_bit(n, e) set ⇔ element e of the thread's C tile n is kept.
struct TileDropout {
  PhiloxSeedOffset so;
  uint32_t threshold;
  int k_len;

  __device__ __forceinline__ uint32_t keep_bits(int64_t row0, int j0) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    uint32_t bits = 0;
    if (k_len % 8 == 0) {
      // Quad lane c draws the groups of row g + 8·(c & 1), C tiles 2q + (c >> 1) (q = 0..3): eight keys each, of
      // which quad lane d holds columns 2d and 2d + 1. Its 32 compares go to byte d of x, bit 2q + p for column
      // 2d + p of group q, so the word lane d needs is byte d of each quad lane's x: a 4×4 byte transpose.
      uint32_t x = 0;
      const int64_t row = row0 + g + 8 * (c & 1);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t first = row * k_len + j0 + (2 * q + (c >> 1)) * 8;
        const uint4 r = dropout_bits(so.seed, so.offset, static_cast<uint64_t>(first) / 8);
#pragma unroll
        for (int d = 0; d < 4; ++d) {
          const uint32_t w = word_of(r, d);  // columns 2d (low half) and 2d + 1 (high half)
          x |= uint32_t((w & 0xFFFFu) >= threshold) << (8 * d + 2 * q);
          x |= uint32_t((w >> 16) >= threshold) << (8 * d + 2 * q + 1);
        }
      }
      // Step 1, with quad lane c ^ 2: z = the bytes for lanes c and c ^ 1 from lanes c and c ^ 2, ordered by the
      // sender's bit 1. Step 2, with c ^ 1: byte k of the result is quad lane k's byte for lane c.
      // (__byte_perm: selector nibble i picks byte i of the result from the 8 bytes {a, b}.)
      const uint32_t y = __shfl_xor_sync(0xffffffffu, x, 2);
      const uint32_t own = c, mate = c ^ 1, hi = (c >> 1) * 4;  // hi: y's bytes (4..7) come first for c ≥ 2
      const uint32_t sel = (own + hi) | (own + 4 - hi) << 4 | (mate + hi) << 8 | (mate + 4 - hi) << 12;
      const uint32_t z = __byte_perm(x, y, sel);
      const uint32_t t = __shfl_xor_sync(0xffffffffu, z, 1);
      bits = __byte_perm(z, t, (c & 1) ? 0x1706u : 0x7160u);
    } else {  // (a loop, not unrolled: 32 Philox calls inlined at every call site made the kernels slow to build)
#pragma unroll 1
      for (int n = 0; n < 8; ++n)
#pragma unroll 1
        for (int e = 0; e < 4; ++e) {
          const int64_t i = (row0 + g + 8 * (e >> 1)) * k_len + j0 + n * 8 + 2 * c + (e & 1);
          bits |= uint32_t(dropout_keep(so.seed, so.offset, static_cast<uint64_t>(i), threshold)) << keep_bit(n, e);
        }
    }
    return bits;
  }
};

// What every kernel derives from the arguments: its (batch, query head), masks, dropout.
template <typename T>
struct Setup {
  int b, h;
  int64_t bh;  // b·heads + h
  Visibility vis;
  TileDropout drop;
  bool dropout;
  float inv_keep, scale2;
  uint32_t* keep;  // AttentionArgs::keep
  __device__ Setup(const AttentionArgs<T>& a, int bh_)
      : b(bh_ / a.heads), h(bh_ % a.heads), bh(bh_), keep(a.keep) {
    vis = {a.key_padding_mask ? a.key_padding_mask + int64_t(b) * a.k_len : nullptr, a.q_len, a.k_len, a.causal};
    drop = {{0, 0}, 0u, a.k_len};
    dropout = a.dropout_p > 0.f;
    if (dropout) {
      drop.so = resolve_philox(a.rng);
      drop.threshold = dropout_threshold(a.dropout_p);
    }
    inv_keep = a.dropout_p < 1.f ? 1.f / (1.f - a.dropout_p) : 0.f;
    scale2 = a.scale * kLog2e;  // exp2 domain
  }
  // This (batch, head)'s matrix of a per-query-head operand (q, out, dout, dq) ...
  template <typename U>
  __device__ U* at(const Strided<U>& s) const { return s.ptr + b * s.batch + h * s.head; }
  // ... and of a per-K/V-head one (k, v, dk, dv): K/V head kv_head(a). (Derived here, not kept: the dK/dV kernels
  // are at their register cap.)
  __device__ int kv_head(const AttentionArgs<T>& a) const { return h / (a.heads / a.kv_heads); }
  template <typename U>
  __device__ U* at_kv(const Strided<U>& s, const AttentionArgs<T>& a) const {
    return s.ptr + b * s.batch + kv_head(a) * s.head;
  }
  // The setup of query head h + j (same batch and K/V group): the dK/dV kernels walk a group's heads.
  __device__ Setup head(int j) const {
    Setup s = *this;
    s.h += j;
    s.bh += j;
    return s;
  }
  // This lane's word of `keep` for the 16×64 tile of queries [i0, i0 + 16) × keys [k0, k0 + 64).
  __device__ uint32_t* keep_word(int i0, int k0) const {
    const int row_groups = (vis.q_len + kBlock - 1) / kBlock * 4, key_tiles = (vis.k_len + kBlock - 1) / kBlock;
    return keep + ((bh * row_groups + i0 / 16) * key_tiles + k0 / kBlock) * 32 + (threadIdx.x & 31);
  }
  // The backward's dropout bits of that tile: the forward's when it kept them, else drawn again.
  __device__ uint32_t tile_keep_bits(int i0, int k0) const {
    return keep != nullptr ? *keep_word(i0, k0) : drop.keep_bits(bh * vis.q_len + i0, k0);
  }
};


// ---- what the forward kernels (attention.cu, attention_sm90.cu) do with a score tile ------------------
// One step of the online softmax over the warp's 16×64 tiles of raw scores s (rows i0 + g, i0 + g + 8; keys
// k0 + column) that the step takes, in three parts: tile_max on each tile (masked; the rows' max over the step's
// tiles), rescale_rows once (the rows' exp2 offset m moved when a score passes it, and this lane's part of their
// running sum l and o rescaled to it), tile_probs on each tile (s replaced by p̃ = z·exp2(s − m); with kKeep the
// tile's dropout bits also go to *keep_out). softmax_step is the step of one tile.
template <typename T>
__device__ __forceinline__ void tile_max(float (&s)[8][4], const Setup<T>& st, const float* bias, int i0, int k0,
                                         float (&mx)[2]) {
  mask_scores(s, bias, st.vis, i0, k0);
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
}

// mx: this lane's max of the step's raw scores (tile_max); base: the exp2 offset of tile_probs.
// m is the exp2 offset of l and o, not always the rows' max: it moves (and o and l are rescaled) only when a row of
// the warp sees a score more than kLazyRescale above it, so p̃ stays ≤ 2^kLazyRescale and most steps after the
// first few skip the rescale. lse = m + log2(l) holds for any such m.
template <typename T, int D>
__device__ __forceinline__ void rescale_rows(float (&mx)[2], float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                                             const Setup<T>& st, float (&base)[2]) {
  constexpr float kLazyRescale = 8.f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    mx[r] *= st.scale2;  // the max of the scaled scores (scale2 > 0, and rounding keeps their order)
  }
  const bool move = __any_sync(0xffffffffu, mx[0] > m[0] + kLazyRescale || mx[1] > m[1] + kLazyRescale);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (move) {
      const float m_new = fmaxf(m[r], mx[r]);
      const float alpha = exp2f(m[r] - (m_new == -kInf ? 0.f : m_new));
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }
    base[r] = m[r] == -kInf ? 0.f : m[r];  // a row with nothing visible yet: exp2(−inf − 0) = 0
  }
}

template <typename T, bool kKeep>
__device__ __forceinline__ void tile_probs(float (&s)[8][4], const float (&base)[2], float (&l)[2],
                                           const Setup<T>& st, int i0, int k0, uint32_t* keep_out) {
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2f(fmaf(s[n][e], st.scale2, -base[e >> 1]));
      l[e >> 1] += s[n][e];
    }
  if (st.dropout) {
    const uint32_t bits = st.drop.keep_bits(st.bh * st.vis.q_len + i0, k0);
    if constexpr (kKeep) *keep_out = bits;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = (bits >> keep_bit(n, e)) & 1u ? s[n][e] * st.inv_keep : 0.f;
  }
}

template <typename T, int D, bool kKeep>
__device__ __forceinline__ void softmax_step(float (&s)[8][4], float (&o)[D / 8][4], float (&m)[2], float (&l)[2],
                                             const Setup<T>& st, const float* bias, int i0, int k0,
                                             uint32_t* keep_out) {
  float mx[2] = {-kInf, -kInf}, base[2];
  tile_max(s, st, bias, i0, k0, mx);
  rescale_rows<T, D>(mx, o, m, l, st, base);
  tile_probs<T, kKeep>(s, base, l, st, i0, k0, keep_out);
}

// The forward's end: the warp's 16 rows of out = o / l and their lse.
template <typename T, int D>
__device__ __forceinline__ void store_out_lse(const AttentionArgs<T>& a, const Setup<T>& st, int i0,
                                              const float (&o)[D / 8][4], const float (&m)[2], float (&l)[2]) {
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  T* out = st.at(a.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    const int i = i0 + g + 8 * r;
    if (i >= a.q_len) continue;
    const float inv_l = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(out + int64_t(i) * a.out.row + n * 8 + 2 * c) =
          pack2<T>(o[n][2 * r] * inv_l, o[n][2 * r + 1] * inv_l);
    if (c == 0) a.lse[st.bh * a.q_len + i] = l[r] > 0.f ? (m[r] + log2f(l[r])) / kLog2e : kInf;
  }
}

// ---- what the backward kernels (attention_bwd.cu, attention_sm90_bwd.cu) do with a score tile ---------
// From S (s, raw scores) and dP (dp) of a 16×64 tile: dS into s. lse2/delta: the two rows' lse (exp2 domain) and Δ.
// kDropout: st.dropout, as a template parameter so that the tile without dropout has no keep-bit selects; bits:
// the tile's keep bits (st.tile_keep_bits, which the Hopper kernel reads while S's and dP's MMAs run), read only
// with kDropout.
template <typename T, bool kDropout>
__device__ __forceinline__ void tile_ds(float (&s)[8][4], const float (&dp)[8][4], const Setup<T>& st,
                                        const float* bias, const float (&lse2)[2], const float (&delta)[2], int i0,
                                        int k0, uint32_t bits) {
  mask_scores(s, bias, st.vis, i0, k0);
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = exp2f(fmaf(s[n][e], st.scale2, -lse2[e >> 1]));
      const float z = kDropout ? ((bits >> keep_bit(n, e)) & 1u ? st.inv_keep : 0.f) : 1.f;
      s[n][e] = p * (dp[n][e] * z - delta[e >> 1]);
    }
}

// The dropout keep bit of each element of the warp's transposed 16 × 64 tile (tile_ds_t) as keep_bit(n, e) of the
// result: words holds the tile's 128 keep words in the forward's layout (word 32·r + l: lane l of the warp of query
// rows [16r, 16r + 16), its bits as keep_bit places them). Element (n, e) is key 16·warp + g + 8·(e >> 1), query
// 8n + 2c + (e & 1): drawn by lane 4·(query % 8) + (key % 8) / 2 of row group n / 2, as its C tile key / 8,
// element 2·(n & 1) + key % 2.
__device__ __forceinline__ uint32_t tile_keep_t(const uint32_t* words) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  uint32_t bits = 0;
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      const uint32_t w = words[32 * r + 4 * (2 * c + col) + g / 2];
#pragma unroll
      for (int nn = 0; nn < 2; ++nn)
#pragma unroll
        for (int row = 0; row < 2; ++row)
          bits |= ((w >> keep_bit(2 * warp + row, 2 * nn + (g & 1))) & 1u) << keep_bit(2 * r + nn, 2 * row + col);
    }
  return bits;
}

// tile_ds on transposed tiles, as the dK/dV kernels compute them (rows are the CTA's keys): from Sᵀ (s) and dPᵀ
// (dp) of the warp's 16 keys (rows kr0 + g, kr0 + g + 8) × the 64 queries q0 + column, dSᵀ into s and P̃ᵀ into dp.
// lse2 / delta: the query tile's 64 lse (exp2 domain) and Δ; bits: the tile's keep bits (tile_keep_t), read only
// with kDropout.
// Each element's arithmetic is tile_ds's, so P̃ and dS are bitwise the same, except in the rows of keys with key
// bias −inf, which are left unmasked: a row of P̃ᵀ or dSᵀ reaches only its own key's row of dV or dK, which
// zero_masked_keys then sets.
template <typename T, bool kDropout>
__device__ __forceinline__ void tile_ds_t(float (&s)[8][4], float (&dp)[8][4], const Setup<T>& st,
                                          const float* lse2, const float* delta, uint32_t bits, int kr0, int q0) {
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int shift = st.vis.k_len - st.vis.q_len;
  if (st.vis.causal && kr0 + 15 > q0 + shift) {  // a tile the diagonal crosses: −inf above it (a uniform branch)
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (kr0 + g + 8 * (e >> 1) > q0 + n * 8 + 2 * c + (e & 1) + shift) s[n][e] = -kInf;
  }
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float2 l = *reinterpret_cast<const float2*>(lse2 + n * 8 + 2 * c);
    const float2 d = *reinterpret_cast<const float2*>(delta + n * 8 + 2 * c);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = e & 1;
      const float p = exp2f(fmaf(s[n][e], st.scale2, -(col ? l.y : l.x)));
      const float z = kDropout ? ((bits >> keep_bit(n, e)) & 1u ? st.inv_keep : 0.f) : 1.f;
      s[n][e] = p * (dp[n][e] * z - (col ? d.y : d.x));
      dp[n][e] = p * z;
    }
  }
}

// dK and dV of the warp's key rows g, g + 8 (key_bias: theirs) that no query sees: 0, whatever tile_ds_t gave them.
template <int N>
__device__ __forceinline__ void zero_masked_keys(float (&dk)[N][4], float (&dv)[N][4], const float (&key_bias)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
    if (key_bias[r] != 0.f)
#pragma unroll
      for (int n = 0; n < N; ++n) dk[n][2 * r] = dk[n][2 * r + 1] = dv[n][2 * r] = dv[n][2 * r + 1] = 0.f;
}

// The query tiles a dK/dV CTA walks: query tiles [0, q_tiles) (queries from begin + 64·tile) of its first query
// head, then of the next head, ... A caller that takes the tiles one at a time in order holds a walk of its own and
// steps it (an add and a compare) instead of dividing a tile's index by q_tiles.
struct QueryWalk {
  int head = 0, start;
  __device__ __forceinline__ explicit QueryWalk(int begin) : start(begin) {}
  // To the next tile; end = begin + 64·q_tiles.
  __device__ __forceinline__ void step(int begin, int end) {
    start += kBlock;
    if (start >= end) {
      start = begin;
      ++head;
    }
  }
};

// The (batch, query head) index of the first query head of K/V group bkv = batch·kv_heads + K/V head: the dK/dV
// kernels run one CTA (per key block) for each K/V head and walk its heads / kv_heads query heads.
template <typename T>
__device__ __forceinline__ int group_first_head(const AttentionArgs<T>& a, int bkv) {
  return (bkv / a.kv_heads) * a.heads + (bkv % a.kv_heads) * (a.heads / a.kv_heads);
}

// The unit and block of CTA x of a grid of `blocks` blocks a unit (a unit: a (batch, query head) for the forward
// and dQ kernels, a (batch, K/V head) group for dK/dV). Under a causal mask with at least kLongestFirstBlocks
// blocks a unit, the blocks from the longest walk (the last query block, or the first key block: last_longest
// false) to the shortest, each over all units, so that the grid ends on short walks instead of some unit's
// longest; otherwise a unit's blocks one after another, which keeps their shared tiles in L2 (with fewer, longer-
// first order loses more in L2 than it saves at the grid's end: performance-notes.md).
constexpr int kLongestFirstBlocks = 16;
struct GridSlot {
  int unit, block;
};
__device__ __forceinline__ GridSlot grid_slot(int x, int units, int blocks, bool causal, bool last_longest) {
  if (causal && blocks >= kLongestFirstBlocks) {
    const int r = x / units;
    return {x % units, last_longest ? blocks - 1 - r : r};
  }
  return {x / blocks, x % blocks};
}

// Launch kernel(args...) with `bytes` of dynamic shared memory (opting in above the 48 KB default when needed), in
// clusters of `cluster` consecutive CTAs when more than one (sm_90).
template <typename Kernel, typename... Args>
cudaError_t launch_kernel(Kernel kernel, int64_t blocks, size_t bytes, cudaStream_t stream, int threads, int cluster,
                          const Args&... args) {
  if (blocks == 0) return cudaSuccess;
  if (bytes > 48 * 1024) {
    const cudaError_t err = allow_dynamic_smem(kernel, int(bytes));
    if (err != cudaSuccess) return err;
  }
  if (cluster == 1) return launch_dependent(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), bytes, stream,
                                           args...);
  cudaLaunchAttribute attrs[2] = {};
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = cluster;
  attrs[0].val.clusterDim.y = attrs[0].val.clusterDim.z = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // as launch_dependent's launches
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(blocks));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = bytes;
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = 2;  // clusters exist from sm_90 on, as dependent launches do
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

// The launch of a kernel that takes the arguments alone.
template <typename Kernel, typename T>
cudaError_t launch(Kernel kernel, int64_t blocks, size_t bytes, const AttentionArgs<T>& a, cudaStream_t stream,
                   int threads = kThreads, int cluster = 1) {
  return launch_kernel(kernel, blocks, bytes, stream, threads, cluster, a);
}

}  // namespace

// Up to how many keys the one-CTA backward (attention_bwd_short.cu) runs: two 64-key groups split dQ's
// columns, so D / 2 must be a multiple of 16; head_dim 16 has one group.
constexpr int attention_short_keys(int head_dim) { return head_dim >= 32 ? 128 : 64; }

template <typename T>
cudaError_t launch_attention_bwd_short(const AttentionArgs<T>& a, cudaStream_t stream);

// Whether a call of this head dim runs the Hopper kernels: attention_sm90_available and set_attention_sm90
// (attention.h) allow it, and head_dim is 64 or 128.
bool attention_sm90_runs(int head_dim);

template <typename T>
cudaError_t launch_attention_fwd_sm90(const AttentionArgs<T>& a, cudaStream_t stream);
// The tiled backward (dQ, then dK/dV) of calls with more keys than attention_short_keys.
template <typename T>
cudaError_t launch_attention_bwd_sm90(const AttentionArgs<T>& a, cudaStream_t stream);

}  // namespace lsmini
