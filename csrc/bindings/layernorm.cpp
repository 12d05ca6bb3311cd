// LayerNorm bindings: layernorm_fwd / layernorm_bwd (kernels in csrc/kernels/layernorm.cu).
#include "common.h"
#include "layernorm.h"
#include "ops.h"

namespace lsmini {
namespace {

// weight/bias: float32 or x's dtype, both the same when both are given.
at::ScalarType param_dtype(const at::Tensor& x, const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias, const char* op) {
  const int64_t hidden = x.size(-1);
  at::ScalarType pt = x.scalar_type();
  bool seen = false;
  for (const auto* p : {&weight, &bias}) {
    if (!p->has_value()) continue;
    const char* name = p == &weight ? "weight" : "bias";
    const at::Tensor& t = p->value();
    check_cuda(t, op, name);
    check_same_device(t, x, op, name, "x");
    check_shape(t, {hidden}, op, name);
    LSMINI_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == x.scalar_type(), op, ": ", name,
                " must be float32 or the dtype of x (", x.scalar_type(), "), got ", t.scalar_type());
    LSMINI_CHECK(!seen || t.scalar_type() == pt, op, ": weight and bias must have the same dtype, got ",
                weight->scalar_type(), " and ", t.scalar_type());
    pt = t.scalar_type();
    seen = true;
  }
  return pt;
}

void check_x(const at::Tensor& x, const char* op, const char* name) {
  check_cuda(x, op, name);
  check_float_dtype(x, op, name);
  LSMINI_CHECK(x.dim() == 2, op, ": ", name, " must be 2-D [rows, hidden], got ", x.dim(), " dims");
  LSMINI_CHECK(x.size(1) >= 1 && x.size(1) <= kLayerNormMaxHidden, op, ": hidden size must be in [1, ",
              kLayerNormMaxHidden, "], got ", x.size(1));
}

template <typename W>
const W* opt_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const W*>(t->data_ptr()) : nullptr;
}

}  // namespace

// Returns (y, mean, rstd), and s after them in the residual form (with residual: s = residual + dropout_p(x +
// x_bias), norm_residual.h, normalized instead of x; x_bias in the parameters' dtype). y written into `out`,
// s into `sum_out` when given (which may be x itself).
std::vector<at::Tensor> layernorm_fwd(const at::Tensor& x_in, const c10::optional<at::Tensor>& weight_in,
                                      const c10::optional<at::Tensor>& bias_in, double eps,
                                      const c10::optional<at::Tensor>& out,
                                      const c10::optional<at::Tensor>& mean_out,
                                      const c10::optional<at::Tensor>& rstd_out,
                                      const c10::optional<at::Tensor>& residual_in,
                                      const c10::optional<at::Tensor>& x_bias_in, double p, const PhiloxTuple& rng,
                                      const c10::optional<at::Tensor>& sum_out) {
  const char* op = "layernorm_fwd";
  check_x(x_in, op, "x");
  LSMINI_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  const at::ScalarType pt = param_dtype(x_in, weight_in, bias_in, op);
  check_probability(p, op, "p");
  LSMINI_CHECK(residual_in || (!x_bias_in && p == 0.0 && !sum_out), op,
               ": x_bias, p and sum_out are those of the residual form: they need a residual");
  if (residual_in) check_like(*residual_in, x_in, x_in.scalar_type(), x_in.sizes(), op, "residual", "x");
  if (x_bias_in) {  // [hidden] on x's device (param_dtype checks it) in the weight and bias's dtype
    LSMINI_CHECK(param_dtype(x_in, x_bias_in, c10::nullopt, op) == pt, op,
                 ": x_bias must have the weight and bias's dtype (", pt, "), got ", x_bias_in->scalar_type());
  }
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  c10::optional<at::Tensor> weight, bias;
  if (weight_in) weight = weight_in->contiguous();
  if (bias_in) bias = bias_in->contiguous();
  const int64_t rows = x.size(0);
  const int hidden = static_cast<int>(x.size(1));
  at::Tensor y;
  if (out) {
    check_written(*out, x, op, "out");
    check_overlap(*out, x, false, op, "out", "x");
    y = *out;
  } else {
    y = at::empty_like(x);
  }
  auto stats = [&](const c10::optional<at::Tensor>& given, const char* name) {
    if (!given) return at::empty({rows}, x.options().dtype(at::kFloat));
    check_like(*given, x, at::kFloat, {rows}, op, name, "x");
    LSMINI_CHECK(given->is_contiguous(), op, ": ", name, " must be contiguous, got strides ", given->strides());
    return *given;
  };
  at::Tensor mean = stats(mean_out, "mean_out"), rstd = stats(rstd_out, "rstd_out");
  c10::optional<at::Tensor> residual, x_bias, sum;
  if (residual_in) {
    residual = residual_in->contiguous();
    if (x_bias_in) x_bias = x_bias_in->contiguous();
    if (sum_out) {
      check_written(*sum_out, x, op, "sum_out");
      check_overlap(*sum_out, x, true, op, "sum_out", "x");  // x itself: s over x, in place
      check_overlap(*sum_out, *residual, false, op, "sum_out", "residual");
    }
    sum = sum_out ? *sum_out : at::empty_like(x);
  }
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    auto run = [&](auto w) {
      using W = decltype(w);
      const NormResidual<K, W> add{residual ? kptr<scalar_t>(*residual) : nullptr, opt_ptr<W>(x_bias),
                                   sum ? kptr<scalar_t>(*sum) : nullptr, static_cast<float>(p),
                                   p > 0.0 ? philox_args(rng, op) : PhiloxArgs{}};
      return launch_layernorm_fwd<K, W>(kptr<scalar_t>(x), opt_ptr<W>(weight), opt_ptr<W>(bias), kptr<scalar_t>(y),
                                        mean.data_ptr<float>(), rstd.data_ptr<float>(), rows, hidden,
                                        static_cast<float>(eps), residual ? &add : nullptr, current_stream());
    };
    check_launch(pt == at::kFloat ? run(float{}) : run(K{}), op);
  });
  if (sum) return {y, mean, rstd, *sum};
  return {y, mean, rstd};
}

// Returns (dx, dweight or None, dbias or None). bias is only read for its presence and dtype. With
// `add` (a residual branch's gradient) dx is LayerNorm's input gradient plus add, rounded once; dx goes
// into `out` when given (else a fresh tensor), which may be add itself (in place).
std::vector<c10::optional<at::Tensor>> layernorm_bwd(const at::Tensor& dy_in, const at::Tensor& x_in,
                                                     const c10::optional<at::Tensor>& weight_in,
                                                     const c10::optional<at::Tensor>& bias,
                                                     const at::Tensor& mean, const at::Tensor& rstd,
                                                     const c10::optional<at::Tensor>& add_in,
                                                     const c10::optional<at::Tensor>& out, const BackwardRoom& room) {
  const char* op = "layernorm_bwd";
  check_x(x_in, op, "x");
  check_like(dy_in, x_in, x_in.scalar_type(), x_in.sizes(), op, "dy", "x");
  const int64_t rows = x_in.size(0);
  for (const auto* p : {&mean, &rstd}) {
    const char* name = p == &mean ? "mean" : "rstd";
    check_like(*p, x_in, at::kFloat, {rows}, op, name, "x");
  }
  const at::ScalarType pt = param_dtype(x_in, weight_in, bias, op);
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), dy = dy_in.contiguous();
  const at::Tensor m = mean.contiguous(), r = rstd.contiguous();
  c10::optional<at::Tensor> weight;
  if (weight_in) weight = weight_in->contiguous();
  const int hidden = static_cast<int>(x.size(1));
  const at::TensorOptions popt = x.options().dtype(pt);

  at::Tensor add;
  if (add_in) {
    check_like(*add_in, x, x.scalar_type(), x.sizes(), op, "add", "x");
    add = add_in->contiguous();
  }
  at::Tensor dx;
  if (out) {
    check_written(*out, x, op, "out");
    check_overlap(*out, dy, false, op, "out", "dy");
    check_overlap(*out, x, false, op, "out", "x");
    if (add.defined()) check_overlap(*out, add, true, op, "out", "add");
    dx = *out;
  } else {
    dx = at::empty_like(x);
  }
  const void* add_ptr = add.defined() ? add.data_ptr() : nullptr;
  c10::optional<at::Tensor> dweight, dbias;
  if (weight) dweight = vector_output(room.grad_weight, hidden, pt, x, op, "grad_weight");
  if (bias) dbias = vector_output(room.grad_bias, hidden, pt, x, op, "grad_bias");
  at::Tensor partials;
  if (dweight || dbias) partials = float_temp(room.workspace, 2 * layernorm_bwd_partial_rows(rows), hidden, x, op);
  float* part_ptr = partials.defined() ? partials.data_ptr<float>() : nullptr;

  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    cudaError_t err;
    if (pt == at::kFloat) {
      auto out = [](c10::optional<at::Tensor>& t) { return t ? t->data_ptr<float>() : nullptr; };
      err = launch_layernorm_bwd<K, float>(kptr<scalar_t>(dy), kptr<scalar_t>(x), opt_ptr<float>(weight),
                                           m.data_ptr<float>(), r.data_ptr<float>(), static_cast<const K*>(add_ptr),
                                           kptr<scalar_t>(dx), out(dweight), out(dbias), part_ptr, rows, hidden,
                                           room.sums, current_stream());
    } else {
      auto out = [](c10::optional<at::Tensor>& t) { return t ? reinterpret_cast<K*>(t->data_ptr()) : nullptr; };
      err = launch_layernorm_bwd<K, K>(kptr<scalar_t>(dy), kptr<scalar_t>(x), opt_ptr<K>(weight),
                                       m.data_ptr<float>(), r.data_ptr<float>(), static_cast<const K*>(add_ptr),
                                       kptr<scalar_t>(dx), out(dweight), out(dbias), part_ptr, rows, hidden,
                                       room.sums, current_stream());
    }
    check_launch(err, op);
  });
  return {dx, dweight, dbias};
}

namespace {

void register_layernorm(pybind11::module_& m) {
  m.def("layernorm_fwd", &layernorm_fwd,
        "LayerNorm forward: (y, mean, rstd), each into out / mean_out / rstd_out when given; with residual also s = "
        "residual + dropout_p(x + x_bias), normalized instead of x and returned last (into sum_out when given)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("eps"),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("mean_out") = pybind11::none(),
        pybind11::arg("rstd_out") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("x_bias") = pybind11::none(), pybind11::arg("p") = 0.0,
        pybind11::arg("rng") = PhiloxTuple{0, 0, 0, 0}, pybind11::arg("sum_out") = pybind11::none());
  m.def("layernorm_bwd",
        [](const at::Tensor& dy, const at::Tensor& x, const c10::optional<at::Tensor>& weight,
           const c10::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
           const c10::optional<at::Tensor>& add, const c10::optional<at::Tensor>& out) {
          return layernorm_bwd(dy, x, weight, bias, mean, rstd, add, out);
        },
        "LayerNorm backward: (dx, dweight, dbias); with add, dx = input gradient + add; dx into out when given "
        "(out may be add)",
        pybind11::arg("dy"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("mean"), pybind11::arg("rstd"), pybind11::arg("add") = pybind11::none(),
        pybind11::arg("out") = pybind11::none());
}

}  // namespace

LSMINI_REGISTER_OPS(register_layernorm);

}  // namespace lsmini
