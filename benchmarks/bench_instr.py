"""Instruction counts (valgrind's callgrind): repeatable overhead figures.

    python benchmarks/bench_instr.py [--cpp-bench build/bench/bench_window]
        [--cpp-baseline OTHER/build/bench/bench_window] [--cpp-only]

(bench.py runs it as part of `make bench`.) Two Gloo ranks on loopback, each
under `valgrind --tool=callgrind --instr-atstart=no`; rank 0's counts are
reported. After warm-up windows (not instrumented) each program switches
instrumentation on (and zeroes the counts) and off (and dumps them) with client
requests around each section: per contender, the K-1 no-sync micro-steps of a
window and whole windows; then one all-reduce of the whole gradient alone.
Instrumentation is global, so Gloo's threads count too (collection toggles
are per thread in callgrind and would miss them):

  Python (benchmarks/_bench_worker.py --instr, client requests through the
  small helper library build/bench/libbench_callgrind.so): plain local
  PyTorch (loss / K, backward; optimizer step), torch DDP + no_sync, gradaccum.
  C++ (bench_window --callgrind): plain LibTorch and gradaccum::Accumulator.

Every count includes all of the process's threads (Gloo's too), so Gloo's
waiting moves a count by up to ~0.6M from one run to the next: each program runs
--instr-repeats times (3), and every figure is the median over the runs, with
the runs' range beside the targets. The small model (297,098 parameters), K=4,
micro-batches of 32 rows, SGD.

Targets: a no-sync micro-step at or below plain local; a window at or below
the local window plus one all-reduce. With --cpp-baseline (bench_window built
against an earlier revision, say in a git worktree), that program runs in turn
with --cpp-bench, run by run, and its gradaccum micro-step and window are the
targets for this build's: the regression check, free of the lone all-reduce's
spread.
"""
import argparse
import glob
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "_bench_worker.py")
TIMEOUT_S = 600
VALGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no",
            "--dump-line=no", "--compress-strings=no"]
LANGUAGES = {"python": "Python", "cpp": "C++", "cpp_baseline": "C++ baseline"}
LABELS = {"local": "plain local", "ddp_nosync": "DDP + no_sync", "gradaccum_py": "gradaccum",
          "gradaccum": "gradaccum"}


def log(msg):
    print(msg, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_dumps(out_dir, pid):
    """{label: instructions} from callgrind's dumps of process `pid`."""
    counts = {}
    for path in glob.glob(os.path.join(out_dir, f"cg.{pid}.out.*")):
        label, total = None, None
        with open(path, errors="replace") as f:
            for line in f:
                prefix = "desc: Trigger: Client Request: "
                if line.startswith(prefix):
                    label = line[len(prefix):].strip()
                elif line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
        if label is not None and total is not None:
            counts[label] = total
    return counts


def run_pair(name, argv, out_dir, log_dir):
    port = free_port()
    procs, logs = [], []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   GRADACCUM_BENCH_MICRO_BATCH="32")
        env.pop("GRADACCUM_BENCH_BUCKET_CAP_MB", None)
        logs.append(open(os.path.join(log_dir, f"{name}.rank{rank}.log"), "w"))
        cmd = VALGRIND + [f"--callgrind-out-file={out_dir}/cg.%p.out"] + argv
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=logs[-1], text=True, cwd=ROOT))
    deadline = time.monotonic() + TIMEOUT_S
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    for rank, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            raise RuntimeError(f"{name} rank {rank} exited {p.returncode}; see {log_dir}/{name}.rank{rank}.log")
    replies = [json.loads(l[3:]) for out in outs for l in out.splitlines() if l.startswith("@@ ")]
    rank0 = next(r for r in replies if r["rank"] == 0)
    counts = [read_dumps(out_dir, p.pid) for p in procs]
    return rank0, counts


def measure(args):
    if not shutil.which("valgrind"):
        return {"skipped": "valgrind not installed (apt-get install valgrind; make deps does)"}
    helper = os.path.join(os.path.dirname(args.cpp_bench or os.path.join(ROOT, "build", "bench", "x")),
                          "libbench_callgrind.so")
    if not os.path.exists(helper):
        return {"skipped": f"{helper} not built (make build-cpp, with valgrind installed)"}
    os.makedirs(args.log_dir, exist_ok=True)
    out = {"model": "small", "K": args.instr_steps, "windows": args.instr_windows, "micro_batch": 32}
    out["repeats"] = args.instr_repeats
    programs = []
    if not getattr(args, "cpp_only", False):
        programs.append(("python", "instr-py", [sys.executable, WORKER, "--model", "small", "--instr", helper]))
    if args.cpp_bench:
        programs.append(("cpp", "instr-cpp", [args.cpp_bench, "--model", "small", "--callgrind"]))
    baseline = getattr(args, "cpp_baseline", None)
    if baseline:
        out["cpp_baseline_program"] = baseline
        programs.append(("cpp_baseline", "instr-cpp-baseline", [baseline, "--model", "small", "--callgrind"]))
    runs, info = {lang: [] for lang, _, _ in programs}, {}
    # Run by run, every program in turn: a baseline and the build under test
    # then alternate, and what drifts on the machine drifts for both.
    for i in range(args.instr_repeats):
        for lang, name, argv in programs:
            argv = argv + ["--steps", str(args.instr_steps), "--windows", str(args.instr_windows)]
            with tempfile.TemporaryDirectory(prefix="gradaccum-callgrind-") as tmp:
                t0 = time.perf_counter()
                info[lang], counts = run_pair(f"{name}.{i}", argv, tmp, args.log_dir)
                runs[lang].append(counts[0])
                log(f"  callgrind, {LANGUAGES[lang]} run {i + 1}/{args.instr_repeats}: "
                    f"{time.perf_counter() - t0:.0f} s")
    for lang, lang_runs in runs.items():
        labels = sorted(set().union(*lang_runs))
        out[lang] = {"rank0": {k: statistics.median([r[k] for r in lang_runs if k in r]) for k in labels},
                     "rank0_runs": lang_runs, "micro_steps": info[lang]["micro_steps"]}
    out["rows"], out["targets"] = table(out)
    return out


def run_ratios(out, lang, num, den):
    """The ratio num(run) / den(run) of each run, for the spread beside a target."""
    ratios = []
    for r in out[lang].get("rank0_runs", []):
        try:
            ratios.append(num(r) / den(r))
        except (KeyError, TypeError, ZeroDivisionError):
            pass
    return f"; runs {min(ratios):.3f}–{max(ratios):.3f}x" if len(ratios) > 1 else ""


def table(out):
    """Per-unit counts (one micro-step, one window) and the targets."""
    rows, targets = [], []
    for lang, contenders, ga in (("python", ("local", "ddp_nosync", "gradaccum_py"), "gradaccum_py"),
                                 ("cpp", ("local", "gradaccum"), "gradaccum"),
                                 ("cpp_baseline", ("local", "gradaccum"), "gradaccum")):
        if lang not in out:
            continue
        c0 = out[lang]["rank0"]
        n_micro = out[lang]["micro_steps"]
        ar = c0.get("allreduce")
        per = {}
        for c in contenders:
            micro = c0.get(f"{c} micro")
            window = c0.get(f"{c} window")
            per[c] = (micro / n_micro if micro else None, window / out["windows"] if window else None)
            rows.append({"language": LANGUAGES[lang], "contender": LABELS[c],
                         "micro": per[c][0], "window": per[c][1],
                         "micro_ratio": per[c][0] / per["local"][0] if per[c][0] and per["local"][0] else None,
                         "window_ratio": per[c][1] / per["local"][1] if per[c][1] and per["local"][1] else None})
        rows.append({"language": LANGUAGES[lang], "contender": "one all-reduce alone",
                     "micro": None, "window": ar, "micro_ratio": None, "window_ratio": None})
        name = LANGUAGES[lang]
        gm, gw = per[ga]
        lm, lw = per["local"]
        if gm and lm:
            spread = run_ratios(out, lang, lambda r: r[f"{ga} micro"], lambda r: r["local micro"])
            targets.append({"target": f"{name}: gradaccum no-sync micro-step <= plain local",
                            "result": "PASS" if gm <= lm else "MISS",
                            "detail": f"{gm:,.0f} vs {lm:,.0f} instructions ({gm / lm:.3f}x{spread})"})
        if gw and lw and ar:
            spread = run_ratios(out, lang, lambda r: r[f"{ga} window"],
                                lambda r: r["local window"] + r["allreduce"] * out["windows"])
            targets.append({"target": f"{name}: gradaccum window <= local window + one all-reduce",
                            "result": "PASS" if gw <= lw + ar else "MISS",
                            "detail": f"{gw:,.0f} vs {lw:,.0f} + {ar:,.0f} = {lw + ar:,.0f} "
                                      f"({gw / (lw + ar):.3f}x{spread})"})
        if lang == "python" and per["ddp_nosync"][0]:
            dm, dw = per["ddp_nosync"]
            targets.append({"target": "Python: gradaccum <= DDP + no_sync (micro-step, window)",
                            "result": "PASS" if gm <= dm and gw <= dw else "MISS",
                            "detail": f"micro-step {gm / dm:.3f}x, window {gw / dw:.3f}x DDP's"})
    if "cpp" in out and "cpp_baseline" in out:
        targets += baseline_targets(out)
    return rows, targets


def baseline_targets(out):
    """The C++ build against the baseline build, run by run in the same
    session: the window and the no-sync micro-step, and what gradaccum adds
    to the local window (window - local: no lone all-reduce in it, whose count
    is mostly Gloo's waiting)."""
    new, old = out["cpp"], out["cpp_baseline"]
    per_window = {"window": out["windows"], "micro": new["micro_steps"]}
    targets = []
    for unit, what in (("micro", "no-sync micro-step"), ("window", "window")):
        key = f"gradaccum {unit}"
        n, b = new["rank0"].get(key), old["rank0"].get(key)
        if not n or not b:
            continue
        pairs = [r1[key] / r0[key] for r1, r0 in zip(new["rank0_runs"], old["rank0_runs"])
                 if key in r1 and key in r0]
        spread = f"; runs {min(pairs):.4f}–{max(pairs):.4f}x" if len(pairs) > 1 else ""
        detail = f"{n / per_window[unit]:,.0f} vs {b / per_window[unit]:,.0f} instructions ({n / b:.4f}x{spread})"
        if unit == "window" and new["rank0"].get("local window") and old["rank0"].get("local window"):
            added_new = (n - new["rank0"]["local window"]) / out["windows"]
            added_old = (b - old["rank0"]["local window"]) / out["windows"]
            detail += f"; window - local window {added_new:,.0f} vs {added_old:,.0f}"
        targets.append({"target": f"C++: gradaccum {what} <= the baseline build's (same run)",
                        "result": "PASS" if n <= b else "MISS", "detail": detail})
    return targets


def markdown(out):
    if out.get("skipped"):
        return f"**Instruction counts: not measured** ({out['skipped']}).\n"
    lines = [f"**Instruction counts** (valgrind callgrind, all threads of rank 0 of 2 Gloo ranks on loopback; "
             f"the small model, K={out['K']}, micro-batches of {out['micro_batch']} rows, SGD; a micro-step is "
             f"one of a window's K-1 no-sync micro-steps, a window is K micro-steps and the optimizer step, "
             f"mean of {out['windows']}; median of {out.get('repeats', 1)} runs: compute repeats to 0.1%, "
             f"Gloo's share does not):", "",
             "| | contender | no-sync micro-step | ÷ local | window | ÷ local |", "|---|---|---:|---:|---:|---:|"]

    def n(x):
        return f"{x / 1e6:.3f}M" if x else "—"

    def r(x):
        return f"{x:.3f}" if x else "—"

    for row in out["rows"]:
        lines.append(f"| {row['language']} | {row['contender']} | {n(row['micro'])} | {r(row['micro_ratio'])} | "
                     f"{n(row['window'])} | {r(row['window_ratio'])} |")
    lines += ["", "| | target | measured |", "|---|---|---|"]
    for t in out["targets"]:
        lines.append(f"| {t['result']} | {t['target']} | {t['detail']} |")
    return "\n".join(lines) + "\n"


def add_arguments(p):
    p.add_argument("--instr-steps", type=int, default=4, help="K for the instruction counts")
    p.add_argument("--instr-windows", type=int, default=3, help="windows counted per contender")
    p.add_argument("--instr-repeats", type=positive, default=3,
                   help="runs of each program; figures are medians (bench.py --quick: 1)")


def positive(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {n}")
    return n


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpp-bench", default=os.path.join(ROOT, "build", "bench", "bench_window"))
    p.add_argument("--log-dir", default=os.path.join(ROOT, "build", "bench-logs"))
    p.add_argument("--out", default=None)
    p.add_argument("--cpp-baseline", default=None,
                   help="a bench_window built against another revision (a git worktree's build/bench): "
                        "run in turn with --cpp-bench, compared in the targets")
    p.add_argument("--cpp-only", action="store_true", help="leave out the Python programs")
    add_arguments(p)
    args = p.parse_args()
    if args.cpp_bench and not os.access(args.cpp_bench, os.X_OK):
        args.cpp_bench = None
    out = measure(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    print(markdown(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
