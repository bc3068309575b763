// The manual path's guards (a plain loss.backward(), inside acc.no_sync() or
// not): a no_sync backward that failed after some gradients reached .grad,
// and a second plain backward into the .grad a reduction wrote. The hooks
// (hooks.cpp) call in here.

#include "reducer/state.h"

#include "detail/grad_version.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <memory>
#include <optional>
#include <utility>

namespace gradaccum {

// Note [A failed backward inside no_sync()]
// A plain loss.backward() inside acc.no_sync() (the manual path) that fails
// after some gradients reached .grad leaves part of its micro-batch there,
// and nothing else marks it: reduced with the window, it was silently half
// of a micro-batch (review). The first of its hooks queues a callback on its
// graph task, as a synchronising backward's does (Note [Where a synchronising
// backward ends]); torch destroys the callback unrun when the task fails, and
// the guard then marks the window. Where that task is nested (reentrant
// checkpointing: every hook ran in the block's own backward) and ends inside
// a node of an outer task, a one-shot post-hook on that node watches the
// outer task in turn once the node returns (its guard marks the window if
// the node fails first): the outer task may still fail after the block
// (review). A node that failed is freed with its graph, which a script may
// keep (the losses in a list): a watch still armed when the window's
// reduction begins means that node failed (its backward has returned), and
// counts as such there (review). Reductions and acc.zero_grad() begin the
// next generation of watches: one armed before them marks nothing later.
// The post-hook is added while the outer node runs: where the nested
// backward ran from that node's own post-hooks (a grad_fn hook or a module's
// full backward hook calling backward()), torch does not run it, and the
// window is dropped though nothing failed (a limit, docs/design.md). The
// window's reduction (the manual path's next synchronising backward) drops
// it on every rank, this rank's error saying why;
// acc.zero_grad() clears the mark with what it drops. The Accumulator's own
// no_sync micro-steps are not watched (NoSync's `counted`: no callback on
// that per-micro-step path): it drops such a window itself (window_failed_). A backward that
// fails before any hook ran leaves no trace (as in torch DDP).
namespace {
struct NoSyncWatch {
  std::weak_ptr<Reducer::State> state;
  bool ran = false;
  bool outer = false; ///< an outer node's: counted in outer_watches
  uint64_t generation = 0;
  /// Ran, or destroyed unrun: an outer node's watch leaves the count (of its
  /// generation only); a failure marks the window it was armed in.
  void settle(Reducer::State& s, bool failed) {
    auto word = s.outer_watches.load();
    bool current = (word >> Reducer::State::kWatchCountBits) == generation;
    // (Leaves the count only within its generation: a compare-and-swap.)
    while (outer && current && !s.outer_watches.compare_exchange_weak(word, word - 1)) {
      current = (word >> Reducer::State::kWatchCountBits) == generation;
    }
    if (failed && current) {
      s.on_no_sync_task_failed();
    }
  }
  ~NoSyncWatch() {
    if (!ran) {
      if (const auto s = state.lock()) {
        settle(*s, /*failed=*/true);
      }
    }
  }
};

// On the outer node inside whose evaluation a watched nested task ended.
class NoSyncOuterHook : public torch::autograd::FunctionPostHook {
 public:
  explicit NoSyncOuterHook(std::shared_ptr<NoSyncWatch> watch) : watch_(std::move(watch)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (const auto watch = std::exchange(watch_, nullptr)) {
      watch->ran = true;
      if (const auto s = watch->state.lock()) {
        watch->settle(*s, /*failed=*/false);
        s->watch_no_sync_task(); // the outer task, current now
      }
    }
    return outputs;
  }
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {} // Note [Compiled autograd]

 private:
  std::shared_ptr<NoSyncWatch> watch_;
};
} // namespace

void Reducer::State::watch_no_sync_task() {
  const int task = torch::autograd::get_current_graph_task_id();
  int watched = watched_task.load(std::memory_order_relaxed);
  if (task < 0 || watched == task || !watched_task.compare_exchange_strong(watched, task)) {
    return; // watched already (by this hook's task, or by a hook racing it on another device thread)
  }
  auto watch = std::make_shared<NoSyncWatch>();
  watch->state = weak_from_this();
  watch->generation = watch_generation();
  try {
    torch::autograd::Engine::get_default_engine().queue_callback([watch] {
      watch->ran = true;
      const auto outer = torch::autograd::get_current_node();
      const auto s = watch->state.lock();
      if (outer == nullptr || !s) {
        return;
      }
      // Nested: watch the outer task from its node's end. The node may fail
      // first, and its graph outlive the failure (kept by the script): a
      // watch still armed at the next reduction counts as failed then.
      auto next = std::make_shared<NoSyncWatch>();
      next->state = watch->state;
      next->outer = true;
      next->generation = s->outer_watches.fetch_add(1) >> Reducer::State::kWatchCountBits;
      try {
        outer->add_post_hook(std::make_unique<NoSyncOuterHook>(next));
      } catch (...) {
        next->ran = true; // (out of memory: that outer task goes unwatched)
        next->settle(*s, /*failed=*/false);
      }
    });
  } catch (...) {
    watch->ran = true;
    throw;
  }
}

// Note [A second backward after the manual path's reduction]
// The manual path's synchronising backward reduces the window into .grad. A
// second plain backward after it without clearing .grad (two losses, the
// first with retain_graph=True) began another reduction of .grad, which held
// the reduced window plus its own gradients. Under "mean" that is exact (the
// reduced part is alike on every rank, and its mean is itself: syncing every
// micro-batch, the plainest DDP recipe, relies on it). Under "sum" the
// reduced part was multiplied by the world size, silently (review; torch DDP
// leaves the second backward's gradients unreduced instead). So under "sum"
// the reduction records each .grad as it leaves it (TensorImpl and version),
// and a manual reduction warns (once per reducer: again after a refresh) where a recorded .grad
// is still there: the first hook's parameter's
// with this backward's accumulation only (one version on), or any other's
// untouched (the same version: a parameter this backward has not reached
// yet). optimizer.zero_grad() sets .grad to None, or zeroes it in place (a
// version on, before this backward's own): neither is taken for a second
// backward. An in-place change of .grad between the two backwards is (a
// version on, as a zeroing): that case goes unseen. Bucket views share their
// bucket's version counter: at the first hook of a backward only that
// hook's accumulation has run, and the untouched test holds for the other
// buckets' views. A warning, not a drop: the same test holds where reducing
// again does no harm, the gradient reduced again being stepped by nobody (a
// GAN's generator step through the discriminator, whose .grad that
// discriminator cleared before and clears again; a trunk no optimizer
// steps), and a drop there failed every iteration (review).
void Reducer::State::note_manual_written() {
  window.manual_written.clear();
  if (config.rule.reduction != Reduction::Sum) {
    return;
  }
  window.manual_written.resize(config.params.size());
  for (const auto i : c10::irange(config.params.size())) {
    const auto& g = config.params[i].grad();
    window.manual_written[i] = g.defined() ? std::pair<const void*, int64_t>(g.unsafeGetTensorImpl(), detail::grad_version(g))
                                           : std::pair<const void*, int64_t>(nullptr, -1);
  }
}

std::optional<size_t> Reducer::State::adds_to_manual_written(size_t index) const {
  const auto& written = window.manual_written;
  if (written.empty()) {
    return std::nullopt;
  }
  const auto still = [&](size_t i, int64_t versions_on) {
    const auto& g = config.params[i].grad();
    return written[i].first != nullptr && g.defined() && g.unsafeGetTensorImpl() == written[i].first &&
        detail::grad_version(g) == written[i].second + versions_on;
  };
  if (still(index, 1)) {
    return index;
  }
  for (const auto i : c10::irange(written.size())) {
    if (i != index && still(i, 0)) {
      return i;
    }
  }
  return std::nullopt;
}

void Reducer::State::on_no_sync_task_failed() noexcept {
  std::lock_guard<std::mutex> lock(mutex);
  if (!closed.load()) {
    window.failed_no_sync = true;
  }
}

} // namespace gradaccum
