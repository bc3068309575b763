"""Accumulators over subgroups (data-parallel pairs of a 4-rank job, as in
hybrid parallelism): each pair equals one process on its own big batch;
per-rank states carry their group's global ranks (another pair's is refused);
a rank outside the group gets a clear error. Ranks in gradaccum's messages
are the group's ranks (docs/integrations.md)."""
import _dist_utils as du
import _subgroup_jobs as sj

SEED, STEPS, WINDOWS = 3, 2, 2


def test_two_pairs_train_apart_and_refuse_each_others_states(tmp_path):
    results = du.run_job("two_pairs", 4, tmp_path, module="_subgroup_jobs", timeout=180, seed=SEED, steps=STEPS,
                         windows=WINDOWS)
    for pair in (0, 1):
        model = du.mlp(SEED)
        want = du.reference_run(model, du.make_optimizer("sgd", model.parameters()),
                                sj.pair_windows(SEED, pair, WINDOWS + pair, STEPS), "mean")["params"]
        for rank in (2 * pair, 2 * pair + 1):
            for got, expected in zip(results[rank]["params"], want):
                assert (got - expected).abs().max().item() <= 1e-12, (rank, pair)
    for rank, res in enumerate(results):
        mine, other = ([0, 1], [2, 3]) if rank < 2 else ([2, 3], [0, 1])
        assert res["group_ranks"] == mine
        assert res["wrong_load"] == (
            "gradaccum: acc.load_state_dict(): this is a rank's own state (acc.state_dict(rank_independent=False)) "
            f"saved in the process group of global ranks {other}, but this Accumulator's group is global ranks "
            f"{mine}: its counters, half-done window and residuals are the other group's. Load the state this "
            "rank saved, or save with acc.state_dict() (rank-independent) to load one state on every rank; if "
            "this is the same group under other global ranks (renumbered on purpose), delete 'group_ranks' from "
            "the state")
        assert res["untouched"]
    for rank in (0, 3):
        assert results[rank]["non_member"] == (
            f"gradaccum: Accumulator(): this rank (global rank {rank}) is not a member of process_group: "
            "torch.distributed.new_group() returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out. "
            "Build the Accumulator on the group's ranks only")
