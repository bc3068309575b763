"""acc.last_window_timeline(): when each gradient arrived and each bucket
filled, launched and completed in the last reduction (Note [The window's
timeline]), on 2 Gloo ranks; acc.window_trace() and gradaccum.trace."""
import json

import gradaccum
import pytest
import torch

import _dist_utils as du

M = "_timeline_jobs"
EMPTY = {"gradients": [], "buckets": [], "backward_end": -1.0, "finished": -1.0, "origin": -1.0}
NOTHING_TO_SHOW = ("gradaccum: acc.window_trace(): no reduction to show: none since the Accumulator was built, "
                   "refresh_parameters() or close(), or it has no process group (a timeline needs a reducer)")


def test_the_timeline_of_a_window_is_ordered_and_complete(tmp_path):
    for res in du.run_job("timeline", 2, tmp_path, module=M, steps=3):
        assert res["empty"] == EMPTY
        t = res["window"]
        end = t["backward_end"]
        assert 0 < end <= t["finished"]
        # Every gradient came through its hook, during backward.
        assert len(t["gradients"]) == len(res["sizes"])
        assert all(0 <= g <= end for g in t["gradients"]), t["gradients"]
        # Backward runs the last layer first: its gradients are ready first.
        assert t["gradients"][-1] < t["gradients"][0]
        buckets = t["buckets"]
        assert len(buckets) == res["stats"]["buckets"] >= 2
        assert sum(b["bytes"] for b in buckets) == res["stats"]["last_window_bytes"]
        for b in buckets:
            assert 0 <= b["ready"] <= b["launched"] <= b["completed"] <= t["finished"], b
        # Written back in launch order, each once its all-reduce completed
        # (Note [Writing back while the last buckets reduce]): the last one
        # after backward ended.
        written = [b["written"] for b in buckets]
        assert all(b["launched"] <= b["written"] <= t["finished"] for b in buckets), buckets
        assert written == sorted(written) and end <= written[-1]
        # Launched in index order; all but the last during backward, which
        # launches at its end (Note [The last bucket closes the window]).
        launched = [b["launched"] for b in buckets]
        assert launched == sorted(launched)
        assert launched[0] < end <= launched[-1]
        assert res["stats"]["last_window_launched_in_backward"] >= 1
        # flush(): no hook ran, every bucket launched at once.
        f = res["flush"]
        assert all(g == -1 for g in f["gradients"])
        assert all(0 <= b["ready"] == b["launched"] <= b["completed"] for b in f["buckets"])


def test_without_a_group_the_timeline_is_empty():
    model = torch.nn.Linear(2, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, process_group=False)
    acc.backward(model(torch.ones(1, 2)).sum())
    acc.step()
    assert acc.last_window_timeline() == EMPTY
    with pytest.raises(RuntimeError) as e:
        acc.window_trace()
    assert str(e.value) == NOTHING_TO_SHOW


def _events(trace, ph, tid=None):
    return [e for e in trace["traceEvents"] if e["ph"] == ph and (tid is None or e.get("tid") == tid)]


def _buckets(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("tid", 0) >= gradaccum.trace.BUCKET_TID]


def test_window_trace_draws_the_timeline_on_the_system_clock(tmp_path):
    """Each rank's trace has its reduction, a track per bucket and the named
    gradients at the timeline's times from its origin, which is on the
    system clock (between time.time() before and after the window); merged,
    the two ranks' all-reduces of each bucket overlap in time."""
    ranks = du.run_job("timeline", 2, tmp_path, module=M, steps=3)
    for rank, res in enumerate(ranks):
        assert res["empty_trace_error"] == NOTHING_TO_SHOW
        t, trace = res["window"], res["trace"]
        before, after = res["clock"]
        assert before <= t["origin"] <= t["origin"] + t["finished"] <= after
        base = int(round(1e6 * t["origin"]))
        us = lambda x: base + int(round(1e6 * x))  # noqa: E731
        meta = {e["name"]: e["args"] for e in _events(trace, "M") if e["name"] == "process_name"}
        assert meta == {"process_name": {"name": f"rank {rank}"}}
        assert {e["pid"] for e in trace["traceEvents"]} == {rank}
        bwd, wait = _events(trace, "X", 1)
        assert (bwd["name"], bwd["ts"], bwd["ts"] + bwd["dur"]) == ("synchronising backward", us(0),
                                                                    us(t["backward_end"]))
        assert (wait["name"], wait["ts"], wait["ts"] + wait["dur"]) == ("wait for the buckets, write back",
                                                                        us(t["backward_end"]), us(t["finished"]))
        spans = _buckets(trace)
        assert len(spans) == len(t["buckets"]) == res["stats"]["buckets"]
        for b, (span, times) in enumerate(zip(spans, t["buckets"])):
            assert span["tid"] == gradaccum.trace.BUCKET_TID + b  # a track each: they overlap in time
            assert span["name"] == f"bucket {b} all-reduce ({times['bytes'] / 2**20:.2f} MiB)"
            assert (span["ts"], span["ts"] + span["dur"]) == (us(times["launched"]), us(times["completed"]))
        grads = _events(trace, "i", 2)
        assert [e["name"] for e in grads] == res["names"]  # every gradient, named, in the Accumulator's order
        assert [e["ts"] for e in grads] == [us(g) for g in t["gradients"]]
        # flush(): no hooks ran, so one reduction span and no gradient instants.
        f = res["flush_trace"]
        assert [e["name"] for e in _events(f, "X", 1)] == ["reduction (no hooks: every bucket at once)"]
        assert _events(f, "i", 2) == []
        # refresh_parameters() starts the reducer over; the next reduction's
        # trace names the trainable parameters only.
        assert res["timeline_after_refresh"] == EMPTY
        assert [e["name"] for e in _events(res["trace_refreshed"], "i", 2)] == res["names"][2:]
        # A backward that failed on rank 0 after its hooks ran dropped the
        # window on both ranks; rank 0's trace says so, rank 1's backward ended.
        d = res["dropped"]
        assert d["windows"] == 1
        # Rank 1 may have written its early buckets back before the verdict
        # (Note [Writing back while the last buckets reduce]): the drop
        # cleared them, and the timeline says nothing was written.
        assert all(g is None for g in d["grads"]), d["grads"]
        assert d["written"] and all(w == -1 for w in d["written"]), d["written"]
        if rank == 0:
            assert any("injected failure on rank 0" in e for e in d["errors"]), d["errors"]
        assert [e["name"] for e in _events(d["trace"], "X", 1)] == (
            ["backward failed: window dropped"] if rank == 0 else
            ["synchronising backward", "wait for the buckets, write back"])
    path = tmp_path / "window.json"
    gradaccum.trace.save(str(path), [r["trace"] for r in ranks])
    merged = json.loads(path.read_text())
    assert len(merged["traceEvents"]) == sum(len(r["trace"]["traceEvents"]) for r in ranks)
    by_rank = [[e for e in _buckets(merged) if e["pid"] == r] for r in (0, 1)]
    for s0, s1 in zip(*by_rank):
        assert s0["ts"] <= s1["ts"] + s1["dur"] and s1["ts"] <= s0["ts"] + s0["dur"], (s0, s1)


def test_trace_save_refuses_what_is_not_a_trace(tmp_path):
    with pytest.raises(ValueError) as e:
        gradaccum.trace.save(str(tmp_path / "x.json"), [{"traceEvents": []}, {"events": []}])
    assert str(e.value) == ("gradaccum: gradaccum.trace.save(): item 1 is not a trace (a dict with 'traceEvents', "
                            "as acc.window_trace() returns)")
    assert not (tmp_path / "x.json").exists()


def _dropped_and_cleared(res, views):
    """A job's dropped window: counted once, not stepped, its gradients
    cleared (to zeros on their views, else None)."""
    d = res["dropped"]
    assert d["dropped_windows"] == 1 and d["stepped"] is False
    if views:
        assert all(g is not None and not g.any() for g in d["grads"]), d["grads"]
    else:
        assert all(g is None for g in d["grads"]), d["grads"]
    return d


@pytest.mark.parametrize("wide,views", [(False, False), (True, False), (False, True)],
                         ids=["float64", "float32 in float64 buckets", "float64 bucket views"])
def test_buckets_written_back_early_divide_by_the_windows_own_weight(tmp_path, wide, views):
    """Note [Writing back while the last buckets reduce]: every bucket but the
    last is written back as soon as its all-reduce completes, dividing by its
    own summed weight. Windows of 0.2, 0.4 and 1.4 items (two micro-steps of
    0.1, 0.2 and 0.7) sum to 2.0 or to 1.9999999999999998 depending on where
    in a collective they are summed, so some of those buckets have another
    divisor than the window's (the last bucket's): they must be written
    again. Every gradient is checked bit for bit against the exact integer
    sum of the ranks' own gradients divided by window_items, on every rank,
    in 3 windows. With float32 parameters in float64 buckets
    (accumulate_dtype), rounded once to float32 after the division, from odd
    sums that put a division by 2 exactly between two float32 values: the
    wide bucket keeps its sums for the second write, and the rounding tells
    the divisors apart. Bucket views, divided in place, are not written
    early here: some rank's weight is fractional (kInexactWeight), so their
    divisor could differ. A window dropped after early writes (rank 0's
    closing backward fails once every hook has run) leaves no gradient on any
    rank, and the window after it is exact: the drop zeroed the (wide) sums
    the early writes had read."""
    ranks = du.run_job("fractional_weights", 3, tmp_path, module=M, steps=2, wide=wide, views=views)
    for rank, res in enumerate(ranks):
        d = _dropped_and_cleared(res, views)
        who = "this rank (rank 0): injected failure on rank 0." if rank == 0 else \
            "rank 0 (its own error is raised there)."
        assert d["errors"] == [
            "gradaccum: acc.backward(): window 3 was dropped on every rank: the synchronising backward (or a "
            f"micro-step of the window) failed on {who} The window's gradients were cleared on every rank and "
            "no optimizer step was taken; training can go on from the next window"]
    ties = 0
    for w in range(4):
        for r in ranks:  # each rank's own sums are exact in their dtype
            assert all(raw.abs().max() < (2**24 if wide else 2**53) for raw in r["windows"][w]["raw"])
        exact = [sum(r["windows"][w]["raw"][i].double() for r in ranks)
                 for i in range(len(ranks[0]["windows"][w]["raw"]))]
        ties += sum(int(((t.abs() >= 2**24) & (t.abs() < 2**25) & (t.remainder(2) == 1)).sum()) for t in exact)
        for rank, res in enumerate(ranks):
            window = res["windows"][w]
            assert res["buckets"] == len(exact) >= (10 if not wide else 12)
            for i, (grad, total) in enumerate(zip(window["grads"], exact)):
                assert torch.equal(total, total.round()) and total.abs().max() < 2**53, "the reference must be exact"
                expected = (total / window["items"]).to(grad.dtype)
                assert grad.dtype == (torch.float32 if wide else torch.float64)
                assert torch.equal(grad, expected), (w, rank, i)
            # Every bucket written back after its launch; the last one last,
            # once backward ended (Note [The last bucket closes the window]);
            # those written again after the verdict come just before it.
            t = window["timeline"]
            written = [b["written"] for b in t["buckets"]]
            assert all(0 <= b["launched"] <= b["written"] <= t["finished"] for b in t["buckets"]), t["buckets"]
            assert t["backward_end"] <= written[-1] == max(written)
    assert not wide or ties > 100, ties  # the float32 rounding can tell the divisors apart
    # Some bucket was written early and then again after the verdict: its
    # second stamp comes after a later bucket's first. (Gloo sums the weight
    # in another order at other positions; without the second write the
    # bit-for-bit checks above fail, in both variants.) Views are written
    # once each, after the verdict, in order.
    assert views != any([b["written"] for b in r["windows"][w]["timeline"]["buckets"]] !=
               sorted(b["written"] for b in r["windows"][w]["timeline"]["buckets"])
               for r in ranks for w in range(4))


@pytest.mark.parametrize("views,items,dtype", [
    (False, False, torch.float64), (True, False, torch.float64), (False, True, torch.float64),
    (True, True, torch.float64), (True, False, torch.bfloat16)],
    ids=["copies", "bucket views", "copies, fractional items", "bucket views, fractional items",
         "bfloat16 bucket views (digits)"])
def test_buckets_are_written_back_while_a_slow_rank_holds_the_last(tmp_path, views, items, dtype):
    """Note [Writing back while the last buckets reduce]: rank 1's closing
    backward sleeps after its last gradient hook, so the last bucket, launched
    at backward's end, completes about SLOW_S late on rank 0, whose other
    buckets completed before. Rank 0 writes those back while it waits: each
    written long before the last bucket completed. Bucket views, divided in
    place, only where no rank's weight is fractional ("mean"; kInexactWeight):
    with fractional item counts they wait for the verdict. The gradients are
    the big batch's, bit for bit: the ranks' own sums added and divided by
    the window's weight. A window dropped after early writes (rank 0's
    closing backward fails once its hooks ran) leaves nothing on either
    rank, and the next window is exact again. In bfloat16 the header
    travels as digits: its integer weights are exact there too."""
    from _timeline_jobs import SLOW_S

    ranks = du.run_job("slow_closing_rank", 2, tmp_path, module=M, views=views, items=items, dtype=dtype)
    for w in range(3):
        for res in ranks:
            window = res["windows"][w]
            assert window["items"] == (pytest.approx(0.6) if items else 4)
            for i, grad in enumerate(window["grads"]):
                total = ranks[0]["windows"][w]["raw"][i] + ranks[1]["windows"][w]["raw"][i]
                assert torch.equal(grad, total / window["items"]), (w, i)
    t = ranks[0]["windows"][1]["timeline"]
    buckets = t["buckets"]
    assert len(buckets) == (6 if dtype == torch.float64 else 5)  # a bucket per parameter (bf16: two share one)
    last = buckets[-1]["completed"]
    assert last - t["backward_end"] > SLOW_S / 2, t
    for b in buckets[:-1]:
        assert 0 <= b["launched"] <= b["completed"] <= b["written"], buckets
        if views and items:  # after the verdict
            assert b["written"] > last - SLOW_S / 2, buckets
        else:
            assert b["written"] < last - SLOW_S / 2, buckets
    assert last <= buckets[-1]["written"] <= t["finished"]
    for res in ranks:
        d = _dropped_and_cleared(res, views)
        assert len(d["errors"]) == 1 and d["errors"][0].startswith(
            "gradaccum: acc.backward(): window 2 was dropped on every rank"), d["errors"]


@pytest.mark.parametrize("narrow_first", [True, False], ids=["float32 bucket last", "float64 bucket last"])
def test_bucket_views_early_only_below_every_buckets_exact_bound(tmp_path, narrow_first):
    """Note [Writing back while the last buckets reduce]: integer weights
    summing to 2^24 + 1, exact in a float64 bucket's meta, are 2^24 in a
    float32 bucket's. Neither view is divided early: exact_weight_bound() is
    the narrowest meta's, 2^24, and a sum must be below it. With the float32
    bucket last, the float64 one would otherwise be divided by 2^24 + 1;
    with it first, by 2^24 (at the bound, not below it). Bit for bit the
    ranks' sums divided by the window's weight, the last bucket's."""
    ranks = du.run_job("large_items_two_dtypes", 2, tmp_path, module=M, narrow_first=narrow_first)
    for res in ranks:
        order = [["torch.float64"], ["torch.float32"]]
        assert res["bucket_dtypes"] == (order if narrow_first else order[::-1])
        assert res["items"] == (2**24 if narrow_first else 2**24 + 1)  # (rounded in float32)
        for i, grad in enumerate(res["grads"]):
            assert torch.equal(grad, (ranks[0]["raw"][i] + ranks[1]["raw"][i]) / res["items"]), i


def test_trace_save_refuses_what_is_not_a_list_of_traces(tmp_path):
    with pytest.raises(TypeError) as e:
        gradaccum.trace.save(str(tmp_path / "x.json"), 5)
    assert str(e.value) == ("gradaccum: gradaccum.trace.save(): traces must be a trace or a list of them "
                            "(acc.window_trace()), got int")
    assert not (tmp_path / "x.json").exists()
    with pytest.raises(TypeError) as e:
        gradaccum.trace.save(None, [{"traceEvents": []}])
    assert str(e.value) == "gradaccum: gradaccum.trace.save(): path must be a str, bytes or an os.PathLike, got NoneType"
    gradaccum.trace.save(tmp_path / "y.json", [{"traceEvents": []}])  # a pathlib.Path is a path
    assert (tmp_path / "y.json").exists()
