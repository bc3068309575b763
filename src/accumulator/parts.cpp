// A micro-step in parts: what acc.run() does with a micro-batch that ran out
// of memory; and the micro-steps with no backward of their own: a refused
// micro-batch, and acc.empty_micro_step().
#include <gradaccum/accumulator.h>

#include "call_guard.h"
#include "precision/loss_scaler.h"

#include <gradaccum/detail/failed_backward.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstring>
#include <string>

namespace gradaccum {

using detail::CallGuard;

namespace {

// Out of memory: c10's error, or its text (torch.OutOfMemoryError raised in
// Python code of the backward reaches C++ as a python_error with its message:
// "CUDA out of memory", the CPU allocator's "not enough memory").
bool out_of_memory(const std::exception& e, const std::string& what) {
  return dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr ||
      what.find("out of memory") != std::string::npos || what.find("not enough memory") != std::string::npos;
}

} // namespace

// Note [Micro-steps in parts]
// acc.run() splits a micro-batch that ran out of memory and runs the parts as
// one micro-step: each part's backward accumulates locally (no collective),
// adding its weight (its share of the rows, or its items) and its loss to the
// window, and end_micro_step() counts the micro-step once; at the window's end
// it runs the synchronising reduction (after the backward: such a window's
// all-reduce is not overlapped, the price of not running out of memory).
// Nothing about the split crosses ranks: the window divides by the weight it
// holds, which rides in the header, so one rank may split while its peers do
// not, and no rank ever waits for another's decision (no deadlock).
//
// A part that ran out of memory without changing any .grad did not happen
// (in its forward, or in its backward before any gradient reached .grad): the
// caller runs it again in smaller parts. Any other error that reached no
// .grad is raised as it was, and the caller fails the micro-step with
// end_micro_step(failed=true) (data parallel every rank must still close its
// windows together; one process, parts before it drop the window). One that changed some gradients
// cannot be undone (a float sum is not reversible): the micro-step fails as a
// failed backward() does. Data parallel, a failed micro-step that does not
// close the window counts (every rank closes its windows together) and the
// window is dropped on every rank when it closes; in the closing micro-step the
// window is dropped on every rank at once. One process: the window is dropped.

int64_t Accumulator::progress_marker() const {
  return stats_.micro_steps + (reducer_ ? reducer_->progress().sequence : 0);
}

void Accumulator::check_no_open_parts(const char* what) const {
  TORCH_CHECK(!parts_open_,
      "gradaccum: ", what, ": a micro-step run in parts (acc.backward_part()) is still open; end it with "
      "acc.end_micro_step() first", reducer_ ? "" : " (or drop the window with acc.zero_grad())");
}

void Accumulator::backward_part(const at::Tensor& loss, std::optional<double> num_items,
                                const at::Tensor& reported, double share, const at::Tensor& metrics, const char* call) {
  const CallGuard guard(driver_, driving_, call, &call_);
  realign_after_manual_reduction(call); // Note [A manual reduction in the middle of a window]
  // Every check comes before backward: a rejected call changes nothing.
  double weight = check_micro_step(loss, num_items, call);
  const auto before = grad_versions();
  check_no_inference_grads(call, before);
  window_forwards_ = true; // (a refused part: acc.run() fails the whole micro-step)
  TORCH_CHECK_VALUE(std::isfinite(share) && share > 0 && share <= 1,
      "gradaccum: ", call, ": a part's share of its micro-batch must be in (0, 1], got ", share);
  check_reported(reported, call);
  check_metrics(metrics, call);
  // Mean: the part's loss is a mean over its rows, weighted by their share;
  // sum and items: a sum over its rows, which adds as it is.
  const bool items = options_.reduction() == Reduction::Items;
  const double scale = options_.reduction() == Reduction::Mean ? share : 1.0;
  check_window_gradients(call, before);
  const auto& value = reported.defined() ? reported : loss;
  const bool keep = keep_micro_batch(scale == 1.0 ? value : value.detach() * scale, metrics);
  weight = !keep ? 0 : items ? weight : share;
  at::Tensor scaled;
  if (keep) {
    scaled = scale == 1.0 ? loss : loss * scale;
    if (loss_scaler_) {
      scaled = loss_scaler_->scale_loss(scaled, options_.steps());
    }
  }
  const auto hooks = reducer_ ? reducer_->hook_calls() : 0;
  try {
    NoSync local(reducer_.get(), /*counted=*/true);
    if (scaled.defined()) {
      scaled.backward();
    }
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    const auto original = std::current_exception();
    const auto facts = detail::inspect_error(original);
    const std::string what = detail::named_message(error ? error->what_without_backtrace() : e.what(), facts);
    const bool oom = out_of_memory(e, what);
    if (grad_versions() == before) {
      throw; // nothing reached .grad: the caller runs it again smaller, or fails it (end_micro_step)
    }
    bool dropped_now = false;
    try {
      fail_micro_step(oom               ? AbortReason::OutOfMemory
                          : facts.interrupt ? AbortReason::Interrupted // Note [An interrupt tells every rank to end]
                                            : AbortReason::BackwardFailed);
    } catch (const c10::Error&) {
      // Data parallel in the closing micro-step: dropped on every rank now;
      // the others' error names this rank, this rank's says what happened.
      dropped_now = true;
    }
    // Note [An interrupt in a synchronising backward]: where nothing was
    // dropped on every rank yet, the script's own error stays itself (as a
    // failed no_sync acc.backward()'s does), this text its note (from Python).
    // (Not an out-of-memory: acc.run() would take it for one that reached no .grad.)
    detail::keep_failed_backward(original, /*raise_original=*/!dropped_now && !oom);
    TORCH_CHECK(false, "gradaccum: ", call, ": a part of the micro-batch failed in its backward after some of its "
        "gradient had reached .grad, which cannot be undone: ",
        !reducer_ ? "the window was dropped" : dropped_now ? "the window was dropped on every rank"
                                                          : "the window will be dropped on every rank when it closes",
        ". The error: ", what);
  } catch (...) {
    if (grad_versions() != before) {
      fail_micro_step(AbortReason::BackwardFailed);
    }
    throw;
  }
  note_hookless_backward(hooks, before);
  if (!parts_open_) {
    parts_open_ = true;
    parts_weight_ = 0;
    parts_skipped_ = false;
  }
  parts_weight_ += weight;
  parts_skipped_ = parts_skipped_ || !keep;
  window_loss_sum_ = pending_loss_sum_;
  accumulate_wide();
  remember_gradients();
}

void Accumulator::end_micro_step(bool failed, bool out_of_memory, const char* call, bool interrupted) {
  const CallGuard guard(driver_, driving_, call, &call_);
  realign_after_manual_reduction(); // Note [A manual reduction in the middle of a window]
  check_open(call);
  if (failed) {
    if (!parts_open_) {
      // A micro-step that takes its place must be one that could run (a
      // closed window is not counted into).
      check_micro_step_state(call);
      // As a micro-step that ran would: the others may have ended the epoch
      // (then this raises the one-sided error, as acc.backward() does).
      check_window_gradients(call, grad_versions());
    }
    // Data parallel the failed micro-step takes its place even with nothing
    // of it in .grad, so that every rank closes its windows together.
    if (parts_open_ || reducer_) {
      fail_micro_step(out_of_memory ? AbortReason::OutOfMemory
                          : interrupted ? AbortReason::Interrupted // Note [An interrupt tells every rank to end]
                                        : AbortReason::BackwardFailed);
    }
    return;
  }
  TORCH_CHECK(parts_open_,
      "gradaccum: ", call, ": no micro-step in parts is open to end (call acc.backward_part() first; "
      "acc.end_micro_step(failed=true) fails a micro-step that has none)");
  parts_open_ = false;
  // Mean and sum: a micro-batch whose parts all count weighs exactly 1 (the
  // shares' float sum may not be); a part left out takes its share with it.
  const bool whole = options_.reduction() != Reduction::Items && !parts_skipped_;
  window_weight_ += whole ? 1.0 : parts_weight_;
  if (!closes_window_next()) {
    ++micro_step_;
    ++stats_.micro_steps;
    return;
  }
  // The parts' weight and loss are in the window now: the closing reduction
  // adds nothing of its own.
  pending_loss_sum_ = window_loss_sum_;
  refuse_closing_in_no_sync(call);
  close_window(at::Tensor(), 0, grad_versions());
}

void Accumulator::fail_micro_step(AbortReason why) {
  parts_open_ = false;
  if (!reducer_) {
    reset_window(); // part of the micro-batch reached .grad: the window is wrong
    return;
  }
  if (!window_failed_) {
    window_failed_ = true;
    window_failure_ = why;
    reducer_->mark_window_failed(why); // (should a plain backward close it)
  }
  if (closes_window_next()) {
    // The others wait in this window's reduction: drop it there now.
    reduce_window(at::Tensor(), 0);
    TORCH_INTERNAL_ASSERT(false, "gradaccum: a failed window's reduction returned");
  }
  ++micro_step_;
  ++stats_.micro_steps;
  remember_gradients();
}

// Note [A refused closing micro-batch]
// A rejected call changes nothing, except where that would leave other ranks
// waiting: data parallel, the other ranks' closing backward has launched (or
// will launch) the window's buckets, and a rank that refuses its closing
// micro-batch (a loss that does not require grad for an empty batch, a NaN
// num_items) would launch none. So it drops the window instead, as a failed
// micro-step does (Note [Dropping a window]): every rank raises, naming this
// rank and why (AbortReason::MicroBatchRefused), and every rank goes on from
// the next window alike. A parameter unfrozen without refresh_parameters()
// (check_requires_grad) counts as a refusal too: it may be so on one rank only.
// Checks of the call itself (a closed window, a closed Accumulator) reject
// alike on every rank and drop nothing; nor does a refusal before the
// closing micro-step, where nobody waits. (no_sync() is this rank's own
// state: Note [The closing micro-step inside no_sync()].)
std::string Accumulator::refuse_micro_batch(const char* call, bool interrupted) {
  const CallGuard guard(driver_, driving_, call, &call_);
  realign_after_manual_reduction(call); // Note [A manual reduction in the middle of a window]
  return drop_refused_window(call, interrupted);
}

// `interrupted`: the checks were interrupted (a KeyboardInterrupt from
// Python's), which tells every rank to end training (Note [An interrupt
// tells every rank to end]) instead of going on.
std::string Accumulator::drop_refused_window(const char* call, bool interrupted) {
  if (epoch_ended_raised_ || told_to_end_training()) {
    // No micro-step may run here at all: that error first (changing nothing,
    // with no drop and no hint to run the micro-step again).
    check_micro_step_state(call);
  }
  const bool peers = reducer_ && reducer_->process_group()->getSize() > 1 && !closed_ && !window_ready_ && !parts_open_;
  if (peers && interrupted && !closes_window_next()) {
    // An interrupt stops this rank: the window is dropped on every rank when
    // it closes, which tells every rank to end (review: a script that caught
    // it went on one micro-step behind, with nothing said).
    fail_micro_step(AbortReason::Interrupted);
    return "this rank was interrupted: the window is dropped on every rank when it closes";
  }
  if (!peers || !closes_window_next()) {
    // Nothing changed. Data parallel, a script that skips the micro-batch
    // would close this rank's windows one micro-step after the others' from
    // here on, silently (acc.run() fails such a micro-step in its place).
    return peers && std::strcmp(call, "acc.run()") != 0
        ? "this micro-step was not counted: run it again with a valid loss, or call acc.empty_micro_step() in "
          "its place, so that this rank's windows stay aligned with the other ranks'"
        : std::string();
  }
  try {
    // As a micro-step that ran would: the others may have ended the epoch.
    check_window_gradients(call, grad_versions());
    fail_micro_step(interrupted ? AbortReason::Interrupted : AbortReason::MicroBatchRefused);
  } catch (const c10::Error& e) {
    // "gradaccum: <call>: window N was dropped…": the caller's error names the call.
    auto text = e.msg();
    const auto prefix = std::string("gradaccum: ") + call + ": ";
    if (text.compare(0, prefix.size(), prefix) == 0) {
      text.erase(0, prefix.size());
    }
    return text;
  }
  TORCH_INTERNAL_ASSERT(false, "gradaccum: ", call, ": a refused window's reduction returned");
  return {};
}

// Note [The closing micro-step inside no_sync()]
// acc.backward() (acc.run(), acc.empty_micro_step()) decides by itself which
// micro-step synchronises: the window's last. Inside acc.no_sync() before it,
// it runs as it would outside (no collective either way). At the closing
// micro-step it is refused, as a refused micro-batch: no_sync() is this
// rank's own state, so the other ranks may be reducing the window (they do
// not use no_sync() there) or refusing it too (they do): either way each
// rank drops the window (Note [A refused closing micro-batch]) and the drops
// pair with the others' reduction or with each other. So every rank raises,
// this one saying why, and every rank goes on from the next window alike.
// (Raising here alone left the others to reduce this window with this rank's
// next one: its micro-batch lost, its windows shifted, silently.)
void Accumulator::refuse_closing_in_no_sync(const char* call) {
  if (!reducer_ || reducer_->expect_hooks() || window_ready_ || !closes_window_next()) {
    return;
  }
  const auto message = c10::str("gradaccum: ", call, ": called inside acc.no_sync() at the window's closing "
      "micro-step. ", call, " decides by itself which micro-step synchronises (the window's last); acc.no_sync() "
      "is for the manual path (a plain loss.backward() inside it)");
  const auto dropped = drop_refused_window(call);
  TORCH_CHECK(dropped.empty(), message, "; ", dropped);
  TORCH_CHECK(false, message);
}

void Accumulator::empty_micro_step() {
  const char* call = "acc.empty_micro_step()";
  const CallGuard guard(driver_, driving_, call, &call_);
  realign_after_manual_reduction(call); // Note [A manual reduction in the middle of a window]
  check_no_open_parts(call);
  check_micro_step_state(call);
  refuse_closing_in_no_sync(call);
  const auto before = grad_versions();
  try {
    check_no_inference_grads(call, before);
  } catch (const c10::Error& e) { // as a refused micro-batch (Note [A refused closing micro-batch])
    const auto dropped = drop_refused_window(call);
    if (dropped.empty()) {
      throw;
    }
    TORCH_CHECK(false, e.msg(), "; ", dropped);
  }
  check_window_gradients(call, before);
  // As a micro-batch nonfinite="skip_micro_batch" leaves out, but not counted
  // as one: weight 0, no backward, the window's loss and metrics unchanged.
  pending_loss_sum_ = window_loss_sum_;
  if (!closes_window_next()) {
    local_micro_step(at::Tensor(), 0, before);
    return;
  }
  close_window(at::Tensor(), 0, before);
}

} // namespace gradaccum
