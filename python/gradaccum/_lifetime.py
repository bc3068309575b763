"""What the Accumulator holds and how it lets go: every open one, closed at
interpreter exit, and the optimizer step the C++ side calls, which holds its
Accumulator weakly (see Accumulator._weakly), with the list of what that
optimizer steps; its optimizer and scheduler, fixed, and no pickling (_Held)."""
import atexit
import os
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from gradaccum._accumulator import Accumulator


# Every open Accumulator, closed at interpreter exit (see _close_at_exit).
_LIVE: "weakref.WeakSet[Accumulator]" = weakref.WeakSet()


def _gloo_workers_alive() -> bool:
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # not Linux
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().startswith("pt_gloo"):
                    return True
        except OSError:
            pass
    return False


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit, while Python still runs (atexit handlers run before
    finalization), lets go of every process group gradaccum holds.

    A Gloo group's worker threads must not outlive the interpreter busy: the
    one that ran the last collective releases that work's Python tensors after
    the caller has already been woken, and needs the GIL for it; during
    finalization that aborts the process ("terminate called without an active
    exception", about 1 torchrun run of train_ddp.py in 10 here). So:
    - close() every open Accumulator, without the GIL: after
      destroy_process_group() its reference is the group's last one, and the
      group's destructor joins the threads now;
    - torch itself keeps the group alive past destroy_process_group() when
      torch._dynamo was first imported while it existed (any torch.optim
      optimizer built after init_process_group does it), and a group nobody
      destroys (torch DDP's, e.g. transformers.Trainer's, in the same script:
      the stock run of examples/python/train_hf_trainer.py aborted so) keeps
      them too: while Gloo threads are alive, give them the GIL for a moment
      to finish what they release."""
    for acc in list(_LIVE):
        try:
            close(acc, warn=False)  # (no warning: the script is over, whatever it left)
        except Exception:  # exiting anyway: nothing left to tell
            pass
    if _gloo_workers_alive():
        time.sleep(0.1)  # releases the GIL


# How deep this thread is in an Accumulator's own optimizer steps, which
# _refuse_own_steps lets run. (Not the optimizer's id: a wrapper such as
# Lightning's LightningOptimizer shares its hooks with the optimizer it wraps,
# whose step runs them: review.)
_STEPPING = threading.local()


def _optimizer_step(acc: "Accumulator", optimizer: Any) -> Callable[[], None]:
    """The C++ side's optimizer step: the pre-step hook, then optimizer.step().
    It holds the Accumulator weakly (see Accumulator._weakly)."""
    ref = weakref.ref(acc)
    _refuse_own_steps(acc, optimizer)

    def step() -> None:
        target = ref()
        if target is not None and target._pre_step_hook is not None:
            target._pre_step_hook()
        _STEPPING.depth = getattr(_STEPPING, "depth", 0) + 1
        try:
            optimizer.step()
        finally:
            _STEPPING.depth -= 1

    return step


def _refuse_own_steps(acc: "Accumulator", optimizer: Any) -> None:
    """A script's own optimizer.step() (or scaler.step(optimizer)) in the
    middle of a window, beside acc.step(): it stepped each rank's own partial
    sum, and the replicas drifted apart, with nothing said (review: a
    migration's leftover). A torch optimizer's step pre-hook refuses it; at a
    window boundary (the manual path's step) it passes."""
    ref = weakref.ref(acc)

    def pre_hook(opt: Any, args: Any, kwargs: Any) -> None:
        target = ref()
        c = getattr(target, "_c", None)  # (None: its construction failed)
        if c is None or getattr(_STEPPING, "depth", 0) or c.closed:
            return
        # A plain backward that reduced a window in its middle (the manual
        # path's reduction) raises that here; else the window ends there and
        # the manual path's steps after it pass (review).
        c.realign("optimizer.step()")
        if c.micro_step == 0 and not c.window_ready:
            target._check_group("optimizer.step()")  # (the manual path's step: nothing reduced it)
            return
        where = ("its window closed, not yet stepped: a second step of it" if c.window_ready else
                 f"after {c.micro_step} of its {target.steps} micro-steps: a step on a partial sum, each rank its own")
        raise RuntimeError(
            f"gradaccum: optimizer.step(): called outside acc.step() in the middle of an Accumulator's window "
            f"({where}). acc.step() steps the optimizer itself, once per window, with the window's reduced "
            "gradient: remove the script's optimizer.step() (and scaler.step(optimizer): pass the scaler as "
            "grad_scaler=), or take the manual path (acc.no_sync() and a plain loss.backward(), stepping the "
            "optimizer yourself). Nothing was stepped")

    try:
        handle = optimizer.register_step_pre_hook(pre_hook)
    except (AttributeError, TypeError):  # not a torch Optimizer (any object with step())
        return
    weakref.finalize(acc, handle.remove)


def _optimizer_parameters(optimizer: Any) -> Optional[Callable[[], List[torch.Tensor]]]:
    """What the optimizer steps, for the C++ side's check that each parameter
    is the model's (Note [Parameters only the optimizer steps]); None for an
    optimizer without param_groups (any object with step())."""
    if optimizer is None or getattr(optimizer, "param_groups", None) is None:
        return None

    def parameters() -> List[torch.Tensor]:
        return [p for group in optimizer.param_groups if isinstance(group, dict)
                for p in group.get("params", ()) if isinstance(p, torch.Tensor)]

    return parameters


def _step_count(scheduler: Any) -> Any:
    """A scheduler's step count: torch's LR schedulers keep it in
    `last_epoch`; a ChainedScheduler's is its schedulers' (a tuple). None
    where there is none to read (a wrapper of another kind)."""
    count = getattr(scheduler, "last_epoch", None)
    if isinstance(count, int):
        return count
    inner = getattr(scheduler, "_schedulers", None)
    if isinstance(inner, (list, tuple)) and inner:
        counts = tuple(_step_count(s) for s in inner)
        return None if any(c is None for c in counts) else counts
    return None


def _ahead(now: Any, left: Any) -> bool:
    if isinstance(now, tuple) and isinstance(left, tuple) and len(now) == len(left):
        return any(_ahead(a, b) for a, b in zip(now, left))
    return isinstance(now, int) and isinstance(left, int) and now > left


class SchedulerStep:
    """The scheduler step acc.step() runs after each real optimizer step. A
    scheduler the script also steps itself (each epoch, or beside acc.step()
    in its loop) runs ahead of the optimizer's steps, silently: its step
    count having moved on since this step left it warns, once per
    Accumulator. A count that went back (the scheduler's state loaded for a
    rollback) is no step of the script's; acc.load_state_dict() forgets the
    count, so the resume recipe's loads never warn. Not checked: a scheduler
    whose count cannot be read (no `last_epoch`)."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.left: Any = None
        self.warned = False

    def forget(self) -> None:
        self.left = None

    def __call__(self) -> None:
        now = _step_count(self.scheduler)
        if not self.warned and _ahead(now, self.left):
            self.warned = True
            warnings.warn(
                f"gradaccum: acc.step(): the scheduler passed as scheduler= was stepped outside acc.step() "
                f"(its step count is {now}, where acc.step()'s last step of it left {self.left}): it runs ahead "
                f"of the optimizer's steps. acc.step() steps it after each optimizer step; drop your own "
                f"scheduler.step() call, or build the Accumulator without scheduler=. Warned once", stacklevel=3)
        try:
            self.scheduler.step()
        finally:  # (a step that raised may have counted itself: a retry is not the script's)
            self.left = _step_count(self.scheduler)


def _fixed(name: str) -> None:
    raise AttributeError(f"gradaccum: acc.{name} cannot be replaced: the Accumulator reduces, scales and steps by "
                         f"what it was built with; acc.close() it and build a new one with the new {name}")


class _Held:
    """What an Accumulator holds for good: the optimizer and scheduler it was
    built with (it steps those: a new one needs a new Accumulator), and
    state no pickle or copy can carry (a process group, hooks on the model)."""

    _optimizer: Any = None
    _scheduler: Any = None

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        raise AttributeError("gradaccum: acc.optimizer cannot be replaced: acc.step() steps the optimizer the "
                             "Accumulator was built with; acc.close() it and build a new one with the new optimizer")

    @property
    def scheduler(self) -> Any:
        return self._scheduler

    @scheduler.setter
    def scheduler(self, value: Any) -> None:
        raise AttributeError("gradaccum: acc.scheduler cannot be replaced: acc.step() steps the scheduler the "
                             "Accumulator was built with; acc.close() it and build a new one, or step a scheduler "
                             "of your own when acc.step() returns True")

    _steps: int = 0
    _reduction: str = "mean"
    _metrics: Tuple[str, ...] = ()
    _grad_scaler: Any = None
    _process_group: Any = None

    # What the Accumulator was built with, read-only like the optimizer: the
    # C++ side keeps its own copy, and a new value here would scale, read or
    # unscale by one rule while it reduced by the other.
    @property
    def steps(self) -> int:
        return self._steps

    @steps.setter
    def steps(self, value: Any) -> None:
        _fixed("steps")

    @property
    def reduction(self) -> str:
        return self._reduction

    @reduction.setter
    def reduction(self, value: Any) -> None:
        _fixed("reduction")

    @property
    def metrics(self) -> Tuple[str, ...]:
        return self._metrics

    @metrics.setter
    def metrics(self, value: Any) -> None:
        _fixed("metrics")

    @property
    def grad_scaler(self) -> Any:
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, value: Any) -> None:
        _fixed("grad_scaler")

    @property
    def process_group(self) -> Any:
        return self._process_group

    @process_group.setter
    def process_group(self, value: Any) -> None:
        _fixed("process_group")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("gradaccum: an Accumulator cannot be pickled or copied (pickle, copy, torch.save): it holds "
                        "a process group and hooks on the model; save acc.state_dict() beside the model's and the "
                        "optimizer's, and load it into a new Accumulator with acc.load_state_dict()")


_WARNED_UNSTEPPED = False


def close(acc: Any, warn: bool) -> None:
    """acc.close(): a window whose counted micro-steps no optimizer step took
    is discarded; unless an error is leaving (`warn` False) that warns, once
    per process (it was silent: a loop's last partial window without
    acc.flush(), say)."""
    global _WARNED_UNSTEPPED
    c = acc._c
    if warn and not _WARNED_UNSTEPPED and not c.closed and (c.micro_step > 0 or c.window_ready):
        _WARNED_UNSTEPPED = True
        what = ("a closed window no optimizer step took (acc.step() steps it); it is" if c.window_ready else
                f"{c.micro_step} counted micro-step(s) of a window no optimizer step took (acc.flush() steps a "
                "partial window: call it at the end of the data, on every rank); they are")
        warnings.warn(f"gradaccum: acc.close(): this Accumulator held {what} discarded. Warned once", stacklevel=3)
    c.close()
    acc._process_group = None  # (the group's last reference may be this one)
