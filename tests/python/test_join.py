"""Uneven data by any number of windows: `with acc.join():` (Note [Joining] in
src/accumulator/join.cpp), on real Gloo ranks, against one process over the
data that exists (float64), with the collectives counted."""
import pytest
import torch

import _dist_utils as du
import _protocol_jobs as pj

M = "_join_jobs"


def run(name, world_size, tmp_path, **kwargs):
    return du.run_job(name, world_size, tmp_path / name, module=M, timeout=240, pg_timeout=30, **kwargs)


# Micro-batches per rank and epoch (K = 3): 0 to 4 windows of difference,
# partial windows, empty shards, and an even epoch.
EPOCHS = {
    2: [[10, 1], [0, 9], [4, 13], [6, 6]],
    3: [[12, 2, 7], [0, 0, 5], [3, 11, 0], [9, 9, 9]],
    4: [[1, 12, 6, 0], [8, 8, 8, 8], [0, 0, 0, 0], [5, 13, 2, 9]],
}


@pytest.mark.parametrize("world_size,reduction", [(2, "mean"), (3, "items"), (4, "mean"), (3, "mean")])
def test_join_trains_on_the_data_that_exists_with_no_extra_collective(tmp_path, world_size, reduction):
    epochs = EPOCHS[world_size]
    last = len(epochs) - 1
    results = run("join_epochs", world_size, tmp_path, seed=11, epochs=epochs, reduction=reduction,
                  as_view=world_size == 3, profile_epoch=last)
    # The same arithmetic as one process over each window's micro-batches
    # (a rank out of data adds nothing to the windows after its last).
    expected = pj.epochs_reference(11, epochs, pj.STEPS, reduction, "adam")
    for rank, res in enumerate(results):
        du.assert_params_close(res["params"], expected, f"rank {rank}")
        assert res["stats"]["dropped_windows"] == 0
        # One reduction per window of the rank with the most full windows,
        # plus the one that closes the last partial windows: what that rank
        # alone would run with flush(); the ranks with data pay nothing for
        # the others' joining.
        assert res["collectives"] == [max(n // pj.STEPS for n in shards) + 1 for shards in epochs], rank
        assert res["allreduces"] == res["collectives"][last] * res["stats"]["buckets"], rank
    assert len({r["stats"]["optimizer_steps"] for r in results}) == 1


def test_a_failure_on_an_active_rank_reaches_the_joined_ranks(tmp_path):
    # rank 0 joins after 1 window; rank 2 fails in the synchronising backward of its 3rd window
    results = run("join_failure", 3, tmp_path, seed=4, shards=[3, 12, 12], fail_rank=2, fail_at=8)
    texts = [r["error"] for r in results]
    assert all(t is not None for t in texts), texts
    for rank, res in enumerate(results):
        # window 2 of the reducer, dropped on every rank, naming rank 2
        assert "window 2 was dropped on every rank" in res["error"], (rank, res["error"])
        assert "rank 2" in res["error"], (rank, res["error"])
        assert res["stats"]["optimizer_steps"] == 2, rank
        # Note [A window dropped while ranks shadow]: rank 0 leaves join()
        # with it, so the ranks with data must not go on (before, they were
        # told "training can go on", and their next window waited for rank 0)
        assert res["error"].endswith(
            "no optimizer step was taken; 1 rank(s) out of data in acc.join() raise this error too and leave it, so "
            "no next window can pair there: end training on every rank here (or resume every rank from a "
            "checkpoint)"), (rank, res["error"])
    assert results[0]["where"] == "acc.join()"  # it had left its loop: told inside join()
    # and the error names that call (the reduction request carries it)
    assert results[0]["error"].startswith("gradaccum: acc.join(): window 2 was dropped on every rank"), texts[0]
    assert "injected failure on rank 2" in results[2]["error"]
    # the failing rank's exception left its join() block, but every rank knew
    # already (the window was dropped everywhere): it sent nothing more
    assert all(r["paired"] for r in results)


LEFT = ("gradaccum: {call}: window 2 was dropped on every rank: rank 2 left its acc.join() block with an "
        "exception (its own error is raised there). The window's gradients were cleared on every rank and no "
        "optimizer step was taken; a rank that left its acc.join() block reduces no more: end training on every "
        "rank here (or resume every rank from a checkpoint)")


@pytest.mark.parametrize("after_backward", [False, True])
def test_an_exception_leaving_join_reaches_every_rank(tmp_path, after_backward):
    """Note [Leaving join() with an exception]: rank 0 shadows after one
    window; rank 2's own code raises mid-window (window 2: before its 8th
    backward; or after its 6th, which closed window 1, before acc.step()).
    Before, rank 0 (in join()) and rank 1 (at its window's end) waited for
    rank 2 until the group's timeout; now they raise at once, naming it, and
    nothing is left unpaired."""
    raise_at = 5 if after_backward else 7
    results = run("join_left_with_exception", 3, tmp_path, seed=4, shards=[3, 12, 12], raise_rank=2,
                  raise_at=raise_at, after_backward=after_backward)
    assert results[2]["error"] == "ValueError: the script's own error"
    assert results[0]["where"] == "acc.join()" and results[1]["where"] == "acc.backward()"
    for rank in (0, 1):
        call = results[rank]["where"]
        assert results[rank]["error"] == "RuntimeError: " + LEFT.format(call=call), (rank, results[rank]["error"])
    for rank, res in enumerate(results):
        assert res["seconds"] < 20, (rank, res["seconds"])  # the group's timeout is 30 s
        assert res["paired"], rank
        # rank 2 raised before stepping window 1 in the second case
        assert res["stats"]["optimizer_steps"] == (1 if after_backward and rank == 2 else 2), rank


def test_a_rank_leaving_after_a_drop_that_let_training_go_on_still_tells_the_others(tmp_path):
    """Rank 1 refuses its closing micro-batch (num_items=True: a TypeError)
    in window 1; the window is dropped on both ranks, which are told
    "training can go on". Rank 0 goes on; rank 1's TypeError leaves its
    join() block: that drop did not end training, so rank 1 still sends its
    own, which rank 0 meets at its next window's end (before, rank 0 waited
    there until the group's timeout)."""
    results = run("join_left_with_exception", 2, tmp_path, seed=4, shards=[12, 12], raise_rank=1,
                  raise_at=5, after_backward="refused", go_on=True)
    assert results[1]["error"].startswith("TypeError: gradaccum: acc.backward(): num_items must be a count"), \
        results[1]["error"]
    (told,) = results[0]["went_on_after"]
    assert "window 1 was dropped on every rank: rank 1 refused the micro-batch" in told and \
        told.endswith("training can go on from the next window"), told
    left = LEFT.replace("rank 2 left", "rank 1 left").format(call="acc.backward()")
    assert results[0]["error"] == "RuntimeError: " + left, results[0]["error"]
    for rank, res in enumerate(results):
        assert res["seconds"] < 20 and res["paired"], (rank, res["seconds"])


def test_several_ranks_leaving_join_are_counted_and_end_training(tmp_path):
    """Ranks 1 and 2 raise before their 8th backward (window 2); rank 0 gets
    one error counting both and telling every rank to end training."""
    results = run("join_left_with_exception", 3, tmp_path, seed=4, shards=[12, 12, 12], raise_rank=[1, 2],
                  raise_at=7, go_on=True)
    assert results[0]["went_on_after"] == []
    assert results[0]["error"] == (
        "RuntimeError: gradaccum: acc.backward(): window 2 was dropped on every rank: 2 ranks (ranks 1 and 2) could "
        "not contribute their window: both left the acc.join() block with an exception (each raises its own "
        "error there). The window's gradients were cleared on every rank and no optimizer "
        "step was taken; a rank that left its acc.join() block reduces no more: end training on every rank here "
        "(or resume every rank from a checkpoint)"), results[0]["error"]
    for rank, res in enumerate(results):
        assert res["seconds"] < 20 and res["paired"], (rank, res["seconds"])


def test_a_nonfinite_raise_while_a_rank_shadows_is_dropped_alike(tmp_path):
    """nonfinite="raise" on a window rank 0 shadows: every rank holds the same
    NaN gradient. Rank 1 raises and drops it with acc.zero_grad(), as its
    error says; the shadow drops it too and keeps pairing. Before, the shadow
    took it for a failure of its own and dropped rank 1's next, valid window
    on every rank, saying the replicas differed."""
    results = run("join_nonfinite_raise", 2, tmp_path)
    assert results[0]["errors"] == [], results[0]["errors"]
    (error,) = results[1]["errors"]
    assert error.startswith("gradaccum: acc.step(): the window's gradient is not finite"), error
    for res in results:
        assert res["stats"]["optimizer_steps"] == 2 and res["stats"]["dropped_windows"] == 0, res["stats"]
    du.assert_params_close(results[0]["params"], results[1]["params"], "rank 0", tol=0)
    # The NaN in the last window, which both close inside join() (every rank
    # joined): no rank has data to go on with, and every rank raises it.
    results = run("join_nonfinite_raise", 2, tmp_path / "last", counts=(3, 3), nan_at=2)
    for res in results:
        (error,) = res["errors"]
        assert error.startswith("join: gradaccum: ") and "the window's gradient is not finite" in error, error
        assert res["stats"]["optimizer_steps"] == 1, res["stats"]
    # Rank 1 lets the error leave its block: the raised window is skipped on
    # both ranks, and counted so on both (review: on the shadow only); both
    # then go on together, and their next window steps (review: it was
    # dropped saying that rank 0 had not stepped a window the others stepped,
    # since only the shadow marked the raised window unstepped).
    results = run("join_nonfinite_raise", 2, tmp_path / "leave", leave=True)
    assert results[1]["errors"][0].startswith("join: gradaccum: acc.step(): the window's gradient is not finite")
    assert not [e for res in results for e in res["errors"] if e.startswith("then: ")], results
    counts = [{k: res["stats"][k] for k in ("skipped_steps", "windows", "optimizer_steps")} for res in results]
    assert counts[0] == counts[1] == {"skipped_steps": 1, "windows": 3, "optimizer_steps": 2}, counts
    du.assert_params_close(results[0]["params"], results[1]["params"], "rank 0", tol=0)
    # Rank 1 resumes its closed NaN window from a state and ends its block: its
    # join() drops the window as the shadow did and pairs (review: resuming
    # forgot that a rank shadowed it, and it raised alone, the shadow waiting).
    results = run("join_nonfinite_raise", 2, tmp_path / "reload", reload=True)
    for res in results:
        assert res["errors"] == [] and res["stats"]["skipped_steps"] == 1, res
    du.assert_params_close(results[0]["params"], results[1]["params"], "rank 0", tol=0)


def test_join_on_one_rank_and_flush_on_another_is_an_error_on_both(tmp_path):
    results = run("join_then_flush", 2, tmp_path, seed=5, shards=[4, 8])
    assert results[0]["error"].startswith("gradaccum: acc.join(): 1 rank(s) ended their data with acc.flush() "
                                          "while this rank was in acc.join()"), results[0]["error"]
    assert results[1]["error"].startswith("gradaccum: acc.flush(): 1 rank(s) are in acc.join()"), results[1]["error"]


def test_a_step_that_fails_on_a_joined_rank_reaches_every_rank(tmp_path):
    # rank 0: 1 window, then shadows; its optimizer raises on window 1's step
    results = run("join_step_failure", 2, tmp_path, seed=6, shards=[3, 12])
    for rank, res in enumerate(results):
        assert res["error"] is not None and res["error"].startswith("gradaccum: "), (rank, res["error"])
        assert "window 2 was dropped on every rank" in res["error"], (rank, res["error"])
    assert "injected optimizer failure on rank 0" in results[0]["error"]


def _big_batches(windows):
    """du.mlp(6) and its SGD after one step per window on its global batch."""
    model = du.mlp(6)
    opt = du.make_optimizer("sgd", model.parameters())
    for window in windows:
        du.global_batch_loss(model, window, "mean").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


ENDED = ("gradaccum: acc.backward(): the last reduction dropped its window on every rank and told every rank to end "
         "training there (ranks were shadowing in acc.join(), one left its block with an exception, or one was "
         "interrupted): end training on this rank too; inside acc.join(), let that error leave its block (C++: call "
         "acc.join(), which returns at once). Nothing was changed")
SHADOWS_LEAVE = ("the replicas differ from here on, and 1 rank(s) out of data in acc.join() raise this error too and "
                 "leave it: end training on every rank here and resume every rank from a checkpoint")


@pytest.mark.parametrize("fail_rank", [0, 1], ids=["shadow", "rank_with_data"])
def test_a_rank_that_could_not_step_a_window_while_ranks_shadow_tells_every_rank_to_end_training(tmp_path,
                                                                                                  fail_rank):
    """3 ranks; rank 0 joins after window 0. `fail_rank`'s optimizer raises in
    window 1's step (rank 0's: its shadow step; rank 1 catches it and drops
    the window with acc.zero_grad(), as the error says), so window 2 is
    dropped on every rank, saying the replicas differ. The shadow leaves
    join() with that error; rank 1 (shadow case: lets it leave its block),
    rank 2 catches it and goes on. The drop tells every rank to end
    training, and says so: rank 2's later micro-steps in the block are
    refused and its block's end shadows nothing, and a rank leaving sends
    nothing (before, the shadow case sent a drop that rank 2's next window
    paired with, and the next epoch's collectives crossed: Gloo aborted the
    process). Every rank then trains one more epoch, paired, in float64: the
    failing rank one window behind (the replicas differ, as every rank was
    told)."""
    catchers = (2,) if fail_rank == 0 else (1, 2)
    results = run("join_step_failure", 3, tmp_path, seed=6, shards=[3, 12, 12], catchers=catchers,
                  next_shards=[6, 6, 6], fail_rank=fail_rank)
    if fail_rank == 0:
        dropped = ("gradaccum: acc.backward(): window 2 was dropped on every rank: rank 0 could not step a window "
                   "every rank had reduced as its data ended (its last, in acc.flush() or acc.join(), or one it "
                   "shadowed in acc.join()), while other ranks stepped theirs (its own error is raised there): " +
                   SHADOWS_LEAVE)
        # the shadow's own error names the step it failed in, without a Python trace (review: it said the
        # window it closed before joining, and carried "At: ...")
        assert results[0]["error"] == (
            "gradaccum: acc.join(): window 2 was dropped on every rank: this rank (rank 0) could not step a window "
            "every rank had reduced as its data ended (its last, in acc.flush() or acc.join(), or one it shadowed in "
            "acc.join()), while other ranks stepped theirs: " + SHADOWS_LEAVE + ". The error on this rank, stepping "
            "a window as it joined (its last, or one it shadowed): RuntimeError: injected optimizer failure on rank "
            "0"), results[0]["error"]
        assert results[1]["error"] == dropped, results[1]["error"]
    else:
        dropped = ("gradaccum: acc.backward(): window 2: rank 1 did not step a window every rank had reduced, while "
                   "the other ranks stepped it (acc.zero_grad() dropped the closed window there, say after "
                   "acc.step() raised; a failure there after the window's reduction cleared it; its loss scaler's "
                   "update() raised after its step; or it left its acc.join() block "
                   "with an exception before stepping it): " + SHADOWS_LEAVE +
                   " (acc.load_state_dict() on every rank). The window was dropped on every rank")
        assert results[0]["error"] == dropped.replace("acc.backward()", "acc.join()"), results[0]["error"]
        assert results[1]["caught"][0] == (5, "injected optimizer failure on rank 1"), results[1]["caught"]
        assert results[1]["caught"][1][0] == 8 and "this rank (rank 1) did not step" in results[1]["caught"][1][1]
        assert results[1]["caught"][2:] == [(i, ENDED) for i in (9, 10, 11)], results[1]["caught"]
    assert results[2]["caught"] == [(8, dropped)] + [(i, ENDED) for i in (9, 10, 11)], results[2]["caught"]
    assert results[2]["error"] is None
    for res in results:
        assert res["paired"], res
    # The reference: the failing rank holds the big batch of window 0, the
    # others of windows 0 and 1; each next window sums every rank's
    # micro-batches' gradients at that rank's own weights, and each replica
    # steps it.
    first = pj.epoch_windows(6, [3, 12, 12], pj.STEPS)
    behind, ahead = _big_batches(first[:1]), _big_batches(first[:2])
    for window in pj.epoch_windows(7, [6, 6, 6], pj.STEPS):
        n = sum(len(m) for m in window)
        total = [torch.zeros_like(p) for p in ahead[0].parameters()]
        for rank in range(3):
            model = (behind if rank == fail_rank else ahead)[0]
            loss = sum(du.micro_loss(model, b, "mean")[0] for b in window[rank]) / n
            for t, g in zip(total, torch.autograd.grad(loss, list(model.parameters()))):
                t += g
        for model, opt in (behind, ahead):
            for p, g in zip(model.parameters(), total):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for rank, res in enumerate(results):
        expected = du.params((behind if rank == fail_rank else ahead)[0])
        du.assert_params_close(res["params"], expected, f"rank {rank}", tol=1e-12)
        assert res["stats"]["optimizer_steps"] == (3 if rank == fail_rank else 4), res["stats"]


def test_buffers_come_from_the_lowest_rank_with_data(tmp_path):
    """BatchNorm statistics under join(), broadcast by default: each window's
    come from the lowest rank that ran micro-batches in it (rank 0 has joined
    after window 0: its buffers are stale), and every rank ends equal."""
    rank0, rank1, rank2 = run("join_buffers", 3, tmp_path, counts=[3, 6, 8])  # K = 3

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    for res in (rank0, rank1, rank2):  # window 0: all had data, rank 0's
        assert same(res["after"][0], rank0["own"][0])
    for res in (rank1, rank2):  # window 1: rank 0 joined, rank 1's
        assert same(res["after"][1], rank1["own"][1])
        assert not same(res["after"][1], rank0["own"][0])
    for res in (rank0, rank1, rank2):  # rank 2's partial window closed as all joined
        assert same(res["final"], rank2["own"][2])
        assert res["stats"]["buffer_broadcasts"] == 3
        # stats() counts every all-reduce the profiler saw: the buckets' and,
        # in the two windows where some ranks had joined, the one that
        # picks the buffers' root (it was left out before).
        assert res["collectives"] == res["allreduces"] == 3 * res["stats"]["buckets"] + 2


@pytest.mark.parametrize("reduction", ["items", "mean"])
def test_buffers_follow_forwards_of_no_weight_in_the_joins_last_window(tmp_path, reduction):
    """Rank 0 joins after window 0; rank 1's last window runs its forwards
    but weighs nothing (num_items=0, or NaN losses that skip_micro_batch
    leaves out), so no rank has weight there. Its forwards moved rank 1's
    BatchNorm statistics: they are broadcast, and both ranks end equal
    (before: nobody broadcast, rank 0 kept window 1's, 0.37 apart)."""
    rank0, rank1 = run("join_buffers", 2, tmp_path, counts=[3, 9], weightless_from=[99, 6], reduction=reduction)
    for res in (rank0, rank1):
        assert all(torch.equal(a, b) for a, b in zip(res["final"], rank1["own"][2]))
        assert res["stats"]["buffer_broadcasts"] == 3
        assert res["stats"]["skipped_steps"] == 1  # the weightless window, alike

    # Rank 0's last micro-steps run no forward (acc.empty_micro_step()),
    # rank 1's last one a forward of no weight: rank 1's buffers, though
    # rank 0 is lower (a micro-step count alone would have picked rank 0's).
    rank0, rank1 = run("join_buffers", 2, tmp_path / "empty", counts=[5, 4], weightless_from=[99, 3],
                       empty_from=[3, 99], reduction=reduction)
    for res in (rank0, rank1):
        assert all(torch.equal(a, b) for a, b in zip(res["final"], rank1["own"][1]))
        assert not all(torch.equal(a, b) for a, b in zip(res["final"], rank0["own"][0]))  # window 0's
        assert res["stats"]["buffer_broadcasts"] == 2
