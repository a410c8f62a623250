"""DPO microbatch grouping: pairs of similar row length share a microbatch, sizes stay equal."""

from __future__ import annotations

import random

import pytest

from megatron_prune.config import DPOConfig, PruneConfig
from megatron_prune.data.preference import PreferencePair
from megatron_prune.dpo.batch import CHOSEN, REJECTED, build_microbatch, round_up, row_length
from megatron_prune.dpo.step import DPOStep, DPOStepSettings

OFF = PruneConfig(position_ratio=1.0, seq_min_ratio=1.0, branch=False)


def step_for(layout: str, mbs: int, prune: PruneConfig = OFF) -> DPOStep:
    runner = object.__new__(DPOStep)  # grouping needs no model or process groups
    runner.s = DPOStepSettings(dpo=DPOConfig(layout=layout), prune=prune, seed=3, micro_batch_size=mbs, pad_id=0)
    return runner


def pairs(n: int, seed: int = 0) -> list[tuple[int, PreferencePair]]:
    rng = random.Random(seed)
    return [(i, PreferencePair([1] * rng.randint(5, 60), [2] * rng.randint(1, 40), [3] * rng.randint(1, 40),
                               "mem", i)) for i in range(n)]


def padded_tokens(groups, layout, branches_of) -> int:
    total = 0
    for g in groups:
        branches = [branches_of(p) for p in g]
        batch = build_microbatch(g, branches=branches, layout=layout, pad_id=0,
                                 seq_length=round_up(row_length(g, layout=layout, branches=branches), 8))
        total += batch.tokens.numel()
    return total


@pytest.mark.parametrize("layout", ["concat", "full"])
def test_groups_are_length_sorted_equal_sized_and_pad_less(layout):
    runner = step_for(layout, mbs=2)
    plans = runner.plan(0, pairs(12))
    both = lambda p: [CHOSEN, REJECTED]  # noqa: E731
    groups = runner._groups(plans, both)
    assert [len(g) for g in groups] == [2] * 6
    assert sorted(p.sample_id for g in groups for p in g) == list(range(12))  # every pair exactly once
    lengths = [row_length([p], layout=layout, branches=[both(p)]) for g in groups for p in g]
    assert lengths == sorted(lengths, reverse=True)
    in_order = [plans[i : i + 2] for i in range(0, 12, 2)]
    assert padded_tokens(groups, layout, both) < padded_tokens(in_order, layout, both)


def test_each_pass_groups_by_its_own_rows():
    """Under branch pruning the kept and the pruned branch make different rows, hence groups."""
    runner = step_for("concat", mbs=2, prune=PruneConfig(position_ratio=1.0, seq_min_ratio=1.0, branch=True))
    plans = runner.plan(0, pairs(8, seed=1))
    kept = runner._groups(plans, lambda p: [p.kept_branch])
    pruned = runner._groups(plans, lambda p: [1 - p.kept_branch])
    for groups, branch_of in ((kept, lambda p: p.kept_branch), (pruned, lambda p: 1 - p.kept_branch)):
        lengths = [len(p.prompt) + len(p.responses[branch_of(p)]) for g in groups for p in g]
        assert lengths == sorted(lengths, reverse=True)
    assert [p.sample_id for g in kept for p in g] != [p.sample_id for g in pruned for p in g]


def test_last_group_holds_the_remainder():
    runner = step_for("concat", mbs=4)
    groups = runner._groups(runner.plan(0, pairs(10)), lambda p: [CHOSEN, REJECTED])
    assert [len(g) for g in groups] == [4, 4, 2]
