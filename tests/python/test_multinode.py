"""Both examples trained across two "nodes": network namespaces on this machine
joined by a veth link throttled to 1 Gbit/s, launched by one torchrun per node
(`--nnodes=2 --nproc_per_node=1 --rdzv-backend=c10d`), a real multi-node launch
and rendezvous. Each example checks itself against one process on the global
batch. Needs root and iproute2; skips, saying why, where namespaces are not
allowed. The cluster (benchmarks/_netns.py) is set up and removed here.
"""
import os
import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("GRADACCUM_BUILD", REPO / "build"))
CPP_EXAMPLE = BUILD / "examples" / "train_mlp"
sys.path.insert(0, str(REPO / "benchmarks"))
import _netns  # noqa: E402

REASON = _netns.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-node emulation unavailable: {REASON}")
ENV = {"OMP_NUM_THREADS": "1"}
TIMEOUT_S = 50


@pytest.fixture(scope="module")
def cluster():
    with _netns.Cluster(nodes=2, rate="1gbit") as c:
        yield c


def traffic(cluster):
    return [cluster.tx_bytes(i) for i in range(cluster.nodes)]


def check_launch(results):
    for node, r in enumerate(results):
        assert r.returncode == 0, f"node {node}: rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    return results[0].stdout + results[1].stdout  # rank 0 is on whichever node the rendezvous chose


def test_python_example_across_two_nodes(cluster):
    before = traffic(cluster)
    results = _netns.run_torchrun(cluster, [str(REPO / "examples/python/train_ddp.py"), "--steps", "4",
                                            "--windows", "6"],
                                  sys.executable, TIMEOUT_S, env=ENV, port=29411)
    out = check_launch(results)
    assert "world size 2," in out, out
    diff = re.search(r"max \|param - reference\|: ([0-9.eE+-]+)", out)
    assert diff and float(diff.group(1)) <= 1e-4, out  # the example's own float32 tolerance
    # Every window's all-reduce crossed the veth link, both ways: each rank sends at
    # least half a gradient per window (8,970 float32 parameters).
    sent = [a - b for a, b in zip(traffic(cluster), before)]
    assert all(s > 6 * 8_970 * 4 / 2 for s in sent), sent


@pytest.mark.skipif(not CPP_EXAMPLE.exists(), reason=f"{CPP_EXAMPLE} not built (run `make build`)")
def test_cpp_example_across_two_nodes(cluster):
    before = traffic(cluster)
    results = _netns.run_torchrun(cluster, [str(CPP_EXAMPLE), "--steps", "4", "--windows", "12"],
                                  sys.executable, TIMEOUT_S, no_python=True, env=ENV, port=29412)
    out = check_launch(results)
    summary = re.search(r"ranks 2, optimizer steps (\d+), collectives per window (\d+) \(buckets (\d+)\)", out)
    assert summary, out
    steps_done, collectives, buckets = map(int, summary.groups())
    assert steps_done == 12 and collectives == buckets >= 1, out
    diff = re.search(r"vs one process on the global batch: ([0-9.eE+-]+)", out)
    assert diff and float(diff.group(1)) < 1e-5, out
    sent = [a - b for a, b in zip(traffic(cluster), before)]
    assert all(s > 12 * 9_610 * 4 / 2 for s in sent), sent  # 9,610 parameters
