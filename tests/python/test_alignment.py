"""Ranks that would fall out of step without an error: a micro-batch that
fails or is refused on one rank in the middle of a window, and a script that
catches the error and goes on. Each error says what keeps the ranks' windows
aligned, and doing that gives the big batch in float64 (review findings; the
C++ side: reducer_failures-test.cpp, "a C++ forward that throws")."""
import pytest

import _alignment_jobs as aj
import _dist_utils as du

M = "_alignment_jobs"


def test_a_failed_no_sync_backward_says_it_counted_and_not_to_run_it_again(tmp_path):
    """Data parallel, a failed no-sync micro-step counts (every rank closes its
    windows together) and its window is dropped on every rank when it closes.
    The error was torch's own, bare (review: an out-of-memory there read as one
    to retry, and a retry runs one micro-step more than the peers); it now
    carries a note saying so. Going on as it says: the big batch without
    window 1, on both ranks."""
    results = du.run_job("failed_or_refused_then_on", 2, tmp_path, module=M, how="failed", timeout=120)
    own = results[1]["errors"][0]
    assert own[:3] == ("1/0", "RuntimeError", "injected failure")
    assert own[3] == ["gradaccum: acc.backward(): this micro-step failed in its backward on this rank and still "
                      "counts, so that every rank closes its windows together; go on with the next micro-batch, not "
                      "this one again (this rank would run one micro-step more than the others). The window will be "
                      "dropped on every rank when it closes, unless acc.zero_grad() here drops this rank's part of it "
                      "so far (the window then goes on without it); acc.run() retries out-of-memory micro-batches in "
                      "smaller parts instead"]
    expected = du.windows_reference(aj.SEED, aj.windows(2), "mean", skip=(1,))
    for rank, res in enumerate(results):
        closing = [e for e in res["errors"] if e[0] == "1/2"]
        assert len(closing) == 1 and "window 1 was dropped on every rank" in closing[0][2], res["errors"]
        assert closing[0][3] == []  # (gradaccum's own error says what happened)
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["optimizer_steps"] == 2
        du.assert_params_close(res["params"], expected, f"rank {rank}")


def test_a_refused_micro_batch_replaced_by_an_empty_micro_step_keeps_the_windows(tmp_path):
    """A refused micro-batch changes nothing; the error says to run it again
    or call acc.empty_micro_step() in its place. Skipping it instead paired
    rank 1's later micro-batches one window position late, silently (review).
    Doing what it says: window 1 holds the 5 micro-batches that ran (weight 5),
    and every window is the big batch in float64."""
    results = du.run_job("failed_or_refused_then_on", 2, tmp_path, module=M, how="refused", timeout=120)
    assert results[0]["errors"] == []
    ((where, kind, text, notes),) = results[1]["errors"]
    assert (where, kind, notes) == ("1/0", "ValueError", [])
    assert text.endswith("; this micro-step was not counted: run it again with a valid loss, or call "
                         "acc.empty_micro_step() in its place, so that this rank's windows stay aligned with the "
                         "other ranks'"), text
    data = aj.windows(2)
    data[1][1] = data[1][1][1:]  # rank 1's refused micro-batch is not in the window
    expected = du.windows_reference(aj.SEED, data, "mean")
    for rank, res in enumerate(results):
        assert res["stats"]["optimizer_steps"] == 3 and res["stats"]["dropped_windows"] == 0
        du.assert_params_close(res["params"], expected, f"rank {rank}")


@pytest.mark.parametrize("steps", [1, 2])
def test_a_rank_that_went_on_after_the_peers_flush_runs_nothing_until_its_own(tmp_path, steps):
    """After "this rank went on training" (the others' flush() ended the
    epoch), every micro-step is refused until this rank's flush(), changing
    nothing: a loss Python refuses too (review: it ran a drop reduction that
    shifted every later window with steps=1, or said to run it again), an
    empty micro-step, and a state_dict() (whose load lifted the refusal).
    Its flush() runs no collective; the ranks stay paired."""
    results = du.run_job("went_on_after_peers_flush", 2, tmp_path, module=M, steps=steps, timeout=120)
    refused = ("this rank's epoch ended with the other ranks' acc.flush() (the error raised before: this rank went "
               "on training after they ended the epoch); call acc.flush() (it steps nothing and runs no collective) "
               "or leave acc.join() before the next epoch's first micro-batch. Nothing was changed")
    errors = results[1]["errors"]
    assert [e[0] for e in errors] == ["0/2", "not a loss", "empty", "save", "plain"], errors
    assert "but this rank went on training" in errors[0][2]
    assert errors[1] == ("not a loss", "RuntimeError", "gradaccum: acc.backward(): " + refused)
    assert errors[2] == ("empty", "RuntimeError", "gradaccum: acc.empty_micro_step(): " + refused)
    assert errors[3] == ("save", "RuntimeError", "gradaccum: acc.state_dict(): this rank went on training after "
                         "the other ranks ended the epoch with acc.flush() (the error raised before); call "
                         "acc.flush() (it steps nothing and runs no collective) before saving")
    assert errors[4] == ("plain", "RuntimeError", "gradaccum: loss.backward(): this rank's epoch ended with the other "
                         "ranks' acc.flush() (this rank went on training after they ended the epoch); call acc.flush() "
                         "(it steps nothing and runs no collective) before the next epoch; this backward reduced "
                         "nothing (its gradients may be in .grad in part: drop them with acc.zero_grad())")
    assert results[1]["flushed"][0] is False
    # rank 0 learns it in its next reduction: epoch 1's first window, dropped on both
    ((where, _, text),) = results[0]["errors"]
    assert where == f"1/{steps - 1}" and "rank 1 went on training after the other ranks had ended the epoch" in text
    for res in results:
        assert res["paired"] and res["stats"]["dropped_windows"] == 1, res["stats"]  # (that one window)
    du.assert_params_close(results[0]["params"], results[1]["params"], "rank 1", tol=0)


def test_a_rank_told_to_end_training_inside_join_reduces_nothing_until_it_leaves(tmp_path):
    """Note [Training ended in join()]: rank 1 catches the end-of-training
    error inside its block and goes on; every call that would reduce is
    refused, changing nothing (review: no_sync's manual path, flush() and a
    refresh paired with rank 0's next epoch, then the ranks never realigned),
    its block's end shadows nothing, and the next epoch pairs."""
    results = du.run_job("told_to_end_then_calls", 2, tmp_path, module=M, timeout=120)
    told = ("the last reduction dropped its window on every rank and told every rank to end training there (ranks "
            "were shadowing in acc.join(), one left its block with an exception, or one was interrupted): end "
            "training on this rank too; inside acc.join(), let that error leave its block (C++: call acc.join(), "
            "which returns at once). Nothing was changed")
    ((where, _, text),) = results[0]["errors"]
    assert where == "join" and text.startswith("gradaccum: acc.join(): window 1 was dropped on every rank"), text
    errors = results[1]["errors"]
    assert [e[0] for e in errors] == ["0/3", "0/4", "0/5", "no_sync", "flush", "refresh", "plain"], errors
    assert "injected failure" in errors[0][2]
    for (where, kind, text), call in zip(errors[1:], ["acc.backward()", "acc.backward()", "acc.no_sync()",
                                                      "acc.flush()", "acc.refresh_parameters()"]):
        assert (kind, text) == ("RuntimeError", f"gradaccum: {call}: {told}"), (where, text)
    # the manual path's plain backward (DDP-style steps=1 loops): refused in its
    # first gradient hook, before any reduction (review: it paired with rank
    # 0's next epoch and both stepped wrong gradients, 0.043 off, silently)
    assert errors[6] == ("plain", "RuntimeError", "gradaccum: loss.backward(): the last reduction dropped its window "
                         "on every rank and told every rank to end training there (ranks were shadowing in "
                         "acc.join(), one left its block with an exception, or one was interrupted): end training "
                         "on this rank too; inside acc.join(), let that error leave its block (C++: call "
                         "acc.join(), which returns at once); this backward reduced "
                         "nothing (its gradients may be in .grad in part: drop them with acc.zero_grad())")
    for res in results:
        assert res["paired"] and res["stats"]["optimizer_steps"] == 2, res["stats"]
    du.assert_params_close(results[0]["params"], results[1]["params"], "rank 1", tol=0)


@pytest.mark.parametrize("kind,via", [("KeyboardInterrupt", "backward"), ("SystemExit", "run")])
def test_an_interrupt_in_the_closing_backward_stays_itself_and_ends_training(tmp_path, kind, via):
    """A KeyboardInterrupt or SystemExit raised by a hook in the window's
    synchronising backward drops the window on every rank, as any failure
    there does. It reached its rank as gradaccum's RuntimeError, so a loop
    that catches Exception and goes on was not stopped by it. It now stays
    itself there, the drop's text as its note (Note [An interrupt in a
    synchronising backward]), and the drop says why: every rank is told to
    end training (the interrupted rank stops; the peers, told that training
    could go on, waited for it in their next window until it exited or the
    group timed out: Note [An interrupt tells every rank to end]). Every
    later micro-step is refused on every rank, without a collective: the
    parameters are the big batch's of window 0, and the ranks still pair."""
    results = du.run_job("interrupt_in_closing_backward", 2, tmp_path, module=M, kind=kind, via=via, timeout=120)
    call = "acc.run()" if via == "run" else "acc.backward()"
    drop = f"gradaccum: {call}: window 1 was dropped on every rank: the synchronising backward (or a micro-step of " \
        "the window) was interrupted on "
    rest = ". The window's gradients were cleared on every rank and no optimizer step was taken; an interrupted " \
        "rank (KeyboardInterrupt, SystemExit) stops: end training on every rank here (or resume every rank from " \
        "a checkpoint)"
    told = f"gradaccum: {call}: the last reduction dropped its window on every rank and told every rank to end " \
        "training there (ranks were shadowing in acc.join(), one left its block with an exception, or one was " \
        "interrupted): end training on this rank too; inside acc.join(), let that error leave its block (C++: " \
        "call acc.join(), which returns at once). Nothing was changed"
    refused = [(f"2/{k}", "RuntimeError", told, []) for k in range(aj.K)]
    assert results[1]["errors"] == [("1/2", kind, "injected", [drop + f"this rank (rank 1): {kind}: injected" + rest])] \
        + refused
    assert results[0]["errors"] == [("1/2", "RuntimeError", drop + "rank 1 (its own error is raised there)" + rest, [])] \
        + refused
    expected = du.windows_reference(aj.SEED, aj.windows(2), "mean", skip=(1, 2))
    for rank, res in enumerate(results):
        assert res["paired"]
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["optimizer_steps"] == 1
        du.assert_params_close(res["params"], expected, f"rank {rank}")


def test_an_interrupt_inside_join_leaves_every_block_at_once(tmp_path):
    """Review: after an interrupt's drop (every rank told to end training),
    the KeyboardInterrupt leaving rank 1's acc.join() block sent one more
    drop, for a rank that left join() with an exception, and waited for peers
    that never sent one: until the group's timeout. Every rank knew already:
    both leave at once, the ranks still pair, and only window 0 stepped."""
    results = du.run_job("interrupt_inside_join", 2, tmp_path, module=M, timeout=120, pg_timeout=15)
    expected = du.windows_reference(aj.SEED, aj.windows(2), "mean", skip=(1, 2))
    assert results[1]["errors"][-1] == ("join", "KeyboardInterrupt", "stop"), results[1]["errors"]
    for rank, res in enumerate(results):
        assert res["seconds"] < 5, (rank, res["seconds"])
        assert res["paired"] and res["stats"]["optimizer_steps"] == 1, res["stats"]
        du.assert_params_close(res["params"], expected, f"rank {rank}")


def test_close_from_a_hook_in_the_closing_backward_raises_instead_of_crashing(tmp_path):
    """Review: acc.close() from a gradient hook inside the window's closing
    acc.backward() took the reducer that the backward's error handling then
    read: a segfault on that rank. It raises the reducer's error now; the
    peer's names that rank, and the ranks still pair."""
    results = du.run_job("close_in_closing_hook", 2, tmp_path, module=M, timeout=120)
    ((k, kind, text),) = results[1]["errors"]
    assert (k, kind) == (aj.K - 1, "RuntimeError") and text.startswith("gradaccum: acc.backward(): "), text
    assert results[1]["closed"]
    ((k, kind, text),) = results[0]["errors"]
    assert (k, kind) == (aj.K - 1, "RuntimeError") and "rank 1 destroyed its Accumulator" in text, text
    assert results[0]["paired"] and results[1]["paired"]


def test_close_from_the_optimizer_inside_join_raises_instead_of_crashing(tmp_path):
    """Review: the optimizer closing the Accumulator in join()'s step left
    join() reading the reducer it had taken: a segfault on every rank."""
    for res in du.run_job("close_from_the_optimizer_in_join", 2, tmp_path, module=M, timeout=120):
        assert res["error"] == ("RuntimeError", "gradaccum: acc.join(): this Accumulator was closed during its step "
                                "(the optimizer or a scheduler called acc.close()?)"), res
