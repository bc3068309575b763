// Where the window's sums in accumulate_dtype live (Note [One
// accumulate_dtype path]), and the window's division of the rest.
#include <gradaccum/accumulator.h>

#include "precision/wide_sums.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

namespace gradaccum {

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
  // A window of weight 0 (nothing kept, no items) is skipped unstepped.
  const bool divide = options_.reduction() != Reduction::Sum && window_weight_ != 1.0 && window_weight_ > 0;
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
