"""An Accumulator that some rank refuses to build (Note [Construction refused
on one rank]): every rank raises at once, the others naming the refusing
rank and its reason, as the same kind of error; the group still pairs after.
Real Gloo ranks; exact error texts."""
import pytest
import torch

import _dist_utils as du
from _construction_jobs import K, batch, model

M = "_construction_jobs"
# Before the fix the other ranks waited in the first construction collective
# until the group's timeout: a short one makes that a quick failure here.
PG_TIMEOUT = 20


def run(tmp_path, world_size, case, refusers):
    return du.run_job("refused", world_size, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT,
                      case=case, refusers=list(refusers))


def reference(world_size):
    """The good window every rank trains after the refusal: SGD on the mean of
    every rank's K micro-batch losses, in float64."""
    m = model()
    loss = sum(m(batch(r, k)).pow(2).mean() for r in range(world_size) for k in range(K)) / (world_size * K)
    loss.backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.5 * p.grad
    return [p.detach() for p in m.parameters()]


def peer_text(refuser, reason, more=0):
    also = f" (as did {more} more rank{'s' if more > 1 else ''})" if more else ""
    return (f"gradaccum: Accumulator(): rank {refuser} refused{also}, so every rank raises (rank {refuser} its "
            f"own error): {reason}")


CASES = {
    # case: (the refusing rank's error type, its message)
    "python_value": ("ValueError", "gradaccum: Accumulator(): invalid reduction: 'avg' (expected one of ('mean', "
                     "'sum', 'items'))"),
    "cpp_options": ("ValueError", "gradaccum: Accumulator(): invalid steps: 0 (must be a positive integer)"),
    "python_type": ("TypeError", "gradaccum: Accumulator(): metrics must be a list or tuple of names, got 5"),
    "claimed": ("ValueError", "gradaccum: Accumulator(): weight already belongs to another live Accumulator, "
                "whose hooks would keep running (reducing every micro-step). Drop the old one (del acc) or call "
                "its close() before building a new one"),
    "conversion": ("ValueError", "gradaccum: Accumulator(): max_grad_norm does not fit in a float64 (int too large "
                   "to convert to float)"),
    "foreign_hooks": ("ValueError", "gradaccum: Accumulator(): weight already has a post-hook on its gradient "
                      "accumulator that gradaccum did not add: the model is also wrapped in torch "
                      "DistributedDataParallel (accelerator.prepare(model), HF Trainer?) or another reducer is "
                      "attached, and the gradient would be reduced twice. Delete the DDP wrapper (del ddp_model; "
                      "with Accelerate, do not prepare the model) before building the Accumulator: gradaccum does "
                      "the data-parallel reduction"),
    "frozen": ("ValueError", "gradaccum: Accumulator(): the model has no trainable parameters (none requires grad)"),
    "cpp_value": ("ValueError", "gradaccum: Accumulator(): parameter 0 is not a leaf tensor; pass the model's "
                  "parameters"),
    "outside_optimizer": ("ValueError", "gradaccum: Accumulator(): the optimizer steps a parameter that is not the "
                          "model's and has a gradient (its parameter 2 counting through param_groups, of shape [1]): "
                          "nothing would divide that gradient by the window's weight, reduce it over ranks or clear "
                          "it, so it would be stepped with every micro-step's gradient summed, window after window. "
                          "Build the Accumulator over a module that holds every parameter the optimizer steps "
                          "(Python: torch.nn.ModuleList([model, head])); for a layer added to the model, call "
                          "acc.refresh_parameters() at a window boundary"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_rank_refusing_to_build_raises_on_every_rank(tmp_path, case):
    kind, own = CASES[case]
    results = run(tmp_path, 2, case, [1])
    got_kind, got_own = results[1]["error"]
    assert (got_kind, got_own) == (kind, own)
    assert results[0]["error"] == (kind, peer_text(1, own[len("gradaccum: Accumulator(): "):]))
    expected = reference(2)
    for res in results:
        for got, want in zip(res["params"], expected):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_several_refusing_ranks_are_counted_and_each_raises_its_own(tmp_path):
    results = run(tmp_path, 3, "python_value", [1, 2])
    own = CASES["python_value"][1]
    assert results[1]["error"] == ("ValueError", own)
    assert results[2]["error"] == ("ValueError", own)
    assert results[0]["error"] == ("ValueError", peer_text(1, own[len("gradaccum: Accumulator(): "):], more=1))
    for res in results:
        for got, want in zip(res["params"], reference(3)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_check_parameters_that_differs_across_ranks_is_an_error_on_every_rank(tmp_path):
    # It decides which collectives follow: compared before any of them.
    results = run(tmp_path, 3, "check_parameters", [2])
    text = ("gradaccum: Accumulator(): check_parameters differs across ranks: true on ranks 0 and 1; false on "
            "rank 2; the ranks would run different construction collectives. Pass the same value on every rank")
    for res in results:
        assert res["error"] == ("ValueError", text)
        for got, want in zip(res["params"], reference(3)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-15)


def test_a_refresh_one_rank_cannot_claim_raises_on_every_rank(tmp_path):
    results = du.run_job("refused_refresh", 2, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT)
    own = ("1.weight already belongs to another live Accumulator, whose hooks would keep running (reducing every "
           "micro-step). Drop the old one (del acc) or call its close() before building a new one")
    assert results[1]["error"] == ("ValueError", "gradaccum: acc.refresh_parameters(): " + own)
    assert results[0]["error"] == ("ValueError", "gradaccum: acc.refresh_parameters(): rank 1 refused, so every "
                                   "rank raises (rank 1 its own error): " + own)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)).double()
    loss = sum(m(batch(r, k)).pow(2).mean() for r in range(2) for k in range(K)) / (2 * K)
    loss.backward()
    for res in results:
        for got, p in zip(res["params"], m.parameters()):
            torch.testing.assert_close(got, p.detach() - 0.5 * p.grad, rtol=0, atol=1e-15)


def test_a_peer_that_never_builds_is_a_prefixed_error(tmp_path):
    """Note [A peer that never builds]: rank 1 leaves before building; rank
    0's construction fails in its first collective with the library's
    prefix and the likely cause around the transport's text (before: Gloo's
    bare text)."""
    results = du.run_job("peer_never_builds", 2, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT)
    error = results[0]["error"]
    assert error is not None and error.startswith(
        "gradaccum: Accumulator(): rank 0 (in the group): the construction's first collective failed. Likely "
        "cause: a peer process did not build its Accumulator (it raised before, e.g. in its model's forward, or "
        "exited) or ran another collective first; every rank must build it at the same point. The original "
        "error: "), error


def test_shapes_are_compared_past_eight_dims(tmp_path):
    """A 10-dim parameter whose last sizes differ across ranks (the same
    element count): before, only the first 8 sizes were compared, and the
    ranks trained silently on differently shaped weights. The error shows
    every size (gathered on the way to it)."""
    results = du.run_job("many_dims", 2, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT)
    for res in results:
        assert res["error"] == (
            "gradaccum: Accumulator(): the model differs across ranks: 0 is Double [1, 1, 1, 1, 1, 1, 1, 1, 3, 2] "
            "on rank 1 but Double [1, 1, 1, 1, 1, 1, 1, 1, 2, 3] on rank 0"), res["error"]


def test_accumulators_built_in_another_order_are_told_so(tmp_path):
    """The first window of two Accumulators built in different orders on
    different ranks is dropped on every rank, saying to build them in the
    same order (before, it said only to run their windows in one)."""
    for res in du.run_job("built_in_another_order", 2, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT):
        assert "every rank must build them in the same order" in res["error"], res["error"]


@pytest.mark.parametrize("skew", [False, True], ids=["same_layouts", "other_layouts"])
def test_frozen_parameters_are_rank_zeros_after_construction(tmp_path, skew):
    """Models initialised from a different seed on each rank: Accumulator()
    broadcasts rank 0's frozen parameters (in place, staged, strided,
    expanded, complex, int8), as torch DDP syncs its module's states, and
    refresh_parameters() those it finds then; before, they
    kept each rank's values, and the window's gradient differed from the big
    batch's by 0.3 with no error. The broadcast's plan follows sizes only:
    with other layouts on rank 1 (`skew`) its first version sent garbage or
    waited in a broadcast the other rank did not run."""
    results = du.run_job("frozen_parameters", 2, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT, skew=skew)
    for res in results:
        assert res["error"] is None, res["error"]
        assert res["frozen_equal"]
        assert res["gradient_error"] < 1e-12, res["gradient_error"]
        assert res["late"] == [0.0, 0.0]


def test_frozen_parameters_that_differ_across_ranks_are_an_error_on_every_rank(tmp_path):
    results = du.run_job("frozen_parameters", 2, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT,
                         freeze_extra=True)
    for res in results:
        assert res["error"] == (
            "gradaccum: Accumulator(): the model's frozen parameters (requires_grad=False) differ across ranks: "
            "rank 1 has 8, rank 0 has 7. Rank 0's are broadcast into every rank's (as torch DDP does): freeze "
            "the same parameters on every rank"), res["error"]


def test_a_frozen_parameter_expanded_on_one_rank_only_is_refused_on_every_rank(tmp_path):
    results = du.run_job("frozen_expanded_on_one_rank", 2, tmp_path, module=M, timeout=90, pg_timeout=PG_TIMEOUT)
    for res in results:
        assert res["error"] == (
            "gradaccum: Accumulator(): the model differs across ranks: frozen parameter table is Double [4, 3] "
            "expanded (stride 0) along dim(s) [0] on rank 1 but Double [4, 3] on rank 0. Rank 0's frozen parameters "
            "are broadcast into every rank's (as torch DDP does): every rank must hold the same ones"), res["error"]

