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
    compiled graph accumulates into them, and no hook says which it reached),
    and a parameter the forward never uses."""
    expected = cj.reference(5, world_size, WINDOWS, reduction, partial=2)
    runs = {}
    for compiled in (False, True):
        runs[compiled] = du.run_job("train", world_size, tmp_path / str(compiled), module=M, timeout=240,
                                    seed=5, n_windows=WINDOWS, reduction=reduction, compiled=compiled,
                                    as_view=as_view, partial=2, unused=as_view)
    for rank in range(world_size):
        eager, compiled = runs[False][rank], runs[True][rank]
        du.assert_params_close(compiled["params"], expected, f"compiled, rank {rank}")
        du.assert_params_close(compiled["params"], eager["params"], f"compiled vs eager, rank {rank}")
        assert compiled["captures"] > 0  # the backward really ran compiled
        # Bucket views share one version counter per bucket, so without hooks
        # a parameter unused everywhere cannot be told apart: it ends the
        # window with zeros (as torch DDP leaves it), not None as in eager.
        for a, b in zip(compiled["unused_grads"], eager["unused_grads"]):
            assert (a is None and b is None) or (b is None and not a.any()) or torch.equal(a, b)
        assert eager["captures"] == 0
        # The same collectives per window; compiled ones after backward.
        assert compiled["collectives"] == eager["collectives"]
        assert all(c >= 2 for c in compiled["collectives"])  # several buckets
        assert compiled["stats"]["hookless_windows"] == WINDOWS  # the flush has no hooks either way
        assert eager["stats"]["hookless_windows"] == 0
        assert compiled["stats"]["optimizer_steps"] == WINDOWS + 1


def test_compiled_autograd_with_reentrant_checkpointing_trains_as_eager(tmp_path):
    """Every parameter inside a reentrant checkpoint: the nested tasks'
    backwards run outside the compiled graph, and their hooks once began
    stray reductions of their own (3 collectives, then an internal assert
    every window). Now the hookless reduction after backward takes them:
    the big batch, as eager, in as many collectives."""
    expected = cj.reference(5, 2, WINDOWS, "mean")
    runs = {}
    for compiled in (False, True):
        runs[compiled] = du.run_job("train", 2, tmp_path / str(compiled), module=M, timeout=240, seed=5,
                                    n_windows=WINDOWS, reduction="mean", compiled=compiled, reentrant=True)
    for rank in range(2):
        eager, compiled = runs[False][rank], runs[True][rank]
        du.assert_params_close(compiled["params"], expected, f"compiled, rank {rank}")
        du.assert_params_close(eager["params"], expected, f"eager, rank {rank}")
        assert compiled["collectives"] == eager["collectives"]
        assert compiled["stats"]["hookless_windows"] == WINDOWS and eager["stats"]["hookless_windows"] == 0
        assert compiled["stats"]["optimizer_steps"] == WINDOWS


def test_compiled_autograd_without_a_group():
    """Local accumulation's hooks only watch for a backward after the window
    closed: compiled equals eager."""
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


def test_a_dropped_window_then_the_next_trains(tmp_path):
    """Rank 1's closing backward fails under compiled autograd: every rank
    gets the drop error naming rank 1; the next window reduces (after its
    backward) and trains as one process on that window alone."""
    results = du.run_job("dropped_then_trained", 2, tmp_path, module=M, timeout=240, seed=9)
    windows = cj.windows(9, 2, 2)
    model = du.mlp(9)
    opt = du.make_optimizer("adam", model.parameters())
    du.global_batch_loss(model, windows[1], "mean").backward()
    opt.step()
    for rank, res in enumerate(results):
        assert len(res["errors"]) == 1 and res["errors"][0].startswith("gradaccum: "), res["errors"]
        assert "rank 1" in res["errors"][0], res["errors"]
        assert res["stepped"] is True
        assert res["stats"]["optimizer_steps"] == 1 and res["stats"]["dropped_windows"] == 1
        du.assert_params_close(res["params"], du.params(model), f"rank {rank}")


def test_the_manual_path_is_refused_under_compiled_autograd(tmp_path):
    for res in du.run_job("manual_path", 2, tmp_path, module=M, timeout=240, seed=4):
        assert res["error"] is not None and "gradaccum: loss.backward(): under compiled autograd" in res["error"], \
            res["error"]
        assert res["stats"]["windows"] == 0


def test_a_backward_after_the_window_closed_is_refused_as_it_compiles():
    """One process: under compiled autograd no hook runs to tell acc.step() of
    a backward that reached the parameters after the window closed (Note [A
    backward after the window closed]): it is refused while it compiles,
    before it writes any gradient, and the window still steps."""
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=cj.STEPS,
                                process_group=False)
    batches = cj.windows(3, 1, 1)[0][0]
    with cj.compiled_autograd(True):
        for batch in batches:
            acc.backward(du.micro_loss(model, batch, "mean")[0])
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(RuntimeError) as info:
            du.micro_loss(model, batches[0], "mean")[0].backward()
    text = str(info.value)
    assert "gradaccum: loss.backward(): a backward reached " in text, text
    assert text.endswith("Under compiled autograd the hooks that would tell acc.step() do not run, so this backward "
                         "was refused before it wrote anything"), text
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)
    assert acc.step()
