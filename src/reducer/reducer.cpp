// The Reducer facade: construction, the public calls, and what they read. The
// data path itself is launch.cpp -> finish.cpp, driven by hooks.cpp.

#include "reducer/state.h"

#include "comm.h"
#include "precision/precision.h"
#include "rank_check.h"

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <optional>

namespace gradaccum {

namespace detail {

void check_request(const ReductionRequest& request, Entry entry) {
  TORCH_CHECK_VALUE(request.weight >= 0 && std::isfinite(request.weight),
      "gradaccum: ", call_name(entry, request), ": the window weight must be a finite number >= 0, got ",
      request.weight);
}

// Note [Reductions that are no window]
// A mid-window snapshot (acc.state_dict()) and a refresh check
// (acc.refresh_parameters()) are reductions through the buckets: they take a
// reduction number and count in `collectives` and `bytes_reduced`. They are
// no window, so the last_window_* counters, which describe the last window,
// are kept across them.
// Kept by a guard, whether the reduction completes or is dropped.
class KeepLastWindowStats {
 public:
  explicit KeepLastWindowStats(ReducerStats& stats)
      : stats_(stats), collectives_(stats.last_window_collectives), bytes_(stats.last_window_bytes),
        launched_(stats.last_window_launched_in_backward) {}
  KeepLastWindowStats(const KeepLastWindowStats&) = delete;
  KeepLastWindowStats& operator=(const KeepLastWindowStats&) = delete;
  ~KeepLastWindowStats() {
    stats_.last_window_collectives = collectives_;
    stats_.last_window_bytes = bytes_;
    stats_.last_window_launched_in_backward = launched_;
  }

 private:
  ReducerStats& stats_;
  int64_t collectives_, bytes_, launched_;
};

} // namespace detail

Reducer::State::State(detail::ReducerConfig config_)
    : config(std::move(config_)), instance_hold(config.group.get(), config.instance), buffer_broadcast(config.buffers),
      frozen_broadcast(config.frozen) {
  const auto n = config.params.size();
  touched.reset(new std::atomic<bool>[n]);
  clear_touched();
  buckets.use(detail::BucketSet::build(config, detail::BucketSet::layout(config)), config.world);
  buckets.final = !config.options.rebuild_buckets();
  if (!buckets.final) {
    buckets.ready_order.reserve(n);
  }
  window.ready.assign(n, 0);
  window.failure.reserve(detail::kFailureCapacity);
  stats.buckets = static_cast<int64_t>(buckets.all.size());
}

namespace {

// Note [A peer that never builds]
// The construction's first collective (agree_to_build()) pairs with the
// other ranks' constructors. A peer that never builds (it raised before, say
// in its model's forward, exited, or ran another collective first) cannot be
// told apart from a slow one: the wait ends with the group's timeout or the
// peer's closed connection. A transport error there says so, around its own
// text, keeping its kind (DistBackendError); the refusals agree_to_build()
// raises itself are the library's, and pass as they are.
[[noreturn]] void rethrow_first_collective_failure(int rank) {
  try {
    throw;
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const std::exception& e) {
    const auto text = detail::message_of(e);
    if (text.rfind("gradaccum: ", 0) == 0) {
      throw;
    }
    const auto message = c10::str("gradaccum: Accumulator(): rank ", rank, " (in the group): the construction's "
        "first collective failed. Likely cause: a peer process did not build its Accumulator (it raised before, "
        "e.g. in its model's forward, or exited) or ran another collective first; every rank must build it at "
        "the same point. The original error: ", text);
    TORCH_CHECK_WITH(DistBackendError, dynamic_cast<const c10::DistBackendError*>(&e) == nullptr, message);
    TORCH_CHECK(false, message);
  }
}

} // namespace

Reducer::Reducer(
    std::vector<at::Tensor> params,
    c10::intrusive_ptr<c10d::ProcessGroup> group,
    ReducerOptions options,
    std::vector<at::Tensor> buffers,
    std::vector<std::string> names,
    WindowRule rule,
    std::vector<std::pair<std::string, at::Tensor>> frozen) {
  // Note [Construction refused on one rank]: what this rank refuses is told
  // to every rank by the first collective, before any other.
  TORCH_CHECK_VALUE(group, "gradaccum: Reducer(): process_group is null");
  const auto params_device = detail::device_of(params);
  std::optional<detail::ReducerConfig> built;
  try {
    built.emplace(std::move(params), group, options, std::move(buffers), std::move(names), rule);
    for (auto& [name, tensor] : frozen) {
      built->frozen_names.push_back(std::move(name));
      built->frozen.push_back(std::move(tensor));
    }
    const auto foreign = detail::foreign_hooks(*built);
    TORCH_CHECK_VALUE(foreign.empty(), "gradaccum: Accumulator(): ", foreign);
  } catch (const std::exception&) {
    detail::tell_construction_refused(*group, params_device);
    throw;
  }
  try {
    built->instance =
        detail::agree_to_build(*group, built->metadata_device(), {}, options.check_parameters(), "Accumulator()");
  } catch (...) {
    rethrow_first_collective_failure(group->getRank()); // Note [A peer that never builds]
  }
  auto config = std::move(*built);
  // Before any bucket is allocated; a collective with check_parameters.
  if (config.options.check_parameters()) {
    detail::check_ranks_match(config);
  }
  // Note [Construction fails on every rank]: the buckets' memory is this
  // rank's alone to find (out of memory on one rank); the others would wait
  // in the broadcasts below. One small all-reduce tells every rank first,
  // through a tensor allocated before the buckets: nothing between the
  // failure and the all-reduce allocates. After it, nothing allocates either
  // (the buffers' flat copies are allocated with the state).
  const auto pg = config.group;
  auto flag = at::empty({1}, at::TensorOptions().dtype(at::kLong).device(config.metadata_device()));
  std::string local_failure;
  bool out_of_memory = false;
  try {
    state_ = std::make_shared<State>(std::move(config));
  } catch (const c10::OutOfMemoryError& e) {
    local_failure = e.what_without_backtrace();
    out_of_memory = true;
  } catch (const std::bad_alloc& e) {
    local_failure = e.what();
    out_of_memory = true;
  } catch (const std::exception& e) {
    local_failure = detail::message_of(e);
  }
  const int failed = detail::lowest_rank_where(*pg, !local_failure.empty(), flag);
  if (failed < pg->getSize()) {
    state_.reset();
    if (!local_failure.empty()) {
      const auto message = c10::str("gradaccum: Accumulator(): building the reducer (allocating its buckets) failed "
          "on this rank (rank ", pg->getRank(), "): ", local_failure, ". Every rank raises");
      TORCH_CHECK_WITH(OutOfMemoryError, !out_of_memory, message);
      TORCH_CHECK(false, message);
    }
    TORCH_CHECK(false, "gradaccum: Accumulator(): building the reducer (allocating its buckets) failed on rank ",
        failed, " (its own error is raised there). Every rank raises");
  }
  auto& s = *state_;
  s.buckets.broadcast_parameters(s.config);
  s.buffer_broadcast.run(*s.config.group, /*root=*/0);
  s.frozen_broadcast.run(*s.config.group, /*root=*/0);
  s.frozen_broadcast = detail::OnceBroadcast(); // (its copies are not needed again)
  if (!s.config.options.broadcast_buffers()) {
    s.buffer_broadcast = detail::BroadcastPlan(); // its copies are not needed again
  }
  if (s.config.options.gradient_as_bucket_view()) {
    // From now on backward accumulates straight into the buckets.
    detail::point_grads_at_views(s.buckets.all, s.config.params, /*undefined_too=*/true);
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
    s.remove_hooks();
  }
  // A synchronising backward still running holds the state through its
  // queued callback: it finishes (or aborts) the pairing with the other ranks
  // there, marked Closed. Nothing here blocks.
}

// ---------------------------------------------------------------------------
// Reductions (backward() is in hooks.cpp)

bool Reducer::expect_hooks() const {
  return state_->expect_hooks.load();
}

void Reducer::set_expect_hooks(bool expect) {
  state_->expect_hooks.store(expect);
}

void Reducer::check_hooks_reach(const char* what) const {
  // torch gives a parameter converted to another dtype or device a new
  // gradient accumulator (`param.data = t`, as model.to() does), without our
  // hooks: a window of acc.backward() is still reduced (after backward, where
  // check_gradient() refuses the converted gradient), but the manual path's
  // plain loss.backward() begins no reduction at all.
  const auto& s = *state_;
  for (const auto i : c10::irange(s.grad_accumulators.size())) {
    const auto now = torch::autograd::impl::try_get_grad_accumulator(s.config.params[i]);
    TORCH_CHECK(now.get() == s.grad_accumulators[i].get(),
        "gradaccum: ", what, ": ", s.config.name(i), " is ", s.config.params[i].scalar_type(),
        " on ", s.config.params[i].device(), " and has a new gradient accumulator, without the Accumulator's "
        "hooks (built for ", s.config.dtypes[i], "): was the model converted after the Accumulator was built "
        "(model.to(dtype), .double(), .half()), or a parametrization registered on it? A plain loss.backward() "
        "through it is not reduced",
        std::string(what) == "acc.step()"
            ? ": if one ran since the last window (the manual path), its gradient was this rank's alone, and an "
              "optimizer step on it made the replicas differ (resume every rank from a checkpoint)"
            : " (nothing was changed)",
        ". Call acc.refresh_parameters() on every rank at the window boundary after such a change");
  }
}

ReductionRequest Reducer::manual_request() const {
  return state_->manual_request();
}

ReductionResult Reducer::reduce(const ReductionRequest& request) {
  const auto keep = state_;
  auto& s = *keep;
  // Accumulator calls it to close a partial window (flush) or to drop one.
  const auto entry = request.flushing ? detail::Entry::Flush : detail::Entry::Backward;
  detail::check_request(request, entry);
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle(detail::call_name(entry, request));
  s.begin_reduction(request, -1, entry);
  if (request.abort != AbortReason::None) {
    s.abort_reduction(request.abort);
    TORCH_CHECK(false, s.window.failure_text());
  }
  return s.finish_reduction();
}

std::vector<at::Tensor> Reducer::snapshot(const ReductionRequest& request, ReductionResult* result) {
  const auto keep = state_;
  auto& s = *keep;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.state_dict()");
  TORCH_CHECK(!s.buckets.any(&Bucket::compressed),
      "gradaccum: acc.state_dict(): a checkpoint in the middle of a window is not supported with comm_dtype (the "
      "half-done window would be rounded to the wire's dtype); save at a window boundary, or "
      "use state_dict(rank_independent=False)");
  const detail::KeepLastWindowStats last_window(s.stats); // Note [Reductions that are no window]
  s.begin_reduction(request, -1, detail::Entry::StateDict);
  if (request.abort != AbortReason::None) {
    s.abort_reduction(request.abort);
    TORCH_CHECK(false, s.window.failure_text());
  }
  std::vector<at::Tensor> sums;
  const auto r = s.finish_reduction(&sums);
  if (result) {
    *result = r;
  }
  return sums;
}

// Note [A refresh pairs like a window]
// acc.refresh_parameters() replaces the reducer at a window boundary, and the
// new one's construction is a sequence of collectives. A rank that did not
// call it (a condition evaluated per rank), or called it in the middle of its
// window (refused there, before any collective), goes on to its next
// reduction: its window's buckets. Any other collective first (a gather, the
// construction's checks) would meet those buckets: mis-sized, an error on one
// rank and a wait until the group's timeout on another. So the refresh opens
// with a reduction of its own through the old buckets: the same collectives,
// in the same order and sizes, as any window's, carrying zeros and every
// slot flagged as missing, with kKind = 2 (refresh). Whatever a peer reduces
// instead pairs with it bucket for bucket, and the kinds differ in every
// header: every rank drops that reduction, and raises, the refreshing ones
// from acc.refresh_parameters() (nothing refreshed), the others from their
// call (the window dropped, as any disagreement drops it). A rank that
// refuses the refresh at the boundary (nothing trainable left, its caller's
// checks) sends the drop's abort flag (AbortReason::RefreshRefused), so every
// rank learns that too from the same collectives. It costs one all-reduce of
// the gradients' size per refresh, beside the new reducer's broadcast of the
// parameters. The zeros go on the wire without touching `.grad` or the
// residuals: a compressed bucket zeroes its wire copy and skips compression;
// otherwise the bucket itself is zeroed. Nothing a later window needs is
// there at a boundary: a copy bucket holds the last window's sums (the next
// window's copy overwrites them), a wide bucket zeros (acc.step(),
// acc.flush() and a drop clear it), and bucket views are `.grad`: zeros
// after acc.step(), or values of an uncounted backward, which the
// Accumulator refuses before this check (Note [A refresh refused on one
// rank]). A rank that refuses sends its buckets as they are, with the
// drop's flag: every rank ignores them. A failed check re-zeroes the
// buckets and leaves `.grad` and the residuals as they were (drop_window()).
// The counters of the last window are kept (Note [Reductions that are no
// window]).
void Reducer::refresh_check(bool refused) {
  const auto keep = state_;
  auto& s = *keep;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.refresh_parameters()");
  const detail::KeepLastWindowStats last_window(s.stats);
  ReductionRequest request;
  request.weight = 0;
  request.divide = false;
  request.abort = refused ? AbortReason::RefreshRefused : AbortReason::None;
  s.begin_reduction(request, -1, detail::Entry::Refresh);
  if (request.abort != AbortReason::None) {
    s.abort_reduction(request.abort);
    TORCH_CHECK(false, s.window.failure_text());
  }
  s.finish_reduction();
}

void Reducer::zero_grad() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.zero_grad()", /*buckets_needed=*/false); // (a lost rank's last window still steps)
  s.clear_touched();
  s.window.failed_no_sync = false; // (what that backward left in .grad goes here)
  s.window.failed_counted = AbortReason::None;
  s.next_watch_generation();
  const bool as_view = s.config.options.gradient_as_bucket_view();
  if (!as_view) {
    for (const auto& p : s.config.params) {
      p.mutable_grad() = at::Tensor();
    }
  }
  if (!s.buckets.lost.empty()) {
    return; // no buckets to zero (BucketSet::rebuild())
  }
  for (auto& bucket : s.buckets.all) {
    if (as_view || bucket.accumulating) {
      bucket.gradients.zero_();
    }
    for (const auto slot : c10::irange(as_view ? bucket.params.size() : 0)) {
      detail::repoint(s.config.params[bucket.params[slot]].mutable_grad(), bucket.views[slot]);
    }
  }
}

void Reducer::release_gradient_views(bool drop_zeros) noexcept {
  auto& s = *state_;
  if (!s.config.options.gradient_as_bucket_view() || torch::autograd::get_current_graph_task_id() >= 0) {
    return;
  }
  try {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.window.in_flight) {
      return; // (a reduction still pairing writes into them)
    }
    const at::NoGradGuard no_grad;
    for (const auto& bucket : s.buckets.all) {
      for (const auto i : bucket.params) {
        auto& grad = s.config.params[i].mutable_grad();
        if (!grad.defined() || !grad.is_alias_of(bucket.gradients)) {
          continue;
        }
        try {
          grad = drop_zeros && !grad.any().item<bool>() ? at::Tensor() : grad.clone();
        } catch (...) { // out of memory: this one stays a view (its storage with it)
        }
      }
    }
  } catch (...) {
  }
}

// ---------------------------------------------------------------------------
// Counters and the late-backward guard (wide sums, residuals: reducer/precision.cpp)

void Reducer::mark_restored(const std::vector<size_t>& indices) {
  for (const auto i : indices) {
    TORCH_CHECK_VALUE(i < state_->config.params.size(), "gradaccum: Reducer::mark_restored(): no parameter ", i);
    state_->touched[i].store(true, std::memory_order_relaxed);
  }
}

uint64_t Reducer::hook_calls() const {
  return state_->hook_calls.load(std::memory_order_relaxed);
}

uint64_t Reducer::manual_reductions() const {
  return state_->manual_reductions.load(std::memory_order_relaxed);
}

uint64_t Reducer::manual_dropped_at() const {
  return state_->manual_dropped_at.load(std::memory_order_relaxed);
}

void Reducer::hold_closed_window(bool hold) {
  state_->late.arm(hold);
}

std::optional<size_t> Reducer::reached_while_held() const {
  return state_->late.reached();
}

// ---------------------------------------------------------------------------
// Progress, counters and accessors

Reducer::Progress Reducer::progress() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const auto& w = state_->window;
  return {state_->stats, w.sequence, w.last_weight, w.residual_weight};
}

void Reducer::mark_unstepped(const char* why) {
  TORCH_INTERNAL_ASSERT(why, "gradaccum: Reducer::mark_unstepped() without a reason");
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.zero_grad()");
  s.window.unstepped_pending = why;
}

void Reducer::mark_window_failed(AbortReason why) noexcept {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->window.failed_counted = why;
}

void Reducer::restore(const Progress& progress, bool backwards_too) {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.load_state_dict()");
  s.window.unstepped_pending = nullptr; // every rank resumes alike (Note [A window not stepped on some ranks])
  s.window.failed_no_sync = false;
  s.window.failed_counted = AbortReason::None;
  // Not in checkpoints: what describes this reducer's buckets (always its
  // own) and its backwards (the old reducer's at a refresh).
  const auto now = s.stats;
  const auto& backwards = backwards_too ? progress.stats : now;
  s.stats = progress.stats;
  s.stats.buckets = now.buckets;
  s.stats.bucket_rebuilds = now.bucket_rebuilds;
  s.stats.launched_in_backward = backwards.launched_in_backward;
  s.stats.last_window_launched_in_backward = backwards.last_window_launched_in_backward;
  s.stats.hookless_windows = backwards.hookless_windows;
  s.window.sequence = progress.sequence;
  // Whether the last reduction told this rank to end training is not the
  // resumed state's: a replay may reuse its window number (Note [Training
  // ended in join()]). The rest of it stays: a closed window's flush() still
  // reads how many ranks shadowed it (review).
  s.window.last_result.dropped = false;
  s.end_acted_on = -1;
  // Note [Scaling before the sum]: the same on every rank, as saved (states
  // from before it was saved hold 0: the first window uses world * steps).
  s.window.last_weight = progress.last_weight;
  s.window.residual_weight = progress.residual_weight;
}

int64_t Reducer::windows() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats.windows;
}

ReducerStats Reducer::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

WindowTimeline Reducer::last_timeline() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto timeline = state_->window.last_timeline;
  const auto& stamps = state_->window.last_completed;
  for (const auto b : c10::irange(std::min(stamps.size(), timeline.buckets.size()))) {
    const auto ns = stamps[b] && stamps[b]->pending.load() == 0 ? stamps[b]->latest_ns.load() : -1;
    timeline.buckets[b].completed = ns < 0 ? -1.0 : static_cast<double>(ns) * 1e-9;
  }
  return timeline;
}

void Reducer::set_end_acted_on(int64_t window) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->end_acted_on = window;
}

bool Reducer::told_to_end_training() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->told_to_end();
}

void Reducer::set_epoch_ended_refusal(const std::string& why) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->epoch_ended_refusal = why;
}

ReductionResult Reducer::last_result() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->window.last_result;
}

const std::vector<Bucket>& Reducer::buckets() const {
  return state_->buckets.all;
}

const c10::intrusive_ptr<c10d::ProcessGroup>& Reducer::process_group() const {
  return state_->config.group;
}

const ReducerOptions& Reducer::options() const {
  return state_->config.options;
}

std::vector<int64_t> Reducer::gather(int64_t value) const {
  const auto& s = *state_;
  s.check_idle("gradaccum: Reducer::gather()");
  const auto all = detail::allgather(
      *s.config.group, at::full({1}, value, at::kLong).to(s.config.metadata_device()));
  std::vector<int64_t> values;
  for (const auto& v : all) {
    values.push_back(v.item<int64_t>());
  }
  return values;
}

NoSync::NoSync(Reducer* reducer, bool counted) {
  if (reducer) {
    state_ = reducer->state_;
    previous_ = reducer->expect_hooks();
    previous_counted_ = reducer->state_->counted_no_sync.exchange(counted);
    reducer->set_expect_hooks(false);
  }
}

NoSync::~NoSync() {
  if (const auto state = state_.lock()) {
    state->expect_hooks.store(previous_);
    state->counted_no_sync.store(previous_counted_);
  }
}

NoSync::NoSync(NoSync&& other) noexcept
    : state_(std::move(other.state_)), previous_(other.previous_), previous_counted_(other.previous_counted_) {
  other.state_.reset();
}

} // namespace gradaccum
