#pragma once

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace gradaccum {

/// How `init_process_group_from_env` and `new_process_group` build a group.
struct ProcessGroupOptions {
  /// "gloo", "nccl", or "" for NCCL when CUDA is available (and gradaccum was
  /// built with NCCL), Gloo otherwise.
  TORCH_ARG(std::string, backend) = "";
  /// Collective and rendezvous timeout.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
};

/// torchrun's variables, checked.
struct LaunchEnvironment {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;
  int master_port = 0;
  /// torchrun's agent already serves the store on MASTER_PORT.
  bool agent_store = false;
  /// torchrun's TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS and
  /// GROUP_WORLD_SIZE (agents, one per node); 0, 0 and 1 without them.
  int restart_count = 0;
  int max_restarts = 0;
  int agents = 1;

  /// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and
  /// torchrun's elastic variables); throws naming a missing or malformed one.
  static LaunchEnvironment from_env();

  /// Whether any of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT is
  /// set: the process was launched for data parallelism (by torchrun or by hand).
  static bool launched();
};

/// Creates the TCPStore and a Gloo or NCCL group from torchrun's variables.
/// Under torchrun's shared agent store, which outlives a restart, the group's
/// keys take the attempt's TORCHELASTIC_RESTART_COUNT as a prefix, so that a
/// restarted attempt never reads the Gloo/NCCL addresses a killed one left.
/// Several agents count restarts each on their own, so with several agents
/// and restarts allowed that is an error: set
/// TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for every agent (each attempt then
/// gets a new store; docs/integrations.md, "Restarts after a failure").
/// Launched without any of them (`LaunchEnvironment::launched()` is false),
/// returns no group (a null pointer: local-only accumulation) and says so once
/// on stderr, so that the same binary runs as one plain process. Some of them
/// set but not all is an error naming the missing one.
///
/// Example:
///   auto group = gradaccum::init_process_group_from_env();   // null when not under torchrun
///   gradaccum::Accumulator acc(model.ptr(), optimizer,
///       gradaccum::AccumulatorOptions(8).process_group(group));
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group_from_env(
    ProcessGroupOptions options = {});

/// A Gloo or NCCL group over an existing store (tests use a HashStore).
c10::intrusive_ptr<c10d::ProcessGroup> new_process_group(
    const c10::intrusive_ptr<c10d::Store>& store,
    int rank,
    int world_size,
    ProcessGroupOptions options = {});

/// Whether this build can create NCCL groups.
bool nccl_available();

} // namespace gradaccum
