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
