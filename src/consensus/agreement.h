#pragma once
// Internal: the one table of what every rank must agree on, and the texts of
// the errors every rank raises when they do not, or when one of them drops a
// window.

#include <gradaccum/bucket.h>
#include <gradaccum/reducer.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

// Note [What ranks agree on]
// Ranks built differently would reduce silently wrong windows, or pair
// collectives that do not belong together. Every value that must be equal on
// every rank is listed once, in agreements(): check_ranks_match() compares the
// ones marked `at_construction` (an allgather when the Accumulator is built,
// with check_parameters), and every reduction carries the ones with a header
// `field` in each bucket's meta (Note [Bucket meta layout]), so that a
// difference construction did not see (check_parameters off, a rank that ran
// another reduction) drops the window on every rank with the same error. The
// one value outside the table is the bucket's index: it checks the pairing
// itself (Note [Collectives pair by launch order]), bucket by bucket.

namespace gradaccum::detail {

/// How a value reads in an error (Optional: a negative value reads "None";
/// Flag: 1 reads "yes", 0 "no"; NonFinite: the policy's name; Names: a hash
/// of a list of names, which the construction error replaces by the first
/// name that differs; Kind: a reduction's kind code, State::kind_code(), as
/// the call that ran it).
enum class Shown { Number, Reduction, Dtype, Optional, Flag, Names, Kind, NonFinite };

/// Where one rank's values come from.
struct AgreementInputs {
  const WindowRule& rule;
  const ReducerOptions& options;
  size_t parameters = 0;
  int64_t window = 0; ///< the reduction's sequence number
  int64_t kind = 0; ///< the reduction's kind code (State::kind_code())
  bool one_host = false; ///< ReducerConfig::one_host
  /// The trainable parameters' names, in the reducer's order (construction only).
  const std::vector<std::string>* names = nullptr;
  /// Why this rank did not step the last window every rank reduced (Note [A
  /// window not stepped on some ranks]); null: it did.
  const char* unstepped = nullptr;
  /// The reducer's number among those built over the group, agreed when it
  /// was built (Note [Which Accumulator a collective belongs to]).
  int64_t instance = 0;
};

/// One value every rank must hold alike.
struct Agreement {
  const char* what; ///< its name in errors
  Shown shown;
  double (*value)(const AgreementInputs& inputs);
  bool at_construction; ///< compared when the reducer is built
  MetaField field; ///< carried in every bucket's header; kMetaHeader: not carried
  /// Its values stay below the consensus modulus: with two ranks, the other
  /// rank's value can be read back from the sum.
  bool small;
  /// What the error advises (a window's, after ". "; or, for a value compared
  /// at construction only, the construction error's, after "); ");
  /// nullptr: use the same options everywhere.
  const char* remedy;
  /// Shown::Names: the names the value hashes.
  const std::vector<std::string>* (*names)(const AgreementInputs& inputs) = nullptr;
};

/// The table (Note [What ranks agree on]).
const std::vector<Agreement>& agreements();

/// `value` as an error shows it.
std::string show(Shown shown, double value);

/// The construction-time error for `agreement` (after "gradaccum:
/// Accumulator(): "); `values` holds every rank's.
std::string construction_disagreement(const Agreement& agreement, const std::vector<double>& values);

/// The same for a Shown::Names value, from every rank's names (gathered only
/// when the hashes differ): the first position where a rank's differ from
/// rank 0's.
std::string construction_disagreement(const Agreement& agreement,
                                      const std::vector<std::vector<std::string>>& names);

/// What a window's summed headers tell about one value that differs.
struct HeaderValues {
  int64_t mine = 0;
  int rank = 0;
  int world = 1;
  std::optional<int64_t> other; ///< the other rank's (two ranks, small values)
  double mean = 0; ///< over the ranks (otherwise)
};

/// A window's error for `agreement`; `where` starts it ("gradaccum:
/// acc.backward(): window 3").
std::string window_disagreement(const std::string& where, const Agreement& agreement,
                                const HeaderValues& values);

/// A window's error when bucket `bucket` met another bucket on some rank.
std::string mispaired(const std::string& where, int64_t bucket);

/// Who dropped a reduction, as its summed header says (kAbort, kAbortRank,
/// kAbortRankSquare, kAbortReasons...: Note [Bucket meta layout]).
struct Aborters {
  int64_t count = 0; ///< ranks that dropped it
  /// Of them, how many for each AbortReason after None (index: reason - 1).
  std::array<int64_t, kAbortReasonSlots> by_reason{};
  /// The one rank (count 1), or the two (count 2, up to kNamedAbortersWorld
  /// ranks), in increasing order; -1 where the header cannot tell.
  std::array<int64_t, 2> ranks{-1, -1};

  int64_t of(AbortReason why) const {
    const auto r = static_cast<int64_t>(why);
    return r >= 1 && r <= kAbortReasonSlots ? by_reason[static_cast<size_t>(r - 1)] : 0;
  }
  /// The reason every one of them has, None where they differ (or none dropped it).
  AbortReason shared() const;
};

/// The ranks that did not step the last window every rank reduced (kUnstepped,
/// kUnsteppedRank: Note [A window not stepped on some ranks]).
struct Unstepped {
  int64_t count = 0;
  int64_t rank = -1; ///< the one rank (count 1)
  int world = 1;
  int reader = 0; ///< this rank
  const char* here = nullptr; ///< why this rank did not, when it is one of them
};

/// The error every rank raises when some ranks but not all did not step the
/// window before.
std::string not_stepped(const std::string& where, const Unstepped& who, int64_t joined = 0);

/// Why the window was dropped, as every rank but the dropping ones reads it:
/// `who` dropped it; `joined` ranks were in acc.join() (Note [A window
/// dropped while ranks shadow]).
std::string dropped_elsewhere(const std::string& where, const Aborters& who, int64_t joined);

/// The error of a rank that dropped the window itself (this rank, `rank`),
/// for `why`: the same text as the others', about "this rank", with what
/// failed here (`local`, when known) and what failed while dropping it
/// (`transport`, when anything did). `left` of the ranks dropping it left
/// their join() block with an exception, `unstepped` could not step a window
/// they closed, `interrupted` were interrupted (this rank among them, or
/// not). `others` more ranks dropped it
/// (`other_rank` the one, -1 where the header does not name it), of `world`
/// (0: not known).
std::string dropped_here(const std::string& where, int rank, AbortReason why, const std::string& local,
                         const std::string& transport, int64_t joined, int64_t left, int64_t unstepped,
                         int64_t interrupted = 0, int64_t others = 0, int64_t other_rank = -1, int world = 0);

} // namespace gradaccum::detail
