"""This rank's share of a window's loss, for the adapters that log the global
loss on a wire that does not carry it.

Note [A wire without the loss]
A bf16/fp16 wire's header carries integers only, so data parallel
``acc.window_loss`` is None where every bucket's is one (Note [The window's
loss rides in the header]). The HF Trainer and the Lightning strategy still log the window's
global loss: each rank keeps its loss sum over the window's micro-batches and,
at the window's end, its share (that sum over the global ``window_items``, or
the sum itself for ``"sum"``); the shares summed over ranks are the window's
loss. Every rank reads the same ``window_loss`` and ``window_items`` (from the
summed header), so every rank takes a share at the same windows and the
all-reduce that sums them pairs. Where the wire does carry the loss, nothing
is kept after the first window (no per-micro-batch work, no collective);
should it stop carrying it (refresh_parameters() leaving only bf16/fp16
buckets), that first window logs none, and the next ones their shares.
"""
from typing import Any, Optional

import torch


class LossShare:
    def __init__(self) -> None:
        self._sum: Optional[torch.Tensor] = None
        # Whether the wire carries no loss: unknown (None) until a window with
        # items closes; kept meanwhile.
        self._needed: Optional[bool] = None

    def add(self, loss: torch.Tensor, skip_nonfinite: bool) -> None:
        """One micro-batch's loss as ``acc.backward`` got it (summed over its
        items with ``"items"``). ``skip_nonfinite``: ``nonfinite=
        "skip_micro_batch"``, which leaves a non-finite loss out of the window."""
        if self._needed is False:
            return
        value = loss.detach().to(torch.float64)
        if skip_nonfinite:
            value = torch.where(torch.isfinite(value), value, torch.zeros_like(value))
        self._sum = value if self._sum is None else self._sum + value

    def drop(self) -> None:
        """The open window was dropped (its losses are not in any window)."""
        self._sum = None

    def take(self, acc: Any, reduction: str, device: Any) -> Optional[torch.Tensor]:
        """At a closed window: this rank's share of its loss where the wire
        carried none (a 0-dim float64 tensor on ``device``, to sum over ranks),
        else None. The same answer on every rank."""
        local, self._sum = self._sum, None
        items = acc.window_items
        if acc.window_loss is not None or items <= 0:
            if acc.window_loss is not None and items > 0:
                self._needed = False
            return None
        if not acc.stats()["data_parallel"]:
            return None  # (one process always has its loss: a window a checkpoint cut)
        if self._needed is False:
            # The wire stopped carrying the loss (refresh_parameters() left
            # only bf16/fp16 buckets): nothing was kept of this window, so it
            # logs none, on every rank alike (the same answer everywhere); the
            # next ones do.
            self._needed = True
            return None
        self._needed = True
        share = local.to(device) if local is not None else torch.zeros((), dtype=torch.float64, device=device)
        return share if reduction == "sum" else share / items
