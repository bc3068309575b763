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
                      "errors": errors, "grads": [p.grad for p in model.parameters()],
                      "written": [b["written"] for b in acc.last_window_timeline()["buckets"]]}
    acc.close()
    return out


class _Fan(torch.nn.Module):
    """Linear layers side by side on one input, their outputs summed: each
    weight's gradient is the loss's scale times a column sum of the input."""

    def __init__(self, widths, dtype):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, w, dtype=dtype) for w in widths)

    def forward(self, x):
        return sum(layer(x).sum() for layer in self.layers)


def _end_window(acc, model, alone, errors=None):
    """Steps a window and starts `alone`'s next. A kept one (errors None):
    its reduced .grad, the raw sums of `alone` (the model run alone),
    window_items and the timeline. A dropped one: its `errors`, what .grad
    it left, the dropped windows counted and whether step() stepped."""
    if errors is not None:
        out = {"errors": errors, "grads": [p.grad for p in model.parameters()],
               "dropped_windows": acc.stats()["dropped_windows"], "stepped": acc.step()}
    else:
        out = {"grads": [p.grad.clone() for p in model.parameters()],
               "raw": [p.grad.clone() for p in alone.parameters()],
               "items": acc.window_items, "timeline": acc.last_window_timeline()}
        assert acc.step()
    alone.zero_grad()
    return out


FAN_SCALE = 699051  # odd: the summed gradients are odd integers half the time


@job
def fractional_weights(rank, world_size, *, steps, wide=False, views=False):
    """Note [Writing back while the last buckets reduce]: one parameter per
    bucket, reduction "items" with fractional item counts, and gradients that
    are exact integers, as are their sums over ranks. Without `wide`, a
    float64 chain of linear layers of unequal widths with small integer
    weights and inputs. With `wide`, float32 parameters summed in float64
    buckets (accumulate_dtype): linear layers side by side (_Fan), the loss
    scaled by FAN_SCALE and inputs of 1 or 2, so that each window's summed
    weight gradient is an integer in [2^24, 2^25): half of them odd, which a
    division by about 2 puts exactly between two float32 values, so the
    rounding to float32 tells a divisor one float64 ulp off. With `views`,
    the float64 chain with gradient_as_bucket_view. Returns, per
    window, the reduced .grad before step(), each rank's own raw gradient
    sums (a copy of the model run alone), window_items and the timeline;
    and what the window dropped between the third and fourth of them left."""
    import copy

    import gradaccum

    if wide:
        model = _Fan([12, 5, 9, 7, 11, 4], torch.float32)
    else:
        widths = [8, 12, 5, 9, 7, 11, 4]
        model = torch.nn.Sequential(*[torch.nn.Linear(a, b, dtype=torch.float64)
                                      for a, b in zip(widths, widths[1:])])
    same = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=same))
    alone = copy.deepcopy(model)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=steps,
                                reduction="items", bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5,
                                accumulate_dtype=torch.float64 if wide else None, gradient_as_bucket_view=views)
    items = [0.1, 0.2, 0.7, 0.3][rank]
    g = torch.Generator().manual_seed(100 + rank)

    def batch():
        if wide:
            return torch.randint(1, 3, (4, 8), generator=g).float(), lambda y: y * FAN_SCALE
        return torch.randint(-3, 4, (4, 8), generator=g).double(), lambda y: y.sum()

    windows, dropped = [], None
    for w in range(5):
        errors = []
        for k in range(steps):
            x, loss = batch()
            if w == 3 and rank == 0 and k == steps - 1:
                # Window 3 is dropped after its early writes: rank 0's
                # closing backward fails once every hook has run (Boom on
                # the input), while the others may already have written
                # buckets back (into float32 from float64 sums, when wide).
                try:
                    acc.backward(loss(model(Boom.apply(x.requires_grad_()))), num_items=items)
                except RuntimeError as e:
                    errors.append(str(e))
                continue
            if w == 3:  # (rank 0's failure drops it on every rank)
                try:
                    acc.backward(loss(model(x)), num_items=items)
                except RuntimeError as e:
                    errors.append(str(e))
            else:
                acc.backward(loss(model(x)), num_items=items)
            loss(alone(x)).backward()
        if w == 3:
            dropped = _end_window(acc, model, alone, errors)
        else:
            windows.append(_end_window(acc, model, alone))
    out = {"windows": windows, "dropped": dropped, "buckets": acc.stats()["buckets"]}
    acc.close()
    return out


SLOW_S = 0.5


class _Slow(torch.autograd.Function):
    """Identity forward; its backward sleeps SLOW_S, after every parameter's
    gradient when applied to the input."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(SLOW_S)
        return grad


@job
def slow_closing_rank(rank, world_size, *, views, items, dtype=torch.float64):
    """Rank 1's closing backward sleeps after its last gradient hook in
    windows 1 and 2, so the last bucket (launched at backward's end)
    completes late on every rank, the others' buckets early. "mean" over
    micro-steps (integer weights), or with `items` "items" with fractional
    item counts. In window 2 rank 0's closing backward fails after its hooks
    ran (Boom on the input): the window is dropped on both ranks after their
    early writes. Returns each kept window's reduced .grad, each rank's own
    raw sums (a copy of the model run alone), window_items and the timeline;
    and what the dropped window left. `dtype`: the model's (bfloat16: the
    buckets' meta travels as digits)."""
    import copy

    import gradaccum

    model = du.mlp(3, dtype=dtype)
    alone = copy.deepcopy(model)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2,
                                reduction="items" if items else "mean",
                                bucket_cap_mb=1e-5, first_bucket_cap_mb=1e-5, gradient_as_bucket_view=views)
    g = torch.Generator().manual_seed(rank)
    windows, dropped = [], None
    for w in range(4):
        errors = []
        for k in range(2):
            x = torch.randn(4, du.D_IN, dtype=torch.float64, generator=g).to(dtype)
            closing = k == 1
            if w in (1, 2) and rank == 1 and closing:
                inp = _Slow.apply(x.clone().requires_grad_())
            elif w == 2 and rank == 0 and closing:
                inp = Boom.apply(x.clone().requires_grad_())
            else:
                inp = x
            kwargs = {"num_items": [0.1, 0.2][rank]} if items else {}
            try:
                acc.backward(model(inp).pow(2).sum(), **kwargs)
            except RuntimeError as e:
                if w != 2:
                    raise
                errors.append(str(e).split("\n")[0])
            alone(x).pow(2).sum().backward()
        if w == 2:
            dropped = _end_window(acc, model, alone, errors)
        else:
            windows.append(_end_window(acc, model, alone))
    acc.close()
    return {"windows": windows, "dropped": dropped}


class _TwoDtypes(torch.nn.Module):
    """A float32 and a float64 linear layer side by side on one input, run
    in registration order, so that backward reaches them in reverse, as the
    buckets launch: with `narrow_first`, the float64 bucket first and the
    float32 one last; else the other way."""

    def __init__(self, narrow_first):
        super().__init__()
        self.narrow_first = narrow_first
        if narrow_first:
            self.narrow = torch.nn.Linear(8, 3, dtype=torch.float32)
        self.wide = torch.nn.Linear(8, 3, dtype=torch.float64)
        if not narrow_first:
            self.narrow = torch.nn.Linear(8, 3, dtype=torch.float32)

    def forward(self, x):
        if self.narrow_first:
            narrow = self.narrow(x.float()).double().sum()
            return narrow + self.wide(x).sum()
        wide = self.wide(x).sum()
        return wide + self.narrow(x.float()).double().sum()


@job
def large_items_two_dtypes(rank, world_size, *, narrow_first):
    """Bucket views, "items" with integer item counts whose sum, 2^24 + 1, is
    exact in the float64 bucket's meta and rounds to 2^24 in the float32
    one's (_TwoDtypes: which closes the window). Returns the reduced .grad,
    each rank's own raw sums, window_items and the buckets' dtypes in launch
    order."""
    import copy

    import gradaccum

    torch.manual_seed(0)
    model = _TwoDtypes(narrow_first)
    alone = copy.deepcopy(model)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=1, reduction="items",
                                gradient_as_bucket_view=True)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    acc.backward(model(x), num_items=[2**23 + 1, 2**23][rank])
    alone(x).backward()
    params = list(model.parameters())
    out = {"grads": [p.grad.clone() for p in params], "raw": [p.grad.clone() for p in alone.parameters()],
           "items": acc.window_items,
           "bucket_dtypes": [sorted({str(params[i].dtype) for i in b}) for b in acc.bucket_indices]}
    assert acc.step()
    acc.close()
    return out
