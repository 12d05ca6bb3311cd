/*
 * attention_ab.cu — a C entry to one tree's attention launchers (launch_attention_fwd / launch_attention_bwd, as
 * the extension calls them), so that several trees' kernels load into one process side by side
 * (benchmarks/probes/attention_ab.py). Not part of the build: scripts/ab_attention.sh compiles it with each tree's
 * csrc/kernels into a shared library of its own.
 *
 * attn_run(backward, q, k, v, out, dout, dq, dk, dv, lse, delta, b, h, hk, lq, lk, d, causal, stream, p, keep):
 * bf16 q, out, dout, dq [b, lq, h, d] and k, v, dk, dv [b, lk, hk, d], contiguous; lse, delta float [b, h, lq];
 * keep (dropout bits, keep_numel words) or null; the forward when backward is 0, else the backward (which reads
 * out and lse). Returns the launchers' cudaError_t. attn_use_sm90(enabled): whether the calls run the Hopper
 * kernels (the default) or the sm_80 ones (set_attention_sm90); returns the previous setting.
 */
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
                                                                void* keep) {
  using T = __nv_bfloat16;
  lsmini::AttentionArgs<T> a{};
  const int64_t qb = int64_t(lq) * h * d, kb = int64_t(lk) * hk * d;
  a.q = {static_cast<const T*>(q), qb, d, int64_t(h) * d};
  a.k = {static_cast<const T*>(k), kb, d, int64_t(hk) * d};
  a.v = {static_cast<const T*>(v), kb, d, int64_t(hk) * d};
  a.out = {static_cast<T*>(out), qb, d, int64_t(h) * d};
  a.dout = {static_cast<const T*>(dout), qb, d, int64_t(h) * d};
  a.dq = {static_cast<T*>(dq), qb, d, int64_t(h) * d};
  a.dk = {static_cast<T*>(dk), kb, d, int64_t(hk) * d};
  a.dv = {static_cast<T*>(dv), kb, d, int64_t(hk) * d};
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
