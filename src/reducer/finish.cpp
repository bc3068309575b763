// The reduction's end: every bucket launched, the collectives waited for, the
// headers agreed on, the reduced gradient written back.

#include "reducer/state.h"

#include "comm.h"
#include "consensus/window_header.h"
#include "precision/precision.h"
#include "rank_check.h"

#include <gradaccum/detail/checked_write.h>

#include <c10/util/irange.h>

#include <algorithm>
#include <exception>
#include <iomanip>
#include <numeric>
#include <sstream>

// Note [Finishing a reduction]
// finish_reduction() runs three phases, each a call, in this order:
//  1. complete_buckets(): before the last launch. What fails here is this
//     rank's alone, and is dropped through the pairing (abort_reduction(),
//     Note [Dropping a window]), so every rank still ends alike.
//  2. launch_rest() and agree(): every collective of the reduction is
//     launched; wait for them, read the summed headers, check the consensus.
//     What fails here every rank sees alike (a transport error, a rank that
//     dropped the window, a disagreement): fail() drops the window and raises.
//     A window's buckets but the last are written back as they complete
//     (Note [Writing back while the last buckets reduce]). A window far
//     lighter than its fp16 wire's scale is sent again, once every rank
//     agreed (Note [Re-sending a light window]): its own failures are every
//     rank's too.
//  3. complete_snapshot() or complete_window(): every rank agreed, the window
//     is reduced everywhere; a local failure from here on (say, out of
//     memory) is reported as such, never as a drop. A window runs its other
//     collectives first (buffers, the rebuild's order: window_collectives(),
//     each run even when the one before failed on this rank, so the pairing
//     holds), then writes back, then rebuilds the buckets (the rebuild's
//     second collective) and ends the reduction, the last two even when a
//     step before them failed on this rank: every rank switches buckets and
//     counts the window alike.

namespace gradaccum {

ReductionResult Reducer::State::finish_reduction(std::vector<at::Tensor>* snapshot) {
  TORCH_INTERNAL_ASSERT(window.in_flight, "gradaccum: finishing a reduction that is not in flight");
  window.timeline.backward_end = window.elapsed();
  const auto saved = complete_buckets(snapshot != nullptr);
  launch_rest();
  auto reduced = agree(/*closing=*/window.kind() == 0);
  if (window.entry == detail::Entry::Refresh) { // Note [A refresh pairs like a window]
    end_reduction(/*window_closed=*/false);
    return reduced.result;
  }
  if (snapshot) {
    return complete_snapshot(std::move(reduced), saved, *snapshot);
  }
  return complete_window(std::move(reduced));
}

std::vector<at::Tensor> Reducer::State::complete_buckets(bool snapshot) {
  std::string foreign;
  std::vector<at::Tensor> saved;
  try {
    if (window.entry == detail::Entry::Refresh) {
      // Note [A refresh pairs like a window]: zeros, no parameter's gradient.
      for (auto& bucket : buckets.all) {
        bucket.wire_gradients.zero_();
        bucket.missing.resize(bucket.params.size());
        std::iota(bucket.missing.begin(), bucket.missing.end(), size_t{0});
      }
      return saved;
    }
    foreign = window.kind() == 0 ? detail::foreign_hooks(config) : "";
    // Whatever backward did not make ready (unused on this rank, or used only
    // in earlier micro-steps) is sent as it is: its accumulated .grad, or
    // zeros flagged as missing.
    for (size_t b = window.next_launch; foreign.empty() && b < buckets.all.size(); ++b) {
      auto& bucket = buckets.all[b];
      for (const auto slot : c10::irange(bucket.params.size())) {
        if (!window.ready[bucket.params[slot]]) {
          copy_into_bucket(bucket, slot);
        }
      }
    }
    // A snapshot must leave the window's local sums where they are: bucket
    // views (which are .grad) and wide sums are overwritten by the
    // all-reduce, so they are kept, and kept after the copy-in above, which
    // may have moved a .grad into its bucket (a .grad that had left its view,
    // say optimizer.zero_grad() at the window's start, is re-pointed at it;
    // a wide bucket takes .grad and clears it): kept before it, that part of
    // the window would be lost.
    if (foreign.empty() && snapshot &&
        (config.options.gradient_as_bucket_view() || buckets.any(&Bucket::accumulating))) {
      TORCH_INTERNAL_ASSERT(window.next_launch == 0, "gradaccum: a snapshot's bucket was launched early");
      for (const auto& bucket : buckets.all) {
        saved.push_back(bucket.gradients.clone());
      }
    }
  } catch (const std::exception& e) {
    const auto local = detail::message_of(e);
    abort_reduction(AbortReason::BackwardFailed);
    TORCH_CHECK(false, own_failure(local));
  }
  if (!foreign.empty()) {
    const auto message = where() + ": " + foreign;
    abort_reduction(AbortReason::ForeignReducer);
    TORCH_CHECK(false, message);
  }
  return saved;
}

// Note [Writing back while the last buckets reduce]
// A window's buckets complete in launch order, the last one (Note [The last
// bucket closes the window]) after backward ends. Each earlier bucket is
// written back to .grad as soon as its all-reduce has completed, while the
// later ones are still on the wire, instead of all of them after the verdict:
// the write-back, a pass over the whole gradient, then mostly hides behind the
// last all-reduce (torch DDP copies its buckets out the same way). It is safe
// before the verdict because every verdict that does not step the window
// (dropped, mis-paired, disagreeing) clears it on every rank (drop_window());
// a write-back that fails here is kept and raised after the window's
// collectives, and clears the window on this rank only, as a failed
// write-back after the verdict does (the others step it). The divisor is the
// bucket's own summed weight. In an agreed window that is the window's (the
// last bucket's): the same per-rank values, summed at another position of
// another collective, so a fractional weight may round differently.
// complete_window() writes such a bucket again from its view, where the
// reduced sum still is; a wide bucket (accumulate_dtype) keeps its sums for
// that until then, and is zeroed for the next window after it. Bucket views
// are scaled in place, with no second chance: one is written early only where
// its divisor cannot differ, no rank having sent a fractional weight
// (kInexactWeight) and the sum being exact in every bucket's meta dtype
// (exact_weight_bound(); the usual case: "mean" counts micro-steps, token
// counts are integers), and complete_window() asserts that it did not.
// Compressed buckets (decompressed in place) are written after the verdict.
// A snapshot leaves .grad as it is.
detail::Reduced Reducer::State::agree(bool closing) {
  try {
    wait_all(/*write_early=*/closing);
    read_all_meta();
  } catch (const std::exception& e) {
    fail_worded([&] {
      return where() + ", " + detail::message_of(e) + (window.entry == detail::Entry::Refresh ? ". Nothing was refreshed" : "");
    });
  }
  // Note [Reading the window allocates nothing]: numbers only from here to
  // the window's other collectives, unless every rank drops the window.
  detail::Reduced reduced;
  reduced.verdict = detail::read_headers(buckets.all, agreement_inputs(), config.rank, config.world,
                                         buckets.modulus);
  const auto& verdict = reduced.verdict;
  auto& result = reduced.result;
  result.window = window.sequence;
  result.global_weight = verdict.global_weight;
  result.flushing_ranks = verdict.flushing_ranks;
  result.flushing_steps_ranks = verdict.flushing_steps_ranks;
  result.joined_ranks = verdict.joined_ranks;
  result.left_ranks = verdict.aborters.of(AbortReason::LeftJoin);
  result.unstepped_ranks = verdict.aborters.of(AbortReason::ClosedWindowNotStepped);
  result.interrupted_ranks = verdict.aborters.of(AbortReason::Interrupted);
  window.last_result = result; // (no metric sums yet: copied without allocating)
  // Note [A window not stepped on some ranks]: read and told, or a rank that
  // could not step its closed window told every rank that the replicas differ.
  using Outcome = detail::Verdict::Outcome;
  if ((verdict.outcome != Outcome::Dropped && verdict.outcome != Outcome::Mispaired) ||
      (verdict.outcome == Outcome::Dropped && verdict.aborters.of(AbortReason::ClosedWindowNotStepped) > 0)) {
    window.unstepped_pending = nullptr;
  }
  if (!verdict.agreed()) {
    fail_worded([&] {
      // A refresh's check is no window: say what became of the refresh, and
      // what to do (a refusal's own text says it already).
      const bool refusal = verdict.outcome == detail::Verdict::Outcome::Dropped &&
          verdict.aborters.shared() == AbortReason::RefreshRefused;
      std::string next;
      if (window.entry == detail::Entry::Refresh && verdict.outcome == detail::Verdict::Outcome::Unstepped) {
        next = ". Nothing was refreshed";
      } else if (window.entry == detail::Entry::Refresh && !refusal) {
        next = verdict.joined_ranks > 0
            ? ". Nothing was refreshed; a rank in acc.join() left it with this error: end training on every "
              "rank here (or resume every rank from a checkpoint)"
            : verdict.flushing_ranks > 0
            ? ". Nothing was refreshed; other ranks ended their epoch with acc.flush() in it: call acc.flush() "
              "here (a no-op), then acc.refresh_parameters() again on every rank, at the same window boundary"
            : ". Nothing was refreshed: call acc.refresh_parameters() again on every rank, at the same window "
              "boundary";
      } else if (verdict.outcome == detail::Verdict::Outcome::Disagreed && verdict.joined_ranks > 0) {
        // Note [A window dropped while ranks shadow]: the shadows leave join() with this error.
        next = ": " + std::to_string(verdict.joined_ranks) + " rank(s) out of data in acc.join() raise this error "
            "too and leave it, so no next window can pair there: end training on every rank here (or resume "
            "every rank from a checkpoint)";
        // A shadow runs window reductions only (docs/checkpoints.md): a
        // snapshot met one, most likely, where the codes are known to say so.
        const auto& v = verdict.values;
        if (verdict.agreement != nullptr && verdict.agreement->shown == detail::Shown::Kind) {
          const bool snapshot = v.mine % 4 == 1 || (v.other.has_value() && *v.other % 4 == 1);
          if (snapshot || !v.other.has_value()) {
            next += std::string(snapshot ? ". A" : ". If a rank called acc.state_dict() in the middle of a window: a") +
                " rank out of data in acc.join() takes no part in a mid-window acc.state_dict() snapshot; while "
                "ranks shadow, checkpoint at window boundaries (after acc.step() returned True)";
          }
        }
      }
      return detail::verdict_error(verdict, where()) + next;
    });
  }
  if (window.entry != detail::Entry::Refresh && window.entry != detail::Entry::ManualBackward) {
    resend_if_light(verdict); // (the manual path's weight says nothing of its gradient's size: never)
  }
  return reduced;
}

void Reducer::State::take_metric_sums(detail::Reduced& reduced) {
  // Every bucket whose meta is not digit-encoded carries the loss and the
  // metrics (launch_bucket()), final before the first launch: the last such
  // bucket's, whichever it is (a model of float32 and bf16 parameters may
  // have either last, and a rebuild may swap them).
  const auto carrier = std::find_if(buckets.all.rbegin(), buckets.all.rend(),
                                    [](const Bucket& b) { return b.encoding != MetaEncoding::kDigits; });
  if (carrier == buckets.all.rend()) {
    return; // (digit-encoded meta carries neither)
  }
  const auto& meta = carrier->meta_values;
  reduced.result.metric_sums.assign(meta.begin() + kMetric0, meta.begin() + kMetaHeader);
  reduced.result.loss_sum = meta[kLoss];
  window.last_result.metric_sums = reduced.result.metric_sums;
  window.last_result.loss_sum = reduced.result.loss_sum;
}

void Reducer::State::wait_all(bool write_early) {
  for (const auto b : c10::irange(buckets.all.size())) {
    wait_bucket(b);
    if (write_early && b + 1 < buckets.all.size()) {
      write_back_early(b);
    }
  }
}

void Reducer::State::wait_bucket(size_t index) {
  for (auto& work : buckets.all[index].works) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      // Wait for nothing else: the group is likely broken. The caller drops
      // the window (its buffers may hold a half-reduced sum) and says where.
      std::ostringstream message;
      message << "rank " << config.rank << ": the all-reduce of bucket " << index << " of " << buckets.all.size()
              << " failed. Likely cause: a peer process left (crashed or was killed), a peer "
              << "stalled past the group's timeout (asleep, stuck in a hook, in other work), or "
              << "the ranks took different paths (flush() on some ranks only, a different "
              << "number of micro-steps or windows, another collective in between). "
              << "The original error: " << detail::message_of(e);
      throw std::runtime_error(message.str());
    }
  }
}

void Reducer::State::write_back_early(size_t index) noexcept {
  // See Note [Writing back while the last buckets reduce].
  auto& bucket = buckets.all[index];
  if (window.early_failure || bucket.compressed) {
    return;
  }
  try {
    TORCH_INTERNAL_ASSERT(window.early.size() == buckets.all.size() && !window.early[index].written,
                          "gradaccum: bucket ", index, " written back early twice, or without its slot");
    auto& early = window.early[index];
    const bool as_view = config.options.gradient_as_bucket_view();
    for (const auto slot : c10::irange(as_view ? 0 : bucket.params.size())) {
      if (detail::on_view(config.params[bucket.params[slot]].grad(), bucket.views[slot])) {
        return; // (a .grad on its view would be divided in place: no second write)
      }
    }
    const auto& meta = bucket.read_meta();
    early.read = true;
    if (meta[kAbort] != 0) {
      return; // the window is dropped: nothing to write
    }
    const double weight = meta[kWeight];
    // Divided in place, a view cannot be written again with another divisor:
    // only where every bucket's summed weight is this one, bit for bit. Every
    // rank sent an integer (kInexactWeight), and the sum is below the bound
    // of the narrowest meta: weights are non-negative and rounding monotone,
    // so no partial sum in any bucket rounded.
    if (as_view && window.request.divide &&
        (meta[kInexactWeight] != 0 || !(weight < buckets.exact_weights_below))) {
      return;
    }
    early.bounded = write_back(bucket, meta, window.request.divide && weight > 0, weight,
                               window.request.check_finite);
    early.weight = weight;
    early.written = true;
    window.timeline.buckets[index].written = window.elapsed();
  } catch (...) {
    window.early_failure = std::current_exception();
  }
}

// Note [Reading the window allocates nothing]
// Every all-reduce of the window has completed on every rank when its meta is
// read; the others go on to the window's other collectives (finish.cpp:
// window_collectives) if the consensus holds. A rank that failed to read its
// meta here could neither tell them nor know whether to join those
// collectives. So each bucket reads its meta back into host memory allocated
// with it (Bucket::meta_host, decoded into Bucket::meta_values): one copy per
// bucket, which on a device is one small synchronous copy each. The verdict
// (read_headers()) is numbers only; the window's loss and metric sums reach
// the result (a vector) after the window's other collectives
// (take_metric_sums()), where a local failure is one after the consensus.
// Only a window every rank drops allocates its error's text; if even that
// fails here, the window is still ended on this rank before the error leaves
// (end_failed_window()).
void Reducer::State::read_all_meta() const {
  for (const auto b : c10::irange(buckets.all.size())) {
    if (b >= window.early.size() || !window.early[b].read) { // (read for an early write already)
      buckets.all[b].read_meta();
    }
  }
}

ReductionResult Reducer::State::complete_snapshot(detail::Reduced reduced,
                                                  const std::vector<at::Tensor>& saved,
                                                  std::vector<at::Tensor>& sums) {
  try {
    take_metric_sums(reduced);
    sums.assign(config.params.size(), at::Tensor());
    for (const auto b : c10::irange(buckets.all.size())) {
      auto& bucket = buckets.all[b];
      for (const auto slot : c10::irange(bucket.params.size())) {
        if (bucket.meta_values[kMetaHeader + slot] != 0) {
          sums[bucket.params[slot]] = bucket.views[slot].clone();
        }
      }
      if (!saved.empty()) {
        bucket.gradients.copy_(saved[b]);
      }
    }
    ++stats.snapshots;
  } catch (...) {
    end_reduction(/*window_closed=*/false);
    throw;
  }
  end_reduction(/*window_closed=*/false);
  return reduced.result;
}

ReductionResult Reducer::State::complete_window(detail::Reduced reduced) {
  auto& result = reduced.result;
  ++stats.windows;
  if (result.global_weight > 0 && result.flushing_ranks == 0 && window.entry != detail::Entry::ManualBackward) {
    window.last_weight = result.global_weight; // Note [Scaling before the sum] (a manual reduction weighs 1 a rank)
  }
  if (window.residual_carry != 0.0) { // (0: held back, still its own window's: Note [Error feedback across window weights])
    window.residual_weight = window.request.weight;
    window.residual_rescale = at::Tensor(); // carried in (Note [Error feedback across loss scales])
  }
  // .grad may hold part of the window, or its undivided sum: never leave
  // that to be stepped (Accumulator::reduce_window says what happened).
  const auto drop_written = [this] {
    window.last_result.written = false;
    try {
      drop_window();
    } catch (...) {
    }
  };
  std::optional<detail::RebuildPlan> rebuild;
  std::exception_ptr failed;
  try {
    window_collectives(result.joined_ranks, rebuild);
    if (window.early_failure) {
      std::rethrow_exception(window.early_failure); // (after the collectives: the others step theirs)
    }
    take_metric_sums(reduced);
    const bool divide = window.request.divide && result.global_weight > 0;
    bool known_finite = window.request.check_finite;
    TORCH_INTERNAL_ASSERT(window.early.size() == buckets.all.size(), "gradaccum: the early writes have no slots");
    for (const auto b : c10::irange(buckets.all.size())) {
      const auto& early = window.early[b];
      // Note [Writing back while the last buckets reduce]: bit for bit the
      // window's divisor, or written again.
      if (early.written && (!window.request.divide || early.weight == result.global_weight)) {
        known_finite = early.bounded && known_finite;
        continue;
      }
      TORCH_INTERNAL_ASSERT(!early.written || !config.options.gradient_as_bucket_view(),
                            "gradaccum: bucket view ", b, " was divided early by ", std::setprecision(17),
                            early.weight, ", not by the window's ", result.global_weight);
      known_finite = write_back(buckets.all[b], buckets.all[b].meta_values, divide, result.global_weight,
                                window.request.check_finite) && known_finite;
      window.timeline.buckets[b].written = window.elapsed();
    }
    for (auto& bucket : buckets.all) {
      if (bucket.accumulating) {
        bucket.gradients.zero_(); // the next window's wide sums start at zero
      }
    }
    result.known_finite = window.last_result.known_finite = known_finite;
  } catch (...) {
    failed = std::current_exception();
    drop_written();
  }
  // Note [Rebuilding buckets in ready order]: after the write-back, on every
  // rank alike, this one too when it failed above.
  if (rebuild) {
    std::exception_ptr rebuild_failed;
    if (buckets.rebuild(std::move(*rebuild), config, rebuild_failed)) {
      stats.buckets = static_cast<int64_t>(buckets.all.size());
      ++stats.bucket_rebuilds;
    }
    if (rebuild_failed && !failed) {
      failed = rebuild_failed;
      drop_written();
    }
  }
  if (failed) {
    ++stats.dropped_windows; // on this rank alone: the others step theirs
    if (window.entry == detail::Entry::ManualBackward) { // (its error tells this rank)
      manual_dropped_at.store(manual_reductions.load(std::memory_order_relaxed), std::memory_order_relaxed);
    }
    if (result.global_weight > 0) {
      window.unstepped_pending = detail::kLostAfterReduction; // Note [A window not stepped on some ranks]
    }
    end_reduction(/*window_closed=*/true);
    if (window.entry == detail::Entry::ManualBackward) {
      fail_manual_after_reduction(failed, result.global_weight > 0); // (acc.backward()'s caller words its own)
    }
    std::rethrow_exception(failed);
  }
  if (window.entry == detail::Entry::ManualBackward) {
    note_manual_written(); // Note [A second backward after the manual path's reduction]
  }
  end_reduction(/*window_closed=*/true);
  return result;
}

void Reducer::State::fail_manual_after_reduction(const std::exception_ptr& failed, bool stepped_elsewhere) {
  std::string what;
  try {
    std::rethrow_exception(failed);
  } catch (const c10::Error& e) {
    what = e.what_without_backtrace();
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    return; // (not ours to word)
  }
  if (what.rfind("gradaccum: ", 0) == 0) {
    return; // worded already
  }
  while (!what.empty() && (what.back() == '.' || what.back() == '\n')) {
    what.pop_back(); // (the sentence goes on)
  }
  TORCH_CHECK(false, "gradaccum: loss.backward(): every rank reduced the manual path's window, but this rank (rank ",
      config.rank, ") failed after that: ", what, ". Its gradients were cleared (its own optimizer.step() steps "
      "nothing)", stepped_elsewhere ? " while the other ranks step theirs: the replicas differ from here on. Resume "
                                      "every rank from a checkpoint (the next reduction tells every rank, and every "
                                      "rank drops it)"
                                    : "; the window was empty on every rank");
}

void Reducer::State::window_collectives(int64_t joined_ranks, std::optional<detail::RebuildPlan>& rebuild) {
  // Before the write-back: a local failure there must not skip one. The
  // buffers come from rank 0, or, while some ranks have joined, from the
  // lowest rank that ran micro-batches in this window: a rank shadowing the
  // others ran no forward, its buffers are stale (Note [Joining]). Ranks
  // with weight first (their micro-batches ran forwards); else ranks whose
  // micro-batches of no weight ran forwards (num_items=0, left out by
  // skip_micro_batch: they moved the buffers too, so the replicas must take
  // one rank's; acc.empty_micro_step() ran none); none: nobody ran a
  // forward since the last broadcast.
  // Whether some ranks joined is in the header, the same on every rank, so
  // every rank takes the same branch, and the ranks pay the extra all-reduce
  // only in the join's tail.
  std::exception_ptr failed;
  if (config.options.broadcast_buffers() && !buffer_broadcast.empty()) {
    try {
      const int tier = window.request.weight > 0 ? 0 : window.request.forwards ? 1 : 2;
      int root = 0;
      if (joined_ranks > 0) {
        ++stats.collectives; // one int64 all-reduce, counted as launched (a failure in it still ran it here)
        ++stats.last_window_collectives;
        stats.bytes_reduced += static_cast<int64_t>(sizeof(int64_t));
        stats.last_window_bytes += static_cast<int64_t>(sizeof(int64_t));
        root = detail::lowest_rank_of_best_tier(*config.group, tier, 2, config.metadata_device());
      }
      if (root < config.world) {
        ++stats.broadcasts;
        buffer_broadcast.run(*config.group, root); // (all of it, whatever fails: Note [The buffers' ...])
      }
    } catch (...) {
      failed = std::current_exception();
    }
  }
  // Note [Rebuilding buckets in ready order]: its order agreed here, its
  // buckets built after the write-back, on this rank too when its broadcast
  // failed: the others switch.
  if (!buckets.final) {
    try {
      rebuild = buckets.agree_on_ready_order(config);
    } catch (...) {
      if (!failed) {
        failed = std::current_exception();
      }
    }
  }
  if (failed) {
    std::rethrow_exception(failed);
  }
}

bool Reducer::State::write_back(Bucket& bucket, const std::vector<double>& meta, bool divide,
                                double divisor, bool check_finite) {
  const bool as_view = config.options.gradient_as_bucket_view();
  if (bucket.compressed) {
    divide = detail::decompress(bucket, wire_scale(bucket), divide, divisor);
  }
  // The division rides on the pass that writes .grad: in place in the bucket
  // for views, fused into the copy back otherwise; so does the check for the
  // non-finite test (Note [The reducer checks the window's gradient]).
  const auto by = divide ? std::optional<double>(divisor) : std::nullopt;
  // A compressed bucket's values came through the wire's copy above, not
  // through this pass: it never reports itself checked.
  const int64_t terms = check_finite && !bucket.compressed ? config.numel : 0;
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
    detail::write_back_wide(bucket, config.params, nowhere, by);
    return false; // not checked
  }
  for (const auto slot : c10::irange(bucket.params.size())) {
    auto& grad = config.params[bucket.params[slot]].mutable_grad();
    const auto& view = bucket.views[slot];
    if (nowhere[slot]) {
      grad = at::Tensor(); // no rank had a gradient: keep it None, as one process would
    } else if (as_view) {
      detail::repoint(grad, view);
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
