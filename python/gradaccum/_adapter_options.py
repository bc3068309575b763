"""The adapters' ``accumulator_options``: Accumulator keyword arguments an
adapter (gradaccum.accelerate, gradaccum.transformers) passes on, checked
when the adapter is built; and Accelerate's ``DistributedDataParallelKwargs``
translated into them."""
import inspect
from collections.abc import Mapping
from typing import Any, Dict, Iterable

import torch

from gradaccum._accumulator import Accumulator
from gradaccum._checks import _check_group_option


def _adapter_options(what: str, options: Any, reserved: Iterable[str]) -> Dict[str, Any]:
    """An adapter's ``accumulator_options``: ``Accumulator`` keyword arguments,
    none of those the adapter sets itself (`reserved`), checked when the
    adapter is built rather than when it builds the Accumulator."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"gradaccum: {what}: accumulator_options must be a dict of Accumulator keyword arguments, "
                        f"got {type(options).__name__}")
    reserved = tuple(reserved)
    known = [name for name in inspect.signature(Accumulator.__init__).parameters
             if name not in ("self", "model", "optimizer") and name not in reserved]
    for name in options:
        if name in reserved or name in ("model", "optimizer"):
            raise ValueError(f"gradaccum: {what}: accumulator_options may not set {name!r}: the adapter sets it "
                             f"(it sets {', '.join(repr(r) for r in reserved)}, the model and the optimizer)")
        if name not in known:
            raise ValueError(f"gradaccum: {what}: accumulator_options: {name!r} is not an Accumulator option "
                             f"(they are {', '.join(known)})")
    # (before the adapter's first collective over it, not in Accumulator())
    _check_group_option(what, options.get("process_group"))
    return dict(options)


# DistributedDataParallelKwargs that gradaccum's reducer takes, under its own names.
_DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "broadcast_buffers")
# Those with no meaning for it: unused parameters are sent as zeros flagged
# missing, the graph may change between windows, and nothing is scattered.
_DDP_MOOT = ("find_unused_parameters", "static_graph", "check_reduction", "dim")


def _with_ddp_kwargs(handler: Any, options: Dict[str, Any]) -> Dict[str, Any]:
    """The Accumulator's options with a ``DistributedDataParallelKwargs``
    handler's settings, which stock Accelerate gives DDP: the bucket cap,
    bucket views and buffer broadcast as they are; an fp16/bf16 compression
    hook as ``comm_dtype``; PowerSGD refused; the rest moot. A value equal
    to DDP's default (``bucket_cap_mb=25``) is not in ``to_kwargs()``, so
    gradaccum's own default applies to it; set it in ``accumulator_options``."""
    if handler is None:
        return options
    options = dict(options)
    what = "gradaccum: Accelerator(): DistributedDataParallelKwargs"
    for name, value in handler.to_kwargs().items():
        if name in _DDP_MOOT:
            continue
        if name not in _DDP_OPTIONS:
            raise ValueError(f"{what}({name}=...) has no gradaccum counterpart")
        if options.get(name) is not None and options[name] != value:
            raise ValueError(f"{what}({name}={value!r}) and accumulator_options {name}={options[name]!r} disagree")
        options[name] = value
    hook = getattr(getattr(handler, "comm_hook", None), "value", None)
    wrapper = getattr(getattr(handler, "comm_wrapper", None), "value", None)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
    # A wrapper without a hook is ignored, as Accelerate ignores it.
    if hook not in (None, "no"):
        if hook not in dtypes or wrapper not in (None, "no"):
            raise ValueError(
                f"{what}: comm_hook={hook!r}, comm_wrapper={wrapper!r} is not supported: gradaccum compresses "
                "its all-reduce to fp16/bf16 only (comm_hook=DDPCommunicationHookType.FP16 or BF16, or "
                "accumulator_options comm_dtype); PowerSGD has no counterpart")
        dtype = dtypes[hook]
        if options.get("comm_dtype") not in (None, dtype):
            raise ValueError(f"{what}(comm_hook={hook!r}) and accumulator_options comm_dtype="
                             f"{options['comm_dtype']} disagree")
        options["comm_dtype"] = dtype
    return options
