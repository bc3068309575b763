"""Jobs of test_mixed_precision.py (and test_gpu.py) about error feedback on a
half-precision wire: what rounding lost carried to the next window, across
window weights, loss scales, checkpoints, rebuilt buckets and overflows.
Spawned by _dist_utils.run_job with module="_error_feedback_jobs"."""
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_utils import job


def _regression_data(seed, rank):
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(32, 1, generator=g)
    g = torch.Generator().manual_seed(seed + 1 + rank)
    x = torch.randn(512, 32, generator=g) * torch.logspace(-2, 1, 32)
    return x, x @ w_true + 0.01 * torch.randn(512, 1, generator=g)


@job
def error_feedback_regression(rank, world_size, *, seed, windows, steps):
    """Small regression, SGD: fp32 communication, bf16 without and with error
    feedback. Returns each run's final loss over every rank's data."""
    import gradaccum

    x, y = _regression_data(seed, rank)
    out = {}
    for name, comm, feedback in (("fp32", None, False), ("bf16", torch.bfloat16, False),
                                 ("bf16+ef", torch.bfloat16, True)):
        torch.manual_seed(seed)
        model = nn.Linear(32, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.004)
        acc = gradaccum.Accumulator(model, opt, steps=steps, comm_dtype=comm,
                                    error_feedback=feedback)
        rows = 512 // steps
        for w in range(windows):
            for k in range(steps):
                sl = slice(k * rows, (k + 1) * rows)
                acc.backward((model(x[sl]) - y[sl]).pow(2).mean())
                acc.step()
        with torch.no_grad():
            loss = (model(x) - y).pow(2).mean().reshape(1)
        dist.all_reduce(loss)
        out[name] = loss.item() / world_size
        if feedback:
            state = acc.state_dict(rank_independent=False)
            out["residual_norm"] = sum(r.norm().item() for r in state["error_feedback_residuals"])
        acc.close()
    return out


@job
def error_feedback_checkpoint(rank, world_size, *, seed, steps):
    """Per-rank states keep the residual exactly: a run saved at a window
    boundary and resumed equals the uninterrupted one bit for bit. A
    rank-independent state holds none; a mid-window one is refused alike."""
    import gradaccum

    x, y = _regression_data(seed, rank)

    def make():
        torch.manual_seed(seed)
        model = nn.Linear(32, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        acc = gradaccum.Accumulator(model, opt, steps=steps, comm_dtype=torch.bfloat16,
                                    error_feedback=True)
        return model, opt, acc

    def train(model, acc, windows, start):
        rows = 512 // steps
        for w in range(start, start + windows):
            for k in range(steps):
                sl = slice(((w * steps + k) % steps) * rows, ((w * steps + k) % steps + 1) * rows)
                acc.backward((model(x[sl]) * (1 + 0.1 * w) - y[sl]).pow(2).mean())
                acc.step()

    out = {}
    model, opt, acc = make()
    train(model, acc, 3, 0)
    saved = ({k: v.clone() for k, v in model.state_dict().items()},
             {k: v for k, v in opt.state_dict().items()}, acc.state_dict(rank_independent=False))
    import copy
    saved = copy.deepcopy(saved)
    out["independent_keys"] = sorted(acc.state_dict().keys())
    train(model, acc, 3, 3)
    out["uninterrupted"] = [p.detach().clone() for p in model.parameters()]
    # Mid-window, a rank-independent state is refused on every rank, changing nothing.
    acc.backward((model(x[:8]) - y[:8]).pow(2).mean())
    try:
        acc.state_dict()
        out["mid_window"] = None
    except RuntimeError as e:
        out["mid_window"] = str(e)
    out["micro_step_after_refusal"] = acc.micro_step
    acc.close()

    model, opt, acc = make()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    acc.load_state_dict(saved[2])
    train(model, acc, 3, 3)
    out["resumed"] = [p.detach().clone() for p in model.parameters()]
    acc.close()
    return out


@job
def error_feedback_overflow(rank, world_size):
    """fp16 wire with error feedback: a window that overflows is skipped on
    every rank, and the residual does not carry the overflow into later ones."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    acc = gradaccum.Accumulator(model, opt, steps=1, comm_dtype=torch.float16, error_feedback=True)
    stepped = []
    x = torch.ones(2, 4)
    for w in range(4):
        acc.backward(model(x).sum() * (1e6 if w == 0 else 1.0))
        stepped.append(acc.step())
    residuals = acc.state_dict(rank_independent=False)["error_feedback_residuals"]
    return {"stepped": stepped, "finite": all(bool(torch.isfinite(r).all()) for r in residuals),
            "params_finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


class _Reversed(nn.Module):
    """Layers applied in the reverse of their registration: the first window's
    buckets are in the wrong order, and the reducer rebuilds them."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


@job
def error_feedback_rebuild(rank, world_size, *, seed, windows):
    """Error feedback with and without the bucket rebuild: each parameter's
    residual moves with it into its new bucket, so both train alike, bit for bit."""
    import gradaccum

    out = {}
    for rebuild in (True, False):
        model = _Reversed(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = gradaccum.Accumulator(model, opt, steps=2, comm_dtype=torch.bfloat16, error_feedback=True,
                                    rebuild_buckets=rebuild, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
        g = torch.Generator().manual_seed(seed + rank)
        for _ in range(windows * 2):
            acc.backward(model(torch.randn(4, 16, generator=g)).pow(2).mean())
            acc.step()
        out[rebuild] = {"params": [p.detach().clone() for p in model.parameters()],
                        "rebuilds": acc.stats()["bucket_rebuilds"]}
        acc.close()
    return out


class _TwoHeads(nn.Module):
    """Two independent linear losses: a window can make one head's gradient
    huge (finite) and the other's infinite."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 1)
        self.b = nn.Linear(8, 1)

    def forward(self, x, overflow=False):
        la, lb = self.a(x).pow(2).mean(), self.b(x).pow(2).mean()
        return la * 1e6 + lb * float("inf") if overflow else la + lb


def two_heads_data(rank, window):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * window + rank))


@job
def error_feedback_partial_overflow(rank, world_size, *, nonfinite):
    """Window 1 is non-finite in one head only (the other's gradient huge but
    finite): it is skipped (or raised and dropped with zero_grad()), and what
    rounding it lost must not reach window 2."""
    import gradaccum

    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = gradaccum.Accumulator(model, opt, steps=1, nonfinite=nonfinite,
                                comm_dtype=torch.bfloat16, error_feedback=True)
    out = {"stepped": []}
    for w in range(3):
        acc.backward(model(two_heads_data(rank, w), overflow=w == 1))
        out[f"grad_a/{w}"] = model.a.weight.grad.clone()
        try:
            out["stepped"].append(acc.step())
        except RuntimeError as e:
            out["stepped"].append(str(e))
            acc.zero_grad()
        if w == 1:
            residuals = acc.state_dict(rank_independent=False)["error_feedback_residuals"]
            out["residual_after_skip"] = max(float(r.abs().max()) for r in residuals if r is not None)
    return out


@job
def error_feedback_state_on_another_set(rank, world_size):
    """A per-rank boundary state with error feedback (float32 wire) loaded
    where the other one of two same-shaped layers is trained: its residuals
    (float64 layers: real ones; float32: None, the wire kept nothing) name
    the saved layer."""
    import gradaccum

    class Two(nn.Module):
        def __init__(self, trained, dtype):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 4).to(dtype), nn.Linear(4, 4).to(dtype)
            (self.b if trained == "a" else self.a).requires_grad_(False)

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    out = {}
    for dtype in (torch.float64, torch.float32):
        model = Two("a", dtype)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        acc = gradaccum.Accumulator(model, opt, steps=2, comm_dtype=torch.float32, error_feedback=True)
        for _ in range(2):
            acc.backward(model(torch.randn(2, 4, dtype=dtype)).pow(2).mean())
        acc.step()
        state = acc.state_dict(rank_independent=False)
        meta = [None if r is None else torch.empty_like(r, device="meta") for r in state["error_feedback_residuals"]]
        try:
            acc.load_state_dict({**state, "error_feedback_residuals": meta})
            meta_refused = None
        except ValueError as e:
            meta_refused = str(e)
        kept = acc.state_dict(rank_independent=False)["error_feedback_residuals"]
        meta_untouched = all((a is None and b is None) or torch.equal(a, b)
                             for a, b in zip(kept, state["error_feedback_residuals"]))
        acc.close()
        other = Two("b", dtype)
        opt = torch.optim.SGD([p for p in other.parameters() if p.requires_grad], lr=0.1)
        acc = gradaccum.Accumulator(other, opt, steps=2, comm_dtype=torch.float32, error_feedback=True)
        held = [r is not None for r in state["error_feedback_residuals"]]
        try:
            acc.load_state_dict(state)
            refused = None
        except ValueError as e:
            refused = str(e)
        acc.load_state_dict({k: v for k, v in state.items() if k != "error_feedback_residuals"})
        out[str(dtype)] = {"held": held, "refused": refused, "micro_step": acc.micro_step,
                           "meta_refused": meta_refused, "meta_untouched": meta_untouched}
        acc.close()
    return out


class _GradRecorder(torch.optim.SGD):
    """SGD at learning rate 0 that keeps each step's gradient, flat."""

    def __init__(self, params):
        super().__init__(params, lr=0.0)
        self.seen = []

    def step(self, closure=None):
        self.seen.append(torch.cat([p.grad.reshape(-1) for g in self.param_groups for p in g["params"]]))
        return super().step(closure)


@job
def error_feedback_changing_weights(rank, world_size, *, windows, reduction, steps, zero_ranks=(),
                                    device="cpu", scaler_growth_interval=None):
    """Windows of very different weights, a bf16 wire without and with error
    feedback against a float32 wire: each window's reduced gradient, as the
    optimizer sees it. `windows[w][rank]` lists the rows of each micro-batch
    of window w (fewer than `steps`: closed by flush()); the loss sums over
    rows with reduction "items" (num_items = rows), else averages. Ranks in
    `zero_ranks` have zero inputs: their gradients are exactly 0 (no bias), so
    the bf16 sum over ranks rounds nothing. With error feedback, also what
    each rank holds back after each window, and that window's weight. With
    `scaler_growth_interval`, every contender has a GradScaler that doubles
    its scale every that many windows; "scale" lists it after each window."""
    import gradaccum

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    out = {}
    for name, comm, feedback in (("fp32", None, False), ("bf16", torch.bfloat16, False),
                                 ("bf16+ef", torch.bfloat16, True)):
        torch.manual_seed(0)
        model = nn.Linear(16, 1, bias=False).to(device)
        opt = _GradRecorder(model.parameters())
        scaler = None
        if scaler_growth_interval:
            scaler = torch.amp.GradScaler(device=torch.device(device).type, init_scale=2.0 ** 8,
                                          growth_interval=scaler_growth_interval)
        acc = gradaccum.Accumulator(model, opt, steps=steps, reduction=reduction, comm_dtype=comm,
                                    error_feedback=feedback, grad_scaler=scaler)
        for w, per_rank in enumerate(windows):
            for i, rows in enumerate(per_rank[rank]):
                g = torch.Generator().manual_seed(1000 * w + 10 * i + rank)
                x, y = torch.randn(rows, 16, generator=g), torch.randn(rows, 1, generator=g)
                if rank in zero_ranks:
                    x = torch.zeros_like(x)
                x, y = x.to(device), y.to(device)
                if reduction == "items":
                    acc.backward((model(x) - y).pow(2).sum(), num_items=rows)
                else:
                    acc.backward((model(x) - y).pow(2).mean())
                acc.step()
            if len(per_rank[rank]) < steps:
                assert acc.flush()
            if feedback:
                state = acc.state_dict(rank_independent=False)
                out.setdefault("held", []).append(
                    (torch.cat([r.reshape(-1) for r in state["error_feedback_residuals"]]).cpu(),
                     state["reducer_residual_weight"]))
                if scaler is not None:
                    out.setdefault("scale", []).append(scaler.get_scale())
        out[name] = [g.cpu() for g in opt.seen]
        acc.close()
    return out
