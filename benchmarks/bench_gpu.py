"""GPU benchmark: gradaccum vs torch DDP on CUDA (CI never runs it).

    python benchmarks/bench_gpu.py                 (make bench-gpu)
    python benchmarks/bench_gpu.py --quick

Runs, for the benchmark's small and large Linear/ReLU models (see
_bench_worker.py), fp32 and bf16 parameters, and K in {1, 4, 16}:

  * NCCL at world size 1 (and at 2 ranks when there are 2+ GPUs);
  * 2 Gloo ranks over CUDA tensors (both on GPU 0 if there is only one).

Contenders per cell: torch DDP + no_sync (anchor), gradaccum.Accumulator, and
a local-only run with no communication. Window times are synchronised with
torch.cuda.synchronize(); blocks are interleaved as in bench.py. For each
backend and dtype, torch.profiler records one window of the large model (K=4)
per data-parallel contender and estimates how much of the all-reduce time
overlaps computation (the synchronising backward): the all-reduce intervals are
NCCL kernels (NCCL) or the "gloo:all_reduce" events of Gloo's worker threads
(Gloo), the compute intervals are the other CUDA kernels, and
overlap = |all-reduce ∩ compute| / |all-reduce|.

Writes benchmarks/results/gpu-latest.json (device name, torch version...).
Exits with status 0 and a message when CUDA is not available.
"""
import argparse
import copy
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _bench_worker import MODELS, build_model, num_parameters  # noqa: E402

CONTENDERS = ("ddp_nosync", "gradaccum_py", "local")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR = 1e-4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def intervals_measure(intervals):
    """Total length of a union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def intersection_measure(a, b):
    """Length of (union of a) ∩ (union of b)."""
    def merged(xs):
        out = []
        for s, e in sorted(xs):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    a, b = merged(a), merged(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class GpuBench:
    def __init__(self, model_name, dtype, device, micro_batch, rank):
        torch.manual_seed(0)
        self.base = build_model(model_name).to(device=device, dtype=dtype)
        w = MODELS[model_name]
        g = torch.Generator(device="cpu").manual_seed(1 + rank)
        self.data = [(torch.randn(micro_batch, w[0], generator=g).to(device, dtype),
                      torch.randn(micro_batch, w[-1], generator=g).to(device, dtype)) for _ in range(16)]
        self.device = device
        self.cuda = device.type == "cuda"
        self._ddp, self._local, self._acc = None, None, {}

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def ddp(self):
        if self._ddp is None:
            m = torch.nn.parallel.DistributedDataParallel(
                copy.deepcopy(self.base), device_ids=[self.device] if self.cuda else None)
            self._ddp = (m, torch.optim.SGD(m.parameters(), lr=LR))
        return self._ddp

    def local(self):
        if self._local is None:
            m = copy.deepcopy(self.base)
            self._local = (m, torch.optim.SGD(m.parameters(), lr=LR))
        return self._local

    def accumulator(self, k):
        if k not in self._acc:
            import gradaccum

            m = copy.deepcopy(self.base)
            opt = torch.optim.SGD(m.parameters(), lr=LR)
            self._acc[k] = (m, gradaccum.Accumulator(m, opt, steps=k))
        return self._acc[k]

    def window(self, contender, k, start=0):
        F = torch.nn.functional
        data = self.data
        if contender == "gradaccum_py":
            m, acc = self.accumulator(k)
            for i in range(k):
                x, y = data[(start + i) % len(data)]
                acc.backward(F.mse_loss(m(x), y))
                acc.step()
            return
        m, opt = self.ddp() if contender == "ddp_nosync" else self.local()
        for i in range(k):
            x, y = data[(start + i) % len(data)]
            if contender == "ddp_nosync" and i < k - 1:
                with m.no_sync():
                    (F.mse_loss(m(x), y) / k).backward()
            else:
                (F.mse_loss(m(x), y) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def time(self, contender, k, windows):
        import torch.distributed as dist

        dist.barrier()
        self.sync()
        times = []
        for w in range(windows):
            t0 = time.perf_counter()
            self.window(contender, k, start=w * k)
            self.sync()
            times.append(time.perf_counter() - t0)
        return times

    def overlap(self, contender, k, backend):
        """Profiles one window: all-reduce time, and the part of it overlapping compute kernels."""
        import torch.distributed as dist
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        self.window(contender, k)
        self.sync()
        dist.barrier()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as prof:
            self.window(contender, k)
            self.sync()
        comm, compute = [], []
        for e in prof.events():
            span = (e.time_range.start, e.time_range.end)
            name = e.name.lower()
            if e.device_type == DeviceType.CUDA:
                if "nccl" in name:
                    comm.append(span)
                elif "memcpy" not in name and "memset" not in name:
                    compute.append(span)
            elif backend == "gloo" and e.name == "gloo:all_reduce":
                comm.append(span)
            elif not self.cuda and e.name.startswith("autograd::engine::evaluate_function"):
                compute.append(span)  # --cpu-dry-run: the backward's nodes on the CPU
        comm_us = intervals_measure(comm)
        overlap_us = intersection_measure(comm, compute)
        return {"contender": contender, "K": k, "allreduce_us": comm_us, "overlap_us": overlap_us,
                "overlap_fraction": overlap_us / comm_us if comm_us else None,
                "compute_us": intervals_measure(compute), "allreduce_intervals": len(comm)}


def rank_main(rank, world, backend, port, args, out_path):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.cpu_dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    results, overlaps = [], []
    try:
        for dtype_name in args.dtypes:
            for model in args.models:
                bench = GpuBench(model, DTYPES[dtype_name], device, args.micro_batch, rank)
                for k in args.steps:  # warm-up: build everything
                    for c in CONTENDERS:
                        bench.window(c, k)
                times = {(k, c): [] for k in args.steps for c in CONTENDERS}
                for b in range(args.blocks):
                    for k in args.steps:
                        order = list(CONTENDERS[b % 3:] + CONTENDERS[:b % 3])
                        for c in order:
                            ts = bench.time(c, k, max(1, args.micro_steps // k))
                            times[(k, c)].append(statistics.median(ts))
                for k in args.steps:
                    anchor = times[(k, "ddp_nosync")]
                    for c in CONTENDERS:
                        ts = times[(k, c)]
                        ratios = [t / a for t, a in zip(ts, anchor)]
                        results.append({
                            "backend": backend, "world_size": world, "dtype": dtype_name, "model": model,
                            "parameters": num_parameters(model), "K": k, "contender": c,
                            "window_ms": 1e3 * statistics.median(ts), "block_ms": [1e3 * t for t in ts],
                            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                            "ratio_max": max(ratios)})
                if model == "large" and not args.no_profile:
                    for c in ("ddp_nosync", "gradaccum_py"):
                        o = bench.overlap(c, 4, backend)
                        o.update(backend=backend, world_size=world, dtype=dtype_name, model=model)
                        overlaps.append(o)
                if rank == 0:
                    print(f"  {backend} x{world} {dtype_name} {model}: " + ", ".join(
                        f"K={r['K']} {r['contender']} {r['window_ms']:.2f} ms ({r['ratio']:.2f}x)"
                        for r in results if r["model"] == model and r["dtype"] == dtype_name), flush=True)
                del bench
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"results": results, "overlap": overlaps}, f)


def nccl_version():
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", default="small,large")
    p.add_argument("--steps", default="1,4,16")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--micro-batch", type=int, default=256, help="rows per micro-batch")
    p.add_argument("--micro-steps", type=int, default=32, help="micro-steps per timed command")
    p.add_argument("--blocks", type=int, default=0, help="interleaved blocks (default 7; --quick 2)")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out", default=None, help="default: benchmarks/results/gpu-latest.json")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="check this script's logic without a GPU: 2 Gloo ranks on CPU tensors "
                        "(writes gpu-dryrun.json; the figures mean nothing)")
    args = p.parse_args()
    args.out = args.out or os.path.join(HERE, "results", "gpu-dryrun.json" if args.cpu_dry_run
                                        else "gpu-latest.json")
    args.models = [m for m in args.models.split(",") if m]
    args.steps = [int(k) for k in args.steps.split(",")]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r} (have {sorted(DTYPES)})")
    args.blocks = args.blocks or (2 if args.quick else 7)
    if args.quick:
        args.micro_steps = min(args.micro_steps, 8)

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        print("bench_gpu.py: CUDA is not available (torch "
              f"{torch.__version__}); nothing to benchmark. Run it on a machine with an NVIDIA GPU.")
        return 0
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import gradaccum

    runs = []
    if args.cpu_dry_run:
        pass
    elif dist.is_nccl_available():
        runs.append(("nccl", 1))
        if torch.cuda.device_count() >= 2:
            runs.append(("nccl", 2))
    else:
        print("NCCL is not available in this torch build: NCCL runs skipped")
    runs.append(("gloo", 2))

    t0 = time.perf_counter()
    results, overlaps = [], []
    for backend, world in runs:
        print(f"{backend}, world size {world}:", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "rank0.json")
            mp.spawn(rank_main, args=(world, backend, free_port(), args, out_path), nprocs=world, join=True)
            with open(out_path) as f:
                part = json.load(f)
        results += part["results"]
        overlaps += part["overlap"]

    cuda = torch.cuda.is_available() and not args.cpu_dry_run
    out = {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
                 "device_count": torch.cuda.device_count() if cuda else 0,
                 "device_memory_gib": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
                 "torch": torch.__version__, "cuda": torch.version.cuda,
                 "nccl": nccl_version() if cuda and dist.is_nccl_available() else None,
                 "gradaccum": gradaccum.__version__, "seconds": time.perf_counter() - t0},
        "config": {"quick": args.quick, "models": {m: MODELS[m] for m in args.models}, "steps": args.steps,
                   "dtypes": args.dtypes, "micro_batch": args.micro_batch, "blocks": args.blocks,
                   "runs": [{"backend": b, "world_size": w} for b, w in runs],
                   "note": "Gloo ranks share GPU 0 when there is only one GPU"},
        "results": results,
        "overlap": overlaps,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("\nall-reduce overlapping compute in one window (large model, K=4):")
    for o in overlaps:
        frac = "n/a" if o["overlap_fraction"] is None else f"{100 * o['overlap_fraction']:.0f}%"
        print(f"  {o['backend']} x{o['world_size']} {o['dtype']} {o['contender']:>12}: "
              f"all-reduce {o['allreduce_us'] / 1e3:.2f} ms, overlapped {frac}")
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
