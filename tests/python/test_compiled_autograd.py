"""Training under torch's compiled autograd (torch._dynamo.compiled_autograd):
the reducer's hooks do not run in a compiled backward graph, so the window's
closing backward reduces after backward returns (Note [Compiled autograd]).
Real Gloo ranks, against one eager process on the global batch, float64."""
import pytest
import torch

import _compiled_jobs as cj
import _dist_utils as du
import gradaccum

M = "_compiled_jobs"
WINDOWS = 3


@pytest.mark.parametrize("world_size,reduction,as_view", [(1, "mean", False), (2, "items", False),
                                                         (2, "mean", True)])
def test_compiled_autograd_trains_as_eager(tmp_path, world_size, reduction, as_view):
    """Full windows and a flushed partial one; with bucket views too (the
    compiled graph accumulates into them, and no hook says which it reached)."""
    expected = cj.reference(5, world_size, WINDOWS, reduction, partial=2)
    runs = {}
    for compiled in (False, True):
        runs[compiled] = du.run_job("train", world_size, tmp_path / str(compiled), module=M, timeout=240,
                                    seed=5, n_windows=WINDOWS, reduction=reduction, compiled=compiled,
                                    as_view=as_view, partial=2)
    for rank in range(world_size):
        eager, compiled = runs[False][rank], runs[True][rank]
        du.assert_params_close(compiled["params"], expected, f"compiled, rank {rank}")
        du.assert_params_close(compiled["params"], eager["params"], f"compiled vs eager, rank {rank}")
        assert compiled["captures"] > 0  # the backward really ran compiled
        assert eager["captures"] == 0
        # The same collectives per window; compiled ones after backward.
        assert compiled["collectives"] == eager["collectives"]
        assert all(c >= 2 for c in compiled["collectives"])  # several buckets
        assert compiled["stats"]["hookless_windows"] == WINDOWS  # the flush has no hooks either way
        assert eager["stats"]["hookless_windows"] == 0
        assert compiled["stats"]["optimizer_steps"] == WINDOWS + 1


def test_compiled_autograd_without_a_group():
    """Local accumulation has no hooks at all: compiled equals eager."""
    results = []
    for compiled in (False, True):
        model = du.mlp(3)
        acc = gradaccum.Accumulator(model, du.make_optimizer("adam", model.parameters()), steps=cj.STEPS,
                                    process_group=False)
        with cj.compiled_autograd(compiled):
            for window in cj.windows(3, 1, 2):
                for batch in window[0]:
                    acc.backward(du.micro_loss(model, batch, "mean")[0])
                assert acc.step()
        results.append(du.params(model))
    du.assert_params_close(results[1], results[0], "compiled vs eager")
    du.assert_params_close(results[0], cj.reference(3, 1, 2, "mean"), "eager vs one backward")
