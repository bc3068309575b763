"""A data-parallel loop that reports the global loss and survives bad micro-batches.

    torchrun --standalone --nproc_per_node=2 examples/python/train_resilient.py

Every rank trains the same MLP on sklearn's digits with a per-sample mean
(`reduction="items"`), K micro-batches per window, and shows three things a
real loop meets:

- **The global window loss** in a progress bar: `acc.window_loss`, the loss
  over every micro-batch of every rank weighted as the gradient, rode in the
  gradient all-reduce's header: no all-reduce or host sync of its own (the
  bar reads it once per window).
- **Out of memory on one rank**: the last rank pretends its device holds no
  more than `--max-rows` rows; `acc.run(fn, batch)` splits its micro-batches
  into parts that fit, while the other ranks run theirs whole. No rank waits
  for another's decision.
- **Bad micro-batches**: one micro-batch's loss is NaN (`nonfinite=
  "skip_micro_batch"` leaves it out, on its rank only) and one holds no valid
  label at all (`num_items=0`: it counts for nothing).

At the end rank 0 re-trains the model in one process, one backward per
window's global batch over the micro-batches kept, and prints the largest
parameter difference; the script exits with status 1 above --tol.
"""
import argparse
import functools
import sys
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from tqdm import tqdm

import gradaccum

IGNORE = -100  # a label that counts for nothing (padding, a prompt token)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="micro-batches per window (K)")
    p.add_argument("--windows", type=int, default=8, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch (B)")
    p.add_argument("--max-rows", type=int, default=5,
                   help="the last rank runs out of memory above this many rows")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-10)
    return p.parse_args(argv)


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10)).double()


def load_data() -> Tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float64)
    return (x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(digits.target)


def micro_batches(window: int, rank: int, world: int, k_steps: int, rows: int,
                  x: torch.Tensor, y: torch.Tensor, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor, bool]]:
    """Rank `rank`'s micro-batches of one window: (x, labels, poisoned)."""
    g = torch.Generator().manual_seed(seed * 100_003 + window)
    order = torch.randperm(len(x), generator=g)[:world * k_steps * rows]
    out = []
    for k in range(k_steps):
        idx = order[(rank * k_steps + k) * rows:(rank * k_steps + k + 1) * rows]
        labels = y[idx].clone()
        if (window, rank, k) == (1, world - 1, 2):
            labels[:] = IGNORE  # a micro-batch with no valid label
        out.append((x[idx], labels, (window, rank, k) == (2, 0, 1)))  # a NaN loss here
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # RANK, WORLD_SIZE, ... from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    K, B = args.steps, args.micro_batch
    x, y = load_data()
    assert world * K * B <= len(x)

    model = make_model(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    acc = gradaccum.Accumulator(model, optimizer, steps=K, reduction="items", nonfinite="skip_micro_batch")
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    low_memory = rank == world - 1

    def loss_of(batch: Tuple[torch.Tensor, torch.Tensor], poisoned: bool) -> Tuple[torch.Tensor, int]:
        inputs, labels = batch
        if low_memory and len(inputs) > args.max_rows:  # stands in for a real CUDA OOM
            raise torch.OutOfMemoryError(f"pretend: {len(inputs)} rows do not fit")
        loss = F.cross_entropy(model(inputs), labels, ignore_index=IGNORE, reduction="sum")
        if poisoned:
            loss = loss * float("nan")
        return loss, int((labels != IGNORE).sum())

    bar = tqdm(range(args.windows), desc="windows", disable=rank != 0, file=sys.stdout)
    for w in bar:
        for inputs, labels, poisoned in micro_batches(w, rank, world, K, B, x, y, args.seed):
            # fn(batch) is the forward; run() runs the backward, and splits
            # the batch (along its rows) if fn or the backward runs out of memory.
            acc.run(functools.partial(loss_of, poisoned=poisoned), (inputs, labels))
        acc.step()
        stats = acc.stats()
        assert acc.window_loss is not None
        bar.set_postfix(loss=f"{float(acc.window_loss):.4f}", items=int(acc.window_items),
                        skipped=stats["skipped_micro_batches"])
    bar.close()
    stats = acc.stats()
    print(f"rank {rank}: micro-steps {stats['micro_steps']}, optimizer steps {stats['optimizer_steps']}, "
          f"skipped micro-batches {stats['skipped_micro_batches']}, out-of-memory retries "
          f"{stats['oom_retries']}, parts of at most {stats['run_max_rows']} rows", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0

    # One process, one backward per window's global batch, over what was kept.
    reference = make_model(args.seed)
    reference.load_state_dict(initial)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
    for w in range(args.windows):
        kept = [mb for r in range(world) for mb in micro_batches(w, r, world, K, B, x, y, args.seed) if not mb[2]]
        inputs = torch.cat([mb[0] for mb in kept])
        labels = torch.cat([mb[1] for mb in kept])
        total = F.cross_entropy(reference(inputs), labels, ignore_index=IGNORE, reduction="sum")
        torch.autograd.backward(total / (labels != IGNORE).sum())
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    print(f"max |param - reference|: {diff:.3e}")
    if not diff <= args.tol:
        print(f"FAILED: difference above --tol {args.tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
