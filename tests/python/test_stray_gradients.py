"""Gradients no micro-step counted (Note [Gradients no micro-step counted]),
a retried acc.step() after clipping, calls on a closed Accumulator, buffers
that differ across ranks, and a disagreement while a rank shadows in join().
Exact error texts; real Gloo ranks where ranks are involved.
"""
import pytest
import torch

import _dist_utils as du
import gradaccum

M = "_stray_jobs"

STRAY = ("gradaccum: acc.backward(): the gradient of weight was written since the last window (or before the "
         "Accumulator was built), but no micro-step counted it: a plain loss.backward() instead of "
         "acc.backward(loss)? A window would sum it in. Call acc.backward(loss) on each micro-batch: it counts "
         "the micro-step and synchronises the window's last one. (A plain loss.backward(), inside acc.no_sync() "
         "for all but the last micro-batch, is the manual path, where you step the optimizer and clear the "
         "gradients yourself.) Nothing was changed: drop these gradients with acc.zero_grad()")


def linear():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1).double()


def data(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(n)]


def big_batch_grads(m, xs):
    m.zero_grad(set_to_none=True)
    (sum(m(x).pow(2).mean() for x in xs) / len(xs)).backward()
    out = [p.grad.clone() for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("where", ["boundary", "construction", "closed_accumulator"])
def test_gradients_no_micro_step_counted_are_refused_at_the_window_start(where):
    """A plain backward at a window boundary, before the Accumulator was
    built, or a closed Accumulator's half-done window: the window's first
    acc.backward() refuses them (they used to be summed into the window,
    silently), changing nothing; acc.zero_grad() drops them and the window
    is then the big batch."""
    m = linear()
    xs = data(3)
    want = big_batch_grads(m, xs[:2])
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    if where == "construction":
        m(xs[2]).pow(2).mean().backward()
        acc = gradaccum.Accumulator(m, opt, steps=2)
    elif where == "closed_accumulator":
        old = gradaccum.Accumulator(m, None, steps=2)
        old.backward(m(xs[2]).pow(2).mean())  # half a window, left in .grad
        old.close()
        acc = gradaccum.Accumulator(m, opt, steps=2)
    else:
        acc = gradaccum.Accumulator(m, opt, steps=2)
        m(xs[2]).pow(2).mean().backward()
    stray = [p.grad.clone() for p in m.parameters()]
    with pytest.raises(RuntimeError) as info:
        acc.backward(m(xs[0]).pow(2).mean())
    assert str(info.value) == STRAY
    for p, g in zip(m.parameters(), stray):
        assert torch.equal(p.grad, g)
    assert acc.stats()["micro_steps"] == 0
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.step\(\): gradients were written since the last window"):
        acc.step()
    acc.zero_grad()
    for x in xs[:2]:
        acc.backward(m(x).pow(2).mean())
    assert acc.window_ready
    for p, g in zip(m.parameters(), want):
        assert (p.grad - g).abs().max().item() <= 1e-15


def test_a_stale_gradient_of_a_parameter_unfrozen_by_a_refresh_is_refused():
    """A parameter frozen when the Accumulator was built kept a .grad from
    before; unfrozen and refreshed, that stale gradient would be summed into
    the next window: refused there, as at construction."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).double()
    x = data(1)[0]
    m(x).sum().backward()  # every parameter has a gradient now
    m[1].zero_grad(set_to_none=True)
    m[0].requires_grad_(False)  # frozen, its stale .grad kept
    acc = gradaccum.Accumulator(m, torch.optim.SGD(m.parameters(), lr=0.0), steps=2)
    m[0].requires_grad_(True)
    acc.refresh_parameters()
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.backward\(\): the gradient of 0\.weight was written "):
        acc.backward(m(x).sum())


def test_zeros_written_in_place_at_the_boundary_are_no_stray_gradient():
    """optimizer.zero_grad(set_to_none=False) at a window boundary leaves
    zeros in .grad: they sum to the same window, as before."""
    m = linear()
    xs = data(2)
    want = big_batch_grads(m, xs)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    m(xs[0]).sum().backward()
    opt.zero_grad(set_to_none=False)  # zeros, before the Accumulator and at its boundary
    acc = gradaccum.Accumulator(m, opt, steps=2)
    for window in range(2):
        opt.zero_grad(set_to_none=False)
        for x in xs:
            acc.backward(m(x).pow(2).mean())
        for p, g in zip(m.parameters(), want):
            assert (p.grad - g).abs().max().item() <= 1e-15
        assert acc.step()


def test_a_non_finite_stray_gradient_is_refused_too():
    m = linear()
    acc = gradaccum.Accumulator(m, None, steps=2)
    m.weight.grad = torch.full_like(m.weight, float("nan"))
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.backward\(\): the gradient of weight was written"):
        acc.backward(m(data(1)[0]).sum())


def test_zero_grad_on_a_closed_accumulator_is_refused():
    """close() says later calls raise; acc.zero_grad() used to clear the
    gradients of whatever Accumulator owned the parameters next."""
    m = linear()
    xs = data(1)
    old = gradaccum.Accumulator(m, None, steps=2)
    old.close()
    acc = gradaccum.Accumulator(m, None, steps=2)
    acc.backward(m(xs[0]).pow(2).mean())
    grads = [p.grad.clone() for p in m.parameters()]
    with pytest.raises(RuntimeError, match=r"^gradaccum: acc\.zero_grad\(\): this Accumulator was closed$"):
        old.zero_grad()
    for p, g in zip(m.parameters(), grads):
        assert torch.equal(p.grad, g)


def test_a_stray_reducing_backward_on_one_rank_is_told_to_every_rank(tmp_path):
    """Rank 1's plain loss.backward() outside no_sync reduces (the manual
    path) while rank 0 closes window 1 with acc.backward(): the two used to
    pair as one window, and rank 0 stepped rank 1's stray gradient with no
    error anywhere. Now the kinds differ: both drop it, each told; then both
    train on alike (the replicas stay equal)."""
    results = du.run_job("stray_reducing_backward", 2, tmp_path, module=M, timeout=120, pg_timeout=30)
    remedy = ("Every rank must reduce its windows the same way: acc.backward(loss) on every micro-batch, or on "
              "every rank the manual path (a plain loss.backward() outside acc.no_sync() for the window's last "
              "micro-batch). A stray plain loss.backward() on one rank reduces a window the others do not. The "
              "window was dropped on every rank")
    manual, window = "a plain loss.backward()'s reduction (the manual path)", "a window's reduction"
    assert results[0]["errors"] == [("w1", f"gradaccum: acc.backward(): window 1: the ranks disagree on what this "
                                           f"collective is, whether a bucket rebuild follows it, or whether its "
                                           f"window was resumed from a rank-independent state: this rank "
                                           f"(rank 0) has {window}, rank 1 has {manual}. {remedy}")]
    assert results[1]["errors"] == [("stray", f"gradaccum: loss.backward(): window 1: the ranks disagree on what "
                                              f"this collective is, whether a bucket rebuild follows it, or whether "
                                              f"its window was resumed from a rank-independent state: this "
                                              f"rank (rank 1) has {manual}, rank 0 has {window}. {remedy}")]
    for res in results:
        assert res["dropped_windows"] == 1 and res["optimizer_steps"] == 2, res
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("how", ["shape", "count", "dtype"])
def test_buffers_that_differ_across_ranks_fail_every_rank_at_construction(tmp_path, how):
    """Rank 0's buffers are broadcast into every rank's: one of another
    shape used to be mixed silently (or kill a rank inside Gloo)."""
    results = du.run_job("buffers_differ", 2, tmp_path, module=M, timeout=120, pg_timeout=30, how=how)
    tail = ". Rank 0's buffers are broadcast into every rank's (as torch DDP does): every rank must hold the same ones"
    if how == "count":
        want = "gradaccum: Accumulator(): the model's buffers differ across ranks: rank 1 has 2 buffers, rank 0 has 1"
    else:
        theirs = "Double [6]" if how == "shape" else "Float [4]"
        want = (f"gradaccum: Accumulator(): the model differs across ranks: buffer 0 (of 1, in the module's "
                f"buffers() order) is {theirs} on rank 1 but Double [4] on rank 0")
    for res in results:
        assert res["error"] == want + tail
        assert res["untouched"]


def test_a_disagreement_while_a_rank_shadows_in_join_says_to_end_training(tmp_path):
    """Rank 0's mid-window snapshot meets rank 1's shadow in acc.join(): both
    raise, and the text says the shadows leave join() (rank 0 had no word of
    it, went on, and waited for a shadow that was gone)."""
    results = du.run_job("snapshot_meets_shadow", 2, tmp_path, module=M, timeout=120, pg_timeout=30)
    tail = (" The window was dropped on every rank: 1 rank(s) out of data in acc.join() raise this error too and "
            "leave it, so no next window can pair there: end training on every rank here (or resume every rank "
            "from a checkpoint). A rank out of data in acc.join() takes no part in a mid-window acc.state_dict() "
            "snapshot; while ranks shadow, checkpoint at window boundaries (after acc.step() returned True)")
    assert results[0]["state_dict"].startswith("gradaccum: acc.state_dict(): window 0: the ranks disagree on what "
                                               "this collective is"), results[0]
    assert results[0]["state_dict"].endswith(tail), results[0]
    assert results[0]["join"] == results[0]["state_dict"]
    assert results[1]["join"].endswith(tail), results[1]


@pytest.mark.parametrize("how", ["backward", "flush", "join"])
def test_a_stray_gradient_on_one_rank_where_its_call_closes_a_window_drops_it_everywhere(tmp_path, how):
    """Rank 0 holds a gradient no micro-step counted where its call closes a
    window (steps=1, or acc.flush() / acc.join() at a boundary while rank 1
    has a micro-step): every rank drops that window with one text each, and
    the next window trains alike on both ranks."""
    results = du.run_job("stray_at_a_closing_start", 2, tmp_path, module=M, timeout=120, pg_timeout=30, how=how)
    call = {"backward": "acc.backward()", "flush": "acc.flush()", "join": "acc.join()"}[how]
    why = ("the accumulated gradients were cleared or changed outside the Accumulator in the middle of the window "
           "(optimizer.zero_grad() or model.zero_grad() between micro-steps, clipping or another in-place change "
           "of .grad before the window closed (clip under `if acc.window_ready:`, after its last backward, or pass "
           "max_grad_norm), a model converted there "
           "(model.double(): convert it at a window boundary, then call acc.refresh_parameters()), or a backward "
           "other than "
           "acc.backward() through these parameters, such as another model's loss?), or held a gradient no "
           "micro-step counted when it began (a plain loss.backward() at the window boundary, or .grad left before "
           "the Accumulator was built?)")
    calls = [call, "acc.backward()" if how == "backward" else call]
    for rank, res in enumerate(results):
        (err,) = res["errors"]
        assert err[0] == "w0", err
        who = "this rank (rank 0)" if rank == 0 else "rank 0"
        assert err[1].startswith(f"gradaccum: {calls[rank]}: window 0 was dropped on every rank: on {who} {why}"), err
        # the rank that held it says which gradient and which case (review: the
        # shared text lists every cause)
        detail = ("(on this rank the gradient of weight was written before the window's first micro-step (or "
                  "before the Accumulator was built), and no micro-step counted it: a plain loss.backward() at the "
                  "window boundary, or a .grad left from before?)")
        ended = (". Every rank ended its epoch in this acc.flush(): do not call it again for this epoch (a second "
                 "one would pair with the other ranks' next window); the next micro-step begins the next epoch")
        assert err[1].endswith(ended) == (how == "flush"), err  # (every rank flushed)
        assert err[1].removesuffix(ended).endswith(detail) == (rank == 0), err
        assert res["dropped_windows"] == 1 and res["stepped"], res
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clear", [True, False])
def test_a_stray_gradient_where_no_reduction_follows_waits_for_the_next_window(tmp_path, clear):
    """Rank 0's flush() after its epoch ended with rank 1's runs no
    reduction: a stray gradient there marks nothing (it used to fail the
    window that had not begun, and the next clean epoch was dropped). Left
    in .grad, the next window's first micro-step reads it: dropped on both."""
    results = du.run_job("stray_after_the_epoch_ended", 2, tmp_path, module=M, timeout=120, pg_timeout=30,
                         clear=clear)
    assert [r["flush"] for r in results] == [False, True]
    for rank, res in enumerate(results):
        if clear:
            assert res["errors"] == [] and res["stepped"] and res["dropped_windows"] == 0, res
        else:
            (err,) = res["errors"]
            who = "this rank (rank 0)" if rank == 0 else "rank 0"
            assert err.startswith(f"gradaccum: acc.backward(): window 1 was dropped on every rank: on {who} the "
                                  f"accumulated gradients were cleared or changed"), err
            assert not res["stepped"] and res["dropped_windows"] == 1, res


def late_backward_error(call, name, data_parallel=False, outcome="Nothing was stepped: acc.zero_grad() drops this "
                        "window"):
    return (f"gradaccum: {call}: a backward reached {name} after the acc.backward() that closed the window and "
            "before acc.step() (another loss's backward through these parameters, e.g. a GAN's generator loss "
            "through a discriminator that is not frozen?): it sums into the window's gradients a gradient no "
            "micro-step counted" + (", reduced over no rank" if data_parallel else "") + ". Call acc.step() right "
            "after the micro-step that closes the window, or freeze the other network for that backward "
            f"(requires_grad_(False)). {outcome}")


def test_a_backward_after_the_window_closed_is_refused_before_the_step():
    """A GAN's generator loss runs backward through the discriminator after
    the discriminator's window closed and before its acc.step(): that
    gradient was summed into the step, silently (data parallel, it began a
    reduction of its own: test_unstepped.py). acc.step() and acc.state_dict()
    refuse it, changing nothing; clipping in place in between is no backward;
    frozen for the generator's backward, the discriminator steps its window;
    acc.zero_grad() drops the window and the next one is the big batch."""
    torch.manual_seed(0)
    gen, disc = torch.nn.Linear(2, 3).double(), torch.nn.Linear(3, 1).double()
    g = torch.Generator().manual_seed(7)
    real = [torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    noise = torch.randn(4, 2, generator=g, dtype=torch.float64)
    want = big_batch_grads(disc, real)
    opt = torch.optim.SGD(disc.parameters(), lr=0.1)
    acc = gradaccum.Accumulator(disc, opt, steps=2)
    for x in real:
        acc.backward(disc(x).pow(2).mean())
    torch.nn.utils.clip_grad_norm_(disc.parameters(), 1e9)  # in place: no backward
    disc(gen(noise)).sum().backward()  # the generator's loss, the discriminator not frozen
    weights = [p.detach().clone() for p in disc.parameters()]
    grads = [p.grad.clone() for p in disc.parameters()]
    for call, outcome in [("acc.step()", "Nothing was stepped: acc.zero_grad() drops this window"),
                          ("acc.state_dict()", "Nothing was saved: acc.zero_grad() drops this window")]:
        with pytest.raises(RuntimeError) as info:
            acc.step() if call == "acc.step()" else acc.state_dict()
        assert str(info.value) == late_backward_error(call, "bias", outcome=outcome)
        assert acc.window_ready and acc.stats()["optimizer_steps"] == 0
        for p, w, gr in zip(disc.parameters(), weights, grads):
            assert torch.equal(p, w) and torch.equal(p.grad, gr)
    acc.zero_grad()
    for x in real:
        acc.backward(disc(x).pow(2).mean())
    for p, gr in zip(disc.parameters(), want):
        assert (p.grad - gr).abs().max().item() <= 1e-15
    fake = disc(gen(noise)).sum()  # its forward before the window closed, for the generator's step
    disc.requires_grad_(False)  # the generator's step done right: nothing reaches the discriminator
    disc(gen(noise)).sum().backward()
    fake.backward()  # frozen since that forward: AccumulateGrad adds nothing (its hooks still run)
    disc.requires_grad_(True)
    torch.nn.utils.clip_grad_norm_(disc.parameters(), 1e9)
    assert acc.step()
    assert acc.stats()["optimizer_steps"] == 1


def test_an_accumulator_closed_inside_a_backward_leaves_its_hooks_inert():
    """A hook that closes the Accumulator while backward runs (its hooks on
    the gradient accumulators are being iterated): they stay, inert, and the
    next Accumulator over the parameters trains as the big batch."""
    m = linear()
    xs = data(2)
    want = big_batch_grads(m, xs)
    old = gradaccum.Accumulator(m, None, steps=2)
    node = m.weight.view_as(m.weight).grad_fn.next_functions[0][0]  # weight's AccumulateGrad
    node.register_hook(lambda grad_inputs, grad_outputs: old.close())
    m(xs[0]).pow(2).mean().backward()  # (a crash here, before)
    m.zero_grad(set_to_none=True)
    acc = gradaccum.Accumulator(m, None, steps=2)
    for x in xs:
        acc.backward(m(x).pow(2).mean())
    for p, g in zip(m.parameters(), want):
        assert (p.grad - g).abs().max().item() <= 1e-15


@pytest.mark.parametrize("clear,how", [(False, "plain"), (True, "plain"), (False, "acc")])
def test_a_failed_backward_inside_no_sync_is_not_reduced_in_part(tmp_path, clear, how):
    """Note [A failed backward inside no_sync()]: the manual path; rank 1's
    no_sync backward fails after the last layer's gradients reached .grad,
    and the script goes on. That half micro-batch was reduced with the
    window, with no error (review). Now the window's closing backward drops
    it on every rank, rank 1 saying why; with acc.zero_grad() after the
    failure, rank 1's part goes and the window steps without it. Either way
    both ranks match the float64 reference of what was kept. `how` "acc":
    the failed micro-step was an acc.backward() and a plain backward closed
    the window, which reduced it silently with the failed part (review); the
    manual windows after the drop step. (Without the failure that window is
    refused at the next call: test_protocol's every-rank test.)"""
    results = du.run_job("manual_no_sync_backward_fails", 2, tmp_path, module=M, timeout=120, pg_timeout=30,
                         clear=clear, how=how)
    injected = (1, 0, "ValueError", "injected failure in backward")
    if clear:
        assert results[1]["errors"][0][:3] == injected[:3] and results[0]["errors"] == []
        assert len(results[1]["errors"]) == 1
    else:
        tail = (". The window's gradients were cleared on every rank and no optimizer step was taken; training can "
                "go on from the next window")
        assert results[1]["errors"][0][:3] == injected[:3]
        assert results[1]["errors"][1:] == [(1, 1, "RuntimeError", (
            "gradaccum: loss.backward(): window 1 was dropped on every rank: the synchronising backward (or a "
            "micro-step of the window) failed on this rank (rank 1): " + (
                "a plain loss.backward() inside acc.no_sync() failed on this rank in this window after some of its "
                "gradients had reached .grad, so the window held part of that micro-batch" if how == "plain" else
                "a micro-step's acc.backward() (or acc.run()) failed on this rank in this window, and this plain "
                "loss.backward() closed the window, which therefore held a wrong sum") + tail))], results[1]["errors"]
        assert results[0]["errors"] == [(1, 1, "RuntimeError", (
            "gradaccum: loss.backward(): window 1 was dropped on every rank: the synchronising backward (or a "
            "micro-step of the window) failed on rank 1 (its own error is raised there)" + tail))], \
            results[0]["errors"]
    for res in results:
        assert res["dropped_windows"] == (0 if clear else 1)
        du.assert_params_close(res["params"], res["ref"], "kept micro-batches")


def test_a_synchronising_backward_with_create_graph_on_one_rank_reduces_on_both(tmp_path):
    """The manual path's plain loss.backward(create_graph=True) on rank 1:
    torch's own error there (a copy under grad mode), rank 0 left waiting
    (review). Both reduce the values now."""
    for res in du.run_job("manual_create_graph", 2, tmp_path, module=M, timeout=120, pg_timeout=30):
        du.assert_params_close(res["grads"], res["ref"], "create_graph")


@pytest.mark.parametrize("interrupt", [False, True])
def test_a_flush_that_drops_the_window_says_whether_the_epoch_goes_on(tmp_path, interrupt):
    """Every rank flushes, and the window is dropped (rank 1's micro-step
    failed): the epoch ended on every rank, and a second flush() on one rank
    would pair with the others' next window (review), which the error says.
    Not where the drop tells every rank to end training (an interrupt: the
    next micro-step is refused; review)."""
    ended = ("Every rank ended its epoch in this acc.flush(): do not call it again for this epoch (a second one "
             "would pair with the other ranks' next window); the next micro-step begins the next epoch")
    for res in du.run_job("flush_after_a_failed_micro_step", 2, tmp_path, module=M, timeout=120, pg_timeout=30,
                          interrupt=interrupt):
        assert res["error"].startswith("gradaccum: acc.flush(): window 0 was dropped on every rank: "), res["error"]
        assert res["error"].endswith(ended) != interrupt, res["error"]
        assert ("end training on every rank here" in res["error"]) == interrupt, res["error"]


@pytest.mark.parametrize("case", ["sync_every", "two_heads", "head_only", "reentrant_outer"])
def test_the_manual_path_refuses_only_what_would_be_wrong(tmp_path, case):
    """Reviews of the two manual-path Notes: syncing at every micro-batch
    ("mean") is exact and trains as DDP; two heads' backwards closing a
    window under "sum" reduce it again, with a warning (Note [A second
    backward after the manual path's reduction]); heads trained under "sum"
    over a trunk no optimizer clears are exact, a drop no more (review); a
    no_sync backward failing in a reentrant checkpoint's outer task drops its
    window on every rank, and the next window trains as the float64
    reference's."""
    results = du.run_job("manual_path_cases", 2, tmp_path, module=M, timeout=120, pg_timeout=30, case=case)
    again = ("gradaccum: loss.backward(): {}'s .grad is still the gradient the last reduction wrote, and this plain "
             "backward reduces it again: under reduction=\"sum\" that part is multiplied by the world size. Where "
             "that gradient is stepped (two losses closing the window, l1.backward(retain_graph=True); "
             "l2.backward()?), put the losses into one backward ((l1 + l2).backward()) or run the first inside "
             "acc.no_sync(). Where it is not (another model's loss through this model, as a GAN generator's step "
             "through its discriminator: run that backward inside this Accumulator's acc.no_sync(); a parameter no "
             "optimizer steps), it does no harm. Warned once (again after acc.refresh_parameters())")
    for res in results:
        if case == "reentrant_outer":
            closing = [e for e in res["errors"] if e[1] == 1]  # (K=2: the closing micro-step)
            assert [e[:3] for e in closing] == [(0, 1, "RuntimeError")], res["errors"]
            assert closing[0][3].startswith("gradaccum: loss.backward(): window 0 was dropped on every rank"), closing
            assert res["stepped"] == [1]
        else:
            assert res["errors"] == [] and res["stepped"] == list(range(3 if case == "head_only" else 2)), res
        said = [w.split(" (Triggered internally")[0] for w in res["warnings"]]
        if case in ("two_heads", "head_only"):  # (once; naming the parameter the first hook found)
            name = {"two_heads": "head2.bias", "head_only": "trunk.weight"}[case]
            assert said == [again.format(name)], said
        else:
            assert said == [], said
        if case != "two_heads":  # (reduced again: what the warning says)
            du.assert_params_close(res["params"], res["ref"], case)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


@pytest.mark.parametrize("keep", [False, True])
def test_a_checkpoint_node_that_fails_after_its_nested_backward_drops_the_window(tmp_path, keep):
    """Note [A failed backward inside no_sync()]: rank 1's no_sync backward
    fails in a checkpoint's node after the block's nested backward reached
    its parameters. Kept alive by the script (`keep`), the failed graph was
    freed only after the window's reduction: the window was reduced with
    part of that micro-batch and the next one dropped (review). Now window 0
    is dropped on every rank either way, and windows 1 and 2 are exact."""
    for res in du.run_job("manual_checkpoint_node_fails", 2, tmp_path, module=M, timeout=120, pg_timeout=30,
                          keep=keep):
        (w0, w1, w2) = res["windows"]
        assert w0[:2] == ("dropped", 0) and "window 0 was dropped on every rank" in w0[2], w0
        assert [w1[:2], w2[:2]] == [("reduced", 1), ("reduced", 2)], res["windows"]
        assert max(w1[2], w2[2]) < 1e-12, res["windows"]
