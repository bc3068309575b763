"""Jobs of test_timeline.py: acc.last_window_timeline() on real ranks
(Note [The window's timeline] in src/reducer/launch.cpp)."""
import torch

import _dist_utils as du
from _dist_utils import job


@job
def timeline(rank, world_size, *, steps):
    """Two windows of an MLP in small buckets; the second window's timeline,
    and one from a flush() (no hooks)."""
    import gradaccum

    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=steps,
                                bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
    empty = acc.last_window_timeline()
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        for _ in range(steps):
            acc.backward(model(torch.randn(4, du.D_IN, dtype=torch.float64, generator=g)).pow(2).mean())
        assert acc.step()
    out = {"empty": empty, "window": acc.last_window_timeline(), "stats": acc.stats(),
           "sizes": [p.numel() * p.element_size() for p in model.parameters()]}
    acc.backward(model(torch.randn(4, du.D_IN, dtype=torch.float64, generator=g)).pow(2).mean())
    acc.flush()
    out["flush"] = acc.last_window_timeline()
    acc.close()
    return out
