"""Jobs of test_alignment.py: a rank whose micro-batch fails or is refused in
the middle of a window, and a script that catches the error and goes on (real
Gloo ranks, spawned by _dist_utils.run_job with module="_alignment_jobs")."""
import torch

import _dist_utils as du
from _dist_utils import job

SEED, K = 11, 3


def windows(world_size):
    return du.make_windows(SEED, du.full_counts(3, world_size, K), 2)


def _recorder(errors):
    """attempt(where, fn): fn(), or its error recorded in `errors`."""
    def attempt(where, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - recorded, judged by the test
            errors.append((where, type(e).__name__, str(e)))
    return attempt


def _still_paired():
    """One all-reduce of the job's own: it pairs (and sums to the world size)
    only if no rank ran a reduction the others did not."""
    import torch.distributed as dist

    ones = torch.ones(3)
    dist.all_reduce(ones)
    return ones.tolist() == [float(dist.get_world_size())] * 3


@job
def failed_or_refused_then_on(rank, world_size, *, how):
    """K=3, 3 windows. In window 1, rank 1's first micro-batch fails in its
    backward (`how` "failed": a hook raises) or is refused (`how` "refused":
    an empty batch's torch.zeros(()) loss). The script catches the error and
    does what it says: "failed" goes on with the next micro-batch (the failed
    micro-step counts); "refused" calls acc.empty_micro_step() in its place."""
    import gradaccum
    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    arm = {"on": False}
    list(model.parameters())[0].register_hook(
        lambda g: (_ for _ in ()).throw(RuntimeError("injected failure")) if arm["on"] else g)
    errors = []
    for w, window in enumerate(windows(world_size)):
        for k, batch in enumerate(window[rank]):
            bad = rank == 1 and w == 1 and k == 0
            try:
                if bad and how == "refused":
                    acc.backward(torch.zeros((), dtype=torch.float64))
                else:
                    arm["on"] = bad
                    acc.backward(du.micro_loss(model, batch, "mean")[0])
            except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                errors.append((f"{w}/{k}", type(e).__name__, str(e), getattr(e, "__notes__", [])))
                if bad and how == "refused":
                    acc.empty_micro_step()
            finally:
                arm["on"] = False
            acc.step()
    return {"errors": errors, "params": du.params(model), "stats": acc.stats()}


@job
def went_on_after_peers_flush(rank, world_size, *, steps):
    """Epoch 0: rank 0 has 1 micro-batch and flushes; rank 1 has 3, and its
    third comes after its second (or first) window's reduction paired with
    rank 0's flush: "went on training". Rank 1 then tries a loss Python
    refuses, acc.empty_micro_step() and acc.state_dict(), then flushes; two
    even epochs follow. Every call's error is recorded."""
    import gradaccum
    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=steps)
    g = torch.Generator().manual_seed(rank)
    errors = []

    attempt = _recorder(errors)

    def micro(where):
        x = torch.randn(3, du.D_IN, generator=g, dtype=torch.float64)
        attempt(where, lambda: acc.backward(model(x).pow(2).mean()))
        attempt(where + " step", acc.step)

    for i in range(1 if rank == 0 else 3):
        micro(f"0/{i}")
    if rank == 1:
        attempt("not a loss", lambda: acc.backward(0.0))
        attempt("empty", acc.empty_micro_step)
        attempt("save", acc.state_dict)
        x = torch.randn(3, du.D_IN, generator=g, dtype=torch.float64)
        attempt("plain", lambda: model(x).pow(2).mean().backward())  # the manual path's reducing backward
        acc.zero_grad()  # (as its error says)
    flushed = [attempt("0 flush", acc.flush)]
    for e in (1, 2):
        for i in range(steps):
            micro(f"{e}/{i}")
        flushed.append(attempt(f"{e} flush", acc.flush))
    return {"errors": errors, "flushed": flushed, "paired": _still_paired(),
            "params": du.params(model), "stats": acc.stats()}


@job
def told_to_end_then_calls(rank, world_size):
    """K=2. Rank 0 has one window and shadows in acc.join(); rank 1's closing
    backward of its second window fails (a hook), which drops the window on
    every rank and tells every rank to end training. Rank 1 catches it inside
    its block and tries what would reduce: acc.no_sync(), acc.flush(),
    acc.refresh_parameters(), acc.backward(); then its block ends. A next epoch
    in acc.join() follows on both ranks."""
    import gradaccum
    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    arm = {"on": False}
    list(model.parameters())[0].register_hook(
        lambda g: (_ for _ in ()).throw(RuntimeError("injected failure")) if arm["on"] else g)
    g = torch.Generator().manual_seed(rank)
    errors = []

    attempt = _recorder(errors)

    def loss():
        return model(torch.randn(3, du.D_IN, generator=g, dtype=torch.float64)).pow(2).mean()

    def manual():
        with acc.no_sync():
            loss().backward()

    try:
        with acc.join():
            for i in range(2 if rank == 0 else 6):
                arm["on"] = rank == 1 and i == 3
                attempt(f"0/{i}", lambda: acc.backward(loss()))
                arm["on"] = False
                acc.step()
            if rank == 1:
                attempt("no_sync", manual)
                attempt("flush", acc.flush)
                attempt("refresh", acc.refresh_parameters)
                attempt("plain", lambda: loss().backward())  # the manual path's reducing backward
                acc.zero_grad()  # (as its error says)
    except RuntimeError as e:
        errors.append(("join", type(e).__name__, str(e)))
    with acc.join():  # the next epoch
        for i in range(2):
            attempt(f"1/{i}", lambda: acc.backward(loss()))
            acc.step()
    return {"errors": errors, "paired": _still_paired(), "params": du.params(model),
            "stats": acc.stats()}


@job
def interrupt_in_closing_backward(rank, world_size, *, kind, via):
    """K=3, 3 windows. In window 1's closing micro-step a hook on rank 1
    raises `kind` (KeyboardInterrupt or SystemExit) inside the synchronising
    backward of acc.backward() or acc.run() (`via`). Every rank catches
    everything, records it, and goes on."""
    import gradaccum
    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K)
    interrupt = {"KeyboardInterrupt": KeyboardInterrupt, "SystemExit": SystemExit}[kind]
    arm = {"on": False}

    def hook(grad):
        if arm["on"]:
            raise interrupt("injected")
        return grad

    list(model.parameters())[0].register_hook(hook)
    errors = []
    for w, window in enumerate(windows(world_size)):
        for k, batch in enumerate(window[rank]):
            arm["on"] = rank == 1 and w == 1 and k == K - 1
            try:
                if via == "run":
                    acc.run(lambda b: du.micro_loss(model, b, "mean")[0], batch)
                else:
                    acc.backward(du.micro_loss(model, batch, "mean")[0])
            except BaseException as e:  # noqa: B036 - recorded, judged by the test
                errors.append((f"{w}/{k}", type(e).__name__, str(e), getattr(e, "__notes__", [])))
            finally:
                arm["on"] = False
            acc.step()
    return {"errors": errors, "paired": _still_paired(), "params": du.params(model), "stats": acc.stats()}


@job
def interrupt_inside_join(rank, world_size):
    """Both ranks train inside acc.join(); in window 1's closing micro-step a
    hook on rank 1 raises KeyboardInterrupt, which leaves rank 1's block.
    Rank 0 catches each error inside its block and goes on: its micro-steps
    are refused, and it leaves the block. How long each rank's leaving took,
    and whether the ranks still pair."""
    import time

    import gradaccum
    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K)
    arm = {"on": False}

    def hook(grad):
        if arm["on"]:
            raise KeyboardInterrupt("stop")
        return grad

    list(model.parameters())[0].register_hook(hook)
    errors, leaving = [], None
    try:
        with acc.join():
            for w, window in enumerate(windows(world_size)):
                for k, batch in enumerate(window[rank]):
                    arm["on"] = rank == 1 and w == 1 and k == K - 1
                    try:
                        acc.backward(du.micro_loss(model, batch, "mean")[0])
                    except Exception as e:  # noqa: BLE001 - recorded, judged by the test
                        errors.append((f"{w}/{k}", type(e).__name__, str(e)))
                    except BaseException:
                        leaving = time.monotonic()
                        raise
                    finally:
                        arm["on"] = False
                    acc.step()
            leaving = time.monotonic()
    except KeyboardInterrupt as e:
        errors.append(("join", type(e).__name__, str(e)))
    seconds = time.monotonic() - leaving  # what leaving the block took (its __exit__)
    return {"errors": errors, "paired": _still_paired(), "seconds": seconds, "params": du.params(model),
            "stats": acc.stats()}


@job
def close_in_closing_hook(rank, world_size):
    """A hook on rank 1 closes the Accumulator inside window 0's closing
    acc.backward(); every rank records what it got."""
    import gradaccum
    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K)
    arm = {"on": False}

    def closer(grad):
        if arm["on"]:
            acc.close()
        return grad

    list(model.parameters())[0].register_hook(closer)
    errors = []
    for k, batch in enumerate(windows(world_size)[0][rank]):
        arm["on"] = rank == 1 and k == K - 1
        try:
            acc.backward(du.micro_loss(model, batch, "mean")[0])
        except Exception as e:  # noqa: BLE001 - recorded, judged by the test
            errors.append((k, type(e).__name__, str(e)))
    return {"errors": errors, "paired": _still_paired(), "closed": acc._c.closed}


@job
def close_from_the_optimizer_in_join(rank, world_size):
    """Both ranks end a partial window in acc.join(); the optimizer's step
    closes the Accumulator. What each rank got."""
    import gradaccum
    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    real_step = opt.step

    def step(*args, **kwargs):
        real_step(*args, **kwargs)
        acc.close()

    opt.step = step
    try:
        with acc.join():
            acc.backward(du.micro_loss(model, windows(world_size)[0][rank][0], "mean")[0])
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - recorded, judged by the test
        return {"error": (type(e).__name__, str(e))}
