"""Checks shared by the tests of rejected calls: a rejected call leaves every
.grad as it was (None stays None; a tensor keeps its values); and the tiny
float64 model and data those tests use."""
import torch


def snapshot_grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_grads_equal(model, expected):
    for p, e in zip(model.parameters(), expected):
        if e is None:
            assert p.grad is None
        else:
            assert p.grad is not None and p.grad.equal(e)


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()


def make_data(rows=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 4, generator=g, dtype=torch.float64),
            torch.randn(rows, 2, generator=g, dtype=torch.float64))


def loss_of(model, x, y):
    return (model(x) - y).pow(2).mean()
