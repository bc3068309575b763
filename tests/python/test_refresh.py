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
        assert error == ("gradaccum: acc.refresh_parameters(): the ranks disagree on the number of trainable "
                         "parameters (rank 0: 6, rank 1: 5); every rank must build its Accumulator with the same "
                         "options and model"), error
        assert res["stats"]["optimizer_steps"] == 2


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


REFUSED_HERE = {
    "empty": "ValueError: gradaccum: acc.refresh_parameters(): the model has no trainable parameters",
    "scaler": "ValueError: gradaccum: acc.refresh_parameters(): grad_scaler: parameter '0.weight' requires grad but "
              "is not in the optimizer's param_groups",
}


@pytest.mark.parametrize("mode", ["empty", "scaler"])
def test_a_refresh_refused_on_one_rank_raises_on_every_rank(tmp_path, mode):
    """Note [A refresh refused on one rank]: at a window boundary rank 1
    refuses the call by itself (in C++: nothing trainable; or in Python's
    grad_scaler check); before, rank 0 waited in the new reducer's
    construction until the group's timeout. Now rank 1 raises its own error
    and rank 0 one naming rank 1, at once, and neither changed its parameters
    (the refresh broadcasts nothing). (In the middle of a window the call is
    refused before any collective: test_unfreezing_at_a_boundary_...)"""
    results = run("refused_on_one_rank", 2, tmp_path, mode=mode)
    (theirs,) = results[0]["errors"]
    assert theirs == ("ValueError: gradaccum: acc.refresh_parameters(): rank 1 refused the call (that rank says "
                      "why), so no rank refreshed its parameters; nothing was changed"), theirs
    (own,) = results[1]["errors"]
    assert own.startswith(REFUSED_HERE[mode]), own
    # seeded alike: the same values on both ranks, none broadcast or changed
    du.assert_params_close(results[1]["params"], results[0]["params"], "rank 1", tol=0)


def test_ranks_that_unfreeze_different_layers_of_one_shape_all_get_an_error(tmp_path):
    """Shapes alone would pass: rank 0 unfreezes layer 0 and rank 1 layer 1,
    both 4x4. Before, rank 0's layer 0 was broadcast into rank 1's layer 1 and
    the windows summed different layers' gradients; now the construction
    check compares the names, and every rank raises."""
    results = run("refused_on_one_rank", 2, tmp_path, mode="names")
    for rank, res in enumerate(results):
        (error,) = res["errors"]
        assert error == (
            "ValueError: gradaccum: acc.refresh_parameters(): the ranks disagree on the trainable parameters' names "
            "(in the Accumulator's order): the first that differs is \"0.weight\" on rank 0 and \"1.weight\" on rank "
            "1 (position 0; rank 0 has 4, rank 1 has 4); every rank must train the same parameters, under the same "
            "names: the same layers frozen (requires_grad=False) and the same module passed"), error
    du.assert_params_close(results[1]["params"], results[0]["params"], "rank 1", tol=0)
