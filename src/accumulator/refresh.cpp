// Accumulator::refresh_parameters(): the trainable set changes at a boundary.
#include <gradaccum/accumulator.h>

#include "call_guard.h"
#include "detail/late_backward.h"
#include "parameters.h"
#include "precision/wide_sums.h"
#include "rank_check.h"

#include <c10/core/InferenceMode.h>

#include <exception>
#include <string>
#include <unordered_set>
#include <utility>

namespace gradaccum {

using detail::CallGuard;

// Note [Refreshing the parameters]
// Fine-tuning unfreezes a backbone (or freezes a head) mid-fit. An
// Accumulator reduces, scales and clears the parameters it was built with;
// refresh_parameters() takes the trainable set again, at a window boundary
// only (no half-done window to carry over). Data parallel it builds a new
// reducer over the new set: its construction is a collective that checks
// every rank has the same parameters and options (a rank that unfroze other
// layers is an error on every rank there; every rank must call it at the
// same point, like every collective: a rank that does not refresh would pair
// its next window with the check) and broadcasts rank 0's values, which
// equal everyone's, and the frozen ones too, as at construction. The counters and the window number carry
// over; error-feedback residuals start at zero; the buckets are laid out
// again (and rebuilt in ready order after the next window, on every rank
// alike). Parameters that left the set get `.grad = None`, so the optimizer
// (momentum, weight decay) leaves them alone. Torch DDP never reduces a
// parameter that was frozen when it was built: its replicas drift apart
// silently after an unfreeze.
void Accumulator::refresh_parameters(ModelParameters model) {
  refresh_parameters(std::move(model), std::string());
}

// Note [A refresh refused on one rank]
// The new reducer's construction is a collective. A rank that refuses the
// call by itself at a window boundary (no trainable parameter left, or the
// caller's own checks: `refused_here`) would skip it and leave the others
// waiting there for the group's timeout. So, data parallel, every rank at a
// boundary first takes part in the old reducer's refresh_check(), saying
// whether it refuses: a reduction through the old buckets that also pairs
// with the window of a rank that did not call refresh_parameters() at all
// (Note [A refresh pairs like a window]). If any rank refused, or one reduced
// something else, every rank raises and nothing changes anywhere: the
// refusing rank its own error, every other rank one naming it. Only then is
// the new reducer built. A rank in the middle of a window, or at a boundary
// with gradients no micro-step counted (which the check would drop), refuses
// before any collective: its next collective is its window's reduction (or
// a checkpoint's snapshot), which meets the others' check there.
void Accumulator::refresh_parameters(ModelParameters model, const std::string& refused_here) {
  const CallGuard guard(driver_, driving_, "acc.refresh_parameters()");
  const c10::InferenceMode not_inference(/*enabled=*/false); // (as the constructor: review)
  realign_after_manual_reduction("acc.refresh_parameters()"); // Note [A manual reduction in the middle of a window]
  check_open("acc.refresh_parameters()");
  check_no_open_parts("acc.refresh_parameters()");
  check_training_not_ended("acc.refresh_parameters()", /*flushing=*/false); // (its check is a collective)
  TORCH_CHECK(micro_step_ == 0 && !window_ready_,
      "gradaccum: acc.refresh_parameters(): called in the middle of a window (micro_step=", micro_step_,
      window_ready_ ? ", closed but not stepped" : "", "); call it at a window boundary: after acc.step() "
      "returned True, or after acc.flush()");
  // Gradients no micro-step counted (the manual path before its optimizer
  // step): refused here, data parallel, before any collective, as in the
  // middle of a window, since the check's reduction would drop them (Note [A
  // refresh pairs like a window]). Decided by marks, alike on every rank that
  // ran the same calls. (One process keeps them: no check runs.)
  if (reducer_) {
    check_no_uncounted_backward("acc.refresh_parameters()");
  }
  std::exception_ptr refused;
  std::vector<std::pair<std::string, at::Tensor>> frozen;
  if (refused_here.empty()) {
    try {
      frozen = detail::checked_trainable(model, "acc.refresh_parameters()");
    } catch (...) {
      if (!reducer_) {
        throw;
      }
      refused = std::current_exception();
    }
  }
  if (reducer_) {
    const auto window = reducer_->progress().sequence;
    try {
      reducer_->refresh_check(refused || !refused_here.empty());
    } catch (...) {
      // Whether the others were flushing (a flag this may set, never clear).
      const bool ended = epoch_ended_;
      note_dropped_window(window);
      epoch_ended_ = epoch_ended_ || ended;
      remember_gradients(); // (the check rewrote bucket views in place, with zeros again)
      if (refused) {
        std::rethrow_exception(refused);
      }
      if (!refused_here.empty()) {
        return; // the caller raises its own error
      }
      throw; // another rank refused, or reduced something else: every rank dropped it
    }
    TORCH_INTERNAL_ASSERT(!refused && refused_here.empty(), "gradaccum: a refused refresh's check returned");
    remember_gradients(); // (bucket views hold the check's zeros: written in place, as they were)
  }
  if (!refused_here.empty()) {
    return; // the caller raises its own error
  }
  // The new set overlaps ours: let ours go to claim it, and take ours back
  // if anything fails (a rejected call changes nothing).
  claim_.reset();
  std::shared_ptr<void> claim;
  std::unique_ptr<Reducer> reducer;
  std::unique_ptr<detail::WideSums> wide;
  try {
    try {
      claim = detail::claim(model.parameters, model.names);
    } catch (const std::exception&) {
      if (reducer_) { // the others wait in the new reducer's first collective
        detail::tell_construction_refused(*reducer_->process_group(), detail::device_of(model.parameters));
      }
      throw;
    }
    if (reducer_) {
      const auto progress = reducer_->progress();
      reducer = std::make_unique<Reducer>(
          model.parameters, reducer_->process_group(), options_.reducer(), std::move(model.buffers), model.names,
          window_rule(), frozen);
      reducer->restore(progress, /*backwards_too=*/true);
    } else if (const auto dtype = options_.accumulate_dtype()) {
      wide = std::make_unique<detail::WideSums>(model.parameters, *dtype);
    }
  } catch (const c10::Error& e) {
    claim.reset();
    claim_ = detail::claim(params_, names_);
    // The reducer's construction checks (every rank alike) speak as the
    // constructor; here they answer this call.
    std::string text = e.what_without_backtrace();
    const std::string ctor = "gradaccum: Accumulator(): ";
    if (text.rfind(ctor, 0) == 0) {
      text = "gradaccum: acc.refresh_parameters(): " + text.substr(ctor.size());
    }
    TORCH_CHECK_VALUE(!dynamic_cast<const c10::ValueError*>(&e), text);
    TORCH_CHECK_WITH(OutOfMemoryError, !dynamic_cast<const c10::OutOfMemoryError*>(&e), text);
    TORCH_CHECK(false, text);
  } catch (...) {
    claim.reset();
    claim_ = detail::claim(params_, names_);
    throw;
  }
  std::unordered_set<const c10::TensorImpl*> kept;
  for (const auto& p : model.parameters) {
    kept.insert(p.unsafeGetTensorImpl());
  }
  for (auto& p : params_) {
    if (!kept.count(p.unsafeGetTensorImpl())) {
      p.mutable_grad() = at::Tensor(); // no longer trained: nothing for the optimizer to act on
    }
  }
  {
    const std::lock_guard<std::mutex> lock(reducer_readers_); // (a reader on another thread)
    std::swap(reducer_, reducer);
  }
  reducer.reset(); // the old one's hooks go with it
  wide_ = std::move(wide);
  claim_ = std::move(claim);
  params_ = std::move(model.parameters);
  names_ = std::move(model.names);
  frozen_ = std::move(frozen);
  if (!reducer_) {
    late_watch_ = std::make_unique<detail::LateBackwardWatch>(params_, names_); // (the old one's hooks go)
  }
  forget_window_loss(); // the last window's loss, items and metrics were of the old set; the counters stay
  remember_gradients();
  forget_nonzero_gradients(); // a newly trainable parameter's stale .grad (Note [Gradients no micro-step counted])
}

} // namespace gradaccum
