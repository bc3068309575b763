"""acc.refresh_parameters(): the trainable set changes at a window boundary
(fine-tuning unfreezes a backbone), on real Gloo ranks and in one process,
against one process on the global batch in float64."""

import pytest
import torch

import _dist_utils as du
import _refresh_jobs as fj
import gradaccum

M = "_refresh_jobs"


def run(name, world_size, tmp_path, **kwargs):
    return du.run_job(name, world_size, tmp_path / name, module=M, timeout=180, pg_timeout=30, **kwargs)


MID_WINDOW = (r"gradaccum: acc.refresh_parameters(): called in the middle of a window (micro_step=1); call it at "
              r"a window boundary: after acc.step() returned True, or after acc.flush()")


@pytest.mark.parametrize("world_size,reduction,as_view", [(2, "mean", False), (2, "items", True), (3, "mean", False)])
def test_unfreezing_at_a_boundary_trains_as_one_process(tmp_path, world_size, reduction, as_view):
    results = run("unfreeze", world_size, tmp_path, seed=8, n_windows=5, unfreeze_at=2, reduction=reduction,
                  as_view=as_view)
    expected = fj.reference(8, world_size, 5, 2, reduction)
    frozen_too_long = fj.reference(8, world_size, 5, 99, reduction)  # never unfrozen
    for rank, res in enumerate(results):
        assert res["errors"] == [MID_WINDOW], res["errors"]
        du.assert_params_close(res["params"], expected, f"rank {rank}")
        # the first layer did train after the refresh
        assert (res["params"][0] - frozen_too_long[0]).abs().max() > 1e-4
        assert res["stats"]["optimizer_steps"] == 5 and res["refreshed"]["optimizer_steps"] == 2
        assert res["stats"]["reductions"] == 5 and res["stats"]["dropped_windows"] == 0


def test_ranks_that_refresh_to_different_sets_all_get_an_error(tmp_path):
    results = run("unfreeze", 2, tmp_path, seed=8, n_windows=4, unfreeze_at=2, reduction="mean", odd_rank=1)
    for rank, res in enumerate(results):
        (error,) = res["errors"]  # at the refresh, on every rank; training stops there
        assert error == ("gradaccum: acc.refresh_parameters(): the ranks disagree on the trainable parameters' "
                         "names (in the Accumulator's order): the first that differs is \"2.bias\" on rank 0 and "
                         "\"4.weight\" on rank 1 (position 3; rank 0 has 6, rank 1 has 5); every rank must train the "
                         "same parameters, under the same names: the same layers frozen (requires_grad=False) and the "
                         "same module passed"), error
        assert res["stats"]["optimizer_steps"] == 2


def test_ranks_that_refresh_to_different_layers_of_one_shape_all_get_an_error(tmp_path):
    for rank, res in enumerate(run("submodules", 2, tmp_path)):
        assert res["errors"] == [
            "gradaccum: acc.refresh_parameters(): the ranks disagree on the trainable parameters' names (in the "
            "Accumulator's order): the first that differs is \"0.weight\" on rank 0 and \"2.weight\" on rank 1 "
            "(position 0; rank 0 has 2, rank 1 has 2); every rank must train the same parameters, under the same "
            "names: the same layers frozen (requires_grad=False) and the same module passed"]
        assert res["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # the set before: nothing refreshed


def test_one_process_refresh_and_the_error_without_it():
    torch.manual_seed(0)
    model = du.mlp(3)
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2, accumulate_dtype=torch.float64)
    batch = fj.windows(3, 1, 1)[0][0][0]
    for _ in range(2):
        acc.backward(du.micro_loss(model, batch, "mean")[0])
        acc.step()
    model[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.backward\(\): 0\.weight was frozen \(requires_grad=False\) "
                       r"when the Accumulator was built and now requires grad.*Call acc\.refresh_parameters\(\) at "
                       r"a window boundary after changing requires_grad$"):
        acc.backward(du.micro_loss(model, batch, "mean")[0])
    acc.refresh_parameters()
    before = model[0].weight.detach().clone()
    for _ in range(2):
        acc.backward(du.micro_loss(model, batch, "mean")[0])
        acc.step()
    assert acc.stats()["optimizer_steps"] == 2
    assert not torch.equal(model[0].weight, before)
    # freezing again drops the layer from the set: its .grad becomes None
    model[0].requires_grad_(False)
    acc.refresh_parameters()
    assert model[0].weight.grad is None
    acc.close()
    params_only = gradaccum.Accumulator(list(model.parameters()), opt, steps=2)
    with pytest.raises(ValueError, match=r"built from an iterable of parameters, not a module"):
        params_only.refresh_parameters()
    params_only.refresh_parameters(model)
    params_only.close()


def test_refresh_errors_name_the_refresh_and_leave_the_set_alone():
    torch.manual_seed(0)
    model = du.mlp(3)
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(list(model[2].parameters()) + list(model[4].parameters()), lr=0.1)  # not model[0]
    acc = gradaccum.Accumulator(model, opt, steps=1, grad_scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    with pytest.raises(TypeError, match=r"^gradaccum: acc\.refresh_parameters\(\): parameters must be a torch\.nn\.Module "
                       r"or an iterable of parameters, got a single Tensor \(wrap it in a list\)$"):
        acc.refresh_parameters(torch.zeros(2))
    model[0].requires_grad_(True)  # unfrozen, but not in the optimizer
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.refresh_parameters\(\): grad_scaler: parameter '0\.weight' "
                       r"requires grad but is not in the optimizer's param_groups\..*Freeze it \(requires_grad=False\) "
                       r"before calling acc\.refresh_parameters\(\), or give the optimizer every trainable parameter "
                       r"\(optimizer\.add_param_group\)$"):
        acc.refresh_parameters()
    # Refused before anything changed: the old set trains on, once frozen again.
    model[0].requires_grad_(False)
    batch = fj.windows(3, 1, 1)[0][0][0]
    acc.backward(du.micro_loss(model, batch, "mean")[0])
    assert acc.step()
    assert model[0].weight.grad is None
    acc.close()


REFUSED_BY_1 = ("rank 1 refused acc.refresh_parameters() at the window boundary (its own error is raised there). "
                "No rank refreshed its parameters and no optimizer step was taken (any window a rank reduced in the "
                "refresh's place was cleared); training can go on from the next window")
REFUSED_HERE = {
    "empty": "ValueError: gradaccum: acc.refresh_parameters(): the model has no trainable parameters",
    "scaler": "ValueError: gradaccum: acc.refresh_parameters(): grad_scaler: parameter '0.weight' requires grad but "
              "is not in the optimizer's param_groups",
    "raising": "KeyError: 'no such layer'",
    "interrupted": "KeyboardInterrupt: stopped",
}


@pytest.mark.parametrize("mode", ["empty", "scaler", "raising", "interrupted"])
def test_a_refresh_refused_on_one_rank_raises_on_every_rank(tmp_path, mode):
    """Note [A refresh refused on one rank]: at a window boundary rank 1
    refuses the call by itself (in C++: nothing trainable; or in Python's
    grad_scaler check; or its parameters' own iteration raising); before, rank 0 waited in the new reducer's
    construction until the group's timeout. Now rank 1 raises its own error
    and rank 0 one naming rank 1 (the drop of the refresh's check, Note [A
    refresh pairs like a window]), at once, and neither changed its
    parameters (the refresh broadcasts nothing) nor its last window's loss (a
    window is stepped first: the check is reduction 1). (In the middle of a window the call is
    refused before any collective: test_unfreezing_at_a_boundary_...)"""
    results = run("refused_on_one_rank", 2, tmp_path, mode=mode)
    (theirs,) = results[0]["errors"]
    assert theirs == ("RuntimeError: gradaccum: acc.refresh_parameters(): its check (reduction 1) was dropped on "
                      "every rank: " + REFUSED_BY_1), theirs
    (own,) = results[1]["errors"]
    assert own.startswith(REFUSED_HERE[mode]), own
    # seeded alike: the same values on both ranks, none broadcast or changed
    du.assert_params_close(results[1]["params"], results[0]["params"], "rank 1", tol=0)
    # no window was dropped: the last window's loss stays, the same on both ranks
    for res in results:
        before, after = res["loss"]
        assert before[1] == 4 and after == before == results[0]["loss"][0], res["loss"]


@pytest.mark.parametrize("mode,first", [("names", ("0.weight", "1.weight", 4)), ("count", ("2.weight", "0.weight", 2))])
def test_ranks_that_unfreeze_different_layers_all_get_an_error(tmp_path, mode, first):
    """Shapes alone would pass: rank 0 unfreezes layer 0 and rank 1 layer 1,
    both 4x4. Before, rank 0's layer 0 was broadcast into rank 1's layer 1 and
    the windows summed different layers' gradients; now the construction
    check compares the names, and every rank raises. Where only rank 1
    unfreezes a layer, the names are shown too (review: the counts only,
    advising to build the Accumulator alike)."""
    results = run("refused_on_one_rank", 2, tmp_path, mode=mode)
    on_0, on_1, count_0 = first
    for rank, res in enumerate(results):
        (error,) = res["errors"]
        assert error == (
            "ValueError: gradaccum: acc.refresh_parameters(): the ranks disagree on the trainable parameters' names "
            f"(in the Accumulator's order): the first that differs is \"{on_0}\" on rank 0 and \"{on_1}\" on rank "
            f"1 (position 0; rank 0 has {count_0}, rank 1 has 4); every rank must train the same parameters, under "
            "the same names: the same layers frozen (requires_grad=False) and the same module passed"), error
    du.assert_params_close(results[1]["params"], results[0]["params"], "rank 1", tol=0)


REFRESHING = "acc.refresh_parameters()'s check at a window boundary"


def one_sided_reference(world_size):
    """One process on the global batch of windows 0 and 2 (window 1 was
    dropped on every rank), the first layer frozen in window 0."""
    model = du.mlp(5)
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = fj.windows(5, world_size, 3)
    for w in (0, 2):
        du.global_batch_loss(model, data[w], "mean").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model[0].requires_grad_(True)
    return du.params(model)


UNCOUNTED = ("uncounted: gradaccum: acc.refresh_parameters(): gradients were written since the last window, but "
             "no micro-step was counted: a plain loss.backward() instead of acc.backward(loss)? A refresh now would "
             "drop them. ")
NOTHING_REFRESHED = (". Nothing was refreshed: call acc.refresh_parameters() again on every rank, at the same "
                     "window boundary")
CALLS = ("Every rank must call acc.state_dict() at the same micro-step of a window, and acc.refresh_parameters() at "
         "the same window boundary (a rank that does not call it reduces its next window against the others' check)")
RESUMED = ("A rank-independent state saved in the middle of a window must be loaded (acc.load_state_dict()) on "
           "every rank or on none: a rank that loaded it holds a share of every rank's sums, one that went on holds "
           "its own")
LEGEND = ("The codes: 0 a window's reduction, 1 acc.state_dict()'s snapshot, 2 acc.refresh_parameters()'s check, "
          "3 a plain loss.backward()'s reduction, plus 4 with a bucket rebuild pending, plus 8 in a window resumed "
          "from a rank-independent state. ")


FLUSHED = (". Nothing was refreshed; other ranks ended their epoch with acc.flush() in it: call acc.flush() here (a "
           "no-op), then acc.refresh_parameters() again on every rank, at the same window boundary")


def one_sided_error(rank, world_size, mode):
    """What rank `rank` of job one_sided must raise last (see its docstring)."""
    odd = world_size - 1
    if mode == "refuse":
        call = ("refresh: RuntimeError: gradaccum: acc.refresh_parameters(): its check (reduction 1)" if rank == 0
                else "backward: RuntimeError: gradaccum: acc.backward(): window 1")
        return f"{call} was dropped on every rank: {REFUSED_BY_1}"
    mine, theirs, tail = "a window's reduction", REFRESHING, ""
    if rank != odd:
        call = "refresh: RuntimeError: gradaccum: acc.refresh_parameters(): its check (reduction 1)"
        mine, theirs, tail = theirs, mine, FLUSHED if mode == "flush" else NOTHING_REFRESHED
    elif mode == "flush":
        call = "flush: RuntimeError: gradaccum: acc.flush(): window 1"
    else:
        call = "backward: RuntimeError: gradaccum: acc.backward(): window 1"
    if world_size == 2:
        rest = f", rank {odd if rank != odd else 0} has {theirs}. {CALLS}"
    else:
        rest = f" (mean over the 3 ranks: 1.33333). {LEGEND}{CALLS}; or rebuild_buckets differs across ranks? " \
               f"Every rank must use the same options; or: {RESUMED}"
    return (f"{call}: the ranks disagree on what this collective is, whether a bucket rebuild follows it, or whether "
            f"its window was resumed from a rank-independent state: this rank (rank {rank}) has {mine}{rest}. The "
            f"window was dropped on every rank{tail}")


@pytest.mark.parametrize("world_size,mode,options", [
    (2, "skip", {}),
    (2, "late", {}),
    (2, "uncounted", {"gradient_as_bucket_view": True}),
    (2, "flush", {}),
    (2, "skip", {"gradient_as_bucket_view": True}),
    (2, "skip", {"comm_dtype": torch.float32, "error_feedback": True}),
    (2, "skip", {"comm_dtype": torch.bfloat16}),
    (3, "skip", {}),
    (3, "refuse", {}),
])
def test_a_rank_that_does_not_refresh_gets_the_same_error_everywhere(tmp_path, world_size, mode, options):
    """Note [A refresh pairs like a window]: rank 0 (and rank 1 of 3)
    refreshes at a window boundary while the last rank trains on into its next
    window without calling acc.refresh_parameters() ("skip"), calls it one
    micro-step late, where it is refused ("late"), calls it with gradients
    of a plain backward no micro-step counted, where it is refused before any
    collective, those gradients untouched ("uncounted"), or ends its epoch
    with acc.flush() there ("flush"); or rank 1 of 3 refuses the refresh while
    rank 2 trains on ("refuse"). Before, rank 0's first refresh collective met
    that rank's bucket all-reduce: mis-sized, an error on one side and a wait
    for the group's timeout on the other. Now the refresh's check goes
    through the old buckets, so the window meets it bucket for bucket: every
    rank raises at once, saying what each rank ran and what to do, nothing is
    refreshed or stepped, the refreshing ranks keep their error-feedback
    residuals, and after a refresh on every rank the job trains on as one
    process on the windows that were not dropped."""
    results = run("one_sided", world_size, tmp_path, mode=mode, options=options)
    odd = world_size - 1
    for rank, res in enumerate(results):
        *first, error = res["errors"]
        if mode == "refuse" and rank == 1:
            assert first == [] and error.startswith(
                "refused: gradaccum: acc.refresh_parameters(): the model has no trainable parameters"), error
        else:
            assert error == one_sided_error(rank, world_size, mode), error
            if not (mode == "uncounted" and rank == odd):  # (its first error: below)
                assert first == (["late: " + MID_WINDOW] if mode == "late" and rank == odd else []), first
        assert res["windows_before"] == 1
        # nothing stepped anywhere between the window before and the error
        du.assert_params_close(res["params_after_error"], res["params_before"], f"rank {rank}", tol=0)
        assert res["stats"]["dropped_windows"] == 1 and res["stats"]["reductions"] == 3, res["stats"]
        assert res["stats"]["optimizer_steps"] == 2
        du.assert_params_close(res["params"], results[0]["params"], f"rank {rank}", tol=0)
    if mode == "uncounted":
        (first, _) = results[odd]["errors"]
        assert first.startswith(UNCOUNTED), first
        assert results[odd]["grads_kept"] and results[odd]["grads_nonzero"] == 4  # the rejected call kept them
    if options.get("error_feedback"):
        assert results[0]["residuals_kept"] and results[0]["residuals_nonzero"] > 0
    wire = options.get("comm_dtype")  # the gradients rounded to the wire's dtype on the way
    tol = {None: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[wire]
    du.assert_params_close(results[0]["params"], one_sided_reference(world_size), "rank 0", tol=tol)
