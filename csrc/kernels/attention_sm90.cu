/*
 * attention_sm90.cu — the fused attention forward for Hopper (sm_90a), and the switch that picks the Hopper
 * kernels. Same math, layout, conventions, masks and dropout bits as attention.cu (its opening comment);
 * only the tile products differ: warpgroup MMAs (attention_sm90.cuh) read Q, K and V from 128-byte-swizzled
 * shared tiles instead of mma.sync reading register fragments. Head dims 64 and 128 (the swizzle's rows are
 * 64 elements); 16 and 32 stay on the sm_80 kernels.
 *
 * How (head dim 64): a CTA of one warpgroup (4 warps) owns a 64-query block, each warp 16 rows (the rows of its
 * wgmma accumulators, in the mma.m16n8 layout the shared score-tile code expects). Per key tile:
 *   S = Q·Kᵀ     m64n64k16 × D/16, A = Q and B = K from shared memory (both K-major);
 *   online softmax, masks and dropout on S in registers (softmax_step, as the sm_80 kernel);
 *   O += P̃·V     m64nDk16 × 4, A = P̃ from registers, B = V from shared memory (N-major).
 * Q, K and V arrive by the TMA unit (tensor maps encoded at launch; one thread issues a tile's copies, which
 * complete on an mbarrier and land already swizzled); K and V stream through two buffers.
 * Head dim 128 over more than 256 keys: the same per-tile steps in a warp-specialized kernel (below): two such
 * warpgroups a CTA, each with its own 64 queries, fed by a third that fills a ring of shared-memory stages
 * (the key bias, and one thread's TMA copies of the K/V tiles).
 */
#include "attention_sm90.cuh"

#include <atomic>

namespace lsmini {
namespace {

// At head dim 64 five CTAs an SM fit without spills; with dropout's keep bits the kernel needs the registers of four.
template <typename T, int D, bool kKeep>
__global__ void __launch_bounds__(kThreads, D > 64 ? 2 : kKeep ? 4 : 5)
    attention_fwd_sm90_kernel(const AttentionArgs<T> a, const __grid_constant__ AttentionMaps maps) {
  begin_dependent_kernel();
#if defined(LSMINI_SM90A_DEVICE)
  // Q, then K and V double-buffered (swizzled tiles), then the key bias of each buffer, then the mbarriers of Q
  // and of the two K/V buffers.
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_1k(smem_raw);
  constexpr int kTile = kSwTileBytes<D>;
  const uint32_t sQ = smem_u32(smem), sK = sQ + kTile, sV = sK + 2 * kTile;
  float* sBias = reinterpret_cast<float*>(smem + 5 * kTile);  // [2][kBlock]
  const uint32_t bar_q = smem_u32(sBias + 2 * kBlock), bar_kv = bar_q + 8;  // bar_kv + 8·buffer

  const GridSlot slot = grid_slot(blockIdx.x, a.batch * a.heads, (a.q_len + kBlock - 1) / kBlock, a.causal, true);
  const int q0 = slot.block * kBlock;
  const Setup<T> st(a, slot.unit);
  const int i0 = q0 + (threadIdx.x >> 5) * 16;  // the warp's first query

  auto issue_kv = [&](int t) { issue_kv_tile<T, D>(t, sK, sV, sBias, bar_kv, maps, st, st.kv_head(a)); };
  const int n_tiles = (st.vis.key_end(q0) + kBlock - 1) / kBlock;
  if (n_tiles > 0) {  // nothing loaded without a visible key
    if (threadIdx.x == 0) {
      mbar_init_copies(bar_q, 3);
      mbar_expect_tx(bar_q, kTile);
      tma_tile<D>(sQ, &maps.q, q0, st.h, st.b, bar_q);
    }
    issue_kv(0);
    if (n_tiles > 1) issue_kv(1);
    __syncthreads();  // the mbarriers initialized, and the key bias of tiles 0 and 1, for every thread
    mbar_wait(bar_q, 0);
  }

  uint32_t* const keep_row = kKeep ? st.keep_word(i0, 0) : nullptr;
  float o[D / 8][4] = {};
  float m[2] = {-kInf, -kInf};
  float l[2] = {0.f, 0.f};
  for (int t = 0; t < n_tiles; ++t) {
    const uint32_t cK = sK + (t & 1) * kTile, cV = sV + (t & 1) * kTile;
    mbar_wait(bar_kv + 8 * (t & 1), (t >> 1) & 1);  // the buffer's (t >> 1)-th fill
    float s[8][4];
    wg_abt<T, D>(s, sQ, cK);
    wgmma_sync(s);
    softmax_step<T, D, kKeep>(s, o, m, l, st, sBias + (t & 1) * kBlock, i0, t * kBlock,
                              kKeep ? keep_row + 32 * t : nullptr);
    wg_xb<T, D>(o, s, cV);
    wgmma_sync(o);
    if (t + 1 < n_tiles) {
      __syncthreads();  // no warp reads buffer t & 1 any more; tile t + 1's key bias is visible
      if (t + 2 < n_tiles) issue_kv(t + 2);
    }
  }

  store_out_lse<T, D>(a, st, i0, o, m, l);
#else
  __trap();  // never launched: attention_sm90_runs is false without sm_90a code
#endif
}

// ---- head dim 128: the warp-specialized forward ------------------------------------------------------------
// At head dim 128 the one-warpgroup kernel holds two CTAs an SM, too few to hide each CTA's waits for its tiles and
// its MMAs behind the other's softmax; this kernel splits the work by role instead: a producer warpgroup that only
// copies and kWsConsumers warpgroups that only compute, one CTA an SM. (At head dim 64 the one-warpgroup kernel
// holds four or five CTAs an SM and is the faster.)
// A stage holds 128 keys, so that a consumer's score products are m64n128 MMAs: at N = 64 the products read their
// two shared-memory operands at the rate shared memory delivers, at N = 128 a third less a product.
constexpr int kWsConsumers = 2, kWsStages = 2, kWsStageKeys = 2 * kBlock, kWsQueries = kWsConsumers * kBlock;
// Head dim 128 takes the warp-specialized kernel past this many keys (the switch below).
constexpr int kWsMinKeys = 256;
// Registers a thread of the producer and of a consumer warpgroup holds after setmaxnreg (multiples of 8, the CTA's
// within the SM's 64 K).
constexpr int kWsProducerRegs = 40, kWsConsumerRegs = 232;
static_assert(kThreads * (kWsProducerRegs + kWsConsumers * kWsConsumerRegs) <= 65536, "");
// The consumers' setmaxnreg.inc waits until the producer's .dec has released the registers it takes: at launch every
// thread holds the bound's 168 (65 536 over 384 threads, in multiples of 8), so the producer must give up at least
// what the consumers gain, or they wait forever.
constexpr int kWsLaunchRegs = 65536 / (kThreads * (1 + kWsConsumers)) / 8 * 8;
static_assert(kWsLaunchRegs - kWsProducerRegs >= kWsConsumers * (kWsConsumerRegs - kWsLaunchRegs), "");
static_assert(kWsConsumers <= kWsStages, "");

// The shared memory: two Q buffers of each consumer (a block's and the next one's), the stages' K, V and key bias,
// then a full and an empty barrier a stage and a free barrier a Q buffer. A stage's K (and V) is one swizzled tile
// of 128 rows: D / 64 blocks of [128 keys][64 elements], kPanel bytes apart, its two 64-key halves 8 KB apart in each.
template <int D>
struct WsSmem {
  static constexpr int kTile = kSwTileBytes<D>, kStage = 2 * kTile, kPanel = kWsStageKeys * 128;
  static constexpr int q = 0, k = q + 2 * kWsConsumers * kTile, v = k + kWsStages * kStage,
                       bias = v + kWsStages * kStage, full = bias + kWsStages * kWsStageKeys * 4,
                       empty = full + kWsStages * 8, q_free = empty + kWsStages * 8,
                       bytes = q_free + 2 * kWsConsumers * 8;
};

// The two consumers take turns issuing their score MMAs, consumer 0 first: a consumer's step waits for the
// other's score MMAs of the step before to be committed (named barrier 1 + c, both consumers' threads), so that the
// two run half a step apart and one's softmax tends to run while the other's products do. Consumer c's step j waits
// only if the other has a step that passes it the turn (consumer 1's step j − 1 for consumer 0, whose step 0
// consumer 1 passes at its start; consumer 0's step j for consumer 1): one that runs out of steps leaves no
// barrier half-arrived, and each pass is taken before the next, so a barrier never sees two arrivals in a row.
#if defined(LSMINI_SM90A_DEVICE)
struct WsTurns {
  int c, other, done = 0;  // this consumer, the other's step count, this one's steps taken
  __device__ WsTurns(int c_, int other_) : c(c_), other(other_) {
    static_assert(kWsConsumers == 2, "turns between two consumers");
    barrier(c == 1 && other > 0, false, 1);
  }
  // bar.sync or bar.arrive under a predicate: pass() sits between the MMAs' commit and their wait, where a branch
  // would make ptxas wait for them first.
  __device__ static void barrier(bool when, bool sync, int id) {
    if (sync)
      asm volatile("{ .reg .pred p; setp.ne.u32 p, %0, 0; @p bar.sync %1, %2; }" ::"r"(int(when)), "r"(id),
                   "n"(2 * kThreads) : "memory");
    else
      asm volatile("{ .reg .pred p; setp.ne.u32 p, %0, 0; @p bar.arrive %1, %2; }" ::"r"(int(when)), "r"(id),
                   "n"(2 * kThreads));
  }
  // Before the step's score MMAs.
  __device__ void wait() { barrier(done < other + 1 - c, true, 1 + c); }
  // Once they are committed.
  __device__ void pass() {
    barrier(done + c < other, false, 2 - c);
    ++done;
  }
};
#endif

// Warp-specialized and persistent: one CTA an SM walks query blocks of 128 queries of one head, one a round of the
// grid (block_of); the rounds take them from the last block (under a causal mask the longest walk) to the first, each
// over all heads. Warpgroup 0 (the producer) streams each block's Q and its K/V tiles into a ring of kWsStages stages
// by TMA and publishes each stage with its full barrier; the other warpgroups (the consumers) each own 64 of the
// block's queries and run the loop of the one-warpgroup kernel on every stage, then free it with the stage's empty
// barrier. The ring and its phases run on across blocks (g counts the CTA's stages), and Q has two buffers a consumer,
// so the next block's Q and first tiles load while the consumers finish a block and store its output. No
// __syncthreads couples the consumers: each waits only for the data it reads, and one's softmax runs while the
// other's products do.
template <typename T, int D, bool kKeep>
__global__ void __launch_bounds__(kThreads * (1 + kWsConsumers), 1)
    attention_fwd_ws_sm90_kernel(const AttentionArgs<T> a, const __grid_constant__ AttentionMaps maps) {
  begin_dependent_kernel();
#if defined(LSMINI_SM90A_DEVICE)
  using L = WsSmem<D>;
  constexpr int kStages = kWsStages, kTile = L::kTile, kStage = L::kStage, kPanel = L::kPanel;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_1k(smem_raw);
  const uint32_t base = smem_u32(smem);
  float* const sBias = reinterpret_cast<float*>(smem + L::bias);  // [kStages][kWsStageKeys]
  const uint32_t full = base + L::full, empty = base + L::empty, q_free = base + L::q_free;

  const int nqb = (a.q_len + kWsQueries - 1) / kWsQueries, bh = a.batch * a.heads, blocks = nqb * bh;
  // Block x: its first query, its (batch, head), the key tiles consumer c reads (none for one whose queries start
  // past q_len) and the tiles the producer loads (the most of them).
  auto first_query = [&](int x) { return (nqb - 1 - x / bh) * kWsQueries; };
  // The CTA's block of round k: the grid takes the next gridDim.x blocks in order on even rounds and reversed
  // on odd ones, so the CTA with a round's longest walk has the next round's shortest (a fixed stride would give
  // CTA 0 the longest of every round). Past the last block the walk ends: only the last round is partial.
  auto block_of = [&](int k) {
    const int ctas = int(gridDim.x), i = int(blockIdx.x);
    return k * ctas + (k % 2 ? ctas - 1 - i : i);
  };
  auto tiles_of = [&](const Setup<T>& st, int q0, int c) {
    const int qc = q0 + c * kBlock;
    return qc < a.q_len ? (st.vis.key_end(qc) + kBlock - 1) / kBlock : 0;
  };
  auto tiles = [&](const Setup<T>& st, int q0) {
    int n = 0;
#pragma unroll
    for (int c = 0; c < kWsConsumers; ++c) n = max(n, tiles_of(st, q0, c));
    return n;
  };

  // Every consumer frees every stage the producer fills, read or not, and each of its Q buffers once a block.
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + 8 * s, kThreads);  // every producer thread, once it wrote its key bias (and the copies' bytes)
      mbar_init(empty + 8 * s, kWsConsumers * kThreads);
    }
#pragma unroll
    for (int b = 0; b < 2 * kWsConsumers; ++b) mbar_init(q_free + 8 * b, kThreads);
    fence_mbar_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / kThreads;
  if (wg == 0) {  // ---- the producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWsProducerRegs));
    const int tid = threadIdx.x;
    int g = 0, n = 0;  // the CTA's stages and its blocks with tiles so far
    for (int k = 0, x; (x = block_of(k)) < blocks; ++k) {
      const int q0 = first_query(x);
      const Setup<T> st(a, x % bh);
      const int n_tiles = tiles(st, q0), h_kv = st.kv_head(a);
      // Stage j (key tiles 2j and 2j + 1: one box of 128 rows a 64-column block) into ring stage g % kStages once the
      // consumers are done with the stage kStages before: every producer thread writes its key bias and arrives;
      // thread 0 instead arrives expecting the bytes of the stage's copies, which it has the TMA unit make (the
      // block's Q with its first stage, into buffer n % 2 once the consumers freed it, two blocks with tiles ago).
      // The stage's phase completes when both are in.
      for (int j = 0; 2 * j < n_tiles; ++j, ++g) {
        const int s = g % kStages, kt = j * kWsStageKeys;
        if (g >= kStages) mbar_wait(empty + 8 * s, (g / kStages - 1) & 1);
        static_assert(kThreads == kWsStageKeys, "a producer thread a key of the stage");
        sBias[s * kWsStageKeys + tid] = st.vis.key_bias(kt + tid);
        if (tid != 0) {
          mbar_arrive(full + 8 * s);
          continue;
        }
        const uint32_t bar = full + 8 * s;
        if (j == 0) {
          const int queries = min(kWsConsumers, (a.q_len - q0 + kBlock - 1) / kBlock);
          if (n >= 2) {
#pragma unroll
            for (int c = 0; c < kWsConsumers; ++c) mbar_wait(q_free + 8 * (2 * c + n % 2), (n / 2 - 1) & 1);
          }
          mbar_expect_tx(bar, 2 * kStage + queries * kTile);
          for (int c = 0; c < queries; ++c)
            tma_tile<D>(base + L::q + (2 * c + n % 2) * kTile, &maps.q, q0 + c * kBlock, st.h, st.b, bar);
        } else {
          mbar_expect_tx(bar, 2 * kStage);
        }
        tma_tile<D>(base + L::k + s * kStage, &maps.k, kt, h_kv, st.b, bar, kPanel);
        tma_tile<D>(base + L::v + s * kStage, &maps.v, kt, h_kv, st.b, bar, kPanel);
      }
      n += n_tiles > 0;
    }
    return;
  }

  // ---- a consumer: queries [qc, qc + 64) of each block
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWsConsumerRegs));
  const int c = wg - 1;
  int g = 0, n = 0;  // as the producer's
  for (int k = 0, x; (x = block_of(k)) < blocks; ++k) {
    const int q0 = first_query(x);
    const Setup<T> st(a, x % bh);
    const int n_tiles = tiles(st, q0), my_tiles = tiles_of(st, q0, c), qc = q0 + c * kBlock;
    const int i0 = qc + ((threadIdx.x >> 5) & 3) * 16;  // the warp's first query
    // Both consumers start a block together: the turns of the block before are all taken (a named barrier must
    // not see one consumer's passes of two blocks in a row).
    if (k > 0) asm volatile("bar.sync 3, %0;\n" ::"n"(2 * kThreads) : "memory");
    WsTurns turns(c, (tiles_of(st, q0, 1 - c) + 1) / 2);
    const uint32_t sQ = base + L::q + (2 * c + n % 2) * kTile;
    uint32_t* const keep_row = kKeep && qc < a.q_len ? st.keep_word(i0, 0) : nullptr;
    float o[D / 8][4] = {};
    float m[2] = {-kInf, -kInf};
    float l[2] = {0.f, 0.f};
    // A stage (two key tiles) a step: one max and one rescale of o for 128 keys (o is 64 registers a thread at head
    // dim 128), the scores of both tiles one m64n128 product. The last tile of an odd count takes a step of its own
    // (an m64n64 product on the stage's first half), outside the loop: a branch between MMAs makes ptxas serialize
    // them.
    const int steps = my_tiles / 2, n_stages = (n_tiles + 1) / 2;
    int j = 0;
    for (; j < steps; ++j) {
      const int s = (g + j) % kStages, t = 2 * j;
      const uint32_t sK = base + L::k + s * kStage, sV = base + L::v + s * kStage;
      const float* const bias = sBias + s * kWsStageKeys;
      mbar_wait(full + 8 * s, ((g + j) / kStages) & 1);
      float sc[2][8][4];
      turns.wait();
      wg_abt<T, D, 2 * kBlock>(*reinterpret_cast<float(*)[16][4]>(&sc), sQ, sK, kPanel);
      wgmma_commit();
      turns.pass();
      wgmma_wait(sc[0], sc[1]);
      float mx[2] = {-kInf, -kInf}, shift[2];
      tile_max(sc[0], st, bias, i0, t * kBlock, mx);
      tile_max(sc[1], st, bias + kBlock, i0, (t + 1) * kBlock, mx);
      rescale_rows<T, D>(mx, o, m, l, st, shift);
      tile_probs<T, kKeep>(sc[0], shift, l, st, i0, t * kBlock, kKeep ? keep_row + 32 * t : nullptr);
      tile_probs<T, kKeep>(sc[1], shift, l, st, i0, (t + 1) * kBlock, kKeep ? keep_row + 32 * (t + 1) : nullptr);
      wg_xb<T, D>(o, sc[0], sV, kPanel);
      wg_xb<T, D>(o, sc[1], sV + kSwBlockBytes, kPanel);
      wgmma_sync(o);
      mbar_arrive(empty + 8 * s);
    }
    if (2 * j < my_tiles) {
      const int s = (g + j) % kStages, t = 2 * j;
      mbar_wait(full + 8 * s, ((g + j) / kStages) & 1);
      float sc[8][4];
      turns.wait();
      wg_abt<T, D>(sc, sQ, base + L::k + s * kStage, kPanel);
      wgmma_commit();
      turns.pass();
      wgmma_wait(sc);
      softmax_step<T, D, kKeep>(sc, o, m, l, st, sBias + s * kWsStageKeys, i0, t * kBlock,
                                kKeep ? keep_row + 32 * t : nullptr);
      wg_xb<T, D>(o, sc, base + L::v + s * kStage, kPanel);
      wgmma_sync(o);
      mbar_arrive(empty + 8 * s);
      ++j;
    }
    // The stages this consumer does not read (its queries end before them, or it has none): freed once filled.
    for (; j < n_stages; ++j) {
      const int s = (g + j) % kStages;
      mbar_wait(full + 8 * s, ((g + j) / kStages) & 1);
      mbar_arrive(empty + 8 * s);
    }
    if (n_tiles > 0) mbar_arrive(q_free + 8 * (2 * c + n % 2));
    if (qc < a.q_len) store_out_lse<T, D>(a, st, i0, o, m, l);
    g += n_stages;
    n += n_tiles > 0;
  }
#else
  __trap();  // never launched: attention_sm90_runs is false without sm_90a code
#endif
}

template <typename T>
cudaError_t fwd_ws_sm90(const AttentionArgs<T>& a, cudaStream_t stream) {
  constexpr int D = 128;
  // One CTA an SM, or one a block where there are fewer blocks.
  const int64_t blocks = std::min<int64_t>(int64_t(a.batch) * a.heads * ((a.q_len + kWsQueries - 1) / kWsQueries),
                                           sm_count());
  // two Q tiles a consumer, kWsStages × (K, V, key bias), the barriers: 197 696 B.
  const size_t bytes = WsSmem<D>::bytes;
  const int threads = kThreads * (1 + kWsConsumers);
  AttentionMaps maps;
  if (blocks > 0 && !encode_maps(&maps, a, false, kWsStageKeys)) return cudaErrorInvalidValue;
  if (a.keep != nullptr && a.dropout_p > 0.f) {
    return launch_with_maps(attention_fwd_ws_sm90_kernel<T, D, true>, blocks, bytes, a, maps, stream, threads);
  }
  return launch_with_maps(attention_fwd_ws_sm90_kernel<T, D, false>, blocks, bytes, a, maps, stream, threads);
}

template <typename T, int D>
cudaError_t fwd_sm90(const AttentionArgs<T>& a, cudaStream_t stream) {
  const int64_t blocks = int64_t(a.batch) * a.heads * ((a.q_len + kBlock - 1) / kBlock);
  AttentionMaps maps;
  if (blocks > 0 && !encode_maps(&maps, a, false)) return cudaErrorInvalidValue;
  // Q + 2×K + 2×V tiles + 2 bias arrays + 3 mbarriers: D = 64 → 41 496 B, D = 128 → 82 456 B.
  const size_t bytes = 5 * kSwTileBytes<D> + 2 * kBlock * sizeof(float) + 3 * 8;
  if (a.keep != nullptr && a.dropout_p > 0.f) {
    return launch_with_maps(attention_fwd_sm90_kernel<T, D, true>, blocks, bytes, a, maps, stream);
  }
  return launch_with_maps(attention_fwd_sm90_kernel<T, D, false>, blocks, bytes, a, maps, stream);
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
    // Over few key tiles the warp-specialized kernel's pipeline does not fill: the one-warpgroup kernel is
    // the faster up to kWsMinKeys keys.
    case 128: return a.k_len > kWsMinKeys ? fwd_ws_sm90<T>(a, stream) : fwd_sm90<T, 128>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

template cudaError_t launch_attention_fwd_sm90<__half>(const AttentionArgs<__half>&, cudaStream_t);
template cudaError_t launch_attention_fwd_sm90<__nv_bfloat16>(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);

}  // namespace lsmini
