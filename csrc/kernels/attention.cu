/*
 * attention.cu — fused scaled-dot-product attention, forward and backward, that never writes the
 * [batch, heads, q_len, k_len] scores or probabilities to memory (the FlashAttention-2 scheme, on
 * mma.sync tensor cores, fp32 accumulation). This file holds the forward kernel; the backward kernels are
 * in attention_bwd.cu (dQ, dK/dV) and attention_bwd_short.cu (one CTA), what all use in attention.cuh
 * (three translation units, so that they compile in parallel).
 *
 * Layout: q [batch, heads, q_len, d], k and v [batch, kv_heads, k_len, d] (query head h reads K/V head
 * h / (heads / kv_heads)), out/dout/dq like q, dk/dv like k: each with its own element strides for batch,
 * head and row (attention.h's Strided; head_dim contiguous, rows 16-byte aligned). So the layers read Q, K
 * and V straight out of their fused projection [tokens, (heads + 2·kv_heads)·d] and write the output in the
 * merged [batch, q_len, heads·d] layout the output projection reads — no head split/merge passes.
 * lse [batch, heads, q_len] fp32 is each row's log-sum-exp of its scaled, masked scores, +inf for a row with
 * every key masked.
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
 *   bwd_dkv: per key block of a K/V head, over the query tiles of every query head reading it: Sᵀ = K·Qᵀ,
 *            dPᵀ = V·dOᵀ and dSᵀ, the block's keys as rows, so P̃ᵀ and dSᵀ are the registers' A operands of
 *            dV += P̃ᵀ·dO, dK += dSᵀ·Q (and a shared K/V head's gradients are summed in registers).
 * S and dP are recomputed in both backward kernels instead of accumulating dQ with atomics: two more
 * small GEMMs, deterministic results. Up to 128 keys (the usual training lengths), bwd_short does it all
 * in one kernel instead: one CTA holds every key of its (batch, head), so its dQ needs no other CTA.
 * Napkin math (64×16 heads of 128×128, d = 64, fp16): ~17 M score elements; fwd reads Q, K, V and
 * writes O (67 MB), bwd ~3× that — tens of µs where the unfused path moves the 34 MB score matrix
 * through memory ~14 times.
 */
#include "attention.cuh"


namespace lsmini {
namespace {

// ---- forward ---------------------------------------------------------------------------------------
// D ≤ 64: three CTAs per SM (≤ 168 registers; at 170 the allocation granularity leaves room for two).
// D = 128: shared memory allows two anyway.
// kKeep: also store the dropout bits (AttentionArgs::keep). A separate instantiation, because the kernel is at
// its register cap: the store's pointer alone made the one without it spill and run 3-5% slower.
template <typename T, int D, bool kKeep>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 3 : 2) attention_fwd_kernel(const AttentionArgs<T> a) {
  begin_dependent_kernel();
  constexpr int ld = D + kPad;
  constexpr int kTile = kBlock * ld;  // elements of one [64 × D] shared tile
  // Q, then K and V double-buffered (buffer b of K at sK + b·kTile), then the key bias of each buffer.
  extern __shared__ __align__(16) unsigned char smem[];
  T* sQ = reinterpret_cast<T*>(smem);
  T* sK = sQ + kTile;
  T* sV = sK + 2 * kTile;
  float* sBias = reinterpret_cast<float*>(sV + 2 * kTile);  // [2][kBlock]

  const GridSlot slot = grid_slot(blockIdx.x, a.batch * a.heads, (a.q_len + kBlock - 1) / kBlock, a.causal, true);
  const int q0 = slot.block * kBlock;
  const Setup<T> st(a, slot.unit);
  const int warp = threadIdx.x >> 5;
  const int i0 = q0 + warp * 16;  // the warp's first query

  const T* k = st.at_kv(a.k, a);
  const T* v = st.at_kv(a.v, a);
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
    softmax_step<T, D, kKeep>(s, o, m, l, st, cBias, i0, k0, kKeep ? keep_row + 32 * t : nullptr);
    tile_xb<T, D>(o, s, cV);
    pipeline_next(t, n_tiles, issue_kv);
  }

  store_out_lse<T, D>(a, st, i0, o, m, l);
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

}  // namespace

template <typename T>
cudaError_t launch_attention_fwd(const AttentionArgs<T>& a, cudaStream_t stream) {
  if (attention_sm90_runs(a.head_dim)) return launch_attention_fwd_sm90(a, stream);
  switch (a.head_dim) {
    case 16: return fwd<T, 16>(a, stream);
    case 32: return fwd<T, 32>(a, stream);
    case 64: return fwd<T, 64>(a, stream);
    case 128: return fwd<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t launch_attention_fwd<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_fwd<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace lsmini
