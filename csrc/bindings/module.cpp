// lsmini._C: the one Python module of the extension. Each csrc/bindings/<family>.cpp registers its own
// functions (LSMINI_REGISTER_OPS), so adding an op family never touches this file unless the family
// has a size limit to export through limits().
#include "common.h"

#include <ATen/cuda/CUDAGeneratorImpl.h>

#include "adam.h"
#include "attention.h"
#include "attention_softmax.h"
#include "cross_entropy.h"
#include "layernorm.h"
#include "ops.h"
#include "rms_norm.h"

#include <mutex>

namespace lsmini {

std::vector<Registrar>& registrars() {
  static std::vector<Registrar> r;
  return r;
}

// The Philox state of one dropout call, from torch's CUDA generator of device device_index (-1: the
// current device), so torch.manual_seed reproduces every mask: (seed, offset, seed_ptr, offset_ptr) as the
// bindings take it (common.h's philox_args). Eager: (seed, offset, 0, 0). Under CUDA graph capture torch
// hands out device words that it refills before every replay, so each replay draws fresh masks: (0, offset
// within the graph, address of the seed, address of the base offset).
PhiloxTuple philox_seed_offset(c10::DeviceIndex device_index) {
  // That device current while the generator is read: whether a capture is under way is asked of the
  // current device's stream. A guard here costs far less than switching devices from Python per call.
  c10::cuda::OptionalCUDAGuard guard;
  if (device_index >= 0) guard.set_index(device_index);
  auto gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(
      std::nullopt, at::cuda::detail::getDefaultCUDAGenerator(device_index));
  std::lock_guard<std::mutex> lock(gen->mutex_);
  // Our counters put the element group in words 0-1 and the offset in words 2-3, so any distinct
  // offset gives an independent stream; advancing by a multiple of 4 keeps torch's own accounting.
  const at::PhiloxCudaState state = gen->philox_cuda_state(4);
  if (!state.captured_) return {state.seed_.val, state.offset_.val, 0, 0};
  return {0, state.offset_intragraph_, reinterpret_cast<int64_t>(state.seed_.ptr),
          reinterpret_cast<int64_t>(state.offset_.ptr)};
}

// The kernels' size limits, the source of lsmini.limits: Python checks inputs against the kernels'
// own constants (its copy of the table serves only installs without the extension).
static pybind11::dict limits() {
  pybind11::list head_dims;
  for (const int head_dim : kAttentionHeadDims) head_dims.append(head_dim);
  pybind11::dict table;
  table["layernorm_max_hidden"] = kLayerNormMaxHidden;
  table["rms_norm_max_hidden"] = kRmsNormMaxHidden;
  table["attention_softmax_max_keys"] = kAttentionSoftmaxMaxKeys;
  table["attention_head_dims"] = head_dims;
  table["adam_max_groups"] = kAdamMaxGroups;
  table["cross_entropy_max_vocab"] = kCrossEntropyMaxVocab;
  return table;
}

}  // namespace lsmini

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lsmini fused CUDA kernels";
  m.def("philox_seed_offset", &lsmini::philox_seed_offset,
        "(seed, offset, seed_ptr, offset_ptr) for one dropout call on CUDA device device_index (-1: the "
        "current one); the pointers are 0 unless a CUDA graph is being captured",
        pybind11::arg("device_index") = -1);
  m.def("limits", &lsmini::limits,
        "the kernels' size limits: {layernorm_max_hidden, rms_norm_max_hidden, attention_softmax_max_keys, "
        "attention_head_dims, adam_max_groups, cross_entropy_max_vocab}, a fresh dict on each call");
  for (auto r : lsmini::registrars()) r(m);
}
