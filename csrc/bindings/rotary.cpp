// Bindings for rotary: the rotary position embedding of q and k in one launch (kernels in csrc/kernels/rotary.cu).
//   rotary_fwd(q, k, cos, sin, interleaved, q_out=None, k_out=None) -> (q rotated, k rotated)
//   rotary_bwd(grad_q, grad_k, cos, sin, interleaved, q_out=None, k_out=None) -> (gradient of q, gradient of k)
// q [batch, heads, seq, head_dim] and k [batch, kv_heads, seq, head_dim] in float32, float16 or bfloat16, one dtype,
// any strides (read through them; a head_dim stride other than 1 is copied first); cos, sin [batch or 1, seq,
// rot_dim] in float32 or q's dtype, rot_dim even and in [2, head_dim]: out = x·cos + rot(x)·sin on the first rot_dim
// dimensions (rot: rotate-half, or rotate-every-two with interleaved), the rest copied. The backward applies the
// transpose (the inverse rotation) to the output gradients. Outputs: into q_out / k_out when given (x's shape and
// dtype, head_dim stride 1; the input itself rotates in place), else fresh tensors in the input's memory order:
// a [batch, seq, heads, head_dim] buffer for an input stored that way (heads inside seq: stride(1) < stride(2)),
// else contiguous [batch, heads, seq, head_dim] — lsmini/ops/rotary.py's fake implementation follows the same rule.
#include "common.h"
#include "ops.h"
#include "rotary.h"

#include <limits>
#include <optional>
#include <tuple>

namespace lsmini {
namespace {

// A fresh tensor of x's shape in x's memory order (see the opening comment).
at::Tensor empty_in_order(const at::Tensor& x) {
  if (x.stride(1) < x.stride(2)) {
    return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
  }
  return at::empty(x.sizes(), x.options());
}

// An output the caller gave: like's shape, dtype and device, head_dim stride 1, no element twice, and either
// separate from like or exactly like (in place); separate from other.
void check_out(const at::Tensor& out, const at::Tensor& like, const at::Tensor& other, const char* op,
               const char* name, const char* like_name, const char* other_name) {
  check_like(out, like, like.scalar_type(), like.sizes(), op, name, like_name);
  LSMINI_CHECK(out.stride(3) == 1, op, ": ", name, " must have stride 1 along head_dim, got strides ", out.strides());
  LSMINI_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, op, ": ", name,
               " must not hold an element twice (an expanded tensor), got strides ", out.strides());
  check_overlap(out, like, true, op, name, like_name);
  check_overlap(out, other, false, op, name, other_name);
}

template <typename T>
RotaryTensors<T> operand(const at::Tensor& in, const at::Tensor& out) {
  RotaryTensors<T> x;
  x.in = static_cast<const T*>(in.data_ptr());
  x.out = static_cast<T*>(out.data_ptr());
  x.heads = in.size(1);
  for (int d = 0; d < 3; ++d) {
    x.in_stride[d] = in.stride(d);
    x.out_stride[d] = out.stride(d);
  }
  return x;
}

// Both directions: the checks (the messages call the backward's inputs grad_q and grad_k), the outputs, the launch.
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos_in,
                                          const at::Tensor& sin_in, bool interleaved,
                                          const std::optional<at::Tensor>& q_out,
                                          const std::optional<at::Tensor>& k_out, bool backward) {
  const char* op = backward ? "rotary_bwd" : "rotary_fwd";
  const char* qn = backward ? "grad_q" : "q";
  const char* kn = backward ? "grad_k" : "k";
  check_cuda(q_in, op, qn);
  check_float_dtype(q_in, op, qn);
  TORCH_CHECK_VALUE(q_in.dim() == 4, msg(op, ": ", qn, " must be 4-D [batch, heads, seq, head_dim], got shape ",
                                         q_in.sizes()));
  const int64_t batch = q_in.size(0), seq = q_in.size(2), head_dim = q_in.size(3);
  check_cuda(k_in, op, kn);
  check_same_device(k_in, q_in, op, kn, qn);
  TORCH_CHECK_TYPE(k_in.scalar_type() == q_in.scalar_type(),
                   msg(op, ": ", kn, " must have ", qn, "'s dtype ", q_in.scalar_type(), ", got ", k_in.scalar_type()));
  TORCH_CHECK_VALUE(k_in.dim() == 4 && k_in.size(0) == batch && k_in.size(2) == seq && k_in.size(3) == head_dim,
                    msg(op, ": ", kn, " must be 4-D [batch, kv_heads, seq, head_dim] with ", qn, "'s batch = ", batch,
                        ", seq = ", seq, " and head_dim = ", head_dim, ", got shape ", k_in.sizes()));
  TORCH_CHECK_VALUE(head_dim <= std::numeric_limits<int32_t>::max(),
                    msg(op, ": head_dim must be at most ", std::numeric_limits<int32_t>::max(), ", got ", head_dim));

  check_cuda(cos_in, op, "cos");
  check_same_device(cos_in, q_in, op, "cos", qn);
  TORCH_CHECK_VALUE(cos_in.dim() == 3 && (cos_in.size(0) == batch || cos_in.size(0) == 1) && cos_in.size(1) == seq,
                    msg(op, ": cos must be 3-D [batch or 1, seq, rot_dim] with batch = ", batch, " and seq = ", seq,
                        ", got shape ", cos_in.sizes()));
  const int64_t rot_dim = cos_in.size(2);
  TORCH_CHECK_VALUE(rot_dim % 2 == 0 && rot_dim >= 2 && rot_dim <= head_dim,
                    msg(op, ": rot_dim (the last dimension of cos and sin) must be even and in [2, head_dim = ",
                        head_dim, "], got ", rot_dim));
  TORCH_CHECK_TYPE(cos_in.scalar_type() == q_in.scalar_type() || cos_in.scalar_type() == at::kFloat,
                   msg(op, ": cos must be ", q_in.scalar_type(), " (", qn, "'s dtype) or float32, got ",
                       cos_in.scalar_type()));
  check_cuda(sin_in, op, "sin");
  check_same_device(sin_in, q_in, op, "sin", qn);
  TORCH_CHECK_VALUE(sin_in.sizes() == cos_in.sizes(),
                    msg(op, ": sin must have cos's shape ", cos_in.sizes(), ", got ", sin_in.sizes()));
  TORCH_CHECK_TYPE(sin_in.scalar_type() == cos_in.scalar_type(),
                   msg(op, ": sin must have cos's dtype ", cos_in.scalar_type(), ", got ", sin_in.scalar_type()));

  c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor q_res, k_res;
  if (q_out) {
    check_out(*q_out, q_in, k_in, op, backward ? "grad_q_out" : "q_out", qn, kn);
    q_res = *q_out;
  } else {
    q_res = empty_in_order(q_in);
  }
  if (k_out) {
    check_out(*k_out, k_in, q_in, op, backward ? "grad_k_out" : "k_out", kn, qn);
    if (q_out) {
      check_overlap(*k_out, *q_out, false, op, backward ? "grad_k_out" : "k_out", backward ? "grad_q_out" : "q_out");
    }
    k_res = *k_out;
  } else {
    k_res = empty_in_order(k_in);
  }
  // The kernel reads along head_dim with stride 1; any other strides it follows. (An input that is its own output
  // has stride 1 there, so no copy breaks an in-place call.)
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  at::Tensor cos = cos_in, sin = sin_in;
  if (cos.stride(2) != 1 || sin.stride(2) != 1 || cos.strides() != sin.strides()) {
    cos = cos.contiguous();
    sin = sin.contiguous();
  }
  const int64_t cs_stride_batch = cos.size(0) == 1 ? 0 : cos.stride(0);

  dispatch_float(q.scalar_type(), op, [&](auto tag) {
    using T = typename KernelType<decltype(tag)>::type;
    auto launch = [&](auto c) {
      using C = decltype(c);
      const auto launcher = backward ? &launch_rotary_bwd<T, C> : &launch_rotary_fwd<T, C>;
      const cudaError_t err = launcher(operand<T>(q, q_res), operand<T>(k, k_res),
                                       static_cast<const C*>(cos.data_ptr()), static_cast<const C*>(sin.data_ptr()),
                                       cs_stride_batch, cos.stride(1), batch, seq, static_cast<int>(head_dim),
                                       static_cast<int>(rot_dim), interleaved, current_stream());
      check_launch(err, op);
    };
    if (cos.scalar_type() == q.scalar_type()) {
      launch(T{});
    } else {
      launch(float{});
    }
  });
  return {q_res, k_res};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rotary_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                              const at::Tensor& sin, bool interleaved,
                                              const std::optional<at::Tensor>& q_out,
                                              const std::optional<at::Tensor>& k_out) {
  return rotary(q, k, cos, sin, interleaved, q_out, k_out, false);
}

std::tuple<at::Tensor, at::Tensor> rotary_bwd(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                              const at::Tensor& cos, const at::Tensor& sin, bool interleaved,
                                              const std::optional<at::Tensor>& q_out,
                                              const std::optional<at::Tensor>& k_out) {
  return rotary(grad_q, grad_k, cos, sin, interleaved, q_out, k_out, true);
}

namespace {

void register_rotary(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rotary_fwd", &rotary_fwd,
        "rotary position embedding of q [b, h, s, d] and k [b, kv_h, s, d] by cos, sin [b or 1, s, rot_dim]: "
        "x·cos + rot(x)·sin on the first rot_dim dims (rotate-half, or pairs (2i, 2i+1) with interleaved), the rest "
        "copied; into q_out / k_out when given (the input itself: in place)",
        py::arg("q"), py::arg("k"), py::arg("cos"), py::arg("sin"), py::arg("interleaved") = false,
        py::arg("q_out") = py::none(), py::arg("k_out") = py::none());
  m.def("rotary_bwd", &rotary_bwd,
        "the gradients of rotary_fwd's q and k from those of its outputs (the transposed map: the inverse rotation); "
        "the same arguments and outputs",
        py::arg("grad_q"), py::arg("grad_k"), py::arg("cos"), py::arg("sin"), py::arg("interleaved") = false,
        py::arg("q_out") = py::none(), py::arg("k_out") = py::none());
}

}  // namespace

LSMINI_REGISTER_OPS(register_rotary);

}  // namespace lsmini
