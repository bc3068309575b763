#pragma once
// Internal: accumulate_dtype for one process. The same wide buckets and the
// same precision functions as data parallel (Note [One accumulate_dtype
// path]); only the collective is missing.

#include <gradaccum/bucket.h>

#include <ATen/ATen.h>

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gradaccum::detail {

// Note [One accumulate_dtype path]
// A window's gradients summed in a dtype wider than the parameters' live in a
// Bucket whose buffer has that dtype (Bucket::accumulating), whether or not
// there is a process group: data parallel, the reducer's buckets; one
// process, a WideSums, which builds one such bucket per (dtype, device) group
// of narrower parameters (a world of one: no collective, no meta is read).
// Both add `.grad` into the bucket after each micro-step (accumulate_grads),
// write the sum back rounded once (write_back_wide), save it for a checkpoint
// (accumulated_sums) and load it (load_wide_sum), all in src/precision/.
class WideSums {
 public:
  /// Empty (holds() is false everywhere) unless some parameter is narrower
  /// than `dtype`.
  WideSums(const std::vector<at::Tensor>& params, at::ScalarType dtype);

  /// Whether parameter `i`'s window is summed here.
  bool holds(size_t i) const {
    return i < locator_.size() && locator_[i].first != kNone;
  }
  bool empty() const {
    return buckets_.empty();
  }
  /// Adds each held parameter's `.grad` into its sum and releases it.
  void add(const std::vector<at::Tensor>& params);
  /// Writes the window's sums back into `.grad` (divided by `divisor` when
  /// given) and starts the next window at zero.
  void write_back(const std::vector<at::Tensor>& params, std::optional<double> divisor);
  /// The window's sums so far (a copy; undefined where nothing was added).
  std::vector<at::Tensor> sums() const;
  /// Restores parameter `i`'s sum from a checkpoint.
  void load(size_t i, const at::Tensor& sum, const std::string& name, at::IntArrayRef sizes);
  /// Drops the window's sums.
  void clear();

 private:
  static constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> locator_; ///< (bucket, slot), or kNone
  std::unique_ptr<std::atomic<bool>[]> touched_; ///< per parameter: added to this window
  size_t parameters_ = 0;
  bool any_touched_ = false;
};

} // namespace gradaccum::detail
