#pragma once

#include <gradaccum/bucket.h>
#include <gradaccum/options.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gradaccum {

/// Counters of the reducer's collectives.
struct ReducerStats {
  int64_t buckets = 0;
  int64_t windows = 0; ///< reductions completed (dropped ones included)
  /// Reductions that ended with the window dropped: on every rank, or on
  /// this rank alone when it failed after every rank had reduced it (then
  /// the ranks' counts differ, as their replicas do).
  int64_t dropped_windows = 0;
  /// All-reduces launched, in all: the buckets' (windows', snapshots' and
  /// refresh checks' too) and, in a window where some ranks have joined and
  /// buffers are broadcast, the one that picks the broadcast's root. Not the
  /// construction's checks nor the bucket rebuild's agreement.
  int64_t collectives = 0;
  int64_t bytes_reduced = 0; ///< bytes handed to those all-reduces, in all
  int64_t last_window_collectives = 0;
  int64_t last_window_bytes = 0;
  int64_t broadcasts = 0; ///< buffer broadcasts at windows' ends
  int64_t snapshots = 0; ///< checkpoint collectives (state_dict() mid-window)
  /// Buckets launched while backward still had gradients to make (before
  /// its last gradient hook; the rest launch at its end): overlapped with it.
  int64_t launched_in_backward = 0;
  int64_t last_window_launched_in_backward = 0;
  /// Windows reduced after their backward returned because the engine ran
  /// none of the reducer's hooks (compiled autograd; Note [Compiled
  /// autograd]): the same collectives, not overlapped with backward.
  int64_t hookless_windows = 0;
  /// Times the current buckets were rebuilt in backward's order (0 or 1; see
  /// ReducerOptions::rebuild_buckets). It describes the layout, like
  /// `buckets`: refresh_parameters() lays the buckets out anew and starts it
  /// at 0 again (they are rebuilt after its first window), and checkpoints do
  /// not hold it.
  int64_t bucket_rebuilds = 0;
};

/// When the parts of the last reduction happened, in seconds from its
/// beginning (the synchronising backward's first step, or flush()'s call):
/// what a bucket schedule had to work with and what it did. A clock read per
/// gradient and per bucket (Note [The window's timeline]).
struct WindowTimeline {
  struct BucketTimes {
    int64_t bytes = 0; ///< handed to the all-reduce
    double ready = -1; ///< its last gradient arrived (or backward ended)
    double launched = -1; ///< its all-reduce was launched
    double completed = -1; ///< the all-reduce completed (-1: the backend cannot say)
    /// written back to .grad (-1: not: a snapshot, or a dropped window);
    /// all but the last bucket's as soon as its all-reduce completed
    double written = -1;
  };
  /// Per parameter, when its gradient hook ran (-1: not in this backward,
  /// e.g. unused, or a reduction with no hooks: flush(), compiled autograd).
  std::vector<double> gradients;
  std::vector<BucketTimes> buckets; ///< in index (launch) order
  double backward_end = -1; ///< backward over: the last buckets launch
  double finished = -1; ///< every bucket waited for and written back
  /// The reduction's beginning on the system clock, in seconds since the Unix
  /// epoch (-1: no reduction yet): what lines the times above up with other
  /// ranks' and other tools' events in a trace (gradaccum.trace).
  double origin = -1;
};

/// What every rank's windows must agree on. Carried in every reduction (and
/// compared at construction), so that ranks configured differently get a clear
/// error at the first window instead of silently mixing windows.
struct WindowRule {
  int64_t steps = 1;
  Reduction reduction = Reduction::Mean;
  /// Sum narrower (bf16/fp16) gradients in this dtype, in the buckets.
  std::optional<at::ScalarType> accumulate_dtype;
  /// The dtype on the wire (bf16, fp16, float32), when other than the buckets'.
  std::optional<at::ScalarType> comm_dtype;
  /// Keep what compression to `comm_dtype` lost and add it to the next window.
  bool error_feedback = false;
  /// The names of the user metrics the window's loss sum carries after the
  /// loss (AccumulatorOptions::metrics), in order.
  std::vector<std::string> metrics;
  /// What the step does with the reduced window, the same on every rank
  /// (compared at construction: Note [What ranks agree on]; the reducer
  /// itself does not use them): the clip, the non-finite policy, and the loss
  /// scaler's scale and schedule (unset: no scaling).
  std::optional<double> max_grad_norm;
  NonFinite nonfinite = NonFinite::Skip;
  std::optional<LossScalerOptions> loss_scaler;
};

/// Why a rank drops the window it is reducing (see Note [Dropping a window]).
enum class AbortReason : int64_t {
  None = 0,
  /// This rank's synchronising backward (or a micro-step of the window) failed.
  BackwardFailed = 1,
  /// This rank went on training after other ranks ended the epoch with flush().
  EpochEnded = 2,
  /// This rank's reducer was destroyed during its synchronising backward.
  Closed = 3,
  /// This rank's parameters carry another reducer's hooks (torch DDP?).
  ForeignReducer = 4,
  /// This rank's gradients were cleared or changed from outside mid-window.
  GradientsChanged = 5,
  /// This rank's window weight is more than a half-precision wire's meta carries.
  WeightTooLarge = 6,
  /// This rank's window weight is too small for a half-precision wire's meta
  /// to carry to 2^-20 (Bucket::min_meta_weight()).
  WeightTooSmall = 7,
  /// flush() at a closed window: this rank could not step it (its .grad was
  /// replaced, its optimizer raised) while the others did before the flush.
  ClosedWindowNotStepped = 8,
  /// This rank ran out of memory in acc.run() on a micro-batch it could not
  /// split further (one row) or run again (part of it had reached .grad).
  OutOfMemory = 9,
  /// This rank refused the window's closing micro-batch (its loss or
  /// num_items failed acc.backward()'s checks) while the others reduced.
  MicroBatchRefused = 10,
  /// An exception took this rank out of its acc.join() block (Note [Leaving
  /// join() with an exception]): it will not reduce again.
  LeftJoin = 11,
  /// This rank refused acc.refresh_parameters() at a window boundary (nothing
  /// trainable left, or its caller's own checks) while others called it
  /// (Note [A refresh pairs like a window]).
  RefreshRefused = 12,
  /// This rank could not round its part of a light window again for the
  /// float16 wire's second all-reduce (Note [Re-sending a light window]).
  ResendFailed = 13,
  /// This rank's synchronising backward (or a micro-step of the window) was
  /// interrupted: from Python, an error that is no Exception
  /// (KeyboardInterrupt, SystemExit), which stops that rank; every rank is
  /// told to end training (Note [An interrupt tells every rank to end]).
  Interrupted = 14,
};

/// One reduction, asked for as a value: what this rank contributes.
struct ReductionRequest {
  /// This rank's share of the divisor: micro-steps (mean), items (items).
  double weight = 1.0;
  /// Divide the sum by the weights summed over ranks (false: reduction "sum").
  bool divide = true;
  /// This rank closes a partial window (flush()).
  bool flushing = false;
  /// With `flushing`: the partial window holds micro-steps (of any weight).
  bool flushing_steps = false;
  /// This rank is out of data and shadows the others' reductions until every
  /// rank is (Accumulator::join(); with `flushing`).
  bool joined = false;
  /// This rank ran a micro-batch's forward in the window (any micro-step but
  /// an empty one): under join() the buffers come from such a rank.
  bool forwards = true;
  /// This rank's window was resumed in its middle from a rank-independent
  /// state (each rank holds a share of every rank's sums): every rank must
  /// have resumed it alike (Note [A window resumed on some ranks only]).
  bool shared = false;
  /// Drop the window on every rank (the gradients sent are ignored).
  AbortReason abort = AbortReason::None;
  /// Check the reduced gradient for the non-finite test in the pass that
  /// writes it back (see ReductionResult::known_finite).
  bool check_finite = false;
  /// This rank's micro-batch losses of the window, summed, then its metrics
  /// summed (a tensor of 1 + up to kMaxWindowMetrics values on any device;
  /// undefined: 0). Written into the header on the device, so no host
  /// synchronisation (Note [The window's loss rides in the header]).
  at::Tensor loss_sum;
  /// The user's call this reduction runs in, as its errors name it (a
  /// string with static storage: "acc.join()"); null: acc.backward(), or
  /// acc.flush() with `flushing`.
  const char* call = nullptr;
};

/// What a completed reduction tells every rank alike.
struct ReductionResult {
  int64_t window = -1; ///< the reduction's sequence number (the same on every rank)
  double global_weight = 0; ///< request weights summed over ranks
  int64_t flushing_ranks = 0; ///< ranks that closed a partial window with flush()
  /// Of them, ranks whose partial window held micro-steps (any weight).
  int64_t flushing_steps_ranks = 0;
  int64_t joined_ranks = 0; ///< of them, ranks in Accumulator::join()
  /// Ranks that dropped the window leaving their join() block with an
  /// exception (AbortReason::LeftJoin): they will not reduce again.
  int64_t left_ranks = 0;
  /// Ranks that dropped it because they could not step the window they
  /// closed (AbortReason::ClosedWindowNotStepped): the replicas differ.
  int64_t unstepped_ranks = 0;
  /// Ranks that dropped it because they were interrupted
  /// (AbortReason::Interrupted): they stop.
  int64_t interrupted_ranks = 0;
  /// The request loss sums summed over ranks; none where digit-encoded meta
  /// (a bf16/fp16 comm_dtype) cannot carry it.
  std::optional<double> loss_sum;
  /// Likewise the metric sums (kMaxWindowMetrics; empty where loss_sum is none).
  std::vector<double> metric_sums;
  bool dropped = false; ///< the window was dropped on every rank (an error was raised)
  /// With `check_finite`: every gradient written back is finite and small
  /// enough that the window's total 2-norm is finite too, the same on every
  /// rank. False: not checked, or not known (half-precision, device or
  /// accumulate_dtype buckets, a value that failed): compute the norm.
  bool known_finite = false;
  /// The reduced window reached .grad on this rank. False after a local
  /// failure that followed the consensus (out of memory in the write-back, a
  /// failed buffer broadcast): this rank's gradients were cleared, while the
  /// other ranks may hold the window.
  bool written = true;
};

/// Data-parallel gradient reduction over a c10d ProcessGroup, driven by autograd.
///
/// A post-hook on each parameter's gradient accumulator fires once `.grad` holds
/// the parameter's gradient. While `expect_hooks()` is false (no_sync micro-steps)
/// the hook returns at once and gradients accumulate locally in `.grad`. While it
/// is true, the hook copies the gradient into its bucket (nothing to copy with
/// `gradient_as_bucket_view`) and, once a bucket is full, all-reduces it
/// asynchronously while backward goes on. A callback queued on the autograd
/// engine runs at the end of that backward: it launches what is left, waits,
/// checks that every rank agreed, and writes the reduced gradient, divided by the
/// window's weight summed over ranks, back into `.grad`.
///
/// Every reduction pairs across ranks (see Note [Collectives pair by launch
/// order]); when something goes wrong on one rank the window is dropped on every
/// rank and every rank raises a clear error (Note [Dropping a window]).
///
/// The hooks and engine callbacks hold the reducer's state by shared pointer:
/// destroying a Reducer during a backward is safe (its hooks go inert; a
/// reduction in flight still completes its pairing with the other ranks).
class Reducer {
 public:
  /// Registers the hooks; with `options.check_parameters()`, checks that every
  /// rank has the same parameters and options (a collective), then broadcasts
  /// `params`, `buffers` and `frozen` from rank 0. `names` (optional) name
  /// parameters in errors. `frozen`: the model's parameters that do not
  /// require grad, by name, broadcast once here (as torch DDP syncs its
  /// module's states) and compared across ranks like the buffers.
  Reducer(
      std::vector<at::Tensor> params,
      c10::intrusive_ptr<c10d::ProcessGroup> group,
      ReducerOptions options = {},
      std::vector<at::Tensor> buffers = {},
      std::vector<std::string> names = {},
      WindowRule rule = {},
      std::vector<std::pair<std::string, at::Tensor>> frozen = {});
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// Whether a backward synchronises when it is not run through backward()
  /// (false inside no_sync; the DDP-style manual path).
  bool expect_hooks() const;
  void set_expect_hooks(bool expect);
  /// Raises, naming `what` (the call), where a parameter's gradient
  /// accumulator is no longer the one the hooks are on (the model converted
  /// after construction): a plain backward through it is not reduced.
  void check_hooks_reach(const char* what) const;

  /// Runs `loss.backward()` as the synchronising backward of a window and
  /// returns the reduction's result. Whatever fails (this rank's backward, a
  /// peer's, a disagreement between ranks, the transport) throws after the
  /// reduction has paired with every rank; the window is then dropped on every
  /// rank (gradients cleared).
  ReductionResult backward(const at::Tensor& loss, const ReductionRequest& request);
  /// Reduces now, outside backward, whatever `.grad` holds (closing a partial
  /// window, or an empty one). Same error behaviour as backward().
  ReductionResult reduce(const ReductionRequest& request);
  /// A checkpoint's collective (every rank calls it at the same point): sums
  /// each rank's half-done window over ranks without touching `.grad`.
  /// Returns one summed (undivided) gradient per parameter, undefined where no
  /// rank has one; `result.global_weight` sums the request weights.
  std::vector<at::Tensor> snapshot(const ReductionRequest& request, ReductionResult* result = nullptr);
  /// acc.refresh_parameters()'s collective at a window boundary, before a new
  /// reducer replaces this one (every rank calls it at the same point): every
  /// bucket all-reduced with zeros, so that it pairs with whatever a rank that
  /// did not call it reduces instead (Note [A refresh pairs like a window]).
  /// `refused`: this rank refuses the refresh. Returns normally when every rank
  /// called it and none refused; otherwise throws after the pairing, on every
  /// rank alike, counted as a dropped reduction. Either way `.grad` and the
  /// residuals stay as they were (a boundary's: call it with no gradient
  /// written since the last window), and on success the last window's
  /// counters too. Its all-reduces count in `collectives` and
  /// `bytes_reduced`; it takes a reduction number, as a snapshot does.
  void refresh_check(bool refused);
  /// Counters, the window sequence number and the last full window's global
  /// weight (the prescale of half-precision wires with "items", Note [Scaling
  /// before the sum]; the same on every rank), as saved in a checkpoint; and
  /// this rank's weight in the window whose rounding the error-feedback
  /// residuals hold (0: unknown; Note [Error feedback across window weights]).
  struct Progress {
    ReducerStats stats;
    int64_t sequence = 0;
    double last_weight = 0;
    double residual_weight = 0;
  };
  Progress progress() const;
  /// Restores what progress() returned (every rank must load the same).
  /// The layout's counters (`buckets`, `bucket_rebuilds`) stay this
  /// reducer's; so do the backwards' (`launched_in_backward` and its last
  /// window's, `hookless_windows`: checkpoints do not hold them) unless
  /// `backwards_too`, as refresh_parameters() hands over its old reducer's.
  void restore(const Progress& progress, bool backwards_too = false);
  /// The request a synchronising backward of the manual path (plain
  /// `loss.backward()` outside no_sync) uses: weight 1, divide unless "sum".
  ReductionRequest manual_request() const;

  /// Makes `.grad` zero (bucket views stay views) or undefined (copy mode).
  void zero_grad();
  /// Before the reducer goes (gradient_as_bucket_view): every `.grad` that is
  /// a view of a bucket becomes its own tensor, or undefined where
  /// `drop_zeros` and it is all zero (a window boundary: as without views),
  /// so that the buckets are freed with the reducer and the model is left as
  /// it would be without them. Never throws: what it cannot copy stays a
  /// view (its values right). Nothing inside a backward or a reduction.
  void release_gradient_views(bool drop_zeros) noexcept;
  /// This rank will not step the last window every rank reduced (`why`, a
  /// string with static storage, words it in this rank's error): its next
  /// reduction tells every rank, and where some ranks but not all did so,
  /// every rank drops that reduction and raises (Note [A window not stepped on
  /// some ranks]). A failure after a window's reduction marks it itself;
  /// restore() clears it.
  void mark_unstepped(const char* why);
  /// The Accumulator's window failed (a micro-step failed, or its gradients
  /// changed) and is dropped when it closes: a manual reduction closing it
  /// instead drops it too, on every rank (Note [A failed backward inside
  /// no_sync()]). acc.zero_grad() and restore() clear it.
  void mark_window_failed(AbortReason why) noexcept;
  /// Note [Training ended in join()] (src/accumulator/join.cpp): the dropped
  /// reduction `window` told this rank to end training and it has left join().
  void set_end_acted_on(int64_t window);
  /// The last reduction told this rank to end training (ranks shadowing, or
  /// one that left its join() block), nothing ran since, and it is not acted on.
  bool told_to_end_training() const;
  /// Why the manual path's backward is refused after the one-sided flush
  /// error (empty: it is not).
  void set_epoch_ended_refusal(const std::string& why);
  /// With an accumulation dtype: adds each `.grad` of a narrower dtype into its
  /// bucket and releases it (after a no_sync micro-step's backward).
  void accumulate_local();
  /// Marks parameters whose `.grad` was restored from a checkpoint as holding
  /// a gradient of this window (bucket views cannot tell otherwise).
  void mark_restored(const std::vector<size_t>& indices);
  /// Gradient hooks run so far: unchanged over a backward that changed
  /// gradients, the engine ran none (compiled autograd).
  uint64_t hook_calls() const;
  /// Reductions a plain loss.backward() began (the manual path), dropped
  /// ones included: an Accumulator tells by it that one ended its window
  /// (Note [A manual reduction in the middle of a window]).
  uint64_t manual_reductions() const;
  /// manual_reductions() as of the last manual reduction dropped on this rank
  /// (0: none): its error told that the window ended.
  uint64_t manual_dropped_at() const;
  /// From a window's close to its step (Note [A backward after the window
  /// closed]): while held, a hook starts no reduction (a manual-path
  /// backward would); it records the first parameter a backward reached.
  /// Holding again forgets that record.
  void hold_closed_window(bool hold);
  /// While held: the first parameter a backward reached since, if any.
  std::optional<size_t> reached_while_held() const;
  /// Whether some bucket sums in a wider dtype than its parameters.
  bool accumulating() const;
  /// With an accumulation dtype, mid-window: the window's sum so far of each
  /// parameter summed in a wider bucket (a copy in that dtype; undefined where
  /// it has none yet, and for parameters of other buckets). Call
  /// accumulate_local() first to include what `.grad` holds.
  std::vector<at::Tensor> accumulated() const;
  /// Whether parameter `index` is summed in a wider bucket.
  bool accumulates(size_t index) const;
  /// Sets parameter `index`'s sum in its wider bucket (a checkpoint's load).
  void load_accumulated(size_t index, const at::Tensor& sum);
  /// Whether some bucket sends its gradients in another dtype (comm_dtype).
  bool compressing() const;
  /// Error feedback: this rank's compression residual of each parameter
  /// (undefined where its bucket keeps none), as saved in a checkpoint.
  std::vector<at::Tensor> residuals() const;
  /// Restores what residuals() returned (undefined entries: zero).
  void set_residuals(const std::vector<at::Tensor>& residuals);
  /// Error feedback: zeroes the residuals. For a window that was reduced but
  /// is then thrown away (skipped as non-finite, a loss scaler's overflow,
  /// zero_grad() of a closed window): its residual holds what rounding that
  /// window lost, which must not reach the next window that steps.
  void discard_residuals();
  /// Error feedback under a loss scaler whose scale went from s to s' at a
  /// window's end: the residuals (in units of s) join the next window
  /// multiplied by `ratio` = s' / s, a one-element tensor on the gradients'
  /// device or the CPU, never read on the host (Note [Error feedback across
  /// loss scales]). Nothing without residuals.
  void rescale_residuals(const at::Tensor& ratio);

  /// Number of reductions completed (synchronising backwards and reduce()).
  int64_t windows() const;
  ReducerStats stats() const;
  /// When the parts of the last reduction happened (see WindowTimeline).
  WindowTimeline last_timeline() const;
  /// The last completed reduction's result (window -1 before the first).
  ReductionResult last_result() const;
  const std::vector<Bucket>& buckets() const;
  const c10::intrusive_ptr<c10d::ProcessGroup>& process_group() const;
  /// Every rank's `value`, by rank: a collective, on the group's metadata
  /// device, that every rank must call at the same point (Note [Collectives
  /// pair by launch order]); not during a synchronising backward.
  std::vector<int64_t> gather(int64_t value) const;
  const ReducerOptions& options() const;

  struct State; ///< shared with the hooks and callbacks; defined in src/reducer/state.h

 private:
  friend class NoSync;
  std::shared_ptr<State> state_;
};

/// RAII guard: backward passes inside it accumulate locally, with no collective
/// (torch DDP's `no_sync`). Only the backward needs to be inside; the forward
/// may be anywhere. A null reducer makes it a no-op. It holds the reducer's
/// state weakly: a reducer destroyed inside the scope (acc.close(),
/// acc.refresh_parameters()) is left alone when the scope ends. `counted`:
/// the Accumulator's own micro-step, whose failed backward it handles
/// itself; its graph task is not watched (Note [A failed backward inside
/// no_sync()], src/reducer/manual.cpp).
class NoSync {
 public:
  explicit NoSync(Reducer* reducer, bool counted = false);
  ~NoSync();
  NoSync(NoSync&& other) noexcept;
  NoSync(const NoSync&) = delete;
  NoSync& operator=(const NoSync&) = delete;
  NoSync& operator=(NoSync&&) = delete;

 private:
  std::weak_ptr<Reducer::State> state_;
  bool previous_ = true;
  bool previous_counted_ = false;
};

} // namespace gradaccum
