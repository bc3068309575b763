#include "consensus/window_header.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace gradaccum::detail {

namespace {

// The largest power of two M with world * (M - 1)^2 and world * M exact in
// the meta's dtype.
int64_t consensus_modulus(int world, at::ScalarType meta_dtype) {
  const int mantissa = meta_dtype == at::kDouble ? 53 : 24;
  int world_bits = 0;
  while ((int64_t{1} << world_bits) < world) {
    ++world_bits;
  }
  const int bits = std::max(1, std::min(20, (mantissa - world_bits) / 2));
  return int64_t{1} << bits;
}

int64_t residue(int64_t v, int64_t modulus) {
  return ((v % modulus) + modulus) % modulus;
}

// A value every rank must share, as (v mod M, (v mod M)^2).
void put_squared(std::vector<double>& meta, MetaField field, int64_t v, int64_t modulus) {
  const auto m = static_cast<double>(residue(v, modulus));
  meta[field] = m;
  meta[field + 1] = m * m;
}

int64_t rounded(double v) {
  return static_cast<int64_t>(std::llround(v));
}

} // namespace

int64_t header_modulus(const std::vector<Bucket>& buckets, int world) {
  auto modulus = consensus_modulus(world, at::kDouble);
  for (const auto& bucket : buckets) {
    // Digits carry integers below 2^32, so squares of values below 2^16.
    modulus = std::min(modulus, bucket.encoding == MetaEncoding::kDigits
        ? int64_t{1} << 16 : consensus_modulus(world, bucket.meta.scalar_type()));
  }
  return modulus;
}

std::vector<double> encode_header(const ReductionRequest& request, int rank, const AgreementInputs& mine,
                                  int64_t bucket, int64_t modulus, size_t slots) {
  std::vector<double> meta(static_cast<size_t>(kMetaHeader) + slots, 1.0);
  const bool aborting = request.abort != AbortReason::None;
  meta[kWeight] = aborting ? 0 : request.weight;
  meta[kFlushing] = request.flushing ? 1 : 0;
  meta[kJoined] = request.joined ? 1 : 0;
  // launch_bucket() writes the loss and the metrics on their device.
  std::fill(meta.begin() + kLoss, meta.begin() + kMetaHeader, 0.0);
  meta[kAbort] = aborting ? 1 : 0;
  meta[kAbortRank] = aborting ? rank : 0;
  meta[kAbortReason] = static_cast<double>(static_cast<int64_t>(request.abort));
  put_squared(meta, kBucketIndex, bucket, modulus);
  // Among them the kind, which also says whether this reduction ends with
  // the one-time bucket rebuild's collectives (Note [Rebuilding buckets in
  // ready order]), so that ranks that disagree drop the window instead of
  // mis-pairing them.
  for (const auto& agreement : agreements()) {
    if (agreement.field != kMetaHeader) {
      put_squared(meta, agreement.field, static_cast<int64_t>(agreement.value(mine)), modulus);
    }
  }
  return meta;
}

AbortReason unsendable_weight(const std::vector<Bucket>& buckets, double weight) {
  const bool digits = std::any_of(buckets.begin(), buckets.end(),
                                  [](const Bucket& b) { return b.encoding == MetaEncoding::kDigits; });
  if (!digits) {
    return AbortReason::None;
  }
  if (weight > Bucket::max_meta_value(kWeight)) {
    return AbortReason::WeightTooLarge;
  }
  if (weight > 0 && weight < Bucket::min_meta_weight()) {
    return AbortReason::WeightTooSmall;
  }
  return AbortReason::None;
}

Verdict read_headers(const std::vector<std::vector<double>>& summed, const AgreementInputs& mine, int rank,
                     int world, int64_t modulus, const std::string& where) {
  TORCH_INTERNAL_ASSERT(!summed.empty(), "gradaccum: a reduction without buckets");
  const double w = world;
  // Over W ranks the values are all equal iff W * sum(v^2) == sum(v)^2.
  const auto all_equal = [&](const std::vector<double>& h, MetaField field) {
    return w * h[field + 1] == h[field] * h[field];
  };
  // The last bucket carries every rank's final word (Note [The last bucket
  // closes the window]).
  const auto& last = summed.back();
  Verdict verdict;
  verdict.global_weight = last[kWeight];
  verdict.flushing_ranks = rounded(last[kFlushing]);
  verdict.joined_ranks = rounded(last[kJoined]);
  verdict.loss_sum = last[kLoss];
  verdict.metric_sums.assign(last.begin() + kMetric0, last.begin() + kMetaHeader);
  for (const auto b : c10::irange(summed.size())) {
    if (!all_equal(summed[b], kBucketIndex)) {
      verdict.error = mispaired(where, static_cast<int64_t>(b));
      return verdict;
    }
  }
  const auto aborting = rounded(last[kAbort]);
  if (aborting > 0) {
    const auto why = static_cast<AbortReason>(aborting == 1 ? rounded(last[kAbortReason]) : 0);
    verdict.error = dropped_elsewhere(where, aborting, rounded(last[kAbortRank]), why);
    return verdict;
  }
  for (const auto& agreement : agreements()) {
    if (agreement.field == kMetaHeader || all_equal(last, agreement.field)) {
      continue;
    }
    HeaderValues values;
    values.mine = static_cast<int64_t>(agreement.value(mine));
    values.rank = rank;
    values.world = world;
    const auto mine_mod = residue(values.mine, modulus);
    if (world == 2 && agreement.small) {
      values.other = rounded(last[agreement.field]) - mine_mod;
    } else {
      values.mean = last[agreement.field] / w + static_cast<double>(values.mine - mine_mod);
    }
    verdict.error = window_disagreement(where, agreement, values);
    return verdict;
  }
  return verdict;
}

} // namespace gradaccum::detail
