// The state an Accumulator saves and loads, and its schema (Note [The
// checkpoint schema]).
#pragma once

#include <gradaccum/options.h>
#include <gradaccum/reducer.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace gradaccum {

/// Everything exact resumption needs, the gradients of a half-done window included.
///
/// Data parallel, `state_dict()` is rank-independent by default (a collective:
/// every rank calls it at the same point): the half-done window is summed over
/// ranks and each rank's state holds 1/world of the sum and of the weight, so
/// whichever rank's state is saved (rank 0's, as frameworks do) and loaded on
/// every rank, the resumed run equals the uninterrupted one. It also loads on
/// another number of ranks, and at a window boundary with another `steps`
/// (Note [Resuming on another shape] in src/accumulator/checkpoint.cpp).
struct AccumulatorState {
  int64_t steps = 0;
  Reduction reduction = Reduction::Mean;
  int64_t world_size = 1;
  int64_t rank = 0; ///< of the rank that saved it
  bool rank_independent = true; ///< false: this rank's own half-window
  int64_t micro_step = 0;
  bool window_ready = false;
  /// window_ready only: no rank had any weight in it (step() skips it).
  bool window_empty = false;
  /// window_ready only: the loss scaler (before_step) already unscaled it, and
  /// then the optimizer step failed; a retried step() steps it as it is.
  bool window_unscaled = false;
  /// window_ready only: max_grad_norm clipped it in place, and then the
  /// optimizer step failed; a retried step() does not clip it again.
  bool window_clipped = false;
  /// With window_ready: nonfinite="raise" raised on this closed window
  /// already (dropped, it counts as skipped; flush() drops it with a warning).
  bool window_raised_nonfinite = false;
  /// With window_ready: the epoch's end (flush(), join()'s last reduction)
  /// closed it, and its step failed; flush() or join() again steps it with
  /// no collective (Note [Flushing again after its step raised]).
  bool window_closed_by_flush = false;
  double window_weight = 0; ///< micro-steps (mean, sum) or items (items) so far
  /// Per-rank states in the middle of a window resumed mid-way from a
  /// rank-independent state: the gradients hold a share of every rank's sums,
  /// so acc.zero_grad() there drops the window on every rank (Note [Dropping
  /// the middle of a window]). Rank-independent states are always so.
  bool window_shared = false;
  bool epoch_ended = false; ///< see Accumulator: flush() owes no collective
  int64_t micro_steps = 0;
  int64_t optimizer_steps = 0;
  int64_t skipped_steps = 0;
  int64_t windows = 0;
  int64_t skipped_micro_batches = 0;
  ReducerStats reducer; ///< counters of the reducer (all zero without a group)
  int64_t reducer_sequence = 0; ///< the next reduction's window number
  /// The last full window's global weight (the same on every rank): the
  /// prescale of half-precision wires with reduction "items".
  double reducer_last_weight = 0;
  /// error_feedback, per-rank states: this rank's weight in the window whose
  /// rounding `residuals` hold (0: unknown, or no residuals saved).
  double reducer_residual_weight = 0;
  double loss_scale = 0; ///< the loss scaler's scale (0 without one)
  int64_t loss_scale_growth_tracker = 0;
  std::vector<at::Tensor> grads; ///< one per parameter; undefined for None
  /// error_feedback, per-rank states only: this rank's compression residual,
  /// one per parameter (undefined where none). Empty: none saved; loading such
  /// a state (rank-independent ones) starts the residual at zero.
  std::vector<at::Tensor> residuals;
  /// The trainable parameters' names (parameter_names()) that grads and
  /// residuals follow, one each. Empty in older checkpoints: a
  /// held gradient then loads by position only.
  std::vector<std::string> parameter_names;
  /// A half-done window's loss sum, then its metric sums (float64, 1-D, on
  /// the CPU), as `grads` are: this rank's share of the sums over ranks, or
  /// its own; undefined where they are not known (a window a checkpoint cut
  /// before, a bf16/fp16 wire's snapshot, older checkpoints): the resumed
  /// window's `window_loss` is then None (Note [The window's loss across a
  /// checkpoint]).
  at::Tensor window_loss_sums;
  /// The metric names window_loss_sums' metric sums follow (saved with
  /// them): resumed with other names, the window's loss and metrics are not
  /// known (None) rather than credited by position. Empty in states of the
  /// version that first kept the sums: they then load by count.
  std::vector<std::string> window_metric_names;
};

// Note [The checkpoint schema]
// Each scalar field of AccumulatorState is named once, here. The archive
// (Accumulator::save/load: key "gradaccum.<name>") and the Python dict (a
// "reducer.<x>" field nested as d["reducer"]["<x>"]) both walk this table, so a
// field added to the state is added here and nowhere else. `visit(name, field,
// required)`: a field that is not required may be missing from an older
// checkpoint (it keeps its default). The tensors (grads, residuals) have their
// own layouts, next to each walk.
template <class State, class Visit>
void for_each_state_field(State& s, Visit&& visit) {
  visit("steps", s.steps, true);
  visit("reduction", s.reduction, true);
  visit("world_size", s.world_size, true);
  visit("rank", s.rank, true);
  visit("rank_independent", s.rank_independent, true);
  visit("micro_step", s.micro_step, true);
  visit("window_ready", s.window_ready, true);
  visit("window_weight", s.window_weight, true);
  visit("epoch_ended", s.epoch_ended, true);
  visit("micro_steps", s.micro_steps, true);
  visit("optimizer_steps", s.optimizer_steps, true);
  visit("skipped_steps", s.skipped_steps, true);
  visit("windows", s.windows, true);
  visit("skipped_micro_batches", s.skipped_micro_batches, false);
  visit("window_empty", s.window_empty, false);
  visit("window_unscaled", s.window_unscaled, false);
  visit("window_clipped", s.window_clipped, false);
  visit("window_raised_nonfinite", s.window_raised_nonfinite, false);
  visit("window_closed_by_flush", s.window_closed_by_flush, false);
  visit("window_shared", s.window_shared, false);
  visit("reducer.windows", s.reducer.windows, true);
  visit("reducer.dropped_windows", s.reducer.dropped_windows, true);
  visit("reducer.collectives", s.reducer.collectives, true);
  visit("reducer.bytes_reduced", s.reducer.bytes_reduced, true);
  visit("reducer.last_window_collectives", s.reducer.last_window_collectives, true);
  visit("reducer.last_window_bytes", s.reducer.last_window_bytes, true);
  visit("reducer.broadcasts", s.reducer.broadcasts, true);
  visit("reducer.snapshots", s.reducer.snapshots, true);
  visit("reducer_sequence", s.reducer_sequence, true);
  visit("reducer_last_weight", s.reducer_last_weight, false);
  visit("reducer_residual_weight", s.reducer_residual_weight, false);
  visit("loss_scale", s.loss_scale, true);
  visit("loss_scale_growth_tracker", s.loss_scale_growth_tracker, true);
}

} // namespace gradaccum
