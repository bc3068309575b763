#pragma once
// Internal: the one-thread rule of gradaccum::Accumulator's public calls.

#include <c10/util/Exception.h>

#include <atomic>
#include <thread>

namespace gradaccum::detail {

// Note [One thread drives an Accumulator]
// An Accumulator is not thread-safe, and it cannot be made so by a lock: its
// calls are collectives, and their order is the protocol every rank follows
// (Note [Collectives pair by launch order]). Two threads calling it at once
// interleave a window's micro-steps and misalign the collectives across ranks.
// So each public call that changes the window claims the Accumulator for its
// thread; a call from another thread meanwhile is refused before it touches
// anything, so the window stays as the first call leaves it. The same thread
// may call in again (step() drops a skipped window through zero_grad()).
class CallGuard {
 public:
  /// `call`, if given, holds the outermost call's name while it runs (what
  /// the reductions it starts name in their errors).
  CallGuard(std::atomic<std::thread::id>& driver, const char* what, const char** call = nullptr)
      : driver_(driver) {
    const auto me = std::this_thread::get_id();
    std::thread::id current{};
    if (driver_.compare_exchange_strong(current, me, std::memory_order_acquire)) {
      owner_ = true;
      if (call) {
        call_ = call;
        *call_ = what;
      }
      return;
    }
    TORCH_CHECK(current == me,
        "gradaccum: ", what, ": called while another thread is inside a call on this Accumulator. "
        "An Accumulator is not thread-safe (its calls are collectives whose order every rank "
        "follows): drive it from one thread. This call was refused and changed nothing");
  }
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;
  ~CallGuard() {
    if (owner_) {
      if (call_) {
        *call_ = nullptr;
      }
      driver_.store(std::thread::id{}, std::memory_order_release);
    }
  }

 private:
  std::atomic<std::thread::id>& driver_;
  const char** call_ = nullptr;
  bool owner_ = false;
};

} // namespace gradaccum::detail
