"""Jobs of test_compiled_autograd.py: training under torch's compiled
autograd (Note [Compiled autograd] in src/reducer/hooks.cpp)."""
import contextlib

import torch

import _dist_utils as du
from _dist_utils import job

STEPS = 3


def windows(seed, world_size, n_windows, partial=0):
    """`n_windows` full windows, then one of `partial` micro-batches a rank."""
    counts = du.full_counts(n_windows, world_size, STEPS) + ([[partial] * world_size] if partial else [])
    return du.make_windows(seed, counts, 2)


def reference(seed, world_size, n_windows, reduction, partial=0):
    """One process, eager, on each window's global batch."""
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    for window in windows(seed, world_size, n_windows, partial):
        du.global_batch_loss(model, window, reduction).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return du.params(model)


def compiled_autograd(on):
    """torch's compiled autograd (its backward graph run through torch.compile
    with the eager backend: what is traced is what matters here, not codegen)."""
    if not on:
        return contextlib.nullcontext()
    from torch._dynamo import compiled_autograd as ca

    return ca._enable(torch.compile(backend="eager"))


@job
def train(rank, world_size, *, seed, n_windows, reduction, compiled, as_view=False, partial=0):
    """Full windows, then a partial one closed by flush()."""
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005, gradient_as_bucket_view=as_view)
    collectives = []
    with compiled_autograd(compiled):
        for w, window in enumerate(windows(seed, world_size, n_windows, partial)):
            for batch in window[rank]:
                loss, n = du.micro_loss(model, batch, reduction)
                acc.backward(loss, num_items=n)
            if w == n_windows:
                assert acc.flush()
            else:
                assert acc.step()
            collectives.append(acc.stats()["last_window_collectives"])
    from torch._dynamo.utils import counters

    out = {"params": du.params(model), "stats": acc.stats(), "collectives": collectives,
           "captures": counters["compiled_autograd"]["captures"]}
    acc.close()
    return out
