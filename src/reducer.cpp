#include <gradaccum/reducer.h>

#include <gradaccum/detail/checked_write.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <tuple>

// Note [Collectives pair by launch order]
// c10d pairs the n-th collective of one rank with the n-th of every other rank.
// So every reduction launches every bucket, strictly in index order, on every
// rank, whatever order the hooks fire in and whatever happens to this rank's
// backward: a failing rank still launches its remaining buckets (flagged, see
// Note [Dropping a window]), a rank whose loss touched no parameter launches
// them all at the end, and a closing micro-step always produces exactly one
// reduction. Buckets change only between windows, once, identically on every
// rank (Note [Rebuilding buckets in ready order]).
//
// Note [Rebuilding buckets in ready order]
// The first layout follows reverse registration order (assign_buckets), a
// guess at backward's order; when it is wrong (an embedding registered first
// but used last, modules built out of order) bucket 0 waits for the last
// gradient and nothing launches during backward. So, with
// ReducerOptions::rebuild_buckets, mark_ready records the order it sees the
// parameters in, and at the end of the first window reduced on every rank
// (phase 3 of finish_reduction, which every rank reaches alike: the consensus
// held; never a dropped window, never a snapshot) every rank takes rank 0's
// order, by one broadcast, and rebuilds its buckets from it; parameters rank 0
// did not see keep their relative order, at the end. The layouts stay
// identical across ranks, so the pairing above holds. A window in which rank 0
// saw no hook at all (a flush after no_sync micro-steps) tries again at the
// next. Whether a rebuild is pending travels in every bucket's kKind field
// (kind_code()), so ranks that disagree (rebuild_buckets differs with
// check_parameters off) drop the window instead of mis-pairing. Once rank 0
// sent an order, every rank takes part in an allgather of its outcome (built,
// same layout, failed: a local failure, out of memory say, is caught, never
// skips the collective) and every rank keeps the old buckets unless all built
// (neither it nor the broadcast is a gradient reduction: stats count neither). Done before
// the write-back, as every collective of phase 3, and applied after it (even
// if this rank's write-back fails): between windows only.
//
// Note [The last bucket closes the window]
// Hooks launch each bucket as soon as it is full, except the last: only
// finish_reduction() (which runs once the whole backward has succeeded) or
// abort_reduction() launch it. So the last bucket's meta always carries every
// rank's final word on the window: whether it drops it. A rank whose backward
// fails after all its gradients were ready still gets to say so.
//
// Note [Dropping a window]
// When a rank cannot contribute its window (its backward raised, it went on
// past the end of an epoch that others ended with flush(), its reducer was
// destroyed mid-backward), it completes the pairing anyway: it launches its
// remaining buckets with kAbort = 1 (and its rank and the reason), and waits
// for all of them. Every rank reads the summed header of the last bucket; a
// non-zero abort count makes every rank drop the window alike: gradients
// cleared, no optimizer step, the same error raised everywhere, and training
// can go on from the next window with every replica still identical. The same
// happens when the ranks disagree on what must be equal (Note [Bucket meta
// layout]): every rank sees the same sums, so every rank decides alike.
//
// Note [Where a synchronising backward ends]
// The reduction finishes in a callback queued on the autograd graph task that
// started it (the "anchor"): the root's task when run through backward(), else
// the task of the first hook. Reentrant activation checkpointing runs nested
// graph tasks inside the outer one; hooks from those are accepted, and if a
// hook comes from a task older than the anchor (an outer task), that task
// becomes the anchor, so the reduction finishes when the outermost task seen
// ends. Each queued callback holds a guard: if the engine destroys the
// callback without running it, that graph task failed, and the reduction is
// aborted right there (before the exception reaches the caller).

namespace gradaccum {
namespace {

constexpr int64_t kMiB = 1024 * 1024;
// Signature of one parameter for the cross-rank check: dtype, dim, sizes.
constexpr int64_t kMaxCheckedDims = 8;
constexpr int64_t kSignatureWidth = 2 + kMaxCheckedDims;

std::string describe(const at::Tensor& row) {
  std::ostringstream out;
  const auto dtype = static_cast<at::ScalarType>(row[0].item<int64_t>());
  const auto dim = row[1].item<int64_t>();
  out << dtype << " [";
  for (int64_t d = 0; d < std::min(dim, kMaxCheckedDims); ++d) {
    out << (d ? ", " : "") << row[2 + d].item<int64_t>();
  }
  out << (dim > kMaxCheckedDims ? ", ...]" : "]");
  return out.str();
}

std::vector<at::Tensor> allgather(
    c10d::ProcessGroup& group,
    const at::Tensor& input) {
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < group.getSize(); ++r) {
    outputs[0].push_back(at::empty_like(input));
  }
  std::vector<at::Tensor> inputs{input};
  group.allgather(outputs, inputs)->wait();
  return outputs[0];
}

// Graph-task ids come from one global counter, narrowed to int by torch: order
// them by a bounded distance so that a wrap after ~2^31 backward calls is fine.
bool older_task(int a, int b) {
  const int64_t newer_by = static_cast<int64_t>(b) - a;
  return newer_by > 0 && newer_by < (int64_t{1} << 30);
}

// The modulus M of Note [Bucket meta layout]: the largest power of two with
// world * (M - 1)^2 and world * M exact in the meta's dtype.
int64_t consensus_modulus(int world, at::ScalarType meta_dtype) {
  const int mantissa = meta_dtype == at::kDouble ? 53 : 24;
  int world_bits = 0;
  while ((int64_t{1} << world_bits) < world) {
    ++world_bits;
  }
  const int bits = std::max(1, std::min(20, (mantissa - world_bits) / 2));
  return int64_t{1} << bits;
}

// Note [Bucket views as .grad]
// With gradient_as_bucket_view, `.grad` is an alias of its bucket view, never
// the view itself: `p.grad.data = t` (or anything else that swaps a tensor's
// storage) then moves the alias off the bucket, and the bucket's own view stays
// put. Whether `.grad` still is the bucket's memory is asked of its storage and
// place (on_view), not of its identity; one that is not is copied in and
// re-pointed at a fresh alias (view_handle), as torch DDP does.
at::Tensor view_handle(const at::Tensor& view) {
  return at::alias(view);
}
bool on_view(const at::Tensor& grad, const at::Tensor& view) {
  return grad.defined() && !grad.is_sparse() && grad.is_alias_of(view) &&
      grad.storage_offset() == view.storage_offset() && grad.sizes() == view.sizes() &&
      grad.strides() == view.strides();
}

std::string message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) {
    return error->what_without_backtrace();
  }
  return e.what();
}

const char* reduction_name(int64_t code) {
  switch (code) {
    case 0: return "mean";
    case 1: return "sum";
    case 2: return "items";
    default: return "?";
  }
}

// The post-hook on each parameter's gradient accumulator. Its own type, so
// that foreign_hooks() tells gradaccum's (maybe inert) hooks from others'.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<Reducer::State> state, size_t index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override;

 private:
  std::weak_ptr<Reducer::State> state_;
  size_t index_;
};

// A pre-hook on the loss's grad_fn: runs first in the root graph task.
class RootHook : public torch::autograd::FunctionPreHook {
 public:
  explicit RootHook(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    fn_();
    return grads;
  }

 private:
  std::function<void()> fn_;
};

} // namespace

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

namespace {

// Runs the end-of-task callback; if the engine destroys it unrun, the task failed.
struct TaskGuard {
  TaskGuard(std::shared_ptr<Reducer::State> state_, uint64_t id_, int task_)
      : state(std::move(state_)), id(id_), task(task_) {}
  TaskGuard(const TaskGuard&) = delete;
  TaskGuard& operator=(const TaskGuard&) = delete;
  std::shared_ptr<Reducer::State> state;
  uint64_t id;
  int task;
  bool ran = false;
  ~TaskGuard() {
    if (!ran) {
      state->on_task_failed(id);
    }
  }
};

} // namespace

torch::autograd::variable_list ReadyHook::operator()(
    const torch::autograd::variable_list& outputs,
    const torch::autograd::variable_list& /*inputs*/) {
  if (auto state = state_.lock()) {
    state->mark_ready(index_);
  }
  return outputs;
}

// ---------------------------------------------------------------------------
// Construction

Reducer::Reducer(
    std::vector<at::Tensor> params,
    c10::intrusive_ptr<c10d::ProcessGroup> group,
    ReducerOptions options,
    std::vector<at::Tensor> buffers,
    std::vector<std::string> names,
    WindowRule rule)
    : state_(std::make_shared<State>()) {
  auto& s = *state_;
  s.params = std::move(params);
  s.buffers = std::move(buffers);
  s.names = std::move(names);
  s.group = std::move(group);
  s.options = options;
  s.rule = rule;
  TORCH_CHECK_VALUE(s.group, "Reducer: process_group is null");
  s.options.validate();
  TORCH_CHECK_VALUE(rule.steps >= 1, "Reducer: steps must be >= 1, got ", rule.steps);
  TORCH_CHECK_VALUE(
      !s.params.empty(), "Reducer: the model has no trainable parameters");
  TORCH_CHECK_VALUE(
      s.names.empty() || s.names.size() == s.params.size(),
      "Reducer: got ", s.names.size(), " names for ", s.params.size(), " parameters");
  if (s.names.empty()) {
    for (const auto i : c10::irange(s.params.size())) {
      s.names.push_back("parameter " + std::to_string(i));
    }
  }
  for (const auto i : c10::irange(s.params.size())) {
    const auto& p = s.params[i];
    TORCH_CHECK_VALUE(p.defined(), "Reducer: ", s.name(i), " is undefined");
    TORCH_CHECK_VALUE(p.is_leaf() && p.requires_grad(),
        "Reducer: ", s.name(i), " must be a leaf tensor that requires grad");
    TORCH_CHECK_VALUE(!p.is_sparse(), "Reducer: ", s.name(i), " is sparse; sparse parameters are not supported");
    s.check_group_reaches(i);
    s.numel += p.numel();
  }
  s.rank = s.group->getRank();
  s.world = s.group->getSize();
  s.touched.reset(new std::atomic<bool>[s.params.size()]);
  s.clear_touched();
  const auto foreign = s.foreign_hooks();
  if (!s.options.check_parameters()) {
    TORCH_CHECK_VALUE(foreign.empty(), foreign);
  }

  if (s.options.check_parameters()) {
    s.check_ranks_match();
  }

  s.use_buckets(s.build_buckets(assign_buckets(
      s.params,
      static_cast<int64_t>(s.options.first_bucket_cap_mb() * kMiB),
      static_cast<int64_t>(s.options.bucket_cap_mb() * kMiB))));
  s.buckets_final = !s.options.rebuild_buckets();
  if (!s.buckets_final) {
    s.ready_order.reserve(s.params.size());
  }
  s.ready.assign(s.params.size(), 0);

  s.broadcast_parameters_from_rank0();
  s.broadcast_from_rank0(s.buffers);

  if (s.options.gradient_as_bucket_view()) {
    // From now on backward accumulates straight into the buckets.
    for (auto& bucket : s.buckets) {
      for (const auto slot : c10::irange(bucket.params.size())) {
        auto& grad = s.params[bucket.params[slot]].mutable_grad();
        if (grad.defined()) {
          bucket.views[slot].copy_(grad);
        }
        grad = view_handle(bucket.views[slot]); // Note [Bucket views as .grad]
      }
    }
  }

  // The hooks hold the state weakly: once the Reducer is gone they do nothing,
  // and a hook never keeps the parameters' state alive on its own.
  std::weak_ptr<State> weak = state_;
  for (const auto i : c10::irange(s.params.size())) {
    auto accumulator = torch::autograd::impl::grad_accumulator(s.params[i]);
    s.hook_keys.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(weak, i)));
    s.grad_accumulators.push_back(std::move(accumulator));
  }
}

Reducer::~Reducer() {
  auto& s = *state_;
  s.closed = true;
  // Inside a backward on this thread (a hook dropped us), torch may be
  // iterating the very hook lists we would erase from: leave the hooks in
  // place, inert (they hold the state weakly, and `closed` is set).
  if (torch::autograd::get_current_graph_task_id() < 0) {
    try {
      for (const auto i : c10::irange(s.grad_accumulators.size())) {
        const bool removed = s.grad_accumulators[i]->del_post_hook(s.hook_keys[i]);
        TORCH_INTERNAL_ASSERT(removed, "gradaccum: the hook of ", s.name(i), " was already removed");
      }
    } catch (const std::exception& e) {
      TORCH_WARN("gradaccum: removing the reducer's hooks failed: ", e.what());
    }
  }
  // A synchronising backward still running holds the state through its
  // queued callback: it finishes (or aborts) the pairing with the other ranks
  // there, marked Closed. Nothing here blocks.
}

void Reducer::State::check_ranks_match() {
  const auto device = metadata_device();
  const auto n = static_cast<int64_t>(params.size());
  // Options every rank must share, then the parameter count.
  const std::vector<std::pair<const char*, double>> settings{
      {"steps", static_cast<double>(rule.steps)},
      {"reduction", static_cast<double>(static_cast<int>(rule.reduction))},
      {"bucket_cap_mb", options.bucket_cap_mb()},
      {"first_bucket_cap_mb", options.first_bucket_cap_mb()},
      {"gradient_as_bucket_view", options.gradient_as_bucket_view() ? 1.0 : 0.0},
      {"broadcast_buffers", options.broadcast_buffers() ? 1.0 : 0.0},
      {"rebuild_buckets", options.rebuild_buckets() ? 1.0 : 0.0},
      {"accumulate_dtype", rule.accumulate_dtype ? static_cast<double>(*rule.accumulate_dtype) : -1.0},
      {"comm_dtype", rule.comm_dtype ? static_cast<double>(*rule.comm_dtype) : -1.0},
      {"error_feedback", rule.error_feedback ? 1.0 : 0.0},
      {"the number of trainable parameters", static_cast<double>(n)},
  };
  // Another reducer's hooks (torch DDP) on some rank fail every rank alike.
  const auto foreign = foreign_hooks();
  {
    auto flag = at::full({1}, foreign.empty() ? 0.0 : 1.0, at::kDouble);
    const auto flags = allgather(*group, flag.to(device));
    TORCH_CHECK_VALUE(foreign.empty(), foreign);
    for (const auto r : c10::irange(flags.size())) {
      TORCH_CHECK_VALUE(flags[r].item<double>() == 0,
          static_cast<int>(r) == rank ? foreign
              : "gradaccum: rank " + std::to_string(r) + "'s parameters carry another reducer's "
                "gradient hooks (the model is also wrapped in torch DDP there?)");
    }
  }
  auto mine = at::empty({static_cast<int64_t>(settings.size())}, at::kDouble);
  for (const auto i : c10::irange(settings.size())) {
    mine[static_cast<int64_t>(i)].fill_(settings[i].second);
  }
  const auto all_settings = allgather(*group, mine.to(device));
  for (const auto i : c10::irange(settings.size())) {
    std::ostringstream values;
    bool differ = false;
    for (const auto r : c10::irange(all_settings.size())) {
      const double v = all_settings[r][static_cast<int64_t>(i)].item<double>();
      differ = differ || v != all_settings[0][static_cast<int64_t>(i)].item<double>();
      values << (r ? ", " : "") << "rank " << r << ": ";
      if (i == 1) {
        values << reduction_name(static_cast<int64_t>(v));
      } else if (std::string(settings[i].first).find("_dtype") != std::string::npos) {
        values << (v < 0 ? "None" : c10::toString(static_cast<at::ScalarType>(static_cast<int>(v))));
      } else {
        values << v;
      }
    }
    TORCH_CHECK_VALUE(!differ,
        "gradaccum: the ranks disagree on ", settings[i].first, " (", values.str(),
        "); every rank must build its Accumulator with the same options and model");
  }
  auto signature = at::full({n, kSignatureWidth}, -1, at::kLong);
  auto rows = signature.accessor<int64_t, 2>();
  for (const auto i : c10::irange(n)) {
    const auto& p = params[i];
    rows[i][0] = static_cast<int64_t>(p.scalar_type());
    rows[i][1] = p.dim();
    for (int64_t d = 0; d < std::min<int64_t>(p.dim(), kMaxCheckedDims); ++d) {
      rows[i][2 + d] = p.size(d);
    }
  }
  const auto all = allgather(*group, signature.to(device));
  const auto reference = all[0].cpu();
  for (const auto r : c10::irange<size_t>(1, all.size())) {
    const auto theirs = all[r].cpu();
    const auto differs = theirs.ne(reference).any(1).nonzero();
    if (differs.numel() > 0) {
      const auto i = differs[0][0].item<int64_t>();
      TORCH_CHECK_VALUE(false,
          "gradaccum: the model differs across ranks: ", name(i), " is ",
          describe(theirs[i]), " on rank ", r, " but ", describe(reference[i]),
          " on rank 0");
    }
  }
}

std::vector<Bucket> Reducer::State::build_buckets(const std::vector<std::vector<size_t>>& layout) const {
  // The one place buckets are made: construction and the rebuild alike.
  std::vector<Bucket> built;
  built.reserve(layout.size());
  for (const auto& indices : layout) {
    built.emplace_back(params, indices,
        BucketConfig{rule.accumulate_dtype, rule.comm_dtype, world, rule.error_feedback});
  }
  return built;
}

void Reducer::State::use_buckets(std::vector<Bucket> built) {
  buckets = std::move(built);
  locator.assign(params.size(), {0, 0});
  for (const auto b : c10::irange(buckets.size())) {
    for (const auto slot : c10::irange(buckets[b].params.size())) {
      locator[buckets[b].params[slot]] = {b, slot};
    }
  }
  // One modulus for all buckets: the narrowest meta dtype decides.
  modulus = consensus_modulus(world, at::kDouble);
  for (const auto& bucket : buckets) {
    // Digits carry integers below 2^32, so squares of values below 2^16.
    modulus = std::min(modulus, bucket.encoding == MetaEncoding::kDigits
        ? int64_t{1} << 16 : consensus_modulus(world, bucket.meta.scalar_type()));
  }
  summed_meta.assign(buckets.size(), {});
  stats.buckets = static_cast<int64_t>(buckets.size());
}

std::string Reducer::State::foreign_hooks() const {
  // torch DDP (and any other reducer) hooks the same gradient accumulators:
  // the gradient would be reduced twice. Ours are added after this check.
  for (const auto i : c10::irange(params.size())) {
    const auto accumulator = torch::autograd::impl::try_get_grad_accumulator(params[i]);
    if (!accumulator) {
      continue;
    }
    const auto& hooks = accumulator->post_hooks();
    // torch DDP's reducer hooks with C++ lambdas; a user's Python node hook is
    // no reducer and stays allowed.
    const bool foreign = std::any_of(hooks.begin(), hooks.end(), [](const auto& hook) {
      return dynamic_cast<const torch::autograd::utils::LambdaPostHook*>(hook.get()) != nullptr;
    });
    if (foreign) {
      return "gradaccum: " + name(i) + " already has a post-hook on its gradient accumulator "
          "that gradaccum did not add: the model is also wrapped in torch "
          "DistributedDataParallel (accelerator.prepare(model), HF Trainer?) or another "
          "reducer is attached, and the gradient would be reduced twice. Delete the DDP "
          "wrapper (del ddp_model; with Accelerate, do not prepare the model) before building "
          "the Accumulator: gradaccum does the data-parallel reduction";
    }
  }
  return "";
}

void Reducer::State::broadcast_parameters_from_rank0() {
  // The buckets are flat buffers shaped like the parameters: broadcast through
  // them, one collective per bucket and no temporary copy of the model.
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    for (const auto slot : c10::irange(bucket.params.size())) {
      bucket.views[slot].copy_(params[bucket.params[slot]]);
    }
    std::vector<at::Tensor> flat{bucket.gradients};
    group->broadcast(flat)->wait();
    for (const auto slot : c10::irange(bucket.params.size())) {
      params[bucket.params[slot]].copy_(bucket.views[slot]);
    }
    bucket.gradients.zero_();
  }
}

void Reducer::State::broadcast_from_rank0(const std::vector<at::Tensor>& tensors) {
  // One broadcast per (dtype, device): flatten, broadcast, copy back.
  using Key = std::tuple<at::ScalarType, at::DeviceType, c10::DeviceIndex>;
  std::map<Key, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) {
    if (t.defined() && t.numel() > 0) {
      groups[Key(t.scalar_type(), t.device().type(), t.device().index())].push_back(t);
    }
  }
  at::NoGradGuard no_grad;
  for (auto& entry : groups) {
    auto& members = entry.second;
    std::vector<at::Tensor> flat_members;
    for (const auto& t : members) {
      flat_members.push_back(t.reshape(-1));
    }
    std::vector<at::Tensor> flat{at::cat(flat_members)};
    group->broadcast(flat)->wait();
    int64_t offset = 0;
    for (auto& t : members) {
      t.copy_(flat[0].narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

// ---------------------------------------------------------------------------
// The synchronising backward

void Reducer::State::mark_ready(size_t index) {
  touched[index].store(true, std::memory_order_relaxed);
  if (!expect_hooks.load(std::memory_order_relaxed) || closed.load()) {
    return; // no_sync: the gradient stays in .grad
  }
  std::lock_guard<std::mutex> lock(mutex);
  const int task = torch::autograd::get_current_graph_task_id();
  if (!in_flight && task == last_anchor_task) {
    return; // a late hook of a task whose reduction already ended (a device thread after a failure)
  }
  if (!in_flight) {
    // See Note [Where a synchronising backward ends]: a task older than the
    // last anchor is an outer task whose nested (reentrant) backward already
    // finished a reduction.
    TORCH_CHECK(last_anchor_task < 0 || !older_task(task, last_anchor_task),
        "gradaccum: ", name(index), " became ready in an outer backward after a nested "
        "(reentrant) backward had already reduced the window. With reentrant activation "
        "checkpointing and a plain loss.backward(), the reduction ends with the first "
        "graph task that reached a parameter; run the backward through "
        "Accumulator.backward(), or use torch.utils.checkpoint(..., use_reentrant=False)");
    ReductionRequest manual;
    manual.divide = rule.reduction != Reduction::Sum;
    begin_reduction(manual, task);
  } else if (task != anchor_task && older_task(task, anchor_task)) {
    anchor_task = task; // an outer task of a reentrant backward: finish at its end
    queue_end_callback(task);
  }
  TORCH_CHECK(!ready[index],
      "gradaccum: ", name(index), " got its gradient twice in one synchronising "
      "backward (a parameter used both inside and outside a reentrant checkpoint, or a "
      "second backward over it?); each parameter may be reduced once per window");
  ready[index] = 1;
  early_launches = hook_launches; // made before this hook, which may be backward's last
  if (!buckets_final) {
    ready_order.push_back(index);
  }
  auto& bucket = buckets[locator[index].first];
  copy_into_bucket(bucket, locator[index].second);
  --bucket.pending;
  launch_ready_buckets();
}

void Reducer::State::begin_reduction(const ReductionRequest& req, int task) {
  TORCH_INTERNAL_ASSERT(!in_flight, "gradaccum: a reduction began while another was in flight");
  in_flight = true;
  request = req;
  ++sync_id;
  anchor_task = task;
  aborted_here = false;
  failure.clear();
  std::fill(ready.begin(), ready.end(), 0);
  ready_order.clear();
  for (auto& bucket : buckets) {
    bucket.pending = bucket.params.size();
    bucket.missing.clear();
    bucket.works.clear();
  }
  next_launch = 0;
  // See Note [Scaling before the sum]: the same value on every rank.
  expected_weight = rule.reduction == Reduction::Items && last_weight > 0
      ? last_weight : static_cast<double>(world) * static_cast<double>(rule.steps);
  // A weight the meta's digits cannot carry (or not closely enough: a tiny
  // one would round to zero and the window would go undivided) drops the
  // window on every rank (raising here, before the collectives, would leave
  // the others waiting).
  if (request.abort == AbortReason::None &&
      std::any_of(buckets.begin(), buckets.end(),
                  [](const Bucket& b) { return b.encoding == MetaEncoding::kDigits; })) {
    if (request.weight > Bucket::max_meta_value(kWeight)) {
      request.abort = AbortReason::WeightTooLarge;
    } else if (request.weight > 0 && request.weight < Bucket::min_meta_weight()) {
      request.abort = AbortReason::WeightTooSmall;
    }
  }
  stats.last_window_collectives = 0;
  stats.last_window_bytes = 0;
  hook_launches = 0;
  early_launches = 0;
  if (task >= 0) {
    queue_end_callback(task);
  }
}

void Reducer::State::queue_end_callback(int task) {
  auto guard = std::make_shared<TaskGuard>(shared_from_this(), sync_id, task);
  try {
    torch::autograd::Engine::get_default_engine().queue_callback([guard] {
      guard->ran = true;
      guard->state->on_task_end(guard->id, guard->task);
    });
  } catch (...) {
    guard->ran = true; // its destructor must not abort under our lock
    throw;
  }
}

void Reducer::State::on_task_end(uint64_t id, int task) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!in_flight || id != sync_id || task != anchor_task) {
    return; // a nested task ended, or this reduction is already over
  }
  if (closed) {
    abort_reduction(AbortReason::Closed);
    return;
  }
  finish_reduction();
}

void Reducer::State::on_task_failed(uint64_t id) noexcept {
  std::lock_guard<std::mutex> lock(mutex);
  if (in_flight && id == sync_id) {
    abort_reduction(closed ? AbortReason::Closed : AbortReason::BackwardFailed);
  }
}

void Reducer::State::copy_into_bucket(Bucket& bucket, size_t slot) {
  auto& grad = params[bucket.params[slot]].mutable_grad();
  auto& view = bucket.views[slot];
  if (bucket.accumulating) {
    // The window's sum so far is in the bucket (accumulate_local); add the rest.
    if (grad.defined()) {
      TORCH_CHECK(!grad.is_sparse(), "gradaccum: ", name(bucket.params[slot]), " has a sparse "
          "gradient (nn.Embedding(sparse=True)?); sparse gradients are not supported: use sparse=False");
      add_widened(view, grad);
      grad = at::Tensor();
    } else if (!touched[bucket.params[slot]].load(std::memory_order_relaxed)) {
      view.zero_();
      bucket.missing.push_back(slot);
    }
    return;
  }
  const bool in_bucket = on_view(grad, view); // Note [Bucket views as .grad]
  const bool untouched_view = in_bucket && !touched[bucket.params[slot]].load(std::memory_order_relaxed);
  if (!grad.defined() || untouched_view) {
    view.zero_();
    bucket.missing.push_back(slot);
    return;
  }
  if (in_bucket) {
    return; // bucket view: backward already accumulated in place
  }
  TORCH_CHECK(!grad.is_sparse(), "gradaccum: ", name(bucket.params[slot]), " has a sparse gradient "
      "(nn.Embedding(sparse=True)?); sparse gradients are not supported: use sparse=False");
  view.copy_(grad);
  if (options.gradient_as_bucket_view()) {
    // Someone replaced .grad (zero_grad(set_to_none=True)) or its storage
    // (.grad.data = t): re-point it.
    grad = view_handle(view);
  }
}

void Reducer::State::launch_ready_buckets() {
  // Never the last bucket: see Note [The last bucket closes the window].
  while (next_launch + 1 < buckets.size() && buckets[next_launch].pending == 0) {
    launch_bucket(next_launch++);
    ++hook_launches;
  }
}

void Reducer::State::launch_rest() {
  while (next_launch < buckets.size()) {
    buckets[next_launch].pending = 0;
    launch_bucket(next_launch++);
  }
}

void Reducer::State::launch_bucket(size_t index) {
  auto& bucket = buckets[index];
  // The header, as Note [Bucket meta layout] describes it.
  const auto squared = [this](int64_t v) {
    const double m = static_cast<double>(((v % modulus) + modulus) % modulus);
    return std::make_pair(m, m * m);
  };
  std::vector<double> meta(static_cast<size_t>(kMetaHeader) + bucket.params.size(), 1.0);
  const bool aborting = request.abort != AbortReason::None;
  meta[kWeight] = aborting ? 0 : request.weight;
  meta[kFlushing] = request.flushing ? 1 : 0;
  meta[kAbort] = aborting ? 1 : 0;
  meta[kAbortRank] = aborting ? rank : 0;
  meta[kAbortReason] = static_cast<double>(static_cast<int64_t>(request.abort));
  std::tie(meta[kWindow], meta[kWindowSquare]) = squared(sequence);
  std::tie(meta[kSteps], meta[kStepsSquare]) = squared(rule.steps);
  std::tie(meta[kReductionMode], meta[kReductionModeSquare]) =
      squared(static_cast<int64_t>(rule.reduction));
  std::tie(meta[kBucketIndex], meta[kBucketIndexSquare]) = squared(static_cast<int64_t>(index));
  // The kind also says whether this reduction ends with the one-time bucket
  // rebuild's collectives (Note [Rebuilding buckets in ready order]), so that
  // ranks that disagree drop the window instead of mis-pairing them.
  std::tie(meta[kKind], meta[kKindSquare]) = squared(kind_code());
  for (const auto slot : bucket.missing) {
    meta[kMetaHeader + slot] = 0;
  }
  if (bucket.compressed) {
    compress(bucket);
  }
  bucket.write_meta(meta);

  std::vector<at::Tensor> tensors{bucket.wire};
  bucket.works.push_back(group->allreduce(tensors));
  if (bucket.encoding == MetaEncoding::kSeparate) {
    std::vector<at::Tensor> meta_tensors{bucket.meta};
    bucket.works.push_back(group->allreduce(meta_tensors));
  }
  const auto launches = static_cast<int64_t>(bucket.works.size());
  TORCH_INTERNAL_ASSERT(launches == bucket.collectives());
  stats.collectives += launches;
  stats.last_window_collectives += launches;
  stats.bytes_reduced += bucket.bytes();
  stats.last_window_bytes += bucket.bytes();
}

// Note [Scaling before the sum]
// With comm_dtype bf16/fp16 (Bucket::prescaled), each rank sends its gradient
// sum divided by the expected global weight E, rounded to the wire's dtype,
// so that the sum over ranks stays near the size of one gradient and fp16
// does not overflow where float32 would not. E is world * steps, or for
// reduction "items" the global weight of the last full window (no rank
// flushing; the same on every rank: it comes from the summed meta); the first
// "items" window of a run uses world * steps, so gradients far larger than
// that (many items per micro-step, fp16) can overflow there once: the window
// is then non-finite on every rank alike. Every rank must use the same E (a
// sum of differently scaled gradients would be silently wrong): it changes
// only at a reduction that every rank completed, and restore() sets it on
// every rank from the checkpoint (Progress::last_weight), so a resumed run
// scales as the uninterrupted one. write_back() multiplies by E / global weight: exactly 1 for a
// full "mean" window. Wires as wide as float32 are not scaled.
void Reducer::State::compress(Bucket& bucket) {
  // In place, no temporary: the bucket's gradients are rewritten from the
  // wire by write_back() (or cleared with a dropped window) in any case.
  at::NoGradGuard no_grad;
  const double scale = bucket.prescaled ? expected_weight : 1.0;
  if (bucket.residual.defined()) {
    // Error feedback: send what was lost last time too, and keep what is lost
    // now (unscaled: the next window's scale may differ). What overflowed or
    // was not finite is not kept: it would poison every later window.
    bucket.residual.add_(bucket.gradients).div_(scale);
    bucket.wire_gradients.copy_(bucket.residual);
    bucket.residual.sub_(bucket.wire_gradients).mul_(scale).nan_to_num_(0.0, 0.0, 0.0);
  } else {
    if (scale != 1.0) {
      bucket.gradients.div_(scale);
    }
    bucket.wire_gradients.copy_(bucket.gradients);
  }
}

void Reducer::State::read_all_meta() {
  // One copy to the host for all buckets (one device synchronisation).
  std::vector<at::Tensor> metas;
  for (const auto& bucket : buckets) {
    metas.push_back(bucket.meta.to(at::kDouble));
  }
  const auto host = at::cat(metas).cpu().contiguous();
  const double* data = host.data_ptr<double>();
  for (const auto b : c10::irange(buckets.size())) {
    summed_meta[b] = buckets[b].decode_meta(data);
    data += buckets[b].meta.numel();
  }
}

void Reducer::State::wait_all(const char* what) {
  for (const auto b : c10::irange(buckets.size())) {
    for (auto& work : buckets[b].works) {
      try {
        work->wait();
      } catch (const std::exception& e) {
        // Wait for nothing else: the group is likely broken. The caller drops
        // the window (its buffers may hold a half-reduced sum).
        std::ostringstream message;
        message << "gradaccum: " << window_label() << " (" << what << "), rank " << rank
                << ": the all-reduce of bucket " << b << " of " << buckets.size()
                << " failed. Likely cause: a peer process left (crashed or was killed), or "
                << "the ranks took different paths (flush() on some ranks only, a different "
                << "number of micro-steps or windows, another collective in between). "
                << "The original error: " << message_of(e);
        throw std::runtime_error(message.str());
      }
    }
  }
}

ReductionResult Reducer::State::finish_reduction(std::vector<at::Tensor>* snapshot) {
  // Phase 1, before the last launch: anything that fails here is this rank's
  // alone, and is dropped through the pairing (Note [Dropping a window]).
  std::vector<at::Tensor> saved;
  try {
    if (kind == 0) {
      const auto foreign = foreign_hooks();
      if (!foreign.empty()) {
        abort_reduction(AbortReason::ForeignReducer);
        TORCH_CHECK(false, foreign);
      }
    }
    // A snapshot must leave bucket views (which are .grad) as they are.
    if (snapshot && (options.gradient_as_bucket_view() ||
                     std::any_of(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.accumulating; }))) {
      for (const auto& bucket : buckets) {
        saved.push_back(bucket.gradients.clone());
      }
    }
    // Whatever backward did not make ready (unused on this rank, or used only
    // in earlier micro-steps) is sent as it is: its accumulated .grad, or
    // zeros flagged as missing.
    for (size_t b = next_launch; b < buckets.size(); ++b) {
      auto& bucket = buckets[b];
      for (const auto slot : c10::irange(bucket.params.size())) {
        if (!ready[bucket.params[slot]]) {
          copy_into_bucket(bucket, slot);
        }
      }
    }
  } catch (const std::exception& e) {
    if (in_flight) {
      const auto local = message_of(e);
      abort_reduction(AbortReason::BackwardFailed);
      TORCH_CHECK(false, failure, ". The error on this rank: ", local);
    }
    throw;
  }
  launch_rest();
  // Phase 2: every collective of this reduction is launched on this rank.
  try {
    wait_all(request.flushing ? "flush" : "synchronising backward");
  } catch (const std::exception& e) {
    fail(e.what());
  }

  // One host read of every bucket's meta (the consensus needs it; it also
  // gives the global weight and the flags).
  read_all_meta();
  auto summed = at::empty({static_cast<int64_t>(buckets.size()), kMetaHeader}, at::kDouble);
  for (const auto b : c10::irange(buckets.size())) {
    std::copy_n(summed_meta[b].begin(), kMetaHeader, summed[static_cast<int64_t>(b)].data_ptr<double>());
  }
  const auto& last = summed_meta.back();
  ReductionResult result;
  result.window = sequence;
  result.global_weight = last[kWeight];
  result.flushing_ranks = static_cast<int64_t>(std::llround(last[kFlushing]));
  last_result = result;
  last_result.dropped = true; // until the consensus holds
  check_consensus(summed);
  last_result.dropped = false;

  // Phase 3: every rank agreed. From here on the window is reduced everywhere;
  // a local failure (say, out of memory) is reported as such, never as a drop.
  struct End {
    State& s;
    bool snapshot;
    ~End() {
      ++s.sequence;
      s.end_reduction(/*window_closed=*/!snapshot);
    }
  } end{*this, snapshot != nullptr};
  if (snapshot) {
    snapshot->assign(params.size(), at::Tensor());
    for (const auto b : c10::irange(buckets.size())) {
      auto& bucket = buckets[b];
      for (const auto slot : c10::irange(bucket.params.size())) {
        if (summed_meta[b][kMetaHeader + slot] != 0) {
          (*snapshot)[bucket.params[slot]] = bucket.views[slot].clone();
        }
      }
      if (!saved.empty()) {
        bucket.gradients.copy_(saved[b]);
      }
    }
    ++stats.snapshots;
    return result;
  }
  ++stats.windows;
  if (result.global_weight > 0 && result.flushing_ranks == 0) {
    last_weight = result.global_weight; // Note [Scaling before the sum]
  }
  // Collectives first: a local failure in write_back must not skip one.
  if (options.broadcast_buffers() && !buffers.empty()) {
    broadcast_from_rank0(buffers);
    ++stats.broadcasts;
  }
  // See Note [Rebuilding buckets in ready order]: agreed here, applied once
  // the write-back below is over (or failed on this rank: every rank switches).
  struct Switch {
    State& s;
    std::optional<std::vector<Bucket>> next;
    ~Switch() {
      if (next) {
        s.switch_buckets(std::move(*next));
      }
    }
  } rebuild{*this, buckets_final ? std::nullopt : agree_on_ready_order()};
  const bool divide = request.divide && result.global_weight > 0;
  bool known_finite = request.check_finite;
  for (const auto b : c10::irange(buckets.size())) {
    known_finite = write_back(buckets[b], summed_meta[b], divide, result.global_weight,
                              request.check_finite) && known_finite;
  }
  result.known_finite = last_result.known_finite = known_finite;
  return result;
}

std::optional<std::vector<Bucket>> Reducer::State::agree_on_ready_order() {
  // Every rank runs the broadcast and then the allgather below, whatever fails
  // locally (a rank that skipped one would pair its next bucket with it).
  // [how many parameters rank 0 saw ready (-1: it failed), then the order of all]
  std::vector<int64_t> order(params.size() + 1, 0);
  try {
    std::vector<char> seen(params.size(), 0);
    size_t k = 1;
    for (const auto i : ready_order) {
      TORCH_INTERNAL_ASSERT(!seen[i], "gradaccum: the ready order saw ", name(i), " twice");
      order[k++] = static_cast<int64_t>(i);
      seen[i] = 1;
    }
    order[0] = static_cast<int64_t>(ready_order.size());
    for (const auto& bucket : buckets) {
      for (const auto i : bucket.params) {
        if (!seen[i]) {
          order[k++] = static_cast<int64_t>(i);
        }
      }
    }
    TORCH_INTERNAL_ASSERT(k == order.size());
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: recording backward's ready order failed on rank ", rank, ": ", message_of(e));
    order.assign(params.size() + 1, 0);
    order[0] = -1;
  }
  std::vector<at::Tensor> message{at::tensor(order, at::kLong).to(metadata_device())};
  group->broadcast(message)->wait();
  const auto agreed = message[0].cpu();
  const auto a = agreed.accessor<int64_t, 1>();
  if (a[0] == 0) {
    return std::nullopt; // rank 0 saw no hook this window: try again at the next
  }
  buckets_final = true; // on every rank alike: once tried, never again
  ready_order = {};
  if (a[0] < 0) {
    return std::nullopt; // rank 0 could not say (it warned)
  }
  // 1: built, 2: the layout would not change, 0: failed here.
  enum Outcome { kFailed = 0, kBuilt = 1, kSame = 2 };
  std::optional<std::vector<Bucket>> built;
  std::string error;
  Outcome outcome = kFailed;
  try {
    std::vector<size_t> ready_by(params.size());
    for (const auto k : c10::irange(params.size())) {
      ready_by[k] = static_cast<size_t>(a[static_cast<int64_t>(k) + 1]);
    }
    const auto layout = assign_buckets(
        params,
        static_cast<int64_t>(options.first_bucket_cap_mb() * kMiB),
        static_cast<int64_t>(options.bucket_cap_mb() * kMiB),
        ready_by);
    const bool same = layout.size() == buckets.size() &&
        std::equal(layout.begin(), layout.end(), buckets.begin(),
                   [](const auto& indices, const Bucket& bucket) { return indices == bucket.params; });
    if (same) {
      outcome = kSame;
    } else {
      built = build_buckets(layout);
      outcome = kBuilt;
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  // Every rank switches, or none does.
  const auto flags = allgather(*group, at::full({1}, static_cast<double>(outcome), at::kDouble).to(metadata_device()));
  int failed = 0;
  int same = 0;
  for (const auto& flag : flags) {
    const auto theirs = static_cast<int>(flag.item<double>());
    failed += theirs == kFailed ? 1 : 0;
    same += theirs == kSame ? 1 : 0;
  }
  if (failed > 0) {
    TORCH_WARN("gradaccum: rebuilding the buckets in backward's order failed on ", failed,
        " rank(s)", error.empty() ? std::string() : " (on this rank: " + error + ")",
        "; every rank keeps the buckets it has");
    return std::nullopt;
  }
  // The layout follows from rank 0's order alone: the same verdict everywhere.
  TORCH_INTERNAL_ASSERT(same == 0 || same == static_cast<int>(flags.size()),
      "gradaccum: ranks computed different bucket layouts from the same order");
  return same > 0 ? std::nullopt : std::move(built);
}

void Reducer::State::switch_buckets(std::vector<Bucket> built) noexcept {
  // Between windows: copy-mode buckets are scratch and accumulating ones are
  // zero, but bucket views are .grad, which holds the window's gradient the
  // user may still read: it moves into the new views.
  if (options.gradient_as_bucket_view()) {
    try {
      at::NoGradGuard no_grad;
      for (auto& bucket : built) {
        for (const auto slot : c10::irange(bucket.params.size())) {
          auto& grad = params[bucket.params[slot]].mutable_grad();
          if (grad.defined()) {
            bucket.views[slot].copy_(grad);
            grad = view_handle(bucket.views[slot]);
          }
        }
      }
    } catch (const std::exception& e) {
      TORCH_WARN("gradaccum: moving .grad into the rebuilt buckets failed: ", message_of(e));
    }
  }
  // Error feedback: each parameter's residual moves into its new bucket.
  try {
    at::NoGradGuard no_grad;
    const auto slice = [this](const Bucket& bucket, size_t slot) {
      int64_t offset = 0;
      for (size_t k = 0; k < slot; ++k) {
        offset += params[bucket.params[k]].numel();
      }
      return bucket.residual.narrow(0, offset, params[bucket.params[slot]].numel());
    };
    for (auto& bucket : built) {
      if (!bucket.residual.defined()) {
        continue;
      }
      for (const auto slot : c10::irange(bucket.params.size())) {
        const auto [b, old_slot] = locator[bucket.params[slot]];
        if (buckets[b].residual.defined()) {
          slice(bucket, slot).copy_(slice(buckets[b], old_slot));
        }
      }
    }
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: moving the error-feedback residuals into the rebuilt buckets failed: ",
               message_of(e));
  }
  use_buckets(std::move(built));
  ++stats.bucket_rebuilds;
}

void Reducer::State::check_consensus(const at::Tensor& summed) {
  const auto h = summed.accessor<double, 2>();
  const auto n = static_cast<int64_t>(buckets.size());
  const double w = world;
  const auto all_equal = [&](int64_t b, int64_t field) {
    return w * h[b][field + 1] == h[b][field] * h[b][field];
  };
  for (int64_t b = 0; b < n; ++b) {
    if (!all_equal(b, kBucketIndex)) {
      fail("gradaccum: " + window_label() + ": collectives were mis-paired across ranks "
           "(bucket " + std::to_string(b) + " met another bucket on some rank): the ranks' "
           "calls diverged. The window was dropped on every rank");
    }
  }
  const auto last = n - 1;
  const auto aborting = static_cast<int64_t>(std::llround(h[last][kAbort]));
  if (aborting > 0) {
    std::ostringstream cause;
    const auto who = static_cast<int64_t>(std::llround(h[last][kAbortRank]));
    const auto why = static_cast<AbortReason>(aborting == 1 ? std::llround(h[last][kAbortReason]) : 0);
    if (aborting > 1) {
      cause << aborting << " ranks could not contribute their window (their synchronising "
            << "backward failed, or they left the epoch early)";
    } else if (why == AbortReason::EpochEnded) {
      cause << "rank " << who << " went on training after other ranks had ended the epoch "
            << "with flush(); every rank must run the same number of full windows and call "
            << "flush() at the end of each epoch";
    } else if (why == AbortReason::WeightTooLarge) {
      cause << "rank " << who << "'s window weight (micro-steps or items) is larger than "
            << static_cast<int64_t>(Bucket::max_meta_value(kWeight)) << ", the most a bf16/fp16 "
            << "bucket's meta carries exactly";
    } else if (why == AbortReason::WeightTooSmall) {
      cause << "rank " << who << "'s window weight (its num_items summed over the window) is "
            << "below " << Bucket::min_meta_weight() << " (2^-13), too small for a bf16/fp16 "
            << "bucket's meta to carry exactly; count items in larger units, or use float32 "
            << "parameters and comm_dtype";
    } else if (why == AbortReason::GradientsChanged) {
      cause << "on rank " << who << " the accumulated gradients were cleared or changed outside "
            << "the Accumulator in the middle of the window (optimizer.zero_grad() or "
            << "model.zero_grad() between micro-steps? clear them only after step() returns True)";
    } else if (why == AbortReason::ForeignReducer) {
      cause << "rank " << who << "'s parameters carry another reducer's gradient hooks (the "
            << "model is also wrapped in torch DDP there?)";
    } else if (why == AbortReason::Closed) {
      cause << "rank " << who << " destroyed its Accumulator during the synchronising backward";
    } else if (why == AbortReason::ClosedWindowNotStepped) {
      fail("gradaccum: " + window_label() + " (flush) was dropped on every rank: rank " +
           std::to_string(who) + " could not step the window it had closed before this flush() "
           "(its own error is raised there), while the other ranks stepped theirs: the replicas "
           "differ from here on. Resume every rank from a checkpoint");
    } else {
      cause << "the synchronising backward (or a micro-step of the window) failed on rank "
            << who << " (its own error is raised there)";
    }
    fail("gradaccum: " + window_label() + " was dropped on every rank: " + cause.str() +
         ". The window's gradients were cleared on every rank and no optimizer step was "
         "taken; training can go on from the next window");
  }
  struct Check {
    MetaField field;
    const char* what;
    int64_t mine;
  };
  const Check checks[] = {
      {kSteps, "steps", rule.steps},
      {kReductionMode, "reduction", static_cast<int64_t>(rule.reduction)},
      {kKind, "what this collective is (a checkpoint's state_dict() on some ranks, a window's "
              "reduction on others), or whether it rebuilds the buckets after it (rebuild_buckets "
              "differs across ranks?); the code is 0/1 for a window/checkpoint, plus 2 while a "
              "rebuild is pending", kind_code()},
      {kWindow, "the window number", sequence},
  };
  for (const auto& check : checks) {
    if (all_equal(last, check.field)) {
      continue;
    }
    const auto show = [&](int64_t v) {
      return check.field == kReductionMode ? std::string(reduction_name(v)) : std::to_string(v);
    };
    std::ostringstream message;
    message << "gradaccum: " << window_label() << ": the ranks disagree on " << check.what
            << ": this rank (rank " << rank << ") has " << show(check.mine);
    const auto mine_mod = ((check.mine % modulus) + modulus) % modulus;
    if (world == 2 && check.field != kWindow) {
      const auto other = static_cast<int64_t>(std::llround(h[last][check.field])) - mine_mod;
      message << ", rank " << (1 - rank) << " has " << show(other);
    } else {
      message << " (mean over the " << world << " ranks: "
              << h[last][check.field] / w + static_cast<double>(check.mine - mine_mod) << ")";
    }
    if (check.field == kWindow) {
      message << ". Some rank ran a reduction the others did not (flush() on some ranks "
                 "only, or a failed micro-step handled differently)";
    } else {
      message << ". Every rank must use the same options";
    }
    message << ". The window was dropped on every rank";
    fail(message.str());
  }
}

void Reducer::State::fail(const std::string& message) {
  // Every collective of this reduction has completed (or the group is broken):
  // the pairing is over, so the window can be dropped and the error raised.
  failure = message;
  if (last_result.window != sequence) {
    last_result = ReductionResult{}; // nothing was read from this reduction
  }
  last_result.window = sequence;
  last_result.dropped = true;
  end_dropped_window();
  TORCH_CHECK(false, message);
}

void Reducer::State::end_dropped_window() noexcept {
  // The pairing is over on this rank: clear the window and count it.
  try {
    drop_window();
  } catch (...) {
  }
  ++stats.windows;
  ++stats.dropped_windows;
  ++sequence;
  end_reduction();
}

void Reducer::State::abort_reduction(AbortReason reason) noexcept {
  // See Note [Dropping a window]. Runs from a failed task's guard (in the
  // engine, during unwinding) or from backward()/reduce(): never throws.
  request.abort = reason;
  aborted_here = true;
  std::string transport;
  last_result = ReductionResult{};
  last_result.window = sequence;
  last_result.dropped = true;
  try {
    launch_rest();
    wait_all("dropping this rank's window");
    // Whether others were flushing still matters to this rank's epoch.
    const auto header = buckets.back().read_meta();
    last_result.flushing_ranks = static_cast<int64_t>(std::llround(header[kFlushing]));
  } catch (const std::exception& e) {
    transport = message_of(e);
  }
  failure = "gradaccum: " + window_label() + ": this rank (rank " + std::to_string(rank) +
      ") could not contribute its window, so the window was dropped on every rank (its "
      "gradients cleared, no optimizer step); training can go on from the next window";
  switch (reason) {
    case AbortReason::WeightTooLarge:
      failure += ". Why: this rank's window weight " + std::to_string(request.weight) +
                 " is larger than a bf16/fp16 bucket's meta carries";
      break;
    case AbortReason::WeightTooSmall:
      failure += c10::str(". Why: this rank's window weight ", request.weight,
                          " is smaller than a bf16/fp16 bucket's meta carries exactly");
      break;
    case AbortReason::ClosedWindowNotStepped:
      failure = "gradaccum: " + window_label() + " (flush): this rank (rank " + std::to_string(rank) +
          ") could not step the window it had closed before this flush(), while the other ranks "
          "stepped theirs: the replicas differ from here on, and the flush was dropped on every "
          "rank. Resume every rank from a checkpoint";
      break;
    case AbortReason::GradientsChanged:
      failure += ". Why: the accumulated gradients were cleared or changed outside the "
                 "Accumulator in the middle of the window (optimizer.zero_grad() or "
                 "model.zero_grad() between micro-steps?); clear them only after step() returns "
                 "True, or drop a window with the Accumulator's zero_grad()";
      break;
    case AbortReason::ForeignReducer:
      failure += ". Why: another reducer's hooks are on this rank's parameters";
      break;
    case AbortReason::EpochEnded:
      failure += ". Why: the other ranks had ended the epoch with flush()";
      break;
    default:
      break;
  }
  if (!transport.empty()) {
    failure += ". Dropping it failed too: " + transport;
  }
  end_dropped_window();
}

void Reducer::State::drop_window() {
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    bucket.gradients.zero_();
    if (bucket.residual.defined()) {
      bucket.residual.zero_(); // it holds part of the dropped window
    }
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = params[bucket.params[slot]].mutable_grad();
      if (!options.gradient_as_bucket_view()) {
        grad = at::Tensor();
      } else if (!on_view(grad, bucket.views[slot])) {
        grad = view_handle(bucket.views[slot]);
      }
    }
  }
  clear_touched();
}

void Reducer::State::end_reduction(bool window_closed) {
  stats.last_window_launched_in_backward = static_cast<int64_t>(early_launches);
  stats.launched_in_backward += static_cast<int64_t>(early_launches);
  for (auto& bucket : buckets) {
    bucket.works.clear();
  }
  if (window_closed) {
    clear_touched();
  }
  kind = 0;
  in_flight = false;
  last_anchor_task = anchor_task;
  anchor_task = -1;
}

bool Reducer::State::write_back(Bucket& bucket, const std::vector<double>& meta, bool divide,
                                double divisor, bool check_finite) {
  const bool as_view = options.gradient_as_bucket_view();
  if (bucket.compressed) {
    // Back from the wire's dtype; undo the scale and divide in one pass
    // (Note [Scaling before the sum]): exactly 1 for a full "mean" window.
    bucket.gradients.copy_(bucket.wire_gradients);
    if (bucket.prescaled) {
      const double factor = expected_weight / (divide ? divisor : 1.0);
      if (factor != 1.0) {
        bucket.gradients.mul_(factor);
      }
      divide = false;
    }
  }
  // A CPU double scalar: the division runs in the gradients' compute type
  // without rounding the divisor to a half-precision dtype first.
  const auto divisor_tensor = at::scalar_tensor(divisor, at::kDouble);
  // The division rides on the pass that writes .grad: in place in the bucket
  // for views, fused into the copy back otherwise; so does the check for the
  // non-finite test (Note [The reducer checks the window's gradient]).
  const auto by = divide ? std::optional<double>(divisor) : std::nullopt;
  // A compressed bucket's values came through the wire's copy above, not
  // through this pass: it never reports itself checked.
  const int64_t terms = check_finite && !bucket.compressed ? numel : 0;
  bool bounded = true;
  if (as_view && (divide || check_finite)) {
    bounded = detail::write_checked(bucket.gradients, bucket.gradients, by, terms);
  }
  // A parameter missing here may have a gradient elsewhere: the summed flag says.
  std::vector<char> nowhere(bucket.params.size(), 0);
  for (const auto slot : bucket.missing) {
    nowhere[slot] = meta[kMetaHeader + slot] == 0;
  }
  if (bucket.accumulating) {
    // Rounded once, to the parameter's dtype; the bucket starts the next window at 0.
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = params[bucket.params[slot]].mutable_grad();
      const auto& p = params[bucket.params[slot]];
      grad = nowhere[slot] ? at::Tensor()
          : (divide ? bucket.views[slot].div(divisor_tensor) : bucket.views[slot]).to(p.scalar_type());
    }
    bucket.gradients.zero_();
    return false; // not checked
  }
  for (const auto slot : c10::irange(bucket.params.size())) {
    auto& grad = params[bucket.params[slot]].mutable_grad();
    const auto& view = bucket.views[slot];
    if (nowhere[slot]) {
      grad = at::Tensor(); // no rank had a gradient: keep it None, as one process would
    } else if (as_view) {
      if (!on_view(grad, view)) {
        grad = view_handle(view);
      }
    } else {
      if (!grad.defined()) {
        grad = at::empty_like(view);
      }
      bounded = detail::write_checked(grad, view, by, terms) && bounded;
    }
  }
  return bounded && !bucket.compressed;
}

// ---------------------------------------------------------------------------
// Public interface

namespace {
void check_request(const ReductionRequest& request) {
  TORCH_CHECK_VALUE(request.weight >= 0 && std::isfinite(request.weight),
      "Reducer: the window weight must be a finite number >= 0, got ", request.weight);
}
} // namespace

bool Reducer::expect_hooks() const {
  return state_->expect_hooks.load();
}

void Reducer::set_expect_hooks(bool expect) {
  state_->expect_hooks.store(expect);
}

ReductionRequest Reducer::manual_request() const {
  ReductionRequest request;
  request.divide = state_->rule.reduction != Reduction::Sum;
  return request;
}

ReductionResult Reducer::backward(const at::Tensor& loss, const ReductionRequest& request) {
  check_request(request);
  // Held locally: a hook may destroy this Reducer while backward runs.
  const auto keep = state_;
  auto& s = *keep;
  const auto sequence_before = [&] {
    std::lock_guard<std::mutex> lock(s.mutex);
    TORCH_CHECK(!s.in_flight, "gradaccum: backward() called while a synchronising backward is in flight");
    return s.sequence;
  }();
  const bool previous = s.expect_hooks.exchange(true);
  struct Restore {
    State& s;
    bool previous;
    ~Restore() {
      s.expect_hooks = previous;
    }
  } restore{s, previous};

  // Begin at the root of the graph, in the outermost task (see Note [Where a
  // synchronising backward ends]); without a root, begin now and finish once
  // backward returns.
  const auto root = loss.grad_fn();
  torch::autograd::FunctionPreHook* root_hook = nullptr;
  if (root) {
    std::weak_ptr<State> weak = keep;
    auto hook = std::make_unique<RootHook>([weak, request] {
      if (auto state = weak.lock()) {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (!state->in_flight && !state->closed) {
          state->begin_reduction(request, torch::autograd::get_current_graph_task_id());
        }
      }
    });
    root_hook = hook.get();
    root->add_pre_hook(std::move(hook));
  } else {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.begin_reduction(request, -1);
  }
  const auto remove_root_hook = [&] {
    if (!root_hook) {
      return;
    }
    auto& hooks = root->pre_hooks();
    for (auto it = hooks.begin(); it != hooks.end(); ++it) {
      if (it->get() == root_hook) {
        hooks.erase(it);
        return;
      }
    }
    TORCH_INTERNAL_ASSERT(false, "gradaccum: the root pre-hook disappeared");
  };

  try {
    loss.backward();
  } catch (const std::exception& e) {
    remove_root_hook();
    std::unique_lock<std::mutex> lock(s.mutex);
    if (s.in_flight) {
      // The engine has not freed the failed task yet: drop the window now.
      s.abort_reduction(AbortReason::BackwardFailed);
    } else if (s.sequence == sequence_before) {
      // Failed before the reduction began on this rank: the others still wait
      // for one (Note [Collectives pair by launch order]).
      s.begin_reduction(request, -1);
      s.abort_reduction(AbortReason::BackwardFailed);
    }
    if (s.aborted_here && s.sequence == sequence_before + 1) {
      TORCH_CHECK(false, s.failure, ". The error on this rank: ", message_of(e));
    }
    throw; // a dropped window's error (every rank raises it), or a transport error
  }
  remove_root_hook();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.in_flight) {
    return s.finish_reduction(); // no root: the reduction ends here
  }
  TORCH_CHECK(!(s.aborted_here && s.sequence == sequence_before + 1), s.failure);
  TORCH_INTERNAL_ASSERT(s.sequence == sequence_before + 1,
      "gradaccum: a synchronising backward ended without its reduction");
  return s.last_result;
}

ReductionResult Reducer::reduce(const ReductionRequest& request) {
  const auto keep = state_;
  auto& s = *keep;
  check_request(request);
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::reduce() called during a synchronising backward");
  s.begin_reduction(request, -1);
  if (request.abort != AbortReason::None) {
    const auto reason = request.abort;
    s.abort_reduction(reason);
    TORCH_CHECK(false, s.failure);
  }
  return s.finish_reduction();
}

void Reducer::accumulate_local() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::accumulate_local() called during a synchronising backward");
  at::NoGradGuard no_grad;
  for (auto& bucket : s.buckets) {
    if (!bucket.accumulating) {
      continue;
    }
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = s.params[bucket.params[slot]].mutable_grad();
      if (grad.defined()) {
        add_widened(bucket.views[slot], grad);
        grad = at::Tensor();
        s.touched[bucket.params[slot]].store(true, std::memory_order_relaxed);
      }
    }
  }
}

void Reducer::mark_restored(const std::vector<size_t>& indices) {
  for (const auto i : indices) {
    TORCH_CHECK_VALUE(i < state_->params.size(), "Reducer::mark_restored: no parameter ", i);
    state_->touched[i].store(true, std::memory_order_relaxed);
  }
}

std::vector<at::Tensor> Reducer::accumulated() const {
  const auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<at::Tensor> out(s.params.size());
  for (const auto& bucket : s.buckets) {
    if (!bucket.accumulating) {
      continue;
    }
    for (const auto slot : c10::irange(bucket.params.size())) {
      const auto i = bucket.params[slot];
      if (s.touched[i].load(std::memory_order_relaxed)) {
        out[i] = bucket.views[slot].clone();
      }
    }
  }
  return out;
}

bool Reducer::accumulates(size_t index) const {
  TORCH_CHECK_VALUE(index < state_->params.size(), "Reducer::accumulates: no parameter ", index);
  return state_->buckets[state_->locator[index].first].accumulating;
}

void Reducer::load_accumulated(size_t index, const at::Tensor& sum) {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::load_accumulated() called during a synchronising backward");
  TORCH_CHECK_VALUE(index < s.params.size(), "Reducer::load_accumulated: no parameter ", index);
  const auto [b, slot] = s.locator[index];
  auto& bucket = s.buckets[b];
  TORCH_CHECK_VALUE(bucket.accumulating, "Reducer::load_accumulated: ", s.name(index),
      " is not summed in a wider bucket");
  TORCH_CHECK_VALUE(sum.sizes() == s.params[index].sizes(), "Reducer::load_accumulated: ",
      s.name(index), " is ", s.params[index].sizes(), ", the sum ", sum.sizes());
  at::NoGradGuard no_grad;
  bucket.views[slot].copy_(sum);
  s.touched[index].store(true, std::memory_order_relaxed);
}

bool Reducer::accumulating() const {
  for (const auto& bucket : state_->buckets) {
    if (bucket.accumulating) {
      return true;
    }
  }
  return false;
}

bool Reducer::compressing() const {
  return std::any_of(state_->buckets.begin(), state_->buckets.end(),
                     [](const Bucket& b) { return b.compressed; });
}

std::vector<at::Tensor> Reducer::residuals() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<at::Tensor> out(state_->params.size());
  for (const auto& bucket : state_->buckets) {
    if (!bucket.residual.defined()) {
      continue;
    }
    int64_t offset = 0;
    for (const auto slot : c10::irange(bucket.params.size())) {
      const auto& view = bucket.views[slot];
      out[bucket.params[slot]] = bucket.residual.narrow(0, offset, view.numel()).clone().view(view.sizes());
      offset += view.numel();
    }
  }
  return out;
}

void Reducer::set_residuals(const std::vector<at::Tensor>& residuals) {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::set_residuals() called during a synchronising backward");
  TORCH_CHECK_VALUE(residuals.empty() || residuals.size() == s.params.size(),
      "gradaccum: got ", residuals.size(), " error-feedback residuals for ", s.params.size(), " parameters");
  // Every entry is checked before any is written: a rejected state changes nothing.
  for (const auto& bucket : s.buckets) {
    for (const auto i : bucket.params) {
      const auto numel = s.params[i].numel();
      const auto& r = residuals.empty() ? at::Tensor() : residuals[i];
      if (r.defined()) {
        TORCH_CHECK_VALUE(bucket.residual.defined(),
            "gradaccum: the state has an error-feedback residual for ", s.name(i),
            " but this Accumulator keeps none (error_feedback=False, or no comm_dtype narrower "
            "than its gradients)");
        TORCH_CHECK_VALUE(r.numel() == numel,
            "gradaccum: the error-feedback residual of ", s.name(i), " has ", r.numel(),
            " elements, the parameter ", numel);
      }
    }
  }
  at::NoGradGuard no_grad;
  for (auto& bucket : s.buckets) {
    int64_t offset = 0;
    for (const auto slot : c10::irange(bucket.params.size())) {
      const auto i = bucket.params[slot];
      const auto numel = s.params[i].numel();
      const auto& r = residuals.empty() ? at::Tensor() : residuals[i];
      if (bucket.residual.defined()) {
        auto part = bucket.residual.narrow(0, offset, numel);
        if (r.defined()) {
          part.copy_(r.reshape(-1));
        } else {
          part.zero_();
        }
      }
      offset += numel;
    }
  }
}

void Reducer::discard_residuals() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::discard_residuals() called during a synchronising backward");
  at::NoGradGuard no_grad;
  for (auto& bucket : s.buckets) {
    if (bucket.residual.defined()) {
      bucket.residual.zero_();
    }
  }
}

std::vector<at::Tensor> Reducer::snapshot(const ReductionRequest& request, ReductionResult* result) {
  const auto keep = state_;
  auto& s = *keep;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::snapshot() called during a synchronising backward");
  TORCH_CHECK(std::none_of(s.buckets.begin(), s.buckets.end(), [](const Bucket& b) { return b.compressed; }),
      "gradaccum: a checkpoint in the middle of a window is not supported with comm_dtype (the "
      "half-done window would be rounded to the wire's dtype); save at a window boundary, or "
      "use state_dict(rank_independent=False)");
  s.begin_reduction(request, -1);
  s.kind = 1;
  if (request.abort != AbortReason::None) {
    s.abort_reduction(request.abort);
    TORCH_CHECK(false, s.failure);
  }
  std::vector<at::Tensor> sums;
  const auto r = s.finish_reduction(&sums);
  if (result) {
    *result = r;
  }
  return sums;
}

Reducer::Progress Reducer::progress() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return {state_->stats, state_->sequence, state_->last_weight};
}

void Reducer::restore(const Progress& progress) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  TORCH_CHECK(!state_->in_flight, "Reducer::restore() called during a synchronising backward");
  // Not in checkpoints: what describes this reducer's buckets and its backwards.
  const auto now = state_->stats;
  state_->stats = progress.stats;
  state_->stats.buckets = now.buckets;
  state_->stats.bucket_rebuilds = now.bucket_rebuilds;
  state_->stats.launched_in_backward = now.launched_in_backward;
  state_->stats.last_window_launched_in_backward = now.last_window_launched_in_backward;
  state_->sequence = progress.sequence;
  // Note [Scaling before the sum]: the same on every rank, as saved (states
  // from before it was saved hold 0: the first window uses world * steps).
  state_->last_weight = progress.last_weight;
}

void Reducer::zero_grad() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::zero_grad() called during a synchronising backward");
  s.clear_touched();
  if (!s.options.gradient_as_bucket_view()) {
    for (auto& p : s.params) {
      p.mutable_grad() = at::Tensor();
    }
    for (auto& bucket : s.buckets) {
      if (bucket.accumulating) {
        bucket.gradients.zero_();
      }
    }
    return;
  }
  for (auto& bucket : s.buckets) {
    bucket.gradients.zero_();
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = s.params[bucket.params[slot]].mutable_grad();
      if (!on_view(grad, bucket.views[slot])) {
        grad = view_handle(bucket.views[slot]);
      }
    }
  }
}

int64_t Reducer::windows() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats.windows;
}

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

ReductionResult Reducer::last_result() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->last_result;
}

const std::vector<Bucket>& Reducer::buckets() const {
  return state_->buckets;
}

const c10::intrusive_ptr<c10d::ProcessGroup>& Reducer::process_group() const {
  return state_->group;
}

const ReducerOptions& Reducer::options() const {
  return state_->options;
}

std::vector<int64_t> Reducer::gather(int64_t value) const {
  const auto& s = *state_;
  TORCH_CHECK(!s.in_flight, "gradaccum: Reducer::gather() called during a synchronising backward");
  const auto all = allgather(*s.group, at::full({1}, value, at::kLong).to(s.metadata_device()));
  std::vector<int64_t> values;
  for (const auto& v : all) {
    values.push_back(v.item<int64_t>());
  }
  return values;
}

NoSync::NoSync(Reducer* reducer) : reducer_(reducer) {
  if (reducer_) {
    previous_ = reducer_->expect_hooks();
    reducer_->set_expect_hooks(false);
  }
}

NoSync::~NoSync() {
  if (reducer_) {
    reducer_->set_expect_hooks(previous_);
  }
}

NoSync::NoSync(NoSync&& other) noexcept
    : reducer_(other.reducer_), previous_(other.previous_) {
  other.reducer_ = nullptr;
}

} // namespace gradaccum
