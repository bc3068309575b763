"""Mixed precision: fp32 accumulation of bf16 gradients, and GradScaler (fp16).

References in float32/float64: the per-micro-batch bf16 gradients summed in
fp32 and rounded once; the big batch trained with its own GradScaler.
"""
import math

import pytest
import torch
import torch.nn as nn

import gradaccum
import _dist_utils as du
import _protocol_jobs as pj

STEPS = 16


def bf16_ulps(a, b):
    """Largest distance between bf16 tensors, in units of b's last place."""
    a, b = a.float(), b.float()
    spacing = torch.where(b == 0, torch.full_like(b, 2.0 ** -133),
                          2.0 ** (torch.floor(torch.log2(b.abs())) - 7))
    return ((a - b).abs() / spacing).max().item()


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp32_accumulation_rounds_the_window_once(tmp_path, world_size):
    results = du.run_job("bf16_window", world_size, tmp_path, module="_protocol_jobs",
                         seed=5, steps=STEPS)
    micro = [g for res in results for g in res["micro"]]  # every micro-batch of every rank
    n = len(micro)
    expected = [(sum(m[i].float() for m in micro) / n).to(torch.bfloat16) for i in range(len(micro[0]))]
    worst_wide, worst_plain = 0.0, 0.0
    for res in results:
        for got, want in zip(res["torch.float32"], expected):
            assert got.dtype == torch.bfloat16
            worst_wide = max(worst_wide, bf16_ulps(got, want))
        for got, want in zip(res["None"], expected):
            worst_plain = max(worst_plain, bf16_ulps(got, want))
        if world_size > 1:
            assert res["collectives/torch.float32"] == res["buckets/torch.float32"]  # fp32 buckets: meta rides along
    assert worst_wide <= 1.0, worst_wide
    assert worst_plain > 2.0, worst_plain  # K bf16 roundings: measurably further


def test_grad_scaler_backs_off_and_skipped_windows_step_nothing():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    w_true = torch.randn(8, 1)
    y = x @ w_true

    def make():
        torch.manual_seed(1)
        model = nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=4)
        return model, opt, sched, scaler

    def loss_of(model, xb, yb):
        with torch.autocast("cpu", dtype=torch.float16):
            return (model(xb).float() - yb).pow(2).mean()

    K, windows = 4, 24
    model, opt, sched, scaler = make()
    acc = gradaccum.Accumulator(model, opt, steps=K, scheduler=sched, grad_scaler=scaler,
                                max_grad_norm=10.0)
    first = loss_of(model, x, y).item()
    for w in range(windows):
        for k in range(K):
            rows = slice((w * K + k) * 8 % 256, (w * K + k) * 8 % 256 + 8)
            acc.backward(loss_of(model, x[rows], y[rows]))
            acc.step()
    stats = acc.stats()
    assert scaler.get_scale() < 2.0 ** 20  # backed off
    assert 0 < stats["skipped_steps"] < windows // 2
    assert stats["optimizer_steps"] + stats["skipped_steps"] == windows
    assert sched.last_epoch == stats["optimizer_steps"]  # skipped windows step no scheduler
    assert all(torch.isfinite(p).all() for p in model.parameters())
    ours = loss_of(model, x, y).item()

    # The big batch with its own GradScaler.
    model, opt, sched, scaler = make()
    for w in range(windows):
        rows = [slice((w * K + k) * 8 % 256, (w * K + k) * 8 % 256 + 8) for k in range(K)]
        xb, yb = torch.cat([x[r] for r in rows]), torch.cat([y[r] for r in rows])
        scaler.scale(loss_of(model, xb, yb)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    theirs = loss_of(model, x, y).item()
    # Both fall by more than an order of magnitude, to within 1.5x of each other
    # (fp16 rounding and one overflow window more or less differ).
    assert ours < first / 10 and theirs < first / 10, (first, ours, theirs)
    assert abs(math.log(ours / theirs)) < math.log(1.5), (ours, theirs)


def test_grad_scaler_state_travels_in_the_state_dict():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    acc = gradaccum.Accumulator(model, opt, steps=2, grad_scaler=scaler)
    state = acc.state_dict()
    assert state["grad_scaler"]["scale"] == 1024.0
    acc.close()
    other = torch.amp.GradScaler("cpu", init_scale=1.0)
    acc = gradaccum.Accumulator(model, opt, steps=2, grad_scaler=other)
    acc.load_state_dict(state)
    assert other.get_scale() == 1024.0


def test_mixed_precision_arguments_are_checked():
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="accumulate_dtype must be torch.float32, torch.float64 or None"):
        gradaccum.Accumulator(model, None, steps=2, accumulate_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="grad_scaler needs an optimizer"):
        gradaccum.Accumulator(model, None, steps=2, grad_scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="accumulate_dtype and gradient_as_bucket_view exclude each other"):
        gradaccum.Accumulator(model, None, steps=2, accumulate_dtype=torch.float32,
                              gradient_as_bucket_view=True)
