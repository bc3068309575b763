#include <gradaccum/detail/failed_backward.h>

#include <utility>

namespace gradaccum::detail {

namespace {
thread_local std::exception_ptr kept;
} // namespace

void keep_failed_backward(std::exception_ptr error) noexcept {
  std::swap(kept, error); // (the one replaced is released as `error` goes)
}

std::exception_ptr take_failed_backward() noexcept {
  return std::exchange(kept, nullptr);
}

} // namespace gradaccum::detail
