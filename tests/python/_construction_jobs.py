"""Jobs of test_construction.py: an Accumulator that one rank refuses to
build (Note [Construction refused on one rank]), on real Gloo ranks.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_construction_jobs") and returns plain data; the parent checks it.
"""
import torch
import torch.nn as nn

from _dist_utils import job

K = 2


def model():
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def batch(rank, k):
    g = torch.Generator().manual_seed(100 * rank + k)
    return torch.randn(4, 3, generator=g, dtype=torch.float64)


def train_window(rank, m, acc):
    """One window of K micro-batches through `acc`; the parameters after it."""
    for k in range(K):
        acc.backward(m(batch(rank, k)).pow(2).mean())
        acc.step()
    acc.close()
    return [p.detach().clone() for p in m.parameters()]


def refusing_kwargs(case, rank, refusers):
    """What a refusing rank passes (or holds) that the others do not."""
    if rank not in refusers:
        return {}
    return {"python_value": {"reduction": "avg"},
            "conversion": {"max_grad_norm": 10**400},
            "cpp_options": {"steps": 0},
            "python_type": {"metrics": 5},
            "check_parameters": {"check_parameters": False},
            }.get(case, {})


@job
def refused(rank, world_size, *, case, refusers):
    """Every rank builds an Accumulator over the default group; the ranks in
    `refusers` cannot (a Python-side check, a C++-side one, the parameters
    still held by another live Accumulator, a frozen model). Every rank must
    raise at once (no hang), then the group still pairs: every rank builds a
    good Accumulator and trains one window of K micro-batches."""
    import gradaccum

    m = model()
    held = None
    if rank in refusers and case == "claimed":
        held = gradaccum.Accumulator(m, None, steps=K, process_group=False)
    target = m
    if rank in refusers and case == "frozen":
        target = model().requires_grad_(False)
    if rank in refusers and case == "cpp_value":
        target = [m.weight * 1.0]  # not a leaf: refused on the C++ side
    ddp = None
    if case == "foreign_hooks":
        # torch DDP over a group of the refusing ranks alone hooks their
        # parameters; with check_parameters=False the Reducer refuses them
        # by itself, inside its construction.
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        alone = dist.new_group(sorted(refusers))
        ddp = DDP(m, process_group=alone) if rank in refusers else None
    optimizer = None
    if rank in refusers and case == "outside_optimizer":  # a head the model does not hold
        head = nn.Parameter(torch.zeros(1, dtype=torch.float64))
        head.grad = torch.ones_like(head)
        optimizer = torch.optim.SGD([*m.parameters(), head], lr=0.5)
    out = {}
    try:
        kwargs = {"steps": K, **refusing_kwargs(case, rank, refusers)}
        if case == "foreign_hooks":
            kwargs["check_parameters"] = False
        gradaccum.Accumulator(target, optimizer, **kwargs).close()
        out["error"] = None
    except (ValueError, TypeError, RuntimeError) as e:
        out["error"] = (type(e).__name__, str(e))
    if held is not None:
        held.close()
    del ddp
    # The group still pairs: one good window on every rank.
    out["params"] = train_window(rank, m, gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.5), steps=K))
    return out


@job
def refused_refresh(rank, world_size):
    """Layer 1 is frozen when the Accumulator is built, then unfrozen on
    every rank; on rank 1 another live (local-only) Accumulator holds it, so
    rank 1's refresh_parameters() cannot claim it, after the refresh's check
    passed on every rank. Every rank raises (the others wait in the new
    reducer's first collective otherwise) and keeps its old reducer; rank 1
    lets the other go, and the refresh and a window then run on every rank."""
    import gradaccum

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)).double()
    m[1].requires_grad_(False)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    acc = gradaccum.Accumulator(m, opt, steps=K)
    m[1].requires_grad_(True)
    held = gradaccum.Accumulator(m[1], None, steps=K, process_group=False) if rank == 1 else None
    out = {}
    try:
        acc.refresh_parameters()
        out["error"] = None
    except (ValueError, RuntimeError) as e:
        out["error"] = (type(e).__name__, str(e))
    if held is not None:
        held.close()
    acc.refresh_parameters()
    out["params"] = train_window(rank, m, acc)
    return out


@job
def peer_never_builds(rank, world_size):
    """Rank 1 raises before building (its model's forward) and leaves; rank 0
    builds and meets the closed connection in the construction's first
    collective: a prefixed error saying what likely happened."""
    import gradaccum

    if rank == 1:
        return {"error": None}  # (exits: its process group goes with it)
    try:
        gradaccum.Accumulator(model(), None, steps=K)
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


@job
def many_dims(rank, world_size):
    """A parameter of 10 dims whose last two sizes are swapped on rank 1 (the
    same count of elements): refused on every rank at construction."""
    import gradaccum

    shape = (1,) * 8 + ((2, 3) if rank == 0 else (3, 2))
    m = nn.ParameterList([nn.Parameter(torch.zeros(shape, dtype=torch.float64))])
    try:
        gradaccum.Accumulator(m, None, steps=K)
        return {"error": None}
    except ValueError as e:
        return {"error": str(e)}


@job
def built_in_another_order(rank, world_size):
    """Two Accumulators of the same structure, built A then B on rank 0 and
    B then A on rank 1: the first window says to build them in the same
    order, on every rank."""
    import gradaccum

    a, b = model(), model()
    order = (a, b) if rank == 0 else (b, a)
    accs = {id(m): gradaccum.Accumulator(m, None, steps=1) for m in order}
    try:
        accs[id(a)].backward(a(batch(rank, 0)).pow(2).mean())
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


class Frozen(nn.Module):
    """A trainable head over frozen parameters of each kind the broadcast
    sends: one of 2 MiB (in place), small ones (staged), a transposed one
    (not contiguous), an expanded one (its slice), complex and int8 ones (as
    bytes)."""

    def __init__(self, seed, skew=False):
        super().__init__()
        torch.manual_seed(seed)
        # (`skew`: the same sizes in other strides: the big one a transposed
        # view, the strided one contiguous; expanded dims must match)
        big = torch.randn(512, 512, dtype=torch.float64)
        self.big = nn.Parameter(big.t() if skew else big, requires_grad=False)
        self.small = nn.Linear(3, 3).double().requires_grad_(False)
        strided = torch.randn(3, 5, dtype=torch.float64).t()
        self.strided = nn.Parameter(strided.contiguous() if skew else strided, requires_grad=False)
        self.twisted = nn.Parameter(torch.randn(3, dtype=torch.complex64), requires_grad=False)
        self.codes = nn.Parameter(torch.randint(-100, 100, (7,), dtype=torch.int8), requires_grad=False)
        self.tiled = nn.Parameter(torch.randn(1, 3, dtype=torch.float64).expand(4, 3), requires_grad=False)
        self.head = nn.Linear(3, 1).double()

    def forward(self, x):
        h = torch.tanh(self.small(x) @ self.strided.t() @ self.strided) + self.big[0, :3] * self.codes[:3].double()
        return self.head(h * self.twisted.abs().double() + self.tiled)


@job
def frozen_parameters(rank, world_size, *, freeze_extra=False, skew=False):
    """Each rank builds Frozen from its own seed (as unseeded models are):
    Accumulator() broadcasts rank 0's frozen parameters, as torch DDP does,
    so the window's gradient is the big batch's on rank 0's model."""
    import copy

    import torch.distributed as dist
    import gradaccum

    m = Frozen(seed=1000 + rank, skew=skew and rank == 1)
    if freeze_extra and rank == 1:
        m.extra = nn.Parameter(torch.zeros(1), requires_grad=False)
    try:
        acc = gradaccum.Accumulator(m, None, steps=K)
    except ValueError as e:
        return {"error": str(e)}
    models = [None] * world_size
    dist.all_gather_object(models, copy.deepcopy(m))
    frozen_equal = all(torch.equal(p, q) for p, q in zip(m.parameters(), models[0].parameters())
                       if not p.requires_grad)
    for k in range(K):
        acc.backward(m(batch(rank, k)).pow(2).mean())
    reference = models[0]  # rank 0's model (its trainable parameters were broadcast too)
    loss = sum(reference(batch(r, k)).pow(2).mean() for r in range(world_size) for k in range(K))
    want = torch.autograd.grad(loss / (world_size * K), [reference.head.weight, reference.head.bias])
    error = max((p.grad - g).abs().max().item() for p, g in zip([m.head.weight, m.head.bias], want))
    acc.zero_grad()  # (no optimizer: a window boundary)
    # refresh_parameters() checks and broadcasts the frozen parameters again.
    m.late = nn.Parameter(torch.full((2,), float(rank), dtype=torch.float64), requires_grad=False)
    acc.refresh_parameters(m)
    late = m.late.tolist()
    acc.close()
    return {"error": None, "frozen_equal": frozen_equal, "gradient_error": error, "late": late}


@job
def frozen_expanded_on_one_rank(rank, world_size):
    """A frozen parameter of the same sizes, expanded (stride 0) on rank 1
    only: it holds one row there, so rank 0's could not be broadcast into
    it; refused on every rank (it once sent rank 0's rows into that one)."""
    import gradaccum

    m = nn.Linear(3, 1).double()
    table = torch.arange(12.0, dtype=torch.float64).view(4, 3)
    m.table = nn.Parameter(table[:1].expand(4, 3) if rank == 1 else table, requires_grad=False)
    try:
        gradaccum.Accumulator(m, None, steps=K).close()
        return {"error": None}
    except ValueError as e:
        return {"error": str(e)}
