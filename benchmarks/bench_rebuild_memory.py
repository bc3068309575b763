"""The first window's memory peak, with and without the bucket rebuild.

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/bench_rebuild_memory.py [--json PATH]

Two Gloo ranks, a 64 MiB float32 model (four 2048x2048 layers) registered in
the reverse of the order its forward runs them, so that the rebuild after the
first window changes the layout (Note [Rebuilding buckets in ready order]).
Per mode (copies, bucket views, float64 `accumulate_dtype`) and per setting of
`rebuild_buckets`: rank 0's peak resident memory over each window's closing
micro-step, above the resident memory just before it (VmHWM after a reset
through /proc/self/clear_refs). Run with MALLOC_MMAP_THRESHOLD_ low, so that
freed buffers go back to the system at once and the peak is the allocations'.
Window 0 is the rebuild's; windows 1 and 2 show the steady state.
"""
import argparse
import datetime
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _mib(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Reversed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048) for _ in range(4))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def worker(rank, port, mode, rebuild, out):
    import gradaccum

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = Reversed()
    kwargs = {"views": dict(gradient_as_bucket_view=True), "wide": dict(accumulate_dtype=torch.float64)}.get(mode, {})
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.01), steps=2, bucket_cap_mb=8,
                                rebuild_buckets=rebuild, **kwargs)
    x = torch.randn(8, 2048)
    peaks = []
    for _ in range(3):
        acc.backward(model(x))
        loss = model(x)
        before = _mib("VmRSS:")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        acc.backward(loss)
        peaks.append(round(_mib("VmHWM:") - before, 1))
        acc.step()
    if rank == 0:
        out.put({"mode": mode, "rebuild_buckets": rebuild, "peak_mib": peaks,
                 "bucket_rebuilds": acc.stats()["bucket_rebuilds"]})
    acc.close()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
        print("warning: MALLOC_MMAP_THRESHOLD_ is not set: freed memory may stay resident", file=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    results = []
    for mode in ("copies", "views", "wide"):
        for rebuild in (True, False):
            queue = ctx.SimpleQueue()
            mp.start_processes(worker, args=(free_port(), mode, rebuild, queue), nprocs=2, start_method="spawn")
            row = queue.get()
            results.append(row)
            print(f"{mode:7s} rebuild_buckets={str(rebuild):5s} peak over the closing micro-step, windows 0-2 "
                  f"(MiB): {row['peak_mib']}  rebuilds {row['bucket_rebuilds']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
