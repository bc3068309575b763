// The Reducer's calls on its wider sums (accumulate_dtype) and its
// error-feedback residuals (comm_dtype with error_feedback): what
// acc.backward(), checkpoints and the loss scaler read and write. The
// arithmetic itself is src/precision/.

#include "reducer/state.h"

#include "precision/precision.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace gradaccum {

void Reducer::accumulate_local() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.backward()");
  for (auto& bucket : s.buckets.all) {
    if (bucket.accumulating) {
      detail::accumulate_grads(bucket, s.config.params, s.touched.get());
    }
  }
}

std::vector<at::Tensor> Reducer::accumulated() const {
  const auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  return detail::accumulated_sums(s.buckets.all, s.config.params.size(), s.touched.get());
}

bool Reducer::accumulates(size_t index) const {
  TORCH_CHECK_VALUE(index < state_->config.params.size(), "gradaccum: Reducer::accumulates(): no parameter ", index);
  return state_->buckets.of(index).accumulating;
}

void Reducer::load_accumulated(size_t index, const at::Tensor& sum) {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.load_state_dict()");
  TORCH_CHECK_VALUE(index < s.config.params.size(), "gradaccum: Reducer::load_accumulated(): no parameter ", index);
  const auto [b, slot] = s.buckets.locator[index];
  auto& bucket = s.buckets.all[b];
  TORCH_CHECK_VALUE(bucket.accumulating, "gradaccum: acc.load_state_dict(): the state has a wide sum for ",
      s.config.name(index), ", which this Accumulator does not sum in a wider bucket");
  detail::load_wide_sum(bucket, slot, sum, s.config.name(index), s.config.params[index].sizes());
  s.touched[index].store(true, std::memory_order_relaxed);
}

bool Reducer::accumulating() const {
  return state_->buckets.any(&Bucket::accumulating);
}

bool Reducer::compressing() const {
  return state_->buckets.any(&Bucket::compressed);
}

std::vector<at::Tensor> Reducer::residuals() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto out = detail::residuals(state_->buckets.all, state_->config.params.size());
  if (const auto& rescale = state_->window.residual_rescale; rescale.defined()) {
    at::NoGradGuard no_grad;
    for (auto& r : out) {
      if (r.defined()) {
        r.mul_(rescale); // (a copy: Note [Error feedback across loss scales])
      }
    }
  }
  return out;
}

void Reducer::set_residuals(const std::vector<at::Tensor>& residuals) {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.load_state_dict()");
  detail::set_residuals(s.buckets.all, s.config, residuals);
  s.window.residual_rescale = at::Tensor();
}

void Reducer::discard_residuals() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.zero_grad()");
  detail::discard_residuals(s.buckets.all);
  s.window.residual_rescale = at::Tensor();
}

void Reducer::rescale_residuals(const at::Tensor& ratio) {
  TORCH_INTERNAL_ASSERT(ratio.defined() && ratio.numel() == 1, "gradaccum: rescale_residuals(): not one ratio");
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.check_idle("acc.rescale_residuals()");
  const auto kept = std::find_if(s.buckets.all.begin(), s.buckets.all.end(),
                                 [](const Bucket& b) { return b.residual.defined(); });
  if (kept == s.buckets.all.end()) {
    return;
  }
  at::NoGradGuard no_grad;
  // A 0-dim tensor on the residuals' device (or a CPU scalar, which any
  // device takes), detached from the scaler's own, which it updates in place.
  auto r = ratio.detach().reshape({});
  r = r.device() == kept->residual.device() || r.is_cpu() ? r.clone() : r.to(kept->residual.device());
  auto& pending = s.window.residual_rescale;
  pending = pending.defined() ? pending * r : r;
}

} // namespace gradaccum
