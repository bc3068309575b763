"""Mixed precision on 2 Gloo ranks (loopback): what fp32 accumulation of bf16
gradients costs in memory and per no-sync micro-step, and what comm_dtype saves
on the wire.

    python benchmarks/bench_mixed.py            (about 2 minutes; part of make bench)

Each variant runs in a fresh pair of processes (OMP_NUM_THREADS=1 each) on an
MLP of ~4.2M parameters (4 Linear layers of width 1024, micro-batches of 32
rows, K=8, SGD), so the peak RSS (VmHWM) of a variant is its own. Reported per
variant: the median no-sync micro-step (forward + backward + what the
Accumulator does after it) and window time with their min-max over windows, the
peak RSS growth over the process's RSS once the model and optimizer exist, the
bytes and all-reduces of one window (stats(), checked by the profiler's count).
glibc is told to map every tensor of 64 KiB or more on its own pages
(MALLOC_MMAP_THRESHOLD_), so the peak RSS follows live tensors.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

WIDTH, LAYERS, MICRO_BATCH, STEPS = 1024, 4, 32, 8

# (name, parameter dtype, accumulate_dtype, comm_dtype)
VARIANTS = [
    ("bf16 params", "bfloat16", None, None),
    ("bf16 params, accumulate_dtype=float32", "bfloat16", "float32", None),
    ("bf16 params, float32 accumulation, comm_dtype=bfloat16", "bfloat16", "float32", "bfloat16"),
    ("fp32 params", "float32", None, None),
    ("fp32 params, comm_dtype=bfloat16", "float32", None, "bfloat16"),
    ("fp32 params, comm_dtype=float16", "float32", None, "float16"),
]


def add_arguments(p):
    p.add_argument("--mixed-windows", type=int, default=0, help="windows per variant (default 12; --quick 4)")


def _vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _worker(rank, port, variant, windows, out_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.profiler import ProfilerActivity, profile

    import gradaccum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    _, dtype, wide, comm = variant
    dtype = getattr(torch, dtype)
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    model = nn.Sequential(*layers).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(MICRO_BATCH, WIDTH, generator=g).to(dtype) for _ in range(STEPS)]
    baseline = _vm("VmRSS")
    acc = gradaccum.Accumulator(model, opt, steps=STEPS,
                                accumulate_dtype=getattr(torch, wide) if wide else None,
                                comm_dtype=getattr(torch, comm) if comm else None)
    micro, window = [], []
    for w in range(windows + 1):  # the first window warms up
        dist.barrier()
        t_window = time.perf_counter()
        for k in range(STEPS):
            t = time.perf_counter()
            acc.backward(model(xs[k]).float().pow(2).mean())
            if k < STEPS - 1 and w > 0:
                micro.append(time.perf_counter() - t)
        acc.step()
        if w > 0:
            window.append(time.perf_counter() - t_window)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(STEPS):
            acc.backward(model(xs[k]).float().pow(2).mean())
        acc.step()
    allreduces = sum(1 for e in prof.events() if e.name == "gloo:all_reduce")
    stats = acc.stats()
    n = sum(p.numel() for p in model.parameters())
    result = {"micro_ms": [1e3 * t for t in micro], "window_ms": [1e3 * t for t in window],
              "peak_growth": _vm("VmHWM") - baseline, "parameters": n,
              "param_bytes": n * torch.finfo(dtype).bits // 8,
              "bytes": stats["last_window_bytes"], "collectives": stats["last_window_collectives"],
              "allreduces_profiled": allreduces, "buckets": stats["buckets"]}
    acc.close()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(args):
    import tempfile

    import torch.multiprocessing as mp

    windows = args.mixed_windows or (4 if getattr(args, "quick", False) else 12)
    # Tensors of 64 KiB and more get pages of their own, returned when freed:
    # the peak RSS then follows the live tensors, not the allocator's arenas.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    ctx = mp.get_context("spawn")
    out = {"config": {"width": WIDTH, "layers": LAYERS, "micro_batch": MICRO_BATCH, "steps": STEPS,
                      "windows": windows, "world_size": 2},
           "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            path = os.path.join(tmp, "result.json")
            port = _free_port()
            procs = [ctx.Process(target=_worker, args=(r, port, variant, windows, path)) for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(600)
                if p.is_alive():
                    p.kill()
            if any(p.exitcode != 0 for p in procs) or not os.path.exists(path):
                print(f"bench_mixed: {variant[0]}: a rank failed (exit codes "
                      f"{[p.exitcode for p in procs]})", file=sys.stderr)
                continue
            with open(path) as f:
                r = json.load(f)
            os.remove(path)
            r["micro_ms"] = _spread(r["micro_ms"])
            r["window_ms"] = _spread(r["window_ms"])
            out["variants"][variant[0]] = r
            print(f"bench_mixed: {variant[0]}: micro-step {r['micro_ms']['median']:.2f} ms, window "
                  f"{r['window_ms']['median']:.1f} ms, peak +{r['peak_growth'] / 2**20:.1f} MiB, "
                  f"{r['bytes'] / 2**20:.2f} MiB in {r['collectives']} all-reduce(s)", file=sys.stderr)
    return out


def markdown(result):
    if not result or not result.get("variants"):
        return ""
    c = result["config"]
    v = result["variants"]
    lines = [
        f"**Mixed precision** (bench_mixed.py: 2 Gloo ranks on loopback, MLP of {LAYERS} x {WIDTH}, "
        f"{next(iter(v.values()))['parameters'] / 1e6:.1f}M parameters, K={c['steps']}, "
        f"micro-batch {c['micro_batch']}; medians over {c['windows']} windows, min-max in brackets):",
        "",
        "| variant | no-sync micro-step | window | peak RSS growth | bytes per window | all-reduces |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in v.items():
        m, w = r["micro_ms"], r["window_ms"]
        lines.append(
            f"| {name} | {m['median']:.2f} ms [{m['min']:.2f}-{m['max']:.2f}] | "
            f"{w['median']:.1f} ms [{w['min']:.1f}-{w['max']:.1f}] | "
            f"{r['peak_growth'] / 2**20:.1f} MiB | {r['bytes'] / 2**20:.2f} MiB | "
            f"{r['collectives']} (profiler {r['allreduces_profiled']}) |")
    base, wide = v.get(VARIANTS[0][0]), v.get(VARIANTS[1][0])
    notes = []
    if base and wide:
        fp32_copy = base["parameters"] * 4
        notes.append(
            f"fp32 accumulation: peak RSS {(wide['peak_growth'] - base['peak_growth']) / 2**20:+.1f} MiB "
            f"over bf16 accumulation (one fp32 copy of the gradients is {fp32_copy / 2**20:.1f} MiB), "
            f"no-sync micro-step {wide['micro_ms']['median'] / base['micro_ms']['median']:.2f}x "
            f"(the add into the bucket, and .grad released).")
    full, half = v.get(VARIANTS[3][0]), v.get(VARIANTS[4][0])
    if full and half:
        notes.append(f"comm_dtype=bfloat16: {half['bytes'] / full['bytes']:.3f}x the bytes of float32, "
                     f"window {half['window_ms']['median'] / full['window_ms']['median']:.2f}x.")
    if notes:
        lines += ["", " ".join(notes)]
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "mixed-latest.json"))
    add_arguments(p)
    args = p.parse_args()
    result = measure(args)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
