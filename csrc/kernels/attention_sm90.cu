/*
 * attention_sm90.cu — the fused attention forward for Hopper (sm_90a), and the switch that picks the Hopper
 * kernels. Same math, layout, conventions, masks and dropout bits as attention.cu (its opening comment);
 * only the tile products differ: warpgroup MMAs (attention_sm90.cuh) read Q, K and V from 128-byte-swizzled
 * shared tiles instead of mma.sync reading register fragments. Head dims 64 and 128 (the swizzle's rows are
 * 64 elements); 16 and 32 stay on the sm_80 kernels.
 *
 * How: a CTA of one warpgroup (4 warps) owns a 64-query block, each warp 16 rows (the rows of its
 * wgmma accumulators, in the mma.m16n8 layout the shared score-tile code expects). Per key tile:
 *   S = Q·Kᵀ     m64n64k16 × D/16, A = Q and B = K from shared memory (both K-major);
 *   online softmax, masks and dropout on S in registers (softmax_step, as the sm_80 kernel);
 *   O += P̃·V     m64nDk16 × 4, A = P̃ from registers, B = V from shared memory (N-major).
 * K and V stream through two buffers by cp.async as in attention.cu; a proxy fence after each tile's
 * copies lands makes them visible to the tensor cores' (async proxy) reads.
 */
#include "attention_sm90.cuh"

#include <atomic>

namespace lsmini {
namespace {

template <typename T, int D, bool kKeep>
__global__ void __launch_bounds__(kThreads, D <= 64 ? 4 : 2) attention_fwd_sm90_kernel(const AttentionArgs<T> a) {
#if defined(LSMINI_SM90A_DEVICE)
  // Q, then K and V double-buffered (swizzled tiles), then the key bias of each buffer.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_1k(smem_raw);
  constexpr int kTile = kSwTileBytes<D>;
  const uint32_t sQ = smem_u32(smem), sK = sQ + kTile, sV = sK + 2 * kTile;
  float* sBias = reinterpret_cast<float*>(smem + 5 * kTile);  // [2][kBlock]

  const int nqb = (a.q_len + kBlock - 1) / kBlock;
  const int q0 = (blockIdx.x % nqb) * kBlock;
  const Setup<T> st(a, blockIdx.x / nqb);
  const int i0 = q0 + (threadIdx.x >> 5) * 16;  // the warp's first query

  const T* k = st.at_kv(a.k, a);
  const T* v = st.at_kv(a.v, a);
  auto issue_kv = [&](int t) {  // key tile t into buffer t & 1, as in attention.cu
    const int kt = t * kBlock, buf = t & 1;
    load_tile_sw<T, D>(sK + buf * kTile, k + int64_t(kt) * a.k.row, a.k.row, min(kBlock, a.k_len - kt));
    load_tile_sw<T, D>(sV + buf * kTile, v + int64_t(kt) * a.v.row, a.v.row, min(kBlock, a.k_len - kt));
    st.vis.fill_key_bias(sBias + buf * kBlock, kt);
  };
  const int n_tiles = (st.vis.key_end(q0) + kBlock - 1) / kBlock;
  if (n_tiles > 0) {  // as attention.cu: Q and key tile 0 in group 0, nothing loaded without a visible key
    load_tile_sw<T, D>(sQ, st.at(a.q) + int64_t(q0) * a.q.row, a.q.row, min(kBlock, a.q_len - q0));
    pipeline_start<true>(n_tiles, issue_kv);
  }

  uint32_t* const keep_row = kKeep ? st.keep_word(i0, 0) : nullptr;
  float o[D / 8][4] = {};
  float m[2] = {-kInf, -kInf};
  float l[2] = {0.f, 0.f};
  for (int t = 0; t < n_tiles; ++t) {
    const uint32_t cK = sK + (t & 1) * kTile, cV = sV + (t & 1) * kTile;
    float s[8][4];
    wg_abt<T, D>(s, sQ, cK);
    wgmma_sync(s);
    softmax_step<T, D, kKeep>(s, o, m, l, st, sBias + (t & 1) * kBlock, i0, t * kBlock,
                              kKeep ? keep_row + 32 * t : nullptr);
    wg_xb<T, D>(o, s, cV);
    wgmma_sync(o);
    pipeline_next<true>(t, n_tiles, issue_kv);
  }

  store_out_lse<T, D>(a, st, i0, o, m, l);
#else
  __trap();  // never launched: attention_sm90_runs is false without sm_90a code
#endif
}

template <typename T, int D>
cudaError_t fwd_sm90(const AttentionArgs<T>& a, cudaStream_t stream) {
  const int64_t blocks = int64_t(a.batch) * a.heads * ((a.q_len + kBlock - 1) / kBlock);
  // Q + 2×K + 2×V tiles + 2 bias arrays: D = 64 → 41 472 B, D = 128 → 82 432 B.
  const size_t bytes = 5 * kSwTileBytes<D> + 2 * kBlock * sizeof(float);
  if (a.keep != nullptr && a.dropout_p > 0.f) {
    return launch(attention_fwd_sm90_kernel<T, D, true>, blocks, bytes, a, stream);
  }
  return launch(attention_fwd_sm90_kernel<T, D, false>, blocks, bytes, a, stream);
}

std::atomic<bool> g_sm90_enabled{true};

}  // namespace

bool attention_sm90_available() {
#if defined(LSMINI_SM90A)
  return compute_capability() == 90;
#else
  return false;
#endif
}

bool set_attention_sm90(bool enabled) { return g_sm90_enabled.exchange(enabled); }

bool attention_sm90_runs(int head_dim) {
  return (head_dim == 64 || head_dim == 128) && g_sm90_enabled.load(std::memory_order_relaxed) &&
         attention_sm90_available();
}

template <typename T>
cudaError_t launch_attention_fwd_sm90(const AttentionArgs<T>& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return fwd_sm90<T, 64>(a, stream);
    case 128: return fwd_sm90<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t launch_attention_fwd_sm90<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_fwd_sm90<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace lsmini
