// Fused attention launchers (see attention.cu for the math, layout and conventions).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "philox.h"

namespace lsmini {

// Head dims with a kernel instantiation (the launchers in attention*.cu switch over the same list).
inline constexpr int kAttentionHeadDims[] = {16, 32, 64, 128};

constexpr bool attention_supports_head_dim(int d) {
  for (const int supported : kAttentionHeadDims) {
    if (d == supported) return true;
  }
  return false;
}

// A [batch, heads, len, head_dim] operand: element strides of batch, head and row; head_dim is contiguous.
// Every row must start 16 bytes aligned (base pointer aligned, strides multiples of 8 elements).
template <typename T>
struct Strided {
  T* ptr;
  int64_t batch, head, row;
};

// Rotary positions the backward folds into its dQ and dK stores (AttentionArgs::rot): with dim > 0, q and k are
// the forward's Q and K after rotary positions (rotate-half over their first dim dimensions), and dq and dk receive
// the gradients of Q and K before them: the stores apply the transpose of the rotation (launch_rotary_bwd's map,
// rotary.cu). cos, sin: float32, element (b, i, r) at [b·stride_batch + i·stride_seq + r] for query or key i of
// batch b (stride_batch 0 shares one table). Self-attention only: q_len == k_len, query and key i at position i.
struct AttentionRotary {
  const float* cos;
  const float* sin;
  int64_t stride_batch, stride_seq;
  int dim;  // 0: none
};

// Everything one call reads and writes. Forward: q, k, v → out, lse. Backward: q, k, v, out, dout,
// lse → dq, dk, dv, with delta as scratch. k, v, dk and dv have kv_heads heads (grouped-query attention:
// kv_heads divides heads, query head h reads K/V head h / (heads / kv_heads)); dk and dv of a K/V head are
// the sums over its query heads, accumulated inside the dK/dV kernels (no expanded K/V, no atomics).
template <typename T>
struct AttentionArgs {
  Strided<const T> q, k, v;
  Strided<T> out;                   // forward writes it, backward reads it
  Strided<const T> dout;            // backward
  Strided<T> dq, dk, dv;            // backward
  float* lse;                       // [batch, heads, q_len] contiguous; forward writes, backward reads
  float* delta;                     // [batch, heads, q_len] contiguous; backward scratch
  const uint8_t* key_padding_mask;  // [batch, k_len] contiguous, nonzero = pad; or null
  // The dropout keep bits as the forward drew them, so that backward reads them instead of drawing
  // again; or null (backward draws them). [batch·heads, 4·ceil(q_len/64), ceil(k_len/64), 32] words:
  // one per lane of the warp that holds each 16-query × 64-key tile (attention.cu's bit order; the
  // kernels work in blocks of 64 queries, so a partial last block has all four row groups).
  uint32_t* keep;
  int batch, heads, kv_heads, q_len, k_len, head_dim;
  float scale;
  bool causal;
  float dropout_p;
  PhiloxArgs rng;  // not read when dropout_p == 0
  AttentionRotary rot;  // backward; dim 0 when the call has none
};

// Words of AttentionArgs::keep for one call.
constexpr int64_t attention_keep_numel(int64_t batch, int64_t heads, int64_t q_len, int64_t k_len) {
  return batch * heads * ((q_len + 63) / 64 * 4) * ((k_len + 63) / 64) * 32;
}

// The Hopper kernels (attention_sm90*.cu: wgmma, head dims 64 and 128): whether this build holds them
// (sm_90a code, LSMINI_SM90A) and the current device, compute capability 9.0, can run them. Where they can
// they run, unless switched off: set_attention_sm90(false) makes every call take the sm_80 kernels (for
// tests and benchmarks that compare the two); it returns the previous setting.
bool attention_sm90_available();
bool set_attention_sm90(bool enabled);

// T: __half or __nv_bfloat16; head_dim: attention_supports_head_dim.
template <typename T>
cudaError_t launch_attention_fwd(const AttentionArgs<T>& args, cudaStream_t stream);

template <typename T>
cudaError_t launch_attention_bwd(const AttentionArgs<T>& args, cudaStream_t stream);

}  // namespace lsmini
