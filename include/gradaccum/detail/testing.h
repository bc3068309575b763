#pragma once
// Internal: seams for gradaccum's own tests (tests/cpp). Not part of the API:
// they may change or go in any release.

#include <atomic>

namespace gradaccum::detail::testing {

/// The rank whose next builds in a bucket rebuild fail, as if out of memory
/// (-1: none), and how many: 1, the new layout's (after the old buckets were
/// freed); 2, the old layout's again too. Note [Rebuilding buckets in ready
/// order]. Set the count first.
extern std::atomic<int> fail_rebuild_on_rank;
extern std::atomic<int> failing_rebuild_builds;

/// The rank whose next rounding of a light window for its second all-reduce
/// fails once, as if out of memory (-1: none). Note [Re-sending a light
/// window].
extern std::atomic<int> fail_resend_on_rank;

} // namespace gradaccum::detail::testing
