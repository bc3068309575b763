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
import _error_feedback_jobs
import _mixed_jobs

STEPS = 16


def bf16_ulps(a, b):
    """Largest distance between bf16 tensors, in units of b's last place."""
    a, b = a.float(), b.float()
    spacing = torch.where(b == 0, torch.full_like(b, 2.0 ** -133),
                          2.0 ** (torch.floor(torch.log2(b.abs())) - 7))
    return ((a - b).abs() / spacing).max().item()


def check_bf16_window(results, grouped):
    """What bf16_window returned: fp32 accumulation within 1 bf16 ulp of the
    float32 sum of every micro-batch's gradient rounded once; bf16 accumulation
    measurably further; through a group, one collective per (float32) bucket."""
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
        if grouped:
            assert res["collectives/torch.float32"] == res["buckets/torch.float32"]  # fp32 buckets: meta rides along
    assert worst_wide <= 1.0, worst_wide
    assert worst_plain > 2.0, worst_plain  # K bf16 roundings: measurably further


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp32_accumulation_rounds_the_window_once(tmp_path, world_size):
    check_bf16_window(du.run_job("bf16_window", world_size, tmp_path, module="_mixed_jobs",
                                 seed=5, steps=STEPS), grouped=world_size > 1)


def check_grad_scaler_run(device):
    """fp16 autocast with a GradScaler whose first scale overflows, against the
    big batch trained with its own GradScaler, on `device` ("cpu" or "cuda")."""
    torch.manual_seed(0)
    x = torch.randn(256, 8).to(device)
    w_true = torch.randn(8, 1).to(device)
    y = x @ w_true

    def make():
        torch.manual_seed(1)
        model = nn.Linear(8, 1).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 20, growth_interval=4)
        return model, opt, sched, scaler

    def loss_of(model, xb, yb):
        with torch.autocast(device, dtype=torch.float16):
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


def test_grad_scaler_backs_off_and_skipped_windows_step_nothing():
    check_grad_scaler_run("cpu")


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


# --------------------------------------------------------------------------- #
# Half-precision wires: one collective per bucket, comm_dtype, error feedback
# --------------------------------------------------------------------------- #

def _relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def check_half_wires(results):
    """What half_wire returned: one all-reduce per bucket, and the window's
    gradient against the float64 reference."""
    ref_sum = [sum(r["ref_sum"][i] for r in results) for i in range(len(results[0]["ref_sum"]))]
    items = sum(r["items"] for r in results)
    expected = [s / items for s in ref_sum]
    for res in results:
        for name, *_ in _mixed_jobs.HALF_CASES:
            case = res[name]
            assert case["buckets"] >= 3, name
            assert case["allreduces"] == case["buckets"], (name, case)  # profiler, every micro-step
            assert case["collectives"] == case["buckets"], (name, case)
            # A wrong weight would be off by a rank's share (> 10%); half
            # precision rounding stays within a few percent.
            for got, want in zip(case["grads"], expected):
                assert _relative(got, want) < 0.03, (name, _relative(got, want))


@pytest.mark.parametrize("world_size", [2, 4])
def test_half_precision_buckets_take_one_collective_each(tmp_path, world_size):
    """bf16/fp16 buckets and comm_dtype wires carry the meta exactly (fractional,
    uneven items weights) in the bucket's own collective."""
    check_half_wires(du.run_job("half_wire", world_size, tmp_path, module="_mixed_jobs", seed=3, steps=3))


def check_comm_bytes(results):
    """What comm_bytes returned: bf16/fp16 wires carry half the bytes (our
    counters, the profiler's, the loopback link's), within their rounding."""
    for res in results:
        full = res["None"]
        for comm in ("torch.bfloat16", "torch.float16"):
            half = res[comm]
            assert half["allreduces"] == full["allreduces"] == full["buckets"]
            # Our byte counts against the profiler's element counts.
            assert half["bytes"] == 2 * half["elements"] and full["bytes"] == 4 * full["elements"]
            assert 0.49 < half["bytes"] / full["bytes"] < 0.51, (comm, half["bytes"], full["bytes"])
            # Independent of our counters: what Gloo put on the loopback link.
            assert 0.4 < half["lo_bytes"] / full["lo_bytes"] < 0.6, (comm, half["lo_bytes"], full["lo_bytes"])
            # Within the wire's rounding of fp32 communication, but not equal to it.
            eps = 2.0 ** -7 if comm == "torch.bfloat16" else 2.0 ** -10
            for got, want in zip(half["grads"], full["grads"]):
                assert 0 < _relative(got, want) < eps, (comm, _relative(got, want))
    assert all(torch.equal(a, b) for a, b in zip(results[0]["torch.bfloat16"]["grads"],
                                                   results[1]["torch.bfloat16"]["grads"]))


def test_comm_dtype_halves_the_bytes(tmp_path):
    check_comm_bytes(du.run_job("comm_bytes", 2, tmp_path, module="_mixed_jobs", seed=4))


def test_fp16_wire_scales_before_the_sum(tmp_path):
    """16 micro-steps of gradients near 5000: their local sum would overflow
    fp16 (> 65504); scaled by 1/(world * steps) first, it does not."""
    results = du.run_job("fp16_headroom", 2, tmp_path, module="_mixed_jobs", seed=6, steps=16)
    for res in results:
        for got, want in zip(res["torch.float16"], res["None"]):
            assert torch.isfinite(got).all()
            assert want.abs().max() * 16 > 65504  # the unscaled local sum would overflow
            assert _relative(got, want) < 2.0 ** -9


def test_error_feedback_reaches_the_fp32_loss(tmp_path):
    results = du.run_job("error_feedback_regression", 2, tmp_path, module="_error_feedback_jobs",
                         seed=8, windows=200, steps=2)
    res = results[0]
    print(f"\nfinal loss after 200 windows: fp32 {res['fp32']:.6g}, bf16 {res['bf16']:.6g}, "
          f"bf16 + error feedback {res['bf16+ef']:.6g}")
    assert res["residual_norm"] > 0
    assert res["bf16+ef"] != res["bf16"]
    assert abs(res["bf16+ef"] / res["fp32"] - 1) < 0.01, res


def _single(counts):
    """One micro-batch per window: counts[w][rank] rows."""
    return [[[n] for n in per_rank] for per_rank in counts]


# Window weights that swing by orders of magnitude (an "items" window of 4096
# rows, then one of a single row, ...; "mean" windows of 4 micro-steps, then
# a flushed one of 1), and steady ones where the ranks' shares differ.
WEIGHTS = {
    "items swinging": (2, dict(reduction="items", steps=1, windows=_single(
        [[4096, 4096], [1, 1], [4096, 4096], [1, 1], [64, 64], [2, 2]]))),
    "mean+flush": (2, dict(reduction="mean", steps=4,
                           windows=[[[64] * 4] * 2, [[64]] * 2, [[64] * 4] * 2, [[64]] * 2, [[64] * 2] * 2])),
    "items uneven": (4, dict(reduction="items", steps=1, windows=_single([[1300, 100, 100, 100]] * 5))),
    # Uneven shards: rank 0 has no micro-batch left for the epoch's flushed window.
    "mean+flush, rank 0 out": (2, dict(reduction="mean", steps=8,
                                       windows=[[[64] * 8] * 2, [[], [64]], [[64] * 8] * 2, [[64] * 8] * 2])),
}


@pytest.mark.parametrize("case", sorted(WEIGHTS))
def test_error_feedback_loses_nothing_when_window_weights_change(tmp_path, case):
    """Error feedback's promise, exactly: over any run of windows, what the
    optimizer got plus what the ranks still hold back (each residual over its
    rank's share of the last window's global weight) is the float32 wire's
    sum. Only rank 0's gradients are non-zero, so the bf16 sum over ranks
    rounds nothing and only compression loses. A residual carried into a
    window as it was (the units of the window before it) broke this by the
    ratio of the two windows' weights; so did one rescaled by world x this
    rank's weight over the last global weight wherever a rank's share is not
    1 / world (rank 0 holds 13/16 in "items uneven"). A window where rank 0
    has no weight holds its residual back, whole: sent there, it reached the
    optimizer at the other ranks' weight."""
    world, kwargs = WEIGHTS[case]
    check_error_feedback_weights(du.run_job("error_feedback_changing_weights", world, tmp_path,
                                            module="_error_feedback_jobs", zero_ranks=tuple(range(1, world)), **kwargs),
                                 kwargs)


@pytest.mark.parametrize("case", ["items swinging", "mean+flush"])
def test_error_feedback_follows_a_growing_loss_scale(tmp_path, case):
    """The same promise with a GradScaler whose scale doubles after every
    window: a residual is in the units of its window's scaled gradients, so
    it must grow with the scale before the next window takes it. Carried as
    it was, each window's residual reached the optimizer at half its size."""
    world, kwargs = WEIGHTS[case]
    kwargs = dict(kwargs, scaler_growth_interval=1)
    results = du.run_job("error_feedback_changing_weights", world, tmp_path, module="_error_feedback_jobs",
                         zero_ranks=tuple(range(1, world)), **kwargs)
    assert results[0]["scale"] == [2.0 ** (9 + w) for w in range(len(kwargs["windows"]))]
    check_error_feedback_weights(results, kwargs)


def check_error_feedback_weights(results, kwargs):
    """The check of test_error_feedback_loses_nothing_when_window_weights_change
    (test_gpu.py runs it on CUDA tensors)."""
    res = results[0]
    def weight(rows):
        return sum(rows) if kwargs["reduction"] == "items" else len(rows)

    got = want = plain = 0
    for w, per_rank in enumerate(kwargs["windows"]):
        got = got + res["bf16+ef"][w]
        plain = plain + res["bf16"][w]
        want = want + res["fp32"][w]
        assert all(r["held"][w][0].abs().max() == 0 for r in results[1:])  # zero gradients, nothing rounded
        if weight(per_rank[0]) == 0:  # held back: the window is the other ranks' zeros, exactly
            assert torch.equal(res["bf16+ef"][w], res["fp32"][w]) and not res["fp32"][w].any()
            assert torch.equal(res["held"][w][0], res["held"][w - 1][0])
            assert res["held"][w][1] == res["held"][w - 1][1]
            continue
        assert res["held"][w][1] == weight(per_rank[0])
        held_back = res["held"][w][0] / sum(weight(rows) for rows in per_rank)
        if "scale" in res:  # held in the units of the next window's scaled gradients
            held_back = held_back * kwargs["steps"] / res["scale"][w]
        assert _relative(got + held_back, want) < 1e-6, w
        assert _relative(plain, want) > 1e-4, w  # bf16 alone loses what it rounds
    assert res["held"][-1][0].abs().max() > 0


def test_error_feedback_with_shares_that_change_stays_within_bf16_rounding(tmp_path):
    """Both ranks with data, their shares of the items changing from window
    to window: a window of a few items after one of 4096 gets its gradient
    within bf16's rounding (carried as it was, the heavy window's residual
    made it 0.46-0.65 off), and what the optimizer got over the run is closer
    to float32's than without error feedback."""
    counts = [[4096, 4096], [1, 3], [4096, 4096], [3, 1], [64, 64], [2, 5], [900, 100], [100, 900]]
    results = du.run_job("error_feedback_changing_weights", 2, tmp_path, module="_error_feedback_jobs",
                         reduction="items", steps=1, windows=_single(counts))
    res = results[0]
    for w in (1, 3, 5):  # light windows after heavier ones
        assert _relative(res["bf16+ef"][w], res["fp32"][w]) < 2.0 ** -8, w
    want = sum(res["fp32"])
    assert _relative(sum(res["bf16+ef"]), want) < _relative(sum(res["bf16"]), want)


def test_error_feedback_residual_travels_in_per_rank_states(tmp_path):
    results = du.run_job("error_feedback_checkpoint", 2, tmp_path, module="_error_feedback_jobs",
                         seed=9, steps=2)
    for res in results:
        assert "error_feedback_residuals" not in res["independent_keys"]
        for a, b in zip(res["resumed"], res["uninterrupted"]):
            assert torch.equal(a, b)
        assert "not supported with comm_dtype" in res["mid_window"]
        assert res["micro_step_after_refusal"] == 1


def test_ranks_must_agree_on_comm_dtype(tmp_path):
    results = du.run_job("comm_dtype_mismatch", 2, tmp_path, module="_mixed_jobs")
    for message in results:
        assert message is not None
        assert "the ranks disagree on comm_dtype (rank 0: BFloat16, rank 1: None)" in message


def test_comm_dtype_arguments_are_checked():
    model = nn.Linear(2, 1)
    with pytest.raises(ValueError, match="comm_dtype must be torch.bfloat16, torch.float16, torch.float32 or None"):
        gradaccum.Accumulator(model, None, steps=2, comm_dtype=torch.float64)
    with pytest.raises(ValueError, match="error_feedback=True needs a comm_dtype"):
        gradaccum.Accumulator(model, None, steps=2, error_feedback=True)
    with pytest.raises(TypeError, match="error_feedback must be a bool"):
        gradaccum.Accumulator(model, None, steps=2, comm_dtype=torch.bfloat16, error_feedback=1)
    # One process: nothing travels, comm_dtype changes nothing.
    acc = gradaccum.Accumulator(model, None, steps=1, comm_dtype=torch.bfloat16, process_group=False)
    acc.backward(model(torch.ones(1, 2)).sum())
    assert torch.equal(model.weight.grad, torch.ones(1, 2))


@pytest.mark.parametrize("world_size,sandwich", [(1, False), (2, False), (2, True)])
def test_mid_window_checkpoint_with_accumulate_dtype(tmp_path, world_size, sandwich):
    """sandwich: the wide bucket sits between float32 buckets (a checkpoint's
    collective must leave every wide bucket as it was, not only the outer ones)."""
    check_accumulate_checkpoint(du.run_job("accumulate_checkpoint", world_size, tmp_path, module="_mixed_jobs",
                                           seed=10, steps=4, save_at=2, sandwich=sandwich),
                                world_size, sandwich)


def check_accumulate_checkpoint(results, world_size, sandwich):
    for res in results:
        if sandwich:
            assert res["buckets"] == [[5, 4], [3, 2], [1, 0]]  # the bf16 one in the middle
        else:
            assert res["saved_dtypes"] == ["torch.float32"]  # the wide sums, not bf16 roundings
        for kind in ("independent", "per_rank"):
            for got, want in zip(res[kind], res["uninterrupted"]):
                assert got.dtype == want.dtype
                if kind == "per_rank" or world_size == 1:
                    assert torch.equal(got, want), kind
                elif got.dtype == torch.bfloat16:
                    # Each rank holds half the float32 sum: other summation order, one rounding.
                    assert bf16_ulps(got, want) <= 1.0, kind
                else:
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_error_feedback_skips_an_overflowing_window_and_recovers(tmp_path):
    for res in du.run_job("error_feedback_overflow", 2, tmp_path, module="_error_feedback_jobs"):
        assert res["stepped"] == [False, True, True, True]
        assert res["finite"] and res["params_finite"]


def test_a_weight_too_large_for_half_precision_meta_drops_the_window_on_every_rank(tmp_path):
    results = du.run_job("weight_too_large", 2, tmp_path, module="_mixed_jobs", timeout=60)
    for res in results:
        assert "window 0 was dropped on every rank: rank 0's window weight (micro-steps or items) " \
               "is larger than 2147483647" in res["error"], res["error"]
        assert res["dropped"] == 1
    assert torch.equal(results[0]["after"], results[1]["after"])


def test_error_feedback_residuals_move_with_rebuilt_buckets(tmp_path):
    for res in du.run_job("error_feedback_rebuild", 2, tmp_path, module="_error_feedback_jobs", seed=12, windows=4):
        assert res[True]["rebuilds"] == 1 and res[False]["rebuilds"] == 0
        for a, b in zip(res[True]["params"], res[False]["params"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_skipped_window_leaves_no_error_feedback_residual(tmp_path, nonfinite):
    """Window 1 overflows in one head while the other's gradient is huge but
    finite: skipped (or raised, then dropped with zero_grad()), its rounding
    residual is discarded, and window 2 is within bf16 rounding of its float64
    reference (the leak was ~1e3 off on a gradient of ~1)."""
    results = du.run_job("error_feedback_partial_overflow", 2, tmp_path, module="_error_feedback_jobs",
                         nonfinite=nonfinite)
    model = _error_feedback_jobs._TwoHeads().double()
    (sum(model(_error_feedback_jobs.two_heads_data(r, 2).double()) for r in range(2)) / 2).backward()
    want = model.a.weight.grad.float()
    for res in results:
        assert res["stepped"][0] is True and res["stepped"][2] is True
        if nonfinite == "skip":
            assert res["stepped"][1] is False
        else:
            assert "the window's gradient is not finite" in res["stepped"][1]
        assert res["residual_after_skip"] == 0.0
        assert _relative(res["grad_a/2"], want) < 2.0 ** -7, _relative(res["grad_a/2"], want)
    assert torch.equal(results[0]["grad_a/2"], results[1]["grad_a/2"])


@pytest.mark.parametrize("comm_dtype", [None, "bfloat16"])
def test_a_window_weight_too_small_for_half_precision_meta_drops_the_window(tmp_path, comm_dtype):
    """Rank 0 counts num_items=1e-10, rank 1 one item: float32 wires divide
    exactly; a bf16 wire's meta cannot carry rank 0's weight (it rounded to 0;
    alone, the window went undivided), so the window is dropped on every rank
    with the reason, and training goes on."""
    results = du.run_job("tiny_items_weight", 2, tmp_path, module="_mixed_jobs",
                         comm_dtype=comm_dtype, num_items=1e-10, timeout=60)
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    (sum(model(torch.ones(2, 3, dtype=torch.float64) * (r + 1)).sum() for r in range(2)) / (1 + 1e-10)).backward()
    for res in results:
        if comm_dtype is None:
            assert _relative(res["grad"].double(), model.weight.grad) < 1e-6
            assert res["dropped"] == 0
        else:
            assert "window 0 was dropped on every rank: rank 0's window weight (its num_items summed " \
                   "over the window) is below 0.00012207 (2^-13), too small for a bf16/fp16 bucket's " \
                   "meta to carry exactly" in res["error"], res["error"]
            assert res["grad_none"] and res["dropped"] == 1
        assert torch.isfinite(res["next"]).all()
    assert torch.equal(results[0]["next"], results[1]["next"])


@pytest.mark.parametrize("comm_dtype", ["bfloat16", "float16"])
def test_items_over_a_half_precision_wire_resumes_bit_for_bit(tmp_path, comm_dtype):
    for res in du.run_job("items_wire_resume", 2, tmp_path, module="_mixed_jobs", comm_dtype=comm_dtype):
        assert res["last_weight"] > 0
        assert res["residual"] > 0
        assert res["weights"][0] > 0 and res["weights"][0] != res["weights"][1]  # the residual is carried rescaled
        for a, b in zip(res["resumed"], res["uninterrupted"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("then", ["zero_grad", "retry"])
def test_a_step_that_raises_after_unscaling_leaves_the_grad_scaler_usable(then):
    """optimizer.step() raises once after GradScaler.unscale_(): update() still
    closes the scaler's window, so the next windows step (torch would otherwise
    raise "unscale_() has already been called" at every later window); a retry
    of step() on the closed window does not unscale it twice: the run equals
    one whose optimizer never failed (retry), or that dropped the window."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def run(failing):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fail = [failing]
        real_step = opt.step

        def flaky_step(*args, **kwargs):
            if fail[0]:
                fail[0] = False
                raise RuntimeError("transient optimizer failure")
            return real_step(*args, **kwargs)

        opt.step = flaky_step
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        acc = gradaccum.Accumulator(model, opt, steps=2, grad_scaler=scaler)
        outcomes = []
        for w in range(3):
            for k in range(2):
                acc.backward(model(x[4 * k:4 * k + 4]).pow(2).mean())
            try:
                outcomes.append(acc.step())
            except RuntimeError as e:
                outcomes.append(str(e))
                if then == "zero_grad":
                    acc.zero_grad()
                else:
                    outcomes.append(acc.step())
        return outcomes, [p.detach().clone() for p in model.parameters()], acc.stats(), scaler.get_scale()

    outcomes, params, stats, scale = run(True)
    if then == "zero_grad":
        assert outcomes == ["transient optimizer failure", True, True]
        assert stats["optimizer_steps"] == 2
    else:
        assert outcomes == ["transient optimizer failure", True, True, True]
        assert stats["optimizer_steps"] == 3
        _, want, _, want_scale = run(False)
        assert all(torch.equal(a, b) for a, b in zip(params, want)), (params, want)
        assert scale == want_scale


def test_error_feedback_residuals_load_only_onto_their_parameters(tmp_path):
    """Note [A held gradient belongs to a named parameter]: real residuals of
    layer a are refused where layer b is trained (they restart at zero when
    left out); a state whose residuals are all None (the wire kept nothing)
    holds nothing and loads onto any set, as any boundary state. Residuals
    on the meta device are refused by name (before: a raw torch error)."""
    for res in du.run_job("error_feedback_state_on_another_set", 2, tmp_path, module="_error_feedback_jobs"):
        real, none = res["torch.float64"], res["torch.float32"]
        assert real["held"] == [True, True] and none["held"] == [False, False]
        assert real["refused"] == (
            "gradaccum: acc.load_state_dict(): the state holds error-feedback residuals of other trainable "
            "parameters than this Accumulator's (trained when saved, not here: 'a.weight', 'a.bias'; trained "
            "here, not when saved: 'b.weight', 'b.bias' (or renamed: the model wrapped in another module?)), so they would land on the wrong parameters. Resume with the trainable "
            "parameters that saved it (the same requires_grad settings), or leave out its "
            "'error_feedback_residuals' (they restart at zero, as after acc.refresh_parameters())")
        assert none["refused"] is None
        assert real["micro_step"] == none["micro_step"] == 0
        # residuals without values (meta) are refused by name (the first in bucket order), changing nothing
        assert real["meta_refused"] == (
            "gradaccum: acc.load_state_dict(): the error-feedback residual of a.bias is a Strided tensor on "
            "meta; a state's residuals are dense tensors holding values, as acc.state_dict() saves them")
        assert real["meta_untouched"] and none["meta_refused"] is None


@pytest.mark.parametrize("comm_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["flush", "items", "items+error_feedback"])
def test_a_window_far_lighter_than_the_fp16_scale_is_sent_again(tmp_path, comm_dtype, case):
    """Note [Re-sending a light window]: a flush() window of 1 micro-batch
    after windows of 16, or an "items" window of 1 item per micro-batch
    after one of 4096: an fp16 wire scaled for the full window carries it 16
    (4096) times smaller, in fp16's subnormal range. Every rank sends its
    fp16 buckets again at the window's own weight: one more all-reduce per
    bucket in that window only, and fp16's own rounding. A bf16 wire has the
    range: never re-sent. No warning either way."""
    items = case.startswith("items")
    results = du.run_job("light_fp16_window", 2, tmp_path, module="_mixed_jobs", comm_dtype=comm_dtype, steps=16,
                         flush_after=16 if items else 1, reduction="items" if items else "mean",
                         error_feedback=case.endswith("error_feedback"))
    for rank, res in enumerate(results):
        assert res["warnings"] == "", (rank, res["warnings"])
        assert res["full"] == res["buckets"] == 1
        assert res["light"] == (2 if comm_dtype == "float16" else 1), (rank, res["light"])
        rel = float((res["got"] - res["ref"]).abs().max() / res["ref"].abs().max())
        # sent at the full window's scale, fp16 erred by 3.1e-3 (flush), and the items window arrived as
        # zeros (relative error 1.0); re-sent, 4.8e-4 and 4.7e-4
        assert rel < (2 ** -7 if comm_dtype == "bfloat16" else 2 ** -10), (rank, rel)
        assert torch.equal(res["got"], results[0]["got"])



@pytest.mark.parametrize("divided,acc_steps,items_before", [(False, 16, False), (True, 16, False), (True, 1, False),
                                                        (True, 16, True)])
def test_the_manual_path_scales_an_fp16_wire_as_a_summed_loss_and_never_resends(tmp_path, divided, acc_steps,
                                                                                items_before):
    """A plain loss.backward()'s reduction is scaled for world * steps, as
    for a loss summed over the window's micro-steps (torch DDP's no_sync
    example): 16 micro-steps of gradients near 5000 (a local sum past fp16's
    65504) stay finite. Its weight (1 per rank) says nothing of its size,
    so it is never sent twice (Note [Re-sending a light window]): sent
    again at that weight, the summed one would overflow. A loss divided by
    `steps` travels 16 times smaller and loses up to 4 bits (5.2e-3 here);
    built with steps=1, the Accumulator scales for world alone: fp16's
    rounding. With "items", after a window of 4096 items per micro-batch,
    still world * steps: scaled for that window's weight instead, the
    manual reduction arrived as zeros."""
    results = du.run_job("manual_path_fp16", 2, tmp_path, module="_mixed_jobs", steps=16, divided=divided,
                         acc_steps=acc_steps, items_before=items_before)
    for rank, res in enumerate(results):
        assert res["collectives"] == res["buckets"] == 1, (rank, res["collectives"])
        assert divided or res["local"] > 65504, res["local"]
        rel = float((res["got"] - res["ref"]).abs().max() / res["ref"].abs().max())
        assert rel < (2 ** -7 if divided and acc_steps > 1 else 2 ** -10), (rank, rel)
