"""Buckets rebuilt in backward's order: a model registered in reverse.

    python benchmarks/bench_rebuild.py [--windows 8] [--steps 4]

Two Gloo ranks on loopback. The large benchmark model (11M parameters,
Linear/ReLU), but with its layers registered in the reverse of the order the
forward runs them, so that backward makes the gradients ready in registration
order: the opposite of the first bucket layout's guess (reverse registration,
as torch DDP's). Bucket caps 4 MiB (first 1 MiB), as bench_net.py uses, so the
model spans several buckets. Per contender: gradaccum with
`rebuild_buckets=False` (the old behaviour: bucket 0 waits for backward's last
gradient, nothing launches early), gradaccum with the default rebuild, and
torch DDP + no_sync (which rebuilds its buckets too) for reference.

Reported, over the windows after two warm-up windows (the first one is where
gradaccum rebuilds): buckets launched while backward still had gradients to
make (stats()["last_window_launched_in_backward"], deterministic), and the
median wall time of the synchronising micro-step (its backward and the
reduction) and of the window. On 2 shared cores with two ranks, wall times are
noisy and the all-reduce competes with backward for the same cores
(benchmarks/README.md): the launch count is the figure that does not depend on
the machine; the time is what it bought here.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _bench_worker import MODELS  # noqa: E402

CAP_MB, FIRST_CAP_MB = 4.0, 1.0


class Reversed(torch.nn.Module):
    """The Linear/ReLU stack of `widths`, its layers registered last-first."""

    def __init__(self, widths):
        super().__init__()
        pairs = list(zip(widths[:-1], widths[1:]))
        self.n = len(pairs)
        for i in reversed(range(self.n)):
            self.add_module(f"layer{i}", torch.nn.Linear(*pairs[i]))

    def forward(self, x):
        for i in range(self.n):
            x = getattr(self, f"layer{i}")(x)
            if i < self.n - 1:
                x = torch.relu(x)
        return x


def worker(rank, world, port, args, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    import gradaccum

    widths = MODELS[args.model]
    g = torch.Generator().manual_seed(1 + rank)
    data = [(torch.randn(args.micro_batch, widths[0], generator=g),
             torch.randn(args.micro_batch, widths[-1], generator=g)) for _ in range(args.steps)]
    results = {}
    for contender in ("no_rebuild", "rebuild", "ddp_nosync"):
        torch.manual_seed(0)
        model = Reversed(widths)
        if contender == "ddp_nosync":
            ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-4)
            acc = gradaccum.Accumulator(model, opt, steps=args.steps, bucket_cap_mb=CAP_MB,
                                        first_bucket_cap_mb=FIRST_CAP_MB,
                                        rebuild_buckets=contender == "rebuild")
        sync_times, window_times, launched = [], [], []
        buckets = None
        for w in range(args.windows):
            dist.barrier()
            start = time.perf_counter()
            for k, (x, y) in enumerate(data):
                last = k == args.steps - 1
                if last:
                    t0 = time.perf_counter()
                if contender == "ddp_nosync":
                    loss = torch.nn.functional.mse_loss(ddp(x), y) / args.steps
                    if last:
                        loss.backward()
                    else:
                        with ddp.no_sync():
                            loss.backward()
                else:
                    acc.backward(torch.nn.functional.mse_loss(model(x), y))
                if last:
                    t_sync = time.perf_counter() - t0
            if contender == "ddp_nosync":
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                stats = acc.stats()
                launched.append(stats["last_window_launched_in_backward"])
                buckets = stats["buckets"]
                acc.step()
            t_window = time.perf_counter() - start
            if w >= 2:
                sync_times.append(t_sync)
                window_times.append(t_window)
        if contender != "ddp_nosync":
            acc.close()
        results[contender] = {"sync_s": sync_times, "window_s": window_times, "launched": launched,
                              "buckets": buckets}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="large", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--out", default=os.path.join(HERE, "results", "rebuild-latest.json"))
    args = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    mp.spawn(worker, args=(2, port, args, args.out), nprocs=2, join=True)
    with open(args.out) as f:
        results = json.load(f)
    print(f"model {args.model} registered in reverse, K={args.steps}, {args.windows - 2} timed windows, "
          f"2 Gloo ranks on loopback, rank 0's figures")
    print("| contender | buckets launched during backward (per window) | synchronising micro-step (median) "
          "| window (median) |")
    print("|---|---|---:|---:|")
    for name, r in results.items():
        launched = (f"{r['launched'][0]} of {r['buckets']} in the first window, then "
                    f"{statistics.median(r['launched'][2:]):.0f} of {r['buckets']}") if r["launched"] else "—"
        print(f"| {name} | {launched} | {statistics.median(r['sync_s']) * 1e3:.1f} ms "
              f"| {statistics.median(r['window_s']) * 1e3:.1f} ms |")
    results["args"] = vars(args)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
