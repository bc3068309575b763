// Accumulator::load_state_dict: whether a state fits this Accumulator (its
// shape, its parameters, its window's sums) and loading it; the save side
// is checkpoint.cpp, the files archive.cpp.
#include <gradaccum/accumulator.h>

#include "precision/loss_scaler.h"
#include "precision/wide_sums.h"

#include "call_guard.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <sstream>

namespace gradaccum {

using detail::CallGuard;

namespace {

// Whether `state` fits this shape: steps, reduction, world size and rank.
void check_shape(const AccumulatorState& state, const AccumulatorOptions& options, int64_t world, int64_t rank) {
  // See Note [Resuming on another shape].
  const bool boundary = state.micro_step == 0 && !state.window_ready;
  TORCH_CHECK_VALUE(state.steps > 0, "gradaccum: acc.load_state_dict(): the state's steps is ", state.steps,
      " (a window has steps > 0)");
  TORCH_CHECK_VALUE(state.steps == options.steps() || boundary,
      "gradaccum: acc.load_state_dict(): the state was saved with steps=", state.steps,
      " in the middle of a window (micro_step=", state.micro_step, state.window_ready ? ", closed, not yet stepped" : "",
      ") but this Accumulator has steps=", options.steps(), "; resume with steps=", state.steps,
      ", or save at a window boundary (after acc.step() returned True) to change steps");
  const auto code = static_cast<int64_t>(state.reduction);
  TORCH_CHECK_VALUE(code >= static_cast<int64_t>(Reduction::Mean) && code <= static_cast<int64_t>(Reduction::Items),
      "gradaccum: acc.load_state_dict(): the state's reduction is ", code, ", which names no reduction");
  TORCH_CHECK_VALUE(state.reduction == options.reduction(),
      "gradaccum: acc.load_state_dict(): the state was saved with reduction='", to_string(state.reduction),
      "' but this Accumulator has reduction='", to_string(options.reduction()), "'");
  TORCH_CHECK_VALUE(state.world_size >= 1 && state.rank >= 0 && state.rank < state.world_size,
      "gradaccum: acc.load_state_dict(): rank=", state.rank, " and world_size=", state.world_size,
      " do not describe a rank of a group");
  if (state.world_size != world) {
    TORCH_CHECK_VALUE(state.rank_independent || state.micro_step == 0,
        "gradaccum: acc.load_state_dict(): this is rank ", state.rank, "'s own state of a half-done window "
        "(acc.state_dict(rank_independent=False)), which holds only that rank's part of it, saved with world size ",
        state.world_size, "; this Accumulator's group has ", world, " rank(s). Save with acc.state_dict() "
        "(rank-independent) to resume a half-done window on another number of ranks, or resume with ",
        state.world_size, " ranks");
    TORCH_CHECK_VALUE(state.residuals.empty(),
        "gradaccum: acc.load_state_dict(): the state holds rank ", state.rank, "'s error-feedback residuals "
        "(what rounding to comm_dtype lost of that rank's share), saved with world size ", state.world_size,
        "; this Accumulator's group has ", world, " rank(s), whose shares differ. Save with acc.state_dict() "
        "(rank-independent: the residuals start at zero), or resume with ", state.world_size, " ranks");
    TORCH_CHECK_VALUE(!state.epoch_ended,
        "gradaccum: acc.load_state_dict(): the state was saved with epoch_ended=true (other ranks had ended "
        "the epoch with acc.flush()) and world size ", state.world_size, "; call acc.flush() before saving "
        "to resume on ", world, " rank(s)");
  } else {
    // At a boundary (or a closed window, alike on every rank) a rank's own
    // state holds nothing of that rank's but its counters, unless residuals
    // or an ended epoch: it loads on any rank, as on another world size
    // above (where a refusal on some ranks only would leave the others going on).
    const bool nothing_own = state.micro_step == 0 && state.residuals.empty() && !state.epoch_ended;
    TORCH_CHECK_VALUE(state.rank_independent || state.rank == rank || nothing_own,
        "gradaccum: acc.load_state_dict(): this is rank ", state.rank, "'s own state (acc.state_dict(rank_independent="
        "False)) but this is rank ", rank, "; save with acc.state_dict() (rank-independent) to load "
        "one rank's state on every rank");
  }
}

// A parameter's name with torch.compile's wrapper ("_orig_mod.") left out,
// so that a model compiled on one side of a resume and not on the other
// still names its parameters alike.
std::string plain_name(const std::string& name) {
  static const std::string wrapper = "_orig_mod.";
  std::string out;
  size_t from = 0;
  while (from <= name.size()) {
    const auto dot = name.find('.', from);
    const auto end = dot == std::string::npos ? name.size() : dot + 1;
    if (name.compare(from, end - from, wrapper) != 0) {
      out.append(name, from, end - from);
    }
    from = end;
    if (dot == std::string::npos) {
      break;
    }
  }
  return out;
}

// Whether `names` are ModelParameters' own for bare parameters, which say
// nothing but the position.
bool positional(const std::vector<std::string>& names) {
  for (const auto i : c10::irange(names.size())) {
    if (names[i] != "parameter " + std::to_string(i)) {
      return false;
    }
  }
  return true;
}

// Note [A held gradient belongs to a named parameter]
// grads and residuals are lists in the trainable parameters' order, so a
// state that holds any of them (mid-window, a closed window, error
// feedback) loads only onto the same trainable parameters: the same count
// and shapes are not enough (another layer of the same shape, trained
// instead, would silently take its gradient). A boundary state holds none
// and fits any set (Note [Refreshing the parameters]). Bare parameters
// (names "parameter i") and older checkpoints (no names) load by position.
void check_parameter_names(const AccumulatorState& state, const std::vector<std::string>& names,
                           bool no_gradient) {
  // (A per-rank state of error feedback lists a residual per parameter, None
  // where its wire kept none.)
  const bool no_residual = std::none_of(state.residuals.begin(), state.residuals.end(),
                                        [](const at::Tensor& r) { return r.defined(); });
  if (state.parameter_names.empty() || (no_gradient && no_residual) ||
      positional(state.parameter_names) || positional(names)) {
    return; // an older checkpoint, or bare parameters (by position); or nothing held
  }
  const auto& saved = state.parameter_names;
  TORCH_CHECK_VALUE(saved.size() == state.grads.size() &&
          (state.residuals.empty() || saved.size() == state.residuals.size()),
      "gradaccum: acc.load_state_dict(): the state names ", saved.size(), " parameters but holds ",
      state.grads.size(), " gradients", state.residuals.empty() ? "" : " and " +
          std::to_string(state.residuals.size()) + " residuals");
  std::ostringstream differ;
  int64_t count = 0;
  // Another set: which names only one side trains (a layer frozen or
  // unfrozen); the same set in another order: where they differ.
  std::vector<std::string> was_names, is_names;
  for (const auto& n : saved) {
    was_names.push_back(plain_name(n));
  }
  for (const auto& n : names) {
    is_names.push_back(plain_name(n));
  }
  auto only_in = [](const std::vector<std::string>& a, const std::vector<std::string>& b) {
    std::vector<std::string> out;
    for (const auto& n : a) {
      if (std::find(b.begin(), b.end(), n) == b.end()) {
        out.push_back(n);
      }
    }
    return out;
  };
  const auto saved_only = only_in(was_names, is_names);
  const auto here_only = only_in(is_names, was_names);
  auto list = [](const std::vector<std::string>& v) {
    std::ostringstream out;
    for (const auto i : c10::irange(std::min<size_t>(v.size(), 3))) {
      out << (i ? ", " : "") << "'" << v[i] << "'";
    }
    out << (v.size() > 3 ? ", ... (" + std::to_string(v.size()) + " in all)" : "");
    return out.str();
  };
  if (!saved_only.empty() || !here_only.empty()) {
    count = static_cast<int64_t>(saved_only.size() + here_only.size());
    const bool both = !saved_only.empty() && !here_only.empty();
    const bool none_shared = saved_only.size() == was_names.size(); // (every name differs)
    differ << (saved_only.empty() ? "" : "trained when saved, not here: " + list(saved_only))
           << (both ? "; " : "") << (here_only.empty() ? "" : "trained here, not when saved: " + list(here_only))
           << (both && none_shared ? " (or renamed: the model wrapped in another module?)" : "");
    count = std::min<int64_t>(count, 3); // (the lists say "..." themselves)
  } else {
    for (const auto i : c10::irange(std::max(saved.size(), names.size()))) {
      const std::string was = i < saved.size() ? was_names[i] : std::string("(none)");
      const std::string is = i < names.size() ? is_names[i] : std::string("(none)");
      if (was != is && count++ < 3) {
        differ << (count > 1 ? "; " : "") << "parameter " << i << " was '" << was << "', is '" << is << "'";
      }
    }
  }
  TORCH_CHECK_VALUE(count == 0 || !no_gradient,
      "gradaccum: acc.load_state_dict(): the state holds error-feedback residuals of other trainable parameters "
      "than this Accumulator's (", differ.str(), count > 3 ? "; ..." : "", "), so they would land on the wrong "
      "parameters. Resume with the trainable parameters that saved it (the same requires_grad settings), or leave "
      "out its 'error_feedback_residuals' (they restart at zero, as after acc.refresh_parameters())");
  TORCH_CHECK_VALUE(count == 0,
      "gradaccum: acc.load_state_dict(): the state holds the gradients of a window in progress for other "
      "trainable parameters than this Accumulator's (", differ.str(), count > 3 ? "; ..." : "", "), so they "
      "would land on the wrong parameters. Resume with the trainable parameters that saved it (the same "
      "requires_grad settings), or save at a window boundary (after acc.step() returned True), which holds no "
      "gradient and resumes on any set");
}

} // namespace

void Accumulator::check_loadable(const AccumulatorState& state) const {
  const int64_t world = reducer_ ? reducer_->process_group()->getSize() : 1;
  const int64_t rank = reducer_ ? reducer_->process_group()->getRank() : 0;
  check_shape(state, options_, world, rank);
  const auto& sums = state.window_loss_sums; // (on any device: torch.load(map_location=...))
  TORCH_CHECK_VALUE(!sums.defined() || (sums.dim() == 1 && sums.numel() >= 1 && sums.scalar_type() == at::kDouble &&
                                         !sums.is_meta()),
      "gradaccum: acc.load_state_dict(): 'window_loss_sums' must be a 1-D float64 tensor (the loss, then the "
      "metrics), got ", sums.defined() ? c10::str(sums.scalar_type(), " ", sums.sizes(), " on ", sums.device())
                                       : std::string());
  TORCH_CHECK_VALUE(state.window_metric_names.empty() || !sums.defined() ||
                        sums.numel() == 1 + static_cast<int64_t>(state.window_metric_names.size()),
      "gradaccum: acc.load_state_dict(): 'window_loss_sums' must hold the loss and one sum per name of "
      "'window_metric_names' (", 1 + state.window_metric_names.size(), " numbers), got ", sums.numel());
  TORCH_CHECK_VALUE(state.micro_step >= 0 && state.micro_step < options_.steps(),
      "gradaccum: acc.load_state_dict(): micro_step=", state.micro_step, " is outside [0, ", options_.steps(), ")");
  TORCH_CHECK_VALUE(!state.window_ready || state.micro_step == 0,
      "gradaccum: acc.load_state_dict(): window_ready=true with micro_step=", state.micro_step,
      " (a closed window has micro_step 0)");
  TORCH_CHECK_VALUE(state.window_ready || (!state.window_empty && !state.window_unscaled && !state.window_clipped &&
                                            !state.window_raised_nonfinite && !state.window_closed_by_flush),
      "gradaccum: acc.load_state_dict(): window_empty, window_unscaled, window_clipped, window_raised_nonfinite or "
      "window_closed_by_flush "
      "without window_ready (they "
      "describe a closed window)");
  TORCH_CHECK_VALUE(!state.window_shared || (!state.rank_independent && state.micro_step > 0),
      "gradaccum: acc.load_state_dict(): window_shared=true describes a per-rank state in the middle of a window "
      "(rank_independent=false, micro_step > 0)");
  TORCH_CHECK_VALUE(state.skipped_micro_batches >= 0,
      "gradaccum: acc.load_state_dict(): skipped_micro_batches=", state.skipped_micro_batches, " must be >= 0");
  TORCH_CHECK_VALUE(std::isfinite(state.window_weight) && state.window_weight >= 0,
      "gradaccum: acc.load_state_dict(): window_weight=", state.window_weight, " must be >= 0");
  TORCH_CHECK_VALUE(std::isfinite(state.reducer_last_weight) && state.reducer_last_weight >= 0,
      "gradaccum: acc.load_state_dict(): reducer_last_weight=", state.reducer_last_weight, " must be >= 0");
  TORCH_CHECK_VALUE(std::isfinite(state.reducer_residual_weight) && state.reducer_residual_weight >= 0,
      "gradaccum: acc.load_state_dict(): reducer_residual_weight=", state.reducer_residual_weight, " must be >= 0");
  // Mid-window the weight is this rank's share of the micro-steps or items
  // so far (after a resume on another number of ranks, not a count of its
  // own), and may be 0 (num_items=0); a window not yet begun has none.
  TORCH_CHECK_VALUE(state.micro_step > 0 || state.window_weight == 0,
      "gradaccum: acc.load_state_dict(): window_weight=", state.window_weight, " with micro_step=0 (no "
      "micro-step of the window is done, so its weight is 0)");
  TORCH_CHECK_VALUE(!state.epoch_ended || (state.micro_step == 0 && world > 1),
      "gradaccum: acc.load_state_dict(): epoch_ended=true needs micro_step=0 and a process group");
  TORCH_CHECK_VALUE((state.loss_scale > 0) == static_cast<bool>(loss_scaler_) && std::isfinite(state.loss_scale) &&
          state.loss_scale_growth_tracker >= 0,
      "gradaccum: acc.load_state_dict(): loss_scale=", state.loss_scale, " does not fit this Accumulator (",
      loss_scaler_ ? "it has a loss_scaler: the scale must be > 0" : "it has no loss_scaler: 0", ")");
  const auto& r = state.reducer;
  TORCH_CHECK_VALUE(state.micro_steps >= 0 && state.optimizer_steps >= 0 &&
          state.skipped_steps >= 0 && state.windows >= 0 && state.reducer_sequence >= 0 && r.windows >= 0 &&
          r.dropped_windows >= 0 && r.collectives >= 0 && r.bytes_reduced >= 0 && r.last_window_collectives >= 0 &&
          r.last_window_bytes >= 0 && r.broadcasts >= 0 && r.snapshots >= 0,
      "gradaccum: acc.load_state_dict(): counters must be >= 0");
  // At a boundary a state holds no gradient, so it fits another trainable set
  // too (a fine-tuning run saved after unfreezing, resumed frozen: Note
  // [Refreshing the parameters]).
  const bool no_gradient = std::none_of(state.grads.begin(), state.grads.end(),
                                        [](const at::Tensor& g) { return g.defined(); });
  check_parameter_names(state, names_, no_gradient); // (first: it names the parameters that differ)
  TORCH_CHECK_VALUE(state.grads.size() == params_.size() || (no_gradient && state.micro_step == 0),
      "gradaccum: acc.load_state_dict(): the state holds ", state.grads.size(),
      " gradients but the model has ", params_.size(), " trainable parameters (are the requires_grad settings "
      "those of the run that saved it?)");
  for (const auto i : c10::irange(std::min(params_.size(), state.grads.size()))) {
    const auto& g = state.grads[i];
    if (g.defined()) {
      TORCH_CHECK_VALUE(g.layout() == at::kStrided && !g.is_meta(),
          "gradaccum: acc.load_state_dict(): gradient ", i, " is a ", g.layout(), " tensor on ", g.device(),
          "; a state's gradients are dense tensors holding values, as acc.state_dict() saves them");
      // Mid-window, a parameter summed in accumulate_dtype takes its sum in
      // that dtype (or its own, widened).
      const bool wide = state.micro_step > 0 && accumulates_wide(i) &&
          g.scalar_type() == *options_.accumulate_dtype();
      TORCH_CHECK_VALUE(g.sizes() == params_[i].sizes() && (wide || g.scalar_type() == params_[i].scalar_type()),
          "gradaccum: acc.load_state_dict(): gradient ", i, " is ", g.scalar_type(), " ", g.sizes(),
          " but the parameter is ", params_[i].scalar_type(), " ", params_[i].sizes(),
          (accumulates_wide(i) && state.micro_step > 0
               ? std::string(" (summed in ") + c10::toString(*options_.accumulate_dtype()) + " here)"
               : std::string()));
    }
  }
  TORCH_CHECK_VALUE(state.residuals.empty() || (reducer_ && !state.rank_independent),
      "gradaccum: acc.load_state_dict(): the state holds error-feedback residuals, which belong to one rank's "
      "per-rank state (rank_independent=False) of a data-parallel Accumulator");
}

void Accumulator::load_state_dict(const AccumulatorState& state) {
  const CallGuard guard(driver_, driving_, "acc.load_state_dict()");
  // Inside torch.inference_mode() the loaded .grad would be inference
  // tensors no backward can add to, and the load half done when that shows
  // (review): what it makes is made outside it.
  const c10::InferenceMode not_inference(/*enabled=*/false);
  realign_after_manual_reduction(); // Note [A manual reduction in the middle of a window]
  check_open("acc.load_state_dict()");
  check_no_open_parts("acc.load_state_dict()");
  check_loadable(state);
  const int64_t world = reducer_ ? reducer_->process_group()->getSize() : 1;
  const int64_t rank = reducer_ ? reducer_->process_group()->getRank() : 0;
  // See Note [Resuming on another shape].
  const double share = state.micro_step == 0 || state.world_size == world
      ? 1.0 : (rank == 0 ? static_cast<double>(state.world_size) : 0.0);
  if (reducer_) {
    reducer_->set_residuals(state.residuals); // all or nothing; the last check that can fail
  }
  // check_loadable() refused what cannot be copied (meta, sparse). One
  // gradient at a time from here, as a resume's peak memory is one set of
  // gradients beside the state's: only running out of memory fails now.
  clear_gradients();
  {
    at::NoGradGuard no_grad;
    std::vector<size_t> restored;
    for (const auto i : c10::irange(params_.size())) {
      const auto g = i >= state.grads.size() || !state.grads[i].defined() || share == 0.0 ? at::Tensor()
          : (share == 1.0 ? state.grads[i].detach() : state.grads[i].detach().mul(share)).to(params_[i].device());
      if (!g.defined()) {
        if (state.window_ready) {
          params_[i].mutable_grad() = at::Tensor(); // no gradient anywhere: None, not a zero view
        }
        continue;
      }
      restored.push_back(i);
      if (state.micro_step > 0 && accumulates_wide(i)) {
        if (reducer_) {
          reducer_->load_accumulated(i, g);
        } else {
          wide_->load(i, g, names_[i], params_[i].sizes());
        }
        continue;
      }
      auto& grad = params_[i].mutable_grad();
      if (grad.defined()) {
        grad.copy_(g); // a bucket view stays a view
      } else {
        grad = g.is_alias_of(state.grads[i]) ? g.clone() : g; // (never the state's own tensor)
      }
    }
    if (reducer_) {
      reducer_->mark_restored(restored); // these hold a gradient even if no hook fires again
    }
  }
  micro_step_ = state.micro_step;
  set_window_ready(state.window_ready);
  window_weight_ = state.window_weight * share;
  window_failed_ = false;
  // (A closed window that raised stays so: dropped, it counts as skipped.)
  window_raised_nonfinite_ = state.window_ready && state.window_raised_nonfinite;
  window_closed_by_flush_ = state.window_ready && state.window_closed_by_flush;
  window_optimizer_stepped_ = false;
  // A closed window steps, or is skipped, as it would have been: already
  // unscaled (a retry after a failed optimizer step) or empty everywhere.
  window_unscaled_ = state.window_ready && state.window_unscaled;
  window_clipped_ = state.window_ready && state.window_clipped;
  window_known_finite_ = false;
  window_empty_ = state.window_ready && state.window_empty;
  epoch_ended_ = state.epoch_ended;
  epoch_ended_raised_ = false;
  if (reducer_) {
    reducer_->set_epoch_ended_refusal({});
  }
  // Note [The window's loss across a checkpoint]; the last closed window's
  // loss is not in checkpoints.
  window_loss_sum_ = at::Tensor();
  window_loss_cut_ = state.micro_step > 0;
  // (Saved with other metric names: that window's loss is not known; review:
  // sums were credited to the metrics by position.)
  const bool same_metrics = state.window_metric_names.empty()
      ? state.window_loss_sums.defined() &&
          state.window_loss_sums.numel() == 1 + static_cast<int64_t>(options_.metrics().size())
      : state.window_metric_names == options_.metrics();
  if (state.micro_step > 0 && state.window_loss_sums.defined() && same_metrics) {
    const bool whole_here = !state.rank_independent || rank == 0;
    window_loss_sum_ = whole_here ? state.window_loss_sums.to(params_.front().device(), /*non_blocking=*/false,
                                                              /*copy=*/true)
                                  : at::zeros_like(state.window_loss_sums, at::device(params_.front().device()));
    window_loss_cut_ = false;
  }
  window_shared_ = reducer_ && (state.rank_independent || state.window_shared) && state.micro_step > 0;
  window_forwards_ = state.micro_step > 0;
  window_loss_.set(at::Tensor(), 0);
  window_metrics_ = at::Tensor();
  stats_.micro_steps = state.micro_steps;
  stats_.optimizer_steps = state.optimizer_steps;
  stats_.skipped_steps = state.skipped_steps;
  stats_.windows = state.windows;
  stats_.skipped_micro_batches = state.skipped_micro_batches;
  stats_.last_grad_norm = std::nullopt; // (not in states: not the checkpoint's last window's)
  if (loss_scaler_) {
    loss_scaler_->restore(state.loss_scale, state.loss_scale_growth_tracker);
  }
  if (reducer_) {
    // The last full window's global weight, as it would be on this many ranks.
    const double last_weight = state.reducer_last_weight * static_cast<double>(world) /
        static_cast<double>(state.world_size);
    // Residuals load only from a per-rank state on as many ranks (or start at
    // zero): their window's weight is as saved.
    reducer_->restore({state.reducer, state.reducer_sequence, last_weight,
                       state.residuals.empty() ? 0.0 : state.reducer_residual_weight});
  }
  remember_gradients();
}

} // namespace gradaccum
