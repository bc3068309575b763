"""Jobs of test_resize.py: a run saved on W ranks and resumed on W' (Note
[Resuming on another shape] in src/accumulator/checkpoint.cpp).

The data is one stream of micro-batches. A window of K micro-steps on W ranks
takes the next W*K of them, rank r's k-th being number k*W + r; the window
that a resume cuts takes W*m on the old ranks and W'*(K-m) on the new ones.
The reference (schedule() and reference()) is one process, one backward per
window over all of that window's micro-batches, in float64.
"""
import os

import torch

import _dist_utils as du
from _dist_utils import job

MICRO = 2


def stream(seed, n):
    return du.make_windows(seed, [[n]], MICRO)[0][0]


def schedule(world, steps, world2, steps2, windows_before, micro_step, windows_after):
    """[(first, count)] of each window's micro-batches in the stream, and the
    slices each phase takes: (before: W ranks) and (after: W' ranks)."""
    windows, pos = [], 0
    for _ in range(windows_before):
        windows.append((pos, world * steps))
        pos += world * steps
    if micro_step:
        # the cut window: m micro-steps on W ranks, steps - m on W' ranks
        windows.append((pos, world * micro_step + world2 * (steps - micro_step)))
        pos += world * micro_step + world2 * (steps - micro_step)
    k = steps if micro_step else steps2
    for _ in range(windows_after):
        windows.append((pos, world2 * k))
        pos += world2 * k
    return windows, pos


def mine(batches, first, world, rank, count):
    """Rank `rank`'s `count` micro-steps of a window starting at `first`."""
    return [batches[first + k * world + rank] for k in range(count)]


def reference(seed, reduction, windows, total):
    batches = stream(seed, total)
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    for first, count in windows:
        du.global_batch_loss(model, [batches[first:first + count]], reduction).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return du.params(model)


def _build(seed, world_size, steps, reduction):
    import gradaccum
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    # One rank: a one-process Accumulator (no group), the local path.
    acc = gradaccum.Accumulator(model, opt, steps=steps, reduction=reduction,
                                process_group=None if world_size > 1 else False,
                                bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    return model, opt, acc


def _train(model, acc, batches, reduction):
    stepped = 0
    for batch in batches:
        loss, n = du.micro_loss(model, batch, reduction)
        acc.backward(loss, num_items=n)
        stepped += bool(acc.step())
    return stepped


def _save(rank, model, opt, acc, path):
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "acc": acc.state_dict()}
    if rank == 0:
        torch.save(state, path)


@job
def save(rank, world_size, *, seed, reduction, steps, windows_before, micro_step, total, ckpt_dir):
    """On W ranks: windows_before windows, a checkpoint at that boundary, then
    micro_step micro-steps of the next window and a checkpoint there."""
    import torch.distributed as dist
    batches = stream(seed, total)
    model, opt, acc = _build(seed, world_size, steps, reduction)
    pos = 0
    for _ in range(windows_before):
        _train(model, acc, mine(batches, pos, world_size, rank, steps), reduction)
        pos += world_size * steps
    _save(rank, model, opt, acc, os.path.join(ckpt_dir, "boundary.pt"))
    _train(model, acc, mine(batches, pos, world_size, rank, micro_step), reduction)
    _save(rank, model, opt, acc, os.path.join(ckpt_dir, "mid.pt"))
    if world_size > 1:
        dist.barrier()
    acc.close()
    return {"saved": True}


@job
def resume(rank, world_size, *, seed, reduction, world, steps, steps2, windows_before, micro_step,
           windows_after, total, ckpt_dir):
    """On W' ranks: each checkpoint of save() loaded and trained to the end of
    its schedule; the final parameters, the counters and what was refused."""
    batches = stream(seed, total)
    out = {}
    for cut in ("boundary", "mid"):
        m = micro_step if cut == "mid" else 0
        windows, _ = schedule(world, steps, world_size, steps2 if cut == "boundary" else steps,
                              windows_before, m, windows_after)
        k = steps2 if cut == "boundary" else steps
        model, opt, acc = _build(seed, world_size, k, reduction)
        loaded = torch.load(os.path.join(ckpt_dir, f"{cut}.pt"), weights_only=False)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["opt"])
        acc.load_state_dict(loaded["acc"])
        resumed = acc.stats()
        stepped = 0
        for first, count in windows[windows_before:]:
            if first == windows[windows_before][0] and m:
                # the cut window: its W*m micro-batches were taken before the save
                first += world * m
                per_rank = steps - m
            else:
                per_rank = k
            stepped += _train(model, acc, mine(batches, first, world_size, rank, per_rank), reduction)
        out[cut] = {"params": du.params(model), "stats": acc.stats(), "resumed": resumed,
                    "stepped": stepped, "micro_step": acc.micro_step}
        acc.close()
    return out


@job
def own_boundary_state_on_every_rank(rank, world_size, *, ckpt_dir):
    """2 windows of K=2, then rank 1 saves its own state (rank_independent=
    False) at the boundary, with the model and optimizer. Every rank loads
    rank 1's file into a new Accumulator and trains 2 more windows. The
    outcome of each rank's load is recorded."""
    import torch.distributed as dist
    import gradaccum
    data = stream(5, 4 * 2 * world_size)

    def train(model, acc, first, last):
        for w in range(first, last):
            for k in range(2):
                acc.backward(du.micro_loss(model, data[(w * 2 + k) * world_size + rank], "mean")[0])
                acc.step()

    model = du.mlp(5)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=2)
    train(model, acc, 0, 2)
    path = os.path.join(ckpt_dir, "rank1.pt")
    if rank == 1:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "acc": acc.state_dict(rank_independent=False)}, path)
    dist.barrier()
    acc.close()
    model = du.mlp(0)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=2)
    saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    try:
        acc.load_state_dict(saved["acc"])
        outcome = "loaded"
    except ValueError as e:
        outcome = str(e)
    train(model, acc, 2, 4)
    return {"outcome": outcome, "params": du.params(model), "stats": acc.stats()}
