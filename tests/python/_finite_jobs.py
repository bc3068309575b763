"""Jobs of test_finite_check.py: the non-finite test of a data-parallel window,
answered by the reducer's write-back pass when it can (Note [The reducer
checks the window's gradient] in src/accumulator.cpp), on real Gloo ranks
(spawned by _dist_utils.run_job with module="_finite_jobs").
"""
import math

import torch

import _dist_utils as du
from _dist_utils import job

STEPS = 2
MICRO = 2
N_WINDOWS = 4
BAD_WINDOW = 1


def scale_of(value):
    return {"nan": math.nan, "inf": math.inf, "huge": 1e160, "none": 1.0}[value]


def reference(seed, world_size, reduction, skip):
    """One process: the big batch's windows, those in `skip` dropped."""
    windows = du.make_windows(seed, du.full_counts(N_WINDOWS, world_size, STEPS), MICRO)
    return du.windows_reference(seed, windows, reduction, skip=skip)


@job
def nonfinite_windows(rank, world_size, *, seed, cases):
    """Per case: rank 1's last micro-step of window BAD_WINDOW has its loss
    scaled by `value` (NaN, inf, or 1e160: finite gradients whose norm
    overflows float64); or, with `poke`, every rank writes a NaN into a .grad
    in place between the window's backward and step() (the reducer's check no
    longer applies). The window closes through backward() or, with `flush`,
    through flush() of a partial window."""
    import gradaccum

    out = {}
    for key, case in cases.items():
        windows = du.make_windows(seed, du.full_counts(N_WINDOWS, world_size, STEPS), MICRO)
        model = du.mlp(seed)
        opt = du.make_optimizer("sgd", model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=STEPS + (1 if case["flush"] else 0),
                                    reduction=case["reduction"], nonfinite=case["mode"],
                                    gradient_as_bucket_view=case["as_view"], **case.get("extra", {}))
        record = {"errors": [], "norms": [], "stepped": []}
        for w, window in enumerate(windows):
            for k, batch in enumerate(window[rank]):
                loss, n = du.micro_loss(model, batch, case["reduction"])
                if w == BAD_WINDOW and rank == 1 and k == STEPS - 1:
                    loss = loss * scale_of(case["value"])
                acc.backward(loss, num_items=n)
            try:
                if case["flush"]:
                    stepped = acc.flush()
                else:
                    if case["poke"] == "data" and w == BAD_WINDOW:
                        # New storage for the same .grad tensor: no version bump.
                        bad = model[2].weight.grad.detach().clone()
                        bad[0, 0] = math.nan
                        model[2].weight.grad.data = bad
                    elif case["poke"] and w == BAD_WINDOW:
                        with torch.no_grad():
                            model[2].weight.grad[0, 0] = math.nan
                    stepped = acc.step()
            except RuntimeError as e:
                record["errors"].append((w, str(e)))
                acc.zero_grad()
                stepped = False
            record["stepped"].append(stepped)
            record["norms"].append(acc.stats()["last_grad_norm"])
        record["params"] = du.params(model)
        record["stats"] = acc.stats()
        out[key] = record
    return out
