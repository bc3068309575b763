"""One rank of benchmarks/bench.py's Python side (not meant to be run by hand).

Launched twice (RANK 0 and 1) with WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
OMP_NUM_THREADS=1 in the environment. Two modes:

  serve: builds the model once per contender and answers commands read from
         stdin, one per line, the same on both ranks, in the same order:
           time CONTENDER K W     W timed windows of K micro-batches
           profile CONTENDER K    one window under torch.profiler: all-reduces
           allreduce R            R all-reduces of one flat whole-gradient tensor
           rss                    this process's peak RSS so far
           quit
  mem:   builds ONE contender in this fresh process, runs a few windows and
         reports peak RSS (peak RSS only grows, so each variant needs its own
         process).

Every answer is one stdout line "@@ {json}".
"""
import argparse
import copy
import datetime
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Layer widths of the two benchmark models: Linear/ReLU stacks (no ReLU after
# the last Linear). bench_window.cpp builds the same ones.
MODELS = {
    "small": [256, 512, 256, 128, 10],  # 297,098 parameters
    "large": [1024, 2048, 2048, 2048, 256],  # 11,016,448 parameters
}
MICRO_BATCH = 32  # rows per micro-batch
POOL = 16  # distinct micro-batches cycled through
LR = 1e-4

CONTENDERS = ("ddp_nosync", "ddp_every", "gradaccum_py", "local")


def build_model(name):
    widths = MODELS[name]
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def num_parameters(name):
    w = MODELS[name]
    return sum(a * b + b for a, b in zip(w[:-1], w[1:]))


def peak_rss_kib():
    """VmHWM from /proc (kB), falling back to ru_maxrss (kB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reply(obj):
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Bench:
    def __init__(self, model_name, bucket_view, nonfinite):
        self.rank = dist.get_rank()
        self.model_name = model_name
        self.bucket_view = bucket_view
        self.nonfinite = nonfinite
        torch.manual_seed(0)  # the same initial weights on every rank
        self.base = build_model(model_name)
        w = MODELS[model_name]
        g = torch.Generator().manual_seed(1 + self.rank)
        self.data = [(torch.randn(MICRO_BATCH, w[0], generator=g),
                      torch.randn(MICRO_BATCH, w[-1], generator=g)) for _ in range(POOL)]
        self._ddp = None
        self._local = None
        self._acc = {}

    # -- contenders, built on first use (both ranks get the same commands) --
    def ddp(self):
        if self._ddp is None:
            model = torch.nn.parallel.DistributedDataParallel(
                copy.deepcopy(self.base), gradient_as_bucket_view=self.bucket_view)
            self._ddp = (model, torch.optim.SGD(model.parameters(), lr=LR))
        return self._ddp

    def local(self):
        if self._local is None:
            model = copy.deepcopy(self.base)
            self._local = (model, torch.optim.SGD(model.parameters(), lr=LR))
        return self._local

    def accumulator(self, k):
        if k not in self._acc:
            import gradaccum

            model = copy.deepcopy(self.base)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            acc = gradaccum.Accumulator(model, opt, steps=k, nonfinite=self.nonfinite,
                                        gradient_as_bucket_view=self.bucket_view)
            self._acc[k] = (model, acc)
        return self._acc[k]

    # -- one window (K micro-batches, one optimizer step) of each contender --
    def window(self, contender, k, start=0):
        data, n = self.data, len(self.data)
        if contender == "gradaccum_py":
            model, acc = self.accumulator(k)
            for i in range(k):
                x, y = data[(start + i) % n]
                acc.backward(F.mse_loss(model(x), y))
                acc.step()
            return
        if contender in ("ddp_nosync", "ddp_every"):
            model, opt = self.ddp()
            for i in range(k):
                x, y = data[(start + i) % n]
                if contender == "ddp_nosync" and i < k - 1:
                    with model.no_sync():
                        (F.mse_loss(model(x), y) / k).backward()
                else:
                    (F.mse_loss(model(x), y) / k).backward()
        elif contender == "local":
            model, opt = self.local()
            for i in range(k):
                x, y = data[(start + i) % n]
                (F.mse_loss(model(x), y) / k).backward()
        else:
            raise ValueError(f"unknown contender {contender!r}")
        opt.step()
        # Bucket views must stay views: zero them instead of dropping them.
        opt.zero_grad(set_to_none=not self.bucket_view)

    def time(self, contender, k, windows):
        dist.barrier()
        times = []
        for w in range(windows):
            t0 = time.perf_counter()
            self.window(contender, k, start=w * k)
            times.append(time.perf_counter() - t0)
        out = {"rank": self.rank, "contender": contender, "K": k, "times": times}
        if contender == "gradaccum_py":
            out["stats"] = self._acc[k][1].stats()
        return out

    def profile(self, contender, k):
        from torch.profiler import ProfilerActivity, profile

        # Run after the timed blocks: contenders are warm, DDP's buckets rebuilt.
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            self.window(contender, k)
        calls, numel = 0, 0
        for e in prof.events():
            if e.name == "gloo:all_reduce":
                calls += 1
                for shape in e.input_shapes or []:
                    if shape:
                        n = 1
                        for d in shape:
                            n *= d
                        numel += n
        elem = next(self.base.parameters()).element_size()
        out = {"rank": self.rank, "contender": contender, "K": k,
               "allreduce_calls": calls, "allreduce_bytes": numel * elem}
        if contender == "gradaccum_py":
            s = self._acc[k][1].stats()
            out.update(stats_buckets=s["buckets"], stats_collectives=s["last_window_collectives"],
                       stats_bytes=s["last_window_bytes"])
        if contender in ("ddp_nosync", "ddp_every"):
            info = self.ddp()[0]._get_ddp_logging_data()
            out["ddp_buckets"] = len(str(info.get("rebuilt_bucket_sizes", info.get("bucket_sizes", ""))).split())
        return out

    def allreduce(self, reps):
        flat = torch.zeros(num_parameters(self.model_name))
        for _ in range(2):
            dist.all_reduce(flat)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - t0)
        return {"rank": self.rank, "numel": flat.numel(), "bytes": flat.numel() * flat.element_size(),
                "times": times}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--bucket-view", type=int, default=0)
    p.add_argument("--nonfinite", default="skip")
    p.add_argument("--mem", choices=CONTENDERS, help="memory mode: build only this contender")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--windows", type=int, default=3)
    args = p.parse_args()
    # Imported by every variant, so that the extension's code pages count alike
    # in every peak RSS.
    import gradaccum  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    bench = Bench(args.model, bool(args.bucket_view), args.nonfinite)
    try:
        if args.mem:
            rss_before = peak_rss_kib()
            for w in range(args.windows):
                bench.window(args.mem, args.steps, start=w * args.steps)
            dist.barrier()
            reply({"rank": bench.rank, "contender": args.mem, "bucket_view": args.bucket_view,
                   "K": args.steps, "peak_rss_kib": peak_rss_kib(),
                   "peak_rss_kib_before_windows": rss_before})
            return
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "quit":
                break
            if cmd[0] == "time":
                reply(bench.time(cmd[1], int(cmd[2]), int(cmd[3])))
            elif cmd[0] == "profile":
                reply(bench.profile(cmd[1], int(cmd[2])))
            elif cmd[0] == "allreduce":
                reply(bench.allreduce(int(cmd[1])))
            elif cmd[0] == "rss":
                reply({"rank": bench.rank, "peak_rss_kib": peak_rss_kib()})
            else:
                reply({"rank": bench.rank, "error": f"unknown command {line.strip()!r}"})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
