"""Every error of load_state_dict() in one process: its type, a message naming
the key, and that a rejected state changes nothing (the window, the counters,
the gradients)."""

import pytest

import gradaccum
from _grad_checks import assert_grads_equal, loss_of, make_data, make_model, snapshot_grads


# load_state_dict -------------------------------------------------------------------

STATE_KEYS = ["steps", "reduction", "world_size", "rank", "rank_independent", "micro_step",
              "window_ready", "window_weight", "epoch_ended", "micro_steps", "optimizer_steps",
              "skipped_steps", "windows", "reducer", "reducer_sequence", "loss_scale",
              "loss_scale_growth_tracker", "grads"]
# Optional: states saved before it was kept load without it (as 0).
OPTIONAL_STATE_KEYS = ["reducer_last_weight", "reducer_residual_weight", "skipped_micro_batches", "window_loss_sums",
                       "window_empty", "window_unscaled", "window_clipped", "window_shared", "parameter_names",
                       "window_raised_nonfinite", "window_closed_by_flush", "window_metric_names"]


@pytest.fixture
def mid_window():
    """An Accumulator (K=4) one micro-step into a window, with its state dict."""
    model = make_model()
    acc = gradaccum.Accumulator(model, steps=4)
    x, y = make_data()
    acc.backward(loss_of(model, x, y))
    return model, acc, acc.state_dict()


def check_untouched(model, acc, grads):
    assert_grads_equal(model, grads)
    assert acc.micro_step == 1
    assert not acc.window_ready
    assert acc.state_dict()["window_weight"] == 1.0


def test_state_dict_keys(mid_window):
    _, _, state = mid_window
    assert sorted(state) == sorted(STATE_KEYS + OPTIONAL_STATE_KEYS)


def test_every_state_key_is_in_the_docs_table(mid_window):
    """docs/checkpoints.md's "What a state holds" names every key (the ones of
    data parallel, error feedback and a grad_scaler too), and no other."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    table = text.split("## What a state holds", 1)[1].split("\n## ", 1)[0]
    documented = set()
    for row in table.splitlines()[1:]:
        if row.startswith("| `"):
            documented |= set(re.findall(r"`([a-z_]+)`", row.split(" | ")[0]))
    extra = {"group_ranks", "error_feedback_residuals", "grad_scaler"}  # (per-rank, error feedback, a scaler)
    assert documented == set(STATE_KEYS + OPTIONAL_STATE_KEYS) | extra, documented ^ (set(STATE_KEYS) | extra)


def test_load_state_dict_without_optional_keys(mid_window):
    model, acc, state = mid_window
    old = {k: v for k, v in state.items() if k not in OPTIONAL_STATE_KEYS}
    acc.load_state_dict(old)
    assert acc.micro_step == 1


@pytest.mark.parametrize("where,key", [("", "bogus"), ("", 3), ("reducer", "sequence2")])
def test_load_state_dict_unknown_key(mid_window, where, key):
    """Review: unknown keys were ignored: a newer version's field (or a dict
    that is not an Accumulator's state) loaded silently."""
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    (state[where] if where else state)[key] = 1
    name = f"{where}.{key}" if where else str(key)
    with pytest.raises(ValueError, match=rf"^gradaccum: acc.load_state_dict\(\): unknown key\(s\) '{name}': no "
                                         r"state of this version of gradaccum holds them"):
        acc.load_state_dict(state)
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("key", STATE_KEYS)
def test_load_state_dict_missing_key(mid_window, key):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    bad = dict(state)
    del bad[key]
    with pytest.raises(ValueError, match=f"'{key}'"):
        acc.load_state_dict(bad)
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("key,value", [
    ("steps", "4"), ("steps", 4.0), ("micro_step", "1"), ("micro_step", None),
    ("window_ready", "yes"), ("window_weight", "1.0"), ("window_weight", None),
    ("micro_steps", 1.5), ("optimizer_steps", "0"), ("skipped_steps", None), ("windows", []),
    ("grads", 5), ("grads", None), ("micro_steps", True), ("windows", False),
    ("window_weight", True), ("rank_independent", 1), ("reducer", None),
    ("parameter_names", "0.weight"), ("parameter_names", [0, 1, 2, 3]),
])
def test_load_state_dict_wrong_type(mid_window, key, value):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match=f"'{key}'"):
        acc.load_state_dict({**state, key: value})
    check_untouched(model, acc, grads)


def test_load_state_dict_grads_hold_non_tensor(mid_window):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match="grads"):
        acc.load_state_dict({**state, "grads": [1.0] * len(state["grads"])})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("delta", [-1, 1])
def test_load_state_dict_wrong_number_of_grads(mid_window, delta):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    g = list(state["grads"])
    g = g[:-1] if delta < 0 else g + [None]
    with pytest.raises(ValueError, match="gradients"):
        acc.load_state_dict({**state, "grads": g})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("how", ["meta", "sparse"])
def test_load_state_dict_grad_without_dense_values(mid_window, how):
    """Refused before anything changes: copying a meta tensor fails only
    once the load has begun (it used to clear the window's gradients)."""
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    g = list(state["grads"])
    g[0] = g[0].to("meta") if how == "meta" else g[0].to_sparse()
    layout, device = ("Strided", "meta") if how == "meta" else ("Sparse", "cpu")
    with pytest.raises(ValueError, match=rf"^gradaccum: acc.load_state_dict\(\): gradient 0 is a {layout} tensor on "
                                         rf"{device}; a state's gradients are dense tensors holding values"):
        acc.load_state_dict({**state, "grads": g})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("how", ["swapped", "transposed", "dtype"])
def test_load_state_dict_wrong_grad_shape_or_dtype(mid_window, how):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    g = list(state["grads"])
    if how == "swapped":
        g[0], g[1] = g[1], g[0]
    elif how == "transposed":
        g[0] = g[0].t().contiguous()
    else:
        g[0] = g[0].float()
    with pytest.raises(ValueError, match="gradient 0"):
        acc.load_state_dict({**state, "grads": g})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("micro_step", [-1, 4, 100])
def test_load_state_dict_micro_step_out_of_range(mid_window, micro_step):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match="micro_step"):
        acc.load_state_dict({**state, "micro_step": micro_step})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_load_state_dict_steps_mismatch(mid_window, steps):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match="steps"):
        acc.load_state_dict({**state, "steps": steps})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("key,value", [
    ("window_weight", -1.0), ("window_weight", float("nan")), ("window_weight", float("inf")),
    ("micro_steps", -1), ("optimizer_steps", -1), ("skipped_steps", -2), ("windows", -1),
])
def test_load_state_dict_negative_values(mid_window, key, value):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match=key if key == "window_weight" else "counters"):
        acc.load_state_dict({**state, key: value})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("value", [[1, 2], None, "state"])
def test_load_state_dict_not_a_dict(mid_window, value):
    model, acc, _ = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(TypeError, match="dict"):
        acc.load_state_dict(value)
    check_untouched(model, acc, grads)




@pytest.mark.parametrize("key", ["window_empty", "window_unscaled", "window_clipped", "window_raised_nonfinite",
                                 "window_closed_by_flush"])
def test_load_state_dict_closed_window_flags_need_a_closed_window(mid_window, key):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): window_empty, window_unscaled, "
                       r"window_clipped, window_raised_nonfinite or window_closed_by_flush without window_ready "
                       r"\(they describe a closed window\)$"):
        acc.load_state_dict({**state, key: True})
    check_untouched(model, acc, grads)
    with pytest.raises(ValueError, match=r"skipped_micro_batches=-1 must be >= 0"):
        acc.load_state_dict({**state, "skipped_micro_batches": -1})
    # (a one-process state is rank-independent: a shared window is a per-rank state's)
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): window_shared=true describes a "
                       r"per-rank state in the middle of a window \(rank_independent=false, micro_step > 0\)$"):
        acc.load_state_dict({**state, "window_shared": True})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("key", ["reducer_last_weight", "reducer_residual_weight"])
@pytest.mark.parametrize("value", [-1.0, float("nan")])
def test_load_state_dict_refuses_a_negative_or_nan_reducer_weight(mid_window, key, value):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match=rf"^gradaccum: acc\.load_state_dict\(\): {key}=(-1|nan) must be >= 0$"):
        acc.load_state_dict({**state, key: value})
    check_untouched(model, acc, grads)


@pytest.mark.parametrize("key", ["windows", "dropped_windows", "collectives", "bytes_reduced", "broadcasts",
                                 "snapshots"])
def test_load_state_dict_refuses_negative_reducer_counters(mid_window, key):
    model, acc, state = mid_window
    grads = snapshot_grads(model)
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): counters must be >= 0$"):
        acc.load_state_dict({**state, "reducer": {**state["reducer"], key: -1}})
    check_untouched(model, acc, grads)
