"""One rank of benchmarks/bench.py's Python side (not meant to be run by hand).

Launched twice (RANK 0 and 1) with WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
OMP_NUM_THREADS=1 in the environment. Two modes:

  serve: builds the model once per contender and answers commands read from
         stdin, one per line, the same on both ranks, in the same order:
           time CONTENDER K W     W timed windows of K micro-batches
           profile CONTENDER K    one window under torch.profiler: all-reduces
           allreduce R            R all-reduces of one flat whole-gradient tensor
           rss                    this process's peak RSS so far
           quit
  mem:   builds ONE contender in this fresh process, runs a few windows and
         reports peak RSS (peak RSS only grows, so each variant needs its own
         process).

  batch: (--batch) under torchrun, e.g. across the network namespaces of
         bench_net.py: for each --models entry, times --contenders at each K
         in blocks (rotating order), then one all-reduce of the whole gradient
         alone and a local backward alone; rank 0 decides when the time budget
         ends the blocks and tells the others. One "@@ {json}" line per rank.
  instr: (--instr) under valgrind's callgrind: instruction counts of the
         no-sync micro-steps and of whole windows (bench_instr.py).

Every answer is one stdout line "@@ {json}".
"""
import argparse
import atexit
import contextlib
import copy
import datetime
import json
import os
import threading
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Layer widths of the two benchmark models: Linear/ReLU stacks (no ReLU after
# the last Linear). bench_window.cpp builds the same ones.
MODELS = {
    "small": [256, 512, 256, 128, 10],  # 297,098 parameters
    "large": [1024, 2048, 2048, 2048, 256],  # 11,016,448 parameters
    # Only for the growth sweep (bench_net.py); the C++ program takes them as --widths.
    "m1": [512, 1024, 512, 256],  # 1,181,440
    "m3": [1024, 1024, 1024, 1024, 256],  # 3,411,200
    "xl": [2048, 4096, 4096, 4096, 2048],  # 50,350,080
}
# The transformer: a GPT-style decoder (token and position embeddings, causal
# self-attention + MLP blocks with LayerNorm, the output head tied to the
# token embedding), trained as a language model on random tokens.
# bench_window.cpp builds the same one (--model gpt).
TRANSFORMERS = {
    "gpt": {"vocab": 4096, "seq": 128, "d": 384, "layers": 6, "heads": 6},  # 12,269,568 parameters
}
MODEL_NAMES = sorted(MODELS) + sorted(TRANSFORMERS)
MICRO_BATCH = int(os.environ.get("GRADACCUM_BENCH_MICRO_BATCH", "32"))  # rows per micro-batch (MLPs)
# Sequences of TRANSFORMERS[...]["seq"] tokens per micro-batch of the transformer.
GPT_MICRO_BATCH = int(os.environ.get("GRADACCUM_BENCH_GPT_MICRO_BATCH", "2"))
POOL = 16  # distinct micro-batches cycled through
# Bucket cap (MiB): GRADACCUM_BENCH_BUCKET_CAP_MB for DDP and gradaccum alike
# (bench_net.py; bench_window.cpp reads it too), or else each library's own
# default (None: DDP's 25 MiB; gradaccum's, from the model's size).
BUCKET_CAP_MB = (float(os.environ["GRADACCUM_BENCH_BUCKET_CAP_MB"])
                 if os.environ.get("GRADACCUM_BENCH_BUCKET_CAP_MB") else None)
# gradaccum's first bucket cap (MiB): the default, 1, or GRADACCUM_BENCH_FIRST_BUCKET_CAP_MB
# (torch DDP's is fixed at 1 MiB).
FIRST_BUCKET_CAP_MB = float(os.environ.get("GRADACCUM_BENCH_FIRST_BUCKET_CAP_MB", "1"))
LR = 1e-4

CONTENDERS = ("ddp_nosync", "ddp_every", "gradaccum_py", "local")


class Block(torch.nn.Module):
    """Pre-LayerNorm decoder block: causal self-attention, then a 4x MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """Token + position embeddings, blocks, final LayerNorm, head tied to wte."""

    def __init__(self, vocab, seq, d, layers, heads):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(seq, d)
        self.blocks = torch.nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = torch.nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied output head


def build_model(name):
    if name in TRANSFORMERS:
        return GPT(**TRANSFORMERS[name])
    widths = MODELS[name]
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def num_parameters(name):
    if name in TRANSFORMERS:
        c = TRANSFORMERS[name]
        d = c["d"]
        block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return c["vocab"] * d + c["seq"] * d + c["layers"] * block + 2 * d
    w = MODELS[name]
    return sum(a * b + b for a, b in zip(w[:-1], w[1:]))


def make_data(name, generator, pool=None):
    """`pool` micro-batches (inputs, targets) of model `name`, from `generator`."""
    pool = pool or POOL
    if name in TRANSFORMERS:
        c = TRANSFORMERS[name]
        shape = (GPT_MICRO_BATCH, c["seq"])
        return [(torch.randint(0, c["vocab"], shape, generator=generator),
                 torch.randint(0, c["vocab"], shape, generator=generator)) for _ in range(pool)]
    w = MODELS[name]
    return [(torch.randn(MICRO_BATCH, w[0], generator=generator),
             torch.randn(MICRO_BATCH, w[-1], generator=generator)) for _ in range(pool)]


def loss_of(model, x, y):
    """The micro-batch's loss: MSE for the MLPs, next-token cross-entropy for the transformer."""
    out = model(x)
    if out.dim() == 3:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def micro_batch_desc(name):
    if name in TRANSFORMERS:
        return f"{GPT_MICRO_BATCH} sequences of {TRANSFORMERS[name]['seq']} tokens"
    return f"{MICRO_BATCH} rows"


def peak_rss_kib():
    """VmHWM from /proc (kB), falling back to ru_maxrss (kB on Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reply(obj):
    sys.stdout.write("@@ " + json.dumps(obj) + "\n")
    sys.stdout.flush()


class Bench:
    def __init__(self, model_name, bucket_view, nonfinite):
        self.rank = dist.get_rank()
        self.model_name = model_name
        self.bucket_view = bucket_view
        self.nonfinite = nonfinite
        torch.manual_seed(0)  # the same initial weights on every rank
        self.base = build_model(model_name)
        g = torch.Generator().manual_seed(1 + self.rank)
        self.data = make_data(model_name, g)
        # Set to a list by batch(): each window then appends its marks (see window()).
        self.marks = None
        self._ddp = None
        self._local = None
        self._acc = {}

    # -- contenders, built on first use (both ranks get the same commands) --
    def ddp(self):
        if self._ddp is None:
            model = torch.nn.parallel.DistributedDataParallel(
                copy.deepcopy(self.base), gradient_as_bucket_view=self.bucket_view, bucket_cap_mb=BUCKET_CAP_MB)
            self._ddp = (model, torch.optim.SGD(model.parameters(), lr=LR))
        return self._ddp

    def local(self):
        if self._local is None:
            model = copy.deepcopy(self.base)
            self._local = (model, torch.optim.SGD(model.parameters(), lr=LR))
        return self._local

    def accumulator(self, k):
        if k not in self._acc:
            import gradaccum

            model = copy.deepcopy(self.base)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            acc = gradaccum.Accumulator(model, opt, steps=k, nonfinite=self.nonfinite,
                                        gradient_as_bucket_view=self.bucket_view, bucket_cap_mb=BUCKET_CAP_MB,
                                        first_bucket_cap_mb=FIRST_BUCKET_CAP_MB)
            self._acc[k] = (model, acc)
        return self._acc[k]

    # -- one window (K micro-batches, one optimizer step) of each contender --
    def window(self, contender, k, start=0):
        """One window. With self.marks a list (batch mode), the window's
        micro-steps' clock marks replace it: per micro-step (start, forward
        done, backward returned, step done), perf_counter seconds; the last
        micro-step's "step done" includes the optimizer step."""
        data, n = self.data, len(self.data)
        clock = time.perf_counter
        marks = [] if self.marks is not None else None
        if contender == "gradaccum_py":
            model, acc = self.accumulator(k)
            for i in range(k):
                x, y = data[(start + i) % n]
                t0 = clock()
                loss = loss_of(model, x, y)
                t1 = clock()
                acc.backward(loss)
                t2 = clock()
                acc.step()
                if marks is not None:
                    marks.append((t0, t1, t2, clock()))
            if marks is not None:
                self.marks = marks
            return
        if contender in ("ddp_nosync", "ddp_every"):
            model, opt = self.ddp()
        elif contender == "local":
            model, opt = self.local()
        else:
            raise ValueError(f"unknown contender {contender!r}")
        for i in range(k):
            x, y = data[(start + i) % n]
            # DDP's forward must run inside no_sync() too (it prepares the reducer).
            with model.no_sync() if contender == "ddp_nosync" and i < k - 1 else contextlib.nullcontext():
                t0 = clock()
                loss = loss_of(model, x, y) / k
                t1 = clock()
                loss.backward()
                t2 = clock()
            if marks is not None:
                marks.append([t0, t1, t2, t2])
        opt.step()
        # Bucket views must stay views: zero them instead of dropping them.
        opt.zero_grad(set_to_none=not self.bucket_view)
        if marks is not None:
            marks[-1][3] = clock()
            self.marks = marks

    def time(self, contender, k, windows):
        dist.barrier()
        times = []
        for w in range(windows):
            t0 = time.perf_counter()
            self.window(contender, k, start=w * k)
            times.append(time.perf_counter() - t0)
        out = {"rank": self.rank, "contender": contender, "K": k, "times": times}
        if contender == "gradaccum_py":
            out["stats"] = self._acc[k][1].stats()
        return out

    def profile(self, contender, k):
        from torch.profiler import ProfilerActivity, profile

        # Run after the timed blocks: contenders are warm, DDP's buckets rebuilt.
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            self.window(contender, k)
        calls, numel = 0, 0
        for e in prof.events():
            if e.name == "gloo:all_reduce":
                calls += 1
                for shape in e.input_shapes or []:
                    if shape:
                        n = 1
                        for d in shape:
                            n *= d
                        numel += n
        elem = next(self.base.parameters()).element_size()
        out = {"rank": self.rank, "contender": contender, "K": k,
               "allreduce_calls": calls, "allreduce_bytes": numel * elem}
        if contender == "gradaccum_py":
            s = self._acc[k][1].stats()
            out.update(stats_buckets=s["buckets"], stats_collectives=s["last_window_collectives"],
                       stats_bytes=s["last_window_bytes"])
        if contender in ("ddp_nosync", "ddp_every"):
            info = self.ddp()[0]._get_ddp_logging_data()
            out["ddp_buckets"] = len(str(info.get("rebuilt_bucket_sizes", info.get("bucket_sizes", ""))).split())
        return out

    def allreduce(self, reps):
        flat = torch.zeros(num_parameters(self.model_name))
        for _ in range(2):
            dist.all_reduce(flat)
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - t0)
        return {"rank": self.rank, "numel": flat.numel(), "bytes": flat.numel() * flat.element_size(),
                "times": times}


def backward_alone(bench, reps):
    """Seconds of one local backward (no communication): what an all-reduce can hide behind."""
    model, _ = bench.local()
    x, y = bench.data[0]
    times = []
    for _ in range(reps):
        loss = loss_of(model, x, y)
        t0 = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times


def backward_beside_allreduce(bench, reps):
    """Seconds of one local backward alone and with the lone all-reduce of
    the gradient's size running alongside (begun as it starts, on every rank),
    in turns (each turn one of each, the first of them alternating): how much
    the communication slows the compute on this machine."""
    model, _ = bench.local()
    x, y = bench.data[0]
    flat = torch.zeros(num_parameters(bench.model_name))
    times = {"alone": [], "beside": []}
    for turn in range(reps):
        for how in ("alone", "beside") if turn % 2 == 0 else ("beside", "alone"):
            loss = loss_of(model, x, y)
            dist.barrier()
            work = dist.all_reduce(flat, async_op=True) if how == "beside" else None
            t0 = time.perf_counter()
            loss.backward()
            times[how].append(time.perf_counter() - t0)
            if work is not None:
                work.wait()
            model.zero_grad(set_to_none=True)
    return times


def batch(args):
    """Blocks of timed windows for each model (see the module docstring)."""
    contenders = args.contenders.split(",")
    ks = [int(k) for k in args.ks.split(",")]
    out = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "models": {}}
    t_start = time.perf_counter()
    for model_name in args.models.split(","):
        bench = Bench(model_name, bool(args.bucket_view), args.nonfinite)
        per_k = {k: max(1, args.micro // k) for k in ks}
        for k in ks:  # warm-up: build every contender, fill caches
            for c in contenders:
                bench.window(c, k)
        times = {k: {c: [] for c in contenders} for k in ks}
        # Per K and contender, per block: the clock marks of the last timed
        # window's micro-steps, and gradaccum's timeline of its synchronising
        # backward (acc.last_window_timeline(), where the package has it).
        traces = {k: {c: [] for c in contenders} for k in ks}
        bench.marks = []
        t_model = time.perf_counter()
        for b in range(args.blocks):
            # Rank 0's clock decides, so every rank runs the same commands.
            go = torch.tensor([1.0 if b < 1 or time.perf_counter() - t_model < args.budget_s else 0.0])
            dist.broadcast(go, 0)
            if not go.item():
                break
            for ki, k in enumerate(ks):
                shift = (b + ki) % len(contenders)
                order = contenders[shift:] + contenders[:shift]
                if b % 2:
                    order.reverse()
                for c in order:
                    times[k][c].append(statistics.median(bench.time(c, k, per_k[k])["times"]))
                    trace = {"marks": [list(m) for m in bench.marks]}
                    if c == "gradaccum_py" and hasattr(bench._acc[k][1], "last_window_timeline"):
                        trace["timeline"] = bench._acc[k][1].last_window_timeline()
                    traces[k][c].append(trace)
        ar = bench.allreduce(args.allreduce_reps)
        bwd = backward_alone(bench, 5)
        beside = backward_beside_allreduce(bench, args.beside_reps) if args.beside_reps else None
        bench.marks = None
        stats = {k: bench._acc[k][1].stats() for k in ks if k in bench._acc}
        acc_model = next(iter(bench._acc.values()))[0] if bench._acc else bench.base
        params = [(n, p) for n, p in acc_model.named_parameters() if p.requires_grad]
        out["models"][model_name] = {
            "parameters": num_parameters(model_name), "windows_per_k": per_k,
            "micro_batch": micro_batch_desc(model_name),
            "times": {str(k): v for k, v in times.items()}, "allreduce": ar["times"],
            "allreduce_bytes": ar["bytes"], "backward": bwd, **({"backward_beside": beside} if beside else {}),
            "stats": {str(k): v for k, v in stats.items()},
            "traces": {str(k): v for k, v in traces.items()},
            # The Accumulator's parameter order (trainable model.parameters()).
            "param_names": [n for n, _ in params],
            "param_bytes": [p.numel() * p.element_size() for _, p in params],
            "bucket_indices": {str(k): [list(b) for b in bench._acc[k][1].bucket_indices]
                               for k in ks if k in bench._acc},
            "bucket_cap_mb": BUCKET_CAP_MB, "first_bucket_cap_mb": FIRST_BUCKET_CAP_MB}
        del bench
    out["seconds"] = time.perf_counter() - t_start
    reply(out)


def instr(args):
    """Instruction counts under callgrind (valgrind --instr-atstart=no).

    The client requests come from a small helper library (bench_window's CMake
    builds it) loaded with ctypes: instrumentation on and zeroed, then off and
    dumped under a label. The same sections as bench_window --callgrind, for
    the local floor, DDP + no_sync and gradaccum; then one all-reduce alone.
    """
    import ctypes

    cg = ctypes.CDLL(args.instr)
    k, windows = args.steps, args.windows
    bench = Bench(args.model, False, args.nonfinite)
    data = bench.data

    def micro(contender, i):
        x, y = data[i % len(data)]
        if contender == "gradaccum_py":
            model, acc = bench.accumulator(k)
            acc.backward(loss_of(model, x, y))
            acc.step()
        elif contender == "ddp_nosync":
            model, _ = bench.ddp()
            with model.no_sync():
                (loss_of(model, x, y) / k).backward()
        else:
            model, _ = bench.local()
            (loss_of(model, x, y) / k).backward()

    def finish(contender):
        # The window's last micro-step (and step), not counted in "micro".
        if contender == "gradaccum_py":
            micro(contender, k - 1)
            return
        model, opt = bench.ddp() if contender == "ddp_nosync" else bench.local()
        x, y = data[(k - 1) % len(data)]
        (loss_of(model, x, y) / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    contenders = ("local", "ddp_nosync", "gradaccum_py")
    for w in range(2):  # warm-up
        for c in contenders:
            bench.window(c, k, start=w * k)
    flat = torch.zeros(num_parameters(args.model))
    dist.all_reduce(flat)
    dumps = []

    def section(label, fn):
        dist.barrier()
        cg.ga_begin()
        fn()
        cg.ga_end(label.encode())
        dumps.append(label)

    for c in contenders:
        section(f"{c} micro", lambda: [micro(c, i) for i in range(k - 1)])
        finish(c)
        section(f"{c} window", lambda: [bench.window(c, k, start=w * k) for w in range(windows)])
    section("allreduce", lambda: dist.all_reduce(flat))
    dist.barrier()
    reply({"rank": dist.get_rank(), "K": k, "windows": windows, "micro_steps": k - 1, "dumps": dumps,
           "running_on_valgrind": int(cg.ga_running_on_valgrind())})


def cap_compute_thread():
    """GRADACCUM_BENCH_COMPUTE_QUOTA=F (0 < F < 1): this thread, which runs
    forward, backward and the hooks, gets at most F of a core (a cgroup v1 cpu
    quota, 10 ms periods); Gloo's threads, started by init_process_group
    before this, stay outside the cap. With 2 ranks on 2 cores the compute
    threads then leave 2 (1 - F) cores for communication, as a node whose
    cores are not all busy with the model would (see bench_net.py
    --compute-quota). GRADACCUM_BENCH_CGROUP_DIR: the cpu hierarchy as the
    launcher sees it (ip netns exec hides /sys/fs/cgroup)."""
    quota = float(os.environ.get("GRADACCUM_BENCH_COMPUTE_QUOTA", "0") or 0)
    if not quota:
        return
    if not 0 < quota < 1:
        raise ValueError(f"GRADACCUM_BENCH_COMPUTE_QUOTA={quota}: expected a fraction of a core in (0, 1)")
    root = os.environ.get("GRADACCUM_BENCH_CGROUP_DIR")
    if not root:
        raise ValueError("GRADACCUM_BENCH_COMPUTE_QUOTA needs GRADACCUM_BENCH_CGROUP_DIR (the cgroup v1 cpu hierarchy)")
    group = os.path.join(root, f"gradaccum-bench-{os.getpid()}-{threading.get_native_id()}")
    os.mkdir(group)
    period = 10000

    def put(path, value):
        try:
            with open(path, "w") as f:
                f.write(str(value))
        except OSError as e:
            raise RuntimeError(f"cannot write {value} to {path}: {e}") from e

    put(os.path.join(group, "cpu.cfs_period_us"), period)
    put(os.path.join(group, "cpu.cfs_quota_us"), round(quota * period))
    tid = threading.get_native_id()
    put(os.path.join(group, "tasks"), tid)

    def release():
        try:
            put(os.path.join(root, "tasks"), tid)
            os.rmdir(group)
        except OSError:
            pass

    atexit.register(release)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=MODEL_NAMES)
    p.add_argument("--batch", action="store_true", help="batch mode (see the module docstring)")
    p.add_argument("--models", default="large")
    p.add_argument("--contenders", default="local,ddp_nosync,gradaccum_py")
    p.add_argument("--ks", default="1,4,16")
    p.add_argument("--micro", type=int, default=4, help="micro-steps per timed command (windows = micro // K)")
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--beside-reps", type=int, default=0,
                   help="batch: also time a local backward with the lone all-reduce alongside, this many times")
    p.add_argument("--budget-s", type=float, default=60.0, help="stop adding blocks after this (at least 1)")
    p.add_argument("--allreduce-reps", type=int, default=10)
    p.add_argument("--instr", default=None, help="instruction mode: path of the callgrind helper library")
    p.add_argument("--bucket-view", type=int, default=0)
    p.add_argument("--nonfinite", default="skip")
    p.add_argument("--mem", choices=CONTENDERS, help="memory mode: build only this contender")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--windows", type=int, default=3)
    args = p.parse_args()
    # Imported by every variant, so that the extension's code pages count alike
    # in every peak RSS.
    import gradaccum  # noqa: F401

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    compute_nice = int(os.environ.get("GRADACCUM_BENCH_COMPUTE_NICE", "0"))
    if compute_nice:
        # This thread runs forward and backward (and the hooks); Gloo's threads,
        # started by init_process_group, keep their priority: whenever they have
        # bytes to move they get a core at once, as communication does on a node
        # whose cores are not all busy with the model.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), compute_nice)
    # After init_process_group: Gloo's threads exist and stay outside the cap
    # (a group created later would start its threads inside it).
    cap_compute_thread()
    if args.batch or args.instr:
        try:
            batch(args) if args.batch else instr(args)
        finally:
            dist.destroy_process_group()
        return
    if args.model is None:
        p.error("--model is required")
    bench = Bench(args.model, bool(args.bucket_view), args.nonfinite)
    try:
        if args.mem:
            rss_before = peak_rss_kib()
            for w in range(args.windows):
                bench.window(args.mem, args.steps, start=w * args.steps)
            dist.barrier()
            reply({"rank": bench.rank, "contender": args.mem, "bucket_view": args.bucket_view,
                   "K": args.steps, "peak_rss_kib": peak_rss_kib(),
                   "peak_rss_kib_before_windows": rss_before})
            return
        for line in sys.stdin:
            cmd = line.split()
            if not cmd:
                continue
            if cmd[0] == "quit":
                break
            if cmd[0] == "time":
                reply(bench.time(cmd[1], int(cmd[2]), int(cmd[3])))
            elif cmd[0] == "profile":
                reply(bench.profile(cmd[1], int(cmd[2])))
            elif cmd[0] == "allreduce":
                reply(bench.allreduce(int(cmd[1])))
            elif cmd[0] == "rss":
                reply({"rank": bench.rank, "peak_rss_kib": peak_rss_kib()})
            else:
                reply({"rank": bench.rank, "error": f"unknown command {line.strip()!r}"})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
