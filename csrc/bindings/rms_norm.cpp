// RMSNorm bindings (kernels in csrc/kernels/rms_norm.cu and rms_norm_bwd.cu):
//   rms_norm_fwd(x, weight|None, eps, residual=None, x_bias=None, p=0, rng) -> (s|None, y, rstd)
//     y = x·rstd·weight, rstd = 1/sqrt(mean(x²) + eps) per row (float32); with residual, s = residual +
//     dropout_p(x + x_bias) (norm_residual.h; x_bias in the weight's dtype, rng as bias_dropout_residual_fwd's)
//     is returned and normalized instead of x (the "add & norm" of a pre-norm block)
//   rms_norm_bwd(dy, x, weight|None, rstd, add=None) -> (dx, dweight|None)
//     x: the tensor the forward normalized (s in the residual form); dx + add when add is given
// x, residual, dy, add: [rows, hidden] in float32, float16 or bfloat16, one dtype; weight: [hidden] in float32
// or x's dtype (dweight in weight's dtype); y, s, dx in x's dtype. Non-contiguous inputs are copied first.
#include "common.h"
#include "ops.h"
#include "rms_norm.h"

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>

namespace lsmini {
namespace {

// A float as printf's %g writes it (msg() would print 1e-9 as 0.000000).
std::string float_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// x: a CUDA [rows, hidden] tensor of a kernel dtype with 1 ≤ hidden ≤ kRmsNormMaxHidden.
void check_rows(const at::Tensor& x, const char* op) {
  check_cuda(x, op, "x");
  check_float_dtype(x, op, "x");
  check_rows_hidden(x, op, "x");
  TORCH_CHECK_VALUE(x.size(1) >= 1 && x.size(1) <= kRmsNormMaxHidden,
                    msg(op, ": x's last dimension (hidden) must be in [1, ", kRmsNormMaxHidden, "], got ", x.size(1)));
}

// weight: [hidden] on x's device, in float32 or x's dtype.
void check_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  check_cuda(weight, op, "weight");
  check_same_device(weight, x, op, "weight", "x");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == x.size(1),
                    msg(op, ": weight must have shape [", x.size(1), "] to match x's last dimension, got ",
                        weight.sizes()));
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
                   msg(op, ": weight must be ", x.scalar_type(), " (x's dtype) or float32, got ", weight.scalar_type()));
}

template <typename W>
const W* opt_ptr(const std::optional<at::Tensor>& t) {
  return t ? reinterpret_cast<const W*>(t->data_ptr()) : nullptr;
}

// Calls f(T{}, W{}) with T the kernel element type of x and W that of the weight (T when there is none).
template <typename F>
void dispatch_types(const at::Tensor& x, const std::optional<at::Tensor>& weight, const char* op, F&& f) {
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    if (weight && weight->scalar_type() != x.scalar_type()) {
      f(T{}, float{});
    } else {
      f(T{}, T{});
    }
  });
}

}  // namespace

std::tuple<std::optional<at::Tensor>, at::Tensor, at::Tensor> rms_norm_fwd(
    const at::Tensor& x_in, const std::optional<at::Tensor>& weight_in, double eps,
    const std::optional<at::Tensor>& residual_in, const std::optional<at::Tensor>& x_bias_in, double p,
    const PhiloxTuple& rng) {
  const char* op = "rms_norm_fwd";
  check_rows(x_in, op);
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0, msg(op, ": eps must be a finite float > 0, got ", float_text(eps)));
  if (weight_in) check_weight(*weight_in, x_in, op);
  if (residual_in) check_like(*residual_in, x_in, x_in.scalar_type(), x_in.sizes(), op, "residual", "x");
  check_probability(p, op, "p");
  TORCH_CHECK_VALUE(residual_in || (!x_bias_in && p == 0.0),
                    msg(op, ": x_bias and p are those of the residual form: they need a residual"));
  if (x_bias_in) {
    check_weight(*x_bias_in, x_in, op);
    const at::ScalarType w = weight_in ? weight_in->scalar_type() : x_in.scalar_type();
    TORCH_CHECK_TYPE(x_bias_in->scalar_type() == w,
                     msg(op, ": x_bias must have the weight's dtype (", w, "), got ", x_bias_in->scalar_type()));
  }

  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  std::optional<at::Tensor> weight, residual, sum, x_bias;
  if (weight_in) weight = weight_in->contiguous();
  if (x_bias_in) x_bias = x_bias_in->contiguous();
  if (residual_in) {
    residual = residual_in->contiguous();
    sum = at::empty_like(x);
  }
  const int64_t rows = x.size(0);
  const int hidden = static_cast<int>(x.size(1));
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch_types(x, weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    const NormResidual<T, W> add{residual ? static_cast<const T*>(residual->data_ptr()) : nullptr,
                                 opt_ptr<W>(x_bias), sum ? static_cast<T*>(sum->data_ptr()) : nullptr,
                                 static_cast<float>(p), p > 0.0 ? philox_args(rng, op) : PhiloxArgs{}};
    const cudaError_t err = launch_rms_norm_fwd<T, W>(static_cast<const T*>(x.data_ptr()), opt_ptr<W>(weight),
                                                      static_cast<T*>(y.data_ptr()), rstd.data_ptr<float>(), rows,
                                                      hidden, static_cast<float>(eps), residual ? &add : nullptr,
                                                      current_stream());
    check_launch(err, op);
  });
  return {sum, y, rstd};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> rms_norm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                              const std::optional<at::Tensor>& weight_in,
                                                              const at::Tensor& rstd_in,
                                                              const std::optional<at::Tensor>& add_in) {
  const char* op = "rms_norm_bwd";
  check_rows(x_in, op);
  check_like(dy_in, x_in, x_in.scalar_type(), x_in.sizes(), op, "dy", "x");
  check_like(rstd_in, x_in, at::kFloat, {x_in.size(0)}, op, "rstd", "x");
  if (weight_in) check_weight(*weight_in, x_in, op);
  if (add_in) check_like(*add_in, x_in, x_in.scalar_type(), x_in.sizes(), op, "add", "x");

  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = dy_in.contiguous(), rstd = rstd_in.contiguous();
  std::optional<at::Tensor> weight, add, dweight;
  if (weight_in) {
    weight = weight_in->contiguous();
    dweight = at::empty({x.size(1)}, weight->options());
  }
  if (add_in) add = add_in->contiguous();
  const int64_t rows = x.size(0);
  const int hidden = static_cast<int>(x.size(1));
  at::Tensor dx = at::empty_like(x);
  at::Tensor partials;
  if (dweight) partials = at::empty({rms_norm_bwd_partial_rows(rows), hidden}, x.options().dtype(at::kFloat));
  dispatch_types(x, weight, op, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    const cudaError_t err = launch_rms_norm_bwd<T, W>(
        static_cast<const T*>(dy.data_ptr()), static_cast<const T*>(x.data_ptr()), opt_ptr<W>(weight),
        rstd.data_ptr<float>(), add ? static_cast<const T*>(add->data_ptr()) : nullptr, static_cast<T*>(dx.data_ptr()),
        dweight ? static_cast<W*>(dweight->data_ptr()) : nullptr, dweight ? partials.data_ptr<float>() : nullptr,
        rows, hidden, nullptr, current_stream());
    check_launch(err, op);
  });
  return {dx, dweight};
}

namespace {

void register_rms_norm(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rms_norm_fwd", &rms_norm_fwd,
        "RMSNorm forward: (s or None, y, rstd); y = x·rstd·weight, rstd = 1/sqrt(mean(x²) + eps) (float32 [rows]); "
        "with residual, s = residual + dropout_p(x + x_bias) is returned and normalized instead of x",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(),
        py::arg("x_bias") = py::none(), py::arg("p") = 0.0, py::arg("rng") = PhiloxTuple{0, 0, 0, 0});
  m.def("rms_norm_bwd", &rms_norm_bwd,
        "RMSNorm backward: (dx, dweight or None) from dy, the normalized input x, weight and the forward's rstd; "
        "with add, dx = the input gradient + add (rounded once)",
        py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("rstd"), py::arg("add") = py::none());
}

}  // namespace

LSMINI_REGISTER_OPS(register_rms_norm);

}  // namespace lsmini
