"""gradaccum.Accumulator against plain PyTorch references (single process).

Every training test runs the same model twice: once with gradaccum over K
micro-batches, once with a plain torch optimizer on the K-times batch, and
compares the results.
"""
import copy
import io
import warnings

import pytest
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


# 1. equivalence with the big batch ------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "items"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_matches_big_batch(kind, opt_name, dtype, reduction):
    dtype = DTYPES[dtype]
    K, windows = 4, 5
    # "items" gets uneven micro-batches (14 rows -> 4, 4, 3, 3): still exact.
    rows = 14 if reduction == "items" else 12
    x, y = make_data(windows * rows, dtype)

    ref = make_model(kind, dtype)
    ref_opt = make_optimizer(opt_name, ref.parameters())
    ref_grads, _ = train_reference(ref, ref_opt, x, y, windows, K, reduction)

    ours = make_model(kind, dtype)
    opt = make_optimizer(opt_name, ours.parameters())
    acc, grads = train_ours(ours, opt, x, y, windows, K, reduction)

    tol = tolerances(dtype)
    for w in range(windows):
        assert_all_close(grads[w], ref_grads[w], **tol)
    assert_all_close(params_of(ours), params_of(ref), **tol)
    # The comparison is not vacuous: training moved the parameters.
    assert not torch.allclose(params_of(ours)[0], params_of(make_model(kind, dtype))[0])
    stats = acc.stats()
    assert stats["micro_steps"] == K * windows
    assert stats["optimizer_steps"] == windows
    assert stats["windows"] == windows
    assert stats["skipped_steps"] == 0
    if opt_name == "adam":
        assert all(int(opt.state[p]["step"]) == windows for p in ours.parameters())


def test_sum_differs_from_mean():
    """With reduction "sum" the window gradient is K times the "mean" one."""
    K = 4
    x, y = make_data(12)
    window = {}
    for reduction in ("mean", "sum"):
        model = make_model()
        acc = gradaccum.Accumulator(model, None, steps=K, reduction=reduction)
        for xb, yb in gradaccum.split((x, y), K):
            acc.backward(micro_loss(model, xb, yb, reduction)[0])
        window[reduction] = grads_of(model)
    assert_all_close([g / K for g in window["sum"]], window["mean"], rtol=1e-12, atol=1e-14)


# 2. partial last window closed by flush() -------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "items"])
@pytest.mark.parametrize("n_micro", [8, 9, 10, 11])
def test_flush_partial_window(n_micro, reduction):
    K, micro_rows = 4, 3
    x, y = make_data(n_micro * micro_rows)

    ours = make_model()
    opt = make_optimizer("sgd", ours.parameters())
    acc = gradaccum.Accumulator(ours, opt, steps=K, reduction=reduction)
    returned = []
    for xb, yb in gradaccum.split((x, y), n_micro):
        assert xb.shape[0] == micro_rows
        loss, n = micro_loss(ours, xb, yb, reduction)
        acc.backward(loss, num_items=n)
        returned.append(acc.step())
    assert returned == [(i + 1) % K == 0 for i in range(n_micro)]
    leftover = n_micro % K
    assert acc.micro_step == leftover
    if leftover:
        # flush() divides by the partial window's own micro-step count.
        assert acc.flush() is True
        assert all(p.grad is None for p in ours.parameters())
    else:
        assert acc.flush() is False
    assert acc.flush() is False  # nothing left
    assert acc.step() is False
    full = n_micro // K
    stats = acc.stats()
    assert stats["optimizer_steps"] == full + (1 if leftover else 0)
    assert stats["windows"] == stats["optimizer_steps"]
    assert stats["micro_steps"] == n_micro

    ref = make_model()
    ref_opt = make_optimizer("sgd", ref.parameters())
    bounds = [(w * K * micro_rows, (w + 1) * K * micro_rows) for w in range(full)]
    if leftover:
        bounds.append((full * K * micro_rows, n_micro * micro_rows))
    for lo, hi in bounds:
        ref_opt.zero_grad(set_to_none=True)
        reference_loss(ref, x[lo:hi], y[lo:hi], reduction, micro_rows).backward()
        ref_opt.step()
    assert_all_close(params_of(ours), params_of(ref), rtol=1e-10, atol=1e-12)


def test_flush_at_closed_window_steps_it():
    K = 3
    x, y = make_data(6)
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    for xb, yb in gradaccum.split((x, y), K):
        acc.backward(micro_loss(model, xb, yb, "mean")[0])
    assert acc.window_ready
    assert acc.flush() is True
    assert not acc.window_ready
    assert acc.stats()["optimizer_steps"] == 1
    ref = make_model()
    ref_opt = make_optimizer("sgd", ref.parameters())
    train_reference(ref, ref_opt, x, y, 1, K, "mean")
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


def test_flush_on_fresh_accumulator_is_noop():
    model = make_model()
    before = params_of(model)
    acc = gradaccum.Accumulator(model, make_optimizer("sgd", model.parameters()), steps=3)
    assert acc.flush() is False
    assert_all_equal(params_of(model), before)
    assert acc.stats()["optimizer_steps"] == 0
    assert acc.stats()["windows"] == 0


# 3. clipping ------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.0, 0.05, 1e3])
@pytest.mark.parametrize("reduction", ["mean", "sum", "items"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_clipping_matches_clip_grad_norm(dtype, reduction, max_norm):
    dtype = DTYPES[dtype]
    K, windows = 4, 4
    rows = 14 if reduction == "items" else 12
    x, y = make_data(windows * rows, dtype)

    ref = make_model("mlp", dtype)
    ref_opt = make_optimizer("sgd", ref.parameters())
    _, ref_norms = train_reference(ref, ref_opt, x, y, windows, K, reduction, max_grad_norm=max_norm)

    ours = make_model("mlp", dtype)
    opt = make_optimizer("sgd", ours.parameters())
    acc, _ = train_ours(ours, opt, x, y, windows, K, reduction, max_grad_norm=max_norm)

    tol = tolerances(dtype)
    if max_norm == 0.05:
        assert min(ref_norms) > 4 * max_norm  # the clipping bites in every window
    if max_norm == 1e3:
        assert max(ref_norms) < max_norm  # and here it never does
    assert acc.stats()["last_grad_norm"] == pytest.approx(ref_norms[-1], rel=tol["rtol"])
    assert_all_close(params_of(ours), params_of(ref), **tol)
    if max_norm == 0.0:
        assert_all_equal(params_of(ours), params_of(make_model("mlp", dtype)))
    else:
        assert not torch.allclose(params_of(ours)[0], params_of(make_model("mlp", dtype))[0])


def test_clipping_changes_the_result():
    """Control: with a biting max_grad_norm the result differs from no clipping."""
    K, windows = 4, 3
    x, y = make_data(windows * 12)
    results = []
    for max_norm in (None, 0.05):
        model = make_model()
        train_ours(model, make_optimizer("sgd", model.parameters()), x, y, windows, K, "mean",
                   max_grad_norm=max_norm)
        results.append(params_of(model))
    assert not torch.allclose(results[0][0], results[1][0], rtol=1e-3)


# 4. "items" with uneven micro-batches ---------------------------------------------


def token_batch(dtype=torch.float64):
    """8 sequences of up to 6 tokens with very different lengths."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([6, 6, 6, 5, 1, 1, 2, 1])
    x = torch.randn(8, 6, 4, generator=g, dtype=dtype)
    y = torch.randn(8, 6, generator=g, dtype=dtype)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).to(dtype)
    return x, y, mask


def token_model(dtype=torch.float64):
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).to(dtype)


def masked_se(model, x, y, mask):
    return (model(x).squeeze(-1) - y).pow(2) * mask


@pytest.mark.parametrize("items_form", ["int", "float", "tensor0d", "tensor1"])
def test_items_uneven_micro_batches_exact_per_item_mean(items_form):
    K = 4
    x, y, mask = token_batch()
    micro = gradaccum.split((x, y, mask), K)
    counts = [int(m.sum()) for _, _, m in micro]
    assert counts == [12, 11, 2, 3]  # very uneven numbers of items

    ref = token_model()
    (masked_se(ref, x, y, mask).sum() / mask.sum()).backward()
    ref_grads = grads_of(ref)

    ours = token_model()
    acc = gradaccum.Accumulator(ours, None, steps=K, reduction="items")
    for xb, yb, mb in micro:
        n = mb.sum()
        n = {"int": int(n), "float": float(n), "tensor0d": n, "tensor1": n.reshape(1)}[items_form]
        acc.backward(masked_se(ours, xb, yb, mb).sum(), num_items=n)
    assert acc.window_ready
    assert_all_close(grads_of(ours), ref_grads, rtol=1e-12, atol=1e-14)

    # Control: the naive mean of per-micro-batch means is a different gradient.
    naive = token_model()
    acc = gradaccum.Accumulator(naive, None, steps=K, reduction="mean")
    for xb, yb, mb in micro:
        acc.backward(masked_se(naive, xb, yb, mb).sum() / mb.sum())
    naive_grads = grads_of(naive)
    assert any(not torch.allclose(n, r, rtol=1e-2) for n, r in zip(naive_grads, ref_grads))


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_items_training_matches_per_item_mean(opt_name):
    K, windows = 4, 3
    x, y, mask = token_batch()
    ref = token_model()
    ref_opt = make_optimizer(opt_name, ref.parameters())
    ours = token_model()
    opt = make_optimizer(opt_name, ours.parameters())
    acc = gradaccum.Accumulator(ours, opt, steps=K, reduction="items")
    for w in range(windows):
        # Each window sees the sequences in a different order: different splits.
        perm = torch.roll(torch.arange(8), 3 * w)
        xw, yw, mw = x[perm], y[perm], mask[perm]
        ref_opt.zero_grad(set_to_none=True)
        (masked_se(ref, xw, yw, mw).sum() / mw.sum()).backward()
        ref_opt.step()
        for xb, yb, mb in gradaccum.split((xw, yw, mw), K):
            acc.backward(masked_se(ours, xb, yb, mb).sum(), num_items=mb.sum())
        assert acc.step() is True
    assert_all_close(params_of(ours), params_of(ref), rtol=1e-10, atol=1e-12)


# 5. state_dict round trip -----------------------------------------------------------


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
        "parameters than this Accumulator's (parameter 0 was 'a.weight', is 'b.weight'; parameter 1 was 'a.bias', "
        "is 'b.bias'), so they would land on the wrong parameters. Resume with the trainable parameters that saved "
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


# 6. LR scheduler --------------------------------------------------------------------


@pytest.mark.parametrize("sched_kind", ["step", "lambda", "exponential"])
def test_scheduler_steps_only_on_optimizer_steps(sched_kind):
    K, n_micro, micro_rows, base_lr = 3, 11, 2, 0.1
    bad_window = 1  # window 1 (micro-batches 3..5) gets a NaN: skipped

    def make_sched(opt):
        if sched_kind == "step":
            return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if sched_kind == "lambda":
            return torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e))
        return torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.7)

    def factor(e):
        return {"step": 0.5 ** e, "lambda": 1.0 / (1 + e), "exponential": 0.7 ** e}[sched_kind]

    x, y = make_data(n_micro * micro_rows)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=base_lr)
    sched = make_sched(opt)
    acc = gradaccum.Accumulator(model, opt, steps=K, scheduler=sched)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, (xb, yb) in enumerate(gradaccum.split((x, y), n_micro)):
            if i == bad_window * K + 1:
                xb = xb.clone()
                xb[0, 0] = float("nan")
            acc.backward(micro_loss(model, xb, yb, "mean")[0])
            acc.step()
            lrs.append(opt.param_groups[0]["lr"])
        assert acc.flush() is True
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    stats = acc.stats()
    assert stats["optimizer_steps"] == 3  # windows 0 and 2, and the flushed one
    assert stats["skipped_steps"] == 1
    assert stats["windows"] == 4
    assert sched.last_epoch == stats["optimizer_steps"]
    assert opt.param_groups[0]["lr"] == pytest.approx(base_lr * factor(3))
    # Unchanged during window 0, once after it, unchanged through the skipped window.
    expected = [base_lr] * 2 + [base_lr * factor(1)] * 6 + [base_lr * factor(2)] * 3
    assert lrs == pytest.approx(expected)

    # The same as the big-batch reference with the same scheduler, skipping window 1.
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=base_lr)
    ref_sched = make_sched(ref_opt)
    rows = K * micro_rows
    for lo, hi in [(0, rows), (2 * rows, 3 * rows), (3 * rows, n_micro * micro_rows)]:
        ref_opt.zero_grad(set_to_none=True)
        reference_loss(ref, x[lo:hi], y[lo:hi], "mean", micro_rows).backward()
        ref_opt.step()
        ref_sched.step()
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


# 7. non-finite gradients ------------------------------------------------------------


def poisoned(xb, value):
    xb = xb.clone()
    xb[0, 0] = value
    return xb


@pytest.mark.parametrize("position", [0, 2])
@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_nonfinite_skip(opt_name, value, position):
    K, windows = 3, 3
    x, y = make_data(windows * K * 2)
    model = make_model()
    opt = make_optimizer(opt_name, model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)  # nonfinite="skip" is the default
    batches = gradaccum.split((x, y), windows * K)
    results = []
    for w in range(windows):
        before = params_of(model)
        for k in range(K):
            xb, yb = batches[w * K + k]
            if w == 1 and k == position:
                xb = poisoned(xb, value)
            acc.backward(micro_loss(model, xb, yb, "mean")[0])
        if w == 1:
            assert any(not torch.isfinite(p.grad).all() for p in model.parameters())
        results.append(acc.step())
        if w == 1:
            assert_all_equal(params_of(model), before)  # untouched
            assert all(p.grad is None for p in model.parameters())  # cleared
            assert acc.micro_step == 0 and not acc.window_ready
            stats = acc.stats()
            assert stats["skipped_steps"] == 1
            assert stats["optimizer_steps"] == 1
            assert stats["windows"] == 2
    assert results == [True, False, True]
    stats = acc.stats()
    assert (stats["optimizer_steps"], stats["skipped_steps"], stats["windows"]) == (2, 1, 3)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    ref = make_model()
    ref_opt = make_optimizer(opt_name, ref.parameters())
    train_reference(ref, ref_opt, x, y, windows, K, "mean", skip_windows=(1,))
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)
    if opt_name == "adam":
        assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())


def test_nonfinite_skip_via_flush():
    K = 4
    x, y = make_data(4)
    model = make_model()
    before = params_of(model)
    acc = gradaccum.Accumulator(model, make_optimizer("sgd", model.parameters()), steps=K)
    micro = gradaccum.split((x, y), 2)
    acc.backward(micro_loss(model, *micro[0], "mean")[0])
    acc.backward(micro_loss(model, poisoned(micro[1][0], float("inf")), micro[1][1], "mean")[0])
    assert acc.flush() is False
    assert_all_equal(params_of(model), before)
    assert all(p.grad is None for p in model.parameters())
    assert acc.stats()["skipped_steps"] == 1


def test_nonfinite_raise():
    K = 2
    x, y = make_data(8)
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K, nonfinite="raise")
    micro = gradaccum.split((x, y), 4)
    before = params_of(model)
    acc.backward(micro_loss(model, *micro[0], "mean")[0])
    acc.backward(micro_loss(model, poisoned(micro[1][0], float("nan")), micro[1][1], "mean")[0])
    with pytest.raises(RuntimeError, match="not finite"):
        acc.step()
    assert_all_equal(params_of(model), before)
    # Gradients left in .grad for inspection.
    assert acc.window_ready
    assert all(p.grad is not None for p in model.parameters())
    assert any(not torch.isfinite(p.grad).all() for p in model.parameters())
    assert acc.stats()["optimizer_steps"] == 0
    with pytest.raises(RuntimeError, match="not finite"):
        acc.step()  # still the same window
    # Dropping the window lets training continue.
    acc.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert not acc.window_ready and acc.micro_step == 0
    acc.backward(micro_loss(model, *micro[2], "mean")[0])
    acc.backward(micro_loss(model, *micro[3], "mean")[0])
    assert acc.step() is True
    ref = make_model()
    ref_opt = make_optimizer("sgd", ref.parameters())
    train_reference(ref, ref_opt, x[4:], y[4:], 1, K, "mean")
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


def test_nonfinite_ignore():
    K = 2
    x, y = make_data(4)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=K, nonfinite="ignore")
    for xb, yb in gradaccum.split((x, y), K):
        acc.backward(micro_loss(model, xb, yb, "mean")[0] * float("nan"))
    assert acc.step() is True
    assert all(torch.isnan(p).all() for p in model.parameters())
    stats = acc.stats()
    assert stats["optimizer_steps"] == 1
    assert stats["skipped_steps"] == 0


# 8. position, sync_gradients, window_ready ------------------------------------------


@pytest.mark.parametrize("K", [1, 3])
def test_progression_and_step_every_k(K):
    windows = 3
    x, y = make_data(windows * K * 2)
    model = make_model()
    opt = make_optimizer("sgd", model.parameters())
    acc = gradaccum.Accumulator(model, opt, steps=K)
    micro = gradaccum.split((x, y), windows * K)
    steps_taken = []
    for i, (xb, yb) in enumerate(micro):
        pos = i % K
        closes = pos == K - 1
        assert acc.micro_step == pos
        assert acc.sync_gradients is closes
        assert acc.window_ready is False
        before = params_of(model)
        acc.backward(micro_loss(model, xb, yb, "mean")[0])
        assert acc.window_ready is closes
        assert acc.micro_step == (0 if closes else pos + 1)
        # As Accelerate's: True through the closing micro-step until step().
        assert acc.sync_gradients is (closes or pos + 1 == K - 1)
        assert acc.stats()["micro_steps"] == i + 1
        if closes:
            grads = grads_of(model)
            # backward() after the window closed, without step(): an error that
            # changes nothing.
            with pytest.raises(RuntimeError, match=r"step\(\)"):
                acc.backward(micro_loss(model, xb, yb, "mean")[0])
            assert_all_equal(grads_of(model), grads)
            assert acc.window_ready and acc.micro_step == 0
            assert acc.stats()["micro_steps"] == i + 1
        stepped = acc.step()
        steps_taken.append(stepped)
        assert stepped is closes
        assert acc.sync_gradients is (K == 1 or (not closes and pos + 1 == K - 1))
        changed = not torch.equal(params_of(model)[0], before[0])
        assert changed is closes
        assert acc.stats()["optimizer_steps"] == (i + 1) // K
    assert steps_taken == [(i % K) == K - 1 for i in range(windows * K)]
    ref = make_model()
    train_reference(ref, make_optimizer("sgd", ref.parameters()), x, y, windows, K, "mean")
    assert_all_close(params_of(model), params_of(ref), rtol=1e-10, atol=1e-12)


def test_zero_grad_drops_the_window():
    K = 4
    x, y = make_data(24)
    micro = gradaccum.split((x, y), 12)
    model = make_model()
    acc = gradaccum.Accumulator(model, make_optimizer("sgd", model.parameters()), steps=K)
    for i in range(2):
        acc.backward(micro_loss(model, *micro[i], "mean")[0])
    acc.zero_grad()
    assert acc.micro_step == 0 and not acc.window_ready
    assert all(p.grad is None for p in model.parameters())
    for i in range(2, 2 + K):
        acc.backward(micro_loss(model, *micro[i], "mean")[0])
    ref = make_model()
    reference_loss(ref, x[4:12], y[4:12], "mean", 2).backward()
    assert_all_close(grads_of(model), grads_of(ref), rtol=1e-12, atol=1e-14)
    # zero_grad() also drops a closed window; backward() is then allowed again.
    acc.zero_grad()
    assert not acc.window_ready
    acc.backward(micro_loss(model, *micro[6], "mean")[0])
    assert acc.micro_step == 1


@pytest.mark.parametrize("reduction", ["mean", "sum", "items"])
def test_no_optimizer_leaves_window_gradient(reduction):
    K = 3
    rows = 7 if reduction == "items" else 6
    x, y = make_data(2 * rows)
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=K, reduction=reduction)
    for w in range(2):
        sl = slice(w * rows, (w + 1) * rows)
        for xb, yb in gradaccum.split((x[sl], y[sl]), K):
            loss, n = micro_loss(model, xb, yb, reduction)
            acc.backward(loss, num_items=n)
        assert acc.window_ready
        ref = make_model()
        reference_loss(ref, x[sl], y[sl], reduction, rows // K).backward()
        assert_all_close(grads_of(model), grads_of(ref), rtol=1e-12, atol=1e-14)
        with pytest.raises(RuntimeError, match="optimizer"):
            acc.step()
        with pytest.raises(RuntimeError, match="optimizer"):
            acc.flush()
        assert_all_close(grads_of(model), grads_of(ref), rtol=1e-12, atol=1e-14)
        acc.zero_grad()
    assert acc.stats()["micro_steps"] == 2 * K


# 10. frozen, tied and unused parameters ------------------------------------------------


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


# 11. an iterable of parameters ---------------------------------------------------------


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
