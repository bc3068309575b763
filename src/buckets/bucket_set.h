#pragma once
// Internal: a reducer's buckets as one set: laid out, built, found by
// parameter, and rebuilt once in backward's order.

#include "reducer/config.h"

#include <gradaccum/bucket.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gradaccum::detail {

// Note [Bucket views as .grad]
// With gradient_as_bucket_view, `.grad` is an alias of its bucket view, never
// the view itself: `p.grad.data = t` (or anything else that swaps a tensor's
// storage) then moves the alias off the bucket, and the bucket's own view stays
// put. Whether `.grad` still is the bucket's memory is asked of its storage and
// place (on_view), not of its identity; one that is not is copied in and
// re-pointed at a fresh alias (view_handle), as torch DDP does.
inline at::Tensor view_handle(const at::Tensor& view) {
  return at::alias(view);
}
inline bool on_view(const at::Tensor& grad, const at::Tensor& view) {
  return grad.defined() && !grad.is_sparse() && grad.is_alias_of(view) &&
      grad.storage_offset() == view.storage_offset() && grad.sizes() == view.sizes() &&
      grad.strides() == view.strides();
}
/// Makes `grad` the bucket's memory again, as it is (no copy).
inline void repoint(at::Tensor& grad, const at::Tensor& view) {
  if (!on_view(grad, view)) {
    grad = view_handle(view);
  }
}

/// With gradient_as_bucket_view: copies each parameter's `.grad` into its view
/// in `buckets` and makes `.grad` an alias of it; an undefined `.grad` becomes
/// one too only with `undefined_too` (at construction).
void point_grads_at_views(std::vector<Bucket>& buckets, const std::vector<at::Tensor>& params,
                          bool undefined_too);

/// A bucket rebuild agreed on by every rank (BucketSet::agree_on_ready_order).
struct RebuildPlan {
  std::vector<std::vector<size_t>> layout; ///< the new buckets' parameters
  bool same = false; ///< the layout is the one in use: nothing to build
  std::string error; ///< this rank could not lay it out (then it builds nothing)
};

/// The buckets of one reducer and where each parameter lives in them. The
/// layout is the same on every rank (Note [Collectives pair by launch order]).
struct BucketSet {
  std::vector<Bucket> all; ///< in launch order
  std::vector<std::pair<size_t, size_t>> locator; ///< (bucket, slot) of each parameter
  int64_t modulus = 2; ///< the consensus modulus of all buckets (header_modulus())
  double exact_weights_below = 0; ///< exact_weight_bound() of all buckets
  bool final = false; ///< rebuilt in ready order, or never to be
  std::vector<size_t> ready_order; ///< the parameters in this window's hook order, while !final
  /// A window ran no hooks (compiled autograd): rank 0 gives the rebuild up.
  bool hookless = false;

  /// The layout of `config`'s parameters in ready order `order` (empty: the
  /// usual guess, reverse registration order): see assign_buckets().
  static std::vector<std::vector<size_t>> layout(const ReducerConfig& config,
                                                 const std::vector<size_t>& order = {});
  /// The one place buckets are made: at construction and at the rebuild.
  static std::vector<Bucket> build(const ReducerConfig& config, const std::vector<std::vector<size_t>>& layout);

  /// Makes `built` the set's buckets.
  void use(std::vector<Bucket> built, int world);
  Bucket& of(size_t param) {
    return all[locator[param].first];
  }
  /// Whether some bucket has `flag` set (Bucket::accumulating, compressed...).
  bool any(bool Bucket::*flag) const;

  /// Gives every rank rank 0's parameter values, through the buckets: one
  /// collective per bucket, no temporary copy of the model.
  void broadcast_parameters(const ReducerConfig& config);

  /// The rebuild's first collective (Note [Rebuilding buckets in ready
  /// order]): rank 0's order, broadcast. Returns the layout it gives, the
  /// same on every rank, when a rebuild follows; nothing when rank 0 saw no
  /// hook this window, or gave up. Allocates no bucket.
  std::optional<RebuildPlan> agree_on_ready_order(const ReducerConfig& config);
  /// The rebuild's second collective, between windows (after the
  /// write-back), on every rank alike: frees the old buckets' storage but
  /// `.grad` (bucket views), builds `plan`'s, all-gathers whether every
  /// rank built them, and switches to them if so; else builds the old layout
  /// again. Returns whether the new layout is in use; `failed` is the
  /// collective's own failure, if any (the old layout then stays too). Never
  /// throws: a rank that cannot build the old layout again is left `lost`.
  bool rebuild(RebuildPlan plan, const ReducerConfig& config, std::exception_ptr& failed) noexcept;
  /// Why this rank has no buckets (empty: it has): see rebuild().
  std::string lost;

 private:
  /// Moves `.grad` (bucket views) and the residuals (`residuals`, by
  /// residuals_by_slot() of the buckets in use) into `built`, then uses it. A
  /// local failure warns and loses what it moved.
  void switch_to(std::vector<Bucket> built, const std::vector<std::vector<at::Tensor>>& residuals,
                 const ReducerConfig& config) noexcept;
  /// Drops the storage of the buckets in use, keeping their layout (and,
  /// with `keep_views`, their gradients: .grad).
  void release(bool keep_views);
};

} // namespace gradaccum::detail
