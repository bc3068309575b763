"""Jobs of test_subgroups.py: Accumulators over process groups that are not
the world (hybrid parallelism: data-parallel pairs), on 4 real Gloo ranks."""
import torch
import torch.distributed as dist

import _dist_utils as du
from _dist_utils import job


def pair_windows(seed, pair, n_windows, steps):
    """Pair `pair`'s data: its own seed, `n_windows` full windows of 2 ranks."""
    return du.make_windows(seed + 10 * pair, du.full_counts(n_windows, 2, steps), 2)


@job
def two_pairs(rank, world_size, *, seed, steps, windows):
    """Global ranks {0, 1} and {2, 3} train apart, pair 1 one window more
    (no cross-talk); then each rank loads the other pair's rank with its own
    group rank's per-rank state (refused, nothing changed) and its own. On
    ranks 0 and 3, an Accumulator over the group {1, 2} they are not in."""
    import gradaccum

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    middle = dist.new_group([1, 2])
    pair = rank // 2
    out = {}
    if rank in (0, 3):
        try:
            gradaccum.Accumulator(du.mlp(seed), None, steps=steps, process_group=middle)
            out["non_member"] = None
        except ValueError as e:
            out["non_member"] = str(e)
    model = du.mlp(seed)
    acc = gradaccum.Accumulator(model, du.make_optimizer("sgd", model.parameters()), steps=steps,
                                process_group=pairs[pair])
    data = pair_windows(seed, pair, windows + pair, steps)
    for window in data:
        for batch in window[rank % 2]:
            acc.backward(du.micro_loss(model, batch, "mean")[0])
            acc.step()
    out["params"] = du.params(model)
    acc.backward(du.micro_loss(model, data[0][rank % 2][0], "mean")[0])  # half a window
    state = acc.state_dict(rank_independent=False)
    out["group_ranks"] = state.get("group_ranks")
    states = [None] * world_size
    dist.all_gather_object(states, state)
    held = [p.grad.clone() for p in model.parameters()]
    try:
        acc.load_state_dict(states[(rank + 2) % world_size])  # same group rank, the other pair
        out["wrong_load"] = None
    except ValueError as e:
        out["wrong_load"] = str(e)
    out["untouched"] = acc.micro_step == 1 and all(torch.equal(h, p.grad) for h, p in zip(held, model.parameters()))
    acc.load_state_dict(state)
    acc.close()
    return out
