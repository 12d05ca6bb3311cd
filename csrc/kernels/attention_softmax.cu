/*
 * attention_softmax.cu — softmax over the keys of attention scores with the key-padding mask, the
 * causal mask and attention-probability dropout fused into one pass; and its backward.
 *
 * Layout: scores [batch, heads, q_len, k_len], contiguous, already scaled by 1/sqrt(d). One row = the
 * k_len scores of one query; rows = batch·heads·q_len, row r is query i = r % q_len of batch
 * b = r / (heads·q_len). The key-padding mask is bytes [batch, k_len], nonzero = pad.
 *
 * Forward, per row, fp32 math:
 *   masked(j) = pad[b, j]  or  (causal and j > i + k_len − q_len)
 *     (causal is aligned bottom-right: the last query sees every key, so a cached decoding step
 *      with q_len < k_len works; with q_len > k_len the first q_len − k_len rows see no key)
 *   y_j   = exp(x_j − m) / Σ_k exp(x_k − m) over unmasked keys, m their max; masked keys give 0
 *           and a row with every key masked is all 0 (never NaN)
 *   out_j = keep_j · y_j / (1 − p)          (dropout; written to a second buffer only when p > 0)
 * Backward (masked keys have y = 0, so no mask is needed):
 *   g_j = dout_j · keep_j / (1 − p),   dx_j = y_j · (g_j − Σ_k y_k g_k)
 *
 * Dropout: element index = flat index into [batch, heads, q_len, k_len], row·k_len + col, with the
 * common.cuh convention (16-bit value idx % 8 of dropout_bits(seed, offset, idx / 8)); backward regenerates
 * keep from (seed, offset). p = 0 draws nothing; p = 1 gives zeros (scale 0). Each kernel resolves its
 * PhiloxArgs once, before its first Philox call (common.cuh), so under CUDA graph capture it reads the
 * (seed, offset) that torch sets before each replay.
 *
 * How: a row lives in registers, owned by a thread group sized to it, so the scores are read once
 * and both outputs written once; max and sum are two reductions inside the same kernel.
 *   - k_len ≤ 1024: GROUP = a power of two ≤ 32 lanes per row (128-thread blocks hold 128/GROUP
 *     rows), each lane owning ITEMS chunks c = lane + it·GROUP (at least two from 16 chunks on);
 *     reductions are shuffles.
 *   - k_len > 1024: one block per row, up to 512 threads × 32 values (the 16384 limit).
 *   A chunk is VEC elements: 16 bytes when k_len·sizeof(T) % 16 == 0 and the pointers are aligned
 *   (then a chunk's flat index is a multiple of VEC and its draws come from whole or half Philox
 *   groups), else VEC = 1 with one Philox call per element (the slow path for odd k_len).
 * Napkin math (H200, fp16, p > 0): 6 bytes/element (read x, write y and out) → ~0.7e12 elements/s
 * at copy speed; one Philox (~80 instructions) per 8 elements keeps the SMs well below their
 * integer-issue limit, so the kernel stays memory-bound. Causal chunks above the diagonal are not
 * read at all.
 */
#include "common.cuh"
#include "attention_softmax.h"

#include <type_traits>

namespace lsmini {
namespace {

constexpr int kRowsBlockThreads = 128;    // block of several short rows
constexpr int kRowBlockMaxThreads = 512;  // block per long row
constexpr int kMaxValuesPerThread = 32;   // row values one thread keeps in registers
constexpr int kWarpRowMaxKeys = 32 * kMaxValuesPerThread;
constexpr int kLongRowKeys = 8192;        // beyond: 32 values per thread so a block stays ≤ 512 threads

// Threads that own a row. GROUP ≤ 32: GROUP lanes of one warp, blockDim = (GROUP, rows per block).
// GROUP == 0: the whole block (blockDim.x threads, a multiple of 32, blockDim.y == 1).
template <int GROUP>
struct RowGroup {
  static __device__ __forceinline__ int size() { return GROUP == 0 ? int(blockDim.x) : GROUP; }
  static __device__ __forceinline__ int64_t row() {
    return GROUP == 0 ? int64_t(blockIdx.x) : int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  }
  static __device__ __forceinline__ float max(float v, float* smem) {
    if constexpr (GROUP == 0) {
      return block_max(v, smem);
    } else {
      return warp_max<GROUP>(v);
    }
  }
  static __device__ __forceinline__ float sum(float v, float* smem) {
    if constexpr (GROUP == 0) {
      return block_sum(v, smem);
    } else {
      return warp_sum<GROUP>(v);
    }
  }
};

// VEC key-padding mask bytes as loaded (VEC-byte aligned), tested one byte where each is used: packing
// the bytes' tests into a bit word first cost about five instructions per element.
template <int VEC>
struct PadBytes {
  static constexpr int kWords = (VEC + 3) / 4;
  uint32_t w[kWords] = {};
  __device__ __forceinline__ void load(const uint8_t* p) {
    if constexpr (VEC % 4 == 0) {
      const Pack<uint32_t, kWords> pk = *reinterpret_cast<const Pack<uint32_t, kWords>*>(p);
#pragma unroll
      for (int i = 0; i < kWords; ++i) w[i] = pk.v[i];
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) w[j / 4] |= uint32_t(p[j]) << (8 * (j % 4));
    }
  }
  __device__ __forceinline__ bool operator[](int j) const { return (w[j / 4] >> (8 * (j % 4))) & 0xFFu; }
};

// n / d for 0 ≤ n < 2^31 as a multiply-high, an add and a shift (Granlund and Montgomery), with
// s = ⌈log2 d⌉ and m = ⌊2^32·(2^s − d)/d⌋ + 1 from the host. A 32-bit division is ~25 instructions;
// paid once a thread, at 8–16 scores a thread it was a visible share of the forward.
struct FastDiv {
  uint32_t d, m, s;
  static FastDiv of(uint32_t d) {
    uint32_t s = 0;
    while ((uint64_t(1) << s) < d) ++s;
    return {d, uint32_t((((uint64_t(1) << s) - d) << 32) / d + 1), s};
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
  __device__ __forceinline__ uint32_t mod(uint32_t n) const { return n - div(n) * d; }
};

template <typename T>
struct FwdArgs {
  const T* scores;
  const uint8_t* pad;  // [batch, k_len] or null
  T* softmax;
  T* probs;            // written only when dropout
  int rows;
  FastDiv rows_per_batch;  // heads·q_len
  FastDiv q_len;
  int k_len;
  bool causal;
  bool dropout;
  uint32_t threshold;
  float scale;         // 1/(1 − p), 0 for p = 1
  PhiloxArgs rng;      // read only when dropout
};

template <typename T>
struct BwdArgs {
  const T* grad_probs;  // may be the same buffer as grad_scores: no __restrict__
  const T* softmax;
  T* grad_scores;
  int rows;
  int k_len;
  bool dropout;
  uint32_t threshold;
  float scale;
  PhiloxArgs rng;  // read only when dropout
};

template <typename T, int VEC, int ITEMS, int GROUP>
__global__ void __launch_bounds__(GROUP == 0 ? kRowBlockMaxThreads : kRowsBlockThreads)
attention_softmax_fwd_kernel(const FwdArgs<T> a) {
  begin_dependent_kernel();
  static_assert(ITEMS * VEC <= kMaxValuesPerThread, "row chunk per thread too large");
  using G = RowGroup<GROUP>;
  __shared__ float smem[32];
  // Resolved before any branch on the thread's row, so that the compiler can keep the seed, the offset and
  // the Philox key schedule in uniform registers, once per warp: resolved after `if (!live) return`, each
  // thread computed the keys itself, ~20 instructions a Philox call.
  const PhiloxSeedOffset philox = a.dropout ? resolve_philox(a.rng) : PhiloxSeedOffset{0, 0};
  const int tid = threadIdx.x, nthreads = G::size();
  const int64_t row64 = G::row();
  const bool live = row64 < a.rows;  // rows past the end still join their group's shuffles
  const int row = live ? int(row64) : 0;
  const int64_t base = int64_t(row) * a.k_len;

  int last = a.k_len - 1;  // keys after `last` are causally masked
  if (a.causal) last = min(last, int(a.q_len.mod(row)) + (a.k_len - int(a.q_len.d)));
  const uint8_t* pad = a.pad ? a.pad + int64_t(a.rows_per_batch.div(row)) * a.k_len : nullptr;

  float x[ITEMS][VEC];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int col = (it * nthreads + tid) * VEC;
    // Chunks wholly above the causal diagonal are not read: their output is 0 whatever they hold.
    if (live && col < a.k_len && col <= last) {
      load_pack<T, VEC>(a.scores + base + col, x[it]);
      PadBytes<VEC> padded;
      if (pad) padded.load(pad + col);
#pragma unroll
      for (int j = 0; j < VEC; ++j)
        if (padded[j] || col + j > last) x[it][j] = -INFINITY;
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) x[it][j] = -INFINITY;
    }
  }
  float m = -INFINITY;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int j = 0; j < VEC; ++j) m = fmaxf(m, x[it][j]);
  m = G::max(m, smem);
  // Every key masked ⇒ m = −inf; shifting by 0 then makes every exp(−inf) = 0 instead of NaN.
  const float shift = m == -INFINITY ? 0.f : m;
  float s = 0.f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      x[it][j] = __expf(x[it][j] - shift);
      s += x[it][j];
    }
  s = G::sum(s, smem);
  const float inv = s > 0.f ? 1.f / s : 0.f;
  if (!live) return;

  // Dropout is drawn here, where each element is selected, not before the reductions: a keep word carried
  // across them had to be packed from the compares and unpacked again, as many instructions as the draws.
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int col = (it * nthreads + tid) * VEC;
    if (col < a.k_len) {
      float y[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) y[j] = x[it][j] * inv;
      store_pack<T, VEC>(a.softmax + base + col, y);
      if (a.dropout) {
        // A chunk with no visible key is all 0 with or without dropout: no draw.
        if (col <= last) dropout_apply<VEC>(y, philox.seed, philox.offset, uint64_t(base + col), a.threshold, a.scale);
        store_pack<T, VEC>(a.probs + base + col, y);
      }
    }
  }
}

template <typename T, int VEC, int ITEMS, int GROUP>
__global__ void __launch_bounds__(GROUP == 0 ? kRowBlockMaxThreads : kRowsBlockThreads)
attention_softmax_bwd_kernel(const BwdArgs<T> a) {
  begin_dependent_kernel();
  static_assert(ITEMS * VEC <= kMaxValuesPerThread, "row chunk per thread too large");
  using G = RowGroup<GROUP>;
  __shared__ float smem[32];
  const PhiloxSeedOffset philox = a.dropout ? resolve_philox(a.rng) : PhiloxSeedOffset{0, 0};
  const int tid = threadIdx.x, nthreads = G::size();
  const int64_t row64 = G::row();
  const bool live = row64 < a.rows;
  const int64_t base = (live ? row64 : 0) * a.k_len;

  // The whole row is read before the reduction and written after it, and each thread writes only
  // the chunks it read itself, so grad_scores may overwrite grad_probs.
  float g[ITEMS][VEC], y[ITEMS][VEC];
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int col = (it * nthreads + tid) * VEC;
    if (live && col < a.k_len) {
      load_pack<T, VEC>(a.grad_probs + base + col, g[it]);
      load_pack<T, VEC>(a.softmax + base + col, y[it]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[it][j] = y[it][j] = 0.f;
    }
  }
  if (a.dropout) {  // after the loads are issued, as in forward
#pragma unroll
    for (int it = 0; it < ITEMS; ++it) {
      const int col = (it * nthreads + tid) * VEC;
      if (live && col < a.k_len) dropout_apply<VEC>(g[it], philox.seed, philox.offset, uint64_t(base + col),
                                                    a.threshold, a.scale);
    }
  }
  float dot = 0.f;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it)
#pragma unroll
    for (int j = 0; j < VEC; ++j) dot += y[it][j] * g[it][j];
  dot = G::sum(dot, smem);
  if (!live) return;

#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    const int col = (it * nthreads + tid) * VEC;
    if (col < a.k_len) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) g[it][j] = y[it][j] * (g[it][j] - dot);
      store_pack<T, VEC>(a.grad_scores + base + col, g[it]);
    }
  }
}

// group: lanes per row (1..32), or 0 for a block of `threads` per row; items: chunks per thread.
struct Plan {
  int group, items, threads;
};

template <int VEC>
Plan make_plan(int k_len) {
  const int chunks = (k_len + VEC - 1) / VEC;
  if (k_len <= kWarpRowMaxKeys) {
    // From 16 chunks on, a lane owns at least two: its fixed work (the row's masks, the Philox keys, two
    // shuffle reductions) is then shared by 16 scores or more instead of 8.
    const int per_lane = chunks >= 16 ? 2 : 1;
    int group = 1;
    while (group < 32 && group * per_lane < chunks) group *= 2;
    int items = 1;
    while (items * group < chunks) items *= 2;
    return {group, items, kRowsBlockThreads};
  }
  const int items = (k_len <= kLongRowKeys ? 16 : 32) / VEC;
  const int threads = ((chunks + items - 1) / items + 31) / 32 * 32;
  return {0, items, threads};
}

template <int N>
using IntC = std::integral_constant<int, N>;

// Calls f(IntC<ITEMS>, IntC<GROUP>) for the power of two `items` ≤ MAXI with GROUP = 32.
template <int ITEMS, int MAXI, typename F>
cudaError_t with_warp_items(int items, F&& f) {
  if (items == ITEMS) return f(IntC<ITEMS>{}, IntC<32>{});
  if constexpr (ITEMS < MAXI) {
    return with_warp_items<ITEMS * 2, MAXI>(items, f);
  } else {
    return cudaErrorInvalidConfiguration;
  }
}

// Calls f(IntC<ITEMS>, IntC<GROUP>) with the plan's instantiation. Only the (items, group) pairs a
// plan can produce are instantiated: sub-warp groups have one chunk per lane, or two from 16 chunks on.
template <int VEC, typename F>
cudaError_t with_plan(const Plan& plan, F&& f) {
  switch (plan.group) {
    case 1: return f(IntC<1>{}, IntC<1>{});
    case 2: return f(IntC<1>{}, IntC<2>{});
    case 4: return f(IntC<1>{}, IntC<4>{});
    case 8: return plan.items == 2 ? f(IntC<2>{}, IntC<8>{}) : f(IntC<1>{}, IntC<8>{});
    case 16: return plan.items == 2 ? f(IntC<2>{}, IntC<16>{}) : f(IntC<1>{}, IntC<16>{});
    case 32: return with_warp_items<2, kMaxValuesPerThread / VEC>(plan.items, f);  // a whole warp: ≥ 33 chunks
    case 0:
      if (plan.items == 16 / VEC) return f(IntC<16 / VEC>{}, IntC<0>{});
      if (plan.items == 32 / VEC) return f(IntC<32 / VEC>{}, IntC<0>{});
      break;
  }
  return cudaErrorInvalidConfiguration;
}

template <int GROUP>
void launch_shape(const Plan& plan, int rows, dim3* grid, dim3* block) {
  if constexpr (GROUP == 0) {
    *block = dim3(plan.threads);
    *grid = dim3(rows);
  } else {
    const int per_block = kRowsBlockThreads / GROUP;
    *block = dim3(GROUP, per_block);
    *grid = dim3(static_cast<unsigned>((int64_t(rows) + per_block - 1) / per_block));
  }
}

template <typename T, int VEC>
cudaError_t fwd_dispatch(const FwdArgs<T>& a, cudaStream_t stream) {
  const Plan plan = make_plan<VEC>(a.k_len);
  return with_plan<VEC>(plan, [&](auto items, auto group) {
    constexpr int I = decltype(items)::value, G = decltype(group)::value;
    dim3 grid, block;
    launch_shape<G>(plan, a.rows, &grid, &block);
    return launch_dependent(attention_softmax_fwd_kernel<T, VEC, I, G>, grid, block, 0, stream, a);
  });
}

template <typename T, int VEC>
cudaError_t bwd_dispatch(const BwdArgs<T>& a, cudaStream_t stream) {
  const Plan plan = make_plan<VEC>(a.k_len);
  return with_plan<VEC>(plan, [&](auto items, auto group) {
    constexpr int I = decltype(items)::value, G = decltype(group)::value;
    dim3 grid, block;
    launch_shape<G>(plan, a.rows, &grid, &block);
    return launch_dependent(attention_softmax_bwd_kernel<T, VEC, I, G>, grid, block, 0, stream, a);
  });
}

constexpr int64_t kMaxRows = 0x7fffffff;  // row indices are int (and a block per row needs grid.x ≥ rows)

inline bool valid_p(float p) { return p >= 0.f && p <= 1.f; }  // false for NaN too

}  // namespace

template <typename T>
cudaError_t launch_attention_softmax_fwd(const T* scores, const uint8_t* key_padding_mask, T* softmax, T* probs,
                                         int64_t batch, int64_t heads, int64_t q_len, int64_t k_len, bool causal,
                                         float dropout_p, PhiloxArgs rng, cudaStream_t stream) {
  if (batch < 0 || heads < 0 || q_len < 0 || k_len < 0 || k_len > kAttentionSoftmaxMaxKeys || !valid_p(dropout_p))
    return cudaErrorInvalidValue;
  if (batch == 0 || heads == 0 || q_len == 0 || k_len == 0) return cudaSuccess;
  const int64_t rows = batch * heads * q_len;
  if (rows > kMaxRows) return cudaErrorInvalidValue;
  FwdArgs<T> a;
  a.scores = scores;
  a.pad = key_padding_mask;
  a.softmax = softmax;
  a.probs = probs;
  a.rows = int(rows);
  a.rows_per_batch = FastDiv::of(uint32_t(heads * q_len));
  a.q_len = FastDiv::of(uint32_t(q_len));
  a.k_len = int(k_len);
  a.causal = causal;
  a.dropout = dropout_p > 0.f;
  a.threshold = dropout_threshold(dropout_p);
  a.scale = dropout_p < 1.f ? 1.f / (1.f - dropout_p) : 0.f;
  a.rng = rng;
  if (a.dropout && (probs == nullptr || probs == softmax)) return cudaErrorInvalidValue;
  constexpr int V = Vec16<T>::value;
  const bool vec = k_len % V == 0 && is_aligned(scores, 16) && is_aligned(softmax, 16) &&
                   (!a.dropout || is_aligned(probs, 16)) && (!key_padding_mask || is_aligned(key_padding_mask, V));
  return vec ? fwd_dispatch<T, V>(a, stream) : fwd_dispatch<T, 1>(a, stream);
}

template <typename T>
cudaError_t launch_attention_softmax_bwd(const T* grad_probs, const T* softmax, T* grad_scores, int64_t rows,
                                         int64_t k_len, float dropout_p, PhiloxArgs rng, cudaStream_t stream) {
  if (rows < 0 || k_len < 0 || k_len > kAttentionSoftmaxMaxKeys || rows > kMaxRows || !valid_p(dropout_p))
    return cudaErrorInvalidValue;
  if (rows == 0 || k_len == 0) return cudaSuccess;
  BwdArgs<T> a;
  a.grad_probs = grad_probs;
  a.softmax = softmax;
  a.grad_scores = grad_scores;
  a.rows = int(rows);
  a.k_len = int(k_len);
  a.dropout = dropout_p > 0.f;
  a.threshold = dropout_threshold(dropout_p);
  a.scale = dropout_p < 1.f ? 1.f / (1.f - dropout_p) : 0.f;
  a.rng = rng;
  constexpr int V = Vec16<T>::value;
  const bool vec = k_len % V == 0 && is_aligned(grad_probs, 16) && is_aligned(softmax, 16) &&
                   is_aligned(grad_scores, 16);
  return vec ? bwd_dispatch<T, V>(a, stream) : bwd_dispatch<T, 1>(a, stream);
}

#define LSMINI_INSTANTIATE_ATTENTION_SOFTMAX(T)                                                                 \
  template cudaError_t launch_attention_softmax_fwd<T>(const T*, const uint8_t*, T*, T*, int64_t, int64_t,     \
                                                       int64_t, int64_t, bool, float, PhiloxArgs,              \
                                                       cudaStream_t);                                          \
  template cudaError_t launch_attention_softmax_bwd<T>(const T*, const T*, T*, int64_t, int64_t, float,        \
                                                       PhiloxArgs, cudaStream_t);

LSMINI_INSTANTIATE_ATTENTION_SOFTMAX(float)
LSMINI_INSTANTIATE_ATTENTION_SOFTMAX(__half)
LSMINI_INSTANTIATE_ATTENTION_SOFTMAX(__nv_bfloat16)

}  // namespace lsmini
