"""Jobs of test_epoch_end.py: what acc.flush() and acc.join() meet at the end
of the data, on real Gloo ranks (spawned by _dist_utils.run_job with
module="_epoch_end_jobs"): a window left closed after nonfinite="raise" (Note
[A non-finite window left for the epoch's end]) and windows with no weight
(Note [A flushed window with no weight]).
"""
import time

import torch

import _dist_utils as du
from _dist_utils import job

SEED = 31
K = 2
MICRO = 2


def windows(world_size, n):
    return du.make_windows(SEED, du.full_counts(n, world_size, K), MICRO)


def reference(world_size, n, skip):
    """One process, float64: the big batches of n windows, but `skip`."""
    return du.windows_reference(SEED, windows(world_size, n), "mean", skip=skip)


def _loss(acc):
    return None if acc.window_loss is None else float(acc.window_loss)


@job
def nonfinite_left_closed(rank, world_size, *, droppers, call_step=True, end="flush"):
    """nonfinite="raise", K=2; window 1's last loss is NaN on rank 1, so every
    rank's reduced gradient is. Every rank calls acc.step() on it
    (`call_step`; it raises) and the ranks in `droppers` drop it with
    acc.zero_grad() as the error says; the others leave it closed. `end`
    "flush": every rank ends the epoch with acc.flush(), then trains window 2
    and flushes again. "join": rank 0 joins after window 0 and shadows rank
    1's window 1, the last of its data inside `with acc.join():`."""
    import gradaccum

    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K, nonfinite="raise")
    data = windows(world_size, 3)
    errors = []
    start = time.monotonic()

    def window(w):
        for k, batch in enumerate(data[w][rank]):
            loss = du.micro_loss(model, batch, "mean")[0]
            if w == 1 and k == K - 1 and rank == 1:
                loss = loss * float("nan")
            acc.backward(loss)
        if w == 1 and not call_step:
            return
        try:
            acc.step()
        except RuntimeError as e:
            errors.append(("step", str(e)))
            if rank in droppers:
                acc.zero_grad()

    try:
        window(0)
        if end == "join":
            with acc.join():
                if rank == 1:
                    window(1)
        else:
            window(1)
            try:
                acc.flush()
            except RuntimeError as e:
                errors.append(("flush", str(e)))
                acc.zero_grad()
            window(2)
            acc.flush()
    except RuntimeError as e:
        errors.append(("end", str(e)))
    stats = acc.stats()
    return {"errors": errors, "params": du.params(model), "seconds": time.monotonic() - start,
            "optimizer_steps": stats["optimizer_steps"], "dropped_windows": stats["dropped_windows"]}


@job
def weightless_windows(rank, world_size, *, case):
    """reduction="items", K=2, nonfinite="skip_micro_batch". Window 0 is a
    full window with items; then, by `case`:
    "flush": every rank's partial window of one micro-batch holds no item
    (num_items=0), closed by acc.flush();
    "flush one": rank 0's does, rank 1 flushes an empty window;
    "nothing": every rank flushes an empty window (window 0 stays the last);
    "join": rank 0 has one more full window whose micro-batches are all left
    out (NaN losses) while rank 1 shadows it in acc.join().
    Returns window_loss, window_items and the counters after each part."""
    import gradaccum

    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K,
                                reduction="items", nonfinite="skip_micro_batch")
    data = windows(world_size, 2)
    seen = []

    def note(label, stepped):
        stats = acc.stats()
        seen.append((label, stepped, _loss(acc), acc.window_items, stats["skipped_steps"],
                     stats["optimizer_steps"]))

    def micro(batch, left_out):
        loss, n = du.micro_loss(model, batch, "items")
        if left_out == "zero":
            acc.backward(loss * 0, num_items=0)
        elif left_out == "nan":
            acc.backward(loss * float("nan"), num_items=n)
        else:
            acc.backward(loss, num_items=n)
        return acc.step()

    stepped = False
    for batch in data[0][rank]:
        stepped = micro(batch, None)
    note("window 0", stepped)
    if case == "join":
        stepped = False
        with acc.join():
            if rank == 0:
                for batch in data[1][rank]:
                    stepped = micro(batch, "nan")
        note("join", stepped)
    else:
        if case == "flush" or (case == "flush one" and rank == 0):
            micro(data[1][rank][0], "zero")
        note("flush", acc.flush())
    return {"seen": seen, "params": du.params(model)}


@job
def weightless_flush_keeps_residuals(rank, world_size, *, closing):
    """A bf16 wire with error feedback, reduction="items": a window of items,
    then one with none on any rank, closed by acc.flush() of one micro-batch
    each (`closing` "flush") or by the closing backward of a full window
    ("backward"). Returns this rank's residuals after each, and the skips."""
    import gradaccum

    model = du.mlp(SEED).float()
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K,
                                reduction="items", comm_dtype=torch.bfloat16, error_feedback=True)
    data = windows(world_size, 2)

    def held():
        return [r.clone() for r in acc.state_dict(rank_independent=False)["error_feedback_residuals"]]

    for batch in data[0][rank]:
        loss, n = du.micro_loss(model, [t.float() if t.is_floating_point() else t for t in batch], "items")
        acc.backward(loss, num_items=n)
        acc.step()
    before = held()
    for batch in data[1][rank][:1 if closing == "flush" else K]:
        loss, _ = du.micro_loss(model, [t.float() if t.is_floating_point() else t for t in batch], "items")
        acc.backward(loss * 0, num_items=0)
        acc.step()
    if closing == "flush":
        acc.flush()
    return {"before": before, "after": held(), "skipped": acc.stats()["skipped_steps"]}


@job
def flush_again_after_its_step_raised(rank, world_size, *, end="flush", retry="flush", roundtrip=False):
    """Epoch 0: a window, then a partial one that the epoch's end (`end`:
    acc.flush(), or acc.join()'s block, whose last reduction closes it)
    closes, whose step raises once on rank 1 (its optimizer); rank 1 saves
    and loads its state if `roundtrip`, then calls `retry` ("flush", "join"
    or "step"). Epoch 1: two windows."""
    import gradaccum

    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    real_step, arm = opt.step, {"on": False}

    def step(*args, **kwargs):
        if arm["on"]:
            arm["on"] = False
            raise RuntimeError("the optimizer failed once")
        return real_step(*args, **kwargs)

    opt.step = step
    errors, flushed = [], []
    for w, window in enumerate(flush_again_windows(world_size)):
        for batch in window[rank]:
            acc.backward(du.micro_loss(model, batch, "mean")[0])
            acc.step()
        if w == 1:
            arm["on"] = rank == 1
            try:
                if end == "flush":
                    flushed.append(acc.flush())
                else:
                    with acc.join():
                        pass
                    flushed.append(True)
            except RuntimeError as e:
                errors.append(str(e))
                if roundtrip:
                    acc.load_state_dict(acc.state_dict())
                if retry == "join":
                    with acc.join():
                        pass
                    flushed.append(True)
                else:
                    flushed.append(acc.flush() if retry == "flush" else acc.step())
    ones = torch.ones(2)
    torch.distributed.all_reduce(ones)  # pairs only if no rank ran a collective more
    return {"errors": errors, "flushed": flushed, "params": du.params(model), "stats": acc.stats(),
            "paired": ones.tolist() == [float(world_size)] * 2}


def flush_again_windows(world_size):
    return du.make_windows(SEED, [[K] * world_size, [1] * world_size, [K] * world_size, [K] * world_size], MICRO)


def epoch_end_save_windows(world_size):
    """Epoch 0: rank 0 has one more full window than the others (its last
    one closes with their flush()); epoch 1: two windows each."""
    return du.make_windows(SEED, [[K] * world_size, [K] * world_size, [K] + [0] * (world_size - 1),
                                  [K] * world_size, [K] * world_size], MICRO)


@job
def save_where_the_epoch_ended(rank, world_size, *, path, resume, flush_first=False):
    """Not `resume`: epoch 0, rank 0 saving a rank-independent state (with
    the model and optimizer) after each step that returned True, as
    frameworks do, then flush() on every rank, then epoch 1. `resume`: every
    rank loads rank 0's last file, calls flush() first if `flush_first`,
    and runs epoch 1."""
    import gradaccum

    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    ws = epoch_end_save_windows(world_size)
    out = {}
    if resume:
        ckpt = torch.load(path, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        acc.load_state_dict(ckpt["accumulator"])
        if flush_first:
            out["flushed"] = acc.flush()
    else:
        for window in ws[:3]:
            for batch in window[rank]:
                acc.backward(du.micro_loss(model, batch, "mean")[0])
                if acc.step() and rank == 0:
                    out["epoch_ended_at_save"] = acc.epoch_ended
                    state = acc.state_dict()
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "accumulator": state}, path)
                    out["saved_epoch_ended"] = state["epoch_ended"]
        acc.flush()
    for window in ws[3:]:
        for batch in window[rank]:
            acc.backward(du.micro_loss(model, batch, "mean")[0])
            acc.step()
    ones = torch.ones(2)
    torch.distributed.all_reduce(ones)  # pairs only if no rank ran a collective more
    return {**out, "params": du.params(model), "stats": acc.stats(), "paired": ones.tolist() == [float(world_size)] * 2}
