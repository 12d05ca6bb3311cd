// The layer runtime: a whole Transformer layer's forward and its whole backward on the kernel path (CUDA,
// float16/bfloat16, a head_dim the fused attention kernel has), each ONE call: the PyTorch operators
// lsmini::layer and lsmini::layer_backward, defined here with their CUDA and Meta (shape) implementations.
// Eager calls, torch.compile graphs and CUDA-graph captures all run these two; the one other
// implementation of a layer is its plain-PyTorch reference (lsmini/layers/reference.py).
//
// A layer is a sequence of blocks ("self" attention, "cross" attention, "ffn"), each with six parameters
// (lsmini/layers/spec.py, BLOCK_PARAMS): its core's input and output GEMM weights and biases and its norm.
//     pre-norm:  r ← r + dropout(core(norm(r)) + bias_out)     post-norm:  r ← norm(r + dropout(core(r) + bias_out))
//     self:   weight_in = fused QKV [H + 2W, H]  weight_out = [H, H]   (W = kv_heads·head_dim: rows Q | K | V)
//     cross:  weight_in = query     [H, H]       K/V come in as inputs: [b, ls, W] column blocks of the decoder
//                                                stack's one K/V projection (its gradient goes back the same way)
//     ffn:    weight_in = [F, H], weight_out = [H, F], bias_in added by bias_act_dropout; with a gated
//             activation (swiglu, geglu) weight_in = [2F, H] = [gate | up] rows, bias_in in the GEMM's epilogue
// norm: LayerNorm (weight, bias) or RMSNorm (weight; no bias). Any bias (bias_in, bias_out, norm_bias) may be
// absent (None): no add, no gradient.
// Attention core: QKV GEMM with the bias in its epilogue, then on Q and K of a self block, in place in the
// projection, rotary positions (from the caller's cos/sin tables), with qk_norm (an RMSNorm over head_dim of
// each head) before them in the same pass, the fused attention kernel reading Q/K/V as head views of the
// projection (kv_heads K/V heads, each read by heads / kv_heads query heads) and writing the merged context,
// the output GEMM. FFN core: GEMM, bias_act_dropout (or the glu kernel on the [gate | up] output), GEMM. Every
// step between GEMMs is an lsmini kernel, called through the bindings' functions (ops.h) or, where the layer
// hands it strided views or room of its own, its launcher.
// A block leaves its output bias, dropout and residual add to the norm kernel's residual form (norm_residual.h),
// which writes the sum and normalizes it: the next block's norm (pre-norm) or its own (post-norm); only the last
// pre-norm block, and a block whose output bias differs in dtype from that norm's parameters, run
// bias_dropout_residual instead. The backward is the same either way.
//
// The call's plan — where each tensor its backward needs lies in one saved-state byte buffer, where the
// dropout states and the GEMM weights cast to the activations' dtype go, where each parameter gradient goes
// in one gradient buffer, how much scratch the backward takes — is computed here (make_plan), from the
// options and the shapes, once per shape for the CUDA calls (a bounded cache) and with symbolic sizes for the
// Meta implementations, which is what torch.compile's fake tensors run. Nothing else writes the layout down.
//
// What forward saves (recompute = true, the default): each block's input, the Q/K/V projection, the
// attention context and its row log-sum-exp (and, where they take no more memory than q, the attention's
// dropout keep bits), the first FFN GEMM's output, the norm statistics (LayerNorm: mean and rstd; RMSNorm:
// rstd), each dropout's Philox state; the self block's projection holds Q and K normalized and rotated, and with
// qk_norm its Q and K as the GEMM made them are saved too (the norm's backward reads them);
// backward recomputes the FFN activation (same mask) and, pre-norm, the norm output. recompute = false
// saves those instead. With relu the FFN keeps its activation (relu' and the mask are read off it).
//
// Backward temporaries are regions of one scratch buffer, laid out per core (regions overlap only where one
// is dead before the other is written, in stream order), followed by a float32 workspace: the attention
// backward's row terms, then a region per column sum of a bias or norm gradient, whose kernels leave partial
// rows there; one launch at the end sums them all (column_sums.h):
//     self:   [0, TH) d(context), then the recomputed core input, then d(core input);
//             [TH', TH' + T(H + 2W)) d(core output), then d(QKV)   (TH' = TH aligned to kAlign)
//     cross:  [0, TH) as above; [TH', TH' + TH) d(core output), then d(Q). dK/dV go to their destinations.
//     ffn:    [0, TF) the recomputed activation, then its gradient, then (in place) d(first GEMM output);
//             gated: [0, TF) as above, then [TF', TF' + 2TF) d(first GEMM output) [gate | up].
//
// Gradients: every parameter gradient comes back in one tensor per dtype (views handed to autograd; the GEMMs and
// the column-sum kernels write theirs in place there), except that a caller may name, per parameter, an
// existing .grad to add it into (GEMM weights with beta = 1, vectors in one multi-tensor add); lsmini.layers.runtime does so only where autograd would have accumulated into that
// .grad in this very backward (layer_grad_into below decides). A cross block's dK/dV go into caller-given
// [b, ls, W] tensors when named (the decoder stack's stacked gradient), else into fresh ones.
//
// Options: norm ("layer_norm", "rms_norm"), activation ("relu", "gelu", "gelu_tanh", "swiglu", "geglu"),
// rotary_dim (0, or even in [2, head_dim]: the tables rotary_cos / rotary_sin, float32 [l, rotary_dim] or
// [b, l, rotary_dim], are then arguments), kv_heads (dividing heads), qk_norm (one self block; its two weights
// [head_dim] follow the blocks' parameters). The operators check them and say what is not supported.
#include "common.h"
#include "ops.h"

#include "attention.h"
#include "bias_act_dropout.h"
#include "bias_dropout_residual.h"
#include "cast_segments.h"
#include "glu.h"
#include "layernorm.h"
#include "qk_norm.h"
#include "rms_norm.h"
#include "rotary.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace lsmini {
namespace {

using OptTensor = std::optional<at::Tensor>;
using Tensors = std::vector<at::Tensor>;

constexpr int64_t kParamsPerBlock = 6;  // lsmini/layers/spec.py, BLOCK_PARAMS
constexpr int64_t kAlign = 64;          // elements: every scratch region and cast copy starts 128 bytes (fp16) apart
constexpr int64_t kStateAlign = 64;     // bytes: every saved tensor's start in the state
constexpr int64_t kCastAlign = 128;     // bytes: where the cast weights start in the state
constexpr PhiloxTuple kNoRng{0, 0, 0, 0};

enum class Kind { Self, Cross, Ffn };

// What a block's forward keeps for its backward, by position in its run of kSlots slots.
enum Slot : int {
  kInput,       // pre-norm with recompute: the block input (the norm and the core input are recomputed)
  kNormX,       // the norm's input: the block input (pre-norm) or the residual sum (post-norm)
  kMean,        // norm row statistics, fp32
  kRstd,
  kCoreInput,   // the core's input when kept
  kProjection,  // attention: the Q/K/V (self) or Q (cross) projection; FFN: the first GEMM's output
  kHidden,      // FFN: its activation when kept (always with relu: its derivative is read off it)
  kContext,     // attention: the merged-heads context [tokens, hidden] and its row log-sum-exp
  kLse,
  kKeys,        // cross-attention: the encoder K/V and the encoder padding mask
  kValues,
  kMask,        // attention: the key padding mask it used
  kBits,        // attention: the dropout keep bits its forward stored for its backward
  kQKRaw,       // self-attention with qk_norm: its Q and K columns before the norm [tokens, (heads + kv_heads)·d]
  kSlots
};

// The call's inputs a slot may refer to, by position.
enum Input : int { kX, kKeyPaddingMask, kEncoderK, kEncoderV, kEncoderPaddingMask };

struct Options {
  std::vector<Kind> kinds;
  int64_t hidden, ffn, heads, head_dim;
  int64_t kv_heads, kv_width;  // K/V heads and their columns, W = kv_heads·head_dim
  int64_t qkv_width;           // columns of a self block's projection: H + 2W
  double scale, eps, dropout, attn_dropout, act_dropout;
  bool pre_ln, causal, recompute;
  bool rms;       // RMSNorm (else LayerNorm)
  bool glu;       // a gated FFN: act is then a GluAct, the first GEMM has 2·ffn rows
  int act;        // BiasAct, or GluAct with glu
  int64_t ffn_in; // rows of the FFN's first GEMM: ffn, or 2·ffn with glu
  int64_t rotary_dim;
  bool qk_norm;   // RMSNorm over head_dim of the self block's Q and K heads (weights after the blocks' params)
};

// The operators' option arguments, as the schemas below take them.
struct OpArgs {
  c10::string_view kinds;
  int64_t hidden, ffn, heads, kv_heads;
  double scale, eps;
  c10::string_view norm;
  bool pre_ln;
  c10::string_view activation;
  double dropout, attn_dropout, act_dropout;
  bool causal, recompute;
  int64_t rotary_dim;
  bool qk_norm;
};
#define LSMINI_LAYER_OPTION_ARGS                                                                             \
  "str kinds, int hidden, int ffn, int heads, int kv_heads, float scale, float eps, str norm, bool pre_ln, " \
  "str activation, float dropout, float attn_dropout, float activation_dropout, bool causal, bool recompute, " \
  "int rotary_dim, bool qk_norm"
#define LSMINI_LAYER_OPTION_PARAMS                                                                          \
  c10::string_view kinds, int64_t hidden, int64_t ffn, int64_t heads, int64_t kv_heads, double scale,      \
      double eps, c10::string_view norm, bool pre_ln, c10::string_view activation, double dropout,           \
      double attn_dropout, double activation_dropout, bool causal, bool recompute, int64_t rotary_dim, bool qk_norm
#define LSMINI_LAYER_OPTION_VALUES                                                                            \
  OpArgs {                                                                                                   \
    kinds, hidden, ffn, heads, kv_heads, scale, eps, norm, pre_ln, activation, dropout, attn_dropout,        \
        activation_dropout, causal, recompute, rotary_dim, qk_norm                                           \
  }

Options options_of(const OpArgs& a, const char* op) {
  Options o;
  for (size_t start = 0; start <= a.kinds.size();) {  // "self,cross,ffn"
    const size_t end = std::min(a.kinds.find(',', start), a.kinds.size());
    const std::string kind(a.kinds.substr(start, end - start));
    LSMINI_CHECK(kind == "self" || kind == "cross" || kind == "ffn", op, ": unknown block kind '", kind,
                 "' (expected self, cross or ffn)");
    o.kinds.push_back(kind == "self" ? Kind::Self : kind == "cross" ? Kind::Cross : Kind::Ffn);
    start = end + 1;
  }
  LSMINI_CHECK(a.hidden > 0 && a.ffn > 0 && a.heads > 0 && a.hidden % a.heads == 0, op, ": bad sizes (hidden ",
               a.hidden, ", ffn ", a.ffn, ", heads ", a.heads, "): hidden must be a multiple of heads");
  const std::string norm(a.norm);
  LSMINI_CHECK(norm == "layer_norm" || norm == "rms_norm", op, ": unknown norm '", norm,
               "' (expected layer_norm or rms_norm)");
  LSMINI_CHECK(a.kv_heads > 0 && a.heads % a.kv_heads == 0, op, ": kv_heads (", a.kv_heads, ") must divide heads (",
               a.heads, ")");
  LSMINI_CHECK(norm != "rms_norm" || a.hidden <= kRmsNormMaxHidden, op, ": rms_norm takes hidden <= ",
               kRmsNormMaxHidden, ", got ", a.hidden);
  const int64_t head_dim = a.hidden / a.heads;
  LSMINI_CHECK(a.rotary_dim == 0 || (a.rotary_dim % 2 == 0 && a.rotary_dim >= 2 && a.rotary_dim <= head_dim), op,
               ": rotary_dim must be 0 or even and in [2, head_dim = ", head_dim, "], got ", a.rotary_dim);
  const std::string act(a.activation);
  LSMINI_CHECK(act == "relu" || act == "gelu" || act == "gelu_tanh" || act == "swiglu" || act == "geglu", op,
               ": unknown activation '", act, "' (expected relu, gelu, gelu_tanh, swiglu or geglu)");
  for (const double p : {a.dropout, a.attn_dropout, a.act_dropout}) {
    LSMINI_CHECK(p >= 0.0 && p < 1.0, op, ": dropout probabilities must be in [0, 1), got ", p);
  }
  LSMINI_CHECK(a.eps >= 0.0, op, ": eps must be >= 0, got ", a.eps);
  o.hidden = a.hidden;
  o.ffn = a.ffn;
  o.heads = a.heads;
  o.head_dim = a.hidden / a.heads;
  o.kv_heads = a.kv_heads;
  o.kv_width = a.kv_heads * o.head_dim;
  o.qkv_width = a.hidden + 2 * o.kv_width;
  o.scale = a.scale;
  o.eps = a.eps;
  o.dropout = a.dropout;
  o.attn_dropout = a.attn_dropout;
  o.act_dropout = a.act_dropout;
  o.pre_ln = a.pre_ln;
  o.causal = a.causal;
  o.recompute = a.recompute;
  o.rms = norm == "rms_norm";
  o.glu = act == "swiglu" || act == "geglu";
  o.act = o.glu ? int(act == "swiglu" ? GluAct::Silu : GluAct::Gelu)
                : int(act == "relu" ? BiasAct::Relu : act == "gelu" ? BiasAct::Gelu : BiasAct::GeluTanh);
  o.ffn_in = o.glu ? 2 * a.ffn : a.ffn;
  o.rotary_dim = a.rotary_dim;
  o.qk_norm = a.qk_norm;
  if (o.qk_norm) {  // one self block: the two norm weights are its own
    int64_t selfs = 0;
    for (const Kind k : o.kinds) selfs += k == Kind::Self;
    LSMINI_CHECK(selfs == 1, op, ": qk_norm needs exactly one self-attention block, got ", selfs);
    LSMINI_CHECK(o.head_dim <= kQkNormMaxHeadDim, op, ": qk_norm takes head_dim <= ", kQkNormMaxHeadDim, ", got ",
                 o.head_dim);
  }
  return o;
}

// The blocks' parameters (kParamsPerBlock each); with qk_norm the Q and K norm weights follow them.
size_t block_param_count(const Options& o) { return o.kinds.size() * kParamsPerBlock; }
size_t param_count(const Options& o) { return block_param_count(o) + (o.qk_norm ? 2 : 0); }

// relu keeps its output for the backward (its derivative is read off it) instead of the GEMM output.
bool keeps_relu_output(const Options& o) { return !o.glu && o.act == int(BiasAct::Relu); }

// ---- the plan -------------------------------------------------------------------------------------------
// Int: int64_t for a CUDA call, c10::SymInt for the Meta implementations (symbolic batch and lengths).
template <typename Int>
Int align_up(const Int& n, int64_t to) {
  return (n + (to - 1)) / to * to;
}

int64_t align(int64_t n) { return align_up<int64_t>(n, kAlign); }

// Whether a layer's attention keeps its forward's dropout keep bits for the backward: with dropout, where the
// bits take no more memory than q (k_len <= 16·head_dim, one bit a score against two bytes an element of q).
template <typename Int>
bool layer_keeps_bits(double p, const Int& k_len, int64_t head_dim) {
  return p > 0 && k_len <= 16 * head_dim;
}

template <typename Int>
Int keep_numel(const Int& batch, int64_t heads, const Int& q_len, const Int& k_len) {  // attention_keep_numel
  return batch * heads * ((q_len + 63) / 64 * 4) * ((k_len + 63) / 64) * 32;
}

enum class Layout : int { None, Input, Same, New };

template <typename Int>
struct SlotPlan {
  Layout kind = Layout::None;
  int64_t ref = 0;  // Input: an Input; Same: the slot whose tensor this is
  at::ScalarType dtype = at::kByte;
  std::vector<Int> shape;
};

// The two gradient tensors lsmini::layer_backward returns: the gradients of the parameters of params[0]'s dtype,
// and those of the parameters of one other dtype (e.g. float32 norm parameters beside float16 weights).
// kGradInto: added into a .grad the caller names; kGradNone: an absent parameter (None), no gradient.
constexpr int kGradMain = 0, kGradOther = 1, kGradInto = -1, kGradNone = -2;

template <typename Int>
struct Plan {
  std::vector<SlotPlan<Int>> slots;  // per block, kSlots each
  std::vector<Int> offsets;          // bytes into the state, per slot (where placed)
  std::vector<bool> placed;
  Int rng_at, cast_at, total;        // bytes: the dropout states, the cast weights, the whole state
  std::vector<int64_t> cast_positions;
  std::vector<Int> cast_at_elements;
  std::vector<int> grad_buffer;   // per parameter: kGradMain, kGradOther, kGradInto or kGradNone
  std::vector<Int> grad_offsets;  // per parameter: elements into its gradient tensor
  std::array<Int, 2> grad_numel{0, 0};
  std::array<bool, 2> grad_gaps{false, false};  // some gradients are followed by alignment padding (zeroed)
  at::ScalarType other_dtype;                   // the dtype of the kGradOther tensor
};

// Whether an input bias is added in its GEMM's epilogue (attention blocks, gated FFNs), so must be in x's dtype.
bool bias_in_gemm(Kind kind, const Options& o) { return kind != Kind::Ffn || o.glu; }

// Whether the call casts parameter i to dtype: the GEMM weights and an input bias added in its GEMM's epilogue
// always, when not in dtype; the other vectors (the QK-norm weights after the blocks' parameters too) only when
// neither float32 nor dtype (the kernels read float32 or dtype). Absent parameters never.
bool needs_cast(const Options& o, size_t i, const at::Tensor& p, at::ScalarType dtype) {
  if (!p.defined()) return false;
  const int64_t position = int64_t(i % kParamsPerBlock);
  const bool gemm = i < block_param_count(o) && (position == 0 || position == 2 ||
                                                 (position == 1 && bias_in_gemm(o.kinds[i / kParamsPerBlock], o)));
  return p.scalar_type() != dtype && (gemm || p.scalar_type() != at::kFloat);
}

template <typename Int>
Plan<Int> make_plan(const Options& o, const Int& batch, const Int& q_len, const Int& src_len, bool has_mask,
                    bool has_encoder_mask, at::ScalarType dtype, at::TensorList params,
                    const std::vector<bool>& into) {
  struct Value {
    int64_t input = -1, made = -1;
  };
  auto numel = [](const at::Tensor& p) -> Int {  // parameters too may have symbolic sizes
    if constexpr (std::is_same_v<Int, int64_t>) {
      return p.numel();
    } else {
      return p.sym_numel();
    }
  };
  struct Made {
    std::vector<Int> shape;
    at::ScalarType dtype;
    int64_t slot = -1;  // where it was placed first
  };
  std::vector<Made> made;
  auto make = [&](std::vector<Int> shape, at::ScalarType dt) {
    made.push_back(Made{std::move(shape), dt});
    return Value{-1, int64_t(made.size()) - 1};
  };
  const Int t = batch * q_len;
  const int64_t h = o.hidden;
  Plan<Int> plan;
  Value residual{kX, -1};
  for (const Kind kind : o.kinds) {
    std::array<std::optional<Value>, kSlots> v;
    v[kCoreInput] = o.pre_ln ? make({t, h}, dtype) : residual;
    if (kind == Kind::Ffn) {
      if (keeps_relu_output(o)) {
        v[kHidden] = make({t, o.ffn}, dtype);
      } else {
        v[kProjection] = make({t, o.ffn_in}, dtype);
        if (!o.recompute) v[kHidden] = make({t, o.ffn}, dtype);
      }
    } else {
      const bool self = kind == Kind::Self;
      v[kProjection] = make({t, self ? o.qkv_width : h}, dtype);
      if (self && o.qk_norm) v[kQKRaw] = make({t, (o.heads + o.kv_heads) * o.head_dim}, dtype);
      v[kContext] = make({t, h}, dtype);
      v[kLse] = make({batch, Int(o.heads), q_len}, at::kFloat);
      if (!self) {
        v[kKeys] = Value{kEncoderK, -1};
        v[kValues] = Value{kEncoderV, -1};
      }
      const Int k_len = self ? q_len : src_len;
      if (layer_keeps_bits(o.attn_dropout, k_len, o.head_dim)) {
        v[kBits] = make({keep_numel(batch, o.heads, q_len, k_len)}, at::kInt);
      }
      if (self ? has_mask : has_encoder_mask) v[kMask] = Value{self ? kKeyPaddingMask : kEncoderPaddingMask, -1};
    }
    if (!o.rms) v[kMean] = make({t}, at::kFloat);
    v[kRstd] = make({t}, at::kFloat);
    if (o.pre_ln) {
      v[kNormX] = residual;
      if (o.recompute) {  // the core input is recomputed from the block input
        v[kCoreInput].reset();
        v[kInput] = residual;
      }
      residual = make({t, h}, dtype);  // the block's output: the next block's input
    } else {
      v[kNormX] = make({t, h}, dtype);
      residual = make({t, h}, dtype);  // the norm's output
    }
    for (int s = 0; s < kSlots; ++s) {
      SlotPlan<Int> slot;
      if (v[s] && v[s]->input >= 0) {
        slot.kind = Layout::Input;
        slot.ref = v[s]->input;
      } else if (v[s]) {
        Made& m = made[v[s]->made];
        if (m.slot >= 0) {
          slot.kind = Layout::Same;
          slot.ref = m.slot;
        } else {
          m.slot = int64_t(plan.slots.size());
          slot.kind = Layout::New;
          slot.dtype = m.dtype;
          slot.shape = m.shape;
        }
      }
      plan.slots.push_back(std::move(slot));
    }
  }
  // the created tensors one after the other in the state, each kStateAlign-aligned; a Same slot at its original
  Int end = 0;
  for (const SlotPlan<Int>& slot : plan.slots) {
    if (slot.kind == Layout::New) {
      plan.offsets.push_back(end);
      plan.placed.push_back(true);
      Int bytes = Int(int64_t(c10::elementSize(slot.dtype)));
      for (const Int& d : slot.shape) bytes = bytes * d;
      end = align_up<Int>(end + bytes, kStateAlign);
    } else if (slot.kind == Layout::Same) {
      plan.offsets.push_back(plan.offsets[slot.ref]);
      plan.placed.push_back(true);
    } else {
      plan.offsets.push_back(Int(0));
      plan.placed.push_back(false);
    }
  }
  // then the dropout states (int64 [2·blocks, 2]), then the cast GEMM weights (each kAlign-aligned)
  plan.rng_at = end;
  plan.cast_at = align_up<Int>(end + int64_t(2 * o.kinds.size() * 16), kCastAlign);
  Int cast_numel = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!needs_cast(o, i, params[i], dtype)) continue;
    plan.cast_positions.push_back(int64_t(i));
    plan.cast_at_elements.push_back(cast_numel);
    cast_numel = cast_numel + align_up<Int>(numel(params[i]), kAlign);
  }
  plan.total = plan.cast_at + cast_numel * int64_t(c10::elementSize(dtype));
  // the gradients of params[0]'s dtype in one tensor, those of the other dtype in another, each kAlign-aligned
  // (absent parameters have no gradient and no place)
  plan.other_dtype = params[0].scalar_type();
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].defined() && !into[i] && params[i].scalar_type() != params[0].scalar_type()) {
      plan.other_dtype = params[i].scalar_type();
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const int b = !params[i].defined() ? kGradNone
                  : into[i]            ? kGradInto
                  : params[i].scalar_type() == params[0].scalar_type() ? kGradMain
                                                                       : kGradOther;
    plan.grad_buffer.push_back(b);
    plan.grad_offsets.push_back(b < 0 ? Int(0) : plan.grad_numel[b]);
    if (b < 0) continue;
    TORCH_CHECK(params[i].scalar_type() == (b == kGradMain ? params[0].scalar_type() : plan.other_dtype),
                "lsmini::layer_backward: the parameters may have at most two dtypes, got ", params[0].scalar_type(),
                ", ", plan.other_dtype, " and ", params[i].scalar_type());
    const Int n = numel(params[i]), padded = align_up<Int>(n, kAlign);
    plan.grad_gaps[b] = plan.grad_gaps[b] || padded != n;
    plan.grad_numel[b] = plan.grad_numel[b] + padded;
  }
  return plan;
}

// Scratch elements one backward takes: the largest block's layout (see the file's comment).
int64_t scratch_numel(const Options& o, int64_t tokens) {
  int64_t n = 0;
  for (const Kind kind : o.kinds) {
    const int64_t th = tokens * o.hidden;
    const int64_t ffn = o.glu ? align(tokens * o.ffn) + tokens * o.ffn_in : tokens * o.ffn;
    n = std::max(n, kind == Kind::Ffn ? ffn : align(th) + tokens * (kind == Kind::Self ? o.qkv_width : o.hidden));
  }
  return n;
}

// Float32 elements of the column partial sums of a block's norm gradients (both, or RMSNorm's weight's).
int64_t norm_partials(const Options& o, int64_t tokens) {
  return o.rms ? rms_norm_bwd_partial_rows(tokens) * o.hidden : 2 * layernorm_bwd_partial_rows(tokens) * o.hidden;
}

// Float32 elements of the column partial sums of a bias gradient over `columns`: bias_act_dropout's backward
// (an FFN's input bias outside a gated GEMM), else bias_dropout_residual's (the output bias, and an input bias
// added in its GEMM's epilogue).
int64_t bias_partials(int64_t tokens, int64_t columns, bool act) {
  return (act ? bias_act_dropout_bwd_partial_slabs(tokens, columns)
              : bias_dropout_residual_bwd_partial_slabs(tokens, columns)) *
         columns;
}

// Columns of a block's input bias.
int64_t bias_in_columns(Kind kind, const Options& o) {
  return kind == Kind::Ffn ? o.ffn_in : kind == Kind::Self ? o.qkv_width : o.hidden;
}

// Float32 elements of the backward's workspace: the attention backward's row terms at its start, then one region
// per column sum of the whole backward (a norm's, an output bias's, an input bias's per block), each written by
// its kernel and summed at the end of the backward with all the others in one launch (column_sums.h).
int64_t workspace_numel(const Options& o, int64_t batch, int64_t q_len, at::TensorList params) {
  const int64_t t = batch * q_len;
  int64_t n = align(batch * o.heads * q_len);
  for (size_t i = 0; i < o.kinds.size(); ++i) {
    const at::Tensor* p = params.data() + i * kParamsPerBlock;
    if (p[4].defined() || p[5].defined()) n += align(norm_partials(o, t));
    if (p[3].defined()) n += align(bias_partials(t, o.hidden, false));
    if (p[1].defined()) {
      n += align(bias_partials(t, bias_in_columns(o.kinds[i], o), !bias_in_gemm(o.kinds[i], o)));
    }
  }
  if (o.qk_norm) {  // the Q and K norm weights' gradients
    n += align(qk_norm_bwd_partial_rows(t * o.heads) * o.head_dim) +
         align(qk_norm_bwd_partial_rows(t * o.kv_heads) * o.head_dim);
  }
  return n;
}

// Appends v's bytes to a cache key (no number goes through an ostream here: common.h says why).
template <typename V>
void put_bytes(std::string& key, const V v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// The plan of a CUDA call, from a cache of the recent shapes (bounded: cleared when full; plans are cheap).
std::shared_ptr<const Plan<int64_t>> call_plan(const OpArgs& a, const Options& o, const at::Tensor& x,
                                               bool has_mask, bool has_encoder_mask, int64_t src_len,
                                               at::TensorList params, const std::vector<bool>& into) {
  std::string key(a.kinds);
  key += '|';
  key += a.activation;
  key += '|';
  key += a.norm;
  key += '|';
  for (const auto v : {a.hidden, a.ffn, a.heads, a.kv_heads, x.size(0), x.size(1), src_len}) put_bytes(key, v);
  for (const auto v : {a.dropout, a.attn_dropout, a.act_dropout}) put_bytes(key, v > 0);
  for (const auto v : {a.pre_ln, a.recompute, a.qk_norm, has_mask, has_encoder_mask}) put_bytes(key, v);
  put_bytes(key, x.scalar_type());
  for (size_t i = 0; i < params.size(); ++i) {
    put_bytes(key, params[i].defined());
    if (params[i].defined()) {
      put_bytes(key, params[i].scalar_type());
      put_bytes(key, params[i].numel());
    }
    put_bytes(key, bool(into[i]));
  }
  constexpr size_t kMaxPlans = 512;
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<std::string, std::shared_ptr<const Plan<int64_t>>>();
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache->find(key);
    if (it != cache->end()) return it->second;
  }
  auto plan = std::make_shared<const Plan<int64_t>>(make_plan<int64_t>(
      o, x.size(0), x.size(1), src_len, has_mask, has_encoder_mask, x.scalar_type(), params, into));
  std::lock_guard<std::mutex> lock(mutex);
  if (cache->size() >= kMaxPlans) cache->clear();
  cache->emplace(key, plan);
  return plan;
}

// ---- views and GEMMs, made with as little host work as possible -------------------------------------------
// A contiguous `dtype` tensor of `sizes` over base's storage, byte_offset bytes past base's first element
// (base contiguous), made directly on that storage: narrow + view(dtype) + view(sizes) would be four ATen
// calls through the dispatcher, and a call carves dozens of these.
at::Tensor carve(const at::Tensor& base, int64_t byte_offset, at::ScalarType dtype, at::IntArrayRef sizes,
                 const char* op) {
  const int64_t item = int64_t(c10::elementSize(dtype));
  const int64_t bytes = c10::multiply_integers(sizes) * item;
  const int64_t start = base.storage_offset() * int64_t(base.element_size()) + byte_offset;
  LSMINI_CHECK(base.is_contiguous() && byte_offset >= 0 && start % item == 0 &&
                   byte_offset + bytes <= base.numel() * int64_t(base.element_size()),
               op, ": ", bytes, " bytes of ", dtype, " at byte ", byte_offset, " do not fit a ",
               base.numel() * int64_t(base.element_size()), "-byte buffer");
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                         caffe2::TypeMeta::fromScalarType(dtype));
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  t.unsafeGetTensorImpl()->set_storage_offset(start / item);
  return t;
}

// Whether a parameter is a transposed view of a contiguous 2-D tensor (GPT-2's Conv1D weights, which the layer
// takes as weight.t()). The copy the layer casts such a weight into and the gradient it writes for it keep that
// layout: the cast runs element by element over the same memory order, and the gradient reaches the parameter
// without autograd copying it into the parameter's layout. runtime.py's _param_grads makes the same choice.
bool transposed_layout(const at::Tensor& p) {
  return p.dim() == 2 && !p.is_contiguous() && p.stride(0) == 1 && p.stride(1) == p.size(0);
}

// carve of p's sizes, in p's layout where transposed_layout(p), else contiguous.
at::Tensor carve_like(const at::Tensor& base, int64_t byte_offset, at::ScalarType dtype, const at::Tensor& p,
                      const char* op) {
  at::Tensor t = carve(base, byte_offset, dtype, p.sizes(), op);
  if (transposed_layout(p)) t.unsafeGetTensorImpl()->set_sizes_and_strides(p.sizes(), p.strides());
  return t;
}

// What base.as_strided(sizes, strides, offset) makes (offset: elements of base's dtype from its storage's
// start), made directly on the storage. Nothing here needs autograd's view tracking: the operators run below
// autograd.
at::Tensor strided_view(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  at::Tensor t =
      at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}

at::Tensor transposed(const at::Tensor& m) {
  return strided_view(m, {m.size(1), m.size(0)}, {m.stride(1), m.stride(0)}, m.storage_offset());
}

// The contiguous [rows, cols] view of flat[offset:].
at::Tensor region(const at::Tensor& flat, int64_t offset, int64_t rows, int64_t cols) {
  return strided_view(flat, {rows, cols}, {cols, 1}, flat.storage_offset() + offset);
}

// The `count` heads from column `first` of x2d [batch·len, columns] (head-major) as the
// [batch, count, len, head_dim] view the attention kernels read, no copy.
at::Tensor head_view(const at::Tensor& x2d, int64_t batch, int64_t len, int64_t first, int64_t count,
                     const Options& o) {
  const int64_t row = x2d.stride(0);
  return strided_view(x2d, {batch, count, len, o.head_dim}, {len * row, o.head_dim, row, 1},
                      x2d.storage_offset() + first);
}

// A self block's projection [batch·len, H + 2W] (or its gradient) as the Q, K and V head views.
std::array<at::Tensor, 3> qkv_views(const at::Tensor& x2d, int64_t batch, int64_t len, const Options& o) {
  return {head_view(x2d, batch, len, 0, o.heads, o), head_view(x2d, batch, len, o.hidden, o.kv_heads, o),
          head_view(x2d, batch, len, o.hidden + o.kv_width, o.kv_heads, o)};
}

// [b, ls, W] encoder keys or values (any row stride, unit column stride) → [b, kv_heads, ls, d].
OptTensor heads_of(const OptTensor& t, const Options& o) {
  if (!t) return std::nullopt;
  return strided_view(*t, {t->size(0), o.kv_heads, t->size(1), o.head_dim},
                      {t->stride(0), o.head_dim * t->stride(2), t->stride(1), t->stride(2)}, t->storage_offset());
}

// The shapes of one call: [batch, q_len] tokens, and the parameters' dtype (weight gradients come out in it).
struct Shape {
  int64_t batch, q_len, tokens;
  at::ScalarType weight_dtype;
};

// [tokens, hidden] (contiguous) as the attention kernels' [batch, heads, len, head_dim] view.
at::Tensor split(const at::Tensor& merged, const Shape& s, const Options& o) {
  return head_view(merged, s.batch, s.q_len, 0, o.heads, o);
}

// x·weightᵀ, into out when given.
at::Tensor matmul_t(const at::Tensor& x, const at::Tensor& weight, const OptTensor& out) {
  if (out) {
    at::Tensor dst = *out;
    return at::mm_out(dst, x, transposed(weight));
  }
  return at::mm(x, transposed(weight));
}

// x·weightᵀ + bias in one GEMM (the bias, in x's dtype, in its epilogue; none when absent), into out when given.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const OptTensor& out) {
  if (!bias.defined()) return matmul_t(x, weight, out);
  if (out) {
    at::Tensor dst = *out;
    return at::addmm_out(dst, bias, x, transposed(weight));
  }
  return at::addmm(bias, x, transposed(weight));
}

// Where one parameter's gradient goes: a tensor the GEMM or the final pass adds into (a .grad) or writes
// (its place in the one gradient tensor), or nowhere given (the gradient is returned on its own).
struct GradDest {
  OptTensor tensor;
  bool add = false;
};

// a·b in the parameter's dtype: float32 straight out of the GEMM under autocast. With a destination the GEMM
// adds its product there (beta = 1) or writes it there, and returns undefined.
at::Tensor weight_grad(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype, const GradDest& dest) {
  if (dest.tensor) {
    at::Tensor dst = *dest.tensor;
    if (dst.scalar_type() == a.scalar_type()) {
      dest.add ? at::addmm_out(dst, dst, a, b) : at::mm_out(dst, a, b);
    } else {
      dest.add ? at::addmm_out(dst, dst, a, b, dst.scalar_type()) : at::mm_out(dst, a, b, dst.scalar_type());
    }
    return at::Tensor();
  }
  if (dtype == at::kFloat && a.scalar_type() != dtype) return at::mm(a, b, dtype);
  return at::mm(a, b).to(dtype);
}

PhiloxTuple draw(double p) { return p > 0 ? philox_seed_offset() : kNoRng; }

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// A parameter's dtype; Undefined for an absent one.
at::ScalarType dtype_of(const at::Tensor& t) { return t.defined() ? t.scalar_type() : at::ScalarType::Undefined; }

template <typename T>
T* ptr(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// One block's parameters, BLOCK_PARAMS order (GEMM weights and attention input biases cast to x's dtype),
// the dtype of its input bias as the module holds it (its gradient's), and for the self block with qk_norm the
// Q and K norm weights (else null).
struct Params {
  const at::Tensor &weight_in, &bias_in, &weight_out, &bias_out, &norm_weight, &norm_bias;
  at::ScalarType bias_in_dtype;
  const at::Tensor* q_norm_weight = nullptr;
  const at::Tensor* k_norm_weight = nullptr;
};

Params block_params(const Tensors& params, size_t block, at::ScalarType bias_in_dtype, const Options& o) {
  const at::Tensor* p = params.data() + block * kParamsPerBlock;
  Params out{p[0], p[1], p[2], p[3], p[4], p[5], bias_in_dtype};
  if (o.qk_norm && o.kinds[block] == Kind::Self) {
    out.q_norm_weight = params.data() + block_param_count(o);
    out.k_norm_weight = out.q_norm_weight + 1;
  }
  return out;
}

// What the attention blocks read besides their parameters ([b, heads, ls, d] encoder K/V; the rotary tables,
// contiguous float32 [b or 1, l, rotary_dim], when rotary_dim > 0).
struct Inputs {
  OptTensor key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, rotary_cos, rotary_sin;
};

// ---- the kernels the layer launches itself (on its own strided views and room) ---------------------------
// Calls f(T{}, W{}): T the kernel type of dtype, W that of the norm weight w (float32 or dtype; T when absent).
template <typename F>
void dispatch_norm_types(at::ScalarType dtype, const at::Tensor& w, const char* op, F&& f) {
  dispatch_float(dtype, op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    if (w.defined() && w.scalar_type() != dtype) {
      f(T{}, float{});
    } else {
      f(T{}, T{});
    }
  });
}

// The residual form of a norm (norm_residual.h): a block's output x, its output bias and dropout, and the residual
// stream it is added to.
struct AddNorm {
  const at::Tensor& residual;
  const at::Tensor& bias;  // undefined: none
  double p;
  const PhiloxTuple& rng;
};

// The dtype the norm kernels take a block's norm parameters in: the weight's or the bias's, else x's.
at::ScalarType norm_param_dtype(const Params& p, at::ScalarType x) {
  return p.norm_weight.defined() ? p.norm_weight.scalar_type()
                                 : p.norm_bias.defined() ? p.norm_bias.scalar_type() : x;
}

// Whether a block's output bias, dropout and residual add go into the norm kernel that follows it (the residual
// form): where the bias, if any, has that norm's parameters' dtype.
bool add_and_norm(const Params& block, const Params& norm, at::ScalarType x) {
  return !block.bias_out.defined() || block.bias_out.scalar_type() == norm_param_dtype(norm, x);
}

// The block's norm of x [tokens, hidden] (contiguous): (y, mean, rstd), each into out / mean / rstd when given;
// mean is undefined for RMSNorm. With add, the residual form: s = residual + dropout(x + bias) is written over x
// and normalized, the add & norm in one kernel.
std::array<at::Tensor, 3> norm_fwd(const at::Tensor& x, const Params& p, const Options& o, const OptTensor& out,
                                   const OptTensor& mean = std::nullopt, const OptTensor& rstd = std::nullopt,
                                   const AddNorm* add = nullptr) {
  if (!o.rms) {
    const Tensors r = add ? layernorm_fwd(x, opt(p.norm_weight), opt(p.norm_bias), o.eps, out, mean, rstd,
                                          add->residual, opt(add->bias), add->p, add->rng, x)
                          : layernorm_fwd(x, opt(p.norm_weight), opt(p.norm_bias), o.eps, out, mean, rstd);
    return {r[0], r[1], r[2]};
  }
  const char* op = "lsmini::layer";
  const at::Tensor y = out ? *out : at::empty({x.size(0), x.size(1)}, x.options());
  const at::Tensor r = rstd ? *rstd : at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  dispatch_norm_types(x.scalar_type(), p.norm_weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    const NormResidual<T, W> residual_form{
        add ? ptr<const T>(add->residual) : nullptr, add && add->bias.defined() ? ptr<const W>(add->bias) : nullptr,
        add ? ptr<T>(x) : nullptr, add ? float(add->p) : 0.f,
        add && add->p > 0.0 ? philox_args(add->rng, op) : PhiloxArgs{}};
    check_launch(launch_rms_norm_fwd<T, W>(ptr<const T>(x), p.norm_weight.defined() ? ptr<const W>(p.norm_weight)
                                                                                   : nullptr,
                                           ptr<T>(y), ptr<float>(r), x.size(0), int(x.size(1)), float(o.eps),
                                           add ? &residual_form : nullptr, current_stream()),
                 op);
  });
  return {y, at::Tensor(), r};
}

// Rotary positions on q and k, [b, heads, l, d] views of one projection, in place. (The backward undoes them in the
// attention backward's stores.)
void rotary_in_place(const at::Tensor& q, const at::Tensor& k, const Inputs& in, const Options& o) {
  const char* op = "lsmini::layer";
  const at::Tensor &cos = *in.rotary_cos, &sin = *in.rotary_sin;
  const int64_t cs_stride_batch = cos.size(0) == 1 ? 0 : cos.stride(0);
  dispatch_float(q.scalar_type(), op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    auto operand = [](const at::Tensor& x) {
      RotaryTensors<T> r;
      r.in = ptr<const T>(x);
      r.out = ptr<T>(x);
      r.heads = x.size(1);
      for (int d = 0; d < 3; ++d) r.in_stride[d] = r.out_stride[d] = x.stride(d);
      return r;
    };
    check_launch(launch_rotary_fwd<T, float>(operand(q), operand(k), ptr<const float>(cos), ptr<const float>(sin),
                                             cs_stride_batch, cos.stride(1), q.size(0), q.size(2), int(o.head_dim),
                                             int(o.rotary_dim), false, current_stream()),
                 op);
  });
}

// The rotary tables as the QK-norm kernels read them, for tokens b·seq + s (none when rotary_dim is 0).
QkRotary qk_rotary(const Inputs& in, const Options& o, int64_t seq) {
  QkRotary r;
  if (o.rotary_dim == 0) return r;
  const at::Tensor &cos = *in.rotary_cos, &sin = *in.rotary_sin;
  r.cos = ptr<const float>(cos);
  r.sin = ptr<const float>(sin);
  r.stride_batch = cos.size(0) == 1 ? 0 : cos.stride(0);
  r.stride_seq = cos.stride(1);
  r.seq = seq;
  r.rot_dim = int(o.rotary_dim);
  return r;
}

// QK-norm of a self block's projection [tokens, H + 2W] (contiguous), in place on its Q and on its K heads, then
// their rotary positions in the same pass; raw [tokens, H + W] receives them as they came, the Q rows
// [tokens·heads, d] then the K rows [tokens·kv_heads, d].
void qk_norm_fwd(const at::Tensor& projection, const at::Tensor& raw, const Params& p, const Options& o,
                 const QkRotary& rotary) {
  const char* op = "lsmini::layer";
  const int64_t tokens = projection.size(0);
  dispatch_norm_types(projection.scalar_type(), *p.q_norm_weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    for (const bool k : {false, true}) {
      check_launch(launch_qk_norm_fwd<T, W>(ptr<T>(projection) + (k ? o.hidden : 0), projection.stride(0),
                                            ptr<T>(raw) + (k ? tokens * o.hidden : 0),
                                            ptr<const W>(k ? *p.k_norm_weight : *p.q_norm_weight), tokens,
                                            int(k ? o.kv_heads : o.heads), int(o.head_dim), float(o.eps), rotary,
                                            current_stream()),
                   op);
    }
  });
}

// dropout(act(gate)·up) of a contiguous [tokens, 2F] = [gate | up] projection, into out [tokens, F] when given.
at::Tensor glu_fwd_into(const at::Tensor& projection, const Options& o, const PhiloxTuple& rng, const OptTensor& out) {
  const char* op = "lsmini::layer";
  const at::Tensor y = out ? *out : at::empty({projection.size(0), o.ffn}, projection.options());
  dispatch_float(projection.scalar_type(), op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    const T* gate = ptr<const T>(projection);
    check_launch(launch_glu_fwd<T>(gate, gate + o.ffn, o.ffn_in, ptr<T>(y), projection.size(0), o.ffn, o.act,
                                   float(o.act_dropout), philox_args(rng, op), current_stream()),
                 op);
  });
  return y;
}

// The gradient of the [tokens, 2F] projection glu_fwd_into read, from that of its output (contiguous [tokens, F]),
// into grad_projection (contiguous [tokens, 2F]); the forward's dropout mask drawn again from rng.
void glu_bwd_into(const at::Tensor& grad_out, const at::Tensor& projection, const Options& o, const PhiloxTuple& rng,
                  const at::Tensor& grad_projection) {
  const char* op = "lsmini::layer_backward";
  dispatch_float(projection.scalar_type(), op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    const T* gate = ptr<const T>(projection);
    T* grad_gate = ptr<T>(grad_projection);
    check_launch(launch_glu_bwd<T>(ptr<const T>(grad_out), gate, gate + o.ffn, o.ffn_in, grad_gate,
                                   grad_gate + o.ffn, projection.size(0), o.ffn, o.act, float(o.act_dropout),
                                   philox_args(rng, op), current_stream()),
                 op);
  });
}

// ---- forward ---------------------------------------------------------------------------------------------
// Where forward puts the tensors it saves: at(slot, ...) is that slot's view of the state, or none where the
// plan has no place for the slot (then the tensor is not saved and the caller allocates as usual).
class Destinations {
 public:
  Destinations(const at::Tensor& state, const Plan<int64_t>& plan, size_t base)
      : state_(state), plan_(plan), base_(base) {}

  OptTensor at(int slot, at::IntArrayRef sizes, at::ScalarType dtype) const {
    const size_t i = base_ + size_t(slot);
    if (i >= plan_.slots.size() || !plan_.placed[i]) return std::nullopt;
    return carve(state_, plan_.offsets[i], dtype, sizes, "lsmini::layer");
  }
  bool has(int slot) const { return plan_.placed[base_ + size_t(slot)]; }

 private:
  const at::Tensor& state_;
  const Plan<int64_t>& plan_;
  size_t base_;
};

// An attention core: x [tokens, hidden] → its output (into `out` when given: where the block's output goes).
at::Tensor attention_core_fwd(Kind kind, const at::Tensor& x, const Params& p, const Options& o, const Shape& s,
                              const Inputs& in, at::Tensor* slots, PhiloxTuple& rng, const Destinations& dest,
                              const OptTensor& out_core) {
  const bool self = kind == Kind::Self;
  const at::ScalarType dtype = x.scalar_type();
  at::Tensor projection =
      project(x, p.weight_in, p.bias_in, dest.at(kProjection, {s.tokens, self ? o.qkv_width : o.hidden}, dtype));
  const auto [q, k, v] = self ? qkv_views(projection, s.batch, s.q_len, o)
                               : std::array{split(projection, s, o), *in.encoder_k, *in.encoder_v};
  // the saved projection holds Q and K normalized and rotated; with qk_norm kQKRaw holds them as they came
  if (self && o.qk_norm) {
    const OptTensor given = dest.at(kQKRaw, {s.tokens, (o.heads + o.kv_heads) * o.head_dim}, dtype);
    slots[kQKRaw] = given ? *given : at::empty({s.tokens, (o.heads + o.kv_heads) * o.head_dim}, x.options());
    qk_norm_fwd(projection, slots[kQKRaw], p, o, qk_rotary(in, o, s.q_len));
  } else if (self && o.rotary_dim > 0) {
    rotary_in_place(q, k, in, o);
  }
  const OptTensor& mask = self ? in.key_padding_mask : in.encoder_padding_mask;
  rng = draw(o.attn_dropout);
  const int64_t k_len = k.size(2);
  const OptTensor bits = dest.has(kBits) ? dest.at(kBits, {keep_numel<int64_t>(s.batch, o.heads, s.q_len, k_len)},
                                                   at::kInt)
                                         : std::nullopt;
  const OptTensor context_out = dest.at(kContext, {s.tokens, o.hidden}, dtype);
  auto [out, lse] = attention_fwd(q, k, v, mask, self && o.causal, o.attn_dropout, o.scale, rng, bits,
                                  context_out ? OptTensor(split(*context_out, s, o)) : std::nullopt,
                                  dest.at(kLse, {s.batch, o.heads, s.q_len}, at::kFloat));
  // out is a [b, h, lq, d] view of a contiguous [b, lq, h, d] buffer: the merged-heads context, no copy
  at::Tensor context = strided_view(out, {s.tokens, o.hidden}, {o.hidden, 1}, out.storage_offset());
  slots[kCoreInput] = x;
  slots[kProjection] = projection;
  slots[kContext] = context;
  slots[kLse] = lse;
  if (!self) {
    slots[kKeys] = k;
    slots[kValues] = v;
  }
  if (mask) slots[kMask] = *mask;
  if (bits) slots[kBits] = *bits;
  return matmul_t(context, p.weight_out, out_core);
}

// The FFN core, as attention_core_fwd.
at::Tensor ffn_fwd(const at::Tensor& x, const Params& p, const Options& o, const Shape& s, at::Tensor* slots,
                   PhiloxTuple& rng, const Destinations& dest, const OptTensor& out_core) {
  const bool relu = keeps_relu_output(o);
  const at::ScalarType dtype = x.scalar_type();
  // gated: the input bias in the GEMM's epilogue, then the glu kernel on [gate | up]
  const OptTensor projection_out = dest.at(kProjection, {s.tokens, o.ffn_in}, dtype);
  at::Tensor pre_activation = o.glu ? project(x, p.weight_in, p.bias_in, projection_out)
                                    : matmul_t(x, p.weight_in, projection_out);
  rng = draw(o.act_dropout);
  const OptTensor hidden_out = dest.at(kHidden, {s.tokens, o.ffn}, dtype);
  at::Tensor hidden =
      o.glu ? glu_fwd_into(pre_activation, o, rng, hidden_out)
            : bias_act_dropout_fwd(pre_activation, opt(p.bias_in), o.act, o.act_dropout, rng, hidden_out);
  slots[kCoreInput] = x;
  if (relu) {  // relu's derivative is read off its output: keep that, not the GEMM output
    slots[kHidden] = hidden;
  } else {
    slots[kProjection] = pre_activation;
    if (!o.recompute) slots[kHidden] = hidden;
  }
  return matmul_t(hidden, p.weight_out, out_core);
}

// The next block's norm, made by a pre-norm block with its residual add (add_and_norm): the next block's
// parameters, where its norm output and statistics go (as its own norm_fwd would put them), and the result.
struct NextNorm {
  const Params& params;
  OptTensor normed, mean, rstd;
  std::array<at::Tensor, 3>& norm;
};

// residual [tokens, hidden] → the block's output (into `output` when given: where the next block saves it);
// fills the block's slots and its two Philox states. The core's output GEMM writes where the residual sum
// goes, and the bias, dropout and residual add happen there in place: no buffer for the core's output.
// given_norm: this block's norm of residual, made by the block before (NextNorm), or null; next: the next block's
// norm to make with the residual add, or null.
at::Tensor block_fwd(Kind kind, const at::Tensor& residual, const Params& p, const Options& o, const Shape& s,
                     const Inputs& in, at::Tensor* slots, PhiloxTuple* rngs, const Destinations& dest,
                     const OptTensor& output, const std::array<at::Tensor, 3>* given_norm, const NextNorm* next) {
  auto core = [&](const at::Tensor& x, const OptTensor& out_core) {
    return kind == Kind::Ffn ? ffn_fwd(x, p, o, s, slots, rngs[0], dest, out_core)
                             : attention_core_fwd(kind, x, p, o, s, in, slots, rngs[0], dest, out_core);
  };
  const at::ScalarType dtype = residual.scalar_type();
  const OptTensor mean = dest.at(kMean, {s.tokens}, at::kFloat), rstd = dest.at(kRstd, {s.tokens}, at::kFloat);
  if (o.pre_ln) {
    const OptTensor normed = dest.at(kCoreInput, {s.tokens, o.hidden}, dtype);
    const auto norm = given_norm ? *given_norm : norm_fwd(residual, p, o, normed, mean, rstd);
    const at::Tensor out = output ? *output : at::empty({s.tokens, o.hidden}, residual.options());
    const at::Tensor out_core = core(norm[0], out);  // written into out
    rngs[1] = draw(o.dropout);
    if (next) {  // out = residual + dropout(out_core + bias), and the next block's norm of it, in one kernel
      const AddNorm add{residual, p.bias_out, o.dropout, rngs[1]};
      next->norm = norm_fwd(out_core, next->params, o, next->normed, next->mean, next->rstd, &add);
    } else {
      bias_dropout_residual_fwd(out_core, opt(p.bias_out), residual, o.dropout, rngs[1], out);
    }
    slots[kNormX] = residual;
    slots[kMean] = norm[1];
    slots[kRstd] = norm[2];
    if (o.recompute) {  // backward recomputes the norm's output from the block's input instead
      slots[kCoreInput] = at::Tensor();
      slots[kInput] = residual;
    }
    return out;
  }
  const OptTensor sum = dest.at(kNormX, {s.tokens, o.hidden}, dtype);
  const at::Tensor out_core = core(residual, sum);
  rngs[1] = draw(o.dropout);
  // the bias, dropout, residual add and the norm in one kernel where they can be (add_and_norm), the sum over
  // out_core
  const bool fused = add_and_norm(p, p, dtype);
  const at::Tensor summed =
      fused ? out_core : bias_dropout_residual_fwd(out_core, opt(p.bias_out), residual, o.dropout, rngs[1], sum);
  const AddNorm add{residual, p.bias_out, o.dropout, rngs[1]};
  const auto norm = norm_fwd(summed, p, o, output, mean, rstd, fused ? &add : nullptr);
  slots[kNormX] = summed;
  slots[kMean] = norm[1];
  slots[kRstd] = norm[2];
  return norm[0];
}

// params: the blocks' parameters with the GEMM weights in x's dtype. Every saved tensor is written where the
// plan puts it in `state`; returns y and the dropout states.
std::tuple<at::Tensor, std::vector<PhiloxTuple>> layer_fwd_impl(const Options& o, const at::Tensor& x,
                                                                 const Inputs& in, const Tensors& params,
                                                                 const at::Tensor& state,
                                                                 const Plan<int64_t>& plan) {
  const char* op = "lsmini::layer";
  const size_t blocks = o.kinds.size();
  const Shape s{x.size(0), x.size(1), x.size(0) * x.size(1), params[0].scalar_type()};
  Tensors saved(blocks * kSlots);
  std::vector<PhiloxTuple> rngs(blocks * 2, kNoRng);
  at::Tensor residual = x.view({s.tokens, o.hidden});
  auto params_of = [&](size_t i) { return block_params(params, i, dtype_of(params[i * kParamsPerBlock + 1]), o); };
  // a pre-norm block's norm made by the block before it, with that block's residual add (add_and_norm)
  std::array<at::Tensor, 3> made_norm;
  bool norm_made = false;
  for (size_t i = 0; i < blocks; ++i) {
    const Params p = params_of(i);
    // a block's output is the next block's input, which that block saves as its norm input (pre-norm) or its
    // core's input (post-norm)
    const Destinations next_dest(state, plan, (i + 1) * kSlots);
    const OptTensor output =
        i + 1 < blocks ? next_dest.at(o.pre_ln ? kNormX : kCoreInput, {s.tokens, o.hidden}, x.scalar_type())
                       : std::nullopt;
    const std::array<at::Tensor, 3> given = made_norm;
    std::optional<Params> next_params;
    if (o.pre_ln && i + 1 < blocks) next_params.emplace(params_of(i + 1));
    const bool make_next = next_params && add_and_norm(p, *next_params, x.scalar_type());
    std::optional<NextNorm> next;
    if (make_next) {  // where the next block's own norm_fwd would put its output and statistics
      next.emplace(NextNorm{*next_params, next_dest.at(kCoreInput, {s.tokens, o.hidden}, x.scalar_type()),
                            next_dest.at(kMean, {s.tokens}, at::kFloat), next_dest.at(kRstd, {s.tokens}, at::kFloat),
                            made_norm});
    }
    residual = block_fwd(o.kinds[i], residual, p, o, s, in, saved.data() + i * kSlots, rngs.data() + i * 2,
                         Destinations(state, plan, i * kSlots), output, norm_made ? &given : nullptr,
                         next ? &*next : nullptr);
    norm_made = make_next;
  }
  // every tensor backward rebuilds from the plan is where the plan puts it (else backward would read garbage)
  for (size_t i = 0; i < saved.size(); ++i) {
    const SlotPlan<int64_t>& slot = plan.slots[i];
    const bool ok = slot.kind == Layout::None ? !saved[i].defined()
                    : slot.kind != Layout::New
                        ? saved[i].defined()
                        : saved[i].defined() && saved[i].sizes() == at::IntArrayRef(slot.shape) &&
                              saved[i].scalar_type() == slot.dtype &&
                              static_cast<const char*>(saved[i].data_ptr()) ==
                                  static_cast<const char*>(state.data_ptr()) + plan.offsets[i];
    LSMINI_CHECK(ok, op, ": saved slot ", int64_t(i), " does not match the plan");
  }
  return {residual.view({s.batch, s.q_len, o.hidden}), rngs};
}

// ---- backward --------------------------------------------------------------------------------------------
// The saved slots of one block, as the plan rebuilds them (None → undefined).
struct Slots {
  const OptTensor* s;
  const at::Tensor& operator[](int i) const {
    static const at::Tensor undefined;
    return s[i] ? *s[i] : undefined;
  }
};

// The float32 regions of the backward's column partial sums (workspace_numel), handed out one per call in
// order, and the second passes of those sums, queued there for one launch at the end of the backward.
struct Partials {
  at::Tensor buffer;
  int64_t used = 0;
  ColumnSums sums{};
};

// Where one block's backward puts things: regions of the scratch for its temporaries (the file's comment),
// the float32 workspace for the attention backward's row terms, the column partial sums' regions, and its six
// parameter gradients' destinations.
struct Room {
  const at::Tensor& scratch;
  const at::Tensor& workspace;
  const GradDest* dest;
  Partials& partials;
  const GradDest* qk_dest;  // the self block with qk_norm: its Q and K norm weights' gradients' (else null)
  // The destination of the vector gradient at `position` (of the Q / K norm weight: qk_vector(0 / 1, ...)) when a
  // kernel computing it in `dtype` can write it there itself: a write, not an add, of that dtype. Else none (the
  // gradient is made and moved at the end).
  static OptTensor written(const GradDest& d, at::ScalarType dtype) {
    return d.tensor && !d.add && d.tensor->scalar_type() == dtype ? d.tensor : std::nullopt;
  }
  OptTensor vector(int position, at::ScalarType dtype) const { return written(dest[position], dtype); }
  OptTensor qk_vector(int which, at::ScalarType dtype) const { return written(qk_dest[which], dtype); }
  // The attention backward's room: its row terms at the workspace's start.
  BackwardRoom attention() const { return {std::nullopt, std::nullopt, workspace}; }
  // The room of a call whose column partial sums take `numel` floats: a region of their own, in use until the
  // queued second pass has read it at the end of the backward.
  BackwardRoom summed(OptTensor weight, OptTensor bias, int64_t numel) const {
    const int64_t at = partials.used;
    partials.used += align(numel);
    LSMINI_CHECK(partials.used <= partials.buffer.numel(), "lsmini::layer_backward: the column partial sums need ",
                 partials.used, " floats of room, the plan gave ", partials.buffer.numel());
    return {std::move(weight), std::move(bias),
            strided_view(partials.buffer, {numel}, {1}, partials.buffer.storage_offset() + at), &partials.sums};
  }
};

at::Tensor bias_grad(const at::Tensor& grad2d, at::ScalarType dtype, const BackwardRoom& room) {
  return *std::get<1>(bias_dropout_residual_bwd(grad2d, 0.0, kNoRng, true, dtype, std::nullopt, room));
}

// The gradient of an input bias added in its GEMM's epilogue, from the GEMM output's gradient: in the parameter's
// dtype where the column-sum kernel writes that (float32), else in the gradient's; undefined for an absent bias.
at::Tensor epilogue_bias_grad(const at::Tensor& grad2d, const Params& p, const Room& room) {
  if (!p.bias_in.defined()) return at::Tensor();
  const at::ScalarType dtype = p.bias_in_dtype == at::kFloat ? at::kFloat : grad2d.scalar_type();
  const int64_t partials = bias_partials(grad2d.size(0), grad2d.size(1), false);
  return bias_grad(grad2d, dtype, room.summed(std::nullopt, room.vector(1, dtype), partials));
}

// The norm's backward from dy: (dx, dweight, dbias), dx = the input gradient (+ add when given), into out when
// given (out may be add); dweight / dbias where the room names them, undefined where absent. The norm's input x
// and statistics as the forward saved them.
std::array<at::Tensor, 3> norm_bwd(const at::Tensor& dy, const Slots& sv, const Params& p, const Options& o,
                                   const OptTensor& add, const OptTensor& out, const Room& room) {
  const at::ScalarType w_dtype = dtype_of(p.norm_weight);
  if (!o.rms) {
    const auto r = layernorm_bwd(dy, sv[kNormX], opt(p.norm_weight), opt(p.norm_bias), sv[kMean], sv[kRstd], add, out,
                                 room.summed(room.vector(4, w_dtype), room.vector(5, dtype_of(p.norm_bias)),
                                             p.norm_weight.defined() || p.norm_bias.defined()
                                                 ? norm_partials(o, dy.size(0))
                                                 : 0));
    return {*r[0], r[1].value_or(at::Tensor()), r[2].value_or(at::Tensor())};
  }
  const char* op = "lsmini::layer_backward";
  const at::Tensor& x = sv[kNormX];
  const at::Tensor dx = out ? *out : at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor dweight;
  if (p.norm_weight.defined()) {
    const OptTensor given = room.vector(4, w_dtype);
    dweight = given ? *given : at::empty({o.hidden}, p.norm_weight.options());
  }
  const BackwardRoom sums =
      room.summed(std::nullopt, std::nullopt, dweight.defined() ? norm_partials(o, x.size(0)) : 0);
  dispatch_norm_types(x.scalar_type(), p.norm_weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    check_launch(launch_rms_norm_bwd<T, W>(ptr<const T>(dy), ptr<const T>(x),
                                           dweight.defined() ? ptr<const W>(p.norm_weight) : nullptr,
                                           ptr<const float>(sv[kRstd]), add ? ptr<const T>(*add) : nullptr, ptr<T>(dx),
                                           dweight.defined() ? ptr<W>(dweight) : nullptr,
                                           dweight.defined() ? ptr<float>(*sums.workspace) : nullptr, x.size(0),
                                           int(x.size(1)), sums.sums, current_stream()),
                 op);
  });
  return {dx, dweight, at::Tensor()};
}

// The backward of qk_norm_fwd (its rotation included) on a self block's projection gradient [tokens, H + 2W], in
// place on its Q and K columns, from the saved raw Q and K; returns the gradients of the Q and K norm weights
// (written where the room names their destinations, else new), their column sums queued with the backward's others.
std::array<at::Tensor, 2> qk_norm_bwd(const at::Tensor& grad_projection, const at::Tensor& raw, const Params& p,
                                      const Options& o, const QkRotary& rotary, const Room& room) {
  const char* op = "lsmini::layer_backward";
  const int64_t tokens = grad_projection.size(0);
  std::array<at::Tensor, 2> grads;
  for (const int k : {0, 1}) {
    const at::Tensor& w = k ? *p.k_norm_weight : *p.q_norm_weight;
    const OptTensor given = room.qk_vector(k, w.scalar_type());
    grads[k] = given ? *given : at::empty({o.head_dim}, w.options());
  }
  dispatch_norm_types(grad_projection.scalar_type(), *p.q_norm_weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    for (const int k : {0, 1}) {
      const int64_t heads = k ? o.kv_heads : o.heads;
      const BackwardRoom sums =
          room.summed(std::nullopt, std::nullopt, qk_norm_bwd_partial_rows(tokens * heads) * o.head_dim);
      check_launch(launch_qk_norm_bwd<T, W>(ptr<T>(grad_projection) + (k ? o.hidden : 0), grad_projection.stride(0),
                                            ptr<const T>(raw) + (k ? tokens * o.hidden : 0),
                                            ptr<const W>(k ? *p.k_norm_weight : *p.q_norm_weight), ptr<W>(grads[k]),
                                            ptr<float>(*sums.workspace), tokens, int(heads), int(o.head_dim),
                                            float(o.eps), rotary, sums.sums, current_stream()),
                   op);
    }
  });
  return grads;
}

// d input = grad·weight, added by the GEMM into accumulate when given (beta = 1: post-norm's residual path,
// no separate add), else into out.
at::Tensor input_grad(const at::Tensor& grad, const at::Tensor& weight, const OptTensor& accumulate,
                      const OptTensor& out) {
  if (accumulate) {
    at::Tensor dst = *accumulate;
    return at::addmm_out(dst, dst, grad, weight);
  }
  if (out) {
    at::Tensor dst = *out;
    return at::mm_out(dst, grad, weight);
  }
  return at::mm(grad, weight);
}

// Backward of an attention core: (d input, d weight_in, d bias_in, d weight_out); qk_grads: those of the Q and K
// norm weights (qk_norm). kv_grads: a cross block's dK/dV destinations. input_of(out): the core's input (recomputed
// into out, or saved). accumulate: where d input is added (input_grad), read by nothing else before.
template <typename InputOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_core_bwd(
    Kind kind, const at::Tensor& grad_core, const Params& p, const Slots& sv, const PhiloxTuple& rng,
    const Options& o, const Shape& s, const Room& room, const InputOf& input_of,
    const std::pair<OptTensor, OptTensor>& kv_grads, const Inputs& in, const OptTensor& accumulate,
    std::array<at::Tensor, 2>& qk_grads) {
  const bool self = kind == Kind::Self;
  const int64_t t = s.tokens;
  const at::Tensor& scratch = room.scratch;
  at::Tensor grad_weight_out = weight_grad(transposed(grad_core), sv[kContext], s.weight_dtype, room.dest[2]);
  at::Tensor grad_context = region(scratch, 0, t, o.hidden);
  at::mm_out(grad_context, grad_core, p.weight_out);
  at::Tensor grad_projection = region(scratch, align(t * o.hidden), t, self ? o.qkv_width : o.hidden);
  auto given = [&](int slot) { return sv[slot].defined() ? OptTensor(sv[slot]) : std::nullopt; };
  const OptTensor mask = given(kMask), bits = given(kBits);
  const BackwardRoom workspace = room.attention();
  if (self) {
    const auto qkv = qkv_views(sv[kProjection], s.batch, s.q_len, o);
    const auto grad_qkv = qkv_views(grad_projection, s.batch, s.q_len, o);
    // with rotary positions (and no qk_norm) the attention backward's dQ and dK stores undo the rotation: the
    // projection's gradients come out of it
    const bool fold_rotary = o.rotary_dim > 0 && !o.qk_norm;
    const RotaryTables tables = fold_rotary ? RotaryTables{*in.rotary_cos, *in.rotary_sin} : RotaryTables{};
    attention_bwd(split(grad_context, s, o), qkv[0], qkv[1], qkv[2], split(sv[kContext], s, o), sv[kLse], mask,
                  o.causal, o.attn_dropout, o.scale, rng, grad_qkv[0], grad_qkv[1], grad_qkv[2], bits, workspace,
                  fold_rotary ? &tables : nullptr);
    // the gradients of the rotated and normalized Q and K → those of the projection's
    if (o.qk_norm) qk_grads = qk_norm_bwd(grad_projection, sv[kQKRaw], p, o, qk_rotary(in, o, s.q_len), room);
  } else {
    attention_bwd(split(grad_context, s, o), split(sv[kProjection], s, o), sv[kKeys], sv[kValues],
                  split(sv[kContext], s, o), sv[kLse], mask, false, o.attn_dropout, o.scale, rng,
                  split(grad_projection, s, o), kv_grads.first, kv_grads.second, bits, workspace);
  }
  at::Tensor grad_bias_in = epilogue_bias_grad(grad_projection, p, room);
  // d(context) is dead once the attention backward has read it: the recomputed input may go there
  at::Tensor grad_weight_in = weight_grad(transposed(grad_projection), input_of(region(scratch, 0, t, o.hidden)),
                                          s.weight_dtype, room.dest[0]);
  // so is a recomputed input, once that GEMM read it
  const at::Tensor grad_input = input_grad(grad_projection, p.weight_in, accumulate, region(scratch, 0, t, o.hidden));
  return {grad_input, grad_weight_in, grad_bias_in, grad_weight_out};
}

template <typename InputOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ffn_bwd(const at::Tensor& grad_core, const Params& p,
                                                                   const Slots& sv, const PhiloxTuple& rng,
                                                                   const Options& o, const Shape& s,
                                                                   const Room& room, const InputOf& input_of,
                                                                   const OptTensor& accumulate) {
  // The scratch holds the activation (recomputed, unless kept), then its gradient, then (in place) the gradient
  // of the first GEMM's output. The [t, H] temporaries are fresh: that keeps the scratch at t·F, and they are
  // freed before the attention blocks' backward, where a layer's memory peaks.
  at::Tensor act_region = region(room.scratch, 0, s.tokens, o.ffn);
  const bool relu = keeps_relu_output(o);
  at::Tensor hidden = sv[kHidden];
  if (!hidden.defined()) {  // recompute the activation from its saved input, same dropout mask
    hidden = o.glu ? glu_fwd_into(sv[kProjection], o, rng, act_region)
                   : bias_act_dropout_fwd(sv[kProjection], opt(p.bias_in), o.act, o.act_dropout, rng, act_region);
  }
  at::Tensor grad_weight_out = weight_grad(transposed(grad_core), hidden, s.weight_dtype, room.dest[2]);
  hidden.reset();
  at::mm_out(act_region, grad_core, p.weight_out);
  at::Tensor grad_pre, grad_bias_in;  // the gradients of the first GEMM's output and of its bias
  if (o.glu) {  // [gate | up]'s gradient after the activation's, then the bias's (added in the GEMM's epilogue)
    grad_pre = region(room.scratch, align(s.tokens * o.ffn), s.tokens, o.ffn_in);
    glu_bwd_into(act_region, sv[kProjection], o, rng, grad_pre);
    grad_bias_in = epilogue_bias_grad(grad_pre, p, room);
  } else {
    const BackwardRoom bias_room = room.summed(std::nullopt, room.vector(1, dtype_of(p.bias_in)),
                                               p.bias_in.defined() ? bias_partials(s.tokens, o.ffn, true) : 0);
    auto [grad_hidden, grad_bias] =
        relu ? bias_act_dropout_bwd(act_region, sv[kHidden], opt(p.bias_in), o.act, o.act_dropout, kNoRng, act_region,
                                    true, bias_room)
             : bias_act_dropout_bwd(act_region, sv[kProjection], opt(p.bias_in), o.act, o.act_dropout, rng, act_region,
                                    false, bias_room);
    grad_pre = grad_hidden;
    grad_bias_in = grad_bias.value_or(at::Tensor());
  }
  at::Tensor grad_weight_in = weight_grad(transposed(grad_pre), input_of(std::nullopt), s.weight_dtype, room.dest[0]);
  return {input_grad(grad_pre, p.weight_in, accumulate, std::nullopt), grad_weight_in, grad_bias_in, grad_weight_out};
}

struct Gradients {  // of one block: its input, its six parameters and (the self block with qk_norm) the Q/K norms'
  at::Tensor input, weight_in, bias_in, weight_out, bias_out, norm_weight, norm_bias;
  std::array<at::Tensor, 2> qk_norm;
};

// grad: the gradient of the block output; grad_is_ours: it is this backward's own tensor, which may become
// the result (else it is not modified). room.dest: where its six parameter gradients go.
Gradients block_bwd(Kind kind, const at::Tensor& grad, const Params& p, const Slots& sv, const PhiloxTuple* rngs,
                    const Options& o, const Shape& s, const Room& room, bool grad_is_ours,
                    const std::pair<OptTensor, OptTensor>& kv_grads, const Inputs& in) {
  // An attention core's output gradient goes into its projection-gradient region, not written before it is dead.
  const OptTensor grad_core_out =
      kind == Kind::Ffn ? std::nullopt
                        : OptTensor(region(room.scratch, align(s.tokens * o.hidden), s.tokens, o.hidden));
  Gradients g;
  auto core = [&](const at::Tensor& grad_core, auto input_of, const OptTensor& accumulate) {
    return kind == Kind::Ffn ? ffn_bwd(grad_core, p, sv, rngs[0], o, s, room, input_of, accumulate)
                             : attention_core_bwd(kind, grad_core, p, sv, rngs[0], o, s, room, input_of, kv_grads, in,
                                                  accumulate, g.qk_norm);
  };
  const bool has_bias_out = p.bias_out.defined();
  const std::optional<at::ScalarType> bias_out_dtype =
      has_bias_out ? std::optional<at::ScalarType>(p.bias_out.scalar_type()) : std::nullopt;
  const BackwardRoom bias_out_room = room.summed(std::nullopt, room.vector(3, dtype_of(p.bias_out)),
                                                 has_bias_out ? bias_partials(s.tokens, o.hidden, false) : 0);
  if (o.pre_ln) {
    // the core's input: saved, or norm(block input) recomputed when the core needs it
    auto input_of = [&](const OptTensor& out) {
      if (sv[kCoreInput].defined()) return sv[kCoreInput];
      return norm_fwd(sv[kInput], p, o, out)[0];
    };
    auto [grad_core, grad_bias_out] =
        bias_dropout_residual_bwd(grad, o.dropout, rngs[1], has_bias_out, bias_out_dtype, grad_core_out, bias_out_room);
    g.bias_out = grad_bias_out.value_or(at::Tensor());
    at::Tensor grad_x;
    std::tie(grad_x, g.weight_in, g.bias_in, g.weight_out) = core(grad_core, input_of, std::nullopt);
    // the residual path: grad added to the norm's input gradient in the same kernel, into grad when it is ours
    std::tie(g.input, g.norm_weight, g.norm_bias) =
        std::tuple_cat(norm_bwd(grad_x, sv, p, o, grad, grad_is_ours ? OptTensor(grad) : std::nullopt, room));
    return g;
  }
  std::tie(g.input, g.norm_weight, g.norm_bias) =
      std::tuple_cat(norm_bwd(grad, sv, p, o, std::nullopt, std::nullopt, room));
  // without dropout grad_core IS g.input; the core has finished reading it before its last GEMM adds the core
  // input's gradient there (the residual path's sum)
  auto [grad_core, grad_bias_out] = bias_dropout_residual_bwd(g.input, o.dropout, rngs[1], has_bias_out,
                                                              bias_out_dtype, grad_core_out, bias_out_room);
  g.bias_out = grad_bias_out.value_or(at::Tensor());
  auto saved_input = [&](const OptTensor&) { return sv[kCoreInput]; };
  std::tie(std::ignore, g.weight_in, g.bias_in, g.weight_out) = core(grad_core, saved_input, g.input);
  return g;
}

// The whole backward: the gradient of x, and per parameter its gradient (undefined where dest[i] took it).
std::tuple<at::Tensor, Tensors> layer_bwd_impl(const Options& o, const at::Tensor& grad_in,
                                               const std::vector<OptTensor>& saved,
                                               const std::vector<PhiloxTuple>& rngs, const Tensors& params,
                                               const at::Tensor& scratch, const at::Tensor& workspace,
                                               const OptTensor& grad_encoder_k, const OptTensor& grad_encoder_v,
                                               at::ScalarType weight_dtype,
                                               const std::vector<at::ScalarType>& param_dtypes,
                                               const std::vector<GradDest>& dest, const Inputs& in) {
  const size_t blocks = o.kinds.size();
  const Shape s{grad_in.size(0), grad_in.size(1), grad_in.size(0) * grad_in.size(1), weight_dtype};
  at::Tensor g = grad_in.view({s.tokens, o.hidden});
  // the workspace: the attention backward's row terms, then the column partial sums (workspace_numel)
  const int64_t row_terms = align(s.batch * o.heads * s.q_len);
  const at::Tensor attention_room = strided_view(workspace, {row_terms}, {1}, workspace.storage_offset());
  Partials partials{
      strided_view(workspace, {workspace.numel() - row_terms}, {1}, workspace.storage_offset() + row_terms)};
  Tensors param_grads(params.size());
  for (size_t i = blocks; i-- > 0;) {
    const bool ours = i < blocks - 1;  // the incoming gradient is autograd's, the others ours
    const std::pair<OptTensor, OptTensor> kv_grads = o.kinds[i] == Kind::Cross
                                                         ? std::make_pair(grad_encoder_k, grad_encoder_v)
                                                         : std::make_pair(OptTensor(), OptTensor());
    const bool qk = o.qk_norm && o.kinds[i] == Kind::Self;
    const Room room{scratch, attention_room, dest.data() + i * kParamsPerBlock, partials,
                    qk ? dest.data() + block_param_count(o) : nullptr};
    Gradients r = block_bwd(o.kinds[i], g, block_params(params, i, param_dtypes[i * kParamsPerBlock + 1], o),
                            Slots{saved.data() + i * kSlots}, rngs.data() + i * 2, o, s, room, ours, kv_grads, in);
    g = r.input;
    at::Tensor* out = param_grads.data() + i * kParamsPerBlock;
    out[0] = r.weight_in;
    out[1] = r.bias_in;
    out[2] = r.weight_out;
    out[3] = r.bias_out;
    out[4] = r.norm_weight;
    out[5] = r.norm_bias;
    if (qk) {
      param_grads[block_param_count(o)] = r.qk_norm[0];
      param_grads[block_param_count(o) + 1] = r.qk_norm[1];
    }
  }
  // the second passes of every column sum above, in one launch: the vectors' gradients are complete after it
  check_launch(launch_column_sums(partials.sums, current_stream()), "lsmini::layer_backward");
  // The vectors' gradients the kernels did not write into their destinations themselves: there in one
  // multi-tensor add and one copy (the GEMM weights' went there already), else returned in their parameters'
  // dtypes.
  Tensors add_to, added, copy_to, copied;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& pg = param_grads[i];
    if (!pg.defined()) continue;
    if (dest[i].tensor && pg.is_same(*dest[i].tensor)) {  // written in place
      pg = at::Tensor();
      continue;
    }
    if (pg.scalar_type() != param_dtypes[i]) pg = pg.to(param_dtypes[i]);
    if (dest[i].tensor) {
      (dest[i].add ? add_to : copy_to).push_back(*dest[i].tensor);
      (dest[i].add ? added : copied).push_back(pg);
      pg = at::Tensor();
    }
  }
  if (!add_to.empty()) at::_foreach_add_(add_to, added);
  if (!copy_to.empty()) at::_foreach_copy_(copy_to, copied);
  return {g.view({s.batch, s.q_len, o.hidden}), param_grads};
}

// ---- the operators ---------------------------------------------------------------------------------------
// Converts the contiguous sources of one dtype into their copies in one launch per kCastSegments.
void cast_copies(const Tensors& copies, const Tensors& sources, at::ScalarType source_dtype) {
  CastSegments segments{};
  auto flush = [&] {
    if (segments.count == 0) return;
    cudaError_t err = cudaErrorInvalidValue;
    const cudaStream_t stream = current_stream();
    dispatch_float(source_dtype, "lsmini::layer", [&](auto src_tag) {
      using S = typename KernelType<decltype(src_tag)>::type;
      if (copies[0].scalar_type() == at::kHalf) {
        if constexpr (!std::is_same_v<S, __half>) err = launch_cast_segments<S, __half>(segments, stream);
      } else if constexpr (!std::is_same_v<S, __nv_bfloat16>) {
        err = launch_cast_segments<S, __nv_bfloat16>(segments, stream);
      }
    });
    check_launch(err, "lsmini::layer");
    segments.count = 0;
  };
  for (size_t j = 0; j < copies.size(); ++j) {
    if (sources[j].scalar_type() != source_dtype) continue;
    segments.src[segments.count] = sources[j].data_ptr();
    segments.dst[segments.count] = copies[j].data_ptr();
    segments.numel[segments.count] = sources[j].numel();
    if (++segments.count == kCastSegments) flush();
  }
  flush();
}

// params with the GEMM weights (and attention input biases) the plan casts replaced by their copies in the
// state's tail, written there when `cast` (forward; backward reads them): one launch per source dtype.
Tensors cast_weights(at::TensorList params, const at::Tensor& state, const Plan<int64_t>& plan,
                     at::ScalarType dtype, bool cast) {
  Tensors weights(params.begin(), params.end());
  if (plan.cast_positions.empty()) return weights;
  const int64_t item = int64_t(c10::elementSize(dtype));
  Tensors copies, sources;
  for (size_t j = 0; j < plan.cast_positions.size(); ++j) {
    const at::Tensor& p = params[plan.cast_positions[j]];
    at::Tensor copy = carve_like(state, plan.cast_at + plan.cast_at_elements[j] * item, dtype, p, "lsmini::layer");
    weights[plan.cast_positions[j]] = copy;
    const bool kernel = (p.is_contiguous() || transposed_layout(p)) &&
                        (p.scalar_type() == at::kFloat || p.scalar_type() == at::kHalf ||
                         p.scalar_type() == at::kBFloat16);
    if (cast && !kernel) copy.copy_(p);  // another strided view or dtype: rare, converted on its own
    if (cast && kernel) {
      copies.push_back(std::move(copy));
      sources.push_back(p);
    }
  }
  for (const at::ScalarType source_dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    cast_copies(copies, sources, source_dtype);
  }
  return weights;
}

at::Tensor rng_rows(const at::Tensor& state, const Plan<int64_t>& plan, int64_t rows) {
  return carve(state, plan.rng_at, at::kLong, {rows, 2}, "lsmini::layer");
}

// Both operators' checks of the inputs (the CUDA and the Meta implementations alike).
void check_inputs(const Options& o, const at::Tensor& x, const OptTensor& key_padding_mask,
                  const OptTensor& encoder_k, const OptTensor& encoder_v, const OptTensor& encoder_padding_mask,
                  at::TensorList params, const OptTensor& rotary_cos, const OptTensor& rotary_sin, const char* op) {
  const size_t blocks = o.kinds.size();
  LSMINI_CHECK(x.dim() == 3 && x.size(2) == o.hidden && x.is_contiguous(), op,
               ": x must be a contiguous [batch, len, hidden=", o.hidden, "] tensor, got shape ", x.sizes());
  LSMINI_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16, op,
               ": x must be float16 or bfloat16 (the fused attention's dtypes), got ", x.scalar_type());
  LSMINI_CHECK(params.size() == param_count(o), op, ": expected ", int64_t(param_count(o)), " parameters for ",
               int64_t(blocks), " blocks", o.qk_norm ? " and the Q and K norm weights" : "", ", got ",
               int64_t(params.size()));
  for (size_t i = block_param_count(o); i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& q = params[block_param_count(o)];
    LSMINI_CHECK(p.defined() && p.sizes() == at::IntArrayRef({o.head_dim}) && p.device() == x.device() &&
                     p.is_floating_point() && p.scalar_type() == q.scalar_type(),
                 op, ": params[", int64_t(i), "] (the ", i == block_param_count(o) ? "Q" : "K",
                 " norm weight) must be a [head_dim=", o.head_dim, "] floating tensor on ", x.device(),
                 ", of the Q norm weight's dtype, got ", p.defined() ? p.sizes() : at::IntArrayRef({}));
  }
  for (size_t i = 0; i < block_param_count(o); ++i) {
    const at::Tensor& p = params[i];
    const int64_t block = int64_t(i) / kParamsPerBlock, position = int64_t(i) % kParamsPerBlock;
    // the GEMM weights and the norm weight are required; the biases may be absent, RMSNorm's is
    const bool optional = position == 1 || position == 3 || position == 5;
    LSMINI_CHECK(p.defined() || optional, op, ": params[", int64_t(i), "] (block ", block, ", parameter ", position,
                 ") must be given: only the biases (parameters 1, 3 and 5 of a block) may be None");
    LSMINI_CHECK(!(o.rms && position == 5 && p.defined()), op, ": params[", int64_t(i), "] (block ", block,
                 ", norm_bias) must be None with norm rms_norm (RMSNorm has no bias)");
    if (!p.defined()) continue;
    const Kind kind = o.kinds[block];
    const int64_t rows_in = kind == Kind::Self ? o.qkv_width : kind == Kind::Cross ? o.hidden : o.ffn_in;
    std::vector<int64_t> want;
    switch (position) {
      case 0: want = {rows_in, o.hidden}; break;
      case 1: want = {rows_in}; break;
      case 2: want = {o.hidden, kind == Kind::Ffn ? o.ffn : o.hidden}; break;
      default: want = {o.hidden};
    }
    LSMINI_CHECK(p.sizes() == at::IntArrayRef(want) && p.device() == x.device() && p.is_floating_point(), op,
                 ": params[", int64_t(i), "] (block ", block, ", parameter ", position, ") must be a ",
                 at::IntArrayRef(want), " floating tensor on ", x.device(), ", got ", p.sizes(), " on ", p.device());
  }
  bool cross = false;
  for (const Kind k : o.kinds) cross = cross || k == Kind::Cross;
  LSMINI_CHECK(cross == encoder_k.has_value() && cross == encoder_v.has_value(), op,
               cross ? ": a cross-attention block needs encoder_k and encoder_v"
                     : ": encoder_k / encoder_v given to a layer without a cross-attention block");
  if (cross) {
    LSMINI_CHECK(encoder_k->dim() == 3 && encoder_k->size(0) == x.size(0) && encoder_k->size(2) == o.kv_width &&
                     encoder_v->sizes() == encoder_k->sizes() && encoder_k->stride(2) == 1 &&
                     encoder_v->stride(2) == 1 && encoder_k->scalar_type() == x.scalar_type() &&
                     encoder_v->scalar_type() == x.scalar_type(),
                 op, ": encoder_k and encoder_v must both be [batch=", x.size(0), ", src_len, kv_heads·head_dim=",
                 o.kv_width, "] in x's dtype with unit column stride, got ", encoder_k->sizes(), " and ",
                 encoder_v->sizes());
  }
  LSMINI_CHECK(rotary_cos.has_value() == (o.rotary_dim > 0) && rotary_sin.has_value() == (o.rotary_dim > 0), op,
               o.rotary_dim > 0 ? ": rotary_dim > 0 needs both rotary_cos and rotary_sin"
                                : ": rotary_cos / rotary_sin given with rotary_dim 0");
  for (const auto* t : {&rotary_cos, &rotary_sin}) {
    if (!t->has_value()) continue;
    const at::Tensor& c = **t;
    const bool per_batch = c.dim() == 3;
    LSMINI_CHECK(c.scalar_type() == at::kFloat && c.device() == x.device() && (c.dim() == 2 || per_batch) &&
                     (!per_batch || c.size(0) == x.size(0)) && c.size(c.dim() - 2) == x.size(1) &&
                     c.size(c.dim() - 1) == o.rotary_dim,
                 op, ": ", t == &rotary_cos ? "rotary_cos" : "rotary_sin", " must be float32 [len=", x.size(1),
                 ", rotary_dim=", o.rotary_dim, "] or [batch=", x.size(0), ", len, rotary_dim] on ", x.device(),
                 ", got ", c.scalar_type(), " ", c.sizes(), " on ", c.device());
  }
  for (const auto* m : {&key_padding_mask, &encoder_padding_mask}) {
    if (!m->has_value()) continue;
    const int64_t len = m == &key_padding_mask ? x.size(1) : encoder_k ? encoder_k->size(1) : -1;
    LSMINI_CHECK((*m)->scalar_type() == at::kBool && (*m)->dim() == 2 && (*m)->size(0) == x.size(0) &&
                     (*m)->size(1) == len,
                 op, ": ", m == &key_padding_mask ? "key_padding_mask" : "encoder_padding_mask",
                 " must be bool [batch, len] = [", x.size(0), ", ", len, "], got ", (*m)->scalar_type(), " ",
                 (*m)->sizes());
  }
}

// The params list as the schema takes it (Tensor?[]: absent biases are None) → tensors, undefined where None.
Tensors param_list(const c10::List<OptTensor>& params) {
  Tensors out;
  out.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const OptTensor p = params.get(i);
    out.push_back(p ? *p : at::Tensor());
  }
  return out;
}

// A rotary table as the kernel reads it: contiguous [batch or 1, len, rotary_dim].
OptTensor rotary_table(const OptTensor& t) {
  if (!t) return std::nullopt;
  return (t->dim() == 2 ? t->unsqueeze(0) : *t).contiguous();
}

std::vector<bool> into_mask(at::IntArrayRef into_index, at::TensorList into, size_t n, const char* op) {
  LSMINI_CHECK(into_index.size() == into.size(), op, ": into_index and into must have the same length, got ",
               int64_t(into_index.size()), " and ", int64_t(into.size()));
  std::vector<bool> mask(n, false);
  for (const int64_t i : into_index) {
    LSMINI_CHECK(i >= 0 && i < int64_t(n) && !mask[i], op, ": into_index holds ", i,
                 ", not a distinct parameter index in [0, ", int64_t(n), ")");
    mask[i] = true;
  }
  return mask;
}

std::tuple<at::Tensor, at::Tensor> layer_cuda(const at::Tensor& x, const OptTensor& key_padding_mask,
                                              const OptTensor& encoder_k, const OptTensor& encoder_v,
                                              const OptTensor& encoder_padding_mask,
                                              const c10::List<OptTensor>& param_args, LSMINI_LAYER_OPTION_PARAMS,
                                              const OptTensor& rotary_cos, const OptTensor& rotary_sin) {
  const char* op = "lsmini::layer";
  const OpArgs a = LSMINI_LAYER_OPTION_VALUES;
  const Options o = options_of(a, op);
  check_cuda(x, op, "x");
  // the operator runs below autograd (its autograd is the caller's): the ATen calls inside skip it too
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const Tensors params = param_list(param_args);
  check_inputs(o, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, rotary_cos, rotary_sin, op);
  const auto plan = call_plan(a, o, x, key_padding_mask.has_value(), encoder_padding_mask.has_value(),
                              encoder_k ? encoder_k->size(1) : 0, params, std::vector<bool>(params.size(), false));
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor state = at::empty({plan->total}, x.options().dtype(at::kByte));
  const Tensors weights = cast_weights(params, state, *plan, x.scalar_type(), true);
  const Inputs in{key_padding_mask,           heads_of(encoder_k, o),   heads_of(encoder_v, o),
                  encoder_padding_mask,       rotary_table(rotary_cos), rotary_table(rotary_sin)};
  auto [y, rngs] = layer_fwd_impl(o, x, in, weights, state, *plan);
  // the dropout states for the backward; a layer without dropout draws none, and its backward reads none
  if (std::any_of(rngs.begin(), rngs.end(), [](const PhiloxTuple& r) { return r != kNoRng; })) {
    philox_state_fwd(rngs, rng_rows(state, *plan, int64_t(rngs.size())));
  }
  return {y, state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_backward_cuda(
    const at::Tensor& grad, const at::Tensor& state, const at::Tensor& x, const OptTensor& key_padding_mask,
    const OptTensor& encoder_k, const OptTensor& encoder_v, const OptTensor& encoder_padding_mask,
    const c10::List<OptTensor>& param_args, at::IntArrayRef into_index, at::TensorList into,
    at::TensorList kv_into, LSMINI_LAYER_OPTION_PARAMS, const OptTensor& rotary_cos, const OptTensor& rotary_sin) {
  const char* op = "lsmini::layer_backward";
  const OpArgs a = LSMINI_LAYER_OPTION_VALUES;
  const Options o = options_of(a, op);
  check_cuda(grad, op, "grad");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_cuda(state, op, "state");
  check_cuda(x, op, "x");
  const Tensors params = param_list(param_args);
  check_inputs(o, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, rotary_cos, rotary_sin, op);
  LSMINI_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type() && grad.device() == x.device(),
               op, ": grad must be like x (", x.scalar_type(), " ", x.sizes(), "), got ", grad.scalar_type(), " ",
               grad.sizes());
  const std::vector<bool> into_at = into_mask(into_index, into, params.size(), op);
  for (size_t j = 0; j < into.size(); ++j) {
    const at::Tensor& t = into[j];
    const at::Tensor& p = params[into_index[j]];
    LSMINI_CHECK(p.defined(), op, ": into_index holds ", into_index[j], ", an absent (None) parameter");
    LSMINI_CHECK(t.device() == p.device() && t.scalar_type() == p.scalar_type() && t.sizes() == p.sizes() &&
                     t.is_contiguous(),
                 op, ": into[", int64_t(j), "] must be a contiguous ", p.scalar_type(), " ", p.sizes(),
                 " tensor on ", p.device(), " (the .grad of params[", into_index[j], "]), got ", t.scalar_type(),
                 " ", t.sizes());
  }
  LSMINI_CHECK(kv_into.empty() || (encoder_k && kv_into.size() == 2 && kv_into[0].sizes() == encoder_k->sizes() &&
                                    kv_into[1].sizes() == encoder_k->sizes() && kv_into[0].stride(2) == 1 &&
                                    kv_into[1].stride(2) == 1 && kv_into[0].scalar_type() == x.scalar_type() &&
                                    kv_into[1].scalar_type() == x.scalar_type() && kv_into[0].is_cuda() &&
                                    kv_into[1].is_cuda()),
               op, ": kv_into must be empty or two tensors like encoder_k (unit column stride)");
  const auto plan = call_plan(a, o, x, key_padding_mask.has_value(), encoder_padding_mask.has_value(),
                              encoder_k ? encoder_k->size(1) : 0, params, into_at);
  c10::cuda::CUDAGuard guard(grad.device());
  LSMINI_CHECK(state.scalar_type() == at::kByte && state.dim() == 1 && state.is_contiguous() &&
                   state.numel() == plan->total,
               op, ": state must be the contiguous uint8 [", plan->total, "] tensor lsmini::layer returned, got ",
               state.scalar_type(), " ", state.sizes());
  // the saved tensors, rebuilt from the plan: inputs, and the state's bytes as forward wrote them
  const Inputs in{key_padding_mask,           heads_of(encoder_k, o),   heads_of(encoder_v, o),
                  encoder_padding_mask,       rotary_table(rotary_cos), rotary_table(rotary_sin)};
  const OptTensor inputs[] = {x.view({-1, o.hidden}), in.key_padding_mask, in.encoder_k, in.encoder_v,
                              in.encoder_padding_mask};
  std::vector<OptTensor> saved(plan->slots.size());
  for (size_t i = 0; i < saved.size(); ++i) {
    const SlotPlan<int64_t>& slot = plan->slots[i];
    if (slot.kind == Layout::Input) saved[i] = inputs[slot.ref];
    if (slot.kind == Layout::Same) saved[i] = saved[slot.ref];
    if (slot.kind == Layout::New) saved[i] = carve(state, plan->offsets[i], slot.dtype, slot.shape, op);
  }
  const int64_t rows = 2 * int64_t(o.kinds.size());
  const auto* words = static_cast<const char*>(rng_rows(state, *plan, rows).data_ptr());
  std::vector<PhiloxTuple> rngs;
  for (int64_t r = 0; r < rows; ++r) {
    rngs.push_back({0, 0, reinterpret_cast<int64_t>(words + 16 * r), reinterpret_cast<int64_t>(words + 16 * r + 8)});
  }
  // the scratch and the workspace in one buffer
  const int64_t scratch_n = scratch_numel(o, x.size(0) * x.size(1));
  const int64_t workspace_at = align_up<int64_t>(scratch_n * int64_t(grad.element_size()), kCastAlign);
  const int64_t workspace_n = workspace_numel(o, x.size(0), x.size(1), params);
  const at::Tensor buffer = at::empty({workspace_at + workspace_n * 4}, grad.options().dtype(at::kByte));
  const at::Tensor scratch = carve(buffer, 0, grad.scalar_type(), {scratch_n}, op);
  const at::Tensor workspace = carve(buffer, workspace_at, at::kFloat, {workspace_n}, op);
  const Tensors weights = cast_weights(params, state, *plan, x.scalar_type(), false);
  // the alignment gaps between gradients are never written: zeroed, the whole tensor is defined; widths that
  // are multiples of 64, as in every real model, leave no gaps and no extra kernel
  Tensors grads;
  for (const int b : {kGradMain, kGradOther}) {
    const at::TensorOptions options = params[0].options().dtype(b == kGradMain ? params[0].scalar_type()
                                                                               : plan->other_dtype);
    grads.push_back(plan->grad_gaps[b] ? at::zeros({plan->grad_numel[b]}, options)
                                       : at::empty({plan->grad_numel[b]}, options));
  }
  std::vector<GradDest> dest(params.size());
  std::vector<at::ScalarType> dtypes;
  for (size_t i = 0; i < params.size(); ++i) dtypes.push_back(dtype_of(params[i]));
  for (size_t j = 0; j < into.size(); ++j) dest[into_index[j]] = GradDest{into[j], true};
  for (size_t i = 0; i < params.size(); ++i) {
    const int b = plan->grad_buffer[i];
    if (b == kGradInto || b == kGradNone) continue;
    dest[i] = GradDest{carve_like(grads[b], plan->grad_offsets[i] * int64_t(grads[b].element_size()),
                                  grads[b].scalar_type(), params[i], op),
                       false};
  }
  // dK/dV [b, ls, W] each, as the keys and values came in, into kv_into when given; the kernels write them
  // through head views. Empty where there are none to return.
  Tensors kv;
  if (encoder_k && kv_into.empty()) {
    kv = {at::empty(encoder_k->sizes(), encoder_k->options().memory_format(at::MemoryFormat::Contiguous)),
          at::empty(encoder_v->sizes(), encoder_v->options().memory_format(at::MemoryFormat::Contiguous))};
  }
  const Tensors kv_dest = kv_into.empty() ? kv : Tensors(kv_into.begin(), kv_into.end());
  const OptTensor grad_k = kv_dest.empty() ? OptTensor() : heads_of(kv_dest[0], o);
  const OptTensor grad_v = kv_dest.empty() ? OptTensor() : heads_of(kv_dest[1], o);
  auto [grad_x, param_grads] = layer_bwd_impl(o, grad.contiguous(), saved, rngs, weights, scratch, workspace, grad_k,
                                              grad_v, params[0].scalar_type(), dtypes, dest, in);
  if (kv.empty()) kv = {at::empty({0}, x.options()), at::empty({0}, x.options())};
  return {grad_x, grads[kGradMain], grads[kGradOther], kv[0], kv[1]};
}

// ---- the Meta implementations: what torch.compile's fake tensors run, from the same plan ----------------------
std::tuple<at::Tensor, at::Tensor> layer_meta(const at::Tensor& x, const OptTensor& key_padding_mask,
                                              const OptTensor& encoder_k, const OptTensor& encoder_v,
                                              const OptTensor& encoder_padding_mask,
                                              const c10::List<OptTensor>& param_args, LSMINI_LAYER_OPTION_PARAMS,
                                              const OptTensor& rotary_cos, const OptTensor& rotary_sin) {
  const char* op = "lsmini::layer";
  const Options o = options_of(LSMINI_LAYER_OPTION_VALUES, op);
  const Tensors params = param_list(param_args);
  LSMINI_CHECK(rotary_cos.has_value() == (o.rotary_dim > 0) && rotary_sin.has_value() == (o.rotary_dim > 0), op,
               ": rotary_cos and rotary_sin must be given exactly when rotary_dim > 0");
  LSMINI_CHECK(x.dim() == 3 && params.size() == param_count(o) && params[0].defined(), op,
               ": x must be [batch, len, hidden] with ", int64_t(param_count(o)), " parameters, the first given");
  const c10::SymInt src_len = encoder_k ? encoder_k->sym_size(1) : c10::SymInt(0);
  const Plan<c10::SymInt> plan =
      make_plan<c10::SymInt>(o, x.sym_size(0), x.sym_size(1), src_len, key_padding_mask.has_value(),
                             encoder_padding_mask.has_value(), x.scalar_type(), params,
                             std::vector<bool>(params.size(), false));
  return {at::empty_symint(x.sym_sizes(), x.options()),
          at::empty_symint({plan.total}, x.options().dtype(at::kByte))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_backward_meta(
    const at::Tensor& grad, const at::Tensor& state, const at::Tensor& x, const OptTensor& key_padding_mask,
    const OptTensor& encoder_k, const OptTensor& encoder_v, const OptTensor& encoder_padding_mask,
    const c10::List<OptTensor>& param_args, at::IntArrayRef into_index, at::TensorList into,
    at::TensorList kv_into, LSMINI_LAYER_OPTION_PARAMS, const OptTensor& rotary_cos, const OptTensor& rotary_sin) {
  const char* op = "lsmini::layer_backward";
  const Options o = options_of(LSMINI_LAYER_OPTION_VALUES, op);
  const Tensors params = param_list(param_args);
  LSMINI_CHECK(rotary_cos.has_value() == (o.rotary_dim > 0) && rotary_sin.has_value() == (o.rotary_dim > 0), op,
               ": rotary_cos and rotary_sin must be given exactly when rotary_dim > 0");
  LSMINI_CHECK(x.dim() == 3 && params.size() == param_count(o) && params[0].defined(), op,
               ": x must be [batch, len, hidden] with ", int64_t(param_count(o)), " parameters, the first given");
  const std::vector<bool> into_at = into_mask(into_index, into, params.size(), op);
  const c10::SymInt src_len = encoder_k ? encoder_k->sym_size(1) : c10::SymInt(0);
  const Plan<c10::SymInt> plan =
      make_plan<c10::SymInt>(o, x.sym_size(0), x.sym_size(1), src_len, key_padding_mask.has_value(),
                             encoder_padding_mask.has_value(), x.scalar_type(), params, into_at);
  const bool kv = encoder_k && kv_into.empty();
  return {at::empty_symint(x.sym_sizes(), x.options()),
          at::empty_symint({plan.grad_numel[kGradMain]}, params[0].options()),
          at::empty_symint({plan.grad_numel[kGradOther]}, params[0].options().dtype(plan.other_dtype)),
          kv ? at::empty_symint(encoder_k->sym_sizes(), encoder_k->options()) : at::empty({0}, x.options()),
          kv ? at::empty_symint(encoder_v->sym_sizes(), encoder_v->options()) : at::empty({0}, x.options())};
}

// ---- gradients only where autograd asks ------------------------------------------------------------------
// Per parameter, its .grad when the running backward is one in which autograd would itself accumulate this
// parameter's gradient into that .grad — a .backward() whose graph reaches the parameter's AccumulateGrad
// node (and, with inputs=, names the parameter) — with nothing that must see the gradient on its way: no
// hooks on the node (a data-parallel reducer's, say), no tensor hooks, no retain_grad, no post-accumulate
// hooks; outside double backward (grad mode on); .grad dense, contiguous, of the parameter's shape, dtype and
// device. Else None: the gradient goes back to autograd. torch.autograd.grad never accumulates, so it always
// gets None.
std::vector<OptTensor> layer_grad_into(const std::vector<OptTensor>& params) {
  std::vector<OptTensor> out(params.size());
  if (at::GradMode::is_enabled()) return out;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (exec_info == nullptr || nodes == nullptr) return out;  // not inside a backward
  for (size_t i = 0; i < params.size(); ++i) {
    if (!params[i]) continue;  // an absent parameter (None)
    const at::Tensor& p = *params[i];
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    const at::Tensor& g = p.grad();
    if (!g.defined() || g.is_sparse() || !g.is_contiguous() || g.sizes() != p.sizes() ||
        g.scalar_type() != p.scalar_type() || g.device() != p.device()) {
      continue;
    }
    auto acc = torch::autograd::impl::try_get_grad_accumulator(p);
    if (!acc) continue;
    torch::autograd::Node* node = acc.get();
    if (nodes->find(node) == nodes->end()) continue;
    if (!exec_info->empty()) {  // backward(inputs=...) or autograd.grad: only what is needed accumulates
      const auto it = exec_info->find(node);
      if (it == exec_info->end() || !it->second.needed_) continue;
    }
    if (!node->pre_hooks().empty() || !node->tensor_pre_hooks().empty() || !node->post_hooks().empty() ||
        !node->retains_grad_hooks().empty() || node->tensor_post_acc_grad_hooks() != nullptr) {
      continue;
    }
    out[i] = g;
  }
  return out;
}

void register_layer(pybind11::module_& m) {
  m.def("layer_grad_into", &layer_grad_into,
        "Per parameter its .grad where the running backward would accumulate into it with nothing watching "
        "(lsmini::layer_backward may then add the gradient there itself), else None",
        pybind11::arg("params"));
}

}  // namespace

LSMINI_REGISTER_OPS(register_layer);

TORCH_LIBRARY_FRAGMENT(lsmini, m) {
  // (y [b, l, H], the call's state for backward in one uint8 buffer). params: every block's six (spec.py's
  // BLOCK_PARAMS), None for an absent bias, then with qk_norm the Q and K norm weights; rotary_cos / rotary_sin: float32 [l, rotary_dim] or [b, l, rotary_dim]
  // tables (given exactly when rotary_dim > 0), applied to Q and K of the self-attention block.
  m.def("layer(Tensor x, Tensor? key_padding_mask, Tensor? encoder_k, Tensor? encoder_v, "
        "Tensor? encoder_padding_mask, Tensor?[] params, " LSMINI_LAYER_OPTION_ARGS
        ", Tensor? rotary_cos=None, Tensor? rotary_sin=None) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag, at::Tag::nondeterministic_seeded});
  // (grad_x [b, l, H], grads, grads_other, grad_encoder_k, grad_encoder_v). grads holds the gradients of the
  // parameters of params[0]'s dtype, in order, each starting at the next multiple of 64 elements (contiguous, or
  // in a transposed 2-D parameter's layout: transposed_layout); grads_other those of the parameters of one other
  // dtype, the same way; absent (None) parameters and the parameters
  // params[into_index] are in neither: the latter's gradients are added into `into` (their .grad).
  // grad_encoder_k/v [b, ls, H] for a layer with a cross block and no kv_into (where they go instead), else
  // empty. (Outputs are plain tensors, never lists: that keeps the operator auto-functionalizable for
  // torch.compile with its mutable arguments.)
  m.def("layer_backward(Tensor grad, Tensor state, Tensor x, Tensor? key_padding_mask, Tensor? encoder_k, "
        "Tensor? encoder_v, Tensor? encoder_padding_mask, Tensor?[] params, int[] into_index, Tensor(a!)[] into, "
        "Tensor(b!)[] kv_into, " LSMINI_LAYER_OPTION_ARGS
        ", Tensor? rotary_cos=None, Tensor? rotary_sin=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(lsmini, CUDA, m) {
  m.impl("layer", TORCH_FN(layer_cuda));
  m.impl("layer_backward", TORCH_FN(layer_backward_cuda));
}

TORCH_LIBRARY_IMPL(lsmini, Meta, m) {
  m.impl("layer", TORCH_FN(layer_meta));
  m.impl("layer_backward", TORCH_FN(layer_backward_meta));
}

}  // namespace lsmini
