// Token embedding: out = dropout(scale · weight[token] + pos_table[step + j]), pad tokens → 0.
// Launchers for the forward, the token-table gradient and the positional-table gradient; see
// embedding.cu for the layout and conventions. IdT is int64_t or int32_t (the token dtype).
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "philox.h"

namespace lsmini {

// Sorted token positions handled by one block of the token-gradient kernel.
constexpr int64_t kEmbeddingBwdChunk = 32;

// Bytes of scratch launch_embedding_bwd needs for `rows` tokens and a table of `vocab` ids: the sort's keys
// and positions (in and out), the radix sort's temporary storage and two fp32 partial rows per chunk.
// rows must be < 2^31 and vocab < 2^32 (the sort's 32-bit positions and keys).
size_t embedding_bwd_scratch_bytes(int64_t rows, int64_t hidden, int64_t vocab);

// How many slices the batch is cut into for the positional gradient, so that short sequences with a
// large batch still spread over the whole GPU. When > 1 the binding allocates
// splits · len · hidden floats of scratch.
inline int64_t embedding_pos_bwd_splits(int64_t batch, int64_t len) {
  if (batch <= 0 || len <= 0) return 1;
  const int64_t by_batch = (batch + 31) / 32;           // at least 32 batch rows per slice
  const int64_t by_blocks = (1024 + len - 1) / len;     // enough blocks to fill the device
  const int64_t s = by_batch < by_blocks ? by_batch : by_blocks;
  return s < 1 ? 1 : s;
}

// out [batch, len, hidden]; tokens [batch, len]; weight [vocab, hidden]; pos_table points at row 0
// of the table (rows step .. step+len-1 are read). padding_idx = -1 means none. dropout_p = 0 uses
// no RNG; rng is not read then.
template <typename T, typename IdT>
cudaError_t launch_embedding_fwd(T* out, const IdT* tokens, const T* weight, const T* pos_table, int64_t batch,
                                 int64_t len, int64_t hidden, int64_t vocab, int64_t step, float scale,
                                 int64_t padding_idx, float dropout_p, PhiloxArgs rng, cudaStream_t stream);

// Adds the token-table gradient into grad_weight [vocab, hidden] (zeros, or a gradient to accumulate into):
// only the rows of ids that occur and count are read and written. tokens: the flat [rows] ids.
// scratch: embedding_bwd_scratch_bytes(rows, hidden, vocab) bytes, 16-byte aligned.
template <typename T, typename IdT>
cudaError_t launch_embedding_bwd(T* grad_weight, void* scratch, const T* grad_out, const IdT* tokens, int64_t rows,
                                 int64_t hidden, int64_t vocab, float scale, int64_t padding_idx, float dropout_p,
                                 PhiloxArgs rng, cudaStream_t stream);

// Writes rows step .. step+len-1 of grad_pos [max_positions, hidden] (the other rows are the caller's
// to zero). partials: embedding_pos_bwd_splits(batch, len) · len · hidden floats when that is > 1,
// else may be null.
template <typename T, typename IdT>
cudaError_t launch_embedding_pos_bwd(T* grad_pos, float* partials, const T* grad_out, const IdT* tokens,
                                     int64_t batch, int64_t len, int64_t hidden, int64_t vocab, int64_t step,
                                     int64_t padding_idx, float dropout_p, PhiloxArgs rng, cudaStream_t stream);

}  // namespace lsmini
