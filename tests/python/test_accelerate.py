"""gradaccum.accelerate.Accelerator under `accelerate launch`: 2 Gloo ranks on
CPU (`--multi_gpu --num_processes 2`; the adapter sets `cpu=True` itself there) and one
process, against one process on the big batches (float64), and against stock
`accelerate.Accelerator` on the same script.

Every case runs in one launch of `_accelerate_jobs.py` per world size
(importing torch, Accelerate and transformers is the slow part); each test
reads its case's per-rank results. The data: 2-row micro-batches, K = 3, two
epochs, SGD with momentum, a LambdaLR schedule, clipping to norm 1.2 (it bites
in some GPT-2 windows, a flushed partial one among them):

- even: 24 samples, 2 ranks: 2 full windows an epoch on each rank;
- partial: 30 samples, 2 ranks: 8 and 7 batches (windows 3, 3, 2 and 3, 3, 1);
- partial_b: 34 samples, 2 ranks: 9 and 8 batches (one rank ends on a full
  window); 1 process: 17 batches, windows of 3 and a last one of 2;
- tokens: a tiny GPT-2, 26 padded sequences (labels -100 past each end),
  reduction="items" with num_items = valid next-token targets: the per-token
  mean over each window; 2 ranks: 7 and 6 batches.
"""
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import torch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import _accelerate_jobs as jobs  # noqa: E402
from _dist_utils import free_port  # noqa: E402

pytestmark = pytest.mark.slow

F64 = 1e-12
CASES = {
    2: ["even", "partial", "partial_b", "tokens", "steps", "resume", "stock_even", "stock_partial"],
    1: ["even", "partial_b", "tokens", "resume", "stock_even", "stock_partial_b"],
}


def launch(script, args, processes, cwd, timeout=240):
    """`accelerate launch` (its own launcher, as a user runs it); stdout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if processes > 1:
        cmd += ["--multi_gpu", "--main_process_port", str(free_port())]
    cmd += [str(script), *args]
    try:
        proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"accelerate launch hung:\n{e.stdout}\n{e.stderr}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def run_alone(tmp_path, name, source):
    """`source` as a script in a process of its own, outside any launch
    (Accelerate's state is per process); its stdout lines."""
    script = tmp_path / name
    script.write_text(source)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for var in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines(), proc.stderr[-2000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for world, cases in CASES.items():
        out = tmp_path_factory.mktemp(f"accelerate{world}")
        launch(HERE / "_accelerate_jobs.py", ["--out", str(out), "--cases", ",".join(cases)], world, out)
        per_rank = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
        for case in cases:
            results[world, case] = [r[case] for r in per_rank]
    return lambda world, case: results[world, case]


def max_diff(params, ref):
    return max(float((p - r).abs().max()) for p, r in zip(params, ref))


REFERENCES = {}


def reference(case, world):
    if (case, world) not in REFERENCES:
        REFERENCES[case, world] = jobs.reference(case, world)
    return REFERENCES[case, world]


WORLDS_CASES = [(w, c) for w in (2, 1) for c in ("even", "partial", "partial_b", "tokens", "steps") if c in CASES[w]]


@pytest.mark.parametrize("world,case", WORLDS_CASES)
def test_equals_one_process_on_the_big_batches(runs, world, case):
    ref = reference(case, world)
    for rank, r in enumerate(runs(world, case)):
        diff = max_diff(r["params"], ref["params"])
        assert diff <= F64, f"rank {rank}: {diff:.3g}"
        assert abs(r["lr"] - ref["lr"]) <= F64  # the schedule stepped after each real step
        assert r["gathered"] == [float(i) for i in range(world)] and r["reduced"] == world  # gather/reduce work
    first = runs(world, case)[0]
    # rank 0 sees every window close (it holds the most batches): the norm the
    # clip returned, the global window loss
    assert len(first["clip_norms"]) == len(ref["norms"]) == ref["steps"]
    for got, want in zip(first["clip_norms"], ref["norms"]):
        assert abs(got - want) <= F64 * max(1.0, want), (first["clip_norms"], ref["norms"])
    for got, want in zip(first["window_losses"], ref["losses"]):
        assert abs(got - want) <= F64 * max(1.0, want), (first["window_losses"], ref["losses"])
    assert len(first["window_losses"]) == ref["steps"]


@pytest.mark.parametrize("world,case", WORLDS_CASES)
def test_one_allreduce_per_window(runs, world, case):
    ref = reference(case, world)
    for r in runs(world, case):
        stats = r["stats"]
        assert stats["buckets"] == (1 if world > 1 else 0)  # one process: no buckets
        assert stats["optimizer_steps"] == stats["windows"] == ref["steps"]
        if world == 1:
            assert r["allreduces"] == stats["collectives"] == 0
        else:
            # counted by torch.profiler over the whole run (gloo:all_reduce) and by the Accumulator
            assert r["allreduces"] == stats["collectives"] == ref["steps"]


@pytest.mark.parametrize("world", [2, 1])
def test_stock_accelerate_agrees_on_even_windows(runs, world):
    """Full windows everywhere: Accelerate's own accumulation (loss / K, DDP
    with no_sync) is right, and gradaccum gives the same, with as many
    all-reduces (one a window) and the same sync_gradients micro-steps."""
    ref = reference("even", world)
    for stock, ours in zip(runs(world, "stock_even"), runs(world, "even")):
        assert max_diff(stock["params"], ref["params"]) <= F64
        assert max_diff(stock["params"], ours["params"]) <= F64
        assert stock["sync_flags"] == ours["sync_flags"]
        assert stock["allreduces"] == ours["allreduces"] == (ref["steps"] if world > 1 else 0)


@pytest.mark.parametrize("world,case", [(2, "partial"), (1, "partial_b")])
def test_stock_accelerate_misses_the_partial_window(runs, world, case):
    """Why the adapter exists: stock Accelerate divides the last, partial
    window's losses by K and (2 ranks, even_batches=True) fills the shorter
    shard with copies of the first samples; it is measurably off."""
    ref = reference(case, world)
    for stock in runs(world, f"stock_{case}"):
        assert max_diff(stock["params"], ref["params"]) > 1e-3
    if world == 2:  # 15 batches: both give both ranks 8 an epoch (stock: one a copy that trains;
        # gradaccum: a padding batch of weight 0, Note [A padding batch, not copies])
        assert [r["batches"] for r in runs(world, f"stock_{case}")] == [16, 16]
        assert [r["batches"] for r in runs(world, case)] == [16, 16]
        assert [r["stats"]["micro_steps"] for r in runs(world, case)] == [16, 16]


@pytest.mark.parametrize("world", [2, 1])
def test_save_state_mid_window_resumes_exactly(runs, world):
    """save_state after 4 batches of epoch 1 (the middle of a window: the
    Accumulator's half-done window goes into the checkpoint), then a fresh
    model (other weights), optimizer, scheduler and Accelerator, load_state,
    skip_first_batches(4): equal to the uninterrupted run."""
    ref = reference("partial", world)
    uninterrupted = runs(world, "partial") if world == 2 else None
    for rank, r in enumerate(runs(world, "resume")):
        assert max_diff(r["params"], ref["params"]) <= F64
        if uninterrupted is not None:
            assert max_diff(r["params"], uninterrupted[rank]["params"]) <= F64
        assert r["stats"]["optimizer_steps"] == ref["steps"]  # counters came back too
        assert abs(r["lr"] - ref["lr"]) <= F64


def test_example_trains_gpt2_per_token_on_two_ranks(tmp_path):
    out = launch(REPO / "examples" / "python" / "train_accelerate.py", [], 2, tmp_path)
    assert "max parameter difference vs one process on the big batches" in out, out
    assert "rank 0: 6 windows, 6 optimizer steps, 6 all-reduces" in out, out
    assert "rank 1: 6 windows, 6 optimizer steps, 6 all-reduces" in out, out


def test_bad_arguments_are_refused_before_accelerate_starts():
    from gradaccum.accelerate import Accelerator

    with pytest.raises(ValueError, match="gradaccum: Accelerator\\(\\): invalid reduction"):
        Accelerator(reduction="median")
    with pytest.raises(ValueError, match="invalid nonfinite"):
        Accelerator(nonfinite="maybe")
    with pytest.raises(ValueError, match=r"^gradaccum: Accelerator\(\): accumulator_options may not set 'grad_scaler': "
                       r"the adapter sets it"):
        Accelerator(accumulator_options={"grad_scaler": None})
    with pytest.raises(ValueError, match=r"^gradaccum: Accelerator\(\): accumulator_options: 'bucket_cap' is not an "
                       r"Accumulator option"):
        Accelerator(accumulator_options={"bucket_cap": 1})
    with pytest.raises(TypeError, match=r"^gradaccum: Accelerator\(\): accumulator_options must be a dict"):
        Accelerator(accumulator_options=[("bucket_cap_mb", 1)])
    # Refused here, not in prepare()'s first collective over it, where
    # torch.distributed would raise its own words.
    for bad in (True, "group"):
        with pytest.raises(TypeError, match=r"^gradaccum: Accelerator\(\): process_group must be a "):
            Accelerator(accumulator_options={"process_group": bad})
    from accelerate.utils import GradientAccumulationPlugin
    with pytest.raises(ValueError, match=r"^gradaccum: Accelerator\(\): GradientAccumulationPlugin\("
                       r"sync_with_dataloader=False\) is not supported"):
        Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2, sync_with_dataloader=False))


def test_k_is_fixed_once_prepared_and_fp16_unscale_is_refused(tmp_path):
    """In a process of its own (Accelerate's state is per process): a changed
    gradient_accumulation_steps after prepare(), unscale_gradients() with
    a GradScaler (fp16 needs a GPU: the scaler is handed over by hand), and
    accumulating by hand with no_sync() (it was a silent no-op, then a
    misleading "the window closed" error) are refused with their errors;
    setting K again to its value is fine."""
    lines, err = run_alone(tmp_path, "k_and_unscale.py",
        "import torch\n"
        "from gradaccum.accelerate import Accelerator\n"
        "acc = Accelerator(cpu=True, gradient_accumulation_steps=2)\n"
        "acc.gradient_accumulation_steps = 3  # before prepare: as stock\n"
        "assert acc.gradient_accumulation_steps == 3\n"
        "acc.scaler = torch.amp.GradScaler('cpu')\n"
        "model = torch.nn.Linear(3, 1)\n"
        "model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "acc.backward(model(torch.ones(2, 3)).sum())\n"
        "assert acc.accumulator is not None and acc.accumulator.steps == 3\n"
        "acc.gradient_accumulation_steps = 3\n"
        "for what, call in [('k', lambda: setattr(acc, 'gradient_accumulation_steps', 4)),\n"
        "                   ('unscale', acc.unscale_gradients),\n"
        "                   ('no_sync', lambda: acc.no_sync(model).__enter__()),\n"
        "                   ('trigger', lambda: acc.trigger_sync_in_backward(model).__enter__())]:\n"
        "    try:\n"
        "        call()\n"
        "        print(what, 'none')\n"
        "    except Exception as e:\n"
        "        print(what, type(e).__name__, e)\n"
        "print('k now', acc.gradient_accumulation_steps)\n")
    assert lines == [
        "k ValueError gradaccum: accelerator.gradient_accumulation_steps = 4: the window size is fixed at 3 once "
        "accelerator.prepare() has built the Accumulator; set it before prepare()",
        "unscale RuntimeError gradaccum: accelerator.unscale_gradients(): with fp16 the Accumulator unscales the "
        "window's gradient once, inside its step, so the gradients here are still scaled (and GradScaler allows one "
        "unscale per step). Clip with accelerator.clip_grad_norm_() or clip_grad_value_(): they are applied to the "
        "unscaled window gradient",
        *[f"{what} RuntimeError gradaccum: accelerator.{call}(): the Accumulator decides by itself which micro-step "
          "synchronises (the last of each window of gradient_accumulation_steps), so accumulating by hand with "
          "no_sync() is not supported. Set Accelerator(gradient_accumulation_steps=K), run each micro-batch inside "
          "accelerator.accumulate(model), and do not divide the loss by K (the window's gradient is the mean over "
          "its micro-batches)" for what, call in [("no_sync", "no_sync"), ("trigger", "trigger_sync_in_backward")]],
        "k now 3",
    ], "\n".join(lines) + err


def test_a_second_prepare_after_free_memory_keeps_one_checkpoint_object(tmp_path):
    """free_memory() then prepare() builds a new Accumulator; Accelerate keeps
    its custom checkpoint objects, so a second one would make save_state()
    write two, which a run that prepared once cannot load_state(). The state
    saved mid-window is the new Accumulator's, and loads back."""
    lines, err = run_alone(tmp_path, "prepare_twice.py",
        "import os, torch\n"
        "from gradaccum.accelerate import Accelerator\n"
        "acc = Accelerator(cpu=True, gradient_accumulation_steps=3)\n"
        "for n in (3, 4):\n"
        "    acc.free_memory()\n"
        "    model = torch.nn.Linear(n, 1)\n"
        "    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "    acc.backward(model(torch.ones(2, n)).sum())\n"
        "acc.save_state('ck')\n"
        "print(sorted(f for f in os.listdir('ck') if f.startswith('custom_checkpoint')))\n"
        "acc.backward(model(torch.ones(2, 4)).sum())\n"
        "acc.load_state('ck')\n"
        "print('micro_step', acc.accumulator.micro_step)\n")
    assert lines == ["['custom_checkpoint_0.pkl']", "micro_step 1"], "\n".join(lines) + err


def test_ddp_kwargs_reach_the_accumulator_or_are_refused(tmp_path):
    """DistributedDataParallelKwargs, which stock Accelerate hands to DDP,
    become the Accumulator's options (in a process of its own: Accelerate's
    state is per process); what gradaccum cannot honour is refused."""
    lines, err = run_alone(tmp_path, "ddp_kwargs.py",
        "import torch\n"
        "from accelerate.utils import DistributedDataParallelKwargs as K, DDPCommunicationHookType as H\n"
        "from gradaccum.accelerate import Accelerator\n"
        "cases = [\n"
        "    ([K(bucket_cap_mb=5, gradient_as_bucket_view=True, broadcast_buffers=False,\n"
        "        find_unused_parameters=True, static_graph=True, comm_hook=H.BF16)], None),\n"
        "    ([K(comm_hook=H.FP16)], {'first_bucket_cap_mb': 2.0}),\n"
        "    ([K(bucket_cap_mb=5)], {'bucket_cap_mb': 5}),\n"
        "    ([K(bucket_cap_mb=5)], {'bucket_cap_mb': 6}),\n"
        "    ([K(comm_hook=H.POWER_SGD)], None),\n"
        "    ([K(comm_hook=H.FP16)], {'comm_dtype': torch.bfloat16}),\n"
        "    ([K(comm_hook=H.FP16)], {'comm_dtype': None, 'bucket_cap_mb': None}),\n"
        "    ([K(comm_wrapper=H.FP16)], None),\n"
        "]\n"
        "for handlers, options in cases:\n"
        "    try:\n"
        "        acc = Accelerator(cpu=True, kwargs_handlers=handlers, accumulator_options=options)\n"
        "        print(sorted(acc._accumulator_options.items()))\n"
        "    except ValueError as e:\n"
        "        print('ValueError', e)\n")
    assert lines == [
        "[('broadcast_buffers', False), ('bucket_cap_mb', 5), ('comm_dtype', torch.bfloat16), "
        "('gradient_as_bucket_view', True)]",
        "[('comm_dtype', torch.float16), ('first_bucket_cap_mb', 2.0)]",
        "[('bucket_cap_mb', 5)]",
        "ValueError gradaccum: Accelerator(): DistributedDataParallelKwargs(bucket_cap_mb=5) and "
        "accumulator_options bucket_cap_mb=6 disagree",
        "ValueError gradaccum: Accelerator(): DistributedDataParallelKwargs: comm_hook='power_sgd', "
        "comm_wrapper='no' is not supported: gradaccum compresses its all-reduce to fp16/bf16 only "
        "(comm_hook=DDPCommunicationHookType.FP16 or BF16, or accumulator_options comm_dtype); PowerSGD has no "
        "counterpart",
        "ValueError gradaccum: Accelerator(): DistributedDataParallelKwargs(comm_hook='fp16') and "
        "accumulator_options comm_dtype=torch.bfloat16 disagree",
        "[('bucket_cap_mb', None), ('comm_dtype', torch.float16)]",  # None: unset, no disagreement
        "[]",  # a wrapper without a hook: Accelerate ignores it too
    ], "\n".join(lines) + err


MODES_SCRIPT = '''
import os, sys, warnings
import torch
from torch.utils.data import DataLoader, TensorDataset
from gradaccum.accelerate import Accelerator

warnings.simplefilter("always")


def say(*parts):  # one write: the ranks share the pipe
    os.write(1, (" ".join(map(str, parts)) + "\\n").encode())


torch.manual_seed(0)
x, y = torch.randn(10, 3, dtype=torch.float64), torch.randn(10, 1, dtype=torch.float64)
model = torch.nn.Linear(3, 1).double()
model.eval()  # as from_pretrained() returns it
initial = {k: v.clone() for k, v in model.state_dict().items()}
acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
model, opt, train, evaluate = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(TensorDataset(x, y), batch_size=2),
                                          DataLoader(TensorDataset(x, y), batch_size=2))
with warnings.catch_warnings(record=True) as caught:
    for epoch in range(2):
        for xb, yb in train:
            model.train()  # inside the loop: the loader began in eval mode
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
                opt.step()
                opt.zero_grad()
say("late", sum("sharded as an evaluation loader" in str(w.message) for w in caught),
      acc.accumulator.stats()["optimizer_steps"], acc.accumulator.micro_step)
if acc.num_processes == 1:
    ref = torch.nn.Linear(3, 1).double()
    ref.load_state_dict(initial)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.1)
    for epoch in range(2):
        for w in ([0, 1], [2, 3], [4]):
            (sum(torch.nn.functional.mse_loss(ref(x[2 * b:2 * b + 2]), y[2 * b:2 * b + 2]) for b in w)
             / len(w)).backward()
            sgd.step()
            sgd.zero_grad()
    say("diff", float((ref.weight - model.weight).abs().max()))
seen = 0
with torch.no_grad():  # evaluation with model.eval() forgotten
    for xb, yb in evaluate:
        seen += acc.gather_for_metrics(((model(xb) - yb) ** 2).flatten()).numel()
say("evaluated", seen, float(model.weight.sum()))
'''


def test_loaders_begun_in_eval_mode_or_without_gradients(tmp_path):
    """Which loader iteration trains: one that begins with gradients on and
    the model in training mode. An evaluation loop under no_grad() that
    forgot model.eval() keeps even_batches (before, its loader lost them and
    the ranks ran different numbers of gather_for_metrics(), and a flush at
    its end: a hang); a training loop whose loader began in eval mode
    (model.train() inside the loop) trains from its first backward, warns
    once, and still closes its epoch's partial window at its end (before,
    that window ran on into the next epoch): the one-process run equals the
    big batches; on 2 ranks both finish with the same steps and weights."""
    lines, err = run_alone(tmp_path, "modes.py", MODES_SCRIPT)
    assert lines[0] == "late 1 6 0", "\n".join(lines) + err  # warned once; 3 windows an epoch
    assert lines[1].startswith("diff ") and float(lines[1].split()[1]) <= F64, lines
    assert lines[2].startswith("evaluated 10 "), lines
    script = tmp_path / "modes2.py"
    script.write_text(MODES_SCRIPT)
    out = launch(script, [], 2, tmp_path).splitlines()
    late = [line for line in out if line.startswith("late ")]
    evaluated = [line for line in out if line.startswith("evaluated ")]
    # 5 batches on 2 ranks, even_batches: 3 each, windows of 2 and 1 an epoch
    assert late == ["late 1 4 0"] * 2, out
    assert len(evaluated) == 2 and evaluated[0] == evaluated[1] and evaluated[0].startswith("evaluated 10 "), out


SIDE_LOADERS_SCRIPT = '''
import os, warnings
import torch
from torch.utils.data import DataLoader, TensorDataset
from gradaccum.accelerate import Accelerator

def say(*words):
    os.write(1, (" ".join(str(w) for w in words) + "\\n").encode())

g = torch.Generator().manual_seed(7)
x = torch.randn(6, 3, generator=g, dtype=torch.float64)
y = torch.randn(6, 1, generator=g, dtype=torch.float64)

def run(case):
    acc = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).double()
    extra = {"num_workers": 2, "in_order": False} if case == "unordered" else {}
    model, opt, train, side = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                          DataLoader(TensorDataset(x, y), batch_size=2, **extra),
                                          DataLoader(TensorDataset(x, y), batch_size=2))
    model.train()
    iterations = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, (xb, yb) in enumerate(train):
            if case == "evalbreak" and step == 0:  # a short evaluation, left after one batch
                model.eval()
                with torch.no_grad():
                    for xe, ye in side:
                        model(xe)
                        break
                model.train()
            if case == "side_batch" and step == 0:  # drawn with gradients on, in training mode
                next(iter(side))
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(xb), yb))
                opt.step()
                opt.zero_grad()
            iterations += 1
    warned = sum(str(w.message).startswith("gradaccum:") for w in caught)
    stats = acc.accumulator.stats()
    say(case, acc.process_index, iterations, stats["micro_steps"], stats["optimizer_steps"], warned,
        *[repr(float(v)) for v in torch.cat([p.detach().flatten() for p in model.parameters()])])
    acc.free_memory()

for case in ("base", "evalbreak", "unordered", "side_batch"):
    run(case)
'''


def test_side_loaders_and_unordered_workers_keep_the_padding_batch_right(tmp_path):
    """6 samples in batches of 2 on 2 ranks, K = 2: rank 0 gets batches 0 and
    2, rank 1 batch 1 and a padding batch; one window, the mean over the 6
    samples. A mid-epoch evaluation left after one batch used to leave
    Accelerate's state on that loader, so rank 1's padding batch trained (the
    first samples counted twice); the adapter now reads the end from the
    training loader itself. A loader whose workers deliver batches out of
    order (in_order=False) is not padded (a real batch could come last),
    warned. A side batch drawn with gradients on is taken as a training
    iteration of its own, warned (the docs say to draw it under no_grad())."""
    script = tmp_path / "side.py"
    script.write_text(SIDE_LOADERS_SCRIPT)
    lines = [line.split() for line in launch(script, [], 2, tmp_path).splitlines() if line.count(" ") > 5]
    got = {(w[0], int(w[1])): w[2:] for w in lines}
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    y = torch.randn(6, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 1).double()
    torch.nn.functional.mse_loss(ref(x), y).backward()
    with torch.no_grad():
        want = torch.cat([(p - 0.1 * p.grad).flatten() for p in ref.parameters()])
    for case, iterations, warned in (("base", [2, 2], 0), ("evalbreak", [2, 2], 0), ("unordered", [2, 1], 1)):
        for rank in (0, 1):
            its, micro, steps, n_warned, *weights = got[case, rank]
            assert (int(its), int(micro), int(steps)) == (iterations[rank], iterations[rank], 1), (case, rank, got)
            assert int(n_warned) == warned, (case, rank, got)
            diff = float((torch.tensor([float(v) for v in weights], dtype=torch.float64) - want).abs().max())
            assert diff <= F64, (case, rank, diff)
    assert all(int(got["side_batch", r][3]) == 1 for r in (0, 1)), got  # warned on every rank


FROZEN_SCRIPT = '''
import os
import torch
from gradaccum.accelerate import Accelerator

def say(*words):
    os.write(1, (" ".join(str(w) for w in words) + "\\n").encode())

acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
rank = acc.process_index
torch.manual_seed(0)
model = torch.nn.Linear(3, 1).double()
if rank == 1 and "{case}" == "frozen":
    model.requires_grad_(False)  # frozen on one rank only
try:
    if rank == 1 and "{case}" == "no_optimizer":  # the optimizer forgotten on one rank
        acc.prepare(model)
    else:
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    say("built", rank)
except ValueError as e:
    say("error", rank, str(e))
'''


@pytest.mark.parametrize("case", ["frozen", "no_optimizer"])
def test_a_model_frozen_on_one_rank_is_refused_on_every_rank_at_prepare(tmp_path, case):
    """Rank 1 has nothing to train (its model frozen, or no optimizer
    prepared): before, it skipped building the Accumulator in prepare() while
    rank 0 built one, and rank 0 waited in its construction until the group's
    timeout. Now both prepare() calls raise, rank 0's naming rank 1's error."""
    script = tmp_path / "frozen.py"
    script.write_text(FROZEN_SCRIPT.replace("{case}", case))
    out = sorted(launch(script, [], 2, tmp_path, timeout=120).splitlines())
    trained, optimizers = (0, 1) if case == "frozen" else (1, 0)
    own = ("gradaccum: Accelerator.prepare(): the Accumulator needs exactly one prepared model with trainable "
           f"parameters and one prepared optimizer; prepared so far: {trained} trained model(s), {optimizers} "
           "optimizer(s). Pass the model and its optimizer to accelerator.prepare()")
    assert out == [
        "error 0 gradaccum: Accumulator(): rank 1 refused, so every rank raises (rank 1 its own error): "
        + own[len("gradaccum: "):],
        "error 1 " + own,
    ], out
