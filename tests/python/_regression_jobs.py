"""Jobs of test_protocol.py that reproduce defects found by review: each used
to mis-pair collectives, wedge, diverge or crash on real Gloo ranks (spawned by
_dist_utils.run_job with module="_regression_jobs")."""
import time

import torch
import torch.nn as nn

import _dist_utils as du
from _dist_utils import job


def _try(errors, tag, fn):
    start = time.monotonic()
    try:
        return fn()
    except Exception as e:  # noqa
        errors.append((tag, type(e).__name__, str(e).split("\n")[0][:300], round(time.monotonic() - start, 2)))
        return None


@job
def dropped_window_meets_flush(rank, world_size):
    """K=2. Epoch 0: rank 0 has 2 micro-batches and its closing backward raises
    (a hook); rank 1 has 1 micro-batch, so it flushes. Both catch errors and go on
    (as the error text says they may); epochs 1 and 2: 2 micro-batches each."""
    import gradaccum
    model = du.mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2, bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
    arm = {"on": False}
    p = list(model.parameters())[2]
    p.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")) if arm["on"] else g)
    g = torch.Generator().manual_seed(rank)
    shards = [[2, 1], [2, 2], [2, 2]]
    errors, log = [], []
    for e, shard in enumerate(shards):
        for k in range(shard[rank]):
            x = torch.randn(3, du.D_IN, generator=g, dtype=torch.float64)
            arm["on"] = rank == 0 and e == 0 and k == 1
            _try(errors, f"epoch {e} backward {k}", lambda: acc.backward(model(x).pow(2).mean()))
            arm["on"] = False
            s = _try(errors, f"epoch {e} step {k}", acc.step)
            log.append((e, k, "step", s))
        s = _try(errors, f"epoch {e} flush", acc.flush)
        log.append((e, "flush", s))
    return {"errors": errors, "log": log, "params": du.params(model), "stats": acc.stats()}


def manual_fail_before_any_param(rank, world_size):  # a documented limitation, not a job
    """Manual (DDP-style) path, K=2: rank 1's synchronising backward of window 1
    raises from a hook on the model output, before any parameter's hook fired."""
    import gradaccum
    model = du.mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, None, bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
    g = torch.Generator().manual_seed(rank)
    errors, times = [], []
    for w in range(3):
        for k in range(2):
            x = torch.randn(3, du.D_IN, generator=g, dtype=torch.float64)
            out = model(x)
            if rank == 1 and w == 1 and k == 1:
                out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom before params")))
            loss = out.pow(2).mean() / 2
            start = time.monotonic()
            if k == 0:
                with acc.no_sync():
                    loss.backward()
                continue
            ok = _try(errors, f"window {w} sync backward", lambda: (loss.backward(), True)[1])
            times.append((w, round(time.monotonic() - start, 2)))
            if ok:
                opt.step()
            opt.zero_grad(set_to_none=True)
    return {"errors": errors, "times": times, "params": du.params(model), "stats": acc.stats()}


@job
def manual_finish_throws(rank, world_size):
    """Manual path: rank 1 has a sparse-gradient embedding used only in a no_sync
    micro-step; finish_reduction() throws in the engine callback with the
    reduction in flight."""
    import gradaccum
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True).double()
    lin = nn.Linear(4, 1).double()
    model = nn.ModuleList([emb, lin])
    # Bare parameters: the module check would refuse the sparse embedding up front.
    acc = gradaccum.Accumulator(list(model.parameters()), None, bucket_cap_mb=0.0001,
                                first_bucket_cap_mb=0.0001)
    errors, times = [], []
    idx = torch.tensor([1, 2, 3])
    for w in range(3):
        with acc.no_sync():
            h = emb(idx) if (rank == 1 and w == 1) else torch.zeros(3, 4, dtype=torch.float64)
            lin(h).sum().backward()
        start = time.monotonic()
        _try(errors, f"window {w} sync backward", lambda: lin(torch.ones(3, 4, dtype=torch.float64)).sum().backward())
        times.append((w, round(time.monotonic() - start, 2)))
        for p in model.parameters():
            p.grad = None
    return {"errors": errors, "times": times, "stats": acc.stats()}


@job
def late_callback_after_reduction(rank, world_size):
    """Accumulator path, K=1: during rank 1's synchronising backward of window 1 a
    hook queues an engine callback that raises; ours (queued at the root) already
    reduced successfully. Rank 1 raises, but its window stays closed and is
    stepped, as on rank 0; both report the same window loss."""
    import gradaccum
    from torch.autograd import Variable
    model = du.mlp(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=1)
    arm = {"on": False}

    def raising():
        raise RuntimeError("a later callback failed")

    def hook(grad):
        if arm["on"]:
            Variable._execution_engine.queue_callback(raising)
        return grad

    list(model.parameters())[2].register_hook(hook)
    g = torch.Generator().manual_seed(rank)
    errors, losses = [], []
    for w in range(3):
        x = torch.randn(3, du.D_IN, generator=g, dtype=torch.float64)
        arm["on"] = rank == 1 and w == 1
        _try(errors, f"window {w} backward", lambda: acc.backward(model(x).pow(2).mean()))
        arm["on"] = False
        acc.step()
        losses.append((acc.window_loss.item(), acc.window_items))
    return {"errors": errors, "params": du.params(model), "stats": acc.stats(), "losses": losses}


@job
def drop_from_node_post_hook(rank, world_size):
    """A post hook on a parameter's AccumulateGrad node, registered before the
    Accumulator, drops the Accumulator during a synchronising backward."""
    import gc
    import gradaccum
    model = du.mlp(4)
    p = list(model.parameters())[2]
    node = p.view_as(p).grad_fn.next_functions[0][0]
    holder = []

    def post(grad_inputs, grad_outputs):
        if holder:
            holder.clear()
            gc.collect()

    node.register_hook(post)
    holder.append(gradaccum.Accumulator(model, None, steps=1))
    x = torch.randn(3, du.D_IN, dtype=torch.float64)
    err = None
    try:
        model(x).pow(2).mean().backward()
    except Exception as e:  # noqa
        err = str(e)[:300]
    return {"error": err, "survived": True}


@job
def flush_after_closed_window_fails_on_one_rank(rank, world_size, *, how, prior_raise=False, failing=(1,)):
    """Every rank closes a full window and ends the epoch with flush() (which
    steps the closed window, then pairs the flush collective); on rank 1 (the
    ranks in `failing`) that step cannot happen: its `.grad` was replaced
    ("replaced"), made non-finite in place ("inf_in_place") or its optimizer
    raises ("optimizer"). Every rank must get an error, none may hang.
    `prior_raise`: a window before raised with nonfinite="raise" on every rank
    (and was dropped with zero_grad())."""
    import time

    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank in failing and how == "optimizer":
        def broken_step(*args, **kwargs):
            raise RuntimeError(f"optimizer failed on rank {rank}")
        opt.step = broken_step
    acc = gradaccum.Accumulator(model, opt, steps=2, nonfinite="raise")
    if prior_raise:
        for _ in range(2):
            acc.backward(model(torch.ones(2, 3)).sum() * float("inf"))
        try:
            acc.step()
        except RuntimeError:
            acc.zero_grad()
    for _ in range(2):
        acc.backward(model(torch.ones(2, 3) * (rank + 1)).sum())
    if rank in failing and how == "replaced":
        model.weight.grad = torch.zeros_like(model.weight)
    if rank in failing and how == "inf_in_place":
        model.weight.grad.mul_(float("inf"))
    t0 = time.monotonic()
    out = {"error": None}
    try:
        out["stepped"] = acc.flush()
    except RuntimeError as e:
        out["error"] = str(e)
    out["seconds"] = time.monotonic() - t0
    # and the next epoch pairs again on every rank
    acc.zero_grad()
    for _ in range(2):
        acc.backward(model(torch.ones(2, 3)).sum())
    out["next_grad"] = model.weight.grad.clone()
    return out


@job
def checkpoint_after_midwindow_zero_grad(rank, world_size):
    """Rank 1 clears its gradients mid-window (optimizer.zero_grad()), then
    every rank saves a rank-independent checkpoint: the snapshot must not save
    (and the run go on with) the window without rank 1's earlier micro-steps."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=4)
    for _ in range(2):
        acc.backward(model(torch.ones(2, 3) * (rank + 1)).sum())
    if rank == 1:
        opt.zero_grad(set_to_none=True)
    out = {"error": None}
    try:
        acc.state_dict()
    except RuntimeError as e:
        out["error"] = str(e)
    out["micro_step"] = acc.micro_step
    out["grad_none"] = model.weight.grad is None
    for _ in range(4):  # the next window pairs on every rank
        acc.backward(model(torch.ones(2, 3)).sum())
    out["next_grad"] = model.weight.grad.clone()
    return out


@job
def per_rank_state_after_failed_micro_step(rank, world_size):
    """A no_sync micro-step's backward raises; a per-rank state saved then
    would resume the poisoned window as if nothing had failed."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    armed = {"on": True}

    def hook(grad):
        if armed["on"]:
            raise RuntimeError("injected failure")
        return grad

    model.weight.register_hook(hook)
    out = {}
    try:
        acc.backward(model(torch.ones(2, 3)).sum())
    except RuntimeError as e:
        out["backward"] = str(e)
    armed["on"] = False
    try:
        acc.state_dict(rank_independent=False)
        out["state"] = None
    except RuntimeError as e:
        out["state"] = str(e)
    return out
