#pragma once
// Internal: the built-in dynamic loss scaler (LossScalerOptions), for C++
// users, who have no torch.amp.GradScaler.

#include <gradaccum/options.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace gradaccum::detail {

// Note [One loss scaler path]
// A window's loss scaler has three moments: the loss is scaled before each
// micro-step's backward; at a closed window the reduced gradient is unscaled
// and checked (false: the window is skipped); once per closed window, stepped
// or skipped, the scale is updated. The Accumulator knows only the last two
// as its window callbacks (set_window_callbacks: before_step, after_window),
// whoever provides them: from Python a torch.amp.GradScaler (unscale_(),
// update()), from C++ this LossScaler, installed as those callbacks when
// AccumulatorOptions::loss_scaler is set. So finish_window() has one path for
// both, with the same retry and failure rules; the arithmetic is
// GradScaler's (the same fused unscale-and-check kernel, the same growth and
// backoff).
class LossScaler {
 public:
  explicit LossScaler(const LossScalerOptions& options)
      : options_(options), scale_(options.init_scale()) {}

  /// What backward differentiates: the loss times scale/steps, so that fp16
  /// sees the big batch's magnitudes.
  at::Tensor scale_loss(const at::Tensor& loss, int64_t steps) const {
    return loss * (scale_ / static_cast<double>(steps));
  }
  /// Undoes scale/steps in `grads` and looks for an overflow in one fused
  /// pass, as GradScaler.unscale_ does. Returns whether all are finite.
  bool unscale(const std::vector<at::Tensor>& grads, int64_t steps);
  /// Once per closed window: backs off after an overflow, grows after
  /// growth_interval finite windows in a row (a window without gradients
  /// changes nothing).
  void update();

  double scale() const {
    return scale_;
  }
  int64_t growth_tracker() const {
    return growth_tracker_;
  }
  void restore(double scale, int64_t growth_tracker) {
    scale_ = scale;
    growth_tracker_ = growth_tracker;
    found_inf_ = false;
    checked_ = false;
  }

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  bool checked_ = false; ///< this window's unscale() saw gradients
  bool found_inf_ = false; ///< ... and one was not finite
};

} // namespace gradaccum::detail
