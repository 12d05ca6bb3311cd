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

// The Philox state of one dropout call, from torch's CUDA generator of the current device, so
// torch.manual_seed reproduces every mask: (seed, offset, seed_ptr, offset_ptr) as the bindings take it
// (common.h's philox_args). Eager: (seed, offset, 0, 0). Under CUDA graph capture torch hands out device
// words that it refills before every replay, so each replay draws fresh masks: (0, offset within the
// graph, address of the seed, address of the base offset).
static std::tuple<uint64_t, uint64_t, int64_t, int64_t> philox_seed_offset() {
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                 at::cuda::detail::getDefaultCUDAGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  // Our counters put the element group in words 0-1 and the offset in words 2-3, so any distinct
  // offset gives an independent stream; advancing by a multiple of 4 keeps torch's own accounting.
  const at::PhiloxCudaState state = gen->philox_cuda_state(4);
  if (!state.captured_) return {state.seed_.val, state.offset_.val, 0, 0};
  return {0, state.offset_intragraph_, reinterpret_cast<int64_t>(state.seed_.ptr),
          reinterpret_cast<int64_t>(state.offset_.ptr)};
}

}  // namespace lsmini

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lsmini fused CUDA kernels";
  m.def("philox_seed_offset", &lsmini::philox_seed_offset,
        "(seed, offset, seed_ptr, offset_ptr) for one dropout call; the pointers are 0 unless a CUDA graph "
        "is being captured");
  for (auto r : lsmini::registrars()) r(m);
}
