"""Jobs of test_window_loss.py: acc.window_loss against the big batch's loss
(Note [The window's loss rides in the header])."""
import _dist_utils as du
from _dist_utils import job

STEPS = 3


def schedule(seed, world_size, n_windows, last):
    """Full windows, then a partial one of `last` micro-steps per rank (flush())."""
    counts = du.full_counts(n_windows, world_size, STEPS) + ([[last] * world_size] if last else [])
    return du.make_windows(seed, counts, 2)


def reference(seed, world_size, n_windows, last, reduction):
    """Each window's big-batch loss (one forward over all its micro-batches)
    before its step, one process, float64."""
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    losses = []
    for window in schedule(seed, world_size, n_windows, last):
        loss = du.global_batch_loss(model, window, reduction)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@job
def window_losses(rank, world_size, *, seed, n_windows, last, reduction, comm_dtype=None):
    import torch
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005,
                                comm_dtype=getattr(torch, comm_dtype) if comm_dtype else None,
                                process_group=None if world_size > 1 else False)
    out = {"losses": [], "items": [], "collectives": [], "before_first": acc.window_loss}
    windows = schedule(seed, world_size, n_windows, last)
    for w, window in enumerate(windows):
        for batch in window[rank]:
            loss, n = du.micro_loss(model, batch, reduction)
            acc.backward(loss, num_items=n)
            if acc.window_ready:
                out["mid"] = acc.window_loss  # readable before step()
            acc.step()
        if w == len(windows) - 1 and last:
            acc.flush()
        wl = acc.window_loss
        out["losses"].append(None if wl is None else float(wl))
        out["items"].append(acc.window_items)
        out["collectives"].append(acc.stats()["last_window_collectives"] if world_size > 1 else 0)
    out["buckets"] = acc.stats()["buckets"]
    out["stats_loss"] = acc.stats()["window_loss"]
    acc.close()
    return out
