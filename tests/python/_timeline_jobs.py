"""Jobs of test_timeline.py: acc.last_window_timeline() and acc.window_trace()
on real ranks (Note [The window's timeline] in src/reducer/launch.cpp)."""
import time

import torch

import _dist_utils as du
from _dist_utils import Boom, job


@job
def timeline(rank, world_size, *, steps):
    """Two windows of an MLP in small buckets; the second window's timeline,
    and one from a flush() (no hooks)."""
    import gradaccum

    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=steps,
                                bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    empty = acc.last_window_timeline()
    try:
        acc.window_trace()
        empty_trace_error = None
    except RuntimeError as e:
        empty_trace_error = str(e)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        before = time.time()
        for _ in range(steps):
            acc.backward(model(torch.randn(4, du.D_IN, dtype=torch.float64, generator=g)).pow(2).mean())
        assert acc.step()
        after = time.time()
    out = {"empty": empty, "empty_trace_error": empty_trace_error, "window": acc.last_window_timeline(),
           "trace": acc.window_trace(), "clock": [before, after], "stats": acc.stats(),
           "sizes": [p.numel() * p.element_size() for p in model.parameters()],
           "names": [n for n, _ in model.named_parameters()]}
    acc.backward(model(torch.randn(4, du.D_IN, dtype=torch.float64, generator=g)).pow(2).mean())
    acc.flush()
    out["flush"] = acc.last_window_timeline()
    out["flush_trace"] = acc.window_trace()
    # Freeze the first layer: the reducer starts over (no timeline), and the
    # next reduction has the trainable parameters only.
    for p in model[0].parameters():
        p.requires_grad_(False)
    acc.refresh_parameters()
    out["timeline_after_refresh"] = acc.last_window_timeline()
    for _ in range(steps):
        acc.backward(model(torch.randn(4, du.D_IN, dtype=torch.float64, generator=g)).pow(2).mean())
    assert acc.step()
    out["trace_refreshed"] = acc.window_trace()
    # A closing backward that fails on rank 0 after its hooks ran: the window
    # is dropped on every rank.
    x = torch.randn(4, du.D_IN, dtype=torch.float64, generator=g, requires_grad=True)
    dropped = acc.stats()["dropped_windows"]
    errors = []
    for k in range(steps):
        try:
            acc.backward(model(Boom.apply(x) if rank == 0 and k == steps - 1 else x).pow(2).mean())
        except RuntimeError as e:
            errors.append(str(e).split("\n")[0])
    out["dropped"] = {"trace": acc.window_trace(), "windows": acc.stats()["dropped_windows"] - dropped,
                      "errors": errors}
    acc.close()
    return out
