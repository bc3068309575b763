#pragma once
// Internal: what a reducer checks of its parameters before it touches them:
// that every rank has the same ones and options (a collective, at
// construction), and that no other reducer hooks them.

#include "reducer/config.h"

#include <string>

namespace gradaccum::detail {

/// Compares every rank's options (Note [What ranks agree on]) and parameter
/// shapes, and whether another reducer hooks some rank's parameters; throws
/// the same error on every rank when they differ. A collective.
void check_ranks_match(const ReducerConfig& config);

/// Why this rank's parameters cannot be reduced here: another reducer (torch
/// DDP) already hooks their gradient accumulators. "" when none does; the
/// caller's prefix ("gradaccum: Accumulator(): ") goes before it.
std::string foreign_hooks(const ReducerConfig& config);

} // namespace gradaccum::detail
