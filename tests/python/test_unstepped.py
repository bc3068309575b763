"""A closed window that some ranks drop instead of stepping (Note [A window not
stepped on some ranks]): the replicas differ, and every rank must say so in the
next reduction; dropped alike on every rank, nothing is said. Real Gloo ranks,
float64 references, exact error texts.
"""
import pytest

import _dist_utils as du
import _unstepped_jobs as uj

M = "_unstepped_jobs"

REPLICAS = ("the replicas differ from here on. Resume every rank from a checkpoint (acc.load_state_dict() on every "
            "rank). The window was dropped on every rank")
ELSEWHERE = ("did not step a window every rank had reduced, while the other ranks stepped it (acc.zero_grad() "
             "dropped the closed window there, say after acc.step() raised; a failure there after the window's "
             "reduction cleared it; its loss scaler's update() raised after its step; or it left its acc.join() "
             "block with an exception before stepping it): " + REPLICAS)
HERE = ("did not step a window every rank had reduced (acc.zero_grad() dropped it here once it was closed), while "
        "the other ranks stepped it: " + REPLICAS)


def run(world_size, tmp_path, **kwargs):
    return du.run_job("closed_window_dropped", world_size, tmp_path, module=M, timeout=120, pg_timeout=30, **kwargs)


def assert_params_close(got, expected, tol=1e-10):
    for i, (a, e) in enumerate(zip(got, expected)):
        diff = (a - e).abs().max().item() / max(1.0, e.abs().max().item())
        assert diff <= tol, f"parameter {i}: relative difference {diff:.3g}"


def step_error(rank):
    return (1, "step", f"optimizer failed on rank {rank}")


def test_a_window_one_rank_drops_after_its_step_failed_makes_every_rank_raise_then_resume(tmp_path):
    """Rank 1's acc.step() raises in window 1; the script drops the window
    with acc.zero_grad() and goes on. Rank 0 stepped it: window 2's reduction
    is dropped on both ranks with one text each (before this, training went on
    with different weights on the two ranks, silently). Both resume from the
    checkpoint before window 1 and end at the float64 big batches."""
    results = run(2, tmp_path, droppers=(1,))
    assert results[0]["errors"] == [(2, "reduction", "gradaccum: acc.backward(): window 2: rank 1 " + ELSEWHERE)]
    assert results[1]["errors"] == [step_error(1), (2, "reduction", "gradaccum: acc.backward(): window 2: this "
                                                    "rank (rank 1) " + HERE)]
    expected = uj.reference(2)
    for res in results:
        assert res["resumed"] and res["dropped_before"] == 1
        assert res["optimizer_steps"] == uj.WINDOWS
        assert_params_close(res["params"], expected)


def test_a_step_one_rank_refuses_for_a_parameter_outside_the_model_makes_every_rank_raise(tmp_path):
    """Rank 1's optimizer gained a parameter the model does not hold, with a
    gradient (Note [Parameters only the optimizer steps]): its acc.step()
    refuses window 1 before stepping anything, and the script drops it. Rank 0
    stepped it: window 2 is dropped on both ranks with one text each, and
    both resume to the float64 big batches."""
    results = run(2, tmp_path, droppers=(1,), fails="outside")
    assert results[0]["errors"] == [(2, "reduction", "gradaccum: acc.backward(): window 2: rank 1 " + ELSEWHERE)]
    assert results[1]["errors"][0] == (1, "step", (
        "gradaccum: acc.step(): the optimizer steps a parameter that is not the model's and has a gradient (its "
        "parameter 6 counting through param_groups, of shape [2]): nothing would divide that gradient by the "
        "window's weight, reduce it over ranks or clear it, so it would be stepped with every micro-step's gradient "
        "summed, window after window. Build the Accumulator over a module that holds every parameter the optimizer "
        "steps (Python: torch.nn.ModuleList([model, head])); for a layer added to the model, call "
        "acc.refresh_parameters() at a window boundary. Nothing was stepped: acc.zero_grad() drops this window"))
    assert results[1]["errors"][1:] == [(2, "reduction", "gradaccum: acc.backward(): window 2: this rank (rank 1) "
                                         + HERE)]
    expected = uj.reference(2)
    for res in results:
        assert res["resumed"] and res["optimizer_steps"] == uj.WINDOWS
        assert_params_close(res["params"], expected)


def test_a_window_every_rank_drops_alike_is_no_error(tmp_path):
    """Every rank drops window 1 (a skip every rank decides alike): the
    replicas are the same, nothing is raised, and training goes on as the big
    batches without window 1."""
    results = run(2, tmp_path, droppers=(0, 1))
    expected = uj.reference(2, skip=(1,))
    for rank, res in enumerate(results):
        assert res["errors"] == [step_error(rank)]
        assert not res["resumed"] and res["optimizer_steps"] == uj.WINDOWS - 1
        assert_params_close(res["params"], expected)


def test_several_ranks_that_drop_a_window_are_counted_on_three_ranks(tmp_path):
    """Ranks 1 and 2 of 3 drop window 1: rank 0 counts them, each of them
    says it is one of them."""
    results = run(3, tmp_path, droppers=(1, 2), on_error="stop")
    assert results[0]["errors"] == [(2, "reduction", "gradaccum: acc.backward(): window 2: 2 of the 3 ranks "
                                     + ELSEWHERE)]
    for rank in (1, 2):
        assert results[rank]["errors"] == [step_error(rank), (2, "reduction", "gradaccum: acc.backward(): window "
                                           f"2: this rank (rank {rank}) and 1 other rank " + HERE)]
    for res in results:
        assert res["dropped_before"] == 1


@pytest.mark.parametrize("then,call,where", [
    ("flush", "acc.flush()", "window 2"),
    ("snapshot", "acc.state_dict()", "window 2"),
    ("refresh", "acc.refresh_parameters()", "its check (reduction 2)"),
])
def test_whatever_reduction_comes_next_tells_every_rank(tmp_path, then, call, where):
    """The next reduction need not be a window's: a flush, a checkpoint's
    snapshot or a refresh's check carries the same word, and every rank raises
    from that call."""
    results = run(2, tmp_path, droppers=(1,), then=then, on_error="stop")
    tail = {"refresh": ". Nothing was refreshed", "snapshot": "",
            "flush": ". Every rank ended its epoch in this acc.flush(): do not call it again for this epoch (a second "
                     "one would pair with the other ranks' next window); the next micro-step begins the next epoch"
            }[then]
    assert results[0]["errors"] == [(2, "reduction", f"gradaccum: {call}: {where}: rank 1 " + ELSEWHERE + tail)]
    assert results[1]["errors"] == [step_error(1), (2, "reduction", f"gradaccum: {call}: {where}: this rank "
                                                    "(rank 1) " + HERE + tail)]


def test_the_word_outlives_a_reduction_dropped_for_another_reason(tmp_path):
    """Rank 1 drops window 1; in window 2 rank 0's backward raises, so every
    rank drops window 2 for that (whose text says nothing of window 1): window
    3 still tells both ranks that the replicas differ."""
    results = run(2, tmp_path, droppers=(1,), boom_rank=0, on_error="go_on")
    (boom0,), (boom1,) = [[e for e in res["errors"] if e[0] == 2] for res in results]
    assert "injected failure on rank 0" in boom0[2] and "rank 0" in boom1[2], (boom0, boom1)
    assert "did not step" not in boom0[2] + boom1[2]
    assert results[0]["errors"][-1] == (3, "reduction", "gradaccum: acc.backward(): window 3: rank 1 " + ELSEWHERE)
    assert results[1]["errors"][-1] == (3, "reduction", "gradaccum: acc.backward(): window 3: this rank (rank 1) "
                                        + HERE)
    for res in results:
        assert res["dropped_windows"] == 2  # windows 2 and 3; window 4 trains


def test_resuming_before_any_reduction_clears_the_word(tmp_path):
    """Rank 1 drops window 1, and every rank resumes from the checkpoint at
    once, before any reduction: nothing is raised, and the run ends at the
    float64 big batches."""
    results = run(2, tmp_path, droppers=(1,), resume_at_once=True)
    assert results[0]["errors"] == []
    assert results[1]["errors"] == [step_error(1)]
    expected = uj.reference(2)
    for res in results:
        assert res["resumed"] and res["optimizer_steps"] == uj.WINDOWS
        assert_params_close(res["params"], expected)


def test_a_retry_after_the_scheduler_raised_runs_the_scheduler_alone(tmp_path):
    """Rank 1's scheduler raises after its optimizer stepped window 1; the
    script calls acc.step() again, which runs the scheduler alone (the
    optimizer stepped once: the big batches), and no rank raises."""
    results = run(2, tmp_path, droppers=(1,), fails="scheduler", recover="retry")
    assert results[0]["errors"] == []
    assert results[1]["errors"] == [(1, "step", "scheduler failed on rank 1")]
    expected = uj.reference(2)
    for res in results:
        assert not res["resumed"] and res["optimizer_steps"] == uj.WINDOWS
        assert res["scheduler_epoch"] == uj.WINDOWS
        assert_params_close(res["params"], expected)


def test_a_retry_after_the_optimizer_raised_clips_once(tmp_path):
    """max_grad_norm clips every window (the norms are above 0.05); rank 1's
    optimizer raises on window 1 after the clip, and the script retries
    acc.step(): the gradient is stepped as clipped, not clipped a second time
    on rank 1 alone (which made the replicas drift by 1e-7, silently). Both
    ranks end at the float64 big batches, clipped once each."""
    expected = uj.reference(2, max_norm=0.05)
    assert max((a - b).abs().max().item() for a, b in zip(expected, uj.reference(2))) > 1e-3  # clipping bites
    results = run(2, tmp_path, droppers=(1,), recover="retry", max_grad_norm=0.05)
    assert results[0]["errors"] == []
    assert results[1]["errors"] == [step_error(1)]
    for res in results:
        assert not res["resumed"] and res["optimizer_steps"] == uj.WINDOWS
        assert_params_close(res["params"], expected)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert (a - b).abs().max().item() <= 1e-15


def test_a_window_dropped_after_the_scheduler_raised_is_told_to_every_rank(tmp_path):
    """Rank 1's optimizer stepped window 1 but its scheduler raised, and the
    script drops the window: the weights agree, the schedulers do not (a
    warmup or cosine learning rate would differ from here on), so every rank
    raises in window 2, rank 1 saying why; then every rank resumes."""
    results = run(2, tmp_path, droppers=(1,), fails="scheduler", recover="zero_grad")
    assert results[0]["errors"] == [(2, "reduction", "gradaccum: acc.backward(): window 2: rank 1 " + ELSEWHERE)]
    assert results[1]["errors"] == [
        (1, "step", "scheduler failed on rank 1"),
        (2, "reduction", "gradaccum: acc.backward(): window 2: this rank (rank 1) did not step a window every rank "
         "had reduced (its optimizer stepped it, but its scheduler raised and acc.zero_grad() dropped the window "
         "here), while the other ranks stepped it: " + REPLICAS)]
    expected = uj.reference(2)
    for res in results:
        assert res["resumed"] and res["optimizer_steps"] == uj.WINDOWS
        assert_params_close(res["params"], expected)


def test_a_scaler_update_that_raised_on_one_rank_is_told_to_every_rank(tmp_path):
    """Review: GradScaler.update() raising on rank 1 after window 0 stepped
    left its scale apart from rank 0's with nothing said to rank 0 (and rank
    1's next window refused, rank 0 then waited for the group's timeout).
    Rank 1 says what failed, and window 1's reduction tells every rank."""
    results = du.run_job("scaler_update_fails", 2, tmp_path, module=M, timeout=120, pg_timeout=30)
    assert results[0]["errors"] == [(1, "reduction", "gradaccum: acc.backward(): window 1: rank 1 " + ELSEWHERE)]
    assert results[1]["errors"] == [
        (0, "step", "gradaccum: acc.step(): the grad_scaler's update() raised after the window stepped (its "
         "optimizer step ran): RuntimeError: a scale store's hiccup. The scaler is left mid-window and its scale "
         "may now differ between ranks: end training here and resume from a checkpoint"),
        (1, "reduction", "gradaccum: acc.backward(): window 1: this rank (rank 1) did not step a window every rank "
         "had reduced (its optimizer stepped it, but its loss scaler's update() raised after, so its loss scale may "
         "differ from the other ranks'), while the other ranks stepped it: " + REPLICAS)]
    assert results[0]["scale"] == 512.0 and results[1]["scale"] == 256.0  # (apart: what the error tells)


def test_a_failure_after_the_manual_paths_reduction_is_worded_and_told(tmp_path):
    results = du.run_job("manual_write_back_fails", 2, tmp_path, module=M, timeout=120, pg_timeout=30)
    (first, second) = results[1]["errors"]
    assert first[0] == 0 and first[1].startswith(
        "gradaccum: loss.backward(): every rank reduced the manual path's window, but this rank (rank 1) failed "
        "after that: "), first
    assert first[1].endswith(". Its gradients were cleared (its own optimizer.step() steps nothing) while the other "
                             "ranks step theirs: the replicas differ from here on. Resume every rank from a "
                             "checkpoint (the next reduction tells every rank, and every rank drops it)"), first
    assert second[0] == 1 and second[1].startswith("gradaccum: loss.backward(): window 1: this rank (rank 1) did not "
                                                   "step a window every rank had reduced"), second
    ((w, text),) = results[0]["errors"]
    assert w == 1 and text.startswith("gradaccum: loss.backward(): window 1: rank 1 did not step a window"), text


def test_a_rank_that_drops_a_window_the_others_skip_is_no_error(tmp_path):
    """Window 1's gradient is NaN (rank 0's loss): nonfinite="skip" skips it
    on rank 0, while rank 1's acc.step() raises before that decision (its
    .grad replaced) and rank 1 drops the window. Neither stepped: nothing is
    raised, and the run is the big batches without window 1."""
    results = run(2, tmp_path, droppers=(1,), fails="replaced", nan_rank=0)
    assert results[0]["errors"] == []
    (step,) = results[1]["errors"]
    assert step[:2] == (1, "step") and "acc.step()" in step[2], step
    expected = uj.reference(2, skip=(1,))
    for res in results:
        assert not res["resumed"] and res["optimizer_steps"] == uj.WINDOWS - 1
        assert_params_close(res["params"], expected)
    assert results[0]["skipped_steps"] == 1


def test_one_process_retry_after_the_scheduler_raised_steps_the_optimizer_once():
    """One process: the optimizer stepped, then the scheduler raised. A
    checkpoint now would step the optimizer again when resumed: refused,
    changing nothing; a retry of acc.step() runs the scheduler alone."""
    import torch

    import gradaccum

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    acc = gradaccum.Accumulator(model, opt, steps=1, scheduler=sched)
    real, calls = sched.step, []

    def step(*args, **kwargs):
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("scheduler failed")
        return real(*args, **kwargs)

    sched.step = step
    x = torch.ones(2, 3, dtype=torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    acc.backward(model(x).sum())
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="scheduler failed"):
        acc.step()
    after_one = [p.detach().clone() for p in model.parameters()]
    for b, g, a in zip(before, grads, after_one):
        assert torch.equal(a, b - 0.1 * g)
    with pytest.raises(RuntimeError) as refused:
        acc.state_dict()
    assert str(refused.value) == ("gradaccum: acc.state_dict(): the optimizer stepped this window but the scheduler "
                                  "raised; call acc.step() again (it runs the scheduler only) before saving")
    assert acc.step() is True
    assert calls == [0, 1] and acc.stats()["optimizer_steps"] == 1
    for a, p in zip(after_one, model.parameters()):
        assert torch.equal(p.detach(), a)  # the optimizer did not step again
    assert not acc.window_ready
    acc.state_dict()  # at the boundary now


@pytest.mark.parametrize("resume", [False, True])
def test_one_process_retry_after_the_optimizer_raised_clips_once(resume):
    """One process, max_grad_norm: the optimizer raises once after the clip.
    A retry of acc.step(), or a checkpoint saved then and resumed by a fresh
    Accumulator ("window_clipped"), steps the gradient clipped once: bit for
    bit the run without the failure."""
    import torch

    import gradaccum

    def run_once(fail):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        acc = gradaccum.Accumulator(model, opt, steps=2, max_grad_norm=0.5)
        real, seen = opt.step, []

        def step(*args, **kwargs):
            seen.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            if fail and len(seen) == 1:
                raise RuntimeError("optimizer failed")
            return real(*args, **kwargs)

        opt.step = step
        x = torch.linspace(-3, 3, 32, dtype=torch.float64).reshape(8, 4)
        for _ in range(2):
            acc.backward(model(x).pow(2).mean())
        if fail:
            with pytest.raises(RuntimeError, match="optimizer failed"):
                acc.step()
            assert acc.window_ready
            if resume:
                state = acc.state_dict()
                assert state["window_clipped"]
                acc.close()
                acc = gradaccum.Accumulator(model, opt, steps=2, max_grad_norm=0.5)
                acc.load_state_dict(state)
        assert acc.step()
        assert acc.stats()["optimizer_steps"] == 1
        return seen, [p.detach().clone() for p in model.parameters()]

    clean_seen, clean = run_once(False)
    assert clean_seen[0].norm().item() == pytest.approx(0.5, rel=1e-5)  # the clip bites
    seen, got = run_once(True)
    assert len(seen) == 2 and torch.equal(seen[1], seen[0]) and torch.equal(seen[1], clean_seen[0])
    for a, b in zip(got, clean):
        assert torch.equal(a, b)


def test_a_flush_that_one_rank_cannot_step_its_closed_window_for_is_told_once(tmp_path):
    """Window 1's gradient is NaN; every rank ends it with acc.flush(), which
    steps the closed window first: rank 0 skips it, rank 1 fails before that
    decision (its .grad replaced) and drops the flush's reduction on every
    rank. Every rank raises there once (it says the replicas differ, which the
    skip makes a false alarm: the documented limit), and the next epoch trains
    with no second error: the big batches without window 1."""
    results = run(2, tmp_path, droppers=(1,), fails="replaced", nan_rank=0, flush_closed=True, on_error="go_on")
    for rank, res in enumerate(results):
        (err,) = res["errors"]
        assert err[:2] == (1, "step") and err[2].startswith("gradaccum: acc.flush(): window 2 was dropped on every "
                                                            "rank: "), err
        assert "could not step a window every rank had reduced as its data ended" in err[2], err
    expected = uj.reference(2, skip=(1,))
    for res in results:
        assert res["optimizer_steps"] == uj.WINDOWS - 1
        assert_params_close(res["params"], expected)


def late_backward_error(name):
    return (f"gradaccum: acc.step(): a backward reached {name} after the acc.backward() that closed the window and "
            "before acc.step() (another loss's backward through these parameters, e.g. a GAN's generator loss "
            "through a discriminator that is not frozen?): it sums into the window's gradients a gradient no "
            "micro-step counted, reduced over no rank. Call acc.step() right after the micro-step that closes the "
            "window, or freeze the other network for that backward (requires_grad_(False)). Nothing was stepped: "
            "acc.zero_grad() drops this window")


def test_a_backward_after_the_window_closed_on_every_rank_is_refused_alike(tmp_path):
    """Every rank runs another loss's backward through the model after window
    1 closed, before acc.step() (a GAN's generator step through a discriminator
    that is not frozen). Its hooks began a reduction of their own (the manual
    path), so the step was neither the window nor the sum, on every rank,
    silently. Now no reduction begins (one per window, none more), acc.step()
    refuses alike on every rank, the script drops the window, and training
    goes on as the big batches without window 1."""
    results = run(2, tmp_path, droppers=(0, 1), fails="late_backward")
    expected = uj.reference(2, skip=(1,))
    for res in results:
        assert res["errors"] == [(1, "step", late_backward_error("4.bias"))]
        assert res["optimizer_steps"] == uj.WINDOWS - 1 and res["reductions"] == uj.WINDOWS
        assert_params_close(res["params"], expected)


def test_a_backward_after_the_window_closed_on_one_rank_is_told_to_every_rank(tmp_path):
    """Rank 1 alone runs that backward: its acc.step() refuses, and its
    acc.zero_grad() is told to every rank by window 2's reduction (before,
    that backward's own reduction met rank 0's window 2 instead). Both resume
    from the checkpoint before window 1 and end at the float64 big batches."""
    results = run(2, tmp_path, droppers=(1,), fails="late_backward")
    assert results[0]["errors"] == [(2, "reduction", "gradaccum: acc.backward(): window 2: rank 1 " + ELSEWHERE)]
    assert results[1]["errors"] == [(1, "step", late_backward_error("4.bias")),
                                    (2, "reduction", "gradaccum: acc.backward(): window 2: this rank (rank 1) " + HERE)]
    expected = uj.reference(2)
    for res in results:
        assert res["resumed"] and res["optimizer_steps"] == uj.WINDOWS
        assert_params_close(res["params"], expected)


# Note [Dropping the middle of a window]
def run_mid(world_size, tmp_path, **kwargs):
    results = du.run_job("mid_window_dropped", world_size, tmp_path, module=M, timeout=120, pg_timeout=30, **kwargs)
    stepped = [r["stepped"] for r in results]
    assert len({len(s) for s in stepped}) == 1, stepped  # every rank stepped as many windows
    expected = uj.mid_reference(world_size, list(zip(*stepped)))
    for res in results:
        assert_params_close(res["params"], expected)
        assert res["dropped_windows"] == 0
    return results


FULL = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11], [12, 13, 14]]


def test_a_rank_that_drops_its_part_after_a_failed_micro_step_stays_in_line(tmp_path):
    """Rank 1's backward fails at micro-batch 4, in window 1; its script
    catches that and drops the window with acc.zero_grad(). Before, rank 1's
    position went back to 0 and its windows started two micro-batches after
    rank 0's from then on: every later window paired micro-batches of other
    positions, with no error anywhere. Now the position stays: window 1
    closes with rank 0's, holding rank 0's three micro-batches and rank 1's
    last one, and every window is the float64 big batch of what it got."""
    results = run_mid(2, tmp_path, droppers=(1,))
    assert results[0]["errors"] == []
    assert results[1]["errors"] == [(4, "backward", "injected failure on rank 1")]
    assert results[0]["stepped"] == FULL
    assert results[1]["stepped"] == [[0, 1, 2], [5]] + FULL[2:]


@pytest.mark.parametrize("world_size, droppers, at", [(2, (0, 1), 4), (2, (0, 1), [3, 4]), (3, (1, 2), 4)],
                         ids=["alike", "different micro-steps", "two of three"])
def test_ranks_that_drop_their_part_of_a_window_stay_in_line(tmp_path, world_size, droppers, at):
    """Drops with no failure, on every rank alike, at different micro-steps
    of one window, or on two ranks of three: no error, every window closes
    on every rank together with what each kept."""
    results = run_mid(world_size, tmp_path, droppers=droppers, fail=False, at=at)
    for rank, res in enumerate(results):
        assert res["errors"] == []
        mine = at[rank] if isinstance(at, list) else at
        expected = FULL if rank not in droppers else [[0, 1, 2], list(range(mine + 1, 6))] + FULL[2:]
        assert res["stepped"] == expected, rank


def test_a_flush_right_after_a_rank_dropped_its_part_steps_what_the_ranks_hold(tmp_path):
    results = run_mid(2, tmp_path, droppers=(1,), then="flush")
    assert results[0]["errors"] == []
    assert results[1]["errors"] == [(4, "backward", "injected failure on rank 1")]
    assert results[0]["stepped"] == [[0, 1, 2], [3, 4]]
    assert results[1]["stepped"] == [[0, 1, 2], []]


def test_the_only_rank_with_data_drops_its_part_while_another_shadows(tmp_path):
    """Rank 1 joined after its first window; rank 0 drops its part of window
    1. Every window is the float64 big batch of what it got."""
    results = du.run_job("mid_window_dropped", 2, tmp_path, module=M, timeout=120, pg_timeout=30,
                         droppers=(0,), fail=False, then="join", counts=[12, 3])
    for res in results:
        assert res["errors"] == [] and res["dropped_windows"] == 0
        assert res["optimizer_steps"] == 4
    assert results[0]["stepped"] == [[0, 1, 2], [5], [6, 7, 8], [9, 10, 11]] and results[0]["left"] == []
    expected = uj.mid_reference(2, [([0, 1, 2], [0, 1, 2]), ([5], []), ([6, 7, 8], []), ([9, 10, 11], [])])
    for res in results:
        assert_params_close(res["params"], expected)


def test_a_rank_that_drops_its_part_of_a_window_resumed_from_a_per_rank_state_stays_in_line(tmp_path):
    """Per-rank states hold each rank's own sums: rank 0's drop after the
    resume leaves rank 1's micro-batches 0-3 and rank 0's 3, and the window's
    loss is theirs on both ranks (each rank's loss sums so far travel in its
    state: Note [The window's loss across a checkpoint])."""
    results = du.run_job("resumed_then_dropped", 2, tmp_path, module=M, timeout=120, pg_timeout=30,
                         rank_independent=False)
    assert [r["error"] for r in results] == [None, None]
    assert results[0]["stepped"] == [3] and results[1]["stepped"] == [0, 1, 2, 3]
    stream = uj.mid_stream(2)
    losses = []
    expected = du.windows_reference(uj.SEED, [[[stream[0][3]], [stream[1][i] for i in range(4)]]], "mean",
                                    optimizer="sgd", losses=losses)
    for res in results:
        assert res["window_loss"] == pytest.approx(losses[0], rel=1e-12), (res["window_loss"], losses)
        assert_params_close(res["params"], expected)


@pytest.mark.parametrize("then_per_rank", [False, True])
def test_a_rank_that_drops_its_part_of_a_window_resumed_from_a_rank_independent_state_drops_it_everywhere(
        tmp_path, then_per_rank):
    """A rank-independent state gives each rank 1/W of every rank's sums:
    one rank's drop cannot take its own part out (it weighed the others'
    micro-batches by a half, silently, 0.2 off). The window is dropped on
    every rank when it closes, naming rank 0 and the resumed window. A
    per-rank state saved and loaded after that resume keeps knowing it
    (window_shared; before: it forgot, and the drop was 0.15 off, silently)."""
    results = du.run_job("resumed_then_dropped", 2, tmp_path, module=M, timeout=120, pg_timeout=30,
                         rank_independent=True, then_per_rank=then_per_rank)
    # (window 1: the rank-independent snapshot took reduction 0; a per-rank save runs none)
    why = ("the accumulated gradients were cleared or changed outside the Accumulator in the middle of the window "
           "(optimizer.zero_grad() or model.zero_grad() between micro-steps, clipping or another in-place change "
           "of .grad before the window closed (clip under `if acc.window_ready:`, after its last backward, or pass "
           "max_grad_norm), a model converted there "
           "(model.double(): convert it at a window boundary, then call acc.refresh_parameters()), or a backward "
           "other than "
           "acc.backward() through these parameters, such as another model's loss?), or held a gradient no "
           "micro-step counted when it began (a plain loss.backward() at the window boundary, or .grad left before "
           "the Accumulator was built?), or acc.zero_grad() dropped its part of a window resumed in its middle from "
           "a rank-independent state, whose gradients hold a share of every rank's sums")
    for rank, res in enumerate(results):
        who = "this rank (rank 0)" if rank == 0 else "rank 0"
        assert res["error"].startswith(f"gradaccum: acc.backward(): window 1 was dropped on every rank: on {who} "
                                       f"{why}"), res["error"]
    init = du.params(du.mlp(uj.SEED))
    for res in results:
        assert res["stepped"] is None
        assert_params_close(res["params"], init, tol=0)


def test_a_micro_step_open_in_parts_is_not_dropped_by_zero_grad(tmp_path):
    """Data parallel, acc.zero_grad() with a micro-step open in parts would
    leave it uncounted on that rank alone: refused, nothing changed; ended
    failed, it keeps its place and the drop then lines up."""
    results = du.run_job("parts_then_zero_grad", 2, tmp_path, module=M, timeout=120, pg_timeout=30)
    text, position = results[0]["refused"]
    assert text.startswith("gradaccum: acc.zero_grad(): a micro-step run in parts (acc.backward_part()) is still "
                           "open; end it first with acc.end_micro_step()"), text
    assert position == 1
    assert results[0]["stepped"] == [[2], [3, 4, 5]] and results[1]["stepped"] == [[0, 1, 2], [3, 4, 5]]
    expected = uj.mid_reference(2, [([2], [0, 1, 2]), ([3, 4, 5], [3, 4, 5])])
    for res in results:
        assert_params_close(res["params"], expected)


def test_a_micro_step_after_a_closed_window_is_refused_alike_and_the_advice_trains_exactly(tmp_path):
    """Every rank forgets acc.step() once: each is refused with the same
    text (which says what to do and what the others do meanwhile; it used to
    say that the other ranks had stepped, which none had: review), and the
    advice, acc.step() and the micro-batch again, is the reference."""
    results = du.run_job("micro_step_after_closed_window", 2, tmp_path, module=M, timeout=120, pg_timeout=30)
    text = ("gradaccum: acc.backward(): the window closed at the previous micro-step (acc.backward() or acc.run(), "
            "or in the state acc.load_state_dict() loaded); "
            "call acc.step() before the next micro-step, then run this micro-batch again (it was not counted): "
            "ranks that stepped their window wait for this one in their next reduction (until the group's "
            "timeout), and acc.zero_grad() would drop the window here, so that this replica would differ from those "
            "of the ranks that stepped it")
    for res in results:
        assert res["refused"] == [(text, 0, True)]
        assert_params_close(res["params"], du.windows_reference(uj.SEED, uj.windows(2)[:3], "mean"))


def test_a_backward_inside_inference_mode_is_refused_and_told_to_every_rank(tmp_path):
    results = du.run_job("backward_in_inference_mode", 2, tmp_path, module=M, timeout=120, pg_timeout=30)
    inference = ("gradaccum: acc.backward(): called inside torch.inference_mode(), where backward would make .grad "
                 "inference tensors that no later backward can add to; run the micro-step outside it (an "
                 "evaluation inside it between micro-steps is fine)")
    first, closing = results[1]["errors"]
    assert first == (0, inference + "; this micro-step was not counted: run it again with a valid loss, or call "
                     "acc.empty_micro_step() in its place, so that this rank's windows stay aligned with the other "
                     "ranks'", 0)
    assert closing[0] == 3 and closing[1].startswith(inference + "; window 1 was dropped on every rank")
    (told,) = results[0]["errors"]
    assert told[0] == 3 and "window 1 was dropped on every rank" in told[1], told
    for res in results:
        assert res["seconds"] < 20 and not any(res["inference_grads"])
        # windows 0 and 2 stepped, window 1 dropped on both ranks
        assert_params_close(res["params"], du.windows_reference(uj.SEED, uj.windows(2)[:3], "mean", skip=(1,)))
