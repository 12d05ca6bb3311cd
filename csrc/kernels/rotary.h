// Rotary position embedding (RoPE) launchers (see rotary.cu for the math, layout and conventions).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace lsmini {

// One [batch, heads, seq, head_dim] tensor a rotary launch reads (in) and the one it writes (out): element
// (b, h, s, d) of in is in[b·in_stride[0] + h·in_stride[1] + s·in_stride[2] + d], of out likewise with out_stride
// (head_dim's stride is 1 in both). out may be in itself, with the same strides (in place): each element is read
// before it is written, by the thread that writes it.
template <typename T>
struct RotaryTensors {
  const T* in;
  T* out;
  int64_t heads;
  int64_t in_stride[3];   // batch, head, seq
  int64_t out_stride[3];  // batch, head, seq
};

// Forward: out = in·cos + rot(in)·sin over the first rot_dim dimensions of every head of q and k, the remaining
// head_dim − rot_dim copied unchanged; rot is rotate-half (rot(x) = [−x2, x1] over the halves of the rotated
// dimensions) or, with interleaved, rotate-every-two (pairs (x0, x1), (x2, x3), …: rot(x)[2i] = −x[2i + 1],
// rot(x)[2i + 1] = x[2i]). q and k share batch, seq and head_dim (their head counts may differ). cos and sin:
// [cs_batch, seq, rot_dim], element (b, s, r) at cos[b·cs_stride_batch + s·cs_stride_seq + r]; cs_stride_batch 0
// shares one table across the batch. T ∈ {float, __half, __nv_bfloat16}; C float or T. rot_dim must be even and in
// [2, head_dim] (cudaErrorInvalidValue otherwise, nothing launched).
template <typename T, typename C>
cudaError_t launch_rotary_fwd(RotaryTensors<T> q, RotaryTensors<T> k, const C* cos, const C* sin,
                              int64_t cs_stride_batch, int64_t cs_stride_seq, int64_t batch, int64_t seq, int head_dim,
                              int rot_dim, bool interleaved, cudaStream_t stream);

// Backward: the transpose of the forward's map, with in = the gradients of its outputs and out = the gradients of
// its inputs (for the usual tables, where each pair shares one angle, the inverse rotation: sin → −sin). The
// arguments are the forward's.
template <typename T, typename C>
cudaError_t launch_rotary_bwd(RotaryTensors<T> q, RotaryTensors<T> k, const C* cos, const C* sin,
                              int64_t cs_stride_batch, int64_t cs_stride_seq, int64_t batch, int64_t seq, int head_dim,
                              int rot_dim, bool interleaved, cudaStream_t stream);

}  // namespace lsmini
