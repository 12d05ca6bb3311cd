// Attention softmax bindings: attention_softmax_fwd / attention_softmax_bwd (kernels in
// csrc/kernels/attention_softmax.cu). rng: the 4-tuple of lsmini._backend.philox_seed_offset() (common.h's
// PhiloxTuple), ignored when p == 0.
#include "common.h"
#include "attention_softmax.h"

#include <cstdint>
#include <tuple>

namespace lsmini {
namespace {

constexpr int64_t kMaxRows = INT32_MAX;  // the kernels index rows with int

void check_scores(const at::Tensor& t, const char* op, const char* name) {
  check_cuda(t, op, name);
  check_float_dtype(t, op, name);
  LSMINI_CHECK(t.dim() == 4, op, ": ", name, " must be 4-D [batch, heads, q_len, k_len], got shape ", t.sizes());
  LSMINI_CHECK(t.size(3) <= kAttentionSoftmaxMaxKeys, op, ": k_len (last dim of ", name, ") must be at most ",
              kAttentionSoftmaxMaxKeys, ", got ", t.size(3));
  const int64_t rows = t.size(0) * t.size(1) * t.size(2);
  LSMINI_CHECK(rows <= kMaxRows, op, ": batch*heads*q_len must be at most ", kMaxRows, ", got ", rows);
}

void check_p(double p, const char* op) {
  LSMINI_CHECK(p >= 0.0 && p <= 1.0, op, ": dropout p must be in [0, 1], got ", p);
}

// Returns (probs, softmax): the dropped probabilities and the pre-dropout softmax. Without dropout
// both are the same tensor (one allocation).
std::tuple<at::Tensor, at::Tensor> attention_softmax_fwd(const at::Tensor& scores_in,
                                                         const c10::optional<at::Tensor>& mask_in, bool causal,
                                                         double p, const PhiloxTuple& rng) {
  const char* op = "attention_softmax_fwd";
  check_scores(scores_in, op, "scores");
  check_p(p, op);
  const PhiloxArgs philox = philox_args(rng, op);
  const int64_t batch = scores_in.size(0), heads = scores_in.size(1), q_len = scores_in.size(2),
                k_len = scores_in.size(3);
  if (mask_in.has_value()) {
    const at::Tensor& m = mask_in.value();
    check_like(m, scores_in, at::kBool, {batch, k_len}, op, "key_padding_mask", "scores");
  }
  c10::cuda::CUDAGuard guard(scores_in.device());
  const at::Tensor scores = scores_in.contiguous();
  at::Tensor mask;
  if (mask_in.has_value()) {
    mask = mask_in->contiguous();
    // A sliced mask may start off a 16-byte boundary, which would push the kernel onto its scalar
    // path; a fresh copy of [batch, k_len] bytes is cheap next to the scores.
    if (reinterpret_cast<uintptr_t>(mask.data_ptr()) % 16 != 0) mask = mask.clone();
  }
  const float pf = static_cast<float>(p);
  const bool dropout = pf > 0.f;
  at::Tensor softmax = at::empty_like(scores);
  at::Tensor probs = dropout ? at::empty_like(scores) : softmax;
  const uint8_t* mask_ptr = mask.defined() ? reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()) : nullptr;
  dispatch_float(scores.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    const cudaError_t err = launch_attention_softmax_fwd<K>(
        kptr<scalar_t>(scores), mask_ptr, kptr<scalar_t>(softmax), dropout ? kptr<scalar_t>(probs) : nullptr, batch,
        heads, q_len, k_len, causal, pf, philox, current_stream());
    check_launch(err, op);
  });
  return {probs, softmax};
}

// grad_scores from grad_probs and the saved pre-dropout softmax; the dropout mask is regenerated
// from (p, rng). inplace: the result overwrites grad_probs (which must be contiguous) and
// grad_probs itself is returned.
at::Tensor attention_softmax_bwd(const at::Tensor& grad_probs, const at::Tensor& softmax_in, double p,
                                 const PhiloxTuple& rng, bool inplace) {
  const char* op = "attention_softmax_bwd";
  check_scores(softmax_in, op, "softmax");
  check_like(grad_probs, softmax_in, softmax_in.scalar_type(), softmax_in.sizes(), op, "grad_probs", "softmax");
  check_p(p, op);
  const PhiloxArgs philox = philox_args(rng, op);
  LSMINI_CHECK(!inplace || grad_probs.is_contiguous(), op,
              ": inplace=True writes into grad_probs, which must then be contiguous, got strides ",
              grad_probs.strides());
  c10::cuda::CUDAGuard guard(softmax_in.device());
  const at::Tensor softmax = softmax_in.contiguous();
  const at::Tensor grad = inplace ? grad_probs : grad_probs.contiguous();
  at::Tensor grad_scores = inplace ? grad_probs : at::empty_like(softmax);
  const int64_t k_len = softmax.size(3);
  const int64_t rows = k_len > 0 ? softmax.numel() / k_len : 0;
  dispatch_float(softmax.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    const cudaError_t err =
        launch_attention_softmax_bwd<K>(kptr<scalar_t>(grad), kptr<scalar_t>(softmax), kptr<scalar_t>(grad_scores),
                                        rows, k_len, static_cast<float>(p), philox, current_stream());
    check_launch(err, op);
  });
  return grad_scores;
}

void register_attention_softmax(pybind11::module_& m) {
  m.def("attention_softmax_fwd", &attention_softmax_fwd,
        "Masked softmax over the keys + dropout: (probs, softmax); one tensor twice when p == 0",
        pybind11::arg("scores"), pybind11::arg("key_padding_mask"), pybind11::arg("causal"), pybind11::arg("p"),
        pybind11::arg("rng"));
  m.def("attention_softmax_bwd", &attention_softmax_bwd,
        "Backward of attention_softmax_fwd: grad_scores (written into grad_probs when inplace)",
        pybind11::arg("grad_probs"), pybind11::arg("softmax"), pybind11::arg("p"), pybind11::arg("rng"),
        pybind11::arg("inplace") = false);
}

}  // namespace

LSMINI_REGISTER_OPS(register_attention_softmax);

}  // namespace lsmini
