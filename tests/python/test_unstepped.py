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
             "dropped the closed window there, say after acc.step() raised, or a failure there after the window's "
             "reduction cleared it): " + REPLICAS)
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
    results = run(3, tmp_path, droppers=(1, 2), resume=False)
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
    results = run(2, tmp_path, droppers=(1,), then=then, resume=False)
    tail = ". Nothing was refreshed" if then == "refresh" else ""
    assert results[0]["errors"] == [(2, "reduction", f"gradaccum: {call}: {where}: rank 1 " + ELSEWHERE + tail)]
    assert results[1]["errors"] == [step_error(1), (2, "reduction", f"gradaccum: {call}: {where}: this rank "
                                                    "(rank 1) " + HERE + tail)]
