#include "reducer/state.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <algorithm>

namespace gradaccum {

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

void Reducer::State::add_hooks() {
  // The hooks hold the state weakly: once the Reducer is gone they do nothing,
  // and a hook never keeps the parameters' state alive on its own.
  std::weak_ptr<State> weak = weak_from_this();
  for (const auto i : c10::irange(params.size())) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params[i]);
    hook_keys.push_back(accumulator->add_post_hook(std::make_unique<ReadyHook>(weak, i)));
    grad_accumulators.push_back(std::move(accumulator));
  }
}

torch::autograd::variable_list ReadyHook::operator()(
    const torch::autograd::variable_list& outputs,
    const torch::autograd::variable_list& /*inputs*/) {
  if (auto state = state_.lock()) {
    state->mark_ready(index_);
  }
  return outputs;
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

} // namespace gradaccum
