"""Misuse guards and checkpoints that survive the frameworks users save with.

Each habit that used to train silently wrong now ends in a clear error (its
text asserted) or in the reference result (float64, 1e-10).
"""
import pytest
import torch
import torch.nn as nn

import gradaccum
import _dist_utils as du

M = "_misuse_jobs"


def run(name, world_size, tmp_path, **kwargs):
    kwargs.setdefault("timeout", 150)
    kwargs.setdefault("pg_timeout", 30)
    return du.run_job(name, world_size, tmp_path, module=M, **kwargs)


def close_params(a, b, tol=1e-10):
    return all((x - y).abs().max().item() <= tol * max(1.0, y.abs().max().item()) for x, y in zip(a, b))


# --------------------------------------------------------------------------- #
# Checkpoints: rank 0 saves, every rank resumes
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("reduction", ["mean", "items"])
def test_rank0_checkpoint_resumes_exactly_on_every_rank(tmp_path, world_size, reduction):
    results = run("checkpoint", world_size, tmp_path, seed=21, reduction=reduction,
                  ckpt_dir=str(tmp_path), save_after=6)  # window 1, micro-step 2 of 4
    for rank, res in enumerate(results):
        saved = res["rank0"]["saved"]
        assert saved["rank_independent"] and saved["world_size"] == world_size
        assert saved["micro_step"] == 2 and saved["reduction"] == reduction
        assert close_params(res["rank0"]["params"], res["uninterrupted"]), f"rank {rank}"
        assert close_params(res["per_rank"]["params"], res["uninterrupted"]), f"rank {rank}"
        # The counters carry on where they were.
        for key in ("micro_steps", "optimizer_steps", "windows", "reductions"):
            assert res["rank0"]["stats"][key] == res["stats"][key], key
        assert res["rank0"]["resumed_stats"]["reductions"] == 1
        # rank 0's state of a half-done window loads in one process too (test_resize.py)
        assert res["other_world"] is None, res["other_world"]
        assert "saved with reduction=" in res["other_reduction"]
        assert "own state" in res["wrong_rank"] and "rank-independent" in res["wrong_rank"]


# --------------------------------------------------------------------------- #
# Habits, on 2 ranks
# --------------------------------------------------------------------------- #

@pytest.fixture(scope="module")
def misuse(tmp_path_factory):
    return run("misuse", 2, tmp_path_factory.mktemp("misuse"))


def test_a_model_also_wrapped_in_ddp_is_refused(misuse):
    for res in misuse:
        assert "the model is wrapped in DistributedDataParallel, which reduces gradients itself" \
            in res["ddp_wrapped"]
        assert "already has a post-hook on its gradient accumulator that gradaccum did not add" \
            in res["ddp_alive"] and "Delete the DDP wrapper" in res["ddp_alive"]


def test_zero_grad_inside_the_window_is_an_error_on_every_rank(misuse):
    for res in misuse:
        assert [i for i, _ in res["zero_grad"]] == [5]  # the window's close, on both ranks
    assert "window 1 was dropped on every rank: on rank 1 the accumulated gradients were " \
           "cleared or changed outside the Accumulator" in misuse[0]["zero_grad"][0][1]
    assert "window 1 was dropped on every rank: on this rank (rank 1) the accumulated gradients were " \
           "cleared" in misuse[1]["zero_grad"][0][1]
    assert "cleared or changed outside the Accumulator in the middle of the window " \
           "(optimizer.zero_grad()" in misuse[1]["zero_grad"][0][1]
    for a, b in zip(misuse[0]["zero_grad_params"], misuse[1]["zero_grad_params"]):
        assert torch.equal(a, b)


def test_process_group_false_is_local_only(misuse):
    for res in misuse:
        assert res["local_only"]["stats"]["collectives"] == 0
    assert not torch.equal(misuse[0]["local_only"]["grad"], misuse[1]["local_only"]["grad"])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_bucket_views_keep_none_for_parameters_unused_everywhere(misuse, opt_name):
    for res in misuse:
        for as_view in (False, True):
            assert all(res[f"idle_grad_none/{as_view}/{opt_name}/{w}"] for w in range(3))
            assert res[f"idle_moved/{as_view}/{opt_name}"] == 0.0
        for a, b in zip(res[f"used/True/{opt_name}"], res[f"used/False/{opt_name}"]):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_a_gradient_a_custom_function_leaves_none_stays_none_with_bucket_views(misuse):
    for res in misuse:
        for as_view in (False, True):
            assert res[f"none_from_function/{as_view}"] == ([True, True], 2.0)
    # ...and one it writes into .grad itself is reduced as any other
    expected = torch.zeros(1, dtype=torch.float64)
    torch.manual_seed(4)
    used = nn.Linear(du.D_IN, 3).double()
    x = misuse[0]["x"]
    for rank in range(2):
        for k in range(2):
            out = used(x + k + rank)
            expected += (2 * out * out * 2.0 / out.numel()).sum().detach() / 4  # d/dw mean((o w)^2) at w=2
    for res in misuse:
        for as_view in (False, True):
            assert torch.allclose(res[f"written_by_function/{as_view}"], expected, rtol=1e-12, atol=0)


def test_an_accumulator_built_and_refreshed_inside_inference_mode_trains_as_outside(misuse):
    for res in misuse:
        du.assert_params_close(res["inference_built/True"], res["inference_built/False"], "inference", tol=0)


# --------------------------------------------------------------------------- #
# Habits, in one process
# --------------------------------------------------------------------------- #

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def test_a_second_accumulator_over_the_same_parameters_is_refused_until_close():
    model = mlp()
    first = gradaccum.Accumulator(model, None, steps=2)
    with pytest.raises(ValueError, match=r"0\.weight already belongs to another live Accumulator.*"
                                         r"call its close\(\)"):
        gradaccum.Accumulator(model, None, steps=2)
    first.close()
    assert first.closed
    with pytest.raises(RuntimeError, match=r"backward\(\): this Accumulator was closed"):
        first.backward(model(torch.ones(1, 4, dtype=torch.float64)).sum())
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.no_sync\(\): this Accumulator was closed$"):
        with first.no_sync():
            pass
    for state in ({}, {"steps": 2}):  # (review: it said "the state dict has no key 'reducer'")
        with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.load_state_dict\(\): this Accumulator was closed$"):
            first.load_state_dict(state)
    other = gradaccum.Accumulator(mlp(), None, steps=2)
    with other.no_sync():
        other.close()  # closed inside: leaving the block restores nothing, and raises nothing
    assert other.closed
    with gradaccum.Accumulator(model, None, steps=2) as second:
        second.backward(model(torch.ones(1, 4, dtype=torch.float64)).sum())
    assert second.closed
    gradaccum.Accumulator(model, None, steps=2).close()  # released again


def test_optimizer_zero_grad_inside_the_window_is_an_error_naming_it():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=3)
    x = torch.ones(2, 4, dtype=torch.float64)
    acc.backward(model(x).sum())
    opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"gradient of 0\.weight was cleared outside the "
                                           r"Accumulator in the middle of a window .*zero_grad"):
        acc.backward(model(x).sum())
    assert acc.micro_step == 1  # rejected: nothing changed
    acc.zero_grad()
    acc.backward(model(x).sum())  # dropping the window is the way on


class _SharedHooks:
    """An optimizer wrapper as Lightning's LightningOptimizer (what manual
    optimization's self.optimizers() returns): the wrapped optimizer's
    attributes, its hooks included, and its class as a base."""

    def __init__(self, optimizer):
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k != "step"}
        self.__class__ = type("Shared" + type(optimizer).__name__, (_SharedHooks, type(optimizer)), {})
        self._wrapped = optimizer

    def step(self, closure=None):
        return self._wrapped.step(closure)


@pytest.mark.parametrize("how", ["optimizer", "scheduler", "scaler", "wrapper"])
def test_the_scripts_own_optimizer_step_inside_a_window_is_refused(how):
    """Review: a migration's leftover optimizer.step() after every
    acc.backward() (or scaler.step(optimizer) at the window's end) stepped
    partial sums, each rank its own (the replicas drifted apart), or the
    window twice, with nothing said. It is refused, stepping nothing, also
    through an LR scheduler's wrapper of step() and GradScaler.step(); at a
    window boundary (the manual path's step) and after close() it passes,
    and acc.step() steps the window as before, also through a wrapper that
    shares its optimizer's hooks (review: acc.step()'s own step was refused
    there)."""
    model = mlp()
    ref = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "wrapper":
        opt = _SharedHooks(opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    if how == "scheduler":
        torch.optim.lr_scheduler.StepLR(opt, 1)  # (wraps opt.step)
    acc = gradaccum.Accumulator(model, opt, steps=2)
    ref_acc = gradaccum.Accumulator(ref, ref_opt, steps=2)
    scaler = torch.amp.GradScaler("cpu")
    own_step = (lambda: scaler.step(opt)) if how == "scaler" else opt.step
    x = torch.ones(2, 4, dtype=torch.float64)
    head = "gradaccum: optimizer.step(): called outside acc.step() in the middle of an Accumulator's window ("
    tail = ("). acc.step() steps the optimizer itself, once per window, with the window's reduced gradient: remove "
            "the script's optimizer.step() (and scaler.step(optimizer): pass the scaler as grad_scaler=), or take "
            "the manual path (acc.no_sync() and a plain loss.backward(), stepping the optimizer yourself). Nothing "
            "was stepped")
    before = [p.detach().clone() for p in model.parameters()]
    for k, where in enumerate(["after 1 of its 2 micro-steps: a step on a partial sum, each rank its own",
                               "its window closed, not yet stepped: a second step of it"]):
        loss = model(x).pow(2).sum()
        acc.backward(scaler.scale(loss) if how == "scaler" else loss)  # (the AMP habit: scaled by hand)
        ref_acc.backward(ref(x).pow(2).sum())
        if how == "scaler" and k == 0:
            continue  # (GradScaler.step() unscales first: once per update())
        with pytest.raises(RuntimeError) as error:
            own_step()
        assert str(error.value) == head + where + tail
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if how == "scaler":
        return  # (the scaler unscaled the window: acc.step() with grad_scaler= is the way)
    assert acc.step() and ref_acc.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    opt.step()  # a boundary: nothing accumulated (the manual path steps here)
    acc.close()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert not torch.equal(model[0].weight, ref[0].weight)
    ref_acc.close()


ZERO_GRAD_LOOP = """
import json, warnings, torch, gradaccum
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).double()
acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
x = torch.ones(2, 4, dtype=torch.float64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    acc.zero_grad()  # at a boundary: nothing dropped, no warning
    for _ in range(4):
        acc.zero_grad()  # a plain loop's optimizer.zero_grad(), carried over
        acc.backward(model(x).sum())
        acc.step()
print(json.dumps([acc.stats()["optimizer_steps"], [str(w.message) for w in caught]]))
"""


def test_zero_grad_in_a_plain_loops_place_warns_once():
    """Review: acc.zero_grad() where the loop had optimizer.zero_grad()
    dropped every window's micro-steps but the last: in one process nothing
    ever stepped, with nothing said. It warns (once: a C++ warning, one per
    process, so in its own process here)."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", ZERO_GRAD_LOOP], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    steps, caught = json.loads(out.stdout)
    assert steps == 0 and caught == [
        "gradaccum: acc.zero_grad(): dropped the 1 micro-step(s) this window had accumulated. "
        "acc.zero_grad() drops the window (after a failed micro-step, say); it is not optimizer.zero_grad(): "
        "acc.step() clears the gradients itself after each window, so a training loop needs no zero_grad() (one "
        "before every acc.backward() leaves each window its last micro-batch). Warned once"], caught


def test_clipping_a_closed_window_in_place_is_allowed():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=1)
    acc.backward(model(torch.ones(2, 4, dtype=torch.float64)).sum())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert acc.step()


def test_a_parameter_unfrozen_after_construction_is_an_error_naming_it():
    model = mlp()
    model[0].weight.requires_grad_(False)
    acc = gradaccum.Accumulator(model, None, steps=2)
    model[0].weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"0\.weight was frozen .* when the Accumulator was built "
                                           r"and now requires grad"):
        acc.backward(model(torch.ones(1, 4, dtype=torch.float64)).sum())


def test_sparse_embeddings_are_refused_at_construction():
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    with pytest.raises(ValueError, match=r"submodule '0' is Embedding\(sparse=True\).*use sparse=False"):
        gradaccum.Accumulator(model, None, steps=2)
    with pytest.raises(ValueError, match=r"Accumulator\(\): the model is Embedding\(sparse=True\)"):  # (was: '')
        gradaccum.Accumulator(nn.Embedding(10, 3, sparse=True), None, steps=2)


def test_a_sparse_gradient_met_later_is_a_clear_error():
    """Bare parameters used through F.embedding(sparse=True): the micro-steps
    accept the sparse .grad (torch sums it), the step names the parameter."""
    weight = nn.Parameter(torch.randn(10, 3))
    acc = gradaccum.Accumulator([weight], torch.optim.SGD([weight], lr=0.1), steps=2)
    for _ in range(2):
        acc.backward(nn.functional.embedding(torch.tensor([1, 2]), weight, sparse=True).sum())
    with pytest.raises(RuntimeError, match="parameter 0 has a sparse gradient"):
        acc.step()


def test_grad_data_assignment_on_bucket_views_leaves_the_bucket_intact(tmp_path):
    """`.grad.data = t` at a closed window with gradient_as_bucket_view: the
    bucket's own view stays put (.grad is an alias of it), so later windows
    still reduce what backward accumulated, on every rank alike."""
    results = run("view_data_assign", 2, tmp_path)
    for res in results:
        for got, want in zip(res["grads"], res["expected"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(results[0]["grads"], results[1]["grads"]):
        assert torch.equal(a, b)


def test_meta_parameters_are_refused():
    with pytest.raises(ValueError, match=r"weight is on the meta device"):
        gradaccum.Accumulator(nn.Linear(3, 2, device="meta"), None, steps=2)


def test_bools_are_not_counts():
    model = mlp()
    acc = gradaccum.Accumulator(model, None, steps=2, reduction="items")
    with pytest.raises(TypeError, match="num_items must be a count of items, got True"):
        acc.backward(model(torch.ones(1, 4, dtype=torch.float64)).sum(), num_items=True)
    state = acc.state_dict()
    with pytest.raises(ValueError, match="key 'micro_step' has the wrong type"):
        acc.load_state_dict(dict(state, micro_step=True))
    with pytest.raises(ValueError, match="window_weight=3 with micro_step=0"):
        acc.load_state_dict(dict(state, window_weight=3.0))


def test_accumulator_backward_inside_its_own_no_sync_is_an_error_where_it_closes_the_window():
    """Note [The closing micro-step inside no_sync()]: before the closing
    micro-step it runs as outside (no collective either way)."""
    model = mlp()
    acc = gradaccum.Accumulator(model, None, steps=2)
    with acc.no_sync():
        acc.backward(model(torch.ones(1, 4, dtype=torch.float64)).sum())
        with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.backward\(\): called inside acc\.no_sync\(\) at "
                           r"the window's closing micro-step"):
            acc.backward(model(torch.ones(1, 4, dtype=torch.float64)).sum())
    assert acc.micro_step == 1


# --------------------------------------------------------------------------- #
# Regressions found by review
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("view", [False, True], ids=["copies", "bucket_views"])
@pytest.mark.parametrize("save_after", [2, 4])
def test_resume_with_a_parameter_unused_after_the_checkpoint(tmp_path, view, save_after):
    results = run("view_resume", 2, tmp_path, view=view, ckpt_dir=str(tmp_path), save_after=save_after)
    for res in results:
        assert max(res["diff"].values()) <= 1e-12, res["diff"]


def test_resume_between_the_last_backward_and_step_keeps_none(tmp_path):
    results = run("ready_resume", 2, tmp_path, ckpt_dir=str(tmp_path))
    for res in results:
        assert res["grad_is_None_after_load"] == res["grad_is_None_before_save"]
        assert res["grad_is_None_after_load"]["c.weight"]
        assert max(res["diff"].values()) <= 1e-12, res["diff"]


def test_a_failed_checkpoint_snapshot_drops_only_that_window(tmp_path):
    results = run("failed_snapshot", 2, tmp_path)
    for rank, log in enumerate(results):
        errors = [entry for entry in log if entry[1] not in ("ok",) and entry[0] not in ("after", "stats")]
        tags = [e[0] for e in errors]
        assert tags == (["b1-fail", "state_dict"] if rank == 1 else ["state_dict"]), log
        stats = [e for e in log if e[0] == "stats"][0]
        assert stats[1] == 1  # one dropped window, not two


def test_bucket_views_keep_channels_last_strides(tmp_path):
    """A channels_last convolution's gradient is a view of its bucket with the
    parameter's own strides: no layout warning, no extra copy, same result."""
    results = du.run_job("channels_last", 1, tmp_path, module=M)
    (res,) = results
    assert res["strides_match"] and res["is_view"]
    assert not res["layout_warnings"], res["layout_warnings"]
    assert torch.allclose(res["grad_view"], res["grad_copy"], rtol=1e-12, atol=1e-14)
