"""gradaccum.split: one batch into micro-batches."""
from typing import Any, List

import torch

from gradaccum import _C


def _flatten(batch: Any, leaves: List[torch.Tensor]) -> Any:
    """Collects the tensors of a nested batch; returns a template to rebuild it."""
    if isinstance(batch, torch.Tensor):
        leaves.append(batch)
        return len(leaves) - 1
    if isinstance(batch, dict):
        return {key: _flatten(value, leaves) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        parts = [_flatten(value, leaves) for value in batch]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*parts)
        return type(batch)(parts)
    raise TypeError(
        f"gradaccum: split(): cannot split a {type(batch).__name__}; a batch is a tensor, or "
        "tuples, lists and dicts of tensors"
    )


def _rebuild(template: Any, leaves: List[torch.Tensor]) -> Any:
    if isinstance(template, int):
        return leaves[template]
    if isinstance(template, dict):
        return {key: _rebuild(value, leaves) for key, value in template.items()}
    parts = [_rebuild(value, leaves) for value in template]
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*parts)
    return type(template)(parts)


def split(batch: Any, steps: int) -> list:
    """Splits a batch along dim 0 into `steps` micro-batches.

    `batch` is a tensor, or tuples/lists/dicts of tensors (nested), all with the
    same size along dim 0. Micro-batch sizes differ by at most one. The parts are
    views, not copies.

    >>> x, y = torch.randn(10, 3), torch.randn(10)
    >>> [tuple(m[0].shape) for m in gradaccum.split((x, y), 3)]
    [(4, 3), (3, 3), (3, 3)]
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"gradaccum: split(): steps must be an int, got {type(steps).__name__}")
    leaves: List[torch.Tensor] = []
    template = _flatten(batch, leaves)
    return [_rebuild(template, parts) for parts in _C.split(leaves, steps)]
