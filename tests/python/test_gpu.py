"""CUDA paths: NCCL at world size 1 and Gloo over CUDA tensors with 2 ranks;
half-precision wires (bf16/fp16 buckets, comm_dtype) on both; the mixed
precision checks of test_mixed_precision.py (fp32 accumulation of bf16
gradients, GradScaler with fp16 autocast, bytes on the wire) on CUDA tensors.

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
    results = du.run_job("cuda_equivalence", 1, tmp_path, backend="nccl", seed=5, dtype_name=dtype_name,
                         steps=STEPS, n_windows=WINDOWS, micro_batch=4)
    check(results, STEPS, tol)


@cuda
@pytest.mark.parametrize("dtype_name,tol", [("float32", 1e-5), ("float64", 1e-10)])
def test_gloo_over_cuda_tensors_two_ranks(tmp_path, dtype_name, tol):
    results = du.run_job("cuda_equivalence", 2, tmp_path, backend="gloo", seed=6, dtype_name=dtype_name,
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
