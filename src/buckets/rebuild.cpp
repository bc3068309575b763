#include "reducer/state.h"

#include <algorithm>

namespace gradaccum {

// Note [Rebuilding buckets in ready order]
// The first layout follows reverse registration order (assign_buckets), a
// guess at backward's order; when it is wrong (an embedding registered first
// but used last, modules built out of order) bucket 0 waits for the last
// gradient and nothing launches during backward. So, with
// ReducerOptions::rebuild_buckets, mark_ready records the order it sees the
// parameters in, and at the end of the first window reduced on every rank
// (phase 3 of finish_reduction, which every rank reaches alike: the consensus
// held; never a dropped window, never a snapshot) every rank takes rank 0's
// order, by one broadcast, and rebuilds its buckets from it; parameters rank 0
// did not see keep their relative order, at the end. The layouts stay
// identical across ranks, so the pairing above holds. A window in which rank 0
// saw no hook at all (a flush after no_sync micro-steps) tries again at the
// next. Whether a rebuild is pending travels in every bucket's kKind field
// (kind_code()), so ranks that disagree (rebuild_buckets differs with
// check_parameters off) drop the window instead of mis-pairing. Once rank 0
// sent an order, every rank takes part in an allgather of its outcome (built,
// same layout, failed: a local failure, out of memory say, is caught, never
// skips the collective) and every rank keeps the old buckets unless all built
// (neither it nor the broadcast is a gradient reduction: stats count neither). Done before
// the write-back, as every collective of phase 3, and applied after it (even
// if this rank's write-back fails): between windows only.
//

std::vector<Bucket> Reducer::State::build_buckets(const std::vector<std::vector<size_t>>& layout) const {
  // The one place buckets are made: construction and the rebuild alike.
  std::vector<Bucket> built;
  built.reserve(layout.size());
  for (const auto& indices : layout) {
    built.emplace_back(params, indices,
        BucketConfig{rule.accumulate_dtype, rule.comm_dtype, world, rule.error_feedback});
  }
  return built;
}

void Reducer::State::use_buckets(std::vector<Bucket> built) {
  buckets = std::move(built);
  locator.assign(params.size(), {0, 0});
  for (const auto b : c10::irange(buckets.size())) {
    for (const auto slot : c10::irange(buckets[b].params.size())) {
      locator[buckets[b].params[slot]] = {b, slot};
    }
  }
  // One modulus for all buckets: the narrowest meta dtype decides.
  modulus = consensus_modulus(world, at::kDouble);
  for (const auto& bucket : buckets) {
    // Digits carry integers below 2^32, so squares of values below 2^16.
    modulus = std::min(modulus, bucket.encoding == MetaEncoding::kDigits
        ? int64_t{1} << 16 : consensus_modulus(world, bucket.meta.scalar_type()));
  }
  summed_meta.assign(buckets.size(), {});
  stats.buckets = static_cast<int64_t>(buckets.size());
}

void Reducer::State::broadcast_parameters_from_rank0() {
  // The buckets are flat buffers shaped like the parameters: broadcast through
  // them, one collective per bucket and no temporary copy of the model.
  at::NoGradGuard no_grad;
  for (auto& bucket : buckets) {
    for (const auto slot : c10::irange(bucket.params.size())) {
      bucket.views[slot].copy_(params[bucket.params[slot]]);
    }
    std::vector<at::Tensor> flat{bucket.gradients};
    group->broadcast(flat)->wait();
    for (const auto slot : c10::irange(bucket.params.size())) {
      params[bucket.params[slot]].copy_(bucket.views[slot]);
    }
    bucket.gradients.zero_();
  }
}

std::optional<std::vector<Bucket>> Reducer::State::agree_on_ready_order() {
  // Every rank runs the broadcast and then the allgather below, whatever fails
  // locally (a rank that skipped one would pair its next bucket with it).
  // [how many parameters rank 0 saw ready (-1: it failed), then the order of all]
  std::vector<int64_t> order(params.size() + 1, 0);
  try {
    std::vector<char> seen(params.size(), 0);
    size_t k = 1;
    for (const auto i : ready_order) {
      TORCH_INTERNAL_ASSERT(!seen[i], "gradaccum: the ready order saw ", name(i), " twice");
      order[k++] = static_cast<int64_t>(i);
      seen[i] = 1;
    }
    order[0] = static_cast<int64_t>(ready_order.size());
    for (const auto& bucket : buckets) {
      for (const auto i : bucket.params) {
        if (!seen[i]) {
          order[k++] = static_cast<int64_t>(i);
        }
      }
    }
    TORCH_INTERNAL_ASSERT(k == order.size());
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: recording backward's ready order failed on rank ", rank, ": ", message_of(e));
    order.assign(params.size() + 1, 0);
    order[0] = -1;
  }
  std::vector<at::Tensor> message{at::tensor(order, at::kLong).to(metadata_device())};
  group->broadcast(message)->wait();
  const auto agreed = message[0].cpu();
  const auto a = agreed.accessor<int64_t, 1>();
  if (a[0] == 0) {
    return std::nullopt; // rank 0 saw no hook this window: try again at the next
  }
  buckets_final = true; // on every rank alike: once tried, never again
  ready_order = {};
  if (a[0] < 0) {
    return std::nullopt; // rank 0 could not say (it warned)
  }
  // 1: built, 2: the layout would not change, 0: failed here.
  enum Outcome { kFailed = 0, kBuilt = 1, kSame = 2 };
  std::optional<std::vector<Bucket>> built;
  std::string error;
  Outcome outcome = kFailed;
  try {
    std::vector<size_t> ready_by(params.size());
    for (const auto k : c10::irange(params.size())) {
      ready_by[k] = static_cast<size_t>(a[static_cast<int64_t>(k) + 1]);
    }
    const auto layout = assign_buckets(
        params,
        static_cast<int64_t>(options.first_bucket_cap_mb() * kMiB),
        static_cast<int64_t>(options.bucket_cap_mb() * kMiB),
        ready_by);
    const bool same = layout.size() == buckets.size() &&
        std::equal(layout.begin(), layout.end(), buckets.begin(),
                   [](const auto& indices, const Bucket& bucket) { return indices == bucket.params; });
    if (same) {
      outcome = kSame;
    } else {
      built = build_buckets(layout);
      outcome = kBuilt;
    }
  } catch (const std::exception& e) {
    error = message_of(e);
  }
  // Every rank switches, or none does.
  const auto flags = allgather(*group, at::full({1}, static_cast<double>(outcome), at::kDouble).to(metadata_device()));
  int failed = 0;
  int same = 0;
  for (const auto& flag : flags) {
    const auto theirs = static_cast<int>(flag.item<double>());
    failed += theirs == kFailed ? 1 : 0;
    same += theirs == kSame ? 1 : 0;
  }
  if (failed > 0) {
    TORCH_WARN("gradaccum: rebuilding the buckets in backward's order failed on ", failed,
        " rank(s)", error.empty() ? std::string() : " (on this rank: " + error + ")",
        "; every rank keeps the buckets it has");
    return std::nullopt;
  }
  // The layout follows from rank 0's order alone: the same verdict everywhere.
  TORCH_INTERNAL_ASSERT(same == 0 || same == static_cast<int>(flags.size()),
      "gradaccum: ranks computed different bucket layouts from the same order");
  return same > 0 ? std::nullopt : std::move(built);
}

void Reducer::State::switch_buckets(std::vector<Bucket> built) noexcept {
  // Between windows: copy-mode buckets are scratch and accumulating ones are
  // zero, but bucket views are .grad, which holds the window's gradient the
  // user may still read: it moves into the new views.
  if (options.gradient_as_bucket_view()) {
    try {
      at::NoGradGuard no_grad;
      for (auto& bucket : built) {
        for (const auto slot : c10::irange(bucket.params.size())) {
          auto& grad = params[bucket.params[slot]].mutable_grad();
          if (grad.defined()) {
            bucket.views[slot].copy_(grad);
            grad = view_handle(bucket.views[slot]);
          }
        }
      }
    } catch (const std::exception& e) {
      TORCH_WARN("gradaccum: moving .grad into the rebuilt buckets failed: ", message_of(e));
    }
  }
  // Error feedback: each parameter's residual moves into its new bucket.
  try {
    at::NoGradGuard no_grad;
    const auto slice = [this](const Bucket& bucket, size_t slot) {
      int64_t offset = 0;
      for (size_t k = 0; k < slot; ++k) {
        offset += params[bucket.params[k]].numel();
      }
      return bucket.residual.narrow(0, offset, params[bucket.params[slot]].numel());
    };
    for (auto& bucket : built) {
      if (!bucket.residual.defined()) {
        continue;
      }
      for (const auto slot : c10::irange(bucket.params.size())) {
        const auto [b, old_slot] = locator[bucket.params[slot]];
        if (buckets[b].residual.defined()) {
          slice(bucket, slot).copy_(slice(buckets[b], old_slot));
        }
      }
    }
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: moving the error-feedback residuals into the rebuilt buckets failed: ",
               message_of(e));
  }
  use_buckets(std::move(built));
  ++stats.bucket_rebuilds;
}

} // namespace gradaccum
