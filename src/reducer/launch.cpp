// The reduction, from its beginning to its last launch: a gradient goes from
// `.grad` (or the hook) into its bucket, and each bucket, once full, into its
// all-reduce.

#include "reducer/state.h"

#include "consensus/window_header.h"
#include "precision/precision.h"

#include <algorithm>
#include <utility>

// Note [The last bucket closes the window]
// Hooks launch each bucket as soon as it is full, except the last: only
// finish_reduction() (which runs once the whole backward has succeeded) or
// abort_reduction() launch it. So the last bucket's meta always carries every
// rank's final word on the window: whether it drops it. A rank whose backward
// fails after all its gradients were ready still gets to say so.

namespace gradaccum {

void Reducer::State::begin_reduction(const ReductionRequest& request, int task, detail::Entry entry) {
  TORCH_INTERNAL_ASSERT(!window.in_flight, "gradaccum: a reduction began while another was in flight");
  window.in_flight = true;
  window.request = request;
  window.entry = entry;
  if (entry == detail::Entry::ManualBackward) {
    manual_reductions.fetch_add(1, std::memory_order_relaxed);
  }
  ++window.sync_id;
  window.anchor_task = task;
  window.aborted_here = false;
  window.failure.clear();
  // Note [A failed backward inside no_sync()]: the manual path's reduction
  // drops the window for it (the Accumulator's own micro-steps say so themselves).
  // An outer node's watch still armed means that node failed (its backward
  // has returned, without running it): the window holds part of it.
  const bool armed = next_watch_generation();
  window.failed_no_sync_read = std::exchange(window.failed_no_sync, false) || armed;
  window.failed_counted_read = std::exchange(window.failed_counted, AbortReason::None);
  // Note [A window not stepped on some ranks]: a rank that drops this
  // reduction because it could not step the window it closed says so already.
  if (request.abort == AbortReason::ClosedWindowNotStepped) {
    window.unstepped_pending = nullptr;
  }
  window.unstepped = window.unstepped_pending;
  std::fill(window.ready.begin(), window.ready.end(), 0);
  buckets.ready_order.clear();
  for (auto& bucket : buckets.all) {
    bucket.pending = bucket.params.size();
    bucket.missing.clear();
    bucket.works.clear();
  }
  window.next_launch = 0;
  // See Note [Scaling before the sum]: the same value on every rank; the
  // manual path's is world * steps whatever the windows' items were.
  window.expected_weight = entry == detail::Entry::ManualBackward
      ? static_cast<double>(config.world) * static_cast<double>(config.rule.steps)
      : detail::expected_weight(config.rule, config.world, window.last_weight);
  window.resent_weight = 0;
  window.residual_carry = detail::residual_carry(request, window.residual_weight);
  // A weight the meta cannot carry drops the window on every rank (raising
  // here, before the collectives, would leave the others waiting).
  if (window.request.abort == AbortReason::None) {
    window.request.abort = detail::unsendable_weight(buckets.all, window.request.weight);
  }
  stats.last_window_collectives = 0;
  stats.last_window_bytes = 0;
  window.hook_launches = 0;
  window.early_launches = 0;
  // Note [The window's timeline]
  window.origin = std::chrono::steady_clock::now();
  window.timeline = WindowTimeline{};
  window.timeline.origin =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  window.timeline.gradients.assign(config.params.size(), -1.0);
  window.timeline.buckets.assign(buckets.all.size(), WindowTimeline::BucketTimes{});
  window.completed.assign(buckets.all.size(), nullptr);
  window.early.assign(buckets.all.size(), detail::Window::EarlyWrite{});
  window.early_failure = nullptr;
}

void Reducer::State::copy_into_bucket(Bucket& bucket, size_t slot) {
  const auto index = bucket.params[slot];
  auto& grad = config.params[index].mutable_grad();
  auto& view = bucket.views[slot];
  if (bucket.accumulating) {
    // The window's sum so far is in the bucket (accumulate_local); add the rest.
    if (grad.defined()) {
      check_gradient(grad, index, view);
      add_widened(view, grad);
      grad = at::Tensor();
    } else if (!touched[index].load(std::memory_order_relaxed)) {
      view.zero_();
      bucket.missing.push_back(slot);
    }
    return;
  }
  const bool in_bucket = detail::on_view(grad, view); // Note [Bucket views as .grad]
  const bool untouched_view = in_bucket && !touched[index].load(std::memory_order_relaxed);
  if (!grad.defined() || untouched_view) {
    view.zero_();
    bucket.missing.push_back(slot);
    return;
  }
  if (in_bucket) {
    return; // bucket view: backward already accumulated in place
  }
  check_gradient(grad, index, view);
  view.copy_(grad);
  if (config.options.gradient_as_bucket_view()) {
    // Someone replaced .grad (zero_grad(set_to_none=True)) or its storage
    // (.grad.data = t): re-point it.
    grad = detail::view_handle(view);
  }
}

void Reducer::State::launch_ready_buckets() {
  // Never the last bucket: see Note [The last bucket closes the window].
  while (window.next_launch + 1 < buckets.all.size() && buckets.all[window.next_launch].pending == 0) {
    launch_bucket(window.next_launch++);
    ++window.hook_launches;
  }
}

void Reducer::State::launch_rest() {
  while (window.next_launch < buckets.all.size()) {
    buckets.all[window.next_launch].pending = 0;
    launch_bucket(window.next_launch++);
  }
}

void Reducer::State::launch_bucket(size_t index) {
  auto& bucket = buckets.all[index];
  TORCH_INTERNAL_ASSERT(bucket.works.empty(), "gradaccum: bucket ", index, " launched twice in one reduction");
  auto meta = bucket_header(window.request, index);
  if (bucket.compressed && window.entry != detail::Entry::Refresh) { // (a refresh sends zeros)
    detail::compress(bucket, bucket.prescaled ? window.expected_weight : 1.0, window.residual_carry,
                     window.residual_rescale);
  }
  write_bucket_meta(bucket, meta);

  auto& times = window.timeline.buckets[index];
  times.launched = window.elapsed();
  if (times.ready < 0) {
    times.ready = times.launched; // completed at the end of backward
  }
  times.bytes = bucket.bytes();
  allreduce_bucket(index);
}

std::vector<double> Reducer::State::bucket_header(const ReductionRequest& request, size_t index) const {
  const auto& bucket = buckets.all[index];
  auto meta = detail::encode_header(request, config.rank, config.world, agreement_inputs(),
                                    static_cast<int64_t>(index), buckets.modulus, bucket.params.size());
  for (const auto slot : bucket.missing) {
    meta[kMetaHeader + slot] = 0;
  }
  return meta;
}

void Reducer::State::write_bucket_meta(Bucket& bucket, const std::vector<double>& header) {
  bucket.write_meta(header);
  if (window.request.loss_sum.defined() && bucket.encoding != MetaEncoding::kDigits) {
    // Note [The window's loss rides in the header]: device to device, the
    // loss and then the metrics.
    const auto sums = window.request.loss_sum.reshape({-1});
    bucket.meta.narrow(0, kLoss, sums.numel()).copy_(sums);
  }
}

void Reducer::State::allreduce_bucket(size_t index) {
  auto& bucket = buckets.all[index];
  TORCH_INTERNAL_ASSERT(bucket.works.empty(), "gradaccum: bucket ", index, " is still on the wire");
  std::vector<at::Tensor> tensors{bucket.wire};
  bucket.works.push_back(config.group->allreduce(tensors));
  if (bucket.encoding == MetaEncoding::kSeparate) {
    std::vector<at::Tensor> meta_tensors{bucket.meta};
    bucket.works.push_back(config.group->allreduce(meta_tensors));
  }
  stamp_completion(index);
  const auto launches = static_cast<int64_t>(bucket.works.size());
  TORCH_INTERNAL_ASSERT(launches == bucket.collectives());
  stats.collectives += launches;
  stats.last_window_collectives += launches;
  stats.bytes_reduced += bucket.bytes();
  stats.last_window_bytes += bucket.bytes();
}

// Note [The window's timeline]
// The reducer stamps what a bucket schedule works with and what it does: when
// each gradient's hook ran, when each bucket filled, launched and completed,
// when backward ended and when the window was written back, in seconds from
// the reduction's beginning (and that beginning on the system clock, for
// traces). A steady-clock read per gradient and per bucket,
// and a callback on each all-reduce's future: Gloo completes them on its own
// threads, so a stamp may land after wait() returned (Reducer::last_timeline()
// reads them later). NCCL marks its future complete once the work is queued on
// the stream, which says nothing of when it ran: CUDA buckets get no
// completion time (-1). A bucket sent twice (Note [Re-sending a light
// window]) keeps its first launch and takes the second all-reduce's
// completion, its bytes both sends': one span in a trace. Benchmarks derive
// the schedule bound from it (benchmarks/bench_net.py); stats() stays
// counters.
void Reducer::State::stamp_completion(size_t index) {
  auto& bucket = buckets.all[index];
  if (bucket.wire.is_cuda()) {
    return; // NCCL completes a future once the work is queued: no time to read (-1)
  }
  auto completion = std::make_shared<detail::Completion>();
  completion->pending = static_cast<int>(bucket.works.size());
  window.completed[index] = completion;
  const auto origin = window.origin;
  for (auto& work : bucket.works) {
    try {
      const auto future = work->getFuture();
      if (!future) {
        continue; // stays pending: unknown (-1)
      }
      future->addCallback([completion, origin](c10::ivalue::Future& /*future*/) {
        const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
            std::chrono::steady_clock::now() - origin).count();
        auto latest = completion->latest_ns.load();
        while (latest < now && !completion->latest_ns.compare_exchange_weak(latest, now)) {
        }
        completion->pending.fetch_sub(1);
      });
    } catch (const std::exception&) {
      // A backend without futures: the completion stays unknown (-1).
    }
  }
}

} // namespace gradaccum
