"""grad_scaler's guards: what GradScaler cannot handle is refused at
construction, a state in the other scaling's units is refused at load, a
rejected load changes nothing, and a resumed window steps before any backward()."""
import copy
import re

import pytest
import torch
import torch.nn as nn

import gradaccum
from _grad_checks import assert_grads_equal, snapshot_grads

K = 4


def make_data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def loss_of(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()


def make(scaler=True, steps=K, init_scale=2.0 ** 8, growth_interval=1, momentum=0.9, **kwargs):
    """A model, its optimizer and an Accumulator (with a CPU GradScaler or not)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    sc = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval) \
        if scaler else None
    return model, opt, gradaccum.Accumulator(model, opt, steps=steps, grad_scaler=sc, **kwargs)


# 0. What a scaler's settings may be ---------------------------------------------

class _ScalerLike:
    """A GradScaler-like object without GradScaler's getters (its settings
    read 0, Note in _checks._scaler_rule)."""

    def __init__(self):
        self._g = torch.amp.GradScaler("cpu")

    def __getattr__(self, name):
        if name.startswith("get_"):
            raise AttributeError(name)
        return getattr(self._g, name)


@pytest.mark.parametrize("scaler", [
    lambda: torch.amp.GradScaler("cpu", backoff_factor=0.0, growth_interval=0),  # torch accepts these
    _ScalerLike,
])
def test_any_scaler_torch_accepts_is_accepted(scaler):
    torch.manual_seed(1)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    acc = gradaccum.Accumulator(model, opt, steps=2, grad_scaler=scaler())
    for batch in make_data(2):
        acc.backward(loss_of(model, batch))
    assert acc.step()
    acc.close()


def test_a_scaler_whose_scale_is_nan_is_refused():
    """Its settings are compared across ranks: a NaN would compare unequal on
    every rank ("the ranks disagree")."""
    scaler = torch.amp.GradScaler("cpu")
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._scale.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"^gradaccum: Accumulator\(\): grad_scaler's scale is nan: it must be a "
                                         r"finite number > 0 \(GradScaler\(init_scale=\.\.\.\)\), or no window could "
                                         r"ever step$"):
        model = nn.Linear(4, 1)
        gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, grad_scaler=scaler)


@pytest.mark.parametrize("init_scale", [0.0, -4.0, float("inf")])
def test_a_grad_scaler_whose_scale_could_never_step_is_refused(init_scale):
    """torch accepts these; with them every window was skipped, silently
    (review)."""
    model = nn.Linear(4, 1)
    with pytest.raises(ValueError, match=re.escape(
            f"gradaccum: Accumulator(): grad_scaler's scale is {init_scale:g}: it must be a finite number > 0 "
            "(GradScaler(init_scale=...)), or no window could ever step")):
        gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2,
                              grad_scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def _failing_unscale(acc, sc, how):
    """Makes the window's unscale raise: a gradient hook (Lightning's
    on_before_optimizer_step) raising after GradScaler.unscale_(), or the
    script's own scaler.unscale_() (torch's AMP recipe) before it."""
    if how == "hook":
        def hook():
            acc._set_gradient_hook(None)
            raise RuntimeError("a logger's hiccup")
        acc._set_gradient_hook(hook)
        return "^a logger's hiccup$"
    sc.unscale_(acc.optimizer)
    return re.escape("gradaccum: acc.step(): the grad_scaler's unscale_() was already called for this optimizer "
                     "since its last update() (scaler.unscale_(optimizer) in the script?), and the Accumulator "
                     "unscales each closed window itself, once, in acc.step() (or flush()/join()): leave unscale_() "
                     "to it, and clip with max_grad_norm= (which clips the unscaled gradient)")


@pytest.mark.parametrize("how", ["hook", "script_unscales"])
def test_a_window_whose_unscale_raised_is_not_stepped_by_a_retry(how):
    """Review: a retry of acc.step() after the unscale itself raised unscaled
    the gradient again (it stepped at 1/256 of its value) and updated the
    scale twice in one window. The retry is refused, the scale updated once;
    acc.zero_grad() drops the window and the next one steps exactly as a run
    without that window (its scale one growth further)."""
    data = make_data(2 * K)
    model, opt, acc = make(momentum=0.0)
    ref_model, ref_opt, ref_acc = make(momentum=0.0, init_scale=2.0 ** 9)
    sc = acc.grad_scaler
    for batch in data[:K]:
        acc.backward(loss_of(model, batch))
    expected = _failing_unscale(acc, sc, how)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=expected):
        acc.step()
    assert sc.get_scale() == 2.0 ** 9  # updated once, for the failed window
    for call in (acc.step, acc.state_dict):
        with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.(step|state_dict)\(\): the loss scaler's "
                                               r"unscale of this (closed )?window raised"):
            call()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    acc.zero_grad()
    for m, a in ((model, acc), (ref_model, ref_acc)):
        for batch in data[K:]:
            a.backward(loss_of(m, batch))
        assert a.step()
    assert sc.get_scale() == ref_acc.grad_scaler.get_scale() == 2.0 ** 10
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    acc.close()
    ref_acc.close()


def test_the_scripts_own_unscale_is_named_with_the_call_that_met_it():
    """Review: the refusal named no call; a flush() meets it too."""
    data = make_data(K - 1)
    model, opt, acc = make(momentum=0.0)
    for batch in data:
        acc.backward(loss_of(model, batch))
    acc.grad_scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.flush\(\): the grad_scaler's unscale_\(\) was already "
                                           r"called for this optimizer"):
        acc.flush()
    acc.close()


def test_a_scaler_update_that_raised_is_named_not_blamed_on_the_script():
    """Review: GradScaler.update() raising after the window stepped left the
    scaler mid-window; the next window's step blamed the script's own
    unscale_(). The update's failure is now said at once (the window did
    step, as a run without the failure), and the next window's refusal says
    what happened."""
    data = make_data(2 * K)
    model, opt, acc = make(momentum=0.0)
    ref_model, ref_opt, ref_acc = make(momentum=0.0)
    sc, update = acc.grad_scaler, acc.grad_scaler.update

    def once():
        sc.update = update
        raise RuntimeError("a scale store's hiccup")
    sc.update = once
    for m, a in ((model, acc), (ref_model, ref_acc)):
        for batch in data[:K]:
            a.backward(loss_of(m, batch))
    assert ref_acc.step()
    with pytest.raises(RuntimeError, match=re.escape(
            "gradaccum: acc.step(): the grad_scaler's update() raised after the window stepped (its optimizer step "
            "ran): RuntimeError: a scale store's hiccup. The scaler is left mid-window and its scale may now differ "
            "between ranks: end training here and resume from a checkpoint")):
        acc.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    for batch in data[K:]:
        acc.backward(loss_of(model, batch))
    with pytest.raises(RuntimeError, match=re.escape(
            "gradaccum: acc.step(): the grad_scaler's update() raised after an earlier window stepped (RuntimeError: a "
            "scale store's hiccup), leaving the scaler mid-window on this rank")):
        acc.step()
    acc.close()
    ref_acc.close()


# 1. An optimizer over part of the trainable parameters --------------------------


def test_grad_scaler_refuses_an_optimizer_over_part_of_the_trainable_parameters():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)  # the head only, the body trainable
    loss_of(model, make_data(1)[0]).backward()
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match=r"^gradaccum: Accumulator\(\): grad_scaler: parameter '0\.weight' requires grad but is "
                       r"not in the optimizer's param_groups\..*Freeze it \(requires_grad=False\) "
                       r"before building the Accumulator, or give the optimizer every trainable "
                       r"parameter \(optimizer\.add_param_group\)$"):
        gradaccum.Accumulator(model, opt, steps=K, grad_scaler=torch.amp.GradScaler("cpu"))
    assert_grads_equal(model, grads)
    # An iterable of parameters names it by position.
    with pytest.raises(ValueError, match=r"^gradaccum: Accumulator\(\): grad_scaler: parameter 1 requires grad but is not in "
                       r"the optimizer's param_groups"):
        gradaccum.Accumulator([model[1].weight, model[0].bias], opt, steps=K,
                              grad_scaler=torch.amp.GradScaler("cpu"))
    assert_grads_equal(model, grads)
    # Nothing was claimed: an Accumulator over the same model builds.
    model.zero_grad(set_to_none=True)
    gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=K,
                          grad_scaler=torch.amp.GradScaler("cpu")).close()


def test_grad_scaler_with_a_frozen_body_clips_as_without_one():
    """The remedy: freeze what the optimizer does not hold. In fp32 a power-of-two
    scale changes nothing, clipping included."""
    data = make_data(3 * K)

    def train(scaler):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        model[0].requires_grad_(False)
        opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
        sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if scaler else None
        acc = gradaccum.Accumulator(model, opt, steps=K, grad_scaler=sc, max_grad_norm=0.5)
        for batch in data:
            acc.backward(loss_of(model, batch))
            acc.step()
        assert acc.stats()["optimizer_steps"] == 3
        return model, acc.stats()["last_grad_norm"]

    (plain, plain_norm), (scaled, scaled_norm) = train(False), train(True)
    assert scaled_norm == pytest.approx(plain_norm, rel=1e-6)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# 5. float16 parameters -------------------------------------------------------------


@pytest.mark.parametrize("accumulate_dtype", [None, torch.float32])
def test_grad_scaler_refuses_float16_parameters(accumulate_dtype):
    torch.manual_seed(1)
    model = nn.Linear(4, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^gradaccum: Accumulator\(\): grad_scaler: parameter 'weight' is float16; GradScaler "
                       r"cannot unscale float16 gradients .*Keep the parameters float32 and run the "
                       r"forward under torch\.autocast\(device_type, dtype=torch\.float16\)"):
        gradaccum.Accumulator(model, opt, steps=2, grad_scaler=torch.amp.GradScaler("cpu"),
                              accumulate_dtype=accumulate_dtype)
    assert all(p.grad is None for p in model.parameters())
    # A frozen float16 parameter has no gradient to unscale: accepted.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].half().requires_grad_(False)
    gradaccum.Accumulator(model, torch.optim.SGD(model[1].parameters(), lr=0.1), steps=2,
                          grad_scaler=torch.amp.GradScaler("cpu")).close()


def test_disabled_grad_scaler_trains_as_no_grad_scaler():
    """GradScaler(enabled=False) (the enabled=use_amp switch) scales nothing:
    the same training as without one (it used to fail at the first step())."""
    data = make_data(2 * K + 1)

    def train(scaler):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sc = torch.amp.GradScaler("cpu", enabled=False) if scaler else None
        acc = gradaccum.Accumulator(model, opt, steps=K, grad_scaler=sc, max_grad_norm=1.0)
        for batch in data:
            acc.backward(loss_of(model, batch))
            acc.step()
        acc.flush()
        assert acc.stats()["optimizer_steps"] == 3
        return model

    for a, b in zip(train(False).parameters(), train(True).parameters()):
        assert torch.equal(a, b)


# 2. A state saved with the other scaling ------------------------------------------


def half_done_state(scaler, micro_steps, seed=0):
    model, opt, acc = make(scaler)
    for batch in make_data(micro_steps, seed=seed):
        acc.backward(loss_of(model, batch))
    state = copy.deepcopy(acc.state_dict())
    acc.close()
    return state


@pytest.mark.parametrize("saved_with,micro_steps", [(False, 2), (True, 2), (False, K), (True, K)])
def test_load_refuses_a_window_saved_with_the_other_scaling(saved_with, micro_steps):
    state = half_done_state(saved_with, micro_steps)
    model, opt, acc = make(not saved_with)
    acc.backward(loss_of(model, make_data(1, seed=7)[0]))  # its own half-done window
    grads, scale = snapshot_grads(model), acc.grad_scaler and acc.grad_scaler.get_scale()
    held = (r"a half-done window \(micro_step=2\)" if micro_steps < K
            else r"a closed window \(micro_step=0, window_ready=True\)")
    saved = (r"an enabled grad_scaler \(its gradients are scaled\)" if saved_with
             else r"no grad_scaler \(its gradients are not scaled\)")
    ours = (r"no grad_scaler \(it expects unscaled gradients\)" if saved_with
            else r"an enabled grad_scaler \(it expects scaled gradients\)")
    with pytest.raises(ValueError, match=rf"^gradaccum: acc\.load_state_dict\(\): the state holds {held} saved with "
                       rf"{saved}, but this Accumulator has {ours}\. Resume with the grad_scaler "
                       r"setting that saved it, or save at a window boundary \(after step\(\)\), "
                       r"where either setting may resume$"):
        acc.load_state_dict(state)
    assert acc.micro_step == 1 and not acc.window_ready
    assert_grads_equal(model, grads)
    if acc.grad_scaler is not None:
        assert acc.grad_scaler.get_scale() == scale


@pytest.mark.parametrize("saved_with", [False, True])
def test_load_accepts_a_boundary_saved_with_the_other_scaling(saved_with):
    model, opt, acc = make(saved_with)
    for batch in make_data(K):
        acc.backward(loss_of(model, batch))
    acc.step()
    state = copy.deepcopy(acc.state_dict())
    acc.close()
    model, opt, acc = make(not saved_with, init_scale=2.0 ** 4)
    acc.load_state_dict(state)
    assert acc.micro_step == 0 and acc.stats()["optimizer_steps"] == 1
    if acc.grad_scaler is not None:  # nothing to load: it keeps its own scale
        assert acc.grad_scaler.get_scale() == 2.0 ** 4


# 3. A rejected load changes nothing ------------------------------------------------


def test_rejected_scaler_state_leaves_the_window_and_the_scaler_untouched():
    state = half_done_state(True, 2)
    model, opt, acc = make(True)
    acc.backward(loss_of(model, make_data(1, seed=7)[0]))
    grads, scale = snapshot_grads(model), acc.grad_scaler.get_scale()

    bad = dict(state, grad_scaler={"scale": 2.0 ** 3})  # GradScaler would set it, then KeyError
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): 'grad_scaler' has no key "
                       r"'growth_factor': it must be what GradScaler\.state_dict\(\) returns$"):
        acc.load_state_dict(bad)
    bad = dict(state, grad_scaler=dict(state["grad_scaler"], growth_interval="2000"))
    with pytest.raises(TypeError, match=r"^gradaccum: acc\.load_state_dict\(\): 'grad_scaler' key 'growth_interval' "
                       r"must be an int, got '2000'$"):
        acc.load_state_dict(bad)
    bad = dict(state, grad_scaler=dict(state["grad_scaler"], scale=0.0))
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): 'grad_scaler' scale must be a "
                       r"positive finite number, got 0\.0$"):
        acc.load_state_dict(bad)
    # A disabled GradScaler's state ({}): its window is not scaled.
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): the state holds a half-done window "
                       r"\(micro_step=2\) saved with a disabled grad_scaler \(its gradients are not "
                       r"scaled\), but this Accumulator has an enabled grad_scaler"):
        acc.load_state_dict(dict(state, grad_scaler={}))
    assert acc.micro_step == 1
    assert_grads_equal(model, grads)
    assert acc.grad_scaler.get_scale() == scale

    acc.load_state_dict(state)  # the good one still loads, scale included
    assert acc.micro_step == 2 and acc.grad_scaler.get_scale() == state["grad_scaler"]["scale"]


def test_rejected_cpp_state_puts_the_scaler_back():
    """The scaler's state loads first and the C++ state last; when the C++ side
    refuses, the scaler is restored (scale, growth tracker, factors)."""
    state = half_done_state(True, 2)
    state["grad_scaler"] = dict(state["grad_scaler"], scale=2.0 ** 3, _growth_tracker=5,
                                growth_interval=7)
    model, opt, acc = make(True, steps=2)  # the C++ side refuses the steps
    acc.backward(loss_of(model, make_data(1, seed=7)[0]))  # the scaler's scale tensor exists
    grads, scaler_state = snapshot_grads(model), acc.grad_scaler.state_dict()
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): the state was saved with steps=4 in the "
                       r"middle of a window \(micro_step=\d+\) but this Accumulator has steps=2; resume with steps=4, "
                       r"or save at a window boundary \(after acc\.step\(\) returned True\) to change steps$"):
        acc.load_state_dict(state)
    assert acc.micro_step == 1
    assert_grads_equal(model, grads)
    assert acc.grad_scaler.state_dict() == scaler_state


# 4. Resume, then step() / flush() before any backward() ----------------------------


def train_until(acc, model, data, windows, then):
    for batch in data[:windows * K]:
        acc.backward(loss_of(model, batch))
        acc.step()
    for batch in data[windows * K:windows * K + then]:
        acc.backward(loss_of(model, batch))


@pytest.mark.parametrize("then,call", [(K, "step"), (2, "flush")])
def test_resumed_window_steps_before_any_backward_as_the_uninterrupted_run(then, call):
    data = make_data(4 * K)
    model, opt, acc = make(True)
    train_until(acc, model, data, 1, then)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), acc.state_dict()))
    assert getattr(acc, call)()
    for batch in data[2 * K:3 * K]:  # and one more window after it
        acc.backward(loss_of(model, batch))
        acc.step()
    expected, expected_scale = [p.detach().clone() for p in model.parameters()], acc.grad_scaler.get_scale()
    acc.close()

    model, opt, acc = make(True, init_scale=2.0 ** 20)  # a fresh process: a fresh GradScaler
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    acc.load_state_dict(saved[2])
    assert acc.grad_scaler._scale is None  # scale() never ran
    assert getattr(acc, call)()
    for batch in data[2 * K:3 * K]:
        acc.backward(loss_of(model, batch))
        acc.step()
    assert acc.stats()["optimizer_steps"] == 3
    assert acc.grad_scaler.get_scale() == expected_scale
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p, e)


def test_a_checkpoint_after_the_gradients_were_cleared_mid_window_is_refused():
    """One process: optimizer.zero_grad() between micro-steps, then
    state_dict(): saving (and resuming) the window without its first
    micro-steps would be silently wrong."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=4)
    for _ in range(2):
        acc.backward(model(torch.ones(3, 2)).sum())
    opt.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="state_dict\\(\\): the gradient of weight was cleared outside "
                                           "the Accumulator in the middle of a window"):
        acc.state_dict()


@pytest.mark.parametrize("case", ["scaler overflow", "no items"])
def test_last_grad_norm_of_a_skipped_window_is_none_not_the_previous_one(case):
    """A window skipped before its norm (a GradScaler's overflow, no items on
    any rank) reported the previous window's norm as last_grad_norm, which
    the HF Trainer adapter logs as grad_norm (review). Now None; a stepped
    window's is torch's clip_grad_norm_ total. With a grad_scaler, loss_scale
    is its get_scale() (it was always None)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    reference = copy.deepcopy(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if case == "scaler overflow" else None
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, max_grad_norm=1.0,
                                grad_scaler=scaler, reduction="mean" if scaler else "items")
    x = torch.randn(3, 4)
    for w in range(2):
        for _ in range(2):
            loss = model(x).pow(2).sum()
            if scaler is not None:
                acc.backward(loss * float("inf") if w == 1 else loss)
            else:
                acc.backward(loss, num_items=3 if w == 0 else 0)
        stepped = acc.step()
        stats = acc.stats()
        assert stepped == (w == 0) and stats["skipped_steps"] == w
        if w == 0:
            ref_loss = sum(reference(x).pow(2).sum() for _ in range(2)) / (2 if scaler else 6)
            ref_loss.backward()
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0).item()
            assert stats["last_grad_norm"] == pytest.approx(expected, rel=1e-6)
        else:
            assert stats["last_grad_norm"] is None
        assert stats["loss_scale"] == (scaler.get_scale() if scaler else None)
    if scaler is not None:
        assert stats["loss_scale"] == 2.0  # backed off from 4 after the overflow
    acc.close()
