"""acc.window_loss: the window's loss over every micro-batch of every rank,
weighted as its gradient, at no extra collective (Note [The window's loss
rides in the header]), against one process's big-batch loss in float64."""
import re

import pytest
import torch

import _dist_utils as du
import _loss_jobs as lj
import gradaccum

M = "_loss_jobs"


def run(name, world_size, tmp_path, **kwargs):
    return du.run_job(name, world_size, tmp_path / name, module=M, timeout=180, pg_timeout=30, **kwargs)


@pytest.mark.parametrize("world_size,reduction", [(1, "mean"), (1, "items"), (2, "mean"), (2, "items"),
                                                  (2, "sum"), (4, "items")])
def test_window_loss_is_the_big_batch_loss(tmp_path, world_size, reduction):
    n_windows, last = 3, 2  # and a partial last window (flush)
    check_window_losses(run("window_losses", world_size, tmp_path, seed=6, n_windows=n_windows, last=last,
                            reduction=reduction), world_size, reduction, n_windows, last, seed=6)


def check_window_losses(results, world_size, reduction, n_windows, last, seed):
    """test_gpu.py runs this check on CUDA tensors too."""
    metrics = []
    expected = lj.reference(seed, world_size, n_windows, last, reduction, metrics=metrics)
    for rank, res in enumerate(results):
        assert res["before_first"] is None
        # the user metrics ride in the same header: summed over the window and every rank
        for w, (got, want) in enumerate(zip(res["metrics"], metrics)):
            for name in want:
                assert abs(got[name] - want[name]) <= 1e-12 * max(1.0, abs(want[name])), (rank, w, name, got, want)
        for w, (got, want) in enumerate(zip(res["losses"], expected)):
            assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (rank, w, got, want)
        assert res["stats_loss"] == res["losses"][-1]
        assert res["mid"].dtype == torch.float64 and res["mid"].dim() == 0
        if reduction != "items":  # micro-batches over all ranks
            assert res["items"] == [world_size * lj.STEPS] * n_windows + [world_size * last], res["items"]
        if world_size > 1:
            # one all-reduce per bucket per window: the loss costs nothing
            assert res["collectives"] == [res["buckets"]] * (n_windows + 1), res["collectives"]


def test_a_half_precision_wire_has_no_window_loss(tmp_path):
    (res, _) = run("window_losses", 2, tmp_path, seed=6, n_windows=1, last=0, reduction="mean",
                   comm_dtype="bfloat16")
    assert res["losses"] == [None]
    assert res["metrics"] == [None]


def test_metrics_are_checked_before_anything_changes():
    model = du.mlp(1)
    acc = gradaccum.Accumulator(model, None, steps=2, reduction="items", process_group=False,
                                metrics=("correct",))
    (batch,) = du.make_windows(2, [[1]], 2)[0][0]
    loss, n = du.micro_loss(model, batch, "items")
    with pytest.raises(ValueError, match=r"gradaccum: acc.backward\(\): unknown metric\(s\) \['wrong'\]: the "
                       r"Accumulator was built with metrics=\['correct'\]"):
        acc.backward(loss, n, metrics={"wrong": 1})
    with pytest.raises(TypeError, match=r"metric 'correct' must be a number or a one-element tensor"):
        acc.backward(loss, n, metrics={"correct": "3"})
    with pytest.raises(ValueError, match=r"gradaccum: acc.backward\(\): metric 'correct' does not fit in a float64 "
                       r"\(int too large to convert to float\)"):
        acc.backward(loss, n, metrics={"correct": 10 ** 400})
    assert acc.micro_step == 0 and all(p.grad is None for p in model.parameters())
    acc.backward(loss, n, metrics={"correct": torch.tensor(3)})
    acc.backward(*du.micro_loss(model, batch, "items"))  # a micro-batch with none: zeros
    assert {k: float(v) for k, v in acc.window_metrics.items()} == {"correct": 3.0}
    with pytest.raises(TypeError, match=r"gradaccum: Accumulator\(\): metrics must be a list or tuple of names"):
        gradaccum.Accumulator(du.mlp(1), steps=2, process_group=False, metrics="correct")
    with pytest.raises(ValueError, match=r"gradaccum: Accumulator\(\): at most 8 metrics, got 9"):
        gradaccum.Accumulator(du.mlp(1), steps=2, process_group=False, metrics=[f"m{i}" for i in range(9)])
    with pytest.raises(ValueError, match=r"gradaccum: Accumulator\(\): the metric 'a' is named twice"):
        gradaccum.Accumulator(du.mlp(1), steps=2, process_group=False, metrics=["a", "a"])
    plain_model = du.mlp(1)
    plain = gradaccum.Accumulator(plain_model, steps=1, process_group=False)
    assert plain.window_metrics is None
    # metrics={} is no metrics (a script that always passes its dict, empty here)
    plain.backward(du.micro_loss(plain_model, batch, "mean")[0], metrics={})
    assert plain.window_ready and plain.window_metrics is None


def test_window_loss_reports_the_loss_a_grad_scaler_scales():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    acc = gradaccum.Accumulator(model, opt, steps=2, grad_scaler=scaler)
    xs = [torch.randn(3, 4, dtype=torch.float64) for _ in range(2)]
    losses = [model(x).pow(2).mean() for x in xs]
    for loss in losses:
        acc.backward(loss)
    assert abs(float(acc.window_loss) - sum(l.item() for l in losses) / 2) <= 1e-15
    acc.step()
    acc.close()


@pytest.mark.parametrize("world_size", [1, 2])
def test_skip_micro_batch_leaves_out_only_the_bad_micro_batch(tmp_path, world_size):
    nan_at = skip_micro_batch_nans(world_size)
    check_skip_micro_batch(run("bad_micro_batches", world_size, tmp_path, seed=9, n_windows=4, reduction="mean",
                               nan_at=nan_at), world_size, nan_at, seed=9)


def skip_micro_batch_nans(world_size):
    """NaNs on the last rank in window 1 (a no_sync micro-step), on rank 0 in
    window 2's synchronising micro-step; window 3: every micro-batch NaN."""
    last = world_size - 1
    return [(1, last, 0), (2, 0, lj.STEPS - 1)] + [(3, r, k) for r in range(world_size) for k in range(lj.STEPS)]


def check_skip_micro_batch(results, world_size, nan_at, seed):
    """test_gpu.py runs this check on CUDA tensors too."""
    expected, skipped = lj.bad_reference(seed, world_size, 4, "mean", nan_at={tuple(t) for t in nan_at})
    assert skipped == 1
    for rank, res in enumerate(results):
        for i, (a, e) in enumerate(zip(res["params"], expected)):
            assert (a - e).abs().max().item() <= 1e-12, (rank, i)
        assert res["stepped"] == [True, True, True, False]
        mine = sum(1 for (w, r, k) in nan_at if r == rank)
        assert res["stats"]["skipped_micro_batches"] == mine
        assert res["stats"]["skipped_steps"] == 1 and res["stats"]["optimizer_steps"] == 3


def test_micro_batches_with_no_items_count_for_nothing(tmp_path):
    # rank 1 has no valid item in all of window 1; window 2 has none anywhere
    empty_at = [(1, 1, k) for k in range(lj.STEPS)] + [(2, r, k) for r in range(2) for k in range(lj.STEPS)]
    results = run("bad_micro_batches", 2, tmp_path, seed=10, n_windows=4, reduction="items", empty_at=empty_at)
    expected, skipped = lj.bad_reference(10, 2, 4, "items", empty_at={tuple(t) for t in empty_at})
    assert skipped == 1
    for rank, res in enumerate(results):
        for i, (a, e) in enumerate(zip(res["params"], expected)):
            assert (a - e).abs().max().item() <= 1e-12, (rank, i)
        assert res["stepped"] == [True, True, False, True]
        assert res["stats"]["skipped_steps"] == 1 and res["stats"]["dropped_windows"] == 0


@pytest.mark.parametrize("world_size,reduction", [(1, "mean"), (2, "mean"), (2, "items")])
def test_an_empty_micro_step_holds_nothing_and_keeps_the_ranks_in_step(tmp_path, world_size, reduction):
    # acc.empty_micro_step(): a shard's padding batch. On the last rank in
    # window 1 (a no_sync micro-step), on rank 0 at window 2's synchronising
    # micro-step; window 3 is padding everywhere (skipped unstepped, alike)
    last = world_size - 1
    padding_at = [(1, last, 0), (2, 0, lj.STEPS - 1)] + [(3, r, k) for r in range(world_size)
                                                         for k in range(lj.STEPS)]
    results = run("bad_micro_batches", world_size, tmp_path, seed=11, n_windows=5, reduction=reduction,
                  padding_at=padding_at, nonfinite="skip")
    expected, skipped = lj.bad_reference(11, world_size, 5, reduction, nan_at={tuple(t) for t in padding_at})
    assert skipped == 1
    for rank, res in enumerate(results):
        for i, (a, e) in enumerate(zip(res["params"], expected)):
            assert (a - e).abs().max().item() <= 1e-12, (rank, i)
        assert res["stepped"] == [True, True, True, False, True]
        assert res["losses"][3] is None and None not in res["losses"][:3] + res["losses"][4:]
        assert res["losses"] == results[0]["losses"]
        stats = res["stats"]
        assert stats["micro_steps"] == 5 * lj.STEPS and stats["skipped_micro_batches"] == 0
        assert stats["skipped_steps"] == 1 and stats["optimizer_steps"] == 4 and stats["dropped_windows"] == 0


def test_an_empty_micro_step_is_refused_where_a_backward_would_be():
    model = torch.nn.Linear(2, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    acc.empty_micro_step()
    model(torch.ones(1, 2)).sum().backward()  # a plain backward mid-window: not counted, seen
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.empty_micro_step\(\): "):
        acc.empty_micro_step()
    acc.zero_grad()
    acc.empty_micro_step()
    acc.empty_micro_step()
    assert acc.window_ready and acc.window_loss is None
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.empty_micro_step\(\): the window closed"):
        acc.empty_micro_step()
    assert acc.step() is False  # nothing anywhere: skipped unstepped
    with acc.no_sync():
        acc.empty_micro_step()  # (as outside before the closing micro-step)
        with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.empty_micro_step\(\): called inside acc\.no_sync\(\) "
                           r"at the window's closing micro-step"):
            acc.empty_micro_step()
    acc.close()
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.empty_micro_step\(\): "):
        acc.empty_micro_step()


def test_the_window_a_checkpoint_cut_keeps_its_loss_and_a_boundary_state_fits_another_set():
    """Note [The window's loss across a checkpoint]: the resumed window's
    loss is the uninterrupted one's (review: it was None, a gap in every
    resumed run's loss log); a state saved before the sums were kept (none
    in it) still resumes with None."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(model, opt, steps=2, metrics=("rows",))
    x = torch.randn(3, 4, dtype=torch.float64)
    acc.backward(model(x).pow(2).mean(), metrics={"rows": 3})
    acc.step()
    acc.backward(model(x).pow(2).mean(), metrics={"rows": 3})
    assert acc.step() and acc.window_loss is not None
    first = model(x).pow(2).mean()
    acc.backward(first, metrics={"rows": 3})
    mid = acc.state_dict()
    acc.close()
    assert mid["window_metric_names"] == ["rows"]
    older = {k: v for k, v in mid.items() if k != "window_metric_names"}  # (the sums' first version: by count)
    for saved, known in ((mid, True), (older, True), ({k: v for k, v in mid.items() if k != "window_loss_sums"}, False)):
        resumed = gradaccum.Accumulator(model, opt, steps=2, metrics=("rows",))
        resumed.load_state_dict(saved)
        assert resumed.window_loss is None
        second = model(x).pow(2).mean()
        resumed.backward(second, metrics={"rows": 4})
        assert resumed.window_ready
        if known:
            assert float(resumed.window_loss) == pytest.approx((first.item() + second.item()) / 2, rel=1e-15)
            assert float(resumed.window_metrics["rows"]) == 7.0
        else:  # its first half was not saved
            assert resumed.window_loss is None and resumed.window_metrics is None
        resumed.close()
    # Sums that do not fit their names are refused, the Accumulator untouched
    # (review: they loaded, and the closing backward raised torch's own
    # size error on every rank).
    resumed = gradaccum.Accumulator(model, opt, steps=2, metrics=("rows",))
    for bad, expected, got in ((dict(mid, window_metric_names=["rows", "count"]), 3, 2),
                               (dict(mid, window_loss_sums=torch.zeros(3, dtype=torch.float64)), 2, 3)):
        with pytest.raises(ValueError, match=re.escape(
                "gradaccum: acc.load_state_dict(): 'window_loss_sums' must hold the loss and one sum per name of "
                f"'window_metric_names' ({expected} numbers), got {got}")):
            resumed.load_state_dict(bad)
        assert resumed.micro_step == 0
    resumed.close()
    # Resumed with other metric names, the sums are not credited by position
    # (review: a renamed or reordered metric got another's sum).
    resumed = gradaccum.Accumulator(model, opt, steps=2, metrics=("count",))
    resumed.load_state_dict(mid)
    resumed.backward(model(x).pow(2).mean(), metrics={"count": 4})
    assert resumed.window_ready and resumed.window_loss is None and resumed.window_metrics is None
    resumed.close()
    resumed = gradaccum.Accumulator(model, opt, steps=2, metrics=("rows",))
    resumed.load_state_dict(mid)
    resumed.backward(model(x).pow(2).mean(), metrics={"rows": 4})
    resumed.step()
    resumed.backward(model(x).pow(2).mean(), metrics={"rows": 1})
    resumed.backward(model(x).pow(2).mean(), metrics={"rows": 1})
    assert resumed.window_loss is not None
    assert resumed.step()
    boundary = resumed.state_dict()
    resumed.close()
    # saved with every layer trainable, resumed with the first one frozen (BaseFinetuning's resume)
    model[0].requires_grad_(False)
    frozen = gradaccum.Accumulator(model, opt, steps=2)
    frozen.load_state_dict(boundary)
    assert frozen.stats()["optimizer_steps"] == 3
    with pytest.raises(ValueError, match=r"gradients of a window in progress for other trainable parameters than "
                       r"this Accumulator's \(trained when saved, not here: '0\.weight', '0\.bias'\), so they"):
        frozen.load_state_dict(mid)  # (review: it said only "the state holds 4 gradients but the model has 2")
    frozen.close()


@pytest.mark.parametrize("reduction", ["mean", "items"])
def test_a_window_dropped_on_every_rank_has_no_loss(tmp_path, reduction):
    # Window 1: rank 1's middle micro-step fails, so the window is dropped on
    # every rank at its closing backward; window 3 (flushed, 2 micro-steps):
    # rank 0's first fails, dropped at flush(). A logger reading the loss then
    # must not get the window before it's.
    n_windows, last = 3, 2
    results = run("dropped_window_loss", 2, tmp_path, seed=7, n_windows=n_windows, last=last, reduction=reduction,
                  fail_at=[(1, 1, 1), (3, 0, 0)])
    expected, params = lj.dropped_reference(7, 2, n_windows, last, reduction, dropped={1, 3})
    for rank, res in enumerate(results):
        assert [bool(e) for e in res["errors"]] == [False, True, False, True], (rank, res["errors"])
        for w, (got, want) in enumerate(zip(res["losses"], expected)):
            if want is None:
                assert got is None and res["items"][w] == 0 and res["metrics"][w] is None, (rank, w, res)
                assert res["stats_loss"][w] is None
            else:
                assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (rank, w, got, want)
                assert res["items"][w] > 0 and res["metrics"][w] is not None
        du.assert_params_close(res["params"], params, f"rank {rank}")
        # every acc.backward() took its place, the dropped window's closing one too (review: not counted)
        assert res["micro_steps"] == res["backward_calls"], (rank, res["micro_steps"], res["backward_calls"])


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_window_reports_alike_at_its_edges(tmp_path, world_size):
    """Alike in one process and on 2 ranks: a window of no weight has no
    loss and no items, but its metric sums (before, data parallel had none);
    a micro-batch skip_micro_batch leaves out is left out whole, its metrics
    with it (stats counts it); window_loss and window_metrics are copies
    (before, `loss *= 100` changed what stats() reported); and
    refresh_parameters() forgets the last window's loss, metrics and items
    alike (before, it kept the items)."""
    for rank, res in enumerate(run("window_report_edges", world_size, tmp_path)):
        # metrics summed over both micro-batches of every rank: 5 + 6 (+ 15 + 16)
        assert res["weightless"] == (None, 0.0, {"c": 11.0 + (31.0 if world_size == 2 else 0.0)}), rank
        seen, items, skipped = res["skipped"]
        assert seen == {"seen": 2.0 * world_size - 1} and items == 2 * world_size - 1, (rank, res["skipped"])
        assert skipped == (1 if rank == world_size - 1 else 0)
        assert res["copies"] == (True, True, seen["seen"])
        assert res["refreshed"] == (None, None, 0.0)


@pytest.mark.parametrize("head_first", [False, True])
def test_a_model_with_a_half_precision_bucket_reports_its_loss_in_every_window(tmp_path, head_first):
    """A float32 body and a bf16 head: the loss rides in the float32
    bucket's header, wherever the bf16 (digit-encoded) bucket sits. Before,
    only the last bucket was read: with the head registered first, the
    first window (before the rebuild in ready order) had no loss."""
    for rank, res in enumerate(run("mixed_wire_window_loss", 2, tmp_path, head_first=head_first)):
        assert res["rebuilds"] == (1 if head_first else 0), res["rebuilds"]
        for w, (got, want) in enumerate(zip(res["got"], res["want"])):
            assert got is not None and abs(got - want) <= 1e-6 * abs(want), (rank, w, got, want)


def test_num_items_that_is_no_real_number_is_refused_on_every_rank(tmp_path):
    """Complex num_items: a TypeError naming the call (before, float()'s bare
    text). A meta tensor at the closing micro-step on one rank: refused, and
    the other rank is told, no wait (before, .item()'s RuntimeError left the
    other rank in the reduction)."""
    model = torch.nn.Linear(3, 1).double()
    acc = gradaccum.Accumulator(model, None, steps=2, reduction="items", process_group=False)
    loss = model(torch.ones(2, 3, dtype=torch.float64)).sum()
    with pytest.raises(TypeError, match=r"^gradaccum: acc.backward\(\): num_items must be a real count of items, "
                                        r"got a torch.complex64 tensor$"):
        acc.backward(loss, num_items=torch.tensor(1 + 0j))
    assert acc.micro_step == 0
    results = run("unreadable_num_items", 2, tmp_path)
    own, told = results[1]["error"], results[0]["error"]
    assert own.startswith("ValueError: gradaccum: acc.backward(): num_items could not be read as a number: "), own
    assert "refused the micro-batch that closes the window" in own and "refused the micro-batch" in told, told
    for res in results:
        assert not res["ready"] and res["micro_step"] == 0


def test_the_loss_share_follows_a_wire_that_stops_carrying_the_loss(tmp_path):
    """Note [A wire without the loss]: while a float32 bucket carries the
    loss, no share is taken; once refresh_parameters() leaves only the bf16
    bucket, the first such window logs nothing on every rank (no share was
    kept: before, a share of 0), the next ones the window's loss as a sum of
    shares; unfrozen again, the header carries it."""
    results = run("loss_share_across_refresh", 2, tmp_path)
    assert results[0] == results[1]
    for w, (loss, summed, want) in enumerate(results[0]):
        if w in (0, 1, 5):
            assert summed is None and abs(loss - want) <= 1e-6 * abs(want), (w, loss, want)
        elif w == 2:
            assert loss is None and summed is None, w
        else:
            assert loss is None and abs(summed - want) <= 1e-12 * abs(want), (w, summed, want)
