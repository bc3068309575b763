#pragma once
// Internal (installed because an Accumulator holds two).

#include <ATen/core/Tensor.h>

#include <mutex>
#include <utility>

namespace gradaccum::detail {

/// A tensor another thread may read (window_loss(), window_metrics(),
/// stats(): not refused by Note [One thread drives an Accumulator]) while
/// the driving thread replaces it: each access under its own lock.
class SharedTensor {
 public:
  SharedTensor& operator=(at::Tensor value) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      std::swap(value_, value);
    }
    return *this; // (the old tensor is released outside the lock)
  }
  at::Tensor get() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return value_;
  }
  bool defined() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return value_.defined();
  }

 private:
  mutable std::mutex mutex_;
  at::Tensor value_;
};

} // namespace gradaccum::detail
