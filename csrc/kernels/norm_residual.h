// The residual form of the norm kernels (layernorm.cu, rms_norm.cu): a block's output added into the residual
// stream and the sum normalized, in one kernel — the "add & norm" between two blocks.
#pragma once

#include "philox.h"

namespace lsmini {

// s = residual + dropout(x + bias), rounded to T, is written to `sum` and normalized instead of x. It is computed
// as bias_dropout_residual.cu computes its output (fp32, the same order of operations, the same keep bits for the
// same p and rng: the flat element index of [rows, hidden]), so both give the same s. bias (the norm weight's
// type W) may be null; p == 0: no dropout (rng is not read).
template <typename T, typename W>
struct NormResidual {
  const T* residual;
  const W* bias;
  T* sum;
  float p;
  PhiloxArgs rng;
};

}  // namespace lsmini
