"""gradaccum.Accumulator: the Python face of the C++ Accumulator."""
import contextlib
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple, Union

import torch

from gradaccum import _C, _checks, _run, _scaler_window
from gradaccum._lifetime import _LIVE, _Held, SchedulerStep, _optimizer_parameters, _optimizer_step, close as _close
from gradaccum._checkpoint import load_state, save_state
from gradaccum._refusal import _refuse_construction
from gradaccum import trace as _trace

# (_NONFINITE, _REDUCTIONS: one list, the adapters read it here)
from gradaccum._checks import (  # noqa: F401
    _NONFINITE, _REDUCTIONS, _check_layout_options, _check_options, _check_scaled_parameters, _default_world_size,
    _as_float, _dist_initialized, _metric_values, _note_counted_failure, _num_items_float, _parameters,
    _resolve_group, _scaler_rule, _scaling,
)


class Optimizer(Protocol):
    """What the Accumulator needs of an optimizer: ``step()``. A
    ``torch.optim.Optimizer`` is one; so is any object with ``step()`` (a
    ZeRO wrapper, a custom optimizer). ``grad_scaler`` needs ``param_groups``
    too, as GradScaler does."""

    def step(self) -> Any: ...



class Accumulator(_Held):
    """Gradient accumulation over windows of ``steps`` micro-batches.

    Args:
        model: a ``torch.nn.Module`` or an iterable of parameters.
        optimizer: any ``torch.optim.Optimizer`` (or object with ``step()``);
            ``None`` makes ``step()``/``flush()`` errors, while ``backward()``
            still leaves each window's gradient in ``.grad``.
        steps: micro-batches per window (K); the optimizer steps once per window.
        reduction: what the window's gradient is the gradient of: ``"mean"`` of
            the micro-batch losses, their ``"sum"``, or ``"items"``: the summed
            losses over the summed ``num_items`` (exact per-item mean).
        max_grad_norm: clip the window's gradient to this total 2-norm (> 0), once.
        nonfinite: at the boundary, a NaN/inf gradient is ``"skip"``-ped (no
            step, gradients cleared, counted), ``"raise"``-d, or ``"ignore"``-d.
        scheduler: an LR scheduler stepped only after a real optimizer step.
        process_group: data-parallel group; ``None`` (the default) means the
            default group when ``torch.distributed`` is initialized, ``False``
            means local-only accumulation (no reduction) even then. Gradients are then all-reduced
            once per window, in buckets overlapped with backward.
        bucket_cap_mb / first_bucket_cap_mb: bucket sizes in MiB (as torch
            DDP). ``bucket_cap_mb=None`` (the default): DDP's fixed 25 MiB
            when every rank runs on one host (``LOCAL_WORLD_SIZE`` equals
            ``WORLD_SIZE``, as torchrun sets them); across hosts, a sixteenth
            of the trainable parameters' bytes, between 1 and 25 MiB, so a
            mid-sized model's all-reduce overlaps backward on the slow link.
        gradient_as_bucket_view: ``.grad`` tensors are views of the buckets.
        broadcast_buffers: broadcast rank 0's buffers at each window's end (the
            default; DDP does before every forward: docs/design.md, Options).
        check_parameters: at construction, check all ranks have the same
            parameters and options (and, with ``bucket_cap_mb=None``, the same
            one-host launch; a collective) and fail naming the first mismatch.
        rebuild_buckets: after the first window, rebuild the buckets once in
            the order its backward made the gradients ready (rank 0's, on every
            rank), as torch DDP does, so buckets launch during backward even
            when the registration order is not backward's.
        accumulate_dtype: ``torch.float32`` sums bf16/fp16 gradients in float32
            (in the buckets, or in buffers of their own in one process): the
            window's gradient is rounded once, into ``.grad``.
        comm_dtype: the dtype gradients travel in between ranks
            (``torch.bfloat16``, ``torch.float16``, ``torch.float32``),
            independent of the one they are summed in. Each rank scales its
            gradients by 1 / (the expected global weight) before rounding, so
            fp16 sums do not overflow.
        error_feedback: with ``comm_dtype``, keep what rounding lost of each
            rank's window and add it to the next window (one more copy of the
            gradients). Saved in per-rank states (``state_dict(rank_independent=False)``).
        grad_scaler: a ``torch.amp.GradScaler``: ``backward()`` scales the
            loss, the window's end unscales, skips overflowing windows and
            updates the scale once per window. The optimizer must hold every
            trainable parameter (GradScaler unscales only its gradients) and
            none may be float16 (float32 parameters under ``torch.autocast``);
            a disabled one (``enabled=False``) works as no grad_scaler.
        metrics: names of small per-window user metrics (at most 8), e.g.
            ``("correct", "tokens")``: ``backward(loss, metrics={...})`` adds
            each micro-batch's values, and ``window_metrics`` gives each
            window's sums over its micro-batches and every rank, riding in the
            gradient all-reduce's header (no extra collective). Every rank
            builds with the same names.
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, Iterable[torch.Tensor]],
        optimizer: Optional[Optimizer] = None,
        steps: int = 1,
        reduction: str = "mean",
        max_grad_norm: Optional[float] = None,
        nonfinite: str = "skip",
        *,
        scheduler: Optional[Any] = None,
        process_group: Union[None, bool, Any] = None,
        bucket_cap_mb: Optional[float] = None,
        first_bucket_cap_mb: float = 1.0,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        check_parameters: bool = True,
        rebuild_buckets: bool = True,
        accumulate_dtype: Optional[torch.dtype] = None,
        grad_scaler: Optional[Any] = None,
        comm_dtype: Optional[torch.dtype] = None,
        error_feedback: bool = False,
        metrics: Union[List[str], Tuple[str, ...]] = (),
    ) -> None:
        metrics = tuple(metrics) if isinstance(metrics, (list, tuple)) else metrics
        # A default group that appears after construction: backward() raises.
        self._watch_for_group = process_group is None and not _dist_initialized()
        # (raised here alone: which group the other ranks build over is not
        # known here, and a guess that runs a collective they never join
        # would hang this rank and break that group)
        process_group, local_only = _resolve_group(process_group)
        params: Optional[List[torch.Tensor]] = None
        try:
            _check_options(steps, reduction, nonfinite, max_grad_norm, optimizer, scheduler,
                           accumulate_dtype, comm_dtype, error_feedback, grad_scaler, metrics)
            _check_layout_options(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb,
                                  gradient_as_bucket_view=gradient_as_bucket_view,
                                  broadcast_buffers=broadcast_buffers, check_parameters=check_parameters,
                                  rebuild_buckets=rebuild_buckets)
            params, names, buffers = _parameters(model)
            if _scaling(grad_scaler):  # before the C++ side claims the parameters
                _check_scaled_parameters(params, names, isinstance(model, torch.nn.Module), optimizer)
            # Converted here, where a failure is still told to the other ranks.
            native = dict(
                steps=int(steps), reduction=reduction, max_grad_norm=_as_float("max_grad_norm", max_grad_norm),
                nonfinite=nonfinite, bucket_cap_mb=_as_float("bucket_cap_mb", bucket_cap_mb),
                first_bucket_cap_mb=_as_float("first_bucket_cap_mb", first_bucket_cap_mb),
                gradient_as_bucket_view=bool(gradient_as_bucket_view),
                broadcast_buffers=bool(broadcast_buffers), check_parameters=bool(check_parameters),
                rebuild_buckets=bool(rebuild_buckets), accumulate_dtype=accumulate_dtype, comm_dtype=comm_dtype,
                error_feedback=error_feedback, metrics=list(metrics), grad_scaler=_scaler_rule(grad_scaler))
        except Exception as error:  # (the user's objects may raise anything)
            if process_group is not None:
                _refuse_construction(process_group, error, params if params is not None else model)
            raise
        self._optimizer: Any = optimizer  # an Optimizer; grad_scaler reads its param_groups too
        self._scheduler = scheduler
        # refresh_parameters() takes a module's trainable set again.
        self._module = model if isinstance(model, torch.nn.Module) else None
        self._process_group = process_group
        self._pre_step_hook: Optional[Callable[[], None]] = None
        self._scheduler_step = SchedulerStep(scheduler) if scheduler is not None else None
        self._c = _C.Accumulator(
            params, names, buffers, process_group=process_group, local_only=local_only, **native,
            # Looked up at each call: an LR scheduler created later wraps optimizer.step.
            optimizer_step=_optimizer_step(self, optimizer) if optimizer is not None else None,
            scheduler_step=self._scheduler_step,
            optimizer_parameters=_optimizer_parameters(optimizer),
        )
        _LIVE.add(self)
        self._steps = int(steps)
        self._reduction = reduction
        self._metrics = tuple(metrics)
        self._no_sync_depth = 0
        self._run_state = _run.RunState()
        self._grad_scaler = grad_scaler
        self._error_feedback = error_feedback
        self._gradient_hook: Optional[Callable[[], None]] = None
        if _scaling(grad_scaler):
            self._c.set_window_callbacks(self._weakly("_unscale_and_check"), self._weakly("_update_scaler"))

    def _weakly(self, method: str) -> Callable[[], bool]:
        """A callback for the C++ side holding this object weakly (a bound method there, invisible
        to Python's garbage collector, would keep this Accumulator and its group alive for good)."""
        ref = weakref.ref(self)

        def call() -> bool:
            target = ref()
            if target is None:  # pragma: no cover - the C++ object dies with it
                raise RuntimeError("gradaccum: a window callback: this Accumulator was garbage-collected")
            return bool(getattr(target, method)())

        return call

    def _set_gradient_hook(self, hook: Optional[Callable[[], None]]) -> None:
        """Calls ``hook()`` at each closed window (stepped or skipped), on its final gradient (reduced,
        divided, unscaled), before clipping, the non-finite check and the optimizer step: where
        Lightning's ``on_before_optimizer_step`` hooks see it (GradaccumStrategy sets it)."""
        self._gradient_hook = hook
        if _scaling(self.grad_scaler):
            return  # _unscale_and_check calls it
        if hook is None:
            self._c.set_window_callbacks(None, None)
        else:
            self._c.set_window_callbacks(self._weakly("_run_gradient_hook"), lambda: None)

    def _set_pre_step_hook(self, hook: Optional[Callable[[], None]]) -> None:
        """Calls ``hook()`` right before each real optimizer step, after
        clipping and the non-finite check (not for a window skipped): where the
        Hugging Face Trainer's ``on_pre_optimizer_step`` callbacks run."""
        self._pre_step_hook = hook

    def _run_gradient_hook(self) -> bool:
        if self._gradient_hook is not None:
            self._gradient_hook()
        return True

    _unscale_and_check = _scaler_window.unscale_and_check  # (functions of the Accumulator: its methods)
    _update_scaler = _scaler_window.update_scaler

    _check_micro_step = _checks.check_micro_step  # (functions of the Accumulator: its methods)
    _check_group = _checks.check_group

    def _micro_batch(self, what: str, loss: Any, num_items: Any) -> Tuple[torch.Tensor, Optional[float], Optional[torch.Tensor]]:
        """The checks backward() and run() share; returns the loss to run
        backward on, num_items as a float, and the loss window_loss reports."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"gradaccum: {what}: loss must be a torch.Tensor, got {type(loss).__name__}")
        self._check_micro_step(what)
        items = None if num_items is None else _num_items_float(what, num_items)
        reported = None
        if _scaling(self.grad_scaler):
            # Scaled, and divided by steps so that fp16 sees the big batch's
            # magnitudes; step() unscales and multiplies back. window_loss
            # reports the loss as given.
            reported, loss = loss, self.grad_scaler.scale(loss) / self.steps
        return loss, items, reported

    def backward(self, loss: torch.Tensor, num_items: Union[None, int, float, torch.Tensor] = None,
                 metrics: Optional[Dict[str, Any]] = None, **unexpected: Any) -> None:
        """Backward on one micro-batch's loss; the window's last call synchronises.

        With ``reduction="items"``, ``loss`` is summed over items and
        ``num_items`` (a number or a one-element tensor) counts them.
        ``metrics``: this micro-batch's values of the metrics named at
        construction (numbers or one-element tensors, kept on their device),
        summed into ``window_metrics``.
        """
        if (num_items is None and metrics is None and self.grad_scaler is None and not self._no_sync_depth and
                not unexpected and not (self._watch_for_group and _dist_initialized()) and isinstance(loss, torch.Tensor)):
            # The common case, with nothing for _micro_batch to check or
            # convert: the C++ side's defaults are what it would pass.
            args: Tuple[Any, ...] = (loss,)
        else:
            try:
                _checks.check_backward_arguments(unexpected)  # (refused as a bad loss is: review)
                loss, items, reported = self._micro_batch("acc.backward()", loss, num_items)
                args = (loss, items, reported, _metric_values("acc.backward()", self.metrics, metrics, loss))
            except BaseException as error:  # (a metric's or the scaler's torch error, an interrupt: review)
                # Data parallel, at the closing micro-step the others are reducing:
                # Note [A refused closing micro-batch] (src/accumulator/parts.cpp).
                dropped = self._c.refuse_micro_batch(interrupted=not isinstance(error, Exception))
                if not dropped or not isinstance(error, Exception):  # (an interrupt stays itself)
                    raise
                if isinstance(error, (TypeError, ValueError)):
                    raise type(error)(f"{error}; {dropped}") from None
                raise RuntimeError(f"gradaccum: acc.backward(): {type(error).__name__}: {error}; {dropped}") from error
        try:
            self._c.backward(*args)
        except BaseException as error:
            _note_counted_failure(self._c, error)
            raise

    def empty_micro_step(self) -> None:
        """Counts a micro-step in which this rank has no micro-batch: no
        backward, no weight, no loss. For shards that differ by one batch: the
        shorter ones call it for the missing batch (instead of training a
        copy), so that every rank runs as many micro-steps and closes its
        windows with the others. The window's last micro-step still
        synchronises; the window divides by what the other micro-steps and
        ranks hold (a window that holds nothing anywhere is skipped, on every
        rank alike). ``gradaccum.accelerate`` calls it for its padding batches.
        """
        self._check_micro_step("acc.empty_micro_step()")
        self._c.empty_micro_step()

    def _backward_part(self, loss: Any, num_items: Any, share: float, metrics: Any = None) -> None:
        """One part of a micro-step run in parts (run())."""
        loss, items, reported = self._micro_batch("acc.run()", loss, num_items)
        self._c.backward_part(loss, items, reported, share, _metric_values("acc.run()", self.metrics, metrics, loss))

    def run(self, fn: Callable[[Any], Any], batch: Any) -> Any:
        """One micro-step that survives running out of memory: ``fn(batch)``
        computes the micro-batch's loss (forward only; ``run`` runs the
        backward) and returns it: with ``reduction="mean"`` its mean over the
        batch's rows (torch losses' default), with ``"sum"`` its sum over them,
        with ``"items"`` ``(loss_sum, num_items)``, so that the parts of a
        split batch add up to it; or a dict ``{"loss": ..., "num_items": ...
        (items only), "metrics": {name: value}}`` to pass metrics as
        ``backward(metrics=)`` does (summed over the parts). Returns what
        ``fn`` returned for the whole micro-batch, detached (from its parts
        when it was split).

        On ``torch.OutOfMemoryError`` in ``fn`` or in the backward, before any
        gradient reached ``.grad``, the micro-batch is split in two along dim
        0 (``gradaccum.split``) and the halves run as parts of the same
        micro-step (accumulated locally; the window synchronises once, as
        always); later micro-batches are split to the size that fit, and
        after ``GROW_AFTER`` (100) micro-steps without running out of memory
        the parts grow back. No rank needs to agree with another: one rank may
        split while its peers do not. An out-of-memory that cannot be retried
        (a part of one row, or in a backward after some gradient reached
        ``.grad``, or in the window's synchronising backward) fails the
        micro-step: data parallel the window is dropped on every rank with
        one error (one process: as for any other error, below). Any
        other error from ``fn`` or the backward fails the micro-step too:
        data parallel it still takes its place, so every rank closes its
        windows together and drops this one (one process: the window goes on
        without it unless parts of it reached ``.grad``). After running out of
        memory, a window's closing micro-step runs whole (its all-reduce
        overlapped with its backward) only at a size that ran whole since;
        otherwise in parts, its all-reduce after the backward. With
        ``"skip_micro_batch"``, each part's loss is checked on its own: a
        non-finite part leaves out its rows, not the whole micro-batch, and
        counts in ``skipped_micro_batches``.
        ``stats()`` counts ``oom_retries`` and shows ``run_max_rows``."""
        return _run.run(self, fn, batch)

    @property
    def window_loss(self) -> Optional[torch.Tensor]:
        """The last closed window's loss over every micro-batch of every rank,
        weighted as its gradient: the mean of the micro-batch losses
        (``"mean"``), total loss / total items (``"items"``), their sum
        (``"sum"``). A 0-dim float64 tensor on the loss's device: reading it
        forces no synchronisation (``float(acc.window_loss)`` does), and data
        parallel it costs no extra collective (it rides in the bucket
        header). Set by the window's closing ``backward()`` (or ``flush()``,
        ``join()``) until the next window closes, so it can be read before or
        after ``step()``; ``None`` before the first window closes, where
        every bucket's wire is bf16/fp16 (``comm_dtype``, or only bf16/fp16
        parameters without ``accumulate_dtype``) and carries its header (up
        to 256 ranks for bf16, 2048 for fp16), for a window with no
        weight, for a window a mid-window checkpoint of an older version cut
        (its state holds no loss sums), for a window dropped on every rank (an error
        every rank raised; ``window_items`` is then 0), not the loss of the
        window before it, and after ``load_state_dict()`` or
        ``refresh_parameters()`` until a window closes. A copy: changing it
        changes nothing here."""
        return self._c.window_loss

    @property
    def window_metrics(self) -> Optional[Dict[str, torch.Tensor]]:
        """The window ``window_loss`` describes: each metric named at
        construction summed over its micro-batches and every rank, not
        divided (``{"correct": 0-dim float64 tensor}``; divide by
        ``window_items`` or by a count metric yourself); a window with no
        weight has them too. A micro-batch ``nonfinite="skip_micro_batch"``
        left out is left out whole, its metrics with it (``stats()
        ["skipped_micro_batches"]`` counts them). No synchronisation, no
        extra collective. ``None`` without metric names, and wherever
        ``window_loss`` is ``None`` but for a window with no weight."""
        sums = self._c.window_metrics
        if sums is None:
            return None
        return {name: sums[i] for i, name in enumerate(self.metrics)}

    @property
    def window_items(self) -> float:
        """The weight of the window ``window_loss`` describes, summed over
        ranks: its items (``"items"``) or micro-batches (``"mean"``, ``"sum"``);
        0 before the first window closes, for a window dropped on every rank,
        and after ``load_state_dict()`` or ``refresh_parameters()`` until a
        window closes."""
        return self._c.window_items

    def step(self) -> bool:
        """At a closed window: clip, check, step the optimizer (and scheduler),
        clear the gradients. Returns whether the optimizer stepped."""
        if self._watch_for_group:
            self._check_group("acc.step()")
        return self._c.step()

    def flush(self) -> bool:
        """Closes a partial window (end of data) and steps. Collective when data
        parallel: every rank calls it."""
        if self._watch_for_group:
            self._check_group("acc.flush()")
        return self._c.flush()

    @contextlib.contextmanager
    def join(self) -> Iterator[None]:
        """Ranks with different amounts of data (as torch DDP's ``join()``)::

            with acc.join():
                for batch in loader:   # any number of batches on each rank
                    acc.backward(loss_of(batch))
                    acc.step()

        Leaving the block, this rank closes its partial window and then takes
        part in the other ranks' windows with nothing of its own, stepping the
        optimizer with each window's gradient as they do, until every rank has
        left its block; every rank leaves at the same reduction, so a failure
        on any rank reaches all of them. The result is the exact mean of the
        data that exists. Ranks with data pay no extra collective, except, with
        buffers and ``broadcast_buffers``, one small all-reduce in a window
        where some ranks have joined (which rank ran micro-batches: the
        buffers are broadcast from the lowest of them). Data parallel, every
        rank ends its data this way (not with ``flush()``: a mix is an error on
        every rank); no ``flush()`` is needed. An exception leaves the block at once; data
        parallel, the other ranks raise an error naming this rank in their next
        reduction (shadows too) instead of waiting for it, and are told to end
        training there."""
        if self.closed:
            raise RuntimeError("gradaccum: acc.join(): this Accumulator was closed")
        if self._watch_for_group:
            self._check_group("acc.join()")
        try:
            yield
        except GeneratorExit:  # closed unfinished (garbage collected): no exception of the script's
            raise
        except BaseException:
            self._c.abandon()  # Note [Leaving join() with an exception]
            raise
        if self._watch_for_group:  # (a group made inside the block: review)
            self._check_group("acc.join()")
        self._c.join()

    def refresh_parameters(self, parameters: Optional[Any] = None) -> None:
        """Takes the trainable parameters again after ``requires_grad``
        changed (fine-tuning unfreezes a backbone), at a window boundary (after
        ``step()`` returned True, or after ``flush()``) and before the next
        forward: data parallel it broadcasts rank 0's values of the new set in
        place, as the constructor does. ``parameters``: the
        module or parameters to train from now on (default: the module the
        Accumulator was built from). Data parallel, a collective: every rank
        calls it at the same point with the same set (checked: a rank that
        refuses it, or reduces its next window instead, makes every rank
        raise, and nothing is refreshed). It all-reduces zeros through the
        buckets once, then broadcasts rank 0's values of the new set. Counters
        carry over (bucket_rebuilds restarts); residuals start at zero."""
        source = parameters if parameters is not None else self._module
        if source is None:
            raise ValueError("gradaccum: acc.refresh_parameters(): this Accumulator was built from an iterable of "
                             "parameters, not a module; pass the ones to train: acc.refresh_parameters(params)")
        what = "acc.refresh_parameters()"
        try:
            params, names, buffers = _parameters(source, what, "parameters", within=self._module)
            if _scaling(self.grad_scaler):
                _check_scaled_parameters(params, names, isinstance(source, torch.nn.Module), self.optimizer, what)
        except BaseException as e:  # (anything: the user's objects, an interrupt) the other ranks still meet
            # this call and raise too (Note [A refresh refused on one rank])
            ours = isinstance(e, (ValueError, TypeError)) and str(e)
            self._c.refresh_parameters([], [], [], refused=str(e) if ours else f"{type(e).__name__}: {e}")
            raise
        self._c.refresh_parameters(params, names, buffers)

    def zero_grad(self) -> None:
        """Drops what the current window accumulated on this rank. In one
        process the position goes too (the next micro-step opens a new
        window); data parallel it stays, so the window still closes with every
        rank at its last micro-step, holding what every rank kept: after a
        micro-step failed on one rank, its script may drop that rank's part
        and go on, and no rank's window is dropped (except a window resumed
        in its middle from a rank-independent state, whose gradients hold a
        share of every rank's sums: it is dropped on every rank when it
        closes)."""
        self._c.zero_grad()

    @property
    def sync_gradients(self) -> bool:
        """As Accelerate's: whether the *next* backward synchronises (True
        from before the closing one until ``step()``, so after the one before
        it too). After a backward, clip or log the reduced gradients under
        ``if acc.window_ready:``; changing ``.grad`` before drops the window."""
        return self._c.sync_gradients

    @property
    def micro_step(self) -> int:
        """Position in the current window, ``0..steps-1``."""
        return self._c.micro_step

    @property
    def window_ready(self) -> bool:
        """True between a window's last ``backward()`` and ``step()``."""
        return self._c.window_ready

    @property
    def epoch_ended(self) -> bool:
        """True where the other ranks ended the epoch with ``flush()`` in the reduction that closed this
        rank's last window (this rank's shard ended on a window boundary, theirs did not): this rank's
        ``flush()`` is owed, a no-op with no collective, before ``state_dict()`` or the next epoch."""
        return self._c.epoch_ended

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally with no collective (torch
        DDP's ``no_sync``); only the backward needs to be inside."""
        self._check_group("acc.no_sync()")
        previous = self._c.expect_hooks
        self._c.expect_hooks = False
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            if not self._c.closed:  # (closed inside: nothing to restore)
                self._c.expect_hooks = previous

    def stats(self) -> Dict[str, Any]:
        """Counters and figures of the windows and the reducer: docs/stats.md."""
        stats = self._c.stats()
        stats["oom_retries"], stats["run_max_rows"] = self._run_state.oom_retries, self._run_state.max_rows
        if _scaling(self.grad_scaler):  # (a host read, as window_loss)
            stats["loss_scale"] = self.grad_scaler.get_scale()
        return stats

    def last_window_timeline(self) -> Dict[str, Any]:
        """When the parts of the last reduction happened, in seconds from its
        beginning (the synchronising backward's first step): ``gradients``
        (per parameter, when its hook ran; -1 if not), ``buckets`` (per
        bucket in launch order: ``bytes``, ``ready``, ``launched``,
        ``completed``, ``written`` (back to ``.grad``); -1 if unknown or
        not done; a bucket an fp16 wire sent twice, its first launch to its
        second completion, both sends' bytes), ``backward_end`` and
        ``finished``, and
        ``origin``: the beginning on the system clock (seconds since the Unix
        epoch). Empty lists and -1 without a process group. As a Chrome
        trace: ``window_trace()``."""
        return self._c.last_window_timeline()

    def window_trace(self, rank: Optional[int] = None) -> Dict[str, Any]:
        """The last reduction on this rank as a Chrome trace (Perfetto,
        ``chrome://tracing``): the synchronising backward, each bucket's ready
        instant and all-reduce, each parameter's gradient by name; times since
        the Unix epoch (see ``gradaccum.trace``). ``rank``: the trace's process
        id (default: this rank in the Accumulator's group; give the global rank
        when gathering several groups' traces). ``gradaccum.trace.save(path,
        traces)`` writes one, or several ranks' merged. RuntimeError when there
        is no reduction to show (none since construction, refresh_parameters()
        or close(), or no process group)."""
        timeline = self._c.last_window_timeline()
        if rank is None:
            group = self.process_group
            rank = group.rank() if group is not None and hasattr(group, "rank") else 0
        return _trace.from_timeline(timeline, rank=rank, names=self.parameter_names, where="acc.window_trace()")

    def state_dict(self, rank_independent: bool = True) -> Dict[str, Any]:
        """Position, counters and the half-done window's gradients.

        Data parallel and mid-window, the default state is rank-independent and
        this is a collective (every rank calls it at the same point): the
        half-done window is summed over ranks and each rank's state holds
        1/world of it, so saving rank 0's state only (as Lightning and
        Accelerate do) and loading it on every rank resumes exactly.
        ``rank_independent=False`` gives this rank's own state (no collective;
        which ranks may load it: docs/checkpoints.md); with a group that
        torch.distributed knows, it holds the group's global ranks
        (``group_ranks``): a subgroup's rank refuses another subgroup's."""
        return save_state(self._c, self.grad_scaler, self.process_group, rank_independent)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state_dict(); all or nothing: a rejected state leaves the
        window, the counters and the grad_scaler as they were (every check
        runs before anything changes; the gradients are then copied one at a
        time, where only running out of memory can fail)."""
        load_state(self._c, self.grad_scaler, self.process_group, state_dict)
        if self._scheduler_step is not None:
            self._scheduler_step.forget()  # (the scheduler's state is loaded with it)

    @property
    def parameter_names(self) -> List[str]:
        """The trainable parameters' names (each once), in the order of
        ``bucket_indices`` and of ``last_window_timeline()["gradients"]``
        (``"parameter i"`` for a plain iterable of parameters, ``i`` its
        position in that iterable)."""
        return self._c.parameter_names

    @property
    def bucket_indices(self) -> List[List[int]]:
        """Parameter indices of each bucket, in launch order (they change
        after the first window with ``rebuild_buckets``, and are laid out again
        by ``refresh_parameters()``)."""
        return self._c.bucket_indices

    def close(self) -> None:
        """Removes the hooks and releases the parameters (for another
        Accumulator over them) and the process group; later calls raise. Also
        on ``with`` exit. No collective: in the middle of a window the other
        ranks still wait for this rank's reduction (Note [Closed in the middle
        of a window]). Counted micro-steps no step took warn, once."""
        _close(self, warn=True)

    @property
    def closed(self) -> bool:
        return self._c.closed

    def __enter__(self) -> "Accumulator":
        return self

    def __exit__(self, *exc: Any) -> None:
        _close(self, warn=exc[0] is None)  # (an error leaving the block says what happened)

    def __repr__(self) -> str:
        if self.closed:
            return f"Accumulator(steps={self.steps}, reduction={self.reduction!r}, closed)"
        stats = self._c.stats()
        group = f", world_size={stats['world_size']}, backend={stats['backend']!r}" if stats["data_parallel"] else ""
        return (f"Accumulator(steps={self.steps}, reduction={self.reduction!r}, "
                f"micro_step={self.micro_step}, data_parallel={stats['data_parallel']}{group})")
