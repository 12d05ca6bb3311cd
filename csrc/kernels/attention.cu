/*
 * attention.cu — fused scaled-dot-product attention, forward and backward, that never writes the
 * [batch, heads, q_len, k_len] scores or probabilities to memory (the FlashAttention-2 scheme, on
 * mma.sync tensor cores, fp32 accumulation).
 *
 * Layout: q [batch, heads, q_len, d], k and v [batch, heads, k_len, d], out/dout/dq like q, dk/dv like
 * k: each with its own element strides for batch, head and row (attention.h's Strided; head_dim
 * contiguous, rows 16-byte aligned). So the layers read Q, K and V straight out of their fused
 * projection [tokens, 3·hidden] and write the output in the merged [batch, q_len, heads·d] layout the
 * output projection reads — no head split/merge passes. lse [batch, heads, q_len] fp32 is each row's
 * log-sum-exp of its scaled, masked scores, +inf for a row with every key masked.
 *
 * Math per (batch b, head h), rows i (queries) and columns j (keys):
 *   s_ij = scale·q_i·k_j; masked(i, j) = key_padding[b, j] or (causal and j > i + k_len − q_len)
 *   (causal bottom-right aligned, as attention_softmax); p_ij = exp(s_ij − lse_i), 0 when masked, so a
 *   fully masked row gives out_i = 0; out_i = Σ_j z_ij·p_ij·v_j with z_ij = keep_ij/(1 − dropout_p).
 * Backward: Δ_i = dout_i·out_i, dp_ij = z_ij·dout_i·v_j, ds_ij = p_ij·(dp_ij − Δ_i),
 *   dq_i = scale·Σ_j ds_ij·k_j,  dk_j = scale·Σ_i ds_ij·q_i,  dv_j = Σ_i z_ij·p_ij·dout_i.
 *
 * Dropout: attention_softmax's mask exactly — element (b, h, i, j) has the flat index
 * ((b·heads + h)·q_len + i)·k_len + j under common.cuh's Philox convention — so the fused and the
 * unfused paths drop the same elements. With k_len % 8 == 0 a Philox group is 8 keys of one row: one
 * row of a 16×8 accumulator tile, whose 4 lanes (a quad) each hold two of its columns; each lane of
 * the quad computes one of the quad's 4 groups and the words are swapped with shuffles (1 Philox call
 * per 8 elements). Otherwise one call per element (slow, correct). With AttentionArgs::keep the forward
 * also stores each lane's 32 bits of every tile it computes (a word per lane, attention.h's layout) and the
 * backward kernels read them instead of calling Philox again: the same bits, without the draws that are
 * most of the backward's instructions. Tiles the forward skips (causal) are skipped by the backward too.
 *
 * How: a CTA of 4 warps owns a 64-row block (queries; keys in the dK/dV kernel), each warp 16 rows held
 * as m16n8k16 fragments. The other operand streams through shared memory in 64-row tiles, rows padded
 * by 8 elements so every fragment load is bank-conflict free. Tiles are copied with cp.async into two
 * buffers: tile t + 1 is in flight while tile t is computed on (one pipeline barrier per tile).
 *   fwd:     per query block, over key tiles: S = QKᵀ, online softmax in registers, O += P̃V.
 *   bwd_dq:  per query block: Δ (kept for bwd_dkv), over key tiles: S, dP, dS, dQ += dS·K.
 *   bwd_dkv: per key block, over query tiles: S, dP, dS as in bwd_dq; P̃ and dS go through shared
 *            memory to be read transposed: dV += P̃ᵀ·dO, dK += dSᵀ·Q.
 * S and dP are recomputed in both backward kernels instead of accumulating dQ with atomics: two more
 * small GEMMs, deterministic results. Up to 128 keys (the usual training lengths), bwd_short does it all
 * in one kernel instead: one CTA holds every key of its (batch, head), so its dQ needs no other CTA.
 * Napkin math (64×16 heads of 128×128, d = 64, fp16): ~17 M score elements; fwd reads Q, K, V and
 * writes O (67 MB), bwd ~3× that — tens of µs where the unfused path moves the 34 MB score matrix
 * through memory ~14 times.
 */
#include "common.cuh"
#include "attention.h"

namespace lsmini {
namespace {

constexpr int kBlock = 64;  // rows of a CTA's block and of a streamed tile
constexpr int kThreads = 128;
constexpr int kPad = 8;     // elements of padding per shared-memory row
constexpr int kTileLd = kBlock + kPad;  // pitch of the 64×64 P̃ / dS tiles
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = __builtin_huge_valf();

// ---- tensor-core fragments (PTX ISA, mma.m16n8k16; g = lane / 4, c = lane % 4) --------------------
// A 16×16 row-major: a0 (g, 2c..2c+1), a1 (g+8, 2c..), a2 (g, 2c+8..), a3 (g+8, 2c+8..)
// B 16×8:            b0 (k = 2c..2c+1, n = g), b1 (k = 2c+8.., n = g)
// C 16×8 fp32:       c0, c1 (g, 2c..2c+1), c2, c3 (g+8, 2c..2c+1)
template <typename T> __device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
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

// ---- asynchronous global → shared copies (cp.async, sm_80+) ------------------------------------------
// The copies bypass registers, so a thread issues every chunk of a tile back-to-back (no load → store
// dependency per chunk) and goes on computing on the other buffer while they land. Each thread waits for
// its own groups only (cp.async.wait_group); a __syncthreads after the wait publishes all threads' chunks.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Block until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The two-buffer tile pipeline of every kernel here; issue(t) starts the copies (and plain shared-memory
// stores) of tile t into buffer t & 1. Start: what the caller issued before, plus tile 0 when there is
// one, is group 0, tile 1 group 1; returns once group 0 is visible to all threads, tile 1 still in flight.
// With n_tiles == 0 and nothing issued before, nothing is left in flight at exit.
template <typename Issue>
__device__ __forceinline__ void pipeline_start(int n_tiles, Issue&& issue) {
  if (n_tiles > 0) issue(0);
  cp_async_commit();
  if (n_tiles > 1) {
    issue(1);
    cp_async_commit();
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
}

// End of iteration t (block-uniform): tile t + 1 becomes visible to all, and no thread reads buffer
// t & 1 — nor anything else iteration t read — any more, so tile t + 2 goes there, in flight while
// tile t + 1 is computed on. After the last tile shared memory is no longer touched.
template <typename Issue>
__device__ __forceinline__ void pipeline_next(int t, int n_tiles, Issue&& issue) {
  if (t + 1 < n_tiles) {
    cp_async_wait<0>();
    __syncthreads();
    if (t + 2 < n_tiles) {
      issue(t + 2);
      cp_async_commit();
    }
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
  // Queries [begin, q_len) can see some key of the block [k0, k0 + kBlock); begin is a block start.
  __device__ __forceinline__ int query_begin(int k0) const {
    return causal ? max(0, k0 - (k_len - q_len)) / kBlock * kBlock : 0;
  }
};

// s ← scale2·s + key bias, −inf above the causal diagonal: the masked scores of a 16×64 tile (rows
// i0 + g, i0 + g + 8; keys k0 + column) in the exp2 domain.
__device__ __forceinline__ void mask_scores(float (&s)[8][4], const float* bias, float scale2, const Visibility& vis,
                                            int i0, int k0) {
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    const float2 kb = *reinterpret_cast<const float2*>(bias + n * 8 + 2 * c);
    s[n][0] = fmaf(s[n][0], scale2, kb.x);
    s[n][1] = fmaf(s[n][1], scale2, kb.y);
    s[n][2] = fmaf(s[n][2], scale2, kb.x);
    s[n][3] = fmaf(s[n][3], scale2, kb.y);
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

// Dropout of a 16×64 tile (rows row0 + g and row0 + g + 8 of the flat [batch·heads·q_len] rows, keys
// [j0, j0 + 64)): bit 4n + e set ⇔ element e of the thread's C tile n is kept.
struct TileDropout {
  PhiloxSeedOffset so;
  uint32_t threshold;
  int k_len;

  __device__ __forceinline__ uint32_t keep_bits(int64_t row0, int j0) const {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    uint32_t bits = 0;
    if (k_len % 8 == 0) {
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        // this lane's group: row g + 8·(c & 1), C tile n + (c >> 1)
        const int64_t row = row0 + g + 8 * (c & 1);
        const int64_t first = row * k_len + j0 + (n + (c >> 1)) * 8;
        const uint4 r = dropout_bits(so.seed, so.offset, static_cast<uint64_t>(first) / 8);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int src = (c - s) & 3;  // the quad lane whose group arrives in this round
          const uint32_t w = __shfl_sync(0xffffffffu, word_of(r, (c + s) & 3), (lane & ~3) | src);
          // w: word c of group src = the 16-bit values of columns 2c and 2c + 1 of that group's row
          const uint32_t k2 = uint32_t((w & 0xFFFFu) >= threshold) | (uint32_t((w >> 16) >= threshold) << 1);
          bits |= k2 << (4 * (n + (src >> 1)) + 2 * (src & 1));
        }
      }
    } else {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t i = (row0 + g + 8 * (e >> 1)) * k_len + j0 + n * 8 + 2 * c + (e & 1);
          bits |= uint32_t(dropout_keep(so.seed, so.offset, static_cast<uint64_t>(i), threshold)) << (4 * n + e);
        }
    }
    return bits;
  }
};

// What every kernel derives from the arguments: its (batch, head), masks, dropout.
template <typename T>
struct Setup {
  int b, h;
  int64_t bh;
  Visibility vis;
  TileDropout drop;
  bool dropout;
  float inv_keep, scale2;
  uint32_t* keep;  // AttentionArgs::keep
  __device__ Setup(const AttentionArgs<T>& a, int bh_) : b(bh_ / a.heads), h(bh_ % a.heads), bh(bh_), keep(a.keep) {
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
  template <typename U>
  __device__ U* at(const Strided<U>& s) const { return s.ptr + b * s.batch + h * s.head; }
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

// ---- forward ---------------------------------------------------------------------------------------
// D ≤ 64: three CTAs per SM (≤ 168 registers; at 170 the allocation granularity leaves room for two).
// D = 128: shared memory allows two anyway.
// kKeep: also store the dropout bits (AttentionArgs::keep). A separate instantiation, because the kernel is at
// its register cap: the store's pointer alone made the one without it spill and run 3-5% slower.
template <typename T, int D, bool kKeep>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 3 : 2) attention_fwd_kernel(const AttentionArgs<T> a) {
  constexpr int ld = D + kPad;
  constexpr int kTile = kBlock * ld;  // elements of one [64 × D] shared tile
  // Q, then K and V double-buffered (buffer b of K at sK + b·kTile), then the key bias of each buffer.
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kTile;
  T* sV = sK + 2 * kTile;
  float* sBias = reinterpret_cast<float*>(sV + 2 * kTile);  // [2][kBlock]

  const int nqb = (a.q_len + kBlock - 1) / kBlock;
  const int q0 = (blockIdx.x % nqb) * kBlock;
  const Setup<T> st(a, blockIdx.x / nqb);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int i0 = q0 + warp * 16;  // the warp's first query

  const T* k = st.at(a.k);
  const T* v = st.at(a.v);
  const int key_end = st.vis.key_end(q0);
  // Key tile `t` into buffer t & 1: K, V (asynchronous) and its key bias (plain stores, published by the
  // same __syncthreads that publishes the copies).
  auto issue_kv = [&](int t) {
    const int kt = t * kBlock, buf = t & 1;
    load_tile_async<T, D>(sK + buf * kTile, k + int64_t(kt) * a.k.row, a.k.row, min(kBlock, a.k_len - kt));
    load_tile_async<T, D>(sV + buf * kTile, v + int64_t(kt) * a.v.row, a.v.row, min(kBlock, a.k_len - kt));
    st.vis.fill_key_bias(sBias + buf * kBlock, kt);
  };
  const int n_tiles = (key_end + kBlock - 1) / kBlock;
  // Prologue: group 0 = Q and key tile 0, group 1 = key tile 1 (still in flight while group 0 is
  // waited for and tile 0 computed on). With no visible key nothing is loaded (the output is 0 and Q is
  // never read), so no copy is ever left in flight at exit.
  uint32_t qa[D / 16][4];
  if (n_tiles > 0) {
    load_tile_async<T, D>(sQ, st.at(a.q) + int64_t(q0) * a.q.row, a.q.row, min(kBlock, a.q_len - q0));
    pipeline_start(n_tiles, issue_kv);  // Q, key tile 0 and bias 0 of every thread are in shared memory
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) frag_a(qa[kk], sQ, ld, warp * 16, kk * 16);
  }

  // Where the dropout bits of key tile t go when kept: keep_row[32·t] (one pointer live across the loop).
  uint32_t* const keep_row = kKeep ? st.keep_word(i0, 0) : nullptr;
  float o[D / 8][4] = {};
  float m[2] = {-kInf, -kInf};  // running max (exp2 domain) of rows g, g + 8
  float l[2] = {0.f, 0.f};      // this lane's part of the running sum
  // At the top of iteration t, tile t is visible in buffer t & 1 and tile t + 1 (if any) is the only
  // group in flight, into the other buffer. One barrier per tile (see the bottom of the loop).
  for (int t = 0; t < n_tiles; ++t) {
    const int k0 = t * kBlock;
    const T* cK = sK + (t & 1) * kTile;
    const T* cV = sV + (t & 1) * kTile;
    const float* cBias = sBias + (t & 1) * kBlock;
    float s[8][4] = {};
    tile_abt<T, D>(s, qa, cK);
    mask_scores(s, cBias, st.scale2, st.vis, i0, k0);
    float mx[2] = {-kInf, -kInf};
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[n][e]);
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r]);
      base[r] = m_new == -kInf ? 0.f : m_new;  // a row with nothing visible yet: exp2(−inf − 0) = 0
      const float alpha = exp2f(m[r] - base[r]);
      m[r] = m_new;
      l[r] *= alpha;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e >> 1]);
        l[e >> 1] += s[n][e];
      }
    if (st.dropout) {
      const uint32_t bits = st.drop.keep_bits(st.bh * a.q_len + i0, k0);
      if constexpr (kKeep) keep_row[32 * t] = bits;
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = (bits >> (4 * n + e)) & 1u ? s[n][e] * st.inv_keep : 0.f;
    }
    tile_xb<T, D>(o, s, cV);
    pipeline_next(t, n_tiles, issue_kv);
  }

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

// From S (s, raw scores) and dP (dp) of a 16×64 tile: dS into s and, with kWantP, p̃ = z·p into dp.
// lse2/delta: the two rows' lse (exp2 domain) and Δ.
template <typename T, bool kWantP>
__device__ __forceinline__ void tile_ds(float (&s)[8][4], float (&dp)[8][4], const Setup<T>& st, const float* bias,
                                        const float (&lse2)[2], const float (&delta)[2], int i0, int k0) {
  mask_scores(s, bias, st.scale2, st.vis, i0, k0);
  const uint32_t bits = st.dropout ? st.tile_keep_bits(i0, k0) : 0xFFFFFFFFu;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = exp2f(s[n][e] - lse2[e >> 1]);
      const float z = st.dropout ? ((bits >> (4 * n + e)) & 1u ? st.inv_keep : 0.f) : 1.f;
      s[n][e] = p * (dp[n][e] * z - delta[e >> 1]);
      if (kWantP) dp[n][e] = p * z;
    }
}

// ---- backward: Δ and dQ ------------------------------------------------------------------------------
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(const AttentionArgs<T> a) {
  constexpr int ld = D + kPad;
  constexpr int kTile = kBlock * ld;
  // Q, dO, then K and V double-buffered, then Δ, lse and the key bias of each buffer.
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sdO = sQ + kTile;
  T* sK = sdO + kTile;
  T* sV = sK + 2 * kTile;
  float* sDelta = reinterpret_cast<float*>(sV + 2 * kTile);
  float* sLse = sDelta + kBlock;
  float* sBias = sLse + kBlock;  // [2][kBlock]

  const int nqb = (a.q_len + kBlock - 1) / kBlock;
  const int q0 = (blockIdx.x % nqb) * kBlock;
  const Setup<T> st(a, blockIdx.x / nqb);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int i0 = q0 + warp * 16;
  const int valid = min(kBlock, a.q_len - q0);

  const T* k = st.at(a.k);
  const T* v = st.at(a.v);
  const int key_end = st.vis.key_end(q0);
  auto issue_kv = [&](int t) {  // key tile t into buffer t & 1, as in the forward kernel
    const int kt = t * kBlock, buf = t & 1;
    load_tile_async<T, D>(sK + buf * kTile, k + int64_t(kt) * a.k.row, a.k.row, min(kBlock, a.k_len - kt));
    load_tile_async<T, D>(sV + buf * kTile, v + int64_t(kt) * a.v.row, a.v.row, min(kBlock, a.k_len - kt));
    st.vis.fill_key_bias(sBias + buf * kBlock, kt);
  };
  const int n_tiles = (key_end + kBlock - 1) / kBlock;
  // Prologue: group 0 = Q, dO and key tile 0 (if any key is visible; Δ needs dO), group 1 = key tile 1,
  // in flight during Δ and tile 0.
  load_tile_async<T, D>(sQ, st.at(a.q) + int64_t(q0) * a.q.row, a.q.row, valid);
  load_tile_async<T, D>(sdO, st.at(a.dout) + int64_t(q0) * a.dout.row, a.dout.row, valid);
  pipeline_start(n_tiles, issue_kv);
  {  // Δ_i = dout_i·out_i: two threads per row
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    float acc = 0.f;
    if (r < valid) {
      const T* o = st.at(a.out) + int64_t(q0 + r) * a.out.row + half * (D / 2);
      const T* d = sdO + r * ld + half * (D / 2);
#pragma unroll
      for (int x = 0; x < D / 2; x += 2) {
        const float2 of = to_float2(*reinterpret_cast<const typename Pair<T>::type*>(o + x));
        const float2 df = to_float2(*reinterpret_cast<const typename Pair<T>::type*>(d + x));
        acc += of.x * df.x + of.y * df.y;
      }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0) {
      sDelta[r] = acc;
      sLse[r] = r < valid ? a.lse[st.bh * a.q_len + q0 + r] * kLog2e : kInf;
      if (r < valid) a.delta[st.bh * a.q_len + q0 + r] = acc;
    }
  }
  __syncthreads();
  uint32_t qa[D / 16][4], da[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    frag_a(qa[kk], sQ, ld, warp * 16, kk * 16);
    frag_a(da[kk], sdO, ld, warp * 16, kk * 16);
  }
  const float lse2[2] = {sLse[warp * 16 + g], sLse[warp * 16 + g + 8]};
  const float delta[2] = {sDelta[warp * 16 + g], sDelta[warp * 16 + g + 8]};

  float dq[D / 8][4] = {};
  // Same pipeline as the forward kernel: at the top of iteration t, tile t is visible in buffer t & 1
  // and only tile t + 1 may be in flight.
  for (int t = 0; t < n_tiles; ++t) {
    const int k0 = t * kBlock;
    const T* cK = sK + (t & 1) * kTile;
    const T* cV = sV + (t & 1) * kTile;
    float s[8][4] = {}, dp[8][4] = {};
    tile_abt<T, D>(s, qa, cK);
    tile_abt<T, D>(dp, da, cV);
    tile_ds<T, false>(s, dp, st, sBias + (t & 1) * kBlock, lse2, delta, i0, k0);
    tile_xb<T, D>(dq, s, cK);
    pipeline_next(t, n_tiles, issue_kv);
  }

  store_tile<T, D / 8>(st.at(a.dq), a.dq.row, i0, a.q_len, 0, dq, a.scale);
}

// ---- backward: dK and dV -----------------------------------------------------------------------------
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkv_kernel(const AttentionArgs<T> a) {
  constexpr int ld = D + kPad;
  constexpr int kTile = kBlock * ld;
  // K, V (loaded once), Q and dO double-buffered, P̃, dS (single), lse and Δ double-buffered, key bias.
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kTile;
  T* sQ = sV + kTile;              // [2] tiles
  T* sdO = sQ + 2 * kTile;         // [2] tiles
  T* sP = sdO + 2 * kTile;         // [64 queries][kTileLd]: p̃
  T* sdS = sP + kBlock * kTileLd;  // [64 queries][kTileLd]: dS
  float* sLse = reinterpret_cast<float*>(sdS + kBlock * kTileLd);  // [2][kBlock]
  float* sDelta = sLse + 2 * kBlock;                                // [2][kBlock]
  float* sBias = sDelta + 2 * kBlock;

  const int nkb = (a.k_len + kBlock - 1) / kBlock;
  const int k0 = (blockIdx.x % nkb) * kBlock;
  const Setup<T> st(a, blockIdx.x / nkb);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int r0 = warp * 16;  // the warp's query rows of a tile, then its key rows of the block

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const T* q = st.at(a.q);
  const T* dout = st.at(a.dout);
  const int q_begin = st.vis.query_begin(k0);
  // Query tile t (queries from q_begin + 64t) into buffer t & 1: Q, dO (asynchronous), lse and Δ
  // (plain stores, published by the same barrier as the copies).
  auto issue_q = [&](int t) {
    const int qt = q_begin + t * kBlock, buf = t & 1;
    const int qvalid = min(kBlock, a.q_len - qt);
    load_tile_async<T, D>(sQ + buf * kTile, q + int64_t(qt) * a.q.row, a.q.row, qvalid);
    load_tile_async<T, D>(sdO + buf * kTile, dout + int64_t(qt) * a.dout.row, a.dout.row, qvalid);
    if (threadIdx.x < kBlock) {
      const int r = threadIdx.x;
      sLse[buf * kBlock + r] = r < qvalid ? a.lse[st.bh * a.q_len + qt + r] * kLog2e : kInf;
      sDelta[buf * kBlock + r] = r < qvalid ? a.delta[st.bh * a.q_len + qt + r] : 0.f;
    }
  };
  const int n_tiles = (max(0, a.q_len - q_begin) + kBlock - 1) / kBlock;
  // Prologue: group 0 = this block's K and V and query tile 0, group 1 = query tile 1. With no query
  // tile (causal, every query before the block) nothing is loaded and dK = dV = 0, so no copy is left in
  // flight at exit.
  if (n_tiles > 0) {
    const int kvalid = min(kBlock, a.k_len - k0);
    load_tile_async<T, D>(sK, st.at(a.k) + int64_t(k0) * a.k.row, a.k.row, kvalid);
    load_tile_async<T, D>(sV, st.at(a.v) + int64_t(k0) * a.v.row, a.v.row, kvalid);
    st.vis.fill_key_bias(sBias, k0);
    pipeline_start(n_tiles, issue_q);
  }

  // At the top of iteration t, query tile t is visible in buffer t & 1 and only tile t + 1 may be in
  // flight; two barriers per iteration: P̃/dS written → read (middle), and the pipeline barrier (bottom).
  for (int t = 0; t < n_tiles; ++t) {
    const int q0 = q_begin + t * kBlock;
    const T* cQ = sQ + (t & 1) * kTile;
    const T* cdO = sdO + (t & 1) * kTile;
    float s[8][4] = {}, dp[8][4] = {};
    tile_s_dp<T, D>(s, dp, cQ, cdO, r0, sK, sV);
    const float* cLse = sLse + (t & 1) * kBlock;
    const float* cDelta = sDelta + (t & 1) * kBlock;
    const float lse2[2] = {cLse[r0 + g], cLse[r0 + g + 8]};
    const float delta[2] = {cDelta[r0 + g], cDelta[r0 + g + 8]};
    tile_ds<T, true>(s, dp, st, sBias, lse2, delta, q0 + r0, k0);
    // sP/sdS: their readers (iteration t − 1) all passed that iteration's closing barrier.
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int off = (r0 + g + 8 * r) * kTileLd + n * 8 + 2 * c;
        *reinterpret_cast<uint32_t*>(sP + off) = pack2<T>(dp[n][2 * r], dp[n][2 * r + 1]);
        *reinterpret_cast<uint32_t*>(sdS + off) = pack2<T>(s[n][2 * r], s[n][2 * r + 1]);
      }
    __syncthreads();  // every warp's rows of P̃ and dS are written
    tile_dkv<T, D>(dk, dv, sP, sdS, kTileLd, r0, cQ, cdO);  // the warp's 16 keys [r0, r0 + 16) of the block
    pipeline_next(t, n_tiles, issue_q);  // (sP/sdS free for iteration t + 1 too)
  }

  store_tile<T, D / 8>(st.at(a.dk), a.dk.row, k0 + r0, a.k_len, 0, dk, a.scale);
  store_tile<T, D / 8>(st.at(a.dv), a.dv.row, k0 + r0, a.k_len, 0, dv, 1.f);
}

// ---- backward, every key in one CTA: dQ, dK and dV in one pass ----------------------------------------
// For k_len ≤ 64·KB: a CTA of KB·4 warps owns all keys of one (batch, head) — warp group grp = warp / 4
// the key block [64·grp, 64·grp + 64), each warp 16 of its keys for dK/dV — and walks every query tile:
//   S and dP of the warp's 16 queries × its group's 64 keys (as bwd_dkv), then
//   Δ_i = Σ_j p̃_ij·dp_ij summed over the CTA's keys — equal to dout_i·out_i, so no Δ pass and no read of
//   out (and computed from the fp32 probabilities rather than the rounded output), then
//   dS, P̃ → shared memory; dV += P̃ᵀ·dO, dK += dSᵀ·Q per warp; dQ = dS·K over all keys, written once
//   per tile — complete, since no other CTA holds keys of this (batch, head).
// One launch instead of two, Q and dO read once, and 5 instead of 7 tile GEMMs per 16 × 64 tile.
template <typename T, int D, int KB>
__global__ void __launch_bounds__(kThreads * KB) attention_bwd_short_kernel(const AttentionArgs<T> a) {
  constexpr int ld = D + kPad;
  constexpr int kTile = kBlock * ld;
  constexpr int kKeys = KB * kBlock;
  constexpr int kLdS = kKeys + kPad;  // pitch of the [64 queries][kKeys] P̃ and dS tiles
  constexpr int kDq = D / KB;         // dQ columns per warp
  constexpr int kDqChunk = kDq < 64 ? kDq : 64;
  static_assert(kDq % 16 == 0, "dQ column slices are pairs of 8-wide n-tiles");
  // K, V [kKeys rows each], Q and dO double-buffered, P̃, dS, lse double-buffered, Δ parts [KB][64], key bias.
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + KB * kTile;
  T* sQ = sV + KB * kTile;     // [2] tiles
  T* sdO = sQ + 2 * kTile;     // [2] tiles
  T* sP = sdO + 2 * kTile;     // [64][kLdS]
  T* sdS = sP + kBlock * kLdS;  // [64][kLdS]
  float* sLse = reinterpret_cast<float*>(sdS + kBlock * kLdS);  // [2][kBlock]
  float* sPart = sLse + 2 * kBlock;                             // [KB][kBlock]
  float* sBias = sPart + KB * kBlock;                           // [kKeys]

  const Setup<T> st(a, blockIdx.x);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int grp = warp >> 2, tid = threadIdx.x & (kThreads - 1);
  const int r0 = (warp & 3) * 16;  // the warp's query rows of a tile, and its key rows of the group's block
  const int kg = grp * kBlock;     // the group's first key
  T* const gK = sK + grp * kTile;
  T* const gV = sV + grp * kTile;

  const T* q = st.at(a.q);
  const T* dout = st.at(a.dout);
  // Query tile t into buffer t & 1: Q (group 0) and dO (the last group) asynchronously, lse plain.
  auto issue_q = [&](int t) {
    const int qt = t * kBlock, buf = t & 1;
    const int qvalid = min(kBlock, a.q_len - qt);
    if (grp == 0) load_tile_async<T, D>(sQ + buf * kTile, q + int64_t(qt) * a.q.row, a.q.row, qvalid, tid);
    if (grp == KB - 1)
      load_tile_async<T, D>(sdO + buf * kTile, dout + int64_t(qt) * a.dout.row, a.dout.row, qvalid, tid);
    if (threadIdx.x < kBlock) {
      const int r = threadIdx.x;
      sLse[buf * kBlock + r] = r < qvalid ? a.lse[st.bh * a.q_len + qt + r] * kLog2e : kInf;
    }
  };
  const int n_tiles = (a.q_len + kBlock - 1) / kBlock;
  // Prologue: group 0 = every key block's K and V and query tile 0, group 1 = query tile 1.
  if (n_tiles > 0) {
    load_tile_async<T, D>(gK, st.at(a.k) + int64_t(kg) * a.k.row, a.k.row, min(kBlock, a.k_len - kg), tid);
    load_tile_async<T, D>(gV, st.at(a.v) + int64_t(kg) * a.v.row, a.v.row, min(kBlock, a.k_len - kg), tid);
    if (threadIdx.x < kKeys) sBias[threadIdx.x] = st.vis.key_bias(threadIdx.x);
    pipeline_start(n_tiles, issue_q);
  }

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  // At the top of iteration t, query tile t is visible in buffer t & 1 and only tile t + 1 may be in
  // flight. Barriers: Δ parts written → read, P̃/dS written → read, and the pipeline barrier.
  for (int t = 0; t < n_tiles; ++t) {
    const int q0 = t * kBlock;
    const T* cQ = sQ + (t & 1) * kTile;
    const T* cdO = sdO + (t & 1) * kTile;
    const int key_end = st.vis.key_end(q0);  // no query of the tile sees a key ≥ key_end
    const bool active = kg < key_end;        // uniform per warp group
    const float* cLse = sLse + (t & 1) * kBlock;
    const float lse2[2] = {cLse[r0 + g], cLse[r0 + g + 8]};
    float s[8][4] = {}, dp[8][4] = {};
    uint32_t bits = 0xFFFFFFFFu;
    float part[2] = {0.f, 0.f};
    if (active) {
      tile_s_dp<T, D>(s, dp, cQ, cdO, r0, gK, gV);
      mask_scores(s, sBias + kg, st.scale2, st.vis, q0 + r0, kg);
      if (st.dropout) bits = st.tile_keep_bits(q0 + r0, kg);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = exp2f(s[n][e] - lse2[e >> 1]);  // p
          const float z = st.dropout ? ((bits >> (4 * n + e)) & 1u ? st.inv_keep : 0.f) : 1.f;
          dp[n][e] *= z;                            // z·dp
          part[e >> 1] += s[n][e] * dp[n][e];       // p̃·dp = p·(z·dp)
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      part[r] += __shfl_xor_sync(0xffffffffu, part[r], 1);
      part[r] += __shfl_xor_sync(0xffffffffu, part[r], 2);
    }
    if (c == 0) {
      sPart[kg + r0 + g] = part[0];
      sPart[kg + r0 + g + 8] = part[1];
    }
    __syncthreads();  // every group's part of Δ is written (and the last tile's P̃/dS readers are done)
    if (active) {
      float delta[2] = {0.f, 0.f};
#pragma unroll
      for (int b = 0; b < KB; ++b) {
        delta[0] += sPart[b * kBlock + r0 + g];
        delta[1] += sPart[b * kBlock + r0 + g + 8];
      }
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float z0 = st.dropout ? ((bits >> (4 * n + 2 * r)) & 1u ? st.inv_keep : 0.f) : 1.f;
          const float z1 = st.dropout ? ((bits >> (4 * n + 2 * r + 1)) & 1u ? st.inv_keep : 0.f) : 1.f;
          const float p0 = s[n][2 * r], p1 = s[n][2 * r + 1];
          const int off = (r0 + g + 8 * r) * kLdS + kg + n * 8 + 2 * c;
          *reinterpret_cast<uint32_t*>(sP + off) = pack2<T>(p0 * z0, p1 * z1);
          *reinterpret_cast<uint32_t*>(sdS + off) =
              pack2<T>(p0 * (dp[n][2 * r] - delta[r]), p1 * (dp[n][2 * r + 1] - delta[r]));
        }
    }
    __syncthreads();  // P̃ and dS of every active group are written
    if (active) tile_dkv<T, D>(dk, dv, sP, sdS, kLdS, kg + r0, cQ, cdO);  // the warp's 16 keys
    // dQ of the warp's 16 queries, columns [grp·kDq, grp·kDq + kDq) in chunks of ≤ 64 (registers):
    // dS·K over the visible keys.
#pragma unroll
    for (int col = grp * kDq; col < (grp + 1) * kDq; col += kDqChunk) {
      float dq[kDqChunk / 8][4] = {};
      const int kk_end = (min(key_end, kKeys) + 15) / 16;
      for (int kk = 0; kk < kk_end; ++kk) {
        uint32_t sa[4];
        frag_a(sa, sdS, kLdS, r0, kk * 16);
#pragma unroll
        for (int n = 0; n < kDqChunk / 8; n += 2) {
          uint32_t b[4];
          frag_b_cols(b, sK, ld, col + n * 8, kk * 16);
          mma16816<T>(dq[n], sa, b[0], b[1]);
          mma16816<T>(dq[n + 1], sa, b[2], b[3]);
        }
      }
      store_tile<T, kDqChunk / 8>(st.at(a.dq), a.dq.row, q0 + r0, a.q_len, col, dq, a.scale);
    }
    pipeline_next(t, n_tiles, issue_q);  // (P̃, dS and the Δ parts free for iteration t + 1 too)
  }

  store_tile<T, D / 8>(st.at(a.dk), a.dk.row, kg + r0, a.k_len, 0, dk, a.scale);
  store_tile<T, D / 8>(st.at(a.dv), a.dv.row, kg + r0, a.k_len, 0, dv, 1.f);
}

// Launch with `bytes` of dynamic shared memory (opting in above the 48 KB default when needed).
template <typename Kernel, typename T>
cudaError_t launch(Kernel kernel, int64_t blocks, size_t bytes, const AttentionArgs<T>& a, cudaStream_t stream,
                   int threads = kThreads) {
  if (blocks == 0) return cudaSuccess;
  if (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), threads, bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t fwd(const AttentionArgs<T>& a, cudaStream_t stream) {
  const int64_t blocks = int64_t(a.batch) * a.heads * ((a.q_len + kBlock - 1) / kBlock);
  // Q + 2×K + 2×V tiles + 2 bias arrays: 5·64·(D + 8)·sizeof(T) + 2·64·4 bytes; fp16/bf16:
  // D = 64 → 46 592 B, D = 128 → 87 552 B.
  const size_t bytes = 5 * kBlock * (D + kPad) * sizeof(T) + 2 * kBlock * sizeof(float);
  if (a.keep != nullptr && a.dropout_p > 0.f) return launch(attention_fwd_kernel<T, D, true>, blocks, bytes, a, stream);
  return launch(attention_fwd_kernel<T, D, false>, blocks, bytes, a, stream);
}

template <typename T, int D, int KB>
cudaError_t bwd_short(const AttentionArgs<T>& a, cudaStream_t stream) {
  // K + V (KB tiles each) + 2×Q + 2×dO tiles, P̃ and dS [64][64·KB + 8], 2 lse + KB Δ-part arrays, key bias;
  // fp16/bf16, D = 64: KB = 1 → 74 496 B, KB = 2 → 110 080 B.
  constexpr int kKeys = KB * kBlock;
  const size_t bytes = (2 * KB + 4) * kBlock * (D + kPad) * sizeof(T) + 2 * kBlock * (kKeys + kPad) * sizeof(T) +
                       (2 * kBlock + KB * kBlock + kKeys) * sizeof(float);
  return launch(attention_bwd_short_kernel<T, D, KB>, int64_t(a.batch) * a.heads, bytes, a, stream, KB * kThreads);
}

template <typename T, int D>
cudaError_t bwd(const AttentionArgs<T>& a, cudaStream_t stream) {
  if (a.k_len <= kBlock) return bwd_short<T, D, 1>(a, stream);
  if constexpr (D >= 32) {  // two 64-key groups split dQ's columns: D / 2 must be a multiple of 16
    if (a.k_len <= 2 * kBlock) return bwd_short<T, D, 2>(a, stream);
  }
  const int64_t bh = int64_t(a.batch) * a.heads;
  // dq: Q + dO + 2×K + 2×V tiles, Δ, lse, 2 bias arrays: 6·64·(D + 8)·sizeof(T) + 4·64·4 bytes;
  // fp16/bf16: D = 64 → 56 320 B, D = 128 → 105 472 B.
  const size_t dq_bytes = 6 * kBlock * (D + kPad) * sizeof(T) + 4 * kBlock * sizeof(float);
  cudaError_t err = launch(attention_bwd_dq_kernel<T, D>, bh * ((a.q_len + kBlock - 1) / kBlock), dq_bytes, a, stream);
  if (err != cudaSuccess) return err;
  // dkv: K + V + 2×Q + 2×dO tiles, P̃ and dS, 2 lse + 2 Δ arrays, bias: 6·64·(D + 8)·sizeof(T) +
  // 2·64·72·sizeof(T) + 5·64·4 bytes; fp16/bf16: D = 64 → 75 008 B, D = 128 → 124 160 B (under the
  // 227 KB limit, but one CTA per SM at D = 128).
  const size_t dkv_bytes =
      6 * kBlock * (D + kPad) * sizeof(T) + 2 * kBlock * kTileLd * sizeof(T) + 5 * kBlock * sizeof(float);
  return launch(attention_bwd_dkv_kernel<T, D>, bh * ((a.k_len + kBlock - 1) / kBlock), dkv_bytes, a, stream);
}

}  // namespace

template <typename T>
cudaError_t launch_attention_fwd(const AttentionArgs<T>& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 16: return fwd<T, 16>(a, stream);
    case 32: return fwd<T, 32>(a, stream);
    case 64: return fwd<T, 64>(a, stream);
    case 128: return fwd<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_attention_bwd(const AttentionArgs<T>& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 16: return bwd<T, 16>(a, stream);
    case 32: return bwd<T, 32>(a, stream);
    case 64: return bwd<T, 64>(a, stream);
    case 128: return bwd<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t launch_attention_fwd<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_fwd<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);
template cudaError_t launch_attention_bwd<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_bwd<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace lsmini
