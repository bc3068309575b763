"""The single-process references the local tests compare gradaccum with:
tiny models, data, the big batch's loss, and training loops (plain torch and
gradaccum) over whole windows."""
import torch

import gradaccum

IN, HID, OUT = 5, 8, 3

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def tolerances(dtype):
    if dtype == torch.float64:
        return dict(rtol=1e-10, atol=1e-12)
    return dict(rtol=1e-5, atol=1e-6)


def make_model(kind="mlp", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    if kind == "mlp":
        model = torch.nn.Sequential(
            torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
    elif kind == "linear":  # a single batch-independent layer
        model = torch.nn.Linear(IN, OUT)
    else:
        raise AssertionError(kind)
    return model.to(dtype)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    raise AssertionError(name)


def make_data(rows, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(rows, OUT, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def micro_loss(model, xb, yb, reduction):
    """(loss, num_items) of one micro-batch."""
    se = (model(xb) - yb).pow(2)
    if reduction == "items":
        return se.sum(), se.numel()
    return se.mean(), None


def reference_loss(model, x, y, reduction, micro_rows):
    """The loss on a whole window whose gradient the window's gradient must equal.

    mean: mean of equal-size micro-batch means == mean over the big batch.
    sum: sum of the micro-batch means == big-batch sum / elements per micro-batch.
    items: summed loss / summed items == mean over the big batch's elements.
    """
    se = (model(x) - y).pow(2)
    if reduction == "sum":
        return se.sum() / (micro_rows * OUT)
    return se.mean()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def grads_of(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def assert_all_close(actual, expected, **tol):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **tol)


def assert_all_equal(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if e is None:
            assert a is None
        else:
            assert torch.equal(a, e)


def train_reference(model, opt, x, y, windows, K, reduction, max_grad_norm=None, scheduler=None,
                    skip_windows=()):
    """Plain torch: one optimizer step per window on the window's whole batch."""
    rows = x.shape[0] // windows
    assert rows % K == 0 or reduction != "sum"
    grads, norms = [], []
    for w in range(windows):
        sl = slice(w * rows, (w + 1) * rows)
        opt.zero_grad(set_to_none=True)
        reference_loss(model, x[sl], y[sl], reduction, rows // K).backward()
        grads.append(grads_of(model))
        if w in skip_windows:
            continue
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        if scheduler is not None:
            scheduler.step()
    opt.zero_grad(set_to_none=True)
    return grads, norms


def train_ours(model, opt, x, y, windows, K, reduction, **kwargs):
    acc = gradaccum.Accumulator(model, opt, steps=K, reduction=reduction, **kwargs)
    rows = x.shape[0] // windows
    grads = []
    for w in range(windows):
        sl = slice(w * rows, (w + 1) * rows)
        micro = gradaccum.split((x[sl], y[sl]), K)
        assert len(micro) == K
        for k, (xb, yb) in enumerate(micro):
            loss, n = micro_loss(model, xb, yb, reduction)
            acc.backward(loss, num_items=n)
            if k == K - 1:
                assert acc.window_ready
                grads.append(grads_of(model))
                assert acc.step() is True
                assert all(p.grad is None for p in model.parameters())
            else:
                assert acc.step() is False
    return acc, grads
