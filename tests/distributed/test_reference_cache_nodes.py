"""The precomputed reference table on several nodes without a shared filesystem: each rank sees its
own cache directory (here one per rank). A table that only some ranks find must be computed again by
all of them (the computation is collective: ranks that took different branches waited on each other
until the collective timeout), and the first rank of every node stores it for that node."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist import run_distributed


class _Pairs:
    def __init__(self, n: int):
        from megatron_prune.data.preference import PreferencePair

        self.pairs = [PreferencePair(prompt_ids=[1, 2], chosen_ids=[3] * (1 + i % 3), rejected_ids=[4] * (2 + i % 2),
                                     source="pairs.jsonl", line=i + 1) for i in range(n)]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        return self.pairs[index]


class _Reference:
    """Stands in for the adapter-off runner: log-prob ``-(index + 1)`` for every token of a pair."""

    def __init__(self):
        self.passes = 0

    def plan(self, step, pairs):
        return pairs

    def reference_logps(self, pairs):
        from megatron_prune.dpo.batch import CHOSEN, REJECTED

        self.passes += 1
        return {(i, b): torch.full((len(ids),), -(i + 1.0)) for i, pair in pairs
                for b, ids in ((CHOSEN, pair.chosen_ids), (REJECTED, pair.rejected_ids))}


def node_local_cache(root: str) -> dict:
    import torch.distributed as dist

    from megatron_prune.dpo.trainer import precompute_reference
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel

    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = "0"  # one rank per "node"
    cache = os.path.join(root, f"node{rank}")
    with model_parallel(ParallelConfig(), seed=1):
        data, out = _Pairs(5), {}
        for launch in ("first", "second", "third"):
            if launch == "second" and rank == 1:  # node 0 kept the first launch's table; node 1 is a fresh machine
                for name in os.listdir(cache):
                    os.remove(os.path.join(cache, name))
            runner = _Reference()
            table = precompute_reference(runner_off=runner, dataset=data, cache_dir=cache, fingerprint="k", batch=1)
            out[launch] = dict(passes=runner.passes, pairs=len(table) // 2, files=sorted(os.listdir(cache)))
    return out


@pytest.mark.distributed
def test_a_table_on_one_node_only_is_computed_again_by_every_rank(tmp_path):
    ranks = run_distributed(node_local_cache, 2, root=str(tmp_path))
    for rank, got in enumerate(ranks):
        assert got["first"]["passes"] > 0 and got["first"]["files"], (rank, got["first"])  # every node stores it
        second, third = got["second"], got["third"]
        assert second["passes"] > 0 and second["pairs"] == 5, (rank, second)  # computed again, by both ranks
        assert third["passes"] == 0 and third["pairs"] == 5, (rank, third)  # then each node reuses its own
        assert [f for f in third["files"] if f.endswith(".tmp")] == [], third


def unreadable_copy_on_one_node(root: str) -> str:
    import torch.distributed as dist

    from megatron_prune.arguments import UsageError
    from megatron_prune.dpo.trainer import precompute_reference
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel

    rank = dist.get_rank()
    os.environ["LOCAL_RANK"] = "0"
    cache = os.path.join(root, f"node{rank}")
    with model_parallel(ParallelConfig(), seed=1):
        data = _Pairs(5)
        precompute_reference(runner_off=_Reference(), dataset=data, cache_dir=cache, fingerprint="k", batch=1)
        if rank == 1:  # node 1's copy was cut short (its disk filled)
            (name,) = os.listdir(cache)
            with open(os.path.join(cache, name), "r+b") as f:
                f.truncate(20)
        try:
            precompute_reference(runner_off=_Reference(), dataset=data, cache_dir=cache, fingerprint="k", batch=1)
        except UsageError as exc:
            return str(exc)
    return "went on"


@pytest.mark.distributed
def test_an_unusable_copy_on_one_node_stops_every_rank_at_once(tmp_path):
    """Rank 1 refused its truncated copy while rank 0 went on into training and waited for it until
    the collective timeout; now both stop, each saying whose copy it is."""
    ranks = run_distributed(unreadable_copy_on_one_node, 2, root=str(tmp_path))
    assert "another rank's copy of it cannot be used" in ranks[0], ranks[0]
    assert f"{tmp_path}/node1/" in ranks[1] and "cannot be read" in ranks[1], ranks[1]
