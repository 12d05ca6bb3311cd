/*
 * attention_bwd_short.cu — fused attention backward up to attention_short_keys(head_dim) keys: one CTA per
 * (batch, head) holds every key. The math, layout, dropout and work split are described at the top of
 * attention.cu.
 */
#include "attention.cuh"

namespace lsmini {
namespace {

// ---- backward, every key in one CTA: dQ, dK and dV in one pass ----------------------------------------
// For k_len ≤ 64·KB: a CTA of KB·4 warps owns all keys of one (batch, K/V head) — warp group grp = warp / 4
// the key block [64·grp, 64·grp + 64), each warp 16 of its keys for dK/dV — and walks every query tile of
// each query head that reads them:
//   S and dP of the warp's 16 queries × its group's 64 keys (as bwd_dkv), then
//   Δ_i = Σ_j p̃_ij·dp_ij summed over the CTA's keys — equal to dout_i·out_i, so no Δ pass and no read of
//   out (and computed from the fp32 probabilities rather than the rounded output), then
//   dS, P̃ → shared memory; dV += P̃ᵀ·dO, dK += dSᵀ·Q per warp; dQ = dS·K over all keys, written once
//   per tile — complete, since no other CTA holds keys of this (batch, K/V head).
// One launch instead of two, Q and dO read once, and 5 instead of 7 tile GEMMs per 16 × 64 tile.
// kGrouped: heads > kv_heads, a separate instantiation as in attention_bwd.cu.
template <typename T, int D, int KB, bool kGrouped>
__global__ void __launch_bounds__(kThreads * KB) attention_bwd_short_kernel(const AttentionArgs<T> a) {
  begin_dependent_kernel();
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

  // one CTA per (batch, K/V head), st its first query head
  const Setup<T> st(a, kGrouped ? group_first_head(a, blockIdx.x) : int(blockIdx.x));
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int grp = warp >> 2, tid = threadIdx.x & (kThreads - 1);
  const int r0 = (warp & 3) * 16;  // the warp's query rows of a tile, and its key rows of the group's block
  const int kg = grp * kBlock;     // the group's first key
  T* const gK = sK + grp * kTile;
  T* const gV = sV + grp * kTile;

  const T* q = st.at(a.q);
  const T* dout = st.at(a.dout);
  // The tiles walked: every query tile of the group's first head, then of the next, ...: tile u is query
  // tile u % q_tiles of query head st.h + u / q_tiles.
  const int q_tiles = (a.q_len + kBlock - 1) / kBlock;
  const int n_tiles = kGrouped ? q_tiles * (a.heads / a.kv_heads) : q_tiles;
  // Tile u into buffer u & 1: Q (group 0) and dO (the last group) asynchronously, lse plain.
  auto issue_q = [&](int u) {
    const int j = kGrouped ? u / q_tiles : 0, qt = (u - j * q_tiles) * kBlock, buf = u & 1;
    const int qvalid = min(kBlock, a.q_len - qt);
    if (grp == 0)
      load_tile_async<T, D>(sQ + buf * kTile, q + j * a.q.head + int64_t(qt) * a.q.row, a.q.row, qvalid, tid);
    if (grp == KB - 1)
      load_tile_async<T, D>(sdO + buf * kTile, dout + j * a.dout.head + int64_t(qt) * a.dout.row, a.dout.row,
                            qvalid, tid);
    if (threadIdx.x < kBlock) {
      const int r = threadIdx.x;
      sLse[buf * kBlock + r] = r < qvalid ? a.lse[(st.bh + j) * a.q_len + qt + r] * kLog2e : kInf;
    }
  };
  // Prologue: group 0 = every key block's K and V and query tile 0, group 1 = query tile 1.
  if (n_tiles > 0) {
    load_tile_async<T, D>(gK, st.at_kv(a.k, a) + int64_t(kg) * a.k.row, a.k.row, min(kBlock, a.k_len - kg), tid);
    load_tile_async<T, D>(gV, st.at_kv(a.v, a) + int64_t(kg) * a.v.row, a.v.row, min(kBlock, a.k_len - kg), tid);
    if (threadIdx.x < kKeys) sBias[threadIdx.x] = st.vis.key_bias(threadIdx.x);
    pipeline_start(n_tiles, issue_q);
  }

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  // At the top of iteration t, query tile t is visible in buffer t & 1 and only tile t + 1 may be in
  // flight. Barriers: Δ parts written → read, P̃/dS written → read, and the pipeline barrier.
  for (int t = 0; t < n_tiles; ++t) {
    const int j = kGrouped ? t / q_tiles : 0;
    const int q0 = (t - j * q_tiles) * kBlock;
    const Setup<T> sj = st.head(j);
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
      mask_scores(s, sBias + kg, st.vis, q0 + r0, kg);
      if (st.dropout) bits = sj.tile_keep_bits(q0 + r0, kg);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[n][e] = exp2f(fmaf(s[n][e], st.scale2, -lse2[e >> 1]));  // p
          const float z = st.dropout ? ((bits >> keep_bit(n, e)) & 1u ? st.inv_keep : 0.f) : 1.f;
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
          const float z0 = st.dropout ? ((bits >> keep_bit(n, 2 * r)) & 1u ? st.inv_keep : 0.f) : 1.f;
          const float z1 = st.dropout ? ((bits >> keep_bit(n, 2 * r + 1)) & 1u ? st.inv_keep : 0.f) : 1.f;
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
      store_tile<T, kDqChunk / 8>(sj.at(a.dq), a.dq.row, q0 + r0, a.q_len, col, dq, a.scale);
    }
    pipeline_next(t, n_tiles, issue_q);  // (P̃, dS and the Δ parts free for iteration t + 1 too)
  }

  store_tile<T, D / 8>(st.at_kv(a.dk, a), a.dk.row, kg + r0, a.k_len, 0, dk, a.scale);
  store_tile<T, D / 8>(st.at_kv(a.dv, a), a.dv.row, kg + r0, a.k_len, 0, dv, 1.f);
}

template <typename T, int D, int KB>
cudaError_t bwd_short(const AttentionArgs<T>& a, cudaStream_t stream) {
  // K + V (KB tiles each) + 2×Q + 2×dO tiles, P̃ and dS [64][64·KB + 8], 2 lse + KB Δ-part arrays, key bias;
  // fp16/bf16, D = 64: KB = 1 → 74 496 B, KB = 2 → 110 080 B.
  constexpr int kKeys = KB * kBlock;
  const size_t bytes = (2 * KB + 4) * kBlock * (D + kPad) * sizeof(T) + 2 * kBlock * (kKeys + kPad) * sizeof(T) +
                       (2 * kBlock + KB * kBlock + kKeys) * sizeof(float);
  const int64_t blocks = int64_t(a.batch) * a.kv_heads;
  if (a.kv_heads != a.heads) {
    return launch(attention_bwd_short_kernel<T, D, KB, true>, blocks, bytes, a, stream, KB * kThreads);
  }
  return launch(attention_bwd_short_kernel<T, D, KB, false>, blocks, bytes, a, stream, KB * kThreads);
}

}  // namespace

template <typename T>
cudaError_t launch_attention_bwd_short(const AttentionArgs<T>& a, cudaStream_t stream) {
  const bool one_block = a.k_len <= kBlock;
  switch (a.head_dim) {
    case 16: return bwd_short<T, 16, 1>(a, stream);
    case 32: return one_block ? bwd_short<T, 32, 1>(a, stream) : bwd_short<T, 32, 2>(a, stream);
    case 64: return one_block ? bwd_short<T, 64, 1>(a, stream) : bwd_short<T, 64, 2>(a, stream);
    case 128: return one_block ? bwd_short<T, 128, 1>(a, stream) : bwd_short<T, 128, 2>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t launch_attention_bwd_short<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_bwd_short<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace lsmini
