"""state_dict()/load_state_dict() in one process, against the uninterrupted
run and the big batch."""
import copy
import io

import pytest
import torch

import gradaccum
from _local_reference import (
    make_model, make_optimizer, make_data, micro_loss, reference_loss, params_of, grads_of,
    assert_all_close, assert_all_equal, train_reference)


# state_dict round trip -----------------------------------------------------------


@pytest.mark.parametrize("save_at", ["mid_window", "window_ready", "boundary"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "items"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_state_dict_round_trip(opt_name, reduction, save_at):
    K, windows = 4, 4
    x, y = make_data(windows * K * 2)
    batches = gradaccum.split((x, y), windows * K)
    save_i = {"mid_window": 2 * K + 1, "window_ready": 2 * K + K - 1, "boundary": 2 * K - 1}[save_at]

    def build(seed):
        model = make_model(seed=seed)
        opt = make_optimizer(opt_name, model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        acc = gradaccum.Accumulator(model, opt, steps=K, reduction=reduction, scheduler=sched)
        return model, opt, sched, acc

    def micro(model, acc, i):
        loss, n = micro_loss(model, *batches[i], reduction)
        acc.backward(loss, num_items=n)

    # Run A: uninterrupted, snapshotting everything at save_i.
    model_a, opt_a, sched_a, acc_a = build(0)
    snapshot = None
    for i in range(len(batches)):
        micro(model_a, acc_a, i)
        if i == save_i and save_at == "window_ready":
            snapshot = acc_a.state_dict()
            saved = (copy.deepcopy(model_a.state_dict()), copy.deepcopy(opt_a.state_dict()),
                     copy.deepcopy(sched_a.state_dict()))
        acc_a.step()
        if i == save_i and save_at != "window_ready":
            snapshot = acc_a.state_dict()
            saved = (copy.deepcopy(model_a.state_dict()), copy.deepcopy(opt_a.state_dict()),
                     copy.deepcopy(sched_a.state_dict()))
        if i == save_i:
            frozen_grads = [None if g is None else g.clone() for g in snapshot["grads"]]
    acc_a.flush()

    expected_micro = {"mid_window": 2, "window_ready": 0, "boundary": 0}[save_at]
    assert snapshot["steps"] == K
    assert snapshot["micro_step"] == expected_micro
    assert snapshot["window_ready"] is (save_at == "window_ready")
    assert len(snapshot["grads"]) == len(list(model_a.parameters()))
    if save_at == "boundary":
        assert all(g is None for g in snapshot["grads"])
    else:
        assert all(isinstance(g, torch.Tensor) for g in snapshot["grads"])
    # A snapshot: the later micro-steps of run A did not change it.
    assert_all_equal(snapshot["grads"], frozen_grads)

    # Run B: fresh objects, everything loaded (the accumulator state via torch.save).
    buf = io.BytesIO()
    torch.save(snapshot, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    model_b, opt_b, sched_b, acc_b = build(123)
    model_b.load_state_dict(saved[0])
    opt_b.load_state_dict(saved[1])
    sched_b.load_state_dict(saved[2])
    loaded_copy = [None if g is None else g.clone() for g in loaded["grads"]]
    acc_b.load_state_dict(loaded)
    assert acc_b.micro_step == expected_micro
    assert acc_b.window_ready is (save_at == "window_ready")
    assert acc_b.state_dict()["micro_steps"] == save_i + 1
    if save_at == "window_ready":
        assert acc_b.step() is True
    for i in range(save_i + 1, len(batches)):
        micro(model_b, acc_b, i)
        acc_b.step()
    acc_b.flush()

    assert_all_equal(params_of(model_b), params_of(model_a))
    assert_all_equal(loaded["grads"], loaded_copy)  # loading copied, did not alias
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"]
    stats_a, stats_b = acc_a.stats(), acc_b.stats()
    for key in ("micro_steps", "optimizer_steps", "skipped_steps", "windows"):
        assert stats_a[key] == stats_b[key]
    assert stats_a["optimizer_steps"] == windows

    # And both equal the big-batch reference.
    ref = make_model()
    ref_opt = make_optimizer(opt_name, ref.parameters())
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    train_reference(ref, ref_opt, x, y, windows, K, reduction, scheduler=ref_sched)
    assert_all_close(params_of(model_a), params_of(ref), rtol=1e-10, atol=1e-12)


def test_load_state_dict_replaces_current_window():
    """Loading a state into an Accumulator that holds other gradients replaces
    them: the window continues from the saved gradients only."""
    K = 3
    x, y = make_data(6)
    micro = gradaccum.split((x, y), K)
    model = make_model()
    acc = gradaccum.Accumulator(model, None, steps=K)
    acc.backward(micro_loss(model, *micro[0], "mean")[0])
    state = acc.state_dict()
    acc.backward(micro_loss(model, *micro[1], "mean")[0])  # to be discarded
    acc.load_state_dict(state)
    assert acc.micro_step == 1
    acc.backward(micro_loss(model, *micro[1], "mean")[0])
    acc.backward(micro_loss(model, *micro[2], "mean")[0])
    ref = make_model()
    reference_loss(ref, x, y, "mean", 2).backward()
    assert_all_close(grads_of(model), grads_of(ref), rtol=1e-12, atol=1e-14)


class _TwoLayers(torch.nn.Module):
    """Two layers of one shape, one of them trained."""

    def __init__(self, trained):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 4).double()
        self.b = torch.nn.Linear(4, 4).double()
        (self.b if trained == "a" else self.a).requires_grad_(False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_a_held_gradient_loads_only_onto_the_parameters_that_saved_it():
    """Note [A held gradient belongs to a named parameter]: a half-done window
    of layer a is refused by an Accumulator training layer b, of the same
    shapes, leaving its own window as it was (before, b took a's gradient and
    the window stepped it); a boundary state loads onto either; a state saved
    before the names were kept, or loaded into bare parameters, loads by
    position; a compiled model's names (``_orig_mod.``) match the plain
    model's."""
    x = torch.randn(8, 4, dtype=torch.float64)
    saving = _TwoLayers("a")
    acc = gradaccum.Accumulator(saving, None, steps=2)
    boundary = acc.state_dict()
    acc.backward(saving(x).pow(2).mean())
    mid = acc.state_dict()
    assert mid["parameter_names"] == ["a.weight", "a.bias"]
    acc.close()

    other = _TwoLayers("b")
    resumed = gradaccum.Accumulator(other, None, steps=2)
    resumed.backward(other(x).pow(2).mean())
    before = [other.b.weight.grad.clone(), other.b.bias.grad.clone()]
    with pytest.raises(ValueError) as refused:
        resumed.load_state_dict(mid)
    assert str(refused.value) == (
        "gradaccum: acc.load_state_dict(): the state holds the gradients of a window in progress for other trainable "
        "parameters than this Accumulator's (trained when saved, not here: 'a.weight', 'a.bias'; trained here, not "
        "when saved: 'b.weight', 'b.bias' (or renamed: the model wrapped in another module?)), so they would land on the wrong parameters. Resume with the trainable parameters that saved "
        "it (the same requires_grad settings), or save at a window boundary (after acc.step() returned True), which "
        "holds no gradient and resumes on any set")
    assert resumed.micro_step == 1
    assert torch.equal(other.b.weight.grad, before[0]) and torch.equal(other.b.bias.grad, before[1])
    resumed.load_state_dict(boundary)
    assert resumed.micro_step == 0
    legacy = {k: v for k, v in mid.items() if k != "parameter_names"}
    resumed.load_state_dict(legacy)  # by position, as before
    assert resumed.micro_step == 1 and torch.equal(other.b.weight.grad, mid["grads"][0])
    resumed.close()
    fresh = _TwoLayers("b")
    bare = gradaccum.Accumulator([fresh.b.weight, fresh.b.bias], None, steps=2)  # named by position only
    bare.load_state_dict(mid)
    assert bare.micro_step == 1 and torch.equal(fresh.b.weight.grad, mid["grads"][0])
    bare.close()

    plain = _TwoLayers("a")
    compiled = gradaccum.Accumulator(torch.compile(plain), None, steps=2)  # (never run: only its names)
    assert compiled.parameter_names == ["_orig_mod.a.weight", "_orig_mod.a.bias"]
    compiled.load_state_dict(mid)
    assert compiled.micro_step == 1 and torch.equal(plain.a.weight.grad, mid["grads"][0])


def _resumed(build, model, opt, acc):
    """A fresh model, optimizer and Accumulator from build(), loaded with
    what `model`, `opt` and `acc` hold now (through torch.save)."""
    buf = io.BytesIO()
    torch.save({"m": model.state_dict(), "o": opt.state_dict(), "a": acc.state_dict()}, buf)
    acc.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, opt, acc = build()
    model.load_state_dict(saved["m"])
    opt.load_state_dict(saved["o"])
    acc.load_state_dict(saved["a"])
    return model, opt, acc


def test_a_closed_window_resumes_as_it_would_have_stepped():
    """A closed window saved before its step() steps after the resume as it
    would have: one with no item on any rank is skipped (before, it was
    stepped, with Adam's momentum); one whose optimizer step failed after the
    loss scaler unscaled it is stepped as it is (before, unscaled a second
    time); and skipped_micro_batches carries over. Each against the same run
    uninterrupted."""
    x = torch.randn(4, 3, dtype=torch.float64)

    def adam():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1).double()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        return model, opt, gradaccum.Accumulator(model, opt, steps=2, reduction="items")

    outcomes = []
    for resume in (False, True):
        model, opt, acc = adam()
        for items in (4, 4, 0, 0):  # a window, then one with no item anywhere
            mask = torch.full((4,), float(items > 0), dtype=torch.float64)
            acc.backward((model(x).squeeze(1) ** 2 * mask).sum(), num_items=items)
            if acc.window_ready and acc.stats()["optimizer_steps"] == 0:
                assert acc.step() is True  # Adam has momentum now
        if resume:
            model, opt, acc = _resumed(adam, model, opt, acc)
        assert acc.window_ready
        stats = acc.stats()
        outcomes.append((acc.step(), acc.stats()["skipped_steps"] - stats["skipped_steps"],
                         acc.stats()["optimizer_steps"], params_of(model)))
        acc.close()
    assert outcomes[0][:3] == outcomes[1][:3] == (False, 1, 1)
    assert_all_equal(outcomes[1][3], outcomes[0][3])

    class Flaky(torch.optim.SGD):
        fail, seen = True, []

        def step(self, closure=None):
            Flaky.seen.append([p.grad.clone() for p in self.param_groups[0]["params"]])
            if Flaky.fail:
                Flaky.fail = False
                raise RuntimeError("a transient failure")
            return super().step(closure)

    def scaled():
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        opt = Flaky(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        return model, opt, gradaccum.Accumulator(model, opt, steps=2, grad_scaler=scaler)

    stepped = []
    for resume in (False, True):
        Flaky.fail, Flaky.seen = True, []
        model, opt, acc = scaled()
        for _ in range(2):
            acc.backward((model(x.float()) ** 2).mean())
        with pytest.raises(RuntimeError, match="a transient failure"):
            acc.step()
        assert acc.window_ready  # unscaled and still closed: a retry steps it
        if resume:
            model, opt, acc = _resumed(scaled, model, opt, acc)
        assert acc.step() is True
        stepped.append((Flaky.seen[-1], params_of(model)))
        acc.close()
    assert_all_equal(stepped[1][0], stepped[0][0])  # the optimizer saw the same gradient
    assert_all_equal(stepped[1][1], stepped[0][1])

    model = torch.nn.Linear(3, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2,
                                nonfinite="skip_micro_batch")
    acc.backward(model(x.float()).sum() * float("nan"))
    acc.backward(model(x.float()).sum())
    assert acc.step() is True
    state = acc.state_dict()
    acc.close()
    again = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2,
                                  nonfinite="skip_micro_batch")
    again.load_state_dict(state)
    assert again.stats()["skipped_micro_batches"] == 1


def test_state_dict_refuses_gradients_no_micro_step_counted():
    """At a window boundary, gradients a plain loss.backward() wrote (the
    manual path before its optimizer step) would be saved as a boundary
    without them: state_dict() refuses, as step() does, and changes nothing.
    Gradients zeroed in place count as written (marks, not values: the same
    decision on every rank); cleared to None they are no gradient."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2)
    x, y = make_data(4)
    with acc.no_sync():
        micro_loss(model, x, y, "mean")[0].backward()
    before = grads_of(model)
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.state_dict\(\): gradients were written since the "
                       r"last window, but no micro-step was counted: .* A checkpoint now would save a window "
                       r"boundary without them\."):
        acc.state_dict()
    assert_all_equal(grads_of(model), before)
    opt.step()
    opt.zero_grad(set_to_none=False)  # zeros, written in place
    with pytest.raises(RuntimeError, match=r"optimizer\.zero_grad\(set_to_none=False\): clear them to None"):
        acc.state_dict()
    opt.zero_grad()  # to None
    state = acc.state_dict()
    assert state["micro_step"] == 0 and all(g is None for g in state["grads"])


def test_a_load_clears_the_last_windows_figures_and_keeps_the_counters():
    """docs/stats.md: a load carries the counters on from the state, and the
    last window's figures start again (review: a load into an Accumulator
    that had trained kept its own last_grad_norm, from before the load)."""
    model = make_model(seed=0)
    opt = make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=2, max_grad_norm=1e9)
    x, y = make_data(8)
    saved = acc.state_dict()
    for xb, yb in gradaccum.split((x, y), 4):
        acc.backward(micro_loss(model, xb, yb, "mean")[0])
        acc.step()
    assert acc.stats()["last_grad_norm"] > 0 and acc.window_loss is not None
    acc.load_state_dict(saved)
    stats = acc.stats()
    assert (stats["last_grad_norm"], acc.window_loss, acc.window_items) == (None, None, 0)
    assert (stats["micro_steps"], stats["optimizer_steps"], stats["windows"]) == (0, 0, 0)
    acc.close()
