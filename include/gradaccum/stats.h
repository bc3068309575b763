#pragma once

#include <gradaccum/reducer.h>

#include <cstdint>
#include <optional>
#include <string>

namespace gradaccum {

/// Counters since construction (or the last load_state_dict).
struct AccumulatorStats {
  int64_t micro_steps = 0; ///< micro-steps counted: backward(), run()'s, empty_micro_step()
  int64_t optimizer_steps = 0; ///< real optimizer steps
  /// Windows closed without a step: non-finite gradients (nonfinite="raise":
  /// once acc.zero_grad() drops the window it raised on), a loss scaler's
  /// overflow, or no weight on any rank.
  int64_t skipped_steps = 0;
  /// Losses left out by nonfinite="skip_micro_batch": a micro-batch's, or
  /// one part's of a micro-batch run in parts (acc.run() after running out of
  /// memory: each part counts).
  int64_t skipped_micro_batches = 0;
  int64_t windows = 0; ///< windows closed (stepped or skipped)
  /// The total norm of the last window acc.step() closed, if computed there
  /// (not for a window skipped before it: a loss scaler's overflow, no weight).
  std::optional<double> last_grad_norm;
  std::optional<double> loss_scale; ///< the loss scaler's current scale, if any
  std::optional<double> window_loss; ///< Accumulator::window_loss(), as a number (a host read)
  double window_items = 0; ///< Accumulator::window_items()
  ReducerStats reducer; ///< all zero without a process group
  bool data_parallel = false; ///< gradients are reduced over a process group
  int64_t world_size = 1; ///< ranks of that group (1 without one)
  std::string backend; ///< the group's backend name ("gloo", "nccl"); empty without one
};

} // namespace gradaccum
