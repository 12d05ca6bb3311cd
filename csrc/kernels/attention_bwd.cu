/*
 * attention_bwd.cu — fused attention backward of longer sequences: the dQ and the dK/dV kernel (up to 128
 * keys attention_bwd_short.cu's one-CTA kernel runs instead). The math, layout, dropout and work split are
 * described at the top of attention.cu.
 */
#include "attention.cuh"

namespace lsmini {
namespace {

// ---- backward: Δ and dQ ------------------------------------------------------------------------------
template <typename T, int D, bool kDropout>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(const AttentionArgs<T> a) {
  begin_dependent_kernel();
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

  const GridSlot slot = grid_slot(blockIdx.x, a.batch * a.heads, (a.q_len + kBlock - 1) / kBlock, a.causal, true);
  const int q0 = slot.block * kBlock;
  const Setup<T> st(a, slot.unit);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int i0 = q0 + warp * 16;
  const int valid = min(kBlock, a.q_len - q0);

  const T* k = st.at_kv(a.k, a);
  const T* v = st.at_kv(a.v, a);
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
    tile_ds<T, kDropout>(s, dp, st, sBias + (t & 1) * kBlock, lse2, delta, i0, k0,
                         kDropout ? st.tile_keep_bits(i0, k0) : 0u);
    tile_xb<T, D>(dq, s, cK);
    pipeline_next(t, n_tiles, issue_kv);
  }

  if (a.rot.dim > 0) __syncthreads();  // the tiles' shared memory becomes the warps' staging rows
  store_rows<T, D>(st.at(a.dq), a.dq.row, i0, a.q_len, dq, a.scale, a.rot, st.b,
                   reinterpret_cast<float*>(smem) + warp * 16 * (D + 4));
}

// ---- backward: dK and dV -----------------------------------------------------------------------------
// Transposed tiles: Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, the warp's 16 keys as rows, so that P̃ᵀ and dSᵀ (tile_ds_t) are
// the A fragments of dV += P̃ᵀ·dO and dK += dSᵀ·Q straight from registers; the dropout bits, laid out per query row
// as the forward draws or keeps them, are exchanged through shared memory (tile_keep_t).
// kGrouped: heads > kv_heads (a separate instantiation: without groups the head walk folds away, and with
// it the registers it would take in a kernel at its register cap); kDropout likewise.
template <typename T, int D, bool kGrouped, bool kDropout>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkv_kernel(const AttentionArgs<T> a) {
  begin_dependent_kernel();
  constexpr int ld = D + kPad;
  constexpr int kTile = kBlock * ld;
  // K, V (loaded once), Q and dO double-buffered, lse and Δ double-buffered, key bias, keep words double-buffered.
  extern __shared__ __align__(16) unsigned char smem[];
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = sK + kTile;
  T* sQ = sV + kTile;       // [2] tiles
  T* sdO = sQ + 2 * kTile;  // [2] tiles
  float* sLse = reinterpret_cast<float*>(sdO + 2 * kTile);  // [2][kBlock]
  float* sDelta = sLse + 2 * kBlock;                         // [2][kBlock]
  float* sBias = sDelta + 2 * kBlock;                        // [kBlock]
  uint32_t* sWords = reinterpret_cast<uint32_t*>(sBias + kBlock);  // [2][kThreads]

  // One CTA per key block of each (batch, K/V head) group, in grid_slot's order; st is the group's first query head.
  const GridSlot slot = grid_slot(blockIdx.x, a.batch * a.kv_heads, (a.k_len + kBlock - 1) / kBlock, a.causal, false);
  const int k0 = slot.block * kBlock;
  const Setup<T> st(a, kGrouped ? group_first_head(a, slot.unit) : slot.unit);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int r0 = warp * 16;  // the warp's key rows of the block (and its row group of a query tile's keep words)

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const T* q = st.at(a.q);
  const T* dout = st.at(a.dout);
  const int q_begin = st.vis.query_begin(k0);
  // The tiles walked: query tiles [0, q_tiles) of the group's first head, then of the next, ...: tile u is
  // query tile u % q_tiles (queries from q_begin + 64·(u % q_tiles)) of query head st.h + u / q_tiles.
  // issued and current walk them for issue_q and the loop.
  const int q_tiles = (max(0, a.q_len - q_begin) + kBlock - 1) / kBlock, q_end = q_begin + q_tiles * kBlock;
  const int n_tiles = kGrouped ? q_tiles * (a.heads / a.kv_heads) : q_tiles;
  QueryWalk issued(q_begin), current(q_begin);
  // Tile u, the next one, into buffer u & 1: Q, dO (asynchronous), lse and Δ, and with dropout this thread's keep
  // word of the tile as the forward's lane threadIdx.x % 32 of row group threadIdx.x / 32 has it (plain stores,
  // published by the same barrier as the copies).
  auto issue_q = [&](int u) {
    const int j = kGrouped ? issued.head : 0, qt = issued.start, buf = u & 1;
    const int qvalid = min(kBlock, a.q_len - qt);
    load_tile_async<T, D>(sQ + buf * kTile, q + j * a.q.head + int64_t(qt) * a.q.row, a.q.row, qvalid);
    load_tile_async<T, D>(sdO + buf * kTile, dout + j * a.dout.head + int64_t(qt) * a.dout.row, a.dout.row,
                          qvalid);
    if (threadIdx.x < kBlock) {
      const int r = threadIdx.x;
      const int64_t row = (st.bh + j) * a.q_len + qt + r;
      sLse[buf * kBlock + r] = r < qvalid ? a.lse[row] * kLog2e : kInf;
      sDelta[buf * kBlock + r] = r < qvalid ? a.delta[row] : 0.f;
    }
    if (kDropout) sWords[buf * kThreads + threadIdx.x] = st.head(j).tile_keep_bits(qt + r0, k0);
    issued.step(q_begin, q_end);
  };
  // Prologue: group 0 = this block's K and V and tile 0, group 1 = tile 1. With no query tile (causal,
  // every query before the block) nothing is loaded and dK = dV = 0, so no copy is left in flight at exit.
  if (n_tiles > 0) {
    const int kvalid = min(kBlock, a.k_len - k0);
    load_tile_async<T, D>(sK, st.at_kv(a.k, a) + int64_t(k0) * a.k.row, a.k.row, kvalid);
    load_tile_async<T, D>(sV, st.at_kv(a.v, a) + int64_t(k0) * a.v.row, a.v.row, kvalid);
    st.vis.fill_key_bias(sBias, k0);
    pipeline_start(n_tiles, issue_q);
  }

  // At the top of iteration t, query tile t is visible in buffer t & 1 and only tile t + 1 may be in
  // flight; one barrier per iteration, the pipeline's.
  const float key_bias[2] = {sBias[r0 + g], sBias[r0 + g + 8]};
  for (int t = 0; t < n_tiles; ++t) {
    const int buf = t & 1;
    const T* cQ = sQ + buf * kTile;
    const T* cdO = sdO + buf * kTile;
    float s[8][4] = {}, dp[8][4] = {};
    tile_s_dp<T, D>(s, dp, sK, sV, r0, cQ, cdO);  // Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ: the warp's 16 keys
    tile_ds_t<T, kDropout>(s, dp, st, sLse + buf * kBlock, sDelta + buf * kBlock,
                           kDropout ? tile_keep_t(sWords + buf * kThreads) : 0u, k0 + r0, current.start);
    current.step(q_begin, q_end);
    tile_xb<T, D>(dv, dp, cdO);
    tile_xb<T, D>(dk, s, cQ);
    pipeline_next(t, n_tiles, issue_q);
  }

  zero_masked_keys(dk, dv, key_bias);
  store_tile<T, D / 8>(st.at_kv(a.dv, a), a.dv.row, k0 + r0, a.k_len, 0, dv, 1.f);
  if (a.rot.dim > 0) __syncthreads();  // the tiles' shared memory becomes the warps' staging rows
  store_rows<T, D>(st.at_kv(a.dk, a), a.dk.row, k0 + r0, a.k_len, dk, a.scale, a.rot, st.b,
                   reinterpret_cast<float*>(smem) + warp * 16 * (D + 4));
}

template <typename T, int D, bool kDropout>
cudaError_t bwd_dkv(const AttentionArgs<T>& a, cudaStream_t stream) {
  // K + V + 2×Q + 2×dO tiles, 2 lse + 2 Δ arrays, bias, 2 × 128 keep words: 6·64·(D + 8)·sizeof(T) + 5·64·4 +
  // 2·128·4 bytes; fp16/bf16: D = 64 → 57 600 B, D = 128 → 106 752 B.
  const size_t bytes =
      6 * kBlock * (D + kPad) * sizeof(T) + 5 * kBlock * sizeof(float) + 2 * kThreads * sizeof(uint32_t);
  const int64_t blocks = int64_t(a.batch) * a.kv_heads * ((a.k_len + kBlock - 1) / kBlock);
  if (a.kv_heads != a.heads) return launch(attention_bwd_dkv_kernel<T, D, true, kDropout>, blocks, bytes, a, stream);
  return launch(attention_bwd_dkv_kernel<T, D, false, kDropout>, blocks, bytes, a, stream);
}

template <typename T, int D>
cudaError_t bwd(const AttentionArgs<T>& a, cudaStream_t stream) {
  // (the one-CTA kernel splits dQ's columns over its warps, so it takes no rotary positions)
  if (a.k_len <= attention_short_keys(D) && a.rot.dim == 0) return launch_attention_bwd_short(a, stream);
  if (attention_sm90_runs(D)) return launch_attention_bwd_sm90(a, stream);
  const int64_t bh = int64_t(a.batch) * a.heads;
  // dq: Q + dO + 2×K + 2×V tiles, Δ, lse, 2 bias arrays: 6·64·(D + 8)·sizeof(T) + 4·64·4 bytes;
  // fp16/bf16: D = 64 → 56 320 B, D = 128 → 105 472 B.
  const size_t dq_bytes = 6 * kBlock * (D + kPad) * sizeof(T) + 4 * kBlock * sizeof(float);
  const int64_t blocks = bh * ((a.q_len + kBlock - 1) / kBlock);
  const bool dropout = a.dropout_p > 0.f;
  const cudaError_t err = dropout ? launch(attention_bwd_dq_kernel<T, D, true>, blocks, dq_bytes, a, stream)
                                  : launch(attention_bwd_dq_kernel<T, D, false>, blocks, dq_bytes, a, stream);
  if (err != cudaSuccess) return err;
  return dropout ? bwd_dkv<T, D, true>(a, stream) : bwd_dkv<T, D, false>(a, stream);
}

}  // namespace

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

template cudaError_t launch_attention_bwd<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_bwd<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace lsmini
