"""Jobs of test_unstepped.py: a closed window that some ranks do not step
(Note [A window not stepped on some ranks]), on real Gloo ranks.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_unstepped_jobs") and returns plain data; the parent checks it against
a one-process reference in float64.
"""
import copy

import _dist_utils as du
from _dist_utils import job

SEED = 23
K = 2
WINDOWS = 5


def windows(world_size):
    return du.make_windows(SEED, [[K] * world_size] * WINDOWS, K)


def reference(world_size, skip=()):
    """One process, float64: the big batches of the WINDOWS windows, but `skip`."""
    return du.windows_reference(SEED, windows(world_size), "mean", optimizer="sgd", skip=skip)


@job
def closed_window_dropped(rank, world_size, *, droppers, then="window", resume=True):
    """K=2, momentum SGD, WINDOWS windows. Window 1's acc.step() raises on the
    ranks in `droppers` (their optimizer), which drop the closed window with
    acc.zero_grad() and go on, as a script that catches the error would
    (`droppers` = every rank: a window skipped alike). `then` is the call
    that runs the next reduction: "window" (window 2's closing backward),
    "flush" (one micro-step, then acc.flush()), "snapshot" (one micro-step,
    then a rank-independent acc.state_dict()), "refresh"
    (acc.refresh_parameters() at the boundary). Where that raises, every rank
    resumes from the checkpoint taken before window 1 (`resume`) and trains
    windows 1.. again, with no failure."""
    import gradaccum

    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    data = windows(world_size)[:]
    errors, saved = [], None
    real_step = opt.step
    fail = {"armed": False}

    def step(*args, **kwargs):
        if fail["armed"]:
            fail["armed"] = False
            raise RuntimeError(f"optimizer failed on rank {rank}")
        return real_step(*args, **kwargs)

    opt.step = step
    w = 0
    resumed = False
    dropped_before = None
    while w < len(data):
        if w == 1 and saved is None:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), acc.state_dict())
        micro = data[w][rank]
        try:
            if w == 2 and then in ("flush", "snapshot") and not resumed:
                acc.backward(du.micro_loss(model, micro[0], "mean")[0])
                if then == "flush":
                    acc.flush()
                else:
                    acc.state_dict()
                errors.append((w, "none"))
                break
            if w == 2 and then == "refresh" and not resumed:
                acc.refresh_parameters()
                errors.append((w, "none"))
                break
            for batch in micro:
                acc.backward(du.micro_loss(model, batch, "mean")[0])
            fail["armed"] = w == 1 and rank in droppers and not resumed
            try:
                acc.step()
            except RuntimeError as e:
                errors.append((w, "step", str(e)))
                acc.zero_grad()
        except RuntimeError as e:
            errors.append((w, "reduction", str(e)))
            dropped_before = acc.stats()["dropped_windows"]
            if not resume:
                break
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            acc.load_state_dict(saved[2])
            resumed = True
            w = 1
            continue
        w += 1
    stats = acc.stats()
    return {"errors": errors, "params": du.params(model), "resumed": resumed, "dropped_before": dropped_before,
            "optimizer_steps": stats["optimizer_steps"], "dropped_windows": stats["dropped_windows"]}
