"""gradaccum.Accumulator against plain PyTorch references (single process).

Every training test runs the same model twice: once with gradaccum over K
micro-batches, once with a plain torch optimizer on the K-times batch, and
compares the results.
"""
import warnings

import pytest
import torch

import gradaccum
from _local_reference import (
    DTYPES, tolerances, make_model, make_optimizer, make_data, micro_loss, reference_loss,
    params_of, grads_of, assert_all_close, assert_all_equal, train_reference, train_ours)


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


@pytest.mark.parametrize("max_norm", [0.05, 1e3])
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
    assert not torch.allclose(params_of(ours)[0], params_of(make_model("mlp", dtype))[0])


def test_max_grad_norm_zero_is_refused():
    # clip_grad_norm_(0) zeroes every gradient: as max_grad_norm it trained nothing,
    # silently, where Hugging Face's 0 means no clipping (review). None clips nothing.
    model = make_model("mlp", torch.float64)
    with pytest.raises(ValueError, match=r"^gradaccum: Accumulator\(\): invalid max_grad_norm: 0 \(must be a "
                                         r"finite number > 0: 0 would clip every gradient to zero"):
        gradaccum.Accumulator(model, make_optimizer("sgd", model.parameters()), steps=2, max_grad_norm=0.0)


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


# 5. LR scheduler --------------------------------------------------------------------


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


@pytest.mark.parametrize("kind", ["step", "chained"])
def test_a_scheduler_the_script_also_steps_warns_once(kind):
    """scheduler= and the script's own scheduler.step() each window: the
    schedule runs ahead of the optimizer, which acc.step() tells once, naming
    both counts (a ChainedScheduler's are its schedulers': review). The same
    loop without the script's call says nothing, nor does a rollback that
    loads earlier states of the scheduler and the Accumulator (review)."""
    def loop(mode):
        torch.manual_seed(0)
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        if kind == "chained":
            sched = torch.optim.lr_scheduler.ChainedScheduler(
                [sched, torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)])
        acc = gradaccum.Accumulator(model, opt, steps=2, scheduler=sched)
        x, y = make_data(12)
        saved = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, (xb, yb) in enumerate(gradaccum.split((x, y), 6)):
                acc.backward(micro_loss(model, xb, yb, "mean")[0])
                if acc.step() and mode == "own_step":
                    sched.step()
                if mode == "rollback" and i == 1:
                    saved = (sched.state_dict(), acc.state_dict())
                if mode == "rollback" and i == 3:
                    sched.load_state_dict(saved[0])
                    acc.load_state_dict(saved[1])
        acc.close()
        return [str(w.message) for w in caught if "gradaccum" in str(w.message)]

    assert loop("plain") == []
    assert loop("rollback") == []
    counts = ("2", "1") if kind == "step" else ("(2, 2)", "(1, 1)")
    assert loop("own_step") == [
        f"gradaccum: acc.step(): the scheduler passed as scheduler= was stepped outside acc.step() (its step "
        f"count is {counts[0]}, where acc.step()'s last step of it left {counts[1]}): it runs ahead of the "
        "optimizer's steps. acc.step() steps it after each optimizer step; drop your own scheduler.step() call, "
        "or build the Accumulator without scheduler=. Warned once"]


# 6. non-finite gradients ------------------------------------------------------------


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
    with pytest.raises(RuntimeError, match=r"not finite \(total norm nan\)"):
        acc.step()  # still the same window
    assert (acc.stats()["skipped_steps"], acc.stats()["windows"]) == (0, 0)
    # Dropping the window lets training continue; it counts as a skipped one,
    # as nonfinite="skip" counts it (review: it was in no counter).
    # Saved and resumed before it is dropped, it still counts (review: the
    # resumed window forgot that it had raised).
    state = acc.state_dict()
    assert state["window_raised_nonfinite"] is True
    acc.load_state_dict(state)
    acc.zero_grad()
    assert (acc.stats()["skipped_steps"], acc.stats()["windows"]) == (1, 1)
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


# 7. position, sync_gradients, window_ready ------------------------------------------


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
