"""The fuzzer's schedules: random ones (`generate`), their size and smaller
variants (`shrink_candidates`) for shrinking a failing one, and the
regression test a shrunk schedule becomes. The schedule format and what each
call must observe: _fuzz_model.py."""
import random

from _fuzz_model import InvalidSchedule, expect

RESIZE_P = 0.12  # schedules that restart on another number of ranks
WIRE_P = 0.2  # of the others, schedules with an fp16 wire (comm_dtype)
BF16_P = 0.4  # of the wires, bf16 ones
FEEDBACK_P = 0.4  # of the wires, with error_feedback
WIDE_P = 0.15  # float32 parameters summed in float64 (accumulate_dtype)
RAISE_P = 0.3  # of the "skip" ones, nonfinite="raise"
METRICS_P = 0.3  # metrics=("m",)
SCALER_P = 0.15  # of those without a wire, restart or manual epoch, a grad_scaler


def _specs(rng, count, reduction, boom_p, closing=None):
    out = []
    for i in range(count):
        u = rng.random()
        if u < boom_p and (closing is None or closing(i)):
            out.append("boom")
        elif u < boom_p + 0.08:
            out.append("nan")
        elif u < boom_p + 0.13:
            out.append("pad")
        elif u < boom_p + 0.30 and reduction == "items":
            out.append("zero")
        else:
            out.append("ok")
    return out


def _mask(rng, net):
    """A trainable set: 1 or 0 per parameter (the mlp's by layer), never empty."""
    if rng.random() < 0.35:
        return [1] * (6 if net == "mlp" else 2)
    while True:
        bits = [rng.randint(0, 1) for _ in range(3 if net == "mlp" else 2)]
        if any(bits):
            return [b for b in bits for _ in range(2)] if net == "mlp" else bits


def _manual(rng, W, K, red):
    """A manual epoch: windows of K micro-batches (or, as DDP allows, another
    number per rank), each ending in a plain backward that may fail."""
    micros, closes = [[] for _ in range(W)], [[] for _ in range(W)]
    for _ in range(rng.randint(1, 3)):
        uneven = rng.random() < 0.3
        for r in range(W):
            n = rng.randint(1, K + 1) if uneven else K
            micros[r] += _specs(rng, n - 1, red, 0.0) + ["boom" if rng.random() < 0.06 else "ok"]
            closes[r].append(len(micros[r]) - 1)
    micros = [[s_ if s_ not in ("nan", "pad") else "ok" for s_ in x] for x in micros]
    return {"end": "manual", "micros": micros, "closes": closes, "events": []}


def _epochs(rng, sched, W, K, m, alone=False):
    """1 to 3 random epochs on W ranks from micro-step m; (epochs, the micro-step
    they end at). `alone`: what one process without a group does as data
    parallel ranks do (no failing backward, join, manual path, cleared
    gradients or per-rank saves)."""
    red, epochs = sched["reduction"], []
    for _ in range(rng.randint(1, 3)):
        end = rng.choices(["flush", "join", "none", "manual"],
                          [5, 0 if alone else 3, 2, 2 if m == 0 and not alone else 0])[0]
        events = []
        if end == "manual":
            epochs.append(_manual(rng, W, K, red))
            continue
        if end == "join":
            n = [rng.randint(0, 3 * K) for _ in range(W)]
            # a backward fails mostly at a window's close; elsewhere it raises
            # out of join()'s block (Note [Leaving join() with an exception])
            micros = [_specs(rng, n[r], red, 0.06, closing=lambda i, m=m: (m + i + 1) % K == 0 or rng.random() < 0.4)
                      for r in range(W)]
            m = 0
        else:
            if end == "flush":
                lock = (K - m) % K + rng.randint(0, 2) * K
                n = [lock + rng.randint(0, K) for _ in range(W)]
            else:
                n = [rng.randint(0, 2 * K + 1)] * W
            micros = [_specs(rng, n[r], red, 0.0 if alone else 0.04) for r in range(W)]
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                kind = rng.choices(["checkpoint", "opt_zero_grad", "acc_zero_grad", "flush", "refresh"],
                                   [5, 0 if alone else 4, 0 if alone else 1, 1, 3])[0]
                arg = rng.randrange(W) if kind in ("checkpoint", "opt_zero_grad") else None
                t = rng.randint(0, min(n))
                if kind == "refresh":
                    arg = _mask(rng, sched["net"])
                    bounds = list(range((K - m) % K, min(n) + 1, K))
                    if bounds and rng.random() < 0.7:
                        t = rng.choice(bounds)  # mostly where it is allowed
                events.append([t, kind, arg])
            starts = [t for t in range((K - m) % K, min(n), K) if t + K - 1 <= min(n)]
            if K > 1 and starts and not alone and rng.random() < 0.3:  # every rank saves, at its own micro-step
                t0 = rng.choice(starts)
                for r in range(W):
                    events.append([t0 + rng.randint(1, K - 1), "state_dict", r])
            events.sort(key=lambda ev: ev[0])
            m = 0 if end == "flush" else (m + n[0]) % K  # (acc_zero_grad keeps the position)
        epochs.append({"end": end, "micros": micros, "events": events})
    return epochs, m


def _try_generate(rng, seed):
    W = rng.choice([2, 2, 3])
    K = rng.randint(1, 4)
    red = rng.choice(["mean", "sum", "items"])
    sched = {"seed": seed, "world": W, "steps": K, "reduction": red,
             "nonfinite": rng.choice(["skip", "skip_micro_batch"]),
             "net": rng.choice(["linear", "mlp"]), "momentum": rng.choice([0.0, 0.9]),
             "buckets": rng.choice(["one", "many"]), "as_view": rng.random() < 0.3,
             "max_grad_norm": rng.choice([None, None, 0.5, 3.0]), "epochs": []}
    if rng.random() < RESIZE_P:  # a restart on another number of ranks
        if rng.random() < 0.25:
            W = sched["world"] = 1
        sched["epochs"], m = _epochs(rng, sched, W, K, 0, alone=W == 1)
        if K > 1 and rng.random() < 0.75:  # mostly saved in the middle of a window
            n = rng.randint(1, 2 * K)
            n += (m + n) % K == 0
            sched["epochs"].append({"end": "none", "micros": [list(x) for x in [_specs(rng, n, red, 0.0)] * W], "events": []})
            m = (m + n) % K
        W2 = rng.choice([w for w in (1, 2, 3) if w != W])
        K2 = K if m else rng.randint(1, 4)  # steps may change at a boundary only
        sched["resize"] = {"world": W2, "steps": K2}
        sched["resize"]["epochs"] = _epochs(rng, sched, W2, K2, m, alone=W2 == 1)[0]
        return _precision(rng, sched)
    sched["epochs"] = _epochs(rng, sched, W, K, 0)[0]
    if rng.random() < 0.05:  # drawn last: the other draws stay as they were
        sched["launch"] = "no_group"
    if rng.random() < WIRE_P:  # (after those: the same)
        sched["wire"] = "float16"
    return _precision(rng, sched)


def _precision(rng, sched):
    """Drawn after everything else (a seed's other draws stay as they were):
    a bf16 wire for some fp16 ones, error feedback, float64 sums."""
    if sched.get("wire"):
        if rng.random() < BF16_P:
            sched["wire"] = "bfloat16"
        if rng.random() < FEEDBACK_P:
            sched["error_feedback"] = True
    if rng.random() < WIDE_P and not sched["as_view"]:  # (they exclude each other)
        sched["wide"] = True
    if sched["nonfinite"] == "skip" and rng.random() < RAISE_P:
        sched["nonfinite"] = "raise"
    if rng.random() < METRICS_P:
        sched["metrics"] = True
    if not sched.get("wire") and "resize" not in sched and rng.random() < SCALER_P \
            and all(ep["end"] != "manual" for ep in sched["epochs"]):
        sched["scaler"] = True
    return sched


def generate(seed):
    """A valid random schedule, a function of `seed` alone."""
    rng = random.Random(seed)
    for _ in range(100):
        sched = _try_generate(rng, seed)
        try:
            expect(sched)
            return sched
        except InvalidSchedule:
            continue
    raise RuntimeError(f"no valid schedule from seed {seed}")


def size(sched):
    eps = sched["epochs"] + sched.get("resize", {}).get("epochs", [])
    return (sum(len(x) for ep in eps for x in ep["micros"]) + 4 * sum(len(ep["events"]) for ep in eps)
            + 6 * len(eps) + 3 * sched["world"] + sched["steps"]
            + sum(s != "ok" for ep in eps for x in ep["micros"] for s in x)
            + (sched["net"] == "mlp") + (sched["momentum"] != 0)
            + (sched.get("buckets") == "many") + bool(sched.get("as_view"))
            + (sched.get("max_grad_norm") is not None) + bool(sched.get("wire"))
            + bool(sched.get("error_feedback")) + bool(sched.get("wide")) + bool(sched.get("scaler"))
            + bool(sched.get("metrics")))


def _copy(sched):
    import copy
    return copy.deepcopy(sched)


def shrink_candidates(sched):
    """Smaller schedules than `sched` that the model still covers, smallest first."""
    cands = []
    if sched.get("launch"):  # a launch with its group
        c = _copy(sched)
        del c["launch"]
        cands.append(c)
    if sched.get("resize"):  # no restart, or fewer epochs or events after it
        c = _copy(sched)
        del c["resize"]
        cands.append(c)
        for e, ep in enumerate(sched["resize"]["epochs"]):
            c = _copy(sched)
            del c["resize"]["epochs"][e]
            cands.append(c)
            for j in range(len(ep["events"])):
                c = _copy(sched)
                del c["resize"]["epochs"][e]["events"][j]
                cands.append(c)
    eps = sched["epochs"]
    for e in range(len(eps)):  # drop an epoch
        if len(eps) > 1:
            c = _copy(sched)
            del c["epochs"][e]
            cands.append(c)
    for e, ep in enumerate(eps):
        for j in range(len(ep["events"])):  # drop an event
            c = _copy(sched)
            del c["epochs"][e]["events"][j]
            cands.append(c)
        for j in range(len(ep.get("closes", [[]])[0])):  # drop a manual window on every rank
            c = _copy(sched)
            cep = c["epochs"][e]
            for r, cl in enumerate(cep["closes"]):
                first = cl[j - 1] + 1 if j else 0
                cut = cl[j] + 1 - first
                del cep["micros"][r][first:cl[j] + 1]
                cep["closes"][r] = cl[:j] + [t - cut for t in cl[j + 1:]]
            cands.append(c)
        n = [len(x) for x in ep["micros"]]
        if min(n) >= sched["steps"]:  # drop the epoch's first window on every rank
            K = sched["steps"]
            c = _copy(sched)
            cep = c["epochs"][e]
            cep["micros"] = [x[K:] for x in cep["micros"]]
            cep["events"] = [[t - K, k, a] for t, k, a in cep["events"] if t >= K]
            cands.append(c)
        for r in range(len(n)):  # one micro-batch less on one rank (its last)
            if n[r] > 0:
                c = _copy(sched)
                cep = c["epochs"][e]
                cep["micros"][r] = cep["micros"][r][:-1]
                if cep["end"] == "none":
                    cep["micros"] = [x[:n[r] - 1] for x in cep["micros"]]
                lock = min(len(x) for x in cep["micros"])
                cep["events"] = [ev for ev in cep["events"] if ev[0] <= lock]
                cands.append(c)
        for r, specs in enumerate(ep["micros"]):  # a bad micro-batch made good
            for t, s in enumerate(specs):
                if s != "ok":
                    c = _copy(sched)
                    c["epochs"][e]["micros"][r][t] = "ok"
                    cands.append(c)
    if sched["world"] == 3:  # two ranks
        c = _copy(sched)
        c["world"] = 2
        for ep in c["epochs"]:
            ep["micros"] = ep["micros"][:2]
            if "closes" in ep:
                ep["closes"] = ep["closes"][:2]
            ep["events"] = [ev for ev in ep["events"] if ev[2] != 2]
        cands.append(c)
    for key, small in (("net", "linear"), ("momentum", 0.0), ("buckets", "one"), ("as_view", False),
                       ("max_grad_norm", None), ("wire", None), ("error_feedback", None), ("wide", None), ("scaler", None),
                       ("metrics", None)):
        if sched.get(key, small) != small:
            c = _copy(sched)
            c[key] = small
            if key == "wire":
                c.pop("error_feedback", None)
            cands.append({k: v for k, v in c.items() if v is not None})
    if sched["steps"] > 1 and all(ep["end"] != "join" for ep in eps):
        c = _copy(sched)
        c["steps"] -= 1
        cands.append(c)
    valid = []
    for c in cands:
        try:
            expect(c)
        except InvalidSchedule:
            continue
        valid.append(c)
    valid.sort(key=size)
    return valid


def regression_test(sched, problems, name=None):
    """A ready-to-paste pytest regression test for test_fuzz.py."""
    import json
    name = name or f"test_fuzz_seed_{sched['seed']}"
    text = json.dumps(sched, separators=(",", ":"))
    first = problems[0].replace('"', "'")[:160] if problems else "fails"
    return (f'@pytest.mark.xfail(strict=True, reason="{first}")\n'
            f"def {name}(tmp_path):\n"
            f"    sched = json.loads({text!r})\n"
            f"    assert_schedules_pass([sched], tmp_path)\n")
