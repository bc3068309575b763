"""A rank that refuses to build an Accumulator while the other ranks build
theirs: Note [Construction refused on one rank] (src/rank_check.cpp). Building
over a group is a collective; a refusal is told to the others through the
construction's first collective, so that every rank raises instead of the
others waiting until the group's timeout."""
from typing import Any, List

import torch

from gradaccum import _C
from gradaccum._checks import _default_group


def _refuse_construction(process_group: Any, error: BaseException, model: Any) -> None:
    """Tells the other ranks, which wait in their Accumulator()'s first
    collective, that this rank refused to build it: they raise its message,
    naming this rank. If they cannot be told (no usable group, a broken one),
    the caller's own error is raised all the same."""
    try:  # (whatever fails here, the caller raises `error` itself)
        kind = "value" if isinstance(error, ValueError) else "type" if isinstance(error, TypeError) else "runtime"
        first = None
        if isinstance(model, torch.nn.Module):
            first = next(model.parameters(), None)
        elif isinstance(model, (list, tuple)) and model and isinstance(model[0], torch.Tensor):
            first = model[0]
        # (None, or one the group cannot reach: the C++ side picks one it reaches.)
        device = first.device if first is not None else torch.device("meta")
        _C._refuse_construction(process_group, str(error), kind, device)
    except Exception:  # noqa: BLE001
        pass

def _group_of(process_group: Any) -> Any:
    """The group an Accumulator built with this ``process_group`` option
    reduces over (None: the default one, if any; False: none)."""
    if process_group is False:
        return None
    return _default_group() if process_group is None else process_group


def _refuse_before_building(process_group: Any, error: BaseException, model: Any) -> None:
    """_refuse_construction() for an adapter that refuses before it builds an
    Accumulator with this ``process_group`` option."""
    group = _group_of(process_group)
    if group is not None:
        _refuse_construction(group, error, model)


def _any_rank_has(flag: bool, process_group: Any, device: Any) -> bool:
    """Whether `flag` holds on some rank of the group an Accumulator with this
    ``process_group`` option would reduce over (a MAX all-reduce of one
    number, on the CPU or on `device`); `flag` without a group."""
    group = _group_of(process_group)
    if group is None:
        return flag
    import torch.distributed as dist

    # Gloo (alone or beside NCCL, "cpu:gloo,cuda:nccl") and MPI take CPU
    # tensors; NCCL and the other accelerators' backends the device's.
    backend = str(dist.get_backend(group))
    on_cpu = "gloo" in backend or "mpi" in backend
    values: List[float] = [float(flag)]
    tensor = torch.tensor(values, device="cpu" if on_cpu else device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return bool(tensor.item())
