"""Restarts on another number of ranks in the fuzzer (README, "Restarts";
docs/checkpoints.md, "Another number of ranks, another `steps`").

A schedule with "resize": {"world": W', "steps": K', "epochs": [...]} runs its
epochs on W ranks; then every rank calls the rank-independent
`acc.state_dict()` (at a window boundary or in the middle of a window) and
rank 0 writes it with the model's and the optimizer's state and the trainable
set to a file. A second launch on W' ranks builds a fresh model, optimizer and
Accumulator (`steps=K'`; K' differs from K only at a boundary), loads the file
on every rank and runs the "resize" epochs. One rank (W or W' = 1) is a
one-process Accumulator (`process_group=False`), as in test_resize.py.

The model: rank 0 takes the whole half-done window (its sum over the W old
ranks, its weight, whether it holds a non-finite gradient), the other new
ranks start it empty, and it closes after the remaining `steps - micro_step`
micro-steps with the exact mean of every micro-batch either side saw, and
its window_loss and window_metrics are the uninterrupted window's (Note [The
window's loss across a checkpoint]). Counters carry over.

Each launch runs a phase schedule, `phases(sched, path)`: the whole schedule
under "whole", with "phase" ("before" or "after"), "first_epoch" (the
after-phase's epochs are numbered on from the before-phase's, for keys and
data) and the file's "path". Keys: "c/E/0" the save, "l/E/0" the load, with E
the number of epochs before the restart.
"""
import itertools
import os

import _fuzz_model as fm


def _before(whole):
    return {k: v for k, v in whole.items() if k != "resize"}


def phases(sched, path):
    """The two launches of a schedule with "resize": (before, after)."""
    base = dict(_before(sched), whole=sched, path=path)
    r = sched["resize"]
    return (dict(base, phase="before", first_epoch=0),
            dict(base, phase="after", world=r["world"], steps=r["steps"], epochs=r["epochs"],
                 first_epoch=len(sched["epochs"])))


def expect_phase(psched):
    """The model's prediction for one phase (fm.Model), or fm.InvalidSchedule."""
    whole = psched["whole"]
    n_before = len(whole["epochs"])
    a = fm.Model(_before(whole)).run()
    r = whole["resize"]
    if a._culprits():
        raise fm.InvalidSchedule("a restart from a window that failed (its save drops it)")
    if a.m and r["steps"] != whole["steps"]:
        raise fm.InvalidSchedule("another steps in the middle of a window")
    if any(m != a.mask[0] for m in a.mask):
        raise fm.InvalidSchedule("ranks with different trainable sets")
    for rank in range(a.W):
        a.exp[rank][f"c/{n_before}/0"] = ("ok", None)
    if psched["phase"] == "before":
        return a
    b = fm.Model(dict(_before(whole), world=r["world"], steps=r["steps"], epochs=r["epochs"],
                      first_epoch=n_before))
    b.params, b.buf, b.optimizer_steps, b.m = a.params, a.buf, a.optimizer_steps, a.m
    b.skipped_steps = a.skipped_steps
    b.left_out = [list(a.left_out[0]) for _ in range(b.W)]  # rank 0's state
    b.dropped = a.dropped if b.W > 1 else 0  # (one process has no reducer)
    b.mask = [list(a.mask[0]) for _ in range(b.W)]
    taken = fm._Window()  # rank 0 takes the whole half-done window
    for w in a.win:
        taken.grad = fm._add(taken.grad, w.grad)
        taken.weight += w.weight
        taken.loss += w.loss
        taken.metric += w.metric
        taken.kept += w.kept
        taken.steps += w.steps
        taken.nan = taken.nan or w.nan
    taken.cut = bool(a.m)
    b.win[0] = taken
    for w in b.win:
        w.shared = bool(a.m)  # every rank holds a share of the half-done window
    b.seen = a.seen
    b.seen.add(f"restart on {'fewer' if b.W < a.W else 'more'} ranks"
               + (" mid-window" if a.m else f" at a boundary{', another steps' if b.K != a.K else ''}")
               + (" (one process)" if 1 in (a.W, b.W) else ""))
    for rank in range(b.W):
        b.exp[rank][f"l/{n_before}/0"] = ("ok", None)
    return b.run()


def expect_whole(sched):
    """Both phases' model; the after-phase's, whose `seen` covers both."""
    return expect_phase(phases(sched, None)[1])


_files = itertools.count()


def verdicts(schedules, tmp_dir, batch, run):
    """fj.verdicts for a list that holds schedules with "resize": every
    before-phase runs with the plain schedules, then the after-phases of those
    that passed. `run` is the plain verdicts(schedules, tmp_dir, batch)."""
    plain = [i for i, s in enumerate(schedules) if "resize" not in s]
    split = {}
    for i, s in enumerate(schedules):
        if "resize" in s:
            path = os.path.join(str(tmp_dir), f"restart{next(_files)}-seed{s['seed']}.pt")
            split[i] = phases(s, path)
    out = [None] * len(schedules)
    firsts = run([schedules[i] for i in plain] + [b for b, _ in split.values()], tmp_dir, batch)
    for i, p in zip(plain, firsts):
        out[i] = p
    later = []
    for i, p in zip(split, firsts[len(plain):]):
        out[i] = [f"before the restart: {x}" for x in p]
        if not p:
            later.append(i)
    for i, p in zip(later, run([split[i][1] for i in later], tmp_dir, batch)):
        out[i] = [f"after the restart: {x}" for x in p]
    return out
