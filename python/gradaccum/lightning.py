"""gradaccum.lightning: a Lightning strategy that accumulates with gradaccum.

    import lightning.pytorch as pl
    from gradaccum.lightning import GradaccumStrategy

    trainer = pl.Trainer(strategy=GradaccumStrategy(), devices=2, accumulate_grad_batches=8,
                         gradient_clip_val=1.0)

It launches processes and sets up the process group exactly as Lightning's
``DDPStrategy`` does (it is one), but never wraps the model in
``DistributedDataParallel``. Instead a :class:`gradaccum.Accumulator` over the
LightningModule's parameters, with the configured optimizer and
``K = accumulate_grad_batches``, does the backward of every batch and the
optimizer step of every window, reducing once per window. Compared with DDP and
Lightning's own accumulation:

- the window's gradient is that of the big batch, also for the epoch's last,
  partial window, which is weighted by what it holds (Lightning divides it by K);
- with ``reduction="items"`` and ``training_step`` returning
  ``{"loss": summed_loss, "num_items": n}``, the exact per-item (per-token) mean
  over the whole window and all ranks, with no extra collective;
- ``gradient_clip_val`` clips the window's reduced gradient once (by norm), a
  non-finite window is skipped on every rank alike (``nonfinite=``), and
  step-interval LR schedulers step only after a real optimizer step;
- the Accumulator's state goes into Lightning's checkpoints and back on resume;
- each window's global loss (over every micro-batch of every rank, weighted as
  the gradient) is logged as ``train_loss`` (``log_loss=``) at each optimizer
  step, with no ``sync_dist`` and no collective of its own (on a bf16/fp16
  wire, which carries no loss: each rank's share, summed by one all-reduce).

Precision: ``32-true``, ``64-true``, ``bf16-mixed``, ``16-mixed`` (the precision
plugin's GradScaler becomes the Accumulator's ``grad_scaler``; once per window
it unscales, skips an overflow window and updates) and the ``*-true`` half
precisions. Manual optimization is refused: use
``gradaccum.Accumulator`` in ``training_step`` directly there.

Lightning is an optional dependency, imported only by this module:
``pip install "lightning>=2.6"`` (or ``pip install "gradaccum[lightning]"``).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.pytorch.callbacks import GradientAccumulationScheduler
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer import call as _call
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as error:  # pragma: no cover - exercised by a test in a subprocess
    raise ImportError(
        f"gradaccum: gradaccum.lightning needs Lightning, which is not importable here ({error}). "
        'Install it with: pip install "lightning>=2.6" (or pip install "gradaccum[lightning]"); '
        "pin torch (pip install -c <file with torch==your version>) so that pip keeps your torch"
    ) from error

from gradaccum._accumulator import _NONFINITE, _REDUCTIONS, Accumulator
from gradaccum._lightning_batches import check_equal_batches
from gradaccum._loss_share import LossShare
from gradaccum._refusal import _refuse_before_building

__all__ = ["GradaccumStrategy"]

#: The key of the Accumulator's state in Lightning's checkpoint dict.
CHECKPOINT_KEY = "gradaccum_accumulator"



class GradaccumStrategy(DDPStrategy):
    """Data parallel like ``DDPStrategy``, accumulating with a gradaccum Accumulator.

    Args:
        reduction: what the window's gradient is the gradient of: the ``"mean"``
            of the micro-batch losses (the big batch's mean loss), their
            ``"sum"``, or ``"items"``: ``training_step`` returns
            ``{"loss": loss summed over items, "num_items": n}`` and the window's
            gradient is that of total loss / total items over all ranks.
        nonfinite: a NaN/inf window gradient is ``"skip"``-ped (no optimizer or
            scheduler step), ``"raise"``-d, or ``"ignore"``-d.
        bucket_cap_mb, first_bucket_cap_mb, gradient_as_bucket_view,
        broadcast_buffers, check_parameters: passed to the Accumulator. An
            unset ``bucket_cap_mb`` follows the Trainer's ``num_nodes`` (which
            Lightning's own launcher does not put in ``LOCAL_WORLD_SIZE``):
            DDP's 25 MiB on one node, the Accumulator's default across nodes.
        log_loss: the name under which each window's global loss
            (``acc.window_loss``: over every micro-batch of every rank,
            weighted as the gradient; it rode in the gradient all-reduce, so
            no ``sync_dist`` is needed) is logged at each optimizer step, on
            the progress bar too; ``None`` logs nothing. A bf16/fp16 wire
            (``comm_dtype``) carries no loss (``window_loss`` is None): each
            rank's share of the window's loss is summed over ranks by one
            small all-reduce per window: the same global loss.
        process_group_backend, timeout, start_method, accelerator,
        parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
        as for Lightning's ``DDPStrategy``.

    ``K`` is the Trainer's ``accumulate_grad_batches`` (a
    ``GradientAccumulationScheduler``'s for each epoch: the Accumulator is
    rebuilt with the new K at the epoch's first batch) and ``max_grad_norm``
    its ``gradient_clip_val`` (by norm). The Accumulator is built in ``setup``
    and is ``strategy.accumulator`` while fitting.
    """

    strategy_name = "gradaccum"

    def __init__(
        self,
        reduction: str = "mean",
        nonfinite: str = "skip",
        *,
        bucket_cap_mb: Optional[float] = None,
        first_bucket_cap_mb: float = 1.0,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        check_parameters: bool = True,
        accumulate_dtype: Optional[torch.dtype] = None,
        comm_dtype: Optional[torch.dtype] = None,
        error_feedback: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
        log_loss: Optional[str] = "train_loss",
    ) -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"gradaccum: GradaccumStrategy(): invalid reduction: {reduction!r} (expected one of {_REDUCTIONS})")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"gradaccum: GradaccumStrategy(): invalid nonfinite: {nonfinite!r} (expected one of {_NONFINITE})")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        if log_loss is not None and not (isinstance(log_loss, str) and log_loss):
            raise ValueError(f"gradaccum: GradaccumStrategy(): log_loss must be a metric name or None, got {log_loss!r}")
        self.reduction = reduction
        self.nonfinite = nonfinite
        self.log_loss = log_loss
        self._accumulator_options: Dict[str, Any] = dict(
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_cap_mb=first_bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            check_parameters=check_parameters,
            accumulate_dtype=accumulate_dtype,
            comm_dtype=comm_dtype,
            error_feedback=error_feedback,
        )
        self.accumulator: Optional[Accumulator] = None
        # training_step's own loss and item count, for the backward that follows
        self._micro_batch: Optional[Tuple[torch.Tensor, Optional[Any]]] = None
        # this rank's share of the window's loss where the wire carries none
        # (Note [A wire without the loss]), and whether a mid-window resume cut
        # the open window
        self._loss_share = LossShare()
        self._cut_window = False
        # which parameters required grad at the last window boundary (_refresh_if_unfrozen)
        self._trainable: Optional[Tuple[bool, ...]] = None
        # whether the last window really stepped (step-interval schedulers follow it)
        self._stepped = True
        self._step_schedulers: List[Any] = []
        self._gated_module: Optional[pl.LightningModule] = None
        # the Accumulator's state from the checkpoint, until on_train_start loads it
        self._saved_state: Optional[Dict[str, Any]] = None
        # a half-done window was loaded and no batch has run since (_check_resumed_position)
        self._resumed = False
        self._saved_batch: Optional[int] = None

    # ------------------------------------------------------------------ set-up

    def _resolved_accumulator_options(self) -> Dict[str, Any]:
        """The Accumulator's options; an unset bucket cap is DDP's 25 MiB on
        one node, as the Accumulator makes it under torchrun on one node
        (Lightning's launcher leaves LOCAL_WORLD_SIZE unset)."""
        options = dict(self._accumulator_options)
        if options["bucket_cap_mb"] is None and self.num_nodes == 1:
            options["bucket_cap_mb"] = 25.0
        return options

    def _configure_launcher(self) -> None:
        # precision="16-mixed": the precision plugin's GradScaler is handed to the
        # Accumulator (grad_scaler=), which scales each micro-step's loss,
        # unscales the reduced window gradient and updates once per window.
        super()._configure_launcher()

    def configure_ddp(self) -> None:
        # Lightning's DDP wraps the model here; the Accumulator reduces instead.
        pass

    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._build_accumulator(trainer)

    def _build_accumulator(self, trainer: "pl.Trainer") -> None:
        module = self.lightning_module
        assert module is not None
        try:
            self._check_buildable(trainer, module)
            steps = self._scheduled_steps(trainer)
        except ValueError as error:
            # The other ranks wait in their Accumulator()'s first collective:
            # they raise this rank's error, named, instead of waiting there
            # until the group's timeout (Note [Construction refused on one rank]).
            _refuse_before_building(None, error, module)
            raise
        self._new_accumulator(trainer, steps)
        self._gate_step_schedulers(module)
        self._trainable = tuple(p.requires_grad for p in module.parameters())

    def _scheduled_steps(self, trainer: "pl.Trainer") -> int:
        """The window size for the current epoch: a GradientAccumulationScheduler's
        (it sets accumulate_grad_batches only at each epoch's start, after the
        Accumulator is built), else the Trainer's accumulate_grad_batches."""
        for callback in trainer.callbacks:
            if isinstance(callback, GradientAccumulationScheduler):
                return int(callback.get_accumulate_grad_batches(trainer.current_epoch))
        return int(trainer.accumulate_grad_batches)

    def _new_accumulator(self, trainer: "pl.Trainer", steps: int) -> None:
        module = self.lightning_module
        assert module is not None
        clip = trainer.gradient_clip_val
        scaler = getattr(self.precision_plugin, "scaler", None)
        self.accumulator = Accumulator(
            module,
            self.optimizers[0],
            steps=steps,
            grad_scaler=scaler,
            reduction=self.reduction,
            max_grad_norm=float(clip) if clip else None,
            nonfinite=self.nonfinite,
            **self._resolved_accumulator_options(),
        )
        # Lightning's on_before_optimizer_step hooks (grad-norm logging, gradient
        # edits) see the window's final gradient, as under its own strategies:
        # reduced, divided, unscaled, before clipping and the step. Called by
        # the Accumulator at each closed window, a flushed partial one too; only
        # when a hook exists (a before-step callback costs the reducer's fused
        # non-finite check: the norm is then computed).
        if is_overridden("on_before_optimizer_step", module, pl.LightningModule) or any(
                is_overridden("on_before_optimizer_step", callback, pl.Callback) for callback in trainer.callbacks):
            self.accumulator._set_gradient_hook(self._before_optimizer_step_hooks)

    def _resize_window(self, trainer: "pl.Trainer", steps: int) -> None:
        """Another window size at a window boundary (a GradientAccumulationScheduler
        at an epoch's start, a resume): a new Accumulator with `steps`, which
        takes the old one's state (counters, the loss scale), as a checkpoint
        saved at a boundary resumes with another K. Every rank runs the same
        callbacks, so every rank rebuilds here alike (the construction is a
        collective)."""
        old = self.accumulator
        assert old is not None and old.micro_step == 0 and not old.window_ready
        state = old.state_dict(rank_independent=False)  # this rank's: its error-feedback residuals too
        trainable = tuple(p.requires_grad for p in self.lightning_module.parameters())
        if self._trainable is not None and trainable != self._trainable:
            # A fine-tuning callback changed the trainable set at this epoch's
            # start: the new Accumulator is built over the new set (its
            # construction compares it across ranks, so a rank that differs is
            # an error on every rank), and the old set's residuals restart at
            # zero, as at a refresh. (A refresh of the old one here would be a
            # collective on the changed ranks only.)
            state.pop("error_feedback_residuals", None)
        old.close()
        self.accumulator = None
        self._new_accumulator(trainer, steps)
        self.accumulator.load_state_dict(state)
        self._trainable = trainable

    def _check_buildable(self, trainer: "pl.Trainer", module: "pl.LightningModule") -> None:
        """What the strategy refuses before it builds the Accumulator (the
        same on every rank of a launch, unless a rank's module or Trainer
        differs)."""
        if not module.automatic_optimization:
            raise ValueError(
                "gradaccum: GradaccumStrategy: it drives backward and the optimizer step, which needs automatic "
                "optimization; with manual optimization use gradaccum.Accumulator in training_step"
            )
        if len(self.optimizers) != 1:
            raise ValueError(
                f"gradaccum: GradaccumStrategy needs exactly one optimizer, configure_optimizers gave {len(self.optimizers)}"
            )
        clip = trainer.gradient_clip_val
        if clip is not None and float(clip) > 0:
            algorithm = trainer.gradient_clip_algorithm  # None means Lightning's default, "norm"
            algorithm = None if algorithm is None else str(getattr(algorithm, "value", algorithm))
            if algorithm not in (None, "norm"):
                raise ValueError(
                    f"gradaccum: GradaccumStrategy clips the window's gradient by its norm (gradient_clip_val); "
                    f"gradient_clip_algorithm={algorithm!r} is not supported"
                )
        if is_overridden("configure_gradient_clipping", module):
            raise ValueError(
                "gradaccum: GradaccumStrategy does not call configure_gradient_clipping: the Accumulator clips "
                "the window's gradient once, by norm, to the Trainer's gradient_clip_val"
            )

    def _before_optimizer_step_hooks(self) -> None:
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is not None:
            optimizer = self.optimizers[0]
            _call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            _call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)

    def _gate_step_schedulers(self, module: "pl.LightningModule") -> None:
        """Lightning steps step-interval schedulers after every window; after
        one the Accumulator skipped (non-finite) there was no optimizer step,
        so there must be no scheduler step either."""
        self._step_schedulers = [c.scheduler for c in self.lr_scheduler_configs if c.interval == "step"]
        if not self._step_schedulers:
            return
        lightning_step = module.lr_scheduler_step

        def lr_scheduler_step(scheduler: Any, metric: Optional[Any]) -> None:
            if not self._stepped and any(scheduler is s for s in self._step_schedulers):
                return
            lightning_step(scheduler, metric)

        module.lr_scheduler_step = lr_scheduler_step  # type: ignore[method-assign]
        self._gated_module = module

    def teardown(self) -> None:
        if self._gated_module is not None:
            del self._gated_module.lr_scheduler_step  # back to the class's own hook
            self._gated_module = None
        close = getattr(self.accumulator, "close", None)
        if callable(close):
            close()
        self.accumulator = None  # its hooks go with it
        self._loss_share = LossShare()
        self._micro_batch = None
        self._saved_state = None
        self._resumed = False
        super().teardown()

    # ---------------------------------------------------------------- training

    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> None:
        """Lightning clears the gradients at the first batch of each of its
        windows (before its backward). An epoch cut short in the middle of a
        window (``on_train_batch_start`` returned -1) reaches no optimizer
        step, so its half-done window is still in the Accumulator: dropped
        here, as Lightning drops it (alike on every rank that cut the epoch
        alike), where the Accumulator would refuse the cleared window."""
        super().on_train_batch_start(batch, batch_idx, *args, **kwargs)
        module = self.lightning_module
        if self.accumulator is not None and module is not None:  # Note [Every rank trains as many batches]
            check_equal_batches(module.trainer, self.accumulator.process_group, self.root_device, batch_idx)
        if self.accumulator is not None and module is not None and not self._resumed \
                and batch_idx % module.trainer.accumulate_grad_batches == 0:
            self._drop_cut_window()
            # Another window size (a GradientAccumulationScheduler at an epoch's
            # start): here, before the batch's training_step, and before its
            # optimizer_step where the batch closes a window (K=1, or an epoch
            # of one batch), which runs training_step inside it.
            trainer, accumulator = module.trainer, self.accumulator
            if trainer.accumulate_grad_batches != accumulator.steps and accumulator.micro_step == 0 \
                    and not accumulator.window_ready:
                self._resize_window(trainer, trainer.accumulate_grad_batches)

    def _drop_cut_window(self) -> None:
        """Drops a half-done window that no optimizer step will close (see
        on_train_batch_start), with a warning. Also before a checkpoint at the
        end of such an epoch (ModelCheckpoint saves there), which would
        otherwise save the window Lightning is about to clear."""
        acc = self.accumulator
        if acc.micro_step > 0 or acc.window_ready:
            rank_zero_warn(
                "gradaccum: GradaccumStrategy: the last epoch ended in the middle of a window (on_train_batch_start "
                "returned -1?), whose gradients Lightning clears at its next batch: the window is dropped, as "
                "Lightning drops it")
            acc._c.restart_window()  # every rank cut the epoch alike: the position goes too
            self._loss_share.drop()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.accumulator is not None and self.lightning_module is not None:
            if self._resumed:
                self._check_resumed_position(self.lightning_module.trainer)
            self._refresh_if_unfrozen(self.lightning_module)  # before the forward: it may broadcast
        output = super().training_step(*args, **kwargs)
        if self.accumulator is not None:
            self._micro_batch = self._read_step_output(output)
        return output

    def _check_resumed_position(self, trainer: "pl.Trainer") -> None:
        """The first batch after resuming a half-done window: Lightning's batch
        counter (which decides where it calls optimizer_step, and where it
        clears the gradients) and the Accumulator's position in the window
        must agree. They do when the checkpoint was saved between batches at a
        batch that the epoch still has on this number of devices: each rank
        carries on at the saved micro-step. Otherwise (Lightning starts the
        epoch over when the saved batch is past its end on the new number of
        devices) the resume is refused, on every rank alike: their states are
        the same."""
        self._resumed = False
        accumulator = self.accumulator
        self._cut_window = accumulator.micro_step > 0 or accumulator.window_ready  # (its first losses are not here)
        steps = accumulator.steps
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # this batch's, 1-based
        position = (ready - 1) % steps
        if accumulator.micro_step <= position and not accumulator.window_ready:
            # Equal: each rank carries on at the saved micro-step. Behind (the
            # checkpoint's run had resumed at a window boundary with another
            # accumulate_grad_batches, so its window started mid-way through
            # Lightning's): the Accumulator gets steps - position more
            # micro-batches before Lightning's optimizer_step, too few to close
            # its window itself, and that optimizer_step closes it (flush), as
            # after the boundary resume.
            return
        saved, batches = self._saved_batch, trainer.num_training_batches
        where = f"the checkpoint was saved in the middle of a window (micro-step {accumulator.micro_step} of {steps})"
        if saved is not None:
            where = f"{where} after batch {saved} of epoch {trainer.current_epoch}"
        if saved is not None and saved + 1 >= batches:
            why = (f"that batch is past the end of the epoch on {trainer.world_size} device(s) ({batches} batches a "
                   "device), so Lightning starts the epoch over")
        else:
            why = ("the Accumulator's window would close before Lightning's optimizer_step (was it saved inside a "
                   "batch's training step or backward?)")
        raise RuntimeError(
            f"gradaccum: GradaccumStrategy: {where}, but Lightning resumes at batch {ready - 1}, micro-step "
            f"{position} of its window: {why}. Resume on the number of devices that saved it, or from a "
            "checkpoint at a window boundary (an epoch end, or a batch whose optimizer step has run)"
        )

    def _read_step_output(self, output: Any) -> Optional[Tuple[torch.Tensor, Optional[Any]]]:
        if isinstance(output, Mapping):
            loss, num_items = output.get("loss"), output.get("num_items")
        else:
            loss, num_items = output, None
        if not isinstance(loss, torch.Tensor):
            return None  # Lightning itself reports a missing loss
        if self.reduction == "items" and num_items is None:
            raise ValueError(
                "gradaccum: GradaccumStrategy(reduction='items'): training_step must return "
                "{'loss': loss summed over the batch's items, 'num_items': their count}"
            )
        if self.reduction != "items" and num_items is not None:
            raise ValueError(
                f"gradaccum: GradaccumStrategy: training_step returned 'num_items' but GradaccumStrategy has reduction="
                f"{self.reduction!r}: pass GradaccumStrategy(reduction='items') for the exact "
                "per-item mean (and return the loss summed over items)"
            )
        return loss, num_items

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.accumulator is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._micro_batch is None:
            raise RuntimeError("gradaccum: GradaccumStrategy.backward(): no loss from training_step to run backward on")
        # Lightning hands over the loss divided by accumulate_grad_batches; the
        # Accumulator takes training_step's own loss and divides by what the
        # window really holds (micro-batches or items, over all ranks).
        loss, num_items = self._micro_batch
        self._micro_batch = None
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward hooks
        self.accumulator.backward(loss, num_items=num_items)
        self._loss_share.add(loss, self.nonfinite == "skip_micro_batch")
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward hooks
        self.post_backward(closure_loss)
        return closure_loss

    def _refresh_if_unfrozen(self, module: "pl.LightningModule") -> None:
        """A fine-tuning callback (BaseFinetuning) changed which parameters
        require grad: at a window boundary, before the forward (the refresh
        broadcasts rank 0's values in place), the Accumulator takes the new set
        (every rank runs the same callback, so every rank refreshes here alike).
        Mid-window the Accumulator's own error says what happened."""
        accumulator = self.accumulator
        if accumulator.micro_step != 0 or accumulator.window_ready:
            return
        trainable = tuple(p.requires_grad for p in module.parameters())
        if self._trainable is None:
            self._trainable = trainable
        elif trainable != self._trainable:
            accumulator.refresh_parameters(module)
            self._trainable = trainable

    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning calls this at each window's last batch and at the epoch's
        last batch: the Accumulator steps a full window, and closes a partial
        one with its own count (``flush``, a collective every rank reaches)."""
        accumulator = self.accumulator
        if accumulator is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.accumulate_grad_batches != accumulator.steps:
            raise ValueError(
                f"gradaccum: GradaccumStrategy: accumulate_grad_batches changed from {accumulator.steps} to "
                f"{trainer.accumulate_grad_batches} in the middle of a window: GradaccumStrategy changes the window "
                "size at a window boundary only (a GradientAccumulationScheduler changes it at an epoch's start)"
            )
        result = closure()  # training_step and backward of this batch
        # on_before_optimizer_step hooks: from inside step()/flush(), on the
        # window's final gradient (_before_optimizer_step_hooks).
        self._stepped = accumulator.step() if accumulator.window_ready else accumulator.flush()
        loss = accumulator.window_loss
        share = self._loss_share.take(accumulator, self.reduction, self.root_device)
        cut, self._cut_window = self._cut_window, False
        if self.log_loss is not None and self.lightning_module is not None:
            if share is not None and not cut:
                # The wire carried no loss: the shares summed over ranks (Note
                # [A wire without the loss]; every rank gets here alike).
                torch.distributed.all_reduce(share, group=accumulator.process_group)
                loss = share
            if loss is not None:
                # The same value on every rank already: no sync_dist.
                self.lightning_module.log(self.log_loss, loss, on_step=True, on_epoch=False, prog_bar=True)
        return result

    # ------------------------------------------------------------- checkpoints

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        # Lightning calls this on every rank and writes rank 0's dict. The
        # Accumulator's state is rank-independent (mid-window: a collective
        # that sums the half-done window, so every rank must get here, as
        # Lightning's save_checkpoint guarantees): rank 0's dict resumes every rank.
        if self.accumulator is not None and "optimizer_states" in checkpoint:
            module = self.lightning_module
            trainer = module.trainer if module is not None else None
            progress = trainer.fit_loop.epoch_loop.batch_progress if trainer is not None else None
            if (progress is not None and progress.is_last_batch and progress.current.processed == progress.current.ready
                    and progress.current.started < progress.current.ready):
                # The epoch's last batch was processed without being started:
                # on_train_batch_start returned -1, and the epoch ended there,
                # maybe mid-window (a last batch that ran stepped or flushed
                # its window; one still running has processed < ready). Every
                # rank that cut its epoch alike drops alike; a rank that did
                # not would take the snapshot collective alone.
                self._drop_cut_window()
            checkpoint[CHECKPOINT_KEY] = self.accumulator.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self.accumulator is not None and CHECKPOINT_KEY in checkpoint:
            # Not yet: after restoring, Lightning clears the gradients
            # (Trainer._run_stage: lightning_module.zero_grad()), which would
            # drop a half-done window. Loaded in on_train_start.
            self._saved_state = dict(checkpoint[CHECKPOINT_KEY])
            try:  # the last batch that ran before the save, for _check_resumed_position's error
                progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
                self._saved_batch = int(progress["ready"]) - 1
            except (KeyError, TypeError, ValueError):
                self._saved_batch = None

    def on_train_start(self) -> None:
        super().on_train_start()
        state, self._saved_state = self._saved_state, None
        module = self.lightning_module
        if self.accumulator is not None and module is not None:  # Note [Every rank trains as many batches]
            check_equal_batches(module.trainer, self.accumulator.process_group, self.root_device)
            # A GradientAccumulationScheduler's size for the epoch that resumes (known now that
            # the checkpoint set the epoch), before a mid-window state is loaded into it.
            trainer = module.trainer
            steps = self._scheduled_steps(trainer)
            if steps != self.accumulator.steps:
                self._resize_window(trainer, steps)
            # Lightning calls on_train_epoch_start, where the scheduler sets
            # accumulate_grad_batches, only when an epoch starts, not when a
            # run resumes in the middle of one: its batch counter would then
            # close windows of the Trainer's own value (1). Set here, after
            # the scheduler's on_train_start checks it is unset.
            trainer.accumulate_grad_batches = steps
        if state is not None and self.accumulator is not None:
            self.accumulator.load_state_dict(state)
            # At a window boundary Lightning's counter may be anywhere in its
            # window (another accumulate_grad_batches): its next optimizer_step
            # closes the shorter window (flush), weighted by what it holds.
            self._resumed = self.accumulator.micro_step > 0 or self.accumulator.window_ready


if "gradaccum" not in StrategyRegistry:
    StrategyRegistry.register("gradaccum", GradaccumStrategy, description="DDP launch and process group; "
                              "gradaccum.Accumulator instead of DDP (reduces once per window)")
