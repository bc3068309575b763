// Accumulator::join(): ranks that run out of data at different times.
#include <gradaccum/accumulator.h>

#include "call_guard.h"
#include "comm.h"

#include <string>
#include <utility>

namespace gradaccum {

using detail::CallGuard;

// Note [Joining]
// Ranks may run out of data at different times (uneven shards, by any number
// of windows). A rank that has no more data calls acc.join(): it closes its
// partial window as flush() does, then shadows the others: each of their
// window reductions pairs with one reduction of its own that sends zero
// gradient and zero weight, and it steps its optimizer with the reduced
// gradient as they do, so the replicas and the optimizer states stay
// identical with no broadcast at the end. Its reductions carry kJoined = 1 in
// the header that every bucket sends anyway (Note [Bucket meta layout]), so
// the ranks that still have data learn how many have joined at no extra
// collective (torch's Join all-reduces a flag at every iteration of every
// active rank). Every rank leaves the loop at the same reduction: the first
// whose kJoined sum is the world size, in which the last ranks to join close
// their own partial windows. The divisor is the micro-steps (mean) or items
// that exist: the result is the exact mean of the data, as one process over
// all of it. A window dropped while some ranks shadow it (a failed backward
// anywhere, a disagreement) raises the same error on the shadowing ranks, so
// a rank that stopped early learns before it returns whether the job's last
// windows completed everywhere (and the error tells every rank to end there:
// Note [A window dropped while ranks shadow]). Ranks must all join or all flush(): a rank
// that ends its data with flush() while others are joined would leave them
// waiting; both sides see it in the header (kFlushing > kJoined, or kJoined
// > 0 at a flush) and raise (check_join_partners()).
// Note [Training ended in join()]
// A window dropped while ranks shadow it, or by a rank that left its join()
// block, tells every rank to end training there: the shadows raise out of
// join(), the ranks with data in their next reduction, and no rank sends
// anything more (abandon()). A rank with data that catches that error inside
// its block and goes on would open windows whose reductions pair with the
// others' next epoch, and, at its block's end, shadow them: no error, and
// every later window pairs other micro-batches. So until this rank leaves
// join() (its exception out of the block: abandon(); the block's end:
// join(), which then returns at once; a shadow's error out of join()), its
// micro-steps, no_sync(), flush() and refresh_parameters() are refused,
// changing nothing (check_training_not_ended()), and so is the manual path's
// plain backward, in its first hook (Reducer::State::training_ended(), which
// keeps what was acted on: resuming a checkpoint forgets both). Leaving marks
// the last reduction as acted on, the drop abandon() itself sends too.
// Ranks that all left may go on together: the next epoch pairs.
bool Accumulator::told_to_end_training() const {
  // (The cheap tests first: every micro-step asks.)
  return reducer_ && micro_step_ == 0 && !window_ready_ && !window_failed_ && !parts_open_ &&
      reducer_->told_to_end_training();
}

int64_t Accumulator::join() {
  try {
    return join_in_call();
  } catch (...) {
    if (told_to_end_training()) {
      reducer_->set_end_acted_on(reducer_->last_result().window); // a shadow told inside join(): it has left
    }
    throw;
  }
}

int64_t Accumulator::join_in_call() {
  const CallGuard guard(driver_, driving_, "acc.join()", &call_);
  realign_after_manual_reduction("acc.join()"); // Note [A manual reduction in the middle of a window]
  check_open("acc.join()");
  check_no_open_parts("acc.join()");
  if (!reducer_) {
    return flush_in_call() ? 1 : 0; // one process: nobody to shadow
  }
  if (told_to_end_training()) {
    // Note [Training ended in join()]: the others have left; nobody would
    // pair with this rank's partial window or its shadows.
    reducer_->set_end_acted_on(reducer_->last_result().window);
    return 0;
  }
  TORCH_CHECK(optimizer_step_,
      "gradaccum: acc.join(): this Accumulator has no optimizer (pass one to the constructor)");
  if (window_ready_ && window_closed_by_flush_ && !window_raised_nonfinite_) {
    // Note [Flushing again after its step raised]: the epoch ended already.
    check_gradients_untouched("acc.join()", /*allow_in_place=*/true);
    return finish_window("acc.join()") ? 1 : 0;
  }
  if (!window_ready_ && micro_step_ > 0 && !window_failed_ && grad_versions() != remembered_) {
    // The collective must still run on every rank: drop the window there.
    fail_for_changed_gradients(grad_versions(), /*uncounted=*/false);
  } else if (!window_ready_ && micro_step_ == 0 && !epoch_ended_ && !epoch_ended_raised_) {
    // Where a reduction follows (see flush()): Note [Gradients no micro-step counted].
    refuse_uncounted_gradients("acc.join()", grad_versions());
  }
  std::string local_failure;
  int64_t stepped = step_before_flush(&local_failure) ? 1 : 0;
  const bool raised_ended = std::exchange(epoch_ended_raised_, false);
  if (raised_ended) {
    reducer_->set_epoch_ended_refusal({});
  }
  if (raised_ended && micro_step_ == 0) {
    // This rank raised that it went on training after the others' flush():
    // they have left the epoch, and nobody would pair with a shadow.
    return stepped;
  }
  if (epoch_ended_) {
    // This rank's last window was reduced with other ranks' flush() (not
    // join()): they have left, and nobody would pair with a shadow.
    epoch_ended_ = false;
    TORCH_CHECK(false,
        "gradaccum: acc.join(): other ranks ended their data with acc.flush() in the reduction that closed "
        "this rank's last window, so they will not shadow this rank's reductions. End the data with "
        "acc.join() on every rank (any difference in data), or acc.flush() on every rank (less than "
        "one window of difference)");
  }
  const auto world = reducer_->process_group()->getSize();
  for (;;) {
    const auto window = reducer_->progress().sequence;
    raised_alike_ = false; // set by this shadow window's step only
    try {
      stepped += reduce_partial_window(local_failure, /*joined=*/true) ? 1 : 0;
    } catch (const std::exception& e) {
      if (!reducer_) {
        throw; // close() from the optimizer or a hook in its step (review: a segfault)
      }
      // Reduced on every rank, and some ranks still have data (they go on to
      // their next window): then stepping it failed here.
      const auto last = reducer_->last_result();
      const bool others_go_on = last.window == window && !last.dropped && last.joined_ranks != world &&
          last.flushing_ranks == last.joined_ranks;
      if (std::exchange(raised_alike_, false) && others_go_on) {
        // nonfinite="raise" on the reduced gradient, which every rank holds
        // alike: the ranks with data raise it, and it tells them to drop the
        // window with acc.zero_grad() and go on. The shadow, with no code of
        // the user's to run, does that here (marked as theirs is: Note [A
        // window not stepped on some ranks]) and keeps pairing (leaving would
        // hang their next window; treating it as its own failure would drop
        // that window too, saying the replicas differ, which they do not).
        // In the last reduction (every rank joined) every rank raises it.
        zero_grad_in_call();
        continue;
      }
      // Stepping it failed here only (the optimizer, a hook, the scaler):
      // keep pairing and drop the peers' next window on every rank, naming
      // this failure, as flush() does. Anything else raised alike everywhere.
      if (!others_go_on) {
        throw;
      }
      local_failure = detail::message_of(e);
      reset_window();
      window_failed_ = true;
      window_failure_ = AbortReason::ClosedWindowNotStepped;
      continue;
    }
    local_failure.clear();
    TORCH_CHECK(reducer_, "gradaccum: acc.join(): this Accumulator was closed during its step (the optimizer or a "
        "scheduler called acc.close()?)");
    if (reducer_->last_result().joined_ranks == world) {
      break; // every rank has joined: this was the last reduction everywhere
    }
  }
  return stepped;
}

// Note [Leaving join() with an exception]
// A rank whose data loop raises (its own code, a failed micro-step) leaves
// its `with acc.join():` block without joining; the other ranks would wait
// for it: shadows in their next reduction, ranks with data at their next
// window's end. So leaving with an exception runs that one reduction as a
// drop (AbortReason::LeftJoin): every other rank raises in it, naming this
// rank and telling them to end training (no later window can pair with it),
// and their exceptions leave their own blocks with nothing more to send:
// their last reduction dropped the window on every rank telling every rank
// to end training (a rank had left join(), counted among kAbortReasons, or
// ranks were shadowing, kJoined > 0) and nothing ran since, which is how abandon() tells
// that every rank already knows. A drop that told the ranks "training can go
// on" (a failed backward, a refused micro-batch, nobody in join()) does not
// count: a rank whose exception then leaves its block still sends its drop,
// which pairs with the next reduction of any rank that went on, or with the
// drops of the others that leave too. A rank whose peers ended the epoch with
// flush() has nobody left to pair with. Leaving clears the window's
// gradients, as any drop does, and waits for the peers' next reduction (a
// peer in a collective of the script's own meets a gradient all-reduce).
void Accumulator::abandon() noexcept {
  if (!reducer_ || closed_ || driving_ != nullptr) {
    return; // one process, closed, or inside a call of its own (a hook's exception)
  }
  const auto last = reducer_->last_result();
  // Told to end training and not yet acted on (once it has been, ranks that
  // all left may have gone on together: a rank leaving again sends its drop).
  const bool everyone_knows = told_to_end_training();
  if (everyone_knows) {
    reducer_->set_end_acted_on(last.window); // Note [Training ended in join()]: this rank has left
  }
  if (everyone_knows || epoch_ended_ || epoch_ended_raised_) {
    return;
  }
  try {
    const CallGuard guard(driver_, driving_, "acc.join()", &call_);
    parts_open_ = false;
    auto abort = new_request();
    abort.abort = AbortReason::LeftJoin;
    if (window_ready_) {
      // A closed window left unstepped: marked so, as a shadow marks one it drops.
      zero_grad_in_call("leaving acc.join() with an exception dropped it here once it was closed");
    } else {
      reset_window();
    }
    forget_window_loss();
    try {
      reducer_->reduce(abort); // throws the dropped window's error, as on every rank
    } catch (const std::exception&) {
    }
    reducer_->set_end_acted_on(reducer_->last_result().window); // (its own drop: this rank has left)
    remember_gradients();
  } catch (...) { // (nothing to tell beyond the caller's own exception)
  }
}

void Accumulator::check_join_partners(const ReductionResult& result, bool joining) {
  if (joining && result.flushing_ranks > result.joined_ranks) {
    reset_window();
    forget_window_loss();
    TORCH_CHECK(false,
        "gradaccum: acc.join(): ", result.flushing_ranks - result.joined_ranks, " rank(s) ended their data "
        "with acc.flush() while this rank was in acc.join(), so they will not shadow the remaining "
        "windows; the window was dropped on every rank. End the data with acc.join() on every rank "
        "(any difference in data), or acc.flush() on every rank (less than one window of difference)");
  }
  if (!joining && result.joined_ranks > 0) {
    reset_window();
    forget_window_loss();
    TORCH_CHECK(false,
        "gradaccum: acc.flush(): ", result.joined_ranks, " rank(s) are in acc.join() (out of data, "
        "shadowing the others' windows) and wait for this rank to join too; the window was dropped "
        "on every rank. End this rank's data with acc.join() as well");
  }
}

} // namespace gradaccum
