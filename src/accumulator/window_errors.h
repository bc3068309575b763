#pragma once
// Internal: errors the Accumulator's window paths share.

#include <gradaccum/reducer.h>

#include <exception>
#include <string>

namespace gradaccum::detail {

/// Every rank reduced the window; this one failed afterwards (its write-back,
/// a collective after the consensus), and the reducer cleared its gradients.
/// `call` names the user's call ("acc.flush()"), `last` is the reducer's
/// last result, `e` what failed here.
std::string failed_after_reduction(const char* call, int rank, const ReductionResult& last, const std::exception& e);

} // namespace gradaccum::detail
