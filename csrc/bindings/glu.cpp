// Bindings for glu: out = dropout(act(gate)·up), the gated FFN activation (kernels in csrc/kernels/glu.cu).
//   glu_fwd(gate, up|None, act, p, rng) -> out
//   glu_bwd(grad_out, gate, up|None, act, p, rng) -> (grad_gate, grad_up|None)
// gate, up: [rows, cols] in float32, float16 or bfloat16, one dtype; or up None and gate [rows, 2·cols], whose
// first half along the last dimension is the gate and the second the up projection (one GEMM produced
// both); the backward then returns that tensor's gradient, [rows, 2·cols], as grad_gate and None as grad_up.
// out: [rows, cols] in gate's dtype. act: "silu", "gelu" (exact, erf) or "gelu_tanh". rng: the 4-tuple of
// lsmini._backend.philox_seed_offset() (common.h's PhiloxTuple), ignored when p == 0; the backward takes the
// forward's and regenerates its mask. Non-contiguous inputs are copied first.
#include "common.h"
#include "glu.h"
#include "ops.h"

#include <optional>
#include <string>
#include <tuple>

namespace lsmini {
namespace {

constexpr const char* kGluActNames[kGluActCount] = {"silu", "gelu", "gelu_tanh"};

void check_act(int act, const char* op) {
  TORCH_CHECK_VALUE(act >= 0 && act < kGluActCount,
                    msg(op, ": unknown activation id ", act, ", expected 0 (silu), 1 (gelu) or 2 (gelu_tanh)"));
}

int act_id(const std::string& name, const char* op) {
  for (int i = 0; i < kGluActCount; ++i) {
    if (name == kGluActNames[i]) return i;
  }
  TORCH_CHECK_VALUE(false, msg(op, ": unknown activation '", name, "', expected one of 'silu', 'gelu', 'gelu_tanh'"));
  return -1;
}

// The checked inputs of one call: gate and up contiguous, the output width and the inputs' row stride.
struct GluInputs {
  at::Tensor gate, up;  // up undefined in the fused form
  int64_t rows, cols, in_stride;
};

GluInputs glu_inputs(const at::Tensor& gate, const std::optional<at::Tensor>& up, const char* op) {
  check_cuda(gate, op, "gate");
  check_float_dtype(gate, op, "gate");
  check_rows_hidden(gate, op, "gate");
  GluInputs in;
  in.gate = gate.contiguous();
  in.rows = gate.size(0);
  if (up) {
    check_like(*up, gate, gate.scalar_type(), gate.sizes(), op, "up", "gate");
    in.up = up->contiguous();
    in.cols = in.in_stride = gate.size(1);
  } else {
    TORCH_CHECK_VALUE(gate.size(1) % 2 == 0, msg(op, ": without up, gate holds gate and up side by side and its last "
                                                 "dimension must be even, got ", gate.size(1)));
    in.cols = gate.size(1) / 2;
    in.in_stride = gate.size(1);
  }
  return in;
}

// The up half's address: up itself, or the second half of each row of the fused gate.
template <typename T>
const T* up_ptr(const GluInputs& in) {
  return in.up.defined() ? static_cast<const T*>(in.up.data_ptr()) : static_cast<const T*>(in.gate.data_ptr()) + in.cols;
}

}  // namespace

at::Tensor glu_fwd(const at::Tensor& gate, const std::optional<at::Tensor>& up, int act, double p,
                   const PhiloxTuple& rng) {
  const char* op = "glu_fwd";
  check_cuda(gate, op, "gate");
  c10::cuda::CUDAGuard guard(gate.device());  // before glu_inputs, which copies non-contiguous inputs
  const GluInputs in = glu_inputs(gate, up, op);
  check_act(act, op);
  check_probability(p, op, "p");
  const PhiloxArgs philox = philox_args(rng, op);

  at::Tensor out = at::empty({in.rows, in.cols}, in.gate.options());
  dispatch_float(in.gate.scalar_type(), op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    const cudaError_t err =
        launch_glu_fwd<T>(static_cast<const T*>(in.gate.data_ptr()), up_ptr<T>(in), in.in_stride,
                          static_cast<T*>(out.data_ptr()), in.rows, in.cols, act, static_cast<float>(p), philox,
                          current_stream());
    check_launch(err, op);
  });
  return out;
}

std::tuple<at::Tensor, std::optional<at::Tensor>> glu_bwd(const at::Tensor& grad_out, const at::Tensor& gate,
                                                         const std::optional<at::Tensor>& up, int act, double p,
                                                         const PhiloxTuple& rng) {
  const char* op = "glu_bwd";
  check_cuda(gate, op, "gate");
  c10::cuda::CUDAGuard guard(gate.device());
  const GluInputs in = glu_inputs(gate, up, op);
  check_like(grad_out, gate, gate.scalar_type(), {in.rows, in.cols}, op, "grad_out", "gate");
  check_act(act, op);
  check_probability(p, op, "p");
  const PhiloxArgs philox = philox_args(rng, op);

  const at::Tensor g = grad_out.contiguous();
  at::Tensor grad_gate = at::empty_like(in.gate);  // the fused form: both halves' gradient
  std::optional<at::Tensor> grad_up;
  if (in.up.defined()) grad_up = at::empty_like(in.up);
  dispatch_float(in.gate.scalar_type(), op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    T* dgate = static_cast<T*>(grad_gate.data_ptr());
    T* dup = grad_up ? static_cast<T*>(grad_up->data_ptr()) : dgate + in.cols;
    const cudaError_t err =
        launch_glu_bwd<T>(static_cast<const T*>(g.data_ptr()), static_cast<const T*>(in.gate.data_ptr()),
                          up_ptr<T>(in), in.in_stride, dgate, dup, in.rows, in.cols, act, static_cast<float>(p),
                          philox, current_stream());
    check_launch(err, op);
  });
  return {grad_gate, grad_up};
}

namespace {

void register_glu(pybind11::module_& m) {
  namespace py = pybind11;
  // The Python entry points take the activation by name.
  auto fwd = [](const at::Tensor& gate, const std::optional<at::Tensor>& up, const std::string& act, double p,
                const PhiloxTuple& rng) { return glu_fwd(gate, up, act_id(act, "glu_fwd"), p, rng); };
  auto bwd = [](const at::Tensor& grad_out, const at::Tensor& gate, const std::optional<at::Tensor>& up,
                const std::string& act, double p, const PhiloxTuple& rng) {
    return glu_bwd(grad_out, gate, up, act_id(act, "glu_bwd"), p, rng);
  };
  m.def("glu_fwd", fwd,
        "out = dropout(act(gate)·up); gate, up [rows, cols], or up None and gate [rows, 2·cols] = [gate | up]; "
        "act 'silu' | 'gelu' | 'gelu_tanh'",
        py::arg("gate"), py::arg("up"), py::arg("act"), py::arg("p"), py::arg("rng"));
  m.def("glu_bwd", bwd,
        "(grad_gate, grad_up or None) of glu, recomputing act and act' from gate; with up None, grad_gate is the "
        "gradient of the fused [rows, 2·cols] gate",
        py::arg("grad_out"), py::arg("gate"), py::arg("up"), py::arg("act"), py::arg("p"), py::arg("rng"));
}

}  // namespace

LSMINI_REGISTER_OPS(register_glu);

}  // namespace lsmini
