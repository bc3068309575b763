#include "precision/loss_scaler.h"

#include <ATen/ATen.h>

namespace gradaccum::detail {

bool LossScaler::unscale(const std::vector<at::Tensor>& grads, int64_t steps) {
  found_inf_ = false;
  checked_ = !grads.empty();
  if (!checked_) {
    return true; // nothing to check: the scale stays as it is
  }
  const auto options = grads.front().options().dtype(at::kFloat);
  auto found_inf = at::zeros({1}, options);
  const auto inv_scale = at::full({1}, static_cast<double>(steps) / scale_, options);
  at::NoGradGuard no_grad;
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
  found_inf_ = found_inf.item<float>() != 0;
  return !found_inf_;
}

void LossScaler::update() {
  if (!checked_) {
    return;
  }
  checked_ = false;
  if (found_inf_) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  found_inf_ = false;
}

} // namespace gradaccum::detail
