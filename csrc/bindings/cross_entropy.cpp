// Cross-entropy bindings: cross_entropy_fwd / cross_entropy_bwd (kernels in csrc/kernels/cross_entropy.cu).
// The per-row outputs are fp32; reductions (mean/sum) happen in Python on these [rows] tensors.
#include "common.h"
#include "cross_entropy.h"

namespace lsmini {
namespace {

void check_logits(const at::Tensor& logits, const char* op) {
  check_cuda(logits, op, "logits");
  check_float_dtype(logits, op, "logits");
  LSMINI_CHECK(logits.dim() == 2, op, ": logits must be 2-D [rows, vocab], got ", logits.dim(), " dims (shape ",
              logits.sizes(), ")");
  LSMINI_CHECK(logits.size(1) >= 1 && logits.size(1) <= kCrossEntropyMaxVocab, op, ": vocab size (logits.size(1)) ",
              "must be in [1, ", kCrossEntropyMaxVocab, "], got ", logits.size(1));
}

// What the kernels read: rows of contiguous elements at one row stride ≥ vocab, so that a view of wider rows
// (linear_cross_entropy's logits against a weight padded for aligned GEMMs) needs no copy. A lone row or a
// single column has no stride that matters.
bool has_row_major(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) && (t.size(0) <= 1 || t.stride(0) >= t.size(1));
}
at::Tensor row_major(const at::Tensor& t) { return has_row_major(t) ? t : t.contiguous(); }
int64_t row_stride(const at::Tensor& t) { return t.size(0) <= 1 ? t.size(1) : t.stride(0); }

void check_rows(const at::Tensor& t, const at::Tensor& logits, at::ScalarType dtype, const char* op,
                const char* name) {
  check_like(t, logits, dtype, {logits.size(0)}, op, name, "logits");
}

void check_smoothing(double label_smoothing, const char* op) {
  LSMINI_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing must be in [0, 1], got ",
              label_smoothing);
}

// Returns (loss_rows, nll_rows, lse), fp32 [rows]; rows whose target is ignore_index hold 0, rows
// whose target is out of range hold NaN (no bounds check here: that is the caller's sync-costing job).
// With grad_rows (fp32 [rows]) the kernel also writes cross_entropy_bwd's gradient for them over the logits,
// in place (their rows must be contiguous), right after each row's lse.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_fwd(const at::Tensor& logits_in,
                                                                 const at::Tensor& target_in,
                                                                 double label_smoothing, int64_t ignore_index,
                                                                 const std::optional<at::Tensor>& grad_rows_in) {
  const char* op = "cross_entropy_fwd";
  check_logits(logits_in, op);
  check_rows(target_in, logits_in, at::kLong, op, "target");
  check_smoothing(label_smoothing, op);
  if (grad_rows_in) {
    check_rows(*grad_rows_in, logits_in, at::kFloat, op, "grad_rows");
    LSMINI_CHECK(has_row_major(logits_in), op,
                ": grad_rows needs logits with contiguous rows (the gradient is written over them), got strides ",
                logits_in.strides());
  }
  c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = row_major(logits_in);
  const at::Tensor target = target_in.contiguous();
  const at::Tensor grad_rows = grad_rows_in ? grad_rows_in->contiguous() : at::Tensor();
  const int64_t rows = logits.size(0);
  const int vocab = static_cast<int>(logits.size(1));
  const at::TensorOptions f32 = logits.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({rows}, f32);
  at::Tensor nll = at::empty({rows}, f32);
  at::Tensor lse = at::empty({rows}, f32);
  dispatch_float(logits.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    check_launch(launch_cross_entropy_fwd(kptr<scalar_t>(logits), target.data_ptr<int64_t>(), loss.data_ptr<float>(),
                                          nll.data_ptr<float>(), lse.data_ptr<float>(),
                                          grad_rows.defined() ? grad_rows.data_ptr<float>() : nullptr, rows, vocab,
                                          row_stride(logits), static_cast<float>(label_smoothing), ignore_index,
                                          current_stream()),
                 op);
  });
  return {loss, nll, lse};
}

// Returns grad_logits [rows, vocab] in logits' dtype: grad_rows[r]·(softmax − smoothed one-hot), zero
// rows for ignore_index, contiguous. inplace: written into logits' own storage (its rows must be contiguous)
// and logits itself is returned.
at::Tensor cross_entropy_bwd(const at::Tensor& grad_rows_in, const at::Tensor& logits_in, const at::Tensor& target_in,
                             const at::Tensor& lse_in, double label_smoothing, int64_t ignore_index, bool inplace) {
  const char* op = "cross_entropy_bwd";
  check_logits(logits_in, op);
  check_rows(grad_rows_in, logits_in, at::kFloat, op, "grad_rows");
  check_rows(target_in, logits_in, at::kLong, op, "target");
  check_rows(lse_in, logits_in, at::kFloat, op, "lse");
  check_smoothing(label_smoothing, op);
  LSMINI_CHECK(!inplace || has_row_major(logits_in), op,
              ": inplace=True needs logits with contiguous rows (the gradient is written over them), got strides ",
              logits_in.strides());
  c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = row_major(logits_in);
  const at::Tensor grad_rows = grad_rows_in.contiguous();
  const at::Tensor target = target_in.contiguous();
  const at::Tensor lse = lse_in.contiguous();
  const int64_t rows = logits.size(0);
  const int vocab = static_cast<int>(logits.size(1));
  at::Tensor grad = inplace ? logits : at::empty({rows, vocab}, logits.options());
  dispatch_float(logits.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    check_launch(launch_cross_entropy_bwd(grad_rows.data_ptr<float>(), kptr<scalar_t>(logits),
                                          target.data_ptr<int64_t>(), lse.data_ptr<float>(), kptr<scalar_t>(grad),
                                          rows, vocab, row_stride(logits), row_stride(grad),
                                          static_cast<float>(label_smoothing), ignore_index, current_stream()),
                 op);
  });
  return grad;
}

void register_cross_entropy(pybind11::module_& m) {
  m.def("cross_entropy_fwd", &cross_entropy_fwd,
        "Label-smoothed cross-entropy forward, per row: (loss_rows, nll_rows, lse), fp32 [rows]; with grad_rows "
        "also the backward's gradient, written over the logits",
        pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("label_smoothing"),
        pybind11::arg("ignore_index"), pybind11::arg("grad_rows") = pybind11::none());
  m.def("cross_entropy_bwd", &cross_entropy_bwd,
        "Label-smoothed cross-entropy backward: grad_logits (logits' own storage when inplace)",
        pybind11::arg("grad_rows"), pybind11::arg("logits"), pybind11::arg("target"), pybind11::arg("lse"),
        pybind11::arg("label_smoothing"), pybind11::arg("ignore_index"), pybind11::arg("inplace"));
}

}  // namespace

LSMINI_REGISTER_OPS(register_cross_entropy);

}  // namespace lsmini
