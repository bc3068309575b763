"""Jobs of test_mixed_precision.py that need real Gloo ranks: fp32 accumulation
of bf16 gradients, half-precision wires (bf16/fp16 buckets, comm_dtype), error
feedback, their checkpoints.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_mixed_jobs") and returns plain data; the parent checks it against a
float64 reference or an fp32-communication run.
"""
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist_utils import job


def _allreduce_count(fn):
    """(all-reduces, elements handed to them), counted by torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    events = [e for e in prof.events() if e.name.endswith(":all_reduce")]  # gloo: or nccl:
    return len(events), sum(e.input_shapes[0][0] for e in events)


def _lo_tx_bytes():
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def _mlp(seed, dtype):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 8)).to(dtype)


# (name, parameter dtype, accumulate_dtype, comm_dtype)
HALF_CASES = [
    ("bf16", torch.bfloat16, None, None),
    ("fp16", torch.float16, None, None),
    ("fp32->bf16", torch.float32, None, torch.bfloat16),
    ("fp32->fp16", torch.float32, None, torch.float16),
    ("bf16+fp32->bf16", torch.bfloat16, torch.float32, torch.bfloat16),
]


@job
def half_wire(rank, world_size, *, seed, steps, device="cpu"):
    """One "items" window with fractional, uneven num_items on each rank, for
    each half-precision wire: all-reduces per window (profiler), buckets, the
    window gradient, and this rank's float64 reference sums (on the CPU)."""
    import gradaccum

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    g = torch.Generator().manual_seed(seed + 11 * rank)
    batches = [(torch.randn(6, 16, generator=g), torch.randn(6, 8, generator=g),
                2.5 + rank + 0.25 * k) for k in range(steps)]
    reference = _mlp(seed, torch.float64)
    for x, y, _ in batches:
        (reference(x.double()) - y.double()).pow(2).sum().backward()
    out = {"ref_sum": [p.grad.clone() for p in reference.parameters()],
           "items": sum(n for _, _, n in batches)}
    for name, dtype, wide, comm in HALF_CASES:
        model = _mlp(seed, dtype).to(device)
        acc = gradaccum.Accumulator(model, None, steps=steps, reduction="items",
                                    accumulate_dtype=wide, comm_dtype=comm,
                                    bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)

        def window():
            for x, y, n in batches:
                acc.backward((model(x.to(device, dtype)).float() - y.to(device)).pow(2).sum(), num_items=n)

        count, _ = _allreduce_count(window)
        stats = acc.stats()
        out[name] = {"allreduces": count, "buckets": stats["buckets"],
                     "collectives": stats["last_window_collectives"],
                     "grads": [p.grad.double().cpu() for p in model.parameters()]}
        acc.close()
    return out


@job
def comm_bytes(rank, world_size, *, seed, device="cpu"):
    """The same window sent in float32, bf16 and fp16: bytes by stats, by the
    profiler's element counts and by the loopback interface's own counter
    (Gloo: CUDA tensors travel through the host too)."""
    import gradaccum

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 256), nn.Tanh(),
                          nn.Linear(256, 64)).to(device)
    g = torch.Generator().manual_seed(seed + rank)
    batches = [torch.randn(16, 256, generator=g).to(device) for _ in range(2)]
    out = {}
    for comm in (None, torch.bfloat16, torch.float16):
        model.zero_grad(set_to_none=True)
        acc = gradaccum.Accumulator(model, None, steps=2, comm_dtype=comm)

        def window():
            for x in batches:
                acc.backward(model(x).pow(2).mean())

        dist.barrier()
        before = _lo_tx_bytes()
        count, elements = _allreduce_count(window)
        dist.barrier()
        out[str(comm)] = {"lo_bytes": _lo_tx_bytes() - before, "allreduces": count,
                          "elements": elements, "bytes": acc.stats()["last_window_bytes"],
                          "buckets": acc.stats()["buckets"],
                          "grads": [p.grad.cpu() for p in model.parameters()]}
        acc.close()
    return out


@job
def fp16_headroom(rank, world_size, *, seed, steps):
    """Micro-step gradients near 5000: the window's local sum (steps * 5000)
    is past fp16's 65504, the scaled one is not."""
    import gradaccum

    out = {}
    for comm in (None, torch.float16):
        torch.manual_seed(seed)
        model = nn.Linear(4, 4)
        acc = gradaccum.Accumulator(model, None, steps=steps, comm_dtype=comm)
        g = torch.Generator().manual_seed(seed + rank)
        for _ in range(steps):
            x = 0.5 + torch.rand(8, 4, generator=g)
            acc.backward(5000.0 * model(x).sum() / 8)
        out[str(comm)] = [p.grad.clone() for p in model.parameters()]
        acc.close()
    return out


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
def comm_dtype_mismatch(rank, world_size):
    import gradaccum

    model = nn.Linear(4, 4)
    try:
        gradaccum.Accumulator(model, None, steps=2,
                              comm_dtype=torch.bfloat16 if rank == 0 else None)
    except ValueError as e:
        return str(e)
    return None


class _Sandwich(nn.Module):
    """float32 layers around a bf16 one: with small buckets the bf16 (wide,
    accumulate_dtype) bucket sits between float32 ones."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32).to(torch.bfloat16)
        self.c = nn.Linear(32, 8)

    def forward(self, x):
        return self.c(self.b(self.a(x.float()).bfloat16()).float())


@job
def accumulate_checkpoint(rank, world_size, *, seed, steps, save_at, sandwich=False, device="cpu"):
    """bf16 parameters summed in float32, saved in the middle of a window
    (rank-independent and per-rank) and resumed in a fresh Accumulator: the
    window's gradient equals the uninterrupted one's."""
    import copy

    import gradaccum

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    g = torch.Generator().manual_seed(seed + 5 * rank)
    batches = [(torch.randn(8, 16, generator=g).to(device), torch.randn(8, 8, generator=g).to(device))
               for _ in range(steps)]
    group = None if world_size > 1 else False

    def make():
        model = (_Sandwich(seed) if sandwich else _mlp(seed, torch.bfloat16)).to(device)
        return model, gradaccum.Accumulator(model, None, steps=steps, accumulate_dtype=torch.float32,
                                            process_group=group, bucket_cap_mb=0.001,
                                            first_bucket_cap_mb=0.001)

    def micro(model, acc, batch):
        x, y = batch
        acc.backward((model(x.to(torch.bfloat16)).float() - y).pow(2).mean())

    out = {}
    model, acc = make()
    for b in batches[:save_at]:
        micro(model, acc, b)
    states = {"independent": copy.deepcopy(acc.state_dict()),
              "per_rank": copy.deepcopy(acc.state_dict(rank_independent=False))}
    out["saved_dtypes"] = sorted({str(t.dtype) for t in states["independent"]["grads"] if t is not None})
    out["saved_devices"] = sorted({str(t.device) for t in states["independent"]["grads"] if t is not None})
    out["buckets"] = acc.bucket_indices
    for b in batches[save_at:]:
        micro(model, acc, b)
    out["uninterrupted"] = [p.grad.cpu() for p in model.parameters()]
    acc.close()
    for kind, state in states.items():
        model, acc = make()
        acc.load_state_dict(state)
        for b in batches[save_at:]:
            micro(model, acc, b)
        out[kind] = [p.grad.cpu() for p in model.parameters()]
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


@job
def weight_too_large(rank, world_size):
    """A window weight beyond what bf16 meta digits carry, on rank 0 only:
    every rank drops the window with the same error, and training goes on."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    acc = gradaccum.Accumulator(model, None, steps=1, reduction="items")
    x = torch.ones(3, 4, dtype=torch.bfloat16)
    out = {}
    try:
        acc.backward(model(x).float().sum(), num_items=3e9 if rank == 0 else 3)
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    acc.backward(model(x).float().sum(), num_items=3)
    out["after"] = model.weight.grad.float().clone()
    out["dropped"] = acc.stats()["dropped_windows"]
    return out


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
def tiny_items_weight(rank, world_size, *, comm_dtype, num_items):
    """reduction="items" where rank 0's window weight is `num_items`, far
    below one item (the others count 1)."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    acc = gradaccum.Accumulator(model, None, steps=1, reduction="items",
                                comm_dtype=getattr(torch, comm_dtype) if comm_dtype else None)
    x = torch.ones(2, 3) * (rank + 1)
    out = {}
    try:
        acc.backward(model(x).sum(), num_items=num_items if rank == 0 else 1.0)
        out["grad"] = model.weight.grad.clone()
    except RuntimeError as e:
        out["error"] = str(e)
        out["grad_none"] = model.weight.grad is None
    acc.zero_grad()
    acc.backward(model(x).sum(), num_items=1.0)  # the next window goes on
    out["next"] = model.weight.grad.clone()
    out["dropped"] = acc.stats()["dropped_windows"]
    return out


@job
def items_wire_resume(rank, world_size, *, comm_dtype):
    """reduction="items" over a prescaled half-precision wire with error
    feedback: a per-rank state saved at a window boundary resumes bit for bit
    (the prescale is the last full window's global weight, kept in the state,
    and so are the residuals and the weight of the window they are from; the
    windows' weights differ). Learning rate 0: a new model is the same one."""
    import copy

    import gradaccum

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))

    g = torch.Generator().manual_seed(rank)
    data = [[(torch.randn(5, 6, generator=g), int(torch.randint(20, 60, (1,), generator=g)))
             for _ in range(2)] for _ in range(3)]

    def window(model, acc, micro):
        for x, n in micro:
            acc.backward(model(x).pow(2).sum(), num_items=n)
        grads = [p.grad.clone() for p in model.parameters()]
        assert acc.step()  # a stepped window keeps its residuals (zero_grad() would drop them)
        return grads

    dtype = getattr(torch, comm_dtype)
    model = make()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2,
                                reduction="items", comm_dtype=dtype, error_feedback=True)
    window(model, acc, data[0])
    window(model, acc, data[1])
    state = copy.deepcopy(acc.state_dict(rank_independent=False))
    uninterrupted = window(model, acc, data[2])
    acc.close()
    model = make()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2,
                                reduction="items", comm_dtype=dtype, error_feedback=True)
    acc.load_state_dict(state)
    return {"uninterrupted": uninterrupted, "resumed": window(model, acc, data[2]),
            "last_weight": state["reducer_last_weight"],
            "residual": max(float(r.abs().max()) for r in state["error_feedback_residuals"]),
            "weights": (state["reducer_residual_weight"], float(acc.window_items))}


# --------------------------------------------------------------------------- #
# Issue 9: fp32 accumulation of bf16 gradients
# --------------------------------------------------------------------------- #

def bf16_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16)


def bf16_batches(seed, rank, steps, device="cpu"):
    g = torch.Generator().manual_seed(seed + 7 * rank)
    return [(torch.randn(8, 16, generator=g).to(device, torch.bfloat16),
             torch.randn(8, 4, generator=g).to(device, torch.bfloat16)) for _ in range(steps)]


def bf16_micro_grads(seed, batches, device="cpu"):
    """Each micro-batch's own bf16 gradient, computed alone (on `device`: its
    kernels round as the Accumulator's run on it does)."""
    model = bf16_model(seed).to(device)
    out = []
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        (model(x).float() - y.float()).pow(2).mean().backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


@job
def bf16_window(rank, world_size, *, seed, steps, device="cpu", use_group=False):
    """One window of `steps` micro-batches through the Accumulator, with and
    without fp32 accumulation; returns the window gradients and every rank's
    per-micro-batch bf16 gradients for the parent's reference (on the host).
    One rank reduces through its group only with `use_group` (NCCL at world
    size 1), else locally."""
    import gradaccum

    if device != "cpu":
        torch.cuda.set_device(torch.device(device))
    batches = bf16_batches(seed, rank, steps, device)
    out = {"micro": [[g.cpu() for g in m] for m in bf16_micro_grads(seed, batches, device)]}
    for wide in (None, torch.float32):
        model = bf16_model(seed).to(device)
        acc = gradaccum.Accumulator(model, None, steps=steps, accumulate_dtype=wide,
                                    process_group=None if world_size > 1 or use_group else False)
        for i, (x, y) in enumerate(batches):
            acc.backward((model(x).float() - y.float()).pow(2).mean())
            if wide is not None and i < steps - 1:
                assert all(p.grad is None for p in model.parameters()), "released between micro-steps"
        out[str(wide)] = [p.grad.cpu() for p in model.parameters()]
        out[f"collectives/{wide}"] = acc.stats()["last_window_collectives"]
        out[f"buckets/{wide}"] = acc.stats()["buckets"]
        acc.close()
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


@job
def light_fp16_window(rank, world_size, *, comm_dtype, steps, flush_after):
    """One full window of `steps` micro-batches, then a window of
    `flush_after` closed by flush(): far lighter than the wire's scale
    (world * steps). Returns what this rank wrote to its stderr (fd 2)
    during the flush, and the flushed window's gradient with a float64
    reference of it."""
    import os
    import tempfile

    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    dtype = getattr(torch, comm_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(model.weight.grad.double().clone()))
    acc = gradaccum.Accumulator(model, opt, steps=steps, comm_dtype=dtype)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(steps):
        acc.backward(model(torch.randn(4, 8, generator=g)).pow(2).mean() * 1e-3)
    acc.step()
    batches = [torch.randn(4, 8, generator=g) for _ in range(flush_after)]
    for x in batches:
        acc.backward(model(x).pow(2).mean() * 1e-3)
    stderr = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            acc.flush()
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    got = seen[-1]
    # float64 reference of the flushed window: every rank's micro-batches
    ref_model = nn.Linear(8, 4).double()
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    mine = torch.stack(batches).double()
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    total = sum(ref_model(x).pow(2).mean() * 1e-3 for xs in every for x in xs)
    (total / (world_size * flush_after)).backward()
    acc.close()
    return {"stderr": text, "got": got, "ref": ref_model.weight.grad.clone()}
