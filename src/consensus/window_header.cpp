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

double exact_weight_bound(const std::vector<Bucket>& buckets) {
  int bits = 53;
  for (const auto& bucket : buckets) {
    const bool wide = bucket.encoding == MetaEncoding::kDigits ||
        (bucket.encoding == MetaEncoding::kPlain && bucket.meta.scalar_type() == at::kDouble);
    bits = std::min(bits, wide ? 53 : 24);
  }
  return std::ldexp(1.0, bits);
}

std::vector<double> encode_header(const ReductionRequest& request, int rank, int world,
                                  const AgreementInputs& mine, int64_t bucket, int64_t modulus, size_t slots) {
  std::vector<double> meta(static_cast<size_t>(kMetaHeader) + slots, 1.0);
  const bool aborting = request.abort != AbortReason::None;
  meta[kWeight] = aborting ? 0 : request.weight;
  meta[kFlushing] = request.flushing ? 1 : 0;
  meta[kFlushingSteps] = request.flushing && request.flushing_steps ? 1 : 0;
  meta[kJoined] = request.joined ? 1 : 0;
  meta[kInexactWeight] = meta[kWeight] == std::floor(meta[kWeight]) ? 0 : 1;
  meta[kUnstepped] = mine.unstepped ? 1 : 0; // Note [A window not stepped on some ranks]
  meta[kUnsteppedRank] = mine.unstepped ? rank : 0;
  // launch_bucket() writes the loss and the metrics on their device.
  std::fill(meta.begin() + kLoss, meta.begin() + kMetaHeader, 0.0);
  // Who drops it, and why (Note [Every rank reads what several aborters did]).
  meta[kAbort] = aborting ? 1 : 0;
  meta[kAbortRank] = aborting ? rank : 0;
  meta[kAbortRankSquare] = aborting && world <= kNamedAbortersWorld ? static_cast<double>(rank) * rank : 0;
  std::fill(meta.begin() + kAbortReasons, meta.begin() + kAbortReasons + kAbortReasonSlots, 0.0);
  if (aborting) {
    const auto why = static_cast<int64_t>(request.abort);
    TORCH_INTERNAL_ASSERT(why >= 1 && why <= kAbortReasonSlots, "gradaccum: abort reason ", why);
    meta[kAbortReasons + why - 1] = 1;
  }
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

Aborters read_aborters(const std::vector<double>& last, int world) {
  static_assert(static_cast<int64_t>(AbortReason::Interrupted) == kAbortReasonSlots,
                "gradaccum: one kAbortReasons field per AbortReason after None");
  Aborters who;
  who.count = rounded(last[kAbort]);
  for (const auto r : c10::irange(kAbortReasonSlots)) {
    who.by_reason[static_cast<size_t>(r)] = rounded(last[kAbortReasons + r]);
  }
  const auto sum = rounded(last[kAbortRank]);
  if (who.count == 1) {
    who.ranks[0] = sum;
  } else if (who.count == 2 && world <= kNamedAbortersWorld) {
    // r0 + r1 = sum and r0^2 + r1^2 = squares, so r1 - r0 = sqrt(2 squares - sum^2).
    const auto squares = rounded(last[kAbortRankSquare]);
    const auto gap = rounded(std::sqrt(static_cast<double>(std::max<int64_t>(0, 2 * squares - sum * sum))));
    const auto r0 = (sum - gap) / 2;
    const auto r1 = sum - r0;
    if (gap > 0 && r0 >= 0 && r1 < world && r0 * r0 + r1 * r1 == squares) {
      who.ranks = {r0, r1};
    }
  }
  return who;
}

// Note [A window not stepped on some ranks]
// Every rank reduces a window alike, but steps it on its own: a rank whose
// acc.step() raised (its optimizer, a hook) and that then drops the closed
// window with acc.zero_grad(), or one that failed after every rank agreed on
// the window (its write-back, a buffer broadcast: the reducer cleared its
// window, Note [Finishing a reduction]), goes on with other weights than the
// ranks that stepped it, and nothing else would ever tell them. Such a rank
// says so in its next reduction, whatever it is (kUnstepped, kUnsteppedRank:
// Reducer::mark_unstepped()), and where some ranks but not all did, every
// rank drops that reduction and raises, naming the rank when one: the
// replicas differ. Where every rank dropped the window alike (a skip decided
// on the window's global loss, nonfinite="raise" followed by acc.zero_grad()
// everywhere, Lightning dropping a cut window), the replicas are the same and
// nothing is said. What acc.step() itself skips (a loss scaler's overflow,
// nonfinite="skip") is decided on the reduced window, the same everywhere,
// and marks it too: a rank whose acc.step() raised before that decision and
// that dropped the window then keeps the count whole (neither stepped). An
// empty window is marked nowhere. A window whose optimizer stepped before its
// scheduler raised is marked when dropped (the scheduler's state differs),
// and a retry of acc.step() runs the scheduler only. A closed window that
// acc.flush() or acc.join() cannot step drops their reduction itself
// (AbortReason::ClosedWindowNotStepped), which tells every rank that the
// replicas differ, and so clears every rank's mark; it says so even where
// the others skipped that window (a rank failing before the skip decision:
// a rare false alarm). The mark is kept through a reduction some rank drops
// for another reason or mis-pairs (its text would not say it) and cleared by
// any other, and by acc.load_state_dict() (every rank resumes alike). A rank
// with no reduction after its mark (the job's last window) tells nobody.
Verdict read_headers(const std::vector<Bucket>& buckets, const AgreementInputs& mine, int rank, int world,
                     int64_t modulus) {
  TORCH_INTERNAL_ASSERT(!buckets.empty(), "gradaccum: a reduction without buckets");
  const double w = world;
  // Over W ranks the values are all equal iff W * sum(v^2) == sum(v)^2.
  const auto all_equal = [&](const std::vector<double>& h, MetaField field) {
    return w * h[field + 1] == h[field] * h[field];
  };
  // The last bucket carries every rank's final word (Note [The last bucket
  // closes the window]).
  const auto& last = buckets.back().meta_values;
  Verdict verdict;
  verdict.global_weight = last[kWeight];
  verdict.flushing_ranks = rounded(last[kFlushing]);
  verdict.flushing_steps_ranks = rounded(last[kFlushingSteps]);
  verdict.joined_ranks = rounded(last[kJoined]);
  verdict.aborters = read_aborters(last, world);
  for (const auto b : c10::irange(buckets.size())) {
    if (!all_equal(buckets[b].meta_values, kBucketIndex)) {
      verdict.outcome = Verdict::Outcome::Mispaired;
      verdict.bucket = static_cast<int64_t>(b);
      return verdict;
    }
  }
  if (verdict.aborters.count > 0) {
    verdict.outcome = Verdict::Outcome::Dropped;
    return verdict;
  }
  // Note [A window not stepped on some ranks]
  verdict.unstepped.count = rounded(last[kUnstepped]);
  if (verdict.unstepped.count > 0 && verdict.unstepped.count < world) {
    verdict.unstepped.rank = verdict.unstepped.count == 1 ? rounded(last[kUnsteppedRank]) : -1;
    verdict.unstepped.world = world;
    verdict.unstepped.reader = rank;
    verdict.unstepped.here = mine.unstepped;
    verdict.outcome = Verdict::Outcome::Unstepped;
    return verdict;
  }
  for (const auto& agreement : agreements()) {
    if (agreement.field == kMetaHeader || all_equal(last, agreement.field)) {
      continue;
    }
    auto& values = verdict.values;
    values.mine = static_cast<int64_t>(agreement.value(mine));
    values.rank = rank;
    values.world = world;
    const auto mine_mod = residue(values.mine, modulus);
    if (world == 2 && agreement.small) {
      values.other = rounded(last[agreement.field]) - mine_mod;
    } else {
      values.mean = last[agreement.field] / w + static_cast<double>(values.mine - mine_mod);
    }
    verdict.outcome = Verdict::Outcome::Disagreed;
    verdict.agreement = &agreement;
    return verdict;
  }
  return verdict;
}

std::string verdict_error(const Verdict& verdict, const std::string& where) {
  switch (verdict.outcome) {
    case Verdict::Outcome::Mispaired:
      return mispaired(where, verdict.bucket);
    case Verdict::Outcome::Dropped:
      return dropped_elsewhere(where, verdict.aborters, verdict.joined_ranks);
    case Verdict::Outcome::Disagreed:
      return window_disagreement(where, *verdict.agreement, verdict.values);
    case Verdict::Outcome::Unstepped:
      return not_stepped(where, verdict.unstepped, verdict.joined_ranks);
    case Verdict::Outcome::Agreed:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "gradaccum: verdict_error() for an agreed window");
}

} // namespace gradaccum::detail
