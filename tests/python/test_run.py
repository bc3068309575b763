"""acc.run(fn, batch): a micro-batch that runs out of memory is split and run
in parts of the same micro-step (Note [Micro-steps in parts]), on the ranks
that need it only, against one process's big batch in float64."""
import pytest
import torch

import _dist_utils as du
import _run_jobs as rj
import gradaccum

M = "_run_jobs"


def run(name, world_size, tmp_path, **kwargs):
    return du.run_job(name, world_size, tmp_path / name, module=M, timeout=180, pg_timeout=30, **kwargs)


def check_against_reference(results, world_size, n_windows, last, reduction):
    expected = rj.reference(11, world_size, n_windows, last, reduction)
    for rank, res in enumerate(results):
        du.assert_params_close(res["params"], expected["params"], f"rank {rank}")
        for w, (got, want) in enumerate(zip(res["losses"], expected["losses"])):
            assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (rank, w, got, want)
        assert res["optimizer_steps"] == n_windows + (1 if last else 0)


@pytest.mark.parametrize("world_size,reduction,where", [
    (1, "mean", "forward"), (1, "items", "backward"), (2, "mean", "forward"), (2, "items", "forward"),
    (2, "sum", "backward"), (3, "items", "forward")])
def test_only_one_rank_runs_out_of_memory_and_the_result_is_the_big_batch(tmp_path, world_size, reduction, where):
    # The last rank cannot hold more than 3 rows (8-row micro-batches: parts of
    # 2); its peers never run out. No rank agrees with another on anything.
    n_windows, last = 3, 2
    oom_rank = world_size - 1
    results = run("oom_run", world_size, tmp_path, seed=11, n_windows=n_windows, last=last,
                  reduction=reduction, oom_ranks=[oom_rank], oom_rows=3, where=where)
    check_against_reference(results, world_size, n_windows, last, reduction)
    micro_batches = rj.STEPS * n_windows + last
    for rank, res in enumerate(results):
        assert res["micro_steps"] == micro_batches
        if rank == oom_rank:
            # 8 rows fail, 4 fail, 2 fit: the first micro-batch tries 8, 4, 2, 2,
            # then the other half 4, 2, 2; later ones go straight to 2-row parts.
            assert res["calls"][:7] == [8, 4, 2, 2, 4, 2, 2], res["calls"]
            assert res["calls"][7:] == [2] * 4 * (micro_batches - 1)
            assert res["oom_retries"] == 3  # 8, then each 4-row half once
            assert res["max_rows"] == [2] * micro_batches
        else:
            assert res["calls"] == [rj.ROWS] * micro_batches
            assert res["oom_retries"] == 0 and res["max_rows"] == [None] * micro_batches
    if world_size > 1:
        # Still one all-reduce per bucket per window, split or not.
        for res in results:
            assert res["collectives"] == [res["buckets"]] * (n_windows + 1), res["collectives"]


def test_the_returned_loss_is_the_whole_micro_batch_loss():
    torch.manual_seed(0)
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, None, steps=2, reduction="mean", process_group=False)
    (batch,) = du.make_windows(5, [[1]], 8)[0][0]
    calls = []
    fn = rj.loss_fn(model, "mean", 0, [0], 3, calls)
    got = acc.run(fn, batch)
    with torch.no_grad():
        want = du.micro_loss(model, batch, "mean")[0]
    assert abs(got.item() - want.item()) <= 1e-15 and not got.requires_grad
    assert acc.micro_step == 1 and calls == [8, 4, 2, 2, 4, 2, 2]


def test_parts_grow_back_after_a_run_without_out_of_memory(tmp_path):
    # GROW_AFTER=2: after two clean micro-steps in 2-row parts, run() tries
    # 4-row parts again, which still do not fit here, and falls back to 2.
    (res,) = run("oom_run", 1, tmp_path, seed=11, n_windows=3, last=0, reduction="mean",
                 oom_ranks=[0], oom_rows=3, grow_after=2)
    check_against_reference([res], 1, 3, 0, "mean")
    assert res["max_rows"][:5] == [2, 4, 2, 4, 2], res["max_rows"]
    assert res["calls"][7:15] == [2, 2, 2, 2, 4, 2, 2, 4], res["calls"]


@pytest.mark.parametrize("world_size,micro_step,where", [
    (2, 0, "one_row"), (2, 2, "one_row"), (2, 1, "mid_backward"), (2, 2, "mid_backward"), (3, 1, "one_row")])
def test_an_out_of_memory_that_cannot_be_retried_drops_the_window_on_every_rank(tmp_path, world_size,
                                                                               micro_step, where):
    oom_rank = world_size - 1
    results = run("unrecoverable", world_size, tmp_path, seed=11, reduction="mean", oom_rank=oom_rank,
                  micro_step=micro_step, where=where)
    own = ("out of memory on a part of one row: it cannot be split further" if where == "one_row" else
           "a part of the micro-batch failed in its backward after some of its gradient had reached .grad")
    # the peers learn why: out of memory in both (the C++ side tells it by
    # c10's error type, or by the text a Python backward's error carries)
    why = ("ran out of memory in acc.run() on a micro-batch it could not split further (one row) or run again "
           "(part of its gradient had reached .grad)")
    dropped = "gradaccum: acc.run(): window 0 was dropped on every rank: "
    closing = micro_step == rj.STEPS - 1
    for rank, res in enumerate(results):
        # The first window is dropped everywhere; the second steps everywhere.
        assert res["optimizer_steps"] == 1 and res["windows"] == 1, res
        errors = res["errors"]
        if rank == oom_rank:
            # its own error at once; the dropped window's when it closes
            assert errors[0][:2] == (0, micro_step) and own in errors[0][3], errors
            assert errors[0][3].startswith("gradaccum: acc.run(): "), errors
            assert len(errors) == (1 if closing else 2), errors
            peers = errors[1:]
        else:
            peers = errors
            assert len(errors) == 1, errors
        for (w, k, kind, text, _) in peers:
            assert (w, k, kind) == (0, rj.STEPS - 1, "RuntimeError")
            assert text.startswith(dropped) and why in text and f"rank {oom_rank}" in text, text
    if world_size > 1:
        du.assert_params_close(results[0]["params"], results[-1]["params"], "replicas", tol=0)


@pytest.mark.parametrize("where", ["user_error", "backward_error", "mid_backward_error", "bad_loss"])
@pytest.mark.parametrize("micro_step", [1, rj.STEPS - 1])
def test_any_error_in_run_fails_the_micro_step_on_every_rank(tmp_path, where, micro_step):
    """An error run() does not retry (fn's own, in a backward before or after
    some gradient reached .grad, or a loss run() rejects) still takes its
    micro-step's place: every rank closes window 0 together and drops it with
    one error; window 1 steps. Before the closing micro-step the script's own
    error stays itself (design.md, "One error voice")."""
    results = run("unrecoverable", 2, tmp_path, seed=11, reduction="mean", oom_rank=1,
                  micro_step=micro_step, where=where)
    own = {"user_error": "a bad sample: 8 rows", "backward_error": "a bad gradient: 8 rows",
           "mid_backward_error": "a bad gradient: 8 rows", "bad_loss": "gradaccum: acc.run(): loss must be a scalar"}[where]
    dropped = "gradaccum: acc.run(): window 0 was dropped on every rank: "
    closing = micro_step == rj.STEPS - 1
    for rank, res in enumerate(results):
        assert res["optimizer_steps"] == 1 and res["windows"] == 1, res
        errors = res["errors"]
        if rank == 1:
            assert errors[0][:2] == (0, micro_step) and own in errors[0][3] + "".join(errors[0][4]), errors
            if where != "bad_loss" and not micro_step == rj.STEPS - 1:
                assert errors[0][2] == "ValueError", errors
            if closing:  # dropped at once: this rank's error says so too
                told = errors[0][3] + "".join(errors[0][4])
                # a loss run() rejects: one message, "<its error>; window 0 was dropped ..."
                said = "; " + dropped[len("gradaccum: acc.run(): "):] if where == "bad_loss" else dropped
                assert len(errors) == 1 and said in told, errors
            else:
                assert len(errors) == 2 and errors[1][:3] == (0, rj.STEPS - 1, "RuntimeError"), errors
                assert errors[1][3].startswith(dropped) and "rank 1" in errors[1][3], errors
        else:
            assert len(errors) == 1 and errors[0][:3] == (0, rj.STEPS - 1, "RuntimeError"), errors
            assert errors[0][3].startswith(dropped) and "rank 1" in errors[0][3], errors
    du.assert_params_close(results[0]["params"], results[1]["params"], "replicas", tol=0)


def test_out_of_memory_in_a_closing_backward_splits_the_later_closing_steps(tmp_path):
    """Rank 1 first runs out of memory in the backward of window 0's closing
    micro-step, run whole (overlapped): that window is dropped on every rank;
    from then on rank 1 runs its micro-batches, closing ones included, in
    parts that fit, and the windows after equal the big batch."""
    n_windows = 3
    results = run("oom_run", 2, tmp_path, seed=11, n_windows=n_windows, last=0, reduction="mean",
                  oom_ranks=[1], oom_rows=4, where="backward", first_oom=rj.STEPS - 1, catch=True)
    expected = rj.reference(11, 2, n_windows, 0, "mean", dropped={0})
    for rank, res in enumerate(results):
        du.assert_params_close(res["params"], expected["params"], f"rank {rank}")
        assert res["optimizer_steps"] == n_windows - 1
        assert [w for w, _ in res["errors"]] == [0], res["errors"]
        for got, want in zip(res["losses"][1:], expected["losses"]):
            assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (rank, got, want)
        assert res["collectives"][1:] == [res["buckets"]] * (n_windows - 1)
    peer, oom = results
    assert "window 0 was dropped on every rank" in peer["errors"][0][1] and "rank 1" in peer["errors"][0][1]
    assert oom["calls"] == [8, 8, 8] + [4] * 2 * rj.STEPS * (n_windows - 1), oom["calls"]
    assert oom["max_rows"] == [None, None] + [4] * rj.STEPS * (n_windows - 1), oom["max_rows"]


def test_training_on_after_a_peers_flush_through_run_fails_once_without_a_hang(tmp_path):
    """Rank 1 trains on after rank 0's flush() ended epoch 0: its run() raises
    the "went on training" error (announced to rank 0, who raises it in its
    next window), fails nothing twice, and its flush() runs no collective; the
    even epoch after it trains on, replicas equal, in seconds (no timeout)."""
    results = run("one_sided_run", 2, tmp_path, seed=4)
    assert [e[:2] for e in results[1]["errors"]] == [(0, 2)], results[1]["errors"]
    assert "but this rank went on training" in results[1]["errors"][0][2]
    assert [e[:2] for e in results[0]["errors"]] == [(1, 1)], results[0]["errors"]
    assert "rank 1 went on training after the other ranks had ended the epoch" in results[0]["errors"][0][2]
    du.assert_params_close(results[0]["params"], results[1]["params"], "replicas", tol=0)
    assert all(res["seconds"] < 20 for res in results), [res["seconds"] for res in results]


def test_run_refuses_a_micro_step_that_could_not_run():
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, process_group=False)
    (a, b) = du.make_windows(5, [[2]], 4)[0][0]
    acc.run(rj.loss_fn(model, "mean", 0, [], 0, []), a)  # closes the window
    calls = []
    closed = (r"gradaccum: acc.run\(\): the window closed at the previous micro-step \(acc.backward\(\) or "
              r"acc.run\(\), or in the state acc.load_state_dict\(\) loaded\); call acc.step\(\)")
    with pytest.raises(RuntimeError, match=closed):
        acc.run(rj.loss_fn(model, "mean", 0, [], 0, calls), b)
    with pytest.raises(RuntimeError, match=closed):
        acc._c.end_micro_step(failed=True)
    assert calls == [] and acc.stats()["micro_steps"] == 1


def test_run_takes_metrics_in_a_dict_and_adds_up_the_parts():
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, None, steps=2, reduction="items", process_group=False,
                                metrics=("rows", "hits"))
    windows = du.make_windows(5, [[2]], 8)[0][0]
    inner = rj.loss_fn(model, "items", 0, [0], 3, [])  # parts of 2 rows

    def fn(batch):
        loss, n = inner(batch)
        return {"loss": loss, "num_items": n, "metrics": {"rows": batch[0].shape[0]}}

    got = [acc.run(fn, b) for b in windows]
    for out, b in zip(got, windows):
        with torch.no_grad():
            loss, n = du.micro_loss(model, b, "items")
        assert set(out) == {"loss", "num_items", "metrics"} and out["metrics"] == {"rows": 8}
        assert out["num_items"] == int(n) and abs(out["loss"].item() - loss.item()) <= 1e-13
    assert {k: float(v) for k, v in acc.window_metrics.items()} == {"rows": 16.0, "hits": 0.0}
    assert acc.stats()["oom_retries"] == 3
    acc.zero_grad()
    # A dict without metrics comes back as fn returned it: no key added (review).
    out = acc.run(lambda batch: {"loss": inner(batch)[0], "num_items": inner(batch)[1]}, windows[0])
    assert set(out) == {"loss", "num_items"}
    acc.zero_grad()
    with pytest.raises(TypeError, match=r"gradaccum: acc.run\(\): a dict from fn\(batch\) holds 'loss', "
                       r"'metrics' \(optional\) and, with reduction='items' only, 'num_items'; got the keys "
                       r"\['loss', 'rows'\]"):
        acc.run(lambda batch: {"loss": inner(batch)[0], "rows": 1}, windows[0])
    assert acc.micro_step == 0


def test_one_process_out_of_memory_on_one_row_leaves_the_window_as_it_was():
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, None, steps=3, reduction="items", process_group=False)
    (a, b) = du.make_windows(5, [[2]], 4)[0][0]
    acc.run(rj.loss_fn(model, "items", 0, [], 0, []), a)
    before = du.grads(model)
    one_row = tuple(t[:1] for t in b)
    with pytest.raises(RuntimeError, match="out of memory on a part of one row: it cannot be split further, so "
                       "this micro-step failed and nothing of it reached .grad: the window goes on without it"):
        acc.run(rj.loss_fn(model, "items", 0, [0], 0, []), one_row)
    du.assert_params_close(du.grads(model), before, "window", tol=0)
    assert acc.micro_step == 1 and not acc._c.parts_open


def test_one_process_failure_after_a_part_reached_grad_drops_the_window():
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, None, steps=3, reduction="mean", process_group=False)
    (a, b) = du.make_windows(5, [[2]], 8)[0][0]
    acc.run(rj.loss_fn(model, "mean", 0, [], 0, []), a)
    calls = []
    inner = rj.loss_fn(model, "mean", 0, [0], 4, calls)

    def fn(batch):  # the first 4-row half runs; the second raises a user error
        if len(calls) == 2:
            raise ValueError("a bad sample")
        return inner(batch)

    with pytest.raises(ValueError, match="a bad sample"):
        acc.run(fn, b)
    assert calls == [8, 4]
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    assert not acc._c.parts_open


def test_run_checks_what_fn_returns():
    model = du.mlp(3)
    (a,) = du.make_windows(5, [[1]], 4)[0][0]
    acc = gradaccum.Accumulator(model, None, steps=2, reduction="items", process_group=False)
    with pytest.raises(TypeError, match=r"gradaccum: acc.run\(\): with reduction='items', fn\(batch\) must "
                       r"return \(loss_sum, num_items\)"):
        acc.run(lambda batch: du.micro_loss(model, batch, "mean")[0], a)
    model2 = du.mlp(3)
    acc2 = gradaccum.Accumulator(model2, None, steps=2, process_group=False)
    with pytest.raises(TypeError, match=r"gradaccum: acc.run\(\): fn\(batch\) must return the micro-batch's loss"):
        acc2.run(lambda batch: (1.0, 2), a)
    assert acc.micro_step == 0 and acc2.micro_step == 0
    # Inside no_sync(): as outside before the window's closing micro-step,
    # refused there (Note [The closing micro-step inside no_sync()]).
    with acc2.no_sync():
        acc2.run(lambda batch: du.micro_loss(model2, batch, "mean")[0], a)
        with pytest.raises(RuntimeError, match=r"^gradaccum: acc.run\(\): called inside acc.no_sync\(\) at the "
                           r"window's closing micro-step"):
            acc2.run(lambda batch: du.micro_loss(model2, batch, "mean")[0], a)
    assert acc2.micro_step == 1


def test_open_parts_refuse_other_calls():
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2,
                                process_group=False)
    (a,) = du.make_windows(5, [[1]], 4)[0][0]
    acc._c.backward_part(du.micro_loss(model, a, "mean")[0], None, None, 0.5)
    for call, name in [(lambda: acc.step(), "acc.step()"), (lambda: acc.flush(), "acc.flush()"),
                       (lambda: acc.state_dict(), "acc.state_dict()"),
                       (lambda: acc.backward(du.micro_loss(model, a, "mean")[0]), "acc.backward()")]:
        with pytest.raises(RuntimeError, match=rf"gradaccum: {name.replace('(', '[(]').replace(')', '[)]')}: "
                           r"a micro-step run in parts \(acc.backward_part\(\)\) is still open"):
            call()
    acc._c.backward_part(du.micro_loss(model, a, "mean")[0], None, None, 0.5)
    acc._c.end_micro_step()
    assert acc.micro_step == 1 and acc.stats()["micro_steps"] == 1
    with pytest.raises(ValueError, match=r"a part's share of its micro-batch must be in \(0, 1\], got 0"):
        acc._c.backward_part(du.micro_loss(model, a, "mean")[0], None, None, 0.0)


def test_the_resilient_example_under_torchrun():
    """examples/python/train_resilient.py: one rank splits every micro-batch,
    a NaN micro-batch and one with no label are left out, the progress bar
    shows the global window loss; the result equals one process's big batch
    over what was kept (the example checks itself and exits 1 if not)."""
    import re

    out = du.run_example("train_resilient.py", "--windows", 4)
    diff = re.search(r"^max \|param - reference\|: ([0-9.eE+-]+)", out, re.M)
    assert diff and float(diff.group(1)) <= 1e-10, out
    # (rank 1's line may land after rank 0's progress bar on the same line)
    ranks = dict(re.findall(r"rank (\d): (micro-steps [^\n]*)", out))
    # 16-row micro-batches, at most 5 rows on rank 1: parts of 4 (16 -> 8 -> 4).
    assert "out-of-memory retries 3, parts of at most 4 rows" in ranks["1"], out
    assert "out-of-memory retries 0, parts of at most None rows" in ranks["0"], out
    assert "skipped micro-batches 1" in ranks["0"] and "skipped micro-batches 0" in ranks["1"], out
    assert "optimizer steps 4" in ranks["0"] and "optimizer steps 4" in ranks["1"], out
    # the progress bar's last state: the global window loss
    assert re.search(r"windows: 100%.*items=\d+, loss=[0-9.]+, skipped=1", out), out


def test_an_empty_micro_batch_runs_as_through_backward():
    """A micro-batch of 0 rows (items: num_items 0) raised ZeroDivisionError
    in acc.run() (its share of the rows), where acc.backward() takes it
    (review). Both now step the same window."""
    steps = []
    for how in ("backward", "run"):
        model = du.mlp(3)
        acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2,
                                    reduction="items", process_group=False)
        (a,) = du.make_windows(5, [[1]], 4)[0][0]
        empty = tuple(t[:0] for t in a)
        for batch in (empty, a):
            fn = rj.loss_fn(model, "items", 0, [], 0, [])
            if how == "run":
                acc.run(fn, batch)
            else:
                acc.backward(*fn(batch))
        assert acc.step() and acc.window_items == int(a[2].sum())
        steps.append(du.params(model))
    du.assert_params_close(steps[1], steps[0], "run vs backward", tol=0)


def test_out_of_memory_after_a_part_reached_grad_shrinks_the_later_parts():
    """An out-of-memory in the middle of a part's backward (after the last
    layer's gradient reached .grad) drops its window, and the part size was
    not remembered: every later window ran whole, ran out of memory there
    and was dropped too (review: no optimizer step ever). Now later
    micro-batches run in halves and step; the windows after the first are
    the big batch's."""
    model = du.mlp(3)
    reference = du.mlp(3)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, process_group=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    windows = du.make_windows(5, [[2]] * 3, 8)
    fn = rj.loss_fn(model, "mean", 0, [0], 4, [], where="mid_backward")
    errors = []
    for w, window in enumerate(windows):
        for batch in window[0]:
            try:
                acc.run(fn, batch)
            except RuntimeError as e:
                errors.append((w, str(e)))
                break  # one process: the window was dropped; the next one starts afresh
        acc.step()
        if w > 0:
            du.global_batch_loss(reference, window, "mean").backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert len(errors) == 1 and errors[0][0] == 0 and "out of memory" in errors[0][1], errors
    assert acc.stats()["optimizer_steps"] == 2 and acc.stats()["run_max_rows"] == 4
    du.assert_params_close(du.params(model), du.params(reference), "after the dropped window")


@pytest.mark.parametrize("where,kind,text", [("interrupt", KeyboardInterrupt, "stop"),
                                             ("mid_backward_error", ValueError, "a bad gradient: 4 rows")])
def test_the_scripts_own_error_in_a_part_after_it_reached_grad_stays_itself(where, kind, text):
    """design.md, "One error voice": the script's own exception from a hook
    stays itself, as acc.backward()'s does. A KeyboardInterrupt, or any
    error, in a part's backward after some of its gradient reached .grad
    came out as gradaccum's RuntimeError (reviews: an `except MyError` that
    works with backward() did not with run()); now as itself, the window's
    fate as its note."""
    model = du.mlp(3)
    acc = gradaccum.Accumulator(model, None, steps=3, process_group=False)
    (a,) = du.make_windows(5, [[1]], 4)[0][0]
    with pytest.raises(kind, match=text) as caught:
        acc.run(rj.loss_fn(model, "mean", 0, [0], 0, [], where=where), a)
    assert caught.value.__notes__ == [
        "gradaccum: acc.run(): a part of the micro-batch failed in its backward after some of its gradient had "
        f"reached .grad, which cannot be undone: the window was dropped. The error: {kind.__name__}: {text}"]
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
