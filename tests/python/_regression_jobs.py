"""Jobs of test_protocol.py that reproduce defects found by review: each used
to mis-pair collectives, wedge, diverge or crash on real Gloo ranks (spawned by
_dist_utils.run_job with module="_regression_jobs")."""
import contextlib
import time

import torch
import torch.nn as nn

import _dist_utils as du
import _protocol_jobs as pj
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


def _refused_setup(world_size, steps=pj.MICRO):
    """refused_micro_batch's model, optimizer, Accumulator and data (3 windows)."""
    import gradaccum
    model = du.mlp(pj.REFUSE_SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=steps)
    return model, opt, acc, du.make_windows(pj.REFUSE_SEED, [[steps] * world_size] * 3, steps)


@job
def no_sync_closing(rank, world_size, *, who):
    """K=2, 3 windows (refused_micro_batch's data). In window 1 the ranks in
    `who` wrap both of their acc.backward() calls in acc.no_sync(): the first
    runs as outside, the closing one is refused and the window dropped on
    every rank (Note [The closing micro-step inside no_sync()])."""
    import contextlib
    model, opt, acc, windows = _refused_setup(world_size)
    errors = []
    for w, window in enumerate(windows):
        for k, batch in enumerate(window[rank]):
            loss = du.micro_loss(model, batch, "mean")[0]
            inside = w == 1 and rank in who
            try:
                with acc.no_sync() if inside else contextlib.nullcontext():
                    acc.backward(loss)
            except Exception as e:  # noqa
                errors.append((f"{w}/{k}", type(e).__name__, str(e)))
        acc.step()
    return {"errors": errors, "params": du.params(model), "stats": acc.stats()}


@job
def ri_load_on_some_ranks(rank, world_size, *, loaders):
    """K=2, 3 windows (refused_micro_batch's data). After window 1's first
    micro-step every rank saves acc.state_dict() (rank-independent); the
    ranks in `loaders` load it back (Note [A window resumed on some ranks
    only])."""
    model, opt, acc, windows = _refused_setup(world_size)
    errors = []
    for w, window in enumerate(windows):
        for k, batch in enumerate(window[rank]):
            try:
                acc.backward(du.micro_loss(model, batch, "mean")[0])
            except Exception as e:  # noqa
                errors.append((f"{w}/{k}", type(e).__name__, str(e)))
            if w == 1 and k == 0:
                state = acc.state_dict()
                if rank in loaders:
                    acc.load_state_dict(state)
        acc.step()
    return {"errors": errors, "params": du.params(model), "stats": acc.stats()}


@job
def manual_mid_window(rank, world_size, *, at, then=None):
    """K=3, 3 windows, acc.step() after every micro-batch. Rank 1 runs window
    0's micro-batch `at` through a plain loss.backward() (the manual path):
    its reduction meets rank 0's closing one and the window is dropped on
    both (Note [A manual reduction in the middle of a window]). `then`, on
    rank 1 right after: "zero_grad" (acc.zero_grad()), or "failed_run" (its
    next micro-batch through acc.run(), whose fn raises). "every_step" and
    "every_run": every rank runs that plain backward, so its reduction
    completes (an auxiliary loss's backward, say), and the next call (the
    acc.step() after it, or acc.run() on the next micro-batch) raises."""
    import gradaccum
    model = du.mlp(pj.REFUSE_SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=3)
    errors = []
    windows = du.make_windows(pj.REFUSE_SEED, [[3] * world_size] * 3, 3)
    for w, window in enumerate(windows):
        for k, batch in enumerate(window[rank]):
            loss = du.micro_loss(model, batch, "mean")[0]
            every = then in ("every_step", "every_run")
            try:
                if (rank == 1 or every) and w == 0 and k == at:
                    try:
                        loss.backward()
                    finally:
                        if then == "zero_grad":
                            acc.zero_grad()
                    if then == "every_run":
                        continue
                elif rank == 1 and w == 0 and k == at + 1 and then == "failed_run":
                    acc.run(lambda batch: (_ for _ in ()).throw(ValueError("boom")), batch)
                elif w == 0 and k == at + 1 and then == "every_run":
                    acc.run(lambda batch: du.micro_loss(model, batch, "mean")[0], batch)
                else:
                    acc.backward(loss)
                acc.step()
            except Exception as e:  # noqa
                errors.append((f"{w}/{k}", type(e).__name__, str(e)[:60]))
    return {"errors": errors, "params": du.params(model), "stats": acc.stats(), "micro_step": acc.micro_step}


@job
def mixed_window_then(rank, world_size, *, then):
    """K=2 (refused_micro_batch's data), on every rank: window 0's first
    micro-batch through acc.backward(), its second through a plain
    loss.backward() (the manual path's reduction, mid-window). Then `then`:
    "manual": the script's own optimizer.step() (refused, naming the plain
    backward), and windows 1 and 2 on the manual path (each micro-batch's
    loss / K, optimizer.step() and zero_grad() by hand: they pass, the
    Accumulator's window having ended at the refusal); "run": windows 1 and
    2 through acc.run(), whose fn would raise a KeyError on rank 1 at the
    first call: that call is refused before fn runs (review: fn ran, and its
    failure counted a micro-step on rank 1 alone), and the script runs it
    again."""
    model, opt, acc, windows = _refused_setup(world_size)
    loss_of = lambda w, k: du.micro_loss(model, windows[w][rank][k], "mean")[0]  # noqa: E731
    errors = []
    acc.backward(loss_of(0, 0))
    loss_of(0, 1).backward()
    calls, first = [0], [True]

    def fn(batch):
        calls[0] += 1
        if rank == 1 and first[0]:
            raise KeyError("a lost shard")
        return du.micro_loss(model, batch, "mean")[0]

    for w in (1, 2):
        for k in range(pj.MICRO):
            for attempt in range(2):
                try:
                    if then == "manual" and w == 1 and k == 0 and attempt == 0:
                        opt.step()
                    elif then == "manual":
                        with contextlib.ExitStack() as stack:
                            if k < pj.MICRO - 1:
                                stack.enter_context(acc.no_sync())
                            (loss_of(w, k) / pj.MICRO).backward()
                        if k == pj.MICRO - 1:
                            opt.step()
                            opt.zero_grad(set_to_none=True)
                    else:
                        first[0] = w == 1 and k == 0 and attempt == 0
                        acc.run(fn, windows[w][rank][k])
                        acc.step()
                    break
                except Exception as e:  # noqa
                    errors.append((f"{w}/{k}", type(e).__name__, str(e)[:100]))
                    opt.zero_grad(set_to_none=True)
    return {"errors": errors, "params": du.params(model), "stats": acc.stats(), "calls": calls[0]}


@job
def told_drop_then_manual_then_acc(rank, world_size):
    """K=2 (refused_micro_batch's data). Window 0: rank 1 runs its second
    micro-batch through a plain backward, which meets rank 0's closing
    reduction: dropped on both, each told. Window 1 on the manual path (the
    script's own step passes: the Accumulator's window ended at the drop).
    Window 2 back through acc.backward(), without clearing .grad first: the
    manual window's gradient is no micro-step's, and the window is dropped
    on every rank (review: rank 1 summed it in, silently)."""
    model, opt, acc, windows = _refused_setup(world_size)
    loss_of = lambda w, k: du.micro_loss(model, windows[w][rank][k], "mean")[0]  # noqa: E731
    errors = []
    for w, k in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]:
        try:
            if w == 1:
                with acc.no_sync() if k == 0 else contextlib.nullcontext():
                    (loss_of(w, k) / pj.MICRO).backward()
                if k == 1:
                    opt.step()
            elif w == 0 and k == 1 and rank == 1:
                loss_of(w, k).backward()
            else:
                acc.backward(loss_of(w, k))
                acc.step()
        except Exception as e:  # noqa
            errors.append((f"{w}/{k}", type(e).__name__, str(e)[:70]))
    return {"errors": errors, "params": du.params(model), "stats": acc.stats()}


@job
def manual_window_then_resume(rank, world_size, *, how):
    """K=2 (refused_micro_batch's data). A legit manual-path window on every
    rank, then `how`: "resume" loads a rank-independent state saved in the
    middle of window 0 before it (with the model and optimizer) and finishes
    that window; "failed_run" runs windows 1 and 2 through acc.run(), whose
    fn raises on rank 1 at window 1's first micro-batch. Neither may end a
    window as a manual reduction in its middle would (Note [A manual
    reduction in the middle of a window])."""
    import copy
    model, opt, acc, windows = _refused_setup(world_size)
    loss_of = lambda w, k: du.micro_loss(model, windows[w][rank][k], "mean")[0]  # noqa: E731
    errors = []
    if how == "resume":
        acc.backward(loss_of(0, 0))
        saved = [copy.deepcopy(x.state_dict()) for x in (acc, model, opt)]
        acc.backward(loss_of(0, 1))
        acc.step()
    with acc.no_sync():
        (loss_of(1, 0) / 2).backward()
    (loss_of(1, 1) / 2).backward()
    opt.zero_grad(set_to_none=True)  # (a manual window the optimizer does not step here)
    if how == "resume":
        model.load_state_dict(saved[1])
        opt.load_state_dict(saved[2])
        acc.load_state_dict(saved[0])
        schedule = [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    else:
        schedule = [(w, k) for w in (1, 2) for k in range(pj.MICRO)]
    for w, k in schedule:
        def fn(batch, w=w, k=k):
            if how == "failed_run" and rank == 1 and (w, k) == (1, 0):
                raise ValueError("boom")
            return du.micro_loss(model, batch, "mean")[0]
        try:
            acc.run(fn, windows[w][rank][k])
            acc.step()
        except Exception as e:  # noqa
            errors.append((f"{w}/{k}", type(e).__name__, str(e)[:50]))
    return {"errors": errors, "params": du.params(model), "stats": acc.stats()}


@job
def converted_after_build(rank, world_size, *, how):
    """K=2, a float32 mlp: window 1 in float32; then model.double() on every
    rank ("none", "refresh": with acc.refresh_parameters() after it) or on
    rank 1 alone ("one_rank"); window 2. Also the one-process big batch of
    window 2 in float64 (from the parameters window 1 left), and each
    window's gradient."""
    import gradaccum
    model = du.mlp(4, dtype=torch.float32)
    ref = du.mlp(4, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2)
    errors, grads = [], []
    data = du.make_windows(7, [[2] * world_size] * 2, 2)
    for w in range(2):
        if w == 1 and (how != "one_rank" or rank == 1):
            ref.load_state_dict(model.state_dict())
            model.double()
            ref.double()
            if how == "refresh":
                _try(errors, "refresh", acc.refresh_parameters)
        dtype = next(model.parameters()).dtype
        window = [[(x.to(dtype), y.to(dtype), m) for x, y, m in micros] for micros in data[w]]
        for k in range(2):
            _try(errors, f"{w}/{k}", lambda: acc.backward(du.micro_loss(model, window[rank][k], "mean")[0]))
            if k == 1:
                grads.append([None if p.grad is None else p.grad.detach().clone() for p in model.parameters()])
            _try(errors, f"{w}/{k} step", acc.step)
        du.global_batch_loss(ref, window, "mean").backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"errors": errors, "grads": grads, "params": du.params(model), "ref": du.params(ref),
            "stats": acc.stats()}


@job
def reshaped_after_build(rank, world_size):
    """K=2, a Linear(4, 2): window 1; then on every rank the layer grows to
    Linear(4, 3) through `param.data = ...` and acc.refresh_parameters();
    window 2 (one rank: no group). Also the one-process big batch of both windows."""
    import gradaccum
    torch.manual_seed(5)
    model, ref = nn.Linear(4, 2).double(), nn.Linear(4, 2).double()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    acc = gradaccum.Accumulator(model, opt, steps=2, process_group=False if world_size == 1 else None)
    g = torch.Generator().manual_seed(9)
    errors = []
    for w in range(2):
        if w == 1:
            torch.manual_seed(6)
            weight, bias = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
            for m in (model, ref):
                m.weight.data, m.bias.data = weight.clone(), bias.clone()
            _try(errors, "refresh", acc.refresh_parameters)
        out = model.weight.shape[0]
        data = [[(torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, out, generator=g, dtype=torch.float64))
                 for _ in range(2)] for _ in range(world_size)]
        for k in range(2):
            x, y = data[rank][k]
            _try(errors, f"{w}/{k}", lambda: acc.backward((model(x) - y).pow(2).mean()))
            _try(errors, f"{w}/{k} step", acc.step)
        x = torch.cat([x for micros in data for x, _ in micros])
        y = torch.cat([y for micros in data for _, y in micros])
        (ref(x) - y).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {"errors": errors, "params": du.params(model), "ref": du.params(ref), "stats": acc.stats()}


@job
def manual_after_conversion(rank, world_size):
    """K=2, a float32 mlp, the manual path: window 1; model.double() on
    every rank; window 2 tries `with acc.no_sync(): loss.backward()`, then
    (as a script with K=1 would) a plain closing backward and acc.step();
    then acc.zero_grad(), acc.refresh_parameters() and window 3, against the
    float64 big batch from window 2's parameters."""
    import gradaccum
    model, ref = du.mlp(4, dtype=torch.float32), du.mlp(4, dtype=torch.float32)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    acc = gradaccum.Accumulator(model, opt, steps=2)
    data = du.make_windows(8, [[2] * world_size] * 3, 2)
    errors = []

    def loss_of(w, k):
        x, y, m = data[w][rank][k]
        dtype = next(model.parameters()).dtype
        return du.micro_loss(model, (x.to(dtype), y.to(dtype), m), "mean")[0] / 2

    for w in range(3):
        if w == 1:
            model.double()
        if w == 2:
            model.zero_grad(set_to_none=True)
            _try(errors, "zero_grad", acc.zero_grad)
            _try(errors, "refresh", acc.refresh_parameters)
            ref.double()
            ref.load_state_dict(model.state_dict())

        def first():
            with acc.no_sync():
                loss_of(w, 0).backward()
        _try(errors, f"{w}/0", first)
        if w == 1:
            model.zero_grad(set_to_none=True)
            loss_of(w, 1).backward()  # unreduced: no hook of ours on the new accumulators
            _try(errors, f"{w}/1 step", acc.step)
            continue
        loss_of(w, 1).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _try(errors, f"{w}/1 step", acc.step)
    window = [[(x.double(), y.double(), m) for x, y, m in micros] for micros in data[2]]
    du.global_batch_loss(ref, window, "mean").backward()
    ref_opt.step()
    return {"errors": errors, "params": du.params(model), "ref": du.params(ref)}


@job
def read_from_another_thread(rank, world_size):
    """K=4, 60 windows (acc.refresh_parameters() after 30), while a second
    thread reads acc.stats(), acc.last_window_timeline(), acc.window_loss and
    acc.window_metrics in a loop (a logger's thread): it once deadlocked both
    ranks (the reader held the GIL waiting for the reducer's lock) or crashed
    on window_loss. Then 100 Accumulators built and closed while it reads
    each (close() and refresh once freed the reducer under a reader)."""
    import threading

    import gradaccum
    model = du.mlp(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    acc = gradaccum.Accumulator(model, opt, steps=4, metrics=["rows"], bucket_cap_mb=0.0005,
                                first_bucket_cap_mb=0.0002)
    done, reads, current = threading.Event(), [0], [acc]

    def reader():
        while not done.is_set():
            a = current[0]
            a.stats()
            a.last_window_timeline()
            a.window_loss
            a.window_metrics
            reads[0] += 1

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    g = torch.Generator().manual_seed(rank)
    try:
        for i in range(60 * 4):
            x = torch.randn(3, du.D_IN, generator=g, dtype=torch.float64)
            acc.backward(model(x).pow(2).mean(), metrics={"rows": 3.0})
            acc.step()
            if i == 30 * 4 - 1:
                acc.refresh_parameters()
        steps = acc.stats()["optimizer_steps"]
        acc.close()  # (read meanwhile)
        for _ in range(100):
            other = gradaccum.Accumulator(model, None, steps=2)
            current[0] = other
            time.sleep(0.001)
            other.close()
    finally:
        done.set()
        thread.join()
    return {"params": du.params(model), "reads": reads[0], "steps": steps}
