"""A window's reduction as a Chrome trace (Perfetto, ``chrome://tracing``).

    trace = acc.window_trace()                 # this rank's last reduction
    gradaccum.trace.save("window.json", trace)

or every rank's in one file (a collective: call it on every rank)::

    traces = [None] * dist.get_world_size()
    dist.all_gather_object(traces, acc.window_trace())
    if dist.get_rank() == 0:
        gradaccum.trace.save("window.json", traces)

Each rank is a process of the trace, with three tracks: the reduction (the
synchronising backward, then the wait for the buckets and the write-back),
the buckets (each one's ready instant and its all-reduce from launch to
completion) and the gradients (an instant per parameter, named, when its hook
ran). Times are microseconds since the Unix epoch on each rank's system
clock, so ranks of one machine line up exactly and consecutive windows of one
rank follow each other. Built from ``acc.last_window_timeline()`` (Note [The
window's timeline] in src/reducer/launch.cpp), which C++ programs read as
``Accumulator::last_window_timeline()``; ``from_timeline`` takes that dict.
"""
import json
from typing import Any, Dict, Iterable, List, Optional, Sequence, Union

__all__ = ["from_timeline", "save"]

Trace = Dict[str, Any]

_TRACKS = ("reduction", "buckets (all-reduce)", "gradients ready")


def from_timeline(timeline: Dict[str, Any], *, rank: int = 0, names: Optional[Sequence[str]] = None,
                  where: str = "gradaccum.trace.from_timeline()") -> Trace:
    """A Chrome trace of one reduction from ``acc.last_window_timeline()``
    (``names``: the parameters' names, in the Accumulator's order)."""
    origin = timeline.get("origin", -1.0)
    if origin is None or origin < 0 or timeline.get("finished", -1.0) < 0:
        raise RuntimeError(f"gradaccum: {where}: no reduction to show: no window has been reduced yet, or the "
                           f"Accumulator has no process group (a timeline needs a reducer)")
    if names is not None and len(names) != len(timeline["gradients"]):
        raise ValueError(f"gradaccum: {where}: {len(names)} names for {len(timeline['gradients'])} parameters")

    def us(t: float) -> float:
        return round(1e6 * (origin + t), 1)

    def dur(t0: float, t1: float) -> float:
        return round(us(t1) - us(t0), 1)

    pid = int(rank)
    ev: List[Dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}},
                                {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    for tid, track in enumerate(_TRACKS, 1):
        ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
    end, finished = timeline["backward_end"], timeline["finished"]
    hooked = any(g >= 0 for g in timeline["gradients"])
    if hooked and end >= 0:
        ev.append({"name": "synchronising backward", "ph": "X", "pid": pid, "tid": 1, "ts": us(0.0),
                   "dur": dur(0.0, end)})
    start = end if hooked and end >= 0 else 0.0  # flush() and hookless windows: all of it is the reduction
    ev.append({"name": "wait for the buckets, write back" if hooked else "reduction (no hooks: all buckets at once)",
               "ph": "X", "pid": pid, "tid": 1, "ts": us(start), "dur": dur(start, finished)})
    for b, times in enumerate(timeline["buckets"]):
        nbytes = times["bytes"]
        args = {"bytes": nbytes, **{f"{k}_ms": round(1e3 * times[k], 3) for k in ("ready", "launched", "completed")}}
        if times["ready"] >= 0:
            ev.append({"name": f"bucket {b} ready", "ph": "i", "s": "t", "pid": pid, "tid": 2,
                       "ts": us(times["ready"]), "args": args})
        if times["launched"] >= 0 and times["completed"] >= 0:
            ev.append({"name": f"bucket {b} all-reduce ({nbytes / 2**20:.2f} MiB)", "ph": "X", "pid": pid, "tid": 2,
                       "ts": us(times["launched"]), "dur": dur(times["launched"], times["completed"]),
                       "args": args})
        elif times["launched"] >= 0:  # CUDA (NCCL): no completion time
            ev.append({"name": f"bucket {b} launched ({nbytes / 2**20:.2f} MiB)", "ph": "i", "s": "t", "pid": pid,
                       "tid": 2, "ts": us(times["launched"]), "args": args})
    for i, t in enumerate(timeline["gradients"]):
        if t >= 0:
            ev.append({"name": names[i] if names is not None else f"parameter {i}", "ph": "i", "s": "t",
                       "pid": pid, "tid": 3, "ts": us(t), "args": {"index": i}})
    return {"traceEvents": ev, "displayTimeUnit": "ms"}


def save(path: str, traces: Union[Trace, Iterable[Trace]]) -> None:
    """Write one trace, or several (ranks, or windows of one rank) merged into
    one file."""
    items = [traces] if isinstance(traces, dict) else list(traces)
    events: List[Dict[str, Any]] = []
    for i, trace in enumerate(items):
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise ValueError(f"gradaccum: gradaccum.trace.save(): item {i} is not a trace "
                             f"(a dict with 'traceEvents', as acc.window_trace() returns)")
        events.extend(trace["traceEvents"])
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
