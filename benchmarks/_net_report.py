"""What bench_net.py writes from its results: the Markdown tables, the
bucket-timeline plot and Chrome traces of the schedule-bound part, and the
growth plot (split out of bench_net.py, which imports it; not run by hand)."""
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _bound  # noqa: E402
from _bench_worker import TRANSFORMERS, num_parameters  # noqa: E402

NET_MICRO_BATCH = 128
LABELS = {"ddp_nosync": "DDP + no_sync", "gradaccum_py": "gradaccum (Python)",
          "gradaccum_cpp": "gradaccum (C++)", "local": "local floor (Python)", "local_cpp": "local floor (C++)"}
# Bucket caps (MiB) whose layout's bound the bound part derives from the same timelines.
CAPS_MB = [1, 2, 4, 8, 16, 25]


def log(msg):
    print(msg, flush=True)


def spread(xs):
    """{median, min, max} of the numbers in xs (NaN left out); None if none."""
    xs = [x for x in xs if x == x]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def write_bound_outputs(bnd, base, quick):
    """Chrome trace JSON per model and the bucket-timeline PNG (both models)."""
    if not bnd or bnd.get("skipped") or not base:
        return
    panels, files = [], {}
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    for model, res in bnd["models"].items():
        tw = res.get("trace_window")
        if not tw:
            continue
        rate = 1e6 * res["rate_MBps"]
        names = res.get("param_names") or []
        info = {"model": model, "parameters": res["parameters"], "K": tw["K"], "link": f"2 nodes, {bnd['rate']}",
                "bound": tw["bound"], "bucket_bound": tw["bucket_bound"], "hidden": tw["hidden"],
                "lone_allreduce_ms": res["allreduce_ms"]}
        path = f"{base}-trace-{model}.json"
        _bound.write_trace(path, _bound.chrome_trace(
            f"{model}: one window, K={tw['K']}, 2 nodes at {bnd['rate']}", [r["marks"] for r in tw["ranks"]],
            tw["ranks"], res["param_bytes"], names, rate, info))
        files[model] = path
        label = "transformer (GPT)" if model in TRANSFORMERS else f"MLP ({model})"
        panels.append({"title": f"{label}: {res['parameters'] / 1e6:.1f}M parameters, "
                                f"{res['gradient_bytes'] / 2**20:.0f} MiB; K={tw['K']}, block {tw['block'] + 1}; "
                                f"lone all-reduce {res['allreduce_ms']:.0f} ms",
                       "combined": tw["combined"], "rate": rate, "param_bytes": res["param_bytes"],
                       "lines": [f"this window: hidden {tw['hidden']:.2f}, bound {tw['bound']:.2f} "
                                 f"(buckets {tw['bucket_bound']:.2f})"]})
    try:
        import matplotlib  # noqa: F401
    except ImportError:  # a bare machine (the GPU one): traces and JSON only
        log("bench_net: matplotlib not installed, no timeline plot")
        panels = []
    if panels:
        png = f"{base}-timeline.png"
        _bound.plot(panels, png, f"The synchronising backward's buckets against the schedule bound, "
                                 f"2 nodes at {bnd['rate']} (Gloo, tbf), bucket caps {bnd['bucket_cap_mb']:g} / "
                                 f"{bnd['first_bucket_cap_mb']:g} MiB{', quick run' if quick else ''}")
        files["png"] = png
    bnd["files"] = {k: os.path.relpath(v, ROOT) for k, v in files.items()}


def plot_growth(growth, path, quick):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"ddp_nosync": ("k", "o", "-"), "gradaccum_py": ("tab:blue", "s", "-"), "local": ("tab:gray", ".", ":")}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    panels = [("k", "ks", "K (micro-batches per window), large model, 2 nodes", True),
              ("size", "parameters", "parameters (K=4, 2 nodes)", True),
              ("ranks", "ranks", "nodes (1 process each; large model, K=4)", False)]
    for ax, (key, xkey, xlabel, logx) in zip(axes, panels):
        g = growth[key]
        xs = g[xkey]
        for c, ys in g["window_ms"].items():
            color, marker, ls = styles[c]
            ax.plot(xs, ys, color=color, marker=marker, ls=ls, label=LABELS[c])
        ar = g["allreduce_ms"]
        floor = g["window_ms"]["local"]
        plus = [f + (a if not isinstance(ar, (int, float)) else ar) for f, a in
                zip(floor, ar if isinstance(ar, list) else [ar] * len(floor))]
        ax.plot(xs, plus, color="tab:red", ls="--", lw=1, label="floor + lone all-reduce (no overlap)")
        if logx:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(xs)
        ax.set_xticklabels([f"{x / 1e6:.1f}M" if key == "size" else str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("time per window (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Window time growth, Gloo over veth links throttled to {growth['rate']} "
                 f"(network namespaces, torchrun c10d){', quick run' if quick else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(result, png_rel, rel=None):
    """rel: results path (relative to the repository) -> link from the page (default: the file name)."""
    lines = []
    if result.get("skipped"):
        return f"**Throttled multi-node link: not measured** ({result['skipped']}).\n"
    if result.get("bound"):
        lines.append(bound_markdown(result["bound"], rel or os.path.basename))
    links = result["links"]
    ks = result["ks"]
    if not links:
        return links_tail(result, lines, png_rel)
    first = links[0]
    lines += [
        f"**Hidden all-reduce on a throttled multi-node link.** Each node is a network namespace with one "
        f"veth link ({first['shaper']}), one torchrun per node (`--nnodes=N --nproc_per_node=1 "
        f"--rdzv-backend=c10d`), one process per node with 1 thread, Gloo; the large model "
        f"({num_parameters('large'):,} parameters, 42 MiB of gradients), micro-batches of "
        f"{result.get('micro_batch', NET_MICRO_BATCH)} rows; bucket caps {result.get('bucket_cap_mb', 4):g} MiB "
        f"(first 1 MiB) for both. "
        f"Hidden fraction = (floor + lone all-reduce − window) / lone all-reduce, per block, "
        f"median [min–max]; the C++ contender against the C++ floor. Ceiling = one local backward / "
        f"all-reduce: only the window's last backward can hide communication.",
        "",
        "| link | lone all-reduce (ms) | backward (ms) | ceiling | K | DDP + no_sync | gradaccum (Python) | "
        "gradaccum (C++) | floor Py / C++ (ms) | windows DDP / Py / C++ (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def frac(cell):
        if not cell or "hidden" not in cell:
            return "—"
        return f"{cell['hidden']:.2f} [{cell['hidden_min']:.2f}–{cell['hidden_max']:.2f}]"

    def ms(cell):
        return f"{cell['window_ms']:.0f}" if cell else "—"

    for s in links:
        for k in ks:
            c = s["cells"][str(k)]
            lines.append(
                f"| {s['nodes']} nodes, {s['rate']} ({s['blocks']} blocks) | {s['allreduce_ms']:.0f} | "
                f"{s['backward_ms']:.0f} | {s['ceiling']:.2f} | {k} | {frac(c.get('ddp_nosync'))} | "
                f"{frac(c.get('gradaccum_py'))} | {frac(c.get('gradaccum_cpp'))} | "
                f"{ms(c.get('local'))} / {ms(c.get('local_cpp'))} | {ms(c.get('ddp_nosync'))} / "
                f"{ms(c.get('gradaccum_py'))} / {ms(c.get('gradaccum_cpp'))} |")
    lines.append("")
    lines += ["Targets (hidden fraction, per link and K):", "", "| | target | measured |", "|---|---|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['result']} | {t['target']} | {t['detail']} |")
    lines.append("")
    return links_tail(result, lines, png_rel)


def links_tail(result, lines, png_rel):
    if result.get("growth"):
        g = result["growth"]
        lines += [f"**Growth** (one run; Gloo over 2 nodes at {g['rate']} unless said; micro-batches of "
                  f"{g['micro_batch']} rows; one window per point for K and size, median of 2 for ranks; "
                  f"4 nodes share 2 cores, so their compute is slower too):", "",
                  f"![growth]({png_rel})", ""]
        kk = g["k"]
        lines += ["| K | " + " | ".join(str(k) for k in kk["ks"]) + " |",
                  "|---|" + "---:|" * len(kk["ks"])]
        for c, ys in kk["window_ms"].items():
            lines.append(f"| {LABELS[c]} (ms) | " + " | ".join(f"{y:.0f}" for y in ys) + " |")
        sz = g["size"]
        lines += ["", "| parameters (K=4) | " + " | ".join(f"{p / 1e6:.1f}M" for p in sz["parameters"]) + " |",
                  "|---|" + "---:|" * len(sz["parameters"]),
                  "| lone all-reduce (ms) | " + " | ".join(f"{a:.0f}" for a in sz["allreduce_ms"]) + " |"]
        for c, ys in sz["window_ms"].items():
            lines.append(f"| {LABELS[c]} (ms) | " + " | ".join(f"{y:.0f}" for y in ys) + " |")
        rk = g["ranks"]
        lines += ["", "| nodes (large, K=4) | " + " | ".join(str(r) for r in rk["ranks"]) + " |",
                  "|---|" + "---:|" * len(rk["ranks"]),
                  "| lone all-reduce (ms) | " + " | ".join(f"{a:.0f}" for a in rk["allreduce_ms"]) + " |"]
        for c, ys in rk["window_ms"].items():
            lines.append(f"| {LABELS[c]} (ms) | " + " | ".join(f"{y:.0f}" for y in ys) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def bound_markdown(bnd, rel):
    """The bound section's tables (rel: makes a results path relative to the page)."""
    if not bnd:
        return ""
    if bnd.get("skipped"):
        return f"**Hidden fraction against the schedule bound: not measured** ({bnd['skipped']}).\n"

    def sp(x, fmt="{:.2f}"):
        if not x:
            return "—"
        return f"{fmt.format(x['median'])} [{fmt.format(x['min'])}–{fmt.format(x['max'])}]"

    lines = [f"**Hidden fraction against the schedule bound** (2 nodes, {bnd.get('shaper', bnd['rate'])}; "
             f"bucket caps {bnd['bucket_cap_mb']:g} MiB, first {bnd['first_bucket_cap_mb']:g} MiB, DDP and "
             f"gradaccum alike; DDP's first bucket is 1 MiB). Bound = the largest fraction of the all-reduce "
             f"any bucket order could hide: a fluid link at the lone all-reduce's rate sending the gradients as "
             f"they become ready (on every rank) in the window's synchronising backward, D(E)/S at the end of "
             f"backward E (from gradaccum's `last_window_timeline()`, per block); \"buckets\": the same with "
             f"the actual buckets as units. Hidden = (floor + lone all-reduce − window) / lone all-reduce; "
             f"ratio = hidden / bound, per block; the bound column is from the Python contender's "
             f"timelines, the C++ contender's ratios are against the bound of its own. Median [min–max] over "
             f"blocks, one run."
             + (f" Each rank's compute thread capped at {bnd['compute_quota']:g} of a core (cgroup cpu quota; "
                f"Gloo's threads uncapped: `--compute-quota`), the floor's too." if bnd.get("compute_quota") else ""),
             "",
             "| model | parameters | bytes / window | micro-batch | lone all-reduce (ms) | local backward (ms) | "
             "local backward, alone / with the lone all-reduce alongside (ms) | slowed ÷ lone all-reduce "
             "(per turn) |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for model, r in bnd["models"].items():
        label = "transformer (`gpt`)" if model in TRANSFORMERS else f"MLP (`{model}`)"
        bb, slowed = r.get("backward_beside_ms") or {}, r.get("backward_slowed_ms")
        beside = (f"{sp(spread(bb['alone']), '{:.0f}')} / {sp(spread(bb['beside']), '{:.0f}')} | "
                  f"{slowed['median'] / r['allreduce_ms']:.2f} [{slowed['min'] / r['allreduce_ms']:.2f}–"
                  f"{slowed['max'] / r['allreduce_ms']:.2f}]") if slowed else "— | —"
        lines.append(f"| {label} | {r['parameters']:,} | {r['bytes_per_window']:,} in "
                     f"{r['collectives_per_window']} all-reduces | {r['micro_batch']} | {r['allreduce_ms']:.0f} "
                     f"({r['rate_MBps']:.0f} MB/s) | {r['backward_ms']:.0f} | {beside} |")
    lines += ["", "| model | K | blocks | synchronising backward (ms) | bound | bound, these buckets | "
                  "gradaccum hidden | ÷ bound | DDP + no_sync hidden | ÷ bound | gradaccum (C++) hidden | ÷ bound "
                  "| done by backward's end (timeline) |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for model, r in bnd["models"].items():
        label = "transformer" if model in TRANSFORMERS else f"MLP {model}"
        for k, c in r["cells"].items():
            ga, dd, cc = c.get("gradaccum_py", {}), c.get("ddp_nosync", {}), c.get("gradaccum_cpp", {})
            n = len(ga.get("hidden_blocks", []))
            lines.append(f"| {label} | {k} | {n} | {sp(c.get('backward_end_ms'), '{:.0f}')} | {sp(c.get('bound'))} | "
                         f"{sp(c.get('bucket_bound'))} | {sp(ga.get('hidden'))} | {sp(ga.get('ratio'))} | "
                         f"{sp(dd.get('hidden'))} | {sp(dd.get('ratio'))} | {sp(cc.get('hidden'))} | "
                         f"{sp(cc.get('ratio'))} | {sp(c.get('done_by_end'))} |")
    rows = []
    for model, r in bnd["models"].items():
        label = "transformer" if model in TRANSFORMERS else f"MLP {model}"
        for k, c in r["cells"].items():
            ga, cc = c.get("gradaccum_py", {}), c.get("gradaccum_cpp", {})
            if ga.get("tail_ms"):
                rows.append(f"| {label} | {k} | {sp(ga.get('tail_ms'), '{:.0f}')} | {sp(ga.get('timeline_hidden'))} | "
                            f"{sp(ga.get('timeline_ratio'))} | {sp(ga.get('rest'))} | "
                            f"{sp(cc.get('tail_ms'), '{:.0f}')} | {sp(cc.get('timeline_hidden'))} | "
                            f"{sp(cc.get('timeline_ratio'))} | {sp(cc.get('rest'))} |")
    if rows:
        lines += ["", "The reducer's schedule alone, from the same timelines: the time from the end of the last "
                      "rank's backward to the last rank's window written back (the buckets still on the link, the "
                      "write-back), and 1 − that ÷ lone all-reduce, against the bound. Unlike the hidden fraction "
                      "above, compute slowed by the communication (both ranks' Gloo threads and TCP work share the "
                      "cores their compute uses) does not count here, as the bound assumes; DDP keeps no timeline. "
                      "The rest: hidden by the schedule less the wall-clock hidden fraction, per block: the "
                      "window's time over its floor, besides what was left after backward, ÷ lone all-reduce "
                      "(compute slowed by the communication, and any cost of the library's own; the timeline is "
                      "the block's last window's, the hidden fraction its median window's):",
                  "", "| model | K | Python: left after backward (ms) | hidden by the schedule | ÷ bound | the rest | "
                      "C++: left after backward (ms) | hidden by the schedule | ÷ bound | the rest |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"] + rows
    rows = []
    for model, r in bnd["models"].items():
        label = "transformer" if model in TRANSFORMERS else f"MLP {model}"
        for k, c in r["cells"].items():
            for name in ("local", "ddp_nosync", "gradaccum_py", "gradaccum_cpp"):
                ph = c.get(name, {}).get("phases_ms")
                if ph:
                    rows.append(f"| {label} | {k} | {LABELS.get(name, name)} | "
                                + " | ".join(sp(ph.get(p), "{:.0f}") for p in ("forward", "backward", "step")) + " |")
    if rows:
        lines += ["", "Where the window goes (ms; the slowest rank's, median [min–max] over blocks; forward and "
                      "backward of the synchronising micro-step, backward from call to return: the communication "
                      "not hidden is in it, and gradaccum's write-back; step: the optimizer step):", "",
                  "| model | K | contender | forward | backward | step |", "|---|---:|---|---:|---:|---:|"] + rows
    lines += ["", "The bound with the buckets as units for other bucket caps (first bucket 1 MiB), from the "
                  "same timelines: the layout gradaccum builds (parameters in ready order, a bucket closed once "
                  "it holds its cap), each bucket ready with its last gradient; median over blocks:", "",
              "| model | K | " + " | ".join(f"{c:g} MiB" for c in CAPS_MB) + " |",
              "|---|---:|" + "---:|" * len(CAPS_MB)]
    for model, r in bnd["models"].items():
        label = "transformer" if model in TRANSFORMERS else f"MLP {model}"
        for k, c in r["cells"].items():
            lines.append(f"| {label} | {k} | " + " | ".join(
                f"{c[f'cap_bound_{cap:g}']['median']:.2f}" if c.get(f"cap_bound_{cap:g}") else "—"
                for cap in CAPS_MB) + " |")
    lines.append("")
    files = bnd.get("files") or {}
    if files.get("png"):
        lines += [f"![bucket timeline]({rel(files['png'])})", ""]
    traces = [f"[{m}]({rel(p)})" for m, p in files.items() if m != "png"]
    if traces:
        lines += ["One window per model as a Chrome trace (open in https://ui.perfetto.dev or chrome://tracing): "
                  + ", ".join(traces) + ".", ""]
    lines += ["| | target | measured |", "|---|---|---|"]
    for t in bnd.get("targets", []):
        lines.append(f"| {t['result']} | {t['target']} | {t['detail']} |")
    lines.append("")
    return "\n".join(lines) + "\n"
