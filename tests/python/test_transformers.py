"""gradaccum.transformers.Trainer under torchrun (2 Gloo ranks, float64)
against a one-process big-batch reference computed with torch alone.

examples/python/train_hf_trainer.py trains a tiny randomly initialised GPT-2
(SGD with momentum, linear LR decay, K=3 micro-batches of 2 sequences per rank)
in three cases: `even` (full-length sequences, whole windows), `partial` (the
epoch's last window partial, its last micro-batch one sequence; clipping at
0.3), `uneven` (right padding with -100 labels: micro-batches and ranks hold
different numbers of tokens; checkpoints every 2 steps). The reference takes
each window's global batch (the Trainer's sequential order, rank r taking
batches r, r + 2, ...: a window is 6 consecutive batches) and steps on the
per-token mean cross-entropy over all its real next-token targets. Each
optimizer step's logged loss and the final parameters must agree to 1e-12,
with one all-reduce per window. Stock transformers.Trainer is shown off in the
`uneven` case (it counts position 0 of GPT-2's labels, and DDP averages), and
a resume from the mid-epoch checkpoint-4 equals the uninterrupted run.
"""
import importlib.util
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # launches torchrun

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "python" / "train_hf_trainer.py"
WORLD, K, B, LR, SEED = 2, 3, 2, 0.5, 0
TOL = 1e-12


def _example():
    spec = importlib.util.spec_from_file_location("train_hf_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = _example()


def _launch(cmd, env, timeout):
    """Runs torchrun in a session of its own: a hang kills its workers too
    (killing torchrun alone would leave them running)."""
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"torchrun hung:\n{stdout}\n{stderr[-6000:]}")
    assert proc.returncode == 0, f"rc={proc.returncode}\n{stdout}\n{stderr[-6000:]}"
    return stdout


def torchrun(out, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
           str(EXAMPLE), "--out", str(out), "--accum", str(K), "--batch", str(B), "--lr", str(LR),
           "--seed", str(SEED), *map(str, args)]
    return _launch(cmd, env, timeout)


def reference(case, world=WORLD):
    """One process, one backward per window's global batch, torch only."""
    n, epochs, _, clip, _ = ex.CASES[case]
    rows = ex.make_data(case, SEED)
    model = ex.make_model(SEED)
    batches = [rows[i:i + B] for i in range(0, n, B)]
    windows = [batches[i:i + K * world] for i in range(0, len(batches), K * world)]
    total = epochs * len(windows)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: max(0.0, (total - t) / total))
    losses = []
    for _ in range(epochs):
        for window in windows:
            group = [r for batch in window for r in batch]
            ids, mask, labels = (torch.stack([r[key] for r in group]) for key in ("input_ids", "attention_mask", "labels"))
            logits = model(input_ids=ids, attention_mask=mask).logits
            assert logits.dtype == torch.float64
            targets = labels[:, 1:]
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, ex.VOCAB), targets.reshape(-1), ignore_index=-100,
                                   reduction="sum") / (targets != -100).sum()
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach() for k, v in model.named_parameters()}}


def differences(got, ref):
    assert len(got["losses"]) == len(ref["losses"]), (got["steps"], ref["losses"])
    loss = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"]))
    assert set(got["params"]) == set(ref["params"])
    param = max((got["params"][k] - ref["params"][k]).abs().max().item() for k in ref["params"])
    return loss, param


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    stdout = torchrun(out, "--case", "even,partial,uneven")
    return out, stdout


@pytest.mark.parametrize("case", ["even", "partial", "uneven"])
def test_trainer_equals_big_batch_reference(runs, case):
    out, stdout = runs
    got = torch.load(out / f"{case}.pt", weights_only=False)
    ref = reference(case)
    n, epochs, *_ = ex.CASES[case]
    windows = epochs * math.ceil(math.ceil(n / B) / (K * WORLD))
    assert got["world_size"] == WORLD
    assert got["global_step"] == windows and got["steps"] == list(range(1, windows + 1)), stdout
    loss, param = differences(got, ref)
    print(f"{case}: {windows} steps, max |loss - ref| {loss:.3g}, max |param - ref| {param:.3g}")
    assert loss <= TOL, (case, got["losses"], ref["losses"])
    assert param <= TOL, (case, param)
    # One all-reduce per window (one bucket: the model is tiny), no DDP.
    stats = got["stats"]
    assert stats["data_parallel"] and stats["world_size"] == WORLD
    assert stats["buckets"] == 1
    assert stats["windows"] == stats["optimizer_steps"] == windows
    assert stats["collectives"] == windows, stats
    assert stats["last_window_collectives"] == 1


def test_stock_trainer_is_off_with_uneven_tokens(runs, tmp_path):
    """transformers.Trainer 5.x on the same run: its num_items_in_batch counts
    every non -100 label of GPT-2 (position 0 too: GPT2LMHeadModel's loss_type
    is unset), so each window's gradient is scaled by the wrong count."""
    out, _ = runs
    torchrun(out, "--case", "uneven", "--stock")
    stock = torch.load(out / "uneven-stock.pt", weights_only=False)
    ours = torch.load(out / "uneven.pt", weights_only=False)
    ref = reference("uneven")
    loss, param = differences(stock, ref)
    print(f"stock transformers.Trainer, uneven: max |loss - ref| {loss:.3g}, max |param - ref| {param:.3g}")
    assert param > 1e-4, param
    assert max(differences(ours, ref)) <= TOL


def test_resume_from_mid_run_checkpoint(runs):
    out, _ = runs
    checkpoint = out / "uneven" / "checkpoint-4"
    assert (checkpoint / "gradaccum_accumulator.pt").is_file(), sorted(os.listdir(checkpoint))
    torchrun(out, "--case", "uneven", "--resume-from", 4)
    resumed = torch.load(out / "uneven-resumed-4.pt", weights_only=False)
    full = torch.load(out / "uneven.pt", weights_only=False)
    assert resumed["steps"] == full["steps"] == [1, 2, 3, 4, 5, 6]
    loss, param = differences(resumed, full)
    print(f"resumed from checkpoint-4 (mid epoch 2): max |loss - full| {loss:.3g}, max |param - full| {param:.3g}")
    assert loss <= TOL and param <= TOL
    stats = resumed["stats"]  # counters resumed from the checkpoint
    assert stats["windows"] == stats["optimizer_steps"] == 6, stats


def test_single_process(tmp_path, monkeypatch):
    """Without torchrun: local accumulation, the partial case against its
    one-process reference (windows of K batches)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    opts = ex.parse_args(["--accum", str(K), "--batch", str(B), "--lr", str(LR), "--seed", str(SEED)])
    got = ex.run_case("partial", opts, str(tmp_path))
    assert got["world_size"] == 1 and not got["stats"]["data_parallel"]
    loss, param = differences(got, reference("partial", world=1))
    print(f"one process, partial: max |loss - ref| {loss:.3g}, max |param - ref| {param:.3g}")
    assert loss <= TOL and param <= TOL


def test_pre_optimizer_step_callbacks_see_the_clipped_gradient(tmp_path, monkeypatch):
    """As in the Trainer: on_pre_optimizer_step runs after clipping, right
    before each optimizer step, once per step (the partial case clips at 0.3,
    and its windows' norms are above that)."""
    import transformers
    from transformers import default_data_collator
    from gradaccum.transformers import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    seen = {"pre": [], "steps": 0}

    class Watch(transformers.TrainerCallback):
        def __init__(self, model):
            self.model = model

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            seen["pre"].append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

        def on_optimizer_step(self, args, state, control, **kwargs):
            seen["steps"] += 1
            assert len(seen["pre"]) == seen["steps"]

    opts = ex.parse_args(["--accum", str(K), "--batch", str(B), "--lr", str(LR), "--seed", str(SEED)])
    model = ex.make_model(SEED)
    trainer = Trainer(model=model, args=ex.training_args("partial", opts, str(tmp_path)),
                      train_dataset=ex.make_data("partial", SEED), data_collator=default_data_collator,
                      callbacks=[Watch(model)])
    trainer.train()
    clip = ex.CASES["partial"][3]
    assert seen["steps"] == trainer.accumulator_stats["optimizer_steps"] > 0
    assert len(seen["pre"]) == seen["steps"]
    # each window's norm before clipping, as logged; clipped: max_norm / (norm + 1e-6) as torch does
    raw = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(raw) == seen["steps"] and max(raw) > clip, raw
    want = [n if n <= clip else n * clip / (n + 1e-6) for n in raw]
    assert all(abs(g - w) <= 1e-9 * w for g, w in zip(seen["pre"], want)), (seen["pre"], raw)


def test_invalid_options():
    from gradaccum.transformers import Trainer

    with pytest.raises(ValueError, match="invalid reduction"):
        Trainer(model=ex.make_model(SEED), reduction="tokens")
    with pytest.raises(ValueError, match="invalid nonfinite"):
        Trainer(model=ex.make_model(SEED), nonfinite="nan")
    # accumulator_options: what the Trainer sets itself, or no Accumulator option at all
    with pytest.raises(ValueError, match=r"^gradaccum: Trainer\(\): accumulator_options may not set 'max_grad_norm': "
                       r"the adapter sets it \(it sets 'steps', 'reduction', 'max_grad_norm', 'nonfinite', "
                       r"'scheduler', the model and the optimizer\)$"):
        Trainer(model=ex.make_model(SEED), accumulator_options={"max_grad_norm": 1.0})
    with pytest.raises(ValueError, match=r"^gradaccum: Trainer\(\): accumulator_options: 'bucket_cap' is not an "
                       r"Accumulator option \(they are process_group, bucket_cap_mb, .*, metrics\)$"):
        Trainer(model=ex.make_model(SEED), accumulator_options={"bucket_cap": 1})
    with pytest.raises(TypeError, match=r"^gradaccum: Trainer\(\): process_group must be a "):
        Trainer(model=ex.make_model(SEED), accumulator_options={"process_group": True})


def test_ddp_arguments_are_the_accumulators_options(tmp_path, monkeypatch):
    """ddp_bucket_cap_mb and ddp_broadcast_buffers reach the Accumulator, as
    they reach DDP under the stock Trainer (they were ignored: rank 0's
    BatchNorm statistics were still broadcast into every rank's)."""
    from transformers import TrainingArguments
    from gradaccum.transformers import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def kwargs(accumulator_options=None, **ddp):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **ddp)
        trainer = Trainer(model=ex.make_model(SEED), args=args, accumulator_options=accumulator_options)
        return trainer._accumulator_kwargs()

    assert kwargs() == {}
    assert kwargs(ddp_bucket_cap_mb=1, ddp_broadcast_buffers=False, ddp_find_unused_parameters=False,
                  ddp_static_graph=True) == {"bucket_cap_mb": 1, "broadcast_buffers": False}
    assert kwargs({"bucket_cap_mb": 1, "comm_dtype": torch.bfloat16}, ddp_bucket_cap_mb=1) == {
        "bucket_cap_mb": 1, "comm_dtype": torch.bfloat16}
    assert kwargs(ddp_bucket_cap_mb=25) == {"bucket_cap_mb": 25}  # DDP's default, given: ours across hosts differs
    with pytest.raises(ValueError, match=r"^gradaccum: Trainer: TrainingArguments\(ddp_bucket_cap_mb=1\) and "
                                         r"accumulator_options bucket_cap_mb=2 disagree$"):
        kwargs({"bucket_cap_mb": 2}, ddp_bucket_cap_mb=1)


def test_a_jit_checkpoint_saved_inside_the_window_step_resumes_exactly(tmp_path, monkeypatch):
    """TrainingArguments(enable_jit_checkpoint=True): after a SIGTERM the JIT
    checkpoint callback saves from on_pre_optimizer_step, inside acc.step(),
    where the Accumulator refuses to be read (the window is half stepped). The
    Trainer's global_step is the window's start and a resume replays its
    batches: the adapter saves the Accumulator's state at the window's start,
    and the resumed run ends where the uninterrupted one does (the flag is set
    by hand, as the signal handler sets it)."""
    from transformers import TrainerCallback, default_data_collator
    from transformers.trainer_jit_checkpoint import JITCheckpointCallback
    from gradaccum.transformers import CHECKPOINT_NAME, Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    running = {}

    class Request(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            if state.global_step == 1:  # in the second window
                for callback in running["trainer"].callback_handler.callbacks:
                    if isinstance(callback, JITCheckpointCallback) and callback.jit_manager is not None:
                        callback.jit_manager.is_checkpoint_requested = True

    opts = ex.parse_args(["--accum", str(K), "--batch", str(B), "--lr", str(LR), "--seed", str(SEED)])

    def train(out, jit=False, resume=None, callbacks=()):
        args = ex.training_args("partial", opts, str(out))
        args.enable_jit_checkpoint = jit
        model = ex.make_model(SEED)
        trainer = running["trainer"] = Trainer(model=model, args=args, train_dataset=ex.make_data("partial", SEED),
                                               data_collator=default_data_collator, callbacks=list(callbacks))
        trainer.train(resume_from_checkpoint=resume)
        return [p.detach().clone() for p in model.parameters()]

    whole = train(tmp_path / "whole")
    train(tmp_path / "jit", jit=True, callbacks=[Request()])
    (folder,) = [f for f in os.listdir(tmp_path / "jit") if f.startswith("checkpoint-")]
    assert folder == "checkpoint-1"
    state = torch.load(tmp_path / "jit" / folder / CHECKPOINT_NAME, weights_only=True)
    assert not state["window_ready"] and state["micro_step"] == 0 and state["optimizer_steps"] == 1
    resumed = train(tmp_path / "jit", resume=str(tmp_path / "jit" / folder))
    for a, b in zip(resumed, whole):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_a_float64_causal_lm_keeps_its_loss_in_float64():
    """transformers' ForCausalLMLoss rounds logits to float32; both adapters
    give a float64 model the same loss in float64 (gradaccum._hf)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from gradaccum._hf import keep_float64_causal_lm_loss

    torch.set_grad_enabled(False)
    try:
        _check_float64_loss(ForCausalLMLoss, keep_float64_causal_lm_loss)
    finally:
        torch.set_grad_enabled(True)


def _check_float64_loss(ForCausalLMLoss, keep_float64_causal_lm_loss):
    model = ex.make_model(SEED)
    rows = ex.make_data("uneven", SEED)[:4]
    ids, labels = torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])
    logits = model(input_ids=ids).logits
    targets = labels[:, 1:]
    n = (targets != -100).sum()
    exact = F.cross_entropy(logits[:, :-1].reshape(-1, ex.VOCAB), targets.reshape(-1), ignore_index=-100,
                            reduction="sum") / n
    stock = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    assert abs(float(stock) - float(exact)) > 1e-12  # rounded through float32
    assert keep_float64_causal_lm_loss(model)
    kept = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
    assert kept.dtype == torch.float64 and abs(float(kept) - float(exact)) < 1e-15
    assert abs(float(model(input_ids=ids, labels=labels).loss) - float(F.cross_entropy(
        logits[:, :-1].reshape(-1, ex.VOCAB), targets.reshape(-1), ignore_index=-100))) < 1e-15
    del model._loss_function
    assert model.loss_function is ForCausalLMLoss
    assert not keep_float64_causal_lm_loss(ex.make_model(SEED).float())  # float32: left alone


def test_loss_is_scaled_for_ga_false_trains_on_the_mean(tmp_path, monkeypatch):
    """A subclass whose compute_loss returns a per-micro-batch mean sets the
    Trainer's loss_is_scaled_for_ga = False: the stock Trainer divides by K, so
    each window is the mean of its micro-batch losses. The adapter trains with
    reduction="mean" then, though the model takes loss kwargs (which alone
    would mean per-token "items"), and equals both the stock Trainer and a
    torch reference; the micro-batches hold different numbers of targets, so
    "items" would differ."""
    import transformers
    from torch.utils.data import SequentialSampler
    from gradaccum.transformers import Trainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4).double()

        def forward(self, x, labels=None, **kwargs):  # takes loss kwargs, as HF models do
            return {"logits": self.lin(x)}

    def row_loss(logits, labels):
        mask = labels != -100
        return (((logits - labels.clamp(min=0)) ** 2) * mask).sum(-1) / mask.sum(-1)

    def subclass(base):
        class Scaled(base):
            loss_is_scaled_for_ga = False

            def _get_train_sampler(self, *args, **kwargs):
                return SequentialSampler(self.train_dataset)

            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return row_loss(model(inputs["x"])["logits"], inputs["labels"]).mean()
        return Scaled

    g = torch.Generator().manual_seed(1)
    rows = []
    for valid in (4, 1, 3, 1):  # targets per row differ
        labels = torch.randn(4, generator=g, dtype=torch.float64)
        labels[valid:] = -100
        rows.append({"x": torch.randn(4, generator=g, dtype=torch.float64), "labels": labels})
    weights = {}
    for name, base in (("stock", transformers.Trainer), ("gradaccum", Trainer)):
        model = Model()
        args = transformers.TrainingArguments(
            str(tmp_path / name), per_device_train_batch_size=1, gradient_accumulation_steps=2, num_train_epochs=1,
            learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], save_strategy="no",
            logging_strategy="no", use_cpu=True, optim="sgd", weight_decay=0.0)
        trainer = subclass(base)(model=model, args=args, train_dataset=rows)
        trainer.train()
        weights[name] = model.lin.weight.detach().clone()
        if name == "gradaccum":
            assert trainer.reduction == "mean"
    reference = Model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for window in (rows[0:2], rows[2:4]):
        (sum(row_loss(reference(r["x"][None])["logits"][0], r["labels"]) for r in window) / 2).backward()
        optimizer.step()
        optimizer.zero_grad()
    want = reference.lin.weight.detach()
    assert (weights["stock"] - want).abs().max().item() <= 1e-15
    assert (weights["gradaccum"] - want).abs().max().item() <= 1e-15


# --------------------------------------------------------------------------- #
# Shards a batch apart (tests/python/_hf_shards_worker.py)
# --------------------------------------------------------------------------- #

SHARDS = REPO / "tests" / "python" / "_hf_shards_worker.py"


def _shards_worker():
    spec = importlib.util.spec_from_file_location("_hf_shards_worker", SHARDS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shards_run(out, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", str(SHARDS),
           "--out", str(out), *map(str, args)]
    return _launch(cmd, env, timeout)


def shards_reference(n, rows_per_batch=None, epochs=1):
    """One process: batch b of `rows_per_batch` rows (B) on rank b % 2, window w the micro-batches
    w*K..w*K+K-1 of every rank (the last window what is left), its gradient
    that of the mean of its micro-batch losses, clipped to norm 1; SGD; the
    same batches each epoch (sequential sampling)."""
    w = _shards_worker()
    model, data = w.Regression(), w.Rows(n)
    size = rows_per_batch or w.B
    batches = [(data.x[i:i + size], data.y[i:i + size]) for i in range(0, n, size)]
    shards = [batches[r::WORLD] for r in range(WORLD)]
    optimizer = torch.optim.SGD(model.parameters(), lr=w.LR)
    for start in [s for _ in range(epochs) for s in range(0, max(len(s) for s in shards), w.K)]:
        micro = [b for shard in shards for b in shard[start:start + w.K]]
        loss = sum(torch.nn.functional.mse_loss(model.net(x), y) for x, y in micro) / len(micro)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # TrainingArguments' max_grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach() for p in model.parameters()], epochs * math.ceil(max(len(s) for s in shards) / w.K)


@pytest.fixture(scope="module")
def shard_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_shards")
    shards_run(out, "--case", "eval,save_at_flush,flos,split_batches,bf16_wire,empty_shard,tokens,no_use_cpu")
    shards_run(out, "--case", "eval", "--stock")

    def load(case):
        return [torch.load(out / f"{case}-{r}.pt", weights_only=True) for r in range(WORLD)]
    return load


@pytest.mark.parametrize("case", ["eval", "save_at_flush", "flos", "split_batches", "empty_shard", "tokens"])
def test_shards_a_batch_apart_train_as_the_big_batch(shard_runs, case):
    """Every case completes on both ranks (before: evaluation paired its
    gather_for_metrics with other calls and hung, since the eval loader lost
    even_batches; a checkpoint at the step where rank 0's last full window met
    rank 1's flush() raised on rank 0 only; a window with a batch on rank 0
    only broadcast an int64 current_flos on rank 1 against float32, and
    Gloo aborted; with split_batches every loader's len() counted 8 batches,
    rank 1 got 7, no rank flushed, and it hung; with one batch for 2 ranks,
    rank 1 stopped training after its empty epoch and rank 0 hung in the
    next) and ends at the one-process big batch."""
    worker = _shards_worker()
    expected, windows = shards_reference(worker.ROWS[case], 1 if case == "split_batches" else None,
                                         worker.EPOCHS.get(case, 1))
    for res in shard_runs(case):
        assert res["global_step"] == windows
        for got, want in zip(res["params"], expected):
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-14), (case, (got - want).abs().max())
    if case == "save_at_flush":
        assert shard_runs(case)[0]["checkpoints"] == ["checkpoint-2"]
    if case == "tokens":
        # Note [Tokens seen, once a window] (before: the Trainer's gather per
        # micro-batch met rank 1's flush() all-reduce, and Gloo aborted): 4 a
        # row, each window's 4 batches of 2 rows, the last window's one batch.
        for res in shard_runs(case):
            assert res["tokens_seen"] == 4 * worker.ROWS[case]
            assert res["logged_tokens"] == [32, 64, 96, 104], res["logged_tokens"]


def test_evaluation_with_uneven_eval_shards_equals_the_stock_trainers(shard_runs):
    """Evaluation loaders keep even_batches: 5 eval rows over 2 ranks x 2 give
    every rank the stock Trainer's eval_loss after every step, and at the end."""
    ours, stock = shard_runs("eval"), shard_runs("eval-stock")
    assert len(stock[0]["evals"]) == 2  # one per step
    for res in ours + stock:
        assert len(res["evals"]) == len(stock[0]["evals"])
        for a, b in zip(res["evals"], stock[0]["evals"]):
            assert abs(a - b) <= 1e-12 * abs(b), (a, b)
        assert abs(res["final_eval"] - stock[0]["final_eval"]) <= 1e-12 * abs(stock[0]["final_eval"])


def test_a_bf16_wire_logs_the_global_loss(shard_runs):
    """A bf16 wire carries no loss (window_loss is None): each rank keeps its
    share of each window's loss and one all-reduce per log sums them. With
    learning rate 0, the logged losses (every 2 windows) and train_loss are
    the one-process means of the windows' losses (before: no loss logged, and
    train_loss 0.0). The shards are a batch apart: the last window holds a
    batch on rank 0 only."""
    w = _shards_worker()
    model, data = w.Regression(), w.Rows(w.ROWS["bf16_wire"])
    batches = [(data.x[i:i + w.B], data.y[i:i + w.B]) for i in range(0, len(data.x), w.B)]
    shards = [batches[r::WORLD] for r in range(WORLD)]
    windows = []
    with torch.no_grad():
        for start in range(0, max(len(s) for s in shards), w.K):
            micro = [b for shard in shards for b in shard[start:start + w.K]]
            windows.append(sum(float(torch.nn.functional.mse_loss(model.net(x), y)) for x, y in micro) / len(micro))
    assert len(windows) == 4
    logged = [(windows[0] + windows[1]) / 2, (windows[2] + windows[3]) / 2]
    for res in shard_runs("bf16_wire"):
        assert res["global_step"] == 4
        assert len(res["losses"]) == 2
        for got, want in zip(res["losses"], logged):
            assert abs(got - want) <= 1e-12 * want, (got, want)
        assert abs(res["train_loss"] - sum(windows) / 4) <= 1e-12 * res["train_loss"], (res["train_loss"], windows)


def test_arguments_that_see_one_process_under_a_group_are_refused_on_every_rank(shard_runs):
    """Without use_cpu=True on a CPU-only torch, transformers sees one process
    under torchrun and gives every rank the whole dataset, while the group
    has 2 ranks (review: the windows were reduced over ranks that each
    trained everything, and every rank saved). Every rank is refused before
    anything trains."""
    text = ("gradaccum: trainer.train(): the process group has 2 ranks, but the TrainingArguments see one process "
            "(args.world_size=1: on a torch without CUDA, transformers runs data parallel only with use_cpu=True), "
            "so every rank would train on the whole dataset; pass TrainingArguments(use_cpu=True), or "
            "accumulator_options={'process_group': False} to train each rank alone on purpose")
    before = [p.detach() for p in _shards_worker().Regression().parameters()]
    for res in shard_runs("no_use_cpu"):
        assert res["refused"] == text
        assert all(torch.equal(a, b) for a, b in zip(res["params"], before))
