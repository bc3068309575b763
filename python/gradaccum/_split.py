"""gradaccum.split: one batch into micro-batches."""
import copy
import numbers
from collections.abc import Mapping, MutableMapping
from typing import Any, Dict, List, NamedTuple

import torch

from gradaccum import _C


class _Tensor(NamedTuple):
    index: int  # into the tensors


class _Samples(NamedTuple):
    index: int  # into the per-sample lists


class _Same(NamedTuple):
    value: Any  # repeated in every micro-batch


class _Mapping(NamedTuple):
    """A mapping other than a plain dict (Hugging Face's BatchEncoding and
    BatchFeature, an OrderedDict...): rebuilt as its own type."""
    original: Mapping
    entries: Dict[Any, Any]  # key: template


class _Leaves:
    """What a batch holds to split: tensors (along dim 0) and lists of
    per-sample values (strings, ids...), with where each came from."""

    def __init__(self) -> None:
        self.tensors: List[torch.Tensor] = []
        self.samples: List[list] = []
        self.paths: List[str] = []  # of the samples, for errors


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(v) for v in value)
    return False


def _flatten(batch: Any, leaves: _Leaves, path: str = "batch") -> Any:
    """Collects what a nested batch holds to split; returns a template to
    rebuild it (see split() for the rules)."""
    if isinstance(batch, torch.Tensor):
        if batch.is_nested or batch.layout != torch.strided:  # (narrow() fails in torch, or a part's first use)
            kind = "a nested tensor" if batch.is_nested else f"layout {batch.layout}"
            raise ValueError(f"gradaccum: split(): {path} is {kind}; only dense (strided) tensors split into views: "
                             "pass a dense (padded) tensor, or split the samples yourself")
        if batch.dim() == 0:
            raise ValueError(f"gradaccum: split(): {path} is a 0-dim tensor; it has no dim 0 to split along")
        leaves.tensors.append(batch)
        return _Tensor(len(leaves.tensors) - 1)
    if isinstance(batch, Mapping):
        entries = {key: _flatten(value, leaves, f"{path}[{key!r}]") for key, value in batch.items()}
        return entries if type(batch) is dict else _Mapping(batch, entries)
    if hasattr(batch, "__array__") and len(getattr(batch, "shape", ())) > 0:
        # Rows of its own, but not a tensor: repeating it whole would be wrong.
        raise TypeError(f"gradaccum: split(): cannot split a {type(batch).__name__} ({path}); convert it to a "
                        "tensor (torch.as_tensor)")
    if isinstance(batch, list) and not _holds_tensor(batch):  # (an empty one too: it has 0 values, not the rows)
        leaves.samples.append(batch)
        leaves.paths.append(path)
        return _Samples(len(leaves.samples) - 1)
    if isinstance(batch, (list, tuple)) and _holds_tensor(batch):
        parts = [_flatten(value, leaves, f"{path}[{i}]") for i, value in enumerate(batch)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return type(batch)(*parts)
        return type(batch)(parts)
    return _Same(batch)


def _rebuild(template: Any, tensors: List[torch.Tensor], samples: List[list]) -> Any:
    if isinstance(template, _Tensor):
        return tensors[template.index]
    if isinstance(template, _Samples):
        return samples[template.index]
    if isinstance(template, _Same):
        return template.value
    if isinstance(template, dict):
        return {key: _rebuild(value, tensors, samples) for key, value in template.items()}
    if isinstance(template, _Mapping):
        return _like(template.original,
                     {key: _rebuild(value, tensors, samples) for key, value in template.entries.items()})
    parts = [_rebuild(value, tensors, samples) for value in template]
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*parts)
    return type(template)(parts)


def _like(original: Mapping, items: Dict[Any, Any]) -> Mapping:
    """A mapping of `original`'s type holding `items`: built from them (a
    BatchEncoding then keeps no tokenizer alignment of the whole batch, which
    would be wrong for a part), else a copy emptied and refilled (a
    defaultdict keeps its factory), else a plain dict."""
    try:
        built = type(original)(items)
        if isinstance(built, Mapping) and len(built) == len(items):
            return built
    except Exception:  # a constructor that takes no mapping
        pass
    if isinstance(original, MutableMapping):
        try:
            refilled = copy.copy(original)
            refilled.clear()
            refilled.update(items)
            return refilled
        except Exception:
            pass
    return dict(items)


def split(batch: Any, steps: int) -> list:
    """Splits a batch along dim 0 into `steps` micro-batches.

    `batch` is a tensor, or tuples/lists/dicts (any mapping: a Hugging Face
    ``BatchEncoding`` stays one) of them, nested, all with the same size along
    dim 0. Micro-batch sizes differ by at most one (the first
    ones take the extra rows); tensor parts are views, not copies. Other
    fields, as a Hugging Face batch carries them, pass through:

    - a list holding no tensor (strings, ids: one value per sample) is split
      alongside the tensors, into lists of the same sizes; its length must be
      the batch's rows (a ValueError names it otherwise);
    - anything else that holds no tensor (a string, a number, None, a tuple
      such as an image size) is repeated in every micro-batch.

    >>> x, y = torch.randn(10, 3), torch.randn(10)
    >>> [tuple(m[0].shape) for m in gradaccum.split((x, y), 3)]
    [(4, 3), (3, 3), (3, 3)]
    >>> [m["text"] for m in gradaccum.split({"ids": torch.arange(3), "text": ["a", "b", "c"]}, 2)]
    [['a', 'b'], ['c']]
    """
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):  # as Accumulator(steps=)
        raise TypeError(f"gradaccum: split(): steps must be an int, got {type(steps).__name__}")
    steps = int(steps)  # numpy's integers too
    if not -2**63 <= steps < 2**63:  # (what the C++ side takes: as Accumulator(steps=))
        raise ValueError(f"gradaccum: split(): steps must be a positive int below 2**63, got {steps}")
    leaves = _Leaves()
    template = _flatten(batch, leaves)
    if not leaves.tensors and not leaves.samples:
        raise ValueError("gradaccum: split(): the batch holds no tensor and no list of samples to split")
    if leaves.tensors:
        tensor_parts = _C.split(leaves.tensors, steps)  # checks the tensors and steps
        sizes = [int(part[0].shape[0]) for part in tensor_parts]
    else:
        rows = len(leaves.samples[0])
        if steps <= 0 or steps > rows:
            raise ValueError(f"gradaccum: split(): cannot split {rows} rows into {steps} micro-batches"
                             if steps > 0 else f"gradaccum: split(): steps must be positive, got {steps}")
        sizes = [rows // steps + (1 if k < rows % steps else 0) for k in range(steps)]
        tensor_parts = [[] for _ in sizes]
    rows = sum(sizes)
    for values, path in zip(leaves.samples, leaves.paths):
        if len(values) != rows:
            raise ValueError(
                f"gradaccum: split(): {path} is a list of {len(values)} values, but the batch has {rows} rows: "
                "a list without tensors is split alongside them, one value per row (make it a tuple to repeat "
                "it in every micro-batch)")
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [_rebuild(template, list(tensors), [values[start:start + size] for values in leaves.samples])
            for tensors, start, size in zip(tensor_parts, starts, sizes)]
