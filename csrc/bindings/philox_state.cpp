// Binding of philox_state (csrc/kernels/philox_state.cu): the Philox states of dropout calls written into a
// device tensor. lsmini's custom operators (what torch.compile sees, lsmini/ops/library.py) carry a dropout
// call's state from forward to backward this way, as a tensor (_backend.rng_in reads it back).
#include "common.h"
#include "ops.h"
#include "philox_state.h"

#include <vector>

namespace lsmini {

// rngs (philox_seed_offset tuples) → out, an int64 CUDA tensor [len(rngs), 2] of resolved (seed, offset).
void philox_state_fwd(const std::vector<PhiloxTuple>& rngs, const at::Tensor& out) {
  const char* op = "philox_state_fwd";
  const int64_t n = static_cast<int64_t>(rngs.size());
  LSMINI_CHECK(n <= kPhiloxStateMaxDraws, op, ": at most ", kPhiloxStateMaxDraws, " states per call, got ", n);
  check_cuda(out, op, "out");
  check_dtype(out, at::kLong, op, "out");
  LSMINI_CHECK(out.dim() == 2 && out.size(0) == n && out.size(1) == 2 && out.is_contiguous(), op,
               ": out must be a contiguous [", n, ", 2] tensor, got shape ", out.sizes());
  PhiloxStateDraws draws{};
  for (int64_t i = 0; i < n; ++i) draws.draw[i] = philox_args(rngs[i], op);
  c10::cuda::CUDAGuard guard(out.device());
  check_launch(launch_philox_state_fwd(draws, static_cast<int>(n), out.data_ptr<int64_t>(), current_stream()), op);
}

static void register_philox_state(pybind11::module_& m) {
  m.def("philox_state_fwd", &philox_state_fwd,
        "Write the resolved (seed, offset) of each rng tuple into out [len(rngs), 2] (int64, CUDA)",
        pybind11::arg("rngs"), pybind11::arg("out"));
}

LSMINI_REGISTER_OPS(register_philox_state);

}  // namespace lsmini
