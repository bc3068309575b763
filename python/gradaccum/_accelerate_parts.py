"""The objects gradaccum.accelerate.Accelerator hands out or registers: the
prepared optimizer and scheduler, the scheduler driver the Accumulator steps,
the checkpointed Accumulator state, and the shard sampler under a loader
(with the padding batch of a training iteration).
Imported by gradaccum.accelerate once Accelerate is known to be importable."""
from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional

import torch
from accelerate.data_loader import BatchSamplerShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState

from gradaccum._accumulator import Accumulator

if TYPE_CHECKING:
    from gradaccum.accelerate import Accelerator


def _find_shard_sampler(loader: Any) -> Optional[BatchSamplerShard]:
    """The BatchSamplerShard under a prepared loader (through a SkipBatchSampler)."""
    seen = 0
    for start in ("batch_sampler", "sampler"):
        obj = getattr(loader, start, None)
        while obj is not None and seen < 8:
            seen += 1
            if isinstance(obj, BatchSamplerShard):
                return obj
            obj = getattr(obj, "batch_sampler", None)
    return None


# Note [A padding batch, not copies]
# Accelerate's even_batches (its default) gives every rank as many batches by
# filling the shorter shards' last batch with copies of the first samples,
# which then weigh twice. Without it (every sample once) ranks differ by one
# batch, and so do their loops: a script that counts sync_gradients steps
# (the *_no_trainer.py scripts' completed_steps against max_train_steps) stops
# at different windows on different ranks, and hangs. So a training iteration
# of a loader with even_batches takes the shards without copies and gives a
# rank short of len(loader) (the same on every rank) one padding batch at its
# end: a copy of one of its batches (the first it had, else the sampler's
# first) whose backward is acc.empty_micro_step(): no weight, no gradient, the
# micro-step still counted, so every rank runs the same iterations and windows.
# The padding batch is always the iteration's last, and the sampler has run to
# its end before the loader knows a batch is its last (the loader's own
# end_of_dataloader; not GradientState's, which another loader left
# unfinished can hold): the flag the sampler sets here is final when the
# adapter reads it. Workers that deliver batches out of order
# (DataLoader(in_order=False)) could put a real batch last: such a loader's
# training shards are not padded (warned).

def _pad_shard(shard: BatchSamplerShard) -> None:
    """Lets a training iteration of `shard` run without copies and with a
    padding batch (Note [A padding batch, not copies]); once per shard. The
    shard's own __iter__ calls these through the instance."""
    if getattr(shard, "_gradaccum_padding", False):
        return
    cls = type(shard)
    shard._gradaccum_padding = True
    shard._gradaccum_train = False  # set when an iteration begins
    shard._gradaccum_pad_to = None
    shard._gradaccum_padded = False
    shard._iter_with_no_split = lambda: _training_batches(shard, cls._iter_with_no_split)
    shard._iter_with_split = lambda: _training_batches(shard, cls._iter_with_split)


def _begin_iteration(shard: BatchSamplerShard, train: bool, pad: bool) -> None:
    """A loader iteration begins: a training one takes every sample once, and
    (`pad`) is padded to len(shard) batches where that is every rank's
    (even_batches)."""
    shard._gradaccum_train = train
    shard._gradaccum_pad = train and pad and shard.even_batches
    shard._gradaccum_padded = False
    shard._gradaccum_pad_to = None


def _training_batches(shard: BatchSamplerShard, stock: Any) -> Iterator[Any]:
    if not shard._gradaccum_train:
        yield from stock(shard)
        return
    if shard._gradaccum_pad:
        try:  # here, after the loader's set_epoch(): a length may change with the epoch
            shard._gradaccum_pad_to = len(shard)
        except TypeError:  # a batch sampler without a length: no padding
            pass
    uneven = copy.copy(shard)  # the same samplers; stock reads even_batches from it
    uneven.even_batches = False
    count, first = 0, None
    for batch in stock(uneven):
        first = batch if first is None else first
        count += 1
        yield batch
    pad_to = shard._gradaccum_pad_to
    if pad_to is not None and count < pad_to:  # by one: shards differ by one batch at most
        if first is None:  # no batch of its own: the sampler's first (any will do)
            first = next(iter(shard.batch_sampler), None)
            if first is not None and shard.split_batches:
                first = first[:max(1, len(first) // shard.num_processes)]
        if first is not None:
            shard._gradaccum_padded = True
            yield list(first)


def _every_rank_ends_on_a_boundary(loader: Any, steps: int) -> bool:
    """From the shard's sampler, which every rank has alike: whether each
    rank's iteration (started at micro-step `_gradaccum_start`, the same on
    every rank) ends on a boundary of windows of `steps`. False when not known."""
    shard = getattr(loader, "_gradaccum_shard", None)
    start = getattr(loader, "_gradaccum_start", None)
    if shard is None or start is None or shard.split_batches:
        return False
    try:
        total = len(shard.batch_sampler)
    except TypeError:
        return False
    world = shard.num_processes
    if getattr(shard, "_gradaccum_pad_to", None) is not None:
        total = shard._gradaccum_pad_to * world  # padded: len(shard) batches on every rank
    skip = int(getattr(loader, "skip_batches", 0) or 0)
    sampler = getattr(loader, "batch_sampler", None)
    while sampler is not None and sampler is not shard:
        skip += int(getattr(sampler, "skip_batches", 0) or 0)
        sampler = getattr(sampler, "batch_sampler", None)
    counts = [total // world + (0 if shard.drop_last else int(r < total % world)) for r in range(world)]
    return all(c >= skip and (start + c - skip) % steps == 0 for c in counts)


class _AccumulatorCheckpoint:
    """What ``register_for_checkpointing`` saves: the Accumulator's state
    (a collective mid-window: Accelerate calls it on every rank)."""

    def __init__(self, accelerator: "Accelerator") -> None:
        self._accelerator = weakref.ref(accelerator)

    def state_dict(self) -> Dict[str, Any]:
        accelerator = self._accelerator()
        acc = None if accelerator is None else accelerator.accumulator
        return {} if acc is None else {"accumulator": acc.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        accelerator = self._accelerator()
        if accelerator is None or "accumulator" not in state:
            return
        if accelerator.accumulator is None:
            accelerator._pending_state = state["accumulator"]
        else:
            accelerator.accumulator.load_state_dict(state["accumulator"])


class _GradaccumOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: ``step()`` is the window's step (or the end of
    a training loader's flush), ``zero_grad()`` is left to the Accumulator."""

    def __init__(self, optimizer: torch.optim.Optimizer, accelerator: "Accelerator",
                 device_placement: bool = True) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self._accelerator_ref = weakref.ref(accelerator)
        self.real_steps = 0  # optimizer steps taken (schedulers follow them)

    def _acc(self) -> Optional[Accumulator]:
        accelerator = self._accelerator_ref()
        return None if accelerator is None else accelerator.accumulator

    def step(self, closure: Any = None) -> None:
        accelerator = self._accelerator_ref()
        acc = self._acc()
        if accelerator is None or acc is None:
            if accelerator is not None and accelerator._models:
                acc = accelerator._ensure_accumulator("optimizer.step()")
            else:
                return super().step(closure)
        if closure is not None:
            raise ValueError("gradaccum: optimizer.step(closure): a closure is not supported; the Accumulator "
                             "steps the optimizer once per window")
        steps, boundary = 0, False
        loader = accelerator._training_loader_at_end()
        if loader is not None:
            loader._gradaccum_flushed = True
            boundary = True
            steps = accelerator._end_epoch(loader)
        elif acc.window_ready:
            boundary = True
            steps = int(bool(acc.step()))
            accelerator._after_window()
        if boundary:
            self._is_overflow = steps == 0
            self.real_steps += steps

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        if self._acc() is None:
            super().zero_grad(set_to_none)


class _GradaccumScheduler(AcceleratedScheduler):
    """The prepared scheduler. Linked to the prepared optimizer (Accelerate's
    ``step_scheduler_with_optimizer``, the default), the Accumulator steps it
    right after each real optimizer step, ``num_processes`` times (once with
    ``split_batches``) as Accelerate's own does, and the script's
    ``scheduler.step()`` does nothing: a rank whose last batch closes a window
    and then flushes the other ranks' partial one steps the optimizer twice in
    one micro-step, with the scheduler stepped in between, as on the others."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)

    def _after_optimizer_step(self) -> None:
        for _ in range(1 if self.split_batches else AcceleratorState().num_processes):
            if hasattr(self.scheduler, "total_steps") and self.scheduler._step_count > self.scheduler.total_steps:
                break
            self.scheduler.step()


class _SchedulerDriver:
    """The Accumulator's ``scheduler``: its ``step()`` runs after each real
    optimizer step and steps the prepared schedulers linked to the optimizer
    (prepared before or after the Accumulator was built)."""

    def __init__(self, accelerator: "Accelerator") -> None:
        self._accelerator = weakref.ref(accelerator)

    def step(self) -> None:
        accelerator = self._accelerator()
        if accelerator is None:
            return
        for scheduler in accelerator._schedulers:
            if isinstance(scheduler, _GradaccumScheduler) and scheduler.step_with_optimizer:
                scheduler._after_optimizer_step()


def _watch_loader(accelerator: Any, loader: Any) -> None:
    """Makes a training iteration of `loader` (prepared by `accelerator`, a
    gradaccum.accelerate.Accelerator) shard without copies and end by closing
    the epoch's window on every rank."""
    if getattr(loader, "_gradaccum_watched", False) or not hasattr(loader, "begin"):
        return
    shard = _find_shard_sampler(loader)
    if shard is not None:
        _pad_shard(shard)
    begin, end = loader.begin, loader.end
    owner_ref = weakref.ref(accelerator)

    def gradaccum_begin() -> None:
        owner = owner_ref()
        train = owner is not None and owner._training_mode()
        loader._gradaccum_train = train
        loader._gradaccum_flushed = False
        acc = None if owner is None else owner.accumulator
        loader._gradaccum_start = None if acc is None or acc.window_ready else acc.micro_step
        if train:
            running = owner._current_training_loader()
            if running is not None and running is not loader and not running._gradaccum_flushed:
                owner._warn_nested_training()
            owner._training_loader = weakref.ref(loader)
        elif owner is not None and owner._current_training_loader() is loader:
            owner._training_loader = None  # its last training iteration ended without end() (a break)
        if shard is not None:
            _begin_iteration(shard, train, pad=train and owner._in_order(loader, shard))
        begin()

    def gradaccum_end() -> None:
        owner = owner_ref()
        try:
            if (owner is not None and loader._gradaccum_train and not loader._gradaccum_flushed
                    and owner.accumulator is not None):
                loader._gradaccum_flushed = True
                owner._end_epoch(loader)
        finally:
            end()
            if owner is not None and owner._training_loader is not None and owner._training_loader() is loader:
                owner._training_loader = None

    loader._gradaccum_watched = True
    loader._gradaccum_shard = shard
    loader._gradaccum_start = None
    loader._gradaccum_train = False
    loader._gradaccum_flushed = False
    loader.begin = gradaccum_begin
    loader.end = gradaccum_end
