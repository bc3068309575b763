"""Jobs of test_protocol.py: what happens off the happy path, on real Gloo ranks.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_protocol_jobs") and returns plain data; the parent checks it against a
one-process reference in float64.
"""
import os
import signal
import time

import torch
import torch.nn as nn

import _dist_utils as du
from _dist_utils import job

STEPS = 3
MICRO = 2


# --------------------------------------------------------------------------- #
# Epochs that end in flush(), uneven shards
# --------------------------------------------------------------------------- #

def epoch_windows(seed, shards, steps):
    """windows[w][r]: rank r's micro-batches of the epoch's w-th reduction: its
    w-th chunk of `steps` micro-batches (a shorter chunk is its flush())."""
    n_windows = max(1, max((n + steps - 1) // steps for n in shards))
    counts = [[max(0, min(steps, n - w * steps)) for n in shards] for w in range(n_windows)]
    return du.make_windows(seed, counts, MICRO)


def epochs_reference(seed, epochs, steps, reduction, opt_name):
    model = du.mlp(seed)
    opt = du.make_optimizer(opt_name, model.parameters())
    for e, shards in enumerate(epochs):
        for window in epoch_windows(seed + e, shards, steps):
            if sum(len(m) for m in window) == 0:
                continue  # nothing anywhere: no step
            du.global_batch_loss(model, window, reduction).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return du.params(model)


@job
def epochs(rank, world_size, *, seed, scenarios):
    """Several epochs per scenario, each ending in flush(); rank 1 also calls
    zero_grad() at each epoch's start (a framework habit)."""
    import gradaccum

    out = {}
    for key, (epochs_, reduction, as_view) in scenarios.items():
        model = du.mlp(seed)
        opt = du.make_optimizer("adam", model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction,
                                    bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005,
                                    gradient_as_bucket_view=as_view)
        steps_taken = 0
        for e, shards in enumerate(epochs_):
            if rank == 1:
                acc.zero_grad()
            for window in epoch_windows(seed + e, shards, STEPS):
                for batch in window[rank]:
                    loss, n = du.micro_loss(model, batch, reduction)
                    acc.backward(loss, num_items=n)
                    steps_taken += acc.step()
            steps_taken += acc.flush()
        out[key] = {"params": du.params(model), "steps": steps_taken, "stats": acc.stats()}
    return out


# --------------------------------------------------------------------------- #
# A backward that raises on one rank
# --------------------------------------------------------------------------- #

def tower(seed, equal):
    """Equal-size layers (every bucket the same size, so a mis-pairing would
    not even show as a size error) or the usual uneven MLP."""
    if not equal:
        return du.mlp(seed)
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh()) for _ in range(4)]).double()


def tower_batches(seed, rank, world_size, windows, steps, equal):
    g = torch.Generator().manual_seed(seed)
    d_in, d_out = (8, 8) if equal else (du.D_IN, du.D_OUT)
    data = [[[(torch.randn(MICRO, d_in, generator=g, dtype=torch.float64),
               torch.randn(MICRO, d_out, generator=g, dtype=torch.float64))
              for _ in range(steps)] for _ in range(world_size)] for _ in range(windows)]
    return data


def big_batch_run(model, windows, skip=None):
    """One process: one backward on each window's global batch, one SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for w, window in enumerate(windows):
        if w == skip:
            continue
        x = torch.cat([b[0] for micro in window for b in micro])
        y = torch.cat([b[1] for micro in window for b in micro])
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return du.params(model)


def tower_reference(seed, world_size, windows, steps, equal, skip):
    return big_batch_run(tower(seed, equal), tower_batches(seed, 0, world_size, windows, steps, equal), skip)


class Boom(RuntimeError):
    pass


@job
def failing_backward(rank, world_size, *, seed, windows, fail_rank, fail_window, path, equal,
                     where="hook", view=False, step_outside=False):
    """`fail_rank` raises inside its synchronising backward of `fail_window`
    (from a tensor hook on a middle parameter, after later buckets launched).
    Every rank catches what it gets and goes on training."""
    import gradaccum

    model = tower(seed, equal)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = gradaccum.Accumulator(model, opt if path == "accumulator" else None, steps=STEPS,
                                bucket_cap_mb=0.0002, first_bucket_cap_mb=0.0002,
                                gradient_as_bucket_view=view)
    state = {"arm": False}
    middle = list(model.parameters())[len(list(model.parameters())) // 2]

    def hook(grad):
        if state["arm"]:
            raise Boom(f"injected failure on rank {rank}")
        return grad

    middle.register_hook(hook)
    errors = []
    data = tower_batches(seed, rank, world_size, windows, STEPS, equal)
    for w in range(windows):
        for k, (x, y) in enumerate(data[w][rank]):
            last = k == STEPS - 1
            state["arm"] = rank == fail_rank and w == fail_window and last and where == "hook"
            if rank == fail_rank and w == fail_window and k == 0 and where == "micro":
                state["arm"] = True  # a no_sync micro-step fails instead
            start = time.monotonic()
            try:
                loss = (model(x) - y).pow(2).mean()
                if path == "accumulator":
                    acc.backward(loss)
                    if not step_outside:
                        acc.step()
                elif last:
                    (loss / STEPS).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    with acc.no_sync():
                        (loss / STEPS).backward()
            except RuntimeError as e:
                errors.append({"window": w, "micro": k, "text": str(e),
                               "seconds": time.monotonic() - start})
                if path == "manual":
                    opt.zero_grad(set_to_none=True)  # drop the window here too
            finally:
                state["arm"] = False
            if step_outside:
                acc.step()  # after a failed micro-step too: no error of its own
    return {"errors": errors, "params": du.params(model), "stats": acc.stats(),
            "buckets": len(acc.bucket_indices),
            "bucket_sizes": [sum(list(model.parameters())[i].numel() for i in b)
                             for b in acc.bucket_indices]}


# --------------------------------------------------------------------------- #
# Ranks that disagree
# --------------------------------------------------------------------------- #

@job
def disagree(rank, world_size, *, case, check_parameters):
    """Ranks configured differently, or one taking another path; every rank
    records the first error it gets and how long after the first backward."""
    import gradaccum

    model = du.mlp(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = {"steps": (4, 2)[rank % 2]}.get(case, 4)
    reduction = {"reduction": ("mean", "sum")[rank % 2]}.get(case, "mean")
    metrics = {"metrics": (("tokens", "correct"), ("correct", "tokens"))[rank % 2]}.get(case, ())
    caps = {"bucket_cap_mb": {"bucket_cap_mb": (None, 25.0)[rank % 2]}}.get(case, {})
    # one_host: rank 0 launched as if every rank ran on its host, rank 1 as one of two hosts
    launch = {"one_host": {"LOCAL_WORLD_SIZE": ("2", "1")[rank % 2], "WORLD_SIZE": "2"}}.get(case, {})
    # What the step does with the reduced window: a clip, a non-finite policy,
    # a GradScaler (enabled on one rank; another scale; another schedule).
    scaler = {"grad_scaler": lambda: torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=rank % 2 == 0),
              "init_scale": lambda: torch.amp.GradScaler("cpu", init_scale=(1024.0, 16.0)[rank % 2]),
              "growth_interval": lambda: torch.amp.GradScaler("cpu", growth_interval=(2000, 100)[rank % 2])}
    step_options = {"max_grad_norm": {"max_grad_norm": (None, 0.5)[rank % 2]},
                    "nonfinite": {"nonfinite": ("skip", "ignore")[rank % 2]}}.get(case, {})
    if case in scaler:
        step_options = {"grad_scaler": scaler[case]()}
    g = torch.Generator().manual_seed(rank)
    start = time.monotonic()
    try:
        with du.launch_env(**launch):  # no names: leaves the environment as it is
            acc = gradaccum.Accumulator(model, opt, steps=steps, reduction=reduction, metrics=metrics,
                                        check_parameters=check_parameters, **caps, **step_options)
        for i in range(24):
            x = torch.randn(2, du.D_IN, generator=g, dtype=torch.float64)
            acc.backward(model(x).pow(2).mean())
            acc.step()
            if case == "one_sided_flush" and rank == 0 and i == 5:
                acc.flush()  # mid-window, on rank 0 only
    except (RuntimeError, ValueError) as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------- #
# Reentrant activation checkpointing
# --------------------------------------------------------------------------- #

class Checkpointed(nn.Module):
    def __init__(self, seed, reentrant):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(du.D_IN, du.D_HID)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(du.D_HID, du.D_HID), nn.Tanh())
                                     for _ in range(2)])
        self.head = nn.Linear(du.D_HID, du.D_OUT)
        self.reentrant = reentrant
        self.double()

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant) if self.reentrant is not None else block(h)
        return self.head(h)


@job
def reentrant(rank, world_size, *, seed, windows):
    import gradaccum

    out = {}
    data = tower_batches(seed, rank, world_size, windows, STEPS, equal=False)
    for path in ("accumulator", "manual"):
        model = Checkpointed(seed, reentrant=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        acc = gradaccum.Accumulator(model, opt if path == "accumulator" else None, steps=STEPS,
                                    bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
        for w in range(windows):
            for k, (x, y) in enumerate(data[w][rank]):
                loss = (model(x) - y).pow(2).mean()
                if path == "accumulator":
                    acc.backward(loss)
                    acc.step()
                elif k == STEPS - 1:
                    (loss / STEPS).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                else:
                    with acc.no_sync():
                        (loss / STEPS).backward()
        out[path] = {"params": du.params(model), "stats": acc.stats(),
                     "buckets": len(acc.bucket_indices)}
    return out


def reentrant_reference(seed, world_size, windows):
    return big_batch_run(Checkpointed(seed, reentrant=None),
                         tower_batches(seed, 0, world_size, windows, STEPS, equal=False))


# --------------------------------------------------------------------------- #
# Lifetimes, and a peer that dies
# --------------------------------------------------------------------------- #

@job
def drop_during_backward(rank, world_size):
    """Rank 1 drops its Accumulator from a tensor hook in the middle of its
    synchronising backward (manual path); rank 0 goes on normally."""
    import gc
    import gradaccum

    model = du.mlp(9)
    holder = [gradaccum.Accumulator(model, None, steps=1, bucket_cap_mb=0.0002,
                                    first_bucket_cap_mb=0.0002)]
    middle = list(model.parameters())[2]

    def hook(grad):
        if rank == 1 and holder:
            holder.clear()
            gc.collect()
        return grad

    middle.register_hook(hook)
    x = torch.randn(3, du.D_IN, dtype=torch.float64)
    error = None
    try:
        model(x).pow(2).mean().backward()
    except RuntimeError as e:
        error = str(e)
    # Both go on: rank 1 with plain local training, rank 0 locally (no_sync).
    if holder:
        with holder[0].no_sync():
            model(x).pow(2).mean().backward()
    else:
        model(x).pow(2).mean().backward()
    return {"error": error, "dropped": not holder,
            "grads_finite": all(torch.isfinite(p.grad).all() for p in model.parameters()
                                if p.grad is not None)}


@job
def peer_killed(rank, world_size):
    import gradaccum

    model = du.mlp(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2)
    x = torch.randn(3, du.D_IN, dtype=torch.float64)
    acc.backward(model(x).pow(2).mean())
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        acc.backward(model(x).pow(2).mean())
        return {"error": None, "seconds": time.monotonic() - start}
    except RuntimeError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------- #
# Regressions found by review (each used to mis-pair, wedge, diverge or crash)
# --------------------------------------------------------------------------- #

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


# --------------------------------------------------------------------------- #
# A micro-batch refused on one rank (Note [A refused closing micro-batch])
# --------------------------------------------------------------------------- #

REFUSE_SEED = 11


def refused_reference(world_size, dropped):
    """One process, float64: the 3 windows' big batches, but `dropped`."""
    windows = du.make_windows(REFUSE_SEED, [[MICRO] * world_size] * 3, MICRO)
    return du.windows_reference(REFUSE_SEED, windows, "mean", optimizer="plain_sgd", skip=(dropped,))


@job
def refused_micro_batch(rank, world_size, *, how, closing, boom_rank=None):
    """K=2, 3 windows. In window 1 rank 1 hands acc.backward() a micro-batch
    it refuses: `how` "no_grad" (a loss that does not require grad, as an
    empty batch's torch.zeros(()): C++'s check), "not_tensor" (a float:
    Python's check), "num_items" (num_items with reduction="mean": C++'s
    check of num_items), "huge_num_items" (an int no float holds: Python's
    conversion, an OverflowError before it was refused). At the closing micro-step (`closing`) the window is
    dropped on every rank; at the first one rank 1 runs the micro-batch again.
    `boom_rank`: at that micro-step, that rank's backward raises."""
    import gradaccum
    model = du.mlp(REFUSE_SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=MICRO)
    errors = []
    windows = du.make_windows(REFUSE_SEED, [[MICRO] * world_size] * 3, MICRO)
    for w, window in enumerate(windows):
        for k, batch in enumerate(window[rank]):
            loss = du.micro_loss(model, batch, "mean")[0]
            if rank == boom_rank and w == 1 and k == (1 if closing else 0):
                loss = du.Boom.apply(loss)
            if rank == 1 and w == 1 and k == (1 if closing else 0):
                bad = {"no_grad": lambda: acc.backward(torch.zeros((), dtype=torch.float64)),
                       "not_tensor": lambda: acc.backward(0.0),
                       "num_items": lambda: acc.backward(loss, num_items=2),
                       "huge_num_items": lambda: acc.backward(loss, num_items=10 ** 400)}[how]
                try:
                    bad()
                except Exception as e:  # noqa
                    errors.append((f"{w}/{k}", type(e).__name__, str(e)))
                if closing:
                    continue
            try:
                acc.backward(loss)
            except Exception as e:  # noqa
                errors.append((f"{w}/{k}", type(e).__name__, str(e)))
        acc.step()
    return {"errors": errors, "params": du.params(model), "stats": acc.stats()}


def two_towers_batches(rank, n, salt):
    g = torch.Generator().manual_seed(4 + rank + 10 * salt)
    return [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(n)]


def two_towers_reference(world_size):
    """One process: each tower's windows on the global batch (equal data)."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
    for tower, salt, sign in ((a, 0, -1), (b, 1, 1)):
        opt = torch.optim.SGD(tower.parameters(), lr=0.1)
        data = [two_towers_batches(r, 4, salt) for r in range(world_size)]
        for w in range(2):
            xs = [x for r in range(world_size) for x in data[r][2 * w:2 * w + 2]]
            (sum((tower(x) + sign).pow(2).mean() for x in xs) / len(xs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]


@job
def two_accumulators_uneven(rank, world_size, *, short):
    """Two Accumulators over the default group, same shapes (two towers),
    one window of A then one of B, K=2; with `short`, rank 1 has one
    micro-batch fewer for A, so its B window meets rank 0's closing A window
    (Note [Which Accumulator a collective belongs to]). Then a fresh pair of
    Accumulators with equal data on every rank: the group still pairs."""
    import gradaccum

    def models():
        torch.manual_seed(0)
        return nn.Linear(4, 4).double(), nn.Linear(4, 4).double()

    def batches(n, salt):
        return two_towers_batches(rank, n, salt)

    out = {"errors": []}
    for phase, n_a in (("uneven", 4 - (1 if short and rank == 1 else 0)), ("even", 4)):
        a, b = models()
        acc_a = gradaccum.Accumulator(a, torch.optim.SGD(a.parameters(), lr=0.1), steps=2)
        acc_b = gradaccum.Accumulator(b, torch.optim.SGD(b.parameters(), lr=0.1), steps=2)
        xa, xb = batches(n_a, 0), batches(4, 1)
        try:
            for w in range(2):
                for x in xa[2 * w:2 * w + 2]:
                    acc_a.backward((a(x) - 1).pow(2).mean())
                    acc_a.step()
                for x in xb[2 * w:2 * w + 2]:
                    acc_b.backward((b(x) + 1).pow(2).mean())
                    acc_b.step()
        except RuntimeError as e:
            out["errors"].append((phase, str(e)))
        out[phase] = [p.detach().clone() for p in [*a.parameters(), *b.parameters()]]
        acc_a.close()
        acc_b.close()
    return out


class _Siamese(nn.Module):
    """One tower under activation checkpointing, run on both inputs."""

    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.tower = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.head = nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, a, b):
        from torch.utils.checkpoint import checkpoint

        if self.reentrant is None:
            return self.head(self.tower(a) - self.tower(b))
        return self.head(checkpoint(self.tower, a, use_reentrant=self.reentrant)
                         - checkpoint(self.tower, b, use_reentrant=self.reentrant))


def siamese_inputs(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)


def siamese_reference(world_size):
    model = _Siamese(None).double()
    for r in range(world_size):
        (model(*siamese_inputs(r)).pow(2).mean() / world_size).backward()
    return [p.grad.clone() for p in model.parameters()]


@job
def checkpointed_twice(rank, world_size, *, reentrant):
    """A checkpointed tower run twice in one forward (a Siamese network), one
    synchronising backward: reentrant checkpointing brings the tower's
    gradients twice (an error on every rank), non-reentrant works."""
    import gradaccum

    model = _Siamese(reentrant).double()
    acc = gradaccum.Accumulator(model, None, steps=1)
    try:
        # (inputs that require grad: a reentrant checkpoint of inputs that do
        # not gives its parameters no gradient at all)
        a, b = (x.requires_grad_() for x in siamese_inputs(rank))
        acc.backward(model(a, b).pow(2).mean())
        out = {"error": None, "grads": [p.grad.clone() for p in model.parameters()]}
    except RuntimeError as e:
        out = {"error": str(e)}
    acc.close()
    return out
