"""The model-based protocol fuzzer's short, fixed-seed budget (`make fuzz` is
the long run: tools/fuzz.py).

Random schedules of ordinary calls across ranks (_fuzz_model.generate) run on
real Gloo ranks (_fuzz_jobs.fuzz_schedules, many schedules per launch) and
are held against the reference model written from the docs
(_fuzz_model.Model): every call's return value or error (class and key words),
the parameters after each epoch (1e-12 relative), window_loss, the final
micro_step and optimizer steps; a hang past the deadline or a dead rank
fails. Failures found become the regression tests at the end of this file.
"""
import json

import pytest
import torch

import _dist_utils as du
import _fuzz_jobs as fj
import _fuzz_model as fm

SEEDS = range(120)  # about a minute on 2 cores


def assert_schedules_pass(schedules, tmp_path):
    verdicts = fj.verdicts(schedules, tmp_path, batch=len(schedules))
    failing = [(s, p) for s, p in zip(schedules, verdicts) if p]
    report = []
    for sched, problems in failing[:5]:
        report.append(f"seed {sched['seed']}: {json.dumps(sched)}\n  " + "\n  ".join(problems[:8]))
    assert not failing, f"{len(failing)} of {len(schedules)} schedules fail:\n" + "\n".join(report)


# --------------------------------------------------------------------------- #
# The model itself (one process, no ranks)
# --------------------------------------------------------------------------- #

def test_the_model_is_the_big_batch_on_plain_windows():
    """Full windows, every rank in step: the model steps as one process does
    on each window's global batch (du.global_batch_loss, the suite's own
    reference), for the three reductions."""
    for reduction in ("mean", "sum", "items"):
        W, K, n_windows = 3, 2, 3
        sched = {"seed": 5, "world": W, "steps": K, "reduction": reduction, "nonfinite": "skip",
                 "net": "mlp", "momentum": 0.9,
                 "epochs": [{"end": "none", "micros": [["ok"] * (K * n_windows)] * W, "events": []}]}
        model = fm.expect(sched)
        net = fm.make_net("mlp", 5)
        opt = torch.optim.SGD(net.parameters(), lr=fm.LR[reduction], momentum=0.9)
        for w in range(n_windows):
            window = [[fm.micro_data(5, 0, r, w * K + k, "ok") for k in range(K)] for r in range(W)]
            du.global_batch_loss(net, window, reduction).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        du.assert_params_close(du.params(net), model.trace[-1], reduction)
        assert model.optimizer_steps == n_windows


def test_the_generator_is_deterministic_and_the_checker_bites():
    for seed in range(20):
        sched = fm.generate(seed)
        assert fm.generate(seed) == sched
        json.loads(json.dumps(sched))  # pastes into a test
    sched = fm.generate(3)
    model = fm.expect(sched)
    perfect = [{"obs": {k: list(v) for k, v in model.exp[r].items()}, "trace": model.trace,
                "micro_step": model.m, "window_ready": False, "optimizer_steps": model.optimizer_steps}
               for r in range(sched["world"])]
    assert fm.check(sched, perfect) == []
    off = [dict(res) for res in perfect]
    off[1] = dict(off[1], trace=[[p + 1e-9 for p in ps] for ps in off[1]["trace"]])
    assert any("parameters after epoch" in p for p in fm.check(sched, off))
    off = [dict(res) for res in perfect]
    off[0] = dict(off[0], obs=dict(off[0]["obs"]))
    off[0]["obs"].popitem()
    assert fm.check(sched, off)


def test_shrink_candidates_are_smaller_and_valid():
    sched = fm.generate(11)
    for cand in fm.shrink_candidates(sched):
        fm.expect(cand)
        assert cand != sched


# --------------------------------------------------------------------------- #
# The fixed-seed budget, on real Gloo ranks
# --------------------------------------------------------------------------- #

def test_fuzz_fixed_seeds(tmp_path):
    assert_schedules_pass([fm.generate(seed) for seed in SEEDS], tmp_path)


# --------------------------------------------------------------------------- #
# Regressions found by the fuzzer (each the smallest failing schedule)
# --------------------------------------------------------------------------- #
