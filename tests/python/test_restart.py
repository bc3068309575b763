"""A rank killed with SIGKILL mid-window, torchrun restarts the job, and it
resumes from its last checkpoint to the uninterrupted result
(examples/python/train_restartable.py; Note [Resuming on another shape] for
the elastic case that comes back with fewer ranks)."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import _dist_utils as du

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "python" / "train_restartable.py"
sys.path.insert(0, str(SCRIPT.parent))
import train_restartable as tr  # noqa: E402



def env(**extra):
    e = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1", **extra)
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(var, None)
    return e


def torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def check_against_reference(out, windows=8):
    got = torch.load(out, weights_only=False)
    expected = tr.reference(tr.parse_args(["--ckpt", "-", "--windows", str(windows)]))
    diff = max(float((p - e).abs().max()) for p, e in zip(got["params"], expected))
    assert diff <= 1e-12, diff
    assert got["stats"]["optimizer_steps"] == windows  # the counters carried over the restart
    return got


@pytest.mark.parametrize("run", range(3))
def test_a_killed_rank_restarts_and_resumes_exactly(tmp_path, run):
    port = du.free_port()
    cmd = torchrun("--nnodes=1", "--nproc_per_node=2", "--max-restarts=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=restart{run}", SCRIPT,
                   "--ckpt", tmp_path / "ckpt.pt", "--kill-rank", "1", "--kill-window", str(3 + run),
                   "--out", tmp_path / "out.pt")
    proc = subprocess.run([str(c) for c in cmd], env=env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    attempts = [line for line in proc.stdout.splitlines() if line.startswith("attempt")]
    # killed in window 3+run; the last checkpoint is at the even boundary before it
    resumed_from = (3 + run) // 2 * 2
    assert attempts == ["attempt 0: 2 rank(s), K=2, from window 0",
                        f"attempt 1: 2 rank(s), K=2, from window {resumed_from}"], proc.stdout[-3000:]
    check_against_reference(tmp_path / "out.pt")


def test_a_job_relaunched_on_fewer_ranks_resumes_at_its_last_boundary(tmp_path):
    """2 ranks, rank 1 killed in window 5 with no restart left (the node is
    gone); the job launched again on 1 rank resumes the checkpoint of window 4
    with K doubled (the same global batch) and ends as the uninterrupted run."""
    port = du.free_port()
    first = torchrun("--nnodes=1", "--nproc_per_node=2", "--max-restarts=0", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=fewer", SCRIPT, "--ckpt", tmp_path / "ckpt.pt",
                     "--kill-rank", "1", "--kill-window", "5", "--out", tmp_path / "out.pt")
    proc = subprocess.run([str(c) for c in first], env=env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode != 0 and not (tmp_path / "out.pt").exists(), proc.stdout[-2000:]
    again = torchrun("--standalone", "--nproc_per_node=1", SCRIPT, "--ckpt", tmp_path / "ckpt.pt",
                     "--out", tmp_path / "out.pt")
    proc = subprocess.run([str(c) for c in again], env=env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "attempt 0: 1 rank(s), K=4, from window 4" in proc.stdout, proc.stdout[-2000:]
    assert check_against_reference(tmp_path / "out.pt")["world"] == 1


def two_agents(common, conf, host_args, other_args, tmp_path):
    """Two torchrun agents on one c10d rendezvous, as two nodes would run
    them; the first hosts the rendezvous store. Every attempt's ranks get a
    store of their own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, the recipe)."""
    def agent(is_host, args):
        cmd = torchrun(*common, conf + is_host, SCRIPT, "--ckpt", tmp_path / "ckpt.pt", *args)
        return subprocess.Popen([str(c) for c in cmd], env=env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return agent("1", host_args), agent("0", other_args)


@pytest.mark.parametrize("kill_rank", [0, 1])
def test_two_agents_restart_a_killed_rank_together(tmp_path, kill_rank):
    """Two agents (`--nnodes=2`, one rank each); one rank is killed mid-window
    5. Its agent restarts it (counting a restart); the other agent restarts
    its healthy rank, counting or not (a membership change does not count),
    so their TORCHELASTIC_RESTART_COUNTs may differ: the ranks must meet all
    the same, resume the checkpoint of window 4 on 2 ranks, and end as the
    uninterrupted run."""
    port = du.free_port()
    common = ["--nnodes=2", "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=two{kill_rank}", "--monitor-interval=0.5"]
    conf = "--rdzv-conf=is_host="
    kill = ["--kill-rank", kill_rank, "--kill-window", "5"]
    first, second = two_agents(common, conf, [*kill, "--out", tmp_path / "out.pt"], [*kill, "--out", tmp_path / "out.pt"],
                               tmp_path)
    try:
        outs = [a.communicate(timeout=240) for a in (first, second)]
    except subprocess.TimeoutExpired:
        first.kill()
        second.kill()
        pytest.fail("the two-agent restart hung")
    text = "".join(o + e[-4000:] for o, e in outs)
    assert first.returncode == 0 and second.returncode == 0, text
    starts = sorted(line.split(": ", 1)[1] for o, _ in outs for line in o.splitlines() if line.startswith("attempt"))
    assert starts == ["2 rank(s), K=2, from window 0", "2 rank(s), K=2, from window 4"], text
    assert (tmp_path / f"ckpt.pt.killed{kill_rank}").exists()  # it did die
    assert check_against_reference(tmp_path / "out.pt")["world"] == 2


def test_several_agents_sharing_one_store_are_refused_before_they_hang(tmp_path):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, two agents with restarts
    left: the recipe stops at once, saying what to set, instead of meeting
    under per-agent restart counts that may differ."""
    port = du.free_port()
    common = ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=shared", "--max-restarts=1"]
    procs = [subprocess.Popen([str(c) for c in torchrun(*common, f"--rdzv-conf=is_host={h}", SCRIPT,
                                                       "--ckpt", tmp_path / "ckpt.pt")],
                              env=env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for h in (1, 0)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the refused start hung")
    assert all(p.returncode != 0 for p in procs)
    assert "set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's environment" in "".join(e for _, e in outs)


def test_a_lost_node_comes_back_as_a_smaller_elastic_job(tmp_path):
    """Two torchrun agents (`--nnodes=1:2`, one rank each) on one c10d
    rendezvous; in window 5 the second node dies (its rank kills its agent,
    then itself). The surviving agent's rank gets the broken all-reduce's
    error, the agent restarts it, the rendezvous closes with the one node
    left, and the job resumes the checkpoint of window 4 on 1 rank with K
    doubled: the same global batches, the uninterrupted result."""
    port = du.free_port()
    common = ["--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic",
              "--monitor-interval=0.5"]
    # wait 5 s for the second node at the start; notice a dead node within ~2 s
    conf = "--rdzv-conf=last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2,is_host="
    # The rendezvous store lives in one agent: the surviving node hosts it (a
    # lost host takes the store and the job with it, whichever agent bound first).
    survivor, lost = two_agents(common, conf, ["--out", tmp_path / "out.pt"], ["--kill-node", "--kill-window", "5"],
                                tmp_path)
    try:
        out, err = survivor.communicate(timeout=240)
        lost_out, _ = lost.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        survivor.kill()
        lost.kill()
        pytest.fail("the elastic restart hung")
    assert survivor.returncode == 0, out[-3000:] + err[-5000:]
    assert lost.returncode == -9  # SIGKILL: the node is gone
    # rank 0 of the first attempt may have been on either node
    attempts = sorted(line for line in (out + lost_out).splitlines() if line.startswith("attempt"))
    assert attempts == ["attempt 0: 2 rank(s), K=2, from window 0",
                        "attempt 1: 1 rank(s), K=4, from window 4"], out[-3000:]
    assert check_against_reference(tmp_path / "out.pt")["world"] == 1
