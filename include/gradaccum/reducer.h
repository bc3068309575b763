#pragma once

#include <gradaccum/bucket.h>
#include <gradaccum/options.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace gradaccum {

/// Counters of the reducer's collectives.
struct ReducerStats {
  int64_t buckets = 0;
  int64_t windows = 0; ///< reductions completed
  int64_t collectives = 0; ///< all-reduces launched, in all
  int64_t bytes_reduced = 0; ///< bytes handed to all-reduces, in all
  int64_t last_window_collectives = 0;
  int64_t last_window_bytes = 0;
  int64_t broadcasts = 0; ///< buffer broadcasts at windows' ends
};

/// Data-parallel gradient reduction over a c10d ProcessGroup, driven by autograd.
///
/// A post-hook on each parameter's gradient accumulator fires once `.grad` holds
/// the parameter's gradient. While `expect_hooks()` is false (no_sync micro-steps)
/// the hook returns at once and gradients accumulate locally in `.grad`. While it
/// is true, the hook copies the gradient into its bucket (nothing to copy with
/// `gradient_as_bucket_view`) and, once a bucket is full, all-reduces it
/// asynchronously while backward goes on. A callback queued on the autograd
/// engine runs at the end of that backward: it launches what is left, waits, and
/// writes the reduced gradient, divided by the window's weight summed over ranks,
/// back into `.grad`.
///
/// Collectives pair up by order, so buckets are launched strictly in index
/// order on every rank, whatever order the hooks fire in. Buckets are built once,
/// at construction, never in the middle of a window.
class Reducer {
 public:
  /// Registers the hooks; with `options.check_parameters()`, checks that every
  /// rank has the same parameters (a collective), then broadcasts `params` and
  /// `buffers` from rank 0. `names` (optional) name parameters in errors.
  Reducer(
      std::vector<at::Tensor> params,
      c10::intrusive_ptr<c10d::ProcessGroup> group,
      ReducerOptions options = {},
      std::vector<at::Tensor> buffers = {},
      std::vector<std::string> names = {});
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// Whether the next backward synchronises (false inside no_sync).
  bool expect_hooks() const {
    return expect_hooks_;
  }
  void set_expect_hooks(bool expect) {
    expect_hooks_ = expect;
  }

  /// This rank's share of the next reduction's divisor (1 by default: the
  /// result is then the mean over ranks, as torch DDP gives). Reset to 1 after
  /// each reduction.
  void set_window_weight(double weight);
  /// Whether the reduced sum is divided by the summed weights (false: a sum).
  void set_divide(bool divide) {
    divide_ = divide;
  }

  /// Reduces now, outside backward, whatever `.grad` holds (closing a partial
  /// window). Returns the window weight summed over ranks.
  double synchronize();

  /// Whether some rank's synchronize() took part in the last reduction: then
  /// every rank's last window was already reduced with the partial windows,
  /// and a flush() on a rank with nothing accumulated must not reduce again.
  bool last_reduction_closed_partial_windows() const;

  /// Drops the state of a synchronising backward that failed before its end
  /// (the engine then never runs the end-of-backward callback). Collectives
  /// already launched cannot be taken back: peers may wait on this rank.
  void abandon_reduction();

  /// Makes `.grad` zero (bucket views stay views) or undefined (copy mode).
  void zero_grad();

  /// Number of reductions completed (synchronising backwards and synchronize()).
  int64_t windows() const {
    return stats_.windows;
  }
  ReducerStats stats() const;
  const std::vector<Bucket>& buckets() const {
    return buckets_;
  }
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const {
    return group_;
  }
  const ReducerOptions& options() const {
    return options_;
  }

 private:
  void check_parameters_match();
  void broadcast_parameters_from_rank0();
  void broadcast_from_rank0(const std::vector<at::Tensor>& tensors);
  at::Device metadata_device() const;
  const std::string& name(size_t index) const;

  void mark_ready(size_t index);
  void begin_reduction();
  void begin_sync_backward();
  void copy_into_bucket(Bucket& bucket, size_t slot);
  void launch_ready_buckets();
  void launch_bucket(Bucket& bucket);
  void finalize_backward();
  double finish_reduction(bool read_weight);
  void end_reduction();
  void write_back(Bucket& bucket, bool divide);

  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> buffers_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  ReducerOptions options_;

  std::vector<Bucket> buckets_;
  /// (bucket, slot) of each parameter.
  std::vector<std::pair<size_t, size_t>> locator_;
  /// Keeps the accumulators (and so the hooks) alive: a leaf holds them weakly.
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> grad_accumulators_;
  std::vector<uintptr_t> hook_keys_;

  bool expect_hooks_ = true;
  bool divide_ = true;
  double window_weight_ = 1.0;

  // State of the synchronising backward in flight; guarded by mutex_ because
  // CUDA backward runs hooks on device threads.
  std::mutex mutex_;
  bool sync_in_flight_ = false;
  bool flushing_ = false; ///< the reduction in flight comes from synchronize()
  std::vector<char> ready_;
  int sync_task_ = -1; ///< autograd graph task of the last synchronising backward
  size_t next_launch_ = 0;

  ReducerStats stats_;
};

/// RAII guard: backward passes inside it accumulate locally, with no collective
/// (torch DDP's `no_sync`). Only the backward needs to be inside; the forward
/// may be anywhere. A null reducer makes it a no-op.
class NoSync {
 public:
  explicit NoSync(Reducer* reducer);
  ~NoSync();
  NoSync(NoSync&& other) noexcept;
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;
  NoSync& operator=(NoSync&&) = delete;

 private:
  Reducer* reducer_;
  bool previous_ = true;
};

} // namespace gradaccum
