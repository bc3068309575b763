// Dropping a window on every rank, and ending a reduction either way.

#include "reducer/state.h"

#include "comm.h"
#include "consensus/agreement.h"
#include "consensus/window_header.h"

#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>

// Note [Dropping a window]
// When a rank cannot contribute its window (its backward raised, it went on
// past the end of an epoch that others ended with flush(), its reducer was
// destroyed mid-backward), it completes the pairing anyway: it launches its
// remaining buckets with kAbort = 1 (and its rank and the reason), and waits
// for all of them. Every rank reads the summed header of the last bucket; a
// non-zero abort count makes every rank drop the window alike: gradients
// cleared, no optimizer step, the same error raised everywhere, and training
// can go on from the next window with every replica still identical. The same
// happens when the ranks disagree on what must be equal (Note [What ranks
// agree on]): every rank sees the same sums, so every rank decides alike.
// Dropping must not throw (it runs while an error unwinds): what it cannot
// word for want of memory it leaves out (the error then reads kUnworded), and
// it still completes the pairing and ends the window.

namespace gradaccum {

void Reducer::State::abort_reduction(AbortReason reason) noexcept {
  // See Note [Dropping a window]. Runs from a failed task's guard (in the
  // engine, during unwinding) or from backward()/reduce(): never throws.
  window.request.abort = reason;
  window.aborted_here = true;
  window.own_reason = reason;
  window.own_transport.clear();
  window.other_aborters = 0;
  window.other_aborter = -1;
  try {
    window.own_where = where();
  } catch (...) { // out of memory: the pairing below matters more than the words
    window.own_where.clear();
  }
  window.last_result = ReductionResult{};
  window.last_result.window = window.sequence;
  window.last_result.dropped = true;
  try {
    launch_rest();
    wait_all();
    // Whether others were flushing still matters to this rank's epoch.
    const auto& header = buckets.all.back().read_meta();
    window.last_result.flushing_ranks = static_cast<int64_t>(std::llround(header[kFlushing]));
    window.last_result.flushing_steps_ranks = static_cast<int64_t>(std::llround(header[kFlushingSteps]));
    window.last_result.joined_ranks = static_cast<int64_t>(std::llround(header[kJoined]));
    const auto who = detail::read_aborters(header, config.world);
    window.last_result.left_ranks = who.of(AbortReason::LeftJoin);
    window.last_result.unstepped_ranks = who.of(AbortReason::ClosedWindowNotStepped);
    window.last_result.interrupted_ranks = who.of(AbortReason::Interrupted);
    window.other_aborters = std::max<int64_t>(who.count - 1, 0);
    if (who.count == 2) {
      window.other_aborter = who.ranks[0] == config.rank ? who.ranks[1] : who.ranks[0];
    }
  } catch (const std::exception& e) {
    try {
      window.own_transport = detail::message_of(e);
    } catch (...) {
    }
  } catch (...) {
  }
  try {
    const auto text = own_failure("");
    window.failure.assign(text); // (a copy, not a move: the reserved buffer stays)
  } catch (...) {
    try {
      window.failure.assign(detail::kUnworded); // (within the capacity reserved for it, as a rule)
    } catch (...) {
      window.failure.clear();
    }
  }
  end_dropped_window();
}

std::string Reducer::State::own_failure(const std::string& local) const {
  // What failed here was often raised by this very reduction: name the call
  // and the window once. A failure complete_buckets() worded already (a
  // gradient it could not take, met at the end of backward) is raised again
  // by the backward it ended: as it is.
  const auto worded = window.own_where + " was dropped on every rank";
  if (local.compare(0, worded.size(), worded) == 0) {
    return local;
  }
  auto cause = local;
  const auto prefix = window.own_where + ": ";
  if (cause.compare(0, prefix.size(), prefix) == 0) {
    cause.erase(0, prefix.size());
  }
  return detail::dropped_here(window.own_where, config.rank, window.own_reason, cause, window.own_transport,
                              window.last_result.joined_ranks, window.last_result.left_ranks,
                              window.last_result.unstepped_ranks, window.last_result.interrupted_ranks,
                              window.other_aborters, window.other_aborter, config.world);
}

void Reducer::State::fail(const std::string& message) {
  // Every collective of this reduction has completed (or the group is broken):
  // the pairing is over, so the window can be dropped and the error raised.
  end_failed_window();
  window.failure = message; // (after: the window ends even if this cannot be kept)
  TORCH_CHECK(false, message);
}

void Reducer::State::end_failed_window() noexcept {
  if (window.last_result.window != window.sequence) {
    window.last_result = ReductionResult{}; // nothing was read from this reduction
  }
  window.last_result.window = window.sequence;
  window.last_result.dropped = true;
  end_dropped_window();
}

void Reducer::State::end_dropped_window() noexcept {
  // The pairing is over on this rank: clear the window and count it.
  try {
    drop_window();
  } catch (...) {
  }
  ++stats.windows;
  ++stats.dropped_windows;
  if (window.entry == detail::Entry::ManualBackward) { // (Note [A manual reduction in the middle of a window])
    manual_dropped_at.store(manual_reductions.load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
  end_reduction(/*window_closed=*/true);
}

void Reducer::State::drop_window() {
  at::NoGradGuard no_grad;
  for (auto& times : window.timeline.buckets) {
    times.written = -1; // (Note [Writing back while the last buckets reduce]: undone)
  }
  // A refresh's check holds no window (Note [A refresh pairs like a window]):
  // its buckets were zeros at a boundary, and may now hold a peer's window;
  // zeroed again, they are as they were. .grad and the residual (the last
  // stepped window's) stay.
  const bool refresh = window.entry == detail::Entry::Refresh;
  if (!refresh) {
    window.residual_rescale = at::Tensor(); // (the residuals are zeroed below)
  }
  for (auto& bucket : buckets.all) {
    bucket.gradients.zero_();
    if (refresh) {
      continue;
    }
    if (bucket.residual.defined()) {
      bucket.residual.zero_(); // it holds part of the dropped window (or was held back through it)
    }
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = config.params[bucket.params[slot]].mutable_grad();
      if (!config.options.gradient_as_bucket_view()) {
        grad = at::Tensor();
      } else {
        detail::repoint(grad, bucket.views[slot]);
      }
    }
  }
  clear_touched();
}

void Reducer::State::end_reduction(bool window_closed) {
  TORCH_INTERNAL_ASSERT(window.in_flight, "gradaccum: ending a reduction that is not in flight");
  ++window.sequence;
  stats.last_window_launched_in_backward = static_cast<int64_t>(window.early_launches);
  stats.launched_in_backward += static_cast<int64_t>(window.early_launches);
  for (auto& bucket : buckets.all) {
    bucket.works.clear();
  }
  window.timeline.finished = window.elapsed();
  window.last_timeline = std::move(window.timeline);
  window.last_completed = std::move(window.completed);
  window.timeline = WindowTimeline{};
  window.completed.clear();
  window.early_failure = nullptr; // (raised already, or moot: the window is over)
  if (window_closed) {
    clear_touched();
  }
  window.in_flight = false;
  window.last_anchor_task = window.anchor_task;
  window.anchor_task = -1;
}

} // namespace gradaccum
