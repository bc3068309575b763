"""The reference model's epochs inside `with acc.join():` and on the manual
path (DDP-style `acc.no_sync()`), as functions of a _fuzz_model.Model
(`self`), whose methods call them; the rest of the model: _fuzz_model.py."""
from _fuzz_model import InvalidSchedule, RAISED, _add


def manual_epoch(self, e, ep):
    """README, "with acc.no_sync(): loss.backward()": the DDP-style manual
    path. Each rank's windows end at its `closes` (micro-batch indices):
    before, `with acc.no_sync(): (loss / K).backward()` accumulates
    locally; at one, a plain `(loss / K).backward()` reduces: the mean over
    ranks of their local sums (reducer.h, manual_request: weight 1 per
    rank, divided unless "sum"), as torch DDP. The user then steps the
    optimizer and clears the gradients itself
    (`optimizer.zero_grad(set_to_none=True)`), and `acc.step()` returns
    False (no window of its own closed: README, acc.step()). Ranks may
    run different numbers of no_sync micro-steps, as with DDP. A closing
    backward that fails after it reached a parameter (design.md, Window
    consensus and Limits) drops the window on every rank: the failing
    rank sees its own error, the others "dropped on every rank"; no step."""
    W, K = self.W, self.K
    closes = ep.get("closes")
    if self.scale is not None:
        raise InvalidSchedule("the manual path steps the optimizer itself: no scaler")
    if self.m or ep["events"] or closes is None or len(closes) != W:
        raise InvalidSchedule("a manual epoch starts at a boundary, without events")
    for r in range(W):
        n = len(ep["micros"][r])
        if closes[r] != sorted(set(closes[r])) or (closes[r] and closes[r][-1] != n - 1) or (n and not closes[r]):
            raise InvalidSchedule("a manual epoch ends each rank's micro-batches with a closing backward")
        if any(spec == "boom" and t not in closes[r] for t, spec in enumerate(ep["micros"][r])) \
                or "nan" in ep["micros"][r] or "pad" in ep["micros"][r]:
            raise InvalidSchedule("manual micro-batches are finite; only a closing backward fails")
    if len({len(c) for c in closes}) != 1:
        raise InvalidSchedule("every rank closes as many manual windows")
    for j in range(len(closes[0])):
        local, culprits, lengths = [None] * W, {}, set()
        for r in range(W):
            first = closes[r][j - 1] + 1 if j else 0
            lengths.add(closes[r][j] + 1 - first)
            for t in range(first, closes[r][j] + 1):
                spec = ep["micros"][r][t]
                if spec == "boom":
                    culprits[r] = "boom"
                    continue
                g = self._grad_of(e, r, t, spec)[0]
                local[r] = _add(local[r], [None if x is None else x / K for x in g])
                if t != closes[r][j]:
                    self.exp[r][f"b/{e}/{t}"] = ("ok", None)
        self.seen.add("manual window" + (" dropped" if culprits else "")
                      + (" of unequal lengths" if len(lengths) > 1 else ""))
        if culprits:
            self._drop()
        else:
            if any(m != self.mask[0] for m in self.mask):
                raise InvalidSchedule("a window over ranks with different trainable sets")
            total = None
            for g in local:
                total = _add(total, g)
            div = 1.0 if self.red == "sum" else float(W)
            self._sgd([None if g is None else g / div for g in total])
        for r in range(W):
            t = closes[r][j]
            if r in culprits:
                self.exp[r][f"b/{e}/{t}"] = ("err", ["injected failure"], [], False)
            elif culprits:
                self.exp[r][f"b/{e}/{t}"] = self._dropped_error(r, culprits)
            else:
                self.exp[r][f"b/{e}/{t}"] = ("ok", None)
            self.exp[r][f"s/{e}/{t}"] = ("ok", False)

def join_epoch(self, e, ep):
    """design.md, Joining: window w holds every rank's w-th chunk of its data
    (the first chunk fills the current window); a rank out of data closes
    its partial window and shadows (weight 0) until every rank has joined.
    A backward that fails before a window's close raises out of the
    rank's join() block: that rank leaves, and the reduction the others
    wait for is dropped on every rank, naming it (Note [Leaving join()
    with an exception])."""
    W, K = self.W, self.K
    if ep["events"]:
        raise InvalidSchedule("no events inside join()")
    chunks, full = [], []
    for r in range(W):
        data = list(enumerate(ep["micros"][r]))
        cs, cap = [], K - self.m
        while len(data) >= cap:
            cs.append(data[:cap])
            data, cap = data[cap:], K
        full.append(len(cs))
        cs.append(data)  # the partial (maybe empty) window closed when leaving join()
        chunks.append(cs)
    rounds = max(full) + 1
    for w in range(rounds):
        closing = {}
        for r in range(W):
            if w >= len(chunks[r]):
                continue
            chunk = chunks[r][w]
            for i, (t, spec) in enumerate(chunk):
                is_close = w < full[r] and i == len(chunk) - 1
                if is_close:
                    closing[r] = (t, spec)
                    continue
                if spec == "boom":  # its own error; it leaves join()'s block
                    self.exp[r][f"b/{e}/{t}"] = ("err", ["injected failure"], [], False)
                    # what its reduction says, whatever failed before in its window
                    self.win[r].culprits[r] = "left"
                    self.seen.add("an exception leaves join()")
                    break
                self._contribute(e, r, t, spec)
                self.exp[r][f"b/{e}/{t}"] = ("ok", None)
                self.exp[r][f"s/{e}/{t}"] = ("ok", False)
        before = self._culprits()
        for r, (t, spec) in closing.items():
            self._contribute(e, r, t, spec)
        culprits = self._culprits()
        stepped, loss = (False, None) if culprits else self._close()
        if stepped == RAISED:  # (acc.step() raising inside join() leaves its block)
            raise InvalidSchedule("a non-finite window raised inside join()")
        if culprits:
            self._drop()
            if "left" not in culprits.values() and all(w < full[r] for r in range(W)):
                # design.md, Joining: after a drop that let training go on, each
                # rank's exception leaving join() runs one more reduction, as a drop
                self._drop()
        self.seen.add("join" + (": window dropped" if culprits else "")
                      + (", shadowed" if any(w > full[r] for r in range(W)) else ""))
        for r in range(W):
            exp = self.exp[r]
            if self.win[r].culprits.get(r) == "left":
                continue  # told by its own exception
            if r in closing:
                t, spec = closing[r]
                if culprits:
                    exp[f"b/{e}/{t}"] = self._dropped_error(r, culprits, own_boom=spec == "boom" and r not in before)
                else:
                    exp[f"b/{e}/{t}"] = ("ok", None)
                    exp[f"s/{e}/{t}"] = (("ok", stepped, loss, self.items, self.metric) if stepped
                                             else ("ok", False))
            elif culprits:  # out of data: told inside join()
                exp[f"j/{e}"] = self._dropped_error(r, culprits)
        self._reset()
        if culprits:
            return  # the error leaves join() on every rank: the epoch ends
    for r in range(W):
        self.exp[r][f"j/{e}"] = ("ok", None)
