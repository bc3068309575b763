#pragma once
// Internal: the few collectives the reducer runs besides its buckets'
// all-reduces, and what every layer above needs to talk about a group.

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <exception>
#include <string>
#include <vector>

namespace gradaccum::detail {

/// The message of `e`, without a c10::Error's C++ backtrace or a Python
/// error's "At:" trace.
std::string message_of(const std::exception& e);

/// Every rank's `input`, in rank order (a collective; waits).
std::vector<at::Tensor> allgather(c10d::ProcessGroup& group, const at::Tensor& input);

/// Gives every rank a root's values of a fixed set of tensors (the module's
/// buffers): one broadcast per (dtype, device), through a flat copy allocated
/// once, here (Note [The buffers' broadcast allocates nothing]).
class BroadcastPlan {
 public:
  BroadcastPlan() = default;
  explicit BroadcastPlan(const std::vector<at::Tensor>& tensors);

  /// A collective; waits. Launches every broadcast, even after one failed on
  /// this rank, and then rethrows the first failure.
  void run(c10d::ProcessGroup& group, int root) const;

  bool empty() const {
    return groups_.empty();
  }

 private:
  struct Group {
    std::vector<at::Tensor> members;
    at::Tensor flat;
  };
  std::vector<Group> groups_;
};

/// The dims along which `t` is expanded (stride 0, size > 1): OnceBroadcast
/// sends the slice such a tensor repeats, so the construction check compares
/// them (one rule for both).
std::vector<int64_t> expanded_dims(const at::Tensor& t);

/// Gives every rank a root's values of tensors broadcast once (the frozen
/// parameters at construction, as torch DDP syncs its module's states), bit
/// for bit whatever their dtype: one of at least kInPlaceBytes by itself (in
/// place where contiguous, else through a copy of its own); the rest through
/// one flat byte copy per device type. Every copy is allocated here, so that
/// run() allocates nothing. The plan follows device types, dtypes and sizes
/// and expanded dims only (what the construction check compares), never
/// other strides; an expanded tensor sends the slice it repeats; sparse and
/// quantized ones are left out.
class OnceBroadcast {
 public:
  static constexpr int64_t kInPlaceBytes = int64_t{1} << 20;
  OnceBroadcast() = default;
  explicit OnceBroadcast(const std::vector<at::Tensor>& tensors);

  /// A collective; waits. Launches every broadcast, even after one failed on
  /// this rank, and then rethrows the first failure.
  void run(c10d::ProcessGroup& group, int root) const;

 private:
  struct Own {
    at::Tensor tensor;
    at::Tensor bytes; ///< its bytes, or a contiguous copy's
  };
  struct Staged {
    std::vector<at::Tensor> members;
    std::vector<int64_t> offsets; ///< in bytes, aligned for any dtype
    at::Tensor flat; ///< bytes
  };
  std::vector<Own> own_;
  std::vector<Staged> staged_;
};

/// The lowest rank whose `here` is true, or the group's size if none is (an
/// all-reduce MIN of one integer through `scratch`, a one-element int64
/// tensor allocated earlier: nothing is allocated before the collective
/// launches; a collective, waits).
int lowest_rank_where(c10d::ProcessGroup& group, bool here, at::Tensor scratch);

/// The lowest rank of the best tier: each rank gives its `tier` (0 is the
/// best; `tiers`: none), and every rank gets the lowest rank among those of
/// the lowest tier given, or the group's size if every rank gave `tiers` (one
/// all-reduce MIN of one integer on `device`; a collective, waits).
int lowest_rank_of_best_tier(c10d::ProcessGroup& group, int tier, int tiers, const at::Device& device);

/// Whether `group` can reduce tensors of `type`. A group that registers no
/// per-device backends (a wrapper overriding the collectives) is trusted.
bool group_reaches(c10d::ProcessGroup& group, c10::DeviceType type);

/// A device the group reaches when the parameters' device is not one (a
/// refusing rank's CPU or meta parameters): the current device of the
/// group's first per-device backend other than the CPU's (NCCL's CUDA,
/// XCCL's XPU, ...); CUDA's for a group without per-device backends.
at::Device reached_device(c10d::ProcessGroup& group);

/// Where the group's small collectives (checks, orders, a bucket's meta) put
/// their tensors, for parameters on `params_device`.
at::Device metadata_device(c10d::ProcessGroup& group, at::Device params_device);

} // namespace gradaccum::detail
