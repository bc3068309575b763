"""gradaccum.Accumulator: the Python face of the C++ Accumulator."""
import contextlib
import numbers
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Union

import torch

from gradaccum import _C

_REDUCTIONS = ("mean", "sum", "items")
_NONFINITE = ("skip", "raise", "ignore")


def _wrapper_classes():
    """Wrappers that reduce gradients themselves: wrapping the model in one of
    them as well would reduce every gradient twice."""
    found = []
    try:
        from torch.nn.parallel import DistributedDataParallel
        found.append(DistributedDataParallel)
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        found.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        pass
    try:
        from torch.distributed.fsdp import FSDPModule  # FSDP2 (fully_shard)
        found.append(FSDPModule)
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


def _check_module(model: torch.nn.Module) -> None:
    wrappers = _wrapper_classes()
    for name, module in model.named_modules():
        if wrappers and isinstance(module, wrappers):
            where = f"submodule {name!r}" if name else "the model"
            raise ValueError(
                f"{where} is wrapped in {type(module).__name__}, which reduces gradients "
                "itself: with gradaccum's reduction too, every gradient would be reduced "
                "twice. Do not wrap the model (with Accelerate, prepare the optimizer and "
                "data loaders but not the model); if it is wrapped already, take "
                "ddp_model.module and delete the wrapper (del ddp_model) before building "
                "the Accumulator: gradaccum does the data-parallel reduction")
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"submodule {name!r} is {type(module).__name__}(sparse=True), which makes "
                "sparse gradients; gradaccum supports dense gradients only: use sparse=False")
    for name, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor":
            raise ValueError(
                f"parameter {name!r} is a DTensor (FSDP2 / tensor parallel): gradaccum reduces "
                "plain replicated parameters; pass the unsharded module")


def _parameters(model: Any):
    """(parameters, names, buffers) of a module or of an iterable of parameters."""
    if isinstance(model, torch.nn.Module):
        _check_module(model)
        named = list(model.named_parameters())
        return [p for _, p in named], [n for n, _ in named], list(model.buffers())
    if isinstance(model, torch.Tensor):
        raise TypeError(
            "model must be a torch.nn.Module or an iterable of parameters, got a single "
            "Tensor (wrap it in a list)"
        )
    try:
        params = list(model)
    except TypeError:
        raise TypeError(
            "model must be a torch.nn.Module or an iterable of parameters, got "
            f"{type(model).__name__}"
        ) from None
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"model must be a torch.nn.Module or an iterable of parameters; item {i} "
                f"is a {type(p).__name__}"
            )
    return params, [f"parameter {i}" for i in range(len(params))], []


def _default_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


class Accumulator:
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
        max_grad_norm: clip the window's gradient to this total 2-norm, once.
        nonfinite: at the boundary, a NaN/inf gradient is ``"skip"``-ped (no
            step, gradients cleared, counted), ``"raise"``-d, or ``"ignore"``-d.
        scheduler: an LR scheduler stepped only after a real optimizer step.
        process_group: data-parallel group; ``None`` (the default) means the
            default group when ``torch.distributed`` is initialized, ``False``
            means local-only accumulation (no reduction) even then. Gradients are then all-reduced
            once per window, in buckets overlapped with backward.
        bucket_cap_mb / first_bucket_cap_mb: bucket sizes (as torch DDP).
        gradient_as_bucket_view: ``.grad`` tensors are views of the buckets.
        broadcast_buffers: broadcast rank 0's buffers at each window's end.
        check_parameters: at construction, check all ranks have the same
            parameters (a collective) and fail naming the first mismatch.
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
            updates the scale once per window.
    """

    def __init__(
        self,
        model: Union[torch.nn.Module, Iterable[torch.Tensor]],
        optimizer: Optional[torch.optim.Optimizer] = None,
        steps: int = 1,
        reduction: str = "mean",
        max_grad_norm: Optional[float] = None,
        nonfinite: str = "skip",
        *,
        scheduler: Optional[Any] = None,
        process_group: Union[None, bool, Any] = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_cap_mb: float = 1.0,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = False,
        check_parameters: bool = True,
        rebuild_buckets: bool = True,
        accumulate_dtype: Optional[torch.dtype] = None,
        grad_scaler: Optional[Any] = None,
        comm_dtype: Optional[torch.dtype] = None,
        error_feedback: bool = False,
    ) -> None:
        if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
            raise TypeError(f"steps must be a positive int, got {steps!r}")
        if reduction not in _REDUCTIONS:
            raise ValueError(f"Invalid reduction: {reduction!r} (expected one of {_REDUCTIONS})")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"Invalid nonfinite: {nonfinite!r} (expected one of {_NONFINITE})")
        if max_grad_norm is not None and not isinstance(max_grad_norm, numbers.Real):
            raise TypeError(f"max_grad_norm must be a number or None, got {max_grad_norm!r}")
        if optimizer is not None and not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have a step() method, got {type(optimizer).__name__}")
        if scheduler is not None and not callable(getattr(scheduler, "step", None)):
            raise TypeError(f"scheduler must have a step() method, got {type(scheduler).__name__}")
        if accumulate_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"accumulate_dtype must be torch.float32, torch.float64 or None, "
                             f"got {accumulate_dtype!r}")
        if comm_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"comm_dtype must be torch.bfloat16, torch.float16, torch.float32 "
                             f"or None, got {comm_dtype!r}")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {error_feedback!r}")
        if error_feedback and comm_dtype is None:
            raise ValueError("error_feedback=True needs a comm_dtype: it keeps what compressing "
                             "the gradients to comm_dtype loses")
        if grad_scaler is not None:
            if optimizer is None:
                raise ValueError("grad_scaler needs an optimizer (it unscales the optimizer's gradients)")
            for method in ("scale", "unscale_", "update", "state_dict", "load_state_dict"):
                if not callable(getattr(grad_scaler, method, None)):
                    raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got "
                                    f"{type(grad_scaler).__name__} (no {method}())")
        params, names, buffers = _parameters(model)
        if process_group is True:
            raise TypeError("process_group must be a ProcessGroup, None (the default group) or "
                            "False (local-only), got True")
        if process_group is None:
            process_group = _default_group()
        elif process_group is False:
            process_group = None
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.process_group = process_group
        self._c = _C.Accumulator(
            params, names, buffers, int(steps), reduction,
            None if max_grad_norm is None else float(max_grad_norm), nonfinite,
            process_group, float(bucket_cap_mb), float(first_bucket_cap_mb),
            bool(gradient_as_bucket_view), bool(broadcast_buffers), bool(check_parameters),
            bool(rebuild_buckets),
            "" if accumulate_dtype is None else str(accumulate_dtype).replace("torch.", ""),
            # Looked up at each call: an LR scheduler created later wraps optimizer.step.
            (lambda: optimizer.step()) if optimizer is not None else None,
            (lambda: scheduler.step()) if scheduler is not None else None,
            "" if comm_dtype is None else str(comm_dtype).replace("torch.", ""),
            error_feedback,
        )
        self.steps = int(steps)
        self.reduction = reduction
        self._no_sync_depth = 0
        self.grad_scaler = grad_scaler
        if grad_scaler is not None:
            self._c.set_window_callbacks(self._unscale_and_check, grad_scaler.update)

    def _unscale_and_check(self) -> bool:
        """At a closed window: unscale the (reduced, divided) gradient and let
        the scaler's found-inf decide; every rank holds the same gradient, so
        every rank decides alike. GradScaler.update() follows once per window."""
        scaler = self.grad_scaler
        scaler.unscale_(self.optimizer)
        state = scaler._per_optimizer_states[id(self.optimizer)]
        found_inf = sum(v.item() for v in state["found_inf_per_device"].values())
        if not found_inf and self.steps > 1:
            # backward() scaled each micro-step by 1/steps as well (torch's own
            # accumulation recipe, same fp16 headroom as the big batch): undo it.
            grads = [p.grad for g in self.optimizer.param_groups for p in g["params"]
                     if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, float(self.steps))
        return not found_inf

    def backward(self, loss: torch.Tensor, num_items: Union[None, int, float, torch.Tensor] = None) -> None:
        """Backward on one micro-batch's loss; the window's last call synchronises.

        With ``reduction="items"``, ``loss`` is summed over items and
        ``num_items`` (a number or a one-element tensor) counts them.
        """
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward(): loss must be a torch.Tensor, got {type(loss).__name__}")
        if self._no_sync_depth:  # data parallel, C++ says the same; here for one process too
            raise RuntimeError(
                "backward(): called inside no_sync(). Accumulator.backward() decides by itself "
                "which micro-step synchronises; no_sync() is for the manual path (a plain "
                "loss.backward() inside it)")
        if isinstance(num_items, bool) or (
                isinstance(num_items, torch.Tensor) and num_items.dtype == torch.bool):
            raise TypeError(f"backward(): num_items must be a count of items, got {num_items!r}")
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1:
                raise ValueError(f"backward(): num_items must be a number, got a tensor of shape {tuple(num_items.shape)}")
            num_items = num_items.item()
        if self.grad_scaler is not None:
            # Scaled, and divided by steps so that fp16 sees the big batch's
            # magnitudes; step() unscales and multiplies back.
            loss = self.grad_scaler.scale(loss) / self.steps
        self._c.backward(loss, None if num_items is None else float(num_items))

    def step(self) -> bool:
        """At a closed window: clip, check, step the optimizer (and scheduler),
        clear the gradients. Returns whether the optimizer stepped."""
        return self._c.step()

    def flush(self) -> bool:
        """Closes a partial window (end of data) and steps. Collective when data
        parallel: every rank calls it."""
        return self._c.flush()

    def zero_grad(self) -> None:
        """Drops the current window's gradients and position."""
        self._c.zero_grad()

    @property
    def sync_gradients(self) -> bool:
        """True when the next ``backward()`` closes the window."""
        return self._c.sync_gradients

    @property
    def micro_step(self) -> int:
        """Position in the current window, ``0..steps-1``."""
        return self._c.micro_step

    @property
    def window_ready(self) -> bool:
        """True between a window's last ``backward()`` and ``step()``."""
        return self._c.window_ready

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally with no collective (torch
        DDP's ``no_sync``); only the backward needs to be inside."""
        previous = self._c.expect_hooks
        self._c.expect_hooks = False
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1
            self._c.expect_hooks = previous

    def stats(self) -> Dict[str, Any]:
        """Counters: micro_steps, optimizer_steps, skipped_steps, windows, and the
        reducer's buckets, collectives, bytes_reduced (in all and last window)."""
        return self._c.stats()

    def state_dict(self, rank_independent: bool = True) -> Dict[str, Any]:
        """Position, counters and the half-done window's gradients.

        Data parallel and mid-window, the default state is rank-independent and
        this is a collective (every rank calls it at the same point): the
        half-done window is summed over ranks and each rank's state holds
        1/world of it, so saving rank 0's state only (as Lightning and
        Accelerate do) and loading it on every rank resumes exactly.
        ``rank_independent=False`` gives this rank's own state (no collective),
        which only this rank can load."""
        state = self._c.state_dict(bool(rank_independent))
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict: expected a dict, got {type(state_dict).__name__}")
        self._c.load_state_dict(state_dict)
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])

    @property
    def bucket_indices(self):
        """Parameter indices of each bucket, in launch order (they change once,
        after the first window, with ``rebuild_buckets``)."""
        return self._c.bucket_indices

    def close(self) -> None:
        """Removes the hooks and releases the parameters (for another
        Accumulator over them); later calls raise. Also on ``with`` exit."""
        self._c.close()

    @property
    def closed(self) -> bool:
        return self._c.closed

    def __enter__(self) -> "Accumulator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Accumulator(steps={self.steps}, reduction={self.reduction!r}, "
                f"micro_step={self.micro_step}, data_parallel={self.process_group is not None})")
