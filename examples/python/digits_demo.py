"""Gradient accumulation gives the big-batch run: a demo on sklearn's digits.

    python examples/python/digits_demo.py --out build/demo      (or: make demo)

Trains one small MLP twice from the same initial weights, on the same shuffled
batches, with the same Adam optimizer and the same number of optimizer steps:

  (a) "big batch":  one backward over a batch of B rows, then optimizer.step();
  (b) "gradaccum":  gradaccum.split() cuts each batch into K micro-batches of
                    B/K rows; gradaccum.Accumulator(steps=K) runs K backwards
                    and steps the optimizer once per window.

With reduction="mean" (the default) a window's gradient is the gradient of the
mean of the K micro-batch losses, which for equal micro-batches is the
big-batch gradient. The two runs differ only by float32 rounding (~1e-6), so
the validation-accuracy curves coincide. The script prints both curves, the
largest parameter and accuracy differences, saves the two training-loss curves
to OUT/loss_curves.png, and exits with status 1 if the runs diverge beyond the
tolerances (--grad-tol, --param-tol, --acc-tol, --loss-tol). Because Adam is
nearly blind to a gradient's scale, it also compares one batch's gradient
directly with the window's gradient that gradaccum leaves in .grad.

The parameters usually agree to ~1e-6, but with some seeds (--seed 2) or
longer training a few weights drift apart by up to ~1e-3: where a weight's
gradient nearly cancels, Adam's per-coordinate normalisation amplifies float32
rounding. Hand-written accumulation (loss / K, K backwards) drifts identically:
it is float arithmetic, not gradaccum. So --param-tol is loose, while the
gradient, loss and accuracy checks are tight.

The accumulation loop makes fewer optimizer steps per second than the big
batch: each step runs K forward/backward calls on B/K rows instead of one on
B rows, and on a model this small each call's fixed cost dominates. What it
buys is memory: activations for B/K rows at a time.

Then (unless --ranks 0) the same model on 2 spawned processes (Gloo on
loopback), each window one big batch spread over the ranks, K micro-batches
each, trained three ways: gradaccum, torch DDP all-reducing at every
micro-step, and DDP with no_sync() on the first K-1. It prints the
all-reduces per window of each, counted independently: gradaccum's
acc.stats(), and a DDP communication hook that counts its calls. gradaccum
and DDP + no_sync need one per bucket per window; DDP without no_sync needs K.

The data (load_digits: 1797 8x8 images, 10 classes) ships with scikit-learn;
nothing is downloaded.
"""
import argparse
import copy
import json
import multiprocessing
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

import gradaccum


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="build/demo", help="folder for loss_curves.png")
    p.add_argument("--batch", type=int, default=192, help="big batch size B")
    p.add_argument("--steps", type=int, default=6, help="micro-batches per window K (B/K rows each)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-tol", type=float, default=1e-5,
                   help="max |gradient difference| allowed, relative to the largest |gradient|")
    p.add_argument("--param-tol", type=float, default=1e-2,
                   help="max |param difference| allowed (loose: see the docstring)")
    p.add_argument("--acc-tol", type=float, default=0.01, help="max validation-accuracy difference allowed")
    p.add_argument("--loss-tol", type=float, default=1e-4, help="max training-loss difference allowed")
    p.add_argument("--ranks", type=int, default=2,
                   help="processes for the collectives-per-window run (0: skip it)")
    p.add_argument("--windows", type=int, default=5, help="windows of that run")
    return p.parse_args(argv)


Data = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def load_data(seed: int) -> Data:
    """Standardised digits, a stratified 80/20 train/validation split, as tensors."""
    # Imported here: the ranks of the collectives run get their data from the
    # parent and need not import scikit-learn (a second or two each).
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        digits.data.astype(np.float32), digits.target, test_size=0.2,
        random_state=seed, stratify=digits.target)
    scaler = StandardScaler().fit(x_train)

    def as_x(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(scaler.transform(a).astype(np.float32))

    def as_y(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64))

    return as_x(x_train), as_y(y_train), as_x(x_val), as_y(y_val)


def make_model(hidden: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10))


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((model(x).argmax(dim=1) == y).float().mean().item())


def batches(n: int, batch: int, epoch: int, seed: int) -> List[torch.Tensor]:
    """The same shuffled full batches for both runs (the last partial batch is dropped)."""
    g = torch.Generator().manual_seed(seed * 1000 + epoch)
    perm = torch.randperm(n, generator=g)
    return [perm[i:i + batch] for i in range(0, n - batch + 1, batch)]


def train(name: str, init_model: torch.nn.Module, data: Data, args: argparse.Namespace,
          use_accumulator: bool) -> Tuple[torch.nn.Module, List[float], List[float], float]:
    """Trains a copy of init_model; returns it, the loss per optimizer step, the
    validation accuracy per epoch and the optimizer steps per second of the
    fastest epoch (the least disturbed by other work on the machine)."""
    x_train, y_train, x_val, y_val = data
    model = copy.deepcopy(init_model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    acc = gradaccum.Accumulator(model, optimizer, steps=args.steps) if use_accumulator else None

    losses: List[float] = []
    val_acc: List[float] = []
    n_batches = len(batches(len(x_train), args.batch, 0, args.seed))
    bar = tqdm(total=args.epochs * n_batches, desc=f"{name:>9}", unit="step", leave=True,
               file=sys.stdout, dynamic_ncols=True)
    fastest = float("inf")
    for epoch in range(args.epochs):
        start = time.perf_counter()
        model.train()
        for idx in batches(len(x_train), args.batch, epoch, args.seed):
            xb, yb = x_train[idx], y_train[idx]
            if acc is None:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(xb), yb)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            else:
                window_loss = 0.0
                for xm, ym in gradaccum.split((xb, yb), args.steps):
                    loss = loss_fn(model(xm), ym)
                    acc.backward(loss)
                    window_loss += loss.item()
                    stepped = acc.step()  # steps only at the window's last micro-batch
                assert stepped, "the optimizer should step once per window"
                losses.append(window_loss / args.steps)
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses[-1]:.4f}", refresh=False)
        fastest = min(fastest, time.perf_counter() - start)
        model.eval()
        val_acc.append(accuracy(model, x_val, y_val))
    bar.close()
    if acc is not None:
        s = acc.stats()
        assert s["optimizer_steps"] == len(losses), s
    return model, losses, val_acc, n_batches / fastest


def gradient_difference(init_model: torch.nn.Module, data: Data,
                        args: argparse.Namespace) -> Tuple[float, float]:
    """Largest |difference| between one big batch's gradient and the window's
    gradient gradaccum leaves in .grad (no optimizer: backward() only). Adam is
    nearly blind to a gradient's scale, so this checks the scale directly."""
    x, y = data[0][:args.batch], data[1][:args.batch]
    loss_fn = torch.nn.CrossEntropyLoss()
    big = copy.deepcopy(init_model)
    loss_fn(big(x), y).backward()
    small = copy.deepcopy(init_model)
    acc = gradaccum.Accumulator(small, None, steps=args.steps)
    for xm, ym in gradaccum.split((x, y), args.steps):
        acc.backward(loss_fn(small(xm), ym))
    big_grads = [p.grad for p in big.parameters() if p.grad is not None]
    small_grads = [p.grad for p in small.parameters() if p.grad is not None]
    scale = max(g.abs().max().item() for g in big_grads)
    diff = max((g - h).abs().max().item() for g, h in zip(big_grads, small_grads))
    return diff, scale


# --------------------------------------------------------------------------- #
# Collectives per window on several ranks
# --------------------------------------------------------------------------- #

CONTENDERS = {
    "gradaccum": ("gradaccum.Accumulator", 'acc.stats()["collectives"]'),
    "ddp_every": ("DDP without no_sync()", "a DDP comm hook that counts"),
    "ddp_no_sync": ("DDP with no_sync()", "a DDP comm hook that counts"),
}


Window = List[Tuple[torch.Tensor, torch.Tensor]]  # one rank's micro-batches of one window


class HookCounter:
    """The state of a DDP communication hook that counts its calls: DDP calls
    it once per bucket in every backward that synchronises."""

    def __init__(self) -> None:
        self.calls = 0


# DDP insists on these exact annotations; torch.distributed does not re-export
# GradBucket for type checkers, hence the ignore.
def counting_allreduce(state: HookCounter,
                       bucket: dist.GradBucket,  # type: ignore[name-defined]
                       ) -> torch.futures.Future[torch.Tensor]:
    """Counts, then does what DDP's default hook does: the mean over ranks."""
    state.calls += 1
    tensor = bucket.buffer().div_(dist.get_world_size())
    work = dist.all_reduce(tensor, async_op=True)
    assert work is not None
    reduced: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return reduced


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_contender(name: str, init_model: torch.nn.Module, windows: List[Window],
                  args: argparse.Namespace) -> Tuple[List[int], torch.nn.Module, int]:
    """Trains a copy of init_model over the windows; returns the all-reduces of
    each window, the model and the number of gradient buckets (gradaccum)."""
    model = copy.deepcopy(init_model)
    loss_fn = torch.nn.CrossEntropyLoss()
    counts: List[int] = []
    if name == "gradaccum":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        with gradaccum.Accumulator(model, optimizer, steps=args.steps) as acc:
            for micro_batches in windows:
                before = acc.stats()["collectives"]
                for xm, ym in micro_batches:
                    acc.backward(loss_fn(model(xm), ym))  # the micro-batch's own mean loss
                    acc.step()
                counts.append(acc.stats()["collectives"] - before)
            return counts, model, int(acc.stats()["buckets"])
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    counter = HookCounter()
    ddp.register_comm_hook(counter, counting_allreduce)
    for micro_batches in windows:
        before = counter.calls
        for k, (xm, ym) in enumerate(micro_batches):
            last = k == len(micro_batches) - 1
            if name == "ddp_no_sync" and not last:
                with ddp.no_sync():  # forward and backward inside: no all-reduce
                    (loss_fn(ddp(xm), ym) / args.steps).backward()
            else:
                (loss_fn(ddp(xm), ym) / args.steps).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        counts.append(counter.calls - before)
    return counts, model, 0


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, init_model: torch.nn.Module,
              shards: List[List[Window]], out: str) -> None:
    """One rank of the collectives run (a spawned process's entry point):
    shards[rank] holds this rank's micro-batches, window by window."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        windows = shards[rank]
        result: Dict[str, object] = {"world": world, "micro_batch": len(windows[0][0][0]),
                                     "windows": len(windows)}
        models = {}
        for name in CONTENDERS:
            counts, model, buckets = run_contender(name, init_model, windows, args)
            result[name] = counts
            models[name] = model
            if buckets:
                result["buckets"] = buckets
        ref = list(models["gradaccum"].parameters())
        result["param_diff"] = {name: max((p - q).abs().max().item() for p, q in zip(models[name].parameters(), ref))
                                for name in ("ddp_every", "ddp_no_sync")}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def collectives_per_window(init_model: torch.nn.Module, data: Data, args: argparse.Namespace) -> bool:
    """Runs rank_main on args.ranks processes, prints the all-reduces per window
    of each contender; returns whether they are what they should be. Each
    window is one big batch of the one-process runs, spread over the ranks."""
    x, y = data[0], data[1]
    share = args.batch // args.ranks
    micro = share // args.steps
    shards: List[List[Window]] = [[] for _ in range(args.ranks)]
    for idx in batches(len(x), args.batch, 0, args.seed)[:args.windows]:
        for rank, shard in enumerate(shards):
            mine = idx[rank * share:(rank + 1) * share]
            shard.append(list(zip(torch.split(x[mine], micro), torch.split(y[mine], micro))))
    out = os.path.join(args.out, "collectives.json")
    if os.path.exists(out):
        os.remove(out)
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(rank, args.ranks, port, args, init_model, shards, out))
             for rank in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=180)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    if any(proc.exitcode != 0 for proc in procs):
        raise RuntimeError(f"a rank of the collectives run failed (exit codes {[p.exitcode for p in procs]}); "
                           "its error is above")
    with open(out) as f:
        r = json.load(f)
    print(f"\n{r['world']} ranks (processes, Gloo on loopback), {r['windows']} windows of K={args.steps} "
          f"micro-batches of {r['micro_batch']} rows per rank: all-reduces per window")
    for name, (label, how) in CONTENDERS.items():
        counts = sorted(set(r[name]))
        shown = str(counts[0]) if len(counts) == 1 else ", ".join(map(str, r[name]))
        print(f"  {label:<23} {shown:>4}   (counted by {how})")
    buckets = r["buckets"]
    print(f"  The gradients fit in {buckets} bucket{'s' if buckets > 1 else ''}: gradaccum and DDP with no_sync() "
          f"all-reduce each bucket once per window, DDP without it once per micro-batch ({args.steps} times).")
    diff = r["param_diff"]
    print(f"  Largest |parameter difference| to gradaccum after {r['windows']} Adam steps: "
          f"DDP without no_sync() {diff['ddp_every']:.1e}, with it {diff['ddp_no_sync']:.1e}")
    return (set(r["gradaccum"]) == {buckets} and set(r["ddp_every"]) == {args.steps * r["ddp_no_sync"][0]}
            and max(diff.values()) <= args.param_tol)


def save_plot(path: str, big_losses: List[float], acc_losses: List[float], args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(big_losses) + 1)
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.3]})
    ax.plot(steps, big_losses, lw=2.5, alpha=0.6, label=f"big batch (B={args.batch})")
    ax.plot(steps, acc_losses, "--", lw=1.2, color="k",
            label=f"gradaccum (K={args.steps} x {args.batch // args.steps})")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("digits MLP, Adam: big batch vs gradient accumulation")
    ax.legend()
    diff = np.abs(np.asarray(big_losses) - np.asarray(acc_losses))
    ax_diff.semilogy(steps, np.maximum(diff, 1e-12), color="tab:red")
    ax_diff.set_ylabel("|difference|")
    ax_diff.set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.batch % args.steps:
        sys.exit(f"--batch ({args.batch}) must be a multiple of --steps ({args.steps})")
    if args.ranks > 1 and args.batch % (args.ranks * args.steps):
        sys.exit(f"--batch ({args.batch}) must be a multiple of --ranks x --steps ({args.ranks * args.steps})")
    torch.manual_seed(args.seed)
    data = load_data(args.seed)
    init_model = make_model(args.hidden)
    n_params = sum(p.numel() for p in init_model.parameters())
    print(f"gradaccum {gradaccum.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"digits: {len(data[0])} train / {len(data[2])} validation rows; MLP with {n_params:,} parameters; "
          f"Adam lr={args.lr}; {args.epochs} epochs")

    grad_diff, grad_scale = gradient_difference(init_model, data, args)
    big_model, big_losses, big_acc, big_rate = train("big batch", init_model, data, args, use_accumulator=False)
    acc_model, acc_losses, acc_acc, acc_rate = train("gradaccum", init_model, data, args, use_accumulator=True)

    print(f"\nvalidation accuracy per epoch (B={args.batch} vs K={args.steps} x {args.batch // args.steps})")
    print(f"{'epoch':>5}  {'big batch':>10}  {'gradaccum':>10}  {'difference':>10}")
    for e, (a, b) in enumerate(zip(big_acc, acc_acc), 1):
        print(f"{e:>5}  {a:>10.4f}  {b:>10.4f}  {abs(a - b):>10.2e}")

    param_diff = max((p - q).abs().max().item()
                     for p, q in zip(big_model.parameters(), acc_model.parameters()))
    acc_diff = max(abs(a - b) for a, b in zip(big_acc, acc_acc))
    loss_diff = max(abs(a - b) for a, b in zip(big_losses, acc_losses))
    print(f"\nlargest |gradient difference|, one batch: {grad_diff:.3e}  (largest |gradient| {grad_scale:.3e}; "
          f"tolerance {args.grad_tol:g} relative)")
    print(f"largest |parameter difference|:          {param_diff:.3e}  (tolerance {args.param_tol:g})")
    print(f"largest validation-accuracy difference:  {acc_diff:.3e}  (tolerance {args.acc_tol:g})")
    print(f"largest training-loss difference:        {loss_diff:.3e}  (tolerance {args.loss_tol:g})")

    os.makedirs(args.out, exist_ok=True)
    plot = os.path.join(args.out, "loss_curves.png")
    save_plot(plot, big_losses, acc_losses, args)
    print(f"saved {plot}")

    micro = args.batch // args.steps
    print(f"\noptimizer steps per second (fastest epoch): big batch {big_rate:.0f}, gradaccum {acc_rate:.0f}. "
          f"gradaccum makes fewer because each of its steps runs K={args.steps} forward/backward calls on "
          f"{micro} rows where the big batch runs one on {args.batch}, and on a model this small each call's "
          f"fixed cost dominates. What accumulation buys is memory: activations of {micro} rows at a time.")

    ok = grad_diff <= args.grad_tol * grad_scale and param_diff <= args.param_tol and acc_diff <= args.acc_tol and loss_diff <= args.loss_tol
    print("OK: gradient accumulation matches the big batch" if ok else
          "FAIL: the two runs diverged beyond the tolerance")
    if args.ranks > 1:
        ranks_ok = collectives_per_window(init_model, data, args)
        print("OK: one all-reduce per bucket per window" if ranks_ok else
              "FAIL: unexpected all-reduce counts or parameters")
        ok = ok and ranks_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
