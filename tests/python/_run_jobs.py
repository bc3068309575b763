"""Jobs of test_run.py: acc.run() splits micro-batches that run out of memory
(Note [Micro-steps in parts]); the out-of-memory is injected by the user
function (or a backward node) above a row count, on some ranks only."""
import _dist_utils as du
from _dist_utils import job

STEPS = 3
ROWS = 8  # rows per micro-batch


def schedule(seed, world_size, n_windows, last):
    """Full windows, then a partial one of `last` micro-steps per rank (flush())."""
    counts = du.full_counts(n_windows, world_size, STEPS) + ([[last] * world_size] if last else [])
    return du.make_windows(seed, counts, ROWS)


def reference(seed, world_size, n_windows, last, reduction):
    """One process, float64: each window's big batch (one forward and backward
    over all its micro-batches of every rank), its loss before the step, then
    one optimizer step; the final parameters."""
    import torch

    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    losses = []
    for window in schedule(seed, world_size, n_windows, last):
        loss = du.global_batch_loss(model, window, reduction)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "dtype": torch.float64}


def loss_fn(model, reduction, rank, oom_ranks, oom_rows, calls, where="forward"):
    """fn for acc.run(): raises torch.OutOfMemoryError above `oom_rows` rows on
    `oom_ranks`: in the forward, at the start of the backward (before any
    gradient reaches .grad: retryable), or in the middle of the backward (after
    the last layer's gradients reached .grad: not retryable)."""
    import torch

    class Gate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            raise torch.OutOfMemoryError(f"injected in backward: {rows} rows")

    def fn(batch):
        nonlocal rows
        x, y, mask = batch
        rows = x.shape[0]
        calls.append(rows)
        oom = rank in oom_ranks and rows > oom_rows
        if oom and where == "forward":
            raise torch.OutOfMemoryError(f"injected: {rows} rows")
        if oom and where == "mid_backward":
            hidden = model[:4](x)
            out = model[4](Gate.apply(hidden))
        else:
            out = model(x)
        if oom and where == "backward":
            out = Gate.apply(out)
        err = (out - y).pow(2)
        if reduction == "mean":
            return err.mean()
        if reduction == "sum":
            return err.sum()
        return (err.sum(-1) * mask).sum(), int(mask.sum())

    rows = 0
    return fn


@job
def oom_run(rank, world_size, *, seed, n_windows, last, reduction, oom_ranks, oom_rows, where="forward",
            grow_after=None, catch=False):
    import torch
    import gradaccum
    from gradaccum import _run

    if grow_after:
        _run.GROW_AFTER = grow_after
    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005, process_group=None if world_size > 1 else False)
    calls = []
    fn = loss_fn(model, reduction, rank, oom_ranks, oom_rows, calls, where)
    out = {"losses": [], "returned": [], "collectives": [], "max_rows": [], "errors": []}
    windows = schedule(seed, world_size, n_windows, last)
    for w, window in enumerate(windows):
        for batch in window[rank]:
            try:
                got = acc.run(fn, batch)
            except RuntimeError as e:
                if not catch:
                    raise
                out["errors"].append((w, str(e)))
                continue
            loss = got[0] if reduction == "items" else got
            assert loss.requires_grad is False
            out["returned"].append(float(loss))
            out["max_rows"].append(acc.stats()["run_max_rows"])
            try:
                acc.step()
            except RuntimeError as e:
                if not catch:
                    raise
                out["errors"].append((w, str(e)))
        if w == len(windows) - 1 and last:
            acc.flush()
        out["losses"].append(None if acc.window_loss is None else float(acc.window_loss))
        out["collectives"].append(acc.stats()["last_window_collectives"] if world_size > 1 else 0)
    stats = acc.stats()
    out.update(params=du.params(model), calls=calls, oom_retries=stats["oom_retries"],
               micro_steps=stats["micro_steps"], optimizer_steps=stats["optimizer_steps"],
               buckets=stats["buckets"] if world_size > 1 else 0)
    acc.close()
    return out


@job
def unrecoverable(rank, world_size, *, seed, reduction, oom_rank, micro_step, where):
    """Every rank runs one window (and a second after it); `oom_rank` cannot
    recover at `micro_step` of the first: a one-row micro-batch that runs out
    of memory, or an out-of-memory in the middle of a split part's backward.
    Each rank records what it raised and where."""
    import torch
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction)
    windows = du.make_windows(seed, du.full_counts(2, world_size, STEPS), ROWS)
    errors = []
    calls = []
    for w, window in enumerate(windows):
        for k, batch in enumerate(window[rank]):
            bad = rank == oom_rank and w == 0 and k == micro_step
            if bad and where == "one_row":
                batch = tuple(t[:1] for t in batch)
            fn = loss_fn(model, reduction, rank, [oom_rank] if bad else [], 0 if where == "one_row" else 2,
                         calls, "forward" if where == "one_row" else "mid_backward")
            if bad and where == "mid_backward":
                acc._run_state.max_rows = 4  # parts of 4 rows, whose backward fails half-way
            try:
                acc.run(fn, batch)
                acc.step()
            except RuntimeError as e:
                errors.append((w, k, type(e).__name__, str(e)))
    stats = acc.stats()
    acc.close()
    return {"errors": errors, "optimizer_steps": stats["optimizer_steps"], "windows": stats["windows"],
            "params": du.params(model)}
