#pragma once
// Internal: a gradient's version, as the checks that compare .grad before and
// after a backward read it.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace gradaccum::detail {

/// An inference tensor (a .grad made inside torch.inference_mode()) keeps no
/// version counter, and reading it raises torch's own error, on that rank
/// alone and before any micro-step could fail as one (review: the other ranks
/// waited for the group's timeout). It reads as this constant: a backward
/// cannot add to it in place (torch refuses an in-place update of an
/// inference tensor outside inference mode), so that backward fails, as a
/// micro-step, and its failure is handled as any other.
constexpr int64_t kInferenceGradVersion = -2;

inline int64_t grad_version(const at::Tensor& grad) {
  return !grad.defined() ? -1 : grad.is_inference() ? kInferenceGradVersion : grad._version();
}

} // namespace gradaccum::detail
