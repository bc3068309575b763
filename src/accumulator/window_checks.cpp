// The Accumulator's checks: a micro-step that may run (its state and loss), and a
// window's gradients that are its own (nothing cleared, replaced or written
// around acc.backward() in the middle of a window).
#include <gradaccum/accumulator.h>

#include "detail/grad_version.h"
#include "detail/late_backward.h"

#include <c10/core/InferenceMode.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <unordered_set>

namespace gradaccum {

void Accumulator::check_open(const char* what) const {
  TORCH_CHECK(!closed_, "gradaccum: ", what, ": this Accumulator was closed");
}

// Note [A manual reduction in the middle of a window]
// A plain loss.backward() outside acc.no_sync() begins the manual path's
// reduction. On one rank in the middle of an acc.backward() window, it pairs
// with the other ranks' closing reduction, which drops the window on every
// rank (their kinds differ); run on every rank, it reduces the window so far
// as a manual one. Either way the others' window ended there, while this
// rank still counted micro-steps into its own: its next closing micro-step
// would pair with their next window's, and every window after it the same,
// one micro-batch apart and silently. So the next micro-step here first ends
// that window too (its gradients are the manual reduction's, or the drop
// cleared them) and starts a new one, at the others' position. Every public
// call that touches the window checks first (right after its CallGuard), and
// notes the reducer's count: only a manual reduction since this
// Accumulator's last call ends its window, whatever that call was (a
// micro-step, a failed one, acc.zero_grad(), a load, a refresh, ...). Where
// that reduction completed (the plain backward ran mid-window on every rank:
// an auxiliary loss's backward, say), its window's micro-batches were lost
// with nothing said, and the windows shifted (review); in one process the
// same script is refused (Note [Gradients no micro-step counted]). So the
// call that meets it raises, after the realignment (a failed or refused
// micro-step's drop has told already; acc.zero_grad() and a load discard the
// window anyway: those pass no call).
void Accumulator::realign_after_manual_reduction(const char* call) {
  if (!reducer_ || closed_) {
    return;
  }
  const auto manual = reducer_->manual_reductions();
  if (manual == manual_seen_) {
    return;
  }
  // A manual reduction since this Accumulator's last call was dropped: its
  // error told this rank (the first of them, which ended the window, as a rule).
  const bool told = reducer_->manual_dropped_at() > manual_seen_;
  manual_seen_ = manual;
  if ((micro_step_ == 0 && !parts_open_) || window_ready_) {
    return;
  }
  const auto done = micro_step_;
  // Told: the drop cleared this window's gradients, and what .grad holds now
  // is a later manual window's, for the script's own step (review: cleared,
  // that step stepped nothing). Else they are what the refusal drops.
  reset_window(/*clear=*/!told);
  if (told) {
    // ...but counted by no micro-step: acc.backward() meeting it refuses it
    // (Note [Gradients no micro-step counted]; review: summed in silently).
    forget_nonzero_gradients();
  }
  TORCH_CHECK(!call || told,
      "gradaccum: ", call, ": a plain loss.backward() outside acc.no_sync() ran after ", done, " of this window's ",
      options_.steps(), " micro-steps: that is the manual path's reduction, which reduced what the window held so "
      "far and ended it here, so the window's micro-batches were dropped on this rank (its gradients cleared, no "
      "optimizer step). Run every micro-batch through acc.backward() (two losses of one micro-batch: "
      "acc.backward(l1 + l2)), or take the manual path throughout (acc.no_sync() and a plain backward, stepping "
      "the optimizer yourself); this call was not run, and the next one starts a new window");
}

void Accumulator::remember_gradients() {
  remembered_ = grad_versions();
}

void Accumulator::check_gradients_untouched(const char* what, bool allow_in_place) const {
  check_gradients_untouched(what, allow_in_place, grad_versions());
  check_no_late_backward(what); // a closed window: no backward since it closed either
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
        "), by optimizer.zero_grad() or model.zero_grad() between micro-steps, by clipping or another in-place "
        "change of .grad before the window closed (clip under `if acc.window_ready:`), or by a backward "
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
// - the window's first micro-step (acc.backward(), acc.run(),
//   acc.empty_micro_step()) and, data parallel, acc.flush() and acc.join()
//   at a boundary, refuse them where they would change the window: a non-zero
//   value (uncounted_gradient()). Zeros written in place
//   (optimizer.zero_grad(set_to_none=False) at the boundary) sum to the same
//   window, and were always allowed there. One process the call raises and
//   changes nothing. Data parallel the window goes on, failed
//   (AbortReason::GradientsChanged), and its reduction drops it on every
//   rank, each told: a refusal of this rank's alone would leave the others
//   waiting in the reduction it skipped where this micro-step closes the
//   window (steps=1, a flush), and the decision reads values, which a rank
//   whose stray gradient happens to be zero reads otherwise;
// - the constructor and acc.refresh_parameters() treat non-zero gradients
//   already in .grad as written by such a backward (forget_nonzero_gradients():
//   their marks are not remembered), so the checks above see them.
// acc.zero_grad() drops them.
std::vector<size_t> Accumulator::nonzero_gradients(const std::vector<size_t>& which) const {
  // One host synchronisation per device in the common answer, none: each
  // gradient's flag stays on its device until they are stacked there.
  std::vector<size_t> sparse;
  std::vector<std::pair<at::Device, std::vector<size_t>>> by_device;
  at::NoGradGuard no_grad;
  for (const auto i : which) {
    const auto& g = params_[i].grad();
    if (!g.defined() || g.numel() == 0) {
      continue;
    }
    if (g.is_sparse()) {
      if (g._nnz() > 0) {
        sparse.push_back(i);
      }
      continue;
    }
    auto it = std::find_if(by_device.begin(), by_device.end(), [&](const auto& e) { return e.first == g.device(); });
    if (it == by_device.end()) {
      by_device.emplace_back(g.device(), std::vector<size_t>{});
      it = std::prev(by_device.end());
    }
    it->second.push_back(i);
  }
  std::vector<size_t> out = sparse;
  for (const auto& [device, indices] : by_device) {
    std::vector<at::Tensor> flags;
    for (const auto i : indices) {
      flags.push_back(params_[i].grad().ne(0).any()); // NaN != 0: counted too
    }
    const auto stacked = at::stack(flags).cpu();
    if (!stacked.any().item<bool>()) {
      continue;
    }
    const auto* f = stacked.const_data_ptr<bool>();
    for (const auto k : c10::irange(indices.size())) {
      if (f[k]) {
        out.push_back(indices[k]);
      }
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<size_t> Accumulator::uncounted_gradient(const std::vector<GradMark>& now) const {
  std::vector<size_t> changed;
  for (const auto i : c10::irange(params_.size())) {
    if (now[i] != remembered_[i]) {
      changed.push_back(i);
    }
  }
  const auto nonzero = changed.empty() ? std::vector<size_t>{} : nonzero_gradients(changed);
  return nonzero.empty() ? std::nullopt : std::optional<size_t>(nonzero.front());
}

void Accumulator::forget_nonzero_gradients() {
  std::vector<size_t> all(params_.size());
  std::iota(all.begin(), all.end(), size_t{0});
  for (const auto i : nonzero_gradients(all)) {
    remembered_[i] = GradMark{};
  }
}

bool Accumulator::refuse_uncounted_gradients(const char* what, const std::vector<GradMark>& now) {
  if (now == remembered_ || window_failed_) {
    return false;
  }
  const auto i = uncounted_gradient(now);
  if (!i) {
    return false;
  }
  if (reducer_) {
    fail_for_changed_gradients(now, /*uncounted=*/true);
    return true;
  }
  TORCH_CHECK(false,
      "gradaccum: ", what, ": the gradient of ", names_[*i], " was written since the last window (or before "
      "the Accumulator was built), but no micro-step counted it: a plain loss.backward() instead of "
      "acc.backward(loss)? A window would sum it in. Call acc.backward(loss) on each micro-batch: it counts "
      "the micro-step and synchronises the window's last one. (A plain loss.backward(), inside acc.no_sync() "
      "for all but the last micro-batch, is the manual path, where you step the optimizer and clear the "
      "gradients yourself.) Nothing was changed: drop these gradients with acc.zero_grad()");
}

void Accumulator::fail_for_changed_gradients(const std::vector<GradMark>& now, bool uncounted) {
  window_failed_ = true;
  window_failure_ = AbortReason::GradientsChanged;
  if (reducer_) {
    reducer_->mark_window_failed(window_failure_); // (should a plain backward close it)
  }
  std::optional<size_t> which = uncounted ? uncounted_gradient(now) : std::nullopt;
  for (size_t i = 0; !which && i < params_.size(); ++i) {
    if (now[i] != remembered_[i]) {
      which = i;
    }
  }
  const std::string name = which ? names_[*which] : std::string("a parameter");
  failure_detail_ = uncounted
      ? "on this rank the gradient of " + name + " was written before the window's first micro-step (or before "
            "the Accumulator was built), and no micro-step counted it: a plain loss.backward() at the window "
            "boundary, or a .grad left from before?"
      : "on this rank the gradient of " + name + " was " + (which && !now[*which].impl ? "cleared" : "changed") +
            " in the middle of the window";
}

std::string Accumulator::with_failure_detail(const std::string& error, const std::string& detail) const {
  return detail.empty() ? error : error + " (" + detail + ")";
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
               : step ? ": there, call optimizer.step() and optimizer.zero_grad() instead of acc.step()"
                      : ", and refresh after that step, once the gradients are cleared",
        ".) Nothing was changed: drop these gradients with acc.zero_grad(). (Gradients converted by "
        "model.to(dtype), or zeroed in place, count as written too, e.g. by optimizer.zero_grad(set_to_none=False)",
        step ? " with gradient_as_bucket_view" : "", ": clear them to None instead.)");
  }
}

// Note [Parameters only the optimizer steps]
// A parameter the optimizer steps that the Accumulator does not hold (a head
// outside the module it was built over, a layer added with add_param_group
// since) gets every micro-step's gradient summed into `.grad`, and nothing
// divides it by the window's weight, reduces it over ranks or clears it: the
// optimizer steps it with K times the window's gradient, then 2K, ..., and
// data parallel each rank with its own, silently. So the optimizer's
// parameters are checked when the Accumulator is built (a refusal there is
// told to the other ranks) and before each optimizer step (after a refresh,
// against the new set): each one that requires grad and has a gradient must
// be one of the model's, trainable or frozen when the Accumulator was built
// (unfreezing one has its own check). One without a gradient is let be: the
// optimizer skips it (the old head of a model whose head was replaced and
// refreshed, still in param_groups; torch has no call that removes it). A
// step refused on some ranks only (a parameter used on some ranks only) is
// told to every rank by the next reduction once acc.zero_grad() drops the
// window (Note [A window not stepped on some ranks]). It costs a pass over
// the optimizer's list per window. Optimizers given as a step function alone
// (C++) are not checked.
void Accumulator::check_optimizer_parameters(const char* what) const {
  if (!optimizer_parameters_) {
    return;
  }
  const auto optimized = optimizer_parameters_();
  std::unordered_set<const c10::TensorImpl*> known;
  known.reserve(params_.size() + frozen_.size());
  for (const auto& p : params_) {
    known.insert(p.unsafeGetTensorImpl());
  }
  for (const auto& entry : frozen_) {
    known.insert(entry.second.unsafeGetTensorImpl());
  }
  const bool building = std::strcmp(what, "Accumulator()") == 0;
  // (An optimizer built over another model, say the one a resume replaced:
  // every step would move parameters no window reaches, and train nothing;
  // review. At construction only: refresh_parameters() may follow.)
  TORCH_CHECK_VALUE(!building || optimized.empty() || params_.empty() ||
          std::any_of(optimized.begin(), optimized.end(),
                      [&](const at::Tensor& p) { return p.defined() && known.count(p.unsafeGetTensorImpl()); }),
      "gradaccum: ", what, ": the optimizer steps none of the model's parameters (its param_groups hold ",
      optimized.size(), ", none of them the model's): every acc.step() would step parameters that no window's "
      "gradient reaches, and the model would not train. Build the optimizer over this model's parameters (a model "
      "rebuilt, say for a resume, needs its optimizer rebuilt too)");
  for (const auto i : c10::irange(optimized.size())) {
    const auto& p = optimized[i];
    if (!p.defined() || !p.requires_grad() || !p.grad().defined() || known.count(p.unsafeGetTensorImpl())) {
      continue;
    }
    TORCH_CHECK_VALUE(false,
        "gradaccum: ", what, ": the optimizer steps a parameter that is not the model's and has a gradient (its "
        "parameter ", i, " counting through param_groups, of shape ", p.sizes(), "): nothing would divide that "
        "gradient by the window's weight, reduce it over ranks or clear it, so it would be stepped with every "
        "micro-step's gradient summed, window after window. Build the Accumulator over a module that holds every "
        "parameter the optimizer steps (Python: torch.nn.ModuleList([model, head])); for a layer added to the "
        "model, call acc.refresh_parameters() at a window boundary",
        building ? "" : ". Nothing was stepped: acc.zero_grad() drops this window");
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
  if (micro_step_ == 0 && !parts_open_ && !window_ready_) {
    refuse_uncounted_gradients(what, before); // Note [Gradients no micro-step counted]
  }
  if ((micro_step_ > 0 || parts_open_) && !window_failed_) {
    if (reducer_) {
      // Data parallel, the window must still close on every rank together:
      // it is dropped on every rank then, each naming this rank's mistake.
      if (before != remembered_) {
        fail_for_changed_gradients(before, /*uncounted=*/false);
      }
    } else {
      check_gradients_untouched(what, /*allow_in_place=*/false, before);
    }
  }
  if (epoch_ended_) {
    fail_after_peers_ended_epoch();
  }
}

void Accumulator::set_window_ready(bool ready) {
  window_ready_ = ready;
  window_closed_by_flush_ = false; // (reduce_partial_window() sets it after)
  if (reducer_) {
    reducer_->hold_closed_window(ready);
  } else if (late_watch_) {
    late_watch_->record().arm(ready);
  }
}

void Accumulator::check_no_late_backward(const char* what) const {
  if (!window_ready_) {
    return;
  }
  // Note [A backward after the window closed] (src/detail/late_backward.cpp)
  const auto reached = reducer_ ? reducer_->reached_while_held()
      : late_watch_ ? late_watch_->record().reached() : std::nullopt;
  TORCH_CHECK(!reached, detail::late_backward_error(what, names_[*reached], reducer_ != nullptr));
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
                   detail::grad_version(g)}
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

void Accumulator::check_micro_step_state(const char* what) const {
  check_open(what);
  TORCH_CHECK(!window_ready_ || !window_closed_by_flush_ || window_raised_nonfinite_,
      "gradaccum: ", what, ": the epoch's end (acc.flush(), or acc.join()'s last reduction) closed the window, and "
      "its step raised; call acc.flush() (or acc.join(), or acc.step()) again to step it, with no collective "
      "(or acc.zero_grad() to drop it) before the next micro-step");
  TORCH_CHECK(!window_ready_ || !window_closed_by_flush_,
      "gradaccum: ", what, ": the epoch's end (acc.flush(), or acc.join()'s last reduction) closed the window, and "
      "its gradient is not finite (nonfinite=\"raise\"); call acc.zero_grad() to drop it before the next "
      "micro-step");
  TORCH_CHECK(!window_ready_,
      "gradaccum: ", what, ": the window closed at the previous micro-step (acc.backward() or acc.run(), or "
      "in the state acc.load_state_dict() loaded); ",
      reducer_ ? "call acc.step() before the next micro-step, then run this micro-batch again (it was not "
                 "counted): ranks that stepped their window wait for this one in their next reduction (until the "
                 "group's timeout), and acc.zero_grad() would drop the window here, so that this replica would "
                 "differ from those of the ranks that stepped it"
               : "call acc.step() (or acc.zero_grad() to drop it) before the next micro-step: this micro-batch was "
                 "not counted");
  check_training_not_ended(what, /*flushing=*/false);
}

void Accumulator::check_training_not_ended(const char* what, bool flushing) const {
  // The error of fail_after_peers_ended_epoch() ended this rank's epoch with
  // the others': a micro-step now would open a window that pairs with their
  // next epoch's reductions, one window out of step (a loop that catches
  // each error and goes on). Its acc.flush() (or acc.join()) ends the epoch.
  TORCH_CHECK(flushing || !(epoch_ended_raised_ && micro_step_ == 0 && !parts_open_),
      "gradaccum: ", what, ": this rank's epoch ended with the other ranks' acc.flush() (the error raised "
      "before: this rank went on training after they ended the epoch); call acc.flush() (it steps nothing and "
      "runs no collective) or leave acc.join() before the next epoch's first micro-batch. Nothing was changed");
  TORCH_CHECK(!told_to_end_training(),
      "gradaccum: ", what, ": the last reduction dropped its window on every rank and told every rank to end "
      "training there (ranks were shadowing in acc.join(), one left its block with an exception, or one was "
      "interrupted): end training on this rank too; inside acc.join(), let that error leave its block (C++: "
      "call acc.join(), which returns at once). Nothing was changed");
}

void Accumulator::check_no_inference_grads(const char* what, const std::vector<GradMark>& marks) const {
  // `marks`: grad_versions(), which the micro-step takes anyway. A .grad the
  // script made inside inference_mode() takes no backward's sum nor the
  // reduction's write-back: refused here, before the window is reduced, not
  // on this rank alone after it (review).
  for (const auto i : c10::irange(marks.size())) {
    TORCH_CHECK(marks[i].version != detail::kInferenceGradVersion, "gradaccum: ", what, ": ", names_[i], "'s .grad "
        "is an inference tensor (made inside torch.inference_mode()), which no backward or reduction can write; "
        "set it to None outside inference_mode (or call acc.zero_grad())");
  }
}

double Accumulator::check_micro_step(
    const at::Tensor& loss, std::optional<double> num_items, const char* what) const {
  check_micro_step_state(what);
  TORCH_CHECK_VALUE(loss.defined(), "gradaccum: ", what, ": loss is undefined");
  // (Backward of a complex loss fails in autograd, after the micro-step began.)
  TORCH_CHECK_TYPE(at::isFloatingType(loss.scalar_type()),
      "gradaccum: ", what, ": loss must be a real floating-point tensor, got ", loss.scalar_type());
  TORCH_CHECK_VALUE(loss.numel() == 1,
      "gradaccum: ", what, ": loss must be a scalar, got a tensor of shape ", loss.sizes());
  TORCH_CHECK_VALUE(!loss.is_meta(),
      "gradaccum: ", what, ": loss is on the meta device: it holds no value (a model built on the meta device and "
      "never materialized?)");
  TORCH_CHECK_VALUE(loss.requires_grad(),
      "gradaccum: ", what, ": loss does not require grad (computed under no_grad or inference_mode, or from "
      "no trainable parameter?)");
  // (Its backward would make every new .grad an inference tensor, which no
  // later backward can add to: review.)
  TORCH_CHECK(!c10::InferenceMode::is_enabled(), "gradaccum: ", what, ": called inside torch.inference_mode(), "
      "where backward would make .grad inference tensors that no later backward can add to; run the micro-step "
      "outside it (an evaluation inside it between micro-steps is fine)");
  double weight = 1.0;
  if (options_.reduction() == Reduction::Items) {
    TORCH_CHECK_VALUE(num_items.has_value(),
        "gradaccum: ", what, ": num_items is required with reduction='items'");
    // 0: a micro-batch with no valid item (all prompt); its loss carries no
    // gradient, and a window with no items on any rank steps nothing.
    TORCH_CHECK_VALUE(std::isfinite(*num_items) && *num_items >= 0,
        "gradaccum: ", what, ": num_items must be a number >= 0, got ", *num_items);
    weight = *num_items;
  } else {
    TORCH_CHECK_VALUE(!num_items.has_value(),
        "gradaccum: ", what, ": num_items is only used with reduction='items' (reduction is '",
        to_string(options_.reduction()), "')");
  }
  check_requires_grad(what);
  return weight;
}

} // namespace gradaccum
