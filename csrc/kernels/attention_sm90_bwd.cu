/*
 * attention_sm90_bwd.cu — the fused attention backward of longer sequences for Hopper (sm_90a): the dQ and
 * the dK/dV kernel of attention_bwd.cu with warpgroup MMAs (attention_sm90.cuh) for every tile product.
 * Math, layout, work split, masks and dropout bits as attention.cu describes; up to attention_short_keys
 * keys the one-CTA sm_80 kernel (attention_bwd_short.cu) still runs.
 *
 * Per tile, one warpgroup (the CTA) computes
 *   bwd_dq:  S = Q·Kᵀ, dP = dO·Vᵀ (B K-major from shared memory; A too at head dim 64, from registers at
 *            128), dS in registers (tile_ds),
 *            dQ += dS·K (A = dS from registers, B = K N-major);
 *   bwd_dkv: the transposed tiles Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ with the query tile streaming (rows are the
 *            CTA's keys), P̃ᵀ and dSᵀ in registers (tile_ds_t), dV += P̃ᵀ·dO and dK += dSᵀ·Q (A from
 *            registers, B N-major): no tile goes through shared memory besides the operands, and one barrier
 *            an iteration. The dropout bits, laid out per query row as the forward draws or keeps them, are
 *            exchanged through shared memory (tile_keep_t).
 * The transposes cost nothing: wgmma reads a tile either way through its descriptor.
 */
#include "attention_sm90.cuh"

namespace lsmini {
namespace {

#if defined(LSMINI_SM90A_DEVICE)
// The backward's two score tiles, waited for: s = S = Q·Kᵀ and dp = dP = dO·Vᵀ (tiles at shared addresses).
// keep_bits() runs while their MMAs do (the tile's dropout bits: a load or Philox, or a constant without dropout).
template <typename T, int D, typename KeepBits>
__device__ __forceinline__ uint32_t wg_s_dp(float (&s)[8][4], float (&dp)[8][4], uint32_t q, uint32_t dout,
                                            uint32_t k, uint32_t v, KeepBits keep_bits) {
  wg_abt<T, D>(s, q, k);
  wg_abt<T, D>(dp, dout, v);
  wgmma_commit();
  const uint32_t bits = keep_bits();
  wgmma_wait(s, dp);
  return bits;
}

// The same with the two A operands held as register fragments (qa, da: the mma A layout of the warp's 16 rows,
// frags_a): only the B tiles are read from shared memory.
template <typename T, int D, typename KeepBits>
__device__ __forceinline__ uint32_t wg_s_dp_rs(float (&s)[8][4], float (&dp)[8][4], const uint32_t (&qa)[D / 16][4],
                                               const uint32_t (&da)[D / 16][4], uint32_t k, uint32_t v,
                                               KeepBits keep_bits) {
  const SwDesc dk(k, 16), dv(v, 16);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) Wgmma<T, 64>::template rs<0>(s, qa[kk], desc_k(dk, kk), kk > 0);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) Wgmma<T, 64>::template rs<0>(dp, da[kk], desc_k(dv, kk), kk > 0);
  wgmma_commit();
  const uint32_t bits = keep_bits();
  wgmma_wait(s, dp);
  return bits;
}

// The A fragments of the warp's 16 rows of the [64 × D] swizzled tile at tile (generic address).
template <int D>
__device__ __forceinline__ void frags_a(uint32_t (&a)[D / 16][4], const unsigned char* tile) {
  const int lane = threadIdx.x & 31, row = (threadIdx.x >> 5) * 16 + (lane & 15);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ldsm4<false>(a[kk], tile + sw_offset(row, kk * 16 + (lane >> 4) * 8));
}
#endif

// Four CTAs an SM at head dim 64 without dropout (128 registers, no spill); the keep-bit selects need more.
template <typename T, int D, bool kDropout>
__global__ void __launch_bounds__(kThreads, D <= 64 ? (kDropout ? 3 : 4) : 2)
    attention_bwd_dq_sm90_kernel(const AttentionArgs<T> a, const __grid_constant__ AttentionMaps maps) {
  begin_dependent_kernel();
#if defined(LSMINI_SM90A_DEVICE)
  // Q, dO, then K and V double-buffered (swizzled tiles), then Δ, lse and the key bias of each buffer, then the
  // mbarriers of Q and dO and of the two K/V buffers.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_1k(smem_raw);
  constexpr int kTile = kSwTileBytes<D>;
  const uint32_t sQ = smem_u32(smem), sdO = sQ + kTile, sK = sdO + kTile, sV = sK + 2 * kTile;
  float* sDelta = reinterpret_cast<float*>(smem + 6 * kTile);
  float* sLse = sDelta + kBlock;
  float* sBias = sLse + kBlock;  // [2][kBlock]
  const uint32_t bar_q = smem_u32(sBias + 2 * kBlock), bar_kv = bar_q + 8;  // bar_kv + 8·buffer

  const GridSlot slot = grid_slot(blockIdx.x, a.batch * a.heads, (a.q_len + kBlock - 1) / kBlock, a.causal, true);
  const int q0 = slot.block * kBlock;
  const Setup<T> st(a, slot.unit);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int i0 = q0 + warp * 16;
  const int valid = min(kBlock, a.q_len - q0);

  auto issue_kv = [&](int t) { issue_kv_tile<T, D>(t, sK, sV, sBias, bar_kv, maps, st, st.kv_head(a)); };
  const int n_tiles = (st.vis.key_end(q0) + kBlock - 1) / kBlock;
  if (threadIdx.x == 0) {
    mbar_init_copies(bar_q, 3);
    mbar_expect_tx(bar_q, 2 * kTile);
    tma_tile<D>(sQ, &maps.q, q0, st.h, st.b, bar_q);
    tma_tile<D>(sdO, &maps.dout, q0, st.h, st.b, bar_q);
  }
  if (n_tiles > 0) issue_kv(0);
  if (n_tiles > 1) issue_kv(1);
  __syncthreads();  // the mbarriers initialized, and the key bias of tiles 0 and 1, for every thread
  mbar_wait(bar_q, 0);
  {  // Δ_i = dout_i·out_i: two threads per row, dO from its swizzled tile
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    float acc = 0.f;
    if (r < valid) {
      const T* o = st.at(a.out) + int64_t(q0 + r) * a.out.row;
#pragma unroll
      for (int x = half * (D / 2); x < (half + 1) * (D / 2); x += 8) {
        float of[8], df[8];
        load_pack<T, 8>(o + x, of);
        load_pack<T, 8>(reinterpret_cast<const T*>(smem + kTile + sw_offset(r, x)), df);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += of[e] * df[e];
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
  const float lse2[2] = {sLse[warp * 16 + g], sLse[warp * 16 + g + 8]};
  const float delta[2] = {sDelta[warp * 16 + g], sDelta[warp * 16 + g + 8]};

  float dq[D / 8][4] = {};
  // At head dim 128 Q and dO stay in registers as the score products' A operands, so those products read only
  // the K and V tiles from shared memory (an m64n64 product that reads both operands there takes as many bytes a
  // cycle as shared memory delivers). At 64 the fragments would make the kernel spill at four CTAs an SM.
  constexpr bool kRegA = D > 64;
  uint32_t qa[D / 16][4], da[D / 16][4];
  if constexpr (kRegA) {
    frags_a<D>(qa, smem);
    frags_a<D>(da, smem + kTile);
  }
  for (int t = 0; t < n_tiles; ++t) {
    const uint32_t cK = sK + (t & 1) * kTile, cV = sV + (t & 1) * kTile;
    float s[8][4], dp[8][4];
    mbar_wait(bar_kv + 8 * (t & 1), (t >> 1) & 1);  // the buffer's (t >> 1)-th fill
    auto keep_bits = [&] { return kDropout ? st.tile_keep_bits(i0, t * kBlock) : 0u; };
    uint32_t bits;
    if constexpr (kRegA)
      bits = wg_s_dp_rs<T, D>(s, dp, qa, da, cK, cV, keep_bits);
    else
      bits = wg_s_dp<T, D>(s, dp, sQ, sdO, cK, cV, keep_bits);
    tile_ds<T, kDropout>(s, dp, st, sBias + (t & 1) * kBlock, lse2, delta, i0, t * kBlock, bits);
    wg_xb<T, D>(dq, s, cK);
    wgmma_sync(dq);
    if (t + 1 < n_tiles) {
      __syncthreads();  // no warp reads buffer t & 1 any more; tile t + 1's key bias is visible
      if (t + 2 < n_tiles) issue_kv(t + 2);
    }
  }

  if (a.rot.dim > 0) __syncthreads();  // the tiles' shared memory becomes the warps' staging rows
  store_rows<T, D>(st.at(a.dq), a.dq.row, i0, a.q_len, dq, a.scale, a.rot, st.b,
                   reinterpret_cast<float*>(smem) + warp * 16 * (D + 4));
#else
  __trap();  // never launched: attention_sm90_runs is false without sm_90a code
#endif
}

// Under grouped K/V heads one CTA per key block walks all `group` query heads of its K/V head, so under a causal
// mask the first key block's CTA does `group` times the tiles of the longest ungrouped one. When that walk is
// longer than the tiles each resident CTA gets on average, the grid waits for it at its end: then the key
// block's CTAs are a cluster, each walking group / cluster of the heads, their dK and dV summed in the cluster's
// shared memory at the end (which costs more than the tail it saves otherwise). The cluster is the largest
// divisor of the group up to 8, the portable cluster size (1: a prime group above 7 keeps one CTA).
constexpr int dkv_cluster(int group) {
  for (int c = group < 8 ? group : 8; c > 1; --c)
    if (group % c == 0) return c;
  return 1;
}

template <typename T>
bool dkv_tail_bound(const AttentionArgs<T>& a, int resident_ctas) {
  const int nqb = (a.q_len + kBlock - 1) / kBlock, nkb = (a.k_len + kBlock - 1) / kBlock;
  int64_t longest = 0, tiles = 0;  // query tiles a key block's CTA walks per query head
  for (int kb = 0; kb < nkb; ++kb) {
    const int begin = a.causal ? max(0, kb * kBlock - (a.k_len - a.q_len)) / kBlock : 0;
    longest = std::max<int64_t>(longest, nqb - begin);
    tiles += nqb - begin;
  }
  return longest * resident_ctas > tiles * a.batch * a.kv_heads;
}

#if defined(LSMINI_SM90A_DEVICE)
// With rotary positions: the transpose of the rotation applied in place to the fp32 [rows × D] dK part at `part`
// (row r is key k0 + r of batch b), before the cluster sums the parts. The rotation is linear, so the sum of the
// rotated parts is the rotated sum; each CTA reads only its own shared memory. One pair of columns (j, j + half)
// a thread at a time: dx_j = g_j·cos_j + g_p·sin_p, dx_p = g_p·cos_p − g_j·sin_j (rotary.cu).
__device__ __forceinline__ void rotate_dk_part(float* part, int D, int rows, const AttentionRotary& rot, int b,
                                               int k0) {
  const int half = rot.dim / 2;
#pragma unroll 4
  for (int idx = threadIdx.x; idx < rows * half; idx += kThreads) {
    const int r = idx / half, j = idx % half, p = j + half;
    const int64_t at = b * rot.stride_batch + int64_t(k0 + r) * rot.stride_seq;
    const float cj = __ldg(rot.cos + at + j), cp = __ldg(rot.cos + at + p);
    const float sj = __ldg(rot.sin + at + j), sp = __ldg(rot.sin + at + p);
    const float x = part[r * D + j], y = part[r * D + p];
    part[r * D + j] = fmaf(x, cj, y * sp);
    part[r * D + p] = fmaf(y, cp, -(x * sj));
  }
}

// Sum the fp32 [64 × D] dK and dV each CTA of the cluster put at the same offset of its shared memory (dK then
// dV, row-major), in rank order (so the result does not depend on timing); CTA `rank` of `n` takes every n-th
// 4-element chunk from `rank` on, and writes the rows below k_len, dK times scale.
template <typename T, int D>
__device__ __forceinline__ void cluster_sum_dkv(uint32_t partial, int rank, int n, T* dk, int64_t dk_row, T* dv,
                                                int64_t dv_row, int rows, float scale) {
  constexpr int kChunks = 2 * kBlock * D / 4;
  for (int i = rank * kThreads + threadIdx.x; i < kChunks; i += n * kThreads) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = 0; q < n; ++q) {
      uint32_t remote;
      float4 v;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(partial + 16 * i), "r"(q));
      asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                   : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                   : "r"(remote)
                   : "memory");
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const int e = 4 * i, is_dv = e >= kBlock * D, r = (e % (kBlock * D)) / D, col = e % D;
    if (r >= rows) continue;
    const float f = is_dv ? 1.f : scale;
    T* out = is_dv ? dv + int64_t(r) * dv_row + col : dk + int64_t(r) * dk_row + col;
    *reinterpret_cast<uint2*>(out) = make_uint2(pack2<T>(sum.x * f, sum.y * f), pack2<T>(sum.z * f, sum.w * f));
  }
}

__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
#endif

// The Q/dO stages of the dK/dV kernel: at head dim 64 three, so that each tile is issued two iterations before its
// use (three CTAs an SM still fit); at 128 two, which keep two CTAs an SM.
template <int D>
constexpr int kDkvStages = D <= 64 ? 3 : 2;

// kGrouped: heads > kv_heads, a separate instantiation as in attention_bwd.cu, launched one CTA or one cluster
// (dkv_tail_bound) a key block. kDropout: dropout_p > 0, also separate: the keep words' registers would make the
// kernel without dropout spill.
template <typename T, int D, bool kGrouped, bool kDropout>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 3 : 2)
    attention_bwd_dkv_sm90_kernel(const AttentionArgs<T> a, const __grid_constant__ AttentionMaps maps) {
  begin_dependent_kernel();
#if defined(LSMINI_SM90A_DEVICE)
  // K, V (loaded once), kStages buffers each of Q and dO (swizzled tiles), then per buffer the lse and Δ of its
  // query tile, the key bias, and per buffer the tile's dropout keep words (these two-buffered: staged one
  // iteration ahead).
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_1k(smem_raw);
  constexpr int kTile = kSwTileBytes<D>, kStages = kDkvStages<D>;
  const uint32_t sK = smem_u32(smem), sV = sK + kTile, sQ = sV + kTile, sdO = sQ + kStages * kTile;
  float* sLse = reinterpret_cast<float*>(smem + (2 + 2 * kStages) * kTile);  // [2][kBlock]
  float* sDelta = sLse + 2 * kBlock;                          // [2][kBlock]
  float* sBias = sDelta + 2 * kBlock;                         // [kBlock]
  uint32_t* sWords = reinterpret_cast<uint32_t*>(sBias + kBlock);  // [2][kThreads]
  const uint32_t bar_kv = smem_u32(sWords + 2 * kThreads), bar_q = bar_kv + 8;  // mbarriers: K/V, then a stage each

  // One CTA (or cluster) per key block of each (batch, K/V head) group, in grid_slot's order; st is the CTA's first
  // query head: the group's first plus rank · heads_per_cta.
  unsigned cluster = 1;
  if (kGrouped) asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(cluster));
  const unsigned rank = blockIdx.x % cluster, block = blockIdx.x / cluster;
  const int heads_per_cta = kGrouped ? a.heads / a.kv_heads / cluster : 1;
  const GridSlot slot = grid_slot(block, a.batch * a.kv_heads, (a.k_len + kBlock - 1) / kBlock, a.causal, false);
  const int k0 = slot.block * kBlock;
  const Setup<T> st(a, kGrouped ? group_first_head(a, slot.unit) + rank * heads_per_cta : slot.unit);
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const int r0 = warp * 16;  // the warp's key rows of the block

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const T* q = st.at(a.q);
  const T* dout = st.at(a.dout);
  const int q_begin = st.vis.query_begin(k0);
  // Tile u: query tile u % q_tiles of query head st.h + u / q_tiles, as in attention_bwd.cu; issued, fetched and
  // current walk them for issue_q, fetch_stats and the loop.
  const int q_tiles = (max(0, a.q_len - q_begin) + kBlock - 1) / kBlock, q_end = q_begin + q_tiles * kBlock;
  const int n_tiles = kGrouped ? q_tiles * heads_per_cta : q_tiles;
  QueryWalk issued(q_begin), fetched(q_begin), current(q_begin);
  // Tile u, the next one, into buffer u % kStages: thread 0 has the TMA unit copy its Q and dO (complete on the
  // buffer's mbarrier).
  auto issue_q = [&](int u) {
    const int h = st.h + (kGrouped ? issued.head : 0), qt = issued.start, buf = u % kStages;
    if (threadIdx.x == 0) {
      const uint32_t bar = bar_q + 8 * buf;
      mbar_expect_tx(bar, 2 * kTile);
      tma_tile<D>(sQ + buf * kTile, &maps.q, qt, h, st.b, bar);
      tma_tile<D>(sdO + buf * kTile, &maps.dout, qt, h, st.b, bar);
    }
    issued.step(q_begin, q_end);
  };
  // What the next tile's products need besides Q and dO, into buffer u & 1 for tile u: (lse·log2 e, Δ) of row
  // threadIdx.x < kBlock (a row past q_len gives P̃ = dS = 0) and, with dropout, this thread's keep word of the tile
  // as the forward's lane threadIdx.x % 32 of row group threadIdx.x / 32 has it. Fetched (fetch_stats) while tile
  // u − 1's products run, then staged after them (stage_stats); the pipeline's barrier shows them.
  struct Stats {
    float2 row;
    uint32_t word;
  };
  auto fetch_stats = [&]() {
    const int j = kGrouped ? fetched.head : 0, qt = fetched.start, i = qt + threadIdx.x;
    Stats v{make_float2(kInf, 0.f), 0u};
    if (threadIdx.x < kBlock && i < a.q_len) {
      const int64_t row = (st.bh + j) * a.q_len + i;
      v.row = make_float2(a.lse[row] * kLog2e, a.delta[row]);
    }
    if (kDropout) v.word = st.head(j).tile_keep_bits(qt + r0, k0);
    fetched.step(q_begin, q_end);
    return v;
  };
  auto stage_stats = [&](const Stats& v, int u) {
    const int buf = u & 1;
    if (threadIdx.x < kBlock) {
      sLse[buf * kBlock + threadIdx.x] = v.row.x;
      sDelta[buf * kBlock + threadIdx.x] = v.row.y;
    }
    if (kDropout) sWords[buf * kThreads + threadIdx.x] = v.word;
  };
  if (n_tiles > 0) {
    if (threadIdx.x == 0) {
      const int h_kv = st.kv_head(a);
      mbar_init_copies(bar_kv, 1 + kStages);
      mbar_expect_tx(bar_kv, 2 * kTile);
      tma_tile<D>(sK, &maps.k, k0, h_kv, st.b, bar_kv);
      tma_tile<D>(sV, &maps.v, k0, h_kv, st.b, bar_kv);
    }
    st.vis.fill_key_bias(sBias, k0);
    stage_stats(fetch_stats(), 0);
#pragma unroll
    for (int u = 0; u < kStages; ++u)
      if (u < n_tiles) issue_q(u);
    __syncthreads();  // the mbarriers initialized, the key bias and tile 0's stats, for every thread
    mbar_wait(bar_kv, 0);
  }

  // One barrier per iteration, the pipeline's: tile t's lse, Δ and keep words are in buffer t & 1, staged during
  // iteration t − 1 into the buffer iteration t − 2 read.
  const float key_bias[2] = {sBias[r0 + g], sBias[r0 + g + 8]};
  for (int t = 0; t < n_tiles; ++t) {
    const int buf = t & 1, stage = t % kStages;
    const uint32_t cQ = sQ + stage * kTile, cdO = sdO + stage * kTile;
    float s[8][4], dp[8][4];
    mbar_wait(bar_q + 8 * stage, (t / kStages) & 1);  // the stage's (t / kStages)-th fill
    const uint32_t bits = wg_s_dp<T, D>(s, dp, sK, sV, cQ, cdO, [&] {  // Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ
      return kDropout ? tile_keep_t(sWords + buf * kThreads) : 0u;
    });
    tile_ds_t<T, kDropout>(s, dp, st, sLse + buf * kBlock, sDelta + buf * kBlock, bits, k0 + r0, current.start);
    current.step(q_begin, q_end);
    // Loaded before the MMAs are issued: code between issue and wait makes ptxas fence them.
    const bool stage_next = t + 1 < n_tiles;
    Stats next{};
    if (stage_next) next = fetch_stats();
    wg_xb<T, D>(dv, dp, cdO);  // the warpgroup's rows are the block's 64 keys: the warp's [r0, r0 + 16)
    wg_xb<T, D>(dk, s, cQ);
    wgmma_sync(dv, dk);
    if (stage_next) stage_stats(next, t + 1);
    if (t + 1 < n_tiles) {
      __syncthreads();  // no warp reads stage t % kStages any more; tile t + 1's stats are visible
      if (t + kStages < n_tiles) issue_q(t + kStages);
    }
  }

  zero_masked_keys(dk, dv, key_bias);
  if (cluster == 1) {
    store_tile<T, D / 8>(st.at_kv(a.dv, a), a.dv.row, k0 + r0, a.k_len, 0, dv, 1.f);
    if (a.rot.dim > 0) __syncthreads();  // the tiles' shared memory becomes the warps' staging rows
    store_rows<T, D>(st.at_kv(a.dk, a), a.dk.row, k0 + r0, a.k_len, dk, a.scale, a.rot, st.b,
                     reinterpret_cast<float*>(smem) + warp * 16 * (D + 4));
    return;
  }
  // This CTA's part of the group's dK and dV into its shared memory, once every warp is done with the tiles
  // there; the cluster's sum once every CTA's part is in; no CTA exits while another may still read its part.
  __syncthreads();
  float* part = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int at = (r0 + g + 8 * r) * D + n * 8 + 2 * c;
      *reinterpret_cast<float2*>(part + at) = make_float2(dk[n][2 * r], dk[n][2 * r + 1]);
      *reinterpret_cast<float2*>(part + kBlock * D + at) = make_float2(dv[n][2 * r], dv[n][2 * r + 1]);
    }
  if (a.rot.dim > 0) {
    __syncthreads();
    rotate_dk_part(part, D, min(kBlock, a.k_len - k0), a.rot, st.b, k0);
  }
  cluster_barrier();
  cluster_sum_dkv<T, D>(smem_u32(smem), rank, cluster, st.at_kv(a.dk, a) + int64_t(k0) * a.dk.row, a.dk.row,
                        st.at_kv(a.dv, a) + int64_t(k0) * a.dv.row, a.dv.row, a.k_len - k0, a.scale);
  cluster_barrier();
#else
  __trap();  // never launched: attention_sm90_runs is false without sm_90a code
#endif
}

template <typename T, int D, bool kDropout>
cudaError_t bwd_dkv_sm90(const AttentionArgs<T>& a, const AttentionMaps& maps, cudaStream_t stream) {
  // K + V + kStages × (Q + dO) tiles, 2 × (lse, Δ), bias, 2 × 128 keep words, 1 + kStages mbarriers: D = 64 →
  // 67 872 B (three CTAs an SM), D = 128 → 100 632 B, under the 115 712 B (half of 228 KB, less 1 KB reserved a
  // CTA) that lets two CTAs share an SM.
  constexpr int kTiles = 2 + 2 * kDkvStages<D>;
  const size_t bytes = kTiles * kSwTileBytes<D> + 5 * kBlock * sizeof(float) + 2 * kThreads * sizeof(uint32_t) +
                       (1 + kDkvStages<D>) * 8;
  // The sum of a grouped cluster's parts takes 2 × 64 × D floats of it: 32 or 64 KB, within those bytes.
  static_assert(2 * kBlock * D * sizeof(float) <= kTiles * kSwTileBytes<D>, "");
  const int64_t blocks = int64_t(a.batch) * a.kv_heads * ((a.k_len + kBlock - 1) / kBlock);
  if (a.kv_heads != a.heads) {
    auto kernel = attention_bwd_dkv_sm90_kernel<T, D, true, kDropout>;
    int per_sm = 0;
    cudaError_t err = allow_dynamic_smem(kernel, int(bytes));
    if (err == cudaSuccess) err = max_active_blocks(kernel, kThreads, bytes, &per_sm);
    if (err != cudaSuccess) return err;
    const int cluster = dkv_tail_bound(a, per_sm * sm_count()) ? dkv_cluster(a.heads / a.kv_heads) : 1;
    return launch_with_maps(kernel, blocks * cluster, bytes, a, maps, stream, kThreads, cluster);
  }
  return launch_with_maps(attention_bwd_dkv_sm90_kernel<T, D, false, kDropout>, blocks, bytes, a, maps, stream);
}

template <typename T, int D>
cudaError_t bwd_sm90(const AttentionArgs<T>& a, cudaStream_t stream) {
  const int64_t bh = int64_t(a.batch) * a.heads;
  // dq: Q + dO + 2×K + 2×V tiles, Δ, lse, 2 bias arrays, 3 mbarriers: D = 64 → 50 200 B, D = 128 → 99 352 B.
  const size_t dq_bytes = 6 * kSwTileBytes<D> + 4 * kBlock * sizeof(float) + 3 * 8;
  const int64_t blocks = bh * ((a.q_len + kBlock - 1) / kBlock);
  AttentionMaps maps;  // the dQ and the dK/dV kernels read the same operands
  if (blocks > 0 && !encode_maps(&maps, a, true)) return cudaErrorInvalidValue;
  const bool dropout = a.dropout_p > 0.f;
  const cudaError_t err =
      dropout ? launch_with_maps(attention_bwd_dq_sm90_kernel<T, D, true>, blocks, dq_bytes, a, maps, stream)
              : launch_with_maps(attention_bwd_dq_sm90_kernel<T, D, false>, blocks, dq_bytes, a, maps, stream);
  if (err != cudaSuccess) return err;
  return dropout ? bwd_dkv_sm90<T, D, true>(a, maps, stream) : bwd_dkv_sm90<T, D, false>(a, maps, stream);
}

}  // namespace

template <typename T>
cudaError_t launch_attention_bwd_sm90(const AttentionArgs<T>& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return bwd_sm90<T, 64>(a, stream);
    case 128: return bwd_sm90<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t launch_attention_bwd_sm90<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_bwd_sm90<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace lsmini
