#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradaccum {

/// Groups parameters into buckets, as torch DDP does: by (dtype, device), walking
/// the parameters in reverse registration order (the order backward makes their
/// gradients ready), closing a bucket once it holds `first_cap_bytes` (the first
/// bucket of each group) or `cap_bytes` (the others). Returns indices into
/// `params`; buckets are ordered by when backward is expected to fill them.
std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<at::Tensor>& params,
    int64_t first_cap_bytes,
    int64_t cap_bytes);

/// One flat buffer of gradients, reduced by one collective.
///
/// The buffer is `[gradients | meta]` when the dtype holds counts exactly enough
/// (float32, float64); otherwise `meta` is a float32 tensor of its own and the
/// bucket costs a second collective. `meta` is `[window weight, flushing, one
/// has-gradient flag per parameter]`: summed over ranks it gives the window's
/// divisor (items or micro-steps, all ranks), whether some rank was closing a
/// partial window with flush(), and which parameters got no gradient anywhere,
/// with no collective of its own.
struct Bucket {
  /// Builds the buffer and the per-parameter views for `params[indices]`.
  Bucket(const std::vector<at::Tensor>& params, std::vector<size_t> indices);

  std::vector<size_t> params; ///< indices into the reducer's parameters
  std::vector<at::Tensor> views; ///< one per parameter, shaped like it
  at::Tensor buffer; ///< what the collective reduces
  at::Tensor gradients; ///< buffer's gradient part
  at::Tensor meta; ///< [weight, flushing, flags…]
  bool meta_in_buffer = false;

  // State of the synchronising backward in flight.
  size_t pending = 0; ///< parameters not yet ready
  std::vector<size_t> missing; ///< slots with no local gradient (sent as zeros)
  std::vector<c10::intrusive_ptr<c10d::Work>> works;

  /// Bytes one launch hands to the collectives.
  int64_t bytes() const;
  static constexpr int64_t kMetaHeader = 2;
  at::Tensor weight() const {
    return meta.narrow(0, 0, 1);
  }
  at::Tensor flushing() const {
    return meta.narrow(0, 1, 1);
  }
  at::Tensor flags() const {
    return meta.narrow(0, kMetaHeader, static_cast<int64_t>(params.size()));
  }
};

} // namespace gradaccum
