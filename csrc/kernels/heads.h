// Head transforms around attention: split_heads (bias add + [b, l, parts·hidden] → [parts, b, h, l, d])
// and merge_heads ([b, h, l, d] → [b, l, h·d]), forward and backward. See heads.cu for the layout.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace lsmini {

// out[p, b, h, l, d] = x[b, l, p·hidden + h·head_dim + d] + bias[p·hidden + h·head_dim + d],
// hidden = num_heads·head_dim. bias may be nullptr (then the copy is bit-exact). TB is float or T.
template <typename T, typename TB>
cudaError_t launch_split_heads_fwd(const T* x, const TB* bias, T* out, int64_t batch, int64_t len, int64_t parts,
                                   int64_t num_heads, int64_t head_dim, cudaStream_t stream);

// Rows of fp32 partial column sums that launch_split_heads_bwd uses for grad_bias: the caller
// allocates `partials` as [num_partials, parts·hidden] fp32. Always ≥ 1 and ≤ 65535.
int64_t split_heads_bwd_num_partials(int64_t batch, int64_t len, int64_t parts, int64_t num_heads,
                                     int64_t head_dim, int elem_size);

// grad_x[b, l, p·hidden + h·head_dim + d] = grad_out[p, b, h, l, d];
// grad_bias[c] = Σ_{b,l} grad_x[b, l, c] (fp32 sums) when grad_bias != nullptr, in which case
// `partials` holds num_partials·parts·hidden floats (any num_partials in [1, 65535] is correct;
// split_heads_bwd_num_partials gives the one that fills the GPU).
template <typename T, typename TB>
cudaError_t launch_split_heads_bwd(const T* grad_out, T* grad_x, TB* grad_bias, float* partials,
                                   int64_t num_partials, int64_t batch, int64_t len, int64_t parts,
                                   int64_t num_heads, int64_t head_dim, cudaStream_t stream);

// out[b, l, h·head_dim + d] = x[b, h, l, d].
template <typename T>
cudaError_t launch_merge_heads_fwd(const T* x, T* out, int64_t batch, int64_t num_heads, int64_t len,
                                   int64_t head_dim, cudaStream_t stream);

// grad_x[b, h, l, d] = grad_out[b, l, h·head_dim + d].
template <typename T>
cudaError_t launch_merge_heads_bwd(const T* grad_out, T* grad_x, int64_t batch, int64_t num_heads, int64_t len,
                                   int64_t head_dim, cudaStream_t stream);

}  // namespace lsmini
