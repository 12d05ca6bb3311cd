// The bindings' functions that C++ callers (csrc/layers) use directly: the same checks and the same
// kernels as the Python entry points of the same names, without a trip through Python.
#pragma once

#include "column_sums.h"
#include "common.h"

#include <optional>
#include <tuple>
#include <vector>

namespace lsmini {

// Room a caller (the layer runtime, from its one scratch buffer) gives a backward binding: its parameter
// gradients go into grad_weight / grad_bias (vectors of the dtype the binding computes them in), its float32
// temporaries (column partial sums, the attention's row terms) to the start of workspace. Whatever is not
// given is allocated, as for the Python entry points. With sums, the second pass of its column sums is queued
// there (column_sums.h) rather than launched: the caller launches it, after which the gradients are complete.
struct BackwardRoom {
  std::optional<at::Tensor> grad_weight, grad_bias, workspace;
  ColumnSums* sums = nullptr;
};

// module.cpp: the Philox state of one dropout call from torch's CUDA generator of that device (-1: current).
PhiloxTuple philox_seed_offset(c10::DeviceIndex device_index = -1);
// philox_state.cpp: rngs → out, an int64 CUDA tensor [len(rngs), 2] of resolved (seed, offset).
void philox_state_fwd(const std::vector<PhiloxTuple>& rngs, const at::Tensor& out);

// layernorm.cpp: (y, mean, rstd), each into out / mean_out / rstd_out when given; with residual (the residual
// form, norm_residual.h) also s, normalized instead of x, into sum_out when given (x itself allowed).
std::vector<at::Tensor> layernorm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                      const std::optional<at::Tensor>& bias, double eps,
                                      const std::optional<at::Tensor>& out,
                                      const std::optional<at::Tensor>& mean_out = std::nullopt,
                                      const std::optional<at::Tensor>& rstd_out = std::nullopt,
                                      const std::optional<at::Tensor>& residual = std::nullopt,
                                      const std::optional<at::Tensor>& x_bias = std::nullopt, double p = 0.0,
                                      const PhiloxTuple& rng = {0, 0, 0, 0},
                                      const std::optional<at::Tensor>& sum_out = std::nullopt);
// (dx, dweight, dbias); with add, dx = input gradient + add; dx into out when given (out may be add).
std::vector<std::optional<at::Tensor>> layernorm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                     const std::optional<at::Tensor>& weight,
                                                     const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                                     const at::Tensor& rstd, const std::optional<at::Tensor>& add,
                                                     const std::optional<at::Tensor>& out,
                                                     const BackwardRoom& room = {});

// rms_norm.cpp: (s or None, y, rstd); with residual, s = x + residual is normalized instead of x.
std::tuple<std::optional<at::Tensor>, at::Tensor, at::Tensor> rms_norm_fwd(
    const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps,
    const std::optional<at::Tensor>& residual = std::nullopt, const std::optional<at::Tensor>& x_bias = std::nullopt,
    double p = 0.0, const PhiloxTuple& rng = {0, 0, 0, 0});
// (dx, dweight or None) from the normalized input x (s of the residual form); with add, dx + add.
std::tuple<at::Tensor, std::optional<at::Tensor>> rms_norm_bwd(const at::Tensor& dy, const at::Tensor& x,
                                                              const std::optional<at::Tensor>& weight,
                                                              const at::Tensor& rstd,
                                                              const std::optional<at::Tensor>& add = std::nullopt);

// rotary.cpp: (q, k) rotated by cos, sin [batch or 1, seq, rot_dim]; into q_out / k_out when given (each may be
// its input: in place). rotary_bwd: the gradients of q and k from those of the outputs, the same way.
std::tuple<at::Tensor, at::Tensor> rotary_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                              const at::Tensor& sin, bool interleaved,
                                              const std::optional<at::Tensor>& q_out = std::nullopt,
                                              const std::optional<at::Tensor>& k_out = std::nullopt);
std::tuple<at::Tensor, at::Tensor> rotary_bwd(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                              const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                                              const std::optional<at::Tensor>& q_out = std::nullopt,
                                              const std::optional<at::Tensor>& k_out = std::nullopt);

// attention.cpp: (out [b, h, lq, d] over a [b, lq, h, d] buffer, lse [b, h, lq] float32).
// keep: int32 [attention_keep_numel] that receives the dropout keep bits for attention_bwd to read.
// out / lse: where the output and lse go when given (out of q's shape, rows 16-byte aligned).
std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& key_padding_mask, bool causal,
                                                 double p, double scale, const PhiloxTuple& rng,
                                                 const std::optional<at::Tensor>& keep = std::nullopt,
                                                 const std::optional<at::Tensor>& out = std::nullopt,
                                                 const std::optional<at::Tensor>& lse = std::nullopt);
// The rotary tables a self-attention backward folds into its dQ and dK stores (AttentionRotary, attention.h):
// float32 [1 or batch, len, rot_dim], unit last stride.
struct RotaryTables {
  at::Tensor cos, sin;
};

// (dq, dk, dv), into dq/dk/dv when given; keep: the forward's keep bits, or none (drawn again); rotary: q and k are
// the rotated Q and K and dq, dk are to be the gradients of the unrotated ones (the layer's self-attention).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask, bool causal, double p, double scale,
    const PhiloxTuple& rng, const std::optional<at::Tensor>& dq, const std::optional<at::Tensor>& dk,
    const std::optional<at::Tensor>& dv, const std::optional<at::Tensor>& keep = std::nullopt,
    const BackwardRoom& room = {}, const RotaryTables* rotary = nullptr);

// bias_dropout_residual.cpp: residual + dropout(x + bias); into out when given.
at::Tensor bias_dropout_residual_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                     const at::Tensor& residual, double p, const PhiloxTuple& rng,
                                     const std::optional<at::Tensor>& out = std::nullopt);
// (grad_x, grad_bias or None); with p == 0 grad_x is grad_out itself.
std::tuple<at::Tensor, std::optional<at::Tensor>> bias_dropout_residual_bwd(
    const at::Tensor& grad_out, double p, const PhiloxTuple& rng, bool has_bias,
    std::optional<at::ScalarType> bias_dtype, const std::optional<at::Tensor>& grad_x, const BackwardRoom& room = {});

// bias_act_dropout.cpp: dropout(act(x + bias)), act a BiasAct id; into out when given.
at::Tensor bias_act_dropout_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias, int act, double p,
                                const PhiloxTuple& rng, const std::optional<at::Tensor>& out);
// (grad_x, grad_bias or None); from_output: relu read off the forward's output passed as x.
std::tuple<at::Tensor, std::optional<at::Tensor>> bias_act_dropout_bwd(
    const at::Tensor& grad_out, const at::Tensor& x, const std::optional<at::Tensor>& bias, int act, double p,
    const PhiloxTuple& rng, const std::optional<at::Tensor>& grad_x, bool from_output, const BackwardRoom& room = {});

// glu.cpp: dropout(act(gate)·up), act a GluAct id; up None: gate is [rows, 2·cols] = [gate | up].
at::Tensor glu_fwd(const at::Tensor& gate, const std::optional<at::Tensor>& up, int act, double p,
                   const PhiloxTuple& rng);
// (grad_gate, grad_up or None); up None: grad_gate is the gradient of the fused gate.
std::tuple<at::Tensor, std::optional<at::Tensor>> glu_bwd(const at::Tensor& grad_out, const at::Tensor& gate,
                                                         const std::optional<at::Tensor>& up, int act, double p,
                                                         const PhiloxTuple& rng);

}  // namespace lsmini
