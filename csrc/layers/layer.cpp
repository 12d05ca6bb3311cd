// One call per Transformer layer: lsmini._C.layer_fwd runs a whole encoder or decoder layer's forward and
// lsmini._C.layer_bwd its whole backward, for the kernel path (CUDA, float16/bfloat16, a head_dim the
// fused attention kernel has). A training step then crosses from Python into the extension twice per
// layer instead of once per kernel and GEMM, so the host stays ahead of the GPU without a CUDA graph.
//
// The computation is lsmini/layers/blocks.py's, step for step and in the same order: the same kernels
// (through the bindings' functions in ops.h, checks included), the same ATen GEMMs, the same dropout
// draws from torch's generator, the same arena layout. Outputs and gradients are therefore bit-for-bit
// those of the Python orchestration, which remains for the reference path, float32 and other head dims,
// and which the tests compare this file against. blocks.py's docstring describes the blocks, what
// forward saves and the arena layout.
//
// Across the boundary: `options` is the call's lsmini.layers.spec.LayerOptions; `params` the blocks'
// parameters in spec.BLOCK_PARAMS order with the GEMM weights already in the compute dtype. Forward
// returns (y, saved, rngs): kSlots tensors per block in `saved` (None where a block keeps nothing) and
// two Philox states per block in `rngs` (the core's dropout, the residual dropout); backward takes
// both back with the arena view `scratch` (spec.scratch_numel elements). Forward makes the tensors it
// saves one by one, or, given `state` (the compiled layer's), as views of that one byte buffer at the
// byte `offsets` (per slot) that lsmini.layers.compiled.state_plan chose.
//
// The same file serves the custom operators lsmini::layer / lsmini::layer_backward on CUDA (the end of
// the file): what torch.compile calls, with the layout of a call planned once per shape.
#include "common.h"
#include "ops.h"

#include "attention.h"
#include "bias_act_dropout.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace lsmini {
namespace {

namespace py = pybind11;
using OptTensor = std::optional<at::Tensor>;

constexpr int64_t kParamsPerBlock = 6;  // spec.BLOCK_PARAMS
constexpr int64_t kAlign = 64;          // arena.ALIGN
constexpr int64_t kStateAlign = 64;     // compiled.STATE_ALIGN, bytes
constexpr PhiloxTuple kNoRng{0, 0, 0, 0};

enum class Kind { Self, Cross, Ffn };

// What a block's forward keeps for its backward, by position in its run of kSlots entries of `saved`.
enum Slot : int {
  kInput,       // pre-LN with recompute: the block input (LayerNorm and the core input are recomputed)
  kNormX,       // the LayerNorm's input: the block input (pre-LN) or the residual sum (post-LN)
  kMean,        // LayerNorm row statistics, fp32
  kRstd,
  kCoreInput,   // the core's input when kept
  kProjection,  // attention: the Q/K/V (self) or Q (cross) projection; FFN: the first GEMM's output
  kHidden,      // FFN: its activation when kept (always with relu: its derivative is read off it)
  kContext,     // attention: the merged-heads context [tokens, hidden] and its row log-sum-exp
  kLse,
  kKeys,        // cross-attention: the encoder K/V views and the encoder padding mask
  kValues,
  kMask,        // attention: the key padding mask it used
  kBits,        // attention: the dropout keep bits its forward stored for its backward (keep_bits), if any
  kSlots
};

struct Options {
  std::vector<Kind> kinds;
  int64_t hidden, ffn, heads, head_dim;
  double scale, eps, dropout, attn_dropout, act_dropout;
  bool pre_ln, causal, recompute;
  int act;
};

Kind kind_of(const std::string& name, const char* op) {
  LSMINI_CHECK(name == "self" || name == "cross" || name == "ffn", op, ": unknown block kind '", name, "'");
  return name == "self" ? Kind::Self : name == "cross" ? Kind::Cross : Kind::Ffn;
}

int activation_of(const std::string& act, const char* op) {
  LSMINI_CHECK(act == "relu" || act == "gelu" || act == "gelu_tanh", op, ": unknown activation '", act, "'");
  return int(act == "relu" ? BiasAct::Relu : act == "gelu" ? BiasAct::Gelu : BiasAct::GeluTanh);
}

// From the call's lsmini.layers.spec.LayerOptions (the pybind entry points).
Options read_options(const py::object& o, const char* op) {
  Options opt;
  for (const py::handle kind : o.attr("kinds")) opt.kinds.push_back(kind_of(kind.cast<std::string>(), op));
  opt.hidden = o.attr("hidden").cast<int64_t>();
  opt.ffn = o.attr("ffn").cast<int64_t>();
  opt.heads = o.attr("heads").cast<int64_t>();
  opt.head_dim = o.attr("head_dim").cast<int64_t>();
  opt.scale = o.attr("scale").cast<double>();
  opt.eps = o.attr("eps").cast<double>();
  opt.dropout = o.attr("dropout").cast<double>();
  opt.attn_dropout = o.attr("attn_dropout").cast<double>();
  opt.act_dropout = o.attr("activation_dropout").cast<double>();
  opt.pre_ln = o.attr("pre_ln").cast<bool>();
  opt.causal = o.attr("causal").cast<bool>();
  opt.recompute = o.attr("recompute").cast<bool>();
  opt.act = activation_of(o.attr("activation").cast<std::string>(), op);
  LSMINI_CHECK(o.attr("kernels").cast<bool>(), op, ": options.kernels is False; the one-call layer runs the kernels");
  return opt;
}

// The shapes of one call: [batch, q_len] tokens, and the parameters' dtype (weight gradients come out in it).
struct Shape {
  int64_t batch, q_len, tokens;
  at::ScalarType weight_dtype;
};

// One block's parameters, spec.BLOCK_PARAMS order.
struct Params {
  const at::Tensor &weight_in, &bias_in, &weight_out, &bias_out, &norm_weight, &norm_bias;
};

Params block_params(const std::vector<at::Tensor>& params, size_t block) {
  const at::Tensor* p = params.data() + block * kParamsPerBlock;
  return {p[0], p[1], p[2], p[3], p[4], p[5]};
}

// A contiguous `dtype` tensor of `sizes` over base's storage, byte_offset bytes past base's first element
// (base contiguous), made directly on that storage: narrow + view(dtype) + view(sizes) would be four ATen
// calls through the dispatcher, and the compiled layer's operators carve dozens of these per call.
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

// What base.as_strided(sizes, strides, offset) makes (offset: elements of base's dtype from its storage's
// start), made directly on the storage: as_strided goes through the dispatcher and t() through it three
// times, and a layer call makes ~15 such views a block. Nothing here needs autograd's view tracking: the
// operators run below autograd, and the eager layer's saved slots are never modified in place.
at::Tensor strided_view(const at::Tensor& base, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t offset) {
  at::Tensor t =
      at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(), base.dtype());
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return t;
}

// m.t() for a matrix, made directly (strided_view).
at::Tensor transposed(const at::Tensor& m) {
  return strided_view(m, {m.size(1), m.size(0)}, {m.stride(1), m.stride(0)}, m.storage_offset());
}

// Where forward puts the tensors it saves: fresh tensors, or views of one byte buffer (layer_fwd's
// `state`). at(slot, ...) is that slot's view, or none (then the caller allocates as usual).
class Destinations {
 public:
  Destinations(const OptTensor& state, const std::vector<int64_t>& offsets) : state_(state), offsets_(offsets) {}

  OptTensor at(size_t slot, at::IntArrayRef sizes, at::ScalarType dtype) const {
    if (!state_ || offsets_[slot] < 0) return std::nullopt;
    const int64_t item = int64_t(c10::elementSize(dtype)), offset = offsets_[slot];
    const int64_t numel = c10::multiply_integers(sizes);
    LSMINI_CHECK(offset % kStateAlign == 0 && offset + numel * item <= state_->numel(), "layer_fwd: saved slot ",
                 slot, " (", numel * item, " bytes at offset ", offset, ") does not fit the ", state_->numel(),
                 "-byte state");
    return carve(*state_, offset, dtype, sizes, "layer_fwd");
  }
  // Whether the call follows a plan (the compiled operator), and whether the plan has a place for slot.
  bool planned() const { return state_.has_value(); }
  bool has(size_t slot) const { return planned() && offsets_[slot] >= 0; }

 private:
  const OptTensor& state_;
  const std::vector<int64_t>& offsets_;
};

// What the attention blocks read besides their parameters.
struct Inputs {
  OptTensor key_padding_mask, encoder_k, encoder_v, encoder_padding_mask;
};

int64_t align(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

PhiloxTuple draw(double p) { return p > 0 ? philox_seed_offset() : kNoRng; }

// Views are made directly (strided_view, rather than chains of view/permute/unbind/narrow): a layer makes
// dozens per call, and each ATen call costs host time.

// The contiguous [rows, cols] view of flat[offset:] (arena.region).
at::Tensor region(const at::Tensor& flat, int64_t offset, int64_t rows, int64_t cols) {
  return strided_view(flat, {rows, cols}, {cols, 1}, flat.storage_offset() + offset);
}

// Part `part` of a projection x2d [batch·len, parts·hidden] (columns part-major, then head) as the
// [batch, heads, len, head_dim] view the attention kernels read (blocks.heads_of), no copy.
at::Tensor head_view(const at::Tensor& x2d, int64_t batch, int64_t len, int64_t part, const Options& o) {
  const int64_t row = x2d.stride(0);
  return strided_view(x2d, {batch, o.heads, len, o.head_dim}, {len * row, o.head_dim, row, 1},
                      x2d.storage_offset() + part * o.hidden);
}

// [tokens, hidden] (contiguous) as the attention kernels' [batch, heads, len, head_dim] view.
at::Tensor split(const at::Tensor& merged, const Shape& s, const Options& o) {
  return head_view(merged, s.batch, s.q_len, 0, o);
}

// x·weightᵀ + bias in one GEMM (the bias in its epilogue), into out when given.
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, const OptTensor& out) {
  if (out) {
    at::Tensor dst = *out;
    return at::addmm_out(dst, bias.to(x.scalar_type()), x, transposed(weight));
  }
  return at::addmm(bias.to(x.scalar_type()), x, transposed(weight));
}

// x·weightᵀ, into out when given.
at::Tensor matmul_t(const at::Tensor& x, const at::Tensor& weight, const OptTensor& out) {
  if (out) {
    at::Tensor dst = *out;
    return at::mm_out(dst, x, transposed(weight));
  }
  return at::mm(x, transposed(weight));
}

// Where a block's parameter gradients go: per parameter a destination, or none (the gradient is returned).
// add: the destinations are the parameters' existing .grad, and each gradient is added there; else each is
// written there (a destination of the caller's, e.g. its place in one tensor holding every gradient).
struct GradInto {
  const OptTensor* dest;
  bool add;
};

// a·b in the parameters' dtype: float32 straight out of the GEMM under autocast (blocks.weight_grad).
// With `into` the GEMM adds its product there itself (beta = 1) or writes it there, and returns undefined:
// no gradient tensor, no separate accumulation or copy pass.
at::Tensor weight_grad(const at::Tensor& a, const at::Tensor& b, at::ScalarType dtype, const OptTensor& into,
                       bool add) {
  if (into) {
    at::Tensor dst = *into;
    if (dst.scalar_type() == a.scalar_type()) {
      add ? at::addmm_out(dst, dst, a, b) : at::mm_out(dst, a, b);
    } else {
      add ? at::addmm_out(dst, dst, a, b, dst.scalar_type()) : at::mm_out(dst, a, b, dst.scalar_type());
    }
    return at::Tensor();
  }
  if (dtype == at::kFloat && a.scalar_type() != dtype) return at::mm(a, b, dtype);
  return at::mm(a, b).to(dtype);
}

at::Tensor bias_grad(const at::Tensor& grad2d, at::ScalarType dtype) {
  return *std::get<1>(bias_dropout_residual_bwd(grad2d, 0.0, kNoRng, true, dtype, std::nullopt));
}

struct Gradients {  // of one block: its input and its six parameters
  at::Tensor input, weight_in, bias_in, weight_out, bias_out, norm_weight, norm_bias;
};

// ---- forward ---------------------------------------------------------------------------------------------
// A block's view of the destinations: at(slot, ...) for its own slots.
struct BlockDestinations {
  const Destinations& all;
  size_t base;
  OptTensor at(int slot, at::IntArrayRef sizes, at::ScalarType dtype) const {
    return all.at(base + size_t(slot), sizes, dtype);
  }
  bool planned() const { return all.planned(); }
  bool has(int slot) const { return all.has(base + size_t(slot)); }
};

// A buffer for the attention forward's dropout keep bits, which its backward then reads instead of drawing
// them again; none where attention_keeps_bits (attention.h) says no: without dropout, or past the policy's
// lengths. A planned call (the compiled operator) keeps them exactly where its plan has their slot instead: the
// plan was made under the policy of its first call at these shapes (compiled.saved_layout asks keeps_bits), and
// its backward reads the bits where the plan puts them, whatever the policy is by then.
OptTensor keep_bits(const at::Tensor& q, int64_t k_len, const Options& o, const BlockDestinations& dest) {
  if (!(dest.planned() ? dest.has(kBits) : attention_keeps_bits(o.attn_dropout, k_len, o.head_dim)))
    return std::nullopt;
  const int64_t numel = attention_keep_numel(q.size(0), o.heads, q.size(2), k_len);
  if (OptTensor into = dest.at(kBits, {numel}, at::kInt)) return into;
  return at::empty({numel}, q.options().dtype(at::kInt));
}

at::Tensor attention_core_fwd(Kind kind, const at::Tensor& x, const Params& p, const Options& o, const Shape& s,
                              const Inputs& in, at::Tensor* slots, PhiloxTuple& rng, const BlockDestinations& dest) {
  const bool self = kind == Kind::Self;
  const at::ScalarType dtype = x.scalar_type();
  at::Tensor projection =
      project(x, p.weight_in, p.bias_in, dest.at(kProjection, {s.tokens, (self ? 3 : 1) * o.hidden}, dtype));
  const at::Tensor q = head_view(projection, s.batch, s.q_len, 0, o);
  const at::Tensor k = self ? head_view(projection, s.batch, s.q_len, 1, o) : *in.encoder_k;
  const at::Tensor v = self ? head_view(projection, s.batch, s.q_len, 2, o) : *in.encoder_v;
  const OptTensor& mask = self ? in.key_padding_mask : in.encoder_padding_mask;
  rng = draw(o.attn_dropout);
  const int64_t k_len = k.size(2);
  const OptTensor bits = keep_bits(q, k_len, o, dest);
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
  return at::mm(context, transposed(p.weight_out));
}

at::Tensor ffn_fwd(const at::Tensor& x, const Params& p, const Options& o, const Shape& s, at::Tensor* slots,
                   PhiloxTuple& rng, const BlockDestinations& dest) {
  const bool relu = o.act == int(BiasAct::Relu);
  const at::ScalarType dtype = x.scalar_type();
  // the slots these go to when they are kept (see below), so only then into the destinations
  at::Tensor pre_activation =
      matmul_t(x, p.weight_in, relu ? std::nullopt : dest.at(kProjection, {s.tokens, o.ffn}, dtype));
  rng = draw(o.act_dropout);
  at::Tensor hidden = bias_act_dropout_fwd(pre_activation, p.bias_in, o.act, o.act_dropout, rng,
                                           relu || !o.recompute ? dest.at(kHidden, {s.tokens, o.ffn}, dtype)
                                                                : std::nullopt);
  slots[kCoreInput] = x;
  if (relu) {  // relu's derivative is read off its output: keep that, not the GEMM output
    slots[kHidden] = hidden;
  } else {
    slots[kProjection] = pre_activation;
    if (!o.recompute) slots[kHidden] = hidden;
  }
  return at::mm(hidden, transposed(p.weight_out));
}

// residual [tokens, hidden] → the block's output (into `output` when given: where the next block saves it);
// fills the block's slots and its two Philox states.
at::Tensor block_fwd(Kind kind, const at::Tensor& residual, const Params& p, const Options& o, const Shape& s,
                     const Inputs& in, at::Tensor* slots, PhiloxTuple* rngs, const BlockDestinations& dest,
                     const OptTensor& output) {
  auto core = [&](const at::Tensor& x) {
    return kind == Kind::Ffn ? ffn_fwd(x, p, o, s, slots, rngs[0], dest)
                             : attention_core_fwd(kind, x, p, o, s, in, slots, rngs[0], dest);
  };
  const at::ScalarType dtype = residual.scalar_type();
  const OptTensor mean = dest.at(kMean, {s.tokens}, at::kFloat), rstd = dest.at(kRstd, {s.tokens}, at::kFloat);
  if (o.pre_ln) {
    const OptTensor normed = o.recompute ? std::nullopt : dest.at(kCoreInput, {s.tokens, o.hidden}, dtype);
    const std::vector<at::Tensor> norm = layernorm_fwd(residual, p.norm_weight, p.norm_bias, o.eps, normed, mean, rstd);
    const at::Tensor out_core = core(norm[0]);
    rngs[1] = draw(o.dropout);
    at::Tensor out = bias_dropout_residual_fwd(out_core, p.bias_out, residual, o.dropout, rngs[1], output);
    slots[kNormX] = residual;
    slots[kMean] = norm[1];
    slots[kRstd] = norm[2];
    if (o.recompute) {  // backward recomputes LN(residual) from the block's input instead
      slots[kCoreInput] = at::Tensor();
      slots[kInput] = residual;
    }
    return out;
  }
  const at::Tensor out_core = core(residual);
  rngs[1] = draw(o.dropout);
  at::Tensor summed = bias_dropout_residual_fwd(out_core, p.bias_out, residual, o.dropout, rngs[1],
                                                dest.at(kNormX, {s.tokens, o.hidden}, dtype));
  std::vector<at::Tensor> norm = layernorm_fwd(summed, p.norm_weight, p.norm_bias, o.eps, output, mean, rstd);
  slots[kNormX] = summed;
  slots[kMean] = norm[1];
  slots[kRstd] = norm[2];
  return norm[0];
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<PhiloxTuple>> layer_fwd_impl(
    const Options& o, const at::Tensor& x, const OptTensor& key_padding_mask, const OptTensor& encoder_k,
    const OptTensor& encoder_v, const OptTensor& encoder_padding_mask, const std::vector<at::Tensor>& params,
    const OptTensor& state, const std::vector<int64_t>& offsets) {
  const char* op = "layer_fwd";
  const size_t blocks = o.kinds.size();
  check_cuda(x, op, "x");
  LSMINI_CHECK(x.dim() == 3 && x.size(2) == o.hidden && x.is_contiguous(), op,
               ": x must be a contiguous [batch, len, hidden=", o.hidden, "] tensor, got shape ", x.sizes());
  LSMINI_CHECK(params.size() == blocks * kParamsPerBlock, op, ": expected ", blocks * kParamsPerBlock,
               " parameters for ", blocks, " blocks, got ", params.size());
  for (size_t i = 0; i < blocks; ++i) {
    LSMINI_CHECK(o.kinds[i] != Kind::Cross || (encoder_k && encoder_v), op,
                 ": a cross-attention block needs encoder_k and encoder_v");
  }
  if (state) {
    check_cuda(*state, op, "state");
    LSMINI_CHECK(state->scalar_type() == at::kByte && state->dim() == 1 && state->is_contiguous() &&
                     state->device() == x.device() && offsets.size() == blocks * kSlots,
                 op, ": state must be a contiguous uint8 vector on ", x.device(), " with one offset per saved slot (",
                 blocks * kSlots, "), got ", state->scalar_type(), " ", state->sizes(), " and ", offsets.size(),
                 " offsets");
  }
  c10::cuda::CUDAGuard guard(x.device());
  const Shape s{x.size(0), x.size(1), x.size(0) * x.size(1), params[0].scalar_type()};
  const Inputs in{key_padding_mask, encoder_k, encoder_v, encoder_padding_mask};
  const Destinations dest(state, offsets);
  std::vector<at::Tensor> saved(blocks * kSlots);
  std::vector<PhiloxTuple> rngs(blocks * 2, kNoRng);
  at::Tensor residual = x.view({s.tokens, o.hidden});
  for (size_t i = 0; i < blocks; ++i) {
    // a block's output is the next block's input, which that block saves as its LayerNorm input (pre-LN) or
    // its core's input (post-LN)
    const OptTensor output =
        i + 1 < blocks ? dest.at((i + 1) * kSlots + (o.pre_ln ? kNormX : kCoreInput), {s.tokens, o.hidden},
                                 x.scalar_type())
                       : std::nullopt;
    residual = block_fwd(o.kinds[i], residual, block_params(params, i), o, s, in, saved.data() + i * kSlots,
                         rngs.data() + i * 2, BlockDestinations{dest, i * kSlots}, output);
  }
  if (state) {  // every saved tensor that has a place in state is there (else backward would read garbage)
    for (size_t i = 0; i < saved.size(); ++i) {
      const char* at = saved[i].defined() ? static_cast<const char*>(saved[i].data_ptr()) : nullptr;
      LSMINI_CHECK(offsets[i] < 0 || at == static_cast<const char*>(state->data_ptr()) + offsets[i], op,
                   ": saved slot ", i, " is not at its offset ", offsets[i], " in state");
    }
  }
  return {residual.view({s.batch, s.q_len, o.hidden}), saved, rngs};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<PhiloxTuple>> layer_fwd(
    const py::object& options, const at::Tensor& x, const OptTensor& key_padding_mask, const OptTensor& encoder_k,
    const OptTensor& encoder_v, const OptTensor& encoder_padding_mask, const std::vector<at::Tensor>& params,
    const OptTensor& state, const std::vector<int64_t>& offsets) {
  return layer_fwd_impl(read_options(options, "layer_fwd"), x, key_padding_mask, encoder_k, encoder_v,
                        encoder_padding_mask, params, state, offsets);
}

// ---- backward --------------------------------------------------------------------------------------------
// The saved slots of one block, as forward left them (None → undefined).
struct Slots {
  const OptTensor* s;
  const at::Tensor& operator[](int i) const {
    static const at::Tensor undefined;
    return s[i] ? *s[i] : undefined;
  }
};

// Backward of an attention core: (d input, d weight_in, d bias_in, d weight_out). kv_grads: a cross
// block's dK/dV destinations. input_of(out): the core's input (recomputed into out, or saved).
template <typename InputOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_core_bwd(
    Kind kind, const at::Tensor& grad_core, const Params& p, const Slots& sv, const PhiloxTuple& rng,
    const Options& o, const Shape& s, const at::Tensor& scratch, const InputOf& input_of,
    const std::pair<OptTensor, OptTensor>& kv_grads, const GradInto& into) {
  const bool self = kind == Kind::Self;
  const int64_t t = s.tokens, parts = self ? 3 : 1;
  at::Tensor grad_weight_out = weight_grad(transposed(grad_core), sv[kContext], s.weight_dtype, into.dest[2], into.add);
  at::Tensor grad_context = region(scratch, 0, t, o.hidden);
  at::mm_out(grad_context, grad_core, p.weight_out);
  at::Tensor grad_projection = region(scratch, align(t * o.hidden), t, parts * o.hidden);
  auto heads = [&](const at::Tensor& x2d, int64_t part) { return head_view(x2d, s.batch, s.q_len, part, o); };
  const at::Tensor& projection = sv[kProjection];
  auto given = [&](int slot) { return sv[slot].defined() ? OptTensor(sv[slot]) : std::nullopt; };
  const OptTensor mask = given(kMask), bits = given(kBits);
  if (self) {
    attention_bwd(split(grad_context, s, o), heads(projection, 0), heads(projection, 1), heads(projection, 2),
                  split(sv[kContext], s, o), sv[kLse], mask, o.causal, o.attn_dropout, o.scale, rng,
                  heads(grad_projection, 0), heads(grad_projection, 1), heads(grad_projection, 2), bits);
  } else {
    attention_bwd(split(grad_context, s, o), heads(projection, 0), sv[kKeys], sv[kValues], split(sv[kContext], s, o),
                  sv[kLse], mask, false, o.attn_dropout, o.scale, rng, heads(grad_projection, 0), kv_grads.first,
                  kv_grads.second, bits);
  }
  at::Tensor grad_bias_in = bias_grad(grad_projection, p.bias_in.scalar_type());
  // d(context) is dead once the attention backward has read it: the recomputed input may go there
  at::Tensor grad_weight_in = weight_grad(transposed(grad_projection), input_of(region(scratch, 0, t, o.hidden)),
                                          s.weight_dtype, into.dest[0], into.add);
  at::Tensor grad_input = region(scratch, 0, t, o.hidden);  // so is a recomputed input, once that GEMM read it
  at::mm_out(grad_input, grad_projection, p.weight_in);
  return {grad_input, grad_weight_in, grad_bias_in, grad_weight_out};
}

template <typename InputOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> ffn_bwd(const at::Tensor& grad_core, const Params& p,
                                                                   const Slots& sv, const PhiloxTuple& rng,
                                                                   const Options& o, const Shape& s,
                                                                   const at::Tensor& scratch,
                                                                   const InputOf& input_of, const GradInto& into) {
  // The arena holds the activation (recomputed, unless kept), then its gradient, then (in place) the
  // gradient of the first GEMM's output; the [t, H] temporaries are fresh (blocks.ffn_backward says why).
  at::Tensor act_region = region(scratch, 0, s.tokens, o.ffn);
  const bool relu = o.act == int(BiasAct::Relu);
  at::Tensor hidden = sv[kHidden];
  if (!hidden.defined()) {  // recompute the activation from its saved input, same dropout mask
    hidden = bias_act_dropout_fwd(sv[kProjection], p.bias_in, o.act, o.act_dropout, rng, act_region);
  }
  at::Tensor grad_weight_out = weight_grad(transposed(grad_core), hidden, s.weight_dtype, into.dest[2], into.add);
  hidden.reset();
  at::mm_out(act_region, grad_core, p.weight_out);
  auto [grad_hidden, grad_bias_in] =
      relu ? bias_act_dropout_bwd(act_region, sv[kHidden], p.bias_in, o.act, o.act_dropout, kNoRng, act_region, true)
           : bias_act_dropout_bwd(act_region, sv[kProjection], p.bias_in, o.act, o.act_dropout, rng, act_region, false);
  at::Tensor grad_weight_in =
      weight_grad(transposed(grad_hidden), input_of(std::nullopt), s.weight_dtype, into.dest[0], into.add);
  return {at::mm(grad_hidden, p.weight_in), grad_weight_in, *grad_bias_in, grad_weight_out};
}

// grad: the gradient of the block output; grad_is_ours: it is this backward's own tensor, which may become
// the result (else it is not modified). into: where its GEMM weight gradients go (weight_grad).
Gradients block_bwd(Kind kind, const at::Tensor& grad, const Params& p, const Slots& sv, const PhiloxTuple* rngs,
                    const Options& o, const Shape& s, const at::Tensor& scratch, bool grad_is_ours,
                    const std::pair<OptTensor, OptTensor>& kv_grads, const GradInto& into) {
  // An attention core's output gradient goes into its projection-gradient region, not written before it is dead.
  const OptTensor grad_core_out =
      kind == Kind::Ffn ? std::nullopt : OptTensor(region(scratch, align(s.tokens * o.hidden), s.tokens, o.hidden));
  auto core = [&](const at::Tensor& grad_core, auto input_of) {
    return kind == Kind::Ffn
               ? ffn_bwd(grad_core, p, sv, rngs[0], o, s, scratch, input_of, into)
               : attention_core_bwd(kind, grad_core, p, sv, rngs[0], o, s, scratch, input_of, kv_grads, into);
  };
  Gradients g;
  if (o.pre_ln) {
    // the core's input: saved, or LN(block input) recomputed when the core needs it
    auto input_of = [&](const OptTensor& out) {
      if (sv[kCoreInput].defined()) return sv[kCoreInput];
      return layernorm_fwd(sv[kInput], p.norm_weight, p.norm_bias, o.eps, out)[0];
    };
    auto [grad_core, grad_bias_out] =
        bias_dropout_residual_bwd(grad, o.dropout, rngs[1], true, p.bias_out.scalar_type(), grad_core_out);
    g.bias_out = *grad_bias_out;
    at::Tensor grad_x;
    std::tie(grad_x, g.weight_in, g.bias_in, g.weight_out) = core(grad_core, input_of);
    // the residual path: grad added to LN's input gradient in the same kernel, into grad when it is ours
    auto norm = layernorm_bwd(grad_x, sv[kNormX], p.norm_weight, p.norm_bias, sv[kMean], sv[kRstd], grad,
                              grad_is_ours ? OptTensor(grad) : std::nullopt);
    g.input = *norm[0];
    g.norm_weight = *norm[1];
    g.norm_bias = *norm[2];
    return g;
  }
  auto norm = layernorm_bwd(grad, sv[kNormX], p.norm_weight, p.norm_bias, sv[kMean], sv[kRstd], std::nullopt,
                            std::nullopt);
  g.input = *norm[0];
  g.norm_weight = *norm[1];
  g.norm_bias = *norm[2];
  // without dropout grad_core IS g.input; the core has finished reading it before the add below
  auto [grad_core, grad_bias_out] =
      bias_dropout_residual_bwd(g.input, o.dropout, rngs[1], true, p.bias_out.scalar_type(), grad_core_out);
  g.bias_out = *grad_bias_out;
  at::Tensor grad_x;
  auto saved_input = [&](const OptTensor&) { return sv[kCoreInput]; };
  std::tie(grad_x, g.weight_in, g.bias_in, g.weight_out) = core(grad_core, saved_input);
  g.input.add_(grad_x);
  return g;
}

std::tuple<at::Tensor, std::vector<at::Tensor>> layer_bwd_impl(
    const Options& o, const at::Tensor& grad_in, const std::vector<OptTensor>& saved,
    const std::vector<PhiloxTuple>& rngs, const std::vector<at::Tensor>& params, const at::Tensor& scratch,
    const OptTensor& grad_encoder_k, const OptTensor& grad_encoder_v, const std::vector<at::ScalarType>& param_dtypes,
    const std::vector<OptTensor>& grad_into, bool add_into) {
  const char* op = "layer_bwd";
  const size_t blocks = o.kinds.size();
  check_cuda(grad_in, op, "grad");
  LSMINI_CHECK(grad_in.dim() == 3 && grad_in.size(2) == o.hidden, op, ": grad must be [batch, len, hidden=", o.hidden,
               "], got shape ", grad_in.sizes());
  LSMINI_CHECK(params.size() == blocks * kParamsPerBlock && param_dtypes.size() == params.size() &&
                   saved.size() == blocks * kSlots && rngs.size() == blocks * 2 && grad_into.size() == params.size(),
               op, ": params, param_dtypes, saved, rngs and grad_into do not match ", blocks, " blocks (got ",
               params.size(), ", ", param_dtypes.size(), ", ", saved.size(), ", ", rngs.size(), ", ", grad_into.size(),
               ")");
  for (size_t i = 0; i < params.size(); ++i) {
    if (!grad_into[i]) continue;
    const at::Tensor& t = *grad_into[i];
    LSMINI_CHECK(t.device() == grad_in.device() && t.scalar_type() == param_dtypes[i] &&
                     t.sizes() == params[i].sizes() && t.is_contiguous(),
                 op, ": grad_into[", i, "] must be a contiguous ", param_dtypes[i], " tensor of shape ",
                 params[i].sizes(), " on ", grad_in.device(), ", got ", t.scalar_type(), " ", t.sizes());
  }
  c10::cuda::CUDAGuard guard(grad_in.device());
  const Shape s{grad_in.size(0), grad_in.size(1), grad_in.size(0) * grad_in.size(1), param_dtypes[0]};
  at::Tensor g = grad_in.contiguous().view({s.tokens, o.hidden});
  std::vector<at::Tensor> param_grads(params.size());
  for (size_t i = blocks; i-- > 0;) {
    const bool ours = i < blocks - 1;  // the incoming gradient is autograd's, the others ours
    const std::pair<OptTensor, OptTensor> kv_grads = o.kinds[i] == Kind::Cross
                                                         ? std::make_pair(grad_encoder_k, grad_encoder_v)
                                                         : std::make_pair(OptTensor(), OptTensor());
    Gradients r = block_bwd(o.kinds[i], g, block_params(params, i), Slots{saved.data() + i * kSlots},
                            rngs.data() + i * 2, o, s, scratch, ours, kv_grads,
                            GradInto{grad_into.data() + i * kParamsPerBlock, add_into});
    g = r.input;
    at::Tensor* out = param_grads.data() + i * kParamsPerBlock;
    out[0] = r.weight_in;
    out[1] = r.bias_in;
    out[2] = r.weight_out;
    out[3] = r.bias_out;
    out[4] = r.norm_weight;
    out[5] = r.norm_bias;
  }
  // The vectors' gradients: into their destinations in one multi-tensor add (or copy) where given (the GEMM
  // weights' went there already), else returned in their parameters' dtypes (casts are no-ops but for
  // mixed parameter dtypes).
  std::vector<at::Tensor> into, added;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& pg = param_grads[i];
    if (!pg.defined()) continue;
    if (pg.scalar_type() != param_dtypes[i]) pg = pg.to(param_dtypes[i]);
    if (grad_into[i]) {
      into.push_back(*grad_into[i]);
      added.push_back(pg);
      pg = at::Tensor();
    }
  }
  if (!into.empty() && add_into) at::_foreach_add_(into, added);
  if (!into.empty() && !add_into) at::_foreach_copy_(into, added);
  return {g.view({s.batch, s.q_len, o.hidden}), param_grads};
}

std::tuple<at::Tensor, std::vector<at::Tensor>> layer_bwd(
    const py::object& options, const at::Tensor& grad_in, const std::vector<OptTensor>& saved,
    const std::vector<PhiloxTuple>& rngs, const std::vector<at::Tensor>& params, const at::Tensor& scratch,
    const OptTensor& grad_encoder_k, const OptTensor& grad_encoder_v, const std::vector<at::ScalarType>& param_dtypes,
    const std::vector<OptTensor>& grad_into, bool add_into) {
  return layer_bwd_impl(read_options(options, "layer_bwd"), grad_in, saved, rngs, params, scratch, grad_encoder_k,
                        grad_encoder_v, param_dtypes, grad_into, add_into);
}

// ---- the compiled layer's operators ------------------------------------------------------------------------
// lsmini::layer and lsmini::layer_backward: their schemas, fake implementations and autograd are
// lsmini/layers/compiled.py's; these are their CUDA kernels, so that a step torch.compile made calls no Python per
// layer. Where each saved tensor, the dropout states, the cast weights and each gradient go is compiled.cpp_plan's
// answer for the call's options and shapes: asked once per shape (through the planner compiled.py installs) and
// kept, so the Python that decides the layout is the one the fake implementations use.
enum LayoutKind : int { kLayoutNone, kLayoutInput, kLayoutSame, kLayoutNew };  // compiled._LAYOUT_*

struct SlotLayout {
  int kind;
  int64_t ref;  // kLayoutInput: index into (x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask)
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

struct CallPlan {
  std::vector<SlotLayout> slots;
  std::vector<int64_t> offsets;                  // bytes into the state, per slot (-1: not there)
  int64_t rng_at, cast_at, total;                // bytes
  std::vector<int64_t> cast_positions, cast_at_elements;
  std::vector<int64_t> grad_offsets;             // elements into the gradient tensor, per parameter (-1: apart)
  int64_t grad_numel;
  bool grad_gaps;
  int64_t scratch_numel;
};

py::object& planner() {
  static auto* fn = new py::object();  // never destroyed: it may outlive the interpreter's teardown
  return *fn;
}

void set_layer_planner(py::object fn) { planner() = std::move(fn); }

struct OpArgs {
  c10::string_view kinds, activation;
  int64_t hidden, ffn, heads;
  double scale, eps, dropout, attn_dropout, act_dropout;
  bool pre_ln, causal, recompute;
};

Options op_options(const OpArgs& a, const char* op) {
  Options o;
  for (size_t start = 0; start <= a.kinds.size();) {  // "self,cross,ffn"
    const size_t end = std::min(a.kinds.find(',', start), a.kinds.size());
    o.kinds.push_back(kind_of(std::string(a.kinds.substr(start, end - start)), op));
    start = end + 1;
  }
  LSMINI_CHECK(!o.kinds.empty() && a.heads > 0 && a.hidden % a.heads == 0, op, ": bad options (kinds '",
               std::string(a.kinds), "', hidden ", a.hidden, ", heads ", a.heads, ")");
  o.hidden = a.hidden;
  o.ffn = a.ffn;
  o.heads = a.heads;
  o.head_dim = a.hidden / a.heads;
  o.scale = a.scale;
  o.eps = a.eps;
  o.dropout = a.dropout;
  o.attn_dropout = a.attn_dropout;
  o.act_dropout = a.act_dropout;
  o.pre_ln = a.pre_ln;
  o.causal = a.causal;
  o.recompute = a.recompute;
  o.act = activation_of(std::string(a.activation), op);
  return o;
}

// Appends v's bytes to a cache key (no number goes through an ostream here: common.h says why).
template <typename V>
void put_bytes(std::string& key, const V v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// The plan of a call: from the cache, or from the planner (under the GIL) the first time.
const CallPlan& call_plan(const OpArgs& a, const at::Tensor& x, bool has_mask, bool has_encoder_mask,
                          int64_t src_len, at::TensorList params, const char* op) {
  std::string key(a.kinds);
  key += '|';
  key += a.activation;
  key += '|';
  for (const auto v : {a.hidden, a.ffn, a.heads, x.size(0), x.size(1), src_len}) put_bytes(key, v);
  for (const auto v : {a.scale, a.eps, a.dropout, a.attn_dropout, a.act_dropout}) put_bytes(key, v);
  for (const auto v : {a.pre_ln, a.causal, a.recompute, has_mask, has_encoder_mask}) put_bytes(key, v);
  put_bytes(key, x.scalar_type());
  for (const at::Tensor& p : params) {
    put_bytes(key, p.scalar_type());
    put_bytes(key, p.dim());
    for (const int64_t d : p.sizes()) put_bytes(key, d);
  }
  static std::mutex mutex;
  static auto* cache = new std::unordered_map<std::string, std::unique_ptr<const CallPlan>>();
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache->find(key);
    if (it != cache->end()) return *it->second;
  }
  auto plan = std::make_unique<CallPlan>();
  {
    py::gil_scoped_acquire gil;
    LSMINI_CHECK(planner() && !planner().is_none(), op, ": no layer planner; import lsmini.layers.compiled first");
    std::vector<at::ScalarType> param_dtypes;
    std::vector<std::vector<int64_t>> param_shapes;
    for (const at::Tensor& p : params) {
      param_dtypes.push_back(p.scalar_type());
      param_shapes.push_back(p.sizes().vec());
    }
    py::tuple r;
    try {  // a Python error becomes torch's, with its message, while the GIL is held
      r = planner()(std::string(a.kinds), a.hidden, a.ffn, a.heads, a.scale, a.eps, a.pre_ln,
                    std::string(a.activation), a.dropout, a.attn_dropout, a.act_dropout, a.causal, a.recompute,
                    x.size(0), x.size(1), has_mask, has_encoder_mask, x.scalar_type(), src_len, param_dtypes,
                    param_shapes);
    } catch (py::error_already_set& e) {
      LSMINI_CHECK(false, op, ": the layer planner failed: ", std::string(e.what()));
    }
    for (const py::handle item : r[0]) {
      const py::tuple t = item.cast<py::tuple>();
      plan->slots.push_back(SlotLayout{t[0].cast<int>(), t[1].cast<int64_t>(), t[2].cast<at::ScalarType>(),
                                       t[3].cast<std::vector<int64_t>>()});
    }
    plan->offsets = r[1].cast<std::vector<int64_t>>();
    plan->rng_at = r[2].cast<int64_t>();
    plan->cast_at = r[3].cast<int64_t>();
    plan->total = r[4].cast<int64_t>();
    plan->cast_positions = r[5].cast<std::vector<int64_t>>();
    plan->cast_at_elements = r[6].cast<std::vector<int64_t>>();
    plan->grad_offsets = r[7].cast<std::vector<int64_t>>();
    plan->grad_numel = r[8].cast<int64_t>();
    plan->grad_gaps = r[9].cast<bool>();
    plan->scratch_numel = r[10].cast<int64_t>();
  }
  LSMINI_CHECK(plan->slots.size() == plan->offsets.size() && plan->grad_offsets.size() == params.size() &&
                   plan->cast_positions.size() == plan->cast_at_elements.size(),
               op, ": the planner's answer does not fit the call");
  std::lock_guard<std::mutex> lock(mutex);
  auto& kept = (*cache)[key];
  if (!kept) kept = std::move(plan);
  return *kept;
}

// params with the GEMM weights the plan casts replaced by their views in the state's tail (copied there when
// cast: forward; backward reads the copies).
std::vector<at::Tensor> cast_weights(at::TensorList params, const at::Tensor& state, const CallPlan& plan,
                                     at::ScalarType dtype, bool cast) {
  std::vector<at::Tensor> weights(params.begin(), params.end());
  if (plan.cast_positions.empty()) return weights;
  const int64_t item = int64_t(c10::elementSize(dtype));
  std::vector<at::Tensor> copies, sources;
  for (size_t j = 0; j < plan.cast_positions.size(); ++j) {
    const at::Tensor& p = params[plan.cast_positions[j]];
    at::Tensor copy = carve(state, plan.cast_at + plan.cast_at_elements[j] * item, dtype, p.sizes(), "lsmini::layer");
    weights[plan.cast_positions[j]] = copy;
    copies.push_back(std::move(copy));
    sources.push_back(p);
  }
  if (cast) at::_foreach_copy_(copies, sources);
  return weights;
}

// [b, ls, H] encoder keys or values (column blocks of the decoder's cross-K/V projection, checked_plan checked
// their shape) → [b, heads, ls, d].
OptTensor heads_of(const OptTensor& t, const Options& o) {
  if (!t) return std::nullopt;
  return strided_view(*t, {t->size(0), o.heads, t->size(1), o.head_dim},
                      {t->stride(0), o.head_dim * t->stride(2), t->stride(1), t->stride(2)}, t->storage_offset());
}

at::Tensor rng_rows(const at::Tensor& state, const CallPlan& plan, int64_t rows) {
  return carve(state, plan.rng_at, at::kLong, {rows, 2}, "lsmini::layer");
}

at::Tensor or_none(const OptTensor& t) { return t ? *t : at::Tensor(); }

OptTensor given(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// Both operators' checks of x and the encoder's keys and values, then the call's plan.
const CallPlan& checked_plan(const OpArgs& a, const at::Tensor& x, const OptTensor& key_padding_mask,
                             const OptTensor& encoder_k, const OptTensor& encoder_v,
                             const OptTensor& encoder_padding_mask, at::TensorList params, const char* op) {
  LSMINI_CHECK(x.dim() == 3 && !params.empty(), op, ": x must be [batch, len, hidden], got shape ", x.sizes());
  LSMINI_CHECK(!encoder_k || (encoder_v && encoder_k->dim() == 3 && encoder_k->size(0) == x.size(0) &&
                                encoder_k->size(2) == a.hidden && encoder_v->sizes() == encoder_k->sizes()),
               op, ": encoder_k and encoder_v must both be [batch=", x.size(0), ", src_len, hidden=", a.hidden,
               "]");
  return call_plan(a, x, key_padding_mask.has_value(), encoder_padding_mask.has_value(),
                   encoder_k ? encoder_k->size(1) : 0, params, op);
}

// ---- layer graphs ----------------------------------------------------------------------------------------
// A compiled training step calls each layer's operators with the same plan, parameters and stream step after
// step, and most of a call's host time is issuing its kernels and GEMMs (~25 launches a block). So once a
// call site (the same parameters, device and stream; forward and backward apart) comes with the same plan
// twice in a row, its operator captures its work into a CUDA graph (on a side stream; the call then replays
// it), and from then on replays that graph: one launch and a few input copies per call.
//
// What keeps a replay right:
// - The graph reads its tensor inputs from buffers, each call first copying its inputs there. A buffer serves
//   every graph of its stream that takes the same input (pass, position, dtype, shape): the copies and
//   replays of a stream run in turn. The parameters it reads where they are (the site's key holds their
//   addresses, so a new tensor is a new site).
// - It writes its outputs into tensors of its own, and the call hands out new tensors over their storage. A
//   replay overwrites them, so it runs only when nothing else references that storage any more: in a
//   training loop, backward has released the forward's y and state by the next step, and
//   zero_grad(set_to_none=True) the gradients. Otherwise the call runs eagerly. (A tensor that has been
//   Python's keeps a reference to its Python object, hence new tensors, and the storage's count; anything
//   that keeps the storage, its Python object included, keeps the site eager.)
// - Backward reads the state in place: its graph is kept for one state address (its forward graph's state,
//   once that forward replays).
// - Dropout: the capture registers torch's generator; each replay advances it as the eager call would, so the
//   masks are the eager call's.
// - A call under an outer capture (mode="reduce-overhead", CUDAGraphStep) runs eagerly: the outer graph
//   takes its kernels.
// - The graphs of a device and stream share one memory pool: they replay one after another on that stream,
//   and what one keeps (its outputs) stays allocated while it lives. But the bytes a graph allocates and
//   frees again during its capture (its temporaries, told by the allocator's trace) are free for the graphs
//   captured after it, outputs included, and each replay writes them again. So a graph also replays only when
//   none of those later outputs lying in its temporaries is held elsewhere (or, its graph gone, held at all).
//   Once its last graph is gone the allocator releases a pool, and the next capture takes a new one.
// - A site whose plan changes drops its graph (one is kept per site), so alternating shapes never capture;
//   a site whose parameters have been freed is dropped (when next called, or at the next capture).
// set_layer_graphs(False) (lsmini._C) turns them off and drops them; layer_graph_counts() tells captures,
// replays, and the calls that ran eagerly because a replay would have overwritten outputs held elsewhere.
using Tensors = std::vector<at::Tensor>;
using Bytes = std::pair<uintptr_t, uintptr_t>;  // [first, last) addresses

bool overlap(const std::vector<Bytes>& a, const std::vector<Bytes>& b) {
  return std::any_of(a.begin(), a.end(), [&b](const Bytes& x) {
    return std::any_of(b.begin(), b.end(), [&x](const Bytes& y) { return x.first < y.second && y.first < x.second; });
  });
}

// What a graph writes and hands out: its outputs' storages, watched for references from elsewhere.
struct Written {
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
  std::vector<size_t> own;  // per storage, the references its graph holds
  std::vector<Bytes> bytes;
  bool graph_gone = false;  // then any reference is held elsewhere

  bool held() const {
    for (size_t i = 0; i < storages.size(); ++i) {
      if (!storages[i].expired() && storages[i].use_count() > (graph_gone ? 0 : own[i])) return true;
    }
    return false;
  }
};

struct LayerGraph {
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> params;  // the site's: gone, the site is stale
  const CallPlan* plan = nullptr;
  const void* state = nullptr;  // backward: the forward graph's state it reads
  int seen = 0;                 // calls with this plan in a row
  bool failed = false;          // the capture failed: this plan runs eagerly
  at::cuda::MempoolId_t pool{0, 0};  // the memory pool its graph allocates from
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  Tensors inputs;   // the buffers it reads the call's inputs from (undefined where a call has none)
  Tensors outputs;  // what it writes and returns
  std::shared_ptr<Written> written;  // its outputs' storages
  std::vector<Bytes> temporaries;    // what its capture allocated and freed again: each replay writes there
  std::vector<std::shared_ptr<Written>> overwrites;  // outputs of graphs captured later, in its temporaries

  ~LayerGraph() {
    if (written) written->graph_gone = true;
  }
  // A replay would overwrite outputs held elsewhere.
  bool blocked() const {
    return written->held() ||
           std::any_of(overwrites.begin(), overwrites.end(), [](const auto& w) { return w->held(); });
  }
};

std::atomic<bool> g_layer_graphs{true};
std::atomic<int64_t> g_graph_captures{0}, g_graph_replays{0}, g_graph_blocked{0};

std::tuple<int64_t, int64_t, int64_t> layer_graph_counts() {
  return {g_graph_captures.load(), g_graph_replays.load(), g_graph_blocked.load()};
}

// The temporaries of a capture, from the caching allocator's trace: it calls the tracker on the allocating
// thread, under its own lock, for every allocation and free of the process; only a thread that captures
// records (the capture mode is thread-local, so all of a capture's allocations are its thread's).
struct Allocations {
  std::unordered_map<uintptr_t, size_t> live;  // allocated during the capture, not yet freed
  std::vector<Bytes> freed;
};
thread_local Allocations* t_capture_allocations = nullptr;

void trace_allocation(const c10::cuda::CUDACachingAllocator::TraceEntry& e) {
  Allocations* a = t_capture_allocations;
  if (a == nullptr) return;
  using Action = c10::cuda::CUDACachingAllocator::TraceEntry::Action;
  if (e.action_ == Action::ALLOC) {
    a->live[e.addr_] = e.size_;
  } else if (e.action_ == Action::FREE_REQUESTED || e.action_ == Action::FREE_COMPLETED) {
    const auto it = a->live.find(e.addr_);
    if (it != a->live.end()) {
      a->freed.push_back({it->first, it->first + it->second});
      a->live.erase(it);
    }
  }
}

struct GraphSites {
  std::mutex mutex;
  std::unordered_map<std::string, std::unique_ptr<LayerGraph>> sites;
  std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> capture_streams;  // each warmed up for cuBLAS
  std::map<std::pair<c10::DeviceIndex, c10::StreamId>, at::cuda::MempoolId_t> pools;  // per stream of replays
  std::unordered_map<std::string, at::Tensor> input_buffers;      // per stream, dtype and shape
  bool tracing = false;  // trace_allocation is attached to the caching allocator
};

GraphSites& graph_sites() {
  static auto* sites = new GraphSites();  // never destroyed: graphs must not outlive the CUDA context's teardown
  return *sites;
}

// Off also drops every graph and input buffer: their memory goes back to the allocator once nothing else holds
// the outputs handed out.
bool set_layer_graphs(bool on) {
  GraphSites& all = graph_sites();
  std::lock_guard<std::mutex> lock(all.mutex);
  if (!on) {
    all.sites.clear();
    all.input_buffers.clear();
  }
  return g_layer_graphs.exchange(on);
}

// The buffer a graph of `stream` reads input `t` from: one per stream, pass (forward or backward), input
// (its position among the call's inputs), dtype and shape, shared by the graphs of all sites (each call fills
// it right before its replay, on that stream, so the graphs take turns).
at::Tensor input_buffer(GraphSites& all, const c10::cuda::CUDAStream& stream, char pass, size_t input,
                        const at::Tensor& t) {
  std::string key(1, pass);
  put_bytes(key, input);
  put_bytes(key, stream.device_index());
  put_bytes(key, stream.id());
  put_bytes(key, t.scalar_type());
  for (const int64_t d : t.sizes()) put_bytes(key, d);
  at::Tensor& buffer = all.input_buffers[key];
  if (!buffer.defined()) buffer = at::empty(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
  return buffer;
}

// The site of a call: forward or backward, device, stream, the parameters' addresses.
std::string site_key(char pass, at::TensorList params, const c10::cuda::CUDAStream& stream) {
  std::string key(1, pass);
  put_bytes(key, stream.device_index());
  put_bytes(key, stream.id());
  for (const at::Tensor& p : params) put_bytes(key, p.data_ptr());
  return key;
}

bool stale(const LayerGraph& g) {
  return std::any_of(g.params.begin(), g.params.end(), [](const auto& p) { return p.expired(); });
}

void copy_inputs(const Tensors& into, const Tensors& from) {
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i].defined()) into[i].copy_(from[i]);
  }
}

// A ready stream waits for the work queued so far on another (an event between them).
void stream_waits(const c10::cuda::CUDAStream& waiting, const c10::cuda::CUDAStream& on) {
  cudaEvent_t event;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(event, on.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiting.stream(), event, 0));
  C10_CUDA_CHECK(cudaEventDestroy(event));
}

// body(inputs) → outputs, eagerly or through the site's graph (see above). inputs: the call's tensors the
// graph must read from its copies (undefined where absent); body reads only those and the parameters, and
// returns tensors it allocates.
template <typename Body>
Tensors through_graph(const std::string& site, at::TensorList params, const CallPlan* plan, const void* state,
                      const Tensors& inputs, const Body& body) {
  if (!g_layer_graphs.load() ||
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) {
    return body(inputs);
  }
  GraphSites& all = graph_sites();
  std::unique_lock<std::mutex> lock(all.mutex);
  const auto eager = [&] {
    lock.unlock();
    return body(inputs);
  };
  if (!g_layer_graphs.load()) return eager();  // turned off (and its graphs dropped) since the check above
  std::unique_ptr<LayerGraph>& g = all.sites[site];
  if (!g || stale(*g) || g->plan != plan || g->state != state) {  // a new site or plan: the old graph goes
    g = std::make_unique<LayerGraph>();
    for (const at::Tensor& p : params) g->params.push_back(p.storage().getWeakStorageImpl());
    g->plan = plan;
    g->state = state;
  }
  if (g->failed) return eager();
  const auto replay = [&] {
    copy_inputs(g->inputs, inputs);
    g->graph->replay();
    ++g_graph_replays;
    Tensors out;  // new tensors over the graph's outputs (see above)
    for (const at::Tensor& t : g->outputs) {
      out.push_back(t.defined() ? strided_view(t, t.sizes(), t.strides(), t.storage_offset()) : t);
    }
    return out;
  };
  if (g->graph) {
    if (!g->blocked()) return replay();
    ++g_graph_blocked;
    return eager();
  }
  if (++g->seen < 2) return eager();
  for (auto it = all.sites.begin(); it != all.sites.end();) {  // drop the graphs of parameters now gone
    it = it->second && it->second.get() != g.get() && stale(*it->second) ? all.sites.erase(it) : std::next(it);
  }
  for (auto it = all.input_buffers.begin(); it != all.input_buffers.end();) {  // and buffers no graph reads
    it = it->second.use_count() == 1 ? all.input_buffers.erase(it) : std::next(it);
  }
  for (auto& [key, other] : all.sites) {  // and the outputs of gone graphs that nothing holds now
    if (!other) continue;
    auto& w = other->overwrites;
    w.erase(std::remove_if(w.begin(), w.end(), [](const auto& o) { return o->graph_gone && !o->held(); }), w.end());
  }
  if (!all.tracing) {
    c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(trace_allocation);
    all.tracing = true;
  }
  // Capture on a side stream (one per device: capture needs a stream of its own), then replay on the caller's
  // to compute this call. The capture stream's cuBLAS workspaces are set up by a first GEMM of each kind there
  // outside any capture, so that they are not taken from a graph's memory pool.
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
  Tensors buffers;
  for (size_t i = 0; i < inputs.size(); ++i) {
    buffers.push_back(inputs[i].defined() ? input_buffer(all, caller, site[0], i, inputs[i]) : at::Tensor());
  }
  auto stream_it = all.capture_streams.find(caller.device_index());
  if (stream_it == all.capture_streams.end()) {
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, caller.device_index());
    c10::cuda::CUDAStreamGuard on_side(side);
    const at::Tensor a = at::zeros({16, 16}, inputs[0].options());
    (void)at::mm(a, a);
    (void)at::addmm(a[0], a, a);  // with a bias: the cuBLASLt path
    stream_it = all.capture_streams.emplace(caller.device_index(), side).first;
  }
  const c10::cuda::CUDAStream side = stream_it->second;
  // One pool per stream of the replays, while a graph uses it: a pool whose last graph is gone is released by
  // the allocator, so the next capture takes a new one.
  at::cuda::MempoolId_t& pool = all.pools[{caller.device_index(), caller.id()}];
  const bool pool_in_use = std::any_of(all.sites.begin(), all.sites.end(), [&](const auto& site_graph) {
    return site_graph.second && site_graph.second->graph && site_graph.second->pool == pool;
  });
  if (!pool_in_use) pool = at::cuda::graph_pool_handle();
  stream_waits(side, caller);
  auto graph = std::make_unique<at::cuda::CUDAGraph>();
  bool captured = false;
  Allocations allocations;
  {
    c10::cuda::CUDAStreamGuard on_side(side);
    try {
      graph->register_generator_state(at::cuda::detail::getDefaultCUDAGenerator(caller.device_index()));
      graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      try {
        t_capture_allocations = &allocations;
        g->outputs = body(buffers);
        t_capture_allocations = nullptr;
        graph->capture_end();
        captured = true;
      } catch (const std::exception&) {
        t_capture_allocations = nullptr;
        g->outputs.clear();
        try {
          graph->capture_end();  // ends the capture (and may throw, the graph being incomplete)
        } catch (const std::exception&) {
        }
      }
    } catch (const std::exception&) {
    }
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;  // a capture that failed to begin or end
  if (cudaStreamIsCapturing(side.stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone) {
    cudaGraph_t partial = nullptr;
    (void)cudaStreamEndCapture(side.stream(), &partial);
    if (partial != nullptr) (void)cudaGraphDestroy(partial);
  }
  stream_waits(caller, side);
  if (!captured) {
    (void)cudaGetLastError();
    g->failed = true;
    g->outputs.clear();
    return eager();
  }
  auto written = std::make_shared<Written>();
  for (const at::Tensor& t : g->outputs) {
    if (!t.defined()) continue;
    written->storages.push_back(t.storage().getWeakStorageImpl());
    written->own.push_back(t.storage().use_count());
    const auto first = reinterpret_cast<uintptr_t>(t.storage().data());
    written->bytes.push_back({first, first + t.storage().nbytes()});
  }
  for (auto& [key, other] : all.sites) {  // the graphs of this pool whose temporaries now hold these outputs
    if (other && other->graph && other->pool == pool && overlap(other->temporaries, written->bytes)) {
      other->overwrites.push_back(written);
    }
  }
  g->written = std::move(written);
  g->temporaries = std::move(allocations.freed);
  g->pool = pool;
  g->graph = std::move(graph);
  g->inputs = std::move(buffers);
  ++g_graph_captures;
  // torch 2.11: the first replay of a fresh capture now and then reads the generator's seed/offset words
  // before their refill lands and draws stale masks (torch's own dropout too). It does not once the device
  // is idle after the capture (benchmarks/RESULTS.md, "the first replay after a capture"). Once per capture.
  c10::cuda::device_synchronize();
  return replay();
}

std::tuple<at::Tensor, at::Tensor> layer_op_cuda(
    const at::Tensor& x, const OptTensor& key_padding_mask, const OptTensor& encoder_k, const OptTensor& encoder_v,
    const OptTensor& encoder_padding_mask, at::TensorList params, c10::string_view kinds, int64_t hidden,
    int64_t ffn, int64_t heads, double scale, double eps, bool pre_ln, c10::string_view activation, double dropout,
    double attn_dropout, double activation_dropout, bool causal, bool recompute) {
  const char* op = "lsmini::layer";
  const OpArgs a{kinds, activation, hidden, ffn, heads, scale, eps, dropout, attn_dropout, activation_dropout,
                 pre_ln, causal, recompute};
  const Options o = op_options(a, op);
  check_cuda(x, op, "x");
  const CallPlan& plan = checked_plan(a, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, op);
  c10::cuda::CUDAGuard guard(x.device());
  const auto body = [&](const Tensors& in) -> Tensors {
    const at::Tensor& xs = in[0];
    at::Tensor state = at::empty({plan.total}, xs.options().dtype(at::kByte));
    const std::vector<at::Tensor> weights = cast_weights(params, state, plan, xs.scalar_type(), true);
    auto [y, saved, rngs] = layer_fwd_impl(o, xs, given(in[1]), heads_of(given(in[2]), o), heads_of(given(in[3]), o),
                                           given(in[4]), weights, state, plan.offsets);
    // each created tensor as the plan says, since backward rebuilds it from the plan (layer_fwd_impl checked
    // that each is at its offset)
    LSMINI_CHECK(saved.size() == plan.slots.size(), op, ": ", saved.size(), " saved slots, the plan has ",
                 plan.slots.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      const SlotLayout& slot = plan.slots[i];
      LSMINI_CHECK((slot.kind == kLayoutNone) != saved[i].defined() &&
                       (slot.kind != kLayoutNew ||
                        (saved[i].sizes() == at::IntArrayRef(slot.shape) && saved[i].scalar_type() == slot.dtype)),
                   op, ": saved slot ", i, " does not match the plan");
    }
    philox_state_fwd(rngs, rng_rows(state, plan, int64_t(rngs.size())));
    return {y, state};
  };
  const Tensors out = through_graph(site_key('f', params, c10::cuda::getCurrentCUDAStream()), params, &plan, nullptr,
                                    {x, or_none(key_padding_mask), or_none(encoder_k), or_none(encoder_v),
                                     or_none(encoder_padding_mask)},
                                    body);
  return {out[0], out[1]};
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> layer_backward_op_cuda(
    const at::Tensor& grad, const at::Tensor& state, const at::Tensor& x, const OptTensor& key_padding_mask,
    const OptTensor& encoder_k, const OptTensor& encoder_v, const OptTensor& encoder_padding_mask,
    at::TensorList params, c10::string_view kinds, int64_t hidden, int64_t ffn, int64_t heads, double scale,
    double eps, bool pre_ln, c10::string_view activation, double dropout, double attn_dropout,
    double activation_dropout, bool causal, bool recompute) {
  const char* op = "lsmini::layer_backward";
  const OpArgs a{kinds, activation, hidden, ffn, heads, scale, eps, dropout, attn_dropout, activation_dropout,
                 pre_ln, causal, recompute};
  const Options o = op_options(a, op);
  check_cuda(grad, op, "grad");
  check_cuda(state, op, "state");
  const CallPlan& plan = checked_plan(a, x, key_padding_mask, encoder_k, encoder_v, encoder_padding_mask, params, op);
  c10::cuda::CUDAGuard guard(grad.device());
  LSMINI_CHECK(state.scalar_type() == at::kByte && state.dim() == 1 && state.is_contiguous() &&
                   state.numel() == plan.total,
               op, ": state must be the contiguous uint8 [", plan.total, "] tensor lsmini::layer returned, got ",
               state.scalar_type(), " ", state.sizes());
  const size_t n_apart = size_t(std::count(plan.grad_offsets.begin(), plan.grad_offsets.end(), int64_t(-1)));
  const auto body = [&](const Tensors& in) -> Tensors {
    const at::Tensor &g = in[0], &xs = in[1];
    const OptTensor ek = given(in[3]), ev = given(in[4]);
    // dK/dV [b, ls, H] each, as the keys and values came in; the kernels write them through heads views
    Tensors kv;
    if (ek) kv = {at::empty(ek->sizes(), ek->options()), at::empty(ev->sizes(), ev->options())};
    const OptTensor inputs[] = {xs.view({-1, o.hidden}), given(in[2]), heads_of(ek, o), heads_of(ev, o), given(in[5])};
    std::vector<OptTensor> saved(plan.slots.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      const SlotLayout& slot = plan.slots[i];
      if (slot.kind == kLayoutInput) saved[i] = inputs[slot.ref];
      if (slot.kind == kLayoutSame) saved[i] = saved[slot.ref];
      if (slot.kind == kLayoutNew) {  // its bytes of state, as layer_fwd_impl wrote them
        saved[i] = carve(state, plan.offsets[i], slot.dtype, slot.shape, op);
      }
    }
    const int64_t rows = 2 * int64_t(o.kinds.size());
    const auto* words = static_cast<const char*>(rng_rows(state, plan, rows).data_ptr());
    std::vector<PhiloxTuple> rngs;
    for (int64_t r = 0; r < rows; ++r) {
      rngs.push_back(
          {0, 0, reinterpret_cast<int64_t>(words + 16 * r), reinterpret_cast<int64_t>(words + 16 * r + 8)});
    }
    const at::Tensor scratch = at::empty({plan.scratch_numel}, g.options());
    const std::vector<at::Tensor> weights = cast_weights(params, state, plan, xs.scalar_type(), false);
    // the alignment gaps between gradients are never written: zeroed, the whole tensor is defined (opcheck
    // compares it); widths that are multiples of 64, as in every real model, leave no gaps and no extra kernel
    const at::TensorOptions grad_options = params[0].options().memory_format(at::MemoryFormat::Contiguous);
    at::Tensor grads = plan.grad_gaps ? at::zeros({plan.grad_numel}, grad_options)
                                      : at::empty({plan.grad_numel}, grad_options);
    std::vector<OptTensor> into(params.size());
    std::vector<at::ScalarType> dtypes;
    for (size_t i = 0; i < params.size(); ++i) {
      dtypes.push_back(params[i].scalar_type());
      if (plan.grad_offsets[i] >= 0) {
        into[i] = carve(grads, plan.grad_offsets[i] * int64_t(grads.element_size()), grads.scalar_type(),
                        params[i].sizes(), op);
      }
    }
    const OptTensor grad_k = kv.empty() ? OptTensor() : heads_of(kv[0], o);
    const OptTensor grad_v = kv.empty() ? OptTensor() : heads_of(kv[1], o);
    auto [grad_x, param_grads] =
        layer_bwd_impl(o, g, saved, rngs, weights, scratch, grad_k, grad_v, dtypes, into, false);
    Tensors out{grad_x, grads};  // then the gradients of the parameters the plan keeps out of grads, then kv
    for (size_t i = 0; i < params.size(); ++i) {
      if (plan.grad_offsets[i] < 0) out.push_back(param_grads[i]);
    }
    out.insert(out.end(), kv.begin(), kv.end());
    return out;
  };
  const Tensors out = through_graph(site_key('b', params, c10::cuda::getCurrentCUDAStream()), params, &plan,
                                    state.data_ptr(),
                                    {grad, x, or_none(key_padding_mask), or_none(encoder_k), or_none(encoder_v),
                                     or_none(encoder_padding_mask)},
                                    body);
  return {out[0], out[1], Tensors(out.begin() + 2, out.begin() + 2 + n_apart),
          Tensors(out.begin() + 2 + n_apart, out.end())};
}

void register_layer(py::module_& m) {
  m.def("layer_fwd", &layer_fwd,
        "One layer's whole forward (lsmini.layers.blocks, kernel path): (y [b, l, H], saved, rngs) for layer_bwd; "
        "the saved tensors as views of state (uint8) at offsets (bytes per slot, -1: not there) when given",
        py::arg("options"), py::arg("x"), py::arg("key_padding_mask"), py::arg("encoder_k"), py::arg("encoder_v"),
        py::arg("encoder_padding_mask"), py::arg("params"), py::arg("state") = py::none(),
        py::arg("offsets") = std::vector<int64_t>());
  m.def("layer_bwd", &layer_bwd,
        "One layer's whole backward from layer_fwd's saved state: (grad_x [b, l, H], parameter gradients in "
        "param_dtypes); a cross block's dK/dV go into grad_encoder_k/grad_encoder_v; a parameter with a tensor in "
        "grad_into gets its gradient added there (add_into) or written there (and None returned)",
        py::arg("options"), py::arg("grad"), py::arg("saved"), py::arg("rngs"), py::arg("params"), py::arg("scratch"),
        py::arg("grad_encoder_k"), py::arg("grad_encoder_v"), py::arg("param_dtypes"), py::arg("grad_into"),
        py::arg("add_into") = true);
  m.attr("layer_saved_slots") = int(kSlots);
  m.def("set_layer_graphs", &set_layer_graphs,
        "Whether the lsmini::layer operators replay a CUDA graph per call site once its plan repeats (default "
        "on; off also drops every graph); returns the previous setting",
        py::arg("on"));
  m.def("layer_graph_counts", &layer_graph_counts,
        "(graphs captured, replays, calls run eagerly because a replay would have overwritten outputs held "
        "elsewhere) of the lsmini::layer operators so far, in this process");
  m.def("set_layer_planner", &set_layer_planner,
        "The Python function (lsmini.layers.compiled.cpp_plan) the lsmini::layer operators' CUDA kernels ask for "
        "a call's layout, once per options and shapes", py::arg("planner"));
}

}  // namespace

LSMINI_REGISTER_OPS(register_layer);

// The schemas are lsmini/layers/compiled.py's (torch.library.define); these kernels serve them on CUDA.
TORCH_LIBRARY_IMPL(lsmini, CUDA, m) {
  m.impl("layer", TORCH_FN(layer_op_cuda));
  m.impl("layer_backward", TORCH_FN(layer_backward_op_cuda));
}

}  // namespace lsmini
