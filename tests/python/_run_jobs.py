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


def reference(seed, world_size, n_windows, last, reduction, dropped=()):
    """One process, float64: each window's big batch (one forward and backward
    over all its micro-batches of every rank), its loss before the step, then
    one optimizer step; the final parameters. Windows in `dropped` are left out."""
    import torch

    losses = []
    params = du.windows_reference(seed, schedule(seed, world_size, n_windows, last), reduction, optimizer="adam",
                                  skip=dropped, losses=losses)
    return {"losses": [x for x in losses if x is not None], "params": params, "dtype": torch.float64}


def loss_fn(model, reduction, rank, oom_ranks, oom_rows, calls, where="forward"):
    """fn for acc.run(): raises torch.OutOfMemoryError above `oom_rows` rows on
    `oom_ranks`: in the forward, at the start of the backward (before any
    gradient reaches .grad: retryable), or in the middle of the backward (after
    the last layer's gradients reached .grad: not retryable; `where`
    "interrupt": a KeyboardInterrupt there, "mid_backward_error" a ValueError)."""
    import torch

    class Gate(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            if where in ("backward_error", "mid_backward_error"):
                raise ValueError(f"a bad gradient: {rows} rows")
            if where == "interrupt":
                raise KeyboardInterrupt("stop")
            raise torch.OutOfMemoryError(f"out of memory (injected in backward: {rows} rows)")

    def fn(batch):
        nonlocal rows
        x, y, mask = batch
        rows = x.shape[0]
        calls.append(rows)
        oom = rank in oom_ranks and rows > oom_rows
        if oom and where == "forward":
            raise torch.OutOfMemoryError(f"out of memory (injected: {rows} rows)")
        if oom and where == "user_error":
            raise ValueError(f"a bad sample: {rows} rows")
        if oom and where in ("mid_backward", "interrupt", "mid_backward_error"):
            hidden = model[:4](x)
            out = model[4](Gate.apply(hidden))
        else:
            out = model(x)
        if oom and where in ("backward", "backward_error"):
            out = Gate.apply(out)
        err = (out - y).pow(2)
        if oom and where == "bad_loss":
            return err  # not a scalar: acc.run() rejects it
        if reduction == "mean":
            return err.mean()
        if reduction == "sum":
            return err.sum()
        return (err.sum(-1) * mask).sum(), int(mask.sum())

    rows = 0
    return fn


@job
def oom_run(rank, world_size, *, seed, n_windows, last, reduction, oom_ranks, oom_rows, where="forward",
            grow_after=None, catch=False, first_oom=0):
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
    active = []  # the out-of-memory ranks from micro-step `first_oom` on
    fn = loss_fn(model, reduction, rank, active, oom_rows, calls, where)
    out = {"losses": [], "returned": [], "collectives": [], "max_rows": [], "errors": []}
    windows = schedule(seed, world_size, n_windows, last)
    k = 0
    for w, window in enumerate(windows):
        for batch in window[rank]:
            if k == first_oom:
                active.extend(oom_ranks)
            k += 1
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
                         calls, "forward" if where == "one_row" else where)
            if bad and where == "mid_backward":
                acc._run_state.max_rows = 4  # parts of 4 rows, whose backward fails half-way
            try:
                acc.run(fn, batch)
                acc.step()
            except (RuntimeError, ValueError) as e:
                errors.append((w, k, type(e).__name__, str(e), getattr(e, "__notes__", [])))
    stats = acc.stats()
    acc.close()
    return {"errors": errors, "optimizer_steps": stats["optimizer_steps"], "windows": stats["windows"],
            "params": du.params(model)}


@job
def cuda_oom(rank, world_size, *, seed, reduction, n_windows):
    """On cuda:0, fn runs out of memory for real: it allocates 0.3 of the
    device's memory per row, so 8 and 4 rows fail in the CUDA caching allocator
    and 2 fit. Against one process's big batch on the CPU in float64."""
    import torch
    import gradaccum

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    per_row = int(0.3 * torch.cuda.get_device_properties(device).total_memory)
    model = du.mlp(seed).to(device)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005)
    calls = []

    def fn(batch):
        x, y, mask = (t.to(device) for t in batch)
        calls.append(x.shape[0])
        scratch = torch.empty(x.shape[0] * per_row, dtype=torch.uint8, device=device)
        del scratch
        err = (model(x) - y).pow(2)
        if reduction == "mean":
            return err.mean()
        return (err.sum(-1) * mask).sum(), int(mask.sum())

    losses = []
    for window in schedule(seed, world_size, n_windows, 0):
        for batch in window[rank]:
            acc.run(fn, batch)
            acc.step()
        losses.append(float(acc.window_loss))
    stats = acc.stats()
    out = {"params": [p.detach().cpu() for p in model.parameters()], "calls": calls, "losses": losses,
           "oom_retries": stats["oom_retries"], "max_rows": stats["run_max_rows"],
           "optimizer_steps": stats["optimizer_steps"], "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    acc.close()
    return out


@job
def one_sided_run(rank, world_size, *, seed):
    """steps=2 through acc.run(): epoch 0 gives rank 0 one micro-batch and
    rank 1 three (rank 0's flush() meets rank 1's first window, then rank 1
    trains on); epoch 1 gives each two. Each rank records its errors."""
    import time

    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=2, reduction="mean")
    fn = loss_fn(model, "mean", rank, [], 0, [])
    batches = du.make_windows(seed, [[3, 3]], ROWS)[0][rank]
    errors = []
    start = time.monotonic()
    for epoch, count in enumerate(([1, 3][rank], 2)):
        for k, batch in enumerate(batches[:count]):
            try:
                acc.run(fn, batch)
                acc.step()
            except RuntimeError as e:
                errors.append((epoch, k, str(e)))
        acc.flush()
    stats = acc.stats()
    acc.close()
    return {"errors": errors, "params": du.params(model), "seconds": time.monotonic() - start,
            "micro_step": stats["micro_steps"]}
