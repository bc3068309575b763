"""An emulated cluster on one machine: network namespaces joined by throttled links.

Used by benchmarks/bench_net.py and tests/python/test_multinode.py (not meant
to be run by hand). Needs root and iproute2 (`ip`, `tc`).

    reason = unavailable_reason()          # None, or why namespaces cannot be used here
    with Cluster(nodes=2, rate="1gbit", delay="0.2ms") as cluster:
        procs = [cluster.popen(i, ["torchrun", ...]) for i in range(2)]

Topology. Each node is a network namespace with one interface, `eth0`, at
10.77.0.(i+1)/24. Two nodes are one veth pair; more nodes hang off a bridge
that lives in a namespace of its own (a switch), one veth per node. Every
link is throttled in both directions: a token bucket (`tbf`) on each end's
egress, or `netem` (rate and delay) where the kernel has it. Nothing is
created outside these namespaces, no address outside them is used, and
everything is removed on exit (also after an error).

Gloo finds its own address by resolving the host name, which here resolves to
127.0.0.1: that would make a rank advertise loopback to its peers. `ip netns
exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts, so each node gets a
hosts file naming the host name as its own 10.77.0.x; the Python (torch) and
C++ (gradaccum::init_process_group_from_env) Gloo groups then both bind eth0.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from typing import List, Optional, Sequence

SUBNET = "10.77.0"
IFACE = "eth0"
NETNS_ETC = "/etc/netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _rate_bits(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for u, f in units.items():
        if rate.endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"rate {rate!r}: expected e.g. 1gbit, 200mbit")


def _netem_available(ns: str) -> bool:
    return _has_qdisc(ns, ["netem", "delay", "1ms"])


def _has_qdisc(ns: str, spec: List[str]) -> bool:
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "lo", "root", *spec],
                       capture_output=True, text=True, timeout=30)
    if r.returncode == 0:
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"],
                       capture_output=True, timeout=30)
    return r.returncode == 0


def unavailable_reason() -> Optional[str]:
    """None when namespaces, veth links and tbf can be set up here; else why not."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"`{tool}` not found: install iproute2 (apt-get install iproute2)"
    probe = f"gaprobe{os.getpid()}"
    try:
        r = _ip("netns", "add", probe, check=False)
        if r.returncode != 0:
            return f"`ip netns add` is not allowed here: {r.stderr.strip()}"
        r = _ip("-n", probe, "link", "add", "name", "gaa", "type", "veth", "peer", "name", "gab", check=False)
        if r.returncode != 0:
            return f"veth links are not allowed here: {r.stderr.strip()}"
        if not _has_qdisc(probe, ["tbf", "rate", "1gbit", "burst", "128kb", "latency", "10ms"]):
            return "the kernel has no tbf qdisc (tc): links cannot be throttled"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"network namespaces unavailable: {e}"
    finally:
        _ip("netns", "del", probe, check=False)


_OURS = re.compile(r"^ga(\d+)x\d+(n\d+|sw)$")


def remove_stale() -> None:
    """Remove namespaces a killed run of ours left behind (named after its pid, now gone).

    A run killed by a signal (a CI timeout) skips its clean-up; its processes
    are gone once its pid is, and so is any use of its namespaces.
    """
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _OURS.match(name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _ip("netns", "del", name, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)


class Cluster:
    """`nodes` namespaces on one subnet; links throttled to `rate` (None: unthrottled)."""

    def __init__(self, nodes: int, rate: Optional[str] = None, delay: Optional[str] = None):
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        self.nodes = nodes
        self.rate = rate
        self.delay = delay
        tag = f"ga{os.getpid()}x{int(time.monotonic() * 1000) % 1000}"
        self.names = [f"{tag}n{i}" for i in range(nodes)]
        self.switch = f"{tag}sw" if nodes > 2 else None
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.delay_emulated = False
        self.shaper = "none"
        self._made: List[str] = []

    # -- set up / tear down --
    def __enter__(self) -> "Cluster":
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        remove_stale()
        host = socket.gethostname()
        for i, ns in enumerate(self.names):
            self._add_ns(ns)
            os.makedirs(os.path.join(NETNS_ETC, ns), exist_ok=True)
            with open(os.path.join(NETNS_ETC, ns, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.addresses[i]} {host}\n")
        ends = []  # (namespace, interface) of every link end, to throttle
        if self.nodes == 2:
            _ip("link", "add", IFACE, "netns", self.names[0], "type", "veth", "peer", "name", IFACE,
                "netns", self.names[1])
            ends = [(ns, IFACE) for ns in self.names]
        elif self.nodes > 2:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                port = f"p{i}"
                _ip("link", "add", IFACE, "netns", ns, "type", "veth", "peer", "name", port, "netns",
                    self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0")
                _ip("-n", self.switch, "link", "set", port, "up")
                ends += [(ns, IFACE), (self.switch, port)]
        for i, ns in enumerate(self.names):
            if self.nodes > 1:
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", IFACE)
                _ip("-n", ns, "link", "set", IFACE, "up")
            else:  # one node: no link, its address on loopback (a world of one)
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/32", "dev", "lo")
        if self.rate and ends:
            self.delay_emulated = bool(self.delay) and _netem_available(self.names[0])
            for ns, dev in ends:
                self._throttle(ns, dev)

    def _throttle(self, ns: str, dev: str) -> None:
        bits = _rate_bits(self.rate)
        if self.delay_emulated:
            # netem: rate and one-way delay in one qdisc; queue of ~20 ms at that rate.
            limit = max(1000, int(bits / 8 / 1500 * 0.02))
            spec = ["netem", "delay", self.delay, "rate", self.rate, "limit", str(limit)]
            self.shaper = f"netem rate {self.rate} delay {self.delay}"
        else:
            # Token bucket: a burst of 1 ms at the rate (at least 64 KiB, so that the
            # veth's GSO packets pass), a queue of 10 ms.
            burst = max(64 * 1024, int(bits / 8 / 1000))
            spec = ["tbf", "rate", self.rate, "burst", str(burst), "latency", "10ms"]
            self.shaper = f"tbf rate {self.rate}" + (" (no netem in this kernel: no added delay)"
                                                     if self.delay else "")
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *spec],
                       check=True, capture_output=True, text=True, timeout=30)

    def close(self) -> None:
        # Deleting a namespace deletes its interfaces, and a veth with its peer.
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        for ns in self.names:
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        self._made = []

    # -- running things on a node --
    def command(self, node: int, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.names[node], *argv]

    def tx_bytes(self, node: int) -> int:
        """Bytes node `node` has sent on its link so far."""
        r = subprocess.run(self.command(node, ["cat", f"/sys/class/net/{IFACE}/statistics/tx_bytes"]),
                           capture_output=True, text=True, check=True, timeout=30)
        return int(r.stdout)

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, argv), **kwargs)

    def torchrun(self, node: int, argv: Sequence[str], python: str, port: int, run_id: str,
                 no_python: bool = False) -> List[str]:
        """torchrun on `node`: one of `nodes` nodes, one process each, c10d rendezvous on node 0."""
        launcher = [python, "-m", "torch.distributed.run", f"--nnodes={self.nodes}", "--nproc_per_node=1",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={self.addresses[0]}:{port}", f"--rdzv-id={run_id}",
                    "--max-restarts=0", "--monitor-interval=0.1", f"--local-addr={self.addresses[node]}"]
        if no_python:
            launcher.append("--no-python")
        return self.command(node, [*launcher, *argv])


def run_torchrun(cluster: Cluster, argv: Sequence[str], python: str, timeout: float, no_python: bool = False,
                 env: Optional[dict] = None, port: int = 29400, attempts: int = 2) -> List[subprocess.CompletedProcess]:
    """Launch `argv` under torchrun on every node of `cluster`; wait (bounded) for all.

    torchrun starts its workers in sessions of their own, so killing a launcher
    leaves them (and the pipes they hold) alive: on a time-out every process in
    the cluster's namespaces is killed. A launch that timed out (an emulated
    rendezvous that never formed, seen about once in a few dozen launches) is
    tried again, with a fresh rendezvous id and port, up to `attempts` times;
    a launch that ran and failed is returned as it is."""
    for attempt in range(attempts):
        results = _launch(cluster, argv, python, timeout, no_python, env, port + 100 * attempt)
        if not any(r.returncode == -9 and "[timed out" in r.stderr for r in results):
            return results
    return results


def _launch(cluster: Cluster, argv: Sequence[str], python: str, timeout: float, no_python: bool,
            env: Optional[dict], port: int) -> List[subprocess.CompletedProcess]:
    run_id = f"ga{os.getpid()}{int(time.time() * 1000) % 100000}"
    full_env = dict(os.environ, **(env or {}))
    # Gloo must use the node's link: an inherited GLOO_SOCKET_IFNAME=lo (the
    # loopback tests set it) would bind 127.0.0.1 inside each namespace. A
    # one-node cluster has no link: its address is on loopback.
    full_env["GLOO_SOCKET_IFNAME"] = IFACE if cluster.nodes > 1 else "lo"
    procs = [subprocess.Popen(cluster.torchrun(i, argv, python, port, run_id, no_python), env=full_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
             for i in range(cluster.nodes)]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_cluster_processes(cluster)
                kill_session(p)
                try:
                    out, err = p.communicate(timeout=10)
                except subprocess.TimeoutExpired:
                    out, err = "", ""
                err += f"\n[timed out after {timeout:.0f} s]"
                p.returncode = -9
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            kill_session(p)
        kill_cluster_processes(cluster)
    return results


def kill_cluster_processes(cluster: Cluster) -> None:
    """SIGKILL every process inside the cluster's namespaces (workers included)."""
    for name in cluster.names:
        r = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError):
                pass


def kill_session(p: subprocess.Popen) -> None:
    """Kill a launcher started with start_new_session=True (its own session)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
