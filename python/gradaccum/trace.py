"""A window's reduction as a Chrome trace (Perfetto, ``chrome://tracing``).

    trace = acc.window_trace()                 # this rank's last reduction
    gradaccum.trace.save("window.json", trace)

or every rank's in one file (a collective: call it on every rank)::

    traces = [None] * dist.get_world_size()
    dist.all_gather_object(traces, acc.window_trace())
    if dist.get_rank() == 0:
        gradaccum.trace.save("window.json", traces)

Each rank is a process of the trace (its rank in the Accumulator's group),
with tracks for the reduction (the synchronising backward, then the wait for
the buckets and the write-back; or one span for a reduction no hook took
part in: flush(), a rank out of data under join(), a rank-independent
state_dict() in the middle of a window, compiled autograd; or a backward that
failed and dropped the window), the gradients (an instant per parameter,
named, when its hook ran) and one per bucket (its ready instant and its
all-reduce from launch to completion; a launch instant for CUDA buckets,
whose completion NCCL does not report). Times are whole microseconds since
the Unix epoch on each rank's system clock, so ranks of one machine line up
and consecutive windows of one rank follow each other. Built from
``acc.last_window_timeline()`` (Note [The window's timeline] in
src/reducer/launch.cpp), which C++ programs read as
``Accumulator::last_window_timeline()``; ``from_timeline`` takes that dict.
"""
import json
import os
from collections import abc
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

__all__ = ["from_timeline", "save"]

Trace = Dict[str, Any]

#: Bucket b's track (thread id) in a rank's process: BUCKET_TID + b.
BUCKET_TID = 10


def from_timeline(timeline: Dict[str, Any], *, rank: int = 0, names: Optional[Sequence[str]] = None,
                  where: str = "gradaccum.trace.from_timeline()") -> Trace:
    """A Chrome trace of one reduction from ``acc.last_window_timeline()``
    (``names``: the parameters' names, in the Accumulator's order; ``rank``:
    the trace's process id)."""
    origin = timeline.get("origin", -1.0)
    if origin is None or origin < 0 or timeline.get("finished", -1.0) < 0:
        raise RuntimeError(f"gradaccum: {where}: no reduction to show: none since the Accumulator was built, "
                           f"refresh_parameters() or close(), or it has no process group (a timeline needs a "
                           f"reducer)")
    if names is not None and len(names) != len(timeline["gradients"]):
        raise ValueError(f"gradaccum: {where}: {len(names)} names for {len(timeline['gradients'])} parameters")
    # Whole microseconds, from one integer base: exact in a double (< 2^53),
    # so spans that meet in the timeline meet in the trace, not a rounding apart.
    base = int(round(1e6 * origin))
    pid = int(rank)

    def us(t: float) -> int:
        return base + int(round(1e6 * t))

    def span(name: str, tid: int, t0: float, t1: float, **extra: Any) -> Dict[str, Any]:
        return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": us(t0), "dur": us(t1) - us(t0), **extra}

    def instant(name: str, tid: int, t: float, args: Dict[str, Any]) -> Dict[str, Any]:
        return {"name": name, "ph": "i", "s": "t", "pid": pid, "tid": tid, "ts": us(t), "args": args}

    ev: List[Dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}},
                                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    # A track per bucket: their all-reduces overlap in time, and spans on one
    # track must nest.
    tracks = [(1, "reduction"), (2, "gradients ready")] + [
        (BUCKET_TID + b, f"bucket {b}") for b in range(len(timeline["buckets"]))]
    for tid, track in tracks:
        ev += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}},
               {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}]
    end, finished = timeline["backward_end"], timeline["finished"]
    if not any(g >= 0 for g in timeline["gradients"]):
        ev.append(span("reduction (no hooks: every bucket at once)", 1, 0.0, finished))
    elif end < 0:  # dropped before backward ended: a backward that failed
        ev.append(span("backward failed: window dropped", 1, 0.0, finished))
    else:
        ev += [span("synchronising backward", 1, 0.0, end),
               span("wait for the buckets, write back", 1, end, finished)]
    for b, times in enumerate(timeline["buckets"]):
        nbytes = times["bytes"]
        # Times in ms from the reduction's beginning; -1 (unknown) left out.
        args = {"bytes": nbytes, **{f"{k}_ms": round(1e3 * times[k], 3)
                                    for k in ("ready", "launched", "completed", "written")
                                    if times.get(k, -1) >= 0}}
        tid = BUCKET_TID + b
        if times["ready"] >= 0:
            ev.append(instant(f"bucket {b} ready", tid, times["ready"], args))
        if times["launched"] >= 0 and times["completed"] >= 0:
            ev.append(span(f"bucket {b} all-reduce ({nbytes / 2**20:.2f} MiB)", tid, times["launched"],
                           times["completed"], args=args))
        elif times["launched"] >= 0:  # CUDA (NCCL): no completion time
            ev.append(instant(f"bucket {b} launched ({nbytes / 2**20:.2f} MiB)", tid, times["launched"], args))
        if times.get("written", -1) >= 0:
            ev.append(instant(f"bucket {b} written back", tid, times["written"], args))
    for i, t in enumerate(timeline["gradients"]):
        if t >= 0:
            ev.append(instant(names[i] if names is not None else f"parameter {i}", 2, t, {"index": i}))
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def save(path: Union[str, "os.PathLike[str]"], traces: Union[Trace, Iterable[Trace]]) -> None:
    """Write one trace, or several (ranks, or windows of one rank) merged into
    one file."""
    if isinstance(traces, dict):
        items = [traces]
    elif isinstance(traces, abc.Iterable) and not isinstance(traces, (str, bytes)):
        items = list(traces)
    else:
        raise TypeError(f"gradaccum: gradaccum.trace.save(): traces must be a trace or a list of them "
                        f"(acc.window_trace()), got {type(traces).__name__}")
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"gradaccum: gradaccum.trace.save(): path must be a str, bytes or an os.PathLike, got "
                        f"{type(path).__name__}")
    events: List[Dict[str, Any]] = []
    for i, trace in enumerate(items):
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise ValueError(f"gradaccum: gradaccum.trace.save(): item {i} is not a trace "
                             f"(a dict with 'traceEvents', as acc.window_trace() returns)")
        events.extend(trace["traceEvents"])
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
