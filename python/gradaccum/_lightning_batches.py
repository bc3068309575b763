"""Note [Every rank trains as many batches]
Lightning (2.6) broadcasts a flag at every training batch (its SIGTERM
check) and synchronises its epoch-end metrics, so ranks with different
numbers of training batches wait for each other with no error, under its own
DDP strategy as under GradaccumStrategy (review: rank 0 with 5 batches and
rank 1 with 4 hung). Lightning's DistributedSampler pads the shards to one
length; a sampler of the script's own (``use_distributed_sampler=False``)
may not. When training starts, and at every later epoch's first batch where
the Trainer reloads dataloaders (``reload_dataloaders_every_n_epochs`` set: a
rank's number may change at a reload), one small all-reduce compares every
rank's number of batches, and every rank raises where they differ. (A rank
whose reloaded loader is empty starts no batch: Lightning ends its fit there,
under its own DDP strategy too, and the others wait.)
"""
from typing import Any, Optional

import torch


def check_equal_batches(trainer: Any, group: Any, device: torch.device, batch_idx: Optional[int] = None) -> None:
    """Raises on every rank where the ranks' numbers of training batches
    differ (a collective: every rank calls it when training starts, with no
    ``batch_idx``, and at every batch, where it checks the first batch of an
    epoch after a reload of the dataloaders)."""
    if batch_idx is not None and (batch_idx != 0 or not trainer.reload_dataloaders_every_n_epochs
                                  or trainer.current_epoch == 0):
        return
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size(group) == 1:
        return
    mine = float(trainer.num_training_batches)  # (inf: a loader without a length, alike everywhere)
    extremes = torch.tensor([mine, -mine], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX, group=group)
    most, fewest = extremes[0].item(), -extremes[1].item()
    if most != fewest:
        raise RuntimeError(
            f"gradaccum: GradaccumStrategy: the ranks have different numbers of training batches in epoch "
            f"{trainer.current_epoch} ({fewest:g} to {most:g}; this rank {mine:g}): Lightning synchronises the "
            "ranks at every batch and at the epoch's end, so they would wait for each other with no error (under "
            "its DDP strategy too). Give every rank as many batches: Lightning's DistributedSampler "
            "(use_distributed_sampler=True, the default) pads the shards to one length; pad your own sampler's "
            "alike")
