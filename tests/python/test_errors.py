"""Every error of the Python API: its type, a message naming the argument, and
that a rejected call changes nothing."""

import pytest
import torch

import gradaccum
from _grad_checks import assert_grads_equal, loss_of, make_data, make_model, snapshot_grads


# Constructor ----------------------------------------------------------------------


@pytest.mark.parametrize("steps", [2.0, "2", True, None, [2]])
def test_steps_wrong_type(steps):
    with pytest.raises(TypeError, match="steps"):
        gradaccum.Accumulator(make_model(), steps=steps)


@pytest.mark.parametrize("steps", [0, -1, -10])
def test_steps_not_positive(steps):
    with pytest.raises(ValueError, match="steps"):
        gradaccum.Accumulator(make_model(), steps=steps)


@pytest.mark.parametrize("reduction", ["avg", "MEAN", "", "none"])
def test_unknown_reduction(reduction):
    with pytest.raises(ValueError, match="reduction"):
        gradaccum.Accumulator(make_model(), steps=2, reduction=reduction)


@pytest.mark.parametrize("nonfinite", ["warn", "Skip", ""])
def test_unknown_nonfinite(nonfinite):
    with pytest.raises(ValueError, match="nonfinite"):
        gradaccum.Accumulator(make_model(), steps=2, nonfinite=nonfinite)


@pytest.mark.parametrize("value", [-1.0, -1e-9, float("nan"), float("inf")])
def test_max_grad_norm_bad_value(value):
    with pytest.raises(ValueError, match="max_grad_norm"):
        gradaccum.Accumulator(make_model(), steps=2, max_grad_norm=value)


@pytest.mark.parametrize("option,value,text", [
    ("bucket_cap_mb", "25", "bucket_cap_mb must be a number of MiB or None, got '25'"),
    ("bucket_cap_mb", True, "bucket_cap_mb must be a number of MiB or None, got True"),
    ("first_bucket_cap_mb", [1], "first_bucket_cap_mb must be a number of MiB, got [1]"),
    ("first_bucket_cap_mb", None, "first_bucket_cap_mb must be a number of MiB, got None"),
    ("gradient_as_bucket_view", "no", "gradient_as_bucket_view must be a bool, got 'no'"),
    ("broadcast_buffers", 0, "broadcast_buffers must be a bool, got 0"),
    ("check_parameters", None, "check_parameters must be a bool, got None"),
    ("rebuild_buckets", "yes", "rebuild_buckets must be a bool, got 'yes'"),
])
def test_reducer_options_wrong_type(option, value, text):
    # A string is not a size, and "no" would have been truthy.
    with pytest.raises(TypeError) as info:
        gradaccum.Accumulator(make_model(), steps=2, **{option: value})
    assert str(info.value) == f"gradaccum: Accumulator(): {text}"


def test_an_optimizer_over_another_models_parameters_is_refused():
    """Every step would move parameters no window reaches (review: accepted,
    and the model did not train, say after a resume rebuilt the model only)."""
    model, other = make_model(), make_model()
    with pytest.raises(ValueError) as info:
        gradaccum.Accumulator(model, torch.optim.SGD(other.parameters(), lr=0.1), steps=2)
    n = len(list(other.parameters()))
    assert str(info.value) == (
        f"gradaccum: Accumulator(): the optimizer steps none of the model's parameters (its param_groups hold {n}, "
        "none of them the model's): every acc.step() would step parameters that no window's gradient reaches, and "
        "the model would not train. Build the optimizer over this model's parameters (a model rebuilt, say for a "
        "resume, needs its optimizer rebuilt too)")
    gradaccum.Accumulator(model, torch.optim.SGD(list(other.parameters()) + [next(model.parameters())], lr=0.1),
                          steps=2).close()  # (one of the model's: the rest are checked at each step)


def test_step_functions_that_need_an_argument_are_refused():
    # acc.step() calls optimizer.step() and scheduler.step() with none: LBFGS
    # (a closure) and ReduceLROnPlateau (a metric) would fail at every window.
    model = make_model()
    with pytest.raises(ValueError) as info:
        gradaccum.Accumulator(model, torch.optim.LBFGS(model.parameters()), steps=2)
    assert str(info.value).startswith("gradaccum: Accumulator(): optimizer LBFGS's step() needs 'closure', "
                                      "and acc.step() calls it with no argument")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as info:
        gradaccum.Accumulator(model, opt, steps=2, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    assert str(info.value).startswith("gradaccum: Accumulator(): scheduler ReduceLROnPlateau's step() needs "
                                      "'metrics', and acc.step() calls it with no argument: leave it out")
    class Wrapper:  # as accelerate's AcceleratedScheduler: step(*args, **kwargs) passes them on
        def __init__(self, scheduler):
            self.scheduler = scheduler

        def step(self, *args, **kwargs):
            self.scheduler.step(*args, **kwargs)

    with pytest.raises(ValueError) as info:
        gradaccum.Accumulator(model, opt, steps=2, scheduler=Wrapper(torch.optim.lr_scheduler.ReduceLROnPlateau(opt)))
    assert str(info.value).startswith("gradaccum: Accumulator(): scheduler Wrapper wrapping ReduceLROnPlateau's "
                                      "step() needs 'metrics'")
    # Those that take none, also optimizer.step() as an LR scheduler wraps it
    # (a function whose signature names `self`), are taken, and step.
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    acc = gradaccum.Accumulator(model, opt, steps=1, scheduler=sched)
    x, y = make_data()
    acc.backward(loss_of(model, x, y))
    assert acc.step() and opt.param_groups[0]["lr"] == 0.05
    acc.close()


def test_optimizer_and_scheduler_cannot_be_swapped_nor_the_accumulator_pickled():
    import copy
    import io
    import pickle

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2)
    for name in ("optimizer", "scheduler"):
        with pytest.raises(AttributeError) as info:
            setattr(acc, name, torch.optim.SGD(model.parameters(), lr=1.0))
        assert str(info.value).startswith(f"gradaccum: acc.{name} cannot be replaced: acc.step() steps the")
    assert acc.optimizer is opt and acc.scheduler is None
    # What it was built with, read-only too: a new steps or grad_scaler here scaled by one
    # rule while the C++ side reduced by the other (review: a wrong gradient, silently).
    for name, value in (("steps", 4), ("reduction", "sum"), ("metrics", ("n",)), ("grad_scaler", None),
                        ("process_group", None)):
        with pytest.raises(AttributeError) as info:
            setattr(acc, name, value)
        assert str(info.value) == (f"gradaccum: acc.{name} cannot be replaced: the Accumulator reduces, scales "
                                   f"and steps by what it was built with; acc.close() it and build a new one "
                                   f"with the new {name}")
    assert (acc.steps, acc.reduction, acc.metrics, acc.grad_scaler) == (2, "mean", (), None)
    x, y = make_data()
    acc.backward(loss_of(model, x, y))
    before = snapshot_grads(model)
    for attempt in (pickle.dumps, copy.copy, copy.deepcopy, lambda a: torch.save(a, io.BytesIO())):
        with pytest.raises(TypeError) as info:
            attempt(acc)
        assert str(info.value).startswith("gradaccum: an Accumulator cannot be pickled or copied")
    assert_grads_equal(model, before)
    assert acc.micro_step == 1
    acc.close()


@pytest.mark.parametrize("value", ["1.0", [1.0], True])
def test_max_grad_norm_wrong_type(value):
    with pytest.raises(TypeError, match="max_grad_norm"):
        gradaccum.Accumulator(make_model(), steps=2, max_grad_norm=value)


@pytest.mark.parametrize("model", [5, None, 1.5], ids=["int", "None", "float"])
def test_model_not_module_or_iterable(model):
    with pytest.raises(TypeError, match="model"):
        gradaccum.Accumulator(model, steps=2)


def test_model_single_tensor():
    with pytest.raises(TypeError, match="model"):
        gradaccum.Accumulator(torch.zeros(3, requires_grad=True), steps=2)


def test_model_iterable_with_non_tensor():
    model = make_model()
    with pytest.raises(TypeError, match="model.*item 1"):
        gradaccum.Accumulator([model[0].weight, "bias"], steps=2)


@pytest.mark.parametrize("group", [5, "world", object()], ids=["int", "str", "object"])
def test_process_group_wrong_type(group):
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        gradaccum.Accumulator(make_model(), steps=2, process_group=group)


def test_optimizer_without_step():
    with pytest.raises(TypeError, match="optimizer"):
        gradaccum.Accumulator(make_model(), object(), steps=2)


def test_scheduler_without_step():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="scheduler"):
        gradaccum.Accumulator(model, opt, steps=2, scheduler=object())


def test_no_trainable_parameters():
    model = make_model().requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        gradaccum.Accumulator(model, steps=2)
    with pytest.raises(ValueError, match="trainable"):
        gradaccum.Accumulator([], steps=2)
    with pytest.raises(ValueError, match="trainable"):
        gradaccum.Accumulator([torch.zeros(3)], steps=2)


def test_non_leaf_parameter():
    w = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        gradaccum.Accumulator([w * 2], steps=2)


# Parameters only the optimizer steps (Note [Parameters only the optimizer steps]) --------

OUTSIDE = ("the optimizer steps a parameter that is not the model's and has a gradient (its parameter {i} "
           "counting through param_groups, of shape [{shape}]): nothing would divide that gradient by the window's "
           "weight, reduce it over ranks or clear it, so it would be stepped with every micro-step's gradient "
           "summed, window after window. Build the Accumulator over a module that holds every parameter the "
           "optimizer steps (Python: torch.nn.ModuleList([model, head])); for a layer added to the model, call "
           "acc.refresh_parameters() at a window boundary{then}")
THEN = ". Nothing was stepped: acc.zero_grad() drops this window"


def test_an_optimizer_stepping_a_parameter_outside_the_model_is_refused():
    # Accumulated unchecked, its gradient was K times the window's, then 2K, ...
    model = make_model()
    head = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    head.grad = torch.ones_like(head)  # (a warm-up backward, say)
    opt = torch.optim.SGD([{"params": model.parameters()}, {"params": [head]}], lr=0.1)
    text = "gradaccum: Accumulator(): " + OUTSIDE.format(i=4, shape=2, then="")
    with pytest.raises(ValueError) as info:
        gradaccum.Accumulator(model, opt, steps=2)
    assert str(info.value) == text
    # Not claimed: a good Accumulator over the same model builds and trains.
    head.requires_grad_(False)  # a frozen one is never stepped: fine
    acc = gradaccum.Accumulator(model, opt, steps=2)
    x, y = make_data()
    acc.backward(loss_of(model, x[:4], y[:4]))
    acc.backward(loss_of(model, x[4:], y[4:]))
    assert acc.step()


@pytest.mark.parametrize("call", ["step", "flush"])
def test_a_parameter_added_to_the_optimizer_later_is_refused_at_the_step(call):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2)
    x, y = make_data()
    head = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    opt.add_param_group({"params": [head]})
    acc.backward((model(x[:4]) - y[:4] - head.sum()).pow(2).mean())
    if call == "step":
        acc.backward((model(x[4:]) - y[4:] - head.sum()).pow(2).mean())
    before = [p.detach().clone() for p in model.parameters()]
    grads = snapshot_grads(model)
    with pytest.raises(ValueError) as info:
        getattr(acc, call)()
    assert str(info.value) == f"gradaccum: acc.{call}(): " + OUTSIDE.format(i=4, shape="3, 2", then=THEN)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # nothing stepped
    if call == "step":
        assert_grads_equal(model, grads)
    assert acc.window_ready  # (flush() closed its partial window before the step)
    acc.zero_grad()
    assert not acc.window_ready


@pytest.mark.parametrize("change", ["added", "replaced"])
def test_a_layer_added_to_model_and_optimizer_steps_after_a_refresh(change):
    """The layer in both, then acc.refresh_parameters() at the boundary: the
    check passes, and the window is the big batch's gradient (float64). A
    replaced head's old parameters stay in param_groups (torch cannot remove
    them) but get no gradient: the optimizer skips them, and so does the
    check."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3)).double()
    if change == "replaced":
        model.append(torch.nn.Linear(3, 2).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = gradaccum.Accumulator(model, opt, steps=2)
    if change == "replaced":
        model[1] = torch.nn.Linear(3, 2).double()
    else:
        model.append(torch.nn.Linear(3, 2).double())
    opt.add_param_group({"params": model[1].parameters()})
    acc.refresh_parameters()
    x, y = make_data()
    acc.backward(loss_of(model, x[:4], y[:4]))
    acc.backward(loss_of(model, x[4:], y[4:]))
    got = [p.grad.clone() for p in model.parameters()]
    assert acc.step()
    model.zero_grad()
    loss_of(model, x, y).backward()
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-15)


# step() / flush() without an optimizer ---------------------------------------------


def test_step_and_flush_without_optimizer():
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=2)
    with pytest.raises(RuntimeError, match="optimizer"):
        acc.step()
    with pytest.raises(RuntimeError, match="optimizer"):
        acc.flush()
    x, y = make_data()
    acc.backward(loss_of(model, x, y))
    with pytest.raises(RuntimeError, match="optimizer"):
        acc.flush()
    assert acc.micro_step == 1  # the failed flush() did not close the window


# backward() ------------------------------------------------------------------------


def bad_backward_calls():
    """(id, reduction, call(acc, model, x, y), exception, match)."""
    return [
        ("loss_not_tensor", "mean", lambda a, m, x, y: a.backward(loss_of(m, x, y).item()),
         TypeError, "loss"),
        ("loss_not_scalar", "mean", lambda a, m, x, y: a.backward((m(x) - y).pow(2)),
         ValueError, "loss.*scalar"),
        ("loss_empty", "mean", lambda a, m, x, y: a.backward(m(x)[:0, 0]),
         ValueError, "loss.*scalar"),
        ("loss_no_grad", "mean", lambda a, m, x, y: a.backward(loss_of(m, x, y).detach()),
         ValueError, "loss.*require grad"),
        # (autograd refuses it only after the micro-step began)
        ("loss_complex", "mean", lambda a, m, x, y: a.backward(loss_of(m, x, y) * (1 + 0j)),
         TypeError, r"^gradaccum: acc.backward\(\): loss must be a real floating-point tensor, got ComplexDouble$"),
        ("num_items_in_mean", "mean", lambda a, m, x, y: a.backward(loss_of(m, x, y), num_items=8),
         ValueError, "num_items"),
        ("num_items_in_sum", "sum", lambda a, m, x, y: a.backward(loss_of(m, x, y), num_items=8),
         ValueError, "num_items"),
        ("num_items_missing", "items", lambda a, m, x, y: a.backward(loss_of(m, x, y)),
         ValueError, "num_items"),
        ("num_items_negative", "items",
         lambda a, m, x, y: a.backward(loss_of(m, x, y), num_items=-3), ValueError, "num_items"),
        ("num_items_nan", "items",
         lambda a, m, x, y: a.backward(loss_of(m, x, y), num_items=float("nan")),
         ValueError, "num_items"),
        ("num_items_inf", "items",
         lambda a, m, x, y: a.backward(loss_of(m, x, y), num_items=float("inf")),
         ValueError, "num_items"),
        ("num_items_tensor_not_one_element", "items",
         lambda a, m, x, y: a.backward(loss_of(m, x, y), num_items=torch.tensor([4, 4])),
         ValueError, "num_items"),
        # (review: accepted, the window's loss sum on meta; every later micro-step failed in torch)
        ("loss_meta", "mean", lambda a, m, x, y: a.backward(torch.zeros((), device="meta", requires_grad=True)),
         ValueError, r"^gradaccum: acc.backward\(\): loss is on the meta device: it holds no value"),
    ]


@pytest.mark.parametrize("reduction,call,exc,match",
                         [c[1:] for c in bad_backward_calls()],
                         ids=[c[0] for c in bad_backward_calls()])
def test_rejected_backward_changes_nothing(reduction, call, exc, match):
    K = 3
    x, y = make_data(9)
    micro = gradaccum.split((x, y), K)
    kwargs = (lambda xb: {"num_items": xb.shape[0] * 2}) if reduction == "items" else (lambda xb: {})
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=K, reduction=reduction)
    acc.backward(loss_of(model, *micro[0]) * (micro[0][0].shape[0] * 2 if reduction == "items" else 1),
                 **kwargs(micro[0][0]))
    grads = snapshot_grads(model)
    assert all(g is not None for g in grads)
    state = acc.state_dict()

    with pytest.raises(exc, match=match):
        call(acc, model, *micro[1])

    assert_grads_equal(model, grads)
    assert acc.micro_step == 1
    assert not acc.window_ready
    after = acc.state_dict()
    for key in ("micro_step", "window_ready", "window_weight", "micro_steps"):
        assert after[key] == state[key]

    # The window then completes exactly as if the bad call never happened.
    for xb, yb in micro[1:]:
        scale = xb.shape[0] * 2 if reduction == "items" else 1
        acc.backward(loss_of(model, xb, yb) * scale, **kwargs(xb))
    assert acc.window_ready
    ref = make_model()
    if reduction == "sum":
        sum(loss_of(ref, xb, yb) for xb, yb in micro).backward()
    else:  # mean of equal micro-batches, or items: both the big batch's mean
        loss_of(ref, x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def test_failed_autograd_backward_changes_nothing():
    """loss.backward() itself raising (graph already freed) must not count the
    micro-step or its weight."""
    K = 2
    x, y = make_data(8)
    micro = gradaccum.split((x, y), K)
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=K)
    loss = loss_of(model, *micro[0])
    acc.backward(loss)
    grads = snapshot_grads(model)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        acc.backward(loss)
    assert_grads_equal(model, grads)
    assert acc.micro_step == 1
    assert acc.state_dict()["window_weight"] == 1.0
    assert acc.stats()["micro_steps"] == 1
    acc.backward(loss_of(model, *micro[1]))
    ref = make_model()
    loss_of(ref, x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


def nested(call, outer):
    return (f"gradaccum: {call}: called from inside {outer} on the same Accumulator (by a gradient hook, the "
            f"optimizer, a scheduler or a callback that it runs), where the window is half-built: call it after "
            f"{outer} returns. This call was refused and changed nothing")


def backward_calling_from_a_hook(acc, model, loss, call):
    """acc.backward(loss) with a gradient hook that calls `call()`: its error."""
    handle = model[0].weight.register_hook(lambda g: call())
    try:
        with pytest.raises(RuntimeError) as error:
            acc.backward(loss)
    finally:
        handle.remove()
    return str(error.value)


def test_a_call_from_a_hook_inside_backward_is_refused():
    """acc.zero_grad() from a gradient hook during the window's closing
    backward used to clear part of the window and step the rest: refused,
    the backward fails, and the window is dropped as after any failed
    backward that reached .grad (one process)."""
    K = 2
    x, y = make_data(8)
    micro = gradaccum.split((x, y), K)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=K)
    acc.backward(loss_of(model, *micro[0]))
    error = backward_calling_from_a_hook(acc, model, loss_of(model, *micro[1]), acc.zero_grad)
    assert nested("acc.zero_grad()", "acc.backward()") in error
    assert acc.micro_step == 0 and not acc.window_ready
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    assert acc.step() is False
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    # the next window is the big batch's
    for xb, yb in micro:
        acc.backward(loss_of(model, xb, yb))
    ref = make_model()
    loss_of(ref, x, y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


class CallingOptimizer(torch.optim.SGD):
    """SGD whose step() first calls `call()`, while `calls_back` is set."""

    def __init__(self, params, call):
        super().__init__(params, lr=0.1)
        self.call, self.calls_back = call, True

    def step(self, closure=None):
        if self.calls_back:
            self.call()
        return super().step(closure)


def test_a_call_from_the_optimizer_inside_step_is_refused():
    """An optimizer whose step() calls acc.step() again (it used to recurse
    until Python's limit): refused; the window stays closed, and a retry with
    a plain step steps it once."""
    x, y = make_data(8)
    model = make_model()
    opt = CallingOptimizer(model.parameters(), lambda: acc.step())
    acc = gradaccum.Accumulator(model, opt, steps=1)
    acc.backward(loss_of(model, x, y))
    grads = snapshot_grads(model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError) as error:
        acc.step()
    assert str(error.value).startswith(nested("acc.step()", "acc.step()"))
    assert acc.window_ready and acc.stats()["optimizer_steps"] == 0
    assert_grads_equal(model, grads)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.calls_back = False
    assert acc.step() is True
    assert acc.stats()["optimizer_steps"] == 1


def test_state_dict_from_inside_a_call_is_refused():
    """acc.state_dict() from the optimizer inside acc.step() (the window half
    stepped: unscaled, clipped) or from a hook inside acc.backward() (half
    accumulated) is refused; the window steps on a retry."""
    K = 3
    x, y = make_data(9)
    micro = gradaccum.split((x, y), K)
    model = make_model()
    opt = CallingOptimizer(model.parameters(), lambda: acc.state_dict())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    acc.backward(loss_of(model, *micro[0]))
    error = backward_calling_from_a_hook(acc, model, loss_of(model, *micro[1]), acc.state_dict)
    assert nested("acc.state_dict()", "acc.backward()") in error
    acc.zero_grad()
    for xb, yb in micro:
        acc.backward(loss_of(model, xb, yb))
    grads = snapshot_grads(model)
    with pytest.raises(RuntimeError) as error:
        acc.step()
    assert str(error.value).startswith(nested("acc.state_dict()", "acc.step()"))
    assert acc.window_ready and acc.stats()["optimizer_steps"] == 0
    assert_grads_equal(model, grads)
    opt.calls_back = False
    assert acc.step() is True


def test_complex_metrics_are_refused():
    x, y = make_data(8)
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=2, metrics=["acc"])
    acc.backward(loss_of(model, x, y), metrics={"acc": 0.5})
    grads = snapshot_grads(model)
    with pytest.raises(TypeError, match=r"^gradaccum: acc.backward\(\): metric 'acc' must be real, got a "
                                        r"torch.complex64 tensor$"):
        acc.backward(loss_of(model, x, y), metrics={"acc": torch.tensor(0.5 + 1j)})
    assert_grads_equal(model, grads)
    assert acc.micro_step == 1


def test_a_meta_loss_or_metric_at_a_windows_first_micro_step_changes_nothing():
    """Review: a meta-device loss at micro-step 0 was taken: the window's loss
    sum went to the meta device, every later micro-step failed in torch, and
    flush() stepped an empty window; data parallel the other rank waited."""
    x, y = make_data(8)
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=2, metrics=["acc"])
    with pytest.raises(ValueError, match="loss is on the meta device"):
        acc.backward(torch.zeros((), device="meta", requires_grad=True))
    with pytest.raises(ValueError, match="metric.*meta device|meta device.*metric"):
        acc.backward(loss_of(model, x, y), metrics={"acc": torch.tensor(1.0, device="meta")})
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    acc.backward(loss_of(model, x, y), metrics={"acc": 1.0})
    acc.backward(loss_of(model, x, y), metrics={"acc": 2.0})
    assert acc.window_ready and float(acc.window_metrics["acc"]) == 3.0
    assert acc.window_loss.device.type == "cpu"


def test_bad_arguments_of_run_and_state_dict_are_refused_before_anything():
    """Review: acc.run(5, batch) failed its micro-step with "'int' object is
    not callable" (data parallel, at the closing micro-step, dropping the
    window on every rank); state_dict(rank_independent="False") took the
    string as true (a collective)."""
    x, y = make_data(8)
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=2)
    with pytest.raises(TypeError, match=r"^gradaccum: acc.run\(\): fn must be callable \(it computes the loss\), "
                                        r"got int$"):
        acc.run(5, (x, y))
    with pytest.raises(TypeError, match=r"^gradaccum: acc.state_dict\(\): rank_independent must be a bool, got "
                                        r"'False'$"):
        acc.state_dict(rank_independent="False")
    assert acc.micro_step == 0 and acc.stats()["micro_steps"] == 0


def test_a_sparse_parameter_is_refused_at_construction_in_one_process_too():
    """Review: refused at construction with a group, but taken in one process
    (the error came at step(), the window left closed)."""
    sparse = torch.nn.Parameter(torch.eye(3).to_sparse())
    with pytest.raises(ValueError, match=r"^gradaccum: Accumulator\(\): parameter 0 is sparse; sparse parameters "
                                         r"are not supported$"):
        gradaccum.Accumulator([sparse], torch.optim.SGD([sparse], lr=0.1), process_group=False)


def test_a_complex_trainable_parameter_is_refused_by_name():
    """Review: the refusal said only that gradients need a floating-point dtype."""
    model = torch.nn.Linear(2, 1)
    model.phase = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"^gradaccum: Accumulator\(\): phase has dtype ComplexFloat; complex "
                                         r"trainable parameters are not supported \(freeze it, or train its real "
                                         r"and imaginary parts as real parameters\)$"):
        gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), process_group=False)
    model.phase.requires_grad_(False)  # frozen: taken
    gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), process_group=False).close()


def test_backward_refuses_torchs_keyword_arguments_by_name():
    """Review: `inputs=` met Python's bare TypeError, outside the refusal
    that keeps the ranks in step; nothing is counted."""
    x, y = make_data(4)
    model = make_model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    with pytest.raises(TypeError, match=r"^gradaccum: acc.backward\(\): unexpected keyword argument\(s\) 'inputs', "
                                        r"'retain_graph': each call is one micro-step and takes no retain_graph, "
                                        r"inputs or create_graph \(sum two losses of one micro-batch into one call; "
                                        r"freeze what should get no gradient and call acc.refresh_parameters\(\)\)$"):
        acc.backward(loss_of(model, x, y), inputs=[model[0].weight], retain_graph=True)
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())


def test_a_mid_window_state_loaded_inside_inference_mode_trains_on():
    """Review: loaded inside torch.inference_mode(), .grad became inference
    tensors (a raw torch error at the next backward, the load half done)."""
    x, y = make_data(8)
    model = make_model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    acc.backward(loss_of(model, x[:4], y[:4]))
    state = acc.state_dict()
    with torch.inference_mode():
        acc.load_state_dict(state)
    assert acc.micro_step == 1 and not any(p.grad.is_inference() for p in model.parameters())
    acc.backward(loss_of(model, x[4:], y[4:]))
    got = [p.grad.clone() for p in model.parameters()]
    reference = make_model()
    (loss_of(reference, x[:4], y[:4]) + loss_of(reference, x[4:], y[4:])).div(2).backward()
    for g, p in zip(got, reference.parameters()):
        assert torch.allclose(g, p.grad, rtol=1e-12, atol=1e-14)


def test_an_inference_grad_is_refused_before_the_window_is_reduced():
    """Review: on a parameter no backward reached, the write-back into it
    failed on that rank alone, after every rank had reduced the window."""
    x, y = make_data(4)
    model = make_model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    with torch.inference_mode():
        model[2].bias.grad = torch.zeros_like(model[2].bias)
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc.backward\(\): 2.bias's .grad is an inference tensor \(made "
                                           r"inside torch.inference_mode\(\)\), which no backward or reduction can "
                                           r"write; set it to None outside inference_mode \(or call acc.zero_grad\(\)\)$"):
        acc.backward(loss_of(model, x, y))
    assert acc.micro_step == 0
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc.empty_micro_step\(\): 2.bias's .grad is an inference "
                                           r"tensor"):  # (review: it closed a window with it)
        acc.empty_micro_step()
    assert acc.micro_step == 0
    model[2].bias.grad = None
    acc.backward(loss_of(model, x, y))
    assert acc.micro_step == 1


def test_a_step_inside_inference_mode_builds_the_optimizers_state_outside_it():
    """Review: the first acc.step() inside an evaluation's inference_mode()
    made SGD's momentum (Adam's moments) inference tensors; every later
    step failed. The result equals steps taken outside it."""
    x, y = make_data(8)
    results = []
    for inference in (False, True):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        acc = gradaccum.Accumulator(model, opt, steps=2)
        for w in range(3):
            acc.backward(loss_of(model, x[:4] + w, y[:4]))
            acc.backward(loss_of(model, x[4:] + w, y[4:]))
            with torch.inference_mode(inference and w == 0):
                assert acc.step()
        assert not any(opt.state[p]["momentum_buffer"].is_inference() for p in model.parameters())
        results.append([p.detach().clone() for p in model.parameters()])
        acc.close()
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_backward_after_closed_window():
    K = 2
    x, y = make_data(8)
    model = make_model()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=K)
    micro = gradaccum.split((x, y), 4)
    acc.backward(loss_of(model, *micro[0]))
    acc.backward(loss_of(model, *micro[1]))
    grads = snapshot_grads(model)
    with pytest.raises(RuntimeError, match=r"step\(\)"):
        acc.backward(loss_of(model, *micro[2]))
    assert_grads_equal(model, grads)
    assert acc.window_ready
    assert acc.stats()["micro_steps"] == 2
    assert acc.step() is True
    acc.backward(loss_of(model, *micro[2]))  # fine after step()
    assert acc.micro_step == 1


# split -----------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, -1])
def test_split_steps_not_positive(steps):
    with pytest.raises(ValueError, match="steps"):
        gradaccum.split(torch.randn(4, 2), steps)


def test_split_steps_beyond_int64():
    with pytest.raises(ValueError, match=r"^gradaccum: split\(\): steps must be a positive int below 2\*\*63, "
                                         r"got 1180591620717411303424$"):
        gradaccum.split(torch.randn(4, 2), 2**70)


@pytest.mark.parametrize("steps", [2.0, "2", True, None])
def test_split_steps_wrong_type(steps):
    with pytest.raises(TypeError, match="steps"):
        gradaccum.split(torch.randn(4, 2), steps)


def test_split_takes_numpy_integers_as_the_accumulator_does():
    import numpy as np

    parts = gradaccum.split(torch.arange(6), np.int64(3))
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("rows,steps", [(3, 4), (1, 2), (0, 1)])
def test_split_more_steps_than_rows(rows, steps):
    with pytest.raises(ValueError, match=f"{rows} rows into {steps}"):
        gradaccum.split(torch.randn(rows, 2), steps)


@pytest.mark.parametrize("batch", [
    (torch.randn(4), torch.randn(5)),
    {"a": torch.randn(4, 2), "b": torch.randn(3, 2)},
    [torch.randn(6), (torch.randn(6), torch.randn(7))],
], ids=["tuple", "dict", "nested"])
def test_split_different_batch_sizes(batch):
    with pytest.raises(ValueError, match="different batch sizes"):
        gradaccum.split(batch, 2)


@pytest.mark.parametrize("batch", ["abcd", None, 3.0], ids=["str", "None", "float"])
def test_split_nothing_to_split(batch):
    with pytest.raises(ValueError, match="holds no tensor and no list of samples to split"):
        gradaccum.split(batch, 2)


def test_split_numpy_unsupported():
    import numpy as np

    with pytest.raises(TypeError, match=r"cannot split a ndarray \(batch\['y'\]\); convert it to a tensor"):
        gradaccum.split({"x": torch.zeros(4), "y": np.zeros((4, 2))}, 2)


@pytest.mark.parametrize("make,kind", [
    (lambda: torch.eye(4).to_sparse(), "layout torch.sparse_coo"),
    (lambda: torch.eye(4).to_sparse_csr(), "layout torch.sparse_csr"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3), torch.ones(1), torch.ones(2)]),
     "a nested tensor"),
], ids=["coo", "csr", "nested"])
def test_split_refuses_tensors_it_cannot_view(make, kind):
    """(Before, torch's own error from narrow(), or none until a part was used.)"""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (sparse CSR and nested tensors are beta/prototype)
        tensor = make()
    with pytest.raises(ValueError) as info:
        gradaccum.split({"x": torch.zeros(4), "y": tensor}, 2)
    assert str(info.value) == (f"gradaccum: split(): batch['y'] is {kind}; only dense (strided) tensors split into "
                               "views: pass a dense (padded) tensor, or split the samples yourself")


def test_split_list_of_samples_of_another_length():
    batch = {"ids": torch.arange(4), "text": ["a", "b", "c"]}
    with pytest.raises(ValueError, match=r"batch\['text'\] is a list of 3 values, but the batch has 4 rows"):
        gradaccum.split(batch, 2)


def test_split_scalar_tensor():
    with pytest.raises(ValueError) as info:
        gradaccum.split(torch.tensor(1.0), 1)
    assert str(info.value) == "gradaccum: split(): batch is a 0-dim tensor; it has no dim 0 to split along"
    with pytest.raises(ValueError, match=r"^gradaccum: split\(\): batch\['step'\] is a 0-dim tensor"):  # (by name)
        gradaccum.split({"x": torch.zeros(4), "step": torch.tensor(3)}, 2)


@pytest.mark.parametrize("batch", [(), [], {}], ids=["tuple", "list", "dict"])
def test_split_no_tensor(batch):
    # (an empty list is a list of samples: 0 of them)
    with pytest.raises(ValueError, match="cannot split 0 rows" if batch == [] else "no tensor"):
        gradaccum.split(batch, 1)


def test_close_warns_once_of_micro_steps_no_step_took(monkeypatch):
    """A loop's last partial window without acc.flush() was discarded by
    close() with nothing said. An error leaving a `with` block says enough."""
    import warnings

    from gradaccum import _lifetime

    monkeypatch.setattr(_lifetime, "_WARNED_UNSTEPPED", False)
    model = make_model()
    x, y = make_data()
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3)
    acc.backward(loss_of(model, x, y))
    acc.backward(loss_of(model, x, y))
    with pytest.warns(UserWarning) as caught:
        acc.close()
    assert [str(w.message) for w in caught] == [
        "gradaccum: acc.close(): this Accumulator held 2 counted micro-step(s) of a window no optimizer step took "
        "(acc.flush() steps a partial window: call it at the end of the data, on every rank); they are discarded. "
        "Warned once"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.close()  # closed already: nothing
        monkeypatch.setattr(_lifetime, "_WARNED_UNSTEPPED", False)
        model.zero_grad(set_to_none=True)  # (closed mid-window, .grad kept that window's part)
        with pytest.raises(KeyError):
            with gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=3) as other:
                other.backward(loss_of(model, x, y))
                raise KeyError("the script's own error")
        model.zero_grad(set_to_none=True)
        with gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1) as done:
            done.backward(loss_of(model, x, y))
            assert done.step()  # a boundary: nothing discarded
