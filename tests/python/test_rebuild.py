"""Buckets rebuilt once, after the first window, in the order backward made the
gradients ready (rank 0's order on every rank; Note [Rebuilding buckets in
ready order] in src/reducer.cpp). Real Gloo ranks; references are one process
in float64.
"""
import pytest
import torch
import torch.distributed as dist

import _dist_utils as du
import _rebuild_jobs as rj

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with Gloo"
)

M = "_rebuild_jobs"
SEED = 21
# Parameter indices of Reversed: head (0, 1), mid (2, 3), body (4, 5), stem (6, 7).


def run(name, world_size, tmp_path, **kwargs):
    kwargs.setdefault("timeout", 150)
    kwargs.setdefault("pg_timeout", 30)
    return du.run_job(name, world_size, tmp_path, module=M, **kwargs)


def flat(layout):
    return [i for bucket in layout for i in bucket]


def layers(layout):
    """The layers in the order the layout launches them (a layer: its 2 params)."""
    order = []
    for i in flat(layout):
        if i // 2 not in order:
            order.append(i // 2)
    return order


def assert_close(got, expected, tol, what):
    assert len(got) == len(expected), what
    for i, (a, e) in enumerate(zip(got, expected)):
        if e is None:
            assert a is None, f"{what}: parameter {i}"
            continue
        scale = max(1.0, e.abs().max().item())
        diff = (a.double() - e).abs().max().item() / scale
        assert diff <= tol, f"{what}: parameter {i}: relative difference {diff:.3g}"


VARIANTS = {
    "copy": {},
    "views": {"gradient_as_bucket_view": True},
    "off": {"rebuild_buckets": False},
    # bf16 parameters are half the bytes: smaller caps for as many buckets
    "bf16": {"dtype": "bfloat16", "accumulate_dtype": torch.float32,
             "bucket_cap_mb": 0.0003, "first_bucket_cap_mb": 0.0003},
    "bf16/off": {"dtype": "bfloat16", "accumulate_dtype": torch.float32, "rebuild_buckets": False,
                 "bucket_cap_mb": 0.0003, "first_bucket_cap_mb": 0.0003},
}


@pytest.fixture(scope="module")
def follows(tmp_path_factory):
    """Rank 1 runs the middle layers the other way round: its own ready order
    differs from rank 0's."""
    out = tmp_path_factory.mktemp("follows")
    return du.run_job("follows_backward", 2, out, module=M, timeout=200, pg_timeout=30,
                      seed=SEED, n_windows=3, swap_rank=1, variants=VARIANTS)


def test_layout_follows_rank0_backward_after_the_first_window(follows):
    for key in ("copy", "views", "bf16"):
        r0, r1 = follows[0][key], follows[1][key]
        assert r0["initial"] == r1["initial"], key
        assert layers(r0["initial"]) == [3, 2, 1, 0], key  # stem first: the guess
        # The first window was reduced in the guessed layout...
        assert r0["windows"][0]["layout"] != r0["initial"], key
        rebuilt = r0["windows"][0]["layout"]
        # ...and rebuilt at its end in rank 0's ready order: head, body, mid, stem
        # (rank 0 runs stem, body, mid, head); rank 1 (stem, mid, body, head) takes it too.
        assert layers(rebuilt) == [0, 1, 2, 3], key
        assert r1["windows"][0]["layout"] == rebuilt, key
        # once: it never changes again
        for w in r0["windows"] + r1["windows"]:
            assert w["layout"] == rebuilt and w["rebuilds"] == 1, key
        assert sorted(flat(rebuilt)) == list(range(8))
        assert r0["windows"][-1]["collectives"] == r0["windows"][-1]["buckets"], key


def test_buckets_launch_during_backward_after_the_rebuild(follows):
    for key in ("copy", "views", "bf16"):
        launched0 = [w["launched"] for w in follows[0][key]["windows"]]
        buckets = follows[0][key]["windows"][-1]["buckets"]
        assert buckets >= 3, key
        # before: bucket 0 (the stem) is ready last, nothing launches early;
        # after: every bucket but the last (which closes the window) launches
        # while backward still has gradients to make.
        assert launched0 == [0, buckets - 1, buckets - 1], (key, launched0)
        # rank 1's own order differs in the middle layers, yet it uses rank 0's
        # layout (see the test above), whose buckets it also completes early here
        assert [w["launched"] for w in follows[1][key]["windows"]][0] == 0, key
    off = [w["launched"] for w in follows[0]["off"]["windows"]]
    assert off == [0, 0, 0]
    assert all(w["rebuilds"] == 0 and w["layout"] == follows[0]["off"]["initial"]
               for w in follows[0]["off"]["windows"])


def test_results_equal_the_big_batch_whatever_the_layout(follows):
    ref = rj.reference(SEED, 2, 3, swap_rank=1)
    for key in ("copy", "views", "off"):
        for rank in range(2):
            res = follows[rank][key]
            for w, (got, expected) in enumerate(zip(res["grads"], ref["grads"])):
                assert_close(got, expected, 1e-10, f"{key} rank {rank} window {w}")
            assert_close(res["params"], ref["params"], 1e-10, f"{key} rank {rank}")
    for key in ("copy", "views", "off", "bf16"):
        for a, b in zip(follows[0][key]["params"], follows[1][key]["params"]):
            assert torch.equal(a, b), key
    # The layout changes no arithmetic: rebuilt or not, bit for bit the same.
    for on, off in (("copy", "off"), ("bf16", "bf16/off")):
        for rank in range(2):
            for a, b in zip(follows[rank][on]["params"], follows[rank][off]["params"]):
                assert torch.equal(a, b), (on, rank)


def test_bucket_views_point_into_the_rebuilt_buckets(follows):
    for rank in range(2):
        report = follows[rank]["views"]["views"]  # after the last window's reduction
        for bucket in report:
            assert all(bucket["defined"])
            assert len(set(bucket["storage"])) == 1  # one bucket, one storage
            assert bucket["nbytes"][0] >= bucket["numel"] * bucket["itemsize"]


@pytest.mark.parametrize("case", ["dropped", "flush"])
def test_rebuild_waits_for_a_window_reduced_with_hooks(tmp_path, case):
    results = run("first_window_not_reduced", 2, tmp_path, seed=SEED, case=case)
    for rank, res in enumerate(results):
        assert [a["rebuilds"] for a in res["after"]] == [0, 1, 1], (case, rank)
        assert layers(res["after"][0]["layout"]) == [3, 2, 1, 0]
        assert layers(res["after"][1]["layout"]) == [0, 1, 2, 3]
    assert results[0]["after"] == results[1]["after"]
    if case == "dropped":
        assert all("window 0" in e for res in results for e in res["errors"])
        assert [len(res["errors"]) for res in results] == [1, 1]
        expected = rj.reference(SEED, 2, 3, swap_rank=-1, skip=(0,))["params"]
    else:
        assert results[0]["errors"] == results[1]["errors"] == []
        expected = rj.reference(SEED, 2, 3, swap_rank=-1, partial=(0, 1))["params"]
    for rank, res in enumerate(results):
        assert_close(res["params"], expected, 1e-10, f"{case} rank {rank}")


def test_a_checkpoint_resumes_in_a_fresh_accumulator_that_rebuilds_alike(tmp_path):
    results = run("resume", 2, tmp_path, seed=SEED, n_windows=4, save_at=3)
    for rank, res in enumerate(results):
        assert layers(res["saved_layout"]) == [0, 1, 2, 3]
        assert layers(res["fresh_layout"]) == [3, 2, 1, 0]  # not rebuilt yet
        assert res["final_layout"] == res["saved_layout"] and res["rebuilds"] == 1
        # the snapshot's all-reduces count in all, but it is no window: the
        # last window's counters stay (they were overwritten before)
        snap = res["snapshot"]
        assert snap["collectives"] == snap["buckets"] and snap["last_after"] == snap["last_before"]
        assert snap["last_before"][0] == snap["buckets"]
        assert_close(res["resumed"], res["straight"], 1e-10, f"rank {rank}")
    for a, b in zip(results[0]["resumed"], results[1]["resumed"]):
        assert torch.equal(a, b)


def test_refresh_parameters_lays_the_buckets_out_anew_and_rebuilds_them(tmp_path):
    # bucket_rebuilds describes the current layout, like stats()["buckets"]:
    # after windows 0 and 1, after the refresh (laid out again, not yet
    # rebuilt), after window 2 (the new buckets rebuilt once)
    for res in run("refresh_rebuilds", 2, tmp_path, seed=SEED):
        assert res["counts"] == [1, 1, 0, 1]
        # the job's counters carry over, the last window's too (the refresh's
        # check adds one collective per bucket, in all only)
        after, before = res["after"], res["before"]
        assert after.pop("collectives") == before.pop("collectives") + len(res["layouts"][0])
        assert after == before and before["launched_in_backward"] > 0, (before, after)
        assert layers(res["layouts"][0]) == layers(res["layouts"][2]) == [0, 1, 2, 3]
        assert layers(res["layouts"][1]) == [3, 2, 1, 0]  # window 1, then the refresh: laid out again


def test_ranks_must_agree_on_rebuild_buckets(tmp_path):
    results = run("option_differs", 2, tmp_path)
    for res in results:
        assert res["error"] and "rebuild_buckets" in res["error"], res


def test_ranks_disagreeing_on_rebuild_buckets_unchecked_drop_the_window(tmp_path):
    results = du.run_job("option_differs_unchecked", 2, tmp_path, module="_rebuild_jobs", timeout=60,
                         pg_timeout=20)
    for res in results:
        assert res["dropped"] == 2
        for error in res["errors"]:
            assert error and "rebuild_buckets differs across ranks?" in error, error
