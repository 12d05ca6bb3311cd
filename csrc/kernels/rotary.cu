/*
 * rotary.cu — rotary position embedding (RoPE) of q and k in one launch, forward and backward.
 *
 *   forward  (each pair (a, b) of rotated dimensions of a head, x its values):
 *              out_a = x_a·cos_a − x_b·sin_a
 *              out_b = x_b·cos_b + x_a·sin_b          i.e. out = x·cos + rot(x)·sin elementwise
 *   backward (the transpose of that map, g the output gradient):
 *              dx_a  = g_a·cos_a + g_b·sin_b
 *              dx_b  = g_b·cos_b − g_a·sin_a
 *   dimensions past rot_dim: out = x (dx = g), copied bit for bit.
 *
 * Pairs: rotate-half (Hugging Face's apply_rotary_pos_emb, GPT-NeoX) pairs dimension i with i + rot_dim/2
 * (i < rot_dim/2); interleaved (GPT-J) pairs 2i with 2i + 1. The tables hold one value per rotated dimension, so
 * each pair reads its angle's cos and sin twice: Hugging Face's cat(freqs, freqs) for rotate-half, each frequency
 * repeated in place for interleaved. Nothing assumes the two copies agree: the forward is exactly the elementwise
 * formula above for any tables, and the backward exactly its transpose, which for such tables (cos_a = cos_b,
 * sin_a = sin_b) is the inverse rotation, sin → −sin.
 *
 * Layout: q [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim], any strides but a unit one on
 * head_dim (RotaryTensors), read and written through their own strides: a [batch, seq, heads, head_dim] buffer
 * viewed as [batch, heads, seq, head_dim] needs no copy, and out may be the input itself (in place). cos and sin:
 * [batch or 1, seq, rot_dim] (batch stride 0 shares one table), in float or T. Math in fp32, one rounding.
 *
 * Work split: one thread row of the block owns one position (b, s) and a chunk of kHeadsPerThread heads of the
 * combined list [q heads…, k heads…]; its threads split head_dim into units: a rotated unit is V pairs (rotate-half:
 * one pack of V elements at a and one at a + rot_dim/2; interleaved: one pack holding V/2 pairs), a copied unit one
 * pack. A thread loads its unit's cos and sin once and applies them to its heads, whose loads it issues together
 * before the first is used, so each thread keeps 2·kHeadsPerThread 16-byte loads in flight. Consecutive rows
 * are the chunks of one position (then the next), so a block's table reads mostly hit L1 after the first. V: 16 bytes of T when
 * head_dim and the rotated blocks are multiples of it and every pointer and stride is aligned, else 1 (rotate-half
 * and interleaved alike then read each pair as two scalars).
 *
 * Napkin math (H100, bf16, batch 8 × seq 2048, 32 query and 8 K/V heads of 128): q 128 MiB and k 32 MiB are read
 * and written once, 320 MiB — about 0.1 ms at ≈ 3.3 TB/s; the tables (2048 × 128 fp32, 1 MiB each) are read from
 * L1/L2, once per position and chunk. The math is 2 multiplies and an add an element: memory-bound.
 */
#include "rotary.h"

#include <algorithm>

#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kRotaryThreads = 256;
constexpr int kHeadsPerThread = 4;
constexpr int kMaxUnitThreads = 64;  // threads of a block's x dimension: one row's units (more units loop)

// V values of the table C at p (16-byte aligned when V > 1) as floats; V·sizeof(C) is a multiple of 16 on the vector
// path, since C is float or T and V fills 16 bytes of T.
template <typename C, int V>
__device__ __forceinline__ void load_table(const C* __restrict__ p, float (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = to_float(p[0]);
  } else {
    constexpr int N = Vec16<C>::value;
    static_assert(V % N == 0, "a table vector is whole 16-byte packs");
#pragma unroll
    for (int c = 0; c < V / N; ++c) {
      float f[N];
      load_pack<C, N>(p + c * N, f);
#pragma unroll
      for (int i = 0; i < N; ++i) out[c * N + i] = f[i];
    }
  }
}

template <typename T, int V>
__device__ __forceinline__ Pack<T, V> ld(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}

// The rows (head_dim elements) of a thread's heads at one position, and which of them exist: heads past the last
// one are clamped onto it and loaded but not stored, so all loads issue without a branch between them.
template <typename T>
struct HeadRows {
  const T* src[kHeadsPerThread];
  T* dst[kHeadsPerThread];
  bool live[kHeadsPerThread];
};

template <typename T>
__device__ __forceinline__ HeadRows<T> head_rows(const RotaryTensors<T>& q, const RotaryTensors<T>& k, int64_t first,
                                                 int64_t b, int64_t s) {
  HeadRows<T> rows;
  const int64_t heads = q.heads + k.heads;
#pragma unroll
  for (int j = 0; j < kHeadsPerThread; ++j) {
    const int64_t t = min(first + j, heads - 1);
    // Field by field rather than a reference to q or k: a runtime choice between two kernel parameters would
    // copy them to local memory.
    const bool is_q = t < q.heads;
    const int64_t h = is_q ? t : t - q.heads;
    const int64_t in_off = b * (is_q ? q.in_stride[0] : k.in_stride[0]) +
                           h * (is_q ? q.in_stride[1] : k.in_stride[1]) + s * (is_q ? q.in_stride[2] : k.in_stride[2]);
    const int64_t out_off = b * (is_q ? q.out_stride[0] : k.out_stride[0]) +
                            h * (is_q ? q.out_stride[1] : k.out_stride[1]) +
                            s * (is_q ? q.out_stride[2] : k.out_stride[2]);
    rows.src[j] = (is_q ? q.in : k.in) + in_off;
    rows.dst[j] = (is_q ? q.out : k.out) + out_off;
    rows.live[j] = first + j < heads;
  }
  return rows;
}

// The pair map's second-term factors: out_a = x_a·cos_a + x_b·m_a, out_b = x_b·cos_b + x_a·m_b with
// (m_a, m_b) = (−sin_a, sin_b) forward and (sin_b, −sin_a) backward (the transpose).
__device__ __forceinline__ void pair_factors(float sin_a, float sin_b, bool backward, float* m_a, float* m_b) {
  *m_a = backward ? sin_b : -sin_a;
  *m_b = backward ? -sin_a : sin_b;
}

// V pairs held in two packs: elements a + i and a + delta + i (rotate-half: delta = rot_dim/2; the scalar
// interleaved path: V = 1, a = 2·pair, delta = 1). cos/sin point at this position's table row.
template <typename T, typename C, int V>
__device__ __forceinline__ void rotate_split(const HeadRows<T>& rows, const C* __restrict__ cos,
                                             const C* __restrict__ sin, int a, int delta, bool backward) {
  Pack<T, V> xa[kHeadsPerThread], xb[kHeadsPerThread];
#pragma unroll
  for (int j = 0; j < kHeadsPerThread; ++j) {
    xa[j] = ld<T, V>(rows.src[j] + a);
    xb[j] = ld<T, V>(rows.src[j] + a + delta);
  }
  float ca[V], cb[V], ma[V], mb[V];
  {
    float sa[V], sb[V];
    load_table<C, V>(cos + a, ca);
    load_table<C, V>(cos + a + delta, cb);
    load_table<C, V>(sin + a, sa);
    load_table<C, V>(sin + a + delta, sb);
#pragma unroll
    for (int i = 0; i < V; ++i) pair_factors(sa[i], sb[i], backward, &ma[i], &mb[i]);
  }
#pragma unroll
  for (int j = 0; j < kHeadsPerThread; ++j) {
    if (!rows.live[j]) continue;
    float fa[V], fb[V], oa[V], ob[V];
    unpack(xa[j], fa);
    unpack(xb[j], fb);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      oa[i] = fa[i] * ca[i] + fb[i] * ma[i];
      ob[i] = fb[i] * cb[i] + fa[i] * mb[i];
    }
    store_pack<T, V>(rows.dst[j] + a, oa);
    store_pack<T, V>(rows.dst[j] + a + delta, ob);
  }
}

// V/2 interleaved pairs (2i, 2i + 1) in one pack at element a.
template <typename T, typename C, int V>
__device__ __forceinline__ void rotate_packed(const HeadRows<T>& rows, const C* __restrict__ cos,
                                              const C* __restrict__ sin, int a, bool backward) {
  static_assert(V % 2 == 0, "a pack holds whole pairs");
  Pack<T, V> x[kHeadsPerThread];
#pragma unroll
  for (int j = 0; j < kHeadsPerThread; ++j) x[j] = ld<T, V>(rows.src[j] + a);
  float c[V], m[V];
  {
    float sn[V];
    load_table<C, V>(cos + a, c);
    load_table<C, V>(sin + a, sn);
#pragma unroll
    for (int i = 0; i < V; i += 2) pair_factors(sn[i], sn[i + 1], backward, &m[i], &m[i + 1]);
  }
#pragma unroll
  for (int j = 0; j < kHeadsPerThread; ++j) {
    if (!rows.live[j]) continue;
    float f[V], o[V];
    unpack(x[j], f);
#pragma unroll
    for (int i = 0; i < V; i += 2) {
      o[i] = f[i] * c[i] + f[i + 1] * m[i];
      o[i + 1] = f[i + 1] * c[i + 1] + f[i] * m[i + 1];
    }
    store_pack<T, V>(rows.dst[j] + a, o);
  }
}

// The dimensions past rot_dim: copied as they are (no conversion, so bit for bit).
template <typename T, int V>
__device__ __forceinline__ void copy_unit(const HeadRows<T>& rows, int a) {
  Pack<T, V> x[kHeadsPerThread];
#pragma unroll
  for (int j = 0; j < kHeadsPerThread; ++j) x[j] = ld<T, V>(rows.src[j] + a);
#pragma unroll
  for (int j = 0; j < kHeadsPerThread; ++j) {
    if (rows.live[j]) *reinterpret_cast<Pack<T, V>*>(rows.dst[j] + a) = x[j];
  }
}

// How a row's head_dim splits into units (see the opening comment).
struct RotaryUnits {
  int rot_units;   // units of rotated pairs, first
  int units;       // all units: the rotated ones, then the copied packs from rot_dim on
  int pair_step;   // rotate_split: element offset of rotated unit u's first pack is u·pair_step
  int pair_delta;  // rotate_split: offset of its second pack from its first
};

// PACKED: interleaved pairs within one pack (V ≥ 2); else rotate_split's two packs.
template <typename T, typename C, int V, bool PACKED>
__global__ void __launch_bounds__(kRotaryThreads)
rotary_kernel(RotaryTensors<T> q, RotaryTensors<T> k, const C* __restrict__ cos, const C* __restrict__ sin,
              int64_t cs_stride_batch, int64_t cs_stride_seq, int64_t seq, int64_t items, int64_t chunks, int rot_dim,
              RotaryUnits split, bool backward) {
  begin_dependent_kernel();
  const int64_t item = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (item >= items) return;  // no block-wide sync follows
  // item = (b·seq + s)·chunks + chunk; 32-bit divisions where the counts allow (the usual case): a 64-bit one is a
  // long instruction sequence.
  int64_t pos, chunk, b, s;
  if (items <= INT32_MAX) {
    const uint32_t i = uint32_t(item), n = uint32_t(chunks), sq = uint32_t(seq);
    const uint32_t p = i / n, bb = p / sq;
    pos = p, chunk = i - p * n, b = bb, s = p - bb * sq;
  } else {
    pos = item / chunks, chunk = item - pos * chunks, b = pos / seq, s = pos - b * seq;
  }
  const HeadRows<T> rows = head_rows(q, k, chunk * kHeadsPerThread, b, s);
  const int64_t table = b * cs_stride_batch + s * cs_stride_seq;
  for (int u = threadIdx.x; u < split.units; u += blockDim.x) {
    if (u < split.rot_units) {
      if constexpr (PACKED) {
        rotate_packed<T, C, V>(rows, cos + table, sin + table, u * V, backward);
      } else {
        rotate_split<T, C, V>(rows, cos + table, sin + table, u * split.pair_step, split.pair_delta, backward);
      }
    } else {
      copy_unit<T, V>(rows, rot_dim + (u - split.rot_units) * V);
    }
  }
}

// A stride that moves along a dimension of size 1 is never applied: 0 keeps it from vetoing the vector path.
template <typename T>
RotaryTensors<T> drop_unit_strides(RotaryTensors<T> x, int64_t batch, int64_t seq) {
  const int64_t sizes[3] = {batch, x.heads, seq};
  for (int d = 0; d < 3; ++d) {
    if (sizes[d] == 1) x.in_stride[d] = x.out_stride[d] = 0;
  }
  return x;
}

template <typename T>
bool vector_ready(const RotaryTensors<T>& x, int v) {
  if (!is_aligned(x.in, 16) || !is_aligned(x.out, 16)) return false;
  for (int d = 0; d < 3; ++d) {
    if (x.in_stride[d] % v != 0 || x.out_stride[d] % v != 0) return false;
  }
  return true;
}

template <typename T, typename C>
cudaError_t launch_rotary(RotaryTensors<T> q, RotaryTensors<T> k, const C* cos, const C* sin, int64_t cs_stride_batch,
                          int64_t cs_stride_seq, int64_t batch, int64_t seq, int head_dim, int rot_dim,
                          bool interleaved, bool backward, cudaStream_t stream) {
  if (rot_dim < 2 || rot_dim % 2 != 0 || rot_dim > head_dim || batch < 0 || seq < 0 || q.heads < 0 || k.heads < 0)
    return cudaErrorInvalidValue;
  const int64_t heads = q.heads + k.heads;
  if (batch == 0 || seq == 0 || heads == 0) return cudaSuccess;
  q = drop_unit_strides(q, batch, seq);
  k = drop_unit_strides(k, batch, seq);
  if (batch == 1) cs_stride_batch = 0;
  if (seq == 1) cs_stride_seq = 0;

  constexpr int VW = Vec16<T>::value;
  const bool vec = head_dim % VW == 0 && (interleaved ? rot_dim : rot_dim / 2) % VW == 0 && vector_ready(q, VW) &&
                   vector_ready(k, VW) && is_aligned(cos, 16) && is_aligned(sin, 16) && cs_stride_batch % VW == 0 &&
                   cs_stride_seq % VW == 0;
  RotaryUnits split;
  if (vec) {
    split.rot_units = (interleaved ? rot_dim : rot_dim / 2) / VW;
    split.units = split.rot_units + (head_dim - rot_dim) / VW;
    split.pair_step = VW;
    split.pair_delta = rot_dim / 2;
  } else {
    split.rot_units = rot_dim / 2;
    split.units = split.rot_units + (head_dim - rot_dim);
    split.pair_step = interleaved ? 2 : 1;
    split.pair_delta = interleaved ? 1 : rot_dim / 2;
  }
  const int64_t chunks = (heads + kHeadsPerThread - 1) / kHeadsPerThread;
  const int64_t items = batch * seq * chunks;
  const int bx = std::min(split.units, kMaxUnitThreads);
  const int by = std::max(1, kRotaryThreads / bx);
  const int64_t blocks = (items + by - 1) / by;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks)), block(bx, by);
  const auto kernel = vec && interleaved ? rotary_kernel<T, C, VW, true>
                      : vec              ? rotary_kernel<T, C, VW, false>
                                         : rotary_kernel<T, C, 1, false>;
  return launch_dependent(kernel, grid, block, 0, stream, q, k, cos, sin, cs_stride_batch, cs_stride_seq, seq, items,
                          chunks, rot_dim, split, backward);
}

}  // namespace

template <typename T, typename C>
cudaError_t launch_rotary_fwd(RotaryTensors<T> q, RotaryTensors<T> k, const C* cos, const C* sin,
                              int64_t cs_stride_batch, int64_t cs_stride_seq, int64_t batch, int64_t seq, int head_dim,
                              int rot_dim, bool interleaved, cudaStream_t stream) {
  return launch_rotary<T, C>(q, k, cos, sin, cs_stride_batch, cs_stride_seq, batch, seq, head_dim, rot_dim, interleaved,
                             false, stream);
}

template <typename T, typename C>
cudaError_t launch_rotary_bwd(RotaryTensors<T> q, RotaryTensors<T> k, const C* cos, const C* sin,
                              int64_t cs_stride_batch, int64_t cs_stride_seq, int64_t batch, int64_t seq, int head_dim,
                              int rot_dim, bool interleaved, cudaStream_t stream) {
  return launch_rotary<T, C>(q, k, cos, sin, cs_stride_batch, cs_stride_seq, batch, seq, head_dim, rot_dim, interleaved,
                             true, stream);
}

#define LSMINI_INSTANTIATE_ROTARY(T, C)                                                                            \
  template cudaError_t launch_rotary_fwd<T, C>(RotaryTensors<T>, RotaryTensors<T>, const C*, const C*, int64_t,   \
                                               int64_t, int64_t, int64_t, int, int, bool, cudaStream_t);           \
  template cudaError_t launch_rotary_bwd<T, C>(RotaryTensors<T>, RotaryTensors<T>, const C*, const C*, int64_t,   \
                                               int64_t, int64_t, int64_t, int, int, bool, cudaStream_t);
LSMINI_INSTANTIATE_ROTARY(float, float)
LSMINI_INSTANTIATE_ROTARY(__half, __half)
LSMINI_INSTANTIATE_ROTARY(__half, float)
LSMINI_INSTANTIATE_ROTARY(__nv_bfloat16, __nv_bfloat16)
LSMINI_INSTANTIATE_ROTARY(__nv_bfloat16, float)
#undef LSMINI_INSTANTIATE_ROTARY

}  // namespace lsmini
