// lsmini._C: the one Python module of the extension. Each csrc/ops/<family>.cpp registers its own
// functions (LSMINI_REGISTER_OPS), so adding an op family never touches this file.
#include "common.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>

#include <mutex>

namespace lsmini {

std::vector<Registrar>& registrars() {
  static std::vector<Registrar> r;
  return r;
}

// (seed, offset) for one dropout call, taken from torch's CUDA generator of the current device, so
// torch.manual_seed reproduces every mask.
static std::tuple<uint64_t, uint64_t> philox_seed_offset() {
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                 at::cuda::detail::getDefaultCUDAGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  // Our counters put the element group in words 0-1 and the offset in words 2-3, so any distinct
  // offset gives an independent stream; advancing by a multiple of 4 keeps torch's own accounting.
  at::PhiloxCudaState state = gen->philox_cuda_state(4);
  LSMINI_CHECK(!state.captured_,
              "lsmini dropout: drawing a dropout seed while capturing a CUDA graph is not supported");
  return {state.seed_.val, state.offset_.val};
}

}  // namespace lsmini

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lsmini fused CUDA kernels";
  m.def("philox_seed_offset", &lsmini::philox_seed_offset, "(seed, offset) for one dropout call");
  for (auto r : lsmini::registrars()) r(m);
}
