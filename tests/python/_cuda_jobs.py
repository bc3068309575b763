"""CUDA-only jobs of test_gpu.py that have no CPU twin: a model whose forward
runs a branch on a side stream, whose backward there is slowed down on the GPU
(so a bucket read before that stream's gradients are in it would read stale
values), stepped by a fused AdamW over bucket views.

Each job runs on every rank (spawned by _dist_utils.run_job with
module="_cuda_jobs") and returns plain data; the parent checks it against one
process on the global batch in float64 on the CPU (`reference`).
"""
import torch
import torch.nn as nn

from _dist_utils import job

D, OUT, ROWS = 384, 8, 16
LR, EPS, WEIGHT_DECAY = 1e-3, 1e-3, 0.01
# About 10 ms of one multiprocessor's clock: the side stream's backward ends
# long after the CPU has gone on to queue the default stream's.
SLEEP_CYCLES = 20_000_000


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward first spins on the GPU (on the stream that the
    autograd engine runs it on: its forward's, the side stream)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if grad.is_cuda:
            torch.cuda._sleep(SLEEP_CYCLES)
        return grad


class SideStreamNet(nn.Module):
    """h = tanh(e(x)); b(tanh(a-branch(h) + c(h))): on CUDA the a-branch runs
    on a side stream; `c_first` says whether c runs before it (so the engine
    runs c's backward after the a-branch's: a bucket holding a's and c's
    gradients is then filled last by c, on the default stream, while a's are
    still being computed on the side stream) or after. e's gradients come
    last, so that bucket is not the window's last one (which only the end of
    backward launches)."""

    def __init__(self, seed, c_first):
        super().__init__()
        torch.manual_seed(seed)
        self.e, self.a, self.c, self.b = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, OUT)
        self.c_first = c_first
        self.side = None

    def forward(self, x):
        x = torch.tanh(self.e(x))
        if not x.is_cuda:
            return self.b(torch.tanh(torch.tanh(self.a(x)) + self.c(x)))
        if self.side is None:
            self.side = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        hc = self.c(x) if self.c_first else None
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            x.record_stream(self.side)
            ha = _SlowBackward.apply(torch.tanh(self.a(x)))
        main.wait_stream(self.side)
        ha.record_stream(main)
        if hc is None:
            hc = self.c(x)
        return self.b(torch.tanh(ha + hc))


def batch(seed, window, rank, k):
    g = torch.Generator().manual_seed(seed * 100003 + window * 1009 + rank * 101 + k)
    return torch.randn(ROWS, D, generator=g), torch.randn(ROWS, OUT, generator=g)


def reference(seed, world_size, steps, windows, c_first):
    """Each window's gradient, and the parameters after the last window: one
    process, float64, the global batch (every rank's micro-batches) in one
    backward, a plain AdamW."""
    model = SideStreamNet(seed, c_first).double()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False)
    grads = []
    for w in range(windows):
        parts = [batch(seed, w, r, k) for r in range(world_size) for k in range(steps)]
        x = torch.cat([p[0] for p in parts]).double()
        y = torch.cat([p[1] for p in parts]).double()
        (model(x) - y).pow(2).mean().backward()  # equal micro-batches: the mean of their means
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, [p.detach().clone() for p in model.parameters()]


@job
def side_stream_windows(rank, world_size, *, seed, steps, windows, configs):
    """For each (gradient_as_bucket_view, c_first, first_bucket_cap_mb,
    bucket_cap_mb) in
    `configs`: `windows` windows of `steps` micro-steps on cuda:0, fused AdamW;
    each window's reduced gradient (read before acc.step()) and the final
    parameters, in float64 on the CPU."""
    import gradaccum

    torch.cuda.set_device(0)
    out = []
    for views, c_first, first_cap_mb, cap_mb in configs:
        model = SideStreamNet(seed, c_first).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
        acc = gradaccum.Accumulator(model, opt, steps=steps, gradient_as_bucket_view=views,
                                    bucket_cap_mb=cap_mb, first_bucket_cap_mb=first_cap_mb)
        grads, launched = [], []
        for w in range(windows):
            for k in range(steps):
                x, y = batch(seed, w, rank, k)
                acc.backward((model(x.cuda()) - y.cuda()).pow(2).mean())
                if acc.window_ready:
                    grads.append([p.grad.double().cpu() for p in model.parameters()])
                    launched.append(acc.stats()["last_window_launched_in_backward"])
                acc.step()
        out.append({"grads": grads, "params": [p.detach().double().cpu() for p in model.parameters()],
                    "buckets": acc.bucket_indices, "steps": acc.stats()["optimizer_steps"],
                    "launched_in_backward": launched})
        acc.close()
    return out
