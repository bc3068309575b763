"""The C++ LibTorch example trains data-parallel under torchrun (Gloo, 2 ranks),
and the same binary as one plain process.

`make test` builds the example against the installed CMake package first and
passes its build folder in GRADACCUM_BUILD.
"""
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("GRADACCUM_BUILD", REPO / "build"))
BINARY = BUILD / "examples" / "train_mlp"


@pytest.mark.skipif(not BINARY.exists(), reason=f"{BINARY} not built (run `make build`)")
@pytest.mark.parametrize("steps", [1, 4])
def test_cpp_example_under_torchrun(steps):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--no-python", str(BINARY), "--steps", str(steps), "--windows", "12"]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun hung: {e.stdout}\n{e.stderr}")
    out = proc.stdout
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    summary = re.search(r"ranks 2, optimizer steps (\d+), collectives per window (\d+) \(buckets (\d+)\)", out)
    assert summary, out
    steps_done, collectives, buckets = map(int, summary.groups())
    assert steps_done == 12
    assert collectives == buckets >= 1  # once per window, whatever K is
    diff = re.search(r"vs one process on the global batch: ([0-9.eE+-]+)", out)
    assert diff and float(diff.group(1)) < 1e-5, out  # float32


@pytest.mark.skipif(not BINARY.exists(), reason=f"{BINARY} not built (run `make build`)")
def test_cpp_example_as_one_plain_process():
    # The same binary without torchrun: no group, said once, local-only accumulation.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([str(BINARY), "--steps", "4", "--windows", "12"], env=env,
                          capture_output=True, text=True, timeout=150)
    out = proc.stdout
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out}\n{proc.stderr[-4000:]}"
    assert proc.stderr.count("running as one process, without a process group") == 1, proc.stderr
    summary = re.search(r"ranks 1, optimizer steps (\d+), collectives per window (\d+)", out)
    assert summary and summary.groups() == ("12", "0"), out
    diff = re.search(r"vs one process on the global batch: ([0-9.eE+-]+)", out)
    assert diff and float(diff.group(1)) < 1e-5, out
