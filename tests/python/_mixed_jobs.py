"""Jobs of test_mixed_precision.py that need real Gloo ranks: fp32 accumulation
of bf16 gradients, half-precision wires (bf16/fp16 buckets, comm_dtype), their
checkpoints (error feedback's jobs: _error_feedback_jobs.py).

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
def light_fp16_window(rank, world_size, *, comm_dtype, steps, flush_after, reduction="mean", error_feedback=False):
    """One full window of `steps` micro-batches, then a window of
    `flush_after` closed by flush(): far lighter than the wire's scale
    (world * steps). With reduction "items", every micro-batch counts
    4096 items in the full window and 1 in the light one (the light window
    is then closed by step(), flush_after == steps). Returns the warnings
    the light window issued, each window's all-reduces, and the light
    window's gradient with a float64 reference of it."""
    import warnings

    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    dtype = getattr(torch, comm_dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    opt.register_step_pre_hook(lambda *_: seen.append(model.weight.grad.double().clone()))
    acc = gradaccum.Accumulator(model, opt, steps=steps, comm_dtype=dtype, reduction=reduction,
                                error_feedback=error_feedback)
    g = torch.Generator().manual_seed(10 + rank)

    def micro(x, items):
        loss = model(x).pow(2).mean() * 1e-3
        if reduction == "items":
            acc.backward(loss * items, num_items=items)
        else:
            acc.backward(loss)

    for _ in range(steps):
        micro(torch.randn(4, 8, generator=g), 4096)
    acc.step()
    full = acc.stats()["last_window_collectives"]
    batches = [torch.randn(4, 8, generator=g) for _ in range(flush_after)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in batches:
            micro(x, 1)
        assert acc.flush() if flush_after < steps else acc.step()
    text = "\n".join(f"{w.category.__name__}: {w.message}" for w in caught)
    got = seen[-1]
    # float64 reference of the light window: every rank's micro-batches
    ref_model = nn.Linear(8, 4).double()
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    mine = torch.stack(batches).double()
    every = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    total = sum(ref_model(x).pow(2).mean() * 1e-3 for xs in every for x in xs)
    (total / (world_size * flush_after)).backward()
    out = {"warnings": text, "got": got, "ref": ref_model.weight.grad.clone(), "full": full,
           "light": acc.stats()["last_window_collectives"], "buckets": acc.stats()["buckets"]}
    acc.close()
    return out


@job
def manual_path_fp16(rank, world_size, *, steps, divided, acc_steps=None, items_before=False):
    """The manual path (acc.no_sync() for all but the last micro-batch, then
    a plain loss.backward()) with an fp16 wire and `steps` set; each
    micro-batch's loss divided by `steps` (`divided`) or not, its gradient
    near 5000 then; the Accumulator built with `acc_steps` (default:
    `steps`). `items_before`: reduction "items", after an acc.backward()
    window of 4096 items per micro-batch. Returns the reduced gradient, a
    float64 reference of it, and the reduction's all-reduces."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    ref_model = nn.Linear(8, 4).double()
    ref_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0) if items_before else None,
                                steps=acc_steps or steps, comm_dtype=torch.float16,
                                reduction="items" if items_before else "mean")
    g = torch.Generator().manual_seed(10 + rank)
    if items_before:
        for _ in range(acc_steps or steps):
            acc.backward(model(torch.randn(4, 8, generator=g)).pow(2).sum() * 1e-3, num_items=4096)
        assert acc.step()
    batches = torch.stack([torch.randn(4, 8, generator=g) for _ in range(steps)])
    scale = 1e-3 / steps if divided else 3e4

    def micro(m, x):
        return m(x).pow(2).mean() * scale

    for k, x in enumerate(batches):
        if k < steps - 1:
            with acc.no_sync():
                micro(model, x).backward()
        else:
            micro(model, x).backward()
    every = [torch.empty_like(batches) for _ in range(world_size)]
    dist.all_gather(every, batches)
    sum(micro(ref_model, x.double()) for x in batches).backward()
    local = float(ref_model.weight.grad.abs().max())  # this rank's sum before the reduction
    ref_model.zero_grad()
    (sum(micro(ref_model, x.double()) for xs in every for x in xs) / world_size).backward()
    out = {"got": model.weight.grad.double().clone(), "ref": ref_model.weight.grad.clone(), "local": local,
           "collectives": acc.stats()["last_window_collectives"], "buckets": acc.stats()["buckets"]}
    acc.close()
    return out
