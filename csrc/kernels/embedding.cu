/*
 * embedding.cu — token embedding with scale, positions and dropout fused into one pass.
 *
 * Forward, for flat row r = b·len + j of the output [batch, len, hidden]:
 *     out[r, :] = dropout(scale · weight[tokens[r], :] + pos_table[step + j, :])
 * and out[r, :] = 0 when tokens[r] == padding_idx or tokens[r] ∉ [0, vocab). The range check is the
 * Python op's job (it raises); the kernels still skip bad ids so an unchecked call never reads or
 * writes out of bounds.
 *
 * Dropout: element index i = r·hidden + c, the flat index into the [batch, len, hidden] output
 * (common.cuh convention), kept values scaled by 1/(1−p). Backward regenerates the same bits. Each
 * kernel resolves its PhiloxArgs once on entry (common.cuh), so under CUDA graph capture it reads the
 * (seed, offset) that torch sets before each replay.
 *
 * Backward, token table (dense, deterministic, no atomics): the flat token ids are sorted stably
 * (a radix sort over the bits of vocab only: ids that do not count, padding and ids outside [0, vocab),
 * become the key vocab and sort last), so equal ids form runs of consecutive sorted positions. The
 * sums are added into grad_weight (a zeroed table, or the parameter's existing gradient): rows of ids
 * that do not occur are never touched. The sorted array is cut into chunks
 * of kEmbeddingBwdChunk positions, one block each. A run that lies inside one chunk is summed in fp32
 * registers and added to its grad_weight row directly. A run that crosses chunk boundaries leaves
 * fp32 pieces in a scratch buffer (each chunk has at most two: the run it starts with, if that began
 * earlier, and the run it ends with, if that continues), and a second kernel — one block per chunk
 * in which such a run starts — adds the pieces in a fixed order. Work per block is thus bounded by the
 * chunk size, whatever the id distribution; only the finishing sum of a very long run (one id making
 * up most of the batch) is left to one block, which reads run_length/32 fp32 rows.
 *
 * Backward, positional table: grad_pos[step + j] = Σ_b dropout'(grad_out[b, j]) over counted tokens,
 * a column reduction over the batch. One block per position j, optionally per slice of the batch
 * (per-slice fp32 partials + a small second pass), so long batches of short sequences still fill the GPU.
 *
 * Layout: rows of `hidden` contiguous elements. 16-byte vectors along hidden when hidden is a multiple
 * of the vector width and every row pointer is 16-byte aligned; otherwise one element per thread.
 */
#include "common.cuh"
#include "embedding.h"

#include <cub/device/device_radix_sort.cuh>

#include <algorithm>

namespace lsmini {

namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // independent row loads in flight per thread in the backward loops

__device__ __forceinline__ bool is_counted(int64_t id, int64_t vocab, int64_t padding_idx) {
  return id >= 0 && id < vocab && id != padding_idx;
}

template <int VEC>
__device__ __forceinline__ void zero(float (&a)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) a[k] = 0.f;
}

// Sum acc over the blockDim.y lanes of a 2-D block into lane 0 (fixed order, so deterministic).
// Every thread of the block must call it. s_red holds VEC · blockDim.x · blockDim.y floats.
template <int VEC>
__device__ __forceinline__ void reduce_over_y(float (&acc)[VEC], float* s_red) {
  if (blockDim.y == 1) return;
  const int nthreads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
#pragma unroll
  for (int k = 0; k < VEC; ++k) s_red[k * nthreads + tid] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0) {
    for (int y = 1; y < blockDim.y; ++y) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += s_red[k * nthreads + y * blockDim.x + threadIdx.x];
    }
  }
  __syncthreads();  // s_red is reused by the next column tile
}

// Block shape for "one row of nvec vectors per threadIdx.y": x threads along the row (a power of two
// up to 32, then multiples of 32 up to kThreads), y = rows (or batch lanes) per block. With per_thread > 1
// a long row gets fewer threads, each walking about per_thread vectors of it.
struct Shape2D {
  int x, y;
};
inline Shape2D row_shape(int64_t nvec, int64_t per_thread = 1) {
  int x = 1;
  if (nvec <= 32) {
    while (x < nvec) x <<= 1;
  } else {
    const int64_t want = std::max<int64_t>(32, (nvec + per_thread - 1) / per_thread);
    x = static_cast<int>(std::min<int64_t>(kThreads, (want + 31) / 32 * 32));
  }
  return {x, std::max(1, kThreads / x)};
}

// Vectors each forward thread walks along its row. A thread's fixed work (the token id and its checks, the
// position in the sequence, the Philox key schedule) costs about as many instructions as one vector's
// dropout, scale and conversions; at one vector a thread it makes the kernel issue-bound.
constexpr int64_t kFwdVecsPerThread = 4;

}  // namespace

// ---------------------------------------------------------------------------------------------
// Forward: threadIdx.y picks the row, threadIdx.x walks its hidden dimension in VEC-vectors. The
// token id is read once per row (one broadcast load for all threads of the row).
// ---------------------------------------------------------------------------------------------
template <typename T, typename IdT, int VEC, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    embedding_fwd_kernel(T* __restrict__ out, const IdT* __restrict__ tokens, const T* __restrict__ weight,
                         const T* __restrict__ pos /* row `step` of the table */, int64_t rows, int64_t len,
                         int64_t hidden, int64_t vocab, float scale, int64_t padding_idx, uint32_t threshold,
                         float inv_keep, PhiloxArgs rng) {
  begin_dependent_kernel();
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(rng) : PhiloxSeedOffset{0, 0};
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int64_t id = static_cast<int64_t>(tokens[row]);
  const bool counted = is_counted(id, vocab, padding_idx);
  const T* w = weight + (counted ? id : 0) * hidden;
  // Position of the row in its sequence. A 64-bit remainder is a long emulated sequence per thread (a
  // visible share of this op's instruction budget); rows < 2^32 take the 32-bit one.
  const int64_t at = rows <= int64_t(UINT32_MAX) ? int64_t(uint32_t(row) % uint32_t(len)) : row % len;
  const T* p = pos + at * hidden;
  T* o = out + row * hidden;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < hidden; c += static_cast<int64_t>(blockDim.x) * VEC) {
    float v[VEC];
    if (counted) {
      float a[VEC], b[VEC];
      load_pack<T, VEC>(w + c, a);
      load_pack<T, VEC>(p + c, b);
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[k] = fmaf(scale, a[k], b[k]);
      if (DROPOUT) dropout_apply<VEC>(v, philox.seed, philox.offset, static_cast<uint64_t>(row * hidden + c),
                                      threshold, inv_keep);
    } else {
      zero(v);  // pad / bad ids: exact zeros, no RNG needed (a dropped zero is a zero)
    }
    store_pack<T, VEC>(o + c, v);
  }
}

// ---------------------------------------------------------------------------------------------
// Token-table gradient, the sort's input: key = the id where it counts, else vocab (after every id
// that counts); value = the flat position, so that a stable sort keeps each run in position order.
// ---------------------------------------------------------------------------------------------
template <typename IdT>
__global__ void __launch_bounds__(kThreads)
    embedding_bwd_keys_kernel(uint32_t* __restrict__ keys, int32_t* __restrict__ positions,
                              const IdT* __restrict__ tokens, int64_t rows, int64_t vocab, int64_t padding_idx) {
  begin_dependent_kernel();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const int64_t id = static_cast<int64_t>(tokens[i]);
  keys[i] = static_cast<uint32_t>(is_counted(id, vocab, padding_idx) ? id : vocab);
  positions[i] = static_cast<int32_t>(i);
}

// grad_weight[id] += factor · sum, rounded once.
template <typename T, int VEC>
__device__ __forceinline__ void add_row(T* dst, const float (&sum)[VEC], float factor) {
  float o[VEC];
  load_pack<T, VEC>(dst, o);
#pragma unroll
  for (int k = 0; k < VEC; ++k) o[k] += sum[k] * factor;
  store_pack<T, VEC>(dst, o);
}

// ---------------------------------------------------------------------------------------------
// Token-table gradient, pass 1: one block per chunk of sorted positions; threads along hidden.
// Runs are closed when the next sorted key differs. `factor` = scale (· 1/(1−p) with dropout) is applied
// only where a row is final, so the pieces of a crossing run stay plain sums. Keys equal to vocab (ids
// that do not count) sort last and are skipped.
// partials: per chunk, [head piece (hidden floats), tail piece (hidden floats)].
// ---------------------------------------------------------------------------------------------
template <typename T, int VEC, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    embedding_bwd_kernel(T* __restrict__ grad_weight, float* __restrict__ partials, const T* __restrict__ grad_out,
                         const uint32_t* __restrict__ sorted_keys, const int32_t* __restrict__ order, int64_t rows,
                         int64_t hidden, int64_t vocab, float factor, uint32_t threshold, PhiloxArgs rng) {
  begin_dependent_kernel();
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(rng) : PhiloxSeedOffset{0, 0};
  constexpr int C = static_cast<int>(kEmbeddingBwdChunk);
  __shared__ int64_t s_id[C];
  __shared__ int64_t s_row[C];
  __shared__ int s_head, s_tail;
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * C;
  const int n = static_cast<int>(min(static_cast<int64_t>(C), rows - p0));
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    s_id[i] = sorted_keys[p0 + i];
    s_row[i] = order[p0 + i];
  }
  if (threadIdx.x == 0) {
    // head: the chunk's first run began in an earlier chunk; tail: its last run goes on in a later one.
    s_head = p0 > 0 && sorted_keys[p0 - 1] == sorted_keys[p0];
    s_tail = p0 + n < rows && sorted_keys[p0 + n] == sorted_keys[p0 + n - 1];
  }
  __syncthreads();
  float* head_piece = partials + static_cast<int64_t>(blockIdx.x) * 2 * hidden;
  float* tail_piece = head_piece + hidden;

  for (int64_t c = static_cast<int64_t>(threadIdx.x) * VEC; c < hidden; c += static_cast<int64_t>(blockDim.x) * VEC) {
    float acc[VEC];
    zero(acc);
    bool first_run = true;
    for (int i0 = 0; i0 < n; i0 += kUnroll) {
      // Issue the loads of kUnroll rows first, then fold them in order (the sum order stays fixed).
      float g[kUnroll][VEC];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u;
        if (i < n && s_id[i] < vocab) {
          const int64_t src = s_row[i] * hidden + c;
          load_pack<T, VEC>(grad_out + src, g[u]);
          // Scale 1: the backward applies 1/(1 − p) with the embedding scale, once per output row.
          if (DROPOUT) dropout_apply<VEC>(g[u], philox.seed, philox.offset, static_cast<uint64_t>(src), threshold, 1.f);
        } else {
          zero(g[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int i = i0 + u;
        if (i >= n) break;
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += g[u][k];
        const int64_t id = s_id[i];
        if (i == n - 1 || s_id[i + 1] != id) {
          if (id < vocab) {
            if (first_run && s_head) {
              store_pack<float, VEC>(head_piece + c, acc);
            } else if (i == n - 1 && s_tail) {
              store_pack<float, VEC>(tail_piece + c, acc);
            } else {
              add_row<T, VEC>(grad_weight + id * hidden + c, acc, factor);
            }
          }
          first_run = false;
          zero(acc);
        }
      }
    }
  }
}

// Token-table gradient, pass 2: block k finishes the run that starts in chunk k and continues past
// it (if any): its tail piece plus the head pieces of the following chunks the run covers. threadIdx.x
// walks hidden, threadIdx.y strides over the pieces; lanes are then summed in a fixed order.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    embedding_bwd_finish_kernel(T* __restrict__ grad_weight, const float* __restrict__ partials,
                                const uint32_t* __restrict__ sorted_keys, int64_t rows, int64_t hidden, int64_t vocab,
                                float factor) {
  begin_dependent_kernel();
  __shared__ float s_red[VEC * kThreads];
  constexpr int64_t C = kEmbeddingBwdChunk;
  const int64_t k = blockIdx.x;
  const int64_t p0 = k * C, p1 = min(p0 + C, rows);
  if (p1 >= rows) return;  // the last chunk's runs cannot continue
  const uint32_t id = sorted_keys[p1 - 1];
  if (sorted_keys[p1] != id) return;                   // last run ends inside chunk k
  if (p0 > 0 && sorted_keys[p0 - 1] == id) return;     // began earlier: not ours
  if (id >= vocab) return;                             // ids that do not count
  // One past the run's last position: the first sorted position ≥ p1 holding another key.
  int64_t lo = p1, hi = rows;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted_keys[mid] == id) lo = mid + 1; else hi = mid;
  }
  const int64_t pieces = (lo - 1) / C - k + 1;  // piece 0: tail of chunk k; piece q: head of chunk k+q

  for (int64_t base = 0; base < hidden; base += static_cast<int64_t>(blockDim.x) * VEC) {
    const int64_t c = base + static_cast<int64_t>(threadIdx.x) * VEC;
    const bool active = c < hidden;
    float acc[VEC];
    zero(acc);
    if (active) {
#pragma unroll 4
      for (int64_t q = threadIdx.y; q < pieces; q += blockDim.y) {
        const float* src = q == 0 ? partials + (2 * k + 1) * hidden : partials + 2 * (k + q) * hidden;
        float v[VEC];
        load_pack<float, VEC>(src + c, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) acc[j] += v[j];
      }
    }
    reduce_over_y<VEC>(acc, s_red);
    if (threadIdx.y == 0 && active) add_row<T, VEC>(grad_weight + static_cast<int64_t>(id) * hidden + c, acc, factor);
  }
}

// ---------------------------------------------------------------------------------------------
// Positional-table gradient: block (j, slice) sums grad_out[b, j, :] over the batch rows b of its slice
// whose token counts. threadIdx.x walks hidden, threadIdx.y strides over b. With one slice the row
// is final (written in T); with several, each slice writes an fp32 partial for the finish pass.
// ---------------------------------------------------------------------------------------------
template <typename T, typename IdT, int VEC, bool DROPOUT>
__global__ void __launch_bounds__(kThreads)
    embedding_pos_bwd_kernel(T* __restrict__ grad_pos /* row `step` */, float* __restrict__ partials,
                             const T* __restrict__ grad_out, const IdT* __restrict__ tokens, int64_t batch,
                             int64_t len, int64_t hidden, int64_t vocab, int64_t padding_idx, float factor,
                             uint32_t threshold, PhiloxArgs rng) {
  begin_dependent_kernel();
  const PhiloxSeedOffset philox = DROPOUT ? resolve_philox(rng) : PhiloxSeedOffset{0, 0};
  __shared__ float s_red[VEC * kThreads];
  const int64_t j = blockIdx.x;
  const int64_t per = (batch + gridDim.y - 1) / gridDim.y;
  const int64_t b0 = static_cast<int64_t>(blockIdx.y) * per;
  const int64_t b1 = min(b0 + per, batch);

  for (int64_t base = 0; base < hidden; base += static_cast<int64_t>(blockDim.x) * VEC) {
    const int64_t c = base + static_cast<int64_t>(threadIdx.x) * VEC;
    const bool active = c < hidden;
    float acc[VEC];
    zero(acc);
    if (active) {
      for (int64_t b = b0 + threadIdx.y; b < b1; b += static_cast<int64_t>(blockDim.y) * kUnroll) {
        float g[kUnroll][VEC];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t bb = b + static_cast<int64_t>(u) * blockDim.y;
          const int64_t row = bb * len + j;
          if (bb < b1 && is_counted(static_cast<int64_t>(tokens[row]), vocab, padding_idx)) {
            load_pack<T, VEC>(grad_out + row * hidden + c, g[u]);
            if (DROPOUT)
              dropout_apply<VEC>(g[u], philox.seed, philox.offset, static_cast<uint64_t>(row * hidden + c), threshold,
                                 1.f);
          } else {
            zero(g[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
          for (int k = 0; k < VEC; ++k) acc[k] += g[u][k];
        }
      }
    }
    reduce_over_y<VEC>(acc, s_red);
    if (threadIdx.y == 0 && active) {
      if (gridDim.y == 1) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] *= factor;
        store_pack<T, VEC>(grad_pos + j * hidden + c, acc);
      } else {
        store_pack<float, VEC>(partials + (static_cast<int64_t>(blockIdx.y) * len + j) * hidden + c, acc);
      }
    }
  }
}

// grad_pos[i] = factor · Σ_s partials[s, i] over the slices, i ∈ [0, len·hidden).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    embedding_pos_bwd_finish_kernel(T* __restrict__ grad_pos, const float* __restrict__ partials, int64_t n,
                                    int64_t splits, float factor) {
  begin_dependent_kernel();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int64_t sp = 0; sp < splits; ++sp) s += partials[sp * n + i];
    grad_pos[i] = from_float<T>(s * factor);
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------
namespace {

struct DropoutParams {
  bool on;
  uint32_t threshold;
  float inv_keep;  // 0 for p = 1, so every element becomes an exact zero
};

inline DropoutParams dropout_params(float p) {
  if (!(p > 0.f)) return {false, 0u, 1.f};
  return {true, dropout_threshold(p), p < 1.f ? 1.f / (1.f - p) : 0.f};
}

}  // namespace

template <typename T, typename IdT>
cudaError_t launch_embedding_fwd(T* out, const IdT* tokens, const T* weight, const T* pos_table, int64_t batch,
                                 int64_t len, int64_t hidden, int64_t vocab, int64_t step, float scale,
                                 int64_t padding_idx, float dropout_p, PhiloxArgs rng, cudaStream_t stream) {
  const int64_t rows = batch * len;
  if (rows == 0 || hidden == 0) return cudaSuccess;
  constexpr int V = Vec16<T>::value;
  const T* pos = pos_table + step * hidden;
  const bool vec = hidden % V == 0 && is_aligned(out, 16) && is_aligned(weight, 16) && is_aligned(pos, 16);
  const DropoutParams d = dropout_params(dropout_p);
  const Shape2D s = row_shape(vec ? hidden / V : hidden, kFwdVecsPerThread);
  const dim3 block(s.x, s.y);
  const dim3 grid(static_cast<unsigned>((rows + s.y - 1) / s.y));
  cudaError_t err;
#define LSMINI_EMB_FWD(VW, DO)                                                                                 \
  err = launch_dependent(embedding_fwd_kernel<T, IdT, VW, DO>, grid, block, 0, stream, out, tokens, weight, pos, \
                         rows, len, hidden, vocab, scale, padding_idx, d.threshold, d.inv_keep, rng)
  if (vec) {
    if (d.on) LSMINI_EMB_FWD(V, true); else LSMINI_EMB_FWD(V, false);
  } else {
    if (d.on) LSMINI_EMB_FWD(1, true); else LSMINI_EMB_FWD(1, false);
  }
#undef LSMINI_EMB_FWD
  return err;
}

namespace {

// Where the token-gradient scratch puts its parts (byte offsets, each 256-aligned), and how many key bits the
// sort looks at: enough for the key vocab (ids that do not count).
struct BwdScratch {
  size_t keys_in, keys_out, pos_in, pos_out, partials, sort, sort_bytes, total;
  int bits;
};

inline size_t align256(size_t n) { return (n + 255) / 256 * 256; }

BwdScratch bwd_scratch(int64_t rows, int64_t hidden, int64_t vocab) {
  BwdScratch s{};
  const size_t words = align256(static_cast<size_t>(rows) * 4);
  s.keys_in = 0;
  s.keys_out = s.keys_in + words;
  s.pos_in = s.keys_out + words;
  s.pos_out = s.pos_in + words;
  s.partials = s.pos_out + words;
  const int64_t chunks = (rows + kEmbeddingBwdChunk - 1) / kEmbeddingBwdChunk;
  s.sort = s.partials + align256(static_cast<size_t>(chunks * 2 * hidden) * sizeof(float));
  s.bits = 1;
  while (s.bits < 32 && (uint64_t{1} << s.bits) <= static_cast<uint64_t>(vocab)) ++s.bits;
  s.sort_bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, s.sort_bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(rows), 0, s.bits);
  s.total = s.sort + align256(s.sort_bytes);
  return s;
}

}  // namespace

size_t embedding_bwd_scratch_bytes(int64_t rows, int64_t hidden, int64_t vocab) {
  return bwd_scratch(rows, hidden, vocab).total;
}

template <typename T, typename IdT>
cudaError_t launch_embedding_bwd(T* grad_weight, void* scratch, const T* grad_out, const IdT* tokens, int64_t rows,
                                 int64_t hidden, int64_t vocab, float scale, int64_t padding_idx, float dropout_p,
                                 PhiloxArgs rng, cudaStream_t stream) {
  if (rows == 0 || hidden == 0 || vocab == 0) return cudaSuccess;
  const BwdScratch sc = bwd_scratch(rows, hidden, vocab);
  char* base = static_cast<char*>(scratch);
  auto* keys_in = reinterpret_cast<uint32_t*>(base + sc.keys_in);
  auto* keys = reinterpret_cast<uint32_t*>(base + sc.keys_out);
  auto* pos_in = reinterpret_cast<int32_t*>(base + sc.pos_in);
  auto* order = reinterpret_cast<int32_t*>(base + sc.pos_out);
  auto* partials = reinterpret_cast<float*>(base + sc.partials);
  const auto key_blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  cudaError_t err = launch_dependent(embedding_bwd_keys_kernel<IdT>, dim3(key_blocks), dim3(kThreads), 0, stream,
                                     keys_in, pos_in, tokens, rows, vocab, padding_idx);
  if (err != cudaSuccess) return err;
  size_t sort_bytes = sc.sort_bytes;
  err = cub::DeviceRadixSort::SortPairs(base + sc.sort, sort_bytes, keys_in, keys, pos_in, order,
                                        static_cast<int>(rows), 0, sc.bits, stream);
  if (err != cudaSuccess) return err;

  constexpr int V = Vec16<T>::value;
  const bool vec = hidden % V == 0 && is_aligned(grad_out, 16) && is_aligned(grad_weight, 16);
  const DropoutParams d = dropout_params(dropout_p);
  const float factor = scale * d.inv_keep;
  const int64_t chunks = (rows + kEmbeddingBwdChunk - 1) / kEmbeddingBwdChunk;
  const int64_t nvec = vec ? hidden / V : hidden;
  const dim3 block1(static_cast<unsigned>(std::min<int64_t>(kThreads, (nvec + 31) / 32 * 32)));
#define LSMINI_EMB_BWD(VW, DO)                                                                                  \
  err = launch_dependent(embedding_bwd_kernel<T, VW, DO>, dim3(static_cast<unsigned>(chunks)), block1, 0, stream, \
                         grad_weight, partials, grad_out, keys, order, rows, hidden, vocab, factor, d.threshold, rng)
  if (vec) {
    if (d.on) LSMINI_EMB_BWD(V, true); else LSMINI_EMB_BWD(V, false);
  } else {
    if (d.on) LSMINI_EMB_BWD(1, true); else LSMINI_EMB_BWD(1, false);
  }
#undef LSMINI_EMB_BWD
  if (err != cudaSuccess || chunks == 1) return err;
  // Finishing blocks: up to 32 threads along hidden (more vectors loop), the rest stride over pieces,
  // so a long run is summed by many lanes at once.
  const int fx = static_cast<int>(std::min<int64_t>(32, row_shape(nvec).x));
  const dim3 block2(fx, kThreads / fx);
  const unsigned grid2 = static_cast<unsigned>(chunks - 1);  // the last chunk never starts a crossing run
  return launch_dependent(vec ? embedding_bwd_finish_kernel<T, V> : embedding_bwd_finish_kernel<T, 1>, dim3(grid2),
                          block2, 0, stream, grad_weight, partials, keys, rows, hidden, vocab, factor);
}

template <typename T, typename IdT>
cudaError_t launch_embedding_pos_bwd(T* grad_pos, float* partials, const T* grad_out, const IdT* tokens,
                                     int64_t batch, int64_t len, int64_t hidden, int64_t vocab, int64_t step,
                                     int64_t padding_idx, float dropout_p, PhiloxArgs rng, cudaStream_t stream) {
  if (batch == 0 || len == 0 || hidden == 0) return cudaSuccess;
  constexpr int V = Vec16<T>::value;
  T* gp = grad_pos + step * hidden;
  const bool vec = hidden % V == 0 && is_aligned(grad_out, 16) && is_aligned(gp, 16);
  const DropoutParams d = dropout_params(dropout_p);
  const int64_t splits = embedding_pos_bwd_splits(batch, len);
  const Shape2D s = row_shape(vec ? hidden / V : hidden);
  const dim3 block(s.x, s.y);
  const dim3 grid(static_cast<unsigned>(len), static_cast<unsigned>(splits));
  cudaError_t err;
#define LSMINI_EMB_POS_BWD(VW, DO)                                                                             \
  err = launch_dependent(embedding_pos_bwd_kernel<T, IdT, VW, DO>, grid, block, 0, stream, gp, partials, grad_out, \
                         tokens, batch, len, hidden, vocab, padding_idx, d.inv_keep, d.threshold, rng)
  if (vec) {
    if (d.on) LSMINI_EMB_POS_BWD(V, true); else LSMINI_EMB_POS_BWD(V, false);
  } else {
    if (d.on) LSMINI_EMB_POS_BWD(1, true); else LSMINI_EMB_POS_BWD(1, false);
  }
#undef LSMINI_EMB_POS_BWD
  if (err != cudaSuccess || splits == 1) return err;
  const int64_t n = len * hidden;
  const unsigned grid2 = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
  return launch_dependent(embedding_pos_bwd_finish_kernel<T>, dim3(grid2), dim3(kThreads), 0, stream, gp, partials, n,
                          splits, d.inv_keep);
}

#define LSMINI_INSTANTIATE_EMBEDDING(T, IdT)                                                                      \
  template cudaError_t launch_embedding_fwd<T, IdT>(T*, const IdT*, const T*, const T*, int64_t, int64_t, int64_t, \
                                                    int64_t, int64_t, float, int64_t, float, PhiloxArgs,           \
                                                    cudaStream_t);                                                 \
  template cudaError_t launch_embedding_bwd<T, IdT>(T*, void*, const T*, const IdT*, int64_t, int64_t, int64_t,  \
                                                    float, int64_t, float, PhiloxArgs, cudaStream_t);              \
  template cudaError_t launch_embedding_pos_bwd<T, IdT>(T*, float*, const T*, const IdT*, int64_t, int64_t,        \
                                                        int64_t, int64_t, int64_t, int64_t, float, PhiloxArgs,     \
                                                        cudaStream_t);

LSMINI_INSTANTIATE_EMBEDDING(float, int64_t)
LSMINI_INSTANTIATE_EMBEDDING(__half, int64_t)
LSMINI_INSTANTIATE_EMBEDDING(__nv_bfloat16, int64_t)
LSMINI_INSTANTIATE_EMBEDDING(float, int32_t)
LSMINI_INSTANTIATE_EMBEDDING(__half, int32_t)
LSMINI_INSTANTIATE_EMBEDDING(__nv_bfloat16, int32_t)
#undef LSMINI_INSTANTIATE_EMBEDDING

}  // namespace lsmini
