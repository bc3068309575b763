"""Jobs of test_rebuild.py: buckets rebuilt in backward's order after the first
window (Note [Rebuilding buckets in ready order] in src/reducer.cpp), on real
Gloo ranks (spawned by _dist_utils.run_job with module="_rebuild_jobs").
"""
import torch
import torch.nn as nn

import _dist_utils as du
from _dist_utils import job

STEPS = 2
MICRO = 2
# About one layer per bucket: 12x12 float64 weights are 1152 bytes.
CAPS = dict(bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)


class Reversed(nn.Module):
    """Modules registered in the reverse of the order forward uses them, so
    backward makes the gradients ready in registration order: the opposite of
    the reducer's first guess (reverse registration order). `swap` runs the two
    middle layers the other way round (another ready order, same shapes)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(du.D_HID, du.D_OUT)
        self.mid = nn.Linear(du.D_HID, du.D_HID)
        self.body = nn.Linear(du.D_HID, du.D_HID)
        self.stem = nn.Linear(du.D_IN, du.D_HID)

    def forward(self, x, swap=False):
        h = torch.tanh(self.stem(x))
        first, second = (self.mid, self.body) if swap else (self.body, self.mid)
        return self.head(torch.tanh(second(torch.tanh(first(h)))))


def reversed_model(seed, dtype=torch.float64):
    torch.manual_seed(seed)
    return Reversed().to(dtype)


def swaps(rank, swap_rank):
    return rank == swap_rank


def loss_of(model, batch, swap):
    x, y, _ = batch
    return (model(x, swap) - y).pow(2).mean()


def reference(seed, world_size, n_windows, swap_rank, opt_name="adam", skip=(), partial=None):
    """One process in float64: each window's loss is the mean of every rank's
    micro-batch losses (each rank with its own forward); windows in `skip` are
    dropped; `partial` = (window, count) makes that window hold `count`
    micro-batches per rank (a flush)."""
    counts = du.full_counts(n_windows, world_size, STEPS)
    if partial:
        counts[partial[0]] = [partial[1]] * world_size
    windows = du.make_windows(seed, counts, MICRO)
    model = reversed_model(seed)
    opt = du.make_optimizer(opt_name, model.parameters())
    window_grads = []
    for w, window in enumerate(windows):
        if w in skip:
            continue
        losses = [loss_of(model, b, swaps(r, swap_rank)) for r in range(world_size) for b in window[r]]
        (sum(losses) / len(losses)).backward()
        window_grads.append(du.grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": window_grads, "params": du.params(model)}


@job
def follows_backward(rank, world_size, *, seed, n_windows, swap_rank, variants):
    """Per variant: the layout and counters at each window's end, the window
    gradients and the final parameters."""
    import gradaccum

    windows = du.make_windows(seed, du.full_counts(n_windows, world_size, STEPS), MICRO)
    out = {}
    for key, options in variants.items():
        options = dict(options)
        dtype = getattr(torch, options.pop("dtype", "float64"))
        model = reversed_model(seed, dtype)
        opt = du.make_optimizer("adam", model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=STEPS, **{**CAPS, **options})
        record = {"initial": [list(b) for b in acc.bucket_indices], "windows": [], "grads": []}
        for window in windows:
            for batch in window[rank]:
                x, y, mask = batch
                acc.backward(loss_of(model, (x.to(dtype), y.to(dtype), mask), swaps(rank, swap_rank)))
                if acc.window_ready:
                    stats = acc.stats()
                    record["windows"].append({
                        "layout": [list(b) for b in acc.bucket_indices],
                        "launched": stats["last_window_launched_in_backward"],
                        "rebuilds": stats["bucket_rebuilds"],
                        "buckets": stats["buckets"],
                        "collectives": stats["last_window_collectives"],
                    })
                    record["grads"].append(du.grads(model))
                    record["views"] = du._bucket_view_report(model, acc)
                acc.step()
        record["params"] = du.params(model)
        record["stats"] = acc.stats()
        out[key] = record
    return out


@job
def first_window_not_reduced(rank, world_size, *, seed, case):
    """The rebuild waits for a window reduced on every rank with hooks seen on
    rank 0: a first window dropped (rank 1's backward raises) or closed by a
    flush() after no_sync micro-steps only does not rebuild; the next does."""
    import gradaccum

    n_windows = 3
    counts = du.full_counts(n_windows, world_size, STEPS)
    if case == "flush":
        counts[0] = [1] * world_size
    windows = du.make_windows(seed, counts, MICRO)
    model = reversed_model(seed)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, **CAPS)
    fail = {"arm": False}

    def hook(grad):
        if fail["arm"]:
            raise RuntimeError("injected failure")
        return grad

    model.mid.weight.register_hook(hook)
    after, errors = [], []
    for w, window in enumerate(windows):
        for k, batch in enumerate(window[rank]):
            fail["arm"] = case == "dropped" and rank == 1 and w == 0 and k == STEPS - 1
            try:
                acc.backward(loss_of(model, batch, False))
                acc.step()
            except RuntimeError as e:
                errors.append(str(e))
            fail["arm"] = False
        if case == "flush" and w == 0:
            acc.flush()
        after.append({"layout": [list(b) for b in acc.bucket_indices],
                      "rebuilds": acc.stats()["bucket_rebuilds"]})
    return {"after": after, "errors": errors, "params": du.params(model), "stats": acc.stats()}


@job
def resume(rank, world_size, *, seed, n_windows, save_at):
    """Uninterrupted run vs a run saved mid-window after the rebuild (a
    collective) and resumed in a fresh Accumulator, which has not rebuilt yet
    and rebuilds after its first window, on every rank alike."""
    import gradaccum

    windows = du.make_windows(seed, du.full_counts(n_windows, world_size, STEPS), MICRO)
    batches = [b for window in windows for b in window[rank]]

    def run(model, acc, part):
        for batch in part:
            acc.backward(loss_of(model, batch, False))
            acc.step()

    model = reversed_model(seed)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=STEPS, **CAPS)
    run(model, acc, batches)
    straight = du.params(model)

    model = reversed_model(seed)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, **CAPS)
    run(model, acc, batches[:save_at])
    last = ("last_window_collectives", "last_window_bytes", "last_window_launched_in_backward")
    before = acc.stats()
    saved = acc.state_dict()  # rank 0's is loaded everywhere (a snapshot: a collective per bucket)
    after = acc.stats()
    snapshot = {"last_before": [before[k] for k in last], "last_after": [after[k] for k in last],
                "collectives": after["collectives"] - before["collectives"], "buckets": after["buckets"]}
    saved_layout = [list(b) for b in acc.bucket_indices]
    model_state, opt_state = model.state_dict(), opt.state_dict()
    acc.close()
    obj = [saved if rank == 0 else None]
    import torch.distributed as dist
    dist.broadcast_object_list(obj, src=0)

    model = reversed_model(seed + 1)  # anything: the state comes from the checkpoint
    model.load_state_dict(model_state)
    opt = du.make_optimizer("sgd", model.parameters())
    opt.load_state_dict(opt_state)
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, **CAPS)
    fresh_layout = [list(b) for b in acc.bucket_indices]
    acc.load_state_dict(obj[0])
    run(model, acc, batches[save_at:])
    return {"straight": straight, "resumed": du.params(model), "saved_layout": saved_layout,
            "fresh_layout": fresh_layout, "final_layout": [list(b) for b in acc.bucket_indices],
            "rebuilds": acc.stats()["bucket_rebuilds"], "snapshot": snapshot}


@job
def refresh_rebuilds(rank, world_size, *, seed):
    """bucket_rebuilds after each of three windows, with refresh_parameters()
    (the same set) after the second: the refresh lays the buckets out in
    registration order again, and they are rebuilt after its first window."""
    import gradaccum

    windows = du.make_windows(seed, du.full_counts(3, world_size, STEPS), MICRO)
    model = reversed_model(seed)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=STEPS, **CAPS)
    counts, layouts = [], []
    for w, window in enumerate(windows):
        for batch in window[rank]:
            acc.backward(loss_of(model, batch, False))
            acc.step()
        counts.append(acc.stats()["bucket_rebuilds"])
        if w == 1:
            before = acc.stats()
            acc.refresh_parameters()
            after = acc.stats()
            counts.append(after["bucket_rebuilds"])
            kept = [k for k in before if k.startswith("last_window_") or k in ("launched_in_backward", "collectives")]
        layouts.append([list(b) for b in acc.bucket_indices])
    return {"counts": counts, "layouts": layouts, "before": {k: before[k] for k in kept},
            "after": {k: after[k] for k in kept}}


@job
def option_differs(rank, world_size):
    """rebuild_buckets differs across ranks: a ValueError on every rank."""
    import gradaccum

    model = reversed_model(3)
    try:
        gradaccum.Accumulator(model, None, rebuild_buckets=rank == 0)
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


@job
def option_differs_unchecked(rank, world_size):
    """rebuild_buckets differs and check_parameters=False: the first window is
    dropped on every rank with an error naming the option, never mis-paired."""
    import gradaccum

    model = reversed_model(3)
    acc = gradaccum.Accumulator(model, None, steps=1, rebuild_buckets=rank == 0, check_parameters=False,
                                bucket_cap_mb=0.0004, first_bucket_cap_mb=0.0004)
    errors = []
    for _ in range(2):
        try:
            acc.backward(model(torch.ones(2, du.D_IN, dtype=torch.float64)).pow(2).mean())
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    return {"errors": errors, "dropped": acc.stats()["dropped_windows"]}
