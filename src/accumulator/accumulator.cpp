#include <gradaccum/accumulator.h>
#include <gradaccum/detail/failed_backward.h>

#include "call_guard.h"
#include "window_errors.h"
#include "comm.h"
#include "detail/late_backward.h"
#include "precision/loss_scaler.h"
#include "precision/wide_sums.h"
#include "parameters.h"
#include "rank_check.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/optim/lbfgs.h>

#include <torch/nn/modules/embedding.h>

#include <cmath>
#include <cstdlib>
#include <sstream>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace gradaccum {
namespace {

using detail::CallGuard;

// Note [No group under a multi-rank launch]
// torchrun starts WORLD_SIZE processes and leaves creating the process group to
// the script. One that forgets builds Accumulators with no group: every rank
// then trains alone, on its own shard, and the ranks end with different weights,
// with no word. So no group under WORLD_SIZE > 1 is an error on every rank
// (each reads the same environment), unless local_only says it is meant. The
// Python package says the same in its own words, and also checks at each
// backward() that no default group appeared after construction.
void check_launch_has_group(const AccumulatorOptions& options) {
  if (options.process_group() || options.local_only()) {
    return;
  }
  const char* world = std::getenv("WORLD_SIZE");
  char* end = nullptr;
  const long ranks = world ? std::strtol(world, &end, 10) : 1;
  const bool a_number = world && end != world && *end == '\0';
  TORCH_CHECK(!a_number || ranks <= 1,
      "gradaccum: Accumulator(): WORLD_SIZE=", world, " in the environment (a torchrun launch?) but "
      "no process group was given, so each rank would train alone and the ranks would end with "
      "different weights. Pass one (options.process_group(gradaccum::init_process_group_from_env())), "
      "or set options.local_only(true) to train each rank alone on purpose");
}

} // namespace

namespace detail {

// Every rank reduced the window; this one failed afterwards (its write-back,
// a collective after the consensus), and the reducer cleared its gradients.
// An empty window (global weight 0) is stepped nowhere: only the buffers may
// differ (this rank's if it failed to receive them, the others' if it sent).
std::string failed_after_reduction(const char* call, int rank, const ReductionResult& last, const std::exception& e) {
  return c10::str("gradaccum: ", call, ": every rank reduced the window, but this rank (rank ", rank,
      ") failed after that: ", detail::message_of(e), ". This rank dropped its window (no optimizer step here) ",
      last.global_weight > 0 ? "while the other ranks step theirs: the replicas differ from here on. Resume every "
                               "rank from a checkpoint (the next reduction tells every rank, and every rank drops "
                               "it)"
                             : "and so do the others (it was empty on every rank), but the ranks' buffers may "
                               "differ from here on. Resume every rank from a checkpoint");
}

} // namespace detail


void refuse_construction(const c10::intrusive_ptr<c10d::ProcessGroup>& group, const std::exception& why,
                         at::Device device) {
  TORCH_CHECK_VALUE(group, "gradaccum: refuse_construction(): process_group is null");
  detail::agree_to_build(*group, device, detail::Refusal::of(why), /*check_parameters=*/true, "Accumulator()");
}

Accumulator::Accumulator(
    ModelParameters model,
    AccumulatorOptions options,
    StepFunction optimizer_step,
    StepFunction scheduler_step,
    ParameterList optimizer_parameters)
    : options_(std::move(options)),
      optimizer_step_(std::move(optimizer_step)),
      scheduler_step_(std::move(scheduler_step)),
      optimizer_parameters_(std::move(optimizer_parameters)) {
  // Buckets, views and .grad made inside torch.inference_mode() would be
  // tensors no backward can write (review): made outside it.
  const c10::InferenceMode not_inference(/*enabled=*/false);
  const auto& group = options_.process_group();
  try {
    options_.validate();
    frozen_ = detail::checked_trainable(model, "Accumulator()");
    check_launch_has_group(options_);
    params_ = model.parameters;
    names_ = model.names;
    check_optimizer_parameters("Accumulator()");
    claim_ = detail::claim(params_, names_);
  } catch (const std::exception&) {
    // Note [Construction refused on one rank]: the other ranks are told
    // (they wait in the Reducer's first collective).
    if (group) {
      detail::tell_construction_refused(*group, detail::device_of(model.parameters));
    }
    throw;
  }
  if (group) {
    reducer_ = std::make_unique<Reducer>(
        params_, options_.process_group(), options_.reducer(),
        std::move(model.buffers), std::move(model.names),
        window_rule(), frozen_);
  } else if (const auto wide = options_.accumulate_dtype()) {
    // One process: the window's sums of narrower gradients (Note [One
    // accumulate_dtype path]).
    wide_ = std::make_unique<detail::WideSums>(params_, *wide);
  }
  if (!reducer_) {
    late_watch_ = std::make_unique<detail::LateBackwardWatch>(params_, names_);
  }
  if (options_.loss_scaler()) {
    // Note [One loss scaler path]: the built-in scaler is the window callbacks.
    loss_scaler_ = std::make_unique<detail::LossScaler>(*options_.loss_scaler());
    before_step_ = [this] { return loss_scaler_->unscale(defined_grads(), options_.steps()); };
    after_window_ = [this] {
      const double before = loss_scaler_->scale();
      loss_scaler_->update();
      if (loss_scaler_->scale() != before) { // Note [Error feedback across loss scales]
        rescale_residuals(at::scalar_tensor(loss_scaler_->scale() / before, at::kDouble));
      }
    };
  }
  remember_gradients();
  // Gradients already in .grad (a sanity-check backward, a warm-up loop, the
  // half-done window of a closed Accumulator) were counted by no micro-step:
  // Note [Gradients no micro-step counted].
  forget_nonzero_gradients();
}

WindowRule Accumulator::window_rule() const {
  WindowRule rule{options_.steps(), options_.reduction(), options_.accumulate_dtype(),
                  options_.comm_dtype(), options_.error_feedback(), options_.metrics()};
  rule.max_grad_norm = options_.max_grad_norm();
  rule.nonfinite = options_.nonfinite();
  rule.loss_scaler = options_.loss_scaler() ? options_.loss_scaler() : options_.external_loss_scaler();
  if (loss_scaler_ && rule.loss_scaler) {
    rule.loss_scaler->init_scale(loss_scaler_->scale()); // (a refresh: where it is now)
  }
  return rule;
}

Accumulator::~Accumulator() {
  close();
}

void Accumulator::set_window_callbacks(std::function<bool()> before_step, std::function<void()> after_window) {
  TORCH_CHECK_VALUE(!loss_scaler_,
      "gradaccum: acc.set_window_callbacks(): this Accumulator has a loss_scaler, whose callbacks these would replace "
      "(one scaler per window)");
  before_step_ = std::move(before_step);
  after_window_ = std::move(after_window);
}

// Note [Closed in the middle of a window]
// close() (and the destructor) start no collective, even in the middle of a
// window whose reduction the other ranks will wait for. Sending that
// reduction as a drop (as abandon() does for join()) would tell them when
// they are in their closing reduction, but a rank closes mid-window as often
// with nothing owed (ranks whose data ran out unevenly, without flush()) or
// while the others run a collective of their own (a logging all-reduce, a
// barrier, Lightning's per-batch broadcast): a drop meeting one of those
// aborts that process in Gloo, or waits with it until the group's timeout
// (both measured), where a close without it costs nothing and a process that
// ends is seen by the others' transport at once.
void Accumulator::close() {
  if (closed_) {
    return;
  }
  closed_ = true;
  std::unique_ptr<Reducer> reducer;
  {
    const std::lock_guard<std::mutex> lock(reducer_readers_); // (a reader on another thread)
    reducer = std::move(reducer_);
  }
  if (reducer) {
    // The model as without bucket views: .grad None at a window boundary
    // (what the window held was stepped or dropped), its own copy otherwise.
    reducer->release_gradient_views(micro_step_ == 0 && !window_ready_ && !window_failed_ && !parts_open_);
    // stats() after close() still tells what the run reduced (review: a
    // stats() logged after a `with` block showed no communication at all).
    stats_.reducer = reducer->stats();
    stats_.data_parallel = true;
    stats_.world_size = reducer->process_group()->getSize();
    stats_.backend = reducer->process_group()->getBackendName();
  }
  reducer.reset(); // removes the hooks; a reduction in flight completes its pairing
  late_watch_.reset(); // (one process: its hooks)
  claim_.reset();
  // The group's last reference may be ours (destroy_process_group() ran):
  // let it go now, not whenever this object is destroyed.
  options_.process_group(nullptr);
}

namespace {

// acc.step() calls optimizer.step() with no closure: an optimizer that
// evaluates the loss again inside its step cannot step a window (the Python
// binding refuses any whose step() needs an argument).
torch::optim::Optimizer& closure_free(torch::optim::Optimizer& optimizer) {
  TORCH_CHECK_VALUE(dynamic_cast<torch::optim::LBFGS*>(&optimizer) == nullptr,
      "gradaccum: Accumulator(): torch::optim::LBFGS needs a closure in step() (it evaluates the loss again), "
      "and acc.step() calls optimizer.step() with none: it cannot step a window accumulated by acc.backward(); "
      "use an optimizer whose step() needs no closure");
  return optimizer;
}

} // namespace

Accumulator::Accumulator(
    ModelParameters model,
    torch::optim::Optimizer& optimizer,
    AccumulatorOptions options,
    torch::optim::LRScheduler* scheduler)
    : Accumulator(
          std::move(model),
          std::move(options),
          [&optimizer = closure_free(optimizer)] { optimizer.step(); },
          scheduler ? StepFunction([scheduler] { scheduler->step(); }) : nullptr,
          [&optimizer] {
            std::vector<at::Tensor> params;
            for (const auto& group : optimizer.param_groups()) {
              params.insert(params.end(), group.params().begin(), group.params().end());
            }
            return params;
          }) {}

Accumulator::Accumulator(ModelParameters model, AccumulatorOptions options)
    : Accumulator(std::move(model), std::move(options), nullptr, nullptr) {}

namespace {

// Other ranks closed partial windows with flush() in this reduction and
// leave; ranks in join() flush too, but go on shadowing (Note [Joining]).
bool peers_ended_epoch(const ReductionResult& result) {
  return result.flushing_ranks > result.joined_ranks;
}

} // namespace

void Accumulator::backward(const at::Tensor& loss, std::optional<double> num_items) {
  backward(loss, num_items, at::Tensor());
}

void Accumulator::backward(const at::Tensor& loss, std::optional<double> num_items, const at::Tensor& reported) {
  backward_as("acc.backward()", loss, num_items, reported, at::Tensor());
}

void Accumulator::backward(const at::Tensor& loss, std::optional<double> num_items, const at::Tensor& reported,
                           const at::Tensor& metrics) {
  backward_as("acc.backward()", loss, num_items, reported, metrics);
}

void Accumulator::backward_whole(const at::Tensor& loss, std::optional<double> num_items, const at::Tensor& reported,
                                 const at::Tensor& metrics) {
  backward_as("acc.run()", loss, num_items, reported, metrics);
}

void Accumulator::backward_as(const char* call, const at::Tensor& loss, std::optional<double> num_items,
                              const at::Tensor& reported, const at::Tensor& metrics) {
  const CallGuard guard(driver_, driving_, call, &call_);
  realign_after_manual_reduction(call); // Note [A manual reduction in the middle of a window]
  check_no_open_parts(call);
  check_micro_step_state(call);
  window_forwards_ = true; // its forward ran, whatever the checks below say of its loss
  // Every check comes before backward: a rejected call changes nothing, but
  // see Note [A refused closing micro-batch].
  refuse_closing_in_no_sync(call); // (drops the window itself)
  // One look at the gradients serves the checks here and, should backward
  // fail, the question whether it reached .grad.
  const auto before = grad_versions();
  double weight = 1.0;
  try {
    weight = check_micro_step(loss, num_items, call);
    check_reported(reported, call);
    check_metrics(metrics, call);
    check_no_inference_grads(call, before);
  } catch (const c10::Error& e) {
    const auto dropped = drop_refused_window(call);
    if (dropped.empty()) {
      throw;
    }
    const bool value_error = dynamic_cast<const c10::ValueError*>(&e) != nullptr;
    TORCH_CHECK_VALUE(!value_error, e.msg(), "; ", dropped);
    TORCH_CHECK(false, e.msg(), "; ", dropped);
  }
  check_window_gradients(call, before);
  const bool keep = keep_micro_batch(reported.defined() ? reported : loss, metrics);
  if (!keep) {
    weight = 0;
  }
  // With the built-in loss scaler: scaled, and by 1/steps so that fp16 sees the
  // big batch's magnitudes; its unscale() undoes both at the window's end.
  // Undefined for a micro-batch left out: no backward.
  const at::Tensor scaled = !keep ? at::Tensor() : loss_scaler_ ? loss_scaler_->scale_loss(loss, options_.steps()) : loss;
  if (!closes_window_next()) {
    local_micro_step(scaled, weight, before);
    return;
  }
  close_window(scaled, weight, before);
}

void Accumulator::close_window(const at::Tensor& scaled, double weight, const std::vector<GradMark>& before) {
  if (reducer_) {
    reduce_window(scaled, weight);
  } else {
    try {
      if (scaled.defined()) {
        scaled.backward();
      }
    } catch (...) {
      if (grad_versions() != before) {
        reset_window();
      }
      throw;
    }
    window_weight_ += weight;
    window_empty_ = window_weight_ == 0;
    accumulate_wide();
    window_loss_sum_ = pending_loss_sum_;
    close_local_window_loss();
    scale_local_gradients();
  }
  ++stats_.micro_steps;
  micro_step_ = 0;
  window_weight_ = 0;
  window_loss_sum_ = at::Tensor();
  set_window_ready(true);
  remember_gradients();
}

void Accumulator::local_micro_step(const at::Tensor& scaled, double weight,
                                   const std::vector<GradMark>& before) {
  NoSync local(reducer_.get(), /*counted=*/true);
  const auto hooks = reducer_ ? reducer_->hook_calls() : 0;
  try {
    if (scaled.defined()) {
      scaled.backward();
    }
  } catch (...) {
    if (reducer_) {
      // The window can no longer be what the other ranks expect: it is
      // dropped on every rank when it closes. The failed micro-step still
      // takes its place, so that every rank closes its windows together.
      window_failed_ = true;
      window_failure_ = detail::inspect_error(std::current_exception()).interrupt // Note [An interrupt tells every rank to end]
          ? AbortReason::Interrupted
          : AbortReason::BackwardFailed;
      reducer_->mark_window_failed(window_failure_); // (should a plain backward close it)
      ++micro_step_;
      ++stats_.micro_steps;
      remember_gradients();
    } else if (grad_versions() != before) {
      reset_window(); // part of this micro-step reached .grad: the window is wrong
    } // else nothing changed: the micro-step simply did not happen
    throw;
  }
  note_hookless_backward(hooks, before);
  window_weight_ += weight;
  ++micro_step_;
  ++stats_.micro_steps;
  window_loss_sum_ = pending_loss_sum_;
  accumulate_wide();
  remember_gradients();
}

void Accumulator::reduce_window(const at::Tensor& scaled, double weight) {
  const auto window = reducer_->progress().sequence;
  if (window_failed_) {
    auto abort = new_request();
    abort.abort = window_failure_;
    const auto detail = failure_detail_;
    reset_window();
    ++stats_.micro_steps; // (the closing one: counted, as the window's others; review)
    try {
      reducer_->reduce(abort); // throws the dropped window's error, as every rank does
    } catch (const c10::Error& e) {
      remember_gradients(); // dropping zeroed the buckets, and with them any .grad views
      note_dropped_window(window);
      forget_window_loss();
      TORCH_CHECK(detail.empty(), with_failure_detail(e.what_without_backtrace(), detail));
      throw;
    } catch (...) {
      remember_gradients();
      note_dropped_window(window);
      forget_window_loss();
      throw;
    }
    TORCH_INTERNAL_ASSERT(false, "gradaccum: an aborted reduction returned");
  }
  auto request = new_request();
  request.weight = window_weight_ + weight;
  request.divide = options_.reduction() != Reduction::Sum;
  request.check_finite = reducer_checks_finite();
  request.loss_sum = pending_loss_sum_;
  ReductionResult result;
  try {
    result = scaled.defined() ? reducer_->backward(scaled, request) : reducer_->reduce(request);
  } catch (const std::exception& e) {
    if (!reducer_) {
      // close() from a hook inside this backward took the reducer (review:
      // a segfault here): the reducer's error says the window was dropped
      // on every rank; this Accumulator refuses every later call.
      throw;
    }
    const auto last = reducer_->last_result();
    if (last.window == window && !last.dropped && last.written) {
      // Reduced and written back on every rank; something failed on this
      // rank afterwards (a later engine callback). The window stays closed,
      // as on the other ranks, and so does its loss.
      epoch_ended_ = peers_ended_epoch(last);
      window_empty_ = last.global_weight == 0;
      try {
        close_window_loss(last, pending_loss_sum_);
      } catch (...) { // (the error already leaving is the one to tell)
        window_loss_.set(at::Tensor(), last.global_weight);
        window_metrics_ = at::Tensor();
      }
      ++stats_.micro_steps;
      micro_step_ = 0;
      window_weight_ = 0;
      window_loss_sum_ = at::Tensor();
      set_window_ready(true);
      window_known_finite_ = false;
      remember_gradients();
      throw;
    }
    if (last.window == window && !last.dropped) {
      // Reduced on every rank, but the write-back (or a collective before it)
      // failed here: the reducer cleared this rank's gradients. The window is
      // dropped here, as flush() drops it, and this rank's position stays the
      // others' (its next acc.step() steps nothing). Its loss is the one the
      // others report.
      take_reduced_loss(last, pending_loss_sum_);
      reset_window();
      epoch_ended_ = peers_ended_epoch(last);
      ++stats_.micro_steps;
      TORCH_CHECK(false, detail::failed_after_reduction(call_name(), reducer_->process_group()->getRank(), last, e));
    }
    reset_window(); // the reducer dropped the window on every rank
    ++stats_.micro_steps;
    note_dropped_window(window);
    forget_window_loss();
    throw;
  }
  // A full window reduced with others' partial ones: their epoch is over,
  // and this rank's flush() must not reduce again (ranks in join() go on
  // shadowing: see Note [Joining]).
  if (result.joined_ranks > 0 && peers_ended_epoch(result)) {
    // Some ranks flushed while others joined (Note [Joining]): they raise;
    // so does this rank, instead of waiting for them in its next window.
    reset_window();
    forget_window_loss();
    TORCH_CHECK(false, "gradaccum: ", call_name(), ": in window ", result.window, " ",
        result.flushing_ranks - result.joined_ranks, " rank(s) ended their data with acc.flush() while ",
        result.joined_ranks, " rank(s) were in acc.join(); the window was dropped on every rank. End the data "
        "with acc.join() on every rank (any difference in data), or acc.flush() on every rank");
  }
  epoch_ended_ = peers_ended_epoch(result);
  window_known_finite_ = result.known_finite;
  window_empty_ = result.global_weight == 0;
  close_window_loss(result, pending_loss_sum_);
}

void Accumulator::note_dropped_window(int64_t window) {
  // A dropped window still tells whether other ranks were flushing (ended
  // their epoch); this rank, which was not, must then not flush again.
  if (!reducer_) {
    return; // (closed meanwhile, from a hook)
  }
  const auto last = reducer_->last_result();
  epoch_ended_ = last.window == window && peers_ended_epoch(last);
}

void Accumulator::reset_window(bool clear) {
  if (window_ready_ && window_raised_nonfinite_) {
    // nonfinite="raise" raised on this closed window and it goes unstepped
    // (acc.zero_grad(); flush() or join() at the epoch's end; an exception
    // leaving join()): a window skipped for its non-finite gradient, counted
    // as nonfinite="skip" counts one, alike on every rank.
    ++stats_.skipped_steps;
    ++stats_.windows;
  }
  window_loss_cut_ = false;
  window_shared_ = false;
  if (clear) {
    clear_gradients();
  }
  micro_step_ = 0;
  set_window_ready(false);
  window_unscaled_ = false;
  window_scaler_failed_ = false;
  window_optimizer_stepped_ = false;
  window_clipped_ = false;
  window_weight_ = 0;
  window_loss_sum_ = at::Tensor();
  window_failed_ = false;
  failure_detail_.clear();
  window_raised_nonfinite_ = false;
  parts_open_ = false;
  window_known_finite_ = false;
  window_empty_ = false;
  window_forwards_ = false;
  remember_gradients();
}

std::vector<at::Tensor> Accumulator::defined_grads() const {
  std::vector<at::Tensor> grads;
  for (const auto& p : params_) {
    if (p.grad().defined()) {
      grads.push_back(p.grad());
    }
  }
  return grads;
}

NoSync Accumulator::no_sync() {
  check_open("acc.no_sync()");
  check_training_not_ended("acc.no_sync()", /*flushing=*/false); // (the manual path reduces too)
  if (reducer_) {
    reducer_->check_hooks_reach("acc.no_sync()");
  }
  return NoSync(reducer_.get());
}

bool Accumulator::expect_hooks() const {
  const std::lock_guard<std::mutex> lock(reducer_readers_);
  return reducer_ ? reducer_->expect_hooks() : true;
}

void Accumulator::set_expect_hooks(bool expect) {
  check_open("acc.no_sync()"); // (its Python form)
  if (reducer_) {
    if (!expect) {
      check_training_not_ended("acc.no_sync()", /*flushing=*/false); // (the manual path reduces too)
      reducer_->check_hooks_reach("acc.no_sync()");
    }
    reducer_->set_expect_hooks(expect);
  }
}

AccumulatorStats Accumulator::stats() const {
  auto stats = stats_;
  if (loss_scaler_) {
    stats.loss_scale = loss_scaler_->scale();
  }
  const auto [loss, items] = window_loss_.get(); // (one window's: another thread may close the next)
  if (loss.defined()) {
    stats.window_loss = loss.item<double>();
  }
  stats.window_items = items;
  const std::lock_guard<std::mutex> lock(reducer_readers_);
  if (reducer_) {
    stats.reducer = reducer_->stats();
    stats.data_parallel = true;
    stats.world_size = reducer_->process_group()->getSize();
    stats.backend = reducer_->process_group()->getBackendName();
  }
  return stats;
}

} // namespace gradaccum
