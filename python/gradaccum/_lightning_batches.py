"""Note [Every rank trains as many batches]
Lightning (2.6) broadcasts a flag at every training batch (its SIGTERM
check) and synchronises its epoch-end metrics, so ranks with different
numbers of training batches wait for each other with no error, under its own
DDP strategy as under GradaccumStrategy (review: rank 0 with 5 batches and
rank 1 with 4 hung). Lightning's DistributedSampler pads the shards to one
length; a sampler of the script's own (``use_distributed_sampler=False``)
may not. When training starts, one small all-reduce compares every rank's
number of batches, and every rank raises where they differ.
"""
from typing import Any

import torch


def check_equal_batches(trainer: Any, group: Any, device: torch.device) -> None:
    """Raises on every rank where the ranks' numbers of training batches
    differ (a collective: every rank calls it when training starts)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return
    mine = float(trainer.num_training_batches)  # (inf: a loader without a length, alike everywhere)
    extremes = torch.tensor([mine, -mine], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    most, fewest = extremes[0].item(), -extremes[1].item()
    if most != fewest:
        raise RuntimeError(
            f"gradaccum: GradaccumStrategy: the ranks have different numbers of training batches ({fewest:g} to "
            f"{most:g}; this rank {mine:g}): Lightning synchronises the ranks at every batch and at the epoch's end, "
            "so they would wait for each other with no error (under its DDP strategy too). Give every rank as many "
            "batches: Lightning's DistributedSampler (use_distributed_sampler=True, the default) pads the shards to "
            "one length; pad your own sampler's alike")
