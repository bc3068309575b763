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

/// The last closed window's loss and its items (its weight summed over
/// ranks), set and read together: a logger thread's stats() never pairs one
/// window's loss with another's items (review).
class SharedLoss {
 public:
  void set(at::Tensor loss, double items) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      std::swap(loss_, loss);
      items_ = items;
    }
  }
  std::pair<at::Tensor, double> get() const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return {loss_, items_};
  }
  at::Tensor loss() const {
    return get().first;
  }
  double items() const {
    return get().second;
  }

 private:
  mutable std::mutex mutex_;
  at::Tensor loss_;
  double items_ = 0;
};

} // namespace gradaccum::detail
