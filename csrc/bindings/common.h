// Shared by every binding in csrc/bindings: argument checks with readable messages, dtype dispatch to
// the kernels' element types, the current stream, launch-error reporting, the dropout RNG argument,
// and the registration hook that puts each family's functions into lsmini._C.
#pragma once

#include <torch/extension.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "philox.h"

namespace lsmini {

// ---- registration: each csrc/bindings/<family>.cpp adds its functions with LSMINI_REGISTER_OPS ----
using Registrar = void (*)(pybind11::module_&);
std::vector<Registrar>& registrars();
struct RegisterOps {
  explicit RegisterOps(Registrar r) { registrars().push_back(r); }
};
#define LSMINI_REGISTER_OPS(fn) static ::lsmini::RegisterOps lsmini_register_##fn(fn)

// ---- error messages ----
// Messages are built as std::string by hand instead of streaming numbers into an ostream: extensions
// built with a newer libstdc++ than torch's can crash formatting integers through the stream facets.
namespace detail {
inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
inline void append(std::string& s, T v) { s += std::to_string(v); }
inline void append(std::string& s, at::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
}  // namespace detail

template <typename... Args>
inline std::string msg(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

// TORCH_CHECK with a message assembled by msg(): use it for every argument check in csrc/bindings.
#define LSMINI_CHECK(cond, ...) TORCH_CHECK((cond), ::lsmini::msg(__VA_ARGS__))

// ---- checks ----
inline void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  LSMINI_CHECK(t.defined(), op, ": ", name, " is undefined");
  LSMINI_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got a tensor on ", t.device());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                              const char* ref_name) {
  LSMINI_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device());
}

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto s = t.scalar_type();
  LSMINI_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", s);
}

inline void check_dtype(const at::Tensor& t, at::ScalarType expected, const char* op, const char* name) {
  LSMINI_CHECK(t.scalar_type() == expected, op, ": ", name, " must be ", expected, ", got ", t.scalar_type());
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* op, const char* name) {
  LSMINI_CHECK(t.sizes() == expected, op, ": ", name, " must have shape ", expected, ", got ", t.sizes());
}

// A tensor read beside `ref`: CUDA, on ref's device, with `dtype` and `shape`.
inline void check_like(const at::Tensor& t, const at::Tensor& ref, at::ScalarType dtype, at::IntArrayRef shape,
                       const char* op, const char* name, const char* ref_name) {
  check_cuda(t, op, name);
  check_same_device(t, ref, op, name, ref_name);
  check_dtype(t, dtype, op, name);
  check_shape(t, shape, op, name);
}

// ---- checks of the row-wise ops on [rows, hidden] (bias_dropout_residual, bias_act_dropout) ----
// A rate out of range and a wrong rank raise ValueError, a wrong bias dtype TypeError, as the ops'
// Python entry points do for the same mistakes; the generic checks above raise RuntimeError.
inline void check_probability(double p, const char* op, const char* name) {
  TORCH_CHECK_VALUE(p >= 0.0 && p <= 1.0, msg(op, ": ", name, " must be in [0, 1], got ", p));
}

inline void check_rows_hidden(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2, msg(op, ": ", name, " must be 2-D [rows, hidden], got shape ", t.sizes()));
}

// A bias added to every row of x [rows, hidden]: 1-D [hidden], on x's device, in x's dtype or float32.
inline void check_column_bias(const at::Tensor& bias, const at::Tensor& x, const char* op) {
  check_cuda(bias, op, "bias");
  check_same_device(bias, x, op, "bias", "x");
  check_shape(bias, {x.size(1)}, op, "bias");
  TORCH_CHECK_TYPE(bias.scalar_type() == x.scalar_type() || bias.scalar_type() == at::kFloat,
                   msg(op, ": bias must be ", x.scalar_type(), " (x's dtype) or float32, got ", bias.scalar_type()));
}

// A tensor a binding writes into (an optional output argument): like's device, dtype and shape, contiguous.
inline void check_written(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  check_like(t, like, like.scalar_type(), like.sizes(), op, name, "x");
  LSMINI_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got strides ", t.strides());
}

// A written tensor against one the kernel reads: no shared memory at all, or (same_ok, for elementwise
// kernels that read each element before writing it) exactly the same elements.
inline void check_overlap(const at::Tensor& written, const at::Tensor& read, bool same_ok, const char* op,
                          const char* name, const char* read_name) {
  // separate storages never overlap (get_overlap_status gives up on strided views before it looks)
  if (!written.storage().is_alias_of(read.storage())) return;
  const at::MemOverlapStatus o = at::get_overlap_status(written, read);
  LSMINI_CHECK(o == at::MemOverlapStatus::No || (same_ok && o == at::MemOverlapStatus::Full), op, ": ", name,
               same_ok ? " partially overlaps " : " overlaps ", read_name,
               same_ok ? " (it may be that tensor itself, in place, or separate memory)" : "");
}

// ---- room a caller gives a backward for its small outputs and temporaries (ops.h, BackwardRoom) ----
// A float32 [rows, cols] temporary at the start of `workspace` when given (contiguous float32 on like's
// device, large enough), else a fresh tensor.
inline at::Tensor float_temp(const std::optional<at::Tensor>& workspace, int64_t rows, int64_t cols,
                             const at::Tensor& like, const char* op) {
  if (!workspace) return at::empty({rows, cols}, like.options().dtype(at::kFloat));
  const at::Tensor& w = *workspace;
  check_like(w, like, at::kFloat, w.sizes(), op, "workspace", "x");
  LSMINI_CHECK(w.is_contiguous() && w.numel() >= rows * cols, op, ": workspace must be contiguous with at least ",
               rows * cols, " elements, got ", w.numel());
  return w.as_strided({rows, cols}, {cols, 1});
}

// A [n] output in dtype on like's device: `given` (checked: contiguous, that dtype and shape) or fresh.
inline at::Tensor vector_output(const std::optional<at::Tensor>& given, int64_t n, at::ScalarType dtype,
                                const at::Tensor& like, const char* op, const char* name) {
  if (!given) return at::empty({n}, like.options().dtype(dtype));
  check_like(*given, like, dtype, {n}, op, name, "x");
  LSMINI_CHECK(given->is_contiguous(), op, ": ", name, " must be contiguous, got strides ", given->strides());
  return *given;
}

// ---- launch errors ----
inline void check_launch(cudaError_t err, const char* op) {
  LSMINI_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// ---- dropout RNG ----
// What lsmini._backend.philox_seed_offset() returns and every dropout binding takes as `rng`:
// (seed, offset, seed_ptr, offset_ptr), the pointers 0 in eager mode and device addresses of torch's
// generator words for a call captured in a CUDA graph (see csrc/kernels/philox.h).
using PhiloxTuple = std::tuple<uint64_t, uint64_t, int64_t, int64_t>;

inline PhiloxArgs philox_args(const PhiloxTuple& rng, const char* op) {
  const auto [seed, offset, seed_ptr, offset_ptr] = rng;
  LSMINI_CHECK((seed_ptr == 0) == (offset_ptr == 0), op,
              ": rng must be (seed, offset, 0, 0) or (0, offset, seed_ptr, offset_ptr) with both pointers set, "
              "got seed_ptr = ", seed_ptr, " and offset_ptr = ", offset_ptr);
  return {seed, offset, reinterpret_cast<const int64_t*>(seed_ptr), reinterpret_cast<const int64_t*>(offset_ptr)};
}

// ---- dtype dispatch: at::ScalarType -> kernel element type ----
template <typename T> struct KernelType;
template <> struct KernelType<float> { using type = float; };
template <> struct KernelType<at::Half> { using type = __half; };
template <> struct KernelType<at::BFloat16> { using type = __nv_bfloat16; };

template <typename T>
inline auto kptr(const at::Tensor& t) {
  using K = typename KernelType<T>::type;
  return reinterpret_cast<K*>(t.data_ptr<T>());
}

// Calls f(scalar_t{}) with scalar_t ∈ {float, at::Half, at::BFloat16}.
template <typename F>
inline void dispatch_float(at::ScalarType s, const char* op, F&& f) {
  switch (s) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default: LSMINI_CHECK(false, op, ": unsupported dtype ", s, " (expected float32, float16 or bfloat16)");
  }
}

}  // namespace lsmini
