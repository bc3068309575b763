"""Data parallel, the non-finite test of a window is answered by the reducer's
write-back pass (no norm pass) when it can, with exactly the skip / raise /
ignore behaviour of the norm (Note [The reducer checks the window's gradient]
in src/accumulator.cpp). Real Gloo ranks; references are one process.
"""
import math

import pytest
import torch
import torch.distributed as dist

import _dist_utils as du
import _finite_jobs as fj

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with Gloo"
)

SEED = 5


def case(value="nan", mode="skip", reduction="mean", as_view=False, flush=False, poke=False, **extra):
    return {"value": value, "mode": mode, "reduction": reduction, "as_view": as_view, "flush": flush,
            "poke": poke, **({"extra": extra} if extra else {})}


CASES = {
    "nan/skip": case(),
    "inf/skip/views": case("inf", as_view=True),
    "nan/skip/sum/views": case(reduction="sum", as_view=True),
    "huge/skip": case("huge"),  # finite gradients, but their norm overflows: skipped, as before
    "nan/skip/flush": case(flush=True, reduction="items"),
    "poke/skip": case("none", poke=True),  # a NaN written into .grad after the reduction
    "poke/skip/views": case("none", poke=True, as_view=True),
    "poke_data/skip": case("none", poke="data"),  # .grad.data = a tensor with a NaN
    "nan/raise": case(mode="raise"),
    "huge/raise/views": case("huge", mode="raise", as_view=True),
    "nan/ignore": case(mode="ignore"),
    "clean/skip": case("none"),
    "clean/skip/clip": case("none", max_grad_norm=1e9),  # clipping: the norm, as clip_grad_norm_
    # A bucket per parameter: all but the last are checked as they are written
    # back early (Note [Writing back while the last buckets reduce]).
    "nan/skip/buckets": case(bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4),
    "huge/raise/buckets": case("huge", mode="raise", bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4),
    "inf/skip/flush/buckets": case("inf", flush=True, reduction="items", bucket_cap_mb=1e-4,
                                   first_bucket_cap_mb=1e-4),
    "clean/skip/buckets": case("none", bucket_cap_mb=1e-4, first_bucket_cap_mb=1e-4),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("finite")
    return du.run_job("nonfinite_windows", 2, out, module="_finite_jobs", timeout=200, pg_timeout=30,
                      seed=SEED, cases=CASES)


def assert_close(got, expected, what):
    for i, (a, e) in enumerate(zip(got, expected)):
        scale = max(1.0, e.abs().max().item())
        diff = (a - e).abs().max().item() / scale
        assert diff <= 1e-10, f"{what}: parameter {i}: relative difference {diff:.3g}"


@pytest.mark.parametrize("key", [k for k, c in CASES.items() if c["mode"] != "ignore"])
def test_skip_and_raise_match_the_norm_on_every_rank(results, key):
    c = CASES[key]
    bad = c["value"] != "none" or c["poke"]
    skip = (fj.BAD_WINDOW,) if bad else ()
    expected = fj.reference(SEED, 2, c["reduction"], skip)
    for rank, res in enumerate(results):
        r = res[key]
        assert_close(r["params"], expected, f"{key} rank {rank}")
        assert r["stepped"] == [w not in skip for w in range(fj.N_WINDOWS)], key
        if c["mode"] == "raise" and bad:
            assert len(r["errors"]) == 1 and r["errors"][0][0] == fj.BAD_WINDOW, key
            norm = "inf" if c["value"] == "huge" else "nan"
            assert r["errors"][0][1].startswith(
                f"gradaccum: acc.step(): the window's gradient is not finite (total norm {norm}); gradients "
                "left in .grad for inspection, call acc.zero_grad() to drop the window"), r["errors"][0][1]
        else:
            assert r["errors"] == [], key
            assert r["stats"]["skipped_steps"] == len(skip), key
        # The norm is computed only where the reducer's check could not
        # answer: a failed value, a gradient changed since, or clipping.
        for w, norm in enumerate(r["norms"]):
            if "clip" in key:
                assert norm is not None and math.isfinite(norm), (key, w)
            elif w in skip:
                assert norm is not None and not math.isfinite(norm), (key, w, norm)
            else:
                assert norm is None, (key, w, norm)


def test_ignore_steps_anyway(results):
    for rank, res in enumerate(results):
        r = res["nan/ignore"]
        assert r["stepped"] == [True] * fj.N_WINDOWS
        assert all(n is None for n in r["norms"])
        assert any(torch.isnan(p).any() for p in r["params"])
        assert r["stats"]["skipped_steps"] == 0


def test_every_rank_decides_alike(results):
    for key in CASES:
        assert results[0][key]["stepped"] == results[1][key]["stepped"], key
        for a, b in zip(results[0][key]["params"], results[1][key]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=key)
