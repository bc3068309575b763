"""Jobs of test_stray_gradients.py: gradients no micro-step counted, buffers
that differ across ranks, a disagreement while a rank shadows in join(), on
real Gloo ranks.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_stray_jobs") and returns plain data; the parent checks it.
"""
import torch
import torch.nn as nn

from _dist_utils import job

K = 2
WINDOWS = 3


def model():
    torch.manual_seed(0)
    return nn.Linear(3, 1).double()


def batch(rank, w, k):
    g = torch.Generator().manual_seed(1000 * rank + 10 * w + k)
    return torch.randn(4, 3, generator=g, dtype=torch.float64)


@job
def stray_reducing_backward(rank, world_size):
    """K=2, SGD, WINDOWS windows; before window 1, rank 1 runs one plain
    loss.backward() outside no_sync (a reducing backward of the manual path)
    while rank 0 runs window 1 through acc.backward(). The two reductions
    used to pair as one window, silently; now every rank drops it, and
    training goes on: rank 1 drops its stray gradient with acc.zero_grad()."""
    import gradaccum

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(m, opt, steps=K)
    errors = []
    for w in range(WINDOWS):
        if rank == 1 and w == 1:
            try:
                m(batch(rank, 99, 0)).pow(2).mean().backward()
            except RuntimeError as e:
                errors.append(("stray", str(e)))
                acc.zero_grad()
                continue  # as rank 0, whose window 1 was dropped: both go on to window 2
        for k in range(K):
            try:
                acc.backward(m(batch(rank, w, k)).pow(2).mean())
            except RuntimeError as e:
                errors.append((f"w{w}", str(e)))
        acc.step()
    stats = acc.stats()
    return {"errors": errors, "params": [p.detach().clone() for p in m.parameters()],
            "optimizer_steps": stats["optimizer_steps"], "dropped_windows": stats["dropped_windows"]}


@job
def buffers_differ(rank, world_size, *, how):
    """The parameters agree; a buffer does not ("shape": 4 values on rank 0,
    6 on rank 1; "count": rank 1 has a second buffer; "dtype")."""
    import gradaccum

    m = model()
    if how == "shape":
        m.register_buffer("cache", torch.zeros(4 if rank == 0 else 6, dtype=torch.float64))
    elif how == "count":
        m.register_buffer("cache", torch.zeros(4, dtype=torch.float64))
        if rank == 1:
            m.register_buffer("extra", torch.zeros(2, dtype=torch.float64))
    else:
        m.register_buffer("cache", torch.zeros(4, dtype=torch.float64 if rank == 0 else torch.float32))
    before = m.cache.clone()
    try:
        gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), steps=K)
        return {"error": None}
    except ValueError as e:
        return {"error": str(e), "untouched": torch.equal(m.cache, before)}


@job
def snapshot_meets_shadow(rank, world_size):
    """Rank 1 has no data and shadows in acc.join(); rank 0 takes a
    rank-independent acc.state_dict() mid-window, which meets rank 1's
    shadow: every rank is told, and told that the shadows leave join()."""
    import gradaccum

    m = model()
    acc = gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), steps=K)
    out = {"state_dict": None, "join": None}
    try:
        with acc.join():
            if rank == 0:
                acc.backward(m(batch(rank, 0, 0)).pow(2).mean())
                try:
                    acc.state_dict()
                except RuntimeError as e:
                    out["state_dict"] = str(e)
                    raise
    except RuntimeError as e:
        out["join"] = str(e)
    return out


@job
def stray_at_a_closing_start(rank, world_size, *, how, steps=1):
    """Rank 0 holds a gradient no micro-step counted (a plain backward before
    the Accumulator was built) where its next call closes a window: the
    first micro-step of a steps=1 window ("backward"), or acc.flush() /
    acc.join() at a boundary while rank 1 has one micro-step ("flush",
    "join"). Rank 0 alone reading it used to skip the reduction (steps=1) or
    sum it in (flush, join); now every rank drops that window, told, and the
    next window trains alike."""
    import gradaccum

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    if rank == 0:
        (m(batch(rank, 98, 0)).pow(2).mean() * 1000).backward()
    k_steps = steps if how == "backward" else 2
    acc = gradaccum.Accumulator(m, opt, steps=k_steps)
    errors = []

    def attempt(tag, fn):
        try:
            fn()
        except RuntimeError as e:
            errors.append((tag, str(e)))
            acc.zero_grad()

    if how == "backward":
        attempt("w0", lambda: acc.backward(m(batch(rank, 0, 0)).pow(2).mean()))
        acc.step()
    else:
        if rank == 1:
            acc.backward(m(batch(rank, 0, 0)).pow(2).mean())
        if how == "flush":
            attempt("w0", acc.flush)
        else:
            def joined():
                with acc.join():
                    pass
            attempt("w0", joined)
    for k in range(k_steps):  # the next window, on every rank
        acc.backward(m(batch(rank, 1, k)).pow(2).mean())
    stepped = acc.step()
    return {"errors": errors, "stepped": stepped, "params": [p.detach().clone() for p in m.parameters()],
            "dropped_windows": acc.stats()["dropped_windows"]}


@job
def stray_after_the_epoch_ended(rank, world_size, *, clear):
    """steps=2. Rank 0 closes a full window, which meets rank 1's flush() of
    one micro-step: rank 0's epoch ended with it, and its own acc.flush()
    then has no reduction. Rank 0 runs a stray backward inside no_sync
    before that flush. With `clear` the script clears it (to None) before
    the next epoch, which trains on both ranks; without, the next window's
    first micro-step reads it, and that window is dropped on both."""
    import gradaccum

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(m, opt, steps=2)
    out = {"errors": []}
    for k in range(2 if rank == 0 else 1):
        acc.backward(m(batch(rank, 0, k)).pow(2).mean())
    if acc.window_ready:
        acc.step()
    if rank == 0:
        with acc.no_sync():
            m(batch(rank, 97, 0)).pow(2).mean().backward()
    out["flush"] = acc.flush()
    if rank == 0 and clear:
        opt.zero_grad(set_to_none=True)
        acc.state_dict(rank_independent=False)  # a boundary, nothing failed
    try:
        for k in range(2):
            acc.backward(m(batch(rank, 1, k)).pow(2).mean())
    except RuntimeError as e:
        out["errors"].append(str(e))
    out["stepped"] = acc.step()
    out["dropped_windows"] = acc.stats()["dropped_windows"]
    return out


class _FailsInBackward(torch.autograd.Function):
    """Passes its input on; its backward raises (after the layers behind it
    in backward got their gradients)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("injected failure in backward")


def _manual_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()


def _manual_loss(m, x, fail=False):
    h = m[1](m[0](x))
    if fail:
        h = _FailsInBackward.apply(h)
    return m[2](h).pow(2).mean()


@job
def manual_no_sync_backward_fails(rank, world_size, *, clear, how="plain"):
    """The manual path (no_sync() and plain loss.backward()), K=2, 3
    windows, SGD. In window 1, rank 1's no_sync backward fails after the last
    layer's gradients reached .grad; the script catches it and goes on. It
    was reduced with the window, silently (half a micro-batch: review). Now
    the closing backward drops the window on every rank (each raises), or,
    where rank 1 dropped its part with acc.zero_grad() (`clear`), the window
    steps without that part. Returns the params and the reference: the
    windows that stepped, each .grad = sum over ranks and micro-batches kept
    / world, as torch DDP's no_sync path gives. `how` "acc": window 1's
    micro-steps before the closing one are acc.backward() calls (counted),
    and the plain backward closes it (Note [A manual reduction in the middle
    of a window]): it was reduced silently with the failed part (review);
    the manual windows after it step."""
    import gradaccum

    m = _manual_net()
    ref = _manual_net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(m, None, steps=K)
    errors = []
    for w in range(WINDOWS):
        failed = False
        for k in range(K):
            fail = rank == 1 and w == 1 and k == 0
            loss = _manual_loss(m, batch(rank, w, k), fail=fail)
            try:
                if k < K - 1 and how == "acc" and w == 1:
                    acc.backward(loss)
                elif k < K - 1:
                    with acc.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            except (ValueError, RuntimeError) as e:
                errors.append((w, k, type(e).__name__, str(e)))
                failed = failed or k == K - 1
                if fail and clear:
                    acc.zero_grad()
        if not failed:
            opt.step()
        opt.zero_grad(set_to_none=True)
        # the reference: the micro-batches each window kept
        if w != 1 or clear:
            ref_opt.zero_grad(set_to_none=True)
            for r in range(world_size):
                for k in range(K):
                    if not (r == 1 and w == 1 and k == 0):
                        (_manual_loss(ref, batch(r, w, k)) / world_size).backward()
            ref_opt.step()
    stats = acc.stats()
    acc.close()
    return {"errors": errors, "params": [p.detach().clone() for p in m.parameters()],
            "ref": [p.detach().clone() for p in ref.parameters()], "dropped_windows": stats["dropped_windows"]}


@job
def manual_create_graph(rank, world_size):
    """The manual path's synchronising backward with create_graph=True on
    rank 1 only: the reducer's copy into its bucket raised torch's own error
    there, and rank 0 waited in its all-reduce (review). Both now reduce the
    values (without a graph), against the reference."""
    import gradaccum

    m = _manual_net()
    acc = gradaccum.Accumulator(m, None, steps=K)
    with acc.no_sync():
        _manual_loss(m, batch(rank, 0, 0)).backward()
    _manual_loss(m, batch(rank, 0, 1)).backward(create_graph=rank == 1)
    grads = [p.grad.detach().clone() for p in m.parameters()]
    ref = _manual_net()
    for r in range(world_size):
        for k in range(K):
            (_manual_loss(ref, batch(r, 0, k)) / world_size).backward()
    acc.close()
    return {"grads": grads, "ref": [p.grad.clone() for p in ref.parameters()]}


class _InterruptedInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise KeyboardInterrupt()


@job
def flush_after_a_failed_micro_step(rank, world_size, *, interrupt):
    """K=3; the epoch ends with 2 micro-steps; rank 1's first of them fails
    (an error, or an interrupt it catches); every rank calls flush(), which
    drops the window. Returns each rank's flush() error."""
    import gradaccum

    m = _manual_net()
    acc = gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), steps=3)
    for k in range(2):
        h = m[1](m[0](batch(rank, 0, k)))
        if rank == 1 and k == 0:
            h = (_InterruptedInBackward if interrupt else _FailsInBackward).apply(h)
        try:
            acc.backward(m[2](h).pow(2).mean())
        except BaseException:  # noqa: B036 - the script catches the interrupt on purpose
            pass
    try:
        acc.flush()
        error = None
    except RuntimeError as e:
        error = str(e)
    acc.close()
    return {"error": error}


@job
def manual_path_cases(rank, world_size, *, case):
    """The manual path, 2 windows of K=2, SGD; what each rank's calls raised,
    its params, and the reference's (the windows that stepped, each .grad =
    sum over ranks and micro-batches / world, as DDP's no_sync recipe):
    - "sync_every": a plain backward at every micro-batch (no no_sync: the
      plainest DDP recipe), "mean": exact, nothing refused (review: the
      second-backward check dropped it);
    - "two_heads": "sum", window 0 closes with two heads' losses,
      l1.backward(retain_graph=True); l2.backward(): the second reduces the
      first's result again (times the world size): a warning, once;
    - "head_only": "sum", K=1, the optimizer holds the heads only and the
      trunk's .grad is never cleared (review: a drop every other window):
      the heads train exactly;
    - "reentrant_outer": rank 1's no_sync backward fails in the outer graph
      task after a reentrant checkpoint's nested task reached every
      parameter (review: only the nested task was watched): dropped."""
    import gradaccum
    from torch.utils.checkpoint import checkpoint

    import warnings

    reduction = "sum" if case in ("two_heads", "head_only") else "mean"
    steps = 1 if case == "head_only" else K

    def net():
        torch.manual_seed(0)
        return nn.ModuleDict({"trunk": nn.Linear(3, 5), "head1": nn.Linear(5, 1), "head2": nn.Linear(5, 1)}).double()

    def losses(m, x, fail=False):
        if case == "reentrant_outer":
            x = x.clone().requires_grad_(True)
            h = _FailsInBackward.apply(x) if fail else x * 1.0  # in the outer task, after the block's backward
            return [m["head1"](checkpoint(lambda t: torch.tanh(m["trunk"](t)), h, use_reentrant=True)).pow(2).mean()]
        h = torch.tanh(m["trunk"](x))
        if case == "two_heads":
            return [m["head1"](h).pow(2).mean(), m["head2"](h).pow(2).mean()]
        return [m["head1"](h).pow(2).mean()]

    m, ref = net(), net()
    owned = (lambda n: [p for k, p in n.named_parameters() if not k.startswith("trunk")]) if case == "head_only" \
        else (lambda n: list(n.parameters()))
    opt = torch.optim.SGD(owned(m), lr=0.1)
    ref_opt = torch.optim.SGD(owned(ref), lr=0.1)
    acc = gradaccum.Accumulator(m, None, steps=steps, reduction=reduction)
    errors, stepped = [], []
    caught = warnings.catch_warnings(record=True)
    said = caught.__enter__()
    warnings.simplefilter("always")
    for w in range(3 if case == "head_only" else 2):
        failed = False
        for k in range(steps):
            fail = case == "reentrant_outer" and rank == 1 and w == 0 and k == 0
            try:
                parts = losses(m, batch(rank, w, k), fail)
                if k < steps - 1 and case != "sync_every":
                    with acc.no_sync():
                        sum(parts).backward()
                elif len(parts) == 2 and w == 0:
                    parts[0].backward(retain_graph=True)
                    parts[1].backward()
                else:
                    sum(parts).backward()
            except (ValueError, RuntimeError) as e:
                errors.append((w, k, type(e).__name__, str(e)))
                failed = failed or k == steps - 1
        if not failed:
            opt.step()
            stepped.append(w)
        opt.zero_grad(set_to_none=True)
        if not failed:
            ref_opt.zero_grad(set_to_none=True)
            for r in range(world_size):
                for k in range(steps):
                    scale = 1.0 if reduction == "sum" else 1.0 / world_size
                    (sum(losses(ref, batch(r, w, k))) * scale).backward()
            ref_opt.step()
    caught.__exit__(None, None, None)
    acc.close()
    return {"errors": errors, "stepped": stepped, "params": [p.detach().clone() for p in owned(m)],
            "ref": [p.detach().clone() for p in owned(ref)],
            "warnings": [str(x.message) for x in said if "gradaccum" in str(x.message)]}


class _CheckpointThenFail(torch.autograd.Function):
    """A hand-written reentrant checkpoint (DeepSpeed and fairscale have
    their own): its backward runs the block's nested backward (the block's
    parameters reach .grad), then fails when `fail` is set."""

    @staticmethod
    def forward(ctx, fn, x, fail):
        ctx.fn, ctx.fail = fn, fail
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, grad)
        if ctx.fail:
            raise RuntimeError("injected failure after the nested backward")
        return None, x.grad, None


@job
def manual_checkpoint_node_fails(rank, world_size, *, keep):
    """The manual path, K=2, 3 windows: rank 1's no_sync backward in window 0
    fails inside a checkpoint's node after its nested backward reached the
    block's parameters; with `keep` the script keeps its losses (and so the
    failed graph, whose freeing tells the watch) until the window ends
    (review: the window was reduced with that part, and the next one
    dropped). Window 0 is dropped on every rank either way; the others match
    the float64 reference."""
    import gradaccum

    def net():
        torch.manual_seed(0)
        return nn.ModuleDict({"pre": nn.Linear(3, 3), "a": nn.Linear(3, 5), "b": nn.Linear(5, 1)}).double()

    def loss_of(m, x, fail=False, checkpointed=True):
        h = m["pre"](x)  # before the block: its gradient comes from the outer task
        block = lambda t: m["b"](torch.tanh(m["a"](t)))  # noqa: E731
        return (_CheckpointThenFail.apply(block, h, fail) if checkpointed else block(h)).pow(2).mean()

    m, ref = net(), net()
    acc = gradaccum.Accumulator(m, None, steps=K)
    out, kept = [], []
    for w in range(3):
        try:
            for k in range(K):
                loss = loss_of(m, batch(rank, w, k), fail=rank == 1 and w == 0 and k == 0)
                if keep:
                    kept.append(loss)
                if k < K - 1:
                    try:
                        with acc.no_sync():
                            loss.backward()
                    except RuntimeError as e:
                        assert "injected" in str(e), str(e)
                else:
                    loss.backward()
            ref.load_state_dict(m.state_dict())
            for p in ref.parameters():
                p.grad = None
            for r in range(world_size):
                for k in range(K):
                    (loss_of(ref, batch(r, w, k), checkpointed=False) / world_size).backward()
            out.append(("reduced", w, max((p.grad - q.grad).abs().max().item()
                                          for p, q in zip(m.parameters(), ref.parameters()))))
        except RuntimeError as e:
            out.append(("dropped", w, str(e)))
        for p in m.parameters():
            p.grad = None
        kept.clear()
    acc.close()
    return {"windows": out}
