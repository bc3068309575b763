// The autograd glue: the post-hook on each parameter's gradient accumulator,
// the pre-hook on the loss, and the callback queued on the engine that ends a
// synchronising backward. It calls into the reduction; the reduction never
// calls back.

#include "reducer/state.h"

#include "comm.h"
#include "detail/grad_accumulator.h"
#include "detail/grad_version.h"
#include "detail/late_backward.h"

#include <gradaccum/detail/failed_backward.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <functional>

// Note [Where a synchronising backward ends]
// The reduction finishes in a callback queued on the autograd graph task that
// started it (the "anchor"): the root's task when run through backward(), else
// the task of the first hook. Reentrant activation checkpointing runs nested
// graph tasks inside the outer one; hooks from those are accepted, and if a
// hook comes from a task older than the anchor (an outer task), that task
// becomes the anchor, so the reduction finishes when the outermost task seen
// ends. On the manual path the first hook may come from a nested task (every
// parameter inside checkpointed blocks), whose outer task no hook names: when
// the anchor ends while a node of another task is still being evaluated
// (torch's current node, the checkpoint's backward that ran the nested task),
// the reduction is not over. A one-shot post-hook on that node (OuterHook)
// makes its task, current once the node returns, the anchor, and the
// reduction finishes when it ends; the same again if that task is nested too.
// Finishing at the nested task's end instead reduced the blocks' gradients
// once per block, sending those already reduced again: multiplied by the
// world size under "sum", and lost with bucket views.
// Each queued callback, and each OuterHook, holds a guard: if the engine
// destroys it without running it, that graph task failed, and the reduction
// is aborted right there (before the exception reaches the caller).

namespace gradaccum {

namespace {

// Graph-task ids come from one global counter, narrowed to int by torch: order
// them by a bounded distance so that a wrap after ~2^31 backward calls is fine.
bool older_task(int a, int b) {
  const int64_t newer_by = static_cast<int64_t>(b) - a;
  return newer_by > 0 && newer_by < (int64_t{1} << 30);
}

// The post-hook on each parameter's gradient accumulator. Its own type, so
// that foreign_hooks() tells gradaccum's (maybe inert) hooks from others'.
class ReadyHook : public torch::autograd::FunctionPostHook {
 public:
  ReadyHook(std::weak_ptr<Reducer::State> state, size_t index)
      : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& inputs) override {
    if (auto state = state_.lock()) {
      // The reducer's copies and collectives are never part of a graph: under
      // loss.backward(create_graph=True) grad mode is on here, and the copy of
      // a gradient that requires grad into its bucket raised torch's own error
      // on that rank alone, which left the others waiting (review). The
      // reduced .grad holds the values, without a graph.
      const at::NoGradGuard no_grad;
      if (state->late.armed()) {
        // Note [A backward after the window closed]: no reduction; acc.step()
        // refuses what reached .grad.
        state->late.note(index_, state->config.params[index_], inputs);
        return outputs;
      }
      // An undefined gradient (a custom Function's backward returned None
      // for it) added nothing: ready, but untouched unless that Function
      // wrote .grad itself (held_gradient()), so that the window leaves it
      // None, bucket views or not (review: a view's zeros were stepped,
      // weight decay moving the parameter).
      state->mark_ready(index_, (!inputs.empty() && inputs[0].defined()) || state->held_gradient(index_));
    }
    return outputs;
  }
  // Note [Compiled autograd]: torch's compiled autograd asks each hook to
  // register itself in the graph it traces, and raises for a C++ hook that
  // does not. Ours register nothing: the traced graph runs without them, and
  // Reducer::backward() reduces the window after backward returns instead.
  // Without the hooks nothing marks the gradients a backward reached: the
  // Accumulator marks those whose .grad changed (note_hookless_backward()),
  // and so does Reducer::backward() for the closing one. The manual path (a
  // plain loss.backward() outside no_sync()) has no such place: only a hook
  // could begin its reduction, so it is refused here, before any collective
  // and alike on every rank that runs it.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    const auto state = state_.lock();
    // Note [A backward after the window closed]: no hook runs to record it.
    TORCH_CHECK(
        !state || state->closed.load() || !state->late.armed() || !state->config.params[index_].requires_grad(),
        detail::late_backward_error("loss.backward()", state->config.name(index_), /*data_parallel=*/true));
    TORCH_CHECK(!state || state->closed.load() || !state->expect_hooks.load() || state->in_backward.load(),
        "gradaccum: loss.backward(): under compiled autograd the reducer's gradient hooks do not run, so a plain "
        "loss.backward() (the manual path) cannot reduce the window; call acc.backward(loss), which reduces "
        "after a compiled backward, or turn compiled autograd off");
  }

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
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {} // Note [Compiled autograd]

 private:
  std::function<void()> fn_;
};

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

// See Note [Where a synchronising backward ends]: a post-hook on the node of
// an outer task that ran a nested one, which makes that outer task the anchor
// once the node returns. One-shot: the node may outlive the reduction (its
// graph retained), and a later run finds the guard gone.
class OuterHook : public torch::autograd::FunctionPostHook {
 public:
  explicit OuterHook(std::shared_ptr<TaskGuard> guard) : guard_(std::move(guard)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (const auto guard = std::exchange(guard_, nullptr)) {
      guard->ran = true;
      guard->state->on_outer_node_end(guard->id, guard->task);
    }
    return outputs;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {} // Note [Compiled autograd]

 private:
  std::shared_ptr<TaskGuard> guard_;
};

// Adds a RootHook to `root` (the loss's grad_fn) that begins the reduction
// for `request` when backward reaches it (see Note [Where a synchronising
// backward ends]).
torch::autograd::FunctionPreHook* add_root_hook(torch::autograd::Node& root,
                                                const std::shared_ptr<Reducer::State>& state,
                                                const ReductionRequest& request) {
  std::weak_ptr<Reducer::State> weak = state;
  auto hook = std::make_unique<RootHook>([weak, request] {
    if (auto s = weak.lock()) {
      std::lock_guard<std::mutex> lock(s->mutex);
      if (!s->window.in_flight && !s->closed) {
        s->begin_in_task(request, torch::autograd::get_current_graph_task_id(), detail::Entry::Backward);
      }
    }
  });
  auto* added = hook.get();
  root.add_pre_hook(std::move(hook));
  return added;
}

void remove_root_hook(torch::autograd::Node* root, torch::autograd::FunctionPreHook* hook) {
  if (!hook) {
    return;
  }
  auto& hooks = root->pre_hooks();
  for (auto it = hooks.begin(); it != hooks.end(); ++it) {
    if (it->get() == hook) {
      hooks.erase(it);
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "gradaccum: the root pre-hook disappeared");
}

} // namespace

void Reducer::State::add_hooks() {
  // The hooks hold the state weakly: once the Reducer is gone they do nothing,
  // and a hook never keeps the parameters' state alive on its own.
  std::weak_ptr<State> weak = weak_from_this();
  for (const auto i : c10::irange(config.params.size())) {
    auto accumulator = detail::grad_accumulator_for(config.params[i]);
    hook_keys.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(weak, i)));
    grad_accumulators.push_back(std::move(accumulator));
  }
}

void Reducer::State::remove_hooks() noexcept {
  try {
    for (const auto i : c10::irange(grad_accumulators.size())) {
      const bool removed = grad_accumulators[i]->del_post_hook(hook_keys[i]);
      TORCH_INTERNAL_ASSERT(removed, "gradaccum: the hook of ", config.name(i), " was already removed");
    }
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: removing the reducer's hooks failed: ", e.what());
  }
}

// Note [Bucket views in no-sync micro-steps]
// With gradient_as_bucket_view, `.grad` is its bucket's memory: one copy of
// the gradients. optimizer.zero_grad() (set_to_none=True, torch's default)
// at a window's start sets it to None, and the next no-sync backward makes a
// fresh `.grad` beside the bucket: two copies until the synchronising
// backward copies it in (copy_into_bucket()). The manual path's window then
// held twice the gradients for all its no-sync micro-steps (review), where
// torch DDP holds one. So a no-sync hook moves such a `.grad` into its view
// at once (one copy, the first micro-step after it was replaced; then
// backward adds in place), as copy_into_bucket() would later. The slot is
// this parameter's own and holds nothing else meanwhile (a `.grad` that is not
// on its view is the parameter's whole window). Buckets that sum in a wider
// dtype (accumulating) keep their own scheme; a `.grad` of another shape,
// dtype, device or layout is left for the synchronising backward to refuse.
void Reducer::State::keep_on_view(size_t index) {
  auto& bucket = buckets.of(index);
  if (bucket.accumulating) {
    return;
  }
  const auto& view = bucket.views[buckets.locator[index].second];
  auto& grad = config.params[index].mutable_grad();
  // (A .grad with a graph, backward(create_graph=True), stays: its graph is
  // the script's, and the synchronising backward copies it in as before.)
  if (!grad.defined() || grad.requires_grad() || detail::on_view(grad, view) || grad.layout() != at::kStrided ||
      grad.scalar_type() != view.scalar_type() || grad.device() != view.device() || grad.sizes() != view.sizes()) {
    return;
  }
  view.copy_(grad);
  grad = detail::view_handle(view);
}

bool Reducer::State::held_gradient(size_t index) {
  // (Only for a hook called without a gradient: rare, so a host read is fine.)
  // A .grad that is not its bucket view holds this window's micro-steps or
  // the script's own, which the checks see, as before; a bucket view holds
  // zeros unless something wrote it in place (a fused kernel's Function
  // that accumulates into .grad and returns None: review of the first
  // version, which dropped that gradient).
  const auto& grad = config.params[index].grad();
  if (!grad.defined()) {
    return false;
  }
  const auto& bucket = buckets.of(index);
  if (bucket.views.empty() || !detail::on_view(grad, bucket.views[buckets.locator[index].second])) {
    return true;
  }
  return grad.ne(0).any().item<bool>(); // (NaN != 0: held)
}

void Reducer::State::mark_ready(size_t index, bool reached) {
  hook_calls.fetch_add(1, std::memory_order_relaxed);
  if (reached) {
    touched[index].store(true, std::memory_order_relaxed);
  }
  if (!expect_hooks.load(std::memory_order_relaxed) || closed.load()) {
    if (config.options.gradient_as_bucket_view() && !closed.load()) {
      keep_on_view(index);
    }
    if (!closed.load() && !counted_no_sync.load(std::memory_order_relaxed)) {
      watch_no_sync_task(); // the manual path's: Note [A failed backward inside no_sync()]
    }
    return; // no_sync: the gradient stays in .grad
  }
  std::lock_guard<std::mutex> lock(mutex);
  const int task = torch::autograd::get_current_graph_task_id();
  if (!window.in_flight && task == window.last_anchor_task) {
    return; // a late hook of a task whose reduction already ended (a device thread after a failure)
  }
  if (!window.in_flight && in_backward.load()) {
    // Inside acc.backward() with no reduction begun: its root hook did not
    // run (compiled autograd, Note [Compiled autograd]), and this hook is of a
    // nested (reentrant checkpoint) task run outside the compiled graph. The
    // hookless reduction after backward takes every gradient backward
    // changed, this one included (touched above).
    return;
  }
  if (!window.in_flight) {
    // See Note [Where a synchronising backward ends]: a task older than the
    // last anchor is an outer task whose nested (reentrant) backward already
    // finished a reduction.
    TORCH_CHECK(window.last_anchor_task < 0 || !older_task(task, window.last_anchor_task),
        "gradaccum: loss.backward(): ", config.name(index), " became ready in an outer backward "
        "after a nested backward had already reduced the window (one torch did not run inside the outer "
        "backward's evaluation of a node, so its end looked like the end of backward); run the backward "
        "through acc.backward(), or use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)");
    const auto ended = training_ended(); // Note [Training ended in join()]
    TORCH_CHECK(ended.empty(), "gradaccum: loss.backward(): ", ended, "; this backward reduced nothing (its "
        "gradients may be in .grad in part: drop them with acc.zero_grad())");
    const auto again = adds_to_manual_written(index);
    begin_in_task(manual_request(), task, detail::Entry::ManualBackward);
    if (again && !window.warned_second_backward) { // Note [A second backward after the manual path's reduction]
      window.warned_second_backward = true;
      TORCH_WARN("gradaccum: loss.backward(): ", config.name(*again), "'s .grad is still the gradient the last "
          "reduction wrote, and this plain backward reduces it again: under reduction=\"sum\" that part is "
          "multiplied by the world size. Where that gradient is stepped (two losses closing the window, "
          "l1.backward(retain_graph=True); l2.backward()?), put the losses into one backward ((l1 + l2).backward()) "
          "or run the first inside acc.no_sync(). Where it is not (another model's loss through this model, as a "
          "GAN generator's step through its discriminator: run that backward inside this Accumulator's "
          "acc.no_sync(); a parameter no optimizer steps), it does no harm. Warned once (again after "
          "acc.refresh_parameters())");
    }
    if (window.failed_no_sync_read) { // Note [A failed backward inside no_sync()]
      abort_reduction(AbortReason::BackwardFailed);
      TORCH_CHECK(false, own_failure("a plain loss.backward() inside acc.no_sync() failed on this rank in this "
          "window after some of its gradients had reached .grad, so the window held part of that micro-batch"));
    }
    if (const auto why = window.failed_counted_read; why != AbortReason::None) { // (review: reduced silently)
      abort_reduction(why);
      TORCH_CHECK(false, own_failure(std::string(why == AbortReason::GradientsChanged
              ? "this rank's part of the window was changed outside the Accumulator (or a resumed window's part "
                "dropped by acc.zero_grad())"
              : why == AbortReason::Interrupted ? "a micro-step's acc.backward() was interrupted on this rank"
                                                : "a micro-step's acc.backward() (or acc.run()) failed on this rank") +
          " in this window, and this plain loss.backward() closed the window, which therefore held a wrong sum"));
    }
  } else if (task != window.anchor_task && older_task(task, window.anchor_task)) {
    window.anchor_task = task; // an outer task of a reentrant backward: finish at its end
    queue_end_callback(task);
  }
  TORCH_CHECK(!window.ready[index],
      where(), ": ", config.name(index), " got its gradient twice in one synchronising "
      "backward (a parameter used both inside and outside a reentrant checkpoint, a block under "
      "reentrant checkpointing called twice in one forward, or a second backward over it?); each "
      "parameter may be reduced once per window. With reentrant checkpointing use "
      "torch.utils.checkpoint.checkpoint(..., use_reentrant=False); otherwise put the losses into one backward");
  window.ready[index] = 1;
  window.timeline.gradients[index] = window.elapsed(); // Note [The window's timeline]
  window.early_launches = window.hook_launches; // made before this hook, which may be backward's last
  if (!buckets.final) {
    buckets.ready_order.push_back(index);
  }
  auto& bucket = buckets.of(index);
  copy_into_bucket(bucket, buckets.locator[index].second);
  if (--bucket.pending == 0) {
    window.timeline.buckets[buckets.locator[index].first].ready = window.timeline.gradients[index];
  }
  launch_ready_buckets();
}

bool Reducer::State::told_to_end() const {
  const auto& last = window.last_result;
  // (Also where a rank could not step a window it closed: the replicas
  // differ, and the shadows leave join() with the drop's error all the same.)
  return last.dropped && (last.left_ranks > 0 || last.joined_ranks > 0 || last.interrupted_ranks > 0) &&
      last.window != end_acted_on && last.window + 1 == window.sequence;
}

std::string Reducer::State::training_ended() const {
  if (!epoch_ended_refusal.empty()) {
    return epoch_ended_refusal;
  }
  return told_to_end() ? "the last reduction dropped its window on every rank and told every rank to end training there "
                "(ranks were shadowing in acc.join(), one left its block with an exception, or one was interrupted): "
                "end training on this rank too; inside acc.join(), let that error leave its block (C++: call "
                "acc.join(), which returns at once)"
              : std::string();
}

ReductionRequest Reducer::State::manual_request() const {
  ReductionRequest request;
  request.divide = config.rule.reduction != Reduction::Sum;
  return request;
}

void Reducer::State::begin_in_task(const ReductionRequest& request, int task, detail::Entry entry) {
  check_buckets(detail::call_name(entry, request));
  begin_reduction(request, task, entry);
  if (task >= 0) {
    queue_end_callback(task);
  }
}

void Reducer::State::queue_end_callback(int task) {
  auto guard = std::make_shared<TaskGuard>(shared_from_this(), window.sync_id, task);
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
  const at::NoGradGuard no_grad; // (the engine's callback runs under create_graph's grad mode)
  std::lock_guard<std::mutex> lock(mutex);
  if (!window.in_flight || id != window.sync_id || task != window.anchor_task) {
    return; // a nested task ended, or this reduction is already over
  }
  if (closed) {
    abort_reduction(AbortReason::Closed);
    return;
  }
  if (window.entry == detail::Entry::ManualBackward) {
    if (const auto outer = torch::autograd::get_current_node()) {
      // See Note [Where a synchronising backward ends]: a nested task ended
      // inside `outer`'s evaluation; its own task finishes the reduction.
      auto guard = std::make_shared<TaskGuard>(shared_from_this(), id, task);
      try {
        outer->add_post_hook(std::make_unique<OuterHook>(guard));
      } catch (...) {
        guard->ran = true; // its destructor must not abort under our lock
        abort_reduction(AbortReason::BackwardFailed);
        throw;
      }
      return;
    }
  }
  finish_reduction();
}

void Reducer::State::on_outer_node_end(uint64_t id, int nested_task) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!window.in_flight || id != window.sync_id || nested_task != window.anchor_task) {
    return; // this reduction is already over, or an outer hook re-anchored it
  }
  window.anchor_task = torch::autograd::get_current_graph_task_id();
  try {
    queue_end_callback(window.anchor_task);
  } catch (...) {
    abort_reduction(AbortReason::BackwardFailed); // no callback would end it
    throw;
  }
}

// Note [An interrupt tells every rank to end]
// A Python error that is no Exception (KeyboardInterrupt, SystemExit) in the
// window's synchronising backward stops its rank (Note [An interrupt in a
// synchronising backward], bindings.cpp): the others must not be told that
// training can go on, or they would wait in their next window for a rank
// that is gone (until its process exits, or the group's timeout). So the
// drop says why (AbortReason::Interrupted, from detail::inspect_error(),
// which the binding provides), every rank's text tells it to end training,
// and as after a drop while ranks shadow in join(), each rank's next
// micro-step is refused without a collective (State::told_to_end()). The
// reason must be known when the drop is sent: a failed task's guard
// (on_task_failed(), during the engine's unwinding) cannot see the error, so
// for acc.backward()'s reduction it leaves the drop to Reducer::backward()'s
// catch (drop_failed_backward()), which always follows there. Failures in a
// no_sync micro-step or an acc.run() part say so too, when their window closes.
void Reducer::State::on_task_failed(uint64_t id) noexcept {
  std::lock_guard<std::mutex> lock(mutex);
  if (window.in_flight && id == window.sync_id) {
    if (!closed && window.entry == detail::Entry::Backward) {
      return; // Reducer::backward()'s catch drops it, knowing why
    }
    abort_reduction(closed ? AbortReason::Closed : AbortReason::BackwardFailed);
  }
}

// ---------------------------------------------------------------------------
// Reducer::backward(): a synchronising backward begun at the loss's root.

ReductionResult Reducer::backward(const at::Tensor& loss, const ReductionRequest& request) {
  detail::check_request(request, detail::Entry::Backward);
  // Held locally: a hook may destroy this Reducer while backward runs.
  const auto keep = state_;
  auto& s = *keep;
  const auto sequence_before = [&] {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.check_idle(detail::call_name(detail::Entry::Backward, request));
    return s.window.sequence;
  }();
  const bool previous = s.expect_hooks.exchange(true);
  s.in_backward = true;
  struct Restore {
    State& s;
    bool previous;
    ~Restore() {
      s.expect_hooks = previous;
      s.in_backward = false;
    }
  } restore{s, previous};
  // Note [Compiled autograd]: which gradients this backward changes, should
  // no hook run to say so (one read of each .grad's version).
  std::vector<std::pair<const void*, int64_t>> versions;
  versions.reserve(s.config.params.size());
  for (const auto& p : s.config.params) {
    const auto& g = p.grad();
    versions.emplace_back(g.defined() ? g.unsafeGetTensorImpl() : nullptr, detail::grad_version(g));
  }

  // Begin at the root of the graph, in the outermost task (see Note [Where a
  // synchronising backward ends]); without a root, begin now and finish once
  // backward returns.
  const auto root = loss.grad_fn();
  torch::autograd::FunctionPreHook* root_hook = nullptr;
  if (root) {
    root_hook = add_root_hook(*root, keep, request);
  } else {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.begin_reduction(request, -1, detail::Entry::Backward);
  }
  try {
    loss.backward();
  } catch (const std::exception& e) {
    remove_root_hook(root.get(), root_hook);
    // Note [An interrupt tells every rank to end]
    const auto facts = detail::inspect_error(std::current_exception());
    const auto own = s.drop_failed_backward(request, sequence_before, detail::named_message(detail::message_of(e), facts),
                                            facts.interrupt ? AbortReason::Interrupted : AbortReason::BackwardFailed);
    if (!own.empty()) {
      detail::keep_failed_backward(std::current_exception()); // Note [An interrupt in a synchronising backward]
      TORCH_CHECK(false, own);
    }
    throw; // a dropped window's error (every rank raises it), or a transport error
  }
  remove_root_hook(root.get(), root_hook);
  return s.end_backward(request, sequence_before, versions);
}

std::string Reducer::State::drop_failed_backward(const ReductionRequest& request, int64_t sequence_before,
                                                 const std::string& local, AbortReason why) {
  std::lock_guard<std::mutex> lock(mutex);
  if (window.in_flight) {
    // Not dropped by the failed task's guard (Note [An interrupt tells every
    // rank to end]), or the engine has not freed the task yet: drop it now.
    abort_reduction(closed ? AbortReason::Closed : why);
  } else if (window.sequence == sequence_before) {
    // Failed before the reduction began on this rank: the others still wait
    // for one (Note [Collectives pair by launch order]).
    begin_reduction(request, -1, detail::Entry::Backward);
    abort_reduction(why);
  }
  const bool dropped_here = window.aborted_here && window.sequence == sequence_before + 1;
  return dropped_here ? own_failure(local) : std::string();
}

ReductionResult Reducer::State::end_backward(const ReductionRequest& request, int64_t sequence_before,
                                             const std::vector<std::pair<const void*, int64_t>>& versions_before) {
  std::lock_guard<std::mutex> lock(mutex);
  if (window.in_flight) {
    return finish_reduction(); // no root: the reduction ends here
  }
  if (window.sequence == sequence_before) {
    // Backward returned, yet the root hook never ran: the engine ran none of
    // our hooks (compiled autograd, Note [Compiled autograd]). The window's
    // sum is in .grad: reduce it now, as flush() does, every bucket after
    // backward instead of overlapped with it; the same collectives.
    ++stats.hookless_windows;
    buckets.hookless = true; // no ready order to rebuild the buckets by
    // No hook said which gradients this backward reached: those whose .grad
    // changed (a bucket view's version moves when backward adds into it).
    for (const auto i : c10::irange(config.params.size())) {
      const auto& g = config.params[i].grad();
      const std::pair<const void*, int64_t> now(g.defined() ? g.unsafeGetTensorImpl() : nullptr,
                                                detail::grad_version(g));
      if (g.defined() && now != versions_before[i]) {
        touched[i].store(true, std::memory_order_relaxed);
      }
    }
    begin_reduction(request, -1, detail::Entry::Backward);
    return finish_reduction();
  }
  TORCH_CHECK(!(window.aborted_here && window.sequence == sequence_before + 1), window.failure_text());
  TORCH_INTERNAL_ASSERT(window.sequence == sequence_before + 1,
      "gradaccum: a synchronising backward ended without its reduction");
  return window.last_result;
}

} // namespace gradaccum
