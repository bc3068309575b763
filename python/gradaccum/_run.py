"""acc.run(): one micro-step that survives running out of memory.

See Note [Micro-steps in parts] in src/accumulator/parts.cpp for what the C++
side guarantees: a part that raised without reaching ``.grad`` did not happen,
and nothing about a split crosses ranks.
"""
import collections
import gc
import math
from typing import Any, Callable, Deque, Dict, Optional, Tuple

import torch

from gradaccum._checks import _metric_values
from gradaccum._split import _flatten, _Leaves, split

#: Micro-steps in a row without running out of memory before run() tries parts
#: twice as big again.
GROW_AFTER = 100


class RunState:
    """What run() remembers between micro-batches (per rank, not saved)."""

    def __init__(self) -> None:
        self.max_rows: Optional[int] = None  # parts of at most this many rows; None: whole micro-batches
        self.clean = 0  # micro-steps since the last out-of-memory
        self.oom_retries = 0  # parts that ran out of memory and were run again in halves
        # The most rows that ran whole since the last out-of-memory: a window's
        # closing micro-step runs whole (overlapped) only at a size known to
        # fit, since running out of memory there drops the window.
        self.proven = 0

    def shrink(self, rows: Optional[int]) -> None:
        """Ran out of memory on ``rows``: later parts take at most half."""
        if rows is not None and rows > 1:
            half = math.ceil(rows / 2)
            self.max_rows = half if self.max_rows is None else min(self.max_rows, half)
        self.clean = 0
        self.proven = 0


def _rows(batch: Any) -> Optional[int]:
    """The batch's rows (dim 0 of its tensors), or None if it cannot be split."""
    leaves = _Leaves()
    try:
        _flatten(batch, leaves)
    except TypeError:
        return None  # run whole: only a split needs to know
    if not leaves.tensors or any(t.dim() == 0 for t in leaves.tensors):
        return None
    rows = leaves.tensors[0].shape[0]
    if any(t.shape[0] != rows for t in leaves.tensors) or any(len(v) != rows for v in leaves.samples):
        return None
    return rows


def _free_memory() -> None:
    """After an out-of-memory: the failed part's tensors are unreachable once
    its exception is gone; collect cycles, and give the CUDA caching
    allocator's free blocks back so that the smaller parts start unfragmented."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# The reducer's own-failure phrase (src/consensus/agreement.cpp): the drop's
# error on the rank whose backward failed, which carries that error's text.
_FAILED_HERE = "failed on this rank"
# backward_part()'s (src/accumulator/parts.cpp): a part failed after some of
# its gradient reached .grad, on this rank.
_PART_FAILED = "a part of the micro-batch failed in its backward after"


def _is_oom(error: BaseException) -> bool:
    """Out of memory, also when the reducer's error carries it as text (its
    own error wraps the failed backward's: "CUDA out of memory", the CPU
    allocator's "not enough memory")."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "not enough memory" in text


def _loss_of(reduction: str, out: Any) -> Tuple[torch.Tensor, Any, Any]:
    """fn's result as (loss, num_items, metrics)."""
    if isinstance(out, dict):
        unknown = sorted(set(out) - {"loss", "num_items", "metrics"})
        if "loss" not in out or unknown or ("num_items" in out) != (reduction == "items"):
            raise TypeError(
                "gradaccum: acc.run(): a dict from fn(batch) holds 'loss', 'metrics' (optional) and, with "
                f"reduction='items' only, 'num_items'; got the keys {sorted(out)} with reduction={reduction!r}")
        return out["loss"], out.get("num_items"), out.get("metrics")
    if reduction == "items":
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                "gradaccum: acc.run(): with reduction='items', fn(batch) must return (loss_sum, num_items): "
                f"the loss summed over the batch's items and their count, got {type(out).__name__}")
        return out[0], out[1], None
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"gradaccum: acc.run(): fn(batch) must return the micro-batch's loss (a tensor: its "
            f"{'mean' if reduction == 'mean' else 'sum'} over the batch's rows) with reduction={reduction!r}, "
            f"got {type(out).__name__}")
    return out, None, None


class _Total:
    """The micro-batch's loss as the window weighs it, from its parts."""

    def __init__(self, reduction: str) -> None:
        self.items = reduction == "items"
        self.mean = reduction == "mean"
        self.loss: Optional[torch.Tensor] = None
        self.num_items: Any = 0
        self.metrics: Optional[Dict[str, Any]] = None  # fn returned a dict: the parts' metrics add up
        self.metrics_given = False  # and its dict had "metrics" (returned only then, as fn's dict)

    def add(self, loss: torch.Tensor, num_items: Any, share: float, metrics: Any, as_dict: bool) -> None:
        value = loss.detach() * share if self.mean else loss.detach()
        self.loss = value if self.loss is None else self.loss + value
        if self.items:
            self.num_items = self.num_items + num_items
        if as_dict:
            self.metrics = self.metrics or {}
            self.metrics_given = self.metrics_given or metrics is not None
            for name, v in (metrics or {}).items():
                v = v.detach() if isinstance(v, torch.Tensor) else v
                self.metrics[name] = v if name not in self.metrics else self.metrics[name] + v

    def result(self) -> Any:
        if self.metrics is not None:
            out: Dict[str, Any] = {"loss": self.loss}
            if self.metrics_given:
                out["metrics"] = self.metrics
            if self.items:
                out["num_items"] = self.num_items
            return out
        return (self.loss, self.num_items) if self.items else self.loss


def _fail(acc: Any, error: BaseException, marker: int) -> None:
    """An error run() does not retry: unless the call that raised took the
    micro-step's place already (``acc._c.progress_marker`` moved on: it
    counted a failed micro-step, or ran a reduction that dropped the window),
    the micro-step fails here: its parts in .grad drop the window; data
    parallel it takes its place, so every rank still closes its windows
    together (at once, on every rank, if it closes the window)."""
    if acc._c.progress_marker != marker:
        return
    if not (acc._c.parts_open or acc.process_group is not None):
        return  # one process, nothing of it in .grad: the window goes on without it
    try:
        # (an interrupt stops this rank: every rank is told to end training)
        acc._c.end_micro_step(failed=True, out_of_memory=_is_oom(error), interrupted=not isinstance(error, Exception))
    except RuntimeError as dropped:
        _add_note(error, str(dropped))


def _add_note(error: BaseException, note: str) -> None:
    add_note = getattr(error, "add_note", None)  # Python 3.11+
    if add_note is not None:
        add_note(note)
    else:
        try:
            error.__notes__ = [*getattr(error, "__notes__", []), note]
        except AttributeError:
            pass


def run(acc: Any, fn: Callable[[Any], Any], batch: Any) -> Any:
    """The body of Accumulator.run (see its docstring)."""
    if not callable(fn):  # (before the micro-step: data parallel, a failed one drops the window)
        raise TypeError(f"gradaccum: acc.run(): fn must be callable (it computes the loss), got {type(fn).__name__}")
    state: RunState = acc._run_state
    acc._c.realign("acc.run()")  # before fn: a failed fn would count a micro-step (review)
    acc._c.check_micro_step_state()  # a micro-step that could not run must be one that could
    marker = acc._c.progress_marker
    rows = _rows(batch)
    parts = 1 if state.max_rows is None or rows is None else max(1, math.ceil(rows / state.max_rows))
    fits = state.max_rows is None or (rows is not None and rows <= state.proven)
    total = _Total(acc.reduction)
    if parts == 1 and fits and acc._c.sync_gradients and acc.process_group is not None:
        # The window's closing micro-step, whole, at a size known to fit: the
        # ordinary synchronising backward, its buckets overlapped with it. Out
        # of memory in the forward is retried in parts; in this backward the
        # reducer drops the window on every rank, as for any failed
        # synchronising backward, and later closing micro-steps run in parts.
        out_of_memory = False
        try:
            out = fn(batch)
        except torch.OutOfMemoryError:
            out_of_memory = True
        except BaseException as error:
            _fail(acc, error, marker)
            raise
        if not out_of_memory:
            try:
                loss, num_items, metrics = _loss_of(acc.reduction, out)
                as_dict = isinstance(out, dict)
                del out
                acc._c.backward_whole(*acc._micro_batch("acc.run()", loss, num_items),
                                      _metric_values("acc.run()", acc.metrics, metrics, loss))
            except BaseException as error:
                # This rank's own out-of-memory (the drop's error here carries
                # its text; a peer's says that rank ran out of memory).
                if isinstance(error, torch.OutOfMemoryError) or (_FAILED_HERE in str(error) and _is_oom(error)):
                    state.shrink(rows)
                _fail(acc, error, marker)
                raise
            _count_clean(state, rows)
            total.add(loss, num_items, 1.0, metrics, as_dict)
            return total.result()
        _free_memory()
        queue = _halves(acc, state, batch, rows)
    else:
        queue = collections.deque([(batch, rows)] if parts == 1 else [(p, _rows(p)) for p in split(batch, parts)])
    whole = len(queue) == 1
    part_rows = rows
    try:
        while queue:
            part, part_rows = queue.popleft()
            # (an empty batch, 0 rows: one part, all of it)
            share = 1.0 if not rows or part_rows is None else part_rows / rows
            out_of_memory = False
            try:
                out = fn(part)
                loss, num_items, metrics = _loss_of(acc.reduction, out)
                as_dict = isinstance(out, dict)
                out = None
                acc._backward_part(loss, num_items, share, metrics)
            except torch.OutOfMemoryError:
                # From fn, or from a backward that reached no .grad (one that
                # did comes back as gradaccum's RuntimeError): run it again in
                # halves, once the exception and its frames are gone.
                out_of_memory = True
            if out_of_memory:
                whole = False
                out = loss = num_items = metrics = None
                _free_memory()
                queue.extendleft(reversed(_halves(acc, state, part, part_rows)))
                continue
            total.add(loss, num_items, share, metrics, as_dict)
            loss = num_items = metrics = None
    except BaseException as error:
        if _PART_FAILED in str(error) and _is_oom(error):
            # This rank's, in a part's backward after some of its gradient
            # reached .grad (gradaccum's error carries the text): the window
            # is lost, but later micro-batches run in smaller parts.
            state.shrink(part_rows)
        _fail(acc, error, marker)  # the micro-batch did not run whole
        raise
    acc._c.end_micro_step()
    _count_clean(state, rows if whole else None)
    return total.result()


def _halves(acc: Any, state: RunState, part: Any, part_rows: Optional[int]) -> Deque[Tuple[Any, Optional[int]]]:
    """The two halves of a part that ran out of memory; remembers the smaller
    part size for the micro-batches after it."""
    if part_rows is None or part_rows <= 1:
        what = "a part of one row" if part_rows == 1 else "a micro-batch that cannot be split (no tensors " \
            "with a common first dimension)"
        if acc.process_group is not None:
            where = "the window is dropped on every rank (at once if this was its closing micro-step, else " \
                "when it closes)"
        elif acc._c.parts_open:
            where = "the window was dropped (parts of this micro-batch had reached .grad)"
        else:
            where = "nothing of it reached .grad: the window goes on without it"
        message = (f"gradaccum: acc.run(): out of memory on {what}: it cannot be split further, so this "
                   f"micro-step failed and {where}. Free memory (a smaller model or micro-batch, "
                   "activation checkpointing) or leave such inputs out")
        try:
            # Data parallel in the closing micro-step: the drop's error.
            acc._c.end_micro_step(failed=True, out_of_memory=True)
        except RuntimeError as dropped:
            raise RuntimeError(message) from dropped
        raise RuntimeError(message)
    state.shrink(part_rows)
    state.oom_retries += 1
    return collections.deque((p, _rows(p)) for p in split(part, 2))


def _count_clean(state: RunState, whole_rows: Optional[int]) -> None:
    """A micro-step ran; ``whole_rows``: its rows when it ran as one part."""
    if state.max_rows is None:
        return
    if whole_rows is not None:
        state.proven = max(state.proven, whole_rows)
    state.clean += 1
    if state.clean >= GROW_AFTER:
        state.clean = 0
        state.max_rows *= 2  # a micro-batch no bigger than this runs whole again
