#pragma once
// Internal: what a reducer checks of its parameters before it touches them:
// that every rank has the same ones and options (a collective, at
// construction), and that no other reducer hooks them.

#include "reducer/config.h"

#include <exception>
#include <string>

namespace gradaccum::detail {

/// Why this rank cannot build its Accumulator or Reducer: the kind of error
/// (none, ValueError, TypeError, any other) and its message.
struct Refusal {
  enum Kind : int64_t { None = 0, Value = 1, Type = 2, Other = 3 };
  Kind kind = None;
  std::string message;

  static Refusal of(const std::exception& error);
  static Refusal of(std::exception_ptr error); ///< none for a null one
};

/// Note [Construction refused on one rank]: the first collective of every
/// construction over a group. Tells every rank whether some rank refused to
/// build (and, if one did, its message), and whether check_parameters agrees.
/// On a rank that refused it returns (the caller raises its own error); on
/// the others it throws that rank's error, named. `call` names the call
/// ("Accumulator()"); `params_device` places the small tensors. Returns the
/// number the ranks agreed for what is being built (Note [Which Accumulator
/// a collective belongs to]; 0 on a refusing rank).
int64_t agree_to_build(c10d::ProcessGroup& group, at::Device params_device, const Refusal& mine,
                       bool check_parameters, const char* call);

/// The first parameter's device, or meta where there is none (agree_to_build()
/// then picks one the group reaches).
at::Device device_of(const std::vector<at::Tensor>& params);

/// Marks `instance` as held by a live reducer over `group` while it lives
/// (Note [Which Accumulator a collective belongs to]): agree_to_build()
/// then gives the next reducer over that group another number.
class InstanceHold {
 public:
  InstanceHold(const c10d::ProcessGroup* group, int64_t instance);
  ~InstanceHold();
  InstanceHold(const InstanceHold&) = delete;
  InstanceHold& operator=(const InstanceHold&) = delete;

 private:
  const c10d::ProcessGroup* group_;
  int64_t instance_;
};

/// For a rank that refuses before or in its Reducer's construction, inside
/// the catch block of its error: agree_to_build() as a refusing rank. If the
/// others cannot be told (a broken group) it returns all the same: the
/// caller rethrows its own error.
void tell_construction_refused(c10d::ProcessGroup& group, at::Device params_device);

/// Compares every rank's options (Note [What ranks agree on]) and parameter
/// and buffer shapes; throws the same error on every rank when they differ.
/// A collective, after agree_to_build().
void check_ranks_match(const ReducerConfig& config);

/// Why this rank's parameters cannot be reduced here: another reducer (torch
/// DDP) already hooks their gradient accumulators. "" when none does; the
/// caller's prefix ("gradaccum: Accumulator(): ") goes before it.
std::string foreign_hooks(const ReducerConfig& config);

} // namespace gradaccum::detail
