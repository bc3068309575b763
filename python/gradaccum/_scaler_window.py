"""The grad_scaler's part of a closed window: unscale and decide, then
update the scale once (the C++ side calls these through the Accumulator's
window callbacks)."""
from typing import Any

import torch
from torch.amp.grad_scaler import OptState


def _call(acc: Any) -> str:
    """The Accumulator's call that runs the scaler (acc.step(), acc.flush(), ...)."""
    return acc._c.running_call or "acc.step()"


def unscale_and_check(acc: Any) -> bool:
    """At a closed window: unscale the (reduced, divided) gradient and let
    the scaler's found-inf decide; every rank holds the same gradient, so
    every rank decides alike. GradScaler.update() follows once per window."""
    scaler = acc.grad_scaler
    grads = [p.grad for g in acc.optimizer.param_groups for p in g["params"]
             if p.grad is not None]
    if getattr(scaler, "_scale", 0) is None:
        # Resumed (load_state_dict sets only the initial scale) and no
        # backward() since: scale() has not made the scale tensor yet.
        first = grads[0] if grads else acc.optimizer.param_groups[0]["params"][0]
        scaler._lazy_init_scale_growth_tracker(first.device)
    state = scaler._per_optimizer_states[id(acc.optimizer)]
    failed = getattr(acc, "_scaler_update_failed", None)
    if state["stage"] is OptState.UNSCALED and failed:
        raise RuntimeError(
            f"gradaccum: {_call(acc)}: the grad_scaler's update() raised after an earlier window stepped ({failed}), "
            "leaving the scaler mid-window on this rank: it could not unscale this window, and its scale may differ "
            "from the other ranks' now, which would weigh their gradients unequally. End training here and resume "
            "from a checkpoint")
    if state["stage"] is OptState.UNSCALED:
        # torch's AMP recipe (scaler.unscale_(optimizer) before clipping) under
        # `if acc.window_ready:`: torch's own error would not say why (review).
        raise RuntimeError(
            f"gradaccum: {_call(acc)}: the grad_scaler's unscale_() was already called for this optimizer since its "
            "last update() (scaler.unscale_(optimizer) in the script?), and the Accumulator unscales each closed "
            "window itself, once, in acc.step() (or flush()/join()): leave unscale_() to it, and clip with "
            "max_grad_norm= (which clips the unscaled gradient)")
    scaler.unscale_(acc.optimizer)
    found_inf = sum(v.item() for v in state["found_inf_per_device"].values())
    if not found_inf and acc.steps > 1:
        # backward() scaled each micro-step by 1/steps as well (torch's own
        # accumulation recipe, same fp16 headroom as the big batch): undo it.
        if grads:
            torch._foreach_mul_(grads, float(acc.steps))
    if acc._gradient_hook is not None:
        acc._gradient_hook()
    return not found_inf


def update_scaler(acc: Any) -> None:
    """GradScaler.update(), once per closed window. With error feedback the
    residuals are in the units of the window's scale: the new scale's
    ratio to it goes to them, on the device (Note [Error feedback across
    loss scales])."""
    scaler = acc.grad_scaler
    before = getattr(scaler, "_scale", None)
    feedback = acc._error_feedback and before is not None
    if feedback:
        before = before.clone()  # update() changes it in place
    try:
        scaler.update()
    except Exception as error:
        # The optimizer stepped; the next window's unscale_() would blame
        # the script (review): say what happened, there and here.
        acc._scaler_update_failed = f"{type(error).__name__}: {error}"
        raise RuntimeError(
            f"gradaccum: {_call(acc)}: the grad_scaler's update() raised after the window stepped (its optimizer step "
            f"ran): {acc._scaler_update_failed}. The scaler is left mid-window and its scale may now differ between "
            "ranks: end training here and resume from a checkpoint") from error
    if feedback:
        acc._c.rescale_residuals(scaler._scale / before)
