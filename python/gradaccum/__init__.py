"""gradaccum: gradient accumulation for PyTorch and LibTorch.

K micro-batches, one optimizer step, identical to the K-times batch; under data
parallelism one overlapped all-reduce per window instead of one per micro-batch.

    acc = gradaccum.Accumulator(model, optimizer, steps=8)
    for batch in loader:
        acc.backward(loss_fn(model(batch.x), batch.y))
        acc.step()          # steps the optimizer once every 8 micro-batches
    acc.flush()             # the partial last window
"""
from gradaccum._accumulator import Accumulator
from gradaccum._split import split
from gradaccum import _C

__version__ = _C.__version__

__all__ = ["Accumulator", "split", "__version__"]
