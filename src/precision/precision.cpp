#include "reducer/state.h"

#include <algorithm>

namespace gradaccum {

// Note [Scaling before the sum]
// With comm_dtype bf16/fp16 (Bucket::prescaled), each rank sends its gradient
// sum divided by the expected global weight E, rounded to the wire's dtype,
// so that the sum over ranks stays near the size of one gradient and fp16
// does not overflow where float32 would not. E is world * steps, or for
// reduction "items" the global weight of the last full window (no rank
// flushing; the same on every rank: it comes from the summed meta); the first
// "items" window of a run uses world * steps, so gradients far larger than
// that (many items per micro-step, fp16) can overflow there once: the window
// is then non-finite on every rank alike. Every rank must use the same E (a
// sum of differently scaled gradients would be silently wrong): it changes
// only at a reduction that every rank completed, and restore() sets it on
// every rank from the checkpoint (Progress::last_weight), so a resumed run
// scales as the uninterrupted one. write_back() multiplies by E / global weight: exactly 1 for a
// full "mean" window. Wires as wide as float32 are not scaled.
void Reducer::State::compress(Bucket& bucket) {
  // In place, no temporary: the bucket's gradients are rewritten from the
  // wire by write_back() (or cleared with a dropped window) in any case.
  at::NoGradGuard no_grad;
  const double scale = bucket.prescaled ? expected_weight : 1.0;
  if (bucket.residual.defined()) {
    // Error feedback: send what was lost last time too, and keep what is lost
    // now (unscaled: the next window's scale may differ). What overflowed or
    // was not finite is not kept: it would poison every later window.
    bucket.residual.add_(bucket.gradients).div_(scale);
    bucket.wire_gradients.copy_(bucket.residual);
    bucket.residual.sub_(bucket.wire_gradients).mul_(scale).nan_to_num_(0.0, 0.0, 0.0);
  } else {
    if (scale != 1.0) {
      bucket.gradients.div_(scale);
    }
    bucket.wire_gradients.copy_(bucket.gradients);
  }
}

void Reducer::accumulate_local() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::accumulate_local() called during a synchronising backward");
  at::NoGradGuard no_grad;
  for (auto& bucket : s.buckets) {
    if (!bucket.accumulating) {
      continue;
    }
    for (const auto slot : c10::irange(bucket.params.size())) {
      auto& grad = s.params[bucket.params[slot]].mutable_grad();
      if (grad.defined()) {
        add_widened(bucket.views[slot], grad);
        grad = at::Tensor();
        s.touched[bucket.params[slot]].store(true, std::memory_order_relaxed);
      }
    }
  }
}

std::vector<at::Tensor> Reducer::accumulated() const {
  const auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<at::Tensor> out(s.params.size());
  for (const auto& bucket : s.buckets) {
    if (!bucket.accumulating) {
      continue;
    }
    for (const auto slot : c10::irange(bucket.params.size())) {
      const auto i = bucket.params[slot];
      if (s.touched[i].load(std::memory_order_relaxed)) {
        out[i] = bucket.views[slot].clone();
      }
    }
  }
  return out;
}

bool Reducer::accumulates(size_t index) const {
  TORCH_CHECK_VALUE(index < state_->params.size(), "Reducer::accumulates: no parameter ", index);
  return state_->buckets[state_->locator[index].first].accumulating;
}

void Reducer::load_accumulated(size_t index, const at::Tensor& sum) {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::load_accumulated() called during a synchronising backward");
  TORCH_CHECK_VALUE(index < s.params.size(), "Reducer::load_accumulated: no parameter ", index);
  const auto [b, slot] = s.locator[index];
  auto& bucket = s.buckets[b];
  TORCH_CHECK_VALUE(bucket.accumulating, "Reducer::load_accumulated: ", s.name(index),
      " is not summed in a wider bucket");
  TORCH_CHECK_VALUE(sum.sizes() == s.params[index].sizes(), "Reducer::load_accumulated: ",
      s.name(index), " is ", s.params[index].sizes(), ", the sum ", sum.sizes());
  at::NoGradGuard no_grad;
  bucket.views[slot].copy_(sum);
  s.touched[index].store(true, std::memory_order_relaxed);
}

bool Reducer::accumulating() const {
  for (const auto& bucket : state_->buckets) {
    if (bucket.accumulating) {
      return true;
    }
  }
  return false;
}

bool Reducer::compressing() const {
  return std::any_of(state_->buckets.begin(), state_->buckets.end(),
                     [](const Bucket& b) { return b.compressed; });
}

std::vector<at::Tensor> Reducer::residuals() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  std::vector<at::Tensor> out(state_->params.size());
  for (const auto& bucket : state_->buckets) {
    if (!bucket.residual.defined()) {
      continue;
    }
    int64_t offset = 0;
    for (const auto slot : c10::irange(bucket.params.size())) {
      const auto& view = bucket.views[slot];
      out[bucket.params[slot]] = bucket.residual.narrow(0, offset, view.numel()).clone().view(view.sizes());
      offset += view.numel();
    }
  }
  return out;
}

void Reducer::set_residuals(const std::vector<at::Tensor>& residuals) {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::set_residuals() called during a synchronising backward");
  TORCH_CHECK_VALUE(residuals.empty() || residuals.size() == s.params.size(),
      "gradaccum: got ", residuals.size(), " error-feedback residuals for ", s.params.size(), " parameters");
  // Every entry is checked before any is written: a rejected state changes nothing.
  for (const auto& bucket : s.buckets) {
    for (const auto i : bucket.params) {
      const auto numel = s.params[i].numel();
      const auto& r = residuals.empty() ? at::Tensor() : residuals[i];
      if (r.defined()) {
        TORCH_CHECK_VALUE(bucket.residual.defined(),
            "gradaccum: the state has an error-feedback residual for ", s.name(i),
            " but this Accumulator keeps none (error_feedback=False, or no comm_dtype narrower "
            "than its gradients)");
        TORCH_CHECK_VALUE(r.numel() == numel,
            "gradaccum: the error-feedback residual of ", s.name(i), " has ", r.numel(),
            " elements, the parameter ", numel);
      }
    }
  }
  at::NoGradGuard no_grad;
  for (auto& bucket : s.buckets) {
    int64_t offset = 0;
    for (const auto slot : c10::irange(bucket.params.size())) {
      const auto i = bucket.params[slot];
      const auto numel = s.params[i].numel();
      const auto& r = residuals.empty() ? at::Tensor() : residuals[i];
      if (bucket.residual.defined()) {
        auto part = bucket.residual.narrow(0, offset, numel);
        if (r.defined()) {
          part.copy_(r.reshape(-1));
        } else {
          part.zero_();
        }
      }
      offset += numel;
    }
  }
}

void Reducer::discard_residuals() {
  auto& s = *state_;
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(!s.in_flight, "Reducer::discard_residuals() called during a synchronising backward");
  at::NoGradGuard no_grad;
  for (auto& bucket : s.buckets) {
    if (bucket.residual.defined()) {
      bucket.residual.zero_();
    }
  }
}

} // namespace gradaccum
