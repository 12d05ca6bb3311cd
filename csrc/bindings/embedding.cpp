// Bindings of the fused token embedding (csrc/kernels/embedding.cu):
//   embedding_fwd(tokens, weight, pos_table, scale, padding_idx, step, dropout_p, rng) -> out
//   embedding_bwd(grad_out, tokens, vocab, max_positions, need_weight_grad, need_pos_grad, scale,
//                 padding_idx, step, dropout_p, rng, weight_grad_into=None) -> (grad_weight | None, grad_pos | None)
// With weight_grad_into (a contiguous [vocab, hidden] tensor in grad_out's dtype, e.g. the table's .grad) the
// token-table gradient is added into it and grad_weight is None.
// rng: the 4-tuple of lsmini._backend.philox_seed_offset() (common.h's PhiloxTuple), ignored when
// dropout_p == 0.
// padding_idx = -1 means "no padding token". Token ids outside [0, vocab) are skipped by the kernels
// (zero output, no gradient); raising for them is the Python op's job (it costs a host sync).
#include "common.h"
#include "embedding.h"

namespace lsmini {
namespace {

void check_tokens(const at::Tensor& tokens, const char* op) {
  check_cuda(tokens, op, "tokens");
  const auto s = tokens.scalar_type();
  LSMINI_CHECK(s == at::kLong || s == at::kInt, op, ": tokens must be int64 or int32, got ", s);
  LSMINI_CHECK(tokens.dim() == 2, op, ": tokens must be 2-D [batch, len], got shape ", tokens.sizes());
}

void check_common_params(const char* op, int64_t vocab, int64_t padding_idx, double dropout_p) {
  LSMINI_CHECK(padding_idx >= -1 && padding_idx < vocab, op, ": padding_idx must be -1 (none) or in [0, ", vocab,
              "), got ", padding_idx);
  LSMINI_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, op, ": dropout_p must be in [0, 1], got ", dropout_p);
}

void check_positions(const char* op, int64_t step, int64_t len, int64_t max_positions) {
  LSMINI_CHECK(step >= 0, op, ": step must be >= 0, got ", step);
  LSMINI_CHECK(step + len <= max_positions, op, ": step + len = ", step, " + ", len, " = ", step + len,
              " exceeds max_positions = ", max_positions, " (rows of pos_table)");
}

// Calls f(IdT{}) with IdT the kernel type of the token ids.
template <typename F>
void dispatch_ids(at::ScalarType s, F&& f) {
  if (s == at::kLong) {
    f(int64_t{});
  } else {
    f(int32_t{});
  }
}

at::Tensor embedding_fwd(const at::Tensor& tokens_in, const at::Tensor& weight_in, const at::Tensor& pos_in,
                         double scale, int64_t padding_idx, int64_t step, double dropout_p,
                         const PhiloxTuple& rng) {
  const char* op = "embedding_fwd";
  check_tokens(tokens_in, op);
  check_cuda(weight_in, op, "weight");
  check_float_dtype(weight_in, op, "weight");
  LSMINI_CHECK(weight_in.dim() == 2, op, ": weight must be 2-D [vocab, hidden], got shape ", weight_in.sizes());
  check_cuda(pos_in, op, "pos_table");
  check_dtype(pos_in, weight_in.scalar_type(), op, "pos_table");
  LSMINI_CHECK(pos_in.dim() == 2 && pos_in.size(1) == weight_in.size(1), op,
              ": pos_table must have shape [max_positions, ", weight_in.size(1), "], got ", pos_in.sizes());
  check_same_device(tokens_in, weight_in, op, "tokens", "weight");
  check_same_device(pos_in, weight_in, op, "pos_table", "weight");
  const int64_t batch = tokens_in.size(0), len = tokens_in.size(1);
  const int64_t vocab = weight_in.size(0), hidden = weight_in.size(1);
  check_common_params(op, vocab, padding_idx, dropout_p);
  check_positions(op, step, len, pos_in.size(0));
  const PhiloxArgs philox = philox_args(rng, op);

  c10::cuda::CUDAGuard guard(weight_in.device());
  const at::Tensor tokens = tokens_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor pos = pos_in.contiguous();
  at::Tensor out = at::empty({batch, len, hidden}, weight.options());
  if (out.numel() == 0) return out;

  cudaError_t err = cudaSuccess;
  dispatch_float(weight.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_ids(tokens.scalar_type(), [&](auto id_tag) {
      using token_t = decltype(id_tag);
      err = launch_embedding_fwd(kptr<scalar_t>(out), tokens.data_ptr<token_t>(), kptr<scalar_t>(weight),
                                 kptr<scalar_t>(pos), batch, len, hidden, vocab, step, static_cast<float>(scale),
                                 padding_idx, static_cast<float>(dropout_p), philox, current_stream());
    });
  });
  check_launch(err, op);
  return out;
}

std::tuple<at::Tensor, at::Tensor> embedding_bwd(const at::Tensor& grad_in, const at::Tensor& tokens_in,
                                                 int64_t vocab, int64_t max_positions, bool need_weight_grad,
                                                 bool need_pos_grad, double scale, int64_t padding_idx, int64_t step,
                                                 double dropout_p, const PhiloxTuple& rng,
                                                 const std::optional<at::Tensor>& weight_grad_into) {
  const char* op = "embedding_bwd";
  check_tokens(tokens_in, op);
  check_cuda(grad_in, op, "grad_out");
  check_float_dtype(grad_in, op, "grad_out");
  check_same_device(grad_in, tokens_in, op, "grad_out", "tokens");
  const int64_t batch = tokens_in.size(0), len = tokens_in.size(1);
  LSMINI_CHECK(grad_in.dim() == 3 && grad_in.size(0) == batch && grad_in.size(1) == len, op,
              ": grad_out must have shape [", batch, ", ", len, ", hidden], got ", grad_in.sizes());
  LSMINI_CHECK(vocab >= 0 && vocab < (int64_t{1} << 32), op, ": vocab must be in [0, 2^32), got ", vocab);
  LSMINI_CHECK(!need_weight_grad || batch * len < (int64_t{1} << 31), op,
               ": the token-table gradient takes at most 2^31 - 1 tokens a call, got ", batch * len);
  check_common_params(op, vocab, padding_idx, dropout_p);
  check_positions(op, step, len, max_positions);
  const PhiloxArgs philox = philox_args(rng, op);
  const int64_t hidden = grad_in.size(2), rows = batch * len;
  if (weight_grad_into) {
    const at::Tensor& into = *weight_grad_into;
    LSMINI_CHECK(need_weight_grad, op, ": weight_grad_into given with need_weight_grad false");
    check_cuda(into, op, "weight_grad_into");
    check_dtype(into, grad_in.scalar_type(), op, "weight_grad_into");
    check_same_device(grad_in, into, op, "grad_out", "weight_grad_into");
    LSMINI_CHECK(into.dim() == 2 && into.size(0) == vocab && into.size(1) == hidden && into.is_contiguous(), op,
                 ": weight_grad_into must be a contiguous [", vocab, ", ", hidden, "] tensor, got shape ",
                 into.sizes(), into.is_contiguous() ? "" : " (not contiguous)");
  }

  c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous();
  const auto f32 = grad.options().dtype(at::kFloat);
  at::Tensor grad_weight, grad_pos;
  cudaError_t err = cudaSuccess;

  if (need_weight_grad) {
    // the kernels add into the table: the caller's gradient, or zeros (rows of ids that do not occur stay zero)
    const at::Tensor table = weight_grad_into ? *weight_grad_into : at::zeros({vocab, hidden}, grad.options());
    if (rows > 0 && hidden > 0 && vocab > 0) {
      const auto bytes = static_cast<int64_t>(embedding_bwd_scratch_bytes(rows, hidden, vocab));
      at::Tensor scratch = at::empty({bytes}, grad.options().dtype(at::kByte));
      dispatch_float(grad.scalar_type(), op, [&](auto tag) {
        using scalar_t = decltype(tag);
        dispatch_ids(tokens.scalar_type(), [&](auto id_tag) {
          using token_t = decltype(id_tag);
          err = launch_embedding_bwd(kptr<scalar_t>(table), scratch.data_ptr(), kptr<scalar_t>(grad),
                                     tokens.data_ptr<token_t>(), rows, hidden, vocab, static_cast<float>(scale),
                                     padding_idx, static_cast<float>(dropout_p), philox, current_stream());
        });
      });
      check_launch(err, op);
    }
    if (!weight_grad_into) grad_weight = table;
  }

  if (need_pos_grad) {
    grad_pos = at::zeros({max_positions, hidden}, grad.options());
    if (rows > 0 && hidden > 0) {
      const int64_t splits = embedding_pos_bwd_splits(batch, len);
      at::Tensor partials = splits > 1 ? at::empty({splits * len * hidden}, f32) : at::Tensor();
      dispatch_float(grad.scalar_type(), op, [&](auto tag) {
        using scalar_t = decltype(tag);
        dispatch_ids(tokens.scalar_type(), [&](auto id_tag) {
          using token_t = decltype(id_tag);
          err = launch_embedding_pos_bwd(kptr<scalar_t>(grad_pos),
                                         partials.defined() ? partials.data_ptr<float>() : nullptr,
                                         kptr<scalar_t>(grad), tokens.data_ptr<token_t>(), batch, len, hidden, vocab,
                                         step, padding_idx, static_cast<float>(dropout_p), philox, current_stream());
        });
      });
      check_launch(err, "embedding_bwd (positions)");
    }
  }
  return {grad_weight, grad_pos};
}

void register_embedding(pybind11::module_& m) {
  m.def("embedding_fwd", &embedding_fwd, "fused token embedding: dropout(scale * weight[tokens] + pos_table[step:])",
        pybind11::arg("tokens"), pybind11::arg("weight"), pybind11::arg("pos_table"), pybind11::arg("scale"),
        pybind11::arg("padding_idx"), pybind11::arg("step"), pybind11::arg("dropout_p"), pybind11::arg("rng"));
  m.def("embedding_bwd", &embedding_bwd, "gradients of embedding_fwd: (grad_weight | None, grad_pos | None)",
        pybind11::arg("grad_out"), pybind11::arg("tokens"), pybind11::arg("vocab"), pybind11::arg("max_positions"),
        pybind11::arg("need_weight_grad"), pybind11::arg("need_pos_grad"), pybind11::arg("scale"),
        pybind11::arg("padding_idx"), pybind11::arg("step"), pybind11::arg("dropout_p"), pybind11::arg("rng"),
        pybind11::arg("weight_grad_into") = std::nullopt);
}

}  // namespace

LSMINI_REGISTER_OPS(register_embedding);

}  // namespace lsmini
