"""CPU benchmark: gradaccum vs torch DDP, 2 Gloo ranks on loopback.

    python benchmarks/bench.py --cpp-bench build/bench/bench_window   (make bench; 40-55 min on 2 cores)
    python benchmarks/bench.py --quick                                 (a few minutes; a smoke test)
    python benchmarks/bench.py --readme benchmarks/RESULTS.md          (also refresh its generated section)

For each model (small: ~0.3M parameters, large: ~11M: Linear/ReLU stacks; gpt: a 12M-parameter
GPT-style transformer on random tokens, 2 sequences of 128 tokens per micro-batch; SGD,
micro-batches of 32 rows) and K in {1, 4, 16} micro-batches per optimizer step,
one "window" (K forward/backward passes, one optimizer step) of each contender:

  ddp_nosync     torch DDP, no_sync() on the first K-1 micro-steps     (anchor)
  ddp_every      torch DDP all-reducing at every micro-step
  gradaccum_py   gradaccum.Accumulator(steps=K) from Python
  gradaccum_cpp  gradaccum::Accumulator from C++ (benchmarks/cpp/bench_window.cpp)
  local          no communication at all: the floor

All contenders' processes stay up side by side (two Python ranks, two C++
ranks, OMP_NUM_THREADS=1 each) and are driven over stdin one command at a time,
so only one pair computes at any moment. Measurements come in blocks; within a
block every contender runs each K once, in an order rotated from block to block,
so drift on a shared machine hits all contenders alike. Per block and cell the
median window time is taken; the report gives the median over blocks and the
median and min-max over blocks of its ratio to the anchor in the same block.

Also measured: all-reduces and bytes per window (gradaccum: its stats();
DDP: "gloo:all_reduce" events counted by torch.profiler over one window),
peak RSS per rank (VmHWM) of DDP and gradaccum with and without
gradient_as_bucket_view, each variant in a fresh pair of processes, and one
all-reduce of the whole gradient timed alone, to set the overhead over the
floor against.

Then (unless --no-net / --no-instr) the two parts that do not depend on a
quiet machine: bench_net.py (the fraction of the all-reduce hidden behind
backward on a throttled multi-node link, network namespaces and torchrun's c10d
rendezvous; and how a window's cost grows with K, model size and ranks) and
bench_instr.py (instruction counts under callgrind), and bench_mixed.py (fp32
accumulation of bf16 gradients: memory and micro-step time; comm_dtype: bytes).

Writes benchmarks/results/cpu-latest.{json,md,png} and cpu-latest-growth.png
(another name with --name).
"""
import argparse
import datetime
import json
import os
import platform
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _bench_worker import GPT_MICRO_BATCH, MICRO_BATCH, MODEL_NAMES, MODELS, TRANSFORMERS, num_parameters  # noqa: E402
import bench_instr  # noqa: E402
import bench_mixed  # noqa: E402
import bench_net  # noqa: E402

WORKER = os.path.join(HERE, "_bench_worker.py")
ANCHOR = "ddp_nosync"
CONTENDERS = ["ddp_nosync", "ddp_every", "gradaccum_py", "gradaccum_cpp", "local"]
LABELS = {
    "ddp_nosync": "DDP + no_sync (anchor)",
    "ddp_every": "DDP, all-reduce every micro-step",
    "gradaccum_py": "gradaccum (Python)",
    "gradaccum_cpp": "gradaccum (C++)",
    "local": "local only, no communication (floor)",
}
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
REPLY_TIMEOUT_S = 300


def log(msg):
    print(msg, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, port):
    env = dict(os.environ)
    # What torchrun sets for two ranks on one node (LOCAL_WORLD_SIZE: the
    # unset bucket cap follows it, Note [The default bucket cap]).
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


class Pair:
    """Two ranks of one program, driven by identical stdin commands."""

    def __init__(self, name, argv, log_dir):
        self.name = name
        port = free_port()
        self.logs = [open(os.path.join(log_dir, f"{name}.rank{r}.log"), "w") for r in range(2)]
        self.procs = [subprocess.Popen(argv, env=rank_env(r, port), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=self.logs[r], text=True,
                                       bufsize=1, cwd=ROOT) for r in range(2)]
        self.queues = [queue.Queue() for _ in range(2)]
        for proc, q in zip(self.procs, self.queues):
            threading.Thread(target=self._read, args=(proc, q), daemon=True).start()

    @staticmethod
    def _read(proc, q):
        for line in proc.stdout:
            if line.startswith("@@ "):
                q.put(json.loads(line[3:]))
        q.put(None)  # EOF

    def ask(self, command):
        for proc in self.procs:
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        replies = []
        for r, q in enumerate(self.queues):
            try:
                reply = q.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                reply = None
            if reply is None or "error" in reply:
                self.close(force=True)
                raise RuntimeError(f"{self.name} rank {r} failed on {command!r}: {reply}; "
                                   f"see {self.logs[r].name}")
            replies.append(reply)
        return replies

    def close(self, force=False):
        for proc in self.procs:
            if proc.poll() is None and not force:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5 if force else 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for f in self.logs:
            f.close()


def run_once(name, argv, log_dir, env=None, timeout=REPLY_TIMEOUT_S):
    """Two fresh ranks that each print one JSON line; returns both (parsed)."""
    port = free_port()
    logs = [open(os.path.join(log_dir, f"{name}.rank{r}.log"), "w") for r in range(2)]
    procs = [subprocess.Popen(argv, env={**rank_env(r, port), **(env or {})}, stdout=subprocess.PIPE, stderr=logs[r],
                              text=True, cwd=ROOT) for r in range(2)]
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for f in logs:
            f.close()
    replies = []
    for r, (proc, out) in enumerate(zip(procs, outs)):
        lines = [l[3:] if l.startswith("@@ ") else l for l in out.splitlines() if l.strip().startswith(("{", "@@"))]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{name} rank {r} exited {proc.returncode}; see {logs[r].name}")
        replies.append(json.loads(lines[-1]))
    return replies


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def windows_per_command(model, k, quick):
    """Timed windows per command: about the same number of micro-steps per K."""
    micro = {"small": 48, "large": 8, "gpt": 4}[model]
    if quick:
        micro = {"small": 16, "large": 1, "gpt": 1}[model]
    return max(1, micro // k)


# --------------------------------------------------------------------------- timing
def bench_model(model, args, cpp, log_dir):
    contenders = [c for c in CONTENDERS if c != "gradaccum_cpp" or cpp]
    steps = args.steps
    t_start = time.perf_counter()
    py = Pair(f"{model}-py", [sys.executable, WORKER, "--model", model, "--nonfinite", args.nonfinite],
              log_dir)
    pairs = {"py": py}
    if cpp:
        pairs["cpp"] = Pair(f"{model}-cpp", [cpp, "--model", model, "--serve", "--nonfinite", args.nonfinite],
                            log_dir)
    try:
        def run(contender, k, windows):
            if contender == "gradaccum_cpp":
                replies = pairs["cpp"].ask(f"run {k} {windows}")
            else:
                replies = py.ask(f"time {contender} {k} {windows}")
            return replies

        # Warm-up: build every contender (collectives at construction), fill caches.
        for k in steps:
            for c in contenders:
                run(c, k, 1 if model == "large" else 2)
        blocks = {k: {c: [] for c in contenders} for k in steps}
        extra = {k: {} for k in steps}
        n_blocks = args.blocks or ({"small": 3, "large": 2, "gpt": 2} if args.quick else
                                   {"small": 20, "large": 10, "gpt": 10})[model]
        budget = args.model_budget_s or (60 if args.quick else {"small": 60, "large": 150, "gpt": 150}[model])
        done = 0
        for b in range(n_blocks):
            if done >= min(3, n_blocks) and time.perf_counter() - t_start > budget:
                log(f"  {model}: time budget ({budget:.0f} s) reached after {done} blocks")
                break
            for ki, k in enumerate(steps):
                shift = (b + ki) % len(contenders)
                order = contenders[shift:] + contenders[:shift]
                if b % 2:
                    order.reverse()
                for c in order:
                    replies = run(c, k, windows_per_command(model, k, args.quick))
                    blocks[k][c].append(median(replies[0]["times"]))
                    if c == "gradaccum_py":
                        extra[k]["gradaccum_py_stats"] = replies[0]["stats"]
                    if c == "gradaccum_cpp":
                        extra[k]["gradaccum_cpp_stats"] = {key: replies[0][key] for key in
                                                           ("buckets", "last_window_collectives",
                                                            "last_window_bytes")}
            done += 1
            line = "  ".join(f"K={k}: " + " ".join(f"{c}={1e3 * blocks[k][c][-1]:.1f}" for c in contenders)
                             for k in steps)
            log(f"  {model} block {b + 1}/{n_blocks} ({time.perf_counter() - t_start:.0f} s) ms: {line}")

        # Collectives and bytes per window, counted by the profiler.
        profiles = {k: {} for k in steps}
        for k in steps:
            for c in ("ddp_nosync", "ddp_every", "gradaccum_py"):
                profiles[k][c] = py.ask(f"profile {c} {k}")[0]
        reps = 5 if args.quick else (10 if model == "large" else 30)
        allreduce = py.ask(f"allreduce {reps}")[0]
    finally:
        for p in pairs.values():
            p.close()
    return {"blocks": blocks, "extra": extra, "profiles": profiles, "allreduce": allreduce,
            "n_blocks": done, "seconds": time.perf_counter() - t_start}


# --------------------------------------------------------------------------- memory
def bench_memory(model, args, cpp, log_dir):
    """Peak RSS per rank, each variant in a fresh pair of processes.

    glibc's malloc raises its mmap threshold as large blocks are freed, after
    which freed tensors may stay in the heap: peak RSS then varies by tens of
    MiB from run to run. A fixed threshold (MALLOC_MMAP_THRESHOLD_, set alike for
    every variant) makes it reproducible to about a MiB and makes it track the
    live tensors.
    """
    k, windows = 4, 3
    out = []
    variants = [("ddp_nosync", 0), ("ddp_nosync", 1), ("gradaccum_py", 0), ("gradaccum_py", 1)]
    if not args.quick:
        variants.insert(0, ("local", 0))
        if cpp:
            variants += [("gradaccum_cpp", 0), ("gradaccum_cpp", 1)]
    for contender, bv in variants:
        name = f"{model}-mem-{contender}-bv{bv}"
        if contender == "gradaccum_cpp":
            argv = [cpp, "--model", model, "--steps", str(k), "--windows", str(windows - 1), "--warmup", "1",
                    "--bucket-view", str(bv), "--nonfinite", args.nonfinite]
        else:
            argv = [sys.executable, WORKER, "--model", model, "--mem", contender, "--bucket-view", str(bv),
                    "--steps", str(k), "--windows", str(windows), "--nonfinite", args.nonfinite]
        replies = run_once(name, argv, log_dir, env={"MALLOC_MMAP_THRESHOLD_": "131072"})
        rss = [r["peak_rss_kib"] for r in replies]
        out.append({"contender": contender, "bucket_view": bv, "K": k, "peak_rss_kib": rss,
                    "peak_rss_mib_max": max(rss) / 1024})
        log(f"  {model} memory {contender} bucket_view={bv}: peak RSS {max(rss) / 1024:.1f} MiB")
    return out


# --------------------------------------------------------------------------- summary
def summarise(model, timing, memory, steps):
    grad_bytes = num_parameters(model) * 4
    cells = {}
    blocks = timing["blocks"]
    for k in steps:
        anchor = blocks[k][ANCHOR]
        floor = blocks[k].get("local", [])
        row = {}
        for c, ts in blocks[k].items():
            ratios = [t / a for t, a in zip(ts, anchor)]
            over = [t - f for t, f in zip(ts, floor)]
            cell = {"window_ms": 1e3 * median(ts), "window_ms_min": 1e3 * min(ts), "window_ms_max": 1e3 * max(ts),
                    "ratio": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                    "overhead_ms": 1e3 * median(over) if floor else None,
                    "block_ms": [1e3 * t for t in ts]}
            if c in ("ddp_nosync", "ddp_every", "gradaccum_py"):
                p = timing["profiles"][k][c]
                cell["collectives"] = p["allreduce_calls"]
                cell["bytes"] = p["allreduce_bytes"]
                if c == "gradaccum_py":
                    cell["stats"] = {"buckets": p["stats_buckets"], "collectives": p["stats_collectives"],
                                     "bytes": p["stats_bytes"]}
                if "ddp_buckets" in p:
                    cell["buckets"] = p["ddp_buckets"]
            elif c == "gradaccum_cpp":
                s = timing["extra"][k]["gradaccum_cpp_stats"]
                cell["collectives"] = s["last_window_collectives"]
                cell["bytes"] = s["last_window_bytes"]
                cell["stats"] = {"buckets": s["buckets"], "collectives": s["last_window_collectives"],
                                 "bytes": s["last_window_bytes"]}
            else:
                cell["collectives"], cell["bytes"] = 0, 0
            row[c] = cell
        cells[k] = row
    ar = timing["allreduce"]
    return {"parameters": num_parameters(model), "gradient_bytes": grad_bytes, "cells": cells,
            "allreduce_alone_ms": 1e3 * median(ar["times"]), "allreduce_alone_bytes": ar["bytes"],
            "allreduce_alone_ms_all": [1e3 * t for t in ar["times"]],
            "memory": memory, "n_blocks": timing["n_blocks"], "seconds": timing["seconds"]}


def check_targets(summary, steps):
    """The issue's targets, each PASS or MISS (or SKIP when not measured)."""
    out = []

    def add(name, ok, detail):
        out.append({"target": name, "result": "SKIP" if ok is None else ("PASS" if ok else "MISS"),
                    "detail": detail})

    for model, limit, c in (("small", 0.90, "gradaccum_py"), ("large", 1.00, "gradaccum_py"),
                            ("small", 0.80, "gradaccum_cpp"), ("gpt", 1.00, "gradaccum_py"),
                            ("gpt", 1.00, "gradaccum_cpp")):
        s = summary.get(model)
        for k in steps:
            cell = s and s["cells"][k].get(c)
            if not cell:
                add(f"{c} <= {limit:.2f}x anchor, {model}, K={k}", None, "not measured")
                continue
            add(f"{c} <= {limit:.2f}x anchor, {model}, K={k}", cell["ratio"] <= limit,
                f"median ratio {cell['ratio']:.3f} (min {cell['ratio_min']:.3f}, max {cell['ratio_max']:.3f})")
    for model, s in summary.items():
        g = s["gradient_bytes"]
        for c in ("gradaccum_py", "gradaccum_cpp"):
            if c not in s["cells"][steps[0]]:
                continue
            per_k = [s["cells"][k][c] for k in steps]
            buckets = per_k[0]["stats"]["buckets"]
            coll_ok = all(x["collectives"] == x["stats"]["buckets"] for x in per_k)
            byts = [x["bytes"] for x in per_k]
            # One copy of the gradients, plus the reducer's few bytes of metadata
            # per bucket (window weight and has-gradient flags).
            bytes_ok = len(set(byts)) == 1 and g <= byts[0] <= g * 1.001
            add(f"{c} collectives/window = #buckets, {model}", coll_ok,
                f"buckets {buckets}; collectives per window " + ", ".join(
                    f"K={k}: {x['collectives']}" for k, x in zip(steps, per_k)))
            add(f"{c} bytes/window = one gradient copy, independent of K, {model}", bytes_ok,
                f"gradients {g:,} B; per window " + ", ".join(f"K={k}: {b:,}" for k, b in zip(steps, byts)))
        every = [s["cells"][k]["ddp_every"]["bytes"] for k in steps]
        nosync = [s["cells"][k]["ddp_nosync"]["bytes"] for k in steps]
        add(f"DDP without no_sync reduces K x the gradients, {model} (reference)",
            all(e == k * n for e, k, n in zip(every, steps, nosync)),
            ", ".join(f"K={k}: {e:,} B" for k, e in zip(steps, every)))
        mem = {(m["contender"], m["bucket_view"]): m["peak_rss_mib_max"] for m in s["memory"] or []}
        for bv in (0, 1):
            a, d = mem.get(("gradaccum_py", bv)), mem.get(("ddp_nosync", bv))
            if a is None or d is None:
                add(f"peak RSS gradaccum <= DDP, bucket_view={bv}, {model}", None, "not measured")
                continue
            add(f"peak RSS gradaccum <= DDP, bucket_view={bv}, {model}", a <= d,
                f"{a:.2f} MiB vs {d:.2f} MiB ({a - d:+.2f} MiB)")
    return out


# --------------------------------------------------------------------------- outputs
def fmt_bytes(b):
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else (f"{b / 1024:.1f} KiB" if b else "0")


def markdown(result, growth_png, rel=None):
    meta = result["meta"]
    steps = result["config"]["steps"]
    lines = [f"CPU: {meta['cpu']} ({meta['cpus']} cores), torch {meta['torch']}, gradaccum {meta['gradaccum']}, "
             f"{meta['date']}; load average {meta.get('load_before', '?')} before the run, "
             f"{meta.get('load_after', '?')} after (other work shared the machine)"
             f"{' — **quick run, not a measurement**' if result['config']['quick'] else ''}.", ""]
    if "net" in result:
        lines.append(bench_net.markdown(result["net"], growth_png, rel))
    if "instr" in result:
        lines.append(bench_instr.markdown(result["instr"]))
    if "mixed" in result:
        lines.append(bench_mixed.markdown(result["mixed"]))
    lines += [
        f"**Wall clock, loopback.** CPU, 2 Gloo ranks on loopback, 1 thread each; {meta['cpu']} ({meta['cpus']} cores), "
        f"torch {meta['torch']}, gradaccum {meta['gradaccum']}, {meta['date']}"
        f"{' — **quick run, not a measurement**' if result['config']['quick'] else ''}. "
        f"Micro-batches of {MICRO_BATCH} rows (MLPs) or {GPT_MICRO_BATCH} sequences of "
        f"{TRANSFORMERS['gpt']['seq']} tokens (transformer), SGD; window = K micro-batches + one optimizer step. "
        f"Time: median over blocks of each block's median window; ratio: to DDP + no_sync in the same "
        f"block, median [min–max] over blocks. Overhead: over the local-only floor. Both ranks and their "
        f"communication share 2 cores here: nothing is left to overlap on, so these ratios measure overhead "
        f"plus noise, not overlap (for that, see the throttled link above).",
        "",
    ]
    for model, s in result["summary"].items():
        lines += [f"**{model}** ({s['parameters']:,} parameters, gradients {fmt_bytes(s['gradient_bytes'])}; "
                  f"{s['n_blocks']} blocks; one all-reduce of the whole gradient alone: "
                  f"{s['allreduce_alone_ms']:.2f} ms)", "",
                  "| K | contender | window (ms) | ratio to anchor | overhead over floor (ms) | "
                  "overhead ÷ lone all-reduce | all-reduces / window | bytes / window |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for k in steps:
            for c in CONTENDERS:
                cell = s["cells"][k].get(c)
                if cell is None:
                    continue
                none = c == "local" or cell["overhead_ms"] is None
                over = "—" if none else f"{cell['overhead_ms']:+.2f}"
                frac = "—" if none else f"{cell['overhead_ms'] / s['allreduce_alone_ms']:.2f}"
                lines.append(
                    f"| {k} | {LABELS[c]} | {cell['window_ms']:.2f} | {cell['ratio']:.3f} "
                    f"[{cell['ratio_min']:.2f}–{cell['ratio_max']:.2f}] | {over} | {frac} | {cell['collectives']} | "
                    f"{fmt_bytes(cell['bytes'])} |")
        lines.append("")
    mem_rows = [(model, m) for model, s in result["summary"].items() for m in (s["memory"] or [])]
    if mem_rows:
        lines += ["Peak RSS per rank (VmHWM, the larger of the two ranks; each variant in fresh processes "
                  "with MALLOC_MMAP_THRESHOLD_=131072, 3 windows of K=4; every Python variant imports "
                  "gradaccum; C++ has no Python interpreter, so compare it only with itself):", "",
                  "| model | contender | gradient_as_bucket_view | peak RSS (MiB) |", "|---|---|---|---:|"]
        for model, m in mem_rows:
            lines.append(f"| {model} | {LABELS[m['contender']]} | {bool(m['bucket_view'])} | "
                         f"{m['peak_rss_mib_max']:.1f} |")
        lines.append("")
    lines += ["Targets:", "", "| | target | measured |", "|---|---|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['result']} | {t['target']} | {t['detail']} |")
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = result["config"]["steps"]
    models = list(result["summary"])
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
    styles = {"ddp_nosync": ("k", "o", "-"), "ddp_every": ("tab:red", "v", "--"),
              "gradaccum_py": ("tab:blue", "s", "-"), "gradaccum_cpp": ("tab:green", "D", "-"),
              "local": ("tab:gray", ".", ":")}
    for ax, model in zip(axes[0], models):
        s = result["summary"][model]
        for c in CONTENDERS:
            if c not in s["cells"][steps[0]]:
                continue
            ys = [s["cells"][k][c]["window_ms"] for k in steps]
            lo = [y - s["cells"][k][c]["window_ms_min"] for k, y in zip(steps, ys)]
            hi = [s["cells"][k][c]["window_ms_max"] - y for k, y in zip(steps, ys)]
            color, marker, ls = styles[c]
            ax.errorbar(steps, ys, yerr=[lo, hi], color=color, marker=marker, ls=ls, capsize=3, label=LABELS[c])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(steps)
        ax.set_xticklabels([str(k) for k in steps])
        ax.set_xlabel("K (micro-batches per optimizer step)")
        ax.set_ylabel("time per window (ms)")
        ax.set_title(f"{model}: {s['parameters'] / 1e6:.2f}M parameters "
                     f"(all-reduce alone {s['allreduce_alone_ms']:.1f} ms)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    meta = result["meta"]
    fig.suptitle(f"gradaccum vs torch DDP, 2 Gloo ranks on CPU (torch {meta['torch']}"
                 f"{', quick run' if result['config']['quick'] else ''}); bars: min–max over blocks",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_readme(path, table_md, md_rel):
    with open(path) as f:
        text = f.read()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        log(f"{path}: no {BEGIN} ... {END} markers; left unchanged")
        return
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    block = f"{BEGIN}\n<!-- generated by benchmarks/bench.py from {md_rel}; do not edit -->\n{table_md}{END}"
    with open(path, "w") as f:
        f.write(head + block + tail)
    log(f"updated {path}")


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpp-bench", default=os.path.join(ROOT, "build", "bench", "bench_window"),
                   help="the C++ contender (built by make build-cpp); skipped if missing")
    p.add_argument("--quick", action="store_true", help="a smoke run of about a minute (noisy figures)")
    p.add_argument("--models", default="small,large,gpt",
                   help="loopback models: the MLPs small, large and the transformer gpt (about 5 minutes of the run)")
    p.add_argument("--steps", default="1,4,16", help="values of K")
    p.add_argument("--blocks", type=int, default=0,
                   help="blocks per model (default: 20 small, 10 large; --quick: 3, 2)")
    p.add_argument("--model-budget-s", type=float, default=0,
                   help="stop adding blocks once a model's timing took this long (at least 3 blocks)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-RSS runs")
    p.add_argument("--nonfinite", default="skip", choices=("skip", "raise", "ignore"),
                   help="gradaccum's nonfinite mode (default: the library's default, skip)")
    p.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    p.add_argument("--log-dir", default=os.path.join(ROOT, "build", "bench-logs"),
                   help="the ranks' stderr logs")
    p.add_argument("--name", default=None, help="output base name (default: cpu-latest, cpu-quick with --quick)")
    p.add_argument("--readme", action="append", default=[],
                   help=f"replace the text between {BEGIN} and {END} in this file (repeatable)")
    p.add_argument("--no-net", action="store_true", help="skip bench_net.py (throttled links, growth)")
    p.add_argument("--no-instr", action="store_true", help="skip bench_instr.py (callgrind)")
    p.add_argument("--no-mixed", action="store_true", help="skip bench_mixed.py (bf16/fp16, comm_dtype)")
    p.add_argument("--no-loopback", action="store_true", help="skip the loopback wall-clock part")
    bench_net.add_arguments(p)
    bench_instr.add_arguments(p)
    bench_mixed.add_arguments(p)
    args = p.parse_args()
    args.steps = [int(k) for k in args.steps.split(",")]
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODEL_NAMES:
            p.error(f"unknown model {m!r} (have {MODEL_NAMES})")
    name = args.name or ("cpu-quick" if args.quick else "cpu-latest")

    import torch
    import gradaccum

    cpp = os.path.abspath(args.cpp_bench) if args.cpp_bench else None
    if cpp and not os.access(cpp, os.X_OK):
        log(f"warning: {args.cpp_bench} not found or not executable: the C++ contender is skipped "
            "(build it: make build-cpp)")
        cpp = None
    args.cpp_bench = cpp
    os.makedirs(args.out_dir, exist_ok=True)
    log_dir = args.log_dir
    os.makedirs(log_dir, exist_ok=True)

    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    extra = {}
    base = os.path.join(args.out_dir, name)
    args.trace_base = base  # bench_net's traces and bucket-timeline plot: {base}-trace-MODEL.json, {base}-timeline.png
    if not args.no_net:
        log("throttled multi-node links (bench_net.py)")
        extra["net"] = bench_net.run(args)
    if not args.no_instr:
        log("instruction counts (bench_instr.py)")
        if args.quick:
            args.instr_repeats = 1
        extra["instr"] = bench_instr.measure(args)
    if not args.no_mixed:
        log("mixed precision (bench_mixed.py)")
        extra["mixed"] = bench_mixed.measure(args)
    summary = {}
    for model in ([] if args.no_loopback else models):
        log(f"{model}: {num_parameters(model):,} parameters")
        timing = bench_model(model, args, cpp, log_dir)
        skip_memory = args.no_memory or (args.quick and model != models[-1])  # --quick: one model only
        memory = None if skip_memory else bench_memory(model, args, cpp, log_dir)
        summary[model] = summarise(model, timing, memory, args.steps)
    targets = check_targets(summary, args.steps)

    result = {
        "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
                 "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                 "gradaccum": gradaccum.__version__, "python": platform.python_version(),
                 "cpu": cpu_name(), "cpus": os.cpu_count(), "hostname": platform.node(),
                 "seconds": time.perf_counter() - t0},
        "config": {"quick": args.quick, "steps": args.steps,
                   "models": {m: MODELS.get(m) or TRANSFORMERS[m] for m in models},
                   "micro_batch": MICRO_BATCH, "gpt_micro_batch": GPT_MICRO_BATCH, "world_size": 2, "backend": "gloo", "threads_per_rank": 1,
                   "optimizer": "SGD", "nonfinite": args.nonfinite, "cpp_bench": cpp,
                   "contenders": {c: LABELS[c] for c in CONTENDERS}},
        "summary": summary,
        "targets": targets,
        **extra,
    }
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    growth_png = base + "-growth.png"
    if (extra.get("net") or {}).get("growth"):
        bench_net.plot_growth(extra["net"]["growth"], growth_png, args.quick)
    table = markdown(result, os.path.basename(growth_png),
                     lambda p: os.path.relpath(os.path.join(ROOT, p), args.out_dir))
    with open(base + ".md", "w") as f:
        f.write(table)
    if summary:
        plot(result, base + ".png")
    for path in args.readme:
        here = os.path.dirname(os.path.abspath(path))
        update_readme(path, markdown(result, os.path.relpath(growth_png, here),
                                     lambda p, here=here: os.path.relpath(os.path.join(ROOT, p), here)),
                      os.path.relpath(base + ".md", here))

    log("")
    log(table)
    log(f"wrote {base}.json, {base}.md, {base}.png in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
