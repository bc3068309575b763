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

The data (load_digits: 1797 8x8 images, 10 classes) ships with scikit-learn;
nothing is downloaded.
"""
import argparse
import copy
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
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
    return p.parse_args(argv)


Data = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def load_data(seed: int) -> Data:
    """Standardised digits, a stratified 80/20 train/validation split, as tensors."""
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
          use_accumulator: bool) -> Tuple[torch.nn.Module, List[float], List[float]]:
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
    for epoch in range(args.epochs):
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
        model.eval()
        val_acc.append(accuracy(model, x_val, y_val))
    bar.close()
    if acc is not None:
        s = acc.stats()
        assert s["optimizer_steps"] == len(losses), s
    return model, losses, val_acc


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
    torch.manual_seed(args.seed)
    data = load_data(args.seed)
    init_model = make_model(args.hidden)
    n_params = sum(p.numel() for p in init_model.parameters())
    print(f"gradaccum {gradaccum.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"digits: {len(data[0])} train / {len(data[2])} validation rows; MLP with {n_params:,} parameters; "
          f"Adam lr={args.lr}; {args.epochs} epochs")

    grad_diff, grad_scale = gradient_difference(init_model, data, args)
    t0 = time.perf_counter()
    big_model, big_losses, big_acc = train("big batch", init_model, data, args, use_accumulator=False)
    acc_model, acc_losses, acc_acc = train("gradaccum", init_model, data, args, use_accumulator=True)
    elapsed = time.perf_counter() - t0

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
    print(f"saved {plot}; both runs took {elapsed:.1f} s")

    ok = grad_diff <= args.grad_tol * grad_scale and param_diff <= args.param_tol and acc_diff <= args.acc_tol and loss_diff <= args.loss_tol
    print("OK: gradient accumulation matches the big batch" if ok else
          "FAIL: the two runs diverged beyond the tolerance")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
