// Accumulator::flush(): the end of an epoch whose last window is partial,
// closed with its own weight on every rank (Note [Joining] builds on it).
#include <gradaccum/accumulator.h>

#include "call_guard.h"
#include "comm.h"
#include "window_errors.h"

#include <string>
#include <utility>

namespace gradaccum {

using detail::CallGuard;

bool Accumulator::flush() {
  const CallGuard guard(driver_, driving_, "acc.flush()", &call_);
  realign_after_manual_reduction("acc.flush()"); // Note [A manual reduction in the middle of a window]
  check_training_not_ended("acc.flush()", /*flushing=*/true); // (the one-sided flush: its way out)
  return flush_in_call();
}

// (call_: acc.flush(), or acc.join(), which flushes through here.)
bool Accumulator::flush_in_call() {
  check_open("acc.flush()");
  check_no_open_parts("acc.flush()");
  TORCH_CHECK(optimizer_step_,
      "gradaccum: acc.flush(): this Accumulator has no optimizer (pass one to the constructor)");
  if (!window_ready_ && micro_step_ > 0 && !window_failed_) {
    if (reducer_ && grad_versions() != remembered_) {
      // The flush collective must still run on every rank: drop the window there.
      fail_for_changed_gradients(grad_versions(), /*uncounted=*/false);
    } else if (!reducer_) {
      check_gradients_untouched("acc.flush()", /*allow_in_place=*/false);
    }
  } else if (!window_ready_ && micro_step_ == 0 && reducer_ && !epoch_ended_ && !epoch_ended_raised_) {
    // Only where a reduction follows, which then drops the window on every
    // rank; otherwise the next window's first micro-step reads them.
    refuse_uncounted_gradients("acc.flush()", grad_versions());
  }
  if (reducer_ && window_ready_ && window_closed_by_flush_ && !window_raised_nonfinite_) {
    // Note [Flushing again after its step raised]
    // The flush's own step raised (its optimizer, on this rank or every
    // rank) after its reduction had closed the window: called again, it
    // steps that window, as acc.step() would, and runs no collective (the
    // others' flush is over: a second one would pair with their next epoch).
    // So does join() after its last reduction (every rank joined), and
    // either of them after the other; a checkpoint keeps the mark.
    check_gradients_untouched("acc.flush()", /*allow_in_place=*/true);
    return finish_window(call_ ? call_ : "acc.flush()");
  }
  std::string local_failure;
  const bool stepped = step_before_flush(&local_failure);
  if (!reducer_) {
    if (micro_step_ == 0) {
      return stepped;
    }
    close_local_window_loss();
    window_empty_ = window_weight_ == 0;
    scale_local_gradients();
    micro_step_ = 0;
    window_weight_ = 0; // (as a closed window's: a state saved here loads; review)
    window_loss_sum_ = at::Tensor();
    set_window_ready(true);
    window_closed_by_flush_ = true; // (no collective to spare: for the texts, and a state resumed data parallel)
    return finish_window(call_ ? call_ : "acc.flush()");
  }
  if (epoch_ended_) {
    // This rank's last window was already reduced together with the other
    // ranks' flush(): nothing is left, and no collective to pair.
    TORCH_INTERNAL_ASSERT(micro_step_ == 0, "gradaccum: micro-steps after the epoch ended");
    epoch_ended_ = false;
    return stepped;
  }
  const bool raised_ended = std::exchange(epoch_ended_raised_, false);
  if (raised_ended) {
    reducer_->set_epoch_ended_refusal({});
  }
  if (raised_ended && micro_step_ == 0) {
    // This rank raised that it went on training after the others' flush():
    // its epoch ended with theirs; its flush() has nobody to pair with (the
    // error's announcement already paired with their next reduction).
    return stepped;
  }
  const auto window = reducer_->progress().sequence;
  try {
    return reduce_partial_window(local_failure, /*joined=*/false) || stepped;
  } catch (const c10::Error& e) {
    // Every rank flushed in the reduction that dropped the window: the
    // epoch's flush is over everywhere, and a second acc.flush() here (a
    // retry of this one) paired with the others' next window (review).
    const auto last = reducer_ ? reducer_->last_result() : ReductionResult{};
    // (Not where ranks shadowed in join(), or the drop told every rank to end training: review.)
    TORCH_CHECK(!(last.dropped && last.window == window && last.joined_ranks == 0 &&
                  last.flushing_ranks == reducer_->process_group()->getSize() && !reducer_->told_to_end_training() &&
                  call_name() == std::string("acc.flush()")),
        e.what_without_backtrace(), ". Every rank ended its epoch in this acc.flush(): do not call it again for "
        "this epoch (a second one would pair with the other ranks' next window); the next micro-step begins the "
        "next epoch");
    throw;
  }
}

// Note [A non-finite window left for the epoch's end]
// nonfinite="raise" raises in acc.step() on every rank alike (every rank
// holds the same reduced gradient), and the error says to drop the window
// with acc.zero_grad(). A script that catches it and goes on to acc.flush()
// or acc.join() without that reaches them with the window still closed; and
// a script that skips acc.step() at the epoch's last window meets the error
// there first. Raising there, before the flush's collective, is alike on
// every rank only where every rank holds the window and none shadows: the
// ranks already in acc.join() dropped it without a word when it was reduced
// (Note [Joining]) and wait in their next shadow reduction, and so does a
// rank whose script did call acc.zero_grad(). So a window whose error
// acc.step() raised already (in one process too, alike), or one reduced while
// ranks shadowed, is dropped there, as acc.zero_grad() drops it (marked as
// such: Note [A window not stepped on some ranks]), with a warning, and the
// flush's collective runs; only a first raise with nobody shadowing is raised
// there, alike.
bool Accumulator::step_before_flush(std::string* local_failure) {
  if (!window_ready_) {
    return false;
  }
  if (window_raised_nonfinite_ && grad_versions() == remembered_) {
    drop_nonfinite_at_epoch_end(/*raised_before=*/true);
    return false;
  }
  if (!reducer_ || epoch_ended_) {
    check_gradients_untouched("acc.flush()", /*allow_in_place=*/true);
    return finish_window(call_ ? call_ : "acc.flush()");
  }
  // The flush collective after this pairs with the other ranks' whatever happens
  // to this closed window here: a rank that cannot step it (its .grad was
  // replaced, its optimizer raised) drops the flush window on every rank
  // instead of raising alone (the others would wait in the collective).
  // They have stepped theirs by then: the message says the replicas differ.
  raised_alike_ = false;
  const bool as_reduced = grad_versions() == remembered_;
  try {
    check_gradients_untouched("acc.flush()", /*allow_in_place=*/true);
    return finish_window(call_ ? call_ : "acc.flush()");
  } catch (const std::exception& e) {
    if (raised_alike_ && as_reduced) {
      // nonfinite="raise" on the reduced gradient, untouched since: every
      // rank holds the same one and raises here alike, before the collective,
      // unless ranks shadow it (Note [A non-finite window left for the epoch's end]).
      if (reducer_->last_result().joined_ranks == 0) {
        throw;
      }
      drop_nonfinite_at_epoch_end(/*raised_before=*/false);
      return false;
    }
    *local_failure = detail::message_of(e);
    drop_window();
    window_failed_ = true;
    window_failure_ = AbortReason::ClosedWindowNotStepped;
    return false;
  }
}

// Note [A flushed window with no weight]
// A reduction closes a window wherever some rank closes one in it: a full
// window (a closing backward, which flush() and join() pair with), or a
// partial one that holds micro-steps. It may have no weight anywhere (every
// micro-batch left out by "skip_micro_batch", num_items=0): then it steps
// nothing and is counted in skipped_steps, with window_loss None and
// window_items 0, as in one process, and alike on every rank, the ranks that
// only flushed nothing or shadowed it in join() too (kFlushingSteps tells
// them). A reduction in which every rank flushed an empty window closes none:
// the last window's loss stays.
void Accumulator::drop_nonfinite_at_epoch_end(bool raised_before) {
  TORCH_WARN("gradaccum: ", call_name(), ": the closed window's gradient is not finite (nonfinite=\"raise\"",
      raised_before ? "; acc.step() raised it already" : "", "): ", call_name(), " dropped the window, as "
      "acc.zero_grad() would", raised_before ? "" : " and as the ranks in acc.join() did",
      ", so that every rank ends the data together");
  zero_grad_in_call();
}

bool Accumulator::reduce_partial_window(const std::string& local_failure, bool joined) {
  if (window_failed_) {
    auto abort = new_request();
    abort.abort = window_failure_;
    abort.flushing = true;
    abort.joined = joined;
    const auto detail = failure_detail_;
    reset_window();
    forget_window_loss();
    try {
      reducer_->reduce(abort);
    } catch (const c10::Error& e) {
      remember_gradients(); // dropping zeroed the buckets, and with them any .grad views
      TORCH_CHECK(detail.empty(), with_failure_detail(e.what_without_backtrace(), detail));
      TORCH_CHECK(local_failure.empty(), e.what_without_backtrace(), ". The error on this rank, stepping ",
          call_ != nullptr && std::string(call_) == "acc.join()" ? "a window as it joined (its last, or one it shadowed)"
                                                                 : "the closed window before the flush",
          ": ", local_failure);
      throw;
    }
    TORCH_INTERNAL_ASSERT(false, "gradaccum: an aborted reduction returned");
  }
  // A collective even with nothing accumulated here, so that ranks whose data
  // ran out at a window's end still pair with the others.
  auto request = new_request();
  request.weight = window_weight_;
  request.divide = options_.reduction() != Reduction::Sum;
  request.flushing = true;
  request.flushing_steps = micro_step_ > 0;
  request.joined = joined;
  request.check_finite = reducer_checks_finite();
  request.loss_sum = window_loss_sum_;
  const auto window = reducer_->progress().sequence;
  ReductionResult result;
  try {
    result = reducer_->reduce(request);
  } catch (const std::exception& e) {
    const auto loss_sum = window_loss_sum_;
    reset_window();
    const auto last = reducer_->last_result();
    if (last.window == window && !last.dropped) {
      take_reduced_loss(last, loss_sum); // reduced everywhere: the others report it
    } else {
      forget_window_loss();
    }
    // As in reduce_window(): reduced everywhere, dropped here alone.
    TORCH_CHECK(last.window != window || last.dropped || last.written,
        detail::failed_after_reduction(call_name(), reducer_->process_group()->getRank(), last, e));
    throw;
  }
  check_join_partners(result, joined); // Note [Joining]
  // Note [A flushed window with no weight]
  const auto world = reducer_->process_group()->getSize();
  if (result.global_weight == 0 && result.flushing_ranks == world && result.flushing_steps_ranks == 0) {
    reset_window(); // no rank had anything: no window anywhere
    return false;
  }
  window_empty_ = result.global_weight == 0; // (step_optimizer() counts it skipped)
  close_window_loss(result, window_loss_sum_);
  micro_step_ = 0;
  window_weight_ = 0;
  window_loss_sum_ = at::Tensor();
  set_window_ready(true);
  window_closed_by_flush_ = !joined || result.joined_ranks == world; // (the epoch's end everywhere)
  window_known_finite_ = result.known_finite;
  remember_gradients(); // what the reducer checked, as step_window() compares
  return finish_window(call_ ? call_ : "acc.flush()");
}

void Accumulator::fail_after_peers_ended_epoch() {
  // This rank's last window was reduced together with other ranks' flush():
  // for them the epoch is over. Tell them (Note [Dropping a window] in
  // src/reducer/drop.cpp), then say what to do here.
  auto abort = new_request();
  abort.abort = AbortReason::EpochEnded;
  try {
    reducer_->reduce(abort);
  } catch (const std::exception&) {
    // Always throws: the window is dropped everywhere; the error below says why.
  }
  epoch_ended_ = false;
  epoch_ended_raised_ = true;
  // (The manual path's backward too: Note [Training ended in join()].)
  reducer_->set_epoch_ended_refusal(
      "this rank's epoch ended with the other ranks' acc.flush() (this rank went on training after they ended "
      "the epoch); call acc.flush() (it steps nothing and runs no collective) before the next epoch");
  reset_window();
  forget_window_loss();
  TORCH_CHECK(false,
      "gradaccum: ", call_name(), ": other ranks ended the epoch with acc.flush() in the reduction that "
      "closed this rank's last window, but this rank went on training. Every rank must run the "
      "same number of full windows and call acc.flush() at the end of each epoch (this rank's "
      "acc.flush() for this epoch steps nothing and runs no collective, and micro-steps are refused until it "
      "runs; the other ranks learn of this error in their next reduction). The window was dropped on every rank");
}

} // namespace gradaccum
