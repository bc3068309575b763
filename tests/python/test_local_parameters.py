"""Which parameters one process trains: frozen, tied and unused ones, an
iterable of parameters, Python autograd code under the C++ backward."""
import pytest
import torch

import gradaccum
from _local_reference import (
    IN, OUT, make_model, make_optimizer, make_data, micro_loss, reference_loss, params_of, grads_of,
    assert_all_close, assert_all_equal, train_reference, train_ours)


# frozen, tied and unused parameters ------------------------------------------------


def test_frozen_parameters_are_ignored():
    K, windows = 3, 3
    x, y = make_data(windows * 6)

    def build():
        model = make_model()
        model[0].weight.requires_grad_(False)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    ref, ref_opt = build()
    train_reference(ref, ref_opt, x, y, windows, K, "mean")
    model, opt = build()
    frozen = model[0].weight.detach().clone()
    acc, grads = train_ours(model, opt, x, y, windows, K, "mean")
    assert all(g[0] is None for g in grads)  # the frozen weight never gets a gradient
    assert torch.equal(model[0].weight, frozen)
    assert len(acc.state_dict()["grads"]) == 3  # only the trainable ones
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN, IN)
        self.b = torch.nn.Linear(IN, IN)
        self.b.weight = self.a.weight  # the same Parameter in two modules
        self.head = torch.nn.Linear(IN, OUT)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_tied(dtype=torch.float64):
    torch.manual_seed(0)
    return Tied().to(dtype)


@pytest.mark.parametrize("form", ["module", "list_with_duplicates"])
@pytest.mark.parametrize("reduction", ["mean", "items"])
def test_tied_parameters_counted_once(form, reduction):
    K, windows = 3, 3
    rows = 7 if reduction == "items" else 6
    x, y = make_data(windows * rows)
    ref = make_tied()
    train_reference(ref, make_optimizer("sgd", ref.parameters()), x, y, windows, K, reduction)

    model = make_tied()
    assert model.a.weight is model.b.weight
    unique = list(model.parameters())
    assert len(unique) == 5
    opt = make_optimizer("sgd", unique)
    if form == "module":
        target = model
    else:
        target = [p for _, p in model.named_parameters(remove_duplicate=False)]
        assert len(target) == 6
    acc = gradaccum.Accumulator(target, opt, steps=K, reduction=reduction)
    assert len(acc.state_dict()["grads"]) == 5
    rows_per_window = rows
    for w in range(windows):
        sl = slice(w * rows_per_window, (w + 1) * rows_per_window)
        for xb, yb in gradaccum.split((x[sl], y[sl]), K):
            loss, n = micro_loss(model, xb, yb, reduction)
            acc.backward(loss, num_items=n)
        assert acc.step() is True
    assert model.a.weight is model.b.weight
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


def test_unused_parameter_keeps_none_grad():
    class WithUnused(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used = torch.nn.Linear(IN, OUT)
            self.unused = torch.nn.Linear(IN, OUT)

        def forward(self, x):
            return self.used(x)

    K = 3
    x, y = make_data(12)

    def build():
        torch.manual_seed(0)
        model = WithUnused().double()
        return model, make_optimizer("adam", model.parameters())

    ref, ref_opt = build()
    train_reference(ref, ref_opt, x, y, 2, K, "mean")
    model, opt = build()
    unused = [p.detach().clone() for p in model.unused.parameters()]
    acc, grads = train_ours(model, opt, x, y, 2, K, "mean")
    assert all(g[2] is None and g[3] is None for g in grads)
    assert_all_equal([p.detach() for p in model.unused.parameters()], unused)
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


# an iterable of parameters ---------------------------------------------------------


@pytest.mark.parametrize("form", ["list", "tuple", "generator"])
def test_iterable_of_parameters(form):
    K, windows = 4, 3
    x, y = make_data(windows * 12)
    ref = make_model()
    train_reference(ref, make_optimizer("adam", ref.parameters()), x, y, windows, K, "mean")

    model = make_model()
    opt = make_optimizer("adam", model.parameters())
    params = {"list": lambda: list(model.parameters()), "tuple": lambda: tuple(model.parameters()),
              "generator": lambda: model.parameters()}[form]()
    acc = gradaccum.Accumulator(params, opt, steps=K)
    for w in range(windows):
        sl = slice(w * 12, (w + 1) * 12)
        for xb, yb in gradaccum.split((x[sl], y[sl]), K):
            acc.backward(micro_loss(model, xb, yb, "mean")[0])
        assert acc.step() is True
    assert acc.stats()["optimizer_steps"] == windows
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


def test_bare_tensor_parameters():
    """Plain leaf tensors with requires_grad (no Module at all)."""
    K = 2
    torch.manual_seed(0)
    w = torch.randn(IN, OUT, dtype=torch.float64, requires_grad=True)
    w_ref = w.detach().clone().requires_grad_(True)
    x, y = make_data(8)
    acc = gradaccum.Accumulator([w], torch.optim.SGD([w], lr=0.1), steps=K)
    for xb, yb in gradaccum.split((x, y), K):
        acc.backward((xb @ w - yb).pow(2).mean())
    assert acc.step() is True
    opt = torch.optim.SGD([w_ref], lr=0.1)
    (x @ w_ref - y).pow(2).mean().backward()
    opt.step()
    torch.testing.assert_close(w.detach(), w_ref.detach(), rtol=1e-12, atol=1e-14)


def test_repr_and_attributes():
    model = make_model()
    acc = gradaccum.Accumulator(model, None, steps=3, reduction="sum")
    assert acc.steps == 3
    assert acc.reduction == "sum"
    assert "steps=3" in repr(acc) and "'sum'" in repr(acc)
    assert acc.bucket_indices == []
    assert acc.stats()["last_grad_norm"] is None


# Python autograd code and callbacks under the C++ backward / step -------------------


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_python_autograd_function_and_hooks():
    K = 3
    x, y = make_data(9)
    model = make_model("linear")
    seen = []
    model.weight.register_hook(lambda g: seen.append(g.clone()))
    acc = gradaccum.Accumulator(model, None, steps=K)
    for xb, yb in gradaccum.split((x, y), K):
        acc.backward(Square.apply(model(xb) - yb).mean())
    assert len(seen) == K
    # The hook saw each micro-batch's unscaled gradient; .grad is their mean.
    torch.testing.assert_close(model.weight.grad, sum(seen) / K, rtol=1e-12, atol=1e-14)
    ref = make_model("linear")
    reference_loss(ref, x, y, "mean", 3).backward()
    assert_all_close(grads_of(model), grads_of(ref), rtol=1e-12, atol=1e-14)


def test_optimizer_exception_propagates_and_keeps_window():
    class Failing:
        def __init__(self):
            self.calls = 0

        def step(self):
            self.calls += 1
            raise ValueError("optimizer exploded")

    K = 2
    x, y = make_data(4)
    model = make_model()
    opt = Failing()
    acc = gradaccum.Accumulator(model, opt, steps=K)
    for xb, yb in gradaccum.split((x, y), K):
        acc.backward(micro_loss(model, xb, yb, "mean")[0])
    grads = grads_of(model)
    with pytest.raises(ValueError, match="optimizer exploded"):
        acc.step()
    assert opt.calls == 1
    assert acc.window_ready
    assert_all_equal(grads_of(model), grads)
    assert acc.stats()["optimizer_steps"] == 0
