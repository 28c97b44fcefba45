// The integers that cross the Python/C++ boundary, named. Python's copy is
// kernels/constants.py (KVKind, ScaleKind, ExpertActivation); the module exports these values
// as KV_KIND_*, SCALE_KIND_* and EXPERT_ACTIVATION_* (bindings.cpp) and tests/test_kernels.py
// checks that the two agree.
#pragma once
#include <cstdint>

namespace expresslane {

// How a layer's KV cache is stored (models/kv_store.py: each store's NATIVE_KIND).
enum class KVKind : int64_t { kPlain = 0, kFp8 = 1, kFp4 = 2, kBf16 = 3 };

// How an FP4 weight's block-scale bytes are read (quant/formats.py: kernel_scale_kind).
enum class ScaleKind : int64_t { kE8M0 = 0, kE4M3 = 1 };

// An expert's activation between its gate_up and down linears (models/moe.py: ACTIVATION).
enum class ExpertActivation : int64_t { kSwiGLU = 0, kClampedSwiGLU = 1 };

template <typename Kind>
constexpr int64_t value(Kind kind) {
  return static_cast<int64_t>(kind);
}

}  // namespace expresslane
