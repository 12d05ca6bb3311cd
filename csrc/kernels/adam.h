// Fused Adam / AdamW over contiguous parameter buffers (lsmini.optim.FusedAdam). See adam.cu for
// the layout, the math and the step-count convention.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace lsmini {

// Most param groups (and so segments) one launch carries. The table travels as a kernel argument,
// so there is no host-to-device copy per step.
constexpr int kAdamMaxGroups = 16;

// Floats in the control block the norm pass writes and the update reads:
//   ctrl[0] skip flag (1: a gradient was inf/NaN and overflow checking is on; 0 otherwise)
//   ctrl[1] multiplier applied to every gradient: inverse loss scale × clip coefficient
//   ctrl[2] global L2 norm of the unscaled gradients
//   ctrl[3] clip coefficient (1 when clipping is off)
constexpr int kAdamCtrlSize = 4;

// Hyperparameters of one param group, in double so step size and bias corrections round like the
// Python arithmetic of torch.optim.Adam(W).
struct AdamGroupHyper {
  double lr, beta1, beta2, eps, weight_decay;
};

// Elements [begin, end) of the flat buffers belong to param group `group`. For the vectorised path
// `begin` must be a multiple of 16 / sizeof(T) elements (the launcher falls back to scalar code
// otherwise); `end` may be anything.
struct AdamSegment {
  int64_t begin, end;
  int32_t group;
};

struct AdamStepArgs {
  int32_t num_groups;    // 1..kAdamMaxGroups; step_in/step_out hold one count per group
  int32_t num_segments;  // 0..kAdamMaxGroups
  int32_t adam_w_mode;   // 1: decoupled weight decay (AdamW); 0: L2 added to the gradient (Adam)
  AdamGroupHyper group[kAdamMaxGroups];
  AdamSegment segment[kAdamMaxGroups];
};

// Number of fp32 partial pairs launch_adam_grad_sumsq writes for n gradients (0 when n == 0), on
// the current device. The caller sizes the partials buffer with it.
int adam_grad_sumsq_num_blocks(int64_t n);

// partials[b] = (Σ (g·m)², any g non-finite ? 1 : 0) over the elements block b visits, where
// m = inv_scale · (scale ? 1/scale[0] : 1). Writes exactly adam_grad_sumsq_num_blocks(n) pairs.
template <typename T>
cudaError_t launch_adam_grad_sumsq(const T* grad, int64_t n, float inv_scale, const float* scale,
                                   float2* partials, cudaStream_t stream);

// Reduces num_partials pairs into ctrl[0..4) (see kAdamCtrlSize). max_norm <= 0 disables clipping;
// check_overflow == 0 leaves ctrl[0] = 0 even when a gradient is non-finite.
cudaError_t launch_adam_grad_norm_finalize(const float2* partials, int num_partials, float inv_scale,
                                           const float* scale, float max_norm, int check_overflow,
                                           float* ctrl, cudaStream_t stream);

// One Adam step over every segment of one flat buffer.
//   T = float: param is updated in place, master must be nullptr.
//   T = __half / __nv_bfloat16: master (fp32) is the weight that is updated; param receives its
//   rounded copy.
// exp_avg / exp_avg_sq are fp32 with the buffer's length. Step counts: group g uses
// t = step_in[g] + 1; when step_out != nullptr, block 0 writes step_out[g] = step_in[g] + (skip ? 0 : 1)
// (step_in and step_out must not overlap). lr: nullptr, or device doubles [num_groups] that replace the
// table's learning rates (graph replay). Gradient multiplier: ctrl[1] when ctrl != nullptr (then
// ctrl[0] != 0 skips the whole update), else inv_scale · (scale ? 1/scale[0] : 1).
//
// Vectorised launches (16-byte aligned buffers, segments starting on the 16-byte grid) on compute capability
// 9.0 and later stream their tiles through shared memory with the bulk copy engine (adam_step_bulk_kernel);
// elsewhere, and with set_adam_bulk(false), each thread moves 16-byte chunks through registers. Both give
// the same bits.
template <typename T>
cudaError_t launch_adam_step(T* param, const T* grad, float* master, float* exp_avg, float* exp_avg_sq,
                             const AdamStepArgs& args, const int32_t* step_in, int32_t* step_out, const double* lr,
                             float inv_scale, const float* scale, const float* ctrl, cudaStream_t stream);

// True when the current device can run the bulk-copy update (compute capability 9.0 or later).
bool adam_bulk_available();
// Process-wide switch, read at each launch (default on): false makes every launch take the register path,
// for comparing the two. Returns the previous setting.
bool set_adam_bulk(bool enabled);
// Whether a vectorised launch on the current device takes the bulk-copy update now.
bool adam_bulk_runs();

}  // namespace lsmini
