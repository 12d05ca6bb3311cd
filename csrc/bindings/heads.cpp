// Bindings of the head transforms: split_heads (bias add + [b, l, parts·hidden] → [parts, b, h, l, d])
// and merge_heads ([b, h, l, d] → [b, l, h·d]), forward and backward. Kernels in csrc/kernels/heads.cu.
#include "common.h"
#include "heads.h"

#include <limits>
#include <optional>
#include <tuple>

namespace lsmini {

namespace {

constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max();

// The kernels index token rows and the columns of one row with 32-bit integers.
void check_index_range(int64_t rows, int64_t row_elems, const char* op) {
  LSMINI_CHECK(rows <= kMaxIndex, op, ": batch·len must be at most ", kMaxIndex, ", got ", rows);
  LSMINI_CHECK(row_elems <= kMaxIndex, op, ": the row width (parts·num_heads·head_dim) must be at most ", kMaxIndex,
              ", got ", row_elems);
}

}  // namespace

// x [batch, len, parts·hidden], bias [parts·hidden] (float32 or x's dtype) or None
// → out [parts, batch, num_heads, len, head_dim], out[p, b, h, l, d] = x[b, l, p·hidden + h·head_dim + d] + bias[...].
static at::Tensor split_heads_fwd(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t num_heads,
                                  int64_t parts) {
  const char* op = "split_heads_fwd";
  check_cuda(x, op, "x");
  check_float_dtype(x, op, "x");
  LSMINI_CHECK(x.dim() == 3, op, ": x must be 3-D [batch, len, parts·hidden], got shape ", x.sizes());
  LSMINI_CHECK(num_heads >= 1, op, ": num_heads must be >= 1, got ", num_heads);
  LSMINI_CHECK(parts >= 1, op, ": parts must be >= 1, got ", parts);
  const int64_t batch = x.size(0), len = x.size(1), width = x.size(2);
  LSMINI_CHECK(width % (parts * num_heads) == 0, op, ": the last dimension of x (", width,
              ") must be divisible by parts·num_heads = ", parts, "·", num_heads, " = ", parts * num_heads);
  const int64_t head_dim = width / (parts * num_heads);
  check_index_range(batch * len, width, op);
  c10::cuda::CUDAGuard guard(x.device());
  const bool has_bias = bias.has_value() && bias->defined();
  at::Tensor b;
  if (has_bias) {
    b = bias->contiguous();
    check_cuda(b, op, "bias");
    check_same_device(b, x, op, "bias", "x");
    LSMINI_CHECK(b.scalar_type() == at::kFloat || b.scalar_type() == x.scalar_type(), op,
                ": bias must be float32 or x's dtype (", x.scalar_type(), "), got ", b.scalar_type());
    check_shape(b, {width}, op, "bias");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({parts, batch, num_heads, len, head_dim}, x.options());
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    cudaError_t err;
    if (has_bias && b.scalar_type() == at::kFloat)
      err = launch_split_heads_fwd<K, float>(kptr<scalar_t>(xc), b.data_ptr<float>(), kptr<scalar_t>(out), batch,
                                             len, parts, num_heads, head_dim, current_stream());
    else
      err = launch_split_heads_fwd<K, K>(kptr<scalar_t>(xc), has_bias ? kptr<scalar_t>(b) : nullptr,
                                         kptr<scalar_t>(out), batch, len, parts, num_heads, head_dim,
                                         current_stream());
    check_launch(err, op);
  });
  return out;
}

// grad [parts, batch, num_heads, len, head_dim] → grad_x [batch, len, parts·num_heads·head_dim] and, when
// has_bias, grad_bias [parts·num_heads·head_dim] (column sums; float32 if bias_fp32, else grad's dtype).
static std::tuple<at::Tensor, std::optional<at::Tensor>> split_heads_bwd(const at::Tensor& grad, bool has_bias,
                                                                         bool bias_fp32) {
  const char* op = "split_heads_bwd";
  check_cuda(grad, op, "grad");
  check_float_dtype(grad, op, "grad");
  LSMINI_CHECK(grad.dim() == 5, op, ": grad must be 5-D [parts, batch, num_heads, len, head_dim], got shape ",
              grad.sizes());
  const int64_t parts = grad.size(0), batch = grad.size(1), num_heads = grad.size(2), len = grad.size(3),
                head_dim = grad.size(4);
  const int64_t width = parts * num_heads * head_dim;
  check_index_range(batch * len, width, op);
  c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor g = grad.contiguous();
  at::Tensor grad_x = at::empty({batch, len, width}, grad.options());
  std::optional<at::Tensor> grad_bias;
  at::Tensor partials;
  int64_t num_partials = 0;
  if (has_bias) {
    grad_bias = at::empty({width}, grad.options().dtype(bias_fp32 ? at::kFloat : grad.scalar_type()));
    num_partials = split_heads_bwd_num_partials(batch, len, parts, num_heads, head_dim,
                                                static_cast<int>(grad.element_size()));
    partials = at::empty({num_partials, width}, grad.options().dtype(at::kFloat));
  }
  dispatch_float(grad.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    using K = typename KernelType<scalar_t>::type;
    float* part_ptr = has_bias ? partials.data_ptr<float>() : nullptr;
    cudaError_t err;
    if (has_bias && grad_bias->scalar_type() == at::kFloat)
      err = launch_split_heads_bwd<K, float>(kptr<scalar_t>(g), kptr<scalar_t>(grad_x), grad_bias->data_ptr<float>(),
                                             part_ptr, num_partials, batch, len, parts, num_heads, head_dim,
                                             current_stream());
    else
      err = launch_split_heads_bwd<K, K>(kptr<scalar_t>(g), kptr<scalar_t>(grad_x),
                                         has_bias ? kptr<scalar_t>(*grad_bias) : nullptr, part_ptr, num_partials,
                                         batch, len, parts, num_heads, head_dim, current_stream());
    check_launch(err, op);
  });
  return {grad_x, grad_bias};
}

// x [batch, num_heads, len, head_dim] → out [batch, len, num_heads·head_dim].
static at::Tensor merge_heads_fwd(const at::Tensor& x) {
  const char* op = "merge_heads_fwd";
  check_cuda(x, op, "x");
  check_float_dtype(x, op, "x");
  LSMINI_CHECK(x.dim() == 4, op, ": x must be 4-D [batch, num_heads, len, head_dim], got shape ", x.sizes());
  const int64_t batch = x.size(0), num_heads = x.size(1), len = x.size(2), head_dim = x.size(3);
  check_index_range(batch * len, num_heads * head_dim, op);
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({batch, len, num_heads * head_dim}, x.options());
  dispatch_float(x.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    check_launch(launch_merge_heads_fwd(kptr<scalar_t>(xc), kptr<scalar_t>(out), batch, num_heads, len, head_dim,
                                        current_stream()),
                 op);
  });
  return out;
}

// grad [batch, len, num_heads·head_dim] → grad_x [batch, num_heads, len, head_dim].
static at::Tensor merge_heads_bwd(const at::Tensor& grad, int64_t num_heads) {
  const char* op = "merge_heads_bwd";
  check_cuda(grad, op, "grad");
  check_float_dtype(grad, op, "grad");
  LSMINI_CHECK(grad.dim() == 3, op, ": grad must be 3-D [batch, len, num_heads·head_dim], got shape ", grad.sizes());
  LSMINI_CHECK(num_heads >= 1, op, ": num_heads must be >= 1, got ", num_heads);
  const int64_t batch = grad.size(0), len = grad.size(1), width = grad.size(2);
  LSMINI_CHECK(width % num_heads == 0, op, ": the last dimension of grad (", width,
               ") must be divisible by num_heads (", num_heads, ")");
  const int64_t head_dim = width / num_heads;
  check_index_range(batch * len, width, op);
  c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor g = grad.contiguous();
  at::Tensor grad_x = at::empty({batch, num_heads, len, head_dim}, grad.options());
  dispatch_float(grad.scalar_type(), op, [&](auto tag) {
    using scalar_t = decltype(tag);
    check_launch(launch_merge_heads_bwd(kptr<scalar_t>(g), kptr<scalar_t>(grad_x), batch, num_heads, len, head_dim,
                                        current_stream()),
                 op);
  });
  return grad_x;
}

static void register_heads(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("split_heads_fwd", &split_heads_fwd, py::arg("x"), py::arg("bias"), py::arg("num_heads"), py::arg("parts"),
        "x [batch, len, parts·hidden], bias [parts·hidden] or None -> [parts, batch, num_heads, len, head_dim]");
  m.def("split_heads_bwd", &split_heads_bwd, py::arg("grad"), py::arg("has_bias"), py::arg("bias_fp32") = false,
        "grad [parts, batch, num_heads, len, head_dim] -> (grad_x [batch, len, parts·hidden], grad_bias or None); "
        "grad_bias is float32 when bias_fp32, else grad's dtype");
  m.def("merge_heads_fwd", &merge_heads_fwd, py::arg("x"),
        "x [batch, num_heads, len, head_dim] -> [batch, len, num_heads·head_dim]");
  m.def("merge_heads_bwd", &merge_heads_bwd, py::arg("grad"), py::arg("num_heads"),
        "grad [batch, len, num_heads·head_dim] -> [batch, num_heads, len, head_dim]");
}

LSMINI_REGISTER_OPS(register_heads);

}  // namespace lsmini
