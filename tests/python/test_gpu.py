"""CUDA paths: NCCL at world size 1 and Gloo over CUDA tensors with 2 ranks;
half-precision wires (bf16/fp16 buckets, comm_dtype) on both; the mixed
precision checks of test_mixed_precision.py (fp32 accumulation of bf16
gradients, GradScaler with fp16 autocast, bytes on the wire, error feedback,
a mid-window checkpoint of float32 sums), the window's loss and a NaN
micro-batch skipped, on CUDA tensors; a forward with a side stream under
bucket views and fused AdamW (_cuda_jobs.py, no CPU twin).

Each CUDA test runs the same job and the same checks as its CPU twin in the
other test files (which CI runs), on cuda:0. Run them on a CUDA machine:
`tools/gpu_run.sh` builds against the torch installed there and runs this file
and `make bench-gpu`; without CUDA these skip, as in CI.
"""
import pytest
import torch
import torch.distributed as dist

import _dist_utils as du

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
STEPS, WINDOWS = 3, 3


def check(results, steps, tol):
    for res in results:
        for reduction, r in res.items():
            for got, want in zip(r["params"], r["reference"]):
                torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=reduction)
            # no collective on micro-steps 1..K-1, one per bucket on the K-th
            expected = [r["buckets"] if (i % steps) == steps - 1 else 0 for i in range(len(r["allreduces"]))]
            assert r["allreduces"] == expected, reduction


@cuda
@pytest.mark.skipif(not dist.is_nccl_available(), reason="torch built without NCCL")
@pytest.mark.parametrize("dtype_name,tol", [("float32", 1e-5), ("float64", 1e-10)])
def test_nccl_world_size_1(tmp_path, dtype_name, tol):
    results = du.run_job("cuda_equivalence", 1, tmp_path, module="_distributed_jobs", backend="nccl", seed=5, dtype_name=dtype_name,
                         steps=STEPS, n_windows=WINDOWS, micro_batch=4)
    check(results, STEPS, tol)


@cuda
@pytest.mark.parametrize("dtype_name,tol", [("float32", 1e-5), ("float64", 1e-10)])
def test_gloo_over_cuda_tensors_two_ranks(tmp_path, dtype_name, tol):
    results = du.run_job("cuda_equivalence", 2, tmp_path, module="_distributed_jobs", backend="gloo", seed=6, dtype_name=dtype_name,
                         steps=STEPS, n_windows=WINDOWS, micro_batch=4)
    check(results, STEPS, tol)
    torch.testing.assert_close(results[0]["mean"]["params"], results[1]["mean"]["params"], rtol=0, atol=0)


@cuda
def test_cuda_single_process_bucket_views_and_bf16():
    import gradaccum

    torch.manual_seed(0)
    x, y = torch.randn(32, 5, device="cuda"), torch.randn(32, 3, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        ref = torch.nn.Linear(5, 3).cuda().to(dtype)
        model = torch.nn.Linear(5, 3).cuda().to(dtype)
        model.load_state_dict(ref.state_dict())
        torch.nn.functional.mse_loss(ref(x.to(dtype)), y.to(dtype)).backward()
        acc = gradaccum.Accumulator(model, None, steps=4)
        for xb, yb in gradaccum.split((x.to(dtype), y.to(dtype)), 4):
            acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol)


@cuda
@pytest.mark.skipif(not dist.is_nccl_available(), reason="torch built without NCCL")
def test_nccl_half_precision_wires(tmp_path):
    """bf16/fp16 buckets and comm_dtype wires over NCCL: the meta's digits sum
    exactly there too, in one all-reduce per bucket."""
    from test_mixed_precision import check_half_wires

    check_half_wires(du.run_job("half_wire", 1, tmp_path, module="_mixed_jobs", backend="nccl",
                                seed=3, steps=3, device="cuda:0"))


@cuda
def test_gloo_half_precision_wires_over_cuda_tensors(tmp_path):
    from test_mixed_precision import check_half_wires

    check_half_wires(du.run_job("half_wire", 2, tmp_path, module="_mixed_jobs", backend="gloo",
                                seed=3, steps=3, device="cuda:0"))


@cuda
@pytest.mark.parametrize("backend,world_size", [("nccl", 1), ("gloo", 1), ("gloo", 2)])
def test_cuda_fp32_accumulation_rounds_the_window_once(tmp_path, backend, world_size):
    """bf16 parameters on CUDA, accumulate_dtype=torch.float32, K=16: within one
    bf16 ulp of the float32 sum rounded once (the reducer's path at world size
    1 under NCCL, the local path under Gloo, two ranks over CUDA tensors)."""
    from test_mixed_precision import STEPS, check_bf16_window

    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("torch built without NCCL")
    check_bf16_window(du.run_job("bf16_window", world_size, tmp_path, module="_mixed_jobs",
                                 backend=backend, seed=5, steps=STEPS, device="cuda:0",
                                 use_group=backend == "nccl"),
                      grouped=world_size > 1 or backend == "nccl")


@cuda
def test_cuda_grad_scaler_with_fp16_autocast():
    """torch.amp.GradScaler("cuda") under CUDA fp16 autocast: the scale backs off,
    skipped windows step neither optimizer nor scheduler, the loss falls as the
    big batch's with its own GradScaler."""
    from test_mixed_precision import check_grad_scaler_run

    check_grad_scaler_run("cuda")


@cuda
def test_cuda_comm_dtype_halves_the_bytes(tmp_path):
    from test_mixed_precision import check_comm_bytes

    check_comm_bytes(du.run_job("comm_bytes", 2, tmp_path, module="_mixed_jobs", seed=4,
                                device="cuda:0"))


@cuda
@pytest.mark.skipif(not dist.is_nccl_available(), reason="torch built without NCCL")
@pytest.mark.parametrize("reduction", ["mean", "items"])
def test_run_survives_a_real_cuda_out_of_memory(tmp_path, reduction):
    """acc.run() on cuda:0 with NCCL (world size 1: the data-parallel path,
    closing micro-steps included): fn's allocation of 0.3 of the device per
    row fails in the caching allocator at 8 and 4 rows, and run() goes on in
    2-row parts; the result is the CPU big batch (test_run.py is its CPU twin)."""
    import _run_jobs as rj

    (res,) = du.run_job("cuda_oom", 1, tmp_path, module="_run_jobs", backend="nccl", seed=11,
                        reduction=reduction, n_windows=2)
    expected = rj.reference(11, 1, 2, 0, reduction)
    for got, want in zip(res["params"], expected["params"]):
        torch.testing.assert_close(got.double(), want, rtol=1e-9, atol=1e-9)
    for got, want in zip(res["losses"], expected["losses"]):
        assert abs(got - want) <= 1e-9 * max(1.0, abs(want)), (got, want)
    # The parts it tried (which sizes fit is the caching allocator's call;
    # on an H100 a 2-row part once failed right after another had fit).
    print("calls", res["calls"], "oom_retries", res["oom_retries"], "peak GiB", round(res["peak_gib"], 1))
    assert res["calls"][:2] == [8, 4] and max(res["calls"][2:]) <= 4, res["calls"]
    assert res["oom_retries"] >= 2 and res["max_rows"] <= 2 and res["optimizer_steps"] == 2


@cuda
@pytest.mark.parametrize("backend,world_size", [("gloo", 2), ("nccl", 1)])
def test_side_stream_forward_with_bucket_views_and_fused_adamw(tmp_path, backend, world_size):
    """A branch of the forward on a side stream, whose backward spins ~10 ms on
    the GPU first. Buckets of 1 MiB (and a first one of 1 KiB): the middle
    bucket holds that branch's gradients and those of a layer on the default
    stream, and is launched during backward by whichever of the two comes
    last (c_first: the default stream's layer, while the side stream is
    still spinning); and one bucket for all. Copies and views; fused AdamW
    stepping the views. Each window's reduced gradient and the final
    parameters against one process on the global batch (CPU, float64): a
    bucket sent before the side stream's copies landed in it would be off by
    a whole gradient."""
    import _cuda_jobs as cj

    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("torch built without NCCL")
    configs = [(True, True, 0.001, 1.0), (False, True, 0.001, 1.0), (True, False, 0.001, 1.0),
               (False, True, 4.0, 4.0)]
    results = du.run_job("side_stream_windows", world_size, tmp_path, module="_cuda_jobs", backend=backend,
                         timeout=240, seed=7, steps=2, windows=3, configs=configs)
    refs = {c_first: cj.reference(7, world_size, 2, 3, c_first) for c_first in (False, True)}
    for res in results:
        for (views, c_first, _, cap), r in zip(configs, res):
            print("views", views, "c_first", c_first, "cap", cap, "buckets", r["buckets"])
            if cap == 1.0:  # a's (2, 3) and c's (4, 5) in a bucket launched during backward
                assert any({2, 3, 4, 5} <= set(b) for b in r["buckets"][:-1]), r["buckets"]
                # (the rebuilt layout's first two buckets, from the second window on; not yet run on a GPU)
                assert all(n >= 2 for n in r["launched_in_backward"][1:]), r["launched_in_backward"]
            want_grads, want_params = refs[c_first]
            assert r["steps"] == 3 and len(r["grads"]) == 3
            for w, (got, want) in enumerate(zip(r["grads"], want_grads)):
                for i, (g, e) in enumerate(zip(got, want)):
                    torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5 * e.abs().max().item(),
                                               msg=f"window {w} param {i} views={views} c_first={c_first}")
            for g, e in zip(r["params"], want_params):
                torch.testing.assert_close(g, e, rtol=0, atol=1e-5)
    for a, b in zip(results[0], results[-1]):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@cuda
def test_cuda_window_loss_is_the_big_batch_loss(tmp_path):
    """test_window_loss.py's check on cuda:0, 2 Gloo ranks, items: the
    window's loss and metrics ride in the bucket header, summed on the device."""
    from test_window_loss import check_window_losses

    check_window_losses(du.run_job("window_losses", 2, tmp_path, module="_loss_jobs", timeout=180, seed=6,
                                   n_windows=3, last=2, reduction="items", device="cuda:0"),
                        2, "items", 3, 2, seed=6)


@cuda
def test_cuda_skip_micro_batch(tmp_path):
    """test_window_loss.py's NaN micro-batches on cuda:0, 2 Gloo ranks: the
    finite check runs on device tensors; every rank skips alike."""
    from test_window_loss import check_skip_micro_batch, skip_micro_batch_nans

    nan_at = skip_micro_batch_nans(2)
    check_skip_micro_batch(du.run_job("bad_micro_batches", 2, tmp_path, module="_loss_jobs", timeout=180, seed=9,
                                      n_windows=4, reduction="mean", nan_at=nan_at, device="cuda:0"),
                           2, nan_at, seed=9)


@cuda
@pytest.mark.parametrize("scaler_growth_interval", [None, 1])
def test_cuda_error_feedback_when_window_weights_change(tmp_path, scaler_growth_interval):
    """test_mixed_precision.py's error-feedback check on cuda:0 (residuals and
    their carry on the device), 2 Gloo ranks, items windows swinging 4096 <-> 1;
    and with a GradScaler on the device whose scale doubles after every window
    (the ratio carried into the residuals on the device)."""
    from test_mixed_precision import WEIGHTS, check_error_feedback_weights

    world, kwargs = WEIGHTS["items swinging"]
    kwargs = dict(kwargs, scaler_growth_interval=scaler_growth_interval)
    check_error_feedback_weights(du.run_job("error_feedback_changing_weights", world, tmp_path,
                                            module="_error_feedback_jobs", zero_ranks=tuple(range(1, world)),
                                            device="cuda:0", **kwargs),
                                 kwargs)


@cuda
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_mid_window_checkpoint_with_accumulate_dtype(tmp_path, world_size):
    """test_mixed_precision.py's mid-window checkpoint on cuda:0: bf16
    parameters summed in float32 buckets on the device, saved (rank-independent
    and per-rank) and resumed in a fresh Accumulator."""
    from test_mixed_precision import check_accumulate_checkpoint

    results = du.run_job("accumulate_checkpoint", world_size, tmp_path, module="_mixed_jobs", seed=10, steps=4,
                         save_at=2, device="cuda:0")
    assert all(res["saved_devices"] == ["cuda:0"] for res in results)
    check_accumulate_checkpoint(results, world_size, sandwich=False)
