"""The silent-wrong cases of a new user, each now a clear `gradaccum:` error
on every rank: torchrun without a process group, a group created after the
Accumulator, a checkpoint that is not a consistent cut, a plain
loss.backward() with acc.step(), two threads driving one Accumulator, and
num_items that is not a number. Multi-rank cases run on real Gloo ranks
(torchrun, or _dist_utils.run_job)."""
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn as nn

import gradaccum
import _dist_utils as du

HERE = os.path.dirname(os.path.abspath(__file__))
NO_GROUP = ("gradaccum: Accumulator(): WORLD_SIZE=2 in the environment (a torchrun launch?) but no "
            "process group exists, so each rank would train alone and the ranks would end with "
            "different weights. Call torch.distributed.init_process_group() before building the "
            "Accumulator, or pass process_group=False to train each rank alone on purpose")
LATE_GROUP = ("gradaccum: acc.backward(): torch.distributed was initialized after this Accumulator was "
              "built without a process group, so it reduces nothing and each rank would train alone. "
              "Build the Accumulator after init_process_group(), or pass process_group=False to train "
              "each rank alone on purpose")


def torchrun(tmp_path, script, nproc=2, timeout=90):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", str(path)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    return proc, [(tmp_path / f"rank{r}.txt").read_text() if (tmp_path / f"rank{r}.txt").exists() else None
                  for r in range(nproc)]


def test_torchrun_without_a_group_is_an_error_on_every_rank(tmp_path):
    proc, out = torchrun(tmp_path, """
        import os, torch, gradaccum
        rank = os.environ["RANK"]
        m = torch.nn.Linear(3, 1)
        lines = []
        for group in (None, "WORLD", False):
            try:
                pg = torch.distributed.group.WORLD if group == "WORLD" else group
                acc = gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.1), steps=2,
                                            process_group=pg)
                lines.append(f"built {repr(acc)}")
                acc.close()
            except RuntimeError as e:
                lines.append(f"error {e}")
        open(f"rank{rank}.txt", "w").write("\\n".join(lines))
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in out:
        none, world, local = text.splitlines()
        assert none == "error " + NO_GROUP
        assert world == "error " + NO_GROUP  # dist.group.WORLD is None before init
        assert local == "built Accumulator(steps=2, reduction='mean', micro_step=0, data_parallel=False)"


def test_a_group_created_after_the_accumulator_fails_its_first_backward(tmp_path):
    proc, out = torchrun(tmp_path, """
        import os, torch, torch.distributed as dist, gradaccum
        rank = os.environ["RANK"]
        m = torch.nn.Linear(3, 1)
        local = gradaccum.Accumulator(m, steps=2, process_group=False)  # on purpose: allowed
        world = os.environ.pop("WORLD_SIZE")  # built as if no launch were in sight...
        late_model = torch.nn.Linear(2, 1)
        late = gradaccum.Accumulator(late_model, torch.optim.SGD(late_model.parameters(), lr=0.1), steps=2)
        late_weight = late_model.weight.tolist()
        # A window begun, and one closed, before the group exists: flush(),
        # step() and join() meet the error too (review: each stepped its own).
        early_model = torch.nn.Linear(2, 1)
        begun = gradaccum.Accumulator(early_model, torch.optim.SGD(early_model.parameters(), lr=0.1), steps=2)
        begun.backward(early_model(torch.ones(1, 2) * (int(rank) + 1)).sum())
        closed_model = torch.nn.Linear(2, 1)
        closed = gradaccum.Accumulator(closed_model, torch.optim.SGD(closed_model.parameters(), lr=0.1), steps=1)
        closed.backward(closed_model(torch.ones(1, 2) * (int(rank) + 1)).sum())
        joined = gradaccum.Accumulator(torch.nn.Linear(2, 1), steps=2)
        joined_block = joined.join()
        joined_block.__enter__()  # the group is made inside the block (review)
        early_state = [p.detach().clone() for p in (*early_model.parameters(), *closed_model.parameters())]
        early_grads = [p.grad.clone() for p in (*early_model.parameters(), *closed_model.parameters())]
        os.environ["WORLD_SIZE"] = world
        dist.init_process_group("gloo")  # ...and a group appears later
        local.backward(m(torch.ones(1, 3)).sum())
        lines = [f"local micro_step {local.micro_step}"]
        try:
            late.backward(late_model(torch.ones(1, 2)).sum())
        except RuntimeError as e:
            lines.append(f"error {e}")
        lines.append(f"late micro_step {late.micro_step} grad {late_model.weight.grad}")
        # The manual path meets the same error: acc.no_sync(), and the script's own step
        # after a plain loss.backward() (review: each rank stepped its own gradient).
        for call in ("no_sync", "step"):
            try:
                if call == "no_sync":
                    with late.no_sync():
                        pass
                else:
                    late_model(torch.ones(1, 2)).sum().backward()
                    late.optimizer.step()
            except RuntimeError as e:
                lines.append(f"error {e}")
        lines.append(f"weight {late_model.weight.tolist()} {late_weight}")
        for name, call in (("flush", begun.flush), ("join", lambda: begun.join().__enter__()),
                           ("step", closed.step), ("join's end", lambda: joined_block.__exit__(None, None, None))):
            try:
                call()
                lines.append(f"{name} passed")
            except RuntimeError as e:
                lines.append(f"error {e}")
        params = (*early_model.parameters(), *closed_model.parameters())
        lines.append(f"untouched {all(torch.equal(p, q) for p, q in zip(params, early_state))} "
                     f"{all(torch.equal(p.grad, g) for p, g in zip(params, early_grads))}")
        built_model = torch.nn.Linear(2, 1)
        built = gradaccum.Accumulator(built_model, steps=2)
        lines.append(repr(built))
        s = built.stats()
        lines.append(f"{s['data_parallel']} {s['world_size']} {s['backend']}")
        for _ in range(2):
            built.backward(built_model(torch.ones(1, 2)).sum())
        built.zero_grad()
        built.close()  # stats() after close() keeps what the run reduced (review)
        s = built.stats()
        lines.append(f"{s['data_parallel']} {s['world_size']} {s['backend']} {s['collectives']} {s['reductions']}")
        open(f"rank{rank}.txt", "w").write("\\n".join(lines))
        dist.destroy_process_group()
        """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for text in out:
        lines = text.splitlines()
        assert lines[0] == "local micro_step 1"
        assert lines[1] == "error " + LATE_GROUP
        assert lines[2] == "late micro_step 0 grad None"  # refused before anything ran
        assert lines[3] == "error " + LATE_GROUP.replace("acc.backward()", "acc.no_sync()")
        assert lines[4] == "error " + LATE_GROUP.replace("acc.backward()", "optimizer.step()")
        weight, before = lines[5][len("weight "):].split("] ")
        assert weight + "]" == before  # nothing stepped
        assert lines[6:11] == ["error " + LATE_GROUP.replace("acc.backward()", call)
                               for call in ("acc.flush()", "acc.join()", "acc.step()", "acc.join()")] \
            + ["untouched True True"]
        assert lines[11] == ("Accumulator(steps=2, reduction='mean', micro_step=0, data_parallel=True, "
                             "world_size=2, backend='gloo')")
        assert lines[12] == "True 2 gloo"
        assert lines[13] == "True 2 gloo 1 1"


@pytest.mark.parametrize("saves,reduction", [([1, 2], "mean"), ([2, 1], "items"), ([1, 2, 2], "sum")])
def test_a_checkpoint_at_different_micro_steps_is_an_error_on_every_rank(tmp_path, saves, reduction):
    world = len(saves)
    results = du.run_job("skewed_checkpoint", world, tmp_path, module="_misuse_jobs", pg_timeout=30,
                         timeout=120, saves=saves, reduction=reduction)
    each = ", ".join(f"rank {r}: {s}" for r, s in enumerate(saves))
    text = (f"gradaccum: acc.state_dict(): the ranks are at different micro-steps of window 0 ({each}), "
            "so no rank's state is a consistent checkpoint of the job. Call acc.state_dict() at the same "
            "micro-step on every rank (at a window boundary, after acc.step() returned True, is "
            "simplest). Nothing was lost: training can go on")
    for res in results:
        assert res["error"] == text
    # the run went on: the same weights as when every rank saves at the same micro-step
    aligned = du.run_job("skewed_checkpoint", world, tmp_path / "aligned", module="_misuse_jobs",
                         pg_timeout=30, timeout=120, saves=[2] * world, reduction=reduction)
    for res, ref in zip(results, aligned):
        assert ref["error"] is None and ref["state_micro_step"] == 2
        assert torch.allclose(res["weight"], ref["weight"], rtol=0, atol=1e-12)
        assert res["stepped"] == ref["stepped"]


def test_a_save_at_the_boundary_on_one_rank_only_fails_that_window_on_every_rank(tmp_path):
    results = du.run_job("skewed_checkpoint", 2, tmp_path, module="_misuse_jobs", pg_timeout=30,
                         timeout=120, saves=[0, 1], reduction="mean")
    # rank 1 snapshots mid-window; rank 0 saved at the boundary with no collective,
    # so rank 1's snapshot meets rank 0's next window: the consensus fails both
    # (window 0: the one-time bucket rebuild follows it on both ranks)
    snapshot = "acc.state_dict()'s snapshot of a half-done window (a bucket rebuild pending)"
    window = "a window's reduction (a bucket rebuild pending)"
    remedy = ". Every rank must call acc.state_dict() at the same micro-step of a window, and "
    assert f"this rank (rank 1) has {snapshot}, rank 0 has {window}{remedy}" in results[1]["error"]
    assert results[0]["error"] is None  # its own save was fine; its window failed instead (below)
    assert results[0]["window_error"] is not None
    assert f"this rank (rank 0) has {window}, rank 1 has {snapshot}{remedy}" in results[0]["window_error"]


def test_plain_loss_backward_with_acc_step_is_an_error_that_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2)
    model(torch.ones(2, 3)).sum().backward()  # not acc.backward()
    grad = model.weight.grad.clone()
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.step\(\): gradients were written since the "
                       r"last window, but no micro-step was counted: a plain loss\.backward\(\) instead of "
                       r"acc\.backward\(loss\)\?"):
        acc.step()
    assert torch.equal(model.weight.grad, grad) and acc.micro_step == 0
    acc.zero_grad()
    for _ in range(2):
        acc.backward(model(torch.ones(2, 3)).sum())
    assert acc.step() and acc.stats()["optimizer_steps"] == 1
    assert not acc.step()  # nothing since: no error


def test_a_second_thread_calling_in_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=4)
    inside, release = threading.Event(), threading.Event()

    def block(grad):
        inside.set()
        assert release.wait(30)
        return grad

    loss = model(torch.ones(2, 3)).sum()
    handle = model.weight.register_hook(block)  # holds the first thread inside acc.backward()
    worker = threading.Thread(target=acc.backward, args=(loss,))
    worker.start()
    assert inside.wait(30)
    errors = []
    for call in (lambda: acc.backward(model(torch.ones(2, 3)).sum()), acc.step, acc.zero_grad,
                 acc.state_dict):
        try:
            call()
        except RuntimeError as e:
            errors.append(str(e))
    release.set()
    worker.join(30)
    handle.remove()
    assert len(errors) == 4
    for e, call in zip(errors, ("acc.backward()", "acc.step()", "acc.zero_grad()", "acc.state_dict()")):
        assert e == (f"gradaccum: {call}: called while another thread is inside acc.backward() on this "
                     "Accumulator. An Accumulator is not thread-safe (its calls are collectives whose order every "
                     "rank follows): drive it from one thread (a gradient hook on an accelerator's tensors runs on "
                     "autograd's device thread: it must not call the Accumulator). This call was refused and changed "
                     "nothing")
    assert acc.micro_step == 1  # the first thread's micro-step only
    assert torch.allclose(model.weight.grad, torch.full((1, 3), 2.0))


@pytest.mark.parametrize("bad", ["4", [4], object()])
def test_num_items_must_be_a_number(bad):
    model = nn.Linear(3, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2,
                                reduction="items")
    with pytest.raises(TypeError, match=r"^gradaccum: acc\.backward\(\): num_items must be a number or a "
                       r"one-element tensor, got "):
        acc.backward(model(torch.ones(2, 3)).sum(), num_items=bad)
    assert acc.micro_step == 0 and model.weight.grad is None


def test_a_gan_step_that_writes_the_accumulated_gradients_is_named():
    torch.manual_seed(0)
    gen, disc = nn.Linear(2, 3), nn.Linear(3, 1)
    acc = gradaccum.Accumulator(disc, torch.optim.SGD(disc.parameters(), lr=0.1), steps=2)
    acc.backward(disc(torch.randn(4, 3)).sum())
    disc(gen(torch.randn(4, 2))).sum().backward()  # G's step, D not frozen: writes D's .grad
    with pytest.raises(RuntimeError) as info:
        acc.backward(disc(torch.randn(4, 3)).sum())
    text = str(info.value)
    assert text.startswith("gradaccum: acc.backward(): the gradient of weight was changed outside the "
                           "Accumulator in the middle of a window (1 of 2 micro-steps done)"), text
    assert "or by a backward that was not acc.backward() (another loss's backward through these " \
        "parameters, e.g. a GAN's generator step that does not freeze the discriminator)?" in text


def test_stats_and_repr_say_whether_data_parallel():
    acc = gradaccum.Accumulator(nn.Linear(3, 1), steps=3)
    s = acc.stats()
    assert (s["data_parallel"], s["world_size"], s["backend"]) == (False, 1, None)
    assert repr(acc) == "Accumulator(steps=3, reduction='mean', micro_step=0, data_parallel=False)"
    acc.close()
    assert repr(acc) == "Accumulator(steps=3, reduction='mean', closed)"
