"""Jobs of test_compiled_autograd.py: training under torch's compiled
autograd (Note [Compiled autograd] in src/reducer/hooks.cpp)."""
import contextlib

import torch

import _dist_utils as du
from _dist_utils import Boom, job  # identity forward, a backward that raises

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


class Reentrant(torch.nn.Module):
    """mlp(seed)'s layers, each under reentrant activation checkpointing:
    every parameter is inside a block, whose backward is a nested graph task."""

    def __init__(self, seed):
        super().__init__()
        self.net = du.mlp(seed)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = x.detach().requires_grad_()  # (reentrant blocks differentiate only then)
        for layer in self.net:
            x = checkpoint(layer, x, use_reentrant=True)
        return x


@job
def train(rank, world_size, *, seed, n_windows, reduction, compiled, as_view=False, partial=0, unused=False,
          reentrant=False):
    """Full windows, then a partial one closed by flush(); `unused`: the
    model holds a parameter its forward never uses; `reentrant`: the
    Reentrant model."""
    import gradaccum

    model = Reentrant(seed) if reentrant else du.mlp(seed)
    if unused:
        model.register_parameter("unused", torch.nn.Parameter(torch.ones(2, 2, dtype=torch.float64)))
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005, gradient_as_bucket_view=as_view)
    collectives, unused_grads = [], []
    with compiled_autograd(compiled):
        for w, window in enumerate(windows(seed, world_size, n_windows, partial)):
            for batch in window[rank]:
                loss, n = du.micro_loss(model, batch, reduction)
                acc.backward(loss, num_items=n)
            if unused:
                unused_grads.append(None if model.unused.grad is None else model.unused.grad.clone())
            if w == n_windows:
                assert acc.flush()
            else:
                assert acc.step()
            collectives.append(acc.stats()["last_window_collectives"])
    from torch._dynamo.utils import counters

    out = {"params": [p.detach().clone() for name, p in model.named_parameters() if name != "unused"], "stats": acc.stats(), "collectives": collectives,
           "unused_grads": unused_grads,
           "captures": counters["compiled_autograd"]["captures"]}
    acc.close()
    return out


@job
def dropped_then_trained(rank, world_size, *, seed):
    """Compiled autograd; rank 1's closing backward of window 0 fails (the
    window is dropped on every rank), window 1 trains."""
    import gradaccum

    model = du.mlp(seed)
    acc = gradaccum.Accumulator(model, du.make_optimizer("adam", model.parameters()), steps=STEPS,
                                bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    out = {"errors": []}
    with compiled_autograd(True):
        for w, window in enumerate(windows(seed, world_size, 2)):
            try:
                for k, batch in enumerate(window[rank]):
                    loss, _ = du.micro_loss(model, batch, "mean")
                    if w == 0 and rank == 1 and k == STEPS - 1:
                        loss = Boom.apply(loss)
                    acc.backward(loss)
                out["stepped"] = acc.step()
            except RuntimeError as e:
                out["errors"].append(str(e))
    out["params"] = du.params(model)
    out["stats"] = acc.stats()
    acc.close()
    return out


@job
def manual_path(rank, world_size, *, seed):
    """Compiled autograd and DDP's manual path: no_sync() backwards work, the
    plain closing loss.backward() is refused (no hook would reduce it)."""
    import gradaccum

    model = du.mlp(seed)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=STEPS)
    batches = windows(seed, world_size, 1)[0][rank]
    out = {}
    with compiled_autograd(True):
        with acc.no_sync():
            du.micro_loss(model, batches[0], "mean")[0].backward()
        try:
            du.micro_loss(model, batches[1], "mean")[0].backward()
            out["error"] = None
        except RuntimeError as e:
            out["error"] = str(e)
    out["stats"] = acc.stats()
    acc.close()
    return out
