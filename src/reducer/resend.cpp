// A window far lighter than its fp16 wire's scale, sent again at its own
// weight once every rank agreed on it (Note [Re-sending a light window], in
// src/precision/precision.cpp).

#include "reducer/state.h"

#include "comm.h"
#include "consensus/agreement.h"
#include "consensus/window_header.h"
#include "precision/precision.h"

#include <gradaccum/detail/testing.h>

#include <c10/util/irange.h>

#include <algorithm>
#include <exception>
#include <string>
#include <vector>

namespace gradaccum {

std::atomic<int> detail::testing::fail_resend_on_rank{-1};

namespace {

// The buckets a light window sends again: a prescaled fp16 wire (bf16 has
// float32's range).
bool sent_again_when_light(const Bucket& bucket) {
  return bucket.prescaled && bucket.wire_gradients.scalar_type() == at::kHalf;
}

} // namespace

double Reducer::State::wire_scale(const Bucket& bucket) const {
  if (!bucket.prescaled) {
    return 1.0;
  }
  return window.resent_weight > 0 && sent_again_when_light(bucket) ? window.resent_weight : window.expected_weight;
}

void Reducer::State::resend_if_light(const detail::Verdict& verdict) {
  // See Note [Re-sending a light window]. Every input to this decision is
  // the same on every rank: the summed weight, E, and the buckets' dtypes.
  const double weight = verdict.global_weight;
  const auto light = sent_again_when_light;
  if (!(weight > 0) || window.expected_weight < detail::kLightWindow * weight ||
      std::none_of(buckets.all.begin(), buckets.all.end(), light)) {
    return;
  }
  window.resent_weight = weight;
  auto request = window.request;
  std::string local;
  try {
    int failing = config.rank; // (the tests' seam: gradaccum/detail/testing.h)
    TORCH_CHECK(!detail::testing::fail_resend_on_rank.compare_exchange_strong(failing, -1),
                "injected resend failure");
    const double factor = window.expected_weight / weight;
    const bool feedback = window.residual_carry != 0.0;
    for (auto& bucket : buckets.all) {
      if (light(bucket)) {
        detail::rescale_wire(bucket, factor, weight, feedback && bucket.residual.defined());
      }
    }
  } catch (const std::exception& e) {
    // Zeros and the drop's flag: the pairing holds, and no rank steps a sum
    // without this rank's share.
    local = detail::message_of(e);
    request.abort = AbortReason::ResendFailed;
    for (auto& bucket : buckets.all) {
      if (light(bucket)) {
        try {
          bucket.wire_gradients.zero_();
        } catch (...) {
        }
      }
    }
  }
  // Note [Collectives pair by launch order]: the light buckets in index
  // order, on every rank, after every first all-reduce of the window. A
  // launch that fails here (out of memory for the header) cannot pair: this
  // rank waits for what it launched and raises; the others meet the missing
  // collective's transport error or the group's timeout.
  std::vector<size_t> resent;
  try {
    for (const auto b : c10::irange(buckets.all.size())) {
      auto& bucket = buckets.all[b];
      if (!light(bucket)) {
        continue;
      }
      write_bucket_meta(bucket, bucket_header(request, b)); // (the loss too, where the header is not digits)
      bucket.works.clear();
      resent.push_back(b);
      allreduce_bucket(b); // Note [The window's timeline]: it completes with this one
      window.timeline.buckets[b].bytes += bucket.bytes();
    }
  } catch (const std::exception& e) {
    const auto local_error = detail::message_of(e);
    for (const auto b : resent) {
      for (auto& work : buckets.all[b].works) {
        try {
          work->wait();
        } catch (...) {
        }
      }
    }
    fail_worded([&] {
      return where() + ": rank " + std::to_string(config.rank) + " could not launch the window's second "
          "all-reduce (Note [Re-sending a light window]), so the ranks' collectives no longer pair: " +
          local_error + ". The window was dropped here; the other ranks fail in that all-reduce. End training on "
          "every rank (or resume every rank from a checkpoint)";
    });
  }
  detail::Aborters who;
  try {
    for (const auto b : resent) {
      wait_bucket(b);
    }
    for (const auto b : resent) {
      buckets.all[b].read_meta();
    }
    who = detail::read_aborters(buckets.all[resent.back()].meta_values, config.world);
  } catch (const std::exception& e) {
    fail_worded([&] {
      return where() + ", " + detail::message_of(e) + " (the window's second all-reduce: Note [Re-sending a light "
          "window])";
    });
  }
  if (who.count > 0) {
    fail_worded([&] {
      if (request.abort == AbortReason::None) {
        return detail::dropped_elsewhere(where(), who, verdict.joined_ranks);
      }
      const int64_t other = who.count == 2 ? (who.ranks[0] == config.rank ? who.ranks[1] : who.ranks[0]) : -1;
      return detail::dropped_here(where(), config.rank, AbortReason::ResendFailed, local, "", verdict.joined_ranks,
                                  0, 0, 0, who.count - 1, other);
    });
  }
}

} // namespace gradaccum
