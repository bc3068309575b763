// The end of a window: the gradient hook, unscaling, the non-finite check,
// clipping, the optimizer and scheduler step, and clearing the gradients; or
// dropping it (zero_grad()).
#include <gradaccum/accumulator.h>

#include "precision/wide_sums.h"

#include "call_guard.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/irange.h>

#include <cmath>
#include <string>

namespace gradaccum {

using detail::CallGuard;

namespace {

// Norms of half-precision gradients in float32 (fp16 squares overflow long
// before the gradient does); full-precision ones as clip_grad_norm_ does.
std::optional<at::ScalarType> norm_dtype(const std::vector<at::Tensor>& grads) {
  bool narrow = false, wide = false;
  for (const auto& g : grads) {
    narrow = narrow || g.element_size() < 4;
    wide = wide || g.scalar_type() == at::kDouble;
  }
  if (!narrow) {
    return std::nullopt;
  }
  return wide ? at::kDouble : at::kFloat;
}

} // namespace

bool Accumulator::step() {
  const CallGuard guard(driver_, driving_, "acc.step()");
  realign_after_manual_reduction("acc.step()"); // Note [A manual reduction in the middle of a window]
  check_open("acc.step()");
  check_no_open_parts("acc.step()");
  TORCH_CHECK(optimizer_step_,
      "gradaccum: acc.step(): this Accumulator has no optimizer (pass one to the constructor; "
      "without one, acc.backward() leaves the window's gradient in .grad)");
  if (!window_ready_) {
    if (micro_step_ == 0) {
      if (reducer_) { // (after the manual path's window, whose backward a conversion leaves unreduced)
        reducer_->check_hooks_reach("acc.step()");
      }
      check_no_uncounted_backward("acc.step()");
    }
    return false;
  }
  if (!window_optimizer_stepped_) { // (else only the scheduler is left to run)
    check_gradients_untouched("acc.step()", /*allow_in_place=*/true); // clipping in place is fine
  }
  return finish_window("acc.step()");
}

bool Accumulator::finish_window(const char* call) {
  if (!window_optimizer_stepped_ && !window_empty_) {
    check_optimizer_parameters(call); // Note [Parameters only the optimizer steps]
  }
  // A retry of step() after a failure past the unscale: the scaler already
  // unscaled this window's gradient and closed its window (see below).
  const bool retry = window_unscaled_;
  const bool empty = window_empty_; // skipped before any callback: none closes
  before_step_ran_ = false;
  raised_alike_ = false;
  bool stepped = false;
  try {
    stepped = step_window(call);
  } catch (...) {
    // The optimizer step, nonfinite="raise" or the callback itself raised
    // after before_step_ (GradScaler.unscale_()) ran: after_window_
    // (GradScaler.update()) must still close the scaler's window, or every
    // later window's unscale_() fails; the window stays closed, unscaled, and
    // a retry of step() must not unscale it again. The original error is the
    // one to see. Where before_step_ itself raised (window_unscaled_ is set
    // once it returns), the gradient may be unscaled in part, or by the
    // script's own scaler.unscale_() (review: a retry unscaled it again and
    // updated the scale twice): no retry may step it (step_optimizer()).
    if (before_step_ran_ && !retry && !window_unscaled_ && (loss_scaler_ || options_.external_loss_scaler())) {
      window_scaler_failed_ = true;
    }
    if (after_window_ && before_step_ran_ && !retry) {
      try {
        after_window_();
      } catch (...) {
      }
    }
    throw;
  }
  if (after_window_ && !retry && !empty) {
    try {
      after_window_(); // once per closed window, stepped or skipped
    } catch (...) {
      // GradScaler.update() raised after the step (review): this rank's
      // scale may now differ from the others', which would weigh the ranks'
      // gradients unequally: the next reduction tells every rank (Note [A
      // window not stepped on some ranks], as for a scheduler that raised).
      if (reducer_) {
        try {
          reducer_->mark_unstepped("its optimizer stepped it, but its loss scaler's update() raised after, so its "
                                   "loss scale may differ from the other ranks'");
        } catch (...) {
        }
      }
      throw;
    }
  }
  return stepped;
}

void Accumulator::clear_gradients() {
  if (reducer_) {
    reducer_->zero_grad();
    return;
  }
  if (wide_) {
    wide_->clear();
  }
  for (auto& p : params_) {
    p.mutable_grad() = at::Tensor();
  }
}

// Note [Dropping the middle of a window]
// acc.zero_grad() in the middle of a window drops what this rank accumulated
// so far. In one process it drops the position too: the next micro-step opens
// a new window. Data parallel the position stays: the window still closes at
// its K-th micro-step, with every rank, and holds what every rank kept (its
// weight counts only those micro-steps, as for micro-batches left out). A
// rank that reset its position alone (a script that catches a failed
// micro-step on the rank where it failed and drops the window there) would
// start its windows later than the others from then on, and every later
// window would pair micro-batches of other positions, silently; and ranks
// cannot tell a reset alone from a reset everywhere without a collective.
// So the failed micro-step's window is not dropped on every rank either: the
// drop cleared it (window_failed_ with it). Two cases cannot keep their
// place that way: a micro-step open in parts (acc.backward_part()), which
// the other ranks count, is refused (end it first, failed if need be); and a
// window resumed in its middle from a rank-independent state, where each
// rank holds 1/W of every rank's sums so far: dropping one rank's copy would
// weigh the others' micro-batches by less than one, so the window is marked
// failed and dropped on every rank when it closes. acc.restart_window() drops the
// position as well, for callers that know every rank calls it at the same
// point (Lightning's strategy at an epoch cut short in the middle of a
// window).
void Accumulator::zero_grad() {
  const CallGuard guard(driver_, driving_, "acc.zero_grad()");
  realign_after_manual_reduction(); // Note [A manual reduction in the middle of a window]
  check_open("acc.zero_grad()"); // the gradients may be another Accumulator's now
  if (micro_step_ > 0 && !window_ready_ && !window_failed_ && !parts_open_) {
    // (review: acc.zero_grad() where a plain loop had optimizer.zero_grad()
    // trained on one micro-batch in K, or never stepped, with nothing said)
    // (A failed micro-step that reached no .grad is not counted in one
    // process: after one, this may warn too; the text allows for it.)
    TORCH_WARN_ONCE("gradaccum: acc.zero_grad(): dropped the ", micro_step_, " micro-step(s) this window had "
        "accumulated. acc.zero_grad() drops the window (after a failed micro-step, say); it is not "
        "optimizer.zero_grad(): acc.step() clears the gradients itself after each window, so a training loop "
        "needs no zero_grad() (one before every acc.backward() leaves each window its last micro-batch). Warned "
        "once");
  }
  if (!reducer_ || window_ready_ || (micro_step_ == 0 && !parts_open_)) {
    zero_grad_in_call();
    return;
  }
  // Note [Dropping the middle of a window]: data parallel, the position stays.
  TORCH_CHECK(!parts_open_,
      "gradaccum: acc.zero_grad(): a micro-step run in parts (acc.backward_part()) is still open; end it first "
      "with acc.end_micro_step() (failed: the micro-batch is dropped and keeps its place, as the other ranks "
      "count it), then drop the window's part here");
  const auto position = micro_step_;
  const bool cut = window_loss_cut_;
  const bool shared = window_shared_;
  const bool forwards = window_forwards_;
  zero_grad_in_call();
  micro_step_ = position;
  window_forwards_ = forwards; // (their forwards moved the buffers all the same)
  window_loss_cut_ = cut; // (the window's first part, before a resume, is still not in its loss)
  if (shared) {
    // Each rank held a share of every rank's sums: a part of them cannot go.
    window_failed_ = true;
    window_failure_ = AbortReason::GradientsChanged;
    reducer_->mark_window_failed(window_failure_); // (should a plain backward close it)
  }
}

void Accumulator::restart_window() {
  const CallGuard guard(driver_, driving_, "acc.restart_window()");
  realign_after_manual_reduction(); // Note [A manual reduction in the middle of a window]
  check_open("acc.restart_window()");
  const bool forwards = window_forwards_ && (micro_step_ > 0 || parts_open_);
  zero_grad_in_call(); // and the position (every rank alike: see the header)
  window_forwards_ = forwards; // (their forwards moved the buffers all the same)
}

// `why`: what dropped a closed window here, for the others' error.
void Accumulator::zero_grad_in_call(const char* why) {
  if (window_ready_ && reducer_ && !window_empty_) {
    // A reduced window that other ranks may step (their schedulers too):
    // Note [A window not stepped on some ranks] (src/consensus/window_header.cpp).
    reducer_->mark_unstepped(window_optimizer_stepped_
        ? "its optimizer stepped it, but its scheduler raised and acc.zero_grad() dropped the window here"
        : why);
  }
  drop_window();
}

void Accumulator::drop_window() {
  // Drops the window; a pending end of epoch (epoch_ended_) stays: it is
  // about where the other ranks are, not about this window's gradients.
  // A window with no weight anywhere rounded nothing: every rank held its
  // residual back (Note [Error feedback across window weights]), and keeps it.
  const bool held_back = window_empty_ && options_.reduction() != Reduction::Sum;
  if (window_ready_ && reducer_ && options_.error_feedback() && !window_optimizer_stepped_ && !held_back) {
    // A reduced window thrown away (skipped, or dropped by the user after
    // nonfinite="raise"): what rounding it lost belongs to it alone (a
    // residual held back through it, at weight 0 here, goes with it: one
    // window's rounding, as without error feedback).
    reducer_->discard_residuals();
  }
  reset_window();
}

void Accumulator::rescale_residuals(const at::Tensor& ratio) {
  check_open("acc.rescale_residuals()");
  TORCH_CHECK_VALUE(ratio.defined() && ratio.numel() == 1 && at::isFloatingType(ratio.scalar_type()),
      "gradaccum: acc.rescale_residuals(): the ratio must be a one-element floating-point tensor, got ",
      !ratio.defined() ? std::string("an undefined one")
                       : std::string("a ") + c10::toString(ratio.scalar_type()) + " tensor of " +
                             std::to_string(ratio.numel()) + (ratio.numel() == 1 ? " element" : " elements"));
  if (reducer_) { // (one process keeps no residual)
    reducer_->rescale_residuals(ratio);
  }
}

// Note [The reducer checks the window's gradient]
// The non-finite test (nonfinite "skip" or "raise", no clipping) needs only to
// know whether the window's total norm is finite, and data parallel the
// reducer writes every reduced gradient back in one pass anyway: asked with
// ReductionRequest::check_finite, it checks each value in that pass
// (detail::write_checked) and answers known_finite only when every value is
// finite and small enough that the norm cannot overflow. Then step_window()
// skips the norm (no pass over the gradients, no host synchronisation of its
// own), which would have been finite: the decision is the one the norm gives,
// on every rank alike. Anything else (clipping, a loss scaler or before_step
// that rewrites the gradients, a gradient changed in place or replaced since
// the reduction, which the versions remembered then tell, an unchecked dtype
// or device, a value that failed) takes the norm, as before, so the skip,
// raise and ignore behaviours and their messages are unchanged.
bool Accumulator::reducer_checks_finite() const {
  return !options_.max_grad_norm() && options_.nonfinite() != NonFinite::Ignore && !before_step_;
}

bool Accumulator::step_window(const char* call) {
  // The optimizer's state (momentum, Adam's moments), made at its first
  // step, must not be inference tensors: acc.step() inside an evaluation's
  // torch.inference_mode() steps with it off (review: every later step on
  // that rank failed).
  const c10::InferenceMode not_inference(/*enabled=*/false);
  // A retry after the scheduler raised: the optimizer stepped this window.
  if (!window_optimizer_stepped_ && !step_optimizer(call)) {
    return false;
  }
  if (scheduler_step_) {
    scheduler_step_();
  }
  reset_window(); // the window was used: its error-feedback residual carries on
  return true;
}

void Accumulator::mark_skipped() {
  // Decided on the reduced window, alike on every rank, unless a rank could
  // not reach the decision (its acc.step() raised before it) and dropped the
  // window instead: neither stepped, and the two marks keep the count whole.
  if (reducer_) {
    reducer_->mark_unstepped("acc.step() skipped it here: a loss scaler's overflow or a non-finite gradient");
  }
}

bool Accumulator::step_optimizer(const char* call) {
  for (const auto i : c10::irange(params_.size())) {
    TORCH_CHECK(!params_[i].grad().defined() || !params_[i].grad().is_sparse(),
        "gradaccum: ", call, ": ", names_[i], " has a sparse gradient (nn.Embedding(sparse=True), or F.embedding(..., sparse=True)?); gradaccum "
        "supports dense gradients only: use sparse=False");
  }
  TORCH_CHECK(!window_scaler_failed_,
      "gradaccum: ", call, ": the loss scaler's unscale of this window raised (that error said why), so its "
      "gradient may be unscaled in part or not at all: stepping it could apply it at the wrong scale. Drop the "
      "window with acc.zero_grad() (data parallel: where other ranks stepped it, the next reduction tells every "
      "rank that the replicas differ)");
  if (window_empty_) {
    // No micro-batch kept and no item on any rank (the same on every rank):
    // nothing to step.
    ++stats_.skipped_steps;
    ++stats_.windows;
    stats_.last_grad_norm = std::nullopt; // (not the previous window's)
    drop_window();
    return false;
  }
  if (!window_unscaled_) {
    before_step_ran_ = static_cast<bool>(before_step_);
    if (before_step_ && !before_step_()) { // Note [One loss scaler path]
      ++stats_.skipped_steps; // e.g. a loss scaler found an overflow: it backs off
      ++stats_.windows;
      stats_.last_grad_norm = std::nullopt; // (not the previous window's)
      mark_skipped();
      drop_window();
      return false;
    }
    window_unscaled_ = true; // until the window ends: see finish_window()
  }
  const auto max_norm = options_.max_grad_norm();
  const auto nonfinite = options_.nonfinite();
  // See Note [The reducer checks the window's gradient].
  const bool known_finite = !max_norm && window_known_finite_ && grad_versions() == remembered_;
  if (window_clipped_) {
    // A retry after the optimizer raised: the gradient was clipped in place
    // from a finite norm (in stats already); clipping again would scale it by
    // max_norm / (norm + 1e-6) once more, on this rank only.
  } else if (known_finite) {
    stats_.last_grad_norm = std::nullopt; // finite: not computed
  } else if (max_norm || nonfinite != NonFinite::Ignore) {
    // As torch.nn.utils.clip_grad_norm_ computes it, so the two agree bit for bit.
    auto grads = defined_grads();
    at::NoGradGuard no_grad;
    at::Tensor total = grads.empty()
        ? at::zeros({}, at::kFloat)
        : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2.0, norm_dtype(grads))), 2.0);
    const double norm = total.item<double>();
    stats_.last_grad_norm = norm;
    if (!std::isfinite(norm) && nonfinite != NonFinite::Ignore) {
      raised_alike_ = nonfinite == NonFinite::Raise; // every rank holds this gradient
      window_raised_nonfinite_ = raised_alike_;
      TORCH_CHECK(nonfinite != NonFinite::Raise,
          "gradaccum: ", call, ": the window's gradient is not finite (total norm ",
          std::isnan(norm) ? std::string("nan") : std::to_string(norm),
          "); gradients left in .grad for inspection, call acc.zero_grad() to drop the window");
      ++stats_.skipped_steps;
      ++stats_.windows;
      mark_skipped();
      drop_window();
      return false;
    }
    if (max_norm && !grads.empty()) {
      auto coefficient = at::clamp(*max_norm / (total + 1e-6), c10::nullopt, 1.0);
      at::_foreach_mul_(grads, coefficient);
    }
    window_clipped_ = max_norm.has_value();
  }
  optimizer_step_();
  window_optimizer_stepped_ = true;
  window_raised_nonfinite_ = false; // (mended and stepped after a raise: not a skipped window)
  ++stats_.optimizer_steps;
  ++stats_.windows;
  return true;
}

WindowTimeline Accumulator::last_window_timeline() const {
  const std::lock_guard<std::mutex> lock(reducer_readers_);
  return reducer_ ? reducer_->last_timeline() : WindowTimeline{};
}

} // namespace gradaccum
