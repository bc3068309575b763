"""acc.last_window_timeline(): when each gradient arrived and each bucket
filled, launched and completed in the last reduction (Note [The window's
timeline]), on 2 Gloo ranks."""
import gradaccum
import torch

import _dist_utils as du

M = "_timeline_jobs"


def test_the_timeline_of_a_window_is_ordered_and_complete(tmp_path):
    for res in du.run_job("timeline", 2, tmp_path, module=M, steps=3):
        assert res["empty"] == {"gradients": [], "buckets": [], "backward_end": -1.0, "finished": -1.0}
        t = res["window"]
        end = t["backward_end"]
        assert 0 < end <= t["finished"]
        # Every gradient came through its hook, during backward.
        assert len(t["gradients"]) == len(res["sizes"])
        assert all(0 <= g <= end for g in t["gradients"]), t["gradients"]
        # Backward runs the last layer first: its gradients are ready first.
        assert t["gradients"][-1] < t["gradients"][0]
        buckets = t["buckets"]
        assert len(buckets) == res["stats"]["buckets"] >= 2
        assert sum(b["bytes"] for b in buckets) == res["stats"]["last_window_bytes"]
        for b in buckets:
            assert 0 <= b["ready"] <= b["launched"] <= b["completed"] <= t["finished"], b
        # Launched in index order; all but the last during backward, which
        # launches at its end (Note [The last bucket closes the window]).
        launched = [b["launched"] for b in buckets]
        assert launched == sorted(launched)
        assert launched[0] < end <= launched[-1]
        assert res["stats"]["last_window_launched_in_backward"] >= 1
        # flush(): no hook ran, every bucket launched at once.
        f = res["flush"]
        assert all(g == -1 for g in f["gradients"])
        assert all(0 <= b["ready"] == b["launched"] <= b["completed"] for b in f["buckets"])


def test_without_a_group_the_timeline_is_empty():
    model = torch.nn.Linear(2, 1)
    acc = gradaccum.Accumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=1, process_group=False)
    acc.backward(model(torch.ones(1, 2)).sum())
    acc.step()
    assert acc.last_window_timeline() == {"gradients": [], "buckets": [], "backward_end": -1.0, "finished": -1.0}
