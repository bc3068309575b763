#include <gradaccum/accumulator.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <unordered_set>

namespace gradaccum {
namespace {

// Drops frozen and repeated (tied) parameters: each is hooked and reduced once.
void keep_trainable_once(ModelParameters& model) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  for (const auto i : c10::irange(model.parameters.size())) {
    const auto& p = model.parameters[i];
    TORCH_CHECK_VALUE(p.defined(), "Accumulator: parameter ", i, " is undefined");
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    params.push_back(p);
    names.push_back(model.names.empty() ? "parameter " + std::to_string(i) : model.names[i]);
  }
  model.parameters = std::move(params);
  model.names = std::move(names);
}

} // namespace

ModelParameters::ModelParameters(std::vector<at::Tensor> parameters_)
    : parameters(std::move(parameters_)) {}

ModelParameters::ModelParameters(
    std::vector<at::Tensor> parameters_,
    std::vector<std::string> names_,
    std::vector<at::Tensor> buffers_)
    : parameters(std::move(parameters_)),
      names(std::move(names_)),
      buffers(std::move(buffers_)) {}

ModelParameters::ModelParameters(const std::shared_ptr<torch::nn::Module>& module, int) {
  TORCH_CHECK_VALUE(module, "Accumulator: the module is null");
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    names.push_back(item.key());
    parameters.push_back(item.value());
  }
  buffers = module->buffers(/*recurse=*/true);
}

Accumulator::Accumulator(
    ModelParameters model,
    AccumulatorOptions options,
    StepFunction optimizer_step,
    StepFunction scheduler_step)
    : options_(std::move(options)),
      optimizer_step_(std::move(optimizer_step)),
      scheduler_step_(std::move(scheduler_step)) {
  options_.validate();
  TORCH_CHECK_VALUE(
      model.names.empty() || model.names.size() == model.parameters.size(),
      "Accumulator: got ", model.names.size(), " names for ",
      model.parameters.size(), " parameters");
  keep_trainable_once(model);
  TORCH_CHECK_VALUE(!model.parameters.empty(),
      "Accumulator: the model has no trainable parameters (none requires grad)");
  for (const auto i : c10::irange(model.parameters.size())) {
    TORCH_CHECK_VALUE(model.parameters[i].is_leaf(),
        "Accumulator: ", model.names[i], " is not a leaf tensor; pass the model's parameters");
    TORCH_CHECK_VALUE(at::isFloatingType(model.parameters[i].scalar_type()),
        "Accumulator: ", model.names[i], " has dtype ", model.parameters[i].scalar_type(),
        "; gradients need a floating-point dtype");
  }
  params_ = model.parameters;
  if (options_.process_group()) {
    reducer_ = std::make_unique<Reducer>(
        params_, options_.process_group(), options_.reducer(),
        std::move(model.buffers), std::move(model.names),
        WindowRule{options_.steps(), options_.reduction()});
  }
}

Accumulator::Accumulator(
    ModelParameters model,
    torch::optim::Optimizer& optimizer,
    AccumulatorOptions options,
    torch::optim::LRScheduler* scheduler)
    : Accumulator(
          std::move(model),
          std::move(options),
          [&optimizer] { optimizer.step(); },
          scheduler ? StepFunction([scheduler] { scheduler->step(); }) : nullptr) {}

Accumulator::Accumulator(ModelParameters model, AccumulatorOptions options)
    : Accumulator(std::move(model), std::move(options), nullptr, nullptr) {}

bool Accumulator::sync_gradients() const {
  return !window_ready_ && micro_step_ + 1 == options_.steps();
}

void Accumulator::backward(const at::Tensor& loss, std::optional<double> num_items) {
  // Every check comes before backward: a rejected call changes nothing.
  TORCH_CHECK(!window_ready_,
      "backward(): the window closed at the previous backward(); call step() "
      "(or zero_grad() to drop it) before the next micro-step");
  TORCH_CHECK(!reducer_ || reducer_->expect_hooks(),
      "backward(): called inside no_sync(). Accumulator.backward() decides by itself "
      "which micro-step synchronises; no_sync() is for the manual path (a plain "
      "loss.backward() inside it)");
  TORCH_CHECK_VALUE(loss.defined(), "backward(): loss is undefined");
  TORCH_CHECK_VALUE(loss.numel() == 1,
      "backward(): loss must be a scalar, got a tensor of shape ", loss.sizes());
  TORCH_CHECK_VALUE(loss.requires_grad(),
      "backward(): loss does not require grad (computed under no_grad, or from "
      "no trainable parameter?)");
  double weight = 1.0;
  if (options_.reduction() == Reduction::Items) {
    TORCH_CHECK_VALUE(num_items.has_value(),
        "backward(): num_items is required with reduction='items'");
    TORCH_CHECK_VALUE(std::isfinite(*num_items) && *num_items > 0,
        "backward(): num_items must be a positive number, got ", *num_items);
    weight = *num_items;
  } else {
    TORCH_CHECK_VALUE(!num_items.has_value(),
        "backward(): num_items is only used with reduction='items' (reduction is '",
        to_string(options_.reduction()), "')");
  }
  if (epoch_ended_) {
    // This rank's last window was reduced together with other ranks' flush():
    // for them the epoch is over. Tell them (Note [Dropping a window] in
    // reducer.cpp), then say what to do here.
    ReductionRequest abort;
    abort.abort = AbortReason::EpochEnded;
    try {
      reducer_->reduce(abort);
    } catch (const std::exception&) {
      // Always throws: the window is dropped everywhere; the error below says why.
    }
    epoch_ended_ = false;
    reset_window();
    TORCH_CHECK(false,
        "backward(): other ranks ended the epoch with flush() in the reduction that closed "
        "this rank's last window, but this rank went on training. Every rank must run the "
        "same number of full windows and call flush() at the end of each epoch (here it "
        "steps nothing and runs no collective). The window was dropped on every rank");
  }

  const bool closes = sync_gradients();
  if (!closes) {
    NoSync local(reducer_.get());
    const auto before = reducer_ ? decltype(grad_versions()){} : grad_versions();
    try {
      loss.backward();
    } catch (...) {
      if (reducer_) {
        // The window can no longer be what the other ranks expect: it is
        // dropped on every rank when it closes. The failed micro-step still
        // takes its place, so that every rank closes its windows together.
        window_failed_ = true;
        ++micro_step_;
        ++stats_.micro_steps;
      } else if (grad_versions() != before) {
        reset_window(); // part of this micro-step reached .grad: the window is wrong
      } // else nothing changed: the micro-step simply did not happen
      throw;
    }
    window_weight_ += weight;
    ++micro_step_;
    ++stats_.micro_steps;
    return;
  }
  if (reducer_) {
    if (window_failed_) {
      ReductionRequest abort;
      abort.abort = AbortReason::BackwardFailed;
      window_failed_ = false;
      reset_window();
      reducer_->reduce(abort); // throws the dropped window's error, as every rank does
      TORCH_INTERNAL_ASSERT(false, "gradaccum: an aborted reduction returned");
    }
    ReductionRequest request;
    request.weight = window_weight_ + weight;
    request.divide = options_.reduction() != Reduction::Sum;
    ReductionResult result;
    try {
      result = reducer_->backward(loss, request);
    } catch (...) {
      reset_window(); // the reducer dropped the window on every rank
      throw;
    }
    // A full window reduced with others' partial ones: their epoch is over,
    // and this rank's flush() must not reduce again.
    epoch_ended_ = result.flushing_ranks > 0;
  } else {
    const auto before = grad_versions();
    try {
      loss.backward();
    } catch (...) {
      if (grad_versions() != before) {
        reset_window();
      }
      throw;
    }
    window_weight_ += weight;
    scale_local_gradients();
  }
  ++stats_.micro_steps;
  micro_step_ = 0;
  window_weight_ = 0;
  window_ready_ = true;
}

std::vector<std::pair<const void*, int64_t>> Accumulator::grad_versions() const {
  // Accumulating into .grad either bumps its version (in place) or replaces it.
  std::vector<std::pair<const void*, int64_t>> versions;
  versions.reserve(params_.size());
  for (const auto& p : params_) {
    const auto& g = p.grad();
    versions.emplace_back(
        g.defined() ? g.unsafeGetTensorImpl() : nullptr,
        g.defined() ? g._version() : 0);
  }
  return versions;
}

void Accumulator::reset_window() {
  clear_gradients();
  micro_step_ = 0;
  window_ready_ = false;
  window_weight_ = 0;
  window_failed_ = false;
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

void Accumulator::scale_local_gradients() {
  if (options_.reduction() == Reduction::Sum || window_weight_ == 1.0) {
    return;
  }
  auto grads = defined_grads();
  at::NoGradGuard no_grad;
  at::_foreach_div_(grads, at::Scalar(window_weight_));
}

bool Accumulator::step() {
  TORCH_CHECK(optimizer_step_,
      "step(): this Accumulator has no optimizer (pass one to the constructor; "
      "without one, backward() leaves the window's gradient in .grad)");
  if (!window_ready_) {
    return false;
  }
  return finish_window();
}

bool Accumulator::flush() {
  TORCH_CHECK(optimizer_step_,
      "flush(): this Accumulator has no optimizer (pass one to the constructor)");
  bool stepped = false;
  if (window_ready_) {
    stepped = finish_window();
  }
  if (!reducer_) {
    if (micro_step_ == 0) {
      return stepped;
    }
    scale_local_gradients();
    micro_step_ = 0;
    window_ready_ = true;
    return finish_window();
  }
  if (epoch_ended_) {
    // This rank's last window was already reduced together with the other
    // ranks' flush(): nothing is left, and no collective to pair.
    TORCH_INTERNAL_ASSERT(micro_step_ == 0, "gradaccum: micro-steps after the epoch ended");
    epoch_ended_ = false;
    return stepped;
  }
  if (window_failed_) {
    ReductionRequest abort;
    abort.abort = AbortReason::BackwardFailed;
    reset_window();
    reducer_->reduce(abort);
    TORCH_INTERNAL_ASSERT(false, "gradaccum: an aborted reduction returned");
  }
  // A collective even with nothing accumulated here, so that ranks whose data
  // ran out at a window's end still pair with the others.
  ReductionRequest request;
  request.weight = window_weight_;
  request.divide = options_.reduction() != Reduction::Sum;
  request.flushing = true;
  ReductionResult result;
  try {
    result = reducer_->reduce(request);
  } catch (...) {
    reset_window();
    throw;
  }
  if (result.global_weight == 0) {
    reset_window(); // no rank had anything: no step anywhere
    return stepped;
  }
  micro_step_ = 0;
  window_weight_ = 0;
  window_ready_ = true;
  return finish_window() || stepped;
}

bool Accumulator::finish_window() {
  const auto max_norm = options_.max_grad_norm();
  const auto nonfinite = options_.nonfinite();
  if (max_norm || nonfinite != NonFinite::Ignore) {
    // As torch.nn.utils.clip_grad_norm_ computes it, so the two agree bit for bit.
    auto grads = defined_grads();
    at::NoGradGuard no_grad;
    at::Tensor total = grads.empty()
        ? at::zeros({}, at::kFloat)
        : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2.0)), 2.0);
    const double norm = total.item<double>();
    stats_.last_grad_norm = norm;
    if (!std::isfinite(norm) && nonfinite != NonFinite::Ignore) {
      TORCH_CHECK(nonfinite != NonFinite::Raise,
          "step(): the window's gradient is not finite (total norm ", norm,
          "); gradients left in .grad for inspection, call zero_grad() to drop the window");
      ++stats_.skipped_steps;
      ++stats_.windows;
      zero_grad();
      return false;
    }
    if (max_norm && !grads.empty()) {
      auto coefficient = at::clamp(*max_norm / (total + 1e-6), c10::nullopt, 1.0);
      at::_foreach_mul_(grads, coefficient);
    }
  }
  optimizer_step_();
  if (scheduler_step_) {
    scheduler_step_();
  }
  ++stats_.optimizer_steps;
  ++stats_.windows;
  zero_grad();
  return true;
}

void Accumulator::clear_gradients() {
  if (reducer_) {
    reducer_->zero_grad();
    return;
  }
  for (auto& p : params_) {
    p.mutable_grad() = at::Tensor();
  }
}

void Accumulator::zero_grad() {
  // Drops the window; a pending end of epoch (epoch_ended_) stays: it is
  // about where the other ranks are, not about this window's gradients.
  reset_window();
}

NoSync Accumulator::no_sync() {
  return NoSync(reducer_.get());
}

bool Accumulator::expect_hooks() const {
  return reducer_ ? reducer_->expect_hooks() : true;
}

void Accumulator::set_expect_hooks(bool expect) {
  if (reducer_) {
    reducer_->set_expect_hooks(expect);
  }
}

AccumulatorStats Accumulator::stats() const {
  auto stats = stats_;
  if (reducer_) {
    stats.reducer = reducer_->stats();
  }
  return stats;
}

AccumulatorState Accumulator::state_dict() const {
  AccumulatorState state;
  state.steps = options_.steps();
  state.micro_step = micro_step_;
  state.window_ready = window_ready_;
  state.window_weight = window_weight_;
  state.micro_steps = stats_.micro_steps;
  state.optimizer_steps = stats_.optimizer_steps;
  state.skipped_steps = stats_.skipped_steps;
  state.windows = stats_.windows;
  const bool mid_window = micro_step_ > 0 || window_ready_;
  for (const auto& p : params_) {
    // A snapshot: later micro-steps must not change what was saved.
    state.grads.push_back(mid_window && p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
  }
  return state;
}

void Accumulator::load_state_dict(const AccumulatorState& state) {
  TORCH_CHECK_VALUE(state.steps == options_.steps(),
      "load_state_dict: the state was saved with steps=", state.steps,
      " but this Accumulator has steps=", options_.steps());
  TORCH_CHECK_VALUE(state.micro_step >= 0 && state.micro_step < options_.steps(),
      "load_state_dict: micro_step=", state.micro_step, " is outside [0, ", options_.steps(), ")");
  TORCH_CHECK_VALUE(!state.window_ready || state.micro_step == 0,
      "load_state_dict: window_ready=true with micro_step=", state.micro_step,
      " (a closed window has micro_step 0)");
  TORCH_CHECK_VALUE(std::isfinite(state.window_weight) && state.window_weight >= 0,
      "load_state_dict: window_weight=", state.window_weight, " must be >= 0");
  TORCH_CHECK_VALUE(state.micro_steps >= 0 && state.optimizer_steps >= 0 &&
          state.skipped_steps >= 0 && state.windows >= 0,
      "load_state_dict: counters must be >= 0");
  TORCH_CHECK_VALUE(state.grads.size() == params_.size(),
      "load_state_dict: the state holds ", state.grads.size(),
      " gradients but the model has ", params_.size(), " trainable parameters");
  for (const auto i : c10::irange(params_.size())) {
    const auto& g = state.grads[i];
    if (g.defined()) {
      TORCH_CHECK_VALUE(g.sizes() == params_[i].sizes() && g.scalar_type() == params_[i].scalar_type(),
          "load_state_dict: gradient ", i, " is ", g.scalar_type(), " ", g.sizes(),
          " but the parameter is ", params_[i].scalar_type(), " ", params_[i].sizes());
    }
  }
  clear_gradients();
  at::NoGradGuard no_grad;
  for (const auto i : c10::irange(params_.size())) {
    const auto& g = state.grads[i];
    if (!g.defined()) {
      continue;
    }
    auto& grad = params_[i].mutable_grad();
    if (grad.defined()) {
      grad.copy_(g); // a bucket view stays a view
    } else {
      grad = g.detach().to(params_[i].device()).clone();
    }
  }
  micro_step_ = state.micro_step;
  window_ready_ = state.window_ready;
  window_weight_ = state.window_weight;
  stats_.micro_steps = state.micro_steps;
  stats_.optimizer_steps = state.optimizer_steps;
  stats_.skipped_steps = state.skipped_steps;
  stats_.windows = state.windows;
}

} // namespace gradaccum
