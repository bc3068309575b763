// One process's mixed precision: the built-in loss scaler's check at the
// window's end, and the window's sums in accumulate_dtype (data parallel, the
// reducer's buckets hold them; see src/precision/).
#include <gradaccum/accumulator.h>

#include "precision/wide_sums.h"

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
  return reducer_ ? reducer_->accumulates(i) : wide_ && wide_->holds(i);
}

void Accumulator::accumulate_wide() {
  // accumulate_dtype: add this micro-step's narrower gradients into the wide
  // sums and release them (Note [One accumulate_dtype path]).
  if (reducer_) {
    if (reducer_->accumulating()) {
      reducer_->accumulate_local();
    }
  } else if (wide_ && !wide_->empty()) {
    wide_->add(params_);
  }
}

void Accumulator::scale_local_gradients() {
  const bool divide = options_.reduction() != Reduction::Sum && window_weight_ != 1.0;
  if (wide_) {
    // The window's gradient, rounded once to the parameters' dtype.
    wide_->write_back(params_, divide ? std::optional<double>(window_weight_) : std::nullopt);
  }
  if (!divide) {
    return;
  }
  std::vector<at::Tensor> grads; // the ones summed in their own dtype
  for (const auto i : c10::irange(params_.size())) {
    if (params_[i].grad().defined() && !accumulates_wide(i)) {
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
