"""The fuzzer's reference model of gradaccum's documented protocol.

Written from README.md, docs/design.md and docs/checkpoints.md, not from the
implementation: plain Python and float64 torch arithmetic on one process, no
torch.distributed. Given a schedule (every rank's calls, see
_fuzz_gen.generate), it says what every rank must observe at each call (a return value, or an error
with its key words) and what every rank's parameters must be after each epoch.

A schedule is a plain dict (JSON-able, so a failing one pastes into a test):

    {"seed", "world", "steps", "reduction", "net", "momentum",
     "nonfinite": "skip" | "skip_micro_batch" | "raise" (whose non-finite window
     every rank's driver drops with acc.zero_grad(), as the error says),
     "buckets": "one" | "many", "as_view": bool (options that change no arithmetic),
     "wire": "float16" | "bfloat16" (comm_dtype; absent: the parameters' float64),
     "error_feedback": bool (with a wire),
     "wide": bool (float32 parameters and data, `accumulate_dtype=torch.float64`),
     "metrics": bool (`metrics=("m",)`: each micro-batch passes metric_value()),
     "scaler": bool (a `grad_scaler`: GradScaler(init_scale=SCALE0,
                growth_interval=GROWTH); no wire, restart or manual epoch),
     "epochs": [{"end": "flush" | "join" | "none" | "manual",
                 "micros": [[spec, ...] per rank],
                 "closes": [[t, ...] per rank] ("manual" only),
                 "events": [[t, kind, arg], ...]}]}

A micro-batch's spec is "ok", "nan" (its loss times NaN), "zero"
(`num_items=0`: no valid item, `reduction="items"` only), "pad" (the rank has
no micro-batch: `acc.empty_micro_step()` instead of its backward) or "boom"
(its backward raises on that rank). An event at `t` happens on every rank after
its t-th micro-batch of the epoch and its `acc.step()`:
"opt_zero_grad" (`optimizer.zero_grad()` on rank `arg` only), "acc_zero_grad"
(`acc.zero_grad()` on every rank, or on rank `arg` alone: not generated,
test_unstepped.py tests it; data parallel the position stays), "flush" (`acc.flush()` on every rank), "state_dict" (`acc.state_dict()` on rank `arg`
alone, mid-window; each rank has one such event in the same window, maybe at
another micro-step: a cut that is not consistent) or "checkpoint" (every rank calls
`acc.state_dict()`; rank `arg`'s state, model and optimizer are loaded by
every rank into a fresh model, optimizer and Accumulator, built with the
trainable set of the moment) or "refresh" (every rank sets requires_grad to
`arg`, 1 or 0 per parameter, and calls `acc.refresh_parameters()`; refused
mid-window, where it then sets requires_grad back).

Each rank runs, per epoch: `for t, spec in enumerate(mine): events at t;
acc.backward(loss, num_items); acc.step()`, then events at len(mine), then
`acc.flush()` ("flush"), or nothing ("none"); "join" epochs run the loop
inside `with acc.join():` (no events there; an error ends the epoch);
"manual" epochs take the DDP-style manual path (_fuzz_epochs.manual_epoch). A
schedule with "resize" restarts on another number of ranks: _fuzz_resize.py.

Observation keys (one namespace per rank; checked in _fuzz_check.py): "b/e/t" backward, "s/e/t" step,
"f/e" flush, "x/e/t" a mid-epoch flush, "j/e" leaving join, "c/e/t" state_dict, "l/e/t" the resume,
"r/e/t" refresh_parameters().

A wire ("wire", fp16 or bf16) rounds each window's gradient once (its arithmetic is
judged to the wire's precision, _fuzz_check.tolerance), carries no window loss
(README: `window_loss` is None on a bf16/fp16 wire) and refuses a
rank-independent `acc.state_dict()` in the middle of a window on every rank,
changing nothing (docs/checkpoints.md). (Its windows stay within 12 times
of the weight the wire is scaled for, world * steps at most 3 * 4: none is
light enough to be sent twice, which test_mixed_precision.py tests.)
"""
import math

import torch
import torch.nn as nn

import _dist_utils as du

MICRO = 2  # rows per micro-batch (each du.TOKENS tokens)
LR = {"mean": 0.05, "items": 0.02, "sum": 0.0005}  # SGD's lr: no blow-up in a few steps
SPECS = ("ok", "nan", "zero", "pad", "boom")
DROPPED = "dropped on every rank"  # the window-drop error's key words (README, design.md)
RAISED = "raised"  # _close(): a non-finite window under nonfinite="raise"
SCALE0, GROWTH = 4.0, 2  # a scaler's init_scale and growth_interval (factors 2 and 0.5)
NOT_FINITE = ("err", ["the window's gradient is not finite", "acc.zero_grad()"], [], True)


class InvalidSchedule(Exception):
    """A schedule outside what the model covers (or what the docs allow)."""


# --------------------------------------------------------------------------- #
# Data and networks, shared with the ranks (_fuzz_jobs.py)
# --------------------------------------------------------------------------- #

def make_net(kind, seed, wide=False):
    """The schedule's network; `wide`: in float32 (its sums in float64)."""
    if kind == "linear":
        torch.manual_seed(seed)
        net = nn.Linear(du.D_IN, du.D_OUT).double()
    else:
        net = du.mlp(seed)
    return net.float() if wide else net


def micro_data(seed, epoch, rank, t, spec, wide=False):
    """Rank `rank`'s t-th micro-batch of `epoch`: (x, y, mask) as du.make_windows
    (`wide`: x and y in float32)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch * 10_007 + rank * 101 + t) % (2 ** 62))
    x = torch.randn(MICRO, du.TOKENS, du.D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(MICRO, du.TOKENS, du.D_OUT, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, du.TOKENS + 1, (MICRO,), generator=g)
    mask = torch.arange(du.TOKENS)[None, :] < lengths[:, None]
    if spec == "zero":
        mask = torch.zeros_like(mask)
    if wide:
        x, y = x.float(), y.float()
    return x, y, mask


def metric_value(epoch, rank, t):
    """The metric "m" of rank `rank`'s t-th micro-batch of `epoch` (exact in float32)."""
    return float(1 + (epoch * 7 + rank * 3 + t) % 5)


def micro_loss(net, batch, reduction, spec):
    """(loss, num_items) exactly as a rank passes them to acc.backward()."""
    loss, n = du.micro_loss(net, batch, reduction)
    if spec == "nan":
        loss = loss * float("nan")  # its gradient is NaN too
    return loss, n


# --------------------------------------------------------------------------- #
# The model
# --------------------------------------------------------------------------- #

class _Window:
    """One rank's part of the current window."""

    def __init__(self):
        self.grad = None     # the sum of its micro-batches' gradients (backwards that ran)
        self.weight = 0.0    # micro-batches kept ("mean", "sum") or items ("items")
        self.loss = 0.0      # the sum of the kept losses
        self.metric = 0.0    # the sum of the kept micro-batches' metric "m"
        self.kept = 0        # micro-batches whose backward ran
        self.steps = 0       # micro-steps counted (empty ones and left-out ones too)
        self.nan = False     # a backward with a NaN gradient ran ("skip")
        self.culprits = {}   # rank -> "boom" | "cleared": the window must be dropped
        self.cut = False     # a checkpoint resumed it mid-window (its loss sums were saved with it)
        self.shared = False  # ... from a rank-independent state: each rank holds a share of every rank's sums


class Model:
    def __init__(self, sched):
        self.s = sched
        self.W, self.K = sched["world"], sched["steps"]
        self.red, self.nonfinite = sched["reduction"], sched["nonfinite"]
        self.net = make_net(sched["net"], sched["seed"])
        # (a "wide" rank's float32 parameters: the same values, rounded)
        self.params = [p.detach().clone().float().double() if sched.get("wide") else p.detach().clone()
                       for p in self.net.parameters()]
        self.buf = [None] * len(self.params)  # SGD's momentum buffers, per parameter
        self.mask = [[1] * len(self.params) for _ in range(self.W)]  # requires_grad, per rank
        self.optimizer_steps = 0
        self.skipped_steps = 0  # windows closed with nothing to step, or a non-finite gradient
        self.dropped = 0  # windows dropped on every rank (stats()["dropped_windows"], data parallel)
        # stats()["skipped_micro_batches"], per rank: the (epoch, micro-batch)
        # of each one it counts (a checkpoint loads its source's count at its point)
        self.left_out = [[] for _ in range(self.W)]
        self.loaded_at = set()  # the points where a checkpoint was loaded
        self.m = 0  # micro-step, alike on every rank outside an epoch's last window
        # mixed-precision.md, grad_scaler: its scale and growth tracker (None: no scaler)
        self.scale, self.growth = (SCALE0, 0) if sched.get("scaler") else (None, 0)
        self.win = [_Window() for _ in range(self.W)]
        self.exp = [dict() for _ in range(self.W)]
        self.trace = []  # parameters at each epoch's end
        # what the schedule exercised (coverage tags)
        self.seen = {{"float16": "fp16 wire", "bfloat16": "bf16 wire"}[sched["wire"]]} if sched.get("wire") else set()
        self.seen |= {"error feedback"} if sched.get("error_feedback") else set()
        self.seen |= {"float64 sums of float32 parameters"} if sched.get("wide") else set()

    # ---- arithmetic ----------------------------------------------------- #

    def _grad_of(self, e, r, t, spec):
        """(gradient, loss value, items) of one micro-batch at the window's
        parameters; None for a parameter rank r has frozen."""
        with torch.no_grad():
            for p, v, f in zip(self.net.parameters(), self.params, self.mask[r]):
                p.copy_(v)
                p.grad = None
                p.requires_grad_(bool(f))
        loss, n = micro_loss(self.net, micro_data(self.s["seed"], e, r, t, spec), self.red, "ok")
        loss.backward()
        return [None if p.grad is None else p.grad.detach().clone() for p in self.net.parameters()], loss.item(), n

    def _sgd(self, grad):
        """torch.optim.SGD's step (momentum, no dampening); a parameter whose
        .grad is None is left alone, its buffer too."""
        mom = self.s["momentum"]
        for i, g in enumerate(grad):
            if g is None:
                continue
            if mom:
                self.buf[i] = g.clone() if self.buf[i] is None else mom * self.buf[i] + g
                g = self.buf[i]
            self.params[i] = self.params[i] - LR[self.red] * g

    def _contribute(self, e, r, t, spec):
        """The local effect of rank r's backward of micro-batch t (no reduction)."""
        w = self.win[r]
        w.steps += 1
        if spec == "boom":
            w.culprits.setdefault(r, "boom")
            return
        if spec == "pad":  # README: no backward, no weight; the micro-step counts
            self.seen.add("empty micro-step")
            return
        if spec == "nan":
            if self.nonfinite == "skip_micro_batch":
                self.seen.add("micro-batch left out")
                self.left_out[r].append((e, t))
                return  # left out: no backward, no weight
            w.nan = True
            w.kept += 1
            w.weight += 1.0 if self.red != "items" else 0.0  # its items do not matter: skipped
            if w.grad is None:
                w.grad = [torch.zeros_like(p) if f else None for p, f in zip(self.params, self.mask[r])]
            return
        g, loss, n = self._grad_of(e, r, t, spec)
        w.grad = _add(w.grad, g)
        w.loss += loss
        w.metric += metric_value(e, r, t)
        w.kept += 1
        w.weight += float(n) if self.red == "items" else 1.0

    def _close(self):
        """The window's reduction, no culprit: returns (stepped, window_loss or
        None), or RAISED (nonfinite="raise": every rank's acc.step() or
        acc.flush() raises, and the driver drops the window with
        acc.zero_grad(), as the error says: a skipped window)."""
        wins = self.win
        if any(w.nan for w in wins) and self.scale is not None:
            # mixed-precision.md: an overflow skips the optimizer, counted in
            # skipped_steps, whatever `nonfinite` says; the scale backs off
            self.seen.add("scaler overflow skipped")
            self.skipped_steps += 1
            self._update_scale(found_inf=True)
            return False, None
        if any(w.nan for w in wins) and self.nonfinite == "raise":
            self.seen.add("nonfinite window raised")
            self.skipped_steps += 1  # (counted once acc.zero_grad() drops it)
            return RAISED, None
        if any(w.nan for w in wins) and self.nonfinite == "skip":
            self.seen.add("nonfinite window skipped")
            self.skipped_steps += 1
            return False, None  # a non-finite window is skipped, alike on every rank
        weight = sum(w.weight for w in wins)
        kept = sum(w.kept for w in wins)
        if weight == 0 or kept == 0:
            if kept:
                self.seen.add("window with no items")
            # (a window of micro-steps that kept nothing steps nothing, counted;
            # a flush of no micro-step at all is no window)
            self.skipped_steps += 1 if any(w.steps for w in wins) else 0
            return False, None  # nothing kept (or no items) anywhere: no step
        if any(m != self.mask[0] for m in self.mask):
            raise InvalidSchedule("a window over ranks with different trainable sets")
        total = None
        for w in wins:
            total = _add(total, w.grad)
        div = 1.0 if self.red == "sum" else weight
        grad = [None if g is None else g / div for g in total]
        clip = self.s.get("max_grad_norm")
        if clip is not None:  # clip_grad_norm_'s arithmetic, once per window
            norm = math.sqrt(sum(float((g * g).sum()) for g in grad if g is not None))
            coef = min(1.0, clip / (norm + 1e-6))
            grad = [None if g is None else g * coef for g in grad]
            if coef < 1.0:
                self.seen.add("window clipped")
        self._sgd(grad)
        self.optimizer_steps += 1
        if self.scale is not None:
            self._update_scale(found_inf=False)
        self.items = weight  # window_items: its items (micro-batches kept, but "items")
        loss = sum(w.loss for w in wins) / div
        loss = None if self.s.get("wire") else loss  # (a window a checkpoint cut keeps its loss)
        # window_metrics: summed, not divided; None where window_loss is
        self.metric = None if loss is None or not self.s.get("metrics") else sum(w.metric for w in wins)
        if self.metric is not None:
            self.seen.add("window metrics")
        return True, loss

    def _update_scale(self, found_inf):
        """GradScaler.update() once per window (growth 2, backoff 0.5)."""
        if found_inf:
            self.scale, self.growth = self.scale * 0.5, 0
            return
        self.growth += 1
        if self.growth == GROWTH:
            self.scale, self.growth = self.scale * 2.0, 0
            self.seen.add("scaler grew")

    def _reset(self):
        self.win = [_Window() for _ in range(self.W)]
        self.m = 0

    def _drop(self):
        """A window dropped on every rank (counted by each rank's reducer)."""
        if self.W > 1:
            self.dropped += 1

    def _load_counts(self, src, e, t):
        """Every rank loads rank src's state saved before micro-batch t of
        epoch e (called by the first rank to get there: no rank has counted
        past it yet). After it the counts are alike: a later checkpoint at
        the same point changes nothing."""
        if (e, t) not in self.loaded_at:
            self.loaded_at.add((e, t))
            self.left_out = [[x for x in self.left_out[src] if x < (e, t)] for _ in range(self.W)]

    def _culprits(self):
        out = {}
        for w in self.win:
            out.update(w.culprits)
        return out

    def _dropped_error(self, r, culprits, own_boom=False):
        all_of = [DROPPED]
        if all(v == "cleared" for v in culprits.values()):
            all_of.append("cleared")
        if len(culprits) == 1 and all(v == "left" for v in culprits.values()):
            all_of.append("left its acc.join() block with an exception")
        if own_boom and culprits.get(r) == "boom":  # its first reason is the one told
            all_of.append("injected failure")
        # design.md, "Window consensus": two ranks that drop one window are
        # named to the others; more are counted
        if len(culprits) == 2 and r not in culprits:
            all_of.append("2 ranks (ranks {} and {})".format(*sorted(culprits)))
        any_of = [f"rank {c}" for c in sorted(culprits)] if len(culprits) == 1 else []
        return ("err", all_of, any_of, True)

    # ---- epochs ----------------------------------------------------------- #

    def run(self):
        if self.s.get("launch") == "no_group":
            # README: under a multi-rank launch without a process group the
            # Accumulator refuses to build (each rank would train alone).
            self.seen.add("launched without a group")
            for r in range(self.W):
                self.exp[r]["g"] = ("err", ["no process group exists", "would train alone"], [], True)
                # one built before the group, used after it: README, torchrun
                self.exp[r]["a"] = ("err", ["torch.distributed was initialized after this Accumulator was built",
                                            "each rank would train alone"], [], True)
        for e, ep in enumerate(self.s["epochs"], self.s.get("first_epoch", 0)):
            if len(ep["micros"]) != self.W:
                raise InvalidSchedule("micros per rank")
            if ep["end"] == "join":
                self._join_epoch(e, ep)
            elif ep["end"] == "manual":
                self._manual_epoch(e, ep)
            else:
                self._plain_epoch(e, ep)
            self.trace.append([p.clone() for p in self.params])
        return self

    def _plain_epoch(self, e, ep):
        W, K = self.W, self.K
        n = [len(x) for x in ep["micros"]]
        if ep["end"] == "none" and len(set(n)) != 1:
            raise InvalidSchedule("an epoch without flush() needs equal shards")
        lock = min(n)
        at = {}
        for t, kind, arg in ep["events"]:
            if not 0 <= t <= lock:
                raise InvalidSchedule("events only where every rank has data")
            at.setdefault(t, []).append((kind, arg))
        ops = []
        for r in range(W):
            lst = []
            for t in range(n[r] + 1):
                for kind, arg in at.get(t, []):
                    if kind in ("opt_zero_grad", "acc_zero_grad", "state_dict") and arg is not None and arg != r:
                        continue
                    lst.append(("flush_now" if kind == "flush" else kind, t, arg))
                if t < n[r]:
                    lst.append(("micro", t, ep["micros"][r][t]))
            if ep["end"] == "flush":
                lst.append(("flush", None, None))
            lst.append(("end", None, None))
            ops.append(lst)
        cur = [0] * W
        epoch_over = [False] * W
        mine = [self.m] * W  # each rank's micro-step (they differ only in the last window)
        while True:
            points = []
            for r in range(W):
                while True:
                    kind, t, arg = ops[r][cur[r]]
                    exp = self.exp[r]
                    if kind == "micro":
                        if epoch_over[r]:
                            raise InvalidSchedule("a rank trains on after a peer's flush() ended the epoch")
                        if mine[r] + 1 == K:
                            break  # a reduction point
                        self._contribute(e, r, t, arg)
                        mine[r] += 1
                        exp[f"b/{e}/{t}"] = (("err", ["injected failure"], [], False) if arg == "boom"
                                             else ("ok", None))
                        exp[f"s/{e}/{t}"] = ("ok", False)
                    elif kind == "opt_zero_grad":
                        if mine[r] == 0:
                            cur[r] += 1
                            continue  # at a boundary: nothing to clear
                        if self.s.get("wide"):
                            # mixed-precision.md: the window's sums are kept in float64
                            # and .grad is released after each micro-step: nothing to clear
                            self.seen.add("optimizer.zero_grad() mid-window, sums kept (accumulate_dtype)")
                            cur[r] += 1
                            continue
                        # README: optimizer.zero_grad() between micro-steps is an error
                        # (the window is dropped on every rank, naming the rank). With no
                        # backward run yet in the window there may be nothing to clear
                        # (.grad None): whether that is seen is not documented.
                        if self.win[r].grad is None and not self.win[r].culprits:
                            raise InvalidSchedule("optimizer.zero_grad() with nothing accumulated")
                        self.win[r].culprits.setdefault(r, "cleared")
                    elif kind == "refresh":
                        exp[f"r/{e}/{t}"] = self._refresh(r, mine[r], arg)
                    elif kind == "acc_zero_grad":
                        # design.md: data parallel, what the window holds goes
                        # and the position stays (Note [Dropping the middle of a window]);
                        # a window resumed mid-way from a rank-independent state cannot
                        # lose one rank's share: it is dropped on every rank when it closes
                        old = self.win[r]
                        self.win[r] = _Window()
                        if mine[r]:
                            self.seen.add("acc.zero_grad() mid-window")
                            self.win[r].cut, self.win[r].shared = old.cut, old.shared
                            self.win[r].steps = old.steps if self.W > 1 else 0  # (the micro-steps still count)
                            if old.shared:
                                self.win[r].culprits.setdefault(r, "cleared")
                    elif kind == "checkpoint":
                        if mine[r] > 0:
                            break
                        exp[f"c/{e}/{t}"] = ("ok", None)
                        exp[f"l/{e}/{t}"] = ("ok", None)
                        self._load_counts(arg, e, t)
                        self.seen.add("checkpoint at a boundary")
                    elif kind == "state_dict":
                        if mine[r] == 0:
                            raise InvalidSchedule("a per-rank-timed state_dict() at a boundary")
                        break  # mid-window: a collective
                    elif kind in ("flush", "flush_now"):
                        if not epoch_over[r]:
                            break
                        exp[_flush_key(e, kind, t)] = ("ok", False)  # its window met a flush: no collective
                    else:  # end
                        break
                    cur[r] += 1
                points.append(ops[r][cur[r]])
            kinds = {p[0] for p in points}
            if kinds == {"end"}:
                break
            if "end" in kinds:
                raise InvalidSchedule("a rank would wait in a reduction its peers never run")
            if "flush_now" in kinds and len(kinds) != 1:
                raise InvalidSchedule("a mid-epoch flush() where the ranks are not at one point")
            if kinds <= {"state_dict", "checkpoint"} and self.s.get("wire"):
                # a rank-independent state_dict() mid-window, refused with comm_dtype on each rank
                # before any collective; the window goes on as it was
                if len(kinds) != 1 or (kinds == {"checkpoint"} and len({p[1] for p in points}) != 1):
                    raise InvalidSchedule("a checkpoint where the ranks are not at one point")
                self.seen.add("mid-window state_dict() refused with comm_dtype")
                for r, (_, t, _) in enumerate(points):
                    self.exp[r][f"c/{e}/{t}"] = ("err", ["not supported with comm_dtype"], [], True)
            elif "state_dict" in kinds:
                if kinds != {"state_dict"}:
                    raise InvalidSchedule("a state_dict() some ranks call in another window")
                culprits = self._culprits()
                if len(set(mine)) == 1:  # one consistent cut (not resumed)
                    if culprits:
                        for r, (_, t, _) in enumerate(points):
                            self.exp[r][f"c/{e}/{t}"] = self._dropped_error(r, culprits)
                        self._drop()
                        self._reset()
                        mine = [0] * W
                    else:
                        for r, (_, t, _) in enumerate(points):
                            self.exp[r][f"c/{e}/{t}"] = ("ok", None)
                else:
                    # checkpoints.md: "Ranks that call state_dict() at different micro-steps
                    # of a window ... get an error on every rank"; the window goes on.
                    if culprits:
                        raise InvalidSchedule("a skewed state_dict() of a failed window")
                    self.seen.add("state_dict() at different micro-steps")
                    for r, (_, t, _) in enumerate(points):
                        self.exp[r][f"c/{e}/{t}"] = ("err", ["different micro-steps"], [], True)
            elif "checkpoint" in kinds:
                if kinds != {"checkpoint"} or len({p[1] for p in points}) != 1 or len(set(mine)) != 1:
                    raise InvalidSchedule("a checkpoint where the ranks are not at one point")
                t = points[0][1]
                culprits = self._culprits()
                self.seen.add("checkpoint mid-window" + (" of a failed window" if culprits else ""))
                if culprits:
                    # checkpoints.md: a rank-independent state_dict() of a window that is
                    # silently wrong drops the window on every rank with that reason
                    for r in range(W):
                        self.exp[r][f"c/{e}/{t}"] = self._dropped_error(r, culprits)
                    self._drop()
                    self._reset()
                    mine = [0] * W
                else:
                    for r in range(W):
                        self.exp[r][f"c/{e}/{t}"] = ("ok", None)
                        self.exp[r][f"l/{e}/{t}"] = ("ok", None)
                        self._load_counts(points[0][2], e, t)
                        self.win[r].cut = True
                        self.win[r].shared = True
            else:
                # closing backwards and flushes pair in one reduction
                before = self._culprits()
                for r, (kind, t, arg) in enumerate(points):
                    if kind == "micro":
                        self._contribute(e, r, t, arg)
                culprits = self._culprits()
                if culprits:
                    stepped, loss = False, None
                    self._drop()
                    self.seen.update(f"window dropped ({v})" for v in culprits.values())
                    if len(culprits) > 1:
                        self.seen.add("window dropped (several ranks)")
                else:
                    stepped, loss = self._close()
                if "flush_now" in kinds:
                    self.seen.add("flush() mid-epoch")
                if "flush" in kinds:
                    self.seen.add("flush" + (" meets closing ranks" if "micro" in kinds else "")
                                  + (" of unequal partial windows" if len(set(mine)) > 1 else ""))
                for r, (kind, t, arg) in enumerate(points):
                    exp = self.exp[r]
                    if kind == "micro":
                        own = arg == "boom" and r not in before
                        exp[f"b/{e}/{t}"] = (self._dropped_error(r, culprits, own_boom=own)
                                             if culprits else ("ok", None))
                        exp[f"s/{e}/{t}"] = (NOT_FINITE if stepped == RAISED else
                                             ("ok", stepped, loss, self.items, self.metric) if stepped else ("ok", False))
                        if "flush" in kinds:
                            epoch_over[r] = True
                    else:
                        exp[_flush_key(e, kind, t)] = (
                            self._dropped_error(r, culprits) if culprits else NOT_FINITE if stepped == RAISED
                            else (("ok", True, loss) if stepped else ("ok", False)))
                self._reset()
                mine = [0] * W
            for r in range(W):
                cur[r] += 1
        if ep["end"] != "flush" and len(set(mine)) != 1:
            raise InvalidSchedule("the ranks end the epoch at different micro-steps")
        self.m = 0 if ep["end"] == "flush" else mine[0]

    def _refresh(self, r, micro_step, mask):
        """README, "Changing requires_grad": acc.refresh_parameters() at a
        window boundary, every rank alike, after requires_grad changed
        (`mask`: 1 where a parameter requires grad). A parameter that left the
        set has .grad None (Note [Refreshing the parameters]): the optimizer
        leaves it alone. The driver observes ("ok", [frozen parameters with a
        .grad]). Mid-window it is an error (design.md, Limits) that changes
        nothing: the driver then sets requires_grad back."""
        if not any(mask) or len(mask) != len(self.params):
            raise InvalidSchedule("a trainable set of no parameter")
        if micro_step:
            self.seen.add("refresh_parameters() mid-window")
            return ("err", ["acc.refresh_parameters()", "window boundary"], [], True)
        old = self.mask[r]
        self.seen.add("refresh_parameters() at a boundary"
                      + (", froze" if any(o and not m for o, m in zip(old, mask)) else "")
                      + (", unfroze" if any(m and not o for o, m in zip(old, mask)) else ""))
        self.mask[r] = list(mask)
        return ("ok", [])

    def _manual_epoch(self, e, ep):
        import _fuzz_epochs
        _fuzz_epochs.manual_epoch(self, e, ep)

    def _join_epoch(self, e, ep):
        import _fuzz_epochs
        _fuzz_epochs.join_epoch(self, e, ep)


def _add(a, b):
    """Per-parameter sums of two gradients (lists, None entries where frozen)."""
    if a is None or b is None:
        return b if a is None else a
    return [y if x is None else x if y is None else x + y for x, y in zip(a, b)]


def _flush_key(e, kind, t):
    return f"f/{e}" if kind == "flush" else f"x/{e}/{t}"


def expect(sched):
    """The model's prediction, or InvalidSchedule. A phase of a restart on
    another number of ranks, or a schedule with one: _fuzz_resize.py."""
    if "phase" in sched or "resize" in sched:
        import _fuzz_resize as fr
        return fr.expect_phase(sched) if "phase" in sched else fr.expect_whole(sched)
    return Model(sched).run()
