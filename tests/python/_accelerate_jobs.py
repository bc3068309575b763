"""Runs under `accelerate launch` for test_accelerate.py (and holds the data,
models and one-process references the test compares with, so both sides build
the same ones).

    accelerate launch --multi_gpu --num_processes 2 tests/python/_accelerate_jobs.py --out DIR --cases even,partial

Each rank saves {case: result} to DIR/rank{r}.pt.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn

K, ROWS, EPOCHS, LR, GAMMA, CLIP = 3, 2, 2, 0.1, 0.9, 1.2  # CLIP bites in some GPT-2 windows
D_IN, D_HID, D_OUT = 5, 8, 3
VOCAB, T = 50, 8

# case -> (model kind, samples, reduction)
CASES = {
    "even": ("mlp", 24, "mean"),          # 2 ranks: 2 full windows an epoch
    "partial": ("mlp", 30, "mean"),       # 2 ranks: 8 and 7 batches, windows 3,3,2 and 3,3,1
    "partial_b": ("mlp", 34, "mean"),     # 2 ranks: 9 and 8 batches: one ends on a full window
    "tokens": ("gpt2", 26, "items"),      # per-token mean, -100 padding, uneven tokens
    "steps": ("mlp", 26, "mean"),         # 2 ranks: 7 and 6 batches; the loop stops after MAX_STEPS
}
# "steps": the *_no_trainer.py loop, which counts sync_gradients micro-steps and
# stops at max_train_steps (epochs = ceil(max_train_steps / ceil(len(loader) / K))).
# On 2 ranks rank 0's 7th batch opens a window rank 1 has no batch for: without
# the padding batch rank 1 counted 2 steps an epoch to rank 0's 3, and the
# ranks stopped at different windows (a hang).
MAX_STEPS = {"steps": 5}


# --------------------------------------------------------------------------- data, models

def mlp_data(n):
    g = torch.Generator().manual_seed(1234 + n)
    x = torch.randn(n, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(n, D_OUT, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, y)


def token_data(n):
    g = torch.Generator().manual_seed(99 + n)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    lengths = torch.randint(2, T + 1, (n,), generator=g)  # 1..T-1 valid next-token targets
    labels = ids.clone()
    labels[torch.arange(T)[None, :] >= lengths[:, None]] = -100
    return torch.utils.data.TensorDataset(ids, labels)


def make_data(kind, n):
    return mlp_data(n) if kind == "mlp" else token_data(n)


def make_model(kind, seed=0):
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_OUT)).double()
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def make_optimizer(model):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: GAMMA ** s)
    return opt, sched


def batch_loss(kind, model, batch, reduction):
    """(loss, num_items) of one micro-batch."""
    if kind == "mlp":
        x, y = batch
        err = (model(x) - y).pow(2)
        return (err.mean(), None) if reduction == "mean" else (err.sum(), x.shape[0] * D_OUT)
    ids, labels = batch
    logits = model(input_ids=ids).logits
    targets = labels[:, 1:]
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1),
                                       ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


def reference(case, world_size):
    return _reference(case, world_size, MAX_STEPS.get(case))


def _reference(case, world_size, max_steps):
    """One process, float64: each window is one big batch of the samples the
    ranks' windows hold together (batches go to the ranks in turn, so a window
    is world_size * K * ROWS consecutive samples; the epoch's last is what is
    left); the loss is their mean (per token for "tokens"); clipped to norm
    CLIP; one SGD step per window, the LR schedule stepped world_size times per step (Accelerate's
    convention)."""
    kind, n, reduction = CASES[case]
    data = make_data(kind, n)
    model = make_model(kind)
    opt, sched = make_optimizer(model)
    window = world_size * K * ROWS
    steps, losses, norms = 0, [], []
    for _ in range(EPOCHS):
        for start in range(0, n, window):
            if steps == max_steps:
                break
            batch = data[start:start + window]
            if kind == "mlp":
                loss = (model(batch[0]) - batch[1]).pow(2).mean()
            else:
                loss_sum, items = batch_loss(kind, model, batch, "items")
                loss = loss_sum / items
            losses.append(loss.item())
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            for _ in range(world_size):
                sched.step()
            steps += 1
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": steps, "losses": losses, "norms": norms,
            "lr": sched.get_last_lr()[0]}


# --------------------------------------------------------------------------- runs (under accelerate launch)

def _count_allreduces(prof):
    return sum(1 for e in prof.events() if e.name == "gloo:all_reduce")


def train(accelerator_cls, case, *, stop_after=None, resume_from=None, save_to=None, init_seed=0, **kwargs):
    """The README's loop. `stop_after=(epoch, batches)` saves the state there
    (to `save_to`) and stops; `resume_from=(dir, epoch, batches)` loads it and
    goes on from there."""
    from torch.profiler import ProfilerActivity, profile

    kind, n, reduction = CASES[case]
    # Stock Accelerate needs cpu=True for Gloo ranks under `accelerate launch --multi_gpu` on a torch
    # without CUDA (else every process is DistributedType.NO, alone); the adapter sets it itself.
    cpu = {} if accelerator_cls.__module__.startswith("gradaccum") else {"cpu": True}
    accelerator = accelerator_cls(gradient_accumulation_steps=K, **cpu, **kwargs)
    model = make_model(kind, init_seed)
    opt, sched = make_optimizer(model)
    loader = torch.utils.data.DataLoader(make_data(kind, n), batch_size=ROWS, shuffle=False)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    ours = hasattr(accelerator, "accumulator")
    start_epoch, skip = 0, 0
    if resume_from is not None:
        accelerator.load_state(resume_from[0])
        start_epoch, skip = resume_from[1], resume_from[2]
    losses, sync_flags, clip_norms, batches, lrs = [], [], [], 0, []
    max_steps, completed_steps = MAX_STEPS.get(case), 0
    epochs = EPOCHS
    if max_steps is not None:  # as the *_no_trainer.py scripts compute it
        epochs = -(-max_steps // -(-len(loader) // K))
    model.train()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for epoch in range(start_epoch, epochs):
            epoch_loader = accelerator.skip_first_batches(loader, skip) if skip else loader
            skip = 0
            for b, batch in enumerate(epoch_loader):
                if stop_after is not None and (epoch, b) == stop_after:
                    accelerator.save_state(save_to)
                    accelerator.wait_for_everyone()
                    return {"stopped": True}
                with accelerator.accumulate(model):
                    loss, items = batch_loss(kind, model, batch, reduction)
                    if ours:
                        accelerator.backward(loss, num_items=items)
                    else:
                        accelerator.backward(loss)
                    sync_flags.append(bool(accelerator.sync_gradients))
                    if accelerator.sync_gradients:
                        norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                        clip_norms.append(norm)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                batches += 1
                lrs.append(sched.get_last_lr()[0])
                if ours and accelerator.sync_gradients and accelerator.window_loss is not None:
                    losses.append(float(accelerator.window_loss))
                completed_steps += int(accelerator.sync_gradients)
                if max_steps is not None and completed_steps >= max_steps:
                    break
            if max_steps is not None and completed_steps >= max_steps:
                break
    out = {
        "params": [p.detach().clone() for p in model.parameters()],
        "allreduces": _count_allreduces(prof),
        "batches": batches,
        "epochs": epochs,
        "sync_flags": sync_flags,
        "clip_norms": [float(c) if c is not None else None for c in clip_norms],
        "lr": sched.get_last_lr()[0],
        "lrs": lrs,
        "gathered": accelerator.gather(torch.tensor([float(accelerator.process_index)])).tolist(),
        "reduced": float(accelerator.reduce(torch.tensor(1.0), reduction="sum")),
    }
    if ours:
        out["stats"] = {k: v for k, v in accelerator.accumulator.stats().items()
                        if isinstance(v, (int, float, bool, str))}
        out["window_losses"] = losses
        accelerator.accumulator.close()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import accelerate

    from gradaccum.accelerate import Accelerator

    results = {}
    for case in args.cases.split(","):
        if case == "resume":
            ckpt = os.path.join(args.out, "ckpt")
            stop = (1, 4)  # epoch 1, after 4 batches: the middle of a window (K = 3)
            train(Accelerator, "partial", stop_after=stop, save_to=ckpt)
            results[case] = train(Accelerator, "partial", resume_from=(ckpt, *stop), init_seed=7)
        elif case.startswith("stock_"):
            results[case] = train(accelerate.Accelerator, case[len("stock_"):])
        else:
            reduction = CASES[case][2]
            results[case] = train(Accelerator, case, reduction=reduction)
    from accelerate.state import PartialState

    rank = PartialState().process_index
    torch.save(results, os.path.join(args.out, f"rank{rank}.pt"))
    PartialState().wait_for_everyone()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
