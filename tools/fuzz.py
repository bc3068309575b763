#!/usr/bin/env python3
"""`make fuzz`: the model-based protocol fuzzer's long run.

Random schedules (world size 2 or 3, `steps` 1..4, the three reductions,
flush/join/no epoch end, NaN and no-item micro-batches, failing backwards,
`optimizer.zero_grad()` and `acc.zero_grad()` mid-window, mid-window
checkpoints, `refresh_parameters()` after freezing or unfreezing layers, the
manual `no_sync` path, restarts on another number of ranks) run on real Gloo
ranks and are held against the reference model in tests/python/_fuzz_model.py.
Each failing seed is shrunk to a smaller schedule that still fails and printed
as a ready-to-paste pytest regression test (for tests/python/test_fuzz.py).

Environment:
  FUZZ_SECONDS  the budget in seconds (default 1800)
  FUZZ_SEEDS    comma-separated seeds to replay instead of random ones
  FUZZ_SHRINK   seconds of shrinking per failure (default 300; 0: none)
  FUZZ_BATCH    schedules per launch (default 40)
"""
import collections
import os
import random
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "python"))

import _fuzz_jobs as fj  # noqa: E402
import _fuzz_gen as fg  # noqa: E402
import _fuzz_model as fm  # noqa: E402


def main():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    budget = float(os.environ.get("FUZZ_SECONDS", "1800"))
    shrink_s = float(os.environ.get("FUZZ_SHRINK", "300"))
    batch = int(os.environ.get("FUZZ_BATCH", "40"))
    replay = [int(s) for s in os.environ.get("FUZZ_SEEDS", "").split(",") if s.strip()]
    rng = random.SystemRandom()
    start = time.monotonic()
    ran, failures, seen = 0, [], collections.Counter()
    tmp = tempfile.mkdtemp(prefix="gradaccum-fuzz-")
    print(f"gradaccum fuzz: budget {budget:.0f} s, launches under {tmp}", flush=True)
    while time.monotonic() - start < budget:
        if replay:
            seeds, replay = replay[:batch], replay[batch:]
        elif os.environ.get("FUZZ_SEEDS"):
            break
        else:
            seeds = [rng.randrange(2 ** 31) for _ in range(batch)]
        scheds = [fg.generate(s) for s in seeds]
        for s in scheds:
            seen.update(fm.expect(s).seen)
        verdicts = fj.verdicts(scheds, tmp, batch=batch)
        ran += len(scheds)
        for sched, problems in zip(scheds, verdicts):
            if not problems:
                continue
            print(f"\nFAIL seed {sched['seed']} (size {fg.size(sched)}):", flush=True)
            for p in problems[:10]:
                print(f"  {p}")
            small, small_p = sched, problems
            left = budget - (time.monotonic() - start)
            if shrink_s > 0 and left > 30:
                small, small_p = fj.shrink(sched, problems, tmp, budget_s=min(shrink_s, left),
                                           log=lambda m: print(m, flush=True))
                print(f"smallest failing schedule (size {fg.size(small)}):")
                for p in small_p[:10]:
                    print(f"  {p}")
            print("\n# ready-to-paste regression test (tests/python/test_fuzz.py):")
            print(fg.regression_test(small, small_p), flush=True)
            failures.append(sched["seed"])
        elapsed = time.monotonic() - start
        print(f"[{elapsed:6.0f} s] {ran} schedules, {len(failures)} failing", flush=True)
    print(f"\n{ran} schedules in {time.monotonic() - start:.0f} s; what they exercised:")
    for tag, n in sorted(seen.items()):
        print(f"  {n:6d}  {tag}")
    if failures:
        print(f"failing seeds (FUZZ_SEEDS={','.join(map(str, failures))} replays them)")
        return 1
    print("no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
