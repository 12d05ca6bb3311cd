/*
 * cross_entropy.cu — label-smoothed softmax cross-entropy over rows of logits, forward and backward.
 *
 *   forward (per row, x = logits[r, :], t = target[r], V = vocab, ε = label_smoothing):
 *     lse  = log Σ_j exp(x_j)
 *     nll  = lse − x_t
 *     loss = (1 − ε)·nll + ε·(lse − Σ_j x_j / V)          (= nll exactly when ε = 0)
 *   backward (s = grad_rows[r], the caller's d(total loss)/d(loss_r)):
 *     dx_j = s·(exp(x_j − lse) − (1 − ε)·[j == t] − ε/V)
 *
 * Layout: logits / grad_logits row-major [rows, V] of T, row r at element r·row_stride (≥ V: a view of wider
 * rows, such as logits computed against a weight padded for aligned GEMMs) / r·grad_stride;
 * target int64 [rows]; loss/nll/lse/grad_rows fp32 [rows]. All math is fp32.
 *
 * Rows: target == ignore_index → loss = nll = lse = 0 and a zero gradient row, without reading the
 * logits (padding rows cost no bandwidth). A target outside [0, V) that is not ignore_index is never
 * used as an index: the row's loss/nll/lse and gradient are NaN, so an unchecked bad label shows up
 * in the loss instead of reading memory outside the row.
 *
 * How: a row belongs to a group of G threads (G = blockDim.x; one block per row when G > 32, a warp
 * per row with 8 rows per block when G == 32, so early exits never strand a __syncthreads). The
 * forward streams the row once with 16-byte loads (kUnroll of them in flight per thread) and keeps
 * an online log-sum-exp per thread: running max m, Σ exp(x − m) (rescaled by exp(m_old − m_new) when
 * the max grows, once per kUnroll·VEC elements, not per element) and Σ x for the smoothing term; one
 * max and one float2 sum reduction combine the threads. Nothing per element is written: the row of
 * log-probabilities never exists in memory. The target logit is a single scalar load by thread 0.
 * The backward reads each element once and writes it once (exp(x − lse) needs no reduction), in
 * place when grad_logits == logits (each element is read before it is written, by the same thread). The
 * forward can write that gradient too, in place, right after the row's lse (linear_cross_entropy, which
 * needs the gradient at once): the row's second read then comes from L2, and the logits cross memory twice
 * instead of three times.
 *
 * Alignment: each row is split into a scalar head up to its first 16-byte boundary, aligned
 * vectors, and a scalar tail, so any V (odd vocabularies such as 50257 included) and any element-
 * aligned base pointer use 16-byte accesses for all but < 2·VEC elements per row. Backward also needs
 * every row of logits and grad_logits to sit at the same offset modulo 16; otherwise it runs all-scalar.
 *
 * Napkin math (16384 × 32000 fp16): 1.05 GB of logits. Forward reads them once, backward reads them
 * once more and writes the gradient once: 3.1 GB, ~0.8 ms at 4 TB/s. One exp per element per pass
 * (≈0.5 G exps ≈ 0.13 ms of MUFU time on an H200) stays under the memory time.
 */
#include "common.cuh"
#include "cross_entropy.h"

#include <float.h>

namespace lsmini {
namespace {

constexpr int kMaxThreads = 256;  // block size; also the largest row group
constexpr int kUnroll = 4;        // 16-byte loads in flight per thread in the streaming loops
constexpr int kMinBlocks = 4;     // ≥ 1024 resident threads per SM: ≥ 64 KB of loads in flight

__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fc00000); }

enum RowKind { kRowNormal, kRowIgnored, kRowBadTarget };

__device__ __forceinline__ RowKind classify(int64_t t, int64_t ignore_index, int vocab) {
  if (t == ignore_index) return kRowIgnored;
  return (t >= 0 && t < vocab) ? kRowNormal : kRowBadTarget;
}

// Elements [0, head) and [tail, vocab) are scalar; [head, tail) are nvec aligned vectors of VEC.
struct RowSplit {
  int head, nvec, tail;
};

template <typename T, int VEC>
__device__ __forceinline__ RowSplit split_row(const T* row, int vocab, bool vec_ok) {
  if (!vec_ok) return {vocab, 0, vocab};
  // Elements of T past the previous 16-byte boundary (pointers are always element-aligned).
  const int mis = static_cast<int>(reinterpret_cast<uintptr_t>(row) % 16) / static_cast<int>(sizeof(T));
  const int head = min(mis == 0 ? 0 : VEC - mis, vocab);
  const int nvec = (vocab - head) / VEC;
  return {head, nvec, head + nvec * VEC};
}

// One 16-byte load into registers (the Pack is copied by value, which is what makes it a single
// vector load), converted into out[0, VEC) — a slice of a wider array in the forward, which reduces
// kUnroll packs as one step.
template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* p, float* out) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = to_float(pk.v[k]);
}

// One thread's online log-sum-exp: m = running max, s = Σ exp(x − m), sx = Σ x.
// m starts at −FLT_MAX rather than −inf so exp(m_old − m_new) is never exp(−inf − (−inf)) = NaN:
// all-(−inf) stretches then add exactly 0, and a row of only −inf ends with s = 0, lse = −inf.
// fmaxf drops NaN, so a NaN logit does not poison m but does poison s (exp(NaN) = NaN) → NaN loss.
struct OnlineLse {
  float m = -FLT_MAX, s = 0.f, sx = 0.f;

  template <int N>
  __device__ __forceinline__ void add(const float (&v)[N]) {
    float cm = v[0];
#pragma unroll
    for (int k = 1; k < N; ++k) cm = fmaxf(cm, v[k]);
    const float nm = fmaxf(m, cm);
    // Two partial sums halve the dependent-add chain per step.
    float a0 = 0.f, a1 = 0.f, x0 = 0.f, x1 = 0.f;
#pragma unroll
    for (int k = 0; k < N; k += 2) {
      a0 += __expf(v[k] - nm);
      x0 += v[k];
      if (k + 1 < N) {
        a1 += __expf(v[k + 1] - nm);
        x1 += v[k + 1];
      }
    }
    s = s * __expf(m - nm) + (a0 + a1);
    m = nm;
    sx += x0 + x1;
  }
};

// The gradient of one row (a normal one: t ∈ [0, vocab)) from its lse, by the row group's threads: each element
// read once and written once, by the same thread, so grad may be logits itself (in place).
template <typename T, int VEC>
__device__ __forceinline__ void write_row_grad(const T* x, T* g, const RowSplit& sp, int vocab, int64_t t,
                                               float scale, float lse, float smoothing) {
  const int tid = threadIdx.x, nthr = blockDim.x;
  const float c_all = scale * (smoothing / vocab);       // s·ε/V, every element
  const float c_hit = c_all + scale * (1.f - smoothing);  // plus s·(1 − ε) at the target
  const int ti = static_cast<int>(t);
  auto dx = [&](float xj, int j) { return fmaf(scale, __expf(xj - lse), -(j == ti ? c_hit : c_all)); };

  for (int j = tid; j < sp.head; j += nthr) g[j] = from_float<T>(dx(to_float(x[j]), j));
  for (int j = sp.tail + tid; j < vocab; j += nthr) g[j] = from_float<T>(dx(to_float(x[j]), j));
  const T* xv = x + sp.head;
  T* gv = g + sp.head;
  int c = tid;
  for (; c + (kUnroll - 1) * nthr < sp.nvec; c += kUnroll * nthr) {
    float v[kUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_floats<T, VEC>(xv + (c + u * nthr) * VEC, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int j0 = sp.head + (c + u * nthr) * VEC;
#pragma unroll
      for (int k = 0; k < VEC; ++k) v[u][k] = dx(v[u][k], j0 + k);
      store_pack<T, VEC>(gv + (c + u * nthr) * VEC, v[u]);
    }
  }
  for (; c < sp.nvec; c += nthr) {
    float v[VEC];
    load_floats<T, VEC>(xv + c * VEC, v);
    const int j0 = sp.head + c * VEC;
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = dx(v[k], j0 + k);
    store_pack<T, VEC>(gv + c * VEC, v);
  }
}

// A constant gradient row f (0 for an ignored row, NaN for a bad target), the logits not read.
template <typename T, int VEC>
__device__ __forceinline__ void fill_row(T* g, const RowSplit& sp, int vocab, float f) {
  const int tid = threadIdx.x, nthr = blockDim.x;
  float fv[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) fv[k] = f;
  for (int j = tid; j < sp.head; j += nthr) g[j] = from_float<T>(f);
  for (int j = sp.tail + tid; j < vocab; j += nthr) g[j] = from_float<T>(f);
  for (int c = tid; c < sp.nvec; c += nthr) store_pack<T, VEC>(g + sp.head + c * VEC, fv);
}

// logits and grad may be the same buffer (in-place backward): no __restrict__ on them.
template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
cross_entropy_bwd_kernel(const float* __restrict__ grad_rows, const T* logits, const int64_t* __restrict__ target,
                         const float* __restrict__ lse_rows, T* grad, int64_t rows, int vocab, int64_t row_stride,
                         int64_t grad_stride, float smoothing, int64_t ignore_index, bool vec_ok) {
  begin_dependent_kernel();
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  // The three row scalars are independent loads: issue them together, before the branch.
  const int64_t t = target[row];
  const float scale = grad_rows[row];
  const float lse = lse_rows[row];
  const RowKind kind = classify(t, ignore_index, vocab);
  const T* x = logits + row * row_stride;
  T* g = grad + row * grad_stride;
  const RowSplit sp = split_row<T, VEC>(x, vocab, vec_ok);  // same split for g: same offset mod 16
  if (kind != kRowNormal) {
    fill_row<T, VEC>(g, sp, vocab, kind == kRowIgnored ? 0.f : quiet_nan());
    return;
  }
  write_row_grad<T, VEC>(x, g, sp, vocab, t, scale, lse, smoothing);
}

// kGrad: the row's gradient too, scaled by grad_rows[row] and written over the logits (what the backward kernel
// writes in place), once the row's lse is known: the second read of the row comes from L2 rather than memory.
template <typename T, int VEC, bool kGrad>
__global__ void __launch_bounds__(kMaxThreads, kMinBlocks)
cross_entropy_fwd_kernel(T* logits, const int64_t* __restrict__ target, float* __restrict__ loss_rows,
                         float* __restrict__ nll_rows, float* __restrict__ lse_rows,
                         const float* __restrict__ grad_rows, int64_t rows, int vocab, int64_t row_stride,
                         float smoothing, int64_t ignore_index) {
  begin_dependent_kernel();
  __shared__ float red_max[32];
  __shared__ float2 red_sum[32];
  // The row group is a whole block when it spans several warps (blockDim.y == 1) or a lone warp
  // without block barriers, so every exit below is uniform over the threads that synchronize.
  const int64_t row = int64_t(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= rows) return;
  const int tid = threadIdx.x, nthr = blockDim.x;
  const int64_t t = target[row];
  const RowKind kind = classify(t, ignore_index, vocab);
  T* const x = logits + row * row_stride;
  if (kind != kRowNormal) {
    const float v = kind == kRowIgnored ? 0.f : quiet_nan();
    if (tid == 0) {
      loss_rows[row] = v;
      nll_rows[row] = v;
      lse_rows[row] = v;
    }
    if (kGrad) fill_row<T, VEC>(x, split_row<T, VEC>(x, vocab, true), vocab, v);
    return;
  }
  const float x_t = tid == 0 ? to_float(x[t]) : 0.f;  // t ∈ [0, vocab) here; issued early, used last

  OnlineLse st;
  const RowSplit sp = split_row<T, VEC>(x, vocab, true);
  for (int j = tid; j < sp.head; j += nthr) {
    const float v[1] = {to_float(x[j])};
    st.add(v);
  }
  for (int j = sp.tail + tid; j < vocab; j += nthr) {
    const float v[1] = {to_float(x[j])};
    st.add(v);
  }
  const T* xv = x + sp.head;
  int c = tid;
  for (; c + (kUnroll - 1) * nthr < sp.nvec; c += kUnroll * nthr) {
    float v[kUnroll * VEC];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_floats<T, VEC>(xv + (c + u * nthr) * VEC, v + u * VEC);
    st.add(v);
  }
  for (; c < sp.nvec; c += nthr) {
    float v[VEC];
    load_floats<T, VEC>(xv + c * VEC, v);
    st.add(v);
  }

  // Both reductions return to every thread of the row. With kGrad the gradient goes over the row after every
  // thread's reads above: behind the reductions' barriers when the group spans warps, the __syncwarp when not.
  const float row_max = block_max(st.m, red_max);  // warp-only when the group is one warp
  const float2 sums = group_sum2(make_float2(st.s * __expf(st.m - row_max), st.sx), red_sum);
  const float log_sum = __logf(sums.x);
  const float lse = row_max + log_sum;
  if (kGrad) {
    __syncwarp();  // a one-warp row group has no barrier above: every lane's reads (x_t's too) before any write
    write_row_grad<T, VEC>(x, x, sp, vocab, t, grad_rows[row], lse, smoothing);
  }
  if (tid == 0) {
    // lse − x_t as (max − x_t) + log Σ: the first difference is exact for nearby values, so a large
    // common offset (logits ≈ 1000) does not cost the nll the rounding of lse at that magnitude.
    const float nll = (row_max - x_t) + log_sum;
    // ε = 0 must not touch the smoothing term: with a −inf logit it is +inf and 0·inf = NaN.
    const float loss =
        smoothing > 0.f ? (1.f - smoothing) * nll + smoothing * ((row_max - sums.y / vocab) + log_sum) : nll;
    loss_rows[row] = loss;
    nll_rows[row] = nll;
    lse_rows[row] = lse;
  }
}

struct CeConfig {
  dim3 block;
  int64_t grid;
};

// Smallest power-of-two group (32 … kMaxThreads) that gives each thread ≥ kUnroll vectors; short
// rows get a warp each, 8 rows to a block.
template <typename T>
inline CeConfig ce_config(int64_t rows, int vocab) {
  constexpr int VEC = Vec16<T>::value;
  const int64_t nvec = (int64_t(vocab) + VEC - 1) / VEC;
  int G = 32;
  while (G < kMaxThreads && int64_t(G) * kUnroll < nvec) G *= 2;
  const int R = G == 32 ? kMaxThreads / 32 : 1;
  return {dim3(G, R), (rows + R - 1) / R};
}

inline bool valid_sizes(int64_t rows, int vocab, int64_t row_stride, int64_t grid) {
  return rows >= 0 && vocab >= 1 && vocab <= kCrossEntropyMaxVocab && row_stride >= vocab && grid <= 0x7fffffff;
}

}  // namespace

template <typename T>
cudaError_t launch_cross_entropy_fwd(T* logits, const int64_t* target, float* loss_rows, float* nll_rows,
                                     float* lse_rows, const float* grad_rows, int64_t rows, int vocab,
                                     int64_t row_stride, float label_smoothing, int64_t ignore_index,
                                     cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const CeConfig cfg = ce_config<T>(rows, vocab);
  if (!valid_sizes(rows, vocab, row_stride, cfg.grid)) return cudaErrorInvalidValue;
  const auto kernel = grad_rows != nullptr ? cross_entropy_fwd_kernel<T, Vec16<T>::value, true>
                                           : cross_entropy_fwd_kernel<T, Vec16<T>::value, false>;
  return launch_dependent(kernel, dim3(static_cast<unsigned>(cfg.grid)), dim3(cfg.block), 0, stream, logits, target,
                          loss_rows, nll_rows, lse_rows, grad_rows, rows, vocab, row_stride, label_smoothing,
                          ignore_index);
}

template <typename T>
cudaError_t launch_cross_entropy_bwd(const float* grad_rows, const T* logits, const int64_t* target,
                                     const float* lse_rows, T* grad_logits, int64_t rows, int vocab,
                                     int64_t row_stride, int64_t grad_stride, float label_smoothing,
                                     int64_t ignore_index, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const CeConfig cfg = ce_config<T>(rows, vocab);
  if (!valid_sizes(rows, vocab, row_stride, cfg.grid) || grad_stride < vocab) return cudaErrorInvalidValue;
  // Every row of both buffers at the same offset modulo 16: the base offsets agree and the strides differ by
  // a multiple of 16 bytes.
  const bool vec_ok = reinterpret_cast<uintptr_t>(logits) % 16 == reinterpret_cast<uintptr_t>(grad_logits) % 16 &&
                      (row_stride - grad_stride) * int64_t(sizeof(T)) % 16 == 0;
  return launch_dependent(cross_entropy_bwd_kernel<T, Vec16<T>::value>, dim3(static_cast<unsigned>(cfg.grid)),
                          dim3(cfg.block), 0, stream, grad_rows, logits, target, lse_rows, grad_logits, rows, vocab,
                          row_stride, grad_stride, label_smoothing, ignore_index, vec_ok);
}

#define LSMINI_INSTANTIATE_CE(T)                                                                               \
  template cudaError_t launch_cross_entropy_fwd<T>(T*, const int64_t*, float*, float*, float*, const float*,    \
                                                   int64_t, int, int64_t, float, int64_t, cudaStream_t);      \
  template cudaError_t launch_cross_entropy_bwd<T>(const float*, const T*, const int64_t*, const float*, T*,  \
                                                   int64_t, int, int64_t, int64_t, float, int64_t, cudaStream_t);

LSMINI_INSTANTIATE_CE(float)
LSMINI_INSTANTIATE_CE(__half)
LSMINI_INSTANTIATE_CE(__nv_bfloat16)

}  // namespace lsmini
