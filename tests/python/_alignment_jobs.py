"""Jobs of test_alignment.py: a rank whose micro-batch fails or is refused in
the middle of a window, and a script that catches the error and goes on (real
Gloo ranks, spawned by _dist_utils.run_job with module="_alignment_jobs")."""
import torch

import _dist_utils as du
from _dist_utils import job

SEED, K = 11, 3


def windows(world_size):
    return du.make_windows(SEED, du.full_counts(3, world_size, K), 2)


@job
def failed_or_refused_then_on(rank, world_size, *, how):
    """K=3, 3 windows. In window 1, rank 1's first micro-batch fails in its
    backward (`how` "failed": a hook raises) or is refused (`how` "refused":
    an empty batch's torch.zeros(()) loss). The script catches the error and
    does what it says: "failed" goes on with the next micro-batch (the failed
    micro-step counts); "refused" calls acc.empty_micro_step() in its place."""
    import gradaccum
    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    arm = {"on": False}
    list(model.parameters())[0].register_hook(
        lambda g: (_ for _ in ()).throw(RuntimeError("injected failure")) if arm["on"] else g)
    errors = []
    for w, window in enumerate(windows(world_size)):
        for k, batch in enumerate(window[rank]):
            bad = rank == 1 and w == 1 and k == 0
            try:
                if bad and how == "refused":
                    acc.backward(torch.zeros((), dtype=torch.float64))
                else:
                    arm["on"] = bad
                    acc.backward(du.micro_loss(model, batch, "mean")[0])
            except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                errors.append((f"{w}/{k}", type(e).__name__, str(e), getattr(e, "__notes__", [])))
                if bad and how == "refused":
                    acc.empty_micro_step()
            finally:
                arm["on"] = False
            acc.step()
    return {"errors": errors, "params": du.params(model), "stats": acc.stats()}
