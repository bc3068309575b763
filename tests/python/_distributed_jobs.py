"""The jobs of test_distributed.py (and test_gpu.py's CUDA twin): each runs on
every rank of a `_dist_utils.run_job(name, ..., module="_distributed_jobs")`
and returns plain data for the parent to check."""
import time

import torch
import torch.nn as nn

from _dist_utils import (
    D_HID, D_IN, D_OUT, TOKENS, JOBS, _bucket_view_report, bn_model, full_counts, grads, job, launch_env, make_optimizer,
    make_windows, micro_loss, mlp, params, reference_run)


def _accumulate(rank, model, acc, windows, reduction, flush_last=False):
    """Feeds this rank's micro-batches; records each window's reduced gradient."""
    window_grads, stepped = [], []
    for w, window in enumerate(windows):
        for batch in window[rank]:
            loss, n = micro_loss(model, batch, reduction)
            acc.backward(loss, num_items=n)
            if acc.window_ready:
                window_grads.append(grads(model))
            stepped.append(("step", acc.step()))
        if flush_last and w == len(windows) - 1:
            stepped.append(("flush", acc.flush()))
    return window_grads, stepped


@job
def equivalence(rank, world_size, *, configs, seed, n_windows, steps, micro_batch):
    import gradaccum

    windows = make_windows(seed, full_counts(n_windows, world_size, steps), micro_batch)
    out = {}
    for opt_name, reduction, as_view in configs:
        model = mlp(seed)
        opt = make_optimizer(opt_name, model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=steps, reduction=reduction,
                                    bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005,
                                    gradient_as_bucket_view=as_view)
        window_grads, _ = _accumulate(rank, model, acc, windows, reduction)
        out[f"{opt_name}/{reduction}/{as_view}"] = {
            "grads": window_grads, "params": params(model), "stats": acc.stats(),
            "buckets": len(acc.bucket_indices),
        }
    return out


def _ddp_batches(seed, rank, n_windows, steps, micro_batch):
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return [[(torch.randn(micro_batch, TOKENS, D_IN, generator=g),
              torch.randn(micro_batch, TOKENS, D_OUT, generator=g))
             for _ in range(steps)] for _ in range(n_windows)]


@job
def ddp(rank, world_size, *, seed, n_windows, steps, micro_batch):
    """torch DDP + no_sync vs gradaccum (Accumulator.backward, and manual
    no_sync + loss.backward()), float32, copy and bucket-view modes."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import gradaccum

    batches = _ddp_batches(seed, rank, n_windows, steps, micro_batch)
    mse = nn.functional.mse_loss
    out = {}

    for as_view in (False, True):
        model = mlp(seed, torch.float32)
        ddp_model = DDP(model, gradient_as_bucket_view=as_view)
        opt = make_optimizer("sgd", ddp_model.parameters())
        trace = []
        for window in batches:
            for k, (x, y) in enumerate(window):
                if k < steps - 1:
                    with ddp_model.no_sync():
                        (mse(ddp_model(x), y) / steps).backward()
                else:
                    (mse(ddp_model(x), y) / steps).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            trace.append(params(model))
        out[f"torch_ddp/{as_view}"] = trace

    for as_view in (False, True):
        # gradaccum.Accumulator.backward / step
        model = mlp(seed, torch.float32)
        opt = make_optimizer("sgd", model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=steps, reduction="mean",
                                    bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005,
                                    gradient_as_bucket_view=as_view)
        trace, views = [], []
        for w, window in enumerate(batches):
            for k, (x, y) in enumerate(window):
                acc.backward(mse(model(x), y))
                if w == 0 and k == 0:
                    views.append(("micro_step_1", _bucket_view_report(model, acc)))
                if acc.window_ready:
                    views.append((f"window_{w}_reduced", _bucket_view_report(model, acc)))
                acc.step()
            trace.append(params(model))
        views.append(("after_step", _bucket_view_report(model, acc)))
        out[f"gradaccum/{as_view}"] = trace
        out[f"views/{as_view}"] = views
        out[f"buckets/{as_view}"] = [list(b) for b in acc.bucket_indices]

        # Manual, DDP-style: acc.no_sync() + loss.backward() + optimizer.step()
        model = mlp(seed, torch.float32)
        opt = make_optimizer("sgd", model.parameters())
        acc = gradaccum.Accumulator(model, None, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005,
                                    gradient_as_bucket_view=as_view)
        trace, views = [], []
        for w, window in enumerate(batches):
            for k, (x, y) in enumerate(window):
                if k < steps - 1:
                    with acc.no_sync():
                        (mse(model(x), y) / steps).backward()
                    views.append((f"window_{w}_no_sync_{k}", _bucket_view_report(model, acc)))
                else:
                    (mse(model(x), y) / steps).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            trace.append(params(model))
        out[f"manual/{as_view}"] = trace
        out[f"manual_views/{as_view}"] = views
        out[f"manual_stats/{as_view}"] = acc.stats()
    dist.barrier()
    return out


def _count_allreduces(fn):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "gloo:all_reduce")


@job
def collectives(rank, world_size, *, seed, step_counts, n_windows):
    """All-reduces per micro-step, counted by torch.profiler, and stats()."""
    import gradaccum

    out = {}
    g = torch.Generator().manual_seed(seed + rank)
    for steps in step_counts:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                              nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
        opt = make_optimizer("sgd", model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=steps, bucket_cap_mb=0.01,
                                    first_bucket_cap_mb=0.01)
        record = {"buckets_init": acc.stats()["buckets"],
                  "bucket_indices": [list(b) for b in acc.bucket_indices],
                  "windows": []}
        ps = list(model.parameters())
        record["bucket_sizes"] = [[ps[i].numel() for i in b] for b in acc.bucket_indices]
        for _ in range(n_windows):
            before = acc.stats()
            counts = []
            for _ in range(steps):
                x = torch.randn(4, 16, generator=g)
                counts.append(_count_allreduces(lambda: acc.backward(model(x).pow(2).mean())))
            after_backward = acc.stats()
            step_count = _count_allreduces(acc.step)
            record["windows"].append({"counts": counts, "step_count": step_count,
                                      "before": before, "after": after_backward})
        # Manual mode: a no_sync backward reduces nothing, a plain one every bucket.
        x = torch.randn(4, 16, generator=g)
        with acc.no_sync():
            record["no_sync_count"] = _count_allreduces(lambda: model(x).pow(2).mean().backward())
        record["plain_count"] = _count_allreduces(lambda: model(x).pow(2).mean().backward())
        record["final"] = acc.stats()
        out[steps] = record
    return out


@job
def default_caps(rank, world_size):
    """The buckets an unset bucket_cap_mb builds, against an explicit 25 MiB:
    32 layers whose weights are 2 MiB each (64 MiB in all), and a tiny model;
    launched across two hosts (LOCAL_WORLD_SIZE=1), on one (LOCAL_WORLD_SIZE
    = WORLD_SIZE) and by a launch that does not say; all-reduces of one window
    counted by torch.profiler; the window's reduced gradient of the last and
    first layers, and this rank's own (plain autograd)."""
    import gradaccum

    def layers():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 1024, bias=False) if i % 2 == 0 else
                                nn.Linear(1024, 512, bias=False) for i in range(32)])
        with torch.no_grad():  # variance-preserving, so 32 layers leave gradients of O(1)
            for layer in model:
                layer.weight.normal_(0.0, layer.in_features ** -0.5)
        return model

    def tiny():
        torch.manual_seed(0)
        return nn.Linear(4, 2)

    ws = str(world_size)
    two_hosts = {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": ws}
    out = {}
    for name, make, caps, env in (
            ("default", layers, {}, two_hosts),
            ("unsaid", layers, {}, {"LOCAL_WORLD_SIZE": None, "WORLD_SIZE": None}),
            ("one_host", layers, {}, {"LOCAL_WORLD_SIZE": ws, "WORLD_SIZE": ws}),
            ("explicit25", layers, {"bucket_cap_mb": 25.0}, two_hosts),
            ("one_host_explicit4", layers, {"bucket_cap_mb": 4.0}, {"LOCAL_WORLD_SIZE": ws, "WORLD_SIZE": ws}),
            ("tiny", tiny, {}, two_hosts)):
        model = make()
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(2, 4 if name == "tiny" else 512, generator=g)
        model(x).pow(2).mean().backward()
        ends = (0, -1)
        local = [list(model.parameters())[i].grad.clone() for i in ends]
        model.zero_grad(set_to_none=True)
        with launch_env(**env):
            acc = gradaccum.Accumulator(model, None, steps=2, **caps)
        acc.backward(model(x).pow(2).mean())  # a no-sync micro-step: no all-reduce
        counts = _count_allreduces(lambda: acc.backward(model(x).pow(2).mean()))
        out[name] = {"bucket_indices": [list(b) for b in acc.bucket_indices], "counts": counts,
                     "local": local, "reduced": [list(model.parameters())[i].grad.clone() for i in ends]}
        del acc
    return out


class Branchy(nn.Module):
    """A trunk and head used always; branches used conditionally."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(D_IN, D_HID)
        self.head = nn.Linear(D_HID, D_OUT)
        self.rank_branch = nn.Linear(D_HID, D_OUT)   # used on one rank only
        self.micro_branch = nn.Linear(D_HID, D_OUT)  # used in some micro-steps only
        self.dead = nn.Linear(D_HID, D_OUT)          # never used

    def forward(self, x, use_rank_branch, use_micro_branch):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        if use_rank_branch:
            out = out + self.rank_branch(h)
        if use_micro_branch:
            out = out + self.micro_branch(h)
        return out


def branchy(seed):
    torch.manual_seed(seed)
    return Branchy().double()


def branch_flags(w, r, k, world_size, steps):
    """rank_branch: only on the last rank, not in window 1 (so nowhere then);
    micro_branch: only in micro-step 0 (never the window's last), on all ranks."""
    return (r == world_size - 1 and w != 1), (k == 0)


def unused_reference(seed, world_size, steps, n_windows, micro_batch, opt_name):
    windows = make_windows(seed, full_counts(n_windows, world_size, steps), micro_batch)
    model = branchy(seed)
    opt = make_optimizer(opt_name, model.parameters())
    window_grads = []
    for w, window in enumerate(windows):
        total = 0
        for r in range(world_size):
            for k, (x, y, _) in enumerate(window[r]):
                flags = branch_flags(w, r, k, world_size, steps)
                total = total + (model(x, *flags) - y).pow(2).mean()
        (total / (world_size * steps)).backward()
        window_grads.append(grads(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"grads": window_grads, "params": params(model),
            "names": [n for n, _ in model.named_parameters()]}


@job
def unused(rank, world_size, *, seed, steps, n_windows, micro_batch, variants):
    import gradaccum

    windows = make_windows(seed, full_counts(n_windows, world_size, steps), micro_batch)
    out = {}
    for opt_name, as_view in variants:
        model = branchy(seed)
        opt = make_optimizer(opt_name, model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=steps, bucket_cap_mb=0.0005,
                                    first_bucket_cap_mb=0.0002, gradient_as_bucket_view=as_view)
        window_grads = []
        for w, window in enumerate(windows):
            for k, (x, y, _) in enumerate(window[rank]):
                flags = branch_flags(w, rank, k, world_size, steps)
                acc.backward((model(x, *flags) - y).pow(2).mean())
                if acc.window_ready:
                    window_grads.append(grads(model))
                acc.step()
        out[f"{opt_name}/{as_view}"] = {"grads": window_grads, "params": params(model),
                                        "stats": acc.stats(),
                                        "views": _bucket_view_report(model, acc)}
    return out


@job
def mismatch(rank, world_size, *, odd_rank):
    """Ranks whose models differ: every rank must raise a ValueError, quickly."""
    import torch.distributed as dist
    import gradaccum

    odd = rank == odd_rank
    cases = {
        "shape": lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 6 if odd else 5)),
        "count": lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5),
                                       *([nn.Linear(5, 5)] if odd else [])),
        "dtype": lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5)).to(
            torch.float64 if odd else torch.float32),
    }
    out = {}
    for case, build in cases.items():
        model = build()
        start = time.monotonic()
        try:
            gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
            out[case] = {"error": None, "message": "", "seconds": time.monotonic() - start}
        except Exception as e:  # noqa: BLE001 - the parent checks the type
            out[case] = {"error": type(e).__name__, "message": str(e),
                         "seconds": time.monotonic() - start}
        dist.barrier()  # the group is still usable, and every rank is here
    return out


@job
def bucket_oom(rank, world_size, *, oom_rank):
    """The reducer's buckets do not fit on `oom_rank` (its address space is
    capped just above what it uses): every rank raises, quickly; then, the cap
    lifted, every rank builds an Accumulator and steps one window alike."""
    import ctypes
    import resource
    import torch.distributed as dist
    import gradaccum

    # One malloc arena (M_ARENA_MAX): a thread of the capped rank that needs a
    # new one would fail elsewhere than in the buckets. mallopt, not
    # MALLOC_ARENA_MAX: glibc reads that at process start, the forkserver's.
    assert ctypes.CDLL(None).mallopt(-8, 1) == 1
    model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 8))  # 64 MiB of float32
    out = {}
    # Once uncapped first: what the package loads lazily maps memory too.
    small = nn.Linear(3, 2)
    gradaccum.Accumulator(small, torch.optim.SGD(small.parameters(), lr=0.1), steps=2).close()
    limits = resource.getrlimit(resource.RLIMIT_AS)
    if rank == oom_rank:
        with open("/proc/self/status") as status:
            vm_kib = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, ((vm_kib + 40 * 1024) * 1024, limits[1]))
    start = time.monotonic()
    try:
        gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2,
                              bucket_cap_mb=64, first_bucket_cap_mb=64)
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - the parent checks the type
        out["error"] = (type(e).__name__, str(e))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limits)
    out["seconds"] = time.monotonic() - start
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1)
    torch.manual_seed(rank)
    acc.backward(model(torch.randn(4, 4096)).square().mean())
    out["stepped"] = acc.step()
    out["params"] = params(model)
    dist.barrier()
    return out


@job
def suite(rank, world_size, *, parts):
    """Several jobs in one process group (spawning is the slow part).

    `parts` maps a key to (job name, kwargs). A part that raises is recorded
    as {"__error__": traceback} and the next part still runs.
    """
    import traceback

    import torch.distributed as dist

    out = {}
    for key, (name, kwargs) in parts.items():
        try:
            out[key] = JOBS[name](rank, world_size, **kwargs)
        except Exception:  # noqa: BLE001 - reported by the parent test that reads it
            out[key] = {"__error__": f"rank {rank}:\n{traceback.format_exc()}"}
        dist.barrier()
    return out


def flush_counts(n_full, world_size, steps, last):
    return full_counts(n_full, world_size, steps) + [list(last)]


@job
def flush(rank, world_size, *, seed, steps, micro_batch, scenarios):
    """Full windows, then a last partial window with per-rank counts `last`
    (some ranks fewer, maybe none); every rank calls flush() at the end."""
    import torch.distributed as dist
    import gradaccum

    out = {}
    for key, (n_full, last, reduction) in scenarios.items():
        windows = make_windows(seed, flush_counts(n_full, world_size, steps, last), micro_batch)
        model = mlp(seed)
        opt = make_optimizer("sgd", model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=steps, reduction=reduction,
                                    bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
        _, stepped = _accumulate(rank, model, acc, windows, reduction, flush_last=True)
        # Every rank issued the same collectives: one more lines up everywhere.
        check = torch.ones(1)
        dist.all_reduce(check)
        out[key] = {"params": params(model), "stepped": stepped, "stats": acc.stats(),
                    "check": float(check)}
    return out



@job
def broadcast(rank, world_size, *, steps):
    """Ranks start from different weights and buffers; rank 0's win."""
    import gradaccum

    out = {}
    for bcast in (False, True, None):  # None: the default
        model = bn_model(100 + rank)  # a different init on every rank
        with torch.no_grad():
            model[1].running_mean.fill_(float(rank + 1))
            model[1].num_batches_tracked.fill_(10 * (rank + 1))
        before = {"params": params(model), "buffers": [b.clone() for b in model.buffers()]}
        option = {} if bcast is None else {"broadcast_buffers": bcast}
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=steps, **option)
        after = {"params": params(model), "buffers": [b.clone() for b in model.buffers()]}
        # One window on rank-specific data: the BatchNorm statistics diverge.
        g = torch.Generator().manual_seed(7 + rank)
        windows = []
        for _ in range(2):
            for _ in range(steps):
                x = torch.randn(8, 6, generator=g) * (rank + 1) + rank
                acc.backward(model(x).pow(2).mean())
            windows.append({"buffers": [b.clone() for b in model.buffers()]})
            acc.step()
        out[bcast] = {"before": before, "after": after, "windows": windows,
                      "stats": acc.stats()}
    return out


@job
def close_views(rank, world_size, *, steps):
    """gradient_as_bucket_view: close() at a window boundary (after a step)
    and in the middle of a window; each .grad as close() leaves it."""
    import gradaccum

    out = {}
    windows = make_windows(21, [[2] * world_size] * 2, 4)
    for where, micro_steps in (("boundary", 2 * steps), ("mid-window", steps + 1)):
        model = mlp(21)
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=steps,
                                    gradient_as_bucket_view=True)
        batches = [b for window in windows for b in window[rank]][:micro_steps]
        for batch in batches:
            acc.backward(micro_loss(model, batch, "mean")[0])
            acc.step()
        before = [None if p.grad is None else (p.grad.clone(), p.grad.untyped_storage().data_ptr())
                  for p in model.parameters()]
        acc.close()
        out[where] = {"before": before, "after": [None if p.grad is None else
                                                  (p.grad.clone(), p.grad.untyped_storage().data_ptr())
                                                  for p in model.parameters()]}
    return out


# --------------------------------------------------------------------------- #
# GPU (tests/python/test_gpu.py; skipped without CUDA)
# --------------------------------------------------------------------------- #

@job
def cuda_equivalence(rank, world_size, *, seed, dtype_name, steps, n_windows, micro_batch):
    """Ranks on cuda:0 (NCCL at world size 1, or Gloo over CUDA tensors) against
    one process on the global batch, on the same device and dtype; all-reduces
    counted by the profiler per micro-step."""
    import gradaccum
    from torch.profiler import ProfilerActivity, profile

    device, dtype = torch.device("cuda", 0), getattr(torch, dtype_name)
    torch.cuda.set_device(device)

    def to_device(window):
        return [[tuple(t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in b)
                 for b in micro] for micro in window]

    windows = [to_device(w) for w in make_windows(seed, full_counts(n_windows, world_size, steps), micro_batch)]
    out = {}
    for reduction in ("mean", "items"):
        reference = mlp(seed).to(device, dtype)
        ref = reference_run(reference, make_optimizer("adam", reference.parameters()), windows, reduction)
        model = mlp(seed).to(device, dtype)
        acc = gradaccum.Accumulator(model, make_optimizer("adam", model.parameters()), steps=steps,
                                    reduction=reduction, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
        per_step = []
        for window in windows:
            for batch in window[rank]:
                loss, n = micro_loss(model, batch, reduction)
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    acc.backward(loss, num_items=n)
                per_step.append(sum(1 for e in prof.events() if e.name.endswith(":all_reduce")))
                acc.step()
        out[reduction] = {
            "params": [p.detach().cpu().double() for p in model.parameters()],
            "reference": [p.cpu().double() for p in ref["params"]],
            "allreduces": per_step, "buckets": len(acc.bucket_indices),
        }
    return out


@job
def resolve_by_name(rank, world_size):
    """An object that is not a ProcessGroup but names one (the binding's
    fallback through c10d's group registry) reduces like the group itself."""
    import types

    import gradaccum
    import torch.distributed as dist

    model = mlp(3)
    stand_in = types.SimpleNamespace(group_name=dist.group.WORLD.group_name)
    acc = gradaccum.Accumulator(model, None, steps=1, process_group=stand_in)
    model(torch.randn(4, D_IN, dtype=torch.float64)).sum().backward()
    return {"stats": acc.stats(), "grad_defined": model[0].weight.grad is not None}


@job
def reentrant(rank, world_size):
    """Reentrant and non-reentrant checkpointing both give the big batch's
    gradient in a synchronising backward (world size 1 here; 2 ranks in
    test_protocol.py)."""
    import gradaccum
    from torch.utils.checkpoint import checkpoint

    out = {}
    # reentrant checkpointing only differentiates when an input requires grad
    x = torch.randn(4, D_IN, dtype=torch.float64, requires_grad=True)
    for reentrant_ in (True, False):
        model = mlp(3)
        ref = mlp(3)
        acc = gradaccum.Accumulator(model, None, steps=2)

        def loss_of(m):
            h = checkpoint(m[0], x, use_reentrant=reentrant_)
            return m[4](m[3](m[2](m[1](h)))).pow(2).mean()

        try:
            for _ in range(2):
                acc.backward(loss_of(model))
            out[reentrant_] = None
            loss_of(ref).backward()  # the window's mean of two equal losses
            out[f"match/{reentrant_}"] = all(
                torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14)
                for p, q in zip(model.parameters(), ref.parameters()))
        except RuntimeError as e:
            out[reentrant_] = str(e)
    return out
