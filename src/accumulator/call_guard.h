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
// anything, so the window stays as the first call leaves it. (A gradient hook
// on an accelerator's tensors runs on autograd's device thread: a call from
// there is another thread's.) A call from the same thread while one runs
// (from a gradient hook inside acc.backward(), the optimizer or a scheduler
// inside acc.step(), a window callback) is refused too: it would read or
// change the window half-built (an acc.zero_grad() from a hook left a closed
// window holding part of a gradient, and stepped it). acc.state_dict() too:
// inside acc.step() the window is half-stepped (unscaled, clipped, the
// optimizer perhaps stepped), and what a resume should do with it depends on
// the framework (the Hugging Face Trainer's JIT checkpoint, saved there,
// replays the window's batches: its adapter saves the window's start). The
// Accumulator's own calls that end in another (acc.join() dropping or
// flushing) call its unguarded part.
class CallGuard {
 public:
  /// `driving` holds the outermost call's name while it runs (what the
  /// refusals name); `call`, if given, holds it too (what the reductions it
  /// starts name in their errors).
  CallGuard(std::atomic<std::thread::id>& driver, std::atomic<const char*>& driving, const char* what,
            const char** call = nullptr)
      : driver_(driver), driving_(driving) {
    const auto me = std::this_thread::get_id();
    std::thread::id current{};
    if (driver_.compare_exchange_strong(current, me, std::memory_order_acquire)) {
      owner_ = true;
      driving_.store(what, std::memory_order_relaxed);
      if (call) {
        call_ = call;
        *call_ = what;
      }
      return;
    }
    const char* outer = driving_.load(std::memory_order_relaxed);
    outer = outer ? outer : "another call";
    TORCH_CHECK(current != me,
        "gradaccum: ", what, ": called from inside ", outer, " on the same Accumulator (by a gradient hook, the "
        "optimizer, a scheduler or a callback that it runs), where the window is half-built: call it after ",
        outer, " returns. This call was refused and changed nothing");
    TORCH_CHECK(false,
        "gradaccum: ", what, ": called while another thread is inside ", outer, " on this Accumulator. "
        "An Accumulator is not thread-safe (its calls are collectives whose order every rank "
        "follows): drive it from one thread (a gradient hook on an accelerator's tensors runs on autograd's "
        "device thread: it must not call the Accumulator). This call was refused and changed nothing");
  }
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;
  ~CallGuard() {
    if (owner_) {
      if (call_) {
        *call_ = nullptr;
      }
      driving_.store(nullptr, std::memory_order_relaxed);
      driver_.store(std::thread::id{}, std::memory_order_release);
    }
  }

 private:
  std::atomic<std::thread::id>& driver_;
  std::atomic<const char*>& driving_;
  const char** call_ = nullptr;
  bool owner_ = false;
};

} // namespace gradaccum::detail
