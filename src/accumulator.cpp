#include <gradaccum/accumulator.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/autograd.h>

#include <torch/nn/modules/embedding.h>

#include <cmath>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace gradaccum {
namespace {

// Drops frozen and repeated (tied) parameters: each is hooked and reduced
// once. Returns the frozen ones, watched in case they are unfrozen later.
std::vector<std::pair<std::string, at::Tensor>> keep_trainable_once(ModelParameters& model) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<at::Tensor> params;
  std::vector<std::string> names;
  std::vector<std::pair<std::string, at::Tensor>> frozen;
  for (const auto i : c10::irange(model.parameters.size())) {
    const auto& p = model.parameters[i];
    TORCH_CHECK_VALUE(p.defined(), "Accumulator: parameter ", i, " is undefined");
    const auto name = model.names.empty() ? "parameter " + std::to_string(i) : model.names[i];
    TORCH_CHECK_VALUE(!p.is_meta(),
        "Accumulator: ", name, " is on the meta device (no data); materialise the model "
        "(e.g. to_empty(device=...) and initialise it) before building the Accumulator");
    if (!seen.insert(p.unsafeGetTensorImpl()).second) {
      continue;
    }
    if (!p.requires_grad()) {
      frozen.emplace_back(name, p);
      continue;
    }
    params.push_back(p);
    names.push_back(model.names.empty() ? "parameter " + std::to_string(i) : model.names[i]);
  }
  model.parameters = std::move(params);
  model.names = std::move(names);
  return frozen;
}

// Parameters owned by a live Accumulator: a second one over any of them would
// leave the first one's hooks reducing too (a notebook re-run, a rebuilt loop).
std::mutex& claims_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<const c10::TensorImpl*, std::string>& claims() {
  static std::unordered_map<const c10::TensorImpl*, std::string> owned;
  return owned;
}

std::shared_ptr<void> claim(const std::vector<at::Tensor>& params, const std::vector<std::string>& names) {
  std::lock_guard<std::mutex> lock(claims_mutex());
  for (const auto i : c10::irange(params.size())) {
    TORCH_CHECK_VALUE(!claims().count(params[i].unsafeGetTensorImpl()),
        "Accumulator: ", names[i], " already belongs to another live Accumulator, whose "
        "hooks would keep running (reducing every micro-step). Drop the old one (del acc) "
        "or call its close() before building a new one");
  }
  auto keys = std::make_shared<std::vector<const c10::TensorImpl*>>();
  for (const auto& p : params) {
    claims()[p.unsafeGetTensorImpl()] = "";
    keys->push_back(p.unsafeGetTensorImpl());
  }
  return std::shared_ptr<void>(nullptr, [keys](void*) {
    std::lock_guard<std::mutex> lock(claims_mutex());
    for (const auto* key : *keys) {
      claims().erase(key);
    }
  });
}

// Norms of half-precision gradients in float32 (fp16 squares overflow long
// before the gradient does); full-precision ones as clip_grad_norm_ does.
std::optional<at::ScalarType> norm_dtype(const std::vector<at::Tensor>& grads) {
  bool narrow = false, wide = false;
  for (const auto& g : grads) {
    narrow = narrow || g.element_size() < 4;
    wide = wide || g.scalar_type() == at::kDouble;
  }
  if (!narrow) {
    return std::nullopt;
  }
  return wide ? at::kDouble : at::kFloat;
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
  for (const auto& item : module->named_modules()) {
    const auto* embedding = dynamic_cast<const torch::nn::EmbeddingImpl*>(item.value().get());
    const auto* bag = dynamic_cast<const torch::nn::EmbeddingBagImpl*>(item.value().get());
    if ((embedding && embedding->options.sparse()) || (bag && bag->options.sparse())) {
      sparse_modules.push_back(item.key().empty() ? "the module" : item.key());
    }
  }
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
  TORCH_CHECK_VALUE(model.sparse_modules.empty(),
      "Accumulator: ", model.sparse_modules.front(), " makes sparse gradients "
      "(Embedding(sparse=True)); gradaccum supports dense gradients only: use sparse=False");
  frozen_ = keep_trainable_once(model);
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
  names_ = model.names;
  claim_ = claim(params_, names_);
  if (options_.process_group()) {
    reducer_ = std::make_unique<Reducer>(
        params_, options_.process_group(), options_.reducer(),
        std::move(model.buffers), std::move(model.names),
        WindowRule{options_.steps(), options_.reduction(), options_.accumulate_dtype(),
                   options_.comm_dtype(), options_.error_feedback()});
  } else if (const auto wide = options_.accumulate_dtype()) {
    // One process: the window's sums of narrower gradients live here.
    for (const auto& p : params_) {
      wide_.push_back(at::elementSize(*wide) > p.element_size()
          ? at::zeros_like(p, p.options().dtype(*wide).requires_grad(false)) : at::Tensor());
    }
    wide_has_.assign(params_.size(), 0);
  }
  if (options_.loss_scaler()) {
    loss_scale_ = options_.loss_scaler()->init_scale();
  }
  remember_gradients();
}

bool Accumulator::unscale_and_check() {
  // The reduced window gradient carries scale/steps (see backward()): undo it
  // and look for an overflow in one fused pass, as GradScaler.unscale_ does.
  std::vector<at::Tensor> grads = defined_grads();
  if (grads.empty()) {
    return true;
  }
  auto found_inf = at::zeros({1}, grads.front().options().dtype(at::kFloat));
  const auto inv_scale = at::full({1}, static_cast<double>(options_.steps()) / loss_scale_,
                                  grads.front().options().dtype(at::kFloat));
  at::NoGradGuard no_grad;
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  const bool finite = found_inf.item<float>() == 0;
  const auto& scaler = *options_.loss_scaler();
  if (!finite) {
    loss_scale_ *= scaler.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == scaler.growth_interval()) {
    loss_scale_ *= scaler.growth_factor();
    growth_tracker_ = 0;
  }
  return finite;
}

Accumulator::~Accumulator() {
  close();
}

void Accumulator::set_window_callbacks(std::function<bool()> before_step, std::function<void()> after_window) {
  TORCH_CHECK_VALUE(!options_.loss_scaler() || !before_step,
      "set_window_callbacks: this Accumulator has a loss_scaler already (one scaler per window)");
  before_step_ = std::move(before_step);
  after_window_ = std::move(after_window);
}

void Accumulator::close() {
  if (closed_) {
    return;
  }
  closed_ = true;
  reducer_.reset(); // removes the hooks; a reduction in flight completes its pairing
  claim_.reset();
  // The group's last reference may be ours (destroy_process_group() ran):
  // let it go now, not whenever this object is destroyed.
  options_.process_group(nullptr);
}

void Accumulator::check_open(const char* what) const {
  TORCH_CHECK(!closed_, what, ": this Accumulator was closed");
}

void Accumulator::remember_gradients() {
  remembered_ = grad_versions();
}

void Accumulator::check_gradients_untouched(const char* what, bool allow_in_place) const {
  check_gradients_untouched(what, allow_in_place, grad_versions());
}

void Accumulator::check_gradients_untouched(
    const char* what, bool allow_in_place, const std::vector<GradMark>& now) const {
  for (const auto i : c10::irange(params_.size())) {
    // New storage for the same tensor (`.grad.data = t`) is a change in place.
    const bool replaced = now[i].impl != remembered_[i].impl;
    const bool changed = replaced || now[i] != remembered_[i];
    TORCH_CHECK(allow_in_place ? !replaced : !changed,
        what, ": the gradient of ", names_[i], " was ", now[i].impl ? "changed" : "cleared",
        " outside the Accumulator in the middle of a window (", micro_step_, " of ",
        options_.steps(), " micro-steps done", window_ready_ ? ", window closed" : "",
        "): optimizer.zero_grad() or model.zero_grad() between micro-steps? Clear "
        "gradients only after step() returns True (step() clears them itself), or call "
        "the Accumulator's zero_grad() to drop the window");
  }
}

void Accumulator::check_requires_grad() const {
  for (const auto& [name, p] : frozen_) {
    TORCH_CHECK(!p.requires_grad(),
        "backward(): ", name, " was frozen (requires_grad=False) when the Accumulator was "
        "built and now requires grad: its gradient would be neither scaled, reduced nor "
        "cleared. Build a new Accumulator after changing requires_grad (close() this one)");
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
  check_open("backward()");
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
  check_requires_grad();
  // One look at the gradients serves the mid-window check here and, should
  // backward fail, the question whether it reached .grad.
  const auto before = grad_versions();
  if (micro_step_ > 0 && !window_failed_) {
    if (reducer_) {
      // Data parallel, the window must still close on every rank together:
      // it is dropped on every rank then, each naming this rank's mistake.
      if (before != remembered_) {
        window_failed_ = true;
        window_failure_ = AbortReason::GradientsChanged;
      }
    } else {
      check_gradients_untouched("backward()", /*allow_in_place=*/false, before);
    }
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

  // With the built-in loss scaler: scaled, and by 1/steps so that fp16 sees the
  // big batch's magnitudes; unscale_and_check() undoes both at the window's end.
  const at::Tensor scaled = loss_scale_ > 0
      ? loss * (loss_scale_ / static_cast<double>(options_.steps())) : loss;
  const bool closes = sync_gradients();
  if (!closes) {
    NoSync local(reducer_.get());
    try {
      scaled.backward();
    } catch (...) {
      if (reducer_) {
        // The window can no longer be what the other ranks expect: it is
        // dropped on every rank when it closes. The failed micro-step still
        // takes its place, so that every rank closes its windows together.
        window_failed_ = true;
        window_failure_ = AbortReason::BackwardFailed;
        ++micro_step_;
        ++stats_.micro_steps;
        remember_gradients();
      } else if (grad_versions() != before) {
        reset_window(); // part of this micro-step reached .grad: the window is wrong
      } // else nothing changed: the micro-step simply did not happen
      throw;
    }
    window_weight_ += weight;
    ++micro_step_;
    ++stats_.micro_steps;
    accumulate_wide();
    remember_gradients();
    return;
  }
  if (reducer_) {
    const auto window = reducer_->progress().sequence;
    if (window_failed_) {
      ReductionRequest abort;
      abort.abort = window_failure_;
      reset_window();
      try {
        reducer_->reduce(abort); // throws the dropped window's error, as every rank does
      } catch (...) {
        note_dropped_window(window);
        throw;
      }
      TORCH_INTERNAL_ASSERT(false, "gradaccum: an aborted reduction returned");
    }
    ReductionRequest request;
    request.weight = window_weight_ + weight;
    request.divide = options_.reduction() != Reduction::Sum;
    request.check_finite = reducer_checks_finite();
    ReductionResult result;
    try {
      result = reducer_->backward(scaled, request);
    } catch (...) {
      const auto last = reducer_->last_result();
      if (last.window == window && !last.dropped) {
        // Reduced on every rank; something failed on this rank afterwards.
        // The window stays closed, as on the other ranks.
        epoch_ended_ = last.flushing_ranks > 0;
        ++stats_.micro_steps;
        micro_step_ = 0;
        window_weight_ = 0;
        window_ready_ = true;
        window_known_finite_ = false; // the write-back may not have finished here
        remember_gradients();
        throw;
      }
      reset_window(); // the reducer dropped the window on every rank
      note_dropped_window(window);
      throw;
    }
    // A full window reduced with others' partial ones: their epoch is over,
    // and this rank's flush() must not reduce again.
    epoch_ended_ = result.flushing_ranks > 0;
    window_known_finite_ = result.known_finite;
  } else {
    try {
      scaled.backward();
    } catch (...) {
      if (grad_versions() != before) {
        reset_window();
      }
      throw;
    }
    window_weight_ += weight;
    accumulate_wide();
    scale_local_gradients();
  }
  ++stats_.micro_steps;
  micro_step_ = 0;
  window_weight_ = 0;
  window_ready_ = true;
  remember_gradients();
}

std::vector<GradMark> Accumulator::grad_versions() const {
  // Accumulating into .grad either bumps its version (in place) or replaces it.
  std::vector<GradMark> versions;
  versions.reserve(params_.size());
  for (const auto& p : params_) {
    const auto& g = p.grad();
    versions.push_back(g.defined()
        // unsafe_storage(): sparse and opaque tensors have none (nullptr), and never throw.
        ? GradMark{g.unsafeGetTensorImpl(), g.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl(),
                   g._version()}
        : GradMark{});
  }
  return versions;
}

void Accumulator::note_dropped_window(int64_t window) {
  // A dropped window still tells whether other ranks were flushing (ended
  // their epoch); this rank, which was not, must then not flush again.
  const auto last = reducer_->last_result();
  epoch_ended_ = last.window == window && last.flushing_ranks > 0;
}

void Accumulator::reset_window() {
  clear_gradients();
  micro_step_ = 0;
  window_ready_ = false;
  window_unscaled_ = false;
  window_weight_ = 0;
  window_failed_ = false;
  window_known_finite_ = false;
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

bool Accumulator::accumulates_wide(size_t i) const {
  if (reducer_) {
    return reducer_->accumulates(i);
  }
  return i < wide_.size() && wide_[i].defined();
}

void Accumulator::accumulate_wide() {
  // accumulate_dtype: add this micro-step's narrower gradients into the wide
  // sums and release them (data parallel: into the buckets).
  if (reducer_) {
    if (reducer_->accumulating()) {
      reducer_->accumulate_local();
    }
    return;
  }
  at::NoGradGuard no_grad;
  for (const auto i : c10::irange(wide_.size())) {
    auto& grad = params_[i].mutable_grad();
    if (wide_[i].defined() && grad.defined()) {
      add_widened(wide_[i], grad);
      grad = at::Tensor();
      wide_has_[i] = 1;
      wide_touched_ = true;
    }
  }
}

void Accumulator::scale_local_gradients() {
  if (wide_touched_) {
    // The window's gradient, rounded once to the parameters' dtype.
    at::NoGradGuard no_grad;
    const bool divide = options_.reduction() != Reduction::Sum && window_weight_ != 1.0;
    for (const auto i : c10::irange(wide_.size())) {
      if (wide_has_[i]) {
        params_[i].mutable_grad() =
            (divide ? wide_[i].div(window_weight_) : wide_[i]).to(params_[i].scalar_type());
      }
      if (wide_[i].defined()) {
        wide_[i].zero_();
      }
      wide_has_[i] = 0;
    }
    wide_touched_ = false;
  }
  if (options_.reduction() == Reduction::Sum || window_weight_ == 1.0) {
    return;
  }
  std::vector<at::Tensor> grads; // the ones summed in their own dtype
  for (const auto i : c10::irange(params_.size())) {
    if (params_[i].grad().defined() && !(i < wide_.size() && wide_[i].defined())) {
      grads.push_back(params_[i].grad());
    }
  }
  if (grads.empty()) {
    return;
  }
  at::NoGradGuard no_grad;
  at::_foreach_div_(grads, at::Scalar(window_weight_));
}

bool Accumulator::step() {
  check_open("step()");
  TORCH_CHECK(optimizer_step_,
      "step(): this Accumulator has no optimizer (pass one to the constructor; "
      "without one, backward() leaves the window's gradient in .grad)");
  if (!window_ready_) {
    return false;
  }
  check_gradients_untouched("step()", /*allow_in_place=*/true); // clipping in place is fine
  return finish_window();
}

bool Accumulator::flush() {
  check_open("flush()");
  TORCH_CHECK(optimizer_step_,
      "flush(): this Accumulator has no optimizer (pass one to the constructor)");
  if (!window_ready_ && micro_step_ > 0 && !window_failed_) {
    if (reducer_ && grad_versions() != remembered_) {
      // The flush collective must still run on every rank: drop the window there.
      window_failed_ = true;
      window_failure_ = AbortReason::GradientsChanged;
    } else if (!reducer_) {
      check_gradients_untouched("flush()", /*allow_in_place=*/false);
    }
  }
  bool stepped = false;
  std::string local_failure;
  if (window_ready_ && reducer_ && !epoch_ended_) {
    // The flush collective below pairs with the other ranks' whatever happens
    // to this closed window here: a rank that cannot step it (its .grad was
    // replaced, its optimizer raised) drops the flush window on every rank
    // instead of raising alone (the others would wait in the collective).
    // They have stepped theirs by then: the message says the replicas differ.
    raised_alike_ = false;
    const bool as_reduced = grad_versions() == remembered_;
    try {
      check_gradients_untouched("flush()", /*allow_in_place=*/true);
      stepped = finish_window();
    } catch (const std::exception& e) {
      if (raised_alike_ && as_reduced) {
        // nonfinite="raise" on the reduced gradient, untouched since: every
        // rank holds the same one and raises here alike, before the collective.
        throw;
      }
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      local_failure = error ? error->what_without_backtrace() : e.what();
      zero_grad();
      window_failed_ = true;
      window_failure_ = AbortReason::ClosedWindowNotStepped;
    }
  } else if (window_ready_) {
    check_gradients_untouched("flush()", /*allow_in_place=*/true);
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
    abort.abort = window_failure_;
    abort.flushing = true;
    reset_window();
    try {
      reducer_->reduce(abort);
    } catch (const c10::Error& e) {
      TORCH_CHECK(local_failure.empty(), e.what_without_backtrace(), ". The error on this rank, "
          "stepping the closed window before the flush: ", local_failure);
      throw;
    }
    TORCH_INTERNAL_ASSERT(false, "gradaccum: an aborted reduction returned");
  }
  // A collective even with nothing accumulated here, so that ranks whose data
  // ran out at a window's end still pair with the others.
  ReductionRequest request;
  request.weight = window_weight_;
  request.divide = options_.reduction() != Reduction::Sum;
  request.flushing = true;
  request.check_finite = reducer_checks_finite();
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
  window_known_finite_ = result.known_finite;
  remember_gradients(); // what the reducer checked, as step_window() compares
  return finish_window() || stepped;
}

bool Accumulator::finish_window() {
  // A retry of step() after a failure past the unscale: the scaler already
  // unscaled this window's gradient and closed its window (see below).
  const bool retry = window_unscaled_;
  before_step_ran_ = false;
  raised_alike_ = false;
  bool stepped = false;
  try {
    stepped = step_window();
  } catch (...) {
    // The optimizer step, nonfinite="raise" or the callback itself raised
    // after before_step_ (GradScaler.unscale_()) ran: after_window_
    // (GradScaler.update()) must still close the scaler's window, or every
    // later window's unscale_() fails; the window stays closed, unscaled, and
    // a retry of step() must not unscale it again. The original error is the
    // one to see.
    if (after_window_ && before_step_ran_ && !retry) {
      try {
        after_window_();
      } catch (...) {
      }
    }
    throw;
  }
  if (after_window_ && !retry) {
    after_window_(); // once per closed window, stepped or skipped
  }
  return stepped;
}

// Note [The reducer checks the window's gradient]
// The non-finite test (nonfinite "skip" or "raise", no clipping) needs only to
// know whether the window's total norm is finite, and data parallel the
// reducer writes every reduced gradient back in one pass anyway: asked with
// ReductionRequest::check_finite, it checks each value in that pass
// (detail::write_checked) and answers known_finite only when every value is
// finite and small enough that the norm cannot overflow. Then step_window()
// skips the norm (no pass over the gradients, no host synchronisation of its
// own), which would have been finite: the decision is the one the norm gives,
// on every rank alike. Anything else (clipping, a loss scaler or before_step
// that rewrites the gradients, a gradient changed in place or replaced since
// the reduction, which the versions remembered then tell, an unchecked dtype
// or device, a value that failed) takes the norm, as before, so the skip,
// raise and ignore behaviours and their messages are unchanged.
bool Accumulator::reducer_checks_finite() const {
  return !options_.max_grad_norm() && options_.nonfinite() != NonFinite::Ignore && loss_scale_ == 0 &&
      !before_step_;
}

bool Accumulator::step_window() {
  for (const auto i : c10::irange(params_.size())) {
    TORCH_CHECK(!params_[i].grad().defined() || !params_[i].grad().is_sparse(),
        "step(): ", names_[i], " has a sparse gradient (Embedding(sparse=True)?); gradaccum "
        "supports dense gradients only: use sparse=False");
  }
  if (!window_unscaled_) {
    before_step_ran_ = static_cast<bool>(before_step_);
    if ((loss_scale_ > 0 && !unscale_and_check()) || (before_step_ && !before_step_())) {
      ++stats_.skipped_steps; // e.g. a loss scaler found an overflow: it backs off
      ++stats_.windows;
      zero_grad();
      return false;
    }
    window_unscaled_ = true; // until the window ends: see finish_window()
  }
  const auto max_norm = options_.max_grad_norm();
  const auto nonfinite = options_.nonfinite();
  // See Note [The reducer checks the window's gradient].
  const bool known_finite = !max_norm && window_known_finite_ && grad_versions() == remembered_;
  if (known_finite) {
    stats_.last_grad_norm = std::nullopt; // finite: not computed
  } else if (max_norm || nonfinite != NonFinite::Ignore) {
    // As torch.nn.utils.clip_grad_norm_ computes it, so the two agree bit for bit.
    auto grads = defined_grads();
    at::NoGradGuard no_grad;
    at::Tensor total = grads.empty()
        ? at::zeros({}, at::kFloat)
        : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2.0, norm_dtype(grads))), 2.0);
    const double norm = total.item<double>();
    stats_.last_grad_norm = norm;
    if (!std::isfinite(norm) && nonfinite != NonFinite::Ignore) {
      raised_alike_ = nonfinite == NonFinite::Raise; // every rank holds this gradient
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
  reset_window(); // the window was used: its error-feedback residual carries on
  return true;
}

void Accumulator::clear_gradients() {
  if (reducer_) {
    reducer_->zero_grad();
    return;
  }
  for (auto& wide : wide_) {
    if (wide.defined()) {
      wide.zero_();
    }
  }
  std::fill(wide_has_.begin(), wide_has_.end(), 0);
  wide_touched_ = false;
  for (auto& p : params_) {
    p.mutable_grad() = at::Tensor();
  }
}

void Accumulator::zero_grad() {
  // Drops the window; a pending end of epoch (epoch_ended_) stays: it is
  // about where the other ranks are, not about this window's gradients.
  if (window_ready_ && reducer_ && options_.error_feedback()) {
    // A reduced window thrown away (skipped, or dropped by the user after
    // nonfinite="raise"): what rounding it lost belongs to it alone.
    reducer_->discard_residuals();
  }
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
  if (loss_scale_ > 0) {
    stats.loss_scale = loss_scale_;
  }
  if (reducer_) {
    stats.reducer = reducer_->stats();
  }
  return stats;
}

AccumulatorState Accumulator::state_dict(bool rank_independent) {
  check_open("state_dict()");
  AccumulatorState state;
  state.steps = options_.steps();
  state.reduction = options_.reduction();
  state.world_size = reducer_ ? reducer_->process_group()->getSize() : 1;
  state.rank = reducer_ ? reducer_->process_group()->getRank() : 0;
  state.rank_independent = !reducer_ || rank_independent;
  state.micro_step = micro_step_;
  state.window_ready = window_ready_;
  state.window_weight = window_weight_;
  state.epoch_ended = epoch_ended_;
  state.micro_steps = stats_.micro_steps;
  state.optimizer_steps = stats_.optimizer_steps;
  state.skipped_steps = stats_.skipped_steps;
  state.windows = stats_.windows;
  state.loss_scale = loss_scale_;
  state.loss_scale_growth_tracker = growth_tracker_;
  TORCH_CHECK(!(reducer_ && rank_independent && epoch_ended_),
      "state_dict(): other ranks ended the epoch with flush() in the reduction that closed "
      "this rank's last window; call flush() (a no-op here) before saving, so that the "
      "state is the same on every rank");
  TORCH_CHECK(!(reducer_ && rank_independent && micro_step_ > 0 && reducer_->compressing()),
      "state_dict(): a rank-independent checkpoint in the middle of a window is not supported "
      "with comm_dtype (the half-done window would be rounded to the wire's dtype); save at a "
      "window boundary (micro_step 0), or use state_dict(rank_independent=False)");
  TORCH_CHECK(!(reducer_ && !rank_independent && window_failed_),
      "state_dict(rank_independent=False): a micro-step of this window failed on this rank, so the "
      "window will be dropped on every rank when it closes; a state saved now would resume it as "
      "if nothing had failed. Save at a window boundary (after the window closes)");
  if (reducer_ && rank_independent && micro_step_ > 0) {
    // Sum the half-done window over ranks; each rank keeps 1/world of it, so
    // any rank's state, loaded everywhere, sums back to the same window.
    ReductionRequest request;
    request.weight = window_weight_;
    request.divide = false;
    request.abort = window_failed_ ? AbortReason::BackwardFailed : AbortReason::None;
    if (!window_failed_ && grad_versions() != remembered_) {
      // Cleared or changed since the last micro-step (optimizer.zero_grad()?):
      // a snapshot of it would save, and then continue, a silently wrong window.
      request.abort = AbortReason::GradientsChanged;
    }
    ReductionResult result;
    const auto window = reducer_->progress().sequence;
    std::vector<at::Tensor> sums;
    try {
      sums = reducer_->snapshot(request, &result);
    } catch (...) {
      reset_window(); // dropped on every rank: see the error
      note_dropped_window(window);
      throw;
    }
    const auto world = static_cast<double>(state.world_size);
    for (const auto& sum : sums) {
      // In the buckets' dtype: an accumulate_dtype sum stays wide.
      state.grads.push_back(sum.defined() ? sum.div(world) : at::Tensor());
    }
    state.window_weight = result.global_weight / world;
    remember_gradients(); // bucket views were written back in place
  } else {
    const bool mid_window = micro_step_ > 0 || window_ready_;
    if (mid_window) {
      // A window cleared or replaced since its last micro-step would be saved,
      // and resumed, without what it lost (no collective here: a local error).
      check_gradients_untouched("state_dict()", /*allow_in_place=*/window_ready_);
    }
    // accumulate_dtype mid-window: the wide sums (in the buckets, or in wide_
    // in one process) are the window's gradient so far; .grad holds none.
    std::vector<at::Tensor> wide;
    if (micro_step_ > 0 && reducer_ && reducer_->accumulating()) {
      wide = reducer_->accumulated();
    }
    for (const auto i : c10::irange(params_.size())) {
      const auto& p = params_[i];
      if (!wide.empty() && reducer_->accumulates(i)) {
        state.grads.push_back(wide[i]);
      } else if (micro_step_ > 0 && i < wide_.size() && wide_[i].defined()) {
        state.grads.push_back(wide_has_[i] ? wide_[i].clone() : at::Tensor());
      } else {
        // A snapshot: later micro-steps must not change what was saved.
        state.grads.push_back(mid_window && p.grad().defined() ? p.grad().detach().clone() : at::Tensor());
      }
    }
  }
  if (reducer_) {
    const auto progress = reducer_->progress();
    state.reducer = progress.stats;
    state.reducer_sequence = progress.sequence;
    state.reducer_last_weight = progress.last_weight;
    if (!state.rank_independent && options_.error_feedback()) {
      state.residuals = reducer_->residuals(); // a rank's own: see AccumulatorState
    }
  }
  return state;
}

void Accumulator::load_state_dict(const AccumulatorState& state) {
  check_open("load_state_dict()");
  const int64_t world = reducer_ ? reducer_->process_group()->getSize() : 1;
  const int64_t rank = reducer_ ? reducer_->process_group()->getRank() : 0;
  TORCH_CHECK_VALUE(state.steps == options_.steps(),
      "load_state_dict: the state was saved with steps=", state.steps,
      " but this Accumulator has steps=", options_.steps());
  TORCH_CHECK_VALUE(state.reduction == options_.reduction(),
      "load_state_dict: the state was saved with reduction='", to_string(state.reduction),
      "' but this Accumulator has reduction='", to_string(options_.reduction()), "'");
  TORCH_CHECK_VALUE(state.world_size == world,
      "load_state_dict: the state was saved with world size ", state.world_size,
      " but this Accumulator's group has ", world, " rank(s); a half-done window cannot be "
      "split over another number of ranks (resume at a window boundary, or with ", state.world_size,
      " ranks)");
  TORCH_CHECK_VALUE(state.rank_independent || state.rank == rank,
      "load_state_dict: this is rank ", state.rank, "'s own state (state_dict(rank_independent="
      "False)) but this is rank ", rank, "; save with state_dict() (rank-independent) to load "
      "one rank's state on every rank");
  TORCH_CHECK_VALUE(state.micro_step >= 0 && state.micro_step < options_.steps(),
      "load_state_dict: micro_step=", state.micro_step, " is outside [0, ", options_.steps(), ")");
  TORCH_CHECK_VALUE(!state.window_ready || state.micro_step == 0,
      "load_state_dict: window_ready=true with micro_step=", state.micro_step,
      " (a closed window has micro_step 0)");
  TORCH_CHECK_VALUE(std::isfinite(state.window_weight) && state.window_weight >= 0,
      "load_state_dict: window_weight=", state.window_weight, " must be >= 0");
  TORCH_CHECK_VALUE(std::isfinite(state.reducer_last_weight) && state.reducer_last_weight >= 0,
      "load_state_dict: reducer_last_weight=", state.reducer_last_weight, " must be >= 0");
  if (state.micro_step == 0) {
    TORCH_CHECK_VALUE(state.window_weight == 0,
        "load_state_dict: window_weight=", state.window_weight, " with micro_step=0 (no "
        "micro-step of the window is done, so its weight is 0)");
  } else if (options_.reduction() != Reduction::Items) {
    TORCH_CHECK_VALUE(state.window_weight == static_cast<double>(state.micro_step),
        "load_state_dict: window_weight=", state.window_weight, " contradicts micro_step=",
        state.micro_step, " (with reduction '", to_string(options_.reduction()),
        "' the weight counts the micro-steps)");
  } else {
    TORCH_CHECK_VALUE(state.window_weight > 0,
        "load_state_dict: window_weight=", state.window_weight, " with micro_step=",
        state.micro_step, " (the items of the done micro-steps must be > 0)");
  }
  TORCH_CHECK_VALUE(!state.epoch_ended || (state.micro_step == 0 && world > 1),
      "load_state_dict: epoch_ended=true needs micro_step=0 and a process group");
  TORCH_CHECK_VALUE((state.loss_scale > 0) == (loss_scale_ > 0) && std::isfinite(state.loss_scale) &&
          state.loss_scale_growth_tracker >= 0,
      "load_state_dict: loss_scale=", state.loss_scale, " does not fit this Accumulator (",
      loss_scale_ > 0 ? "it has a loss_scaler: the scale must be > 0" : "it has no loss_scaler: 0", ")");
  TORCH_CHECK_VALUE(state.micro_steps >= 0 && state.optimizer_steps >= 0 &&
          state.skipped_steps >= 0 && state.windows >= 0 && state.reducer_sequence >= 0,
      "load_state_dict: counters must be >= 0");
  TORCH_CHECK_VALUE(state.grads.size() == params_.size(),
      "load_state_dict: the state holds ", state.grads.size(),
      " gradients but the model has ", params_.size(), " trainable parameters");
  for (const auto i : c10::irange(params_.size())) {
    const auto& g = state.grads[i];
    if (g.defined()) {
      // Mid-window, a parameter summed in accumulate_dtype takes its sum in
      // that dtype (or its own, widened).
      const bool wide = state.micro_step > 0 && accumulates_wide(i) &&
          g.scalar_type() == *options_.accumulate_dtype();
      TORCH_CHECK_VALUE(g.sizes() == params_[i].sizes() && (wide || g.scalar_type() == params_[i].scalar_type()),
          "load_state_dict: gradient ", i, " is ", g.scalar_type(), " ", g.sizes(),
          " but the parameter is ", params_[i].scalar_type(), " ", params_[i].sizes(),
          (accumulates_wide(i) && state.micro_step > 0
               ? std::string(" (summed in ") + c10::toString(*options_.accumulate_dtype()) + " here)"
               : std::string()));
    }
  }
  TORCH_CHECK_VALUE(state.residuals.empty() || (reducer_ && !state.rank_independent),
      "load_state_dict: the state holds error-feedback residuals, which belong to one rank's "
      "per-rank state (rank_independent=False) of a data-parallel Accumulator");
  if (reducer_) {
    reducer_->set_residuals(state.residuals); // all or nothing; the last check that can fail
  }
  clear_gradients();
  {
    at::NoGradGuard no_grad;
    std::vector<size_t> restored;
    for (const auto i : c10::irange(params_.size())) {
      const auto& g = state.grads[i];
      if (!g.defined()) {
        if (state.window_ready) {
          params_[i].mutable_grad() = at::Tensor(); // no gradient anywhere: None, not a zero view
        }
        continue;
      }
      restored.push_back(i);
      if (state.micro_step > 0 && accumulates_wide(i)) {
        if (reducer_) {
          reducer_->load_accumulated(i, g.to(params_[i].device()));
        } else {
          wide_[i].copy_(g);
          wide_has_[i] = 1;
          wide_touched_ = true;
        }
        continue;
      }
      auto& grad = params_[i].mutable_grad();
      if (grad.defined()) {
        grad.copy_(g); // a bucket view stays a view
      } else {
        grad = g.detach().to(params_[i].device()).clone();
      }
    }
    if (reducer_) {
      reducer_->mark_restored(restored); // these hold a gradient even if no hook fires again
    }
  }
  micro_step_ = state.micro_step;
  window_ready_ = state.window_ready;
  window_weight_ = state.window_weight;
  window_failed_ = false;
  window_unscaled_ = false;
  window_known_finite_ = false;
  epoch_ended_ = state.epoch_ended;
  stats_.micro_steps = state.micro_steps;
  stats_.optimizer_steps = state.optimizer_steps;
  stats_.skipped_steps = state.skipped_steps;
  stats_.windows = state.windows;
  loss_scale_ = state.loss_scale;
  growth_tracker_ = state.loss_scale_growth_tracker;
  if (reducer_) {
    reducer_->restore({state.reducer, state.reducer_sequence, state.reducer_last_weight});
  }
  remember_gradients();
}

namespace {

const char* const kIntFields[] = {"steps", "reduction", "world_size", "rank", "micro_step",
    "micro_steps", "optimizer_steps", "skipped_steps", "windows", "reducer_sequence",
    "reducer.windows", "reducer.dropped_windows", "reducer.collectives", "reducer.bytes_reduced",
    "reducer.last_window_collectives", "reducer.last_window_bytes", "reducer.broadcasts",
    "reducer.snapshots", "loss_scale_growth_tracker"};

// A list of tensors, undefined ones included: `count_key`, then per entry
// `prefix<i>.defined` and `prefix<i>` (an empty tensor where undefined).
void write_tensors(torch::serialize::OutputArchive& archive, const std::string& count_key,
                   const std::string& prefix, const std::vector<at::Tensor>& tensors) {
  archive.write(count_key, c10::IValue(static_cast<int64_t>(tensors.size())));
  for (const auto i : c10::irange(tensors.size())) {
    const auto key = prefix + std::to_string(i);
    archive.write(key + ".defined", c10::IValue(tensors[i].defined()));
    archive.write(key, tensors[i].defined() ? tensors[i] : at::empty({0}), /*is_buffer=*/true);
  }
}

std::vector<at::Tensor> read_tensors(torch::serialize::InputArchive& archive, const std::string& prefix,
                                     int64_t count) {
  std::vector<at::Tensor> tensors;
  c10::IValue defined;
  for (int64_t i = 0; i < count; ++i) {
    at::Tensor tensor;
    const auto key = prefix + std::to_string(i);
    archive.read(key + ".defined", defined);
    archive.read(key, tensor, /*is_buffer=*/true);
    tensors.push_back(defined.toBool() ? tensor : at::Tensor());
  }
  return tensors;
}

std::vector<int64_t*> int_fields(AccumulatorState& s) {
  return {&s.steps, nullptr, &s.world_size, &s.rank, &s.micro_step, &s.micro_steps,
      &s.optimizer_steps, &s.skipped_steps, &s.windows, &s.reducer_sequence, &s.reducer.windows,
      &s.reducer.dropped_windows, &s.reducer.collectives, &s.reducer.bytes_reduced,
      &s.reducer.last_window_collectives, &s.reducer.last_window_bytes, &s.reducer.broadcasts,
      &s.reducer.snapshots, &s.loss_scale_growth_tracker};
}

} // namespace

void Accumulator::save(torch::serialize::OutputArchive& archive, bool rank_independent) {
  auto state = state_dict(rank_independent);
  const auto fields = int_fields(state);
  for (const auto i : c10::irange(fields.size())) {
    const int64_t value = fields[i] ? *fields[i] : static_cast<int64_t>(state.reduction);
    archive.write(std::string("gradaccum.") + kIntFields[i], c10::IValue(value));
  }
  archive.write("gradaccum.rank_independent", c10::IValue(state.rank_independent));
  archive.write("gradaccum.window_ready", c10::IValue(state.window_ready));
  archive.write("gradaccum.epoch_ended", c10::IValue(state.epoch_ended));
  archive.write("gradaccum.window_weight", c10::IValue(state.window_weight));
  archive.write("gradaccum.loss_scale", c10::IValue(state.loss_scale));
  archive.write("gradaccum.reducer_last_weight", c10::IValue(state.reducer_last_weight));
  write_tensors(archive, "gradaccum.grads", "gradaccum.grad.", state.grads);
  write_tensors(archive, "gradaccum.residuals", "gradaccum.residual.", state.residuals);
}

void Accumulator::load(torch::serialize::InputArchive& archive) {
  AccumulatorState state;
  const auto fields = int_fields(state);
  c10::IValue value;
  for (const auto i : c10::irange(fields.size())) {
    archive.read(std::string("gradaccum.") + kIntFields[i], value);
    if (fields[i]) {
      *fields[i] = value.toInt();
    } else {
      state.reduction = static_cast<Reduction>(value.toInt());
    }
  }
  archive.read("gradaccum.rank_independent", value);
  state.rank_independent = value.toBool();
  archive.read("gradaccum.window_ready", value);
  state.window_ready = value.toBool();
  archive.read("gradaccum.epoch_ended", value);
  state.epoch_ended = value.toBool();
  archive.read("gradaccum.window_weight", value);
  state.window_weight = value.toDouble();
  archive.read("gradaccum.loss_scale", value);
  state.loss_scale = value.toDouble();
  if (archive.try_read("gradaccum.reducer_last_weight", value)) { // older archives have none
    state.reducer_last_weight = value.toDouble();
  }
  archive.read("gradaccum.grads", value);
  state.grads = read_tensors(archive, "gradaccum.grad.", value.toInt());
  if (archive.try_read("gradaccum.residuals", value)) { // archives before 0.2 have none
    state.residuals = read_tensors(archive, "gradaccum.residual.", value.toInt());
  }
  load_state_dict(state);
}

} // namespace gradaccum
