"""acc.run(): one micro-step that survives running out of memory.

See Note [Micro-steps in parts] in src/accumulator/parts.cpp for what the C++
side guarantees: a part that raised without reaching ``.grad`` did not happen,
and nothing about a split crosses ranks.
"""
import collections
import gc
import math
from typing import Any, Callable, Deque, List, Optional, Tuple

import torch

from gradaccum._split import _flatten, split

#: Micro-steps in a row without running out of memory before run() tries parts
#: twice as big again.
GROW_AFTER = 100


class RunState:
    """What run() remembers between micro-batches (per rank, not saved)."""

    def __init__(self) -> None:
        self.max_rows: Optional[int] = None  # parts of at most this many rows; None: whole micro-batches
        self.clean = 0  # micro-steps since the last out-of-memory
        self.oom_retries = 0  # parts that ran out of memory and were run again in halves


def _rows(batch: Any) -> Optional[int]:
    """The batch's rows (dim 0 of its tensors), or None if it cannot be split."""
    leaves: List[torch.Tensor] = []
    try:
        _flatten(batch, leaves)
    except TypeError:
        return None
    if not leaves or any(t.dim() == 0 for t in leaves):
        return None
    rows = leaves[0].shape[0]
    return rows if all(t.shape[0] == rows for t in leaves) else None


def _free_memory() -> None:
    """After an out-of-memory: the failed part's tensors are unreachable once
    its exception is gone; collect cycles, and give the CUDA caching
    allocator's free blocks back so that the smaller parts start unfragmented."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _loss_of(reduction: str, out: Any) -> Tuple[torch.Tensor, Any]:
    if reduction == "items":
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                "gradaccum: acc.run(): with reduction='items', fn(batch) must return (loss_sum, num_items): "
                f"the loss summed over the batch's items and their count, got {type(out).__name__}")
        return out[0], out[1]
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"gradaccum: acc.run(): fn(batch) must return the micro-batch's loss (a tensor: its "
            f"{'mean' if reduction == 'mean' else 'sum'} over the batch's rows) with reduction={reduction!r}, "
            f"got {type(out).__name__}")
    return out, None


class _Total:
    """The micro-batch's loss as the window weighs it, from its parts."""

    def __init__(self, reduction: str) -> None:
        self.items = reduction == "items"
        self.mean = reduction == "mean"
        self.loss: Optional[torch.Tensor] = None
        self.num_items: Any = 0

    def add(self, loss: torch.Tensor, num_items: Any, share: float) -> None:
        value = loss.detach() * share if self.mean else loss.detach()
        self.loss = value if self.loss is None else self.loss + value
        if self.items:
            self.num_items = self.num_items + num_items

    def result(self) -> Any:
        return (self.loss, self.num_items) if self.items else self.loss


def run(acc: Any, fn: Callable[[Any], Any], batch: Any) -> Any:
    """The body of Accumulator.run (see its docstring)."""
    state: RunState = acc._run_state
    items = acc.reduction == "items"
    rows = _rows(batch)
    parts = 1 if state.max_rows is None or rows is None else max(1, math.ceil(rows / state.max_rows))
    if parts == 1 and acc._c.sync_gradients and acc.process_group is not None:
        # The window's closing micro-step, whole: the ordinary synchronising
        # backward, its buckets overlapped with it. Out of memory in the
        # forward is retried in parts; in this backward the reducer drops the
        # window on every rank, as for any failed synchronising backward.
        out_of_memory = False
        try:
            out = fn(batch)
        except torch.OutOfMemoryError:
            out_of_memory = True
        if not out_of_memory:
            loss, num_items = _loss_of(acc.reduction, out)
            del out
            acc._c.backward_whole(*acc._micro_batch("acc.run()", loss, num_items))
            _count_clean(state)
            return (loss.detach(), num_items) if items else loss.detach()
        _free_memory()
        queue = _halves(acc, state, batch, rows)
    else:
        queue = collections.deque([(batch, rows)] if parts == 1 else [(p, _rows(p)) for p in split(batch, parts)])
    total = _Total(acc.reduction)
    try:
        while queue:
            part, part_rows = queue.popleft()
            share = 1.0 if rows is None or part_rows is None else part_rows / rows
            out_of_memory = False
            try:
                loss, num_items = _loss_of(acc.reduction, fn(part))
                acc._backward_part(loss, num_items, share)
            except torch.OutOfMemoryError:
                out_of_memory = True  # handled below, once the exception and its frames are gone
            if out_of_memory:
                loss = num_items = None
                _free_memory()
                queue.extendleft(reversed(_halves(acc, state, part, part_rows)))
                continue
            total.add(loss, num_items, share)
            loss = num_items = None
    except BaseException:
        # The micro-batch did not run whole: its parts in .grad (or, data
        # parallel, its missing place in the window) fail the micro-step.
        if acc._c.parts_open:
            acc._c.end_micro_step(failed=True)
        raise
    acc._c.end_micro_step()
    _count_clean(state)
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
    half = math.ceil(part_rows / 2)
    state.max_rows = half if state.max_rows is None else min(state.max_rows, half)
    state.clean = 0
    state.oom_retries += 1
    return collections.deque((p, _rows(p)) for p in split(part, 2))


def _count_clean(state: RunState) -> None:
    if state.max_rows is None:
        return
    state.clean += 1
    if state.clean >= GROW_AFTER:
        state.clean = 0
        state.max_rows *= 2  # a micro-batch no bigger than this runs whole again
