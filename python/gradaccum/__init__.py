"""gradaccum: gradient accumulation for PyTorch and LibTorch.

K micro-batches, one optimizer step, identical to the K-times batch; under data
parallelism one overlapped all-reduce per window instead of one per micro-batch.

    acc = gradaccum.Accumulator(model, optimizer, steps=8)
    for batch in loader:
        acc.backward(loss_fn(model(batch.x), batch.y))
        acc.step()          # steps the optimizer once every 8 micro-batches
    acc.flush()             # the partial last window

The installed package is also the C++ SDK: ``gradaccum.cmake_prefix_path`` (as
``torch.utils.cmake_prefix_path``) lets CMake's ``find_package(gradaccum)``
find its headers, ``libgradaccum`` and the ``gradaccum::gradaccum`` target.
"""
import os as _os
import re as _re


def _check_torch() -> None:
    """_C is bound to the C++ ABI of the torch it was compiled against: say so
    plainly, before importing it fails with an undefined symbol."""
    try:
        from gradaccum._build_info import TORCH_VERSION as built
    except ImportError:
        raise ImportError(
            "gradaccum: not built here (no gradaccum/_build_info.py): install it with "
            "`pip install --no-build-isolation .` and import the installed package"
        ) from None
    import torch

    def release_line(version: str) -> str:
        match = _re.match(r"\d+\.\d+", version)
        return match.group(0) if match else version

    if release_line(str(torch.__version__)) != release_line(built):
        raise ImportError(
            f"gradaccum: built against torch {built} but torch {torch.__version__} is "
            f"installed; its C++ extension works only with torch {release_line(built)}.*. "
            f"Install torch=={release_line(built)}.* or rebuild gradaccum against this torch: "
            "pip install --no-build-isolation --force-reinstall --no-deps ."
        )


_check_torch()

from gradaccum._accumulator import Accumulator, Optimizer  # noqa: E402
from gradaccum._split import split  # noqa: E402
from gradaccum import _C  # noqa: E402

__version__: str = _C.__version__

#: Directory to add to CMake's ``CMAKE_PREFIX_PATH`` (with
#: ``torch.utils.cmake_prefix_path``) so that ``find_package(gradaccum)``
#: finds this installation's headers, library and ``gradaccum::gradaccum``.
cmake_prefix_path: str = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "lib", "cmake")

from gradaccum import trace  # noqa: E402

__all__ = ["Accumulator", "Optimizer", "split", "trace", "cmake_prefix_path", "__version__"]
