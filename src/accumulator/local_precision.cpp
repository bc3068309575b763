// One process's mixed precision: the built-in loss scaler's check at the
// window's end, and the window's sums in accumulate_dtype (data parallel, the
// reducer's buckets hold them; see src/precision/).
#include <gradaccum/accumulator.h>

#include <ATen/ATen.h>
#include <c10/util/irange.h>

namespace gradaccum {

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

} // namespace gradaccum
