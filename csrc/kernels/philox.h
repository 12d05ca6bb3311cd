// The Philox (seed, offset) of one dropout call as every dropout launcher and kernel takes it. Host code
// (the bindings) builds it, so it lives here rather than in common.cuh, which is device code.
#pragma once

#include <stdint.h>

namespace lsmini {

// Passed by value to the kernels. Eager: seed_ptr == offset_ptr == nullptr and (seed, offset) are the
// values to use. Under CUDA graph capture the values change at every replay, so the kernel must read
// them at run time: seed_ptr / offset_ptr point at the device words torch's generator refills before
// each replay, and `offset` is this call's constant part within the graph (it is added to *offset_ptr).
// resolve_philox (common.cuh) turns either form into the pair a kernel keys its Philox calls with.
struct PhiloxArgs {
  uint64_t seed;
  uint64_t offset;
  const int64_t* seed_ptr;
  const int64_t* offset_ptr;
};

}  // namespace lsmini
