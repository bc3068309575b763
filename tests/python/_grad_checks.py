"""Checks shared by the tests of rejected calls: a rejected call leaves every
.grad as it was (None stays None; a tensor keeps its values)."""


def snapshot_grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_grads_equal(model, expected):
    for p, e in zip(model.parameters(), expected):
        if e is None:
            assert p.grad is None
        else:
            assert p.grad is not None and p.grad.equal(e)
