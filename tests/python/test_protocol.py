"""Off the happy path, with real Gloo ranks: every rank agrees, or every rank
gets the same clear error (Note [Dropping a window] in src/reducer.cpp).

References are one process in float64; errors are asserted by their text.
"""
import torch
import pytest

import _dist_utils as du
import _protocol_jobs as pj

M = "_protocol_jobs"
R = "_regression_jobs"  # the jobs that reproduce review findings


def run(name, world_size, tmp_path, module=M, **kwargs):
    kwargs.setdefault("timeout", 120)
    kwargs.setdefault("pg_timeout", 30)
    return du.run_job(name, world_size, tmp_path, module=module, **kwargs)


def assert_params_close(got, expected, tol=1e-10, what=""):
    for i, (a, e) in enumerate(zip(got, expected)):
        scale = max(1.0, e.abs().max().item())
        diff = (a - e).abs().max().item() / scale
        assert diff <= tol, f"{what} parameter {i}: relative difference {diff:.3g}"


# --------------------------------------------------------------------------- #
# 1. Epochs ending in flush(), uneven and empty shards
# --------------------------------------------------------------------------- #

# Micro-batches per rank and epoch (K = 3). Ranks may differ by less than one
# window (the rank with fewer ends with a partial or an empty flush()), shards
# may be empty on one rank or on all; each scenario runs several epochs in a row.
EPOCHS = {
    2: [[7, 6], [2, 0], [0, 0], [4, 6], [3, 0], [6, 6], [0, 3], [5, 3]],
    4: [[7, 6, 8, 6], [0, 2, 0, 1], [0, 0, 0, 0], [3, 0, 3, 1], [6, 6, 6, 6], [4, 6, 5, 3]],
}


@pytest.mark.parametrize("world_size", [2, 4])
def test_epochs_ending_in_flush_with_uneven_shards_match_one_process(tmp_path, world_size):
    epochs = EPOCHS[world_size]
    scenarios = {"mean": (epochs, "mean", False), "items": (epochs, "items", False),
                 "items/views": (epochs, "items", True)}
    results = run("epochs", world_size, tmp_path, timeout=240, seed=7, scenarios=scenarios)
    for key, (_, reduction, _) in scenarios.items():
        expected = pj.epochs_reference(7, epochs, pj.STEPS, reduction, "adam")
        for rank, res in enumerate(results):
            assert_params_close(res[key]["params"], expected, what=f"{key} rank {rank}")
            assert res[key]["stats"]["dropped_windows"] == 0
        assert len({r[key]["steps"] for r in results}) == 1


# --------------------------------------------------------------------------- #
# 2. A synchronising backward that raises on one rank
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("path", ["accumulator", "manual"])
@pytest.mark.parametrize("equal", [True, False], ids=["equal_buckets", "unequal_buckets"])
def test_failed_synchronising_backward_drops_the_window_on_every_rank(tmp_path, path, equal):
    windows, fail_window, fail_rank = 4, 1, 1
    results = run("failing_backward", 2, tmp_path, seed=3, windows=windows, fail_rank=fail_rank,
                  fail_window=fail_window, path=path, equal=equal)
    assert results[0]["buckets"] >= 3
    if equal:
        assert len(set(results[0]["bucket_sizes"])) == 1, results[0]["bucket_sizes"]
    expected = pj.tower_reference(3, 2, windows, pj.STEPS, equal, skip=fail_window)
    call = "acc.backward()" if path == "accumulator" else "loss.backward()"
    for rank, res in enumerate(results):
        (err,) = res["errors"]
        assert (err["window"], err["micro"]) == (fail_window, pj.STEPS - 1)
        if rank == fail_rank:
            assert "injected failure on rank 1" in err["text"]
            if path == "accumulator":
                assert f"gradaccum: {call}: window 1 was dropped on every rank: the synchronising " \
                       "backward (or a micro-step of the window) failed on this rank (rank 1)" in err["text"]
        else:
            assert f"gradaccum: {call}: window 1 was dropped on every rank: the synchronising backward " \
                   "(or a micro-step of the window) failed on rank 1" in err["text"]
            assert err["seconds"] < 5
        assert res["stats"]["dropped_windows"] == 1
        # training went on: the replicas are bit-identical and equal the run without that window
        assert_params_close(res["params"], expected, what=f"rank {rank}")
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("view", [False, True])
def test_failed_no_sync_micro_step_drops_the_window_on_every_rank_when_it_closes(tmp_path, view):
    # step() outside the try: after the dropped window (whose bucket views were
    # zeroed) it must not mistake the drop for a plain loss.backward()
    results = run("failing_backward", 2, tmp_path, seed=3, windows=3, fail_rank=0, fail_window=1,
                  path="accumulator", equal=False, where="micro", view=view, step_outside=True)
    expected = pj.tower_reference(3, 2, 3, pj.STEPS, False, skip=1)
    (own,) = [e for e in results[0]["errors"] if e["micro"] == 0]
    assert own["window"] == 1 and "injected failure on rank 0" in own["text"]
    for rank, res in enumerate(results):
        closing = [e for e in res["errors"] if e["micro"] == pj.STEPS - 1]
        assert len(closing) == 1 and closing[0]["window"] == 1
        assert "window 1" in closing[0]["text"] and "dropped on every rank" in closing[0]["text"]
        assert_params_close(res["params"], expected, what=f"rank {rank}")


# --------------------------------------------------------------------------- #
# 3. Ranks that disagree
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("case,text", [
    ("steps", "the ranks disagree on steps: this rank (rank {r}) has {mine}, rank {o} has {theirs}"),
    ("reduction", "the ranks disagree on reduction: this rank (rank {r}) has {mine}, rank {o} has {theirs}"),
])
def test_mismatched_options_fail_in_the_first_reduction_on_every_rank(tmp_path, case, text):
    values = {"steps": ("4", "2"), "reduction": ("mean", "sum")}[case]
    results = run("disagree", 2, tmp_path, case=case, check_parameters=False)
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} trained on"
        want = text.format(r=rank, o=1 - rank, mine=values[rank], theirs=values[1 - rank])
        assert want in res["error"], res["error"]
        assert "dropped on every rank" in res["error"]
        assert res["seconds"] < 5


@pytest.mark.parametrize("case,text", [
    ("steps", "the ranks disagree on steps (rank 0: 4, rank 1: 2)"),
    ("reduction", "the ranks disagree on reduction (rank 0: mean, rank 1: sum)"),
    # the same names in another order would sum one metric into the other
    ("metrics", 'the ranks disagree on the metric names (AccumulatorOptions::metrics, in their order): the '
                'first that differs is "tokens" on rank 0 and "correct" on rank 1 (position 0; rank 0 has 2, rank 1 '
                'has 2); every rank must build its Accumulator with the same options and model'),
    # unset (the default, from the model's size) against an explicit cap
    ("bucket_cap_mb", "the ranks disagree on bucket_cap_mb (rank 0: None, rank 1: 25)"),
    # both unset, but launched as one host on rank 0 and as two on rank 1
    ("one_host", "the ranks disagree on whether every rank runs on one host (LOCAL_WORLD_SIZE equal to "
                 "WORLD_SIZE), which an unset bucket_cap_mb follows (25 MiB on one host, a sixteenth of the "
                 "model across hosts) (rank 0: yes, rank 1: no); launch every rank alike (torchrun sets both on "
                 "every node), or pass bucket_cap_mb explicitly"),
    # what the step does with the reduced window (each rank would step another gradient)
    ("max_grad_norm", "the ranks disagree on max_grad_norm (rank 0: None, rank 1: 0.5)"),
    ("nonfinite", "the ranks disagree on nonfinite (rank 0: 'skip', rank 1: 'ignore')"),
    # scaled and unscaled gradients would be summed in one all-reduce
    ("grad_scaler", "the ranks disagree on the loss scale (grad_scaler's or loss_scaler's scale; None: no loss "
                    "scaling) (rank 0: 1024, rank 1: None); every rank must scale its loss alike: the same "
                    "grad_scaler settings (enabled, init_scale) and the same scaler state (load it on every rank)"),
    ("init_scale", "the ranks disagree on the loss scale (grad_scaler's or loss_scaler's scale; None: no loss "
                   "scaling) (rank 0: 1024, rank 1: 16)"),
    ("growth_interval", "the ranks disagree on the loss scaler's growth_interval (rank 0: 2000, rank 1: 100)"),
])
def test_mismatched_options_fail_at_construction_naming_every_rank(tmp_path, case, text):
    results = run("disagree", 2, tmp_path, case=case, check_parameters=True)
    for res in results:
        assert res["error"] is not None and text in res["error"], res["error"]


def test_flush_on_one_rank_only_is_a_clear_error_on_every_rank(tmp_path):
    results = run("disagree", 2, tmp_path, case="one_sided_flush", check_parameters=False)
    assert "rank 1 went on training after the other ranks had ended the epoch with acc.flush()" \
        in results[0]["error"], results[0]["error"]
    assert "gradaccum: acc.backward(): other ranks ended the epoch with acc.flush() in the reduction that closed this " \
           "rank's last window, but this rank went on training" in results[1]["error"]
    for res in results:
        assert res["seconds"] < 5


# --------------------------------------------------------------------------- #
# 4. Reentrant activation checkpointing
# --------------------------------------------------------------------------- #

def test_reentrant_checkpointing_matches_the_big_batch(tmp_path):
    results = run("reentrant", 2, tmp_path, seed=2, windows=3)
    expected = pj.reentrant_reference(2, 2, 3)
    for rank, res in enumerate(results):
        for path in ("accumulator", "manual"):
            assert res[path]["buckets"] >= 2
            assert res[path]["stats"]["reductions"] == 3
            assert_params_close(res[path]["params"], expected, what=f"{path} rank {rank}")


@pytest.mark.parametrize("reduction,view,outer", [("sum", False, False), ("mean", True, False),
                                                   ("sum", True, True)])
def test_manual_path_with_every_parameter_in_reentrant_blocks(tmp_path, reduction, view, outer):
    """Note [Where a synchronising backward ends]: the first gradient comes
    from a nested graph task, which no longer ends the reduction: one per
    window, each block reduced once. Before, each block's task reduced on its
    own and sent the blocks before it again: "sum" multiplied them by the
    world size, bucket views lost them, and a layer outside the blocks, last
    in backward, was an error."""
    results = run("reentrant_blocks_only", 2, tmp_path, seed=5, windows=3, reduction=reduction, view=view,
                  outer=outer)
    for rank, res in enumerate(results):
        assert max(res["errors"]) < 1e-12, (rank, res["errors"])
        assert res["reductions"] == 3, res
        assert res["collectives"] == [res["buckets"]] * 3, res


# --------------------------------------------------------------------------- #
# 5. Lifetimes; a peer that dies
# --------------------------------------------------------------------------- #

def test_dropping_the_accumulator_during_backward_is_safe_and_told(tmp_path):
    results = run("drop_during_backward", 2, tmp_path)
    assert results[1]["dropped"] and results[1]["error"] is None
    assert "rank 1 destroyed its Accumulator during the synchronising backward" in results[0]["error"]
    assert all(r["grads_finite"] for r in results)


def test_a_killed_peer_is_an_error_on_the_others_within_seconds(tmp_path):
    results = run("peer_killed", 2, tmp_path, allow_death=True, timeout=60)
    assert results[1] is None  # SIGKILLed
    err = results[0]["error"]
    assert err is not None and "gradaccum: acc.backward(): window 0, rank 0: the " \
        "all-reduce of bucket" in err and "a peer process left" in err, err
    assert results[0]["seconds"] < 5


# --------------------------------------------------------------------------- #
# 6. Regressions found by review
# --------------------------------------------------------------------------- #

def test_a_dropped_window_that_met_a_peers_flush_still_ends_the_epoch(tmp_path):
    results = run("dropped_window_meets_flush", 2, tmp_path, module=R)
    assert [e[0] for e in results[0]["errors"]] == ["epoch 0 backward 1"]
    assert [e[0] for e in results[1]["errors"]] == ["epoch 0 flush"]
    assert "failed on this rank (rank 0)" in results[0]["errors"][0][2]
    assert "dropped on every rank" in results[1]["errors"][0][2]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    assert results[0]["stats"]["optimizer_steps"] == results[1]["stats"]["optimizer_steps"] == 2
    assert results[0]["stats"]["reductions"] == results[1]["stats"]["reductions"]


def test_a_failure_before_the_last_launch_aborts_instead_of_wedging(tmp_path):
    results = run("manual_finish_throws", 2, tmp_path, module=R)
    assert [e[0] for e in results[1]["errors"]] == ["window 1 sync backward"]
    assert "sparse gradient" in results[1]["errors"][0][2]
    assert [e[0] for e in results[0]["errors"]] == ["window 1 sync backward"]
    assert "dropped on every rank" in results[0]["errors"][0][2]
    for res in results:  # window 2 reduces normally: nothing is wedged
        assert res["stats"]["reductions"] == 3 and res["stats"]["dropped_windows"] == 1


def test_a_local_failure_after_a_completed_reduction_keeps_the_window(tmp_path):
    results = run("late_callback_after_reduction", 2, tmp_path, module=R)
    assert results[0]["errors"] == []
    assert [e[0] for e in results[1]["errors"]] == ["window 1 backward"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    # The window rank 1 raised in was reduced and stepped: its loss is the
    # window's, not the one before.
    assert results[0]["losses"] == results[1]["losses"]
    assert len({loss for loss, _ in results[0]["losses"]}) == 3


def test_dropping_the_accumulator_from_a_node_post_hook_does_not_crash(tmp_path):
    results = run("drop_from_node_post_hook", 1, tmp_path, module=R)
    assert results[0]["survived"]


@pytest.mark.parametrize("how,prior_raise", [("replaced", False), ("optimizer", False),
                                             ("replaced", True), ("inf_in_place", False)])
def test_flush_that_cannot_step_a_closed_window_on_one_rank_fails_on_every_rank(tmp_path, how, prior_raise):
    """flush() at a closed window steps it, then pairs the flush collective.
    When rank 1 cannot step it (its .grad was replaced, made non-finite in
    place, or its optimizer raised; also after an earlier window raised
    non-finite on every rank), it still takes part in the flush collective,
    dropping it: every rank raises within seconds, saying that the replicas
    now differ (the others stepped), rank 1 its own error too; none waits for
    the collective's time-out, and the next window pairs again."""
    results = du.run_job("flush_after_closed_window_fails_on_one_rank", 2, tmp_path,
                         module=R, how=how, prior_raise=prior_raise,
                         pg_timeout=30, timeout=90)
    assert "rank 1 could not step a window every rank had reduced as its data ended (its last, in acc.flush() " \
        "or acc.join(), or one it shadowed in acc.join()), while other ranks stepped theirs (its own error is " \
        "raised there): the replicas differ from here on" in results[0]["error"], results[0]["error"]
    assert "this rank (rank 1) could not step a window every rank had reduced as its data ended (its last" \
        in results[1]["error"], results[1]["error"]
    for res in results:
        assert "Resume every rank from a checkpoint" in res["error"]
        assert res["seconds"] < 10, res["seconds"]
    local = {"replaced": "the gradient of weight was changed outside the Accumulator",
             "inf_in_place": "the window's gradient is not finite",
             "optimizer": "optimizer failed on rank 1"}[how]
    assert local in results[1]["error"], results[1]["error"]
    assert torch.equal(results[0]["next_grad"], results[1]["next_grad"])


def test_ranks_that_cannot_step_their_closed_window_tell_every_rank_the_replicas_differ(tmp_path):
    """Note [Every rank reads what several aborters did]: two of three ranks
    cannot step the window flush() steps. Rank 0 stepped it: the replicas
    differ, and rank 0 must say so, naming both ranks (it once counted them
    and said training could go on); each of them names the other."""
    results = du.run_job("flush_after_closed_window_fails_on_one_rank", 3, tmp_path, module=R,
                         how="optimizer", failing=(1, 2), pg_timeout=30, timeout=90)
    assert results[0]["error"] == (
        "gradaccum: acc.flush(): window 1 was dropped on every rank: 2 ranks (ranks 1 and 2) could not contribute "
        "their window: both could not step a window every rank had reduced as their data ended (in acc.flush() or "
        "acc.join()), while other ranks stepped theirs (each raises its own error there): the replicas differ "
        "from here on. Resume every rank from a checkpoint. Every rank ended its epoch in this acc.flush(): do not "
        "call it again for this epoch (a second one would pair with the other ranks' next window); the next "
        "micro-step begins the next epoch"), results[0]["error"]
    for rank in (1, 2):
        err = results[rank]["error"]
        assert err.startswith(f"gradaccum: acc.flush(): window 1 was dropped on every rank: this rank (rank {rank}) "
                              "could not step a window every rank had reduced as its data ended (its last, in "
                              "acc.flush() or acc.join(), or one it shadowed in acc.join()), while other ranks "
                              f"stepped theirs; rank {3 - rank} could not contribute "
                              "its window either: the replicas differ from here on. "
                              "Resume every rank from a checkpoint. The error on this rank, stepping the closed "
                              f"window before the flush: RuntimeError: optimizer failed on rank {rank}"), err
    for res in results:
        assert res["seconds"] < 10, res["seconds"]


def test_two_ranks_dropping_one_window_for_different_reasons_are_both_named(tmp_path):
    """On 3 ranks, at window 1's closing micro-step, rank 1 refuses its
    micro-batch and rank 2's backward raises: rank 0 names both, with each
    reason counted, and each of them names the other (the same story, as
    far as the header tells); every rank drops the window and the next one
    trains (the float64 big batches without window 1)."""
    results = run("refused_micro_batch", 3, tmp_path, how="no_grad", closing=True, boom_rank=2)
    assert results[0]["errors"] == [("1/1", "RuntimeError",
                                     "gradaccum: acc.backward(): window 1 was dropped on every rank: 2 ranks (ranks 1 "
                                     "and 2) could not contribute their window: 1 of them failed in the "
                                     "synchronising backward (or a micro-step of the window); 1 of them refused "
                                     "the micro-batch that "
                                     f"closes the window (each raises its own error there){THEN}")]
    kind, local = REFUSED["no_grad"]
    assert results[1]["errors"] == [("1/1", kind, f"{local}; window 1 was dropped on every rank: this "
                                     f"rank (rank 1) {WHY}; rank 2 could not contribute its window either{THEN}")]
    (boom,) = results[2]["errors"]
    assert boom[0] == "1/1" and boom[2].startswith(
        "gradaccum: acc.backward(): window 1 was dropped on every rank: the synchronising backward (or a "
        "micro-step of the window) failed on this rank (rank 2): injected failure on rank 2"), boom
    assert boom[2].endswith(f"; rank 1 could not contribute its window either{THEN}"), boom
    expected = pj.refused_reference(3, dropped=1)
    for res in results:
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["optimizer_steps"] == 2
        du.assert_params_close(res["params"], expected, "two reasons")


def test_a_checkpoint_after_a_midwindow_zero_grad_on_one_rank_drops_the_window_everywhere(tmp_path):
    results = du.run_job("checkpoint_after_midwindow_zero_grad", 2, tmp_path, module=R,
                         pg_timeout=30, timeout=90)
    assert "window 0 was dropped on every rank: on rank 1 the accumulated gradients were cleared " \
        "or changed outside the Accumulator" in results[0]["error"], results[0]["error"]
    assert "window 0 was dropped on every rank: on this rank (rank 1) the accumulated gradients were " \
        "cleared" in results[1]["error"], results[1]["error"]
    assert "the accumulated gradients were cleared or changed outside the Accumulator" in results[1]["error"]
    for res in results:
        assert res["micro_step"] == 0 and res["grad_none"]
    assert torch.equal(results[0]["next_grad"], results[1]["next_grad"])


def test_a_per_rank_state_of_a_window_whose_micro_step_failed_is_refused(tmp_path):
    res, = du.run_job("per_rank_state_after_failed_micro_step", 1, tmp_path, module=R)
    assert "injected failure" in res["backward"]
    assert res["state"] is not None and "a micro-step of this window failed on this rank" in res["state"]


REFUSED = {
    "no_grad": ("ValueError", "gradaccum: acc.backward(): loss does not require grad (computed under no_grad or inference_mode, or from "
                "no trainable parameter?)"),
    "not_tensor": ("TypeError", "gradaccum: acc.backward(): loss must be a torch.Tensor, got float"),
    "num_items": ("ValueError", "gradaccum: acc.backward(): num_items is only used with reduction='items' "
                  "(reduction is 'mean')"),
    "huge_num_items": ("ValueError", "gradaccum: acc.backward(): num_items does not fit in a float64 (int too "
                       "large to convert to float)"),
    # (review: a sparse metric raised torch's RuntimeError on rank 1 alone, and
    # rank 0 waited in its all-reduce for the group's timeout)
    "sparse_metric": ("ValueError", "gradaccum: acc.backward(): metric 'm' must be a dense tensor, got "
                      "torch.sparse_coo"),
    "raising_metrics": ("RuntimeError", "gradaccum: acc.backward(): RuntimeError: metric store offline"),
}
WHY = ("refused the micro-batch that closes the window: its acc.backward() or acc.run() rejected its loss, "
       "num_items or metrics (a loss that is not a scalar or does not require grad, a num_items that is not a number "
       ">= 0, ...) or its other arguments, found a parameter unfrozen without acc.refresh_parameters() or an "
       "inference .grad, or was called inside acc.no_sync() or torch.inference_mode()")
NOT_COUNTED = ("this micro-step was not counted: run it again with a valid loss, or call acc.empty_micro_step() in "
               "its place, so that this rank's windows stay aligned with the other ranks'")
THEN = (". The window's gradients were cleared on every rank and no optimizer step was taken; training can go on "
        "from the next window")


def test_an_interrupt_in_the_checks_of_a_first_micro_batch_ends_training_on_every_rank(tmp_path):
    """Review: a KeyboardInterrupt in Python's checks of a micro-batch before
    the closing one was told to nobody; a script that caught it went on one
    micro-step behind the others, pairing other micro-batches, with nothing
    said. It now counts as an interrupted micro-step: the window is dropped
    on every rank when it closes, and every rank is told to end training."""
    results = run("refused_micro_batch", 2, tmp_path, how="interrupted_metrics", closing=False)
    assert results[1]["errors"][0] == ("1/0", "KeyboardInterrupt", "metric store interrupted")
    assert "was interrupted on rank 1" in results[0]["errors"][0][2], results[0]["errors"]
    for res in results:
        later = [e for e in res["errors"] if e[0] >= "2/0"]
        assert later and all("told every rank to end training" in e[2] for e in later), res["errors"]
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["optimizer_steps"] == 1, res["stats"]
    du.assert_params_close(results[0]["params"], results[1]["params"], "replicas", tol=0)


def test_an_interrupt_in_the_closing_micro_batchs_checks_stays_itself_and_is_told_to_every_rank(tmp_path):
    """Review: a KeyboardInterrupt in Python's checks of the closing
    micro-batch (a metrics mapping) was not told to the other ranks: a script
    that caught it and went on paired its next micro-batch with the others'
    window. It stays itself on its rank; the window is dropped on every rank,
    the others naming rank 1, and, as for an interrupt in a backward, every
    rank is told to end training (the later micro-steps are refused)."""
    results = run("refused_micro_batch", 2, tmp_path, how="interrupted_metrics", closing=True)
    ended = ("gradaccum: acc.backward(): the last reduction dropped its window on every rank and told every rank to "
             "end training there (ranks were shadowing in acc.join(), one left its block with an exception, or one "
             "was interrupted): end training on this rank too; inside acc.join(), let that error leave its block "
             "(C++: call acc.join(), which returns at once). Nothing was changed")
    later = [("2/0", "RuntimeError", ended), ("2/1", "RuntimeError", ended)]
    assert results[1]["errors"] == [("1/1", "KeyboardInterrupt", "metric store interrupted")] + later
    assert results[0]["errors"] == [("1/1", "RuntimeError", (
        "gradaccum: acc.backward(): window 1 was dropped on every rank: the synchronising backward (or a "
        "micro-step of the window) was interrupted on rank 1 (its own error is raised there). The window's "
        "gradients were cleared on every rank and no optimizer step was taken; an interrupted rank "
        "(KeyboardInterrupt, SystemExit) stops: end training on every rank here (or resume every rank from a "
        "checkpoint)"))] + later
    for res in results:
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["optimizer_steps"] == 1


@pytest.mark.parametrize("how", sorted(REFUSED))
@pytest.mark.parametrize("closing", [True, False], ids=["closing", "first"])
def test_a_micro_batch_refused_on_one_rank_drops_the_window_only_if_it_closes_it(tmp_path, how, closing):
    """Note [A refused closing micro-batch]: at the closing micro-step the other
    rank is already reducing, so the window is dropped on both, each naming
    rank 1 (no hang, no wait for a timeout); before it the call is refused on
    rank 1 alone and changes nothing, and says so: a script that skipped the
    micro-batch would pair other micro-batches in every later window, with no
    error (review: window losses 2.29 and 2.04 for 2.56 and 1.89)."""
    results = run("refused_micro_batch", 2, tmp_path, how=how, closing=closing)
    kind, local = REFUSED[how]
    if closing:
        window = 1  # the second reduction (the window's number in the reducer's count)
        assert results[0]["errors"] == [("1/1", "RuntimeError",
                                         f"gradaccum: acc.backward(): window {window} was dropped on every rank: "
                                         f"rank 1 {WHY} (its own error is raised there){THEN}")]
        assert results[1]["errors"] == [("1/1", kind, f"{local}; window {window} was dropped on every rank: this "
                                         f"rank (rank 1) {WHY}{THEN}")]
    else:  # nothing changed; the error says how to keep the ranks' windows aligned (review)
        assert results[0]["errors"] == []
        assert results[1]["errors"] == [("1/0", kind, f"{local}; {NOT_COUNTED}")]
    expected = pj.refused_reference(2, dropped=1 if closing else None)
    for res in results:
        assert res["stats"]["dropped_windows"] == (1 if closing else 0)
        assert res["stats"]["optimizer_steps"] == (2 if closing else 3)
        du.assert_params_close(res["params"], expected, "refused")


@pytest.mark.parametrize("who", [[1], [0, 1]], ids=["one_rank", "every_rank"])
def test_the_closing_micro_step_inside_no_sync_drops_the_window_on_every_rank(tmp_path, who):
    """Note [The closing micro-step inside no_sync()]: no_sync() is one rank's
    own state. Before, the closing acc.backward() inside it was refused on
    that rank alone, and the others reduced the window with its next one:
    its micro-batch lost and its windows shifted, with no error there."""
    results = run("no_sync_closing", 2, tmp_path, module=R, who=who)
    own = ("gradaccum: acc.backward(): called inside acc.no_sync() at the window's closing micro-step. "
           "acc.backward() decides by itself which micro-step synchronises (the window's last); acc.no_sync() is "
           "for the manual path (a plain loss.backward() inside it); window 1 was dropped on every rank: this rank "
           "(rank {r}) " + WHY + "{also}" + THEN)
    for rank, res in enumerate(results):
        if rank in who:
            also = f"; rank {1 - rank} could not contribute its window either" if len(who) == 2 else ""
            want = own.format(r=rank, also=also)
        else:
            want = (f"gradaccum: acc.backward(): window 1 was dropped on every rank: rank 1 {WHY} (its own error is "
                    f"raised there){THEN}")
        assert res["errors"] == [("1/1", "RuntimeError", want)], res["errors"]
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["optimizer_steps"] == 2
        du.assert_params_close(res["params"], pj.refused_reference(2, dropped=1), "no_sync")


@pytest.mark.parametrize("loaders", [[1], [0, 1]], ids=["one_rank", "every_rank"])
def test_a_mid_window_rank_independent_state_loaded_on_one_rank_drops_the_window(tmp_path, loaders):
    """Note [A window resumed on some ranks only]: before, rank 1's share of
    the saved sums met rank 0's own sums, and the window stepped a gradient
    that counted rank 0's first micro-batch 1.5 times and rank 1's 0.5 times,
    with no error. Loaded on every rank, the window is the big batch's."""
    results = run("ri_load_on_some_ranks", 2, tmp_path, module=R, loaders=loaders)
    if len(loaders) == 2:
        for res in results:
            assert res["errors"] == [] and res["stats"]["optimizer_steps"] == 3
            du.assert_params_close(res["params"], pj.refused_reference(2, dropped=None), "every rank loaded")
        return
    for rank, res in enumerate(results):
        assert len(res["errors"]) == 1 and res["errors"][0][:2] == ("1/1", "RuntimeError"), res["errors"]
        # (window 2 in the reducer's count: the snapshot was reduction 1)
        mine, theirs = "a window's reduction", "a window's reduction in a window resumed from a rank-independent state"
        if rank == 1:
            mine, theirs = theirs, mine
        assert res["errors"][0][2] == (
            "gradaccum: acc.backward(): window 2: the ranks disagree on what this collective is, whether a bucket "
            "rebuild follows it, or whether its window was resumed from a rank-independent state: this rank (rank "
            f"{rank}) has {mine}, rank {1 - rank} has {theirs}. A rank-independent state saved in the middle of a "
            "window must be loaded (acc.load_state_dict()) on every rank or on none: a rank that loaded it holds a "
            "share of every rank's sums, one that went on holds its own. The window was dropped on every rank"), \
            res["errors"][0][2]
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["optimizer_steps"] == 2
        du.assert_params_close(res["params"], pj.refused_reference(2, dropped=1), "one rank loaded")


@pytest.mark.parametrize("at", [1, 2])
def test_a_plain_backward_in_the_middle_of_a_window_on_one_rank_is_one_dropped_window(tmp_path, at):
    """Note [A manual reduction in the middle of a window]: before, rank 1
    kept counting micro-steps into the window the others had ended: its next
    window was dropped too (its gradients "cleared outside the Accumulator"),
    and its windows then closed at other micro-batches than the others'."""
    results = run("manual_mid_window", 2, tmp_path, module=R, at=at)
    prefix = {0: "gradaccum: acc.backward(): window 0: the ranks disagree on w"[:60],
              1: "gradaccum: loss.backward(): window 0: the ranks disagree on "[:60]}
    closing = {0: "0/2", 1: f"0/{at}"}
    for rank, res in enumerate(results):
        assert res["errors"] == [(closing[rank], "RuntimeError", prefix[rank])], res["errors"]
        assert res["stats"]["dropped_windows"] == 1, res["stats"]
    # Every later window reduced on both ranks alike, at the same collectives.
    assert results[0]["stats"]["optimizer_steps"] == results[1]["stats"]["optimizer_steps"] == 2
    du.assert_params_close(results[0]["params"], results[1]["params"], "replicas", tol=0)
    # Rank 1's acc.zero_grad() right after trains the same windows; a failed
    # micro-step next starts the next window there, which is then dropped on
    # every rank (they once hid the manual reduction, and the windows
    # shifted: review).
    other = run("manual_mid_window", 2, tmp_path, module=R, at=at, then="zero_grad")
    for rank in range(2):
        du.assert_params_close(other[rank]["params"], results[0]["params"], f"zero_grad rank {rank}", tol=0)
    if at == 2:
        return  # (window 0 has no micro-batch after it)
    other = run("manual_mid_window", 2, tmp_path, module=R, at=at, then="failed_run")
    assert [r["stats"]["dropped_windows"] for r in other] == [2, 2], [r["errors"] for r in other]
    assert [r["stats"]["optimizer_steps"] for r in other] == [1, 1]
    du.assert_params_close(other[0]["params"], other[1]["params"], "failed_run replicas", tol=0)


@pytest.mark.parametrize("then", ["every_step", "every_run"])
def test_a_plain_backward_in_the_middle_of_a_window_on_every_rank_is_refused_on_every_rank(tmp_path, then):
    """Review: every rank running a plain loss.backward() in the middle of an
    acc.backward() window (an auxiliary loss) completed the manual path's
    reduction, and the next call dropped the window's micro-batches with
    nothing said (one process refuses the same script). The call after it
    (acc.step(), or acc.run() on the next micro-batch) now raises on every
    rank, starting a new window there; no later window is dropped, and the
    replicas stay equal."""
    results = run("manual_mid_window", 2, tmp_path, module=R, at=1, then=then)
    call, where = ("acc.step()", "0/1") if then == "every_step" else ("acc.run()", "0/2")
    text = (f"gradaccum: {call}: a plain loss.backward() outside acc.no_sync() ran after 1 of this window's 3 "
            "micro-steps"[:60])
    for res in results:
        assert res["errors"] == [(where, "RuntimeError", text[:60])], res["errors"]
        # micro-batches 0/2 (or, refused, not), 1/0..2, 2/0..2: windows of 3 from the refusal on
        assert res["stats"]["dropped_windows"] == 0 and res["stats"]["optimizer_steps"] == 2, res["stats"]
        assert res["micro_step"] == (1 if then == "every_step" else 0)
    du.assert_params_close(results[0]["params"], results[1]["params"], "replicas", tol=0)


@pytest.mark.parametrize("then", ["manual", "run"])
def test_after_a_mixed_window_the_scripts_next_step_or_run_is_refused_and_training_goes_on(tmp_path, then):
    """Review: after a plain backward ended an acc.backward() window on every
    rank, the script's own optimizer.step() was refused for good (the
    Accumulator's position was only realigned at its next call, so later
    manual-path windows were refused too), and an acc.run() whose fn raised
    counted a failed micro-step on that rank alone. The first such call now
    raises the mid-window refusal on every rank, before anything runs, and
    the windows after it train as the float64 big batch without window 0."""
    results = run("mixed_window_then", 2, tmp_path, module=R, then=then)
    call = "optimizer.step()" if then == "manual" else "acc.run()"
    text = (f"gradaccum: {call}: a plain loss.backward() outside acc.no_sync() ran after 1 of this window's 2 "
            "micro-steps")[:100]
    for res in results:
        assert res["errors"] == [("1/0", "RuntimeError", text)], res["errors"]
        if then == "run":
            assert res["stats"]["optimizer_steps"] == 2 and res["stats"]["dropped_windows"] == 0, res["stats"]
            assert res["calls"] == 4  # (fn never ran in the refused call)
    du.assert_params_close(results[0]["params"], pj.refused_reference(2, dropped=0), "rank 0")
    du.assert_params_close(results[1]["params"], pj.refused_reference(2, dropped=0), "rank 1")


def test_a_manual_window_after_a_told_drop_steps_and_its_gradient_is_no_micro_steps(tmp_path):
    """Review: after a drop already told, the manual window's gradient was
    cleared by the script's own step (it stepped nothing); once kept, it was
    summed into the next acc.backward() window on one rank. The manual
    window steps, and the acc.backward() window meeting its gradient is
    dropped on every rank: both ranks train window 1 only."""
    results = run("told_drop_then_manual_then_acc", 2, tmp_path, module=R)
    for res in results:
        assert [e[:2] for e in res["errors"]] == [("0/1", "RuntimeError"), ("2/1", "RuntimeError")], res["errors"]
        assert "was dropped on every rank" in res["errors"][1][2], res["errors"]
    windows = du.make_windows(pj.REFUSE_SEED, [[pj.MICRO] * 2] * 3, pj.MICRO)
    expected = du.windows_reference(pj.REFUSE_SEED, windows, "mean", optimizer="plain_sgd", skip=(0, 2))
    for res in results:
        du.assert_params_close(res["params"], expected, "window 1 only")


@pytest.mark.parametrize("how", ["resume", "failed_run"])
def test_a_manual_window_on_every_rank_ends_no_later_window(tmp_path, how):
    """Review of Note [A manual reduction in the middle of a window]: its
    first version noted the manual reductions at a window's first micro-step
    only, so after a manual window a resumed mid-window state was thrown
    away (every rank alike, silently) and a failed acc.run() at a window's
    first micro-step left that window undropped on one rank."""
    results = run("manual_window_then_resume", 2, tmp_path, module=R, how=how)
    if how == "resume":
        for res in results:
            assert res["errors"] == [] and res["stats"]["optimizer_steps"] == 3, res  # (the state holds 0)
        du.assert_params_close(results[0]["params"], pj.refused_reference(2, dropped=None), "resumed")
    else:
        assert results[1]["errors"][0] == ("1/0", "ValueError", "boom")
        for res in results:
            assert res["errors"][-1][:2] == ("1/1", "RuntimeError"), res["errors"]
            assert "window 1 was dropped on ever" in res["errors"][-1][2], res["errors"]
            assert res["stats"]["optimizer_steps"] == 1 and res["stats"]["dropped_windows"] == 1, res["stats"]
        du.assert_params_close(results[0]["params"], results[1]["params"], "replicas", tol=0)


@pytest.mark.parametrize("short", [False, True])
def test_two_accumulators_whose_windows_cross_raise_on_every_rank(tmp_path, short):
    """Two Accumulators over one group with buckets of the same sizes; rank 1
    one micro-batch short of A's data, so its closing B reduction meets rank
    0's closing A reduction. Both ranks drop it with the same error naming
    the Accumulators (Note [Which Accumulator a collective belongs to]);
    without the header's number the two were summed silently. Fresh
    Accumulators after it train on equal data to the big batch (float64)."""
    results = run("two_accumulators_uneven", 2, tmp_path, short=short)
    want = pj.two_towers_reference(2)
    for rank, res in enumerate(results):
        assert_params_close(res["even"], want, tol=1e-12, what=f"rank {rank}, even")
        if not short:
            assert res["errors"] == []
            assert_params_close(res["uneven"], want, tol=1e-12, what=f"rank {rank}, uneven")
            continue
        ((phase, text),) = res["errors"]
        call, mine, theirs = "acc.backward()", rank, 1 - rank  # A is Accumulator 0, B is 1
        assert phase == "uneven"
        assert text == (
            f"gradaccum: {call}: window 1: the ranks disagree on which Accumulator this collective belongs to (a "
            "number each Accumulator over this process group gets when built, the same on every rank and none "
            "shared by two alive; refresh_parameters() gives a new one): this rank (rank "
            f"{rank}) has {mine}, rank {1 - rank} has {theirs}. Several Accumulators over "
            "one process group pair their collectives in launch order: every rank must build them in the same "
            "order (built in another order, each was numbered, and had its parameters broadcast from rank 0's, as "
            "another one), and run their windows in the same order, with the same number of micro-batches for each "
            "(equal shards); docs/design.md, Limits. The window was dropped on every rank"), text


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_block_run_twice_in_one_forward(tmp_path, reentrant):
    """Reentrant checkpointing of a tower run twice (a Siamese network) brings
    its parameters' gradients twice into one synchronising backward: every
    rank drops the window and says to use use_reentrant=False, which gives
    the one-process gradients (float64)."""
    results = run("checkpointed_twice", 2, tmp_path, reentrant=reentrant)
    if not reentrant:
        want = pj.siamese_reference(2)
        for res in results:
            assert res["error"] is None
            assert_params_close(res["grads"], want, tol=1e-12)
        return
    for rank, res in enumerate(results):
        assert res["error"].startswith("gradaccum: acc.backward(): window 0 was dropped on every rank"), res["error"]
        assert ("got its gradient twice in one synchronising backward (a parameter used both inside and outside a "
                "reentrant checkpoint, a block under reentrant checkpointing called twice in one forward, or a "
                "second backward over it?); each parameter may be reduced once per window. With reentrant "
                "checkpointing use torch.utils.checkpoint.checkpoint(..., use_reentrant=False); otherwise put the "
                "losses into one backward") in res["error"], res["error"]


@pytest.mark.parametrize("how", ["none", "one_rank", "refresh"])
def test_a_model_converted_after_the_accumulator_was_built(tmp_path, how):
    """model.double() after construction: its float64 gradients would be
    reduced through the float32 buckets, silently rounded (review, 2.1e-8 off
    the big batch; bf16 -> float32: 8.8e-4). Without refresh_parameters() the
    window is dropped on every rank, naming the parameter; with it, the big
    batch in float64."""
    results = run("converted_after_build", 2, tmp_path, module=R, how=how)
    if how == "refresh":
        for res in results:
            assert res["errors"] == [] and res["stats"]["optimizer_steps"] == 2, res["errors"]
            du.assert_params_close(res["params"], res["ref"], "converted and refreshed", tol=1e-15)  # (float32 would be 1e-8 off)
            assert all(g.dtype == torch.float64 for g in res["grads"][1])
        return
    texts = []
    for rank, res in enumerate(results):
        converted = how == "none" or rank == 1  # (its acc.step() then says so, until a refresh)
        assert [e[:2] for e in res["errors"]] == [("1/1", "RuntimeError")] + \
            [("1/1 step", "RuntimeError")] * converted, res["errors"]
        assert res["stats"]["optimizer_steps"] == 1 and res["stats"]["dropped_windows"] == 1, res["stats"]
        texts.append(res["errors"][0][2])
    told = ("'s gradient is Double [", "but the Accumulator was built for a Float [")  # (cut at 300 chars)
    for rank, text in enumerate(texts):
        assert text.startswith("gradaccum: acc.backward(): window 1 was dropped on every rank"), text
        assert text.count("was dropped on every rank") == 1, text
        if how == "none" or rank == 1:
            assert all(t in text for t in told), text
        else:  # the rank that did not convert: the other's failure, named
            assert "rank 1" in text, text


@pytest.mark.parametrize("world", [1, 2])
def test_a_layer_reshaped_through_param_data_trains_after_a_refresh(tmp_path, world):
    """`param.data = t` of another shape, then acc.refresh_parameters(): the
    hooks held the parameters' old accumulators, made for the old shape, and
    every backward failed in torch ("invalid gradient", review). Now the
    refresh takes new ones: the big batch, data parallel and in one process
    (no group)."""
    for res in run("reshaped_after_build", world, tmp_path, module=R):
        assert res["errors"] == [] and res["stats"]["optimizer_steps"] == 2, res["errors"]
        assert [tuple(p.shape) for p in res["params"]] == [(3, 4), (3,)]
        du.assert_params_close(res["params"], res["ref"], "reshaped and refreshed")


def test_a_closed_window_no_rank_can_step_is_not_said_to_split_the_replicas(tmp_path):
    """Every rank's optimizer raises at the closed window that flush() steps
    (a scheduler or optimizer that cannot step: review). Every rank failed
    alike, so the replicas still agree: the error said the others had stepped
    and the replicas differed, and told every rank to restore a checkpoint."""
    results = du.run_job("flush_after_closed_window_fails_on_one_rank", 2, tmp_path, module=R,
                         how="optimizer", failing=(0, 1), pg_timeout=30, timeout=90)
    for rank, res in enumerate(results):
        assert res["error"].startswith(
            f"gradaccum: acc.flush(): window 1 was dropped on every rank: this rank (rank {rank}) could not step "
            "a window every rank had reduced as its data ended (its last, in acc.flush() or acc.join(), or one it "
            "shadowed in acc.join()); neither could any other "
            "rank, so the replicas still agree (unless the ranks failed at different points of their step). Mend "
            "what failed; training can go on from the next window. The error on this rank, "
            f"stepping the closed window before the flush: RuntimeError: optimizer failed on rank {rank}"), \
            res["error"]
        assert "differ from here on" not in res["error"] and res["seconds"] < 10
    assert torch.equal(results[0]["next_grad"], results[1]["next_grad"])


def test_the_manual_path_after_a_conversion_is_refused_not_left_unreduced(tmp_path):
    """After model.double() torch gives each parameter a new gradient
    accumulator, without the Accumulator's hooks: the manual path's plain
    backward began no reduction, and each rank stepped its own gradient,
    silently (review: 0.2 off the big batch, the replicas 0.04 apart).
    acc.no_sync() now refuses (nothing changed), and acc.step() after such
    a window says the replicas differ; refreshed, the big batch in float64."""
    results = run("manual_after_conversion", 2, tmp_path, module=R)
    for res in results:
        assert [e[:2] for e in res["errors"]] == [("1/0", "RuntimeError"), ("1/1 step", "RuntimeError")], res["errors"]
        assert res["errors"][0][2].startswith("gradaccum: acc.no_sync(): 0.weight is Double on cpu and has a new "
                                              "gradient accumulator, without the Accumulator's hooks (built for "
                                              "Float)"), res["errors"][0][2]
        assert res["errors"][1][2].startswith("gradaccum: acc.step(): 0.weight is Double"), res["errors"][1][2]
        du.assert_params_close(res["params"], res["ref"], "refreshed after the conversion")


def test_another_thread_may_read_the_window_while_ranks_train(tmp_path):
    """stats(), last_window_timeline(), window_loss and window_metrics from a
    second thread during data-parallel training (review: both ranks
    deadlocked, or rank 0 died of SIGSEGV). 60 windows end alike on both ranks."""
    results = run("read_from_another_thread", 2, tmp_path, module=R, timeout=120, pg_timeout=30)
    assert all(res["steps"] == 60 and res["reads"] > 0 for res in results), [(r["steps"], r["reads"]) for r in results]
    du.assert_params_close(results[0]["params"], results[1]["params"], "replicas", tol=0)
