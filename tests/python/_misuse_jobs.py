"""Jobs of test_misuse.py and test_launch_and_misuse.py: misuse guards and
checkpoints (saved mid-window, resumed, skewed between ranks) on real Gloo ranks.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_misuse_jobs") and returns plain data; the parent checks it against an
uninterrupted run or a one-process reference in float64.
"""
import os

import torch
import torch.nn as nn

import _dist_utils as du
from _dist_utils import job
from _protocol_jobs import MICRO, STEPS

# --------------------------------------------------------------------------- #
# Issue 8: misuse guards and checkpoints
# --------------------------------------------------------------------------- #

def _train_micro(model, acc, batches, reduction):
    for batch in batches:
        loss, n = du.micro_loss(model, batch, reduction)
        acc.backward(loss, num_items=n)
        acc.step()


def _refusal(acc, state):
    """acc.load_state_dict(state)'s ValueError text; None where it loaded."""
    try:
        acc.load_state_dict(state)
        return None
    except ValueError as e:
        return str(e)


@job
def checkpoint(rank, world_size, *, seed, reduction, ckpt_dir, save_after):
    """The uninterrupted run against a run saved mid-window and resumed, in
    three ways: rank 0's rank-independent state loaded on every rank; each
    rank's own state; and the rejected ones."""
    import torch.distributed as dist
    import gradaccum

    steps, n_windows = 4, 3
    windows = du.make_windows(seed, du.full_counts(n_windows, world_size, steps), MICRO)
    mine = [b for w in windows for b in w[rank]]

    def build():
        model = du.mlp(seed)
        opt = du.make_optimizer("adam", model.parameters())
        acc = gradaccum.Accumulator(model, opt, steps=steps, reduction=reduction,
                                    bucket_cap_mb=0.001, first_bucket_cap_mb=0.0005)
        return model, opt, acc

    model, opt, acc = build()
    _train_micro(model, acc, mine, reduction)
    out = {"uninterrupted": du.params(model), "stats": acc.stats()}
    acc.close()

    for mode in ("rank0", "per_rank"):
        model, opt, acc = build()
        _train_micro(model, acc, mine[:save_after], reduction)
        state = {"model": model.state_dict(), "opt": opt.state_dict(),
                 "acc": acc.state_dict(rank_independent=(mode == "rank0"))}
        path = os.path.join(ckpt_dir, f"ckpt-{mode}-{rank if mode == 'per_rank' else 0}.pt")
        if mode == "per_rank" or rank == 0:
            torch.save(state, path)
        dist.barrier()
        acc.close()
        model, opt, acc = build()
        loaded = torch.load(path, weights_only=False)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["opt"])
        acc.load_state_dict(loaded["acc"])
        resumed_stats = acc.stats()
        _train_micro(model, acc, mine[save_after:], reduction)
        out[mode] = {"params": du.params(model), "stats": acc.stats(),
                     "resumed_stats": resumed_stats, "saved": loaded["acc"]}
        if mode == "per_rank" and world_size > 1:
            other = torch.load(os.path.join(ckpt_dir, f"ckpt-per_rank-{1 - rank if rank < 2 else 0}.pt"),
                               weights_only=False)["acc"]
            out["wrong_rank"] = _refusal(acc, other)
        acc.close()
    # A state of this world size into a single process, and into another reduction.
    saved = out["rank0"]["saved"]
    local = gradaccum.Accumulator(du.mlp(seed), None, steps=steps, reduction=reduction,
                                  process_group=False)
    out["other_world"] = _refusal(local, saved)
    local.close()
    other = gradaccum.Accumulator(du.mlp(seed), None, steps=steps,
                                  reduction="sum" if reduction != "sum" else "mean", process_group=False)
    out["other_reduction"] = _refusal(other, dict(saved, world_size=1))
    return out


@job
def misuse(rank, world_size):
    """Everyday habits that used to give silently wrong training, on 2 ranks."""
    import torch.distributed as dist
    import gradaccum
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    # 1. The model also wrapped in DDP: passed wrapped, or unwrapped while DDP lives.
    model = du.mlp(1)
    ddp = DDP(model)
    for key, what in (("ddp_wrapped", ddp), ("ddp_alive", model)):
        try:
            gradaccum.Accumulator(what, None, steps=2).close()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    del ddp
    # 3. optimizer.zero_grad() inside the window, on rank 1 only.
    model = du.mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=3)
    x = torch.randn(2, du.D_IN, dtype=torch.float64)
    errors = []
    for i in range(6):
        try:
            acc.backward(model(x * (i + 1)).pow(2).mean())
            acc.step()
            if rank == 1 and i == 3:
                opt.zero_grad()  # the single-process habit, mid-window
        except RuntimeError as e:
            errors.append((i, str(e)))
    out["zero_grad"] = errors
    out["zero_grad_params"] = du.params(model)
    acc.close()
    # 7. process_group=False: local-only although torch.distributed is initialized.
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, None, steps=2, process_group=False)
    for _ in range(2):
        acc.backward(model(x + rank).pow(2).mean())
    out["local_only"] = {"stats": acc.stats(), "grad": model[0].weight.grad.clone()}
    acc.close()
    # 7. bucket views keep None for a parameter unused everywhere, as copy mode.
    for as_view in (False, True):
        torch.manual_seed(4)
        net = nn.ModuleDict({"used": nn.Linear(du.D_IN, 3), "idle": nn.Linear(du.D_IN, 3)}).double()
        idle_before = [p.detach().clone() for p in net["idle"].parameters()]
        for opt_name in ("sgd", "adamw"):
            opt = (torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
                   else torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.0))
            acc = gradaccum.Accumulator(net, opt, steps=2, gradient_as_bucket_view=as_view)
            for w in range(3):
                for k in range(2):
                    acc.backward(net["used"](x + w + k + rank).pow(2).mean())
                    if k == 1:
                        out[f"idle_grad_none/{as_view}/{opt_name}/{w}"] = all(
                            p.grad is None for p in net["idle"].parameters())
                    acc.step()
            out[f"idle_moved/{as_view}/{opt_name}"] = max(
                (p - b).abs().max().item() for p, b in zip(net["idle"].parameters(), idle_before))
            out[f"used/{as_view}/{opt_name}"] = [p.detach().clone() for p in net["used"].parameters()]
            acc.close()
    # 8. ...and for one a custom Function's backward gives None (review: a
    # bucket view's zeros were stepped, weight decay moving it).
    for as_view in (False, True):
        torch.manual_seed(4)
        net = nn.ModuleDict({"used": nn.Linear(du.D_IN, 3)}).double()
        net.scale = nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
        acc = gradaccum.Accumulator(net, torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=0.5), steps=2,
                                    gradient_as_bucket_view=as_view)
        nones = []
        for w in range(2):
            for k in range(2):
                acc.backward(_NoGradFor.apply(net["used"](x + w + k + rank), net.scale).pow(2).mean())
                if k == 1:
                    nones.append(net.scale.grad is None)
                acc.step()
        out[f"none_from_function/{as_view}"] = (nones, net.scale.item())
        acc.close()
    # 9. ...but one a Function writes into .grad itself (a fused kernel's way)
    # keeps it (review of the first fix, which dropped it with bucket views).
    for as_view in (False, True):
        torch.manual_seed(4)
        net = nn.ModuleDict({"used": nn.Linear(du.D_IN, 3)}).double()
        net.scale = nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
        acc = gradaccum.Accumulator(net, None, steps=2, gradient_as_bucket_view=as_view)
        for k in range(2):
            acc.backward(_WritesGradOf.apply(net["used"](x + k + rank), net.scale).pow(2).mean())
        out[f"written_by_function/{as_view}"] = net.scale.grad.clone()
        out["x"] = x
        acc.close()
    # 10. Built and refreshed inside torch.inference_mode(): trains as outside
    # (review: the refresh's buckets were inference tensors, every window dropped).
    for inference in (False, True):
        torch.manual_seed(4)
        net = nn.Sequential(nn.Linear(du.D_IN, 3), nn.Tanh(), nn.Linear(3, 2)).double()
        net[0].requires_grad_(False)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with torch.inference_mode(inference):
            acc = gradaccum.Accumulator(net, opt, steps=2, gradient_as_bucket_view=True)
        acc.backward(net(x + rank).pow(2).mean())
        acc.backward(net(x - rank).pow(2).mean())
        acc.step()
        net[0].requires_grad_(True)
        with torch.inference_mode(inference):
            acc.refresh_parameters()
        for w in range(2):
            acc.backward(net(x + w + rank).pow(2).mean())
            acc.backward(net(x - w - rank).pow(2).mean())
            acc.step()
        out[f"inference_built/{inference}"] = du.params(net)
        acc.close()
    dist.barrier()
    return out


class _WritesGradOf(torch.autograd.Function):
    """x * w, whose backward adds w's gradient into w.grad itself and gives
    None for it (as fused kernels that accumulate in place do)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        with torch.no_grad():
            own = (grad * x).sum().reshape(1)
            if w.grad is None:
                w.grad = own
            else:
                w.grad.add_(own)
        return grad * w, None


class _NoGradFor(torch.autograd.Function):
    """x * w, whose backward gives w no gradient (None)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * w, None


# --------------------------------------------------------------------------- #
# Regressions found by the review of the checkpoint change
# --------------------------------------------------------------------------- #

class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 4).double()
        self.a = nn.Linear(4, 1).double()   # used only in the first 2 micro-steps of a window
        self.b = nn.Linear(4, 1).double()
        self.c = nn.Linear(4, 1).double()   # never used
    def forward(self, x, use_a):
        h = torch.tanh(self.trunk(x))
        out = self.b(h).sum()
        if use_a:
            out = out + self.a(h).sum()
        return out


def batches(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(n)]


@job
def view_resume(rank, world_size, *, view, ckpt_dir, save_after, steps=4, windows=2):
    import torch.distributed as dist
    import gradaccum
    data = batches(rank, steps * windows)

    def build():
        m = Branchy()
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        acc = gradaccum.Accumulator(m, opt, steps=steps, gradient_as_bucket_view=view,
                                    bucket_cap_mb=0.00001, first_bucket_cap_mb=0.00001)
        return m, opt, acc

    def train(m, acc, idx):
        for i in idx:
            acc.backward(m(data[i], use_a=(i % steps) < 2))
            acc.step()

    m, opt, acc = build()
    train(m, acc, range(steps * windows))
    ref = [p.detach().clone() for p in m.parameters()]
    acc.close()
    m, opt, acc = build()
    train(m, acc, range(save_after))
    st = {"m": m.state_dict(), "o": opt.state_dict(), "a": acc.state_dict()}
    path = os.path.join(ckpt_dir, "c.pt")
    if rank == 0:
        torch.save(st, path)
    dist.barrier()
    acc.close()
    m, opt, acc = build()
    ld = torch.load(path, weights_only=False)
    m.load_state_dict(ld["m"]); opt.load_state_dict(ld["o"]); acc.load_state_dict(ld["a"])
    grads_after_load = {n: (None if p.grad is None else float(p.grad.abs().sum())) for n, p in m.named_parameters()}
    train(m, acc, range(save_after, steps * windows))
    diff = {n: float((p.detach() - r).abs().max()) for (n, p), r in zip(m.named_parameters(), ref)}
    acc.close()
    return {"diff": diff, "grads_after_load": grads_after_load}


@job
def failed_snapshot(rank, world_size):
    import gradaccum
    torch.manual_seed(0)
    m = nn.Linear(4, 1).double()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(m, opt, steps=4)
    x = torch.randn(3, 4, dtype=torch.float64)
    log = []
    def tr(tag, fn):
        try:
            r = fn(); log.append((tag, "ok", r))
        except Exception as e:
            log.append((tag, type(e).__name__, str(e).split("\n")[0][:400]))
    tr("b0", lambda: acc.backward(m(x).sum()))
    if rank == 1:
        tr("b1-fail", lambda: acc.backward(du.Boom.apply(m(x)).sum()))
    else:
        tr("b1", lambda: acc.backward(m(x).sum()))
    tr("state_dict", lambda: acc.state_dict()["micro_step"])
    log.append(("after", acc.micro_step, [None if p.grad is None else float(p.grad.sum()) for p in m.parameters()]))
    for i in range(6):
        tr(f"b{i+2}", lambda: acc.backward(m(x).sum()))
        tr(f"step{i+2}", lambda: acc.step())
    log.append(("stats", acc.stats()["dropped_windows"], acc.stats()["reductions"]))
    return log


@job
def ready_resume(rank, world_size, *, ckpt_dir, steps=2):
    """Checkpoint between the window's last backward and step() (window_ready), bucket views."""
    import gradaccum
    data = batches(rank, steps * 2)
    def build():
        m = Branchy(); opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        return m, opt, gradaccum.Accumulator(m, opt, steps=steps, gradient_as_bucket_view=True)
    m, opt, acc = build()
    for i in range(steps):
        acc.backward(m(data[i], use_a=True))
    before = {n: p.grad is None for n, p in m.named_parameters()}
    import copy
    st = copy.deepcopy({"m": m.state_dict(), "o": opt.state_dict(), "a": acc.state_dict()})
    acc.step()
    ref = {n: p.detach().clone() for n, p in m.named_parameters()}
    acc.close()
    m, opt, acc = build()
    m.load_state_dict(st["m"]); opt.load_state_dict(st["o"]); acc.load_state_dict(st["a"])
    after = {n: p.grad is None for n, p in m.named_parameters()}
    acc.step()
    return {"grad_is_None_before_save": before, "grad_is_None_after_load": after,
            "diff": {n: float((p.detach() - ref[n]).abs().max()) for n, p in m.named_parameters()}}


@job
def channels_last(rank, world_size):
    import warnings
    import gradaccum

    out = {}
    for as_view in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).double()
        model = model.to(memory_format=torch.channels_last)
        acc = gradaccum.Accumulator(model, None, steps=2, gradient_as_bucket_view=as_view,
                                    bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
        x = torch.randn(2, 3, 9, 9, dtype=torch.float64).to(memory_format=torch.channels_last)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                acc.backward(model(x).pow(2).mean())
        w = model[0].weight
        if as_view:
            out["strides_match"] = w.grad.stride() == w.stride()
            out["is_view"] = w.grad._base is not None
            out["layout_warnings"] = [str(c.message) for c in caught if "stride" in str(c.message).lower()]
        out[f"grad_{'view' if as_view else 'copy'}"] = w.grad.clone()
        acc.close()
    return out


@job
def view_data_assign(rank, world_size):
    """gradient_as_bucket_view, lr 0; in window 0 every rank swaps each .grad's
    storage for a copy of itself before step(). Returns each later window's
    gradient and the mean over ranks of the same micro-batches' gradients."""
    import torch.distributed as dist

    import gradaccum

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = gradaccum.Accumulator(model, opt, steps=2, gradient_as_bucket_view=True,
                                bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4)
    reference = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    reference.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(1 + rank)
    out = {"grads": [], "expected": []}
    for w in range(3):
        reference.zero_grad(set_to_none=True)
        for _ in range(2):
            x = torch.randn(3, 4, generator=g, dtype=torch.float64)
            acc.backward(model(x).pow(2).mean())
            reference(x).pow(2).mean().backward()
        if w == 0:
            for p in model.parameters():
                p.grad.data = p.grad.detach().clone()
        else:
            out["grads"] += [p.grad.clone() for p in model.parameters()]
            for p in reference.parameters():
                dist.all_reduce(p.grad)
                out["expected"].append(p.grad / (2 * world_size))
        acc.step()
    return out


@job
def skewed_checkpoint(rank, world_size, *, saves, reduction):
    """Rank r calls state_dict() after saves[r] micro-steps of the window (a
    save decided per rank: preemption, a timer). A rank-independent state is
    one rank's view of the window, loaded on every rank: it must be a
    consistent cut, or every rank must be told. The run then goes on."""
    import gradaccum

    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction)
    out = {"error": None, "stepped": []}

    def micro(i):
        x = torch.full((2, 3), float(rank + 1 + i), dtype=torch.float64)
        kw = {"num_items": 2} if reduction == "items" else {}
        acc.backward(model(x).sum(), **kw)
        out["stepped"].append(acc.step())

    for i in range(saves[rank]):
        micro(i)
    try:
        state = acc.state_dict()
        out["state_micro_step"] = state["micro_step"]
    except RuntimeError as e:
        out["error"] = str(e)
    out["window_error"] = None
    try:
        for i in range(saves[rank], 2 * STEPS):
            micro(i)
    except RuntimeError as e:
        out["window_error"] = str(e)
    out["weight"] = model.weight.detach().clone()
    return out
