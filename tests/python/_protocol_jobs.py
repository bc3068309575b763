"""Jobs of test_protocol.py: what happens off the happy path, on real Gloo ranks.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_protocol_jobs") and returns plain data; the parent checks it against a
one-process reference in float64.
"""
import collections.abc
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


class BlocksOnly(nn.Module):
    """Every parameter inside a reentrant checkpointed block (the first
    gradient of a backward comes from a nested graph task), or, `outer`, one
    layer before them, whose gradient comes last and from the outer task."""

    def __init__(self, seed, outer):
        super().__init__()
        torch.manual_seed(seed)
        self.outer = nn.Linear(du.D_IN, du.D_IN) if outer else None
        sizes = [du.D_IN, du.D_HID, du.D_HID, du.D_OUT]
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(sizes, sizes[1:])])
        self.double()

    def forward(self, x, reentrant=True):
        from torch.utils.checkpoint import checkpoint
        h = self.outer(x) if self.outer is not None else x.detach().requires_grad_()
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True) if reentrant else block(h)
        return h


@job
def reentrant_blocks_only(rank, world_size, *, seed, windows, reduction, view, outer):
    """The manual path (plain loss.backward()) over BlocksOnly: one reduction
    per window (Note [Where a synchronising backward ends]), each window's
    gradient against the big batch's, computed here without checkpointing."""
    import gradaccum

    data = tower_batches(seed, rank, world_size, windows, STEPS, equal=False)
    model, reference = BlocksOnly(seed, outer), BlocksOnly(seed, outer)
    acc = gradaccum.Accumulator(model, None, steps=STEPS, reduction=reduction, gradient_as_bucket_view=view,
                                bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0002)
    errors, collectives = [], []
    for w in range(windows):
        for k, (x, y) in enumerate(data[w][rank]):
            loss = (model(x) - y).pow(2).mean() / STEPS
            if k < STEPS - 1:
                with acc.no_sync():
                    loss.backward()
            else:
                loss.backward()
        x = torch.cat([b[0] for micro in data[w] for b in micro])
        y = torch.cat([b[1] for micro in data[w] for b in micro])
        scale = world_size if reduction == "sum" else 1  # each rank's loss is its own mean
        want = torch.autograd.grad((reference(x, reentrant=False) - y).pow(2).mean() * scale,
                                   list(reference.parameters()))
        errors.append(max((p.grad - g).abs().max().item() for p, g in zip(model.parameters(), want)))
        collectives.append(acc.stats()["last_window_collectives"])
        with torch.no_grad():
            for p, g in zip(model.parameters(), want):
                p -= 0.1 * p.grad
            for p, g in zip(reference.parameters(), want):
                p -= 0.1 * g
        for p in model.parameters():
            p.grad = None
    return {"errors": errors, "collectives": collectives, "buckets": len(acc.bucket_indices),
            "reductions": acc.stats()["reductions"]}


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
# A micro-batch refused on one rank (Note [A refused closing micro-batch])
# --------------------------------------------------------------------------- #

REFUSE_SEED = 11


def refused_reference(world_size, dropped):
    """One process, float64: the 3 windows' big batches, but `dropped`."""
    windows = du.make_windows(REFUSE_SEED, [[MICRO] * world_size] * 3, MICRO)
    return du.windows_reference(REFUSE_SEED, windows, "mean", optimizer="plain_sgd", skip=(dropped,))


class RaisingMetrics(collections.abc.Mapping):
    """A metrics mapping whose lookup fails (a metric store gone away), or is
    interrupted."""

    def __init__(self, error=None):
        self.error = error or RuntimeError("metric store offline")

    def __getitem__(self, name):
        raise self.error

    def __iter__(self):
        return iter(["m"])

    def __len__(self):
        return 1


@job
def refused_micro_batch(rank, world_size, *, how, closing, boom_rank=None):
    """K=2, 3 windows. In window 1 rank 1 hands acc.backward() a micro-batch
    it refuses: `how` "no_grad" (a loss that does not require grad, as an
    empty batch's torch.zeros(()): C++'s check), "not_tensor" (a float:
    Python's check), "num_items" (num_items with reduction="mean": C++'s
    check of num_items), "huge_num_items" (an int no float holds: Python's
    conversion, an OverflowError before it was refused), "sparse_metric" (a
    metric in sparse layout), "raising_metrics" (a metrics mapping whose
    lookup raises a RuntimeError; "interrupted_metrics": a KeyboardInterrupt,
    which the script catches). At the closing micro-step (`closing`) the window is
    dropped on every rank; at the first one rank 1 runs the micro-batch again.
    `boom_rank`: at that micro-step, that rank's backward raises."""
    import gradaccum
    model = du.mlp(REFUSE_SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=MICRO, metrics=("m",))
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
                       "huge_num_items": lambda: acc.backward(loss, num_items=10 ** 400),
                       "sparse_metric": lambda: acc.backward(loss, metrics={"m": torch.ones(1).to_sparse()}),
                       "raising_metrics": lambda: acc.backward(loss, metrics=RaisingMetrics()),
                       "interrupted_metrics": lambda: acc.backward(loss, metrics=RaisingMetrics(
                           KeyboardInterrupt("metric store interrupted")))}[how]
                try:
                    bad()
                except BaseException as e:  # noqa
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
