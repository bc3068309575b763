#include "buckets/bucket_set.h"

#include "comm.h"
#include "precision/precision.h"

#include <gradaccum/detail/testing.h>

#include <c10/util/irange.h>

#include <algorithm>
#include <string>

// Note [Rebuilding buckets in ready order]
// The first layout follows reverse registration order (assign_buckets), a
// guess at backward's order; when it is wrong (an embedding registered first
// but used last, modules built out of order) bucket 0 waits for the last
// gradient and nothing launches during backward. So, with
// ReducerOptions::rebuild_buckets, mark_ready records the order it sees the
// parameters in, and at the end of the first window reduced on every rank
// (the window's collectives of finish_reduction, which every rank reaches
// alike: the consensus held; never a dropped window, never a snapshot) every
// rank takes rank 0's order, by one broadcast, and rebuilds its buckets from
// it; parameters rank 0 did not see keep their relative order, at the end.
// The layouts stay identical across ranks, so the pairing holds (Note
// [Collectives pair by launch order]). A window in which rank 0 saw no hook at
// all (a flush after no_sync micro-steps) tries again at the next. Whether a
// rebuild is pending travels in every bucket's kKind field (kind_code()), so
// ranks that disagree (rebuild_buckets differs with check_parameters off) drop
// the window instead of mis-pairing. The order's broadcast is one of the
// window's collectives, before the write-back; the buckets are built after
// it, between windows, on every rank alike (even one whose write-back
// failed). Copy-mode and wide buckets then hold nothing the next window
// needs: their storage is freed before the new buckets are allocated, so the
// two layouts are never held at once (bucket views are .grad: they are
// copied into the new ones, as torch DDP does; only their compressed wires
// are freed first). Then every rank takes part in
// an allgather of its outcome (built, same layout, failed: a local failure,
// out of memory say, is caught, never skips the collective), and every rank
// keeps the old layout unless all built: a rank that freed its old buckets
// builds them again, from the memory the new ones just gave back (neither
// collective is a gradient reduction: stats count neither). Should even that
// fail, the rank is `lost`: every later call that reduces raises there, and
// the others wait for it in their next reduction until the group's timeout.
// Error feedback's residuals are held in both layouts while they move.

namespace gradaccum::detail {

std::atomic<int> testing::fail_rebuild_on_rank{-1};
std::atomic<int> testing::failing_rebuild_builds{1};

namespace {

// The tests' seam (gradaccum/detail/testing.h).
void inject_failure(int rank) {
  if (testing::fail_rebuild_on_rank.load() != rank) {
    return;
  }
  if (testing::failing_rebuild_builds.fetch_sub(1) <= 1) {
    testing::fail_rebuild_on_rank = -1;
  }
  TORCH_CHECK(false, "injected bucket rebuild failure");
}

// What one rank made of rank 0's order.
enum Outcome { kFailed = 0, kBuilt = 1, kSame = 2 };

// [how many parameters this rank saw ready (-1: recording failed), then every
// parameter: those in ready order first, the others in their bucket order].
std::vector<int64_t> encode_ready_order(const BucketSet& set, const ReducerConfig& config) {
  const auto n = config.params.size();
  std::vector<int64_t> order(n + 1, 0);
  try {
    std::vector<char> seen(n, 0);
    size_t k = 1;
    for (const auto i : set.ready_order) {
      TORCH_INTERNAL_ASSERT(!seen[i], "gradaccum: the ready order saw ", config.name(i), " twice");
      order[k++] = static_cast<int64_t>(i);
      seen[i] = 1;
    }
    // -2 when no hook ran (compiled autograd): no order will come; give up.
    order[0] = set.hookless ? -2 : static_cast<int64_t>(set.ready_order.size());
    for (const auto& bucket : set.all) {
      for (const auto i : bucket.params) {
        if (!seen[i]) {
          order[k++] = static_cast<int64_t>(i);
        }
      }
    }
    TORCH_INTERNAL_ASSERT(k == order.size());
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: recording backward's ready order failed on rank ", config.rank, ": ", message_of(e));
    order.assign(n + 1, 0);
    order[0] = -1;
  }
  return order;
}

// Rank 0's encode_ready_order(), on every rank (a collective).
std::vector<int64_t> broadcast_order(std::vector<int64_t> order, const ReducerConfig& config) {
  std::vector<at::Tensor> message{at::tensor(order, at::kLong).to(config.metadata_device())};
  config.group->broadcast(message)->wait();
  const auto agreed = message[0].cpu();
  const auto a = agreed.accessor<int64_t, 1>();
  for (const auto k : c10::irange(order.size())) {
    order[k] = a[static_cast<int64_t>(k)];
  }
  return order;
}

// Whether every rank built (kBuilt) or kept (kSame) its layout (a collective).
bool every_rank_built(const ReducerConfig& config, Outcome outcome, const std::string& error) {
  const auto flags = allgather(*config.group,
      at::full({1}, static_cast<double>(outcome), at::kDouble).to(config.metadata_device()));
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
    return false;
  }
  // The layout follows from rank 0's order alone: the same verdict everywhere.
  TORCH_INTERNAL_ASSERT(same == 0 || same == static_cast<int>(flags.size()),
      "gradaccum: ranks computed different bucket layouts from the same order");
  return true;
}

} // namespace

std::optional<RebuildPlan> BucketSet::agree_on_ready_order(const ReducerConfig& config) {
  // Every rank runs the broadcast, whatever fails locally (a rank that
  // skipped it would pair its next bucket with it).
  const auto agreed = broadcast_order(encode_ready_order(*this, config), config);
  if (agreed[0] == 0) {
    return std::nullopt; // rank 0 saw no hook this window: try again at the next
  }
  final = true; // on every rank alike: once tried, never again
  ready_order = {};
  if (agreed[0] < 0) {
    return std::nullopt; // rank 0 could not say (it warned)
  }
  RebuildPlan plan;
  try {
    std::vector<size_t> ready_by(agreed.begin() + 1, agreed.end());
    plan.layout = layout(config, ready_by);
    plan.same = plan.layout.size() == all.size() &&
        std::equal(plan.layout.begin(), plan.layout.end(), all.begin(),
                   [](const auto& indices, const Bucket& bucket) { return indices == bucket.params; });
  } catch (const std::exception& e) {
    plan.error = message_of(e);
  }
  return plan;
}

bool BucketSet::rebuild(RebuildPlan plan, const ReducerConfig& config, std::exception_ptr& failed) noexcept {
  Outcome outcome = plan.error.empty() && plan.same ? kSame : kFailed;
  std::string error = std::move(plan.error);
  std::optional<std::vector<Bucket>> built;
  std::vector<std::vector<at::Tensor>> residuals;
  std::vector<std::vector<size_t>> old_layout;
  bool released = false;
  if (outcome != kSame && error.empty()) {
    try {
      residuals = residuals_by_slot(all);
      for (const auto& bucket : all) {
        old_layout.push_back(bucket.params);
      }
      // Anything in the old storage was written back or zeroed: freed first,
      // so the two layouts are never held at once; but bucket views are
      // .grad, the window's gradient: they stay, and move into the new
      // buckets (switch_to).
      release(/*keep_views=*/config.options.gradient_as_bucket_view());
      released = true;
      inject_failure(config.rank);
      built = build(config, plan.layout);
      outcome = kBuilt;
    } catch (const std::exception& e) {
      built.reset();
      error = message_of(e);
    }
  }
  // Every rank runs the allgather, whatever failed here; every rank keeps the
  // old layout unless all built.
  bool every_rank = false;
  try {
    every_rank = every_rank_built(config, outcome, error);
  } catch (...) {
    failed = std::current_exception();
  }
  if (every_rank && outcome == kBuilt) {
    switch_to(std::move(*built), residuals, config);
    return true;
  }
  built.reset(); // its memory first: the old layout takes as much
  if (released) {
    try {
      inject_failure(config.rank);
      switch_to(build(config, old_layout), residuals, config); // (bucket views: .grad moves in again)
    } catch (const std::exception& e) {
      lost = "after a failed bucket rebuild, allocating the old buckets again failed on rank " +
          std::to_string(config.rank) + ": " + message_of(e);
      TORCH_WARN("gradaccum: ", lost, ", so this rank cannot reduce again: end training on every rank (the others "
                 "wait for it in their next reduction until the group's timeout) and resume from a checkpoint in new "
                 "Accumulators");
    }
  }
  return false;
}

void BucketSet::release(bool keep_views) {
  for (auto& bucket : all) {
    bucket.works.clear(); // (completed: they would keep the tensors they reduced)
    // A compressed wire and separate meta are scratch, bucket views or not
    // (a plain wire and its meta are parts of the buffer).
    bucket.wire_gradients = bucket.wire = bucket.meta = at::Tensor();
    bucket.meta_staging = bucket.residual = at::Tensor(); // (the residuals live on in residuals_by_slot())
    if (!keep_views) {
      bucket.views.clear();
      bucket.gradients = bucket.buffer = at::Tensor();
    }
  }
}

void BucketSet::switch_to(std::vector<Bucket> built, const std::vector<std::vector<at::Tensor>>& residuals,
                          const ReducerConfig& config) noexcept {
  // Between windows: copy-mode buckets are scratch (freed before the build)
  // and accumulating ones are zero, but bucket views are .grad, which holds
  // the window's gradient the user may still read: it moves into the new
  // views.
  if (config.options.gradient_as_bucket_view()) {
    try {
      point_grads_at_views(built, config.params, /*undefined_too=*/false);
    } catch (const std::exception& e) {
      TORCH_WARN("gradaccum: moving .grad into the rebuilt buckets failed: ", message_of(e));
    }
  }
  try {
    move_residuals(residuals, locator, built);
  } catch (const std::exception& e) {
    TORCH_WARN("gradaccum: moving the error-feedback residuals into the rebuilt buckets failed: ",
               message_of(e));
  }
  use(std::move(built), config.world);
}

} // namespace gradaccum::detail
