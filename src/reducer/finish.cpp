#include "reducer/state.h"

#include <gradaccum/detail/checked_write.h>

#include <algorithm>
#include <cmath>

namespace gradaccum {

// Note [Dropping a window]
// When a rank cannot contribute its window (its backward raised, it went on
// past the end of an epoch that others ended with flush(), its reducer was
// destroyed mid-backward), it completes the pairing anyway: it launches its
// remaining buckets with kAbort = 1 (and its rank and the reason), and waits
// for all of them. Every rank reads the summed header of the last bucket; a
// non-zero abort count makes every rank drop the window alike: gradients
// cleared, no optimizer step, the same error raised everywhere, and training
// can go on from the next window with every replica still identical. The same
// happens when the ranks disagree on what must be equal (Note [Bucket meta
// layout]): every rank sees the same sums, so every rank decides alike.
//

ReductionResult Reducer::State::finish_reduction(std::vector<at::Tensor>* snapshot) {
  // Phase 1, before the last launch: anything that fails here is this rank's
  // alone, and is dropped through the pairing (Note [Dropping a window]).
  std::vector<at::Tensor> saved;
  try {
    if (kind == 0) {
      const auto foreign = foreign_hooks();
      if (!foreign.empty()) {
        abort_reduction(AbortReason::ForeignReducer);
        TORCH_CHECK(false, foreign);
      }
    }
    // A snapshot must leave bucket views (which are .grad) as they are.
    if (snapshot && (options.gradient_as_bucket_view() ||
                     std::any_of(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.accumulating; }))) {
      for (const auto& bucket : buckets) {
        saved.push_back(bucket.gradients.clone());
      }
    }
    // Whatever backward did not make ready (unused on this rank, or used only
    // in earlier micro-steps) is sent as it is: its accumulated .grad, or
    // zeros flagged as missing.
    for (size_t b = next_launch; b < buckets.size(); ++b) {
      auto& bucket = buckets[b];
      for (const auto slot : c10::irange(bucket.params.size())) {
        if (!ready[bucket.params[slot]]) {
          copy_into_bucket(bucket, slot);
        }
      }
    }
  } catch (const std::exception& e) {
    if (in_flight) {
      const auto local = message_of(e);
      abort_reduction(AbortReason::BackwardFailed);
      TORCH_CHECK(false, failure, ". The error on this rank: ", local);
    }
    throw;
  }
  launch_rest();
  // Phase 2: every collective of this reduction is launched on this rank.
  try {
    wait_all(request.flushing ? "flush" : "synchronising backward");
  } catch (const std::exception& e) {
    fail(e.what());
  }

  // One host read of every bucket's meta (the consensus needs it; it also
  // gives the global weight and the flags).
  read_all_meta();
  auto summed = at::empty({static_cast<int64_t>(buckets.size()), kMetaHeader}, at::kDouble);
  for (const auto b : c10::irange(buckets.size())) {
    std::copy_n(summed_meta[b].begin(), kMetaHeader, summed[static_cast<int64_t>(b)].data_ptr<double>());
  }
  const auto& last = summed_meta.back();
  ReductionResult result;
  result.window = sequence;
  result.global_weight = last[kWeight];
  result.flushing_ranks = static_cast<int64_t>(std::llround(last[kFlushing]));
  last_result = result;
  last_result.dropped = true; // until the consensus holds
  check_consensus(summed);
  last_result.dropped = false;

  // Phase 3: every rank agreed. From here on the window is reduced everywhere;
  // a local failure (say, out of memory) is reported as such, never as a drop.
  struct End {
    State& s;
    bool snapshot;
    ~End() {
      ++s.sequence;
      s.end_reduction(/*window_closed=*/!snapshot);
    }
  } end{*this, snapshot != nullptr};
  if (snapshot) {
    snapshot->assign(params.size(), at::Tensor());
    for (const auto b : c10::irange(buckets.size())) {
      auto& bucket = buckets[b];
      for (const auto slot : c10::irange(bucket.params.size())) {
        if (summed_meta[b][kMetaHeader + slot] != 0) {
          (*snapshot)[bucket.params[slot]] = bucket.views[slot].clone();
        }
      }
      if (!saved.empty()) {
        bucket.gradients.copy_(saved[b]);
      }
    }
    ++stats.snapshots;
    return result;
  }
  ++stats.windows;
  if (result.global_weight > 0 && result.flushing_ranks == 0) {
    last_weight = result.global_weight; // Note [Scaling before the sum]
  }
  // Collectives first: a local failure in write_back must not skip one.
  if (options.broadcast_buffers() && !buffers.empty()) {
    broadcast_from_rank0(buffers);
    ++stats.broadcasts;
  }
  // See Note [Rebuilding buckets in ready order]: agreed here, applied once
  // the write-back below is over (or failed on this rank: every rank switches).
  struct Switch {
    State& s;
    std::optional<std::vector<Bucket>> next;
    ~Switch() {
      if (next) {
        s.switch_buckets(std::move(*next));
      }
    }
  } rebuild{*this, buckets_final ? std::nullopt : agree_on_ready_order()};
  const bool divide = request.divide && result.global_weight > 0;
  bool known_finite = request.check_finite;
  for (const auto b : c10::irange(buckets.size())) {
    known_finite = write_back(buckets[b], summed_meta[b], divide, result.global_weight,
                              request.check_finite) && known_finite;
  }
  result.known_finite = last_result.known_finite = known_finite;
  return result;
}

void Reducer::State::fail(const std::string& message) {
  // Every collective of this reduction has completed (or the group is broken):
  // the pairing is over, so the window can be dropped and the error raised.
  failure = message;
  if (last_result.window != sequence) {
    last_result = ReductionResult{}; // nothing was read from this reduction
  }
  last_result.window = sequence;
  last_result.dropped = true;
  end_dropped_window();
  TORCH_CHECK(false, message);
}

void Reducer::State::end_dropped_window() noexcept {
  // The pairing is over on this rank: clear the window and count it.
  try {
    drop_window();
  } catch (...) {
  }
  ++stats.windows;
  ++stats.dropped_windows;
  ++sequence;
  end_reduction();
}

void Reducer::State::abort_reduction(AbortReason reason) noexcept {
  // See Note [Dropping a window]. Runs from a failed task's guard (in the
  // engine, during unwinding) or from backward()/reduce(): never throws.
  request.abort = reason;
  aborted_here = true;
  std::string transport;
  last_result = ReductionResult{};
  last_result.window = sequence;
  last_result.dropped = true;
  try {
    launch_rest();
    wait_all("dropping this rank's window");
    // Whether others were flushing still matters to this rank's epoch.
    const auto header = buckets.back().read_meta();
    last_result.flushing_ranks = static_cast<int64_t>(std::llround(header[kFlushing]));
  } catch (const std::exception& e) {
    transport = message_of(e);
  }
  failure = "gradaccum: " + window_label() + ": this rank (rank " + std::to_string(rank) +
      ") could not contribute its window, so the window was dropped on every rank (its "
      "gradients cleared, no optimizer step); training can go on from the next window";
  switch (reason) {
    case AbortReason::WeightTooLarge:
      failure += ". Why: this rank's window weight " + std::to_string(request.weight) +
                 " is larger than a bf16/fp16 bucket's meta carries";
      break;
    case AbortReason::WeightTooSmall:
      failure += c10::str(". Why: this rank's window weight ", request.weight,
                          " is smaller than a bf16/fp16 bucket's meta carries exactly");
      break;
    case AbortReason::ClosedWindowNotStepped:
      failure = "gradaccum: " + window_label() + " (flush): this rank (rank " + std::to_string(rank) +
          ") could not step the window it had closed before this flush(), while the other ranks "
          "stepped theirs: the replicas differ from here on, and the flush was dropped on every "
          "rank. Resume every rank from a checkpoint";
      break;
    case AbortReason::GradientsChanged:
      failure += ". Why: the accumulated gradients were cleared or changed outside the "
                 "Accumulator in the middle of the window (optimizer.zero_grad() or "
                 "model.zero_grad() between micro-steps?); clear them only after step() returns "
                 "True, or drop a window with the Accumulator's zero_grad()";
      break;
    case AbortReason::ForeignReducer:
      failure += ". Why: another reducer's hooks are on this rank's parameters";
      break;
    case AbortReason::EpochEnded:
      failure += ". Why: the other ranks had ended the epoch with flush()";
      break;
    default:
      break;
  }
  if (!transport.empty()) {
    failure += ". Dropping it failed too: " + transport;
  }
  end_dropped_window();
}

void Reducer::State::drop_window() {
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    bucket.gradients.zero_();
    if (bucket.residual.defined()) {
      bucket.residual.zero_(); // it holds part of the dropped window
    }
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = params[bucket.params[slot]].mutable_grad();
      if (!options.gradient_as_bucket_view()) {
        grad = at::Tensor();
      } else if (!on_view(grad, bucket.views[slot])) {
        grad = view_handle(bucket.views[slot]);
      }
    }
  }
  clear_touched();
}

void Reducer::State::end_reduction(bool window_closed) {
  stats.last_window_launched_in_backward = static_cast<int64_t>(early_launches);
  stats.launched_in_backward += static_cast<int64_t>(early_launches);
  for (auto& bucket : buckets) {
    bucket.works.clear();
  }
  if (window_closed) {
    clear_touched();
  }
  kind = 0;
  in_flight = false;
  last_anchor_task = anchor_task;
  anchor_task = -1;
}

bool Reducer::State::write_back(Bucket& bucket, const std::vector<double>& meta, bool divide,
                                double divisor, bool check_finite) {
  const bool as_view = options.gradient_as_bucket_view();
  if (bucket.compressed) {
    // Back from the wire's dtype; undo the scale and divide in one pass
    // (Note [Scaling before the sum]): exactly 1 for a full "mean" window.
    bucket.gradients.copy_(bucket.wire_gradients);
    if (bucket.prescaled) {
      const double factor = expected_weight / (divide ? divisor : 1.0);
      if (factor != 1.0) {
        bucket.gradients.mul_(factor);
      }
      divide = false;
    }
  }
  // A CPU double scalar: the division runs in the gradients' compute type
  // without rounding the divisor to a half-precision dtype first.
  const auto divisor_tensor = at::scalar_tensor(divisor, at::kDouble);
  // The division rides on the pass that writes .grad: in place in the bucket
  // for views, fused into the copy back otherwise; so does the check for the
  // non-finite test (Note [The reducer checks the window's gradient]).
  const auto by = divide ? std::optional<double>(divisor) : std::nullopt;
  // A compressed bucket's values came through the wire's copy above, not
  // through this pass: it never reports itself checked.
  const int64_t terms = check_finite && !bucket.compressed ? numel : 0;
  bool bounded = true;
  if (as_view && (divide || check_finite)) {
    bounded = detail::write_checked(bucket.gradients, bucket.gradients, by, terms);
  }
  // A parameter missing here may have a gradient elsewhere: the summed flag says.
  std::vector<char> nowhere(bucket.params.size(), 0);
  for (const auto slot : bucket.missing) {
    nowhere[slot] = meta[kMetaHeader + slot] == 0;
  }
  if (bucket.accumulating) {
    // Rounded once, to the parameter's dtype; the bucket starts the next window at 0.
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = params[bucket.params[slot]].mutable_grad();
      const auto& p = params[bucket.params[slot]];
      grad = nowhere[slot] ? at::Tensor()
          : (divide ? bucket.views[slot].div(divisor_tensor) : bucket.views[slot]).to(p.scalar_type());
    }
    bucket.gradients.zero_();
    return false; // not checked
  }
  for (const auto slot : c10::irange(bucket.params.size())) {
    auto& grad = params[bucket.params[slot]].mutable_grad();
    const auto& view = bucket.views[slot];
    if (nowhere[slot]) {
      grad = at::Tensor(); // no rank had a gradient: keep it None, as one process would
    } else if (as_view) {
      if (!on_view(grad, view)) {
        grad = view_handle(view);
      }
    } else {
      if (!grad.defined()) {
        grad = at::empty_like(view);
      }
      bounded = detail::write_checked(grad, view, by, terms) && bounded;
    }
  }
  return bounded && !bucket.compressed;
}

} // namespace gradaccum
