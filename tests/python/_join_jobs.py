"""Jobs of test_join.py: ranks with different amounts of data end it with
`with acc.join():` (Note [Joining] in src/accumulator/join.cpp)."""
import torch

import _dist_utils as du
import _protocol_jobs as pj
from _dist_utils import Boom, job


def _count_allreduces(fn):
    """Runs fn(); the all-reduces this rank launched (the profiler's count)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if "allreduce" in e.key.lower())


@job
def join_epochs(rank, world_size, *, seed, epochs, reduction, as_view=False, profile_epoch=None):
    """Several epochs, each rank's shard as `epochs[e][rank]` micro-batches,
    each epoch's loop inside `with acc.join():`."""
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("adam", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=pj.STEPS, reduction=reduction, bucket_cap_mb=0.001,
                                first_bucket_cap_mb=0.0005, gradient_as_bucket_view=as_view)
    out = {"collectives": []}
    for e, shards in enumerate(epochs):
        mine = [b for window in pj.epoch_windows(seed + e, shards, pj.STEPS) for b in window[rank]]
        before = acc.stats()

        def epoch():
            with acc.join():
                for batch in mine:
                    loss, n = du.micro_loss(model, batch, reduction)
                    acc.backward(loss, num_items=n)
                    acc.step()

        if e == profile_epoch:
            out["allreduces"] = _count_allreduces(epoch)
        else:
            epoch()
        after = acc.stats()
        out["collectives"].append(after["reductions"] - before["reductions"])
    out["params"] = du.params(model)
    out["stats"] = acc.stats()
    acc.close()
    return out


@job
def join_failure(rank, world_size, *, seed, shards, fail_rank, fail_at):
    """Rank `fail_rank`'s micro-step `fail_at` raises in backward while other
    ranks have joined; every rank records the error it got, then stops."""
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=pj.STEPS)
    mine = [b for window in pj.epoch_windows(seed, shards, pj.STEPS) for b in window[rank]]
    out = {"error": None, "where": None}
    try:
        with acc.join():
            for i, batch in enumerate(mine):
                loss, _ = du.micro_loss(model, batch, "mean")
                if rank == fail_rank and i == fail_at:
                    loss = Boom.apply(loss)
                out["where"] = "acc.backward()"
                acc.backward(loss)
                acc.step()
            out["where"] = "acc.join()"
    except RuntimeError as e:
        out["error"] = str(e)
    out["stats"] = acc.stats()
    out["paired"] = _still_paired(world_size)
    acc.close()
    return out


def _still_paired(world_size):
    """One all-reduce of the job's own after the errors: it pairs (and sums to
    the world size) only if no rank ran a reduction the others did not."""
    import torch.distributed as dist

    ones = torch.ones(3)
    dist.all_reduce(ones)
    return ones.tolist() == [float(world_size)] * 3


@job
def join_left_with_exception(rank, world_size, *, seed, shards, raise_rank, raise_at, after_backward=False,
                             go_on=False):
    """Rank `raise_rank` raises an exception of the script's own at its
    micro-batch `raise_at` (before its backward, or after it and before
    acc.step()), which leaves its `with acc.join():` block; every rank
    records what it got and how long it took."""
    import time

    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=pj.STEPS)
    mine = [b for window in pj.epoch_windows(seed, shards, pj.STEPS) for b in window[rank]]
    raising = rank in raise_rank if isinstance(raise_rank, list) else rank == raise_rank
    out = {"error": None, "where": None, "went_on_after": []}
    start = time.monotonic()
    try:
        with acc.join():
            for i, batch in enumerate(mine):
                loss, _ = du.micro_loss(model, batch, "mean")
                if raising and i == raise_at and not after_backward:
                    raise ValueError("the script's own error")
                out["where"] = "acc.backward()"
                try:
                    acc.backward(loss, num_items=True if raising and i == raise_at and after_backward == "refused"
                                 else None)
                except RuntimeError as e:
                    if go_on and "training can go on" in str(e):  # as the error says
                        out["went_on_after"].append(str(e))
                        continue
                    raise
                if raising and i == raise_at:
                    raise ValueError("the script's own error")
                acc.step()
            out["where"] = "acc.join()"
    except (RuntimeError, ValueError, TypeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    out["stats"] = acc.stats()
    out["paired"] = _still_paired(world_size)
    acc.close()
    return out


@job
def join_then_flush(rank, world_size, *, seed, shards):
    """Rank 0 ends its data with acc.join(), rank 1 with acc.flush(): both get
    an error, neither hangs."""
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=pj.STEPS)
    mine = [b for window in pj.epoch_windows(seed, shards, pj.STEPS) for b in window[rank]]
    out = {"error": None}
    try:
        if rank == 0:
            with acc.join():
                for batch in mine:
                    acc.backward(du.micro_loss(model, batch, "mean")[0])
                    acc.step()
        else:
            for batch in mine:
                acc.backward(du.micro_loss(model, batch, "mean")[0])
                acc.step()
            acc.flush()
    except (RuntimeError, ValueError) as e:
        out["error"] = str(e)
    acc.close()
    return out


class FailOnce:
    """An optimizer whose `fail_at`-th step raises (on the rank that has one)."""

    def __init__(self, opt, fail_at):
        self.opt, self.fail_at, self.calls = opt, fail_at, 0

    def step(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"injected optimizer failure on rank {torch.distributed.get_rank()}")
        self.opt.step()


@job
def join_step_failure(rank, world_size, *, seed, shards, catchers=(), next_shards=None, fail_rank=0):
    """Rank 0 joins after its data; `fail_rank`'s optimizer raises at its
    2nd step (rank 0's: a shadow step of a window the others stepped):
    every rank must get an error at the next window, none may wait. Ranks in
    `catchers` catch each error inside their block and go on (a closed
    window their step left, they drop with acc.zero_grad(), as its error
    says); with `next_shards`, every rank then runs one more epoch (outside
    join(), ended by flush())."""
    import gradaccum

    model = du.mlp(seed)
    opt = du.make_optimizer("sgd", model.parameters())
    wrapped = FailOnce(opt, 2 if rank == fail_rank else 0)
    acc = gradaccum.Accumulator(model, wrapped, steps=pj.STEPS)
    mine = [b for window in pj.epoch_windows(seed, shards, pj.STEPS) for b in window[rank]]
    out = {"error": None, "caught": []}
    try:
        with acc.join():
            for i, batch in enumerate(mine):
                try:
                    acc.backward(du.micro_loss(model, batch, "mean")[0])
                    acc.step()
                except RuntimeError as e:
                    if rank not in catchers:
                        raise
                    out["caught"].append((i, str(e)))
                    if acc.window_ready:
                        acc.zero_grad()
    except RuntimeError as e:
        out["error"] = str(e)
    if next_shards is not None:
        for window in pj.epoch_windows(seed + 1, next_shards, pj.STEPS):
            for batch in window[rank]:
                acc.backward(du.micro_loss(model, batch, "mean")[0])
                acc.step()
        acc.flush()
        out["params"] = du.params(model)
    out["stats"] = acc.stats()
    out["paired"] = _still_paired(world_size)
    acc.close()
    return out


@job
def join_buffers(rank, world_size, *, counts, weightless_from=None, empty_from=None, reduction="mean"):
    """A BatchNorm model, `counts[rank]` micro-batches of rank-specific data,
    the loop inside `with acc.join():`, buffers broadcast by default. Records
    the buffers before each closing micro-step's backward (this rank's own,
    from its forwards), after each step, and at the end. From micro-batch
    `weightless_from[rank]` on, this rank's micro-batches weigh nothing (but
    run their forward): num_items=0 ("items"), or a NaN loss left out by
    nonfinite="skip_micro_batch" ("mean"); from `empty_from[rank]` on, its
    micro-steps are acc.empty_micro_step() (no forward)."""
    import gradaccum

    model = du.bn_model(11)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=pj.STEPS,
                                reduction=reduction, nonfinite="skip_micro_batch")
    g = torch.Generator().manual_seed(100 + rank)
    out = {"own": [], "after": []}

    def train():
        with acc.join():
            for i in range(counts[rank]):
                x = torch.randn(4, 6, generator=g) * (rank + 1) + rank
                if empty_from is not None and i >= empty_from[rank]:
                    acc.empty_micro_step()
                    continue
                weightless = weightless_from is not None and i >= weightless_from[rank]
                per_row = model(x).pow(2).mean(1)
                if acc.sync_gradients or i + 1 == counts[rank]:
                    out["own"].append([b.clone() for b in model.buffers()])
                if reduction == "items":
                    acc.backward(per_row.sum() * (0.0 if weightless else 1.0), num_items=0 if weightless else 4)
                else:
                    acc.backward(per_row.mean() * (float("nan") if weightless else 1.0))
                if acc.step():
                    out["after"].append([b.clone() for b in model.buffers()])

    before = acc.stats()["collectives"]
    out["allreduces"] = _count_allreduces(train)
    out["collectives"] = acc.stats()["collectives"] - before
    out["final"] = [b.clone() for b in model.buffers()]
    out["stats"] = acc.stats()
    acc.close()
    return out


@job
def join_nonfinite_raise(rank, world_size, *, counts=(2, 6), nan_at=3, leave=False, reload=False):
    """nonfinite="raise", K=2, counts[r] micro-batches on rank r, rank 1's
    micro-batch `nan_at` with a NaN loss, so the reduced window gradient is
    NaN on every rank. By default rank 0 has one window and joins, and rank 1
    catches its step's error in its second window and drops the window with
    acc.zero_grad(), as the error says; rank 0 shadows it. `leave`: rank 1
    lets the error leave its join() block instead; `reload`: rank 1 saves
    and loads its state at the closed NaN window and ends its block there."""
    import gradaccum

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, nonfinite="raise")
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = {"errors": []}
    try:
        with acc.join():
            for i in range(counts[rank]):
                loss = model(x).pow(2).mean()
                acc.backward(loss * float("nan") if rank == 1 and i == nan_at else loss)
                if reload and rank == 1 and i == nan_at:
                    acc.load_state_dict(acc.state_dict())
                    break
                try:
                    acc.step()
                except RuntimeError as e:
                    if leave:
                        raise
                    out["errors"].append(str(e))
                    acc.zero_grad()
    except RuntimeError as e:
        out["errors"].append(f"join: {e}")
    if leave:  # every rank has left join(): they go on together (a next window)
        for i in range(2):
            try:
                acc.backward(model(x).pow(2).mean())
                acc.step()
            except RuntimeError as e:
                out["errors"].append(f"then: {e}")
    out["params"] = du.params(model)
    out["stats"] = acc.stats()
    acc.close()
    return out
