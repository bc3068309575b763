#pragma once

#include <gradaccum/model_parameters.h>
#include <gradaccum/options.h>
#include <gradaccum/reducer.h>
#include <gradaccum/shared_tensor.h>
#include <gradaccum/state.h>
#include <gradaccum/stats.h>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/lr_scheduler.h>
#include <torch/serialize/archive.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace gradaccum {

namespace detail {
class LateBackwardWatch; // src/detail/late_backward.h
class LossScaler; // src/precision/loss_scaler.h
class WideSums; // src/precision/wide_sums.h
} // namespace detail

/// What tells one `.grad` from another, or from itself changed: the tensor,
/// its storage (`.grad.data = t` keeps the tensor) and its version (in-place
/// writes through `.grad` bump it; writes through `.data` or numpy do not).
struct GradMark {
  const void* impl = nullptr;
  const void* data = nullptr;
  int64_t version = 0;
  bool operator==(const GradMark& o) const {
    return impl == o.impl && data == o.data && version == o.version;
  }
  bool operator!=(const GradMark& o) const {
    return !(*this == o);
  }
};

/// Gradient accumulation over windows of `steps` micro-batches, optionally data
/// parallel over a c10d ProcessGroup.
///
/// Example:
/// ```
/// gradaccum::Accumulator acc(model.ptr(), optimizer, gradaccum::AccumulatorOptions(8));
/// for (auto& batch : loader) {
///   acc.backward(loss_fn(model->forward(batch.data), batch.target));
///   acc.step(); // steps the optimizer once every 8 micro-batches
/// }
/// acc.flush(); // the partial last window
/// ```
///
/// Gradients accumulate unscaled within a window; the window's last backward
/// divides them once by the window's weight (micro-steps for "mean", items for
/// "items", summed over ranks), fused into the reduction when data parallel.
class Accumulator {
 public:
  using StepFunction = std::function<void()>;
  /// The tensors an optimizer steps (its param_groups' parameters, in order).
  using ParameterList = std::function<std::vector<at::Tensor>()>;

  /// `optimizer` (and `scheduler`, stepped only after a real optimizer step)
  /// must outlive the Accumulator; not torch::optim::LBFGS, whose step()
  /// needs a closure (refused). Each of its parameters that requires grad
  /// and has a gradient must be one of the model's, when built and at each
  /// step (Note [Parameters only the optimizer steps]).
  Accumulator(
      ModelParameters model,
      torch::optim::Optimizer& optimizer,
      AccumulatorOptions options,
      torch::optim::LRScheduler* scheduler = nullptr);
  /// No optimizer: backward() leaves the window's gradient in `.grad`; step()
  /// and flush() are errors.
  Accumulator(ModelParameters model, AccumulatorOptions options);
  /// Any optimizer, as callbacks (the Python binding's form);
  /// `optimizer_parameters`, where given, says what it steps, checked as above.
  Accumulator(
      ModelParameters model,
      AccumulatorOptions options,
      StepFunction optimizer_step,
      StepFunction scheduler_step = nullptr,
      ParameterList optimizer_parameters = nullptr);

  Accumulator(const Accumulator&) = delete;
  Accumulator& operator=(const Accumulator&) = delete;

  /// Runs backward on one micro-batch's loss and counts the micro-step. With
  /// reduction "items", `num_items` is required: the items the (summed) loss
  /// covers. The window's last call synchronises and scales the gradients.
  void backward(const at::Tensor& loss, std::optional<double> num_items = std::nullopt);
  /// The same, for a `loss` scaled by someone else (a Python GradScaler):
  /// `reported` is the unscaled loss that window_loss() reports.
  void backward(const at::Tensor& loss, std::optional<double> num_items, const at::Tensor& reported);
  /// The same with this micro-batch's user metrics: a tensor of one value per
  /// AccumulatorOptions::metrics name (on any device; undefined: zeros),
  /// summed over the window and every rank (window_metrics()). A micro-batch
  /// left out by nonfinite="skip_micro_batch" adds none.
  void backward(const at::Tensor& loss, std::optional<double> num_items, const at::Tensor& reported,
                const at::Tensor& metrics);
  /// Counts a micro-step in which this rank has no micro-batch (a padding
  /// batch of a data loader whose shards differ by one batch, so that every
  /// rank runs as many micro-steps): no backward, no weight, no loss. The
  /// window's last micro-step still synchronises, and the window divides by
  /// what the other micro-steps (and ranks) hold; one that holds nothing
  /// anywhere is skipped unstepped, on every rank alike.
  void empty_micro_step();
  /// At a closed window: clip, check, step the optimizer (and scheduler), clear
  /// the gradients; returns whether the optimizer stepped. Elsewhere returns
  /// false, except that gradients written with no micro-step counted (a plain
  /// loss.backward()) are an error at micro-step 0.
  bool step();
  /// Closes a partial window (end of data) with its own micro-step count and
  /// steps. Data parallel: every rank must call it (a collective).
  bool flush();
  /// End of this rank's data when ranks have different amounts (Note
  /// [Joining] in src/accumulator/join.cpp): closes the partial window, then
  /// takes part in the other ranks' windows with nothing of its own, stepping
  /// the optimizer with each window's gradient as they do, until every rank
  /// has called join(); every rank returns from the same reduction. Active
  /// ranks pay no extra collective. Data parallel: every rank must end with
  /// join() (not flush()). One process: flush(). Returns the optimizer steps
  /// taken.
  int64_t join();
  /// An exception takes this rank out of its data loop before join() (Python:
  /// out of the `with acc.join():` block). Data parallel, where the other
  /// ranks would wait for it in their next reduction (as shadows in join(), or
  /// at their next window's end), it runs that reduction as a drop, so that
  /// every rank raises an error naming this rank and telling them to end
  /// training, instead of waiting. Nothing where every rank already knows (the
  /// last reduction dropped the window on every rank, or failed, and no
  /// micro-step ran since) and in one process. Raises nothing: the caller's
  /// exception is the one to tell (Note [Leaving join() with an exception]).
  void abandon() noexcept;
  /// The last reduction dropped its window on every rank telling every rank
  /// to end training (ranks in join(), or one that left its block), nothing
  /// ran since, and this rank has not left join() after it: its micro-steps
  /// are refused, and join() returns at once (Note [Training ended in join()]).
  bool told_to_end_training() const;
  /// Refuses a call that would run or open a reduction (a micro-step,
  /// no_sync(), a refresh; flush(), `flushing`, only when told to end
  /// training) after fail_after_peers_ended_epoch() or told_to_end_training().
  void check_training_not_ended(const char* what, bool flushing) const;
  /// One part of a micro-step too big for memory at once (Python's acc.run()
  /// splits a micro-batch that ran out of memory and runs its parts here):
  /// backward on `loss` into the window locally (no collective, never the
  /// synchronising backward), without counting a micro-step. `share` is the
  /// part's share of the micro-batch (its rows over the micro-batch's, in
  /// (0, 1]). With reduction "mean" the loss is a mean over the part's rows and
  /// is scaled by `share`, so that the parts add up to the micro-batch's mean;
  /// with "sum" it is a sum over them and adds as it is; with "items" it is a
  /// sum and `num_items` counts the part's items. A part that raises having changed no gradient did
  /// not happen (run it again, smaller); one that reached .grad fails the
  /// micro-step (Note [Micro-steps in parts] in src/accumulator/parts.cpp).
  /// `metrics` as for backward(): the parts' metrics add up. `call`: the
  /// name its errors give (Python's acc.run() passes its own).
  void backward_part(const at::Tensor& loss, std::optional<double> num_items, const at::Tensor& reported,
                     double share, const at::Tensor& metrics = {}, const char* call = "acc.backward_part()");
  /// Ends the micro-step that backward_part() calls made and counts it; at the
  /// window's end it synchronises (after the backward: not overlapped).
  /// `failed`: the micro-batch could not run (an error that was not retried):
  /// the micro-step fails as a failed backward() does (data parallel: the
  /// window is dropped on every rank, at once if this was its closing
  /// micro-step; one process: dropped if a part reached .grad);
  /// `out_of_memory` says why to the other ranks. So a C++ forward that
  /// throws on one rank, before its backward() (or backward_part()) ran,
  /// fails its micro-step with `end_micro_step(true)`: every rank's window is
  /// dropped alike, and every rank raises at that window's close (at once if
  /// it was the closing micro-step), rather than this rank's windows shifting
  /// one micro-step against the others'. (Not after a backward() that raised:
  /// that micro-step failed already; progress_marker() tells the two apart.)
  /// `call`: the name its errors give (Python's acc.run() passes its own).
  /// `interrupted`: what failed stops this rank (Python's KeyboardInterrupt,
  /// SystemExit): every rank is told to end training (Note [An interrupt
  /// tells every rank to end]).
  void end_micro_step(bool failed = false, bool out_of_memory = false, const char* call = "acc.end_micro_step()",
                      bool interrupted = false);
  /// The checks of a micro-step that need no loss (the Accumulator is open, its
  /// window not closed), naming `what`: acc.run() makes
  /// them before it runs its function, so that a micro-step it would fail is
  /// one that could run.
  void check_micro_step_state(const char* what) const;
  /// A micro-batch whose loss, num_items or metrics this rank rejected
  /// (acc.backward()'s own checks call it, and a binding's checks before
  /// them). One process, or before the window's closing micro-step, it does
  /// nothing: the rejected call changed nothing. Data parallel, at the closing
  /// micro-step, the other ranks are already reducing the window: it is
  /// dropped on every rank (Note [A refused closing micro-batch]), and the
  /// returned text says so ("window N was dropped on every rank: …"), to
  /// append to this rank's error. Data parallel before the closing
  /// micro-step, the text says that the micro-step was not counted and how
  /// to keep this rank's windows aligned (run it again, or
  /// empty_micro_step()). Empty otherwise.
  std::string refuse_micro_batch(const char* call, bool interrupted = false);
  /// How far this rank has gone: the micro-steps it counted plus the
  /// reductions it ran (dropped ones too). acc.run() compares it around a
  /// call that raised: unchanged, the call took no micro-step's place (data
  /// parallel, run() then fails the micro-step so that every rank still
  /// closes its windows together).
  int64_t progress_marker() const;
  /// backward_part() ran and end_micro_step() is still due.
  bool parts_open() const {
    return parts_open_;
  }
  /// backward() for a micro-batch that Python's acc.run() runs whole: the
  /// same, but its errors (and the reductions') name acc.run().
  void backward_whole(const at::Tensor& loss, std::optional<double> num_items, const at::Tensor& reported,
                      const at::Tensor& metrics = {});
  /// Takes the model's trainable set again after `requires_grad` changed
  /// (fine-tuning unfreezes a backbone), at a window boundary only, before the
  /// next forward (data parallel it broadcasts rank 0's values in place). Data
  /// parallel, a collective: every rank calls it at the same point, with the
  /// same set (checked). Counters carry over (but ReducerStats::bucket_rebuilds,
  /// which describes the new layout). See Note [Refreshing the
  /// parameters] in src/accumulator/refresh.cpp. A call this rank refuses at
  /// a window boundary (no trainable parameter) still meets the other ranks'
  /// (data parallel), so that every rank raises, and nothing changes;
  /// mid-window it is refused before any collective. Data parallel it opens
  /// with Reducer::refresh_check(), which a rank that reduces its next window
  /// instead meets bucket for bucket: every rank raises (Note [A refresh
  /// pairs like a window]).
  void refresh_parameters(ModelParameters model);
  /// The same, for a caller that refused the call on this rank already
  /// (`refused_here`: why, non-empty; Python's own checks): data parallel it
  /// meets the other ranks' calls, which then raise, and returns; the caller
  /// raises its own error.
  void refresh_parameters(ModelParameters model, const std::string& refused_here);
  /// Drops the current window: clears gradients and counters of the window.
  /// Data parallel, a closed window dropped on some ranks but stepped on
  /// others makes every rank raise in its next reduction (the replicas
  /// differ); dropped on every rank alike, it is simply gone (Note [A window
  /// not stepped on some ranks]). In the middle of a window it drops what
  /// this rank accumulated; one process, the position too (the next
  /// micro-step opens a new window); data parallel the position stays, so the
  /// window still closes with every rank, holding what every rank kept (Note
  /// [Dropping the middle of a window]).
  void zero_grad();
  /// zero_grad(), and data parallel the position too: every rank must call it
  /// at the same point (an epoch cut short alike on every rank).
  void restart_window();

  /// The last closed window's loss over every micro-batch of every rank,
  /// weighted as its gradient (mean of the micro-batch losses; total loss /
  /// total items; their sum): a 0-dim float64 tensor on the loss's device, no
  /// host synchronisation and no extra collective (Note [The window's loss
  /// rides in the header] in src/accumulator/window_loss.cpp). From the
  /// window's closing backward (or flush) until the next window closes; none
  /// before the first, where every bucket's wire is bf16/fp16 (comm_dtype, or
  /// only bf16/fp16 parameters without accumulate_dtype) and carries its
  /// header (up to 256 ranks for bf16, 2048 for fp16), for a window of
  /// weight 0, for the window a mid-window checkpoint cut, for a window
  /// dropped on every rank (window_items() is then 0), and after
  /// load_state_dict() or refresh_parameters() until a window closes. A copy:
  /// changing it changes nothing here.
  std::optional<at::Tensor> window_loss() const;
  /// That window's user metrics (AccumulatorOptions::metrics), each summed
  /// over its micro-batches and every rank, not divided (a window of weight 0
  /// has them too; a micro-batch nonfinite "skip_micro_batch" left out is left
  /// out whole, metrics included: stats().skipped_micro_batches counts them):
  /// a 1-D float64 tensor in the names' order, on the loss's device, no host
  /// synchronisation and no extra collective. None without metric names, and
  /// where window_loss() is None for any reason but the window's weight of 0.
  std::optional<at::Tensor> window_metrics() const;
  /// That window's weight summed over ranks: its items ("items") or
  /// micro-batches ("mean", "sum"). 0 before the first window closes, for a
  /// window dropped on every rank, and after load_state_dict() or
  /// refresh_parameters() until a window closes.
  double window_items() const {
    return window_loss_.items();
  }

  /// As Accelerate's `sync_gradients`: true through the window's closing
  /// micro-step, from before its backward() (the next one closes the window)
  /// until step(). It says whether the *next* backward() synchronises, so it
  /// is true after the backward() before the closing one too: code that
  /// needs the window's reduced gradients after a backward() (clipping,
  /// logging the norm) tests window_ready() instead.
  bool sync_gradients() const;
  /// Position in the current window, 0..steps-1.
  int64_t micro_step() const {
    return micro_step_;
  }
  /// True between the window's last backward() and step().
  bool window_ready() const {
    return window_ready_;
  }
  /// True where the other ranks ended the epoch with flush() in the reduction
  /// that closed this rank's last window (its shard ended on a boundary,
  /// theirs did not): this rank's own flush() is owed, a no-op with no
  /// collective, before its state is saved or the next epoch trains.
  bool epoch_ended() const {
    return epoch_ended_;
  }
  /// DDP-style manual control of the reducer (no-op without a process group).
  NoSync no_sync();
  /// The reducer's expect-hooks flag (true without a process group).
  bool expect_hooks() const;
  void set_expect_hooks(bool expect);

  AccumulatorStats stats() const;
  /// When the parts of the last reduction happened: each gradient's hook,
  /// each bucket's fill, launch and completion, the end of backward (see
  /// WindowTimeline). Empty without a process group.
  WindowTimeline last_window_timeline() const;
  /// The trainable parameters' names (each parameter once), in the
  /// Accumulator's order: that of last_window_timeline().gradients and of the
  /// reducer's bucket indices.
  const std::vector<std::string>& parameter_names() const {
    return names_;
  }
  /// Data parallel with `rank_independent` (the default), a collective when
  /// mid-window: every rank must call it at the same point.
  AccumulatorState state_dict(bool rank_independent = true);
  void load_state_dict(const AccumulatorState& state);
  /// The state through torch::serialize archives (`torch::save`-style).
  /// Writes state_dict(rank_independent) (rank_independent=false keeps this
  /// rank's error-feedback residual; only this rank may load it, but at a
  /// window boundary without a residual or an ended epoch).
  void save(torch::serialize::OutputArchive& archive, bool rank_independent = true);
  void load(torch::serialize::InputArchive& archive);

  /// Callbacks around each window's optimizer step (a loss scaler's: GradScaler
  /// from Python). `before_step` runs first at a closed window, before the
  /// non-finite check and clipping; false skips the window (no optimizer or
  /// scheduler step; skipped_steps). `after_window` runs once per closed window.
  void set_window_callbacks(std::function<bool()> before_step, std::function<void()> after_window);
  /// For a loss scaler of the caller's with error feedback: its `after_window`
  /// tells the new scale's ratio to the window's (a one-element tensor) when it
  /// changed, for the residuals (the built-in and Python scalers do it themselves).
  void rescale_residuals(const at::Tensor& ratio);
  /// The public call running now (acc.step(), ...: what callbacks name), or nullptr.
  const char* running_call() const {
    return driving_.load(std::memory_order_relaxed);
  }
  /// Note [A manual reduction in the middle of a window]: ends the window a
  /// plain loss.backward()'s reduction ended; raises for `call` if nothing told.
  void realign_after_manual_reduction(const char* call = nullptr);

  /// Removes the hooks and releases the parameters for another Accumulator.
  /// Later training calls raise; getters, stats() and close() again do not.
  /// No collective (Note [Closed in the middle of a window]).
  void close();
  bool closed() const {
    return closed_;
  }
  ~Accumulator();

  const AccumulatorOptions& options() const {
    return options_;
  }
  const std::vector<at::Tensor>& parameters() const {
    return params_;
  }
  /// Null without a process group.
  Reducer* reducer() {
    return reducer_.get();
  }

 private:
  void scale_local_gradients();
  void accumulate_wide();
  void check_open(const char* what) const;
  void check_gradients_untouched(const char* what, bool allow_in_place) const;
  void check_gradients_untouched(const char* what, bool allow_in_place,
                                 const std::vector<GradMark>& now) const;
  void remember_gradients();
  void check_requires_grad(const char* what) const;
  void check_optimizer_parameters(const char* what) const;
  void check_no_open_parts(const char* what) const;
  /// After a local backward that ran no gradient hook (compiled autograd):
  /// tells the reducer which gradients it changed (Note [Compiled autograd]).
  void note_hookless_backward(uint64_t hooks_before, const std::vector<GradMark>& before);
  /// The next backward() (or micro-step in parts) closes the window.
  bool closes_window_next() const;
  void backward_as(const char* call, const at::Tensor& loss, std::optional<double> num_items,
                   const at::Tensor& reported, const at::Tensor& metrics);
  void check_metrics(const at::Tensor& metrics, const char* what) const;
  /// The loss window_loss reports in place of the one backward runs on.
  static void check_reported(const at::Tensor& reported, const char* what);
  /// A request naming the public call in progress (for the reducer's errors).
  ReductionRequest new_request() const {
    ReductionRequest request;
    request.call = call_;
    request.forwards = window_forwards_;
    request.shared = window_shared_;
    return request;
  }
  const char* call_name() const {
    return call_ ? call_ : "acc.backward()";
  }
  void check_window_gradients(const char* what, const std::vector<GradMark>& before);
  bool keep_micro_batch(const at::Tensor& value, const at::Tensor& metrics);
  void close_window(const at::Tensor& scaled, double weight, const std::vector<GradMark>& before);
  void fail_micro_step(AbortReason why);
  /// refuse_micro_batch() inside a call that holds the call guard.
  std::string drop_refused_window(const char* call, bool interrupted = false);
  /// Note [The closing micro-step inside no_sync()]: throws, at the window's
  /// closing micro-step inside acc.no_sync(), after dropping the window on
  /// every rank.
  void refuse_closing_in_no_sync(const char* call);
  /// At a boundary, for `what`: "acc.step()", "acc.state_dict()" or
  /// "acc.refresh_parameters()" (each words its error).
  void check_no_uncounted_backward(const char* what) const;
  /// Every write of window_ready_: holding a closed window arms the check
  /// below (Note [A backward after the window closed]).
  void set_window_ready(bool ready);
  /// Refuses a closed window a backward reached after it closed (part of
  /// check_gradients_untouched()).
  void check_no_late_backward(const char* what) const;
  /// Note [Gradients no micro-step counted]: the first parameter whose .grad
  /// changed since `remembered_` and holds a non-zero value.
  std::optional<size_t> uncounted_gradient(const std::vector<GradMark>& now) const;
  /// Raises (one process) or fails the window (data parallel, true) for one.
  bool refuse_uncounted_gradients(const char* what, const std::vector<GradMark>& now);
  void forget_nonzero_gradients();
  /// Those of `which` whose .grad holds a non-zero (or NaN) value, in order.
  std::vector<size_t> nonzero_gradients(const std::vector<size_t>& which) const;
  double check_micro_step(const at::Tensor& loss, std::optional<double> num_items, const char* what) const;
  void check_no_inference_grads(const char* what, const std::vector<GradMark>& marks) const;
  void fail_after_peers_ended_epoch();
  void local_micro_step(const at::Tensor& scaled, double weight, const std::vector<GradMark>& before);
  void reduce_window(const at::Tensor& scaled, double weight);
  bool step_before_flush(std::string* local_failure);
  bool reduce_partial_window(const std::string& local_failure, bool joined);
  void check_join_partners(const ReductionResult& result, bool joining);
  void add_micro_loss(const at::Tensor& loss, const at::Tensor& metrics);
  void close_window_loss(const ReductionResult& result, const at::Tensor& like);
  void close_local_window_loss();
  /// A window dropped on every rank when it closed: no loss, metrics or items.
  void forget_window_loss();
  /// close_window_loss(), or forget_window_loss() where that fails.
  void take_reduced_loss(const ReductionResult& result, const at::Tensor& like) noexcept;
  void reset_window(bool clear = true);
  /// zero_grad() without its call guard: a closed window that every rank
  /// drops alike (acc.step()'s skips) or that a reduction tells of already.
  void drop_window();
  /// zero_grad() and flush() inside a call of this Accumulator's own (join()).
  void zero_grad_in_call(const char* why = "acc.zero_grad() dropped it here once it was closed");
  int64_t join_in_call(); ///< join() (whose catch notes that a shadow was told to end training)
  bool flush_in_call();
  void note_dropped_window(int64_t window);
  void check_consistent_cut(int64_t window, bool failed_here = false) const;
  void snapshot_window_into(AccumulatorState& state);
  void copy_window_into(AccumulatorState& state) const;
  at::Tensor own_window_loss_sums() const; ///< Note [The window's loss across a checkpoint]
  void check_loadable(const AccumulatorState& state) const;
  /// What the reducer's ranks must agree on, from the options (and the
  /// built-in loss scaler's scale now, where it exists).
  WindowRule window_rule() const;
  std::vector<GradMark> grad_versions() const;
  bool finish_window(const char* call);
  bool step_window(const char* call);
  /// step_window() up to and with the optimizer's step: false where the
  /// window is skipped (no step).
  bool step_optimizer(const char* call);
  /// Note [A non-finite window left for the epoch's end].
  void drop_nonfinite_at_epoch_end(bool raised_before);
  /// A skip of a reduced window, said in the next reduction (Note [A window
  /// not stepped on some ranks]).
  void mark_skipped();
  bool reducer_checks_finite() const;
  void clear_gradients();
  std::vector<at::Tensor> defined_grads() const;

  AccumulatorOptions options_;
  std::vector<at::Tensor> params_;
  StepFunction optimizer_step_;
  StepFunction scheduler_step_;
  ParameterList optimizer_parameters_;
  std::unique_ptr<Reducer> reducer_;

  int64_t micro_step_ = 0;
  bool window_ready_ = false;
  double window_weight_ = 0; ///< of the micro-steps so far (the closing one excluded)
  /// A micro-step of this window failed on this rank: when the window closes,
  /// it is dropped on every rank (data parallel only).
  bool window_failed_ = false;
  /// backward_part() ran in this micro-step; end_micro_step() counts it.
  bool parts_open_ = false;
  double parts_weight_ = 0; ///< the open parts' weight (kept shares, or items)
  bool parts_skipped_ = false; ///< a part was left out (nonfinite="skip_micro_batch")
  AbortReason window_failure_ = AbortReason::BackwardFailed;
  /// What this rank alone knows of a GradientsChanged failure (which
  /// parameter, which case), appended to its own error when the window is
  /// dropped (fail_for_changed_gradients()).
  std::string failure_detail_;
  /// Marks the window failed for gradients changed outside the Accumulator:
  /// mid-window (`uncounted` false), or written before its first micro-step
  /// and counted by none (true).
  void fail_for_changed_gradients(const std::vector<GradMark>& now, bool uncounted);
  /// `error` with failure_detail_ appended (the window's drop on this rank).
  std::string with_failure_detail(const std::string& error, const std::string& detail) const;
  /// This rank's last window was reduced with other ranks' flush(): the epoch
  /// is over, and this rank's flush() steps nothing and reduces nothing.
  bool epoch_ended_ = false;
  /// This rank raised that it went on training after the others ended the
  /// epoch (fail_after_peers_ended_epoch()): its own flush() that ends the
  /// epoch pairs with nothing and runs no collective.
  bool epoch_ended_raised_ = false;
  /// The window's micro-batch losses so far, then its metrics (1-D float64,
  /// on the loss's device), and with the current micro-step's; the last
  /// closed window's loss and weight.
  at::Tensor window_loss_sum_;
  at::Tensor pending_loss_sum_;
  /// Held while reducer_ is read by stats(), last_window_timeline() and
  /// expect_hooks() (another thread may call them) and while close() and
  /// refresh_parameters() take it away.
  mutable std::mutex reducer_readers_;
  detail::SharedLoss window_loss_; ///< the last closed window's loss, with its items (window_items())
  detail::SharedTensor window_metrics_; ///< the last closed window's metric sums (window_metrics())
  /// This window was resumed mid-way from a checkpoint: its loss is unknown.
  bool window_loss_cut_ = false;
  /// This window's sums so far are each rank's share of every rank's, from
  /// a rank-independent state loaded in its middle (Note [Dropping the middle
  /// of a window]).
  bool window_shared_ = false;
  /// Reducer::manual_reductions() at this Accumulator's last call.
  uint64_t manual_seen_ = 0;
  /// The reducer found the closed window's gradient finite as it wrote it back.
  bool window_known_finite_ = false;
  /// The closed window's weight is 0 on every rank (every micro-batch left
  /// out, or no items anywhere): step_window() skips it.
  bool window_empty_ = false;
  AccumulatorStats stats_;
  /// Frozen when built: an error if one becomes trainable (it would be untracked).
  std::vector<std::pair<std::string, at::Tensor>> frozen_;
  /// .grad identities and versions after this Accumulator last touched them.
  std::vector<GradMark> remembered_;
  bool closed_ = false;
  /// A micro-batch of this window ran its forward here (any micro-step but an
  /// empty one; a mid-window resume counts): ReductionRequest::forwards.
  bool window_forwards_ = false;
  /// The thread inside a public call, if any (Note [One thread drives an Accumulator]).
  std::atomic<std::thread::id> driver_{};
  /// The outermost public call in progress (set by its CallGuard); null
  /// between calls.
  std::atomic<const char*> driving_{nullptr};
  /// The outermost public call in progress that runs reductions (set by its
  /// CallGuard); null between calls.
  const char* call_ = nullptr;
  std::function<bool()> before_step_;
  bool before_step_ran_ = false; ///< in this window's step_window(): see finish_window()
  /// step_window() raised a decision every rank makes alike (nonfinite="raise"
  /// on the reduced gradient): flush() need not drop the window everywhere.
  bool raised_alike_ = false;
  /// This closed window's step raised nonfinite="raise" already (Note [A
  /// non-finite window left for the epoch's end]).
  bool window_raised_nonfinite_ = false;
  /// This closed window is the one acc.flush()'s own reduction closed (Note [Flushing again after its step raised]).
  bool window_closed_by_flush_ = false;
  /// This closed window went through the loss scaler / before_step_ already
  /// (a step() that raised after it is retried without them).
  bool window_unscaled_ = false;
  /// The optimizer stepped this closed window, then the scheduler raised: a
  /// retry of step() runs the scheduler only (acc.zero_grad() drops it).
  bool window_optimizer_stepped_ = false;
  bool window_scaler_failed_ = false; ///< before_step_ itself raised: see finish_window()
  /// max_grad_norm clipped this closed window's gradient in place (its norm is
  /// stats().last_grad_norm), and then the optimizer raised: a retry of step()
  /// steps it as it is, where clipping again would scale it down once more.
  bool window_clipped_ = false;
  /// The built-in loss scaler, installed as the window callbacks (Note [One
  /// loss scaler path]); null without AccumulatorOptions::loss_scaler.
  std::unique_ptr<detail::LossScaler> loss_scaler_;
  std::function<void()> after_window_;
  /// Whether parameter `i`'s window is summed in accumulate_dtype (wider).
  bool accumulates_wide(size_t i) const;
  /// One process with accumulate_dtype: the window's sums of narrower
  /// gradients (data parallel: in the reducer's buckets).
  std::unique_ptr<detail::WideSums> wide_;
  /// One process: the hooks that see a backward after the window closed
  /// (data parallel, the reducer's do).
  std::unique_ptr<detail::LateBackwardWatch> late_watch_;
  std::vector<std::string> names_;
  std::shared_ptr<void> claim_; ///< releases the parameters for another Accumulator
};

/// Building an Accumulator over a group is a collective, and a rank that
/// cannot build one tells the others in the construction's first collective,
/// so that every rank raises (Note [Construction refused on one rank],
/// src/rank_check.cpp). A check of your own before the constructor does the
/// same: call this, in place of the constructor, on the rank that refuses,
/// then raise `why` there. The other ranks' constructors raise its message,
/// naming this rank, as the same kind of error (c10::ValueError,
/// c10::TypeError, or else c10::Error). `device`: the parameters' device; one
/// the group cannot reach (the CPU under NCCL) means the current CUDA device.
void refuse_construction(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::exception& why,
                         at::Device device = at::kCPU);

} // namespace gradaccum
