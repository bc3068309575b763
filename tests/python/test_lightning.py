"""gradaccum.lightning.GradaccumStrategy under Lightning's own launcher: 2 CPU
ranks, Gloo, `Trainer(strategy=GradaccumStrategy(), devices=2,
accumulate_grad_batches=K)`, against one process on the big batches (float64).

All scenarios run in one launch of `_lightning_worker.py` (importing Lightning
is the slow part); each test reads its scenario's per-rank results.
"""
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _lightning_worker as worker  # noqa: E402

pytestmark = pytest.mark.slow

F64 = 1e-10  # relative, float64


def reference(name, **extra):
    cfg = {k: v for k, v in worker.SCENARIOS[name].items()
           if k in ("kind", "reduction", "optimizer", "batches_per_rank", "steps", "epochs", "clip", "schedule",
                    "unfreeze_epoch")}
    return worker.reference(**dict(cfg, **extra))


def max_rel(params, ref):
    return max(float((p - r).abs().max() / r.abs().max()) for p, r in zip(params, ref))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(var, None)
    def devices(name):
        return worker.SCENARIOS[name].get("devices", worker.WORLD)

    # One launch per device count, in the order their checkpoints need
    # (worker.launch): a 1-device run that saves, the 2-device launch, the
    # 1-device resumes.
    for n in sorted({worker.launch(name) for name in worker.SCENARIOS}):
        names = [name for name in worker.SCENARIOS if worker.launch(name) == n]
        cmd = [sys.executable, str(HERE / "_lightning_worker.py"), str(out), *names]
        try:
            proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"the Lightning run hung:\n{e.stdout}\n{e.stderr}")
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"

    def load(name):
        return [torch.load(out / f"{name}.rank{r}.pt", weights_only=False) for r in range(devices(name))]

    return load


def ok(results):
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}"
    return results


def test_partial_last_window_is_weighted_by_what_it_holds(runs):
    # 5 batches per rank and K = 3: windows of 3 and 2 batches, two epochs
    ref, _ = reference("partial")
    for r in ok(runs("partial")):
        assert r["wrapped_in"] == ["Net"]  # never wrapped in DistributedDataParallel
        assert max_rel(r["params"], ref) < F64
        assert r["stats"]["optimizer_steps"] == 4 and r["stats"]["micro_steps"] == 10
    # Lightning's own DDP + accumulation weights the partial window by 2/3
    # (Lightning-AI/pytorch-lightning#19987): it misses the big batch, and
    # matches the reference that divides the partial window by K.
    ddp = ok(runs("partial_ddp"))[0]
    assert ddp["wrapped_in"] == ["DistributedDataParallel"]
    assert max_rel(ddp["params"], ref) > 1e-3
    divided, _ = reference("partial", divide_partial_by_k=True)
    assert max_rel(ddp["params"], divided) < F64


def test_on_before_optimizer_step_sees_the_windows_final_gradient(runs):
    """Lightning's on_before_optimizer_step hooks run inside step()/flush(), on
    the reduced, divided window gradient (the partial windows too), as the
    optimizer then sees it."""
    norms = []
    reference("partial", grad_norms=norms)
    for r in ok(runs("partial")):
        assert len(r["hook_norms"]) == len(norms) == 4
        for got, want in zip(r["hook_norms"], norms):
            assert abs(got - want) <= F64 * want, (r["hook_norms"], norms)


def test_items_is_the_exact_per_item_mean_with_no_extra_collective(runs):
    ref, _ = reference("items")
    for r in ok(runs("items")):
        assert max_rel(r["params"], ref) < F64
        stats = r["stats"]
        # the item count rides in the gradient bucket: one collective per bucket per window
        assert stats["collectives"] == stats["reductions"] * stats["buckets"] == 4


@pytest.mark.parametrize("name", ["partial", "items"])
def test_train_loss_is_each_windows_global_loss(runs, name):
    """The strategy logs acc.window_loss as train_loss at each optimizer step:
    the loss of the window's big batch over both ranks (the partial window's
    too), the same on every rank, with no sync_dist and no extra collective."""
    losses = []
    reference(name, losses=losses)
    steps = worker.SCENARIOS[name]["steps"]
    per_rank = worker.SCENARIOS[name]["batches_per_rank"]
    for r in ok(runs(name)):
        ends = {(epoch, (w + 1) * steps - 1 if (w + 1) * steps <= per_rank else per_rank - 1): loss
                for epoch, w, loss in losses}
        logged = {(epoch, batch): value for epoch, batch, value in r["logged_losses"] if (epoch, batch) in ends}
        assert len(logged) == len(ends) == 4, r["logged_losses"]
        for key, want in ends.items():
            assert abs(logged[key] - want) <= 1e-12 * max(1.0, abs(want)), (key, logged[key], want)
        assert r["stats"]["collectives"] == r["stats"]["reductions"] * r["stats"]["buckets"]


def test_train_loss_on_a_bf16_wire_is_summed_from_each_ranks_share(runs):
    """A bf16 wire carries no loss (window_loss is None): each rank logs its
    share of the window's loss with sync_dist (reduce_fx "sum"). The first
    window's (the parameters still the reference's) is the reference's to
    float64 rounding; the later ones follow the bf16 wire's own trajectory
    (before: nothing was logged)."""
    losses = []
    reference("partial", losses=losses)
    steps, per_rank = worker.SCENARIOS["partial_comm"]["steps"], worker.SCENARIOS["partial_comm"]["batches_per_rank"]
    ends = {(epoch, (w + 1) * steps - 1 if (w + 1) * steps <= per_rank else per_rank - 1): loss
            for epoch, w, loss in losses}
    first = min(ends)
    for r in ok(runs("partial_comm")):
        logged = {(epoch, batch): value for epoch, batch, value in r["logged_losses"] if (epoch, batch) in ends}
        assert len(logged) == len(ends) == 4 and None not in logged.values(), r["logged_losses"]
        assert abs(logged[first] - ends[first]) <= 1e-12 * abs(ends[first]), (logged[first], ends[first])
        for key, want in ends.items():
            assert abs(logged[key] - want) <= 2e-2 * abs(want), (key, logged[key], want)


def test_a_window_dropped_at_an_epoch_cut_leaves_no_loss_behind(runs):
    """Epoch 0 is cut one micro-batch into its first window (on_train_batch_start
    returns -1): the strategy drops the window, no step ran, and epoch 1's first
    window logs its own loss at the initial parameters, on the bf16 wire too
    (before, the dropped micro-batch's loss was left in that rank's share)."""
    cfg = worker.SCENARIOS["cut_comm"]
    rows = worker.windows(cfg["batches_per_rank"], cfg["steps"], 1)[0]
    with torch.no_grad():
        want = worker.window_loss(worker.mlp(torch.float64), worker.dataset("plain", cfg["batches_per_rank"]), rows,
                                  "mean").item()
    for r in ok(runs("cut_comm")):
        logged = {(epoch, batch): value for epoch, batch, value in r["logged_losses"]}
        assert logged[(0, 0)] is None and abs(logged[(1, 2)] - want) <= 1e-12 * want, (r["logged_losses"], want)


def test_nonfinite_window_skipped_clipped_once_scheduler_only_on_real_steps(runs):
    # a NaN on rank 1 in epoch 0's first window: skipped on both ranks; the
    # other three windows clipped once (to 0.05) and stepped, LambdaLR with them
    ref, scheduler_steps = reference("skip_clip", skip={(0, 0)})
    assert scheduler_steps == 3
    for r in ok(runs("skip_clip")):
        assert max_rel(r["params"], ref) < F64
        assert r["stats"]["skipped_steps"] == 1 and r["stats"]["optimizer_steps"] == 3
        assert r["scheduler_steps"] == 3  # Lightning alone would have stepped it 4 times
        assert r["stats"]["last_grad_norm"] > 0.05  # so the clipping did act


def test_bf16_mixed_trains(runs):
    ref, _ = reference("bf16", dtype=torch.float32)
    init = [p.detach() for p in worker.mlp(torch.float32).parameters()]
    for r in ok(runs("bf16")):
        assert r["output_dtypes"] == ["torch.bfloat16"]  # autocast was on
        moved = max(float((p - q).abs().max()) for p, q in zip(ref, init))
        error = max(float((p - q).abs().max()) for p, q in zip(r["params"], ref))
        assert moved > 0.05 and error < moved / 10, (moved, error)


def test_bf16_mixed_with_bf16_communication(runs):
    """GradaccumStrategy(comm_dtype=torch.bfloat16): the float32 gradients go on
    the wire in bf16, half the bytes, and training lands where bf16-mixed does."""
    ref, _ = reference("bf16", dtype=torch.float32)
    init = [p.detach() for p in worker.mlp(torch.float32).parameters()]
    full = ok(runs("bf16"))[0]["stats"]
    for r in ok(runs("bf16_comm")):
        moved = max(float((p - q).abs().max()) for p, q in zip(ref, init))
        error = max(float((p - q).abs().max()) for p, q in zip(r["params"], ref))
        assert moved > 0.05 and error < moved / 10, (moved, error)
        stats = r["stats"]
        assert stats["last_window_collectives"] == stats["buckets"]
        # The gradients take 2 bytes each instead of 4; the rest is the buckets'
        # meta (a tiny model here, so the meta is a large part of the bytes):
        # float32 on the full wire, 45 header fields and a flag per parameter
        # (Note [Bucket meta layout]); digits of the integer fields on the bf16 wire
        # (one each for the 0-or-1 counts): 104 bf16 values per bucket on 2 ranks
        # (docs/mixed-precision.md).
        numel = sum(p.numel() for p in r["params"])
        meta_full = full["last_window_bytes"] - 4 * numel
        meta_half = stats["last_window_bytes"] - 2 * numel
        assert meta_full == 4 * (45 * full["buckets"] + len(r["params"]))
        assert meta_half == 2 * (104 * stats["buckets"] + len(r["params"]))


def test_16_mixed_trains_through_the_accumulators_grad_scaler(runs):
    """Lightning's MixedPrecision("16-mixed") plugin: its GradScaler becomes the
    Accumulator's; an initial scale of 2**17 overflows fp16, so the scale backs
    off (windows skipped on every rank alike) and training then follows the
    float32 big batch."""
    ref, _ = reference("fp16", dtype=torch.float32)
    init = [p.detach() for p in worker.mlp(torch.float32).parameters()]
    results = ok(runs("fp16"))
    for r in results:
        assert r["output_dtypes"] == ["torch.float16"]  # autocast was on
        assert r["scale"] < 2.0 ** 17 and r["stats"]["skipped_steps"] > 0
        assert r["stats"]["optimizer_steps"] + r["stats"]["skipped_steps"] == r["stats"]["windows"]
        assert all(torch.isfinite(p).all() for p in r["params"])
        moved = max(float((p - q).abs().max()) for p, q in zip(ref, init))
        error = max(float((p - q).abs().max()) for p, q in zip(r["params"], ref))
        assert moved > 0.05 and error < moved, (moved, error)
        # The hooks see unscaled gradients, as under Lightning's own strategies
        # (scaled ones would be thousands: the scale stays >= 2**10 here).
        finite = [n for n in r["hook_norms"] if n is not None and math.isfinite(n)]
        assert len(r["hook_norms"]) == r["stats"]["windows"] and finite
        assert max(finite) < 50, r["hook_norms"]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_checkpoint_at_a_window_boundary_resumes_exactly(runs):
    full = ok(runs("ckpt_full"))
    first = ok(runs("ckpt_first"))
    resumed = ok(runs("ckpt_resume"))
    ref, _ = reference("ckpt_full")
    state = first[0]["checkpoint_state"]
    assert state is not None and state["micro_step"] == 0 and state["optimizer_steps"] == 2
    for f, r in zip(full, resumed):
        assert max_rel(f["params"], ref) < F64
        assert max_rel(r["params"], f["params"]) < 1e-13
        for key in ("micro_steps", "optimizer_steps", "windows"):
            assert r["stats"][key] == f["stats"][key], key


def test_a_fine_tuning_callback_unfreezes_the_backbone_mid_fit(runs):
    """BaseFinetuning unfreezes net[0] at epoch 1 (a new param group at lr /
    10); the strategy refreshes the Accumulator at that window boundary, so
    both ranks train it as one process on the global batch does. (Lightning's
    own DDP strategy never reduces a layer frozen when DDP was built: its
    replicas drift apart.)"""
    ref, _ = reference("finetune")
    never, _ = reference("finetune", unfreeze_epoch=99)  # frozen throughout
    results = ok(runs("finetune"))
    for r in results:
        assert max_rel(r["params"], ref) < F64
        assert max_rel(r["params"][:2], never[:2]) > 1e-3  # the backbone did train
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_ranks_with_different_numbers_of_batches_are_refused_on_every_rank(runs):
    """Note [Every rank trains as many batches]: a sampler of the script's
    own gives rank 0 5 batches and rank 1 4; it hung with no error (in
    Lightning's per-batch broadcast, under its DDP strategy too: review).
    Every rank now raises when training starts, nothing trained."""
    for rank, r in enumerate(runs("uneven_batches")):
        assert r["error"] == (
            "RuntimeError: gradaccum: GradaccumStrategy: the ranks have different numbers of training batches in "
            f"epoch 0 (4 to 5; this rank {5 - rank}): Lightning synchronises the ranks at every batch and at the "
            "epoch's end, so they would wait for each other with no error (under its DDP strategy too). Give every "
            "rank as many batches: Lightning's DistributedSampler (use_distributed_sampler=True, the default) pads "
            "the shards to one length; pad your own sampler's alike"), r["error"]
        assert r["logged_losses"] == []


def test_ranks_whose_reloaded_loaders_differ_are_refused_at_that_epoch(runs):
    """The same where the dataloaders are reloaded at every epoch
    (reload_dataloaders_every_n_epochs=1) and rank 1's has a batch fewer from
    epoch 1 (review: only the start of training was checked, so that epoch
    would hang): epoch 0 trains its 5 batches on both ranks, and both raise
    at epoch 1's first batch, before it trains."""
    results = runs("uneven_reload")
    for rank, r in enumerate(results):
        assert r["error"].startswith(
            "RuntimeError: gradaccum: GradaccumStrategy: the ranks have different numbers of training batches in "
            f"epoch 1 (4 to 5; this rank {5 - rank}): "), r["error"]
        assert [(epoch, batch) for epoch, batch, _ in r["logged_losses"]] == [(0, b) for b in range(5)]
    assert torch.equal(results[0]["params"][0], results[1]["params"][0])


def test_the_new_trainable_set_of_a_resize_is_compared_across_ranks(runs):
    """Rank 1 alone unfreezes net[0] at the epoch whose first batch resizes
    the window: both ranks raise the new Accumulator's construction error
    (a refresh of the old one, on rank 1 only, hung)."""
    for r in runs("gas_finetune_rank1"):
        assert r["error"] == ("ValueError: gradaccum: Accumulator(): the ranks disagree on the trainable parameters' "
                              "names (in the Accumulator's order): the first that differs is \"net.2.weight\" on "
                              "rank 0 and \"net.0.weight\" on rank 1 (position 0; rank 0 has 2, rank 1 has 4); every "
                              "rank must train the same parameters, under the same names: the same layers frozen "
                              "(requires_grad=False) and the same module passed"), r["error"]


def test_a_two_device_checkpoint_resumes_on_one_device_with_twice_the_steps(runs):
    """devices=2, accumulate_grad_batches=3 -> devices=1, 6: the same global
    batches, so the same training as the uninterrupted 2-device run."""
    full = ok(runs("ckpt_full"))
    (resumed,) = ok(runs("ckpt_resume_1dev"))
    ref, _ = reference("ckpt_full")
    assert max_rel(resumed["params"], ref) < F64
    assert max_rel(resumed["params"], full[0]["params"]) < F64
    for key in ("optimizer_steps", "windows"):
        assert resumed["stats"][key] == full[0]["stats"][key], key


def test_checkpoint_mid_window_under_data_parallelism_is_rank_independent(runs):
    """Lightning saves rank 0's dict: the Accumulator's part of it holds the
    half-done window summed over ranks, a 1/world share each (issue 8), which
    test_misuse.py resumes exactly on every rank."""
    results = runs("ckpt_midwindow")
    for r in results:
        assert "error" not in r, r.get("error")
        state = r["checkpoint_state"]
        assert state["rank_independent"] and state["world_size"] == 2
        assert state["micro_step"] == 2 and state["window_weight"] == 2
    # every rank wrote the same file; its window shares are defined
    assert all(g is not None for g in results[0]["checkpoint_state"]["grads"])


# (saved by, resumed by, micro-batches of each window over all ranks: the
# first holds the saved ones and the resumed ranks' rest of the window)
MID_WINDOW = [("ckpt_midwindow", "mid_2to2", [2 * 2 + 2 * 1, 4, 6, 4]),
              ("ckpt_midwindow", "mid_2to1", [2 * 2 + 1, 3, 3, 1, 3, 3, 3, 1]),
              ("mid_1dev", "mid_1to2", [2 + 2 * 1, 4, 6, 4]),
              ("mid_1dev", "mid_1to2_end", [3, 1 + 2 * 1, 6, 4])]


@pytest.mark.parametrize("saved,resumed,sizes", MID_WINDOW, ids=[name for _, name, _ in MID_WINDOW])
def test_a_mid_window_checkpoint_resumes_on_the_same_or_another_number_of_devices(runs, saved, resumed, sizes):
    """trainer.save_checkpoint from on_train_batch_end at batch 1, the middle
    of a window of 3 (as a preemption handler saves), resumed with the same
    accumulate_grad_batches on 2 -> 2, 2 -> 1 and 1 -> 2 devices (and at
    batch 3 of 10, 1 -> 2, where batch 4 ends the 2-device epoch): each new
    rank carries on at the saved micro-step (Lightning's batch counter too),
    and the window closes with the exact mean over every micro-batch it held,
    against one process over the micro-batches each rank really trained on
    before and after the resume (float64). With a plain DataLoader Lightning
    replays the epoch's first batches after a mid-epoch resume: so do
    the reference's micro-batches."""
    batch = int(worker.SCENARIOS[resumed]["resume_from"].rsplit(".b", 1)[1])  # saved after it
    before = [entry for r in ok(runs(saved)) for entry in r["seen"][:r["seen_at_save"][batch]]]
    after = ok(runs(resumed))
    ref, windows = worker.replay(before, [entry for r in after for entry in r["seen"]],
                                 worker.SCENARIOS[resumed]["steps"])
    assert windows == sizes
    for rank, r in enumerate(after):  # the next batch of the epoch, on the rows of its batch 0
        assert r["seen"][0] == (0, batch + 1, worker.rank_rows(len(after), rank, epoch=0)[:worker.B])
    for r in after:
        assert max_rel(r["params"], ref) < 1e-12
        assert r["stats"]["optimizer_steps"] == len(windows)
    for a, b in zip(after[0]["params"], after[-1]["params"]):
        assert torch.equal(a, b)


def test_a_checkpoint_at_a_boundary_mid_epoch_resumes_with_another_k(runs):
    """Saved after batch 2 (its window stepped) on 2 devices with K = 3,
    resumed on 1 device with K = 6: Lightning's counter is then half-way
    through its window of 6, and its optimizer_step at batch 5 closes the
    Accumulator's window of 3 micro-batches with their exact mean."""
    before = [entry for r in ok(runs("ckpt_midwindow")) for entry in r["seen"][:r["seen_at_save"][2]]]
    (after,) = ok(runs("bnd_2to1_k6"))
    ref, windows = worker.replay(before, after["seen"], 3, after_steps=6)
    assert windows == [6, 3, 4] and after["seen"][0][:2] == (0, 3)
    assert max_rel(after["params"], ref) < 1e-12
    assert after["stats"]["optimizer_steps"] == len(windows)
    # saved again after batch 3 (micro-step 1 of that window of 3, Lightning
    # at batch 4 of its 6) and resumed: accepted, the same windows
    middle = after["seen"][:after["seen_at_save"][3]]
    (again,) = ok(runs("bnd_k6_again"))
    ref, windows = worker.replay(before, middle + again["seen"], 3, after_steps=6)
    assert windows == [6, 3, 4] and again["seen"][0][:2] == (0, 4)
    assert max_rel(again["params"], ref) < 1e-12
    assert again["stats"]["optimizer_steps"] == len(windows)


def test_a_mid_window_resume_lightning_cannot_serve_is_refused_on_every_rank(runs):
    """Saved after batch 7 of 10 on 1 device, mid-window: on 2 devices the
    epoch has 5 batches a device, Lightning starts it over at batch 0 and its
    optimizer steps would miss the Accumulator's windows. And another
    accumulate_grad_batches in the middle of a window."""
    late = runs("mid_1to2_late")
    assert late[0]["error"] == late[1]["error"]
    assert late[0]["error"].startswith(
        "RuntimeError: gradaccum: GradaccumStrategy: the checkpoint was saved in the middle of a window (micro-step "
        "2 of 3) after batch 7 of epoch 0, but Lightning resumes at batch 0, micro-step 0 of its window: that batch "
        "is past the end of the epoch on 2 device(s) (5 batches a device), so Lightning starts the epoch over. "
        "Resume on the number of devices that saved it"), late[0]["error"]
    assert all(r["seen"] == [] for r in late)
    (k6,) = runs("mid_2to1_k6")
    assert "saved with steps=3 in the middle of a window (micro_step=2) but this Accumulator has steps=6" in k6["error"]


def test_reduction_and_training_step_output_must_agree(runs):
    for r in runs("items_without_count"):
        assert "reduction='items'): training_step must return" in r["error"]
    for r in runs("count_without_items"):
        assert "pass GradaccumStrategy(reduction='items')" in r["error"]


def test_a_gradient_accumulation_scheduler_resizes_the_window_at_each_epoch(runs):
    """GradientAccumulationScheduler({0: 2, 1: 3}): windows of 2 batches in
    epoch 0 and of 3 from epoch 1, the big batches' (it was refused after the
    first batch: "accumulate_grad_batches changed during fit"). A checkpoint
    after batch 1 of epoch 1, in the middle of a window of 3, resumes on 2
    devices with windows of 3 (Lightning does not run on_train_epoch_start,
    where the scheduler sets accumulate_grad_batches, when it resumes in the
    middle of an epoch), against one process over the micro-batches each rank
    trained on (Lightning replays the epoch's first batches)."""
    ref, _ = reference("gas")
    whole = ok(runs("gas"))
    for r in whole:
        assert max_rel(r["params"], ref) < F64
        # 3 + 2 windows, 10 micro-steps a rank
        assert r["stats"]["optimizer_steps"] == 5 and r["stats"]["micro_steps"] == 10
    saved = whole[0]["checkpoint_state"]
    assert saved["steps"] == 3 and saved["micro_step"] == 2
    before = [entry for r in whole for entry in r["seen"][:r["seen_at_save"][1]]]
    after = ok(runs("gas_resume"))
    ref, windows = worker.replay(before, [entry for r in after for entry in r["seen"]], worker.SCENARIOS["gas"]["steps"])
    assert windows == [4, 4, 2, 2 * 2 + 2 * 1, 4]
    for r in after:
        assert r["seen"][0][:2] == (1, 2)
        assert max_rel(r["params"], ref) < 1e-12
        assert r["stats"]["optimizer_steps"] == len(windows)
    # K lowered to 1: the first batch of epoch 1 closes a window (its
    # optimizer_step runs training_step inside it): resized before it
    ref, _ = reference("gas_down")
    for r in ok(runs("gas_down")):
        assert max_rel(r["params"], ref) < F64
        assert r["stats"]["optimizer_steps"] == 3 + 5
    # unfrozen at the resize's epoch, with error feedback on a float32 wire
    # (it failed on every rank: the old set's residuals met the new set)
    ref, _ = reference("gas_finetune_ef")
    never, _ = reference("gas_finetune_ef", unfreeze_epoch=99)
    results = ok(runs("gas_finetune_ef"))
    for r in results:
        assert max_rel(r["params"], ref) < 1e-6  # the wire's rounding, fed back
        assert max_rel(r["params"][:2], never[:2]) > 1e-3  # the backbone did train
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def test_a_configuration_refused_on_one_rank_is_raised_on_every_rank(runs):
    """Rank 1's module overrides configure_gradient_clipping: the strategy
    refuses it before building the Accumulator, and rank 0, already in the
    Accumulator's first collective, raises it too instead of waiting there."""
    mine = ("gradaccum: GradaccumStrategy does not call configure_gradient_clipping: the Accumulator clips the "
            "window's gradient once, by norm, to the Trainer's gradient_clip_val")
    zero, one = runs("clip_hook_on_rank1")
    assert one["error"] == "ValueError: " + mine
    assert zero["error"] == ("ValueError: gradaccum: Accumulator(): rank 1 refused, so every rank raises (rank 1 its "
                             "own error): " + mine.removeprefix("gradaccum: "))


def test_bad_arguments():
    from gradaccum.lightning import GradaccumStrategy

    with pytest.raises(ValueError, match="invalid reduction: 'avg'"):
        GradaccumStrategy(reduction="avg")
    with pytest.raises(ValueError, match="invalid nonfinite: 'nan'"):
        GradaccumStrategy(nonfinite="nan")


def test_an_unset_bucket_cap_is_ddps_on_one_node():
    """Lightning's launcher does not set LOCAL_WORLD_SIZE: the strategy says
    one host from the Trainer's num_nodes (which the connector sets)."""
    from gradaccum.lightning import GradaccumStrategy

    strategy = GradaccumStrategy()
    strategy.num_nodes = 1
    assert strategy._resolved_accumulator_options()["bucket_cap_mb"] == 25.0
    strategy.num_nodes = 2  # across nodes: the Accumulator's own default
    assert strategy._resolved_accumulator_options()["bucket_cap_mb"] is None
    explicit = GradaccumStrategy(bucket_cap_mb=4)
    explicit.num_nodes = 1
    assert explicit._resolved_accumulator_options()["bucket_cap_mb"] == 4
    assert strategy._accumulator_options["bucket_cap_mb"] is None  # the strategy's own stays unset


def test_without_lightning_the_import_says_what_to_install():
    code = ("import sys; sys.modules['lightning'] = None\n"
            "try:\n    import gradaccum.lightning\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert 'pip install "lightning>=2.6"' in out, out
    # and plain `import gradaccum` does not need Lightning
    code = "import sys; sys.modules['lightning'] = None\nimport gradaccum\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


SKIP_REST = '''
import sys, warnings
import torch, lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1).double()

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x), y)

    def on_train_batch_start(self, batch, i):
        if self.current_epoch == 0 and i == 4:  # micro-batch 1 of the second window: skip the rest
            return -1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(18, 3, generator=g, dtype=torch.float64),  # 9 batches: 3 full windows
                     torch.randn(18, 1, generator=g, dtype=torch.float64))
from lightning.pytorch.callbacks import ModelCheckpoint


class SaveAtTheLastBatchStart(pl.Callback):
    """A checkpoint at the start of epoch 1's last batch (micro-step 2 of its
    last window): the window is not the cut one, and must survive the save."""
    def on_train_batch_start(self, trainer, module, batch, i):
        if trainer.current_epoch == 1 and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            before = trainer.strategy.accumulator.micro_step
            trainer.save_checkpoint(sys.argv[1] + "/last_batch.ckpt")
            print("last_batch", before, trainer.strategy.accumulator.micro_step, flush=True)


def fit(name, ckpt_dir=None, resume=None):
    if name == "gradaccum":
        from gradaccum.lightning import GradaccumStrategy
        strategy = GradaccumStrategy()
    else:
        from lightning.pytorch.strategies import SingleDeviceStrategy
        strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    model = Model()
    callbacks = ([ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}"), SaveAtTheLastBatchStart()]
                 if ckpt_dir else [])
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, accumulate_grad_batches=3, max_epochs=2,
                         logger=False, enable_checkpointing=bool(ckpt_dir), callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # the same order in both
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(data, batch_size=2), ckpt_path=resume)
    dropped = sum("the window is dropped, as Lightning drops it" in str(w.message) for w in caught)
    return trainer.global_step, dropped, model.lin.weight.detach().flatten().tolist()


steps, dropped, weight = fit("stock")
print("stock", steps, dropped, *weight, flush=True)
# the epoch-0 checkpoint is taken at the cut epoch's end: its window is dropped before the save
steps, dropped, weight = fit("gradaccum", ckpt_dir=sys.argv[1])
print("gradaccum", steps, dropped, *weight, flush=True)
state = torch.load(sys.argv[1] + "/epoch=0.ckpt", weights_only=False)["gradaccum_accumulator"]
print("saved", state["micro_step"], state["window_ready"], flush=True)
steps, dropped, weight = fit("gradaccum", resume=sys.argv[1] + "/epoch=0.ckpt")
print("resumed", steps, dropped, *weight, flush=True)
'''


def test_an_epoch_cut_short_mid_window_drops_the_window_as_lightning_does(tmp_path):
    """on_train_batch_start returning -1 skips the rest of the epoch, here one
    micro-batch into a window: no optimizer step closes it, and Lightning
    clears its gradients at the next epoch's first batch. The strategy drops
    it there too (with a warning), where before the Accumulator raised at the
    next backward that its window had been cleared: the same optimizer steps
    and weights as Lightning's own single-device strategy."""
    script = tmp_path / "skip_rest.py"
    script.write_text(SKIP_REST)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.split()[:1] in
            (["stock"], ["gradaccum"], ["saved"], ["resumed"], ["last_batch"])}
    stock, ours, resumed = rows["stock"], rows["gradaccum"], rows["resumed"]
    assert ours[0] == stock[0] == resumed[0] == "4", rows  # global_step: 1 + 3 windows
    assert stock[1] == "0" and ours[1] == "1", rows  # warned once (before the epoch-end save)
    assert rows["saved"] == ["0", "False"], rows  # the checkpoint holds no half window
    assert rows["last_batch"] == ["2", "2"], rows  # a save inside the last batch keeps its window
    for got in (ours, resumed):
        assert max(abs(float(a) - float(b)) for a, b in zip(got[2:], stock[2:])) <= 1e-12, rows
