"""A Hugging Face Accelerate script that accumulates with gradaccum: only the
import line and ``reduction="items"`` differ from a stock Accelerate script.

    accelerate launch --multi_gpu --num_processes 2 examples/python/train_accelerate.py   # 2 ranks
    python examples/python/train_accelerate.py                                            # 1 process

A tiny randomly initialised GPT-2 (no download) in float64 learns next tokens
of padded sequences (labels -100 past each sequence's end). The loss is summed
over the valid next-token targets and ``num_items`` counts them: each window's
gradient is that of the exact per-token mean over the window on every rank,
also for the epoch's last, partial window. At the end rank 0 trains one
process on the same windows as big batches and prints the largest parameter
difference (``--check``, on by default), and every rank prints its counts:
one all-reduce per window.

On a machine without GPUs, ``accelerate launch --multi_gpu`` still gives Gloo
ranks on CPU: the adapter passes ``cpu=True`` there (stock Accelerate would
leave each process alone).
"""
import argparse
from typing import Tuple

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel  # type: ignore[import-not-found, unused-ignore]

from gradaccum.accelerate import Accelerator  # was: from accelerate import Accelerator

VOCAB, T = 50, 8


def build_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def build_data(n: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (n, T), generator=g)
    lengths = torch.randint(2, T + 1, (n,), generator=g)
    labels = ids.masked_fill(torch.arange(T)[None, :] >= lengths[:, None], -100)
    return torch.utils.data.TensorDataset(ids, labels)


def token_loss(model: torch.nn.Module, ids: torch.Tensor,
               labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(loss summed over the valid next-token targets, their count)."""
    logits = model(input_ids=ids).logits[:, :-1]
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3, help="micro-batches per window (K)")
    parser.add_argument("--batch", type=int, default=2, help="rows per micro-batch")
    parser.add_argument("--samples", type=int, default=26)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no-check", dest="check", action="store_false")
    args = parser.parse_args()
    torch.set_num_threads(1)

    accelerator = Accelerator(gradient_accumulation_steps=args.steps, reduction="items")
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.95 ** s)
    loader = torch.utils.data.DataLoader(build_data(args.samples), batch_size=args.batch)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    for epoch in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                loss_sum, n = token_loss(model, *batch)
                accelerator.backward(loss_sum, num_items=n)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        window_loss = accelerator.window_loss
        assert window_loss is not None
        accelerator.print(f"epoch {epoch}: last window's per-token loss {float(window_loss):.6f} "
                          "(every rank's tokens)")

    assert accelerator.accumulator is not None
    stats = accelerator.accumulator.stats()
    print(f"rank {accelerator.process_index}: {stats['windows']} windows, {stats['optimizer_steps']} optimizer "
          f"steps, {stats['collectives']} all-reduces", flush=True)
    if args.check and accelerator.is_main_process:
        # One process, big batches: a window is world * K * batch consecutive
        # samples (Accelerate deals batches to the ranks in turn), the epoch's
        # last one what is left; the schedule steps num_processes times a step.
        world = accelerator.num_processes
        reference = build_model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
        ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.95 ** s)
        data, window = build_data(args.samples), world * args.steps * args.batch
        for _ in range(args.epochs):
            for start in range(0, args.samples, window):
                loss_sum, n = token_loss(reference, *data[start:start + window])
                torch.autograd.backward(loss_sum / n)
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
                ref_opt.step()
                ref_opt.zero_grad()
                for _ in range(world):
                    ref_sched.step()
        diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
        print(f"max parameter difference vs one process on the big batches: {diff:.3g}")
        assert diff <= 1e-12, diff
    accelerator.end_training()


if __name__ == "__main__":
    main()
