#pragma once
// Internal: the state a Reducer shares with its hooks and engine callbacks.

#include <gradaccum/reducer.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace gradaccum {
namespace detail {

constexpr int64_t kMiB = 1024 * 1024;

std::vector<at::Tensor> allgather(c10d::ProcessGroup& group, const at::Tensor& input);
int64_t consensus_modulus(int world, at::ScalarType meta_dtype);
std::string message_of(const std::exception& e);
const char* reduction_name(int64_t code);
void check_request(const ReductionRequest& request);

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

} // namespace detail

using detail::kMiB;
using detail::allgather;
using detail::check_request;
using detail::consensus_modulus;
using detail::message_of;
using detail::on_view;
using detail::reduction_name;
using detail::view_handle;

struct Reducer::State : std::enable_shared_from_this<Reducer::State> {
  // Fixed after construction.
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> buffers;
  std::vector<std::string> names;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  ReducerOptions options;
  WindowRule rule;
  int rank = 0;
  int world = 1;
  int64_t modulus = 2;
  int64_t numel = 0; ///< of all parameters: the terms of the window's norm
  // Set by use_buckets(); rebuilt once, see Note [Rebuilding buckets in ready order].
  std::vector<Bucket> buckets;
  std::vector<std::pair<size_t, size_t>> locator; ///< (bucket, slot) of each parameter
  // shared_ptr<Node> before torch 2.13, intrusive_ptr<Node> since: whatever
  // grad_accumulator() returns.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> grad_accumulators;
  std::vector<uintptr_t> hook_keys;

  std::atomic<bool> expect_hooks{true};
  /// Whether a hook fired for each parameter since the last reduction: with
  /// bucket views .grad is always defined, so this tells "no gradient" apart.
  std::unique_ptr<std::atomic<bool>[]> touched;
  std::atomic<bool> closed{false}; ///< the Reducer was destroyed: hooks are inert

  // Everything below is guarded by mutex: CUDA backward runs hooks on device
  // threads, and a failed backward's guard runs wherever torch frees the task.
  mutable std::mutex mutex;
  bool in_flight = false;
  ReductionRequest request;
  uint64_t sync_id = 0; ///< which reduction the queued callbacks belong to
  int anchor_task = -1; ///< see Note [Where a synchronising backward ends]
  int last_anchor_task = -1;
  std::vector<char> ready;
  size_t next_launch = 0;
  bool aborted_here = false; ///< this rank dropped the last reduction itself
  std::string failure; ///< why the last reduction dropped its window ("" if it did not)
  int64_t sequence = 0; ///< reductions completed: the next one's window number
  /// comm_dtype to bf16/fp16: each rank multiplies its gradients by 1 / this
  /// before rounding them (so that fp16 cannot overflow in the sum), fixed when
  /// the reduction begins (Note [Scaling before the sum]).
  double expected_weight = 1.0;
  /// The global weight of the last full window reduced (the same on every
  /// rank); 0 before the first. The expected weight of the next items window.
  double last_weight = 0;
  /// Each bucket's summed meta (Note [Bucket meta layout]), read once per reduction.
  std::vector<std::vector<double>> summed_meta;
  bool buckets_final = false; ///< rebuilt in ready order, or never to be
  size_t hook_launches = 0; ///< buckets this reduction's hooks launched
  size_t early_launches = 0; ///< of those, launched before the last hook so far
  std::vector<size_t> ready_order; ///< this reduction's, while !buckets_final
  ReductionResult last_result;
  ReducerStats stats;

  const std::string& name(size_t index) const {
    return names[index];
  }
  at::Device metadata_device() const {
    // NCCL reduces device tensors only; every other backend takes CPU tensors.
    // A group of per-device backends without one for the CPU gets its metadata
    // on the parameters' device too.
    const bool cpu_reachable = reaches(c10::DeviceType::CPU);
    return group->getBackendType() == c10d::ProcessGroup::BackendType::NCCL || !cpu_reachable
        ? params.front().device()
        : at::Device(at::kCPU);
  }
  // Whether the group can reduce tensors of `type`. A group that registers no
  // per-device backends (a wrapper overriding the collectives) is trusted.
  bool reaches(c10::DeviceType type) const {
    if (!group->hasBackends()) {
      return true;
    }
    try { // (hasBackendForDeviceType() is newer than torch 2.11)
      return group->getBackend(type).defined();
    } catch (const c10::Error&) {
      return false;
    }
  }
  // A group whose backends are registered per device type (as torch's and
  // gradaccum's own) must have one for each parameter's device: an NCCL-only
  // group cannot reduce CPU parameters, and would fail only at the first
  // synchronising backward, after a window of work.
  void check_group_reaches(size_t index) const {
    const auto device = params[index].device();
    TORCH_CHECK_VALUE(reaches(device.type()),
        "gradaccum: Accumulator(): the process group (backend '", group->getBackendName(),
        "') has no backend for ", device.type(), " tensors, and ", name(index), " is on ", device,
        ": move the model to a device the group reduces (model.to('cuda') under NCCL) or use a "
        "Gloo group for CPU training");
  }

  void check_ranks_match();
  std::vector<Bucket> build_buckets(const std::vector<std::vector<size_t>>& layout) const;
  void use_buckets(std::vector<Bucket> built);
  std::optional<std::vector<Bucket>> agree_on_ready_order();
  void switch_buckets(std::vector<Bucket> built) noexcept;
  void broadcast_parameters_from_rank0();
  void broadcast_from_rank0(const std::vector<at::Tensor>& tensors);

  void add_hooks();
  void mark_ready(size_t index);
  void clear_touched() {
    for (const auto i : c10::irange(params.size())) {
      touched[i].store(false, std::memory_order_relaxed);
    }
  }
  std::string foreign_hooks() const;
  int64_t kind = 0; ///< of the reduction in flight: 0 window, 1 snapshot
  void begin_reduction(const ReductionRequest& req, int task);
  /// kKind's value: the kind, plus 2 while the bucket rebuild is pending.
  int64_t kind_code() const {
    return kind + (buckets_final ? 0 : 2);
  }
  void queue_end_callback(int task);
  void on_task_end(uint64_t id, int task);
  void on_task_failed(uint64_t id) noexcept;
  void copy_into_bucket(Bucket& bucket, size_t slot);
  void launch_ready_buckets();
  void launch_bucket(size_t index);
  void launch_rest();
  void wait_all(const char* what);
  ReductionResult finish_reduction(std::vector<at::Tensor>* snapshot = nullptr);
  void abort_reduction(AbortReason reason) noexcept;
  [[noreturn]] void fail(const std::string& message);
  void end_dropped_window() noexcept;
  void check_consensus(const at::Tensor& headers);
  void drop_window();
  void end_reduction(bool window_closed = true);
  bool write_back(Bucket& bucket, const std::vector<double>& meta, bool divide, double divisor,
                  bool check_finite);
  void compress(Bucket& bucket);
  void read_all_meta();
  std::string window_label() const {
    return "window " + std::to_string(sequence);
  }
};

} // namespace gradaccum
