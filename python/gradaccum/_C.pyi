# Types of gradaccum._C, the pybind11 module built from
# python/gradaccum/csrc/bindings.cpp. Use the gradaccum package, not this module.
# tests/python/test_packaging.py checks this stub against the built module (mypy's stubtest).
from typing import Any, Callable, Dict, List, Optional

import torch

__version__: str

class Accumulator:
    expect_hooks: bool
    def __init__(
        self,
        params: List[torch.Tensor],
        names: List[str],
        buffers: List[torch.Tensor],
        *,
        steps: int,
        reduction: str,
        max_grad_norm: Optional[float],
        nonfinite: str,
        process_group: Optional[Any],
        local_only: bool,
        bucket_cap_mb: float,
        first_bucket_cap_mb: float,
        gradient_as_bucket_view: bool,
        broadcast_buffers: bool,
        check_parameters: bool,
        rebuild_buckets: bool,
        accumulate_dtype: Optional[torch.dtype],
        comm_dtype: Optional[torch.dtype],
        error_feedback: bool,
        optimizer_step: Optional[Callable[[], Any]],
        scheduler_step: Optional[Callable[[], Any]],
    ) -> None: ...
    def backward(self, loss: torch.Tensor, num_items: Optional[float] = None) -> None: ...
    def step(self) -> bool: ...
    def flush(self) -> bool: ...
    def zero_grad(self) -> None: ...
    @property
    def sync_gradients(self) -> bool: ...
    @property
    def micro_step(self) -> int: ...
    @property
    def window_ready(self) -> bool: ...
    def stats(self) -> Dict[str, Any]: ...
    def state_dict(self, rank_independent: bool = True) -> Dict[str, Any]: ...
    def close(self) -> None: ...
    def set_window_callbacks(self, before_step: Optional[Callable[[], bool]], after_window: Optional[Callable[[], None]]) -> None: ...
    @property
    def closed(self) -> bool: ...
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None: ...
    @property
    def bucket_indices(self) -> List[List[int]]: ...

def split(tensors: List[torch.Tensor], steps: int) -> List[List[torch.Tensor]]: ...
def nccl_available() -> bool: ...
