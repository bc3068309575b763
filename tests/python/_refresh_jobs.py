"""Jobs of test_refresh.py: the trainable set changes at a window boundary
(Note [Refreshing the parameters] in src/accumulator/refresh.cpp)."""
import torch

import _dist_utils as du
from _dist_utils import job

STEPS = 3


def windows(seed, world_size, n_windows):
    return du.make_windows(seed, du.full_counts(n_windows, world_size, STEPS), 2)


def reference(seed, world_size, n_windows, unfreeze_at, reduction):
    """One process on each window's global batch; the first layer frozen
    before window `unfreeze_at`."""
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    model[0].requires_grad_(False)
    for w, window in enumerate(windows(seed, world_size, n_windows)):
        if w == unfreeze_at:
            model[0].requires_grad_(True)
        du.global_batch_loss(model, window, reduction).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return du.params(model)


@job
def unfreeze(rank, world_size, *, seed, n_windows, unfreeze_at, reduction, as_view=False, odd_rank=None):
    """The first layer frozen, unfrozen at window `unfreeze_at` and the
    Accumulator refreshed; `odd_rank` unfreezes the second layer's bias too."""
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())  # Adam skips parameters without .grad
    model[0].requires_grad_(False)
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005, gradient_as_bucket_view=as_view)
    out = {"errors": []}
    for w, window in enumerate(windows(seed, world_size, n_windows)):
        for k, batch in enumerate(window[rank]):
            if w == unfreeze_at and k == 1:
                try:
                    acc.refresh_parameters()  # mid-window: refused
                except RuntimeError as e:
                    out["errors"].append(str(e))
            loss, n = du.micro_loss(model, batch, reduction)
            acc.backward(loss, num_items=n)
            acc.step()
        if w + 1 == unfreeze_at:
            model[0].requires_grad_(True)
            if rank == odd_rank:
                model[2].bias.requires_grad_(False)
            try:
                acc.refresh_parameters()
            except (RuntimeError, ValueError) as e:
                out["errors"].append(str(e))
                break
            out["refreshed"] = acc.stats()
    out["params"] = du.params(model)
    out["stats"] = acc.stats()
    acc.close()
    return out


@job
def refused_on_one_rank(rank, world_size, *, mode):
    """Every rank calls acc.refresh_parameters() at a window boundary, but
    rank 1 refuses it by itself (`mode`: "empty": it froze every layer;
    "scaler": it unfroze a layer its optimizer lacks, with a GradScaler,
    refused in Python), or "names": rank 0 unfreezes layer 0 and rank 1
    layer 1, of the same shape, or "count": rank 1 unfreezes layer 0, or
    "raising": rank 1 passes parameters whose iteration raises a KeyError
    (review: rank 0 waited for the group's timeout), or "interrupted": a
    KeyboardInterrupt. A window is stepped first. Each rank's
    errors, parameters, and window loss and items before and after."""
    import gradaccum

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).double()
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if mode == "scaler" else None
    acc = gradaccum.Accumulator(model, opt, steps=2, grad_scaler=scaler)
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        acc.backward(model(x).pow(2).mean())
    acc.step()
    before = (float(acc.window_loss), acc.window_items)
    if rank == 1 and mode == "empty":
        model.requires_grad_(False)
    if rank == 1 and mode == "scaler":
        model[0].requires_grad_(True)
    if mode == "names":
        model[rank].requires_grad_(True)
    if mode == "count" and rank == 1:
        model[0].requires_grad_(True)
    out = {"errors": []}
    def raising():
        yield from model.parameters()
        raise KeyboardInterrupt("stopped") if mode == "interrupted" else KeyError("no such layer")

    try:
        acc.refresh_parameters(raising() if mode in ("raising", "interrupted") and rank == 1 else None)
    except BaseException as e:  # noqa
        out["errors"].append(f"{type(e).__name__}: {e}")
    out["params"] = du.params(model)
    out["loss"] = (before, (None if acc.window_loss is None else float(acc.window_loss), acc.window_items))
    acc.close()
    return out


@job
def submodules(rank, world_size):
    """Each rank refreshes to another layer of the same shape (review: named
    relative to the layer, both were "weight", "bias": no rank raised, and
    each summed the other's gradients into its own layer)."""
    import gradaccum

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
    out = {"errors": []}
    model.requires_grad_(False)
    layer = model[0] if rank == 0 else model[2]
    layer.requires_grad_(True)
    try:
        acc.refresh_parameters(layer)
    except ValueError as e:
        out["errors"].append(str(e))
    out["names"] = acc.parameter_names
    acc.close()
    return out


@job
def one_sided(rank, world_size, *, mode, options):
    """Note [A refresh pairs like a window]: after window 0, rank 0 (every
    rank but the last) unfreezes the first layer and calls
    acc.refresh_parameters() at the boundary, but the last rank does not
    ("skip": it trains on into window 1), calls it one micro-step late
    ("late": refused there, mid-window), or calls it after a plain backward
    inside acc.no_sync() ("uncounted": refused before any collective; it then
    drops those gradients with acc.zero_grad()); either way it then trains
    window 1, whose reduction meets the others' check. Each rank's errors and
    parameters then; then every rank refreshes alike and trains window 2 (so
    the job goes on): its parameters, counters and window loss."""
    import gradaccum

    model = du.mlp(5)
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005,
                                **options)
    odd = rank == world_size - 1
    data = windows(5, world_size, 3)
    out = {"errors": []}

    def train(window, late=False):
        for k, batch in enumerate(window[rank]):
            if late and k == 1:
                try:
                    acc.refresh_parameters()
                except RuntimeError as e:
                    out["errors"].append(f"late: {e}")
            loss, _ = du.micro_loss(model, batch, "mean")
            try:
                acc.backward(loss)
            except RuntimeError as e:
                out["errors"].append(f"backward: {type(e).__name__}: {e}")
                return
            acc.step()

    def residuals():
        return acc.state_dict(rank_independent=False).get("error_feedback_residuals")

    train(data[0])
    out["windows_before"] = acc.stats()["reductions"]
    out["params_before"] = du.params(model)
    before = residuals()
    if mode == "refuse" and rank == 1:  # rank 1 of 3 refuses: nothing left to train
        model.requires_grad_(False)
        try:
            acc.refresh_parameters()
        except ValueError as e:
            out["errors"].append(f"refused: {e}")
    elif odd and mode == "flush":
        try:
            acc.flush()
        except RuntimeError as e:
            out["errors"].append(f"flush: {type(e).__name__}: {e}")
    elif odd:
        if mode == "uncounted":
            with acc.no_sync():
                du.micro_loss(model, data[1][rank][0], "mean")[0].backward()
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            try:
                acc.refresh_parameters()
            except RuntimeError as e:
                out["errors"].append(f"uncounted: {e}")
            out["grads_kept"] = all((g is None and p.grad is None) or (g is not None and torch.equal(g, p.grad))
                                    for g, p in zip(grads, model.parameters()))
            out["grads_nonzero"] = sum(g is not None and bool(g.abs().sum() > 0) for g in grads)
            acc.zero_grad()
        train(data[1], late=mode == "late")
    else:
        model[0].requires_grad_(True)
        try:
            acc.refresh_parameters()
        except RuntimeError as e:
            out["errors"].append(f"refresh: {type(e).__name__}: {e}")
        after = residuals()
        if before is not None:  # error feedback: the failed check kept this rank's residuals
            out["residuals_nonzero"] = sum(bool(r.abs().sum() > 0) for r in before if r is not None)
            out["residuals_kept"] = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(before, after))
        if mode == "flush":
            acc.flush()  # the peer ended its epoch in the check: a no-op here, as the error says
    out["params_after_error"] = du.params(model)
    # Recovery: every rank at a boundary, with the old set; now all alike.
    model.requires_grad_(True)
    acc.refresh_parameters()
    train(data[2])
    out["params"] = du.params(model)
    out["stats"] = acc.stats()
    out["window_loss"] = None if acc.window_loss is None else acc.window_loss.item()
    acc.close()
    return out
