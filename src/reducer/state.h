#pragma once
// Internal: the state a Reducer shares with its autograd hooks and engine
// callbacks. Three parts: the config (fixed), the buckets, and the window (the
// reduction in flight, and what the last one left); and the layers that work
// on them, each calling only the ones listed before it:
//   comm.h, reducer/config.h                                  (no State)
//   consensus/, precision/, buckets/, rank_check.h            (no State)
//   the reduction: launch.cpp, finish.cpp, drop.cpp           (State)
//   the autograd glue: hooks.cpp                              (State)
//   the Reducer facade: reducer.cpp

#include "buckets/bucket_set.h"
#include "comm.h"
#include "consensus/agreement.h"
#include "consensus/window_header.h"
#include "detail/late_backward.h"
#include "rank_check.h"
#include "reducer/config.h"

#include <gradaccum/reducer.h>

#include <c10/util/irange.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// Note [Collectives pair by launch order]
// c10d pairs the n-th collective of one rank with the n-th of every other rank.
// So every reduction launches every bucket, strictly in index order, on every
// rank, whatever order the hooks fire in and whatever happens to this rank's
// backward: a failing rank still launches its remaining buckets (flagged, see
// Note [Dropping a window]), a rank whose loss touched no parameter launches
// them all at the end, and a closing micro-step always produces exactly one
// reduction. Buckets change only between windows, once, identically on every
// rank (Note [Rebuilding buckets in ready order]). The reducer's other
// collectives pair by the same rule, so each runs on every rank at the same
// point, whatever fails locally: the checks at construction
// (check_ranks_match), the second all-reduce of a light window's fp16
// buckets after every rank's verdict (Note [Re-sending a light window];
// resend.cpp), the buffers' broadcast and the rebuild's broadcast and
// allgather after a window every rank reduced (finish.cpp).

// Note [What a window number means]
// Window::sequence counts the reductions this rank completed, dropped ones and
// checkpoints' snapshots included, so it is the number of the next one: the
// "window 3" of errors, ReductionResult::window, Progress::sequence. Every
// reduction pairs on every rank (Note [Collectives pair by launch order]), so
// it is the same on every rank; every bucket's header carries it (kWindow)
// and a difference drops the window. It advances in end_reduction() only,
// once per reduction whatever its end, and restore() sets it from a
// checkpoint on every rank alike.

namespace gradaccum {
namespace detail {

/// The user-level call a reduction runs in (its errors surface there).
enum class Entry {
  Backward, ///< acc.backward() (Reducer::backward, or reduce() dropping a window)
  ManualBackward, ///< a plain loss.backward() outside no_sync (begun by a hook)
  Flush, ///< acc.flush() (reduce() closing a partial window)
  StateDict, ///< acc.state_dict() (snapshot() of a half-done window)
  Refresh, ///< acc.refresh_parameters() (refresh_check() at a window boundary)
};

/// How errors name `entry`: the call in which they surface.
inline const char* call_name(Entry entry) {
  switch (entry) {
    case Entry::Backward: return "acc.backward()";
    case Entry::ManualBackward: return "loss.backward()";
    case Entry::Flush: return "acc.flush()";
    case Entry::StateDict: return "acc.state_dict()";
    case Entry::Refresh: return "acc.refresh_parameters()";
  }
  return "?";
}

/// The same, unless the request names the user's call itself.
inline const char* call_name(Entry entry, const ReductionRequest& request) {
  return request.call ? request.call : call_name(entry);
}

/// A bucket's all-reduces completing (Note [The window's timeline]): the
/// latest completion, once none is pending.
struct Completion {
  std::atomic<int64_t> latest_ns{-1};
  std::atomic<int> pending{0};
};

/// What Window::failure holds without allocating (kUnworded fits).
constexpr size_t kFailureCapacity = 256;
/// A dropped window's error when its own text could not be allocated.
constexpr const char* kUnworded =
    "gradaccum: this rank dropped the window (every rank drops it), and ran out of memory wording why";

/// Why a rank did not step a window every rank had reduced (Note [A window
/// not stepped on some ranks]), as its own error says.
constexpr const char* kLostAfterReduction = "a failure after its reduction cleared it here";

/// The reduction in flight, and what the last one left. Guarded by
/// State::mutex; begin_reduction() resets the first part, end_reduction()
/// ends it.
struct Window {
  bool in_flight = false;
  ReductionRequest request;
  Entry entry = Entry::Backward;
  uint64_t sync_id = 0; ///< which reduction the queued callbacks belong to
  int anchor_task = -1; ///< see Note [Where a synchronising backward ends]
  std::vector<char> ready; ///< per parameter: its hook fired in this reduction
  size_t next_launch = 0; ///< the next bucket to launch, in index order
  size_t hook_launches = 0; ///< buckets this reduction's hooks launched
  size_t early_launches = 0; ///< of those, launched before the last hook so far
  /// comm_dtype to bf16/fp16: each rank multiplies its gradients by 1 / this
  /// before rounding them (so that fp16 cannot overflow in the sum), fixed when
  /// the reduction begins (Note [Scaling before the sum]).
  double expected_weight = 1.0;
  /// The window's global weight where its fp16 buckets were sent again at
  /// it (Note [Re-sending a light window]); 0: not re-sent.
  double resent_weight = 0;
  /// Error feedback: what each rank multiplies its residual by before adding
  /// it to this reduction's gradients, fixed when the reduction begins (Note
  /// [Error feedback across window weights]).
  double residual_carry = 1.0;

  /// Note [The window's timeline]: times from `origin`, the reduction's
  /// beginning; each bucket's completion is stamped by a callback on its
  /// all-reduce's future (which may run after wait() returned: read late).
  std::chrono::steady_clock::time_point origin;
  WindowTimeline timeline;
  std::vector<std::shared_ptr<Completion>> completed;
  /// Note [Writing back while the last buckets reduce]: per bucket, whether
  /// agree() wrote it back already, what its own summed weight was then, and
  /// whether the values it wrote were bounded; and the first local failure
  /// of those write-backs, raised once the window's collectives are done.
  struct EarlyWrite {
    bool read = false; ///< its meta (Bucket::meta_values), whether written or not
    bool written = false;
    bool bounded = false;
    double weight = 0;
  };
  std::vector<EarlyWrite> early;
  std::exception_ptr early_failure;
  double elapsed() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - origin).count();
  }

  /// Why this rank did not step the last window every rank reduced, told to
  /// every rank in its next reduction (Note [A window not stepped on some
  /// ranks]); null where it did. `unstepped` is what this reduction sends.
  const char* unstepped = nullptr;

  // What outlives a reduction.
  int64_t sequence = 0; ///< Note [What a window number means]
  /// Why this rank will not step the last window every rank reduced, until a
  /// reduction tells every rank (Reducer::mark_unstepped()); null: none.
  const char* unstepped_pending = nullptr;
  WindowTimeline last_timeline; ///< the last completed reduction's (completions unresolved)
  std::vector<std::shared_ptr<Completion>> last_completed;
  /// The global weight of the last full window reduced (the same on every
  /// rank); 0 before the first. The expected weight of the next items window.
  double last_weight = 0;
  /// Error feedback: this rank's weight in the window whose rounding the
  /// residuals hold (0: unknown, carried as they are; Note [Error feedback
  /// across window weights]).
  double residual_weight = 0;
  /// Error feedback under a loss scaler: what the residuals still owe the
  /// scale's changes since their window, a 0-dim tensor (undefined: 1; Note
  /// [Error feedback across loss scales]).
  at::Tensor residual_rescale;
  int last_anchor_task = -1;
  /// Note [A failed backward inside no_sync()]: one failed after some of its
  /// gradients reached .grad, since the last reduction or acc.zero_grad();
  /// `failed_no_sync_read` is what the reduction in flight read of it.
  bool failed_no_sync = false;
  bool failed_no_sync_read = false;
  /// The same for the Accumulator's own micro-steps: one failed (or found
  /// the gradients changed) in this window, which the Accumulator drops when
  /// it closes; a plain loss.backward() that closes it instead (Note [A
  /// manual reduction in the middle of a window]) drops it with this reason.
  AbortReason failed_counted = AbortReason::None;
  AbortReason failed_counted_read = AbortReason::None;
  /// Note [A second backward after the manual path's reduction]: under
  /// "sum", each parameter's .grad (its TensorImpl and version) as the last
  /// manual reduction left it (empty otherwise).
  std::vector<std::pair<const void*, int64_t>> manual_written;
  bool warned_second_backward = false;
  bool aborted_here = false; ///< this rank dropped the last reduction itself
  /// Why the last reduction dropped its window ("" if it did not; also if
  /// even kUnworded could not be kept). Its capacity is reserved with the
  /// state: abort_reduction(), which must not throw, falls back to kUnworded.
  std::string failure;
  /// `failure`, or kUnworded where not even that could be kept.
  std::string failure_text() const {
    return failure.empty() ? std::string(kUnworded) : failure;
  }
  // When this rank dropped it: own_failure() composes the error from these.
  std::string own_where;
  AbortReason own_reason = AbortReason::None;
  std::string own_transport;
  /// Of the ranks that dropped it, those but this one (their count, and the
  /// one's rank where the header names it, else -1).
  int64_t other_aborters = 0;
  int64_t other_aborter = -1;
  ReductionResult last_result;

  /// 0: a window's reduction (acc.backward(), acc.flush(), acc.join()),
  /// 1: a checkpoint's snapshot, 2: a refresh's check, 3: a plain
  /// loss.backward()'s (the manual path) (kKind). A rank whose stray plain
  /// backward reduces meets the others' window: the kinds differ, every rank
  /// drops it, where the two used to pair silently.
  int64_t kind() const {
    return entry == Entry::StateDict ? 1 : entry == Entry::Refresh ? 2 : entry == Entry::ManualBackward ? 3 : 0;
  }
};

/// A reduction every rank agreed on: its result, and the verdict it came
/// from (the window's metric sums, which the result takes later: Note
/// [Reading the window allocates nothing]). The summed meta stays in each
/// bucket (Bucket::meta_values).
struct Reduced {
  detail::Verdict verdict;
  ReductionResult result;
};

/// Checks a request where it enters (Reducer::backward(), reduce()), for the
/// call `entry`.
void check_request(const ReductionRequest& request, Entry entry);

} // namespace detail

struct Reducer::State : std::enable_shared_from_this<Reducer::State> {
  explicit State(detail::ReducerConfig config);

  const detail::ReducerConfig config;
  /// config.instance, held while this state lives (Note [Which Accumulator a
  /// collective belongs to]).
  const detail::InstanceHold instance_hold;
  /// config.buffers' broadcast, its flat copies allocated here
  /// (Note [The buffers' broadcast allocates nothing]); emptied after the
  /// construction's broadcast without broadcast_buffers.
  detail::BroadcastPlan buffer_broadcast;
  detail::OnceBroadcast frozen_broadcast; ///< at construction only

  // The autograd glue's own (hooks.cpp).
  // shared_ptr<Node> before torch 2.13, intrusive_ptr<Node> since: whatever
  // grad_accumulator() returns.
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::vector<NodePtr> grad_accumulators;
  std::vector<uintptr_t> hook_keys;
  std::atomic<bool> expect_hooks{true};
  /// Whether a hook fired for each parameter since the last reduction: with
  /// bucket views .grad is always defined, so this tells "no gradient" apart.
  std::unique_ptr<std::atomic<bool>[]> touched;
  /// Gradient hooks run, in all: a backward that changed gradients without
  /// running one ran none (Note [Compiled autograd]).
  std::atomic<uint64_t> hook_calls{0};
  std::atomic<uint64_t> manual_reductions{0}; ///< Reducer::manual_reductions()
  std::atomic<uint64_t> manual_dropped_at{0}; ///< Reducer::manual_dropped_at()
  /// Reducer::backward() (acc.backward()) is running: a compiled backward
  /// without hooks is then reduced after it (Note [Compiled autograd]).
  std::atomic<bool> in_backward{false};
  std::atomic<bool> closed{false}; ///< the Reducer was destroyed: hooks are inert
  /// Note [A failed backward inside no_sync()]: the graph task of the last
  /// no_sync backward a hook of which ran (its failure watched).
  std::atomic<int> watched_task{-1};
  /// Inside the Accumulator's own no_sync micro-step (NoSync's `counted`):
  /// its failures are the Accumulator's to handle, and nothing is watched.
  std::atomic<bool> counted_no_sync{false};
  /// The watches' generation (a reduction or acc.zero_grad() begins the
  /// next one) above kWatchCountBits, and below them how many outer nodes'
  /// post-hooks of this generation are armed and not yet run: one word, so
  /// that a count always belongs to its generation.
  static constexpr int kWatchCountBits = 20;
  std::atomic<uint64_t> outer_watches{0};
  uint64_t watch_generation() const { return outer_watches.load() >> kWatchCountBits; }
  /// Begins the next generation; whether any outer watch of this one was still armed.
  bool next_watch_generation() {
    auto word = outer_watches.load();
    while (!outer_watches.compare_exchange_weak(word, ((word >> kWatchCountBits) + 1) << kWatchCountBits)) {
    }
    return (word & ((uint64_t{1} << kWatchCountBits) - 1)) != 0;
  }
  /// Note [A backward after the window closed]: armed while the Accumulator's
  /// window is closed and not yet stepped (held: hooks begin no reduction).
  detail::LateBackwardRecord late;

  // Everything below is guarded by mutex: CUDA backward runs hooks on device
  // threads, and a failed backward's guard runs wherever torch frees the task.
  /// The dropped reduction whose "end training" this rank has acted on
  /// (left join()); the manual path's backward is refused while one is not,
  /// and while `epoch_ended_refusal` says why the one-sided flush error does.
  int64_t end_acted_on = -1;
  std::string epoch_ended_refusal;
  mutable std::mutex mutex;
  detail::BucketSet buckets;
  detail::Window window;
  ReducerStats stats;

  // The autograd glue (hooks.cpp).
  void add_hooks();
  void remove_hooks() noexcept;
  void mark_ready(size_t index, bool reached);
  bool held_gradient(size_t index);
  /// A no-sync hook with gradient_as_bucket_view: Note [Bucket views in
  /// no-sync micro-steps].
  void keep_on_view(size_t index);
  /// begin_reduction() inside graph task `task` (-1: none), finishing at its end.
  void begin_in_task(const ReductionRequest& request, int task, detail::Entry entry);
  void queue_end_callback(int task);
  void on_outer_node_end(uint64_t id, int nested_task);
  void on_task_end(uint64_t id, int task);
  void on_task_failed(uint64_t id) noexcept;
  void watch_no_sync_task();
  void note_manual_written();
  std::optional<size_t> adds_to_manual_written(size_t index) const;
  void on_no_sync_task_failed() noexcept;
  /// Reducer::backward() after loss.backward() raised `local`: drops the
  /// window on every rank unless that happened already. Returns this rank's
  /// own error when this rank dropped it ("" when the error raised is every
  /// rank's).
  std::string drop_failed_backward(const ReductionRequest& request, int64_t sequence_before,
                                   const std::string& local, AbortReason why);
  ReductionResult end_backward(const ReductionRequest& request, int64_t sequence_before,
                               const std::vector<std::pair<const void*, int64_t>>& versions_before);
  /// The request of a synchronising backward of the manual path.
  ReductionRequest manual_request() const;
  /// Why the manual path may not begin a reduction on this rank now, or
  /// empty (Note [Training ended in join()], in src/accumulator/join.cpp).
  std::string training_ended() const;
  /// The last reduction told this rank to end training, not yet acted on.
  bool told_to_end() const;

  // The reduction: beginning and launching (launch.cpp).
  void begin_reduction(const ReductionRequest& request, int task, detail::Entry entry);
  void copy_into_bucket(Bucket& bucket, size_t slot);
  void launch_ready_buckets();
  void launch_rest();
  void launch_bucket(size_t index);
  void stamp_completion(size_t index);
  /// This rank's header for bucket `index` in the reduction `request` asks
  /// for, its missing slots flagged (Note [Bucket meta layout]).
  std::vector<double> bucket_header(const ReductionRequest& request, size_t index) const;
  /// Writes `header` into the bucket's meta, and the window's loss and
  /// metrics where the meta is not digit-encoded.
  void write_bucket_meta(Bucket& bucket, const std::vector<double>& header);
  /// Launches the all-reduce(s) of what bucket `index`'s wire and meta hold
  /// now, stamps their completion and counts them.
  void allreduce_bucket(size_t index);

  // Finishing, as named phases (finish.cpp: Note [Finishing a reduction]).
  ReductionResult finish_reduction(std::vector<at::Tensor>* snapshot = nullptr);
  std::vector<at::Tensor> complete_buckets(bool snapshot);
  /// `closing`: a window's reduction, whose buckets may be written back as
  /// their all-reduces complete (Note [Writing back while the last buckets
  /// reduce]); a snapshot's never are.
  detail::Reduced agree(bool closing);
  /// Waits for every collective launched; throws what failed, naming this rank.
  void wait_all(bool write_early = false);
  void wait_bucket(size_t index);
  /// Writes bucket `index` back before the verdict where it can; never throws
  /// (a local failure is kept in Window::early_failure).
  void write_back_early(size_t index) noexcept;
  void read_all_meta() const;
  /// The result's loss and metric sums from the verdict, together (the
  /// metric sums allocate: a local failure here comes after the consensus).
  void take_metric_sums(detail::Reduced& reduced);
  ReductionResult complete_snapshot(detail::Reduced reduced, const std::vector<at::Tensor>& saved,
                                    std::vector<at::Tensor>& sums);
  ReductionResult complete_window(detail::Reduced reduced);
  /// Note [Re-sending a light window]: after an agreed verdict (resend.cpp).
  void resend_if_light(const detail::Verdict& verdict);
  /// The scale a compressed bucket's wire was sent at.
  double wire_scale(const Bucket& bucket) const;
  /// Runs every one of them, whatever fails on this rank, then rethrows.
  void window_collectives(int64_t joined_ranks, std::optional<detail::RebuildPlan>& rebuild);
  /// The manual path's own words for a local failure after its reduction
  /// (a plain loss.backward() has no Accumulator call to word it); returns
  /// when it is worded already.
  void fail_manual_after_reduction(const std::exception_ptr& failed, bool stepped_elsewhere);
  /// A wide bucket keeps its sums: complete_window() zeroes them.
  bool write_back(Bucket& bucket, const std::vector<double>& meta, bool divide, double divisor,
                  bool check_finite);

  // Dropping a window, and ending a reduction (drop.cpp).
  void abort_reduction(AbortReason reason) noexcept;
  /// The error of the window this rank dropped, with what failed here (`local`).
  std::string own_failure(const std::string& local) const;
  [[noreturn]] void fail(const std::string& message);
  /// fail() with the message `word()` returns; if wording it throws, the
  /// window still ends here (end_failed_window()) before that error leaves.
  template <typename Word>
  [[noreturn]] void fail_worded(const Word& word) {
    std::string message;
    try {
      message = word();
    } catch (...) {
      end_failed_window();
      throw;
    }
    fail(message);
  }
  /// fail() without its error: for a failure whose error could not be worded.
  void end_failed_window() noexcept;
  void end_dropped_window() noexcept;
  void drop_window();
  void end_reduction(bool window_closed);

  // Small helpers, also on the hot path (inline).
  void clear_touched() {
    for (const auto i : c10::irange(config.params.size())) {
      touched[i].store(false, std::memory_order_relaxed);
    }
  }
  /// kKind's value: the kind, plus 4 while the bucket rebuild is pending,
  /// plus 8 in a window resumed from a rank-independent state (Note [A
  /// window resumed on some ranks only]).
  int64_t kind_code() const {
    return window.kind() + (buckets.final ? 0 : 4) + (window.request.shared ? 8 : 0);
  }
  /// This rank's values of what the ranks must agree on, for this reduction.
  detail::AgreementInputs agreement_inputs() const {
    detail::AgreementInputs inputs{config.rule, config.options, config.params.size(), window.sequence, kind_code(),
                                   config.one_host};
    inputs.unstepped = window.unstepped;
    inputs.instance = config.instance;
    return inputs;
  }
  /// What every error of this reduction starts with: "gradaccum: acc.flush(): window 3".
  std::string where() const {
    if (window.entry == detail::Entry::Refresh) { // (no window: Note [A refresh pairs like a window])
      return "gradaccum: acc.refresh_parameters(): its check (reduction " + std::to_string(window.sequence) + ")";
    }
    return std::string("gradaccum: ") + detail::call_name(window.entry, window.request) + ": window " +
        std::to_string(window.sequence);
  }
  /// Raises when a hook meets a sparse gradient, or one of another dtype or
  /// shape than the parameter's bucket slot `view` was built for (on the
  /// hook's path: inline).
  void check_gradient(const at::Tensor& grad, size_t index, const at::Tensor& view) const {
    TORCH_CHECK(!grad.is_sparse(), where(), ": ", config.name(index), " has a sparse gradient "
        "(nn.Embedding(sparse=True), or F.embedding(..., sparse=True)?); sparse gradients are not supported: use "
        "sparse=False");
    if (C10_UNLIKELY(grad.scalar_type() != config.dtypes[index] || !grad.sizes().equals(view.sizes()))) {
      TORCH_CHECK(false, where(), ": ", config.name(index), "'s gradient is ", grad.scalar_type(), " ",
          grad.sizes(), ", but the Accumulator was built for a ", config.dtypes[index], " ", view.sizes(),
          " parameter: was the model converted or reshaped after it was built (model.to(dtype), .double(), "
          ".half(), param.data = ...)? Call acc.refresh_parameters() on every rank at the window boundary "
          "after such a change");
    }
  }
  /// Raises unless no reduction is in flight and (with `buckets_needed`) this
  /// rank has its buckets: `call` names the user's call.
  void check_idle(const char* call, bool buckets_needed = true) const {
    TORCH_CHECK(!window.in_flight, "gradaccum: ", call, ": called during a synchronising backward; "
        "an Accumulator is not thread-safe: call it from the thread that runs its backward, never "
        "from a gradient hook or while another thread is inside acc.backward()");
    if (buckets_needed) {
      check_buckets(call);
    }
  }
  /// Raises when this rank lost its buckets (BucketSet::rebuild()).
  void check_buckets(const char* call) const {
    TORCH_CHECK(buckets.lost.empty(), "gradaccum: ", call, ": ", buckets.lost,
                ", so this rank cannot reduce again: end training on every rank and resume from a checkpoint in "
                "new Accumulators");
  }
};

} // namespace gradaccum
