#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace gradaccum {

/// Groups parameters into buckets, as torch DDP does: by (dtype, device), walking
/// the parameters in the order backward makes their gradients ready, closing a
/// bucket once it holds `first_cap_bytes` (the first bucket of each group) or
/// `cap_bytes` (the others). That order is `ready_order` (a permutation of the
/// indices: the order a backward was seen to produce) when given, else reverse
/// registration order (the usual guess). Returns indices into `params`;
/// buckets are ordered by when backward is expected to fill them.
std::vector<std::vector<size_t>> assign_buckets(
    const std::vector<at::Tensor>& params,
    int64_t first_cap_bytes,
    int64_t cap_bytes,
    const std::vector<size_t>& ready_order = {});

// Note [Bucket meta layout]
// Every bucket's buffer is `[gradients | meta]` when its dtype holds small
// integers exactly (float32, float64); otherwise `meta` is a float32 tensor of
// its own, reduced by a second collective right after the buffer. `meta` is a
// header of `MetaField`s followed by one has-gradient flag per parameter, and
// the collective sums all of it over ranks, so with no collective of its own
// every rank learns:
//  - the window's divisor (kWeight: items or micro-steps, all ranks),
//  - how many ranks closed a partial window with flush() (kFlushing),
//  - how many ranks drop the window, which one and why (kAbort*; see
//    Note [Dropping a window]),
//  - whether every rank agrees on what must be equal (the window sequence
//    number, steps, the reduction, the bucket's index, the kind of reduction):
//    each such value v is
//    sent as (v mod M, (v mod M)^2); over W ranks the values are all equal iff
//    W * sum(v^2) == sum(v)^2. M is chosen so both sums stay exact integers in
//    the meta's dtype (see consensus_modulus()).
//  - which parameters got no gradient on any rank (the flags).
// The reducer writes the header in launch_bucket() and reads it in
// check_consensus(); the layout is the same on every rank because the buckets
// are (checked at construction, or by the index field at the first window).
enum MetaField : int64_t {
  kWeight = 0,
  kFlushing,
  kAbort,
  kAbortRank,
  kAbortReason,
  kWindow,
  kWindowSquare,
  kSteps,
  kStepsSquare,
  kReductionMode,
  kReductionModeSquare,
  kBucketIndex,
  kBucketIndexSquare,
  kKind, ///< 0: a window's reduction, 1: a checkpoint's snapshot of a half-done window
  kKindSquare,
  kMetaHeader, // the header's length
};

/// One flat buffer of gradients, reduced by one collective (see Note [Bucket
/// meta layout]).
struct Bucket {
  /// Builds the buffer and the per-parameter views for `params[indices]`, in
  /// `dtype` when given (fp32 accumulation of bf16 parameters), else theirs.
  Bucket(const std::vector<at::Tensor>& params, std::vector<size_t> indices,
         std::optional<at::ScalarType> dtype = std::nullopt);

  std::vector<size_t> params; ///< indices into the reducer's parameters
  std::vector<at::Tensor> views; ///< one per parameter, shaped like it
  at::Tensor buffer; ///< what the collective reduces
  at::Tensor gradients; ///< buffer's gradient part
  at::Tensor meta; ///< [header (MetaField), flags…]
  bool meta_in_buffer = false;
  /// The buffer is wider than the parameters (accumulate_dtype): micro-steps'
  /// gradients are summed in it and `.grad` holds none between them.
  bool accumulating = false;

  // State of the reduction in flight.
  size_t pending = 0; ///< parameters not yet ready
  std::vector<size_t> missing; ///< slots with no local gradient (sent as zeros)
  std::vector<c10::intrusive_ptr<c10d::Work>> works;

  /// Bytes one launch hands to the collectives.
  int64_t bytes() const;
  at::Tensor header() const {
    return meta.narrow(0, 0, kMetaHeader);
  }
  at::Tensor weight() const {
    return meta.narrow(0, kWeight, 1);
  }
  at::Tensor flags() const {
    return meta.narrow(0, kMetaHeader, static_cast<int64_t>(params.size()));
  }
};

} // namespace gradaccum
