/*
 * attention_ab.cu — a C entry to one tree's attention launchers (launch_attention_fwd / launch_attention_bwd, as
 * the extension calls them), so that several trees' kernels load into one process side by side
 * (benchmarks/probes/attention_ab.py). Not part of the build: scripts/ab_probe.sh attention compiles it with each
 * tree's kernel files below into a shared library of its own.
 *
 * attn_run(backward, q, k, v, out, dout, dq, dk, dv, lse, delta, b, h, hk, lq, lk, d, causal, stream, p, keep,
 *          q_row, kv_row, cos, sin, rot_dim):
 * bf16 q, out, dout, dq [b, lq, h, d] and k, v, dk, dv [b, lk, hk, d], unit head stride d, rows q_row (q, dq) and
 * kv_row (k, v, dk, dv) elements apart (h·d and hk·d when contiguous; out and dout are contiguous); lse, delta
 * float [b, h, lq]; keep (dropout bits, keep_numel words) or null; cos, sin float [lq, rot_dim] with rot_dim > 0
 * for the backward's rotary fold (as the layer passes them), else null and 0. The forward when backward is 0, else
 * the backward (which reads out and lse). Returns the launchers' cudaError_t. attn_use_sm90(enabled): whether the
 * calls run the Hopper kernels (the default) or the sm_80 ones (set_attention_sm90); returns the previous setting.
 */
// ab-sources: attention.cu attention_bwd.cu attention_bwd_short.cu attention_sm90.cu attention_sm90_bwd.cu
#include <cuda_bf16.h>

#include <cmath>

#include "attention.h"

extern "C" __attribute__((visibility("default"))) int attn_use_sm90(int enabled) {
  return lsmini::set_attention_sm90(enabled != 0);
}

extern "C" __attribute__((visibility("default"))) int attn_run(int backward, void* q, void* k, void* v, void* out,
                                                                void* dout, void* dq, void* dk, void* dv, float* lse,
                                                                float* delta, int b, int h, int hk, int lq, int lk,
                                                                int d, int causal, void* stream, float dropout_p,
                                                                void* keep, int q_row, int kv_row, const float* cos,
                                                                const float* sin, int rot_dim) {
  using T = __nv_bfloat16;
  lsmini::AttentionArgs<T> a{};
  const int64_t ob = int64_t(lq) * h * d, qb = int64_t(lq) * q_row, kb = int64_t(lk) * kv_row;
  a.q = {static_cast<const T*>(q), qb, d, q_row};
  a.k = {static_cast<const T*>(k), kb, d, kv_row};
  a.v = {static_cast<const T*>(v), kb, d, kv_row};
  a.out = {static_cast<T*>(out), ob, d, int64_t(h) * d};
  a.dout = {static_cast<const T*>(dout), ob, d, int64_t(h) * d};
  a.dq = {static_cast<T*>(dq), qb, d, q_row};
  a.dk = {static_cast<T*>(dk), kb, d, kv_row};
  a.dv = {static_cast<T*>(dv), kb, d, kv_row};
  if (rot_dim > 0) a.rot = {cos, sin, 0, rot_dim, rot_dim};
  a.lse = lse;
  a.delta = delta;
  a.key_padding_mask = nullptr;
  a.keep = static_cast<uint32_t*>(keep);
  a.batch = b;
  a.heads = h;
  a.kv_heads = hk;
  a.q_len = lq;
  a.k_len = lk;
  a.head_dim = d;
  a.scale = 1.f / std::sqrt(float(d));
  a.causal = causal != 0;
  a.dropout_p = dropout_p;
  a.rng = {1234u, 5678u, nullptr, nullptr};
  auto s = static_cast<cudaStream_t>(stream);
  return int(backward ? lsmini::launch_attention_bwd<T>(a, s) : lsmini::launch_attention_fwd<T>(a, s));
}
