/*
 * heads.cu — the head transforms on both sides of attention.
 *
 * split_heads: a fused projection GEMM (QKV: parts = 3; the cross-attention K/V of every decoder
 *   layer at once: parts = 2·layers) writes token-major rows x[b, l, :] of parts·hidden columns laid
 *   out part-major, then head, then head_dim: column c = p·hidden + h·head_dim + d. Attention wants
 *   each part head-major, so
 *       out[p, b, h, l, d] = x[b, l, c] + bias[c]          (bias optional; fp32 add, one rounding)
 *   with all parts in ONE [parts, batch, heads, len, head_dim] buffer: backward then reads one
 *   gradient buffer and writes grad_x in a single pass, and grad_bias[c] = Σ_{b,l} grad_x[b, l, c].
 * merge_heads: [b, h, l, d] → [b, l, h·d] is exactly split_heads' backward transpose with one part
 *   and no bias, and its backward is split_heads' forward likewise, so both ops share two kernels:
 *   split_heads_fwd_kernel (token-major → head-major) and split_heads_bwd_kernel (the reverse).
 *
 * Work layout (both kernels): a thread owns one V-element vector of a token row (column vector cv)
 *   and walks token rows, so the column's head-major position (p, h, d) is decoded once per thread
 *   and a row costs one 32-bit division (row → b, l). The token-major side is read/written in full
 *   rows (coalesced); on the head-major side consecutive threads cover consecutive d of a head and
 *   consecutive threadIdx.y cover consecutive l, so a block touches runs of ty·head_dim contiguous
 *   elements per head. V = 16 bytes of T when head_dim·sizeof(T) % 16 == 0 and the base pointers
 *   are 16-byte aligned (a vector then never straddles two heads, so it is contiguous on both
 *   sides), else V = 1. Each thread moves kUnroll rows per step, all loads before all stores, to
 *   keep enough bytes in flight to saturate HBM at full occupancy.
 *
 * Without a bias the elements are moved as raw bits (bit-exact, NaN payloads included).
 * grad_bias: each thread sums its column vector over the rows it visits in fp32; the block folds
 *   its threadIdx.y rows through shared memory into one row of `partials` [gridDim.y, parts·hidden]
 *   (column_partials.cuh's store_column_partials), and sum_column_partials then sums the gridDim.y
 *   rows per column in a fixed order. No atomics, deterministic for a given grid.
 *
 * Limits (checked by the launchers): batch·len < 2^31 and parts·hidden < 2^31 (32-bit indices inside
 *   a row / for the row number; element offsets are 64-bit).
 */
#include "heads.h"

#include "column_partials.cuh"
#include "common.cuh"

namespace lsmini {
namespace {

constexpr int kThreads = 256;      // threads per block: tx column vectors × ty rows
constexpr int kUnroll = 4;         // rows per thread per step (loads in flight)
constexpr int kMaxBlocksPerSm = 8;  // 2048 resident threads per SM / 256

struct HeadsGeometry {
  int32_t rows;         // batch·len token rows
  int32_t len;          // len
  int32_t head_dim;     // head_dim (elements)
  int32_t row_vecs;     // vectors per token row: parts·hidden / V
  int32_t hidden_vecs;  // hidden / V
  int32_t head_vecs;    // head_dim / V
  int64_t row_elems;    // parts·hidden
  int64_t part_stride;  // batch·heads·len·head_dim: one part of the head-major buffer
  int64_t batch_stride; // heads·len·head_dim
  int64_t head_stride;  // len·head_dim
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int vec_width(int64_t head_dim, int elem_size) {
  return (head_dim * elem_size) % 16 == 0 ? 16 / elem_size : 1;
}

HeadsGeometry make_geometry(int64_t batch, int64_t len, int64_t parts, int64_t num_heads, int64_t head_dim,
                            int vec) {
  HeadsGeometry g;
  const int64_t hidden = num_heads * head_dim;
  g.rows = static_cast<int32_t>(batch * len);
  g.len = static_cast<int32_t>(len);
  g.head_dim = static_cast<int32_t>(head_dim);
  g.row_elems = parts * hidden;
  g.row_vecs = static_cast<int32_t>(g.row_elems / vec);
  g.hidden_vecs = static_cast<int32_t>(hidden / vec);
  g.head_vecs = static_cast<int32_t>(head_dim / vec);
  g.head_stride = len * head_dim;
  g.batch_stride = num_heads * g.head_stride;
  g.part_stride = batch * g.batch_stride;
  return g;
}

// Column vectors per block row. All 256 threads on one row would idle most of them on narrow rows,
// and a block overhanging the row's end idles the overhang: take the widest of 128/64 that wastes
// at most 1/8 of the row, else 32; rows of ≤ 32 vectors get the next power of two (a warp then spans
// several rows, still contiguous per row).
int pick_block_x(int64_t row_vecs) {
  if (row_vecs <= 32) {
    int tx = 1;
    while (tx < row_vecs) tx *= 2;
    return tx;
  }
  for (int tx = 128; tx >= 64; tx /= 2)
    if ((ceil_div(row_vecs, tx) * tx - row_vecs) * 8 <= row_vecs) return tx;
  return 32;
}

struct LaunchShape {
  dim3 grid, block;
};

// One wave of resident blocks (blocks_per_sm per SM) or fewer when the rows run out; threads then
// stride over the rows, which amortises the per-thread column decode and bounds gridDim.y (the rows
// of grad_bias partials).
LaunchShape launch_shape(int64_t rows, int64_t row_vecs, int blocks_per_sm) {
  const int tx = pick_block_x(row_vecs), ty = kThreads / tx;
  const int64_t gx = ceil_div(row_vecs, tx);
  const int64_t needed_y = ceil_div(rows, static_cast<int64_t>(ty) * kUnroll);
  const int64_t fill_y = ceil_div(static_cast<int64_t>(sm_count()) * blocks_per_sm, gx);
  int64_t gy = needed_y < fill_y ? needed_y : fill_y;
  gy = gy < 1 ? 1 : (gy > 65535 ? 65535 : gy);
  LaunchShape s;
  s.grid = dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
  s.block = dim3(tx, ty);
  return s;
}

// Resident blocks per SM of `kernel` (register use differs per instantiation: 32 to 64 registers).
template <typename Kernel>
cudaError_t resident_blocks(Kernel kernel, size_t smem, int* blocks) {
  const cudaError_t err = max_active_blocks(kernel, kThreads, smem, blocks);
  if (*blocks < 1) *blocks = 1;
  return err;
}

bool sizes_supported(int64_t rows, int64_t row_elems) {
  return rows >= 0 && row_elems >= 0 && rows <= INT32_MAX && row_elems <= INT32_MAX;
}

// Offset, in the head-major [parts, batch, heads, len, head_dim] buffer, of column vector cv at
// token row 0 (b = l = 0).
template <int V>
__device__ __forceinline__ int64_t head_major_col_offset(const HeadsGeometry& g, int cv) {
  const int p = cv / g.hidden_vecs;
  const int r = cv - p * g.hidden_vecs;
  const int h = r / g.head_vecs;
  const int dv = r - h * g.head_vecs;
  return p * g.part_stride + h * g.head_stride + static_cast<int64_t>(dv) * V;
}

// Offset added by token row (b, l) in the head-major buffer.
__device__ __forceinline__ int64_t head_major_row_offset(const HeadsGeometry& g, uint32_t row) {
  const uint32_t b = row / static_cast<uint32_t>(g.len);
  const uint32_t l = row - b * static_cast<uint32_t>(g.len);
  return b * g.batch_stride + static_cast<int64_t>(l) * g.head_dim;
}

}  // namespace

// Token-major → head-major (+ bias). Block (tx, ty): x = column vectors, y = token rows.
template <typename T, typename TB, int V, bool HAS_BIAS>
__global__ void __launch_bounds__(kThreads)
    split_heads_fwd_kernel(const T* __restrict__ x, const TB* __restrict__ bias, T* __restrict__ out,
                           HeadsGeometry g) {
  begin_dependent_kernel();
  using P = Pack<T, V>;
  const int cv = blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= g.row_vecs) return;  // no block-wide sync in this kernel
  const int64_t col_in = static_cast<int64_t>(cv) * V;
  const int64_t col_out = head_major_col_offset<V>(g, cv);
  float bv[V];
  if (HAS_BIAS) {
#pragma unroll
    for (int j = 0; j < V; ++j) bv[j] = to_float(bias[col_in + j]);
  }
  const int64_t rows_per_step = static_cast<int64_t>(blockDim.y) * kUnroll;
  for (int64_t base = blockIdx.y * rows_per_step; base < g.rows; base += gridDim.y * rows_per_step) {
    P v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = base + u * blockDim.y + threadIdx.y;
      if (row < g.rows) v[u] = *reinterpret_cast<const P*>(x + row * g.row_elems + col_in);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t row = base + u * blockDim.y + threadIdx.y;
      if (row < g.rows) {
        if (HAS_BIAS) {
#pragma unroll
          for (int j = 0; j < V; ++j) v[u].v[j] = from_float<T>(to_float(v[u].v[j]) + bv[j]);
        }
        *reinterpret_cast<P*>(out + col_out + head_major_row_offset(g, static_cast<uint32_t>(row))) = v[u];
      }
    }
  }
}

// Head-major → token-major, plus per-block fp32 column sums into partials[blockIdx.y, :] when
// BIAS_GRAD. Dynamic shared memory (BIAS_GRAD only): blockDim.x·blockDim.y·V floats.
template <typename T, int V, bool BIAS_GRAD>
__global__ void __launch_bounds__(kThreads)
    split_heads_bwd_kernel(const T* __restrict__ grad_out, T* __restrict__ grad_x, float* __restrict__ partials,
                           HeadsGeometry g) {
  wait_for_previous_kernel();  // before any access to global memory
  using P = Pack<T, V>;
  const int cv = blockIdx.x * blockDim.x + threadIdx.x;
  float acc[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc[j] = 0.f;
  if (cv < g.row_vecs) {  // no early return: the BIAS_GRAD epilogue syncs the whole block
    const int64_t col_in = static_cast<int64_t>(cv) * V;
    const int64_t col_out = head_major_col_offset<V>(g, cv);
    const int64_t rows_per_step = static_cast<int64_t>(blockDim.y) * kUnroll;
    for (int64_t base = blockIdx.y * rows_per_step; base < g.rows; base += gridDim.y * rows_per_step) {
      P v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t row = base + u * blockDim.y + threadIdx.y;
        if (row < g.rows)
          v[u] = *reinterpret_cast<const P*>(grad_out + col_out + head_major_row_offset(g, static_cast<uint32_t>(row)));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t row = base + u * blockDim.y + threadIdx.y;
        if (row < g.rows) {
          *reinterpret_cast<P*>(grad_x + row * g.row_elems + col_in) = v[u];
          if (BIAS_GRAD) {
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += to_float(v[u].v[j]);
          }
        }
      }
    }
  }
  if (BIAS_GRAD) {
    extern __shared__ float fold[];  // [blockDim.y][blockDim.x·V]
    store_column_partials<V>(acc, fold, partials, g.row_elems);
  }
}

namespace {

template <typename T, typename TB, int V, bool HAS_BIAS>
cudaError_t run_to_head_major(const T* x, const TB* bias, T* out, const HeadsGeometry& g, cudaStream_t stream) {
  const auto kernel = split_heads_fwd_kernel<T, TB, V, HAS_BIAS>;
  int blocks = 1;
  cudaError_t err = resident_blocks(kernel, 0, &blocks);
  if (err != cudaSuccess) return err;
  const LaunchShape s = launch_shape(g.rows, g.row_vecs, blocks);
  return launch_dependent(kernel, s.grid, s.block, 0, stream, x, bias, out, g);
}

template <typename T, typename TB>
cudaError_t to_head_major(const T* x, const TB* bias, T* out, int64_t batch, int64_t len, int64_t parts,
                          int64_t num_heads, int64_t head_dim, cudaStream_t stream) {
  const int64_t rows = batch * len, row_elems = parts * num_heads * head_dim;
  if (!sizes_supported(rows, row_elems)) return cudaErrorInvalidValue;
  if (rows == 0 || row_elems == 0) return cudaSuccess;
  constexpr int VW = Vec16<T>::value;
  const bool vec = vec_width(head_dim, sizeof(T)) == VW && is_aligned(x, 16) && is_aligned(out, 16);
  const HeadsGeometry g = make_geometry(batch, len, parts, num_heads, head_dim, vec ? VW : 1);
  if (vec && bias) return run_to_head_major<T, TB, VW, true>(x, bias, out, g, stream);
  if (vec) return run_to_head_major<T, TB, VW, false>(x, bias, out, g, stream);
  if (bias) return run_to_head_major<T, TB, 1, true>(x, bias, out, g, stream);
  return run_to_head_major<T, TB, 1, false>(x, bias, out, g, stream);
}

// partials == nullptr: no column sums. Otherwise *num_partials is the capacity of `partials` (rows)
// on entry and the rows actually written on return.
template <typename T, int V>
cudaError_t run_to_token_major(const T* grad_out, T* grad_x, float* partials, int64_t* num_partials,
                               const HeadsGeometry& g, cudaStream_t stream) {
  int blocks = 1;
  if (partials != nullptr) {
    const auto kernel = split_heads_bwd_kernel<T, V, true>;
    const size_t smem = sizeof(float) * kThreads * V;
    cudaError_t err = resident_blocks(kernel, smem, &blocks);
    if (err != cudaSuccess) return err;
    LaunchShape s = launch_shape(g.rows, g.row_vecs, blocks);
    if (s.grid.y > *num_partials) s.grid.y = static_cast<unsigned>(*num_partials);
    *num_partials = s.grid.y;
    return launch_dependent(kernel, s.grid, s.block, smem, stream, grad_out, grad_x, partials, g);
  } else {
    const auto kernel = split_heads_bwd_kernel<T, V, false>;
    cudaError_t err = resident_blocks(kernel, 0, &blocks);
    if (err != cudaSuccess) return err;
    const LaunchShape s = launch_shape(g.rows, g.row_vecs, blocks);
    return launch_dependent(kernel, s.grid, s.block, 0, stream, grad_out, grad_x, nullptr, g);
  }
}

// partials == nullptr: no column sums.
template <typename T>
cudaError_t to_token_major(const T* grad_out, T* grad_x, float* partials, int64_t* num_partials, int64_t batch,
                           int64_t len, int64_t parts, int64_t num_heads, int64_t head_dim, cudaStream_t stream) {
  constexpr int VW = Vec16<T>::value;
  const bool vec = vec_width(head_dim, sizeof(T)) == VW && is_aligned(grad_out, 16) && is_aligned(grad_x, 16);
  if (vec)
    return run_to_token_major<T, VW>(grad_out, grad_x, partials, num_partials,
                                     make_geometry(batch, len, parts, num_heads, head_dim, VW), stream);
  return run_to_token_major<T, 1>(grad_out, grad_x, partials, num_partials,
                                  make_geometry(batch, len, parts, num_heads, head_dim, 1), stream);
}

}  // namespace

template <typename T, typename TB>
cudaError_t launch_split_heads_fwd(const T* x, const TB* bias, T* out, int64_t batch, int64_t len, int64_t parts,
                                   int64_t num_heads, int64_t head_dim, cudaStream_t stream) {
  return to_head_major<T, TB>(x, bias, out, batch, len, parts, num_heads, head_dim, stream);
}

int64_t split_heads_bwd_num_partials(int64_t batch, int64_t len, int64_t parts, int64_t num_heads,
                                     int64_t head_dim, int elem_size) {
  const int64_t rows = batch * len, row_elems = parts * num_heads * head_dim;
  if (rows <= 0 || row_elems <= 0) return 1;
  // An upper bound: the launcher takes min(this, its own one-wave grid for the kernel's occupancy).
  return launch_shape(rows, row_elems / vec_width(head_dim, elem_size), kMaxBlocksPerSm).grid.y;
}

template <typename T, typename TB>
cudaError_t launch_split_heads_bwd(const T* grad_out, T* grad_x, TB* grad_bias, float* partials,
                                   int64_t num_partials, int64_t batch, int64_t len, int64_t parts,
                                   int64_t num_heads, int64_t head_dim, cudaStream_t stream) {
  const int64_t rows = batch * len, row_elems = parts * num_heads * head_dim;
  if (!sizes_supported(rows, row_elems)) return cudaErrorInvalidValue;
  if (row_elems == 0) return cudaSuccess;
  if (grad_bias != nullptr && rows == 0)  // a sum over no rows; all-zero bits are 0.0 in every TB
    return cudaMemsetAsync(grad_bias, 0, sizeof(TB) * row_elems, stream);
  if (rows == 0) return cudaSuccess;
  if (grad_bias == nullptr)
    return to_token_major<T>(grad_out, grad_x, nullptr, nullptr, batch, len, parts, num_heads, head_dim, stream);
  if (partials == nullptr || num_partials < 1 || num_partials > 65535) return cudaErrorInvalidValue;
  cudaError_t err =
      to_token_major<T>(grad_out, grad_x, partials, &num_partials, batch, len, parts, num_heads, head_dim, stream);
  if (err != cudaSuccess) return err;
  return sum_column_partials<TB>(partials, num_partials, row_elems, grad_bias, stream);
}

template <typename T>
cudaError_t launch_merge_heads_fwd(const T* x, T* out, int64_t batch, int64_t num_heads, int64_t len,
                                   int64_t head_dim, cudaStream_t stream) {
  // [b, h, l, d] → [b, l, h·d] is split_heads' backward transpose with parts = 1.
  const int64_t rows = batch * len, row_elems = num_heads * head_dim;
  if (!sizes_supported(rows, row_elems)) return cudaErrorInvalidValue;
  if (rows == 0 || row_elems == 0) return cudaSuccess;
  return to_token_major<T>(x, out, nullptr, nullptr, batch, len, 1, num_heads, head_dim, stream);
}

template <typename T>
cudaError_t launch_merge_heads_bwd(const T* grad_out, T* grad_x, int64_t batch, int64_t num_heads, int64_t len,
                                   int64_t head_dim, cudaStream_t stream) {
  // [b, l, h·d] → [b, h, l, d] is split_heads' forward with parts = 1 and no bias.
  return to_head_major<T, T>(grad_out, nullptr, grad_x, batch, len, 1, num_heads, head_dim, stream);
}

#define LSMINI_INSTANTIATE_SPLIT_HEADS(T, TB)                                                                   \
  template cudaError_t launch_split_heads_fwd<T, TB>(const T*, const TB*, T*, int64_t, int64_t, int64_t,       \
                                                     int64_t, int64_t, cudaStream_t);                          \
  template cudaError_t launch_split_heads_bwd<T, TB>(const T*, T*, TB*, float*, int64_t, int64_t, int64_t,     \
                                                     int64_t, int64_t, int64_t, cudaStream_t);

LSMINI_INSTANTIATE_SPLIT_HEADS(float, float)
LSMINI_INSTANTIATE_SPLIT_HEADS(__half, __half)
LSMINI_INSTANTIATE_SPLIT_HEADS(__half, float)
LSMINI_INSTANTIATE_SPLIT_HEADS(__nv_bfloat16, __nv_bfloat16)
LSMINI_INSTANTIATE_SPLIT_HEADS(__nv_bfloat16, float)

#define LSMINI_INSTANTIATE_MERGE_HEADS(T)                                                                       \
  template cudaError_t launch_merge_heads_fwd<T>(const T*, T*, int64_t, int64_t, int64_t, int64_t, cudaStream_t); \
  template cudaError_t launch_merge_heads_bwd<T>(const T*, T*, int64_t, int64_t, int64_t, int64_t, cudaStream_t);

LSMINI_INSTANTIATE_MERGE_HEADS(float)
LSMINI_INSTANTIATE_MERGE_HEADS(__half)
LSMINI_INSTANTIATE_MERGE_HEADS(__nv_bfloat16)

}  // namespace lsmini
