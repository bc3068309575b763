"""gradaccum.accelerate: Hugging Face Accelerate's ``Accelerator``, accumulating with gradaccum.

A drop-in subclass: an Accelerate script changes its import line (and may pass
``reduction=``) and keeps its shape::

    from gradaccum.accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=8, reduction="items")
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss_sum, n = ...                       # summed over the batch's tokens, and their count
            accelerator.backward(loss_sum, num_items=n)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

What changes underneath (Accelerate launches and sets up the process group as
always):

- ``prepare(model)`` places the model and applies Accelerate's mixed precision
  (autocast) and ``torch.compile`` as Accelerate does, but never wraps it in
  ``DistributedDataParallel``. The first ``prepare`` that has seen both the
  model and the optimizer (or the first ``accumulate()``/``backward()``)
  builds ``accelerator.accumulator``: a :class:`gradaccum.Accumulator` over
  the model with the prepared optimizer, ``steps = gradient_accumulation_steps``
  and ``reduction``. It all-reduces the gradients once per window.
- ``accelerator.backward(loss, num_items=None)`` is ``acc.backward``: no
  ``loss / K``; with ``reduction="items"`` pass the loss summed over items and
  their count: the window's gradient is that of total loss / total items over
  the window and every rank (the count rides in the gradient all-reduce).
  ``"mean"`` (the default) averages the micro-batch losses, as Accelerate's own
  accumulation does for full windows.
- ``sync_gradients`` is True through the window's closing micro-step, from
  ``accumulate()`` on (before its backward), as in Accelerate; the micro-step
  that ends a training loader's iteration closes the window too.
- The prepared optimizer's ``step()`` steps only at a closed window
  (``acc.step()``, which clears the gradients); ``zero_grad()`` does nothing
  while the Accumulator exists (it clears them itself).
- At the end of a training loader's iteration (Accelerate's
  ``end_of_dataloader``) ``optimizer.step()`` closes the epoch's partial window
  with its own weight on every rank (``acc.flush()``): the big batch's
  gradient, where Accelerate divides a partial window's losses by K anyway. A
  rank that never reaches such a step (no batch of its own, or a loop that
  does not call ``optimizer.step()`` on the last batch) flushes when its
  loader's iteration ends, so every rank takes part.
- Data loaders: a training iteration (one that starts with gradients on and
  the model in training mode) takes every sample once, with no copies of the
  first samples to fill the last batches (Accelerate's default
  ``even_batches`` fills them, which weights those samples twice). Batches go
  to the ranks in turn, so ranks differ by at most one batch, and with
  ``even_batches`` (the default) a rank one short ends with a padding batch (a
  copy of one of its batches) whose ``backward`` is
  ``acc.empty_micro_step()``: no weight, the micro-step still counts. Every
  rank runs ``len(loader)`` iterations and sees ``sync_gradients`` on the same
  ones, so a loop that stops after N of them stops at the same window
  everywhere (Note [A padding batch, not copies] in _accelerate_parts.py;
  with ``even_batches=False`` shards stay uneven). An iteration that starts
  in eval mode keeps Accelerate's sharding, so ``gather_for_metrics`` still
  lines up on every rank and drops the copies (``skip_first_batches`` alike).
- ``clip_grad_norm_``/``clip_grad_value_`` at a closed window clip the
  reduced, divided gradient (every rank alike) and return the norm. At a
  flushed partial window (and with an fp16 GradScaler, whose unscale happens
  inside the step) the gradient is reduced only inside ``optimizer.step()``:
  the clip is applied there, on the final gradient, before the optimizer
  step, and the tensor ``clip_grad_norm_`` returned (NaN until then) is
  filled in place. On a micro-step that closes no window (Accelerate clips
  local, partial sums there) they do nothing and return None (warned once).
- A scheduler from ``prepare`` is stepped by the Accumulator right after each
  real optimizer step (not mid-window, not after a window skipped for a
  non-finite gradient); like Accelerate's, ``num_processes`` times per
  optimizer step unless ``split_batches=True``, so the same schedule as stock
  Accelerate. The script's ``scheduler.step()`` then does nothing: a rank
  whose last batch closes a full window and then flushes the others' partial
  one steps the optimizer twice in one micro-step, and the schedule must
  advance in between, as on the other ranks (with
  ``step_scheduler_with_optimizer=False`` it steps as called).
- A rank whose last batch closed a full window (clipped by the script) clips
  the partial window the following flush closes alike.
- ``save_state``/``load_state`` carry the Accumulator's state (a registered
  checkpoint object; rank 0's copy resumes every rank, also from the middle
  of a window). ``accelerator.window_loss`` is ``acc.window_loss``: the last
  window's loss over every micro-batch of every rank, weighted as its
  gradient, with no collective of its own. ``gather``, ``reduce``,
  ``gather_for_metrics`` are Accelerate's.
- A float64 model whose loss is transformers' ``ForCausalLMLoss`` (which
  rounds logits to float32) gets the same loss computed in float64, so that
  ``outputs.loss`` windows equal a float64 big batch.
- ``fp16`` mixed precision: Accelerate's GradScaler becomes the
  Accumulator's ``grad_scaler`` (scaled backward, unscale, overflow skip and
  update once per window); ``bf16`` is autocast only.

Launched on CPUs (``accelerate launch --multi_gpu --num_processes 2`` where
torch sees no GPU), the processes form a Gloo group: the adapter passes
``cpu=True`` unless the script set ``cpu`` (stock Accelerate leaves each
process alone there, and gradaccum would refuse to train alone).

``DistributedDataParallelKwargs`` (``kwargs_handlers``) reach the
Accumulator: ``bucket_cap_mb``, ``gradient_as_bucket_view`` and
``broadcast_buffers`` as they are, ``comm_hook=FP16``/``BF16`` as
``comm_dtype``; ``find_unused_parameters``, ``static_graph``,
``check_reduction`` and ``dim`` are moot (unused parameters are handled, the
graph may change). PowerSGD hooks and wrappers are refused, as is a setting
that disagrees with ``accumulator_options``.

Not supported (refused when built): DeepSpeed, FSDP, Megatron-LM, XLA,
tensor/context parallelism, several trained models or optimizers under one
Accelerator, a closure in ``optimizer.step``, ``backward`` keyword arguments
other than ``num_items`` and ``metrics``. ``GradientAccumulationPlugin``'s
``sync_each_batch`` has no effect (the Accumulator decides when to reduce);
``sync_with_dataloader=False`` is refused (each epoch's last window closes at
the loader's end), and so is changing ``gradient_accumulation_steps`` after
``prepare()`` built the Accumulator. ``no_sync()`` and
``trigger_sync_in_backward()`` (accumulating by hand) raise: use
``gradient_accumulation_steps`` and ``accumulate()``. With fp16, ``unscale_gradients()`` raises:
the Accumulator unscales inside its step, and ``clip_grad_norm_()`` clips the
unscaled window gradient.
Not covered by the tests: iterable datasets and ``dispatch_batches=True``
(Accelerate pads those shards itself), fp16 on CUDA.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch

try:
    import accelerate as _accelerate
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError as error:  # pragma: no cover - exercised without accelerate
    raise ImportError(
        f"gradaccum: gradaccum.accelerate needs Hugging Face Accelerate, which is not importable here ({error}). "
        'Install it with: pip install "accelerate>=1.0" (pin torch, pip install -c <file with torch==your version>, '
        "so that pip keeps your torch)"
    ) from error

from gradaccum._accelerate_parts import (
    _AccumulatorCheckpoint,
    _every_rank_ends_on_a_boundary,
    _GradaccumOptimizer,
    _GradaccumScheduler,
    _SchedulerDriver,
    _watch_loader,
)
from gradaccum._accumulator import _NONFINITE, _REDUCTIONS, Accumulator
from gradaccum._refusal import _any_rank_has, _refuse_before_building
from gradaccum._adapter_options import _adapter_options, _with_ddp_kwargs
from gradaccum._hf import keep_float64_causal_lm_loss

__all__ = ["Accelerator"]

_SUPPORTED = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA", "MULTI_MUSA",
              "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON"}


_MANUAL_SYNC = (
    "gradaccum: {call}: the Accumulator decides by itself which micro-step synchronises (the last of each window "
    "of gradient_accumulation_steps), so accumulating by hand with no_sync() is not supported. Set "
    "Accelerator(gradient_accumulation_steps=K), run each micro-batch inside accelerator.accumulate(model), and "
    "do not divide the loss by K (the window's gradient is the mean over its micro-batches)")


def _launched_without_accelerator() -> bool:
    """Several processes launched (WORLD_SIZE > 1) where torch sees no GPU."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and not torch.cuda.is_available() and not (
        hasattr(torch, "xpu") and torch.xpu.is_available())


class Accelerator(_accelerate.Accelerator):
    """``accelerate.Accelerator`` whose gradient accumulation and data-parallel
    reduction are a :class:`gradaccum.Accumulator` (see the module's docstring).

    Args:
        reduction: ``"mean"`` (the mean of the micro-batch losses), ``"sum"``,
            or ``"items"`` (``backward(loss_sum, num_items=n)``: the exact
            per-item mean over the window and every rank).
        nonfinite: a NaN/inf window gradient is ``"skip"``-ped on every rank (no
            optimizer or scheduler step), ``"raise"``-d or ``"ignore"``-d.
        accumulator_options: more ``gradaccum.Accumulator`` keyword arguments
            (``bucket_cap_mb``, ``max_grad_norm``, ``accumulate_dtype``, ...).
        Everything else: as for ``accelerate.Accelerator``;
        ``gradient_accumulation_steps`` is the window's K.
    """

    def __init__(self, *args: Any, reduction: str = "mean", nonfinite: str = "skip",
                 accumulator_options: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"gradaccum: Accelerator(): invalid reduction: {reduction!r} (expected one of {_REDUCTIONS})")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"gradaccum: Accelerator(): invalid nonfinite: {nonfinite!r} (expected one of {_NONFINITE})")
        options = _adapter_options(
            "Accelerator()", accumulator_options, ("steps", "reduction", "nonfinite", "scheduler", "grad_scaler"))
        # Before Accelerate starts. Without a plugin given, Accelerate builds
        # its own from gradient_accumulation_steps, which syncs with the loader.
        plugin = kwargs.get("gradient_accumulation_plugin")
        if plugin is not None and not getattr(plugin, "sync_with_dataloader", True):
            raise ValueError(
                "gradaccum: Accelerator(): GradientAccumulationPlugin(sync_with_dataloader=False) is not supported: "
                "the adapter closes each epoch's last window at the end of the training loader (acc.flush(), a "
                "collective every rank reaches, so that uneven shards stay paired); leave sync_with_dataloader=True")
        if "cpu" not in kwargs and _launched_without_accelerator():
            # `accelerate launch --multi_gpu --num_processes N` on a machine
            # without GPUs starts N processes that stock Accelerate leaves
            # each alone (DistributedType.NO): Gloo on CPU, as they meant.
            kwargs["cpu"] = True
        super().__init__(*args, **kwargs)
        kind = getattr(self.distributed_type, "value", str(self.distributed_type))
        if kind not in _SUPPORTED or (self.parallelism_config is not None and (
                self.parallelism_config.tp_enabled or self.parallelism_config.cp_enabled)):
            raise ValueError(
                f"gradaccum: Accelerator(): distributed type {kind} is not supported: gradaccum replaces DDP's "
                "gradient reduction and works with plain data parallelism (one process per device) or one process; "
                "use accelerate.Accelerator for DeepSpeed, FSDP, Megatron-LM, XLA or tensor parallelism")
        self.reduction = reduction
        self.nonfinite = nonfinite
        self._accumulator_options = _with_ddp_kwargs(self.ddp_handler, options)
        self.accumulator: Optional[Accumulator] = None
        self._pending_state: Optional[Dict[str, Any]] = None
        self._deferred_clips: List[Any] = []
        self._micro_step_clips: List[Any] = []
        self._warned_mid_window_clip = False
        self._warned_late_train = False
        self._warned_unordered = False
        self._warned_nested = False
        # The training loader whose iteration runs (its own end_of_dataloader
        # tells its last batch: GradientState's can be a loader left unfinished).
        self._training_loader: Optional[weakref.ref] = None

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        # The window size is the Accumulator's once prepare() built it (as
        # GradaccumStrategy refuses a changed accumulate_grad_batches).
        acc = getattr(self, "accumulator", None)
        if acc is not None and not acc.closed and steps != acc.steps:
            raise ValueError(
                f"gradaccum: accelerator.gradient_accumulation_steps = {steps!r}: the window size is fixed at "
                f"{acc.steps} once accelerator.prepare() has built the Accumulator; set it before prepare()")
        self.gradient_state.plugin_kwargs.update({"num_steps": steps})

    # ------------------------------------------------------------------ prepare

    def prepare_model(self, model: torch.nn.Module, device_placement: Optional[bool] = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        # Device placement, autocast and torch.compile as Accelerate does, never
        # the DDP wrapper: the Accumulator reduces instead.
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("gradaccum: Accelerator.prepare(): the model is DDP-wrapped; pass the plain module "
                             "(gradaccum reduces the gradients itself)")
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        keep_float64_causal_lm_loss(self.unwrap_model(prepared))
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: Optional[bool] = None) -> Any:
        if getattr(optimizer, "_is_accelerate_prepared", False):
            if optimizer not in self._optimizers:
                self._optimizers.append(optimizer)
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        prepared = _GradaccumOptimizer(optimizer, self, device_placement=device_placement)
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> Any:
        if getattr(scheduler, "_is_accelerate_prepared", False):
            if scheduler not in self._schedulers:
                self._schedulers.append(scheduler)
            return scheduler
        optimizer: Any = self._optimizers
        for opt in self._optimizers:
            if getattr(scheduler, "optimizer", None) is opt.optimizer:
                optimizer = opt
                break
        prepared = _GradaccumScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                       split_batches=self.split_batches)
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: Any, device_placement: Optional[bool] = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        already = getattr(data_loader, "_is_accelerate_prepared", False)
        prepared = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        if not already:
            _watch_loader(self, prepared)
        return prepared

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        skipped = super().skip_first_batches(dataloader, num_batches=num_batches)
        if skipped is not dataloader:
            _watch_loader(self, skipped)
        return skipped

    def prepare(self, *args: Any, device_placement: Optional[List[bool]] = None) -> Any:
        before = (len(self._models), len(self._optimizers))
        result = super().prepare(*args, device_placement=device_placement)
        added = (len(self._models), len(self._optimizers)) != before
        if self.accumulator is None and added and self._any_rank_trains():
            self._ensure_accumulator("Accelerator.prepare()")
        return result

    def _any_rank_trains(self) -> bool:
        """Whether some rank has a trained model and an optimizer prepared
        (one small all-reduce, data parallel, in a prepare() that added a
        model or an optimizer). Those ranks build the Accumulator now; a rank
        without them then refuses through their construction (Note
        [Construction refused on one rank]), not later and alone. Where no
        rank has them yet, a later prepare() or the first accumulate() builds
        it, as in one process."""
        ready = bool(self._trained_models()) and bool(self._optimizers)
        return _any_rank_has(ready, self._accumulator_options.get("process_group"), self.device)

    def _trained_models(self) -> List[torch.nn.Module]:
        return [m for m in self._models if any(p.requires_grad for p in m.parameters())]

    def _ensure_accumulator(self, what: str) -> Accumulator:
        if self.accumulator is not None:
            return self.accumulator
        models, optimizers = self._trained_models(), self._optimizers
        if len(models) != 1 or len(optimizers) != 1:
            error = ValueError(
                f"gradaccum: {what}: the Accumulator needs exactly one prepared model with trainable parameters and "
                f"one prepared optimizer; prepared so far: {len(models)} trained model(s), {len(optimizers)} "
                "optimizer(s). Pass the model and its optimizer to accelerator.prepare()")
            _refuse_before_building(self._accumulator_options.get("process_group"), error,
                                    (models or self._models or [None])[0])
            raise error
        optimizer = optimizers[0]
        inner = optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
        scaler = self.scaler if (self.scaler is not None and getattr(self.scaler, "is_enabled", lambda: True)()) else None
        self.accumulator = Accumulator(models[0], inner, steps=self.gradient_accumulation_steps,
                                       reduction=self.reduction, nonfinite=self.nonfinite, grad_scaler=scaler,
                                       scheduler=_SchedulerDriver(self),
                                       **self._accumulator_options)
        # Once: free_memory() and a new prepare() build another Accumulator, but
        # Accelerate keeps its custom objects (a second would change the count
        # load_state() expects). The one registered reads the current one.
        if not any(isinstance(obj, _AccumulatorCheckpoint) for obj in self._custom_objects):
            self.register_for_checkpointing(_AccumulatorCheckpoint(self))
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.accumulator.load_state_dict(state)
        return self.accumulator

    # ------------------------------------------------------------ data loaders

    def _training_mode(self) -> bool:
        """Whether a loader iteration beginning now trains: gradients on and
        the model in training mode. An evaluation loop under no_grad() (or
        inference_mode()) that forgot model.eval() is evaluation: its loader
        keeps even_batches, so every rank runs its loop alike."""
        if not torch.is_grad_enabled():
            return False
        models = self._trained_models()
        return all(m.training for m in models) if models else True

    def _train_late(self) -> None:
        """A backward in a loader iteration that began as evaluation (the
        model in eval mode, e.g. from from_pretrained(), with model.train()
        inside the loop): that iteration trains after all, and its epoch's
        partial window closes at its end, on every rank (the loader was
        sharded with even_batches, so every rank runs as many batches: its
        samples are Accelerate's, copies included)."""
        if self._current_training_loader() is not None:
            return  # a training iteration runs: the backward is its (another loader may be left unfinished)
        loader = self.gradient_state.active_dataloader
        if loader is None or not getattr(loader, "_gradaccum_watched", False) or loader._gradaccum_train:
            return
        loader._gradaccum_train = True
        loader._gradaccum_start = None  # the ranks' batch counts are not the sampler's: always flush
        self._training_loader = weakref.ref(loader)
        if not self._warned_late_train:
            self._warned_late_train = True
            warnings.warn(
                "gradaccum: accelerator.backward(): this training loader's iteration began with the model in eval "
                "mode or gradients off, so it was sharded as an evaluation loader (with even_batches: samples "
                "repeated to give every rank as many batches, as stock Accelerate does); its partial window still "
                "closes at its end. Call model.train() before iterating the training loader to shard it without "
                "copies", stacklevel=3)

    def _in_order(self, loader: Any, shard: Any) -> bool:
        """Whether `loader` delivers its batches in the sampler's order, which
        padding needs (Note [A padding batch, not copies]); warns once if not."""
        if getattr(loader, "in_order", True) or not getattr(loader, "num_workers", 0):
            return True
        if shard.even_batches and not self._warned_unordered:
            self._warned_unordered = True
            warnings.warn(
                "gradaccum: a training loader with DataLoader(in_order=False) and worker processes delivers batches "
                "out of order, so a shorter shard's padding batch could not be told from the others: its shards are "
                "not padded, and ranks may run one batch apart. Count optimizer steps "
                "(accelerator.accumulator.stats()['optimizer_steps']), not sync_gradients iterations, or pass "
                "in_order=True", stacklevel=4)
        return False

    def _warn_nested_training(self) -> None:
        if not self._warned_nested:
            self._warned_nested = True
            warnings.warn(
                "gradaccum: a loader's iteration began with gradients on and the model in training mode while "
                "another training loader's iteration had not ended (a break out of it, or a side batch drawn "
                "with next(iter(loader)) inside the training loop): the new one is taken as the training "
                "iteration, whose last batch closes the epoch's window. Draw side batches under torch.no_grad() "
                "or with the model in eval mode", stacklevel=4)

    def _current_training_loader(self) -> Any:
        """The loader whose training iteration runs, or None. Tracked here:
        GradientState's active loader can be another one left unfinished (a
        break out of an evaluation, a next(iter(loader)))."""
        loader = None if self._training_loader is None else self._training_loader()
        return loader if loader is not None and getattr(loader, "_gradaccum_train", False) else None

    def _training_loader_at_end(self) -> Any:
        """The training loader whose last batch this is (its window closes with
        it), or None: read from that loader itself."""
        loader = self._current_training_loader()
        if (loader is not None and self.gradient_state.sync_with_dataloader
                and not getattr(loader, "_gradaccum_flushed", True) and getattr(loader, "end_of_dataloader", False)):
            return loader
        return None

    def _end_epoch(self, loader: Any) -> int:
        """Closes this rank's epoch on `loader`: steps a closed window, then
        flushes the partial one (a collective every rank reaches), unless every
        rank's shard is known to end on a window boundary (no partial window
        anywhere: no collective). Returns the optimizer steps taken (0 to 2)."""
        acc = self.accumulator
        assert acc is not None
        try:
            steps = int(bool(acc.step())) if acc.window_ready else 0
            if not _every_rank_ends_on_a_boundary(loader, self.gradient_accumulation_steps):
                if not self._deferred_clips and self._micro_step_clips:
                    # This rank's last batch closed a full window (clipped by
                    # the script); the flush closes the other ranks' partial
                    # one: clipped alike, as on the ranks that clip it there.
                    for apply, parameters in self._micro_step_clips:
                        self._defer_clip(apply, parameters)
                steps += int(bool(acc.flush()))
        finally:
            self._after_window()
        return steps

    def _padding_batch(self) -> bool:
        """Whether this micro-batch is this rank's padding batch (Note [A
        padding batch, not copies] in _accelerate_parts.py): the last of a
        training iteration that the shard padded."""
        loader = self._training_loader_at_end()
        shard = None if loader is None else getattr(loader, "_gradaccum_shard", None)
        return shard is not None and getattr(shard, "_gradaccum_padded", False)

    # ----------------------------------------------------------- accumulation

    def _closing(self, acc: Accumulator) -> bool:
        """Whether the current micro-step closes its window (Accelerate's
        sync_gradients): valid before and after its backward."""
        return bool(acc.window_ready or acc.micro_step + 1 == acc.steps
                    or self._training_loader_at_end() is not None)

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        acc = self._ensure_accumulator("accelerator.accumulate()")
        self.gradient_state._set_sync_gradients(self._closing(acc))
        yield

    def no_sync(self, model: Any = None) -> Any:
        """Refused: with stock Accelerate, DDP's ``no_sync`` lets a loop
        accumulate by hand; here the Accumulator decides which micro-step
        synchronises, and a window of 1 would close at every backward."""
        raise RuntimeError(_MANUAL_SYNC.format(call="accelerator.no_sync()"))

    @staticmethod
    def trigger_sync_in_backward(model: Any = None) -> Any:
        """Refused, as no_sync() is."""
        raise RuntimeError(_MANUAL_SYNC.format(call="accelerator.trigger_sync_in_backward()"))

    def backward(self, loss: torch.Tensor, num_items: Any = None, **kwargs: Any) -> None:
        metrics = kwargs.pop("metrics", None)
        unsupported = {k: v for k, v in kwargs.items() if v is not None}
        if unsupported:
            raise TypeError(f"gradaccum: accelerator.backward(): keyword argument(s) {sorted(unsupported)} are not "
                            "supported (the Accumulator runs the backward); pass num_items= and metrics= only")
        acc = self._ensure_accumulator("accelerator.backward()")
        self._train_late()
        self._micro_step_clips = []
        self.gradient_state._set_sync_gradients(self._closing(acc))
        if self._padding_batch():
            acc.empty_micro_step()  # a copy that counts nothing: Note [A padding batch, not copies]
        else:
            acc.backward(loss, num_items=num_items, metrics=metrics)

    @property
    def window_loss(self) -> Optional[torch.Tensor]:
        """The last closed window's loss over every micro-batch of every rank
        (``acc.window_loss``); None before the first window closes."""
        return None if self.accumulator is None else self.accumulator.window_loss

    # ---------------------------------------------------------------- clipping

    def _scaling(self) -> bool:
        acc = self.accumulator
        return acc is not None and acc.grad_scaler is not None and acc.grad_scaler.is_enabled()

    def _clip(self, what: str, apply: Any, parameters: List[Any]) -> Optional[torch.Tensor]:
        acc = self._ensure_accumulator(what)
        if acc.window_ready and not self._scaling():
            # Also for the window a flush may close after this one in the
            # same micro-step (_end_epoch).
            self._micro_step_clips.append((apply, parameters))
            return apply()
        if not self._closing(acc):
            if not self._warned_mid_window_clip:
                self._warned_mid_window_clip = True
                warnings.warn(f"gradaccum: {what} on a micro-step that closes no window does nothing (the gradients "
                              "are this rank's partial sums); call it when accelerator.sync_gradients is True",
                              stacklevel=3)
            return None
        # The window's gradient exists only inside optimizer.step() (a flushed
        # partial window, or unscaled there): clip it there, before the step.
        return self._defer_clip(apply, parameters)

    def _defer_clip(self, apply: Any, parameters: List[Any]) -> torch.Tensor:
        acc = self.accumulator
        assert acc is not None
        first = next((p for p in parameters if isinstance(p, torch.Tensor)), None)
        like = first if first is not None and first.is_floating_point() else torch.empty((), dtype=torch.float32)
        result = torch.full((), math.nan, dtype=like.dtype, device=like.device)
        self._deferred_clips.append((apply, result))
        acc._set_gradient_hook(self._run_deferred_clips)
        return result

    def _run_deferred_clips(self) -> None:
        clips, self._deferred_clips = self._deferred_clips, []
        for apply, result in clips:
            norm = apply()
            if norm is not None:
                result.copy_(norm.detach().to(result.device, result.dtype))

    def _after_window(self) -> None:
        if self._deferred_clips or (self.accumulator is not None and self.accumulator._gradient_hook is not None):
            self._deferred_clips = []
            if self.accumulator is not None and not self.accumulator.closed:
                self.accumulator._set_gradient_hook(None)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Optional[torch.Tensor]:
        parameters = list(parameters)
        return self._clip("accelerator.clip_grad_norm_()", lambda: torch.nn.utils.clip_grad_norm_(
            parameters, max_norm, norm_type=norm_type), parameters)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        parameters = list(parameters)
        self._clip("accelerator.clip_grad_value_()",
                   lambda: torch.nn.utils.clip_grad_value_(parameters, clip_value), parameters)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        if self.accumulator is None:
            super().unscale_gradients(optimizer)
        elif self.accumulator.grad_scaler is not None:
            # GradScaler unscales once per optimizer step, and the Accumulator
            # does it inside its step: gradients read here are still scaled.
            raise RuntimeError(
                "gradaccum: accelerator.unscale_gradients(): with fp16 the Accumulator unscales the window's "
                "gradient once, inside its step, so the gradients here are still scaled (and GradScaler allows one "
                "unscale per step). Clip with accelerator.clip_grad_norm_() or clip_grad_value_(): they are applied "
                "to the unscaled window gradient")
        # Without a scaler there is nothing to unscale, as in stock Accelerate.

    def free_memory(self, *objects: Any) -> Any:
        if self.accumulator is not None:
            self.accumulator.close()
            self.accumulator = None
        return super().free_memory(*objects)
