"""A job that survives a dead rank: torchrun restarts it, it resumes from its
last checkpoint, and it ends as the uninterrupted run would.

    torchrun --nnodes=1 --nproc_per_node=2 --max-restarts=3 \\
        --rdzv-backend=c10d --rdzv-endpoint=localhost:29400 --rdzv-id=job1 \\
        examples/python/train_restartable.py --ckpt /tmp/job1.pt

Every `--save-every` windows, at a window boundary, rank 0 writes the model,
the optimizer and the Accumulator's rank-independent state (a file replaced
atomically, so a rank killed mid-save leaves the previous one). After a
failure torchrun kills the surviving ranks and starts all of them again;
each loads the last checkpoint and goes on from the next window. The data of
window w is a function of w alone: a global batch of `--global-micro`
micro-batches, rank r taking every WORLD_SIZE-th one from r, so K =
global-micro / WORLD_SIZE. The global batch is then the same on any number of
ranks, and a job relaunched on fewer ranks resumes at the boundary with a
larger K (Note [Resuming on another shape]).

Rendezvous: `--rdzv-backend=c10d` with a fixed endpoint, and
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in every agent's environment. With it,
each attempt's rank 0 serves a new store on a new port (MASTER_PORT): nothing
the killed attempt wrote can be read by the next. Without it the agents share
one store across attempts; on one node this script then keys its process
group by TORCHELASTIC_RESTART_COUNT, but with several nodes it refuses to
start, because each agent counts its restarts on its own (an agent whose
ranks were healthy restarts them for the membership change without
counting), so ranks would look for each other under different keys until
the timeout. Both ways every restart came back in the tests (test_restart.py).

`--kill-rank R --kill-window W` kills rank R with SIGKILL in the middle of
window W, once (a file next to the checkpoint remembers it): a test's
stand-in for a lost GPU; `--kill-node` (given to one node's agent only) kills
that node's agent as well: a lost node. Rank 0 writes the final parameters to `--out`.
"""
import argparse
import os
import signal
import sys
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

import gradaccum


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="checkpoint file (rank 0 writes it)")
    p.add_argument("--windows", type=int, default=8, help="optimizer steps in all")
    p.add_argument("--global-micro", type=int, default=4, help="micro-batches per window over all ranks")
    p.add_argument("--micro-batch", type=int, default=3, help="rows per micro-batch")
    p.add_argument("--save-every", type=int, default=2, help="windows between checkpoints")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-window", type=int, default=None)
    p.add_argument("--kill-node", action="store_true",
                   help="with --kill-window: this rank kills its torchrun agent too (a lost node)")
    p.add_argument("--out", default=None, help="rank 0 saves the final parameters here")
    return p.parse_args(argv)


def make_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def micro_batch(seed: int, window: int, index: int, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `index` of window `window`: the same on any number of ranks."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + window * 1009 + index)
    return torch.randn(rows, 6, generator=g, dtype=torch.float64), torch.randn(rows, 3, generator=g,
                                                                              dtype=torch.float64)


def loss_of(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = model(x)
    return (out - y).pow(2).mean()


def reference(args: argparse.Namespace) -> List[torch.Tensor]:
    """One process, one backward per window on its global batch."""
    model = make_model(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for w in range(args.windows):
        batches = [micro_batch(args.seed, w, i, args.micro_batch) for i in range(args.global_micro)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        torch.autograd.backward(loss_of(model, (x, y)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def save_atomically(state: Dict[str, Any], path: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def init_group() -> None:
    """The process group of this attempt (the module's docstring says why)."""
    timeout = timedelta(seconds=60)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # No torchrun, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0 serves
        # a store of this attempt's own on MASTER_PORT.
        dist.init_process_group("gloo", timeout=timeout)
        return
    # The agents' shared store outlives a restart: the killed attempt's keys
    # (each rank's Gloo address) are still there, and a restarted rank that
    # read them would dial dead ports (`Gloo connectFullMesh failed ...
    # Connection refused`). A prefix per attempt keeps each attempt's keys
    # apart, but only one agent's restart count is sure to be every rank's.
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise SystemExit(
            "train_restartable.py: several torchrun agents share one store across restarts, and their restart "
            "counts may differ: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in every agent's environment")
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                     int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=PrefixStore(f"gradaccum/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)


def kill_now(args: argparse.Namespace, rank: int) -> bool:
    """Whether this rank dies here (--kill-rank, --kill-node): once per job."""
    if not (rank == args.kill_rank or args.kill_node):
        return False
    marker = f"{args.ckpt}.killed{rank}"
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    init_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_micro % world:
        raise SystemExit(f"--global-micro {args.global_micro} is not a multiple of the world size {world}")
    steps = args.global_micro // world
    model = make_model(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    acc = gradaccum.Accumulator(model, opt, steps=steps)
    start = 0
    if os.path.exists(args.ckpt):
        ckpt = torch.load(args.ckpt, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        acc.load_state_dict(ckpt["accumulator"])  # saved at a boundary: any world size, any steps
        start = ckpt["next_window"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == 0:
        print(f"attempt {attempt}: {world} rank(s), K={steps}, from window {start}", flush=True)
    for w in range(start, args.windows):
        for k in range(steps):
            if w == args.kill_window and k == steps // 2 and kill_now(args, rank):
                if args.kill_node:
                    os.kill(os.getppid(), signal.SIGKILL)  # the agent: the node is gone
                os.kill(os.getpid(), signal.SIGKILL)  # mid-window, as a lost GPU
            acc.backward(loss_of(model, micro_batch(args.seed, w, k * world + rank, args.micro_batch)))
            acc.step()
        if (w + 1) % args.save_every == 0:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "accumulator": acc.state_dict(), "next_window": w + 1}
            if rank == 0:
                save_atomically(state, args.ckpt)
    if rank == 0 and args.out:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "stats": acc.stats(), "world": world}, args.out)
    acc.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
