"""The schedule bound: how much of a window's all-reduce any bucket order could
hide behind its synchronising backward, from gradaccum's timeline of that
backward (acc.last_window_timeline()). Used by bench_net.py (not run by hand).

Fluid single-link model. Gradients (or buckets) become ready during backward;
a link of B bytes/s (the lone all-reduce's rate, bytes / seconds) sends
whatever is ready, in any order, without idling while something is ready.
A(t−) is the bytes ready strictly before t. By the end of backward, E, at
most

    D(E) = min over s in {0, each ready time, E} of  A(s−) + B·(E − s)

bytes can have left (Reich's formula for a work-conserving queue: the link
is busy from the last s on, and nothing ready after s helps). No order of
sending does better, since whatever arrives after s has at most E − s of
link time left, and the best order (any order that never idles) achieves it.
The bound on the hidden fraction is min(1, D(E) / S), S the total bytes.
With gradients as the units it is what the model allows; with the actual
buckets as units (ready when their last gradient is), what these buckets
allow.

Timelines are per rank, in seconds from that rank's synchronising backward's
start; the worker marks that start on its own clock (perf_counter, or
steady_clock in C++: both CLOCK_MONOTONIC, shared by the network namespaces),
so ranks combine on one clock: a unit is ready when it is ready on every
rank, and backward ends when it ends on the last rank.
"""
import json
import os

import gradaccum.trace


def departures(units, t, rate):
    """D(t): bytes a fluid link of `rate` bytes/s can have sent by t, units =
    [(ready, bytes)] (times from the same origin as t; origin 0)."""
    units = sorted(u for u in units if u[0] >= 0)
    best = rate * t  # s = 0
    before = 0.0  # A(s−)
    i = 0
    while i < len(units) and units[i][0] < t:
        s = units[i][0]
        best = min(best, before + rate * (t - s))
        while i < len(units) and units[i][0] == s:
            before += units[i][1]
            i += 1
    return min(best, before)  # s = t: A(t−)


def departure_curve(units, ts, rate):
    return [departures(units, t, rate) for t in ts]


def bound(units, end, rate):
    total = sum(b for _, b in units)
    return min(1.0, departures(units, end, rate) / total) if total else float("nan")


def combine(ranks, param_bytes):
    """One synchronising backward seen by all ranks, on one clock.

    ranks: per rank {"timeline": ..., "origin": clock at that rank's backward
    start}. Returns times relative to t0 = the latest rank's start:
    gradients [(ready, bytes)], buckets [(ready, bytes)] (ready on every rank),
    backward_end (the last rank's), and rank 0's bucket launch / completion
    times on the same scale."""
    t0 = max(r["origin"] for r in ranks)
    n = len(param_bytes)
    grads = []
    for j in range(n):
        ts = [r["origin"] + r["timeline"]["gradients"][j] for r in ranks
              if j < len(r["timeline"]["gradients"]) and r["timeline"]["gradients"][j] >= 0]
        if len(ts) == len(ranks):
            grads.append((max(ts) - t0, param_bytes[j]))
    nb = min(len(r["timeline"]["buckets"]) for r in ranks)
    buckets = []
    for b in range(nb):
        ts = [r["origin"] + r["timeline"]["buckets"][b]["ready"] for r in ranks
              if r["timeline"]["buckets"][b]["ready"] >= 0]
        if len(ts) == len(ranks):
            buckets.append((max(ts) - t0, ranks[0]["timeline"]["buckets"][b]["bytes"]))
    end = max(r["origin"] + r["timeline"]["backward_end"] for r in ranks) - t0
    r0 = ranks[0]
    own = [{"bytes": b["bytes"], "ready": rel(r0, b["ready"], t0), "launched": rel(r0, b["launched"], t0),
            "completed": rel(r0, b["completed"], t0)} for b in r0["timeline"]["buckets"]]
    return {"t0": t0, "gradients": grads, "buckets": buckets, "backward_end": end,
            "finished": max(r["origin"] + r["timeline"]["finished"] for r in ranks) - t0,
            "rank0_buckets": own}


def layout(ready, param_bytes, cap, first_cap):
    """The buckets gradaccum would build with these caps, in the ready order
    (its layout after the rebuild; src/buckets/bucket.cpp): parameters in the
    order their gradients became ready, a bucket closed once it holds at least
    its cap (the first bucket first_cap); the rest is the last bucket.
    ready: [(time, index)]. Returns [(ready, bytes)] per bucket: its last
    gradient's time."""
    out, cur, size, t, first = [], 0, 0, 0.0, True
    for when, j in sorted(ready):
        cur += 1
        size += param_bytes[j]
        t = max(t, when)
        if size >= (first_cap if first else cap):
            out.append((t, size))
            cur, size, t, first = 0, 0, 0.0, False
    if cur:
        out.append((t, size))
    return out


def cap_bounds(c, rate, caps, first_cap=2**20):
    """The bound with the buckets as units for other bucket caps (bytes),
    from the same gradient ready times (c: combine()'s result)."""
    order = [(t, j) for j, (t, _) in enumerate(c["gradients"])]
    pb = [b for _, b in c["gradients"]]
    return {cap: bound(layout(order, pb, cap, first_cap), c["backward_end"], rate) for cap in caps}


def rel(rank, t, t0):
    return -1.0 if t is None or t < 0 else rank["origin"] + t - t0


def analyse(ranks, param_bytes, rate):
    """The bounds and what the buckets did, for one window (see combine)."""
    c = combine(ranks, param_bytes)
    end = c["backward_end"]
    total = sum(param_bytes)
    done = sum(b["bytes"] for b in c["rank0_buckets"] if 0 <= b["completed"] <= end)
    in_backward = sum(1 for b in c["rank0_buckets"] if 0 <= b["launched"] < end)
    return {"bound": bound(c["gradients"], end, rate), "bucket_bound": bound(c["buckets"], end, rate),
            "backward_end_ms": 1e3 * end, "finished_ms": 1e3 * c["finished"],
            "done_by_end": done / total if total else float("nan"),
            "buckets_launched_in_backward": in_backward, "buckets": len(c["rank0_buckets"]),
            "combined": c}


# --------------------------------------------------------------------------- the trace
def chrome_trace(title, ranks_marks, ranks, param_bytes, param_names, rate, info):
    """Chrome trace / Perfetto JSON of one window: per rank, the micro-steps
    (forward, backward, step) and the reduction as gradaccum.trace draws it
    (the synchronising backward, its buckets' ready instants and
    launch→completion spans, the gradients); one more process draws the
    fluid bound's departures and the bytes ready and done, as counters.
    Times in µs from the window's start (the earliest rank's first
    micro-step)."""
    start = min(m[0][0] for m in ranks_marks)
    us = lambda t: round(1e6 * (t - start), 1)  # noqa: E731
    counters = len(ranks)  # the counters' process, after the ranks'
    ev = [{"name": "process_name", "ph": "M", "pid": counters, "args": {"name": title}}]
    names = param_names if len(param_names) == len(ranks[0]["timeline"]["gradients"]) else None
    for r, (marks, rk) in enumerate(zip(ranks_marks, ranks)):
        # The reduction on the window's clock: its origin in seconds from start.
        ev += gradaccum.trace.from_timeline({**rk["timeline"], "origin": rk["origin"] - start}, rank=r,
                                            names=names)["traceEvents"]
        ev.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "micro-steps"}})
        k = len(marks)
        for i, (t0, t1, t2, t3) in enumerate(marks):
            sync = i == k - 1
            ev.append({"name": f"micro-step {i + 1}/{k}" + (" (synchronising)" if sync else " (no sync)"),
                       "ph": "X", "pid": r, "tid": 0, "ts": us(t0), "dur": us(t3) - us(t0)})
            ev.append({"name": "forward", "ph": "X", "pid": r, "tid": 0, "ts": us(t0), "dur": us(t1) - us(t0)})
            ev.append({"name": "backward" + (" + reduction" if sync else ""), "ph": "X", "pid": r, "tid": 0,
                       "ts": us(t1), "dur": us(t2) - us(t1)})
            if t3 > t2:
                ev.append({"name": "step" if not sync else "step (optimizer)", "ph": "X", "pid": r, "tid": 0,
                           "ts": us(t2), "dur": us(t3) - us(t2)})
    # Counters on the combined clock: ready (all ranks), the bound's departures, done.
    c = combine(ranks, param_bytes)
    t0 = c["t0"]
    end = c["finished"]
    ts = sorted({0.0, end, c["backward_end"]} | {t for t, _ in c["gradients"]} |
                {b["completed"] for b in c["rank0_buckets"] if b["completed"] >= 0} |
                {i * end / 200 for i in range(201)})
    for t in ts:
        ready = sum(b for r, b in c["gradients"] if r <= t)
        done = sum(b["bytes"] for b in c["rank0_buckets"] if 0 <= b["completed"] <= t)
        ev.append({"name": "MiB (all ranks)", "ph": "C", "pid": counters, "ts": us(t0 + t),
                   "args": {"ready": ready / 2**20, "bound: sent by the best order": departures(c["gradients"], t, rate)
                            / 2**20, "buckets done": done / 2**20}})
    return {"traceEvents": ev, "displayTimeUnit": "ms", "otherData": info}


def write_trace(path, trace):
    with open(path, "w") as f:
        json.dump(trace, f)


# --------------------------------------------------------------------------- the plot
def plot(panels, path, suptitle):
    """panels: [{"title", "analysis": analyse(...)["combined"], "rate", "param_bytes", "lines"}]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(panels), figsize=(7.5 * len(panels), 8), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 2]}, sharex="col")
    for col, p in enumerate(panels):
        c = p["combined"]
        rate = p["rate"]
        end, fin = c["backward_end"], c["finished"]
        total = sum(p["param_bytes"])
        ts = [i * fin / 400 for i in range(401)]
        mib = 1 / 2**20
        ax = axes[0][col]
        ax.plot([1e3 * t for t in ts], [mib * sum(b for r, b in c["gradients"] if r <= t) for t in ts],
                color="tab:gray", label="gradients ready (on every rank)")
        ax.plot([1e3 * t for t in ts], [mib * departures(c["gradients"], t, rate) for t in ts], color="tab:red",
                ls="--", label="bound: sent by the best order (fluid link)")
        ax.plot([1e3 * t for t in ts], [mib * departures(c["buckets"], t, rate) for t in ts], color="tab:orange",
                ls=":", label="bound with these buckets as units")
        ax.plot([1e3 * t for t in ts],
                [mib * sum(b["bytes"] for b in c["rank0_buckets"] if 0 <= b["completed"] <= t) for t in ts],
                color="tab:blue", lw=2, drawstyle="steps-post", label="gradaccum: buckets done")
        ax.axvline(1e3 * end, color="k", lw=1)
        ax.text(1e3 * end, total * mib * 1.02, " backward ends", fontsize=8, va="bottom")
        ax.axhline(total * mib, color="k", lw=0.5, ls=":")
        ax.set_ylabel("MiB")
        ax.set_title(p["title"], fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[1][col]
        for b, bt in enumerate(c["rank0_buckets"]):
            if bt["launched"] >= 0 and bt["completed"] >= 0:
                ax.barh(b, 1e3 * (bt["completed"] - bt["launched"]), left=1e3 * bt["launched"], height=0.6,
                        color="tab:blue", alpha=0.7)
            if b < len(c["buckets"]):
                ax.plot(1e3 * c["buckets"][b][0], b, "k|", ms=14, mew=2)
            ax.text(1e3 * max(bt["completed"], bt["launched"]), b, f" {bt['bytes'] / 2**20:.1f} MiB", va="center",
                    fontsize=7)
        ax.axvline(1e3 * end, color="k", lw=1)
        nb = len(c["rank0_buckets"])
        ax.set_ylim(nb - 0.5, -0.5)
        ax.set_yticks(range(nb))
        ax.set_ylabel("bucket (launch order)")
        ax.set_xlabel("ms from the later rank's backward start (bars: rank 0's launch to completion; "
                      "|: ready on every rank)", fontsize=8)
        ax.grid(True, alpha=0.3)
        for i, line in enumerate(p.get("lines", [])):
            axes[0][col].text(0.99, 0.03 + 0.06 * i, line, transform=axes[0][col].transAxes, ha="right",
                              fontsize=8)
    fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
