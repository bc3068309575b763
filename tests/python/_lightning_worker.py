"""Lightning runs for test_lightning.py: `python _lightning_worker.py OUT_DIR SCENARIO...`.

Lightning's own launcher (as `Trainer(devices=2)` launches any script) starts
the second rank by running this script again; both ranks join a Gloo group on
loopback and run every scenario, one Trainer each, and save what the parent
test compares (`OUT_DIR/<scenario>.rank<r>.pt`). A scenario that raises is
recorded as {"error": message}. The data and the one-process references live
here too, so that the ranks and the parent build exactly the same ones.
"""
import os
import sys
import warnings

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

WORLD, B, D_IN, D_HID, D_OUT, TOKENS = 2, 4, 5, 8, 3, 6


def mlp(dtype):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_OUT)).to(dtype)


def dataset(kind, batches_per_rank, dtype=torch.float64, world=WORLD):
    """world * B * batches_per_rank rows: every rank gets batches_per_rank batches of B."""
    g = torch.Generator().manual_seed(1)
    n = world * B * batches_per_rank
    if kind == "items":
        x = torch.randn(n, TOKENS, D_IN, generator=g, dtype=dtype)
        y = torch.randn(n, TOKENS, D_OUT, generator=g, dtype=dtype)
        lengths = torch.randint(1, TOKENS + 1, (n,), generator=g)
        mask = (torch.arange(TOKENS)[None, :] < lengths[:, None]).to(dtype)
        return x, y, mask
    return torch.randn(n, D_IN, generator=g, dtype=dtype), torch.randn(n, D_OUT, generator=g, dtype=dtype)


def windows(batches_per_rank, steps, epoch):
    """The rows of each window of an epoch: K batches of every rank, the last
    window partial when K does not divide the batches. Rank r's rows are what
    Lightning's training sampler gives it: torch's DistributedSampler, which
    shuffles with seed 0 + epoch."""
    n = WORLD * B * batches_per_rank
    per_rank = []
    for rank in range(WORLD):
        sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=WORLD, rank=rank, shuffle=True)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    return [[i for rows in per_rank for i in rows[B * start:B * min(start + steps, batches_per_rank)]]
            for start in range(0, batches_per_rank, steps)]


def rank_rows(world, rank, epoch, n=WORLD * B * 5):
    """The rows a rank trains on in an epoch, in order."""
    sampler = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True)
    sampler.set_epoch(epoch)
    return list(sampler)


def window_loss(model, data, rows, reduction):
    if reduction == "items":
        x, y, mask = (t[rows] for t in data)
        return (((model(x) - y) ** 2).sum(-1) * mask).sum() / mask.sum()
    x, y = (t[rows] for t in data)
    return nn.functional.mse_loss(model(x), y)  # equal micro-batches: the mean of their means


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def reference(*, kind, reduction, optimizer, batches_per_rank, steps, epochs, dtype=torch.float64,
              clip=None, skip=(), schedule=False, divide_partial_by_k=False, grad_norms=None, unfreeze_epoch=None,
              losses=None):
    """One process, one backward per window on the window's big batch.
    `skip`: (epoch, window) pairs whose window is non-finite (no step at all).
    `divide_partial_by_k`: what Lightning's own accumulation computes for a
    partial window of n < K batches: its mean loss times n / K. `grad_norms`:
    a list that gets each window's gradient norm before clipping; `losses`:
    each window's loss, as (epoch, window, loss)."""
    data = dataset(kind, batches_per_rank, dtype)
    model = mlp(dtype)
    if unfreeze_epoch is not None:
        model[0].requires_grad_(False)  # as BaseFinetuning.freeze_before_training
    opt = make_optimizer(optimizer, [p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s) if schedule else None
    for epoch in range(epochs):
        if epoch == unfreeze_epoch:  # as BaseFinetuning.unfreeze_and_add_param_group
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": opt.param_groups[0]["lr"] / 10})
        k = steps if isinstance(steps, int) else steps[max(e for e in steps if e <= epoch)]  # a schedule
        for w, rows in enumerate(windows(batches_per_rank, k, epoch)):
            if (epoch, w) in skip:
                continue
            loss = window_loss(model, data, rows, reduction)
            if losses is not None:
                losses.append((epoch, w, loss.item()))
            if divide_partial_by_k:
                loss = loss * (len(rows) // (WORLD * B)) / k
            loss.backward()
            if grad_norms is not None:
                grad_norms.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if sched is not None:
                sched.step()
    return [p.detach().clone() for p in model.parameters()], (sched.last_epoch if sched else None)


# --------------------------------------------------------------------------- #
# The Lightning side (only the ranks import Lightning and gradaccum.lightning)
# --------------------------------------------------------------------------- #

SCENARIOS = {
    # partial last window, mean, SGD with momentum: 5 batches per rank, K = 3
    "partial": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps=3, epochs=2),
    # the same on a bf16 wire (comm_dtype), which carries no loss: train_loss by sync_dist
    "partial_comm": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps=3, epochs=2,
                         strategy_options=dict(comm_dtype=torch.bfloat16)),
    # the same, epoch 0 cut one micro-batch into its first window (on_train_batch_start
    # returns -1 at batch 1): the window is dropped, and so is its loss
    "cut_comm": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps=3, epochs=2,
                     strategy_options=dict(comm_dtype=torch.bfloat16), cut_at=(0, 1)),
    # the same with Lightning's own DDP + accumulate_grad_batches, for contrast
    "partial_ddp": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps=3, epochs=2,
                        ddp=True),
    # exact per-token mean over uneven masks, Adam
    "items": dict(kind="items", reduction="items", optimizer="adam", batches_per_rank=5, steps=3, epochs=2),
    # a NaN on rank 1 in epoch 0's first window; clip-once; LambdaLR per step
    "skip_clip": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=6, steps=3, epochs=2,
                      clip=0.05, schedule=True, nan_at=(0, 1, 1)),
    "bf16": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=4, steps=2, epochs=3,
                 dtype="float32", precision="bf16-mixed"),
    # the same, all-reduced in bf16 (comm_dtype): half the bytes
    "bf16_comm": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=4, steps=2, epochs=3,
                      dtype="float32", precision="bf16-mixed", strategy_options=dict(comm_dtype=torch.bfloat16)),
    # 16-mixed through Lightning's own MixedPrecision plugin and its GradScaler (on CPU
    # precision="16-mixed" would become bf16, so the plugin is given explicitly)
    "fp16": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=4, steps=2, epochs=3,
                 dtype="float32", fp16_plugin=True),
    # checkpoint (ModelCheckpoint, at the end of epoch 0) and resume to epoch 2
    "ckpt_full": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3, epochs=2),
    "ckpt_first": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3, epochs=1,
                       checkpoint=True),
    "ckpt_resume": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3, epochs=2,
                        resume=True),
    # the same checkpoint (2 devices, K=3) resumed on 1 device with K=6: the same
    # global batches (Note [Resuming on another shape]); run by a launch of its own
    "ckpt_resume_1dev": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=10, steps=6,
                             epochs=2, resume=True, devices=1),
    # BaseFinetuning unfreezes the first layer at epoch 1 and adds it to the
    # optimizer (lr / 10): the strategy refreshes the Accumulator
    "finetune": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps=3, epochs=3,
                     unfreeze_epoch=1),
    # mismatched reduction and training_step output: clear errors
    "items_without_count": dict(kind="plain", reduction="items", optimizer="sgd", batches_per_rank=2, steps=2,
                                epochs=1),
    "count_without_items": dict(kind="items", reduction="mean", optimizer="sgd", batches_per_rank=2, steps=2,
                                epochs=1),
    # one rank's module overrides configure_gradient_clipping, which the
    # strategy refuses before it builds the Accumulator: every rank raises
    "clip_hook_on_rank1": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=2, steps=2,
                               epochs=1, clip_hook_rank=1),
    # a checkpoint in the middle of a window under data parallelism: rank 0's
    # file holds the half-done window summed over the ranks
    "ckpt_midwindow": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3,
                           epochs=1, save_at_batch=(1, 2), rows=True),
    # Mid-window checkpoints (saved from on_train_batch_end, as a preemption
    # handler would) resumed on another number of devices, the same K; `rows`
    # records the rows of every micro-batch each rank trained on, for the
    # reference (Lightning replays an epoch's first batches with a plain
    # DataLoader). 2 -> 2 and 2 -> 1 (the checkpoint above), and 1 -> 2,
    # early in the epoch, near its end and past the end of the 2-device epoch
    # (batch 7 of 10, 5 a rank).
    "mid_2to1": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=10, steps=3, epochs=2,
                     devices=1, rows=True, resume_from="ckpt_midwindow.b1"),
    # its checkpoint after batch 2, at a window boundary, resumed on 1 device
    # with accumulate_grad_batches 6: Lightning's counter is at batch 3 of its
    # window, so its next optimizer_step closes a window of 3 (flush)
    "bnd_2to1_k6": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=10, steps=6, epochs=1,
                        devices=1, rows=True, resume_from="ckpt_midwindow.b2", save_at_batch=(3,)),
    # and its own checkpoint after batch 3 resumed (a preemption in that
    # shorter window): the Accumulator is at micro-step 1, Lightning at 4 of
    # its 6; its optimizer_step at batch 5 still closes the window of 3
    "bnd_k6_again": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=10, steps=6, epochs=1,
                         devices=1, rows=True, resume_from="bnd_2to1_k6.b3", launch=3),
    # the mid-window one with accumulate_grad_batches 6: refused (a window's steps are fixed)
    "mid_2to1_k6": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=10, steps=6, epochs=2,
                        devices=1, rows=True, resume_from="ckpt_midwindow.b1"),
    # the same on the same 2 devices
    "mid_2to2": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3, epochs=2,
                     rows=True, resume_from="ckpt_midwindow.b1"),
    "mid_1dev": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=10, steps=3, epochs=1,
                     devices=1, rows=True, save_at_batch=(1, 3, 7), launch=0),
    "mid_1to2": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3, epochs=2,
                     rows=True, resume_from="mid_1dev.b1"),
    # after batch 3 of 10 (micro-step 1): on 2 devices batch 4 ends the epoch
    # and closes the window with 1 + 2 micro-batches
    "mid_1to2_end": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3, epochs=2,
                         rows=True, resume_from="mid_1dev.b3"),
    # a GradientAccumulationScheduler (`steps` is its schedule): windows of 2
    # in epoch 0 (2, 2, 1), of 3 from epoch 1 (3, 2); a checkpoint after batch
    # 1 of epoch 1, in the middle of a window of 3, resumed on 2 devices
    "gas": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps={0: 2, 1: 3}, epochs=2,
                save_at_batch=(1,), save_epoch=1, rows=True),
    # a scheduler that lowers K to 1: every batch of epoch 1 closes a window
    "gas_down": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps={0: 2, 1: 1},
                     epochs=2),
    # with error feedback, and BaseFinetuning unfreezing net[0] at the epoch
    # whose first batch resizes the window: the resize takes the new set first
    "gas_finetune_ef": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps={0: 2, 1: 3},
                            epochs=2, unfreeze_epoch=1,
                            strategy_options=dict(comm_dtype=torch.float32, error_feedback=True)),
    # the same with rank 1 alone unfreezing: the resize's new Accumulator
    # refuses it on every rank (a refresh there was a collective on rank 1 only)
    "gas_finetune_rank1": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5,
                               steps={0: 2, 1: 3}, epochs=2, unfreeze_epoch=1, unfreeze_rank=1),
    "gas_resume": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps={0: 2, 1: 3},
                       epochs=2, resume_from="gas.b1", rows=True),
    # a sampler of the script's own gives rank 0 5 batches and rank 1 4:
    # refused on both ranks when training starts (it hung in Lightning's
    # per-batch broadcast, under its DDP strategy too)
    "uneven_batches": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps=2, epochs=1,
                           uneven=True),
    # the same from epoch 1 only, the dataloaders reloaded at every epoch:
    # refused there on both ranks, after epoch 0 trained
    "uneven_reload": dict(kind="plain", reduction="mean", optimizer="sgd", batches_per_rank=5, steps=2, epochs=2,
                          uneven=True, uneven_from_epoch=1),
    "mid_1to2_late": dict(kind="plain", reduction="mean", optimizer="adam", batches_per_rank=5, steps=3, epochs=2,
                          rows=True, resume_from="mid_1dev.b7"),
}


def launch(name):
    """Which launch runs a scenario: the 2-device one (1) before the 1-device
    one (2) that resumes its checkpoints; 0 for a 1-device run whose
    checkpoint the 2-device launch resumes."""
    cfg = SCENARIOS[name]
    return cfg.get("launch", 1 if cfg.get("devices", WORLD) == WORLD else 2)  # 3: resumes a launch-2 run


def replay(before, after, steps, after_steps=None, kind="plain", reduction="mean", optimizer="adam",
           dtype=torch.float64, world=WORLD, batches_per_rank=5):
    """The reference for a run resumed from a checkpoint: `before` and `after`
    hold (epoch, batch_idx, rows) of every micro-batch of every rank before the
    save and after the resume. A window is every micro-batch with the same
    epoch and batch_idx // steps; the half-done window at the save takes the
    resumed ranks' micro-batches of its key (Lightning's batch counter carries
    on at the saved batch, so each new rank runs the window's remaining
    micro-steps), or is closed alone when the resumed run has none (its epoch
    ended on the new shape). One process, one backward per window on the mean
    of its micro-batch losses. `after_steps`: another accumulate_grad_batches
    after a resume at a window boundary (Lightning's window then ends where
    its counter says: batch_idx // after_steps). Returns the parameters and
    the windows' sizes."""
    def group(seen, steps):
        grouped = {}
        for epoch, batch_idx, rows in seen:
            k = steps if isinstance(steps, int) else steps[max(e for e in steps if e <= epoch)]  # a schedule
            grouped.setdefault((epoch, batch_idx // k), []).append(list(rows))
        return [grouped[key] for key in sorted(grouped)], sorted(grouped)

    (old, old_keys), (new, new_keys) = group(before, steps), group(after, after_steps or steps)
    if after_steps is None and old_keys and new_keys and old_keys[-1] == new_keys[0]:
        old[-1] += new.pop(0)
    data = dataset(kind, batches_per_rank, dtype, world=world)
    model = mlp(dtype)
    opt = make_optimizer(optimizer, model.parameters())
    for micro in old + new:
        loss = sum(window_loss(model, data, rows, reduction) for rows in micro) / len(micro)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], [len(micro) for micro in old + new]


def run(name, out_dir):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BaseFinetuning, Callback, GradientAccumulationScheduler, ModelCheckpoint
    from lightning.pytorch.plugins.precision import MixedPrecision

    from gradaccum.lightning import CHECKPOINT_KEY, GradaccumStrategy

    cfg = SCENARIOS[name]
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    reduction = cfg["reduction"]
    returns_count = cfg["kind"] == "items"

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp(dtype)
            self.output_dtypes = set()
            self.wrapped_in = set()
            self.hook_norms = []
            self.seen = []
            self.seen_at_save = {}

        def on_train_batch_start(self, batch, batch_idx):
            if cfg.get("cut_at") == (self.current_epoch, batch_idx):
                return -1  # the rest of the epoch is skipped
            return None

        def on_before_optimizer_step(self, optimizer):
            # What Lightning's hooks see (grad-norm logging, gradient edits).
            grads = [p.grad.flatten().double() for p in self.parameters() if p.grad is not None]
            self.hook_norms.append(float(torch.cat(grads).norm()) if grads else None)

        def training_step(self, batch, batch_idx):
            if cfg.get("rows"):
                *batch, rows = batch
                self.seen.append((self.current_epoch, batch_idx, rows.tolist()))
            self.wrapped_in.add(type(self.trainer.strategy.model).__name__)
            if returns_count:
                x, y, mask = batch
                loss = (((self.net(x) - y) ** 2).sum(-1) * mask).sum()
                return {"loss": loss, "num_items": mask.sum()}
            x, y = batch
            out = self.net(x)
            self.output_dtypes.add(str(out.dtype))
            loss = nn.functional.mse_loss(out.to(y.dtype), y)
            if cfg.get("nan_at") == (self.current_epoch, batch_idx, self.global_rank):
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self):
            opt = make_optimizer(cfg["optimizer"], [p for p in self.parameters() if p.requires_grad])
            if not cfg.get("schedule"):
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class SaveMidWindow(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == cfg.get("save_epoch", 0) and batch_idx in cfg["save_at_batch"]:
                pl_module.seen_at_save[batch_idx] = len(pl_module.seen)
                trainer.save_checkpoint(os.path.join(out_dir, f"{name}.b{batch_idx}.ckpt"))

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, pl_module):
            self.freeze(pl_module.net[0])

        def finetune_function(self, pl_module, epoch, optimizer):
            only = cfg.get("unfreeze_rank")  # a callback that differs on one rank
            if epoch == cfg["unfreeze_epoch"] and only in (None, int(os.environ.get("LOCAL_RANK", "0"))):
                self.unfreeze_and_add_param_group(pl_module.net[0], optimizer, train_bn=True)

    ckpt_dir = os.path.join(out_dir, "ckpt")
    callbacks = [Unfreeze()] if "unfreeze_epoch" in cfg else []
    if cfg.get("checkpoint"):
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, filename="epoch{epoch}", save_top_k=-1,
                                         every_n_epochs=1, save_on_train_epoch_end=True,
                                         auto_insert_metric_name=False))
    if "save_at_batch" in cfg:
        callbacks.append(SaveMidWindow())
    scheduled = isinstance(cfg["steps"], dict)
    if scheduled:
        callbacks.append(GradientAccumulationScheduler(dict(cfg["steps"])))
    strategy = "ddp" if cfg.get("ddp") else GradaccumStrategy(reduction=reduction,
                                                              **cfg.get("strategy_options", {}))
    trainer = pl.Trainer(
        accelerator="cpu", devices=cfg.get("devices", WORLD), strategy=strategy, precision=cfg.get("precision"),
        plugins=[MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 17))]
        if cfg.get("fp16_plugin") else None,
        accumulate_grad_batches=1 if scheduled else cfg["steps"], max_epochs=cfg["epochs"], gradient_clip_val=cfg.get("clip"),
        logger=False, enable_checkpointing=bool(cfg.get("checkpoint")), callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=not cfg.get("uneven"), reload_dataloaders_every_n_epochs=int("uneven_from_epoch" in cfg),
    )
    data = dataset(cfg["kind"], cfg["batches_per_rank"], dtype, world=cfg.get("devices", WORLD))
    if cfg.get("rows"):
        data = (*data, torch.arange(len(data[0])))
    loader = DataLoader(TensorDataset(*data), batch_size=B, shuffle=False)
    def uneven_loader(epoch):  # rank r: the rows of 5 - r batches, its own (from uneven_from_epoch)
        rank, per_rank = int(os.environ.get("LOCAL_RANK", "0")), B * cfg["batches_per_rank"]
        fewer = rank if epoch >= cfg.get("uneven_from_epoch", 0) else 0
        rows = range(rank * per_rank, rank * per_rank + B * (cfg["batches_per_rank"] - fewer))
        return DataLoader(torch.utils.data.Subset(TensorDataset(*data), rows), batch_size=B, shuffle=False)

    if cfg.get("uneven"):
        loader = uneven_loader(0)
    if "uneven_from_epoch" in cfg:  # a loader per epoch (reload_dataloaders_every_n_epochs=1)
        class PerEpoch(pl.LightningDataModule):
            def train_dataloader(self):
                return uneven_loader(self.trainer.current_epoch)

        loader = PerEpoch()
    model = Net()
    if cfg.get("clip_hook_rank") == int(os.environ.get("LOCAL_RANK", "0")):
        class ClippingNet(Net):
            def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
                pass

        model = ClippingNet()
    result = {}
    try:
        ckpt_path = os.path.join(ckpt_dir, "epoch0.ckpt") if cfg.get("resume") else None
        if "resume_from" in cfg:
            ckpt_path = os.path.join(out_dir, cfg["resume_from"] + ".ckpt")
        accumulator = {}
        logged_losses = result["logged_losses"] = []

        class Grab(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                logged = trainer.callback_metrics.get("train_loss")
                logged_losses.append((trainer.current_epoch, batch_idx, None if logged is None else float(logged)))

            def on_train_end(self, trainer, pl_module):
                acc = getattr(trainer.strategy, "accumulator", None)
                if acc is not None:
                    accumulator["stats"] = acc.stats()
                    scaler = getattr(acc, "grad_scaler", None)
                    accumulator["scale"] = None if scaler is None else scaler.get_scale()

        trainer.callbacks.append(Grab())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, **({"datamodule": loader} if isinstance(loader, pl.LightningDataModule)
                                  else {"train_dataloaders": loader}), ckpt_path=ckpt_path)
        result["warnings"] = [str(w.message) for w in caught]
        result["stats"] = accumulator.get("stats")
        result["scale"] = accumulator.get("scale")
    except Exception as e:  # noqa: BLE001 - the parent asserts on it
        result["error"] = f"{type(e).__name__}: {e}"
    result["params"] = [p.detach().clone() for p in model.net.parameters()]
    result["output_dtypes"] = sorted(model.output_dtypes)
    result["wrapped_in"] = sorted(model.wrapped_in)
    result["hook_norms"] = model.hook_norms
    result["seen"] = model.seen
    result["seen_at_save"] = model.seen_at_save

    schedulers = [c.scheduler for c in trainer.lr_scheduler_configs] if hasattr(trainer, "lr_scheduler_configs") else []
    result["scheduler_steps"] = schedulers[0].last_epoch if schedulers else None
    if cfg.get("checkpoint"):
        saved = torch.load(os.path.join(ckpt_dir, "epoch0.ckpt"), weights_only=False)
        result["checkpoint_state"] = saved.get(CHECKPOINT_KEY)
    if "save_at_batch" in cfg:
        saved = torch.load(os.path.join(out_dir, f"{name}.b{cfg['save_at_batch'][0]}.ckpt"), weights_only=False)
        result["checkpoint_state"] = saved.get(CHECKPOINT_KEY)
    return result


def main():
    out_dir, names = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    for name in names:
        result = run(name, out_dir)
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.save(result, os.path.join(out_dir, f"{name}.rank{rank}.pt"))


if __name__ == "__main__":
    main()
