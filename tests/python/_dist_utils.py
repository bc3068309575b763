"""Multi-process helpers for test_distributed.py.

`run_job(name, world_size, out_dir, **kwargs)` starts `world_size` processes,
joins them into a Gloo process group on loopback (a free TCP port) and runs the
job `JOBS[name](rank, world_size, **kwargs)` on every rank. Each rank saves the
dict its job returns with torch.save; the parent gets the list of them, one per
rank, and makes the assertions. A hang fails: collectives time out
(`pg_timeout`) and the parent kills whatever is still running after `timeout`.

Jobs live in importable modules (`_distributed_jobs.py` for test_distributed.py,
`_<topic>_jobs.py` for the others; `run_job(..., module=...)` names it) because
spawned processes import them by name. The data, the models and the one-process
references are here, so that the parent and the workers build exactly the same
ones.
"""
import contextlib
import os
import socket
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp
import torch.nn as nn

DEFAULT_PG_TIMEOUT = 60  # seconds a collective may wait before it fails


# --------------------------------------------------------------------------- #
# Spawning
# --------------------------------------------------------------------------- #

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_example(script, *args, timeout=150):
    """examples/python/`script` under torchrun (2 ranks, Gloo on loopback);
    its stdout. A hang or a non-zero exit fails the test, with the output."""
    import subprocess
    import sys
    from pathlib import Path

    import pytest

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(repo / "examples" / "python" / script), *map(str, args)]
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun hung: {e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


# Ranks are forked from a server that has imported torch and gradaccum once
# (multiprocessing's "forkserver", started at the first launch): importing
# them took about 2 s of CPU per rank with "spawn", about a quarter of the
# suite's time on two cores. The server is a fresh interpreter with no
# threads, no process group and no CUDA. Each rank's os.environ is the
# launching test's; what is read at process start or at import (MALLOC_*,
# LD_*, OMP_* at libgomp's load, TORCH_DISTRIBUTED_DEBUG) is the server's, as
# the first launch found it: a job that needs such a setting makes it itself.
# GRADACCUM_TEST_SPAWN=1 spawns every rank afresh instead.
_PRELOAD = ["torch", "torch.distributed", "gradaccum", "_dist_utils"]


def _start_method():
    if os.environ.get("GRADACCUM_TEST_SPAWN") == "1":
        return "spawn"
    import multiprocessing
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    return "forkserver"


def _entry(rank, world_size, port, name, out_dir, pg_timeout, backend, kwargs, module=None, env=None):
    import faulthandler

    faulthandler.enable()  # a rank that crashes says where (the test shows its stderr)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    if module:  # jobs registered by another test module
        import importlib
        importlib.import_module(module)

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout),
    )
    try:
        result = JOBS[name](rank, world_size, **kwargs)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # The job ran and its result is saved: leave without the interpreter's
    # teardown. A rare worker abort ("terminate called without an active
    # exception", once in several suite runs; cause not found) is suspected to
    # come from there. A job that fails still raises above and fails the test.
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_job(name, world_size, out_dir, *, timeout=150, pg_timeout=DEFAULT_PG_TIMEOUT,
            backend="gloo", module=None, allow_death=False, **kwargs):
    """Runs JOBS[name] on `world_size` ranks (Gloo unless `backend` says
    otherwise); returns their results by rank. `module` names the module that
    registers the job (imported by every rank). With `allow_death`, a rank that
    dies (a test that kills one) gives None instead of failing the run."""
    if module:
        import importlib
        importlib.import_module(module)
    assert name in JOBS, name
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    ctx = mp.start_processes(
        _entry,
        args=(world_size, free_port(), name, out_dir, pg_timeout, backend, kwargs, module, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method=_start_method(),
    )
    deadline = time.monotonic() + timeout
    if allow_death:
        while any(p.is_alive() for p in ctx.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
    while not allow_death and not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            alive = [p.pid for p in ctx.processes if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise TimeoutError(f"job {name!r} on {world_size} ranks still running after {timeout} s "
                               f"(processes {alive} killed): a hang")
    if allow_death:
        alive = [p.pid for p in ctx.processes if p.is_alive()]
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        if alive:
            raise TimeoutError(f"job {name!r}: processes {alive} still running after {timeout} s: a hang")
    results = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.pt")
        if allow_death and not os.path.exists(path):
            results.append(None)
        else:
            results.append(torch.load(path, weights_only=True))
    return results


class Boom(torch.autograd.Function):
    """Identity forward; its backward raises (a failed micro-step)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(f"injected failure on rank {torch.distributed.get_rank()}")


JOBS = {}


def job(fn):
    JOBS[fn.__name__] = fn
    return fn


# --------------------------------------------------------------------------- #
# Models, data, losses
# --------------------------------------------------------------------------- #

D_IN, D_HID, D_OUT, TOKENS = 5, 12, 3, 6


def mlp(seed, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, D_HID), nn.Tanh(),
        nn.Linear(D_HID, D_HID), nn.Tanh(),
        nn.Linear(D_HID, D_OUT),
    ).to(dtype)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "plain_sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise ValueError(name)


def make_windows(seed, counts, micro_batch, dtype=torch.float64):
    """Synthetic token data: windows[w][r] is the list of rank r's micro-batches
    in window w; `counts[w][r]` says how many (K for a full window).

    A micro-batch is (x [B, T, D_IN], y [B, T, D_OUT], mask [B, T]); every
    sample has a random number (1..T) of valid tokens, so item counts differ
    between micro-batches and ranks.
    """
    g = torch.Generator().manual_seed(seed)
    windows = []
    for per_rank in counts:
        window = []
        for n in per_rank:
            micro = []
            for _ in range(n):
                x = torch.randn(micro_batch, TOKENS, D_IN, generator=g, dtype=dtype)
                y = torch.randn(micro_batch, TOKENS, D_OUT, generator=g, dtype=dtype)
                lengths = torch.randint(1, TOKENS + 1, (micro_batch,), generator=g)
                mask = torch.arange(TOKENS)[None, :] < lengths[:, None]
                micro.append((x, y, mask))
            window.append(micro)
        windows.append(window)
    return windows


def windows_reference(seed, windows, reduction, *, optimizer="sgd", skip=(), max_norm=None, losses=None):
    """One process, float64: mlp(seed) stepped on each of `windows`' big
    batches, but those whose index is in `skip` (dropped windows); with
    `max_norm`, each big batch's gradient clipped by clip_grad_norm_. The
    final parameters; `losses`, a list, gets each window's big-batch loss
    before its step (None for a skipped one)."""
    model = mlp(seed)
    opt = make_optimizer(optimizer, model.parameters())
    for w, window in enumerate(windows):
        if w in skip:
            if losses is not None:
                losses.append(None)
            continue
        loss = global_batch_loss(model, window, reduction)
        if losses is not None:
            losses.append(loss.item())
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params(model)


def full_counts(n_windows, world_size, steps):
    return [[steps] * world_size for _ in range(n_windows)]


def micro_loss(model, batch, reduction):
    """(loss, num_items) of one micro-batch, as a data-parallel rank computes it."""
    x, y, mask = batch
    err = (model(x) - y).pow(2)
    if reduction == "mean":
        return err.mean(), None
    if reduction == "sum":
        return err.sum(), None
    per_token = err.sum(-1)
    return (per_token * mask).sum(), int(mask.sum())


def global_batch_loss(model, window, reduction):
    """The loss of the whole global batch (every rank's micro-batches of the
    window, concatenated), computed by one process in one forward."""
    parts = [b for micro in window for b in micro]
    x = torch.cat([b[0] for b in parts])
    y = torch.cat([b[1] for b in parts])
    mask = torch.cat([b[2] for b in parts])
    err = (model(x) - y).pow(2)
    if reduction == "mean":
        return err.mean()  # equal micro-batches: the mean of the micro-batch means
    if reduction == "sum":
        return err.sum()
    return (err.sum(-1) * mask).sum() / mask.sum()


def grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def assert_params_close(got, expected, what, tol=1e-12):
    """Each parameter within `tol`, relative to max(1, its largest value)."""
    for i, (a, e) in enumerate(zip(got, expected)):
        diff = (a - e).abs().max().item() / max(1.0, e.abs().max().item())
        assert diff <= tol, f"{what}: parameter {i} differs by {diff:.3g}"


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def reference_run(model, optimizer, windows, reduction):
    """One process, one backward on each window's global batch, one step."""
    window_grads = []
    for window in windows:
        global_batch_loss(model, window, reduction).backward()
        window_grads.append(grads(model))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"grads": window_grads, "params": params(model)}


# --------------------------------------------------------------------------- #
# Shared by several job modules
# --------------------------------------------------------------------------- #

@contextlib.contextmanager
def launch_env(**values):
    """The named environment variables as a launcher would set them (None:
    unset) for the block, restored after it."""
    def put(settings):
        for n, v in settings.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v

    saved = {n: os.environ.get(n) for n in values}
    try:
        put(values)
        yield
    finally:
        put(saved)


def bn_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _bucket_view_report(model, acc):
    """Per bucket: the storages and sizes of its parameters' .grad."""
    ps = list(model.parameters())
    report = []
    for bucket in acc.bucket_indices:
        gs = [ps[i].grad for i in bucket]
        report.append({
            "defined": [g is not None for g in gs],
            "storage": [g.untyped_storage().data_ptr() if g is not None else -1 for g in gs],
            "nbytes": [g.untyped_storage().nbytes() if g is not None else -1 for g in gs],
            "numel": sum(ps[i].numel() for i in bucket),
            "n": len(bucket),
            "itemsize": ps[bucket[0]].element_size(),
        })
    return report
