"""The objects gradaccum.accelerate.Accelerator hands out or registers: the
prepared optimizer and scheduler, the scheduler driver the Accumulator steps,
the checkpointed Accumulator state, and the shard sampler under a loader.
Imported by gradaccum.accelerate once Accelerate is known to be importable."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Dict, Optional

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
