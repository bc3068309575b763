"""Jobs of test_window_loss.py: acc.window_loss against the big batch's loss
(Note [The window's loss rides in the header])."""
import torch

import _dist_utils as du
from _dist_utils import job

STEPS = 3


def schedule(seed, world_size, n_windows, last):
    """Full windows, then a partial one of `last` micro-steps per rank (flush())."""
    counts = du.full_counts(n_windows, world_size, STEPS) + ([[last] * world_size] if last else [])
    return du.make_windows(seed, counts, 2)


def metric_values(model, batch):
    """The user metrics each micro-batch reports: its summed squared error
    and its valid items."""
    x, y, mask = batch
    with_grad = (model(x) - y).pow(2).sum(-1)
    return {"sq_err": (with_grad * mask).sum(), "items": int(mask.sum())}


def reference(seed, world_size, n_windows, last, reduction, metrics=None):
    """Each window's big-batch loss (one forward over all its micro-batches)
    before its step, one process, float64. `metrics`: a list that gets each
    window's metric sums over all its micro-batches."""
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    losses = []
    for window in schedule(seed, world_size, n_windows, last):
        loss = du.global_batch_loss(model, window, reduction)
        losses.append(loss.item())
        if metrics is not None:
            with torch.no_grad():
                parts = [metric_values(model, b) for micro in window for b in micro]
            metrics.append({k: float(sum(p[k] for p in parts)) for k in ("sq_err", "items")})
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@job
def window_losses(rank, world_size, *, seed, n_windows, last, reduction, comm_dtype=None, device="cpu"):
    import torch
    import gradaccum

    model = du.mlp(seed).to(device)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005,
                                comm_dtype=getattr(torch, comm_dtype) if comm_dtype else None,
                                process_group=None if world_size > 1 else False, metrics=("sq_err", "items"))
    out = {"losses": [], "items": [], "collectives": [], "metrics": [], "before_first": acc.window_loss}
    windows = schedule(seed, world_size, n_windows, last)
    for w, window in enumerate(windows):
        for batch in window[rank]:
            batch = tuple(t.to(device) for t in batch)
            loss, n = du.micro_loss(model, batch, reduction)
            acc.backward(loss, num_items=n, metrics=metric_values(model, batch))
            if acc.window_ready:
                mid = acc.window_loss  # readable before step()
                out["mid"] = None if mid is None else mid.cpu()
            acc.step()
        if w == len(windows) - 1 and last:
            acc.flush()
        wl = acc.window_loss
        out["losses"].append(None if wl is None else float(wl))
        out["items"].append(acc.window_items)
        wm = acc.window_metrics
        out["metrics"].append(None if wm is None else {k: float(v) for k, v in wm.items()})
        out["collectives"].append(acc.stats()["last_window_collectives"] if world_size > 1 else 0)
    out["buckets"] = acc.stats()["buckets"]
    out["stats_loss"] = acc.stats()["window_loss"]
    acc.close()
    return out


def bad_schedule(seed, world_size, n_windows, nan_at=(), empty_at=()):
    """Full windows; micro-batches at (window, rank, k) in `nan_at` get a NaN
    loss, those in `empty_at` no valid item (mask all False)."""
    windows = du.make_windows(seed, du.full_counts(n_windows, world_size, STEPS), 2)
    for (w, r, k) in empty_at:
        x, y, mask = windows[w][r][k]
        windows[w][r][k] = (x, y, mask & False)
    return windows


def bad_reference(seed, world_size, n_windows, reduction, nan_at=(), empty_at=()):
    """One process: each window's big batch over the micro-batches kept (a NaN
    one, or a padding one, left out; an empty one holds no item); a window with
    nothing steps not."""
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    skipped = 0
    for w, window in enumerate(bad_schedule(seed, world_size, n_windows, nan_at, empty_at)):
        kept = [[b for k, b in enumerate(micro) if (w, r, k) not in nan_at] for r, micro in enumerate(window)]
        if sum(len(m) for m in kept) == 0 or (reduction == "items" and
                                              sum(int(b[2].sum()) for m in kept for b in m) == 0):
            skipped += 1
            continue
        du.global_batch_loss(model, kept, reduction).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return du.params(model), skipped


@job
def bad_micro_batches(rank, world_size, *, seed, n_windows, reduction, nan_at=(), empty_at=(), padding_at=(),
                      nonfinite="skip_micro_batch", device="cpu"):
    """`padding_at`: micro-steps this rank has no micro-batch for
    (acc.empty_micro_step())."""
    import gradaccum

    nan_at = {tuple(t) for t in nan_at}
    empty_at = {tuple(t) for t in empty_at}
    padding_at = {tuple(t) for t in padding_at}
    model = du.mlp(seed).to(device)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, nonfinite=nonfinite,
                                process_group=None if world_size > 1 else False)
    stepped, losses = [], []
    for w, window in enumerate(bad_schedule(seed, world_size, n_windows, nan_at, empty_at)):
        for k, batch in enumerate(window[rank]):
            if (w, rank, k) in padding_at:
                acc.empty_micro_step()
            else:
                loss, n = du.micro_loss(model, tuple(t.to(device) for t in batch), reduction)
                if (w, rank, k) in nan_at:
                    loss = loss * float("nan")
                acc.backward(loss, num_items=n)
            if acc.window_ready:
                stepped.append(acc.step())
                losses.append(None if acc.window_loss is None else float(acc.window_loss))
    out = {"params": [p.cpu() for p in du.params(model)], "stats": acc.stats(), "stepped": stepped,
           "losses": losses}
    acc.close()
    return out


def dropped_reference(seed, world_size, n_windows, last, reduction, dropped):
    """Each window's big-batch loss, one process, float64, and the parameters
    after the last; the windows in `dropped` step nothing and have no loss
    (None)."""
    losses = []
    params = du.windows_reference(seed, schedule(seed, world_size, n_windows, last), reduction, optimizer="adam",
                                  skip=dropped, losses=losses)
    return losses, params


@job
def dropped_window_loss(rank, world_size, *, seed, n_windows, last, reduction, fail_at):
    """A micro-step whose backward raises at (window, rank, k) in `fail_at`:
    its window is dropped on every rank when it closes (the closing backward,
    or flush()); what every rank reads then of the window's loss."""
    import gradaccum

    fail_at = {tuple(t) for t in fail_at}
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, process_group=None,
                                metrics=("sq_err", "items"))
    out = {"losses": [], "items": [], "metrics": [], "stats_loss": [], "errors": []}
    windows = schedule(seed, world_size, n_windows, last)
    for w, window in enumerate(windows):
        errors = []
        for k, batch in enumerate(window[rank]):
            loss, n = du.micro_loss(model, batch, reduction)
            if (w, rank, k) in fail_at:
                loss = du.Boom.apply(loss)
            try:
                acc.backward(loss, num_items=n, metrics=metric_values(model, batch))
            except RuntimeError as e:
                errors.append(str(e).split(".")[0])
            if acc.window_ready:
                acc.step()
        if w == len(windows) - 1 and last:
            try:
                acc.flush()
            except RuntimeError as e:
                errors.append(str(e).split(".")[0])
        wl, wm = acc.window_loss, acc.window_metrics
        out["losses"].append(None if wl is None else float(wl))
        out["items"].append(acc.window_items)
        out["metrics"].append(None if wm is None else {k: float(v) for k, v in wm.items()})
        out["stats_loss"].append(acc.stats()["window_loss"])
        out["errors"].append(errors)
    out["params"] = du.params(model)
    out["micro_steps"] = acc.stats()["micro_steps"]
    out["backward_calls"] = sum(len(window[rank]) for window in windows)
    acc.close()
    return out


@job
def window_report_edges(rank, world_size):
    """What the window reports at its edges, on every rank (or one process):
    a window of no weight still has its metric sums; a micro-batch
    skip_micro_batch leaves out takes its metrics with it; window_loss and
    window_metrics are copies; refresh_parameters() forgets the last window
    (loss, metrics and items alike)."""
    import torch
    import gradaccum

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    pg = None if world_size > 1 else False
    out = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = gradaccum.Accumulator(model, opt, steps=2, reduction="items", process_group=pg, metrics=("c",))
    x = torch.randn(4, 3, dtype=torch.float64)
    for k in range(2):  # every micro-batch has no valid item: weight 0 everywhere
        acc.backward(model(x).sum() * 0, num_items=0, metrics={"c": 5 + k + 10 * rank})
    out["weightless"] = (None if acc.window_loss is None else float(acc.window_loss), acc.window_items,
                         {k: float(v) for k, v in acc.window_metrics.items()})
    acc.step()
    acc.close()
    model.zero_grad(set_to_none=True)

    acc = gradaccum.Accumulator(model, opt, steps=2, process_group=pg, nonfinite="skip_micro_batch",
                                metrics=("seen",))
    for k in range(2):
        bad = rank == world_size - 1 and k == 0
        acc.backward(model(x).pow(2).mean() * (float("nan") if bad else 1.0), metrics={"seen": 1})
    out["skipped"] = ({k: float(v) for k, v in acc.window_metrics.items()}, acc.window_items,
                      acc.stats()["skipped_micro_batches"])
    loss = acc.window_loss
    before = float(loss)
    loss *= 100  # a copy: the Accumulator's stays
    acc.window_metrics["seen"].add_(7)
    out["copies"] = (float(acc.window_loss) == before, acc.stats()["window_loss"] == before,
                     float(acc.window_metrics["seen"]))
    acc.step()
    model.weight.requires_grad_(False)
    acc.refresh_parameters()
    out["refreshed"] = (acc.window_loss, acc.window_metrics, acc.window_items)
    acc.close()
    return out


@job
def mixed_wire_window_loss(rank, world_size, *, head_first):
    """A float32 body and a bf16 head, no accumulate_dtype: the head's
    bucket is digit-encoded (a bf16 wire), the body's is not. The window's
    loss rides in the body's header, whichever bucket is last (before and
    after the first window's rebuild). Returns each window's loss and the
    float64 mean of every rank's micro-batch losses."""
    import torch
    import torch.distributed as dist
    import gradaccum

    torch.manual_seed(1)
    body, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1).to(torch.bfloat16)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if head_first:
                self.head, self.body = head, body
            else:
                self.body, self.head = body, head

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)).to(torch.bfloat16)).float()

    model = Net()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    g = torch.Generator().manual_seed(20 + rank)
    out = {"got": [], "want": []}
    for _ in range(3):
        losses = []
        for _ in range(2):
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            losses.append(loss.detach().double())
            acc.backward(loss)
        every = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(every, torch.stack(losses))
        out["want"].append(float(torch.cat(every).mean()))
        out["got"].append(None if acc.window_loss is None else float(acc.window_loss))
        acc.step()
    out["rebuilds"] = acc.stats()["bucket_rebuilds"]
    acc.close()
    return out


@job
def unreadable_num_items(rank, world_size):
    """A num_items no number can be read from, on the last rank at the
    window's closing micro-step: every rank raises (the others are told),
    none waits."""
    import torch
    import gradaccum

    model = torch.nn.Linear(3, 1).double()
    acc = gradaccum.Accumulator(model, None, steps=2, reduction="items")
    x = torch.randn(4, 3, dtype=torch.float64)
    acc.backward(model(x).sum(), num_items=4)
    bad = torch.empty((), device="meta") if rank == world_size - 1 else 4
    try:
        acc.backward(model(x).sum(), num_items=bad)
        error = None
    except (RuntimeError, ValueError, TypeError) as e:
        error = f"{type(e).__name__}: {e}"
    out = {"error": error, "ready": acc.window_ready, "micro_step": acc.micro_step}
    acc.close()
    return out


@job
def loss_share_across_refresh(rank, world_size):
    """The Lightning strategy's LossShare (Note [A wire without the loss])
    over a float32 layer and a bf16 one, the float32 one frozen by
    refresh_parameters() for three windows and unfrozen again: per window,
    window_loss, whether take() gave a share, the shares summed over ranks
    (as the strategy sums them) and the float64 window loss."""
    import torch
    import torch.distributed as dist
    import gradaccum
    from gradaccum._loss_share import LossShare

    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1).to(torch.bfloat16)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x):
            return self.b(self.a(x).to(torch.bfloat16)).float()

    model = Net()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), steps=2)
    share, g, rows, trained = LossShare(), torch.Generator().manual_seed(1 + rank), [], True
    for both in (True, True, False, False, False, True):
        if both != trained:
            a.requires_grad_(both)
            acc.refresh_parameters()
            trained = both
        local = torch.zeros((), dtype=torch.float64)
        for _ in range(2):
            loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
            acc.backward(loss)
            share.add(loss, False)
            local += loss.detach().double()
        acc.step()
        mine = share.take(acc, "mean", "cpu")
        summed = None
        if mine is not None:
            summed = mine.clone()
            dist.all_reduce(summed)
            summed = float(summed)
        dist.all_reduce(local)
        wl = acc.window_loss
        rows.append((None if wl is None else float(wl), summed, float(local) / acc.window_items))
    acc.close()
    return rows
