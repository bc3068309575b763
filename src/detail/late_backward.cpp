#include "detail/late_backward.h"

#include "detail/grad_accumulator.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

// Note [A backward after the window closed]
// From the acc.backward() that closes a window to the call that consumes it
// (acc.step(), acc.flush(), acc.zero_grad(); acc.state_dict() reads it), the
// window's gradients are final. A backward that reaches the parameters in
// between (a GAN's generator loss through a discriminator whose window just
// closed, not frozen) sums into them a gradient no micro-step counted. Its
// accumulation in place looks like clipping's (both bump the version of
// .grad), so the marks of Note [Gradients no micro-step counted] cannot tell
// it: a hook can.
// - Data parallel, the reducer's hooks used to begin a manual-path reduction
//   of it, so the step was neither the window nor the sum. While the
//   Accumulator holds a closed window (Reducer::hold_closed_window()) they
//   begin nothing and record the first parameter reached.
// - One process, LateBackwardWatch's hooks record it (they are armed only
//   then; otherwise each costs a check per backward).
// Both record into a LateBackwardRecord, and only a gradient AccumulateGrad
// adds: its post-hooks run for an undefined gradient, or a parameter frozen
// since the forward (the other network frozen for that backward), too.
// acc.step(), acc.flush() (stepping a closed window first) and
// acc.state_dict() then refuse, changing nothing; acc.zero_grad() drops the
// window. The decision reads hooks, never values: it is the same on every
// rank that ran the same calls. A rank that ran such a backward alone refuses
// alone, and its acc.zero_grad() is told to every rank by the next reduction
// (Note [A window not stepped on some ranks]); inside acc.flush(), the
// flush's reduction drops the window on every rank. Under compiled autograd
// the hooks do not run: the backward is refused while it is compiled, before
// it writes any gradient.

namespace gradaccum::detail {

std::string late_backward_error(const char* call, const std::string& name, bool data_parallel) {
  const std::string c = call;
  const char* outcome = c == "loss.backward()" ? "Under compiled autograd the hooks that would tell acc.step() do "
                                                 "not run, so this backward was refused before it wrote anything"
      : c == "acc.state_dict()" ? "Nothing was saved: acc.zero_grad() drops this window"
                                : "Nothing was stepped: acc.zero_grad() drops this window";
  return c10::str("gradaccum: ", call, ": a backward reached ", name, " after the acc.backward() that closed "
      "the window and before acc.step() (another loss's backward through these parameters, e.g. a GAN's "
      "generator loss through a discriminator that is not frozen?): it sums into the window's gradients a "
      "gradient no micro-step counted", data_parallel ? ", reduced over no rank" : "", ". Call acc.step() "
      "right after the micro-step that closes the window, or freeze the other network for that backward "
      "(requires_grad_(False)). ", outcome);
}

namespace {

class WatchHook : public torch::autograd::FunctionPostHook {
 public:
  WatchHook(std::weak_ptr<LateBackwardWatch::Shared> shared, size_t index)
      : shared_(std::move(shared)), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& inputs) override {
    if (auto shared = shared_.lock(); shared && shared->record.armed()) {
      shared->record.note(index_, shared->params[index_], inputs);
    }
    return outputs;
  }
  // Note [Compiled autograd] (src/reducer/hooks.cpp): registers nothing.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& /*args*/) const override {
    const auto shared = shared_.lock();
    TORCH_CHECK(!shared || !shared->record.armed() || !shared->params[index_].requires_grad(),
        late_backward_error("loss.backward()", shared ? shared->names[index_] : "", /*data_parallel=*/false));
  }

 private:
  std::weak_ptr<LateBackwardWatch::Shared> shared_;
  size_t index_;
};

} // namespace

LateBackwardWatch::LateBackwardWatch(const std::vector<at::Tensor>& params, const std::vector<std::string>& names)
    : shared_(std::make_shared<Shared>()) {
  TORCH_INTERNAL_ASSERT(params.size() == names.size(), "gradaccum: a name per parameter");
  shared_->params = params;
  shared_->names = names;
  std::weak_ptr<Shared> weak = shared_;
  for (const auto i : c10::irange(params.size())) {
    auto accumulator = grad_accumulator_for(params[i]);
    TORCH_INTERNAL_ASSERT(accumulator, "gradaccum: ", names[i], " has no gradient accumulator");
    keys_.push_back(accumulator->add_post_hook(std::make_unique<WatchHook>(weak, i)));
    accumulators_.push_back(std::move(accumulator));
  }
}

LateBackwardWatch::~LateBackwardWatch() {
  if (torch::autograd::get_current_graph_task_id() >= 0) {
    return; // inside a backward (a hook that closes the Accumulator): as ~Reducer
  }
  try {
    for (const auto i : c10::irange(accumulators_.size())) {
      accumulators_[i]->del_post_hook(keys_[i]);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: removing the Accumulator's hooks failed: ", e.what());
  }
}

} // namespace gradaccum::detail
