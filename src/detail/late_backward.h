#pragma once
// Internal: a backward that reaches an Accumulator's parameters after its
// window closed and before acc.step() (Note [A backward after the window
// closed], late_backward.cpp).

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace gradaccum::detail {

/// The error of such a backward. `call` is the call that refuses it
/// ("acc.step()"; "loss.backward()" under compiled autograd, where the hooks
/// that would record it do not run), `name` the first parameter it reached.
std::string late_backward_error(const char* call, const std::string& name, bool data_parallel);

/// What the hooks record from a window's close to its step: armed then, the
/// first parameter a backward brought a gradient to. The Reducer's hooks
/// (data parallel) and LateBackwardWatch's (one process) share it.
class LateBackwardRecord {
 public:
  /// Arming (or disarming) forgets what was recorded.
  void arm(bool armed) {
    first_.store(-1);
    armed_.store(armed);
  }
  bool armed() const {
    return armed_.load(std::memory_order_relaxed);
  }
  /// From a post-hook on `param`'s gradient accumulator, while armed: records
  /// it if the backward brought a gradient. AccumulateGrad adds nothing for an
  /// undefined one or a parameter frozen since the forward, and runs its
  /// post-hooks all the same.
  void note(size_t index, const at::Tensor& param, const torch::autograd::variable_list& inputs) {
    if (!inputs.empty() && inputs[0].defined() && param.requires_grad()) {
      int64_t none = -1;
      first_.compare_exchange_strong(none, static_cast<int64_t>(index));
    }
  }
  /// While armed: the first parameter recorded, if any.
  std::optional<size_t> reached() const {
    const auto first = first_.load();
    return armed_.load() && first >= 0 ? std::optional<size_t>(static_cast<size_t>(first)) : std::nullopt;
  }

 private:
  std::atomic<bool> armed_{false};
  std::atomic<int64_t> first_{-1};
};

/// One process (no reducer, whose hooks do this data parallel): a post-hook on
/// each parameter's gradient accumulator that, while armed, records the first
/// parameter a backward reached. The hooks go with the watch.
class LateBackwardWatch {
 public:
  LateBackwardWatch(const std::vector<at::Tensor>& params, const std::vector<std::string>& names);
  /// Removes the hooks, unless a backward is running (the engine may be
  /// iterating over them): they are inert without the watch.
  ~LateBackwardWatch();
  LateBackwardWatch(const LateBackwardWatch&) = delete;
  LateBackwardWatch& operator=(const LateBackwardWatch&) = delete;

  /// Armed from a window's close to its step.
  LateBackwardRecord& record() {
    return shared_->record;
  }

  struct Shared {
    LateBackwardRecord record;
    std::vector<at::Tensor> params;
    std::vector<std::string> names;
  };

 private:
  using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));
  std::shared_ptr<Shared> shared_;
  std::vector<NodePtr> accumulators_;
  std::vector<uintptr_t> keys_;
};

} // namespace gradaccum::detail
