"""The HF Trainer's training shards (gradaccum.transformers): one per rank,
without Accelerate's ``even_batches`` copies, so ranks differ by a batch at
most; what the Trainer's step arithmetic, the epoch's flush() and its stop
rule read from their lengths."""
from typing import Any, List, Optional, Tuple

import torch
from transformers.trainer_utils import has_length

from gradaccum._accelerate_parts import _find_shard_sampler


class _Longest:
    """A data loader that reports another length (the longest rank's), for
    the Trainer's step arithmetic; everything else is the loader's."""

    def __init__(self, loader: Any, length: int) -> None:
        self._loader, self._length = loader, length

    def __len__(self) -> int:
        return self._length

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def unpadded_shards(loader: Any) -> bool:
    """The training loader's shards without Accelerate's ``even_batches``
    copies (as ``join_uneven_inputs`` switches them off, on the prepared
    loader's sampler): every sample once, ranks a batch apart at most.
    Evaluation and prediction loaders keep ``even_batches``: the Trainer's
    ``gather_for_metrics`` at each of their batches pairs only if every rank
    has as many (it drops the copies). Returns whether ``len(loader)`` is
    still this rank's own count of batches: with ``split_batches`` it is the
    global batches' count, and a rank whose slice of the short last batch is
    empty gets one fewer."""
    sampler = _find_shard_sampler(loader)
    if sampler is None:
        return True
    sampler.even_batches = False
    return not getattr(sampler, "split_batches", False)


def shard_lengths(dataloader: Any, device: Any) -> Tuple[Optional[List[int]], Any]:
    """Every rank's number of training batches (one all-gather, when training
    starts; None where a loader's len() is not its rank's own count, or is
    unknown), and the loader to give the Trainer's arithmetic: over the
    longest rank's length, which sets the windows (steps) per epoch on every
    rank alike."""
    lengths = None
    own_lengths = unpadded_shards(dataloader)
    if has_length(dataloader) and torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        device = device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor([len(dataloader)], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(every, mine)
        lengths = [int(t.item()) for t in every]
        dataloader = _Longest(dataloader, max(lengths))
    elif has_length(dataloader):
        lengths = [len(dataloader)]
    if not own_lengths:
        lengths = None  # (the same on every rank) every epoch ends with a flush everywhere
    return lengths, dataloader


def needs_flush(lengths: Optional[List[int]], exhausted: bool, acc: Any) -> bool:
    """Whether this epoch ends with a flush() on every rank: its data ran
    out and some rank's shard does not end on a window boundary (or the
    shards differ), or the epoch was stopped in the middle of a window
    (every rank stops at the same point)."""
    if not exhausted:
        return acc.micro_step > 0 or acc.window_ready
    if lengths is None:  # unknown lengths: flush on every rank
        return True
    return len(set(lengths)) > 1 or lengths[0] % acc.steps != 0


def no_rank_had_data(lengths: Optional[List[int]], had_data: bool, acc: Any, device: Any) -> bool:
    """At an epoch's end, on every rank: whether no rank had a batch in it
    (the Trainer then stops training). With fewer batches than ranks some
    rank has none while the others train: it goes on with them into the
    next epoch's windows, where stopping alone would leave them waiting."""
    if lengths is not None or not acc.stats()["data_parallel"]:
        return not had_data and (lengths is None or max(lengths) == 0)
    # Lengths unknown, data parallel: every rank asks the others here.
    group = acc.process_group
    device = device if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu")
    had = torch.tensor([int(had_data)], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(had, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(had.item()) == 0
