// The window's loss: what the window's micro-batches scored, weighted as the
// gradient, over every rank.
#include <gradaccum/accumulator.h>

#include <ATen/ATen.h>

#include <cmath>

#include <utility>

namespace gradaccum {

// Note [The window's loss rides in the header]
// A training loop logs a loss; under data parallel accumulation the one that
// was optimised is the window's, over every micro-batch of every rank,
// weighted as the gradient: the mean of the micro-batch losses (mean), total
// loss over total items (items), or their sum (sum). Frameworks pay an extra
// all-reduce and a host synchronisation for it, or log rank 0's number. Here
// each rank keeps its window's loss sum on the loss's device (detached,
// float64: no synchronisation), and the synchronising reduction writes it into
// the header of every bucket on the device (kLoss), so the all-reduce that
// already carries the weight sums it too: no extra collective. The reducer
// reads the summed header to the host anyway, so the window's loss is known
// when the window closes, divided by the same global weight as the gradient.
// Digit-encoded meta (a bf16/fp16 wire: comm_dtype, or bf16/fp16 parameters
// without accumulate_dtype) carries integers only: where every bucket's is,
// the window's loss is not available (None); the reducer reads it from the
// last bucket whose meta is not (take_metric_sums()). Nor for a window of
// weight 0 (its metrics are: sums, as in one process), or one dropped on
// every rank (forget_window_loss(): none of its loss was applied; a window
// reduced everywhere but dropped on one rank alone keeps its loss there, as
// the others stepped it, where the failure came after the reducer read it:
// the write-back). One process: the
// local sum over the window's weight, on the device. User metrics
// (AccumulatorOptions::metrics) ride the same way, after the loss (kMetric0):
// the header keeps room for kMaxWindowMetrics of them in every bucket, so
// their number changes no layout; they are summed, never divided.

// The window's sums are one float64 tensor: the loss, then the user metrics
// (AccumulatorOptions::metrics), which ride in the header after it (kMetric0).

void Accumulator::check_metrics(const at::Tensor& metrics, const char* what) const {
  if (!metrics.defined()) {
    return;
  }
  const auto n = static_cast<int64_t>(options_.metrics().size());
  TORCH_CHECK_VALUE(n > 0, "gradaccum: ", what, ": metrics were given, but the Accumulator was built without "
      "metric names (Accumulator(metrics=...); C++: AccumulatorOptions::metrics)");
  TORCH_CHECK_VALUE(metrics.dim() <= 1 && metrics.numel() == n,
      "gradaccum: ", what, ": metrics must hold ", n, " value(s), one per metric name, got a tensor of shape ",
      metrics.sizes());
  TORCH_CHECK_TYPE(!metrics.is_complex(),
      "gradaccum: ", what, ": metrics must be real numbers, got ", metrics.scalar_type());
  TORCH_CHECK_VALUE(!metrics.is_meta(), "gradaccum: ", what, ": metrics are on the meta device: they hold no value");
  TORCH_CHECK_VALUE(metrics.layout() == at::kStrided,
      "gradaccum: ", what, ": metrics must be a dense tensor, got layout ", metrics.layout());
}

void Accumulator::check_reported(const at::Tensor& reported, const char* what) {
  if (!reported.defined()) {
    return;
  }
  TORCH_CHECK_VALUE(reported.numel() == 1,
      "gradaccum: ", what, ": the reported loss must be a scalar, got a tensor of shape ", reported.sizes());
  TORCH_CHECK_TYPE(!reported.is_complex(),
      "gradaccum: ", what, ": the reported loss must be real, got ", reported.scalar_type());
  TORCH_CHECK_VALUE(reported.layout() == at::kStrided,
      "gradaccum: ", what, ": the reported loss must be a dense tensor, got layout ", reported.layout());
}

void Accumulator::add_micro_loss(const at::Tensor& loss, const at::Tensor& metrics) {
  const auto options = loss.options().dtype(at::kDouble);
  auto value = loss.detach().to(at::kDouble).reshape({1});
  if (const auto n = static_cast<int64_t>(options_.metrics().size()); n > 0) {
    value = at::cat({value, metrics.defined() ? metrics.detach().to(options).reshape({n}) : at::zeros({n}, options)});
  }
  // (A micro-batch's loss on another device than the first's: summed where the first's is.)
  pending_loss_sum_ = window_loss_sum_.defined() ? window_loss_sum_ + value.to(window_loss_sum_.device()) : value;
}

void Accumulator::close_window_loss(const ReductionResult& result, const at::Tensor& like) {
  const double items = result.global_weight;
  const bool cut = std::exchange(window_loss_cut_, false);
  window_metrics_ = at::Tensor();
  // On the device of this rank's losses; a rank whose window kept none (all
  // skipped, empty micro-steps, joined) takes its parameters', so that every
  // rank's tensors are on their device alike (an all-reduce of them works).
  const auto device = like.defined() ? like.device() : params_.empty() ? at::Device(at::kCPU) : params_[0].device();
  const auto on_device = [&](at::Tensor t) {
    return device.is_cpu() ? t : t.to(device, /*non_blocking=*/true);
  };
  // Metrics are sums: a window of weight 0 has them too, as in one process.
  const auto n = static_cast<int64_t>(options_.metrics().size());
  if (result.loss_sum && !cut && n > 0) {
    window_metrics_ = on_device(at::tensor(
        std::vector<double>(result.metric_sums.begin(), result.metric_sums.begin() + n),
        at::TensorOptions().dtype(at::kDouble)));
  }
  // No loss for a window of weight 0 (nothing kept anywhere) or one a
  // checkpoint cut (its first part's losses were not saved).
  if (!result.loss_sum || result.global_weight == 0 || cut) {
    window_loss_.set(at::Tensor(), items);
    return;
  }
  const bool divide = options_.reduction() != Reduction::Sum && result.global_weight > 0;
  const double value = *result.loss_sum / (divide ? result.global_weight : 1.0);
  window_loss_.set(on_device(at::scalar_tensor(value, at::TensorOptions().dtype(at::kDouble))), items);
}

void Accumulator::close_local_window_loss() {
  const double items = window_weight_;
  const bool cut = std::exchange(window_loss_cut_, false);
  const auto n = static_cast<int64_t>(options_.metrics().size());
  window_metrics_ = at::Tensor();
  if (n > 0 && !cut) {
    window_metrics_ = window_loss_sum_.defined() ? window_loss_sum_.narrow(0, 1, n).clone()
                                                 : at::zeros({n}, at::TensorOptions().dtype(at::kDouble));
  }
  if (!window_loss_sum_.defined() || window_weight_ == 0 || cut) {
    window_loss_.set(at::Tensor(), items);
    return;
  }
  const bool divide = options_.reduction() != Reduction::Sum && window_weight_ > 0;
  const auto loss = window_loss_sum_[0];
  window_loss_.set(divide ? loss / window_weight_ : loss.clone(), items);
}

void Accumulator::take_reduced_loss(const ReductionResult& result, const at::Tensor& like) noexcept {
  // A window reduced on every rank that this rank then dropped alone: its
  // loss is the one the others report (none if even that fails: the error
  // already leaving is the one to tell).
  try {
    close_window_loss(result, like);
  } catch (...) {
    forget_window_loss();
  }
}

void Accumulator::forget_window_loss() {
  // A window dropped on every rank closed with nothing applied: what a logger
  // reads next is "no loss", not the window before it's.
  window_loss_.set(at::Tensor(), 0);
  window_metrics_ = at::Tensor();
}

bool Accumulator::keep_micro_batch(const at::Tensor& value, const at::Tensor& metrics) {
  // nonfinite="skip_micro_batch": a non-finite loss is left out of the window
  // (no backward, no weight); the micro-step still counts, so that every rank
  // closes its windows together (a host read of the loss).
  const bool keep = options_.nonfinite() != NonFinite::SkipMicroBatch ||
      std::isfinite(value.detach().to(at::kDouble).item<double>());
  if (keep) {
    add_micro_loss(value, metrics); // Note [The window's loss rides in the header]
  } else {
    pending_loss_sum_ = window_loss_sum_;
    ++stats_.skipped_micro_batches;
  }
  return keep;
}

// Copies: a caller's in-place change (`l = acc.window_loss; l *= 100`) must
// not change what the Accumulator reports next (stats() included).
std::optional<at::Tensor> Accumulator::window_metrics() const {
  const auto metrics = window_metrics_.get();
  if (!metrics.defined()) {
    return std::nullopt;
  }
  return metrics.clone();
}

std::optional<at::Tensor> Accumulator::window_loss() const {
  const auto loss = window_loss_.loss();
  if (!loss.defined()) {
    return std::nullopt;
  }
  return loss.clone();
}

} // namespace gradaccum
