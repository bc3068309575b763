#include "reducer/state.h"

#include <algorithm>
#include <sstream>
#include <tuple>

namespace gradaccum {

// Note [Collectives pair by launch order]
// c10d pairs the n-th collective of one rank with the n-th of every other rank.
// So every reduction launches every bucket, strictly in index order, on every
// rank, whatever order the hooks fire in and whatever happens to this rank's
// backward: a failing rank still launches its remaining buckets (flagged, see
// Note [Dropping a window]), a rank whose loss touched no parameter launches
// them all at the end, and a closing micro-step always produces exactly one
// reduction. Buckets change only between windows, once, identically on every
// rank (Note [Rebuilding buckets in ready order]).
//
//
// Note [The last bucket closes the window]
// Hooks launch each bucket as soon as it is full, except the last: only
// finish_reduction() (which runs once the whole backward has succeeded) or
// abort_reduction() launch it. So the last bucket's meta always carries every
// rank's final word on the window: whether it drops it. A rank whose backward
// fails after all its gradients were ready still gets to say so.
//

void Reducer::State::begin_reduction(const ReductionRequest& req, int task) {
  TORCH_INTERNAL_ASSERT(!in_flight, "gradaccum: a reduction began while another was in flight");
  in_flight = true;
  request = req;
  ++sync_id;
  anchor_task = task;
  aborted_here = false;
  failure.clear();
  std::fill(ready.begin(), ready.end(), 0);
  ready_order.clear();
  for (auto& bucket : buckets) {
    bucket.pending = bucket.params.size();
    bucket.missing.clear();
    bucket.works.clear();
  }
  next_launch = 0;
  // See Note [Scaling before the sum]: the same value on every rank.
  expected_weight = rule.reduction == Reduction::Items && last_weight > 0
      ? last_weight : static_cast<double>(world) * static_cast<double>(rule.steps);
  // A weight the meta's digits cannot carry (or not closely enough: a tiny
  // one would round to zero and the window would go undivided) drops the
  // window on every rank (raising here, before the collectives, would leave
  // the others waiting).
  if (request.abort == AbortReason::None &&
      std::any_of(buckets.begin(), buckets.end(),
                  [](const Bucket& b) { return b.encoding == MetaEncoding::kDigits; })) {
    if (request.weight > Bucket::max_meta_value(kWeight)) {
      request.abort = AbortReason::WeightTooLarge;
    } else if (request.weight > 0 && request.weight < Bucket::min_meta_weight()) {
      request.abort = AbortReason::WeightTooSmall;
    }
  }
  stats.last_window_collectives = 0;
  stats.last_window_bytes = 0;
  hook_launches = 0;
  early_launches = 0;
  if (task >= 0) {
    queue_end_callback(task);
  }
}

void Reducer::State::copy_into_bucket(Bucket& bucket, size_t slot) {
  auto& grad = params[bucket.params[slot]].mutable_grad();
  auto& view = bucket.views[slot];
  if (bucket.accumulating) {
    // The window's sum so far is in the bucket (accumulate_local); add the rest.
    if (grad.defined()) {
      TORCH_CHECK(!grad.is_sparse(), "gradaccum: ", name(bucket.params[slot]), " has a sparse "
          "gradient (nn.Embedding(sparse=True)?); sparse gradients are not supported: use sparse=False");
      add_widened(view, grad);
      grad = at::Tensor();
    } else if (!touched[bucket.params[slot]].load(std::memory_order_relaxed)) {
      view.zero_();
      bucket.missing.push_back(slot);
    }
    return;
  }
  const bool in_bucket = on_view(grad, view); // Note [Bucket views as .grad]
  const bool untouched_view = in_bucket && !touched[bucket.params[slot]].load(std::memory_order_relaxed);
  if (!grad.defined() || untouched_view) {
    view.zero_();
    bucket.missing.push_back(slot);
    return;
  }
  if (in_bucket) {
    return; // bucket view: backward already accumulated in place
  }
  TORCH_CHECK(!grad.is_sparse(), "gradaccum: ", name(bucket.params[slot]), " has a sparse gradient "
      "(nn.Embedding(sparse=True)?); sparse gradients are not supported: use sparse=False");
  view.copy_(grad);
  if (options.gradient_as_bucket_view()) {
    // Someone replaced .grad (zero_grad(set_to_none=True)) or its storage
    // (.grad.data = t): re-point it.
    grad = view_handle(view);
  }
}

void Reducer::State::launch_ready_buckets() {
  // Never the last bucket: see Note [The last bucket closes the window].
  while (next_launch + 1 < buckets.size() && buckets[next_launch].pending == 0) {
    launch_bucket(next_launch++);
    ++hook_launches;
  }
}

void Reducer::State::launch_rest() {
  while (next_launch < buckets.size()) {
    buckets[next_launch].pending = 0;
    launch_bucket(next_launch++);
  }
}

void Reducer::State::launch_bucket(size_t index) {
  auto& bucket = buckets[index];
  // The header, as Note [Bucket meta layout] describes it.
  const auto squared = [this](int64_t v) {
    const double m = static_cast<double>(((v % modulus) + modulus) % modulus);
    return std::make_pair(m, m * m);
  };
  std::vector<double> meta(static_cast<size_t>(kMetaHeader) + bucket.params.size(), 1.0);
  const bool aborting = request.abort != AbortReason::None;
  meta[kWeight] = aborting ? 0 : request.weight;
  meta[kFlushing] = request.flushing ? 1 : 0;
  meta[kAbort] = aborting ? 1 : 0;
  meta[kAbortRank] = aborting ? rank : 0;
  meta[kAbortReason] = static_cast<double>(static_cast<int64_t>(request.abort));
  std::tie(meta[kWindow], meta[kWindowSquare]) = squared(sequence);
  std::tie(meta[kSteps], meta[kStepsSquare]) = squared(rule.steps);
  std::tie(meta[kReductionMode], meta[kReductionModeSquare]) =
      squared(static_cast<int64_t>(rule.reduction));
  std::tie(meta[kBucketIndex], meta[kBucketIndexSquare]) = squared(static_cast<int64_t>(index));
  // The kind also says whether this reduction ends with the one-time bucket
  // rebuild's collectives (Note [Rebuilding buckets in ready order]), so that
  // ranks that disagree drop the window instead of mis-pairing them.
  std::tie(meta[kKind], meta[kKindSquare]) = squared(kind_code());
  for (const auto slot : bucket.missing) {
    meta[kMetaHeader + slot] = 0;
  }
  if (bucket.compressed) {
    compress(bucket);
  }
  bucket.write_meta(meta);

  std::vector<at::Tensor> tensors{bucket.wire};
  bucket.works.push_back(group->allreduce(tensors));
  if (bucket.encoding == MetaEncoding::kSeparate) {
    std::vector<at::Tensor> meta_tensors{bucket.meta};
    bucket.works.push_back(group->allreduce(meta_tensors));
  }
  const auto launches = static_cast<int64_t>(bucket.works.size());
  TORCH_INTERNAL_ASSERT(launches == bucket.collectives());
  stats.collectives += launches;
  stats.last_window_collectives += launches;
  stats.bytes_reduced += bucket.bytes();
  stats.last_window_bytes += bucket.bytes();
}

void Reducer::State::read_all_meta() {
  // One copy to the host for all buckets (one device synchronisation).
  std::vector<at::Tensor> metas;
  for (const auto& bucket : buckets) {
    metas.push_back(bucket.meta.to(at::kDouble));
  }
  const auto host = at::cat(metas).cpu().contiguous();
  const double* data = host.data_ptr<double>();
  for (const auto b : c10::irange(buckets.size())) {
    summed_meta[b] = buckets[b].decode_meta(data);
    data += buckets[b].meta.numel();
  }
}

void Reducer::State::wait_all(const char* what) {
  for (const auto b : c10::irange(buckets.size())) {
    for (auto& work : buckets[b].works) {
      try {
        work->wait();
      } catch (const std::exception& e) {
        // Wait for nothing else: the group is likely broken. The caller drops
        // the window (its buffers may hold a half-reduced sum).
        std::ostringstream message;
        message << "gradaccum: " << window_label() << " (" << what << "), rank " << rank
                << ": the all-reduce of bucket " << b << " of " << buckets.size()
                << " failed. Likely cause: a peer process left (crashed or was killed), or "
                << "the ranks took different paths (flush() on some ranks only, a different "
                << "number of micro-steps or windows, another collective in between). "
                << "The original error: " << message_of(e);
        throw std::runtime_error(message.str());
      }
    }
  }
}

} // namespace gradaccum
