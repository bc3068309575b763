"""The Accumulator's state dicts on the Python side: the C++ state (Note [The
checkpoint schema]) plus what only Python knows, the GradScaler's state and,
in per-rank states, the global ranks of the process group."""
from typing import Any, Dict, Optional

from gradaccum._checks import (
    _check_scaler_setting,
    _check_scaler_state,
    _group_ranks,
    _saved_scaled,
    _scaling,
)


def save_state(native: Any, grad_scaler: Optional[Any], process_group: Any,
               rank_independent: bool) -> Dict[str, Any]:
    """Accumulator.state_dict(): `native` is its C++ side."""
    if not isinstance(rank_independent, bool):  # ("False" is true: a collective where none was meant)
        raise TypeError(f"gradaccum: acc.state_dict(): rank_independent must be a bool, got {rank_independent!r}")
    state = native.state_dict(rank_independent)
    if not state["rank_independent"]:
        ranks = _group_ranks(process_group)
        if ranks is not None:
            state["group_ranks"] = ranks
    if grad_scaler is not None:
        state["grad_scaler"] = grad_scaler.state_dict()
    return state


def load_state(native: Any, grad_scaler: Optional[Any], process_group: Any, state_dict: Any) -> None:
    """Accumulator.load_state_dict(), all or nothing: every check first, the
    scaler's state before the C++ state, and put back if that is refused."""
    if native.closed:  # (before the state's own checks: no state can be loaded)
        raise RuntimeError("gradaccum: acc.load_state_dict(): this Accumulator was closed")
    if not isinstance(state_dict, dict):
        raise TypeError(f"gradaccum: acc.load_state_dict(): expected a dict, got {type(state_dict).__name__}")
    _check_group_ranks(process_group, state_dict)
    _check_scaler_setting(grad_scaler, state_dict)
    load_scaler = _scaling(grad_scaler) and _saved_scaled(state_dict)
    if load_scaler:
        _check_scaler_state(state_dict["grad_scaler"])
        # The scaler first, the C++ state last: a C++ rejection puts it back.
        previous = grad_scaler.state_dict()
        try:
            grad_scaler.load_state_dict(state_dict["grad_scaler"])
        except BaseException:
            grad_scaler.load_state_dict(previous)
            raise
    try:
        native.load_state_dict(state_dict)
    except BaseException:
        if load_scaler:
            grad_scaler.load_state_dict(previous)
        raise


def _check_group_ranks(process_group: Any, state_dict: Dict[str, Any]) -> None:
    """A per-rank state names the global ranks of the group it was saved in
    (save_state()): with subgroups, group rank r of another group passes the
    C++ side's rank check, and its half-done window is that group's. A group
    of another size is the C++ side's to judge."""
    saved = state_dict.get("group_ranks")
    if saved is None or state_dict.get("rank_independent") is not False:
        return
    if not isinstance(saved, (list, tuple)) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                       for r in saved):
        raise ValueError(f"gradaccum: acc.load_state_dict(): 'group_ranks' must be a list of global ranks, "
                         f"got {saved!r}")
    mine = _group_ranks(process_group)
    if mine is None or len(mine) != len(saved) or list(saved) == mine:
        return
    raise ValueError(f"gradaccum: acc.load_state_dict(): this is a rank's own state "
                     f"(acc.state_dict(rank_independent=False)) saved in the process group of global ranks "
                     f"{list(saved)}, but this Accumulator's group is global ranks {mine}: its counters, "
                     f"half-done window and residuals are the other group's. Load the state this rank saved, "
                     f"or save with acc.state_dict() (rank-independent) to load one state on every rank; "
                     f"if this is the same group under other global ranks (renumbered on purpose), delete "
                     f"'group_ranks' from the state")
