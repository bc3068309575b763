"""The end of the data on real Gloo ranks: acc.flush() and acc.join() meeting
a window nonfinite="raise" left closed (Note [A non-finite window left for
the epoch's end]) and windows with no weight (Note [A flushed window with no
weight]). Float64 references, exact texts, no waits for a timeout."""
import pytest
import torch

import _dist_utils as du
import _epoch_end_jobs as ej

M = "_epoch_end_jobs"
NONFINITE = "the window's gradient is not finite (total norm nan)"


def run(name, world_size, tmp_path, **kwargs):
    return du.run_job(name, world_size, tmp_path, module=M, timeout=120, pg_timeout=30, **kwargs)


@pytest.mark.parametrize("droppers", [(), (0,), (0, 1)], ids=["none", "one", "both"])
def test_a_nonfinite_window_left_closed_is_dropped_by_flush_on_every_rank(tmp_path, droppers):
    """Every rank's acc.step() raises on window 1; the ranks in `droppers`
    drop it as the error says, the others go on to acc.flush() with it still
    closed. Before, those raised again before the flush's collective: with
    one rank dropping, the other ranks waited in the flush until the group's
    timeout. Now acc.flush() drops it there (with a warning), every rank
    pairs, and the next windows are the float64 big batches without it."""
    results = run("nonfinite_left_closed", 2, tmp_path, droppers=droppers)
    expected = ej.reference(2, 3, skip=(1,))
    for res in results:
        assert res["errors"] == [("step", "gradaccum: acc.step(): " + NONFINITE + "; gradients left in .grad "
                                  "for inspection, call acc.zero_grad() to drop the window")], res["errors"]
        assert res["seconds"] < 20
        assert res["optimizer_steps"] == 2 and res["dropped_windows"] == 0
        du.assert_params_close(res["params"], expected, "rank")


def test_a_nonfinite_window_flush_steps_first_is_raised_there_on_every_rank(tmp_path):
    """No acc.step() on window 1: acc.flush() steps it and meets the NaN
    first, every rank alike, and raises it naming acc.flush()."""
    results = run("nonfinite_left_closed", 2, tmp_path, droppers=(), call_step=False)
    expected = ej.reference(2, 3, skip=(1,))
    for res in results:
        assert res["errors"] == [("flush", "gradaccum: acc.flush(): " + NONFINITE + "; gradients left in .grad "
                                  "for inspection, call acc.zero_grad() to drop the window")], res["errors"]
        du.assert_params_close(res["params"], expected, "rank")


@pytest.mark.parametrize("call_step", [True, False], ids=["raised", "first"])
def test_a_nonfinite_window_left_closed_while_a_rank_shadows_ends_join_on_every_rank(tmp_path, call_step):
    """Rank 0 shadows rank 1's last window in acc.join(); its gradient is
    NaN, so the shadow drops it. Rank 1 leaves it closed (its acc.step()
    raised, or it never called it): its acc.join() raised before any
    collective and rank 0 waited in its shadow reduction until the group's
    timeout. Now rank 1's acc.join() drops it too, and both leave join()."""
    results = run("nonfinite_left_closed", 2, tmp_path, droppers=(), end="join", call_step=call_step)
    expected = ej.reference(2, 3, skip=(1, 2))
    assert results[0]["errors"] == []
    assert results[1]["errors"] == ([("step", "gradaccum: acc.step(): " + NONFINITE + "; gradients left in .grad "
                                      "for inspection, call acc.zero_grad() to drop the window")] if call_step else [])
    for res in results:
        assert res["seconds"] < 20
        assert res["optimizer_steps"] == 1 and res["dropped_windows"] == 0
        du.assert_params_close(res["params"], expected, "rank")


def seen(res, label):
    (entry,) = [s for s in res["seen"] if s[0] == label]
    return entry[1:]


@pytest.mark.parametrize("case", ["flush", "flush one", "join"])
def test_a_window_with_no_weight_anywhere_is_skipped_alike_on_every_rank(tmp_path, case):
    """A window closed with no item anywhere steps nothing, counts in
    skipped_steps and has no window_loss, on every rank, as in one process:
    a flushed one (on both ranks, or on rank 0 alone while rank 1 flushes
    nothing) and one rank 1 shadows in join(). Before, the flushing ranks and
    the shadow kept the last window's loss and items and counted no skip."""
    results = run("weightless_windows", 2, tmp_path, case=case)
    label = "join" if case == "join" else "flush"
    for res in results:
        stepped, loss, items, skipped, steps = seen(res, label)
        assert (stepped, loss, items, skipped, steps) == (False, None, 0.0, 1, 1), res["seen"]
    du.assert_params_close(results[0]["params"], results[1]["params"], "rank 1", tol=0)


def test_a_flush_with_nothing_anywhere_closes_no_window(tmp_path):
    """Every rank flushes an empty window after a full one: no window closed,
    so window 0's loss and items stay and nothing is skipped."""
    results = run("weightless_windows", 2, tmp_path, case="nothing")
    for res in results:
        stepped, loss, items, skipped, steps = seen(res, "flush")
        assert (stepped, skipped, steps) == (False, 0, 1)
        assert (loss, items) == seen(res, "window 0")[1:3] and loss is not None and items > 0


@pytest.mark.parametrize("closing", ["flush", "backward"])
def test_a_window_with_no_weight_keeps_the_held_back_residuals(tmp_path, closing):
    """Error feedback: a window with no weight on any rank rounds nothing,
    and every rank holds its residual back through it (docs/design.md). It
    was thrown away with the skipped window, flushed or closed by a backward."""
    results = run("weightless_flush_keeps_residuals", 2, tmp_path, closing=closing)
    for res in results:
        assert res["skipped"] == 1
        assert any(r.abs().max() > 0 for r in res["before"])
        assert all(torch.equal(a, b) for a, b in zip(res["before"], res["after"]))


DROPPED_WARNING = (
    "gradaccum: acc.flush(): the closed window's gradient is not finite (nonfinite=\"raise\"; acc.step() raised it "
    "already): acc.flush() dropped the window, as acc.zero_grad() would, so that every rank ends the data together")


@pytest.mark.parametrize("filter_", ["default", "error"])
def test_one_process_flush_drops_a_nonfinite_window_step_raised_already(filter_):
    """The same rule in one process: acc.step() raised; acc.flush() drops the
    window as acc.zero_grad() would (it raised it again before), and the next
    window trains from where the last good one left the model. Its warning is
    a Python UserWarning (Note [C++ warnings reach Python's warnings]); a
    filter that makes it an error cannot undo the drop: the error is
    reported as unraisable, and flush() returns."""
    import sys
    import warnings

    import gradaccum

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    ref = torch.nn.Linear(3, 1).double()
    ref.load_state_dict(model.state_dict())
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, nonfinite="raise")
    x = torch.randn(4, 3, dtype=torch.float64)
    for k in range(2):
        acc.backward(model(x).pow(2).mean() * (float("nan") if k else 1.0))
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc.step\(\): the window's gradient is not finite"):
        acc.step()
    unraisable, hook = [], sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(u.exc_value)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter(filter_)
            assert acc.flush() is False
    finally:
        sys.unraisablehook = hook
    if filter_ == "error":
        assert caught == [] and [type(e) for e in unraisable] == [UserWarning], unraisable
        assert str(unraisable[0]) == DROPPED_WARNING
    else:
        assert [(w.category, str(w.message)) for w in caught] == [(UserWarning, DROPPED_WARNING)] and not unraisable
    assert not acc.window_ready and all(p.grad is None for p in model.parameters())
    for _ in range(2):
        acc.backward(model(x).pow(2).mean())
    assert acc.step()
    ref.zero_grad()
    ref(x).pow(2).mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q.detach() - 0.1 * q.grad, rtol=0, atol=1e-15)


@pytest.mark.parametrize("end,retry,roundtrip", [("flush", "flush", False), ("flush", "flush", True),
                                                 ("join", "flush", False), ("join", "join", False),
                                                 ("join", "step", True)])
def test_flush_called_again_after_its_step_raised_steps_its_window_without_a_collective(tmp_path, end, retry,
                                                                                       roundtrip):
    """Note [Flushing again after its step raised]: rank 1's optimizer raised
    in the step of the window its acc.flush() (or acc.join()'s last
    reduction) had closed; the flush called again ran a second flush
    collective, which paired with rank 0's next epoch: every rank raised
    there, or, retried by join(), rank 0 stepped its next windows alone,
    silently wrong (reviews; also after a checkpoint between the two). It now
    steps the closed window, as acc.step() would: every window of the
    float64 big batch, and the ranks still pair."""
    results = du.run_job("flush_again_after_its_step_raised", 2, tmp_path, module=M, timeout=120, end=end,
                         retry=retry, roundtrip=roundtrip)
    expected = du.windows_reference(ej.SEED, ej.flush_again_windows(2), "mean")
    assert results[0]["errors"] == [] and results[0]["flushed"] == [True]
    assert results[1]["flushed"] == [True] and len(results[1]["errors"]) == 1
    assert "the optimizer failed once" in results[1]["errors"][0], results[1]["errors"]
    for rank, res in enumerate(results):
        assert res["paired"] and res["stats"]["optimizer_steps"] == 4, res["stats"]
        du.assert_params_close(res["params"], expected, f"rank {rank}")


@pytest.mark.parametrize("flush_first", [False, True], ids=["next_epoch", "flush_first"])
def test_a_state_saved_where_the_others_flush_ended_the_epoch_resumes_every_rank(tmp_path, flush_first):
    """Rank 0 has one more full window than rank 1; its step of that window
    ends its epoch with rank 1's flush() (acc.epoch_ended), and it saves a
    rank-independent state there, as frameworks do after each optimizer step.
    That state_dict() raised on rank 0 alone, its peer then failing in a
    transport error (review); it now saves the state every rank holds after
    its flush(). Resumed on both ranks (into the next epoch, or a flush()
    first, which pairs): the float64 big batches, as the uninterrupted run."""
    path = str(tmp_path / "ckpt.pt")
    first = du.run_job("save_where_the_epoch_ended", 2, tmp_path / "first", module=M, timeout=120, path=path,
                       resume=False)
    assert first[0]["epoch_ended_at_save"] is True and first[0]["saved_epoch_ended"] is False, first[0]
    resumed = du.run_job("save_where_the_epoch_ended", 2, tmp_path / "resumed", module=M, timeout=120, path=path,
                         resume=True, flush_first=flush_first)
    expected = du.windows_reference(ej.SEED, ej.epoch_end_save_windows(2), "mean")
    for rank in range(2):
        for res in (first[rank], resumed[rank]):
            assert res["paired"] and res["stats"]["optimizer_steps"] == 5, res["stats"]
            du.assert_params_close(res["params"], expected, f"rank {rank}")
    assert [res.get("flushed") for res in resumed] == ([False, False] if flush_first else [None, None])


def _one_process_flush_that_raised():
    """One process, K=3: one micro-step, then flush(), whose optimizer step
    raises once. The model, its optimizer, the Accumulator and the input."""
    import gradaccum

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=3)
    x = torch.randn(2, 3, dtype=torch.float64)
    acc.backward(model(x).pow(2).mean())
    real, opt.step = opt.step, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("optimizer failed"))
    with pytest.raises(RuntimeError, match="optimizer failed"):
        acc.flush()
    opt.step = real
    return model, opt, acc, x


def test_a_micro_step_after_the_epoch_ends_step_raised_says_to_flush_again():
    """One process: flush() closes the partial window and its step raises.
    The next micro-step is refused, naming the epoch's end and the retry
    (review: it said the previous micro-step closed the window), changing
    nothing; flush() again steps the window."""
    model, opt, acc, x = _one_process_flush_that_raised()
    held = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError) as info:
        acc.backward(model(x).pow(2).mean())
    assert str(info.value) == (
        "gradaccum: acc.backward(): the epoch's end (acc.flush(), or acc.join()'s last reduction) closed the window, "
        "and its step raised; call acc.flush() (or acc.join(), or acc.step()) again to step it, with no collective "
        "(or acc.zero_grad() to drop it) before the next micro-step")
    assert all(torch.equal(p.grad, h) for p, h in zip(model.parameters(), held))
    assert acc.flush() and acc.stats()["optimizer_steps"] == 1


def test_a_state_saved_after_a_one_process_flushs_step_raised_loads_and_flushes_again():
    """One process: flush() closed the partial window and its step raised; the
    state saved there kept the window's weight, and every load refused it
    (review). It loads, and flush() again steps the window. A NaN window
    that nonfinite="raise" refused at flush() is not told to flush again:
    the refusal says to drop it (review)."""
    import gradaccum

    model, opt, acc, x = _one_process_flush_that_raised()
    state = acc.state_dict()
    assert (state["window_ready"], state["window_weight"], state["window_closed_by_flush"]) == (True, 0.0, True)
    acc.close()
    resumed = gradaccum.Accumulator(model, opt, steps=3)
    resumed.load_state_dict(state)
    assert resumed.flush() and resumed.stats()["optimizer_steps"] == 1
    resumed.close()
    acc = gradaccum.Accumulator(model, opt, steps=3, nonfinite="raise")
    acc.backward(model(x).pow(2).mean() * float("nan"))
    with pytest.raises(RuntimeError, match="not finite"):
        acc.flush()
    with pytest.raises(RuntimeError) as info:
        acc.backward(model(x).pow(2).mean())
    assert str(info.value).startswith(  # (review: it said the previous micro-step had closed it)
        "gradaccum: acc.backward(): the epoch's end (acc.flush(), or acc.join()'s last reduction) closed the window, "
        "and its gradient is not finite (nonfinite=\"raise\"); call acc.zero_grad() to drop it before the next "
        "micro-step")
    acc.close()
