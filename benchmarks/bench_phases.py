"""Where a window's time goes, gradaccum against torch DDP, at equal bucket caps.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/bench_phases.py [--caps 3,25] [--iters 25]
        [--bucket-view]

Two Gloo ranks (one host). For each cap, a gradaccum Accumulator (steps=1)
and a DDP model are built from one transformer (`_bench_worker`'s "gpt"),
and every iteration runs one window of each contender in turn (interleaved,
after a barrier), timing forward, backward and step (DDP: `optimizer.step()`
and `zero_grad()`). Rank 0 prints each phase's median over the iterations
after the first 3, and for gradaccum when its timeline says backward ended
and the reduction finished (`last_window_timeline()`), in ms from the
reduction's beginning, and how long after the last all-reduce's completion
it finished (what the write-back left to do then). "last gradient" is when
backward accumulated its last gradient (a post-accumulate-grad hook on every
parameter, for both libraries): backward's compute, without the wait.
`--bucket-view`: both with gradient_as_bucket_view. Used by hand for
benchmarks/RESULTS.md ("The default bucket cap on one host", "Writing back
while the last buckets reduce"); `--json FILE` also writes the medians.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench_worker as W  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt", choices=W.MODEL_NAMES)
    p.add_argument("--caps", default="3,25", help="bucket caps in MiB, each for both libraries")
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--json", default=None)
    p.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view for both libraries")
    args = p.parse_args()

    import gradaccum

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = W.build_model(args.model)
    data = W.make_data(args.model, torch.Generator().manual_seed(rank))
    contenders = {}
    for cap in (float(c) for c in args.caps.split(",")):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        acc = gradaccum.Accumulator(model, opt, steps=1, bucket_cap_mb=cap, gradient_as_bucket_view=args.bucket_view)
        contenders[f"gradaccum cap {cap:g}"] = ("gradaccum", model, acc)
        ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap,
                                                        gradient_as_bucket_view=args.bucket_view)
        contenders[f"DDP cap {cap:g}"] = ("ddp", ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))
    # When each contender's last gradient was accumulated: the end of
    # backward's compute, the same measure for both libraries.
    last_grad = {}
    for name, (_, model, _) in contenders.items():
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _, name=name: last_grad.__setitem__(name, time.perf_counter()))
    phases = {name: [] for name in contenders}
    timeline = {name: [] for name, c in contenders.items() if c[0] == "gradaccum"}
    for it in range(args.iters):
        for name, (kind, model, x) in contenders.items():
            inp, tgt = data[it % len(data)]
            dist.barrier()
            t0 = time.perf_counter()
            loss = W.loss_of(model, inp, tgt)
            t1 = time.perf_counter()
            if kind == "gradaccum":
                x.backward(loss)
                t2 = time.perf_counter()
                x.step()
                t = x.last_window_timeline()
                done = [b["completed"] for b in t["buckets"]]  # (-1: unknown, as for CUDA buckets)
                timeline[name].append((t["backward_end"], t["finished"],
                                       t["finished"] - max(done) if min(done) >= 0 else float("nan")))
            else:
                loss.backward()
                t2 = time.perf_counter()
                x.step()
                x.zero_grad(set_to_none=not args.bucket_view)
            t3 = time.perf_counter()
            if it >= 3:
                phases[name].append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, last_grad[name] - t1))
    if rank == 0:
        out = {}
        for name, rows in phases.items():
            fwd, bwd, step, total, grads = (1e3 * statistics.median(c) for c in zip(*rows))
            out[name] = {"forward_ms": fwd, "backward_ms": bwd, "step_ms": step, "window_ms": total,
                         "last_gradient_ms": grads,
                         "buckets": len(contenders[name][2].bucket_indices) if name in timeline else None}
            line = (f"{name:20s} forward {fwd:6.1f}  backward {bwd:6.1f} (last gradient {grads:6.1f})  "
                    f"step {step:5.1f}  window {total:6.1f} ms")
            if name in timeline:
                ends, finished, after_last = zip(*timeline[name][3:])
                out[name]["backward_end_ms"] = 1e3 * statistics.median(ends)
                out[name]["finished_ms"] = 1e3 * statistics.median(finished)
                out[name]["after_last_completion_ms"] = 1e3 * statistics.median(after_last)
                line += (f"  ({out[name]['buckets']} buckets; timeline: backward ended "
                         f"{out[name]['backward_end_ms']:.1f}, finished {out[name]['finished_ms']:.1f}, "
                         f"{out[name]['after_last_completion_ms']:.1f} after the last all-reduce completed)")
            print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "iters": args.iters, "bucket_view": args.bucket_view,
                           "results": out}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
