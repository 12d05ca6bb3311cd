// Fused attention bindings: attention_fwd / attention_bwd (kernels in csrc/kernels/attention*.cu).
// q [b, h, lq, d], k and v [b, hk, lk, d] (hk dividing h: grouped-query attention) in any strides whose last
// one is 1 (others are copied): the layers pass views into their fused projections. rng: the 4-tuple of
// lsmini._backend.dropout_rng.
#include "common.h"
#include "attention.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <tuple>

namespace lsmini {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

// The kernels read rows with 16-byte loads: the last stride 1, the others multiples of 8 elements, the
// start 16-byte aligned.
bool kernel_layout(const at::Tensor& t) {
  return t.stride(3) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0 &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

at::Tensor readable(const at::Tensor& t) { return kernel_layout(t) ? t : t.contiguous(); }

// The supported head dims as a message spells them: "16, 32, 64 or 128".
std::string supported_head_dims() {
  std::string text;
  const size_t count = std::size(kAttentionHeadDims);
  for (size_t i = 0; i < count; ++i) {
    if (i > 0) text += i + 1 == count ? " or " : ", ";
    text += std::to_string(kAttentionHeadDims[i]);
  }
  return text;
}

// Whether the memory from the first to the last element of a and of b intersects. Coarser than
// at::get_overlap_status where it matters (views that interleave without sharing an element count), but it
// answers for the strided head views the layers pass, where get_overlap_status gives up ("too hard").
bool spans_intersect(const at::Tensor& a, const at::Tensor& b) {
  if (!a.storage().is_alias_of(b.storage())) return false;
  auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const char* first = static_cast<const char*>(t.data_ptr());
    return std::pair{first, first + (last + 1) * t.element_size()};
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

template <typename U>
Strided<U> strided(const at::Tensor& t) {
  return {reinterpret_cast<U*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

void check_operand(const at::Tensor& t, const at::Tensor& q, const char* op, const char* name) {
  check_cuda(t, op, name);
  check_same_device(t, q, op, name, "q");
  LSMINI_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": ", name,
              " must be float16 or bfloat16, got ", t.scalar_type());
  check_dtype(t, q.scalar_type(), op, name);
  LSMINI_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D [batch, heads, len, head_dim], got shape ", t.sizes());
}

struct Dims {
  int64_t b, h, hk, lq, lk, d;
};

// Checks q/k/v (and the mask) and returns their sizes.
Dims check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const std::optional<at::Tensor>& mask, double p, double scale, const char* op) {
  check_operand(q, q, op, "q");
  check_operand(k, q, op, "k");
  check_operand(v, q, op, "v");
  const Dims s{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  LSMINI_CHECK(s.hk >= 1 && s.h % s.hk == 0, op, ": k's heads (", s.hk, ") must divide q's heads (", s.h,
               "), got q ", q.sizes(), " and k ", k.sizes());
  check_shape(k, {s.b, s.hk, s.lk, s.d}, op, "k");
  check_shape(v, {s.b, s.hk, s.lk, s.d}, op, "v");
  LSMINI_CHECK(attention_supports_head_dim(int(s.d)), op, ": head_dim must be ", supported_head_dims(), ", got ", s.d);
  LSMINI_CHECK(s.b >= 1 && s.h >= 1 && s.lq >= 1 && s.lk >= 1, op, ": q and k must be non-empty, got q ",
              q.sizes(), " and k ", k.sizes());
  LSMINI_CHECK(s.lq <= kMaxInt && s.lk <= kMaxInt && s.b * s.h * ((std::max(s.lq, s.lk) + 63) / 64) <= kMaxInt, op,
              ": too many rows for the kernels' 32-bit grid: q ", q.sizes(), ", k ", k.sizes());
  LSMINI_CHECK(p >= 0.0 && p <= 1.0, op, ": dropout p must be in [0, 1], got ", p);
  // The kernels scale the scores by scale·log2(e) in float32 with denormals flushed: it must be a normal float.
  LSMINI_CHECK(scale > 0.0 && std::isnormal(static_cast<float>(scale * 1.4426950408889634)), op,
               ": scale must be positive and at most about 2e38, its product with log2(e) a normal float32 "
               "(at least about 8e-39), got ", scale);
  if (mask.has_value() && mask->defined()) {
    check_like(*mask, q, at::kBool, {s.b, s.lk}, op, "key_padding_mask", "q");
  }
  return s;
}

template <typename K>
AttentionArgs<K> make_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                           const Dims& s, bool causal, double p, double scale, const PhiloxTuple& rng, const char* op) {
  AttentionArgs<K> a{};
  a.q = strided<const K>(q);
  a.k = strided<const K>(k);
  a.v = strided<const K>(v);
  a.key_padding_mask = mask.defined() ? reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()) : nullptr;
  a.batch = int(s.b);
  a.heads = int(s.h);
  a.kv_heads = int(s.hk);
  a.q_len = int(s.lq);
  a.k_len = int(s.lk);
  a.head_dim = int(s.d);
  a.scale = static_cast<float>(scale);
  a.causal = causal;
  a.dropout_p = static_cast<float>(p);
  a.rng = philox_args(rng, op);
  return a;
}

// Calls f(scalar_t{}) with scalar_t ∈ {at::Half, at::BFloat16}.
template <typename F>
void dispatch_half(at::ScalarType s, F&& f) {
  if (s == at::kHalf) {
    f(at::Half{});
  } else {
    f(at::BFloat16{});
  }
}

at::Tensor contiguous_mask(const std::optional<at::Tensor>& mask) {
  return mask.has_value() && mask->defined() ? mask->contiguous() : at::Tensor();
}

// A gradient output: the caller's tensor (checked, written in place) or a fresh one like `like`.
at::Tensor grad_output(const std::optional<at::Tensor>& given, const at::Tensor& like, const char* op,
                       const char* name) {
  if (!(given.has_value() && given->defined())) return at::empty_like(like, at::MemoryFormat::Contiguous);
  const at::Tensor& t = *given;
  check_like(t, like, like.scalar_type(), like.sizes(), op, name, "q");
  LSMINI_CHECK(kernel_layout(t), op, ": ", name,
               " is written in place, so it needs the kernels' layout (last stride 1,",
               " other strides multiples of 8 elements, 16-byte aligned start), got strides ", t.strides());
  return t;
}

// The keep-bits buffer of a call with dropout (attention.h's AttentionArgs::keep), checked; null without
// one, or when nothing is dropped.
uint32_t* keep_words(const std::optional<at::Tensor>& keep, const at::Tensor& q, const Dims& s, double p,
                     const char* op) {
  if (!(keep.has_value() && keep->defined())) return nullptr;
  const at::Tensor& t = *keep;
  check_cuda(t, op, "keep");
  check_same_device(t, q, op, "keep", "q");
  check_dtype(t, at::kInt, op, "keep");
  const int64_t numel = attention_keep_numel(s.b, s.h, s.lq, s.lk);
  LSMINI_CHECK(t.dim() == 1 && t.numel() == numel && t.is_contiguous(), op,
               ": keep must be a contiguous int32 [", numel, "] tensor (lsmini.ops.attention.keep_numel) for q ",
               q.sizes(), " and k_len ", s.lk, ", got shape ", t.sizes());
  return p > 0.0 ? reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>()) : nullptr;
}

}  // namespace

// (out, lse): out [b, h, lq, d] as a view of a contiguous [b, lq, h, d] buffer (the merged-heads layout);
// lse [b, h, lq] float32. With `keep`, the dropout keep bits go there too.
std::tuple<at::Tensor, at::Tensor> attention_fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in, const std::optional<at::Tensor>& mask_in,
                                                 bool causal, double p, double scale, const PhiloxTuple& rng,
                                                 const std::optional<at::Tensor>& keep,
                                                 const std::optional<at::Tensor>& out_in,
                                                 const std::optional<at::Tensor>& lse_in) {
  const char* op = "attention_fwd";
  const Dims s = check_qkv(q_in, k_in, v_in, mask_in, p, scale, op);
  if (out_in) {
    check_operand(*out_in, q_in, op, "out");
    check_shape(*out_in, q_in.sizes(), op, "out");
    LSMINI_CHECK(kernel_layout(*out_in), op, ": out must have head_dim contiguous, its other strides multiples of 8 "
                 "and a 16-byte aligned start, got strides ", out_in->strides());
    for (const auto& [t, name] : {std::pair<const at::Tensor*, const char*>{&q_in, "q"}, {&k_in, "k"}, {&v_in, "v"}}) {
      LSMINI_CHECK(!spans_intersect(*out_in, *t), op, ": out overlaps ", name);
    }
  }
  if (lse_in) {
    check_like(*lse_in, q_in, at::kFloat, {s.b, s.h, s.lq}, op, "lse", "q");
    LSMINI_CHECK(lse_in->is_contiguous(), op, ": lse must be contiguous, got strides ", lse_in->strides());
  }
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in), mask = contiguous_mask(mask_in);
  at::Tensor out = out_in ? *out_in : at::empty({s.b, s.lq, s.h, s.d}, q.options()).transpose(1, 2);
  at::Tensor lse = lse_in ? *lse_in : at::empty({s.b, s.h, s.lq}, q.options().dtype(at::kFloat));
  dispatch_half(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    AttentionArgs<K> a = make_args<K>(q, k, v, mask, s, causal, p, scale, rng, op);
    a.out = strided<K>(out);
    a.lse = lse.data_ptr<float>();
    a.keep = keep_words(keep, q, s, p, op);
    check_launch(launch_attention_fwd<K>(a, current_stream()), op);
  });
  return {out, lse};
}

// (dq, dk, dv), written into the given tensors when passed. With `keep` (the forward's, same call
// arguments), the dropout bits are read from it instead of drawn again: the same bits, fewer instructions.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const std::optional<at::Tensor>& mask_in, bool causal, double p,
    double scale, const PhiloxTuple& rng, const std::optional<at::Tensor>& dq_in,
    const std::optional<at::Tensor>& dk_in, const std::optional<at::Tensor>& dv_in,
    const std::optional<at::Tensor>& keep, const BackwardRoom& room, const RotaryTables* rotary) {
  const char* op = "attention_bwd";
  const Dims s = check_qkv(q_in, k_in, v_in, mask_in, p, scale, op);
  if (rotary != nullptr) {
    const at::Tensor &cos = rotary->cos, &sin = rotary->sin;
    LSMINI_CHECK(s.lq == s.lk, op, ": rotary positions need q_len == k_len, got ", s.lq, " and ", s.lk);
    for (const at::Tensor* t : {&cos, &sin}) {
      LSMINI_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && (t->size(0) == 1 || t->size(0) == s.b) &&
                       t->size(1) == s.lq && t->size(2) % 2 == 0 && t->size(2) >= 2 && t->size(2) <= s.d &&
                       t->stride(2) == 1 && t->device() == q_in.device(),
                   op, ": rotary tables must be float32 [1 or batch, len, even rot_dim <= head_dim] on q's device "
                   "with a unit last stride, got ", t->scalar_type(), " ", t->sizes());
    }
    LSMINI_CHECK(cos.sizes() == sin.sizes() && cos.strides() == sin.strides(), op,
                 ": rotary cos and sin must have the same shape and strides, got ", cos.sizes(), " and ", sin.sizes());
  }
  check_operand(out_in, q_in, op, "out");
  check_operand(dout_in, q_in, op, "dout");
  check_shape(out_in, q_in.sizes(), op, "out");
  check_shape(dout_in, q_in.sizes(), op, "dout");
  check_like(lse_in, q_in, at::kFloat, {s.b, s.h, s.lq}, op, "lse", "q");
  c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = readable(q_in), k = readable(k_in), v = readable(v_in), out = readable(out_in),
                   dout = readable(dout_in), lse = lse_in.contiguous(), mask = contiguous_mask(mask_in);
  at::Tensor dq = grad_output(dq_in, q, op, "dq"), dk = grad_output(dk_in, k, op, "dk"),
             dv = grad_output(dv_in, v, op, "dv");
  at::Tensor delta = float_temp(room.workspace, s.b * s.h, s.lq, lse, op);
  dispatch_half(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    AttentionArgs<K> a = make_args<K>(q, k, v, mask, s, causal, p, scale, rng, op);
    // the forward's output is only read
    a.out = strided<K>(out);
    a.dout = strided<const K>(dout);
    a.dq = strided<K>(dq);
    a.dk = strided<K>(dk);
    a.dv = strided<K>(dv);
    a.lse = lse.data_ptr<float>();
    a.delta = delta.data_ptr<float>();
    a.keep = keep_words(keep, q, s, p, op);
    if (rotary != nullptr) {
      const at::Tensor& cos = rotary->cos;
      a.rot = {cos.data_ptr<float>(), rotary->sin.data_ptr<float>(), cos.size(0) == 1 ? 0 : cos.stride(0),
               cos.stride(1), int(cos.size(2))};
    }
    check_launch(launch_attention_bwd<K>(a, current_stream()), op);
  });
  return {dq, dk, dv};
}

namespace {

void register_attention(pybind11::module_& m) {
  m.def("attention_fwd", &attention_fwd,
        "Fused attention forward: (out [b, h, lq, d] over a [b, lq, h, d] buffer, lse [b, h, lq] float32); into "
        "out / lse when given",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("key_padding_mask"),
        pybind11::arg("causal"), pybind11::arg("p"), pybind11::arg("scale"), pybind11::arg("rng"),
        pybind11::arg("keep") = pybind11::none(), pybind11::arg("out") = pybind11::none(),
        pybind11::arg("lse") = pybind11::none());
  m.def("attention_bwd",
        [](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
           const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask, bool causal, double p,
           double scale, const PhiloxTuple& rng, const std::optional<at::Tensor>& dq,
           const std::optional<at::Tensor>& dk, const std::optional<at::Tensor>& dv,
           const std::optional<at::Tensor>& keep) {
          return attention_bwd(dout, q, k, v, out, lse, key_padding_mask, causal, p, scale, rng, dq, dk, dv, keep);
        },
        "Fused attention backward: (dq, dk, dv), into dq/dk/dv when given",
        pybind11::arg("dout"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("lse"), pybind11::arg("key_padding_mask"), pybind11::arg("causal"), pybind11::arg("p"),
        pybind11::arg("scale"), pybind11::arg("rng"), pybind11::arg("dq") = pybind11::none(),
        pybind11::arg("dk") = pybind11::none(), pybind11::arg("dv") = pybind11::none(),
        pybind11::arg("keep") = pybind11::none());
  m.def("attention_sm90_available", &attention_sm90_available,
        "Whether this build holds the Hopper attention kernels (wgmma, head dims 64 and 128) and the current "
        "device (compute capability 9.0) runs them");
  m.def("set_attention_sm90", &set_attention_sm90,
        "Let fused attention use the Hopper kernels where available (True, the default) or not; returns the "
        "previous setting",
        pybind11::arg("enabled"));
}

}  // namespace

LSMINI_REGISTER_OPS(register_attention);

}  // namespace lsmini
