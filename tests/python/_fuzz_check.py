"""The fuzzer's checker: what the ranks observed (the driver's results,
_fuzz_jobs.py) held against the reference model's prediction (_fuzz_model.py),
as a list of problems, one string each; [] when all agree."""
import _fuzz_model as fm


def _close(a, b, tol):
    return abs(a - b) <= tol * max(1.0, abs(b))


FP16_TOL = 5e-4  # (the worst seen: 9.5e-5, 29 schedules of seeds 0-159)
# (the worst seen: 1.7e-3, 46 schedules of seeds 0-1199). Coarse: a micro-batch
# counted twice in a window of 12 moves parameters by about 2e-3 (review), so
# a bf16 wire's arithmetic catches gross errors only; its protocol (returns,
# errors, counts) is judged as any schedule's.
BF16_TOL = 6e-3
WIDE_TOL = 2e-6  # float32 parameters and arithmetic (the worst seen: 1.1e-7, 49 schedules)


def tolerance(sched):
    """Relative error allowed on parameters and window losses: float64
    arithmetic in another order, float32 parameters ("wide"), or a wire's
    rounding of each window."""
    wire = {"float16": FP16_TOL, "bfloat16": BF16_TOL}.get(sched.get("wire"), 0.0)
    return max(wire, WIDE_TOL if sched.get("wide") else 0.0, 1e-12)


def check(sched, results, tol=None):
    """Problems (strings) between the ranks' results and the model; [] when all agree."""
    model = fm.expect(sched)
    tol = tolerance(sched) if tol is None else tol
    problems = []
    for r, res in enumerate(results):
        if res is None:
            problems.append(f"rank {r}: no result")
            continue
        if res.get("crash"):
            problems.append(f"rank {r}: unexpected exception escaped the driver: {res['crash']}")
            continue
        got, exp = res["obs"], model.exp[r]
        for key in sorted(set(got) | set(exp), key=_order):
            g, x = got.get(key), exp.get(key)
            if x is None:
                problems.append(f"rank {r} {key}: not expected, got {_show(g)}")
            elif g is None:
                problems.append(f"rank {r} {key}: expected {_show(x)}, the rank never got there")
            elif x[0] == "err":
                _, all_of, any_of, prefixed = x
                if g[0] != "err":
                    problems.append(f"rank {r} {key}: expected an error with {all_of} "
                                    f"and one of {any_of}, got {_show(g)}")
                    continue
                _, mro, text = g
                bad = [w for w in all_of if w not in text]
                if any_of and not any(w in text for w in any_of):
                    bad.append(f"one of {any_of}")
                if "RuntimeError" not in mro:
                    bad.append(f"class RuntimeError (got {mro[0]})")
                if prefixed and not text.startswith("gradaccum: "):
                    bad.append("the 'gradaccum: ' prefix")
                if bad:
                    problems.append(f"rank {r} {key}: error lacks {bad}: {text[:300]}")
            else:
                if g[0] != "ok":
                    problems.append(f"rank {r} {key}: expected {_show(x)}, got {_show(g)}")
                elif g[1] != x[1]:
                    problems.append(f"rank {r} {key}: returned {g[1]!r}, expected {x[1]!r}")
                elif x[1] is True and len(x) > 2:
                    wl, want = g[2], x[2]
                    if want is None and wl is not None:
                        problems.append(f"rank {r} {key}: window_loss {wl!r}, expected None "
                                        "(a bf16/fp16 wire)")
                    elif want is not None and (wl is None or not _close(wl, want, tol)):
                        problems.append(f"rank {r} {key}: window_loss {wl!r}, expected {want!r}")
                    if len(x) > 3 and len(g) > 3 and not _close(g[3], x[3], 1e-12):
                        problems.append(f"rank {r} {key}: window_items {g[3]!r}, expected {x[3]!r}")
                    # (small integers: exact, but where a resumed window's sums were split in shares)
                    got_m, want_m = (g[4], x[4]) if len(x) > 4 and len(g) > 4 else (None, None)
                    if (got_m is None) != (want_m is None) or (want_m is not None and not _close(got_m, want_m, tol)):
                        problems.append(f"rank {r} {key}: window_metrics['m'] {got_m!r}, expected {want_m!r}")
        for e, (got_p, want_p) in enumerate(zip(res["trace"], model.trace)):
            worst = max(((a - b).abs().max().item() / max(1.0, b.abs().max().item())
                         for a, b in zip(got_p, want_p)), default=0.0)
            if not worst <= tol:
                problems.append(f"rank {r}: parameters after epoch {e} differ by {worst:.3g} (relative)")
                break
        if len(res["trace"]) != len(model.trace):
            problems.append(f"rank {r}: {len(res['trace'])} epochs ran, expected {len(model.trace)}")
        if res["micro_step"] != model.m or res["window_ready"]:
            problems.append(f"rank {r}: ends at micro_step {res['micro_step']} (window_ready "
                            f"{res['window_ready']}), expected {model.m}")
        if res["optimizer_steps"] != model.optimizer_steps:
            problems.append(f"rank {r}: stats()['optimizer_steps'] {res['optimizer_steps']}, "
                            f"expected {model.optimizer_steps}")
        if res.get("skipped_steps", model.skipped_steps) != model.skipped_steps:
            problems.append(f"rank {r}: stats()['skipped_steps'] {res['skipped_steps']}, "
                            f"expected {model.skipped_steps}")
        if res.get("dropped_windows", model.dropped) != model.dropped:
            problems.append(f"rank {r}: stats()['dropped_windows'] {res['dropped_windows']}, "
                            f"expected {model.dropped}")
        if res.get("loss_scale", model.scale) != model.scale:
            problems.append(f"rank {r}: stats()['loss_scale'] {res['loss_scale']}, expected {model.scale}")
        left_out = len(model.left_out[r])
        if res.get("skipped_micro_batches", left_out) != left_out:
            problems.append(f"rank {r}: stats()['skipped_micro_batches'] {res['skipped_micro_batches']}, "
                            f"expected {left_out}")
    return problems


def _order(key):
    parts = key.split("/")
    return tuple(int(p) for p in parts[1:]) + ("agzcxrblsjf".index(parts[0]),)


def _show(obs):
    if obs is None:
        return "nothing"
    if obs[0] == "err":
        if isinstance(obs[1], list) and obs[1] and isinstance(obs[1][0], str) and len(obs) == 3 \
                and isinstance(obs[2], str):
            return f"{obs[1][0]}: {obs[2][:300]}"
        return f"an error with {obs[1]}"
    return f"returned {obs[1]!r}"
