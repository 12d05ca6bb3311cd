// Bindings for bias_act_dropout: out = dropout(act(x + bias)) on [rows, hidden] tensors.
//   bias_act_dropout_fwd(x, bias|None, act, p, rng, out=None) -> out
//   bias_act_dropout_bwd(grad_out, x, bias|None, act, p, rng, grad_x=None, from_output=False)
//     -> (grad_x, grad_bias|None)
// out / grad_x: where to write (contiguous, x's shape and dtype), else a fresh tensor; they may BE an input
// (elementwise, each element is read before it is written) but may not partially overlap one.
// rng: the 4-tuple of lsmini._backend.philox_seed_offset() (common.h's PhiloxTuple), ignored when p == 0.
// act is a name ("relu", "gelu", "gelu_tanh") or its id (0, 1, 2). The backward takes the forward's
// input x (not its output): act'(x + bias) is recomputed — or, relu only, with from_output=True the
// forward's output as x: it is > 0 exactly where the gradient passes (then bias only sets grad_bias's
// dtype and rng is not read).
#include "common.h"
#include "bias_act_dropout.h"
#include "ops.h"

#include <optional>
#include <string>

namespace lsmini {
namespace {

constexpr const char* kFwdName = "bias_act_dropout_fwd";
constexpr const char* kBwdName = "bias_act_dropout_bwd";
constexpr const char* kActNames[kBiasActCount] = {"relu", "gelu", "gelu_tanh"};

// An activation id: one of BiasAct.
void check_act(int64_t act_id, const char* op) {
  TORCH_CHECK_VALUE(act_id >= 0 && act_id < kBiasActCount,
                    msg(op, ": unknown activation id ", act_id, ", expected 0 (relu), 1 (gelu) or 2 (gelu_tanh)"));
}

int parse_act(const pybind11::handle& act, const char* op) {
  namespace py = pybind11;
  if (py::isinstance<py::str>(act)) {
    const std::string name = act.cast<std::string>();
    for (int i = 0; i < kBiasActCount; ++i) {
      if (name == kActNames[i]) return i;
    }
    TORCH_CHECK_VALUE(false,
                      msg(op, ": unknown activation '", name, "', expected one of 'relu', 'gelu', 'gelu_tanh'"));
  }
  if (py::isinstance<py::int_>(act) && !py::isinstance<py::bool_>(act)) {
    const int64_t id = act.cast<int64_t>();
    check_act(id, op);
    return static_cast<int>(id);
  }
  TORCH_CHECK_TYPE(false, msg(op, ": act must be a str ('relu', 'gelu', 'gelu_tanh') or an int id, got ",
                               std::string(py::str(py::type::of(act).attr("__name__")))));
  return -1;
}

// The output: `out` (checked; it may be one of `inputs` itself, not part of one) or a fresh tensor.
at::Tensor output(const std::optional<at::Tensor>& out, const at::Tensor& like,
                  std::initializer_list<std::pair<const at::Tensor*, const char*>> inputs, const char* op,
                  const char* name) {
  if (!out) return at::empty_like(like, at::MemoryFormat::Contiguous);
  check_written(*out, like, op, name);
  for (const auto& [t, tname] : inputs) check_overlap(*out, *t, true, op, name, tname);
  return *out;
}

}  // namespace

at::Tensor bias_act_dropout_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias, int act_id, double p,
                                const PhiloxTuple& rng, const std::optional<at::Tensor>& out_in) {
  const char* op = kFwdName;
  check_cuda(x, op, "x");
  check_rows_hidden(x, op, "x");
  check_float_dtype(x, op, "x");
  if (bias) check_column_bias(*bias, x, op);
  check_act(act_id, op);
  check_probability(p, op, "p");
  const PhiloxArgs philox = philox_args(rng, op);

  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  at::Tensor out = output(out_in, xc, {{&xc, "x"}}, op, "out");
  const int64_t rows = xc.size(0), hidden = xc.size(1);
  cudaError_t err = cudaSuccess;
  dispatch_float(xc.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using T = typename KernelType<scalar_t>::type;
    if (!bc.defined() || bc.scalar_type() == xc.scalar_type()) {
      const T* b = bc.defined() ? kptr<scalar_t>(bc) : nullptr;
      err = launch_bias_act_dropout_fwd<T, T>(kptr<scalar_t>(xc), b, kptr<scalar_t>(out), rows, hidden, act_id,
                                              static_cast<float>(p), philox, current_stream());
    } else {
      err = launch_bias_act_dropout_fwd<T, float>(kptr<scalar_t>(xc), bc.data_ptr<float>(), kptr<scalar_t>(out), rows,
                                                  hidden, act_id, static_cast<float>(p), philox, current_stream());
    }
  });
  check_launch(err, op);
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> bias_act_dropout_bwd(const at::Tensor& grad_out, const at::Tensor& x,
                                                                       const std::optional<at::Tensor>& bias,
                                                                       int act_id, double p,
                                                                       const PhiloxTuple& rng,
                                                                       const std::optional<at::Tensor>& grad_x_in,
                                                                       bool from_output, const BackwardRoom& room) {
  const char* op = kBwdName;
  check_cuda(grad_out, op, "grad_out");
  check_rows_hidden(grad_out, op, "grad_out");
  check_float_dtype(grad_out, op, "grad_out");
  check_like(x, grad_out, grad_out.scalar_type(), grad_out.sizes(), op, "x", "grad_out");
  if (bias) check_column_bias(*bias, x, op);
  check_act(act_id, op);
  TORCH_CHECK_VALUE(!from_output || act_id == int(BiasAct::Relu),
                    msg(op, ": from_output=True needs act 'relu' (its derivative is readable from the output), got '",
                        kActNames[act_id], "'"));
  check_probability(p, op, "p");
  const PhiloxArgs philox = philox_args(rng, op);

  c10::cuda::CUDAGuard guard(grad_out.device());
  const at::Tensor g = grad_out.contiguous();
  const at::Tensor xc = x.contiguous();
  const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
  const int64_t rows = g.size(0), hidden = g.size(1);
  at::Tensor grad_x = output(grad_x_in, g, {{&g, "grad_out"}, {&xc, "x"}}, op, "grad_x");
  std::optional<at::Tensor> grad_bias;
  at::Tensor partials;
  if (bc.defined()) {
    grad_bias = vector_output(room.grad_bias, hidden, bc.scalar_type(), g, op, "grad_bias");
    partials = float_temp(room.workspace, bias_act_dropout_bwd_partial_slabs(rows, hidden), hidden, g, op);
  }
  cudaError_t err = cudaSuccess;
  dispatch_float(g.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using T = typename KernelType<scalar_t>::type;
    float* part = bc.defined() ? partials.data_ptr<float>() : nullptr;
    const int64_t slabs = bc.defined() ? partials.size(0) : 0;
    if (!bc.defined() || bc.scalar_type() == g.scalar_type()) {
      const T* b = bc.defined() ? kptr<scalar_t>(bc) : nullptr;
      T* gb = bc.defined() ? kptr<scalar_t>(*grad_bias) : nullptr;
      err = launch_bias_act_dropout_bwd<T, T>(kptr<scalar_t>(g), kptr<scalar_t>(xc), b, kptr<scalar_t>(grad_x), gb,
                                              part, slabs, rows, hidden, act_id, static_cast<float>(p), philox,
                                              from_output, room.sums, current_stream());
    } else {
      err = launch_bias_act_dropout_bwd<T, float>(kptr<scalar_t>(g), kptr<scalar_t>(xc), bc.data_ptr<float>(),
                                                  kptr<scalar_t>(grad_x), grad_bias->data_ptr<float>(), part, slabs,
                                                  rows, hidden, act_id, static_cast<float>(p), philox,
                                                  from_output, room.sums, current_stream());
    }
  });
  check_launch(err, op);
  return {grad_x, grad_bias};
}

static void register_bias_act_dropout(pybind11::module_& m) {
  namespace py = pybind11;
  // The Python entry points take the activation by name or id.
  auto fwd = [](const at::Tensor& x, const std::optional<at::Tensor>& bias, const py::object& act, double p,
                const PhiloxTuple& rng, const std::optional<at::Tensor>& out) {
    return bias_act_dropout_fwd(x, bias, parse_act(act, kFwdName), p, rng, out);
  };
  auto bwd = [](const at::Tensor& grad_out, const at::Tensor& x, const std::optional<at::Tensor>& bias,
                const py::object& act, double p, const PhiloxTuple& rng, const std::optional<at::Tensor>& grad_x,
                bool from_output) {
    return bias_act_dropout_bwd(grad_out, x, bias, parse_act(act, kBwdName), p, rng, grad_x, from_output);
  };
  m.def("bias_act_dropout_fwd", fwd,
        "out = dropout(act(x + bias)); x [rows, hidden], bias [hidden] (x's dtype or float32) or None, "
        "act 'relu' | 'gelu' | 'gelu_tanh' (or 0 | 1 | 2)",
        py::arg("x"), py::arg("bias"), py::arg("act"), py::arg("p"), py::arg("rng"), py::arg("out") = py::none());
  m.def("bias_act_dropout_bwd", bwd,
        "(grad_x, grad_bias or None) of bias_act_dropout, recomputing act' from x and bias (or, relu with "
        "from_output=True, reading it from the forward's output passed as x); grad_bias in bias's dtype",
        py::arg("grad_out"), py::arg("x"), py::arg("bias"), py::arg("act"), py::arg("p"), py::arg("rng"),
        py::arg("grad_x") = py::none(), py::arg("from_output") = false);
}

LSMINI_REGISTER_OPS(register_bias_act_dropout);

}  // namespace lsmini
