"""Jobs of test_unstepped.py: a closed window that some ranks do not step
(Note [A window not stepped on some ranks]), on real Gloo ranks.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_unstepped_jobs") and returns plain data; the parent checks it against
a one-process reference in float64.
"""
import copy

import torch

import _dist_utils as du
from _dist_utils import job

SEED = 23
K = 2
WINDOWS = 5


def windows(world_size):
    return du.make_windows(SEED, [[K] * world_size] * WINDOWS, K)


def reference(world_size, skip=(), max_norm=None):
    """One process, float64: the big batches of the WINDOWS windows, but `skip`."""
    return du.windows_reference(SEED, windows(world_size), "mean", optimizer="sgd", skip=skip, max_norm=max_norm)


@job
def closed_window_dropped(rank, world_size, *, droppers, then="window", on_error="resume", fails="optimizer",
                          recover="zero_grad", resume_at_once=False, boom_rank=None, nan_rank=None,
                          flush_closed=False, max_grad_norm=None):
    """K=2, momentum SGD, a constant LambdaLR, WINDOWS windows. Window 1's
    acc.step() raises on the ranks in `droppers`: their optimizer raises
    (`fails` "optimizer"), their scheduler after the optimizer stepped
    ("scheduler"), or the script replaced a .grad after the closing backward
    ("replaced"), or another backward reached the model after the closing
    one ("late_backward": acc.step() refuses), or their optimizer gains a parameter the model does not
    hold, with a gradient ("outside": acc.step() refuses; the script then
    removes it). They `recover` as a script that catches the error would:
    drop the closed window with acc.zero_grad() ("zero_grad"), or call
    acc.step() again ("retry"). `resume_at_once`: every rank then resumes
    from the checkpoint taken before window 1 before any reduction.
    `then` is the call that runs the next reduction: "window" (window 2's
    closing backward), "flush" (one micro-step, then acc.flush()), "snapshot"
    (one micro-step, then a rank-independent acc.state_dict()), "refresh"
    (acc.refresh_parameters() at the boundary). `boom_rank`: that rank's
    closing backward of window 2 raises. `nan_rank`: that rank's first loss
    of window 1 is NaN (nonfinite="skip" skips the window). `flush_closed`:
    every rank ends window 1 with acc.flush() instead of acc.step() (which
    steps the closed window, then pairs the flush). `max_grad_norm`: the
    Accumulator's clipping. Where a reduction
    raises, `on_error`: every rank resumes from the checkpoint and trains
    windows 1.. again with no failure ("resume"), stops ("stop"), or goes on
    ("go_on")."""
    import gradaccum

    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    acc = gradaccum.Accumulator(model, opt, steps=K, scheduler=scheduler, max_grad_norm=max_grad_norm)
    data = windows(world_size)
    errors, saved = [], None
    fail = {"armed": False}

    def failing(real, what):
        def call(*args, **kwargs):
            if fail["armed"]:
                fail["armed"] = False
                raise RuntimeError(f"{what} failed on rank {rank}")
            return real(*args, **kwargs)
        return call

    if fails == "optimizer":
        opt.step = failing(opt.step, "optimizer")
    elif fails == "scheduler":
        scheduler.step = failing(scheduler.step, "scheduler")

    def resume():
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        acc.load_state_dict(saved[2])

    w = 0
    resumed = False
    dropped_before = None
    while w < len(data):
        if w == 1 and saved is None:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), acc.state_dict())
        micro = data[w][rank]
        try:
            if w == 2 and then in ("flush", "snapshot") and not resumed:
                acc.backward(du.micro_loss(model, micro[0], "mean")[0])
                if then == "flush":
                    acc.flush()
                else:
                    acc.state_dict()
                errors.append((w, "none"))
                break
            if w == 2 and then == "refresh" and not resumed:
                acc.refresh_parameters()
                errors.append((w, "none"))
                break
            for k, batch in enumerate(micro):
                loss = du.micro_loss(model, batch, "mean")[0]
                if w == 1 and k == 0 and rank == nan_rank and not resumed:
                    loss = loss * float("nan")
                if w == 2 and k == K - 1 and rank == boom_rank and not resumed:
                    loss = du.Boom.apply(loss)
                acc.backward(loss)
            failing_here = w == 1 and rank in droppers and not resumed
            if failing_here and fails == "replaced":
                model[0].weight.grad = model[0].weight.grad.clone()
            if failing_here and fails == "late_backward":
                # Another loss's backward through the model after its window
                # closed, before acc.step() (a GAN's generator step).
                du.micro_loss(model, micro[0], "mean")[0].backward()
            fail["armed"] = failing_here and fails in ("optimizer", "scheduler")
            if failing_here and fails == "outside":
                head = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
                head.grad = torch.ones_like(head)
                opt.add_param_group({"params": [head]})
            try:
                acc.flush() if flush_closed and w == 1 else acc.step()
            except (RuntimeError, ValueError) as e:
                errors.append((w, "step", str(e)))
                if failing_here and fails == "outside":
                    opt.param_groups.pop()
                if recover == "retry":
                    acc.step()
                else:
                    acc.zero_grad()
            if w == 1 and resume_at_once and not resumed:  # every rank, before a reduction tells of the drop
                resume()
                resumed = True
                continue
        except RuntimeError as e:
            errors.append((w, "reduction", str(e)))
            if dropped_before is None:
                dropped_before = acc.stats()["dropped_windows"]
            if on_error == "stop":
                break
            if on_error == "resume":
                resume()
                resumed = True
                w = 1
                continue
        w += 1
    stats = acc.stats()
    return {"errors": errors, "params": du.params(model), "resumed": resumed, "dropped_before": dropped_before,
            "optimizer_steps": stats["optimizer_steps"], "dropped_windows": stats["dropped_windows"],
            "skipped_steps": stats["skipped_steps"], "reductions": stats["reductions"],
            "lr": opt.param_groups[0]["lr"],
            "scheduler_epoch": scheduler.last_epoch}


@job
def scaler_update_fails(rank, world_size):
    """K=2, a CPU GradScaler (growth every window). Rank 1's
    GradScaler.update() raises once, after window 0 stepped; the script
    catches it and goes on. Its scale may now differ from the others' (the
    ranks' gradients would be weighed unequally): window 1's reduction tells
    every rank, and the script stops there (review: rank 0 stepped on, rank 1
    refused its next window, and then rank 0 waited for the group's
    timeout)."""
    import gradaccum

    model = du.mlp(SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=1)
    acc = gradaccum.Accumulator(model, opt, steps=K, grad_scaler=scaler)
    update = scaler.update

    def once():
        scaler.update = update
        raise RuntimeError("a scale store's hiccup")
    if rank == 1:
        scaler.update = once
    errors = []
    for w, window in enumerate(windows(world_size)[:3]):
        try:
            for batch in window[rank]:
                acc.backward(du.micro_loss(model, batch, "mean")[0])
        except RuntimeError as e:
            errors.append((w, "reduction", str(e)))
            break
        try:
            acc.step()
        except RuntimeError as e:
            errors.append((w, "step", str(e)))
    return {"errors": errors, "scale": scaler.get_scale()}


@job
def manual_write_back_fails(rank, world_size):
    """The manual path (no_sync, then a plain backward that reduces): rank 1's
    write-back of window 0 fails after every rank reduced it (an expanded
    .grad of a layer the closing backward does not reach cannot be written
    in place). Its loss.backward() says so in gradaccum's words (review: the
    bare torch error), rank 0 steps, and window 1 tells both ranks."""
    import gradaccum

    torch.manual_seed(SEED)
    model = torch.nn.ModuleDict({"main": torch.nn.Linear(3, 2), "aux": torch.nn.Linear(3, 2)}).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=K)
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    errors = []
    for w in range(2):
        try:
            with acc.no_sync():
                (model["main"](x) + model["aux"](x)).pow(2).mean().backward()
            if w == 0 and rank == 1:
                model["aux"].bias.grad = torch.zeros(1, dtype=torch.float64).expand(2)
            model["main"](x).pow(2).mean().backward()
            opt.step()
        except RuntimeError as e:
            errors.append((w, str(e)))
        opt.zero_grad()
    return {"errors": errors}


MID_STEPS = 3
MID_BATCHES = 15


def mid_stream(world_size):
    """Each rank's stream of MID_BATCHES micro-batches (stream[rank][i])."""
    return du.make_windows(SEED, [[MID_BATCHES] * world_size], MID_STEPS)[0]


def mid_reference(world_size, windows):
    """One process, float64: the big batch of each stepped window, where
    windows[k][rank] lists the micro-batches rank contributed to window k."""
    stream = mid_stream(world_size)
    return du.windows_reference(SEED, [[[stream[r][i] for i in per_rank[r]] for r in range(world_size)]
                                       for per_rank in windows], "mean", optimizer="sgd")


@job
def mid_window_dropped(rank, world_size, *, droppers, fail=True, at=4, then="go_on", counts=None):
    """K=3, momentum SGD; each rank trains on its stream of micro-batches,
    acc.step() after each. At micro-batch `at` (in window 1; a list: each
    rank's) the ranks in
    `droppers` drop their window in its middle with acc.zero_grad(): after
    that micro-batch's backward raised on them (`fail`: a script that catches
    a failed micro-step there), or after it ran. Then every rank goes on with
    its stream and ends the epoch with acc.flush() (`then` "go_on"), or ends
    it with acc.flush() at the next micro-batch ("flush"), or runs the whole
    stream inside `with acc.join():` ("join"). `counts[rank]`: the length of
    rank's stream (default MID_BATCHES). Returns each error with the
    micro-batch it came at, and the micro-batches each stepped window got
    from this rank."""
    import gradaccum

    model = du.mlp(SEED)
    opt = du.make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=MID_STEPS)
    stream = mid_stream(world_size)[rank][:None if counts is None else counts[rank]]
    at = at[rank] if isinstance(at, list) else at
    errors, stepped, current = [], [], []
    if then == "join":
        with acc.join():
            for i, batch in enumerate(stream):
                current.append(i)
                acc.backward(du.micro_loss(model, batch, "mean")[0])
                if acc.step():
                    stepped.append(current)
                    current = []
                if i == at and rank in droppers:
                    acc.zero_grad()
                    current = []
        stats = acc.stats()
        return {"errors": errors, "stepped": stepped, "left": current, "params": du.params(model),
                "dropped_windows": stats["dropped_windows"], "optimizer_steps": stats["optimizer_steps"]}
    for i, batch in enumerate(stream + [None]):
        if batch is None or (then == "flush" and i == at + 1):
            try:
                if acc.flush():
                    stepped.append(current)
            except RuntimeError as e:
                errors.append((i, "flush", str(e)))
            break
        loss = du.micro_loss(model, batch, "mean")[0]
        dropping = i == at and rank in droppers
        if dropping and fail:
            loss = du.Boom.apply(loss)
        current.append(i)
        try:
            acc.backward(loss)
            if acc.step():
                stepped.append(current)
                current = []
        except RuntimeError as e:
            errors.append((i, "backward", str(e)))
            if not dropping:
                current = []  # a reduction dropped on every rank
        if dropping:
            acc.zero_grad()
            current = []
    stats = acc.stats()
    return {"errors": errors, "stepped": stepped, "params": du.params(model),
            "dropped_windows": stats["dropped_windows"], "optimizer_steps": stats["optimizer_steps"]}


@job
def resumed_then_dropped(rank, world_size, *, rank_independent, then_per_rank=False):
    """K=4: micro-batches 0 and 1, then every rank saves a state and loads
    it (rank-independent or per-rank; `then_per_rank`: then saves and loads a
    per-rank state of that resumed window, through torch.save), then
    micro-batch 2, after which rank 0 drops its part with acc.zero_grad(),
    then micro-batch 3 closes the window. Returns the error, window_loss and
    the micro-batches of the window that stepped from this rank."""
    import io

    import torch
    import gradaccum

    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=4)
    stream = mid_stream(world_size)[rank]
    kept, error = [], None
    for i in range(4):
        if i == 2:
            acc.load_state_dict(acc.state_dict(rank_independent=rank_independent))
            if then_per_rank:
                buffer = io.BytesIO()
                torch.save(acc.state_dict(rank_independent=False), buffer)
                buffer.seek(0)
                state = torch.load(buffer, weights_only=True)
                assert state["window_shared"] == rank_independent, state["window_shared"]
                acc.load_state_dict(state)
        kept.append(i)
        try:
            acc.backward(du.micro_loss(model, stream[i], "mean")[0])
            stepped = acc.step()
        except RuntimeError as e:
            error, stepped = str(e), False
        if i == 2 and rank == 0:
            acc.zero_grad()
            kept = []
    loss = acc.window_loss
    return {"error": error, "stepped": kept if stepped else None, "window_loss": None if loss is None else float(loss),
            "params": du.params(model)}


@job
def parts_then_zero_grad(rank, world_size):
    """Rank 0 runs half of micro-batch 1 as a part (acc.run()'s path), then
    calls acc.zero_grad() with the part open: refused, nothing changed; it
    ends the micro-step failed, drops its part of the window and goes on.
    K=3, 6 micro-batches, both ranks."""
    import gradaccum

    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=3)
    stream = mid_stream(world_size)[rank]
    refused, stepped, current = None, [], []
    for i, batch in enumerate(stream[:6]):
        current.append(i)
        if rank == 0 and i == 1:
            acc._backward_part(du.micro_loss(model, batch, "mean")[0] * 0.5, None, 0.5)
            try:
                acc.zero_grad()
            except RuntimeError as e:
                refused = (str(e), acc.micro_step)
            acc._c.end_micro_step(failed=True)
            acc.zero_grad()
            current = []
            continue
        acc.backward(du.micro_loss(model, batch, "mean")[0])
        if acc.step():
            stepped.append(current)
            current = []
    return {"refused": refused, "stepped": stepped, "params": du.params(model)}


@job
def micro_step_after_closed_window(rank, world_size):
    """Every rank runs one micro-batch more after its window closed, before
    acc.step(): refused alike, nothing counted. Each then steps the window
    and runs that micro-batch again, as the refusal says. K=2, 3 windows."""
    import gradaccum

    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K)
    batches = [b for window in windows(world_size)[:3] for b in window[rank]]
    refused = []
    for i, batch in enumerate(batches):
        if i == 2:
            try:
                acc.backward(du.micro_loss(model, batch, "mean")[0])
            except RuntimeError as e:
                refused.append((str(e), acc.micro_step, acc.window_ready))
            acc.step()
        acc.backward(du.micro_loss(model, batch, "mean")[0])
        if i != 1:
            acc.step()
    return {"refused": refused, "params": du.params(model)}


@job
def backward_in_inference_mode(rank, world_size):
    """Rank 1 runs acc.backward() inside torch.inference_mode(): at the first
    micro-step (refused, not counted: it runs it again outside), then at the
    window's closing micro-step (the window is dropped on every rank). Before,
    .grad became inference tensors, every later backward raised torch's error
    on rank 1 alone, and rank 0 waited for the group's timeout (review)."""
    import time

    import gradaccum

    model = du.mlp(SEED)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=K)
    batches = [b for window in windows(world_size)[:3] for b in window[rank]]
    errors, start = [], time.monotonic()
    for i, batch in enumerate(batches):
        loss = du.micro_loss(model, batch, "mean")[0]
        if rank == 1 and i in (0, 3):
            try:
                with torch.inference_mode():
                    acc.backward(loss)
            except RuntimeError as e:
                errors.append((i, str(e), acc.micro_step))
            if i == 0:
                acc.backward(loss)
            continue
        try:
            acc.backward(loss)
        except RuntimeError as e:
            errors.append((i, str(e), acc.micro_step))
        acc.step()
    return {"errors": errors, "seconds": time.monotonic() - start, "params": du.params(model),
            "inference_grads": [p.grad is not None and p.grad.is_inference() for p in model.parameters()]}
