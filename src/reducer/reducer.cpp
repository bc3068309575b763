#include "reducer/state.h"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>

#include <cmath>

namespace gradaccum {

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

  s.add_hooks();
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

// ---------------------------------------------------------------------------
// Public interface

namespace detail {
void check_request(const ReductionRequest& request) {
  TORCH_CHECK_VALUE(request.weight >= 0 && std::isfinite(request.weight),
      "Reducer: the window weight must be a finite number >= 0, got ", request.weight);
}
} // namespace detail

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

void Reducer::mark_restored(const std::vector<size_t>& indices) {
  for (const auto i : indices) {
    TORCH_CHECK_VALUE(i < state_->params.size(), "Reducer::mark_restored: no parameter ", i);
    state_->touched[i].store(true, std::memory_order_relaxed);
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
