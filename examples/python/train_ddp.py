"""Data-parallel gradient accumulation with gradaccum, launched by torchrun.

    torchrun --standalone --nproc_per_node=2 examples/python/train_ddp.py --steps 4

(or `python -m torch.distributed.run --standalone --nproc_per_node=2 ...`).

Every rank trains the same small MLP on sklearn's digits (bundled with
scikit-learn, nothing is downloaded). Each optimizer step ("window") sees a
global batch of WORLD_SIZE * K * B rows: rank r takes its own K micro-batches
of B rows, and gradaccum.Accumulator(steps=K) runs K backwards, the first K-1
with no communication and the K-th all-reducing the gradient buckets while
backward runs. The window's gradient is that of the mean loss over the whole
global batch, so at the end rank 0 re-trains the model in one process, one
backward per global batch, and prints the largest parameter difference.

Rank 0 prints each window's loss and all-reduce count, the accumulator's
stats(), the final loss and `max |param - reference|`; the script exits with
status 1 if that difference exceeds --tol (default: 1e-4 for float32, 1e-10
for float64). With --trace FILE, rank 0 writes the last window's reduction on
every rank as one Chrome trace (open it in https://ui.perfetto.dev).
"""
import argparse
import os
import sys
from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import gradaccum


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="micro-batches per window (K)")
    p.add_argument("--windows", type=int, default=10, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch (B)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=0.01,
                   help="small, so that the tiny model spans several buckets")
    p.add_argument("--tol", type=float, default=None)
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write the last window's reduction, every rank's, as a Chrome trace")
    return p.parse_args(argv)


def make_model(seed: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 10)).to(dtype)


def load_data(dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=dtype)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return x, torch.tensor(digits.target)


def window_rows(window: int, global_batch: int, n_rows: int, seed: int) -> torch.Tensor:
    """Row indices of one window's global batch (the same on every rank)."""
    g = torch.Generator().manual_seed(seed * 100_003 + window)
    return torch.randperm(n_rows, generator=g)[:global_batch]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    tol = args.tol if args.tol is not None else (1e-10 if dtype == torch.float64 else 1e-4)

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # RANK, WORLD_SIZE, ... from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    K, B = args.steps, args.micro_batch
    global_batch = world * K * B
    x, y = load_data(dtype)
    assert global_batch <= len(x), f"global batch {global_batch} > {len(x)} rows"

    model = make_model(args.seed + rank, dtype)  # different on purpose: the Accumulator
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # broadcasts rank 0's
    acc = gradaccum.Accumulator(model, optimizer, steps=K, reduction="mean",
                                bucket_cap_mb=args.bucket_cap_mb,
                                first_bucket_cap_mb=args.bucket_cap_mb)
    initial = {k: v.clone() for k, v in model.state_dict().items()}  # rank 0's, on every rank
    if rank == 0:
        print(f"world size {world}, K={K} micro-batches of {B} rows per rank, "
              f"global batch {global_batch}, {len(acc.bucket_indices)} buckets", flush=True)

    final_loss = None
    for w in range(args.windows):
        rows = window_rows(w, global_batch, len(x), args.seed)
        mine = rows[rank * K * B:(rank + 1) * K * B]
        for k in range(K):
            idx = mine[k * B:(k + 1) * B]
            acc.backward(F.cross_entropy(model(x[idx]), y[idx]))
        stats = acc.stats()  # this window's reduction, before anything else
        acc.step()
        # The window's mean loss over every rank's micro-batches: it rode in
        # the gradient all-reduce's header, no collective of its own.
        window_loss = acc.window_loss
        assert window_loss is not None  # float32 parameters: the header carries it
        final_loss = float(window_loss)
        if rank == 0:
            print(f"window {w:3d}  loss {final_loss:.6f}  all-reduces {stats['last_window_collectives']}"
                  f"  bytes {stats['last_window_bytes']}", flush=True)
    # Every window here is full; with a ragged end of data every rank would call
    # acc.flush() to close the partial window.
    stats = acc.stats()
    if args.trace:  # a collective: every rank's trace to every rank
        traces: List[Any] = [None] * world
        dist.all_gather_object(traces, acc.window_trace())
        if rank == 0:
            gradaccum.trace.save(args.trace, traces)
            print(f"trace: {args.trace}")
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return 0

    print(f"stats: {stats}")
    print(f"final loss: {final_loss:.6f}")
    # One process, one backward per global batch, the same optimizer.
    reference = make_model(args.seed, dtype)
    reference.load_state_dict(initial)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=args.lr)
    for w in range(args.windows):
        rows = window_rows(w, global_batch, len(x), args.seed)
        torch.autograd.backward(F.cross_entropy(reference(x[rows]), y[rows]))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    print(f"max |param - reference|: {diff:.3e}")
    if not diff <= tol:
        print(f"FAILED: difference above --tol {tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
