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
// anything, so the window stays as the first call leaves it. A call from the
// same thread while one runs (from a gradient hook inside acc.backward(), the
// optimizer or a scheduler inside acc.step(), a window callback) is refused
// too: it would change the window under the call that is building it (an
// acc.zero_grad() from a hook left a closed window holding part of a
// gradient, and stepped it). The Accumulator's own calls that end in another
// (acc.join() dropping or flushing) call its unguarded part.
class CallGuard {
 public:
  /// `driving` holds the outermost call's name while it runs (what a nested
  /// call's error names); `call`, if given, holds it too (what the reductions
  /// it starts name in their errors).
  CallGuard(std::atomic<std::thread::id>& driver, const char*& driving, const char* what,
            const char** call = nullptr)
      : driver_(driver), driving_(driving) {
    const auto me = std::this_thread::get_id();
    std::thread::id current{};
    if (driver_.compare_exchange_strong(current, me, std::memory_order_acquire)) {
      owner_ = true;
      driving_ = what;
      if (call) {
        call_ = call;
        *call_ = what;
      }
      return;
    }
    TORCH_CHECK(current != me,
        "gradaccum: ", what, ": called from inside ", driving_ ? driving_ : "another call", " on the same "
        "Accumulator (by a gradient hook, the optimizer, a scheduler or a callback that it runs). It would change "
        "the window while ", driving_ ? driving_ : "that call", " builds it: call it after that call returns. "
        "This call was refused and changed nothing");
    TORCH_CHECK(false,
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
      driving_ = nullptr;
      driver_.store(std::thread::id{}, std::memory_order_release);
    }
  }

 private:
  std::atomic<std::thread::id>& driver_;
  const char*& driving_;
  const char** call_ = nullptr;
  bool owner_ = false;
};

} // namespace gradaccum::detail
