// Accumulator::state_dict / load_state_dict: the checkpoint of a window in
// progress (see AccumulatorState in state.h); loading it in load.cpp, the
// files in archive.cpp.
#include <gradaccum/accumulator.h>

#include "precision/loss_scaler.h"
#include "precision/wide_sums.h"

#include "call_guard.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace gradaccum {

using detail::CallGuard;

// Note [A checkpoint is a consistent cut]
// A rank-independent state is one rank's view of the window, loaded on every
// rank, so every rank must save it at the same micro-step. A save decided per
// rank (a timer, a preemption signal) can break that. Mid-window, every rank
// saving takes part in the snapshot's reduction, whose consensus ties it to
// the same window, but not to the same micro-step: the micro-steps are then
// gathered (the snapshot completed on every rank, so this collective pairs) and
// a difference is the same error on every rank. The window itself stays
// right: the snapshot's sums plus the micro-steps still to come are the
// window's gradient whatever the cut, so training may go on. A rank at the
// window boundary saves with no collective; its peers' snapshot then meets its
// next reduction, and the reducer's consensus fails that window on every rank.
// Note [Resuming on another shape]
// A state saved at a window boundary holds no gradient, only counters: it
// loads on any number of ranks and with any `steps` (the next window uses the
// new ones). A closed window not yet stepped (window_ready) holds the reduced
// gradient, the same on every rank: it loads on any number of ranks, with
// the steps it was saved with. A half-done window saved rank-independent on
// W ranks holds 1/W of the window's sum over ranks and of its global weight
// (micro-steps or items). Resumed on W ranks, each rank takes that share, as
// before. Resumed on W' != W ranks, rank 0 takes all of it (W times the
// share: W' equal shares of a float32 weight such as 2/3 would not sum back
// exactly) and the other ranks start the window empty; each rank then runs
// the window's remaining steps - micro_step micro-steps, and the window
// closes with the exact mean (or items-weighted mean) of every micro-batch it
// saw on either side of the resume: its divisor is the saved global weight
// plus what the new ranks add. A per-rank state of a half-done window, and
// error-feedback residuals (each rank's rounding of its own share), cannot be
// split that way: loading them on another world size is an error.
void Accumulator::check_consistent_cut(int64_t window, bool failed_here) const {
  // -1: this rank's snapshot failed after it completed everywhere (an error
  // of its own follows); it still takes part, so that no peer waits here.
  const auto steps = reducer_->gather(failed_here ? -1 : micro_step_);
  std::ostringstream each;
  bool same = true;
  int64_t failed = -1;
  for (const auto r : c10::irange(steps.size())) {
    same = same && steps[r] == steps[0];
    failed = steps[r] < 0 && failed < 0 ? static_cast<int64_t>(r) : failed;
    each << (r ? ", " : "") << "rank " << r << ": " << steps[r];
  }
  if (failed_here) {
    return;
  }
  TORCH_CHECK(failed < 0,
      "gradaccum: acc.state_dict(): the checkpoint of window ", window, " failed on rank ", failed,
      " after its snapshot (that rank says why); no rank's state is a checkpoint of the job");
  TORCH_CHECK(same,
      "gradaccum: acc.state_dict(): the ranks are at different micro-steps of window ", window, " (",
      each.str(), "), so no rank's state is a consistent checkpoint of the job. Call acc.state_dict() "
      "at the same micro-step on every rank (at a window boundary, after acc.step() returned "
      "True, is simplest). Nothing was lost: training can go on");
}

AccumulatorState Accumulator::state_dict(bool rank_independent) {
  const CallGuard guard(driver_, driving_, "acc.state_dict()");
  realign_after_manual_reduction("acc.state_dict()"); // Note [A manual reduction in the middle of a window]
  check_open("acc.state_dict()");
  check_no_open_parts("acc.state_dict()");
  // (A state saved here would step the optimizer again when resumed.)
  TORCH_CHECK(!window_optimizer_stepped_,
      "gradaccum: acc.state_dict(): the optimizer stepped this window but the scheduler raised; call acc.step() "
      "again (it runs the scheduler only) before saving");
  // (Loading such a state would lift the refusal of micro-steps that keeps
  // this rank's windows paired with the others': review.)
  TORCH_CHECK(!epoch_ended_raised_,
      "gradaccum: acc.state_dict(): this rank went on training after the other ranks ended the epoch with "
      "acc.flush() (the error raised before); call acc.flush() (it steps nothing and runs no collective) before "
      "saving");
  AccumulatorState state;
  state.steps = options_.steps();
  state.reduction = options_.reduction();
  state.world_size = reducer_ ? reducer_->process_group()->getSize() : 1;
  state.rank = reducer_ ? reducer_->process_group()->getRank() : 0;
  state.rank_independent = !reducer_ || rank_independent;
  state.micro_step = micro_step_;
  state.window_ready = window_ready_;
  state.window_weight = window_weight_;
  state.window_empty = window_ready_ && window_empty_;
  state.window_unscaled = window_ready_ && window_unscaled_;
  state.window_clipped = window_ready_ && window_clipped_;
  state.window_raised_nonfinite = window_ready_ && window_raised_nonfinite_;
  state.window_closed_by_flush = window_ready_ && window_closed_by_flush_;
  state.window_shared = reducer_ && !rank_independent && micro_step_ > 0 && window_shared_;
  // A rank-independent state is the one every rank holds after its flush():
  // where the others' flush() ended this rank's epoch, its own flush() only
  // clears the mark (no collective, no counter), so the state saves it
  // cleared (every rank loading it then ends or begins the epoch alike; rank
  // 0 saving after the step that closed its last window is the frameworks'
  // way, review). A rank's own state keeps it.
  state.epoch_ended = epoch_ended_ && !(reducer_ && rank_independent);
  state.micro_steps = stats_.micro_steps;
  state.optimizer_steps = stats_.optimizer_steps;
  state.skipped_steps = stats_.skipped_steps;
  state.windows = stats_.windows;
  state.skipped_micro_batches = stats_.skipped_micro_batches;
  state.loss_scale = loss_scaler_ ? loss_scaler_->scale() : 0.0;
  state.loss_scale_growth_tracker = loss_scaler_ ? loss_scaler_->growth_tracker() : 0;
  state.parameter_names = names_;
  TORCH_CHECK(!(reducer_ && rank_independent && micro_step_ > 0 && reducer_->compressing()),
      "gradaccum: acc.state_dict(): a rank-independent checkpoint in the middle of a window is not supported "
      "with comm_dtype (the half-done window would be rounded to the wire's dtype); save at a "
      "window boundary (micro_step 0), or use acc.state_dict(rank_independent=False)");
  TORCH_CHECK(!window_scaler_failed_,
      "gradaccum: acc.state_dict(): the loss scaler's unscale of this closed window raised, so its gradient may "
      "be unscaled in part: a state saved now would resume it as a window to unscale. Drop it with "
      "acc.zero_grad() first");
  TORCH_CHECK(!(reducer_ && !rank_independent && window_failed_),
      "gradaccum: acc.state_dict(rank_independent=False): a micro-step of this window failed on this rank (or its "
      "gradients were changed outside the Accumulator), so the window will be dropped on every rank when it "
      "closes; a state saved now would resume it as if nothing had failed. Save at a window boundary (after the "
      "window closes)");
  if (reducer_ && rank_independent && micro_step_ > 0) {
    snapshot_window_into(state);
  } else {
    copy_window_into(state);
  }
  if (reducer_) {
    const auto progress = reducer_->progress();
    state.reducer = progress.stats;
    state.reducer_sequence = progress.sequence;
    state.reducer_last_weight = progress.last_weight;
    if (!state.rank_independent && options_.error_feedback()) {
      state.residuals = reducer_->residuals(); // a rank's own: see AccumulatorState
      state.reducer_residual_weight = progress.residual_weight;
    }
  }
  return state;
}

void Accumulator::snapshot_window_into(AccumulatorState& state) {
  // Sum the half-done window over ranks; each rank keeps 1/world of it, so
  // any rank's state, loaded everywhere, sums back to the same window.
  ReductionRequest request;
  request.weight = window_weight_;
  request.divide = false;
  request.abort = window_failed_ ? window_failure_ : AbortReason::None; // (what failed: its text)
  request.loss_sum = window_loss_cut_ ? at::Tensor() : window_loss_sum_; // Note [The window's loss across a checkpoint]
  if (!window_failed_ && grad_versions() != remembered_) {
    // Cleared or changed since the last micro-step (optimizer.zero_grad()?):
    // a snapshot of it would save, and then continue, a silently wrong window.
    request.abort = AbortReason::GradientsChanged;
  }
  ReductionResult result;
  const auto window = reducer_->progress().sequence;
  std::vector<at::Tensor> sums;
  try {
    sums = reducer_->snapshot(request, &result);
  } catch (...) {
    const auto last = reducer_->last_result();
    if (last.window == window && !last.dropped) {
      // Completed on every rank, failed here afterwards: the peers go on to
      // the cut's check; meet them there (it fails on every rank).
      try {
        check_consistent_cut(window, /*failed_here=*/true);
      } catch (const std::exception&) {
        // the peers' collective failed too: this rank's own error says why
      }
    }
    reset_window(); // dropped on this rank: see the error
    note_dropped_window(window);
    throw;
  }
  remember_gradients(); // bucket views were written back in place
  check_consistent_cut(window);
  const auto world = static_cast<double>(state.world_size);
  for (const auto& sum : sums) {
    // In the buckets' dtype: an accumulate_dtype sum stays wide.
    state.grads.push_back(sum.defined() ? sum.div(world) : at::Tensor());
  }
  state.window_weight = result.global_weight / world;
  if (result.loss_sum && !window_loss_cut_) {
    std::vector<double> sums{*result.loss_sum};
    const auto n = options_.metrics().size();
    sums.insert(sums.end(), result.metric_sums.begin(), result.metric_sums.begin() + static_cast<std::ptrdiff_t>(n));
    state.window_loss_sums = at::tensor(sums, at::kDouble); // (whole: rank 0 takes it on loading)
    state.window_metric_names = options_.metrics();
  }
}

// Note [The window's loss across a checkpoint]
// A half-done window's loss and metric sums are saved with its gradients:
// summed over ranks by the snapshot (they ride in its header, as in a
// window's reduction: Note [The window's loss rides in the header]), whole
// (1 + metrics numbers: not split in shares as the gradients are, so that a
// count metric sums back exactly and an infinite loss is not multiplied by
// 0); or this rank's own, in a per-rank state or one process. Resumed from a
// rank-independent state, rank 0 takes them and the others start at zero; a
// per-rank state gives its rank its own. The window's closing reduction sums
// them with the losses after the resume: window_loss is the uninterrupted
// window's. Where
// they are not known (a window cut by an older checkpoint, a digit-encoded
// wire's header, a state from before they were kept) window_loss is None for
// the resumed window, as it was for every resumed window before.
at::Tensor Accumulator::own_window_loss_sums() const {
  if (micro_step_ == 0 || window_loss_cut_) {
    return at::Tensor();
  }
  const auto n = static_cast<int64_t>(options_.metrics().size());
  return window_loss_sum_.defined() ? window_loss_sum_.detach().reshape({-1}).to(at::kCPU, at::kDouble).clone()
                                    : at::zeros({1 + n}, at::kDouble);
}

void Accumulator::copy_window_into(AccumulatorState& state) const {
  const bool mid_window = micro_step_ > 0 || window_ready_;
  state.window_loss_sums = own_window_loss_sums();
  if (state.window_loss_sums.defined()) {
    state.window_metric_names = options_.metrics();
  }
  if (mid_window) {
    // A window cleared or replaced since its last micro-step would be saved,
    // and resumed, without what it lost (no collective here: a local error).
    check_gradients_untouched("acc.state_dict()", /*allow_in_place=*/window_ready_);
  } else {
    // Gradients no micro-step counted (the manual no_sync path before its
    // optimizer step) would be saved as a boundary without them: refused, as
    // acc.step() refuses them. By marks, not values, so that every rank that
    // ran the same calls decides alike (a gradient that happens to be zero on
    // one rank must not let that rank save while the others raise).
    check_no_uncounted_backward("acc.state_dict()");
  }
  // accumulate_dtype mid-window: the wide sums (in the buckets, or in wide_
  // in one process) are the window's gradient so far; .grad holds none.
  std::vector<at::Tensor> wide;
  if (micro_step_ > 0 && reducer_ && reducer_->accumulating()) {
    wide = reducer_->accumulated();
  } else if (micro_step_ > 0 && wide_) {
    wide = wide_->sums();
  }
  for (const auto i : c10::irange(params_.size())) {
    const auto& p = params_[i];
    if (!wide.empty() && accumulates_wide(i)) {
      state.grads.push_back(wide[i]);
    } else {
      // A snapshot: later micro-steps must not change what was saved.
      state.grads.push_back(mid_window && p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
    }
  }
}

} // namespace gradaccum
