"""Accumulator()'s argument checks, its parameters, its process group and its
grad_scaler's state: everything gradaccum.Accumulator validates before the C++
side sees it (each refusal a gradaccum: error naming the call)."""
import inspect
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Tuple

import torch

_REDUCTIONS = ("mean", "sum", "items")
_NONFINITE = ("skip", "raise", "ignore", "skip_micro_batch")


def _wrapper_classes():
    """Wrappers that reduce gradients themselves: wrapping the model in one of
    them as well would reduce every gradient twice. Only from modules already
    imported: a model cannot be wrapped in a class never imported, and importing
    torch.distributed.fsdp while a group exists keeps that group alive past
    destroy_process_group() (its Gloo threads then outlive the interpreter and
    can abort it at exit)."""
    import sys

    found = []
    for module_name, names in (("torch.nn.parallel", ("DistributedDataParallel",)),
                               ("torch.distributed.fsdp", ("FullyShardedDataParallel", "FSDPModule"))):
        module = sys.modules.get(module_name)
        for name in names:
            cls = getattr(module, name, None)
            if isinstance(cls, type):
                found.append(cls)
    return tuple(found)


def _check_module(model: torch.nn.Module, what: str = "Accumulator()") -> None:
    wrappers = _wrapper_classes()
    for name, module in model.named_modules():
        if wrappers and isinstance(module, wrappers):
            where = f"submodule {name!r}" if name else "the model"
            raise ValueError(
                f"gradaccum: {what}: {where} is wrapped in {type(module).__name__}, which reduces gradients "
                "itself: with gradaccum's reduction too, every gradient would be reduced "
                "twice. Do not wrap the model (with Accelerate, prepare the optimizer and "
                "data loaders but not the model); if it is wrapped already, take "
                "ddp_model.module and delete the wrapper (del ddp_model) before building "
                "the Accumulator: gradaccum does the data-parallel reduction")
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"gradaccum: {what}: {f'submodule {name!r}' if name else 'the model'} is "
                f"{type(module).__name__}(sparse=True), which makes "
                "sparse gradients; gradaccum supports dense gradients only: use sparse=False")
    for name, p in model.named_parameters():
        if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor":
            raise ValueError(
                f"gradaccum: {what}: parameter {name!r} is a DTensor (FSDP2 / tensor parallel): gradaccum reduces "
                "plain replicated parameters; pass the unsharded module")


def _parameters(model: Any, what: str = "Accumulator()", arg: str = "model", within: Any = None):
    """(parameters, names, buffers) of a module or of an iterable of parameters;
    `what` and `arg` name the call and its argument in errors. A parameter of
    the module `within` (a refresh's: the Accumulator's) is named as there, so
    that ranks refreshing different layers of one shape differ by name."""
    params, names, buffers = _parameters_of(model, what, arg)
    if within is not None and within is not model:
        qualified = {id(p): name for name, p in within.named_parameters()}
        names = [qualified.get(id(p), name) for p, name in zip(params, names)]
    return params, names, buffers


def _parameters_of(model: Any, what: str, arg: str):
    if isinstance(model, torch.nn.Module):
        _check_module(model, what)
        named = list(model.named_parameters())
        return [p for _, p in named], [n for n, _ in named], list(model.buffers())
    if isinstance(model, torch.Tensor):
        raise TypeError(
            f"gradaccum: {what}: {arg} must be a torch.nn.Module or an iterable of parameters, got a single "
            "Tensor (wrap it in a list)"
        )
    try:
        params = list(model)
    except TypeError:
        raise TypeError(
            f"gradaccum: {what}: {arg} must be a torch.nn.Module or an iterable of parameters, got "
            f"{type(model).__name__}"
        ) from None
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"gradaccum: {what}: {arg} must be a torch.nn.Module or an iterable of parameters; item {i} "
                f"is a {type(p).__name__}"
            )
    return params, [f"parameter {i}" for i in range(len(params))], []


def _scaling(grad_scaler: Optional[Any]) -> bool:
    """Whether grad_scaler really scales: a GradScaler(enabled=False) (the usual
    ``enabled=use_amp`` switch) scales nothing, so the Accumulator runs as
    without one (same gradient units, no window callbacks)."""
    if grad_scaler is None:
        return False
    is_enabled = getattr(grad_scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def _check_scaled_parameters(params, names, is_module: bool, optimizer: Any, what: str = "Accumulator()") -> None:
    """With a GradScaler, every gradient the Accumulator clips and checks must be
    one GradScaler unscales (the optimizer's), and none may be float16.
    `what`: the call (Accumulator() or acc.refresh_parameters())."""
    before = "building the Accumulator" if what == "Accumulator()" else f"calling {what}"
    def label(name: str) -> str:
        return f"parameter {name!r}" if is_module else name

    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        raise TypeError(f"gradaccum: {what}: grad_scaler needs a torch.optim.Optimizer (GradScaler.unscale_ reads its "
                        f"param_groups), got {type(optimizer).__name__}")
    optimized = {id(p) for group in groups for p in group["params"]}
    for p, name in zip(params, names):
        if not p.requires_grad:  # frozen: the Accumulator does not accumulate it
            continue
        if id(p) not in optimized:
            raise ValueError(
                f"gradaccum: {what}: grad_scaler: {label(name)} requires grad but is not in the optimizer's "
                "param_groups. GradScaler unscales (and checks for inf/NaN) only the optimizer's "
                "gradients, while the Accumulator clips and checks every trainable parameter's: "
                f"this one would stay scaled. Freeze it (requires_grad=False) before {before}, or give "
                "the optimizer every trainable parameter (optimizer.add_param_group)")
        if p.dtype == torch.float16:
            raise ValueError(
                f"gradaccum: {what}: grad_scaler: {label(name)} is float16; GradScaler cannot unscale float16 "
                "gradients (torch refuses them at the first step()). Keep the parameters float32 "
                "and run the forward under torch.autocast(device_type, dtype=torch.float16) "
                "(torch's own mixed-precision recipe)")


_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _saved_scaled(state_dict: Dict[str, Any]) -> bool:
    """Whether a state was saved by an Accumulator whose GradScaler scaled (an
    enabled one's state_dict() is never empty; a disabled one's is {})."""
    saved = state_dict.get("grad_scaler")
    return isinstance(saved, dict) and bool(saved)


def _held_gradients(state_dict: Dict[str, Any]) -> List[str]:
    """What gradients a state holds, in words; none at a window boundary
    without error feedback (the keys are only looked at here; the C++ load
    checks their types)."""
    def any_tensor(key: str) -> bool:
        value = state_dict.get(key)
        return isinstance(value, (list, tuple)) and any(t is not None for t in value)

    micro_step, window_ready = state_dict.get("micro_step"), state_dict.get("window_ready")
    held = []
    if window_ready in (True, 1):
        held.append(f"a closed window (micro_step={micro_step}, window_ready=True)")
    elif (isinstance(micro_step, numbers.Real) and micro_step > 0) or any_tensor("grads"):
        held.append(f"a half-done window (micro_step={micro_step})")
    if any_tensor("error_feedback_residuals"):
        held.append("error-feedback residuals")
    return held


def _check_scaler_setting(scaler: Optional[Any], state_dict: Dict[str, Any]) -> None:
    """acc.load_state_dict(): held gradients are in the loss scale's units
    with a GradScaler (scaled, and divided by steps) and plain without one."""
    scaling, saved_scaling = _scaling(scaler), _saved_scaled(state_dict)
    held = _held_gradients(state_dict)
    if scaling == saved_scaling or not held:
        return
    saved_kind = "a disabled grad_scaler" if "grad_scaler" in state_dict else "no grad_scaler"
    ours_kind = "a disabled grad_scaler" if scaler is not None else "no grad_scaler"
    saved = "an enabled grad_scaler (its gradients are scaled)" if saved_scaling else \
        f"{saved_kind} (its gradients are not scaled)"
    ours = "an enabled grad_scaler (it expects scaled gradients)" if scaling else \
        f"{ours_kind} (it expects unscaled gradients)"
    remedy = "Resume with the grad_scaler setting that saved it"
    if "error-feedback residuals" not in held:
        remedy += ", or save at a window boundary (after step()), where either setting may resume"
    raise ValueError(
        f"gradaccum: acc.load_state_dict(): the state holds {' and '.join(held)} saved with {saved}, but "
        f"this Accumulator has {ours}. {remedy}")


def _check_scaler_state(saved: Any) -> None:
    """What GradScaler.load_state_dict needs; it reads the keys one by one and
    would be left half-loaded by a bad one."""
    if not isinstance(saved, dict):
        raise TypeError(f"gradaccum: acc.load_state_dict(): 'grad_scaler' must be a GradScaler state dict, got "
                        f"{type(saved).__name__}")
    for key in _SCALER_KEYS:
        if key not in saved:
            raise ValueError(f"gradaccum: acc.load_state_dict(): 'grad_scaler' has no key {key!r}: it must be what "
                             "GradScaler.state_dict() returns")
    for key in _SCALER_KEYS:
        value = saved[key]
        integral = key in ("growth_interval", "_growth_tracker")
        kind = numbers.Integral if integral else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"gradaccum: acc.load_state_dict(): 'grad_scaler' key {key!r} must be "
                            f"{'an int' if integral else 'a number'}, got {value!r}")
    if not (0.0 < float(saved["scale"]) < float("inf")):
        raise ValueError(f"gradaccum: acc.load_state_dict(): 'grad_scaler' scale must be a positive finite number, "
                         f"got {saved['scale']!r}")


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _default_world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _non_member(process_group: Any) -> bool:
    """What new_group() returns on a rank outside the group (an int, -100)."""
    if isinstance(process_group, bool) or not isinstance(process_group, int) or not _dist_initialized():
        return False
    import torch.distributed as dist

    return process_group == dist.GroupMember.NON_GROUP_MEMBER


def _group_ranks(process_group: Any) -> Optional[List[int]]:
    """The global ranks of `process_group`'s members, in group-rank order;
    None where torch.distributed does not know the group (one built in C++)."""
    if process_group is None or not _dist_initialized():
        return None
    import torch.distributed as dist

    try:
        return [int(r) for r in dist.get_process_group_ranks(process_group)]
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _default_group():
    import torch.distributed as dist

    return dist.group.WORLD if _dist_initialized() else None


def _check_launch_has_group() -> None:
    """No group under a multi-rank launch: see Note [No group under a
    multi-rank launch] in src/accumulator/accumulator.cpp (each rank would train alone)."""
    world = os.environ.get("WORLD_SIZE", "")
    try:
        ranks = int(world)
    except ValueError:  # unset or not a number: no launch to speak of (as in C++)
        return
    if ranks > 1:
        raise RuntimeError(
            f"gradaccum: Accumulator(): WORLD_SIZE={world} in the environment (a torchrun launch?) "
            "but no process group exists, so each rank would train alone and the ranks would end "
            "with different weights. Call torch.distributed.init_process_group() before building "
            "the Accumulator, or pass process_group=False to train each rank alone on purpose")


def _required_arguments(method: Any) -> str:
    """The arguments a call of `method` with none would lack ("closure"), or ""."""
    if method is None:
        return ""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):  # a builtin or C++ method: not known
        return ""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    params = list(signature.parameters.values())
    if params and params[0].name == "self":  # an LR scheduler's wrapper of optimizer.step: wraps the unbound one
        params = params[1:]
    return ", ".join(f"'{p.name}'" for p in params if p.default is inspect.Parameter.empty and p.kind in kinds)


def _wrapped_required_arguments(obj: Any, attribute: str) -> Tuple[str, str]:
    """_required_arguments() of `obj.step`, or of the object it wraps (an
    `accelerate` AcceleratedOptimizer's `.optimizer`, AcceleratedScheduler's
    `.scheduler`, whose step(*args, **kwargs) passes them on), with the
    name of the one that needs them."""
    names = []
    for _ in range(4):
        if obj is None:
            break
        names.append(type(obj).__name__)
        needed = _required_arguments(getattr(obj, "step", None))
        if needed:
            return needed, " wrapping ".join(names)
        obj = getattr(obj, attribute, None)
    return "", ""


def _check_options(steps: Any, reduction: Any, nonfinite: Any, max_grad_norm: Any, optimizer: Any,
                   scheduler: Any, accumulate_dtype: Any, comm_dtype: Any, error_feedback: Any,
                   grad_scaler: Any, metrics: Any = ()) -> None:
    """Accumulator()'s options, each refused with a gradaccum: error naming it."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"gradaccum: Accumulator(): steps must be a positive int, got {steps!r}")
    if not -2**63 <= steps < 2**63:
        raise ValueError(f"gradaccum: Accumulator(): steps must be a positive int below 2**63, got {steps}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"gradaccum: Accumulator(): invalid reduction: {reduction!r} (expected one of {_REDUCTIONS})")
    if nonfinite not in _NONFINITE:
        raise ValueError(f"gradaccum: Accumulator(): invalid nonfinite: {nonfinite!r} (expected one of {_NONFINITE})")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real)):
        raise TypeError(f"gradaccum: Accumulator(): max_grad_norm must be a number or None, got {max_grad_norm!r}")
    if optimizer is not None and not callable(getattr(optimizer, "step", None)):
        raise TypeError(f"gradaccum: Accumulator(): optimizer must have a step() method, got {type(optimizer).__name__}")
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise TypeError(f"gradaccum: Accumulator(): scheduler must have a step() method, got {type(scheduler).__name__}")
    needed, inner = _wrapped_required_arguments(optimizer, "optimizer")
    if needed:
        raise ValueError(
            f"gradaccum: Accumulator(): optimizer {inner}'s step() needs {needed}, and acc.step() "
            "calls it with no argument: an optimizer that evaluates the loss again inside its step (a closure, as "
            "torch.optim.LBFGS) cannot step a window accumulated by acc.backward(); use one whose step() takes none")
    needed, inner = _wrapped_required_arguments(scheduler, "scheduler")
    if needed:
        raise ValueError(
            f"gradaccum: Accumulator(): scheduler {inner}'s step() needs {needed}, and acc.step() "
            f"calls it with no argument: leave it out of the Accumulator and step it yourself after each real "
            f"optimizer step (`if acc.step(): scheduler.step(...)`, say with acc.window_loss, or a validation "
            f"loss at each epoch's end, as torch.optim.lr_scheduler.ReduceLROnPlateau expects)")
    if accumulate_dtype not in (None, torch.float32, torch.float64):
        raise ValueError(f"gradaccum: Accumulator(): accumulate_dtype must be torch.float32, torch.float64 or None, "
                         f"got {accumulate_dtype!r}")
    if comm_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"gradaccum: Accumulator(): comm_dtype must be torch.bfloat16, torch.float16, torch.float32 "
                         f"or None, got {comm_dtype!r}")
    if not isinstance(error_feedback, bool):
        raise TypeError(f"gradaccum: Accumulator(): error_feedback must be a bool, got {error_feedback!r}")
    if error_feedback and comm_dtype is None:
        raise ValueError("gradaccum: Accumulator(): error_feedback=True needs a comm_dtype: it keeps what compressing "
                         "the gradients to comm_dtype loses")
    if isinstance(metrics, str) or not isinstance(metrics, (list, tuple)) or \
            not all(isinstance(name, str) for name in metrics):
        raise TypeError(f"gradaccum: Accumulator(): metrics must be a list or tuple of names, got {metrics!r}")
    if grad_scaler is not None:
        if optimizer is None:
            raise ValueError("gradaccum: Accumulator(): grad_scaler needs an optimizer (it unscales the optimizer's gradients)")
        for method in ("scale", "unscale_", "update", "state_dict", "load_state_dict"):
            if not callable(getattr(grad_scaler, method, None)):
                raise TypeError(f"gradaccum: Accumulator(): grad_scaler must be a torch.amp.GradScaler, got "
                                f"{type(grad_scaler).__name__} (no {method}())")


def _check_layout_options(**options: Any) -> None:
    """Accumulator()'s reducer options: the bucket caps numbers (a string or a
    bool is a mistake, not a size), the switches bools (``"no"`` is truthy)."""
    for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
        value = options.pop(name)
        if value is None and name == "bucket_cap_mb":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"gradaccum: Accumulator(): {name} must be a number of MiB"
                            f"{' or None' if name == 'bucket_cap_mb' else ''}, got {value!r}")
    for name, value in options.items():
        if not isinstance(value, bool):
            raise TypeError(f"gradaccum: Accumulator(): {name} must be a bool, got {value!r}")


def _check_group_option(what: str, process_group: Any) -> None:
    """A ``process_group`` option's type: a ProcessGroup (or an object naming
    one), None or False; refused on this rank alone, before any collective
    (the group's members pair none with it)."""
    if process_group is True:
        raise TypeError(f"gradaccum: {what}: process_group must be a ProcessGroup, None "
                        "(the default group) or False (local-only), got True")
    if _non_member(process_group):
        import torch.distributed as dist

        raise ValueError(f"gradaccum: {what}: this rank (global rank {dist.get_rank()}) is not a member of "
                         "process_group: torch.distributed.new_group() returns GroupMember.NON_GROUP_MEMBER on "
                         "the ranks it leaves out. Build the Accumulator on the group's ranks only")
    if process_group is not None and process_group is not False:
        import torch.distributed as dist

        # (what the C++ side takes: a ProcessGroup, or an object naming one)
        if not isinstance(process_group, dist.ProcessGroup) and not hasattr(process_group, "group_name"):
            raise TypeError(f"gradaccum: {what}: process_group must be a torch.distributed.ProcessGroup, "
                            f"None (the default group) or False (local-only), got {type(process_group)}")


def _resolve_group(process_group: Any) -> "tuple[Any, bool]":
    """(the group to reduce over or None, whether local-only): None means the
    default group, or local-only when there is none (an error under a
    multi-rank launch); False means local-only on purpose."""
    _check_group_option("Accumulator()", process_group)
    if process_group is None:
        process_group = _default_group()
        if process_group is None:
            _check_launch_has_group()
    if process_group is False:
        return None, True
    return process_group, process_group is None


def _finite_float(what: str, label: str, value: numbers.Real) -> float:
    """A number as a float, a ValueError (a refused micro-batch, told to the
    other ranks) where it does not fit in one (an int of 10**400)."""
    try:
        return float(value)
    except OverflowError as error:
        raise ValueError(f"gradaccum: {what}: {label} does not fit in a float64 ({error})") from None


def _num_items_float(what: str, num_items: Any) -> float:
    """A micro-batch's ``num_items`` (a real number or a one-element real
    tensor) as a float; a TypeError or ValueError otherwise, which
    backward() and run() refuse as a bad micro-batch (told to the other
    ranks at a closing micro-step, as any error of these checks)."""
    if isinstance(num_items, bool) or (isinstance(num_items, torch.Tensor) and num_items.dtype == torch.bool):
        raise TypeError(f"gradaccum: {what}: num_items must be a count of items, got {num_items!r}")
    if not isinstance(num_items, (numbers.Real, torch.Tensor)):
        raise TypeError(f"gradaccum: {what}: num_items must be a number or a one-element "
                        f"tensor, got {num_items!r} ({type(num_items).__name__})")
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1:
            raise ValueError(f"gradaccum: {what}: num_items must be a number, got a tensor of shape "
                             f"{tuple(num_items.shape)}")
        if num_items.is_complex():
            raise TypeError(f"gradaccum: {what}: num_items must be a real count of items, got a "
                            f"{num_items.dtype} tensor")
        try:
            num_items = num_items.item()
        except RuntimeError as error:  # (a meta tensor holds no value): refused as any bad num_items
            raise ValueError(f"gradaccum: {what}: num_items could not be read as a number: {error}") from None
    return _finite_float(what, "num_items", num_items)


def _metric_values(what: str, names: Tuple[str, ...], metrics: Any, like: torch.Tensor) -> Optional[torch.Tensor]:
    """A ``{name: value}`` dict as the tensor the C++ side takes (the
    constructor's names' order; a name left out is 0)."""
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise TypeError(f"gradaccum: {what}: metrics must be a dict of name: value, got {type(metrics).__name__}")
    unknown = [name for name in metrics if name not in names]
    if unknown:
        raise ValueError(f"gradaccum: {what}: unknown metric(s) {unknown}: the Accumulator was built with "
                         f"metrics={list(names)}")
    values = []
    for name in names:
        value = metrics.get(name, 0.0)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"gradaccum: {what}: metric {name!r} must be a scalar, got a tensor of shape "
                                 f"{tuple(value.shape)}")
            if value.is_complex():
                raise TypeError(f"gradaccum: {what}: metric {name!r} must be real, got a {value.dtype} tensor")
            if value.is_meta:
                raise ValueError(f"gradaccum: {what}: metric {name!r} is on the meta device: it holds no value")
            if value.layout != torch.strided:
                raise ValueError(f"gradaccum: {what}: metric {name!r} must be a dense tensor, got {value.layout}")
            values.append(value.detach().reshape(()).to(device=like.device, dtype=torch.float64))
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            number = _finite_float(what, f"metric {name!r}", value)
            values.append(torch.tensor(number, dtype=torch.float64, device=like.device))
        else:
            raise TypeError(f"gradaccum: {what}: metric {name!r} must be a number or a one-element tensor, "
                            f"got {value!r}")
    if not values:
        return None  # metrics={} on an Accumulator built without metrics: nothing to carry
    return torch.stack(values)


def _as_float(name: str, value: Any) -> Optional[float]:
    """An option as the float the C++ side takes (None stays None)."""
    return None if value is None else _finite_float("Accumulator()", name, value)


def _scaler_rule(grad_scaler: Any) -> Optional[Tuple[float, float, float, int]]:
    """An enabled GradScaler's scale and schedule, which every rank must
    share (compared when the C++ side is built); None where nothing scales.
    A scaler-like object without GradScaler's getters reads 0 for them."""
    if not _scaling(grad_scaler):
        return None

    def get(name: str) -> float:
        getter = getattr(grad_scaler, name, None)
        return float(getter()) if callable(getter) else 0.0

    scale = get("get_scale")
    if isinstance(grad_scaler, torch.amp.GradScaler) and not 0 < scale < math.inf:
        # (torch accepts these; every window would then be skipped, silently: review)
        raise ValueError(f"gradaccum: Accumulator(): grad_scaler's scale is {scale:g}: it must be a finite number "
                         "> 0 (GradScaler(init_scale=...)), or no window could ever step")
    return (scale, get("get_growth_factor"), get("get_backoff_factor"), int(get("get_growth_interval")))


# A no-sync micro-step whose backward raised, data parallel, still counts
# (every rank closes its windows together) and its window is dropped on every
# rank when it closes: a script that ran the micro-batch again (after running
# out of memory, say) would run one micro-step more than the other ranks, and
# pair other micro-batches in every later window, with no error.
_COUNTED_HEAD = ("gradaccum: acc.backward(): this micro-step failed in its backward on this rank and still counts, "
                 "so that every rank closes its windows together")
_COUNTED = (_COUNTED_HEAD + "; go on with the next micro-batch, not this one again "
            "(this rank would run one micro-step more than the others). The window will be dropped on every rank "
            "when it closes, unless acc.zero_grad() here drops this rank's part of it so far (the window then goes "
            "on without it); acc.run() retries out-of-memory micro-batches in smaller parts instead")


def _note_counted_failure(native: Any, error: BaseException) -> None:
    """Adds _COUNTED's note to an error of a data-parallel backward (its own:
    gradaccum's errors say what happened themselves)."""
    if str(error).startswith("gradaccum: ") or not hasattr(error, "add_note"):
        return
    if any(str(note).startswith("gradaccum: ") for note in getattr(error, "__notes__", ())):
        return  # an interrupt that dropped the window: its note says so
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if not isinstance(error, Exception) and tb is not None and tb.tb_frame.f_code.co_name == "backward" \
            and tb.tb_frame.f_globals.get("__name__") == "gradaccum._accumulator":
        return  # a signal's KeyboardInterrupt once the call had returned: nothing failed in it (review)
    try:
        if native.closed or not native.stats()["data_parallel"]:
            return
    except Exception:  # noqa: BLE001 - the original error matters, not this note
        return
    if not isinstance(error, Exception):  # an interrupt: this rank stops
        error.add_note(_COUNTED_HEAD + ". The window will be dropped on every rank when it closes, and every rank "
                       "told to end training (if this rank goes on to close it)")
        return
    error.add_note(_COUNTED)


def check_micro_step(self: Any, what: str) -> None:
    """What Python checks of any micro-step before the C++ side's checks."""
    if self._no_sync_depth and self.process_group is None and self._c.micro_step == self.steps - 1:
        # (data parallel, the C++ side refuses it and drops the window on every rank:
        # Note [The closing micro-step inside no_sync()])
        raise RuntimeError(
            f"gradaccum: {what}: called inside acc.no_sync() at the window's closing micro-step. {what} "
            "decides by itself which micro-step synchronises (the window's last); acc.no_sync() is for the "
            "manual path (a plain loss.backward() inside it)")
    self._check_group(what)


def check_backward_arguments(unexpected: Dict[str, Any]) -> None:
    """acc.backward()'s keyword arguments other than its own (torch's)."""
    if unexpected:
        raise TypeError(
            f"gradaccum: acc.backward(): unexpected keyword argument(s) {', '.join(map(repr, unexpected))}: each call "
            "is one micro-step and takes no retain_graph, inputs or create_graph (sum two losses of one micro-batch "
            "into one call; freeze what should get no gradient and call acc.refresh_parameters())")


def check_group(self: Any, what: str) -> None:
    """A group made after this Accumulator, which was built without one:
    each rank would train alone (the manual path's no_sync() and own
    optimizer.step() are checked too)."""
    if self._watch_for_group and not self._c.closed and _dist_initialized() and _default_world_size() > 1:
        raise RuntimeError(
            f"gradaccum: {what}: torch.distributed was initialized after this "
            "Accumulator was built without a process group, so it reduces nothing and each rank "
            "would train alone. Build the Accumulator after init_process_group(), or pass "
            "process_group=False to train each rank alone on purpose")
