"""The fuzzer's rank-side driver (job `fuzz_schedules`) and its parent-side
runner and shrinker, shared by test_fuzz.py and tools/fuzz.py.

One launch (du.run_job, real Gloo ranks on loopback) runs many schedules in
sequence, each with a fresh model, optimizer and Accumulator; each rank
records what every call returned or raised, and its parameters after each
epoch. The parent holds them against _fuzz_model (the reference model).
"""
import os
import time
import traceback

import torch

import _dist_utils as du
import _fuzz_check as fc
import _fuzz_gen as fg
import _fuzz_model as fm
import _fuzz_resize as fr
from _dist_utils import Boom, job


def _err(e):
    return ["err", [c.__name__ for c in type(e).__mro__], str(e)[:4000]]


class _Run:
    """One rank's side of one schedule."""

    def __init__(self, rank, sched, ctl):
        self.rank, self.s, self.ctl = rank, sched, ctl
        self.net = self.opt = self.acc = None
        self.mask = None  # requires_grad per parameter (None: all)
        self.restored = None  # the after-phase of a restart: what the before-phase saved
        if sched.get("phase") == "after":
            self.restored = torch.load(sched["path"], weights_only=False)
            self.mask = self.restored["mask"]
        self._build()

    def _build(self):
        import gradaccum

        s = self.s
        self.net = fm.make_net(s["net"], s["seed"], s.get("wide", False))
        for p, f in zip(self.net.parameters(), self.mask or []):
            p.requires_grad_(bool(f))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=fm.LR[s["reduction"]], momentum=s["momentum"])
        caps = ({"bucket_cap_mb": 0.0005, "first_bucket_cap_mb": 0.0002} if s.get("buckets") == "many" else {})
        self.acc = gradaccum.Accumulator(self.net, self.opt, steps=s["steps"], reduction=s["reduction"],
                                         nonfinite=s["nonfinite"], max_grad_norm=s.get("max_grad_norm"),
                                         gradient_as_bucket_view=bool(s.get("as_view")),
                                         comm_dtype=getattr(torch, s["wire"]) if s.get("wire") else None,
                                         error_feedback=bool(s.get("error_feedback")),
                                         accumulate_dtype=torch.float64 if s.get("wide") else None,
                                         grad_scaler=torch.amp.GradScaler("cpu", init_scale=fm.SCALE0,
                                                                          growth_interval=fm.GROWTH)
                                         if s.get("scaler") else None,
                                         metrics=("m",) if s.get("metrics") else (),
                                         process_group=False if s["world"] == 1 else None, **caps)

    def backward(self, e, t, spec):
        if spec == "pad":
            self.acc.empty_micro_step()
            return
        batch = fm.micro_data(self.s["seed"], e, self.rank, t, spec, self.s.get("wide", False))
        loss, n = fm.micro_loss(self.net, batch, self.s["reduction"], spec)
        if spec == "boom":
            loss = Boom.apply(loss)
        if n is not None:
            # Each form a caller passes: an int, a float, a 0-dim or one-element tensor.
            n = [n, float(n), torch.tensor(n), torch.tensor([float(n)])][(e + t + self.rank) % 4]
        metrics = None
        if self.s.get("metrics"):  # a float, an int or a 0-dim tensor
            v = fm.metric_value(e, self.rank, t)
            metrics = {"m": [v, int(v), torch.tensor(v)][(e + t + self.rank) % 3]}
        self.acc.backward(loss, num_items=n, metrics=metrics)

    def manual_backward(self, e, t, spec, closing, obs):
        """The manual path: `(loss / K).backward()`, inside acc.no_sync()
        unless `closing`; a closing one is followed by optimizer.step() (if
        it succeeded), optimizer.zero_grad(set_to_none=True) and acc.step()."""
        x, y, mask = fm.micro_data(self.s["seed"], e, self.rank, t, spec, self.s.get("wide", False))
        if spec == "boom":  # fails after the parameters' gradients were accumulated
            x = Boom.apply(x.requires_grad_())
        loss, _ = fm.micro_loss(self.net, (x, y, mask), self.s["reduction"], spec)
        loss = loss / self.s["steps"]
        if not closing:
            try:
                with self.acc.no_sync():
                    loss.backward()
                obs[f"b/{e}/{t}"] = ["ok", None]
            except Exception as err:  # noqa: BLE001
                obs[f"b/{e}/{t}"] = _err(err)
            return
        try:
            loss.backward()
            obs[f"b/{e}/{t}"] = ["ok", None]
            self.opt.step()
        except Exception as err:  # noqa: BLE001
            obs[f"b/{e}/{t}"] = _err(err)
        self.opt.zero_grad(set_to_none=True)
        try:
            obs[f"s/{e}/{t}"] = self.step()
        except Exception as err:  # noqa: BLE001
            obs[f"s/{e}/{t}"] = _err(err)

    def refresh(self, mask):
        """requires_grad set to `mask` and acc.refresh_parameters(); the
        frozen parameters that still have a .grad. Refused: set back."""
        old = self.mask or [1] * len(mask)
        for p, f in zip(self.net.parameters(), mask):
            p.requires_grad_(bool(f))
        try:
            self.acc.refresh_parameters()
        except Exception:
            for p, f in zip(self.net.parameters(), old):
                p.requires_grad_(bool(f))
            raise
        self.mask = list(mask)
        return ["ok", [i for i, (p, f) in enumerate(zip(self.net.parameters(), mask)) if not f and p.grad is not None]]

    def _stepped(self, v):
        if not v:
            return ["ok", v]
        wl, wm = self.acc.window_loss, self.acc.window_metrics
        return ["ok", v, None if wl is None else float(wl), self.acc.window_items,
                None if wm is None else float(wm["m"])]

    def step(self):
        return self._stepped(self._dropping_nonfinite(self.acc.step))

    def flush(self):
        return self._stepped(self._dropping_nonfinite(self.acc.flush))

    def _dropping_nonfinite(self, call):
        """nonfinite="raise": a non-finite window raises on every rank; the
        caller drops it with acc.zero_grad(), as the error says."""
        try:
            return call()
        except RuntimeError as err:
            if self.s["nonfinite"] == "raise" and "is not finite" in str(err):
                self.acc.zero_grad()
            raise

    def checkpoint(self, e, t, src, obs):
        """Every rank saves; rank `src`'s state is loaded everywhere, into a
        fresh model, optimizer and Accumulator."""
        import torch.distributed as dist

        try:
            state = self.acc.state_dict()
            obs[f"c/{e}/{t}"] = ["ok", None]
        except Exception as err:  # noqa: BLE001 - recorded, judged by the parent
            obs[f"c/{e}/{t}"] = _err(err)
            state = None
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, state is not None, group=self.ctl)
        if not all(flags):
            return  # nobody resumes (the parent judges the errors)
        blob = [{"acc": state, "model": self.net.state_dict(), "opt": self.opt.state_dict()}
                if self.rank == src else None]
        dist.broadcast_object_list(blob, src=src, group=self.ctl)
        try:
            self.acc.close()
            self._build()
            self.net.load_state_dict(blob[0]["model"])
            self.opt.load_state_dict(blob[0]["opt"])
            self.acc.load_state_dict(blob[0]["acc"])
            obs[f"l/{e}/{t}"] = ["ok", None]
        except Exception as err:  # noqa: BLE001
            obs[f"l/{e}/{t}"] = _err(err)

    def restart(self, obs):
        """A restart on another number of ranks (_fuzz_resize.py): the
        before-phase saves at its end on every rank, rank 0 writing the file;
        the after-phase loads it on every rank before its first epoch."""
        key = f"{len(self.s['whole']['epochs'])}/0"
        try:
            if self.s["phase"] == "after":
                blob = self.restored
                self.net.load_state_dict(blob["model"])
                self.opt.load_state_dict(blob["opt"])
                self.acc.load_state_dict(blob["acc"])
                obs[f"l/{key}"] = ["ok", None]
                return
            blob = {"acc": self.acc.state_dict(), "model": self.net.state_dict(), "opt": self.opt.state_dict(),
                    "mask": self.mask or [1] * len(list(self.net.parameters()))}
            obs[f"c/{key}"] = ["ok", None]
        except Exception as err:  # noqa: BLE001
            obs[("l/" if self.s["phase"] == "after" else "c/") + key] = _err(err)
            return
        if self.rank == 0:
            torch.save(blob, self.s["path"] + ".part")
            os.replace(self.s["path"] + ".part", self.s["path"])

    def run(self):
        obs, trace = {}, []
        rank = self.rank
        if self.s.get("phase") == "after":
            self.restart(obs)
        for e, ep in enumerate(self.s["epochs"], self.s.get("first_epoch", 0)):
            mine = ep["micros"][rank]
            if ep["end"] == "join":
                where = None
                try:
                    with self.acc.join():
                        for t, spec in enumerate(mine):
                            where = f"b/{e}/{t}"
                            self.backward(e, t, spec)
                            obs[where] = ["ok", None]
                            where = f"s/{e}/{t}"
                            obs[where] = self.step()
                        where = f"j/{e}"
                    obs[f"j/{e}"] = ["ok", None]
                except Exception as err:  # noqa: BLE001
                    obs[where] = _err(err)
            elif ep["end"] == "manual":
                for t, spec in enumerate(mine):
                    self.manual_backward(e, t, spec, t in ep["closes"][rank], obs)
            else:
                at = {}
                for t, kind, arg in ep["events"]:
                    at.setdefault(t, []).append((kind, arg))
                for t in range(len(mine) + 1):
                    for kind, arg in at.get(t, []):
                        try:
                            if kind == "opt_zero_grad":
                                if arg == rank:
                                    self.opt.zero_grad()
                            elif kind == "acc_zero_grad":
                                if arg is None or arg == rank:
                                    self.acc.zero_grad()
                            elif kind == "state_dict":  # on rank `arg` alone, at this point
                                if arg == rank:
                                    try:
                                        self.acc.state_dict()
                                        obs[f"c/{e}/{t}"] = ["ok", None]
                                    except Exception as err:  # noqa: BLE001
                                        obs[f"c/{e}/{t}"] = _err(err)
                            elif kind == "refresh":
                                try:
                                    obs[f"r/{e}/{t}"] = self.refresh(arg)
                                except Exception as err:  # noqa: BLE001
                                    obs[f"r/{e}/{t}"] = _err(err)
                            elif kind == "flush":
                                try:
                                    obs[f"x/{e}/{t}"] = self.flush()
                                except Exception as err:  # noqa: BLE001
                                    obs[f"x/{e}/{t}"] = _err(err)
                            else:
                                self.checkpoint(e, t, arg, obs)
                        except Exception as err:  # noqa: BLE001
                            obs[f"z/{e}/{t}"] = _err(err)
                    if t == len(mine):
                        break
                    for key, call in ((f"b/{e}/{t}", lambda: self.backward(e, t, mine[t]) or ["ok", None]),
                                      (f"s/{e}/{t}", self.step)):
                        try:
                            obs[key] = call()
                        except Exception as err:  # noqa: BLE001
                            obs[key] = _err(err)
                if ep["end"] == "flush":
                    try:
                        obs[f"f/{e}"] = self.flush()
                    except Exception as err:  # noqa: BLE001
                        obs[f"f/{e}"] = _err(err)
            trace.append(du.params(self.net))
        if self.s.get("phase") == "before":
            self.restart(obs)
        out = {"obs": obs, "trace": trace, "micro_step": self.acc.micro_step,
               "window_ready": self.acc.window_ready,
               "optimizer_steps": self.acc.stats()["optimizer_steps"],
               "skipped_steps": self.acc.stats()["skipped_steps"],
               "dropped_windows": self.acc.stats()["dropped_windows"],
               "skipped_micro_batches": self.acc.stats()["skipped_micro_batches"],
               "loss_scale": self.acc.stats()["loss_scale"]}
        self.acc.close()
        return out


def _without_group(rank, world_size, sched, relaunch):
    """A torchrun launch that forgot init_process_group(): the default group is
    destroyed, WORLD_SIZE and RANK are set as torchrun sets them, and an
    Accumulator is built with the default process_group; then the group comes
    back on the same store. Also an Accumulator built with no group and no
    launch (one process, as it looks then), whose first backward after the
    group came back must refuse to train each rank alone. Returns the two
    observations and the driver's new control group."""
    from datetime import timedelta

    import gradaccum
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    store, backend = c10d._get_default_store(), dist.get_backend()
    dist.destroy_process_group()  # the control group goes with it
    try:
        with du.launch_env(WORLD_SIZE=str(world_size), RANK=str(rank)):
            net = fm.make_net(sched["net"], sched["seed"])
            acc = gradaccum.Accumulator(net, torch.optim.SGD(net.parameters(), lr=0.1), steps=sched["steps"])
            acc.close()
        seen = ["ok", None]
    except Exception as err:  # noqa: BLE001 - recorded, judged by the parent
        seen = _err(err)
    try:
        alone = fm.make_net(sched["net"], sched["seed"])
        early = gradaccum.Accumulator(alone, torch.optim.SGD(alone.parameters(), lr=0.1), steps=sched["steps"])
    finally:
        dist.init_process_group(backend, store=dist.PrefixStore(f"relaunch{relaunch}", store), rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT))
    batch = fm.micro_data(sched["seed"], 0, rank, 0, "ok")
    try:
        early.backward(fm.micro_loss(alone, batch, "mean", "ok")[0])
        late = ["ok", None]
    except Exception as err:  # noqa: BLE001
        late = _err(err)
    early.close()
    return (seen, late), dist.new_group(backend="gloo")


@job
def fuzz_schedules(rank, world_size, *, schedules):
    """Runs each schedule in turn on this rank; a list of results, one per schedule."""
    import torch.distributed as dist

    ctl = dist.new_group(backend="gloo")  # the driver's own traffic, apart from gradaccum's
    out = []
    for i, sched in enumerate(schedules):
        dist.barrier(group=ctl)
        run = None
        try:
            launch = None
            if sched.get("launch") == "no_group":
                launch, ctl = _without_group(rank, world_size, sched, i)
            run = _Run(rank, sched, ctl)
            out.append(run.run())
            if launch is not None:
                out[-1]["obs"]["g"], out[-1]["obs"]["a"] = launch
        except Exception:  # noqa: BLE001
            out.append({"crash": traceback.format_exc()[-3000:]})
            if run is not None and run.acc is not None:
                try:
                    run.acc.close()
                except Exception:  # noqa: BLE001
                    pass
    return out


# --------------------------------------------------------------------------- #
# Parent side
# --------------------------------------------------------------------------- #

PG_TIMEOUT = 20  # a collective that waits this long fails (a hang shows as an error)


def _launch(schedules, out_dir, timeout=None):
    """One launch; per schedule, its problems. Raises when the launch itself
    fails (a hang past the deadline, a rank that died or raised)."""
    world = schedules[0]["world"]
    assert all(s["world"] == world for s in schedules)
    timeout = timeout or 60 + 4 * len(schedules)
    results = du.run_job("fuzz_schedules", world, out_dir, module="_fuzz_jobs", timeout=timeout,
                         pg_timeout=PG_TIMEOUT, schedules=schedules)
    return [fc.check(s, [results[r][i] for r in range(world)]) for i, s in enumerate(schedules)]


_launches = [0]


def verdicts(schedules, tmp_dir, batch=30):
    """Problems of each schedule (a list per schedule; [] passes), grouped by
    world size into launches of up to `batch`. After a failing schedule the
    rest of its launch runs again in a new one (a failure may leave the ranks
    out of step); a launch that fails as a whole is rerun one schedule per
    launch. A schedule with a restart on another number of ranks runs as two
    launches (_fuzz_resize.verdicts)."""
    if any("resize" in s for s in schedules):
        return fr.verdicts(schedules, tmp_dir, batch, verdicts)
    out = [None] * len(schedules)
    pending = list(range(len(schedules)))
    while pending:
        world = schedules[pending[0]]["world"]
        idx = [i for i in pending if schedules[i]["world"] == world][:batch]
        _launches[0] += 1
        out_dir = os.path.join(str(tmp_dir), f"launch{_launches[0]}")
        try:
            probs = _launch([schedules[i] for i in idx], out_dir)
        except Exception as exc:  # noqa: BLE001 - a hang or a crash
            what = f"the launch failed: {type(exc).__name__}: {str(exc)[-1500:]}"
            if len(idx) == 1:
                out[idx[0]] = [what]
                pending.remove(idx[0])
            else:
                for i in idx:  # one per launch
                    out[i] = verdicts([schedules[i]], tmp_dir)[0]
                    pending.remove(i)
            continue
        for i, p in zip(idx, probs):
            out[i] = p
            pending.remove(i)
            if p:
                break  # the rest of this launch runs again
    return out


def signature(problems):
    """Coarse kinds of a failure, so that shrinking keeps to the same bug."""
    kinds = set()
    for p in problems:
        if "launch failed" in p or "escaped the driver" in p or "no result" in p:
            kinds.add("launch")
        elif "parameters after" in p:
            kinds.add("params")
        elif "window_loss" in p or "window_metrics" in p:
            kinds.add("loss")
        elif any(k in p for k in ("micro_step", "optimizer_steps", "skipped_steps", "loss_scale")):
            kinds.add("state")
        else:
            kinds.add("calls")
    return kinds


def shrink(sched, problems, tmp_dir, budget_s=300, log=None, chunk=8):
    """Greedy: the smallest candidate that still fails the same way, repeated
    while one does and the budget lasts. Returns (schedule, problems)."""
    deadline = time.monotonic() + budget_s
    best, best_p = sched, problems
    sig = signature(problems)
    while time.monotonic() < deadline:
        cands = fg.shrink_candidates(best)
        found = False
        for start in range(0, len(cands), chunk):
            if time.monotonic() >= deadline:
                break
            part = cands[start:start + chunk]
            vs = verdicts(part, tmp_dir, batch=chunk)
            failing = [(c, p) for c, p in zip(part, vs) if p and signature(p) & sig]
            if failing:
                best, best_p = min(failing, key=lambda cp: fg.size(cp[0]))
                if log:
                    log(f"  shrunk to size {fg.size(best)}: {best_p[0][:160]}")
                found = True
                break
        if not found:
            break
    return best, best_p
