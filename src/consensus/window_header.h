#pragma once
// Internal: the header every bucket's collective carries (Note [Bucket meta
// layout]): what one rank writes into it, and what the sums over ranks say.

#include "consensus/agreement.h"

#include <gradaccum/bucket.h>
#include <gradaccum/reducer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gradaccum::detail {

/// The modulus M of Note [Bucket meta layout] for `buckets` summed over
/// `world` ranks: one for all buckets, which the narrowest meta decides.
int64_t header_modulus(const std::vector<Bucket>& buckets, int world);

/// 2^p, p the fewest exact integer bits among `buckets`' meta (53 where every
/// bucket's meta is float64 or digits, else 24): a sum of non-negative integer
/// weights below it is exact in every bucket, whatever order a collective
/// adds them in, since no partial sum exceeds it (Note [Writing back while
/// the last buckets reduce]).
double exact_weight_bound(const std::vector<Bucket>& buckets);

/// Bucket `bucket`'s meta as this rank (`rank` of `world`) sends it: the
/// header for `request` (Note [Bucket meta layout]), then `slots`
/// has-gradient flags, all 1.
std::vector<double> encode_header(const ReductionRequest& request, int rank, int world,
                                  const AgreementInputs& mine, int64_t bucket, int64_t modulus, size_t slots);

/// Why this rank cannot send `weight` in the headers of `buckets`: digit
/// encoded meta (kDigits) carries weights up to max_meta_value(kWeight), and
/// non-zero ones from min_meta_weight() on (a smaller one would round to zero,
/// the window going undivided). AbortReason::None when it can.
AbortReason unsendable_weight(const std::vector<Bucket>& buckets, double weight);

/// What every rank reads alike from one reduction's summed headers: numbers
/// only, so that reading them allocates nothing (Note [Reading the window
/// allocates nothing]); verdict_error() words a failed one.
struct Verdict {
  double global_weight = 0; ///< kWeight summed: the window's divisor
  int64_t flushing_ranks = 0;
  int64_t flushing_steps_ranks = 0;
  int64_t joined_ranks = 0;
  /// Whether every rank keeps the window, and if not, why every rank drops it.
  enum class Outcome {
    Agreed,
    Mispaired, ///< `bucket` met another bucket on some rank
    Dropped, ///< `aborters` dropped it
    Disagreed, ///< the ranks hold different values of `agreement` (`values`)
    Unstepped, ///< some ranks but not all did not step the window before (`unstepped`)
  } outcome = Outcome::Agreed;
  int64_t bucket = 0;
  Aborters aborters; ///< who dropped it (read from every reduction; none when it is not dropped)
  Unstepped unstepped; ///< who did not step the window before (read unless `aborters` dropped it)
  const Agreement* agreement = nullptr;
  HeaderValues values;

  bool agreed() const {
    return outcome == Outcome::Agreed;
  }
};

/// Who dropped the reduction whose last bucket's summed meta is `last`
/// (Bucket::read_meta()), over `world` ranks.
Aborters read_aborters(const std::vector<double>& last, int world);

/// Reads the summed meta each of `buckets` holds (Bucket::read_meta(), in
/// launch order). `mine` and `rank` are this rank's.
Verdict read_headers(const std::vector<Bucket>& buckets, const AgreementInputs& mine, int rank, int world,
                     int64_t modulus);

/// Why every rank drops the window, for a verdict that is not agreed; `where`
/// starts it ("gradaccum: acc.backward(): window 3").
std::string verdict_error(const Verdict& verdict, const std::string& where);

} // namespace gradaccum::detail
