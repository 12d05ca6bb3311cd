// Bindings for bias_dropout_residual: out = residual + dropout(x + bias) on [rows, hidden] tensors.
//   bias_dropout_residual_fwd(x, bias|None, residual, p, rng) -> out
//   bias_dropout_residual_bwd(grad_out, p, rng, has_bias, bias_dtype=None) -> (grad_x, grad_bias|None)
// rng: the 4-tuple of lsmini._backend.philox_seed_offset() (common.h's PhiloxTuple), ignored when p == 0.
// grad_residual is grad_out itself, so the backward does not return it. With p == 0 grad_x is
// grad_out (no copy) and only the bias column sums run.
#include "common.h"
#include "bias_dropout_residual.h"
#include "ops.h"

#include <optional>

namespace lsmini {
namespace {

constexpr const char* kFwdName = "bias_dropout_residual_fwd";
constexpr const char* kBwdName = "bias_dropout_residual_bwd";

}  // namespace

at::Tensor bias_dropout_residual_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                     const at::Tensor& residual, double p, const PhiloxTuple& rng,
                                     const std::optional<at::Tensor>& out_in) {
  const char* op = kFwdName;
  check_cuda(x, op, "x");
  check_rows_hidden(x, op, "x");
  check_float_dtype(x, op, "x");
  check_like(residual, x, x.scalar_type(), x.sizes(), op, "residual", "x");
  if (bias) check_column_bias(*bias, x, op);
  check_probability(p, op, "p");
  const PhiloxArgs philox = philox_args(rng, op);

  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor rc = residual.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  at::Tensor out;
  if (out_in) {  // elementwise: each element is read before it is written, so out may be x or residual
    check_written(*out_in, xc, op, "out");
    check_overlap(*out_in, xc, true, op, "out", "x");
    check_overlap(*out_in, rc, true, op, "out", "residual");
    out = *out_in;
  } else {
    out = at::empty_like(xc, at::MemoryFormat::Contiguous);
  }
  const int64_t rows = xc.size(0), hidden = xc.size(1);
  cudaError_t err = cudaSuccess;
  dispatch_float(xc.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using T = typename KernelType<scalar_t>::type;
    if (!bc.defined() || bc.scalar_type() == xc.scalar_type()) {
      const T* b = bc.defined() ? kptr<scalar_t>(bc) : nullptr;
      err = launch_bias_dropout_residual_fwd<T, T>(kptr<scalar_t>(xc), b, kptr<scalar_t>(rc), kptr<scalar_t>(out),
                                                   rows, hidden, static_cast<float>(p), philox, current_stream());
    } else {
      err = launch_bias_dropout_residual_fwd<T, float>(kptr<scalar_t>(xc), bc.data_ptr<float>(), kptr<scalar_t>(rc),
                                                       kptr<scalar_t>(out), rows, hidden, static_cast<float>(p),
                                                       philox, current_stream());
    }
  });
  check_launch(err, op);
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_dropout_residual_bwd(
    const at::Tensor& grad_out, double p, const PhiloxTuple& rng, bool has_bias,
    std::optional<at::ScalarType> bias_dtype, const std::optional<at::Tensor>& grad_x_in, const BackwardRoom& room) {
  const char* op = kBwdName;
  check_cuda(grad_out, op, "grad_out");
  check_rows_hidden(grad_out, op, "grad_out");
  check_float_dtype(grad_out, op, "grad_out");
  check_probability(p, op, "p");
  const PhiloxArgs philox = philox_args(rng, op);
  const at::ScalarType bdt = bias_dtype.value_or(grad_out.scalar_type());
  TORCH_CHECK_TYPE(bdt == grad_out.scalar_type() || bdt == at::kFloat,
                   msg(op, ": bias_dtype must be ", grad_out.scalar_type(), " (grad_out's dtype) or float32, got ",
                       bdt));

  c10::cuda::CUDAGuard guard(grad_out.device());
  const at::Tensor g = grad_out.contiguous();
  const int64_t rows = g.size(0), hidden = g.size(1);
  const bool dropout = p > 0.0;
  // Without dropout the gradient passes through unchanged: hand back grad_out, no copy (grad_x, when
  // given, is then left untouched).
  at::Tensor grad_x = g;
  if (dropout) {
    if (grad_x_in) {
      check_written(*grad_x_in, g, op, "grad_x");
      check_overlap(*grad_x_in, g, false, op, "grad_x", "grad_out");
      grad_x = *grad_x_in;
    } else {
      grad_x = at::empty_like(g, at::MemoryFormat::Contiguous);
    }
  }
  if (!dropout && !has_bias) return {grad_x, std::nullopt};

  std::optional<at::Tensor> grad_bias;
  at::Tensor partials;
  if (has_bias) {
    grad_bias = vector_output(room.grad_bias, hidden, bdt, g, op, "grad_bias");
    partials = float_temp(room.workspace, bias_dropout_residual_bwd_partial_slabs(rows, hidden), hidden, g, op);
  }
  cudaError_t err = cudaSuccess;
  dispatch_float(g.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using T = typename KernelType<scalar_t>::type;
    T* gx = dropout ? kptr<scalar_t>(grad_x) : nullptr;
    float* part = has_bias ? partials.data_ptr<float>() : nullptr;
    const int64_t slabs = has_bias ? partials.size(0) : 0;
    if (!has_bias || bdt == g.scalar_type()) {
      T* gb = has_bias ? kptr<scalar_t>(*grad_bias) : nullptr;
      err = launch_bias_dropout_residual_bwd<T, T>(kptr<scalar_t>(g), gx, gb, part, slabs, rows, hidden,
                                                   static_cast<float>(p), philox, room.sums, current_stream());
    } else {
      err = launch_bias_dropout_residual_bwd<T, float>(kptr<scalar_t>(g), gx, grad_bias->data_ptr<float>(), part,
                                                       slabs, rows, hidden, static_cast<float>(p), philox,
                                                       room.sums, current_stream());
    }
  });
  check_launch(err, op);
  return {grad_x, grad_bias};
}

static void register_bias_dropout_residual(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("bias_dropout_residual_fwd", &bias_dropout_residual_fwd,
        "out = residual + dropout(x + bias); x, residual [rows, hidden], bias [hidden] (x's dtype or float32) "
        "or None; into out when given",
        py::arg("x"), py::arg("bias"), py::arg("residual"), py::arg("p"), py::arg("rng"), py::arg("out") = py::none());
  m.def("bias_dropout_residual_bwd",
        [](const at::Tensor& grad_out, double p, const PhiloxTuple& rng, bool has_bias,
           std::optional<at::ScalarType> bias_dtype, const std::optional<at::Tensor>& grad_x) {
          return bias_dropout_residual_bwd(grad_out, p, rng, has_bias, bias_dtype, grad_x);
        },
        "(grad_x, grad_bias or None) of bias_dropout_residual; grad_bias in bias_dtype (default grad_out's dtype); "
        "with p > 0 grad_x is written into grad_x when given (else fresh), with p == 0 it is grad_out itself",
        py::arg("grad_out"), py::arg("p"), py::arg("rng"), py::arg("has_bias"), py::arg("bias_dtype") = py::none(),
        py::arg("grad_x") = py::none());
}

LSMINI_REGISTER_OPS(register_bias_dropout_residual);

}  // namespace lsmini
