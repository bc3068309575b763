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

  /// Armed from a window's close to its step; arming again forgets the record.
  void arm(bool armed);
  /// While armed: the first parameter a backward reached since, if any.
  std::optional<size_t> reached() const;

  struct Shared {
    std::atomic<bool> armed{false};
    std::atomic<int64_t> first{-1};
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
