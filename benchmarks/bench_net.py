"""Overlap on a throttled multi-node link, and how a window's cost grows.

    python benchmarks/bench_net.py [--cpp-bench build/bench/bench_window] [--quick]

(bench.py runs it as part of `make bench`.) Needs root and iproute2: the
"nodes" are network namespaces on this machine joined by veth links throttled
with tc (benchmarks/_netns.py), one torchrun per node, `--nnodes=N
--nproc_per_node=1 --rdzv-backend=c10d`. Everything is set up and removed here;
without namespaces it says why and writes nothing.

0. Against the schedule bound (--bound-models gpt,large; empty to skip): on 2
   nodes at 1 Gbit/s, the GPT-style transformer (8 sequences of 128 tokens)
   and the large MLP (1024 rows), where one backward is about as long as the
   all-reduce, K=1 (--bound-ks): the hidden fraction of DDP + no_sync and gradaccum
   (Python and C++), and the largest fraction any bucket order could hide,
   from gradaccum's timeline of the synchronising backward (benchmarks/
   _bound.py); with --out (or from bench.py) a Chrome trace of one window per
   model and a plot of its buckets, BASE-trace-MODEL.json and BASE-timeline.png.
1. Hidden fraction. The large model, K in {1, 4, 16}, micro-batches of 128 rows,
   on 2 nodes at 1 and 10 Gbit/s (and 4 nodes behind a bridge at 1 Gbit/s):
   window time of DDP + no_sync, gradaccum from Python and from C++, and the
   local floor (no communication; Python and C++ each have their own); one
   all-reduce of the whole gradient alone on that link; and the fraction of it
   hidden behind backward, (floor + all-reduce - window) / all-reduce, per
   block, median [min-max]. The ceiling of that fraction is one local backward
   / all-reduce: only the window's last backward can hide communication.
2. Growth. Window time against K (1..64, large model), model size (0.3M..50M
   parameters, K=4) and ranks (1, 2, 4 nodes, large model, K=4), on the
   1 Gbit/s link, 32-row micro-batches, Python contenders.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _bound  # noqa: E402
import _netns  # noqa: E402
from _bench_worker import num_parameters  # noqa: E402
from _net_report import (CAPS_MB, LABELS, NET_MICRO_BATCH, log, markdown, plot_growth, spread,  # noqa: E402
                         write_bound_outputs)

WORKER = os.path.join(HERE, "_bench_worker.py")
CGROUP_CPU = "/sys/fs/cgroup/cpu"
LAUNCH_TIMEOUT_S = 420
GROWTH_SIZES = ["small", "m1", "m3", "large", "xl"]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def parse_lines(results):
    """JSON lines ('@@ {...}' or '{...}') printed by the workers on every node."""
    out = []
    for r in results:
        for line in r.stdout.splitlines():
            line = line.strip()
            if line.startswith("@@ "):
                line = line[3:]
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


def launch(cluster, argv, no_python, env, log_path, port, budget_s=0.0):
    """budget_s: the seconds of timed blocks the command may spend (the worker
    stops adding blocks after its budget), on top of the fixed allowance."""
    t0 = time.perf_counter()
    # A capped compute thread (--compute-quota F) runs everything 1/F as long.
    quota = float(env.get("GRADACCUM_BENCH_COMPUTE_QUOTA") or 0) or 1.0
    results = _netns.run_torchrun(cluster, argv, sys.executable, LAUNCH_TIMEOUT_S / quota + budget_s,
                                  no_python=no_python,
                                  env=env, port=port)
    with open(log_path, "w") as f:
        for i, r in enumerate(results):
            f.write(f"=== node {i} rc={r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}\n")
    bad = [i for i, r in enumerate(results) if r.returncode != 0]
    if bad:
        raise RuntimeError(f"node {bad[0]} failed (rc={results[bad[0]].returncode}); see {log_path}")
    return parse_lines(results), time.perf_counter() - t0


def run_python(cluster, args, models, ks, contenders, micro, blocks, budget, env, name, beside_reps=0):
    argv = [WORKER, "--batch", "--models", ",".join(models), "--ks", ",".join(map(str, ks)),
            "--contenders", ",".join(contenders), "--micro", str(micro), "--blocks", str(blocks),
            "--budget-s", str(budget), "--allreduce-reps", str(args.allreduce_reps),
            "--beside-reps", str(beside_reps)]
    lines, secs = launch(cluster, argv, False, env, os.path.join(args.log_dir, f"{name}.log"), 29431,
                         budget_s=budget * len(models))
    ranks = sorted((l for l in lines if "models" in l), key=lambda l: l["rank"])
    if not ranks or ranks[0]["rank"] != 0:
        raise RuntimeError(f"{name}: no result from rank 0; see {args.log_dir}/{name}.log")
    log(f"  {name}: {secs:.0f} s")
    # A data-parallel window is as slow as its slowest rank: per block, the
    # largest time over ranks (the floor too: the slowest rank's compute).
    out = ranks[0]
    for model, m in out["models"].items():
        # Each rank's clock marks and timelines (the bound combines the ranks).
        m["rank_traces"] = [r["models"][model].pop("traces", {}) for r in ranks]
        for k, row in m["times"].items():
            for c in row:
                per_rank = [r["models"][model]["times"][k][c] for r in ranks]
                row[c] = [max(block) for block in zip(*per_rank)]
        m["backward"] = [max(b) for b in zip(*[r["models"][model]["backward"] for r in ranks])]
        if all("backward_beside" in r["models"][model] for r in ranks):
            m["backward_beside"] = {how: [max(b) for b in zip(*[r["models"][model]["backward_beside"][how]
                                                                 for r in ranks])]
                                    for how in ("alone", "beside")}
    return out


def run_cpp(cluster, args, ks, windows, blocks, env, name, model="large"):
    argv = [args.cpp_bench, "--model", model, "--steps", ",".join(map(str, ks * blocks)),
            "--windows", str(windows), "--warmup", "1", "--contenders", "gradaccum,local"]
    lines, secs = launch(cluster, argv, True, env, os.path.join(args.log_dir, f"{name}.log"), 29432)
    per_rank, traces = {}, {}
    for l in lines:
        if "times" in l:
            per_rank.setdefault(l["rank"], {}).setdefault(str(l["K"]), {}).setdefault(l["contender"], []).append(
                median(l["times"]))
            if "timeline" in l:
                traces.setdefault(str(l["K"]), {}).setdefault(l["rank"], []).append(
                    {"timeline": l["timeline"], "marks": l["marks"]})
    log(f"  {name}: {secs:.0f} s")
    # Per block, the slowest rank (see run_python).
    out = {str(k): {c: [max(b) for b in zip(*[r[str(k)][c] for r in per_rank.values()])]
                    for c in ("gradaccum_cpp", "local_cpp")} for k in ks}
    for k in ks:
        if str(k) in traces:
            out[str(k)]["rank_traces"] = [traces[str(k)][r] for r in sorted(traces[str(k)])]
    return out


def hidden_fraction(window, floor, allreduce):
    """Per block: (floor + all-reduce - window) / all-reduce."""
    return [(f + allreduce - w) / allreduce for w, f in zip(window, floor)]


def summarise_link(py, cpp, ks):
    m = py["models"]["large"]
    ar = median(m["allreduce"])
    bwd = median(m["backward"])
    rows = {}
    for k in ks:
        t = dict(m["times"][str(k)])
        if cpp:  # its contenders' block times, not the traces kept beside them
            t.update({c: v for c, v in cpp[str(k)].items() if c != "rank_traces"})
        row = {}
        for c, ts in t.items():
            if not ts:
                continue
            floor = t["local_cpp"] if c in ("gradaccum_cpp", "local_cpp") else t["local"]
            cell = {"window_ms": 1e3 * median(ts), "block_ms": [1e3 * x for x in ts]}
            if not c.startswith("local"):
                n = min(len(ts), len(floor))
                fr = hidden_fraction(ts[:n], floor[:n], ar)
                cell.update(hidden=median(fr), hidden_min=min(fr), hidden_max=max(fr))
            row[c] = cell
        rows[str(k)] = row
    return {"allreduce_ms": 1e3 * ar, "allreduce_ms_all": [1e3 * x for x in m["allreduce"]],
            "allreduce_bytes": m["allreduce_bytes"], "backward_ms": 1e3 * bwd,
            "ceiling": min(1.0, bwd / ar), "cells": rows,
            "buckets": (m["stats"].get(str(ks[0])) or {}).get("buckets")}


def quota_env(args):
    """--compute-quota: the workers' environment for it (see _bench_worker.py,
    cap_compute_thread); the cgroup v1 cpu hierarchy through this process's
    root, since `ip netns exec` mounts a /sys of its own without it."""
    if not args.compute_quota:
        return {}
    return {"GRADACCUM_BENCH_COMPUTE_QUOTA": str(args.compute_quota),
            "GRADACCUM_BENCH_CGROUP_DIR": f"/proc/{os.getpid()}/root{CGROUP_CPU}"}


def quota_unavailable_reason():
    if not os.path.isfile(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us")) or not os.access(CGROUP_CPU, os.W_OK):
        return f"--compute-quota needs a writable cgroup v1 cpu hierarchy at {CGROUP_CPU}"
    return None


def remove_quota_groups():
    """Empty cgroups a killed worker left behind."""
    for name in os.listdir(CGROUP_CPU) if os.path.isdir(CGROUP_CPU) else []:
        if name.startswith("gradaccum-bench-"):
            try:
                os.rmdir(os.path.join(CGROUP_CPU, name))
            except OSError:
                pass


def link_runs(args, configs, ks):
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRADACCUM_BENCH_MICRO_BATCH": str(args.micro_batch),
           "GRADACCUM_BENCH_BUCKET_CAP_MB": str(args.bucket_cap_mb),
           "GRADACCUM_BENCH_COMPUTE_NICE": str(args.compute_nice), **quota_env(args)}
    out = []
    for nodes, rate, with_cpp in configs:
        log(f"link: {nodes} nodes, {rate}")
        with _netns.Cluster(nodes=nodes, rate=rate, delay=args.delay) as cluster:
            name = f"net-{nodes}n-{rate}"
            blocks = 1 if args.quick else (2 if nodes > 2 else 5)
            py = run_python(cluster, args, ["large"], ks, ["local", "ddp_nosync", "gradaccum_py"],
                            1 if args.quick else 4, blocks, 40 if args.quick else 100, env, name + "-py")
            cpp = None
            if with_cpp and args.cpp_bench:
                cpp = run_cpp(cluster, args, ks, 1 if args.quick else 2, min(blocks, 4), env, name + "-cpp")
            s = summarise_link(py, cpp, ks)
            s.update(nodes=nodes, rate=rate, shaper=cluster.shaper, delay_emulated=cluster.delay_emulated,
                     blocks=len(py["models"]["large"]["times"][str(ks[0])]["local"]))
            out.append(s)
            for k in ks:
                log(f"  K={k}: " + "  ".join(
                    f"{c}={cell['window_ms']:.0f}ms" + (f" hidden {cell['hidden']:.2f}" if "hidden" in cell else "")
                    for c, cell in s["cells"][str(k)].items()) + f"  (all-reduce {s['allreduce_ms']:.0f} ms)")
    return out


def window_ranks(rank_traces, k, contender, block):
    """Each rank's {"timeline", "origin", "marks"} of one block's last window
    (origin: the clock just before the synchronising acc.backward())."""
    out = []
    for rt in rank_traces:
        tr = rt[str(k)][contender][block] if contender else rt[block]
        if not tr.get("timeline") or not tr["timeline"].get("buckets"):
            return None
        out.append({"timeline": tr["timeline"], "origin": tr["marks"][-1][1], "marks": tr["marks"]})
    return out


def phases(rank_traces, k, contender):
    """Where a window's time goes, from the clock marks of each block's last
    window (K=1: one micro-step): forward, backward (call to return) and step
    (optimizer step, zero_grad; gradaccum's write-back is in backward: it
    runs before acc.backward() returns), each the slowest rank's, median
    [min-max] over blocks, in ms. With K > 1, forward and backward are the
    synchronising micro-step's."""
    out = {}
    # Python's traces are per K and contender; C++'s (contender None) per block.
    blocks_of = (lambda rt: rt) if contender is None else (lambda rt: rt.get(str(k), {}).get(contender, []))
    for name, a, b in (("forward", 0, 1), ("backward", 1, 2), ("step", 2, 3)):
        per_block = []
        for blk in range(min(len(blocks_of(rt)) for rt in rank_traces)):
            marks = [blocks_of(rt)[blk].get("marks") for rt in rank_traces]
            if not all(marks):
                break
            per_block.append(1e3 * max(mk[-1][b] - mk[-1][a] for mk in marks))
        if per_block:
            out[name] = spread(per_block)
    return out


def timeline_hidden(a, allreduce_s):
    """(ms left after backward's end, 1 - that / the lone all-reduce, that
    ÷ the window's bound) for one window's analysis (_bound.analyse)."""
    tail = a["finished_ms"] - a["backward_end_ms"]
    hidden = 1 - tail / (1e3 * allreduce_s)
    return tail, hidden, hidden / a["bound"] if a["bound"] > 0 else float("nan")


def bound_cells(m, k, rate, contenders, cpp=None):
    """Per block: the bound from that block's gradaccum timeline, the hidden
    fractions of the block's windows, and their ratios (see _bound.py)."""
    times, pb = m["times"][str(k)], m["param_bytes"]
    ar = median(m["allreduce"])
    blocks = len(times["local"])
    per = {"bound": [], "bucket_bound": [], "backward_end_ms": [], "done_by_end": [], "lag_ms": [],
           "launched_in_backward": [], "tail_ms": [], "timeline_hidden": [], "timeline_ratio": []}
    hidden = {c: hidden_fraction(times[c], times["local"], ar) for c in contenders if c in times}
    analyses, rest = [], []
    for b in range(blocks):
        ranks = window_ranks(m["rank_traces"], k, "gradaccum_py", b)
        if ranks is None:
            analyses.append(None)
            continue
        a = _bound.analyse(ranks, pb, rate)
        analyses.append((a, ranks))
        per["bound"].append(a["bound"])
        per["bucket_bound"].append(a["bucket_bound"])
        per["backward_end_ms"].append(a["backward_end_ms"])
        per["done_by_end"].append(a["done_by_end"])
        per["launched_in_backward"].append(a["buckets_launched_in_backward"])
        # The reducer's schedule alone, on the timeline's clock: what was left
        # after the last rank's backward ended (the last buckets and the
        # write-back) against the lone all-reduce; compute slowed by the
        # communication does not count here, as the bound assumes.
        tail, th, tr = timeline_hidden(a, ar)
        per["tail_ms"].append(tail)
        per["timeline_hidden"].append(th)
        per["timeline_ratio"].append(tr)
        if "gradaccum_py" in hidden:
            rest.append(th - hidden["gradaccum_py"][b])
        for cap, v in _bound.cap_bounds(a["combined"], rate, [c * 2**20 for c in CAPS_MB]).items():
            per.setdefault(f"cap_bound_{cap / 2**20:g}", []).append(v)
        # The call-to-return time of the synchronising acc.backward() less the
        # timeline's span: how far the clock marks are off the reducer's.
        per["lag_ms"].append(max(1e3 * (r["marks"][-1][2] - r["marks"][-1][1] - r["timeline"]["finished"])
                                 for r in ranks))
    cell = {k2: spread(v) for k2, v in per.items()}
    cell["buckets"] = analyses[-1][0]["buckets"] if analyses and analyses[-1] else None
    for c, h in hidden.items():
        cell[c] = {"hidden": spread(h), "hidden_blocks": h}
        if per["bound"] and len(per["bound"]) == len(h):
            cell[c]["ratio"] = spread([x / bnd for x, bnd in zip(h, per["bound"])])
        if c == "gradaccum_py":  # the schedule's figures are from its timelines: kept with it, as C++'s
            cell[c].update({key: cell.pop(key) for key in ("tail_ms", "timeline_hidden", "timeline_ratio")})
            # What the window lost besides the schedule, per block: its time
            # over the floor that is not the communication left after backward.
            cell[c]["rest"] = spread(rest)
    if cpp and cpp.get("rank_traces"):
        h = hidden_fraction(cpp["gradaccum_cpp"], cpp["local_cpp"], ar)
        bnds, tails, ths, trs, rests = [], [], [], [], []
        for b in range(len(h)):
            ranks = window_ranks([rt for rt in cpp["rank_traces"]], k, None, b)
            a = _bound.analyse(ranks, pb, rate) if ranks else None
            bnds.append(a["bound"] if a else float("nan"))
            if a:
                tail, th, tr = timeline_hidden(a, ar)
                tails.append(tail)
                ths.append(th)
                trs.append(tr)
                rests.append(th - h[b])
        cell["gradaccum_cpp"] = {"hidden": spread(h), "hidden_blocks": h, "bound": spread(bnds),
                                 "ratio": spread([x / bnd for x, bnd in zip(h, bnds)]),
                                 "tail_ms": spread(tails), "timeline_hidden": spread(ths),
                                 "timeline_ratio": spread(trs), "rest": spread(rests),
                                 "window_ms": 1e3 * median(cpp["gradaccum_cpp"]),
                                 "floor_ms": 1e3 * median(cpp["local_cpp"])}
        ph = phases(cpp["rank_traces"], k, None)
        if ph:
            cell["gradaccum_cpp"]["phases_ms"] = ph
    for c in ("local",) + tuple(contenders):
        if c in times:
            cell.setdefault(c, {})["window_ms"] = 1e3 * median(times[c])
            ph = phases(m["rank_traces"], k, c)
            if ph:
                cell[c]["phases_ms"] = ph
    # The block whose gradaccum hidden fraction is the median one: its window for the trace.
    pick = None
    if hidden.get("gradaccum_py") and any(analyses):
        ok = [b for b in range(blocks) if analyses[b]]
        pick = sorted(ok, key=lambda b: hidden["gradaccum_py"][b])[len(ok) // 2]
    return cell, (analyses[pick] if pick is not None else None), pick


def bound_runs(args):
    """The hidden fraction against the schedule bound, transformer and MLP (see README)."""
    models = [x for x in args.bound_models.split(",") if x]
    ks = [int(k) for k in args.bound_ks.split(",")]
    cap = args.bound_bucket_cap_mb if args.bound_bucket_cap_mb is not None else args.bucket_cap_mb
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "GRADACCUM_BENCH_MICRO_BATCH": str(args.bound_micro_batch),
           "GRADACCUM_BENCH_GPT_MICRO_BATCH": str(args.gpt_micro_batch),
           "GRADACCUM_BENCH_BUCKET_CAP_MB": str(cap),
           "GRADACCUM_BENCH_FIRST_BUCKET_CAP_MB": str(args.first_bucket_cap_mb),
           "GRADACCUM_BENCH_COMPUTE_NICE": str(args.compute_nice), **quota_env(args)}
    contenders = ["local", "ddp_nosync", "gradaccum_py"]
    blocks = 1 if args.quick else args.bound_blocks
    micro = 1 if args.quick else max(6, max(ks))  # micro-steps per timed command: 6 windows of K=1
    out = {"rate": args.bound_rate, "nodes": 2, "ks": ks, "bucket_cap_mb": cap,
           "first_bucket_cap_mb": args.first_bucket_cap_mb, "compute_quota": args.compute_quota, "models": {}}
    log(f"schedule bound: 2 nodes, {args.bound_rate}, models {', '.join(models)}, K {args.bound_ks}, "
        f"bucket caps {cap:g} / {args.first_bucket_cap_mb:g} MiB")
    with _netns.Cluster(nodes=2, rate=args.bound_rate, delay=args.delay) as cluster:
        py = run_python(cluster, args, models, ks, contenders, micro, blocks, 30 if args.quick else args.bound_budget_s,
                        env, "bound-py", beside_reps=2 if args.quick else 5)
        cpps = {}
        if args.cpp_bench and not args.bound_no_cpp:
            for model in models:
                cpps[model] = run_cpp(cluster, args, ks, max(1, micro // max(ks)), blocks, env, f"bound-cpp-{model}",
                                      model=model)
        out.update(shaper=cluster.shaper, delay_emulated=cluster.delay_emulated)
    for model in models:
        m = py["models"][model]
        ar = median(m["allreduce"])
        rate = m["allreduce_bytes"] / ar
        st = m["stats"].get(str(ks[-1])) or {}
        beside = m.get("backward_beside") or {}
        res = {"parameters": m["parameters"], "gradient_bytes": sum(m["param_bytes"]),
               "bytes_per_window": st.get("last_window_bytes"), "collectives_per_window":
                   st.get("last_window_collectives"), "micro_batch": m["micro_batch"],
               "allreduce_ms": 1e3 * ar, "rate_MBps": rate / 1e6, "backward_ms": 1e3 * median(m["backward"]),
               # The local backward alone and with the lone all-reduce alongside, in turns (ms;
               # each turn's slowest rank), and per turn the one less the other.
               "backward_beside_ms": {how: [1e3 * t for t in ts] for how, ts in beside.items()},
               "backward_slowed_ms": spread([1e3 * (b - a) for a, b in zip(beside["alone"], beside["beside"])])
               if beside else None,
               "bucket_indices": m["bucket_indices"].get(str(ks[-1])), "param_names": m["param_names"],
               "param_bytes": m["param_bytes"], "cells": {}}
        for k in ks:
            cell, picked, block = bound_cells(m, k, rate, ["ddp_nosync", "gradaccum_py"],
                                              (cpps.get(model) or {}).get(str(k)))
            res["cells"][str(k)] = cell
            if picked and k == max(ks):
                a, ranks = picked
                res["trace_window"] = {"K": k, "block": block, "combined": a["combined"],
                                       "ranks": ranks, "bound": a["bound"], "bucket_bound": a["bucket_bound"],
                                       "hidden": cell["gradaccum_py"]["hidden_blocks"][block]}
        out["models"][model] = res
        for k in ks:
            c = res["cells"][str(k)]
            ga, dd = c.get("gradaccum_py", {}), c.get("ddp_nosync", {})

            def f(x):
                return f"{x['median']:.2f}" if x else "—"
            log(f"  {model} K={k}: bound {f(c.get('bound'))} (buckets {f(c.get('bucket_bound'))}), gradaccum "
                f"hidden {f(ga.get('hidden'))} ratio {f(ga.get('ratio'))}, DDP hidden {f(dd.get('hidden'))} "
                f"ratio {f(dd.get('ratio'))}"
                + (f", C++ hidden {f(c['gradaccum_cpp']['hidden'])} ratio {f(c['gradaccum_cpp']['ratio'])}"
                   if "gradaccum_cpp" in c else ""))
            for name in ("local", "ddp_nosync", "gradaccum_py", "gradaccum_cpp"):
                ph = c.get(name, {}).get("phases_ms")
                if ph:
                    log(f"    {name} K={k} (ms): " + ", ".join(f"{p} {v['median']:.0f} [{v['min']:.0f}-{v['max']:.0f}]"
                                                         for p, v in ph.items()))
        log(f"  {model}: {res['parameters']:,} parameters, {res['gradient_bytes']:,} B of gradients, "
            f"{res['bytes_per_window']} B and {res['collectives_per_window']} all-reduces per window; lone "
            f"all-reduce {res['allreduce_ms']:.0f} ms ({res['rate_MBps']:.0f} MB/s), local backward "
            f"{res['backward_ms']:.0f} ms"
            + (f"; a local backward {res['backward_slowed_ms']['median']:.0f} ms slower with the lone all-reduce "
               f"alongside (median of {len(res['backward_beside_ms']['alone'])} turns)"
               if res["backward_slowed_ms"] else ""))
    return out


def growth_runs(args):
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GRADACCUM_BENCH_MICRO_BATCH": "32"}
    contenders = ["local", "ddp_nosync", "gradaccum_py"]
    rate = "1gbit"
    quick = args.quick
    ks = [1, 4, 16] if quick else [1, 2, 4, 8, 16, 32, 64]
    sizes = ["small", "m1"] if quick else GROWTH_SIZES
    out = {"rate": rate, "micro_batch": 32}
    log(f"growth on {rate}")
    with _netns.Cluster(nodes=2, rate=rate) as cluster:
        r = run_python(cluster, args, ["large"], ks, contenders, 64 if not quick else 16, 1, 0, env, "growth-k")
        m = r["models"]["large"]
        out["k"] = {"ks": ks, "allreduce_ms": 1e3 * median(m["allreduce"]),
                    "window_ms": {c: [1e3 * m["times"][str(k)][c][0] for k in ks] for c in contenders}}
        r = run_python(cluster, args, sizes, [4], contenders, 8, 1, 0, env, "growth-size")
        out["size"] = {"models": sizes, "parameters": [num_parameters(s) for s in sizes],
                       "allreduce_ms": [1e3 * median(r["models"][s]["allreduce"]) for s in sizes],
                       "window_ms": {c: [1e3 * r["models"][s]["times"]["4"][c][0] for s in sizes]
                                     for c in contenders}}
    ranks = [1, 2] if quick else [1, 2, 4]
    out["ranks"] = {"ranks": ranks, "window_ms": {c: [] for c in contenders}, "allreduce_ms": []}
    for n in ranks:
        with _netns.Cluster(nodes=n, rate=rate) as cluster:
            r = run_python(cluster, args, ["large"], [4], contenders, 8, 1 if quick else 2, 0, env,
                           f"growth-ranks{n}")
        m = r["models"]["large"]
        out["ranks"]["allreduce_ms"].append(1e3 * median(m["allreduce"]))
        for c in contenders:
            out["ranks"]["window_ms"][c].append(1e3 * median(m["times"]["4"][c]))
    return out


def bound_targets(bnd):
    out = []
    for model, r in bnd.get("models", {}).items():
        for k, c in r["cells"].items():
            dd = (c.get("ddp_nosync") or {}).get("hidden")
            for name in ("gradaccum_py", "gradaccum_cpp"):
                cell = c.get(name) or {}
                if not cell.get("ratio"):
                    continue
                ratio, h = cell["ratio"]["median"], cell["hidden"]["median"]
                # C++'s ratios are against the bound of its own timelines.
                bnd = (cell if name == "gradaccum_cpp" else c)["bound"]["median"]
                out.append({"target": f"{LABELS[name]}: hidden >= 0.9 x bound, {model}, K={k}",
                            "result": "PASS" if ratio >= 0.9 else "MISS",
                            "detail": f"hidden {h:.2f}, bound {bnd:.2f}, ratio per block {ratio:.2f} "
                                      f"[{cell['ratio']['min']:.2f}–{cell['ratio']['max']:.2f}]"})
                if dd:
                    out.append({"target": f"{LABELS[name]}: hidden >= DDP + no_sync's, {model}, K={k}",
                                "result": "PASS" if h >= dd["median"] else "MISS",
                                "detail": f"{h:.2f} vs DDP {dd['median']:.2f}"})
                # The schedule alone (timeline; the compute's slowdown left out).
                sched, th = cell.get("timeline_ratio"), cell.get("timeline_hidden")
                if sched and th:
                    out.append({"target": f"{LABELS[name]}: hidden by the schedule (timeline) >= 0.9 x bound, "
                                          f"{model}, K={k}",
                                "result": "PASS" if sched["median"] >= 0.9 else "MISS",
                                "detail": f"hidden {th['median']:.2f}, bound {bnd:.2f}, ratio per block "
                                          f"{sched['median']:.2f} [{sched['min']:.2f}–{sched['max']:.2f}]"})
    return out


def check_targets(links, ks):
    out = []
    for s in links:
        for k in ks:
            c = s["cells"][str(k)]
            ddp = c.get("ddp_nosync", {}).get("hidden")
            for name in ("gradaccum_py", "gradaccum_cpp"):
                cell = c.get(name)
                if not cell or ddp is None:
                    continue
                h = cell["hidden"]
                ok = h >= ddp and h >= 0.5
                why = []
                if h < ddp:
                    why.append(f"below DDP's {ddp:.2f}")
                if h < 0.5:
                    why.append("below 0.50" + (f"; the ceiling here is {s['ceiling']:.2f} (one backward "
                                               f"{s['backward_ms']:.0f} ms vs all-reduce {s['allreduce_ms']:.0f} ms)"
                                               if s["ceiling"] < 0.5 else ""))
                out.append({"target": f"{LABELS[name]} hidden >= max(DDP, 0.50), {s['nodes']} nodes {s['rate']}, "
                                      f"K={k}",
                            "result": "PASS" if ok else "MISS",
                            "detail": f"{h:.2f} vs DDP {ddp:.2f}" + (f" ({'; '.join(why)})" if why else "")})
    return out


def run(args):
    reason = _netns.unavailable_reason()
    if reason:
        log(f"bench_net: skipped, network namespaces unavailable: {reason}")
        return {"skipped": reason}
    os.makedirs(args.log_dir, exist_ok=True)
    ks = [int(k) for k in args.net_ks.split(",")]
    configs = []
    links = args.links or ("2:1gbit" if args.quick else "2:1gbit,2:10gbit,4:1gbit")
    for item in ([] if links == "none" else links.split(",")):
        nodes, rate = item.split(":")
        configs.append((int(nodes), rate, int(nodes) == 2))  # C++ on 2 nodes (time)
    if args.compute_quota:
        if not 0.1 <= args.compute_quota < 1:
            raise SystemExit(f"bench_net: --compute-quota {args.compute_quota:g}: expected a fraction of a core "
                             f"in [0.1, 1)")
        reason = quota_unavailable_reason()
        if reason:
            raise SystemExit(f"bench_net: {reason}")
        remove_quota_groups()
    t0 = time.perf_counter()
    bnd = None
    try:
        if args.bound_models:
            bnd = bound_runs(args)
            bnd["targets"] = bound_targets(bnd)
            write_bound_outputs(bnd, getattr(args, "trace_base", None), args.quick)
        links = link_runs(args, configs, ks)
    finally:
        remove_quota_groups()
    growth = None if args.no_growth else growth_runs(args)
    return {"ks": ks, "links": links, "targets": check_targets(links, ks), "growth": growth, "bound": bnd,
            "bucket_cap_mb": args.bucket_cap_mb, "compute_quota": args.compute_quota,
            "micro_batch": args.micro_batch, "seconds": time.perf_counter() - t0}


def add_arguments(p):
    p.add_argument("--delay", default="0.2ms", help="one-way delay per link where the kernel has netem")
    p.add_argument("--allreduce-reps", type=int, default=10)
    p.add_argument("--no-growth", action="store_true")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0,
                   help="bucket cap of DDP and gradaccum alike on the throttled links (default 4)")
    p.add_argument("--micro-batch", type=int, default=NET_MICRO_BATCH,
                   help=f"rows per micro-batch on the throttled links (default {NET_MICRO_BATCH})")
    p.add_argument("--net-ks", default="1,4,16", help="values of K on the throttled links")
    p.add_argument("--compute-nice", type=int, default=0,
                   help="niceness of each rank's compute thread (Gloo's threads keep 0): "
                        "communication gets a core whenever it needs one")
    p.add_argument("--compute-quota", type=float, default=0.0,
                   help="cap each rank's compute thread at this fraction of a core, 0.1 <= F < 1 (cgroup v1 "
                        "cpu quota; Gloo's threads uncapped), in the bound and link runs: with 2 ranks on 2 "
                        "cores, 2 (1 - F) cores stay free for communication, as on a node with spare cores "
                        "(default 0: no cap)")
    p.add_argument("--links", default=None,
                   help="NODES:RATE,... (default 2:1gbit,2:10gbit,4:1gbit; --quick: 2:1gbit; none: no link runs)")
    p.add_argument("--bound-models", default="gpt,large",
                   help="models of the schedule-bound part, on 2 nodes (empty: skip it)")
    p.add_argument("--bound-ks", default="1", help="values of K of the schedule-bound part (default 1: with "
                   "K=4 the floor's noise swamps the fraction here)")
    p.add_argument("--bound-blocks", type=int, default=5, help="blocks of the schedule-bound part")
    p.add_argument("--bound-budget-s", type=float, default=150, help="stop adding blocks after this, per model")
    p.add_argument("--bound-rate", default="1gbit", help="link rate of the schedule-bound part")
    p.add_argument("--bound-micro-batch", type=int, default=1024,
                   help="rows per MLP micro-batch in the schedule-bound part (default 1024: backward ~ all-reduce)")
    p.add_argument("--gpt-micro-batch", type=int, default=8,
                   help="sequences per transformer micro-batch in the schedule-bound part")
    p.add_argument("--bound-bucket-cap-mb", type=float, default=None,
                   help="bucket cap of the schedule-bound part (default: --bucket-cap-mb)")
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0,
                   help="gradaccum's first bucket cap in the schedule-bound part (DDP's stays 1 MiB)")
    p.add_argument("--bound-no-cpp", action="store_true", help="no C++ contender in the schedule-bound part")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpp-bench", default=os.path.join(ROOT, "build", "bench", "bench_window"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-dir", default=os.path.join(ROOT, "build", "bench-logs"))
    p.add_argument("--out", default=None, help="JSON output (default: print only)")
    add_arguments(p)
    args = p.parse_args()
    if args.cpp_bench and not os.access(args.cpp_bench, os.X_OK):
        log(f"warning: {args.cpp_bench} not built: no C++ contender")
        args.cpp_bench = None
    if args.out:
        args.trace_base = os.path.splitext(args.out)[0]
    result = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if result.get("growth"):
            plot_growth(result["growth"], os.path.splitext(args.out)[0] + "-growth.png", args.quick)
    print(markdown(result, "growth.png", lambda p: os.path.relpath(os.path.join(ROOT, p), HERE)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
