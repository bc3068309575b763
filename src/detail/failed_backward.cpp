#include <gradaccum/detail/failed_backward.h>

#include <atomic>
#include <utility>

namespace gradaccum::detail {

namespace {
thread_local KeptFailure kept;
std::atomic<ErrorInspector> inspector{nullptr};
} // namespace

void keep_failed_backward(std::exception_ptr error, bool raise_original) noexcept {
  KeptFailure failure{std::move(error), raise_original};
  std::swap(kept, failure); // (the one replaced is released as `failure` goes)
}

KeptFailure take_failed_backward() noexcept {
  return std::exchange(kept, KeptFailure{});
}

void set_error_inspector(ErrorInspector fn) noexcept {
  inspector.store(fn);
}

ErrorFacts inspect_error(const std::exception_ptr& error) noexcept {
  const auto fn = inspector.load();
  if (fn == nullptr || !error) {
    return {};
  }
  try {
    return fn(error);
  } catch (...) {
    return {};
  }
}

std::string named_message(const std::string& message, const ErrorFacts& facts) {
  return (message.empty() || message == "python_error") && !facts.type.empty() ? facts.type : message;
}

} // namespace gradaccum::detail
