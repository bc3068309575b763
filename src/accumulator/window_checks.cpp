// The Accumulator's checks that a window's gradients are its own: nothing
// cleared, replaced or written around acc.backward() in the middle of a window.
#include <gradaccum/accumulator.h>

#include <c10/util/irange.h>

namespace gradaccum {

void Accumulator::check_open(const char* what) const {
  TORCH_CHECK(!closed_, "gradaccum: ", what, ": this Accumulator was closed");
}

void Accumulator::remember_gradients() {
  remembered_ = grad_versions();
}

void Accumulator::check_gradients_untouched(const char* what, bool allow_in_place) const {
  check_gradients_untouched(what, allow_in_place, grad_versions());
}

void Accumulator::check_gradients_untouched(
    const char* what, bool allow_in_place, const std::vector<GradMark>& now) const {
  for (const auto i : c10::irange(params_.size())) {
    // New storage for the same tensor (`.grad.data = t`) is a change in place.
    const bool replaced = now[i].impl != remembered_[i].impl;
    const bool changed = replaced || now[i] != remembered_[i];
    TORCH_CHECK(allow_in_place ? !replaced : !changed,
        "gradaccum: ", what, ": the gradient of ", names_[i], " was ", now[i].impl ? "changed" : "cleared",
        " outside the Accumulator in the middle of a window (", micro_step_, " of ",
        options_.steps(), " micro-steps done", window_ready_ ? ", window closed" : "",
        "), by optimizer.zero_grad() or model.zero_grad() between micro-steps, or by a backward "
        "that was not acc.backward() (another loss's backward through these parameters, e.g. a "
        "GAN's generator step that does not freeze the discriminator)? Clear "
        "gradients only after acc.step() returns True (acc.step() clears them itself), or call "
        "acc.zero_grad() to drop the window");
  }
}

// Note [Gradients no micro-step counted]
// A window's gradients are the sums of its counted micro-steps. A backward
// that was not acc.backward() (a plain loss.backward(), a sanity check before
// the Accumulator was built, a stray backward inside acc.no_sync()) writes
// .grad without a count; in the middle of a window the gradient check tells
// (check_window_gradients()), and at a boundary:
// - acc.step(), acc.state_dict() and acc.refresh_parameters() refuse them
//   (check_no_uncounted_backward(): by marks, never values);
// - the window's first acc.backward() refuses them where they would change
//   the window, a non-zero value (check_no_uncounted_gradients()): zeros
//   written in place (optimizer.zero_grad(set_to_none=False) at the boundary)
//   sum to the same window, and were always allowed there;
// - the constructor treats non-zero gradients already in .grad as written by
//   such a backward (their marks are not remembered), so the two checks above
//   see them.
// Refused, nothing changes: acc.zero_grad() drops them. Data parallel the
// refusal is this rank's alone, before any collective, as any refused call's.
bool Accumulator::has_nonzero_gradient(size_t i) const {
  const auto& g = params_[i].grad();
  if (!g.defined()) {
    return false;
  }
  if (g.is_sparse()) {
    return g._nnz() > 0;
  }
  at::NoGradGuard no_grad;
  return g.numel() > 0 && g.ne(0).any().item<bool>(); // NaN != 0: refused too
}

void Accumulator::check_no_uncounted_gradients(const char* what, const std::vector<GradMark>& now) const {
  for (const auto i : c10::irange(params_.size())) {
    if (now[i] == remembered_[i] || !has_nonzero_gradient(i)) {
      continue;
    }
    TORCH_CHECK(false,
        "gradaccum: ", what, ": the gradient of ", names_[i], " was written since the last window (or before "
        "the Accumulator was built), but no micro-step counted it: a plain loss.backward() instead of "
        "acc.backward(loss)? This window would sum it in. Call acc.backward(loss) on each micro-batch: it counts "
        "the micro-step and synchronises the window's last one. (A plain loss.backward(), inside acc.no_sync() "
        "for all but the last micro-batch, is the manual path, where you step the optimizer and clear the "
        "gradients yourself.) Nothing was changed: drop these gradients with acc.zero_grad()");
  }
}

void Accumulator::check_no_uncounted_backward(const char* what) const {
  // At micro-step 0 the gradients are as the last window (or reset) left them;
  // different ones came from a backward this Accumulator did not count. The
  // window would never close: step() would return false for good, silently,
  // state_dict() would save a boundary without them, and
  // refresh_parameters()'s check would drop them (Note [A refresh pairs like
  // a window]). A gradient cleared to None is no backward:
  // optimizer.zero_grad() at a window boundary is allowed, and with bucket
  // views the last window left zeroed views in .grad, which it drops. The
  // decision reads marks, never values: it is the same on every rank that ran
  // the same calls (a backward whose gradient happens to be zero on one rank
  // only still counts there).
  const std::string call = what;
  const bool step = call == "acc.step()";
  const bool saving = call == "acc.state_dict()";
  const auto now = grad_versions();
  for (const auto i : c10::irange(params_.size())) {
    TORCH_CHECK(now[i] == remembered_[i] || !now[i].impl,
        "gradaccum: ", what, ": gradients were written since the last window, but no micro-step was "
        "counted: a plain loss.backward() instead of acc.backward(loss)? ",
        saving ? "A checkpoint now would save a window boundary without them. " : "",
        step ? "" : saving ? "" : "A refresh now would drop them. ",
        "Call acc.backward(loss) on "
        "each micro-batch: it counts the micro-step and synchronises the window's last one, and "
        "acc.step() then steps once per window. (A plain loss.backward(), inside acc.no_sync() for "
        "all but the last micro-batch, is the manual path, where you step the optimizer yourself",
        saving ? ", and save after that step, once the gradients are cleared"
               : step ? "" : ", and refresh after that step, once the gradients are cleared",
        ".) Nothing was changed: drop these gradients with acc.zero_grad(). (Gradients zeroed in place "
        "count as written too, e.g. by optimizer.zero_grad(set_to_none=False)",
        step ? " with gradient_as_bucket_view" : "", ": clear them to None instead.)");
  }
}

void Accumulator::check_requires_grad(const char* what) const {
  for (const auto& [name, p] : frozen_) {
    TORCH_CHECK(!p.requires_grad(),
        "gradaccum: ", what, ": ", name, " was frozen (requires_grad=False) when the Accumulator was "
        "built and now requires grad: its gradient would be neither scaled, reduced nor "
        "cleared. Call acc.refresh_parameters() at a window boundary after changing requires_grad");
  }
}

void Accumulator::check_window_gradients(const char* what, const std::vector<GradMark>& before) {
  if (micro_step_ == 0 && !parts_open_ && !window_ready_ && before != remembered_) {
    check_no_uncounted_gradients(what, before); // Note [Gradients no micro-step counted]
  }
  if ((micro_step_ > 0 || parts_open_) && !window_failed_) {
    if (reducer_) {
      // Data parallel, the window must still close on every rank together:
      // it is dropped on every rank then, each naming this rank's mistake.
      if (before != remembered_) {
        window_failed_ = true;
        window_failure_ = AbortReason::GradientsChanged;
      }
    } else {
      check_gradients_untouched(what, /*allow_in_place=*/false, before);
    }
  }
  epoch_ended_raised_ = false; // a micro-step after that error: a new epoch, its flush() pairs again
  if (epoch_ended_) {
    fail_after_peers_ended_epoch();
  }
}

std::vector<GradMark> Accumulator::grad_versions() const {
  // Accumulating into .grad either bumps its version (in place) or replaces it.
  std::vector<GradMark> versions;
  versions.reserve(params_.size());
  for (const auto& p : params_) {
    const auto& g = p.grad();
    versions.push_back(g.defined()
        // unsafe_storage(): sparse and opaque tensors have none (nullptr), and never throw.
        ? GradMark{g.unsafeGetTensorImpl(), g.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl(),
                   g._version()}
        : GradMark{});
  }
  return versions;
}

bool Accumulator::closes_window_next() const {
  return !window_ready_ && micro_step_ + 1 == options_.steps();
}

// As Accelerate's: through the closing micro-step, until step().
bool Accumulator::sync_gradients() const {
  return window_ready_ || closes_window_next();
}

void Accumulator::note_hookless_backward(uint64_t hooks_before, const std::vector<GradMark>& before) {
  if (!reducer_ || reducer_->hook_calls() != hooks_before) {
    return;
  }
  const auto after = grad_versions();
  std::vector<size_t> changed;
  for (const auto i : c10::irange(after.size())) {
    if (after[i] != before[i]) {
      changed.push_back(i);
    }
  }
  reducer_->mark_restored(changed);
}

} // namespace gradaccum
