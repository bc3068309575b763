"""The HF Trainer adapter's count of input tokens seen.

Note [Tokens seen, once a window]
The Trainer counts input tokens (``include_num_input_tokens_seen``) with an
``accelerator.gather`` per micro-batch, a collective that the adapter's
shards, up to a batch apart, do not pair: the longer shard's last gather met
the other rank's ``flush()`` all-reduce, and Gloo aborted (review). Each rank
counts its own micro-batches' tokens as the Trainer does (its gather made the
identity: no collective), and the counts are summed over ranks with one
all-reduce of one int64 at each window's end, where every rank closes the
same windows (``flush()`` included), before the step's callbacks, logs and
checkpoints read ``state.num_input_tokens_seen``.
"""
from typing import Any

import torch
import transformers


class TokensSeen:
    def __init__(self) -> None:
        self._pending = 0  # this rank's tokens since the last window's end

    def count(self, trainer: Any, inputs: Any) -> None:
        """The Trainer's count of this micro-batch's tokens, this rank's own."""
        state, accelerator = trainer.state, trainer.accelerator
        before = state.num_input_tokens_seen
        accelerator.gather = lambda tensor: tensor  # (shadows the method until deleted)
        try:
            transformers.Trainer._track_num_input_tokens(trainer, inputs)
        finally:
            del accelerator.gather
        self._pending += state.num_input_tokens_seen - before
        state.num_input_tokens_seen = before

    def end_window(self, trainer: Any, group: Any) -> None:
        """Adds every rank's tokens since the last window's end (one
        all-reduce, data parallel) to ``state.num_input_tokens_seen``."""
        if trainer.args.include_num_input_tokens_seen == "no":
            return
        pending, self._pending = self._pending, 0
        if group is not None:
            total = torch.tensor([pending], dtype=torch.int64, device=trainer.args.device)
            torch.distributed.all_reduce(total, group=group)
            pending = int(total.item())
        trainer.state.num_input_tokens_seen += pending
