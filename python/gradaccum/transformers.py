"""gradaccum.transformers: a Hugging Face ``Trainer`` that accumulates with gradaccum.

    from gradaccum.transformers import Trainer   # instead of transformers.Trainer

    args = TrainingArguments(output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=8, ...)
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=valid)
    trainer.train()                               # torchrun --nproc_per_node=N train.py

A subclass of ``transformers.Trainer`` with the same arguments (and three
keyword-only ones, below). Logging, evaluation, callbacks, ``save_steps``
checkpoints, ``resume_from_checkpoint`` and the learning-rate schedule work as
in the Trainer; what changes is how a window of ``gradient_accumulation_steps``
(K) micro-batches becomes one optimizer step. A :class:`gradaccum.Accumulator`
over the model's parameters runs every micro-batch's backward and the window's
step; under torchrun it all-reduces the gradients once per window (the model is
never wrapped in DDP), and the window's gradient is that of the big batch:

- **Per-token mean, counted right.** A model whose loss takes
  ``num_items_in_batch`` (``**kwargs`` in ``forward``: every HF model with a
  built-in loss), or a ``compute_loss_func``, trains with
  ``reduction="items"``: each micro-batch's loss is computed as the Trainer does
  (``compute_loss``), normalised by the micro-batch's own count ``n``, and
  ``acc.backward(loss * n, num_items=n)`` adds its summed loss; the window
  divides by the items of all its micro-batches on all ranks. The counts ride in
  the gradient all-reduce's header: no all-gather of counts
  (``average_tokens_across_devices`` is turned off in this Trainer's copy of the
  arguments; its ``loss * world_size`` rescaling would be wrong here). ``n``
  counts the real targets: for a causal LM (a model in
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, or whose loss is ``ForCausalLMLoss``)
  the shifted labels, ``(labels[..., 1:] != -100).sum()`` (the stock Trainer
  5.23 counts every position of ``labels`` for e.g. ``GPT2LMHeadModel``, whose
  ``loss_type`` is unset), ``shift_labels`` when the batch has them, otherwise
  ``(labels != -100).sum()``. Override :meth:`Trainer.count_items` for other
  targets. Evaluation uses the same count. Other models (and
  ``reduction="mean"``) train with the mean of the micro-batch losses.
- **No duplicated samples, partial windows weighted by what they hold.** The
  training data loader is sharded without Accelerate's ``even_batches``
  padding (which repeats the first samples to even out the last batches): rank
  r gets batches r, r + world, ..., so ranks differ by at most one batch
  (evaluation and prediction loaders keep ``even_batches``: their
  ``gather_for_metrics`` must pair on every rank). At the end of each epoch
  every rank calls ``acc.flush()``, which closes the partial window with its
  own count (``items`` or micro-batches over all ranks). The
  number of optimizer steps per epoch is that of the rank with the most batches
  (one all-gather of the ranks' loader lengths when training starts), so every
  rank has the same ``max_steps`` and LR schedule.
- **One optimizer step per window.** ``args.max_grad_norm`` > 0 clips the
  window's reduced gradient once, inside the Accumulator (the Trainer's own
  ``clip_grad_norm_`` at every window end, even with ``max_grad_norm=0``, would
  rewrite ``.grad`` behind its back). The LR scheduler steps only after a real
  optimizer step (not after a window skipped as non-finite;
  ``ReduceLROnPlateau``/``GreedyLR`` step at evaluation, as in the Trainer).
  ``state.global_step`` counts windows: every closed window, a skipped one too
  (as the Trainer counts a step its fp16 scaler skipped), so ``max_steps``,
  ``save_steps`` and the data skipped on resume stay in step on every rank.
- **Logged loss.** ``loss`` in the logs is the mean over the logged windows of
  ``acc.window_loss``: each window's global loss (every micro-batch of every
  rank, weighted as its gradient: total loss / total items with ``items``),
  with no all-gather. On a bf16/fp16 wire (``comm_dtype``), which carries
  no loss (``window_loss`` is None there), each rank keeps its share of each
  window's loss, and one all-reduce at each log sums them over ranks: the
  same global loss. ``grad_norm`` is the window's gradient norm before
  clipping (``stats()["last_grad_norm"]``), when the Accumulator computed it.
  ``on_pre_optimizer_step`` callbacks run right before each real optimizer
  step, on the window's final gradient (reduced, divided and clipped, as the
  Trainer clips before them); ``on_optimizer_step`` after it. Neither runs
  for a window skipped as non-finite.
- **Checkpoints.** ``acc.state_dict()`` is written beside the optimizer's state
  (``gradaccum_accumulator.pt``, by the process that saves) and loaded on
  ``resume_from_checkpoint``. The Trainer saves at window boundaries only
  (after a step or at the epoch's end), so the state is rank-independent and
  resuming on the same world size reproduces the uninterrupted run.
- Non-finite windows are skipped on every rank (``nonfinite="skip"``, the
  Accumulator's default); ``bf16``/``fp16`` work through Accelerate's autocast
  (the model is prepared with ``evaluation_mode=True``: autocast, no DDP), and
  with ``fp16`` Accelerate's GradScaler becomes the Accumulator's
  ``grad_scaler`` (unscale, overflow skip, update once per window). Only float32
  and float64 are tested.

Keyword-only arguments besides the Trainer's:

- ``reduction``: ``None`` (the default: ``"items"`` as above, else ``"mean"``),
  or ``"items"``, ``"mean"``, ``"sum"`` to force one;
- ``nonfinite``: ``"skip"`` (default), ``"raise"`` or ``"ignore"``;
- ``accumulator_options``: a dict of further :class:`gradaccum.Accumulator`
  options (``bucket_cap_mb``, ``gradient_as_bucket_view``, ``comm_dtype``, ...).

``TrainingArguments``' ``ddp_bucket_cap_mb`` and ``ddp_broadcast_buffers``,
when given, are the Accumulator's ``bucket_cap_mb`` and
``broadcast_buffers``, as they are DDP's under the stock Trainer (an
``accumulator_options`` value that disagrees is a ValueError);
``ddp_find_unused_parameters`` and ``ddp_static_graph`` change nothing (a
parameter without a gradient is sent as zeros flagged missing, and the graph
may change between windows).

The Accumulator is ``trainer.accumulator`` while training; it is closed when
``train()`` returns (its hooks leave the model), and its last ``stats()`` are
``trainer.accumulator_stats``.

Not supported (refused when training starts): DeepSpeed, FSDP, tensor /
context / sequence parallelism, ``nn.DataParallel`` (several GPUs in one
process), SageMaker model parallelism, XLA. Iterable datasets whose shards
differ by a window or more are not handled (``flush()`` assumes ranks differ by
less than a window, or end one full window apart).

transformers is an optional dependency, imported only by this module.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, Optional

import torch

try:
    import transformers
    from accelerate import skip_first_batches
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.optimization import GreedyLR
    from transformers.trainer_callback import TrainerCallback
except ImportError as error:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        f"gradaccum: gradaccum.transformers needs transformers and accelerate, which are not importable here "
        f"({error}). Install them with: pip install transformers accelerate"
    ) from error

from gradaccum._accumulator import _NONFINITE, _REDUCTIONS, Accumulator
from gradaccum._refusal import _refuse_before_building
from gradaccum._adapter_options import _adapter_options
from gradaccum._hf import _float64_causal_lm_loss, keep_float64_causal_lm_loss
from gradaccum._hf_shards import needs_flush, no_rank_had_data, shard_lengths
from gradaccum._hf_support import check_supported
from gradaccum._hf_tokens import TokensSeen
from gradaccum._loss_share import LossShare

__all__ = ["Trainer", "CHECKPOINT_NAME"]

#: The file, in a Trainer checkpoint folder, that holds ``acc.state_dict()``.
CHECKPOINT_NAME = "gradaccum_accumulator.pt"

_METRIC_SCHEDULERS = (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)


def _own_args(args: "transformers.TrainingArguments") -> "transformers.TrainingArguments":
    """A copy of the arguments with what this Trainer changes (the caller's
    object is left alone): no all-gathered token counts."""
    args = copy.copy(args)
    args.average_tokens_across_devices = False
    return args


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose gradient accumulation (and data-parallel
    reduction) is a :class:`gradaccum.Accumulator`: see the module docstring."""

    def __init__(self, model: Any = None, args: Any = None, *positional: Any, reduction: Optional[str] = None,
                 nonfinite: str = "skip", accumulator_options: Optional[Dict[str, Any]] = None,
                 **kwargs: Any) -> None:
        if reduction is not None and reduction not in _REDUCTIONS:
            raise ValueError(f"gradaccum: Trainer(): invalid reduction: {reduction!r} "
                             f"(expected None or one of {_REDUCTIONS})")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"gradaccum: Trainer(): invalid nonfinite: {nonfinite!r} (expected one of {_NONFINITE})")
        self._reduction_option = reduction
        self.nonfinite = nonfinite
        self.accumulator_options = _adapter_options(
            "Trainer()", accumulator_options, ("steps", "reduction", "max_grad_norm", "nonfinite", "scheduler"))
        self.accumulator: Optional[Accumulator] = None
        self.accumulator_stats: Optional[Dict[str, Any]] = None
        self.reduction: Optional[str] = None
        self._shard_lengths: Optional[list] = None
        self._loss_windows = 0
        # Each closed window's loss that the wire did not carry: this rank's
        # share, until _sum_loss_shares (Note [A wire without the loss]).
        self._loss_share = LossShare()
        self._loss_shares: list = []
        self._window_start: Optional[Dict[str, Any]] = None
        self._flushed_epoch = False
        super().__init__(model, _own_args(args) if args is not None else None, *positional, **kwargs)

    # ------------------------------------------------------------------ set-up

    def create_accelerator_and_postprocess(self) -> None:
        if self.args.average_tokens_across_devices:
            self.args = _own_args(self.args)  # Trainer(args=None): its own default arguments
        super().create_accelerator_and_postprocess()

    def _choose_reduction(self) -> str:
        """As the Trainer decides whether to divide a loss by K: a subclass's
        ``loss_is_scaled_for_ga`` (transformers >= 5) says whether its
        ``compute_loss`` normalises by ``num_items_in_batch`` (True: "items")
        or returns a per-micro-batch mean the Trainer divides by K (False:
        "mean"); unset, a model taking loss kwargs or a ``compute_loss_func``
        means "items"."""
        if self._reduction_option is not None:
            return self._reduction_option
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return "items" if scaled else "mean"
        return "items" if (self.model_accepts_loss_kwargs or self.compute_loss_func is not None) else "mean"

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple:
        """The Trainer's arithmetic over the longest rank's loader: ranks differ
        by at most a batch, and the one with the most sets the number of
        windows (steps) per epoch, on every rank alike."""
        self._shard_lengths, dataloader = shard_lengths(dataloader, self.args.device)
        return super().set_initial_training_values(args, dataloader)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Optional[str]):
        """The Trainer's, without DDP: Accelerate prepares the model for
        evaluation (device, autocast, compile; no DDP wrap); the optimizer
        stays a plain torch optimizer (the Accumulator steps it once per
        window); then the Accumulator is built, and restored on resume."""
        check_supported(self)
        if self.accumulator is not None:
            self._close_accumulator()
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        model = self.accelerator.prepare_model(self.model, evaluation_mode=True)
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = model
        saved = None
        if resume_from_checkpoint is not None:
            try:
                self._load_optimizer_and_scheduler(resume_from_checkpoint)
                self._load_scaler(resume_from_checkpoint)
                path = os.path.join(resume_from_checkpoint, CHECKPOINT_NAME)
                if os.path.isfile(path):
                    saved = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as error:  # one node's unreadable file: told to the others, building
                _refuse_before_building(self.accumulator_options.get("process_group"), error, self.model)
                raise
        self._build_accumulator()
        if saved is not None:
            self.accumulator.load_state_dict(saved)
        self._remember_window_start()
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return model, train_dataloader

    def _keep_float64_loss(self) -> None:
        """A float64 model with transformers' causal-LM loss trains on a
        float64 loss (``ForCausalLMLoss`` rounds logits to float32), so that
        windows equal a float64 big batch; restored when training ends."""
        model = self.accelerator.unwrap_model(self.model)
        if keep_float64_causal_lm_loss(model):
            self._float64_loss_model = model

    def _build_accumulator(self) -> None:
        self._keep_float64_loss()
        self.reduction = self._choose_reduction()
        scheduler = self.lr_scheduler if not isinstance(self.lr_scheduler, _METRIC_SCHEDULERS) else None
        options = self._accumulator_kwargs()
        clip = self.args.max_grad_norm
        self.accumulator = Accumulator(
            self.model,
            self.optimizer,
            steps=self.args.gradient_accumulation_steps,
            reduction=self.reduction,
            max_grad_norm=float(clip) if clip is not None and clip > 0 else None,
            nonfinite=self.nonfinite,
            scheduler=scheduler,
            **options,
        )
        if any(type(cb).on_pre_optimizer_step is not TrainerCallback.on_pre_optimizer_step
               for cb in self.callback_handler.callbacks):
            # As in the Trainer: after clipping, right before the optimizer
            # step (a flushed partial window's too); like on_optimizer_step,
            # not for a window skipped as non-finite.
            self.accumulator._set_pre_step_hook(self._pre_optimizer_step_callbacks)
        self._loss_windows = 0
        self._loss_share, self._loss_shares = LossShare(), []
        self._tokens_seen = TokensSeen()  # Note [Tokens seen, once a window]

    def _accumulator_kwargs(self) -> Dict[str, Any]:
        """accumulator_options, with what the Trainer's arguments give DDP
        (ddp_bucket_cap_mb, ddp_broadcast_buffers) and the accelerator's
        GradScaler."""
        options = dict(self.accumulator_options)
        # Read from the arguments, not from the accelerator's
        # DistributedDataParallelKwargs: those leave out a value equal to
        # DDP's default (ddp_bucket_cap_mb=25), which is not always ours.
        for name in ("bucket_cap_mb", "broadcast_buffers"):
            value = getattr(self.args, f"ddp_{name}", None)
            if value is None:
                continue
            if options.get(name) is not None and options[name] != value:
                raise ValueError(f"gradaccum: Trainer: TrainingArguments(ddp_{name}={value!r}) and "
                                 f"accumulator_options {name}={options[name]!r} disagree")
            options[name] = value
        if getattr(self.accelerator, "scaler", None) is not None:
            options.setdefault("grad_scaler", self.accelerator.scaler)
        return options

    @property
    def _acc(self) -> Accumulator:
        acc = self.accumulator
        if acc is None:
            raise RuntimeError("gradaccum: Trainer: no Accumulator: it exists only while train() runs")
        return acc

    def _pre_optimizer_step_callbacks(self) -> None:
        self.control = self.callback_handler.on_pre_optimizer_step(self.args, self.state, self.control)

    def _close_accumulator(self) -> None:
        model, self._float64_loss_model = getattr(self, "_float64_loss_model", None), None
        if model is not None and getattr(model, "_loss_function", None) is _float64_causal_lm_loss:
            del model._loss_function
        acc, self.accumulator = self.accumulator, None
        if acc is not None and not acc.closed:
            self.accumulator_stats = acc.stats()
            acc.close()

    def _finalize_training(self, trial: Any, num_train_samples: Any, start_time: Any) -> Any:
        try:
            if self.accumulator is not None:
                self._sum_loss_shares()  # the windows since the last log (every rank gets here)
            return super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            self._close_accumulator()

    # ---------------------------------------------------------------- counting

    def _shifts_labels(self) -> bool:
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            return False
        if getattr(self, "_loss_shifts_labels", False):
            return True
        if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            return True
        loss_type = getattr(model, "loss_type", None)
        return LOSS_MAPPING.get(loss_type) is ForCausalLMLoss or getattr(model, "_loss_function", None) in (
            ForCausalLMLoss, _float64_causal_lm_loss)

    def count_items(self, inputs: Dict[str, Any]) -> torch.Tensor:
        """The number of real targets in one micro-batch (a 0-dim int64 tensor):
        ``shift_labels`` != -100 when the batch has them, else for a causal LM
        ``labels[..., 1:]`` != -100, else ``labels`` != -100. Override for
        other targets."""
        if "shift_labels" in inputs:
            labels = inputs["shift_labels"]
        elif "labels" in inputs:
            labels = inputs["labels"][..., 1:] if self._shifts_labels() else inputs["labels"]
        else:
            raise ValueError("gradaccum: Trainer(reduction='items'): the batch has no 'labels' to count items in; "
                             "override Trainer.count_items(inputs), or pass reduction='mean'")
        return labels.ne(-100).sum()

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> Any:
        """Evaluation's count (prediction_step): the real targets, as in training."""
        count = super()._get_num_items_in_batch(batch_samples, device)
        if count is None:
            return None
        try:
            total = sum(self.count_items(batch) for batch in batch_samples)
        except (TypeError, AttributeError, ValueError):
            return count
        return total.to(device) if torch.is_tensor(total) else total

    # ---------------------------------------------------------------- training

    def training_step(self, model: torch.nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch: forward (``compute_loss``) and ``acc.backward``.
        ``num_items_in_batch`` is ignored: each micro-batch's own count goes to
        the Accumulator, which divides by the window's total."""
        acc = self._acc
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if self.reduction == "items":
            count = self.count_items(inputs)
            divisor = count.clamp(min=1)  # no targets: a zero loss sum, not 0 / 0
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=divisor)
            del inputs
            summed = loss * divisor.to(loss.device, loss.dtype)
            acc.backward(summed, num_items=count)
        else:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs)
            del inputs
            summed = loss
            acc.backward(loss)
        self._loss_share.add(summed, self.nonfinite == "skip_micro_batch")
        return loss.detach()

    def _run_epoch(self, model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                   ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                   steps_trained_in_current_epoch):
        """One pass over this rank's shard: a backward per micro-batch, the
        window's bookkeeping when the Accumulator closes it, and ``flush()`` of
        the partial window at the end (every rank)."""
        acc = self._acc
        args = self.args
        step = -1
        rng_to_sync = False
        if self._tr_loss.dtype != torch.float64:
            self._tr_loss = self._tr_loss.to(torch.float64)
        if epoch == epochs_trained and resume_from_checkpoint is not None:
            if steps_trained_in_current_epoch > 0 and not args.ignore_data_skip:
                train_dataloader = skip_first_batches(train_dataloader, steps_trained_in_current_epoch)
                step = steps_trained_in_current_epoch - 1
                rng_to_sync = True
            elif steps_trained_in_current_epoch == 0:
                self._load_rng_state(resume_from_checkpoint)
        if hasattr(train_dataloader, "set_epoch"):
            train_dataloader.set_epoch(epoch)
        shard_wrapper = getattr(train_dataloader, "batch_sampler", None)
        underlying_sampler = getattr(shard_wrapper, "batch_sampler", None)
        if hasattr(underlying_sampler, "set_epoch"):
            underlying_sampler.set_epoch(epoch)

        window = dict(model=model, epoch=epoch, steps_in_epoch=steps_in_epoch, trial=trial,
                      ignore_keys_for_eval=ignore_keys_for_eval, start_time=start_time)
        exhausted = True
        self._flushed_epoch = False
        for inputs in train_dataloader:
            if rng_to_sync:  # as the Trainer: after the skipped batches were drawn
                self._load_rng_state(resume_from_checkpoint)
                rng_to_sync = False
            step += 1
            if acc.micro_step == 0 and not acc.window_ready:
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            self.training_step(model, inputs)
            self.current_flos += float(self.floating_point_ops(inputs))
            self._track_num_input_tokens(inputs)
            if acc.window_ready:
                self._end_window(acc.step, step=step, **window)
            else:
                self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
            if self.control.should_epoch_stop or self.control.should_training_stop:
                exhausted = False
                break

        if self._needs_flush(exhausted) and not self._flushed_epoch:
            self._end_window(acc.flush, step=step, **window)

        if self._no_rank_had_data(step >= 0):
            self.control.should_training_stop = True
        self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        self._maybe_log_save_evaluate(self._tr_loss, self._grad_norm(), model, trial, epoch,
                                      ignore_keys_for_eval, start_time, learning_rate=None)

    def _no_rank_had_data(self, had_data: bool) -> bool:
        return no_rank_had_data(self._shard_lengths, had_data, self._acc, self.args.device)

    def _needs_flush(self, exhausted: bool) -> bool:
        return needs_flush(self._shard_lengths, exhausted, self._acc)

    def _grad_norm(self) -> Optional[float]:
        if self.accumulator is None:
            return None
        return self.accumulator.stats().get("last_grad_norm")

    def _end_window(self, close, *, model, epoch, step, steps_in_epoch, trial, ignore_keys_for_eval, start_time):
        """Closes a window (``acc.step`` at a full one, ``acc.flush`` at the
        epoch's end) and does the Trainer's per-step work if one closed."""
        acc = self._acc
        windows = acc.stats()["windows"]
        learning_rate = self._get_learning_rate()  # the rate this step uses, before the scheduler moves it
        stepped = close()
        if acc.epoch_ended:
            # This rank's shard ended on a boundary and the others flushed their
            # partial window in the reduction that closed it: its flush() is a
            # no-op owed now, before a checkpoint saves its state (the same as
            # the others'); _run_epoch does not flush again.
            acc.flush()
            self._flushed_epoch = True
        self._remember_window_start()
        stats = acc.stats()
        if stats["windows"] == windows:
            return  # nothing to close anywhere
        self._tokens_seen.end_window(self, acc.process_group)
        if stepped:
            self.control = self.callback_handler.on_optimizer_step(self.args, self.state, self.control)
        loss = acc.window_loss
        share = self._loss_share.take(acc, self.reduction, self._tr_loss.device)
        if share is not None:
            # The wire carried no loss: this rank's share, summed over ranks at
            # the next log (Note [A wire without the loss]).
            self._loss_shares.append(share)
        elif loss is not None and not (self.args.logging_nan_inf_filter and not torch.isfinite(loss)):
            self._tr_loss += loss.to(self._tr_loss.device, self._tr_loss.dtype)
            self._loss_windows += 1
        self.state.global_step += 1
        self.state.epoch = epoch + (step + 1) / steps_in_epoch
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        self._maybe_log_save_evaluate(self._tr_loss, stats.get("last_grad_norm"), model, trial, epoch,
                                      ignore_keys_for_eval, start_time, learning_rate=learning_rate)

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                 learning_rate=None):
        """The Trainer's, with the loss logged as the mean of the windows'
        global losses since the last log (no all-gather: every rank has it)."""
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            self._sum_loss_shares()
            total = float(tr_loss)
            tr_loss -= tr_loss
            logs: Dict[str, float] = {}
            if self._loss_windows:
                logs["loss"] = total / self._loss_windows
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            logs["learning_rate"] = learning_rate if learning_rate is not None else self._get_learning_rate()
            # train_loss (at the end) is the total over optimizer steps: count
            # a window without a loss as the mean of those with one.
            steps = self.state.global_step - self._globalstep_last_logged
            self._total_loss_scalar += total / self._loss_windows * steps if self._loss_windows else 0.0
            self._loss_windows = 0
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()
            self.log(logs, start_time)
            self.control.should_log = False
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time,
                                         learning_rate=learning_rate)

    def _sum_loss_shares(self) -> None:
        """The windows whose loss the wire did not carry: their shares summed
        over ranks (one all-reduce; every rank logs at the same step, with as
        many shares), each a window's global loss, into the logged total."""
        shares, self._loss_shares = self._loss_shares, []
        if not shares:
            return
        losses = torch.stack([s.to(self._tr_loss.device) for s in shares])
        # (LossShare.take gives shares only data parallel)
        torch.distributed.all_reduce(losses, group=self._acc.process_group)
        if self.args.logging_nan_inf_filter:
            losses = losses[torch.isfinite(losses)]
        self._tr_loss += losses.sum().to(self._tr_loss.dtype)
        self._loss_windows += losses.numel()

    def _track_num_input_tokens(self, inputs: Any) -> None:
        self._tokens_seen.count(self, inputs)  # no collective: Note [Tokens seen, once a window]

    def store_flos(self) -> None:
        # The Trainer resets current_flos to the int 0, and a rank without a
        # micro-batch since then (shards a batch apart) would broadcast an
        # int64 tensor against the others' float32.
        self.current_flos = float(self.current_flos)
        super().store_flos()

    # ------------------------------------------------------------- checkpoints

    def _remember_window_start(self) -> None:
        """The Accumulator's state at a window boundary (counters only, no
        collective), for a checkpoint saved inside the next window's step."""
        acc = self.accumulator
        if acc is not None and acc.micro_step == 0 and not acc.window_ready:
            self._window_start = acc.state_dict()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.accumulator is not None:
            if self.accumulator.window_ready:
                # Inside the window's step: the JIT checkpoint's on_pre_optimizer_step
                # (enable_jit_checkpoint), before the optimizer step. The Trainer's
                # global_step is the window's start, and a resume replays its
                # batches: so is the Accumulator's state (the window's own is half
                # stepped, and the Accumulator refuses to read it there).
                state = self._window_start
            else:
                # Every rank gets here; at a window boundary this is no collective,
                # mid-window (a user's own save) it is one, on every rank alike.
                state = self.accumulator.state_dict()
            if self.args.should_save:
                torch.save(state, os.path.join(output_dir, CHECKPOINT_NAME))
