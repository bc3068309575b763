"""Resume on another number of ranks, and with another `steps` at a window
boundary (Note [Resuming on another shape] in src/accumulator/checkpoint.cpp):
real Gloo ranks (one rank: a one-process Accumulator), against one process
over the same micro-batches in float64."""
import os

import pytest
import torch

import _dist_utils as du
import _resize_jobs as rj
import gradaccum

M = "_resize_jobs"


def run(name, world_size, tmp_path, **kwargs):
    return du.run_job(name, world_size, tmp_path / name, module=M, timeout=180, pg_timeout=30, **kwargs)


# (W, W', reduction, steps, steps at the boundary resume): 2 -> 1 with steps
# doubled keeps the global batch (Lightning's devices=2 -> 1 with
# accumulate_grad_batches doubled).
CASES = [(2, 1, "items", 4, 8), (1, 2, "mean", 4, 2), (2, 3, "items", 3, 3), (4, 2, "mean", 2, 4)]


@pytest.mark.parametrize("world,world2,reduction,steps,steps2", CASES,
                         ids=[f"{w}to{w2}-{r}" for w, w2, r, _, _ in CASES])
def test_a_run_resumes_on_another_number_of_ranks(tmp_path, world, world2, reduction, steps, steps2):
    windows_before, micro_step, windows_after, seed = 2, steps // 2 or 1, 2, 40 + world * 10 + world2
    # enough micro-batches for either schedule
    total = max(rj.schedule(world, steps, world2, s, windows_before, m, windows_after)[1]
                for s, m in ((steps2, 0), (steps, micro_step))) + world * steps
    ckpt_dir = str(tmp_path)
    run("save", world, tmp_path, seed=seed, reduction=reduction, steps=steps, windows_before=windows_before,
        micro_step=micro_step, total=total, ckpt_dir=ckpt_dir)
    results = run("resume", world2, tmp_path, seed=seed, reduction=reduction, world=world, steps=steps,
                  steps2=steps2, windows_before=windows_before, micro_step=micro_step,
                  windows_after=windows_after, total=total, ckpt_dir=ckpt_dir)
    for cut, m, k in (("boundary", 0, steps2), ("mid", micro_step, steps)):
        windows, _ = rj.schedule(world, steps, world2, k, windows_before, m, windows_after)
        expected = rj.reference(seed, reduction, windows, total)
        for rank, res in enumerate(results):
            got = res[cut]
            du.assert_params_close(got["params"], expected, f"{cut} resume, rank {rank}")
            assert got["micro_step"] == 0
            assert got["stepped"] == len(windows) - windows_before
            # the counters carry over: every window of the schedule was stepped once
            assert got["stats"]["optimizer_steps"] == len(windows)
            assert got["resumed"]["optimizer_steps"] == windows_before
            assert got["stats"]["windows"] == len(windows)


def _half_done_state(world_size=2, rank=1, rank_independent=False, **extra):
    """A per-rank state of a half-done window, as another job's rank saves it."""
    model, opt, acc = rj._build(3, 1, 4, "mean")
    for batch in rj.stream(3, 2):
        acc.backward(du.micro_loss(model, batch, "mean")[0])
    state = acc.state_dict()
    acc.close()
    model.zero_grad(set_to_none=True)  # the half window is in the state; a new Accumulator refuses it in .grad
    state.update(world_size=world_size, rank=rank, rank_independent=rank_independent, **extra)
    return model, state


def test_what_cannot_be_split_over_another_number_of_ranks_is_refused():
    model, state = _half_done_state()
    acc = gradaccum.Accumulator(model, None, steps=4, process_group=False)
    acc.backward(du.micro_loss(model, rj.stream(4, 1)[0], "mean")[0])
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): this is rank 1's own state of a "
                       r"half-done window \(acc\.state_dict\(rank_independent=False\)\), which holds only that "
                       r"rank's part of it, saved with world size 2; this Accumulator's group has 1 rank\(s\)\. "
                       r"Save with acc\.state_dict\(\) \(rank-independent\)"):
        acc.load_state_dict(state)
    assert acc.micro_step == 1
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    acc.close()
    # steps may change only at a boundary
    _, state = _half_done_state(rank_independent=True, rank=0)
    other = gradaccum.Accumulator(model, None, steps=8, process_group=False)
    with pytest.raises(ValueError, match=r"^gradaccum: acc\.load_state_dict\(\): the state was saved with steps=4 "
                       r"in the middle of a window \(micro_step=2\) but this Accumulator has steps=8; resume with "
                       r"steps=4, or save at a window boundary"):
        other.load_state_dict(state)
    assert other.micro_step == 0
    with pytest.raises(ValueError, match=r"rank=2 and world_size=2 do not describe a rank"):
        other.load_state_dict(dict(state, rank=2, micro_step=0, window_weight=0.0, grads=[None] * len(grads)))
    other.close()


def test_a_half_done_window_saved_on_two_ranks_resumes_in_one_process_exactly():
    """In-process: rank 0's rank-independent state of 2 ranks (each holding
    half of the window's sum and weight), loaded without a group, closes with
    the mean over all 2*m + (K - m) micro-batches."""
    steps, seed = 4, 5
    batches = rj.stream(seed, 2 * 2 + 2)
    ref = du.mlp(seed)
    du.global_batch_loss(ref, [batches], "mean").backward()
    model = du.mlp(seed)
    # The state as 2 ranks save it: 1/2 of the sum of 4 micro-batch mean-gradients, weight 4/2.
    probe2 = du.mlp(seed)
    for b in batches[:4]:
        du.micro_loss(probe2, b, "mean")[0].backward()
    state = {"steps": steps, "reduction": "mean", "world_size": 2, "rank": 0, "rank_independent": True,
             "micro_step": 2, "window_ready": False, "window_weight": 2.0,
             "grads": [p.grad / 2 for p in probe2.parameters()]}
    acc = gradaccum.Accumulator(model, None, steps=steps, process_group=False)
    full = acc.state_dict()
    full.update(state)
    acc.load_state_dict(full)
    for b in batches[4:]:
        acc.backward(du.micro_loss(model, b, "mean")[0])
    assert acc.micro_step == 0
    for p, r in zip(model.parameters(), ref.parameters()):
        assert (p.grad - r.grad).abs().max().item() <= 1e-15


def test_a_ranks_own_boundary_state_loads_on_every_rank(tmp_path):
    """A rank's own state saved at a boundary holds nothing of that rank's
    (no residuals, no ended epoch). Loaded on every rank of the same world
    size, it was refused on the other rank only ("this is rank 1's own
    state ... but this is rank 0"), which then went on alone, while on another
    world size it loaded everywhere (review). It loads everywhere, and the
    run is the big batch's in float64."""
    results = du.run_job("own_boundary_state_on_every_rank", 2, tmp_path, module=M, ckpt_dir=str(tmp_path),
                         timeout=120)
    data = rj.stream(5, 16)
    windows = [[[data[(w * 2 + k) * 2 + r] for k in range(2)] for r in range(2)] for w in range(4)]
    model = du.mlp(5)
    expected = du.reference_run(model, du.make_optimizer("sgd", model.parameters()), windows, "mean")["params"]
    for rank, res in enumerate(results):
        assert res["outcome"] == "loaded", (rank, res["outcome"])
        assert res["stats"]["optimizer_steps"] == 4
        du.assert_params_close(res["params"], expected, f"rank {rank}")
