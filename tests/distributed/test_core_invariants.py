"""Invariants the rest of the suite takes for granted, checked where they are cheap to break.

- Every pruning draw is a pure function of (seed, step, sample id): ranks of one run plan the
  same pairs identically, whichever rank they are (a rank-dependent draw would give TP/PP peers
  different shapes and DP ranks a different objective than the single-rank run).
- The trainer's reference model is a frozen copy of the starting policy, not the policy itself:
  after the policy's first update the log-ratios (the rewards) move away from 0.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

SEED = 77
STEPS = range(3)
PRUNE_ALL = dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True, branch_chosen_prob=0.3)


def _plans() -> list[tuple]:
    """What each pair executes at a few steps, as plain values (through ``plan_pair``)."""
    from megatron_prune.config import PruneConfig
    from megatron_prune.data.preference import PreferencePair
    from megatron_prune.dpo.batch import plan_pair

    prune = PruneConfig(**PRUNE_ALL)
    out = []
    for step in STEPS:
        for sample_id in range(8):
            pair = PreferencePair(prompt_ids=[1, 2, 3], chosen_ids=list(range(10, 30 + sample_id)),
                                  rejected_ids=list(range(40, 52 + 2 * sample_id)), source="synthetic", line=sample_id)
            plan = plan_pair(pair, sample_id=sample_id, step=step, seed=SEED, prune=prune)
            out.append((step, sample_id, plan.full_lengths, tuple(len(r) for r in plan.responses),
                        tuple(tuple(s.tolist()) for s in plan.scored), plan.kept_branch))
    return out


def test_pruning_draws_are_the_same_on_every_rank():
    """Two ranks plan the same pairs exactly as a process without torch.distributed does."""
    single = _plans()
    # The draws are real: some responses are cut short, and the kept branch varies.
    assert any(kept < full for p in single for kept, full in zip(p[3], p[2]))
    assert {p[5] for p in single} == {0, 1}
    ranks = run_distributed(_plans, 2)
    assert ranks[0] == single, "rank 0 plans differ from the single-process plans"
    assert ranks[1] == single, "rank 1 plans differ from rank 0's: a pruning draw depends on the rank"


def _train_two_steps(metrics: str) -> list[dict]:
    from megatron_prune.data import HH_RLHF_SAMPLE
    from megatron_prune.dpo.__main__ import main

    argv = ["--model-preset", "tiny", "--device", "cpu", "--data-path", HH_RLHF_SAMPLE, "--seq-length", "128",
            "--max-prompt-length", "64", "--global-batch-size", "4", "--micro-batch-size", "2",
            "--train-iters", "2", "--lr", "1e-2", "--seed", str(SEED), "--metrics-jsonl", metrics]
    assert main(argv) == 0
    with open(metrics, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_reference_stays_the_starting_policy_while_the_policy_trains():
    """Through the DPO trainer: at step 0 policy and reference are the same weights (rewards 0);
    after one update of the policy the rewards are not 0, so the reference did not move with it."""
    with tempfile.TemporaryDirectory() as tmp:
        records = run_distributed(_train_two_steps, 1, metrics=os.path.join(tmp, "metrics.jsonl"))[0]
    assert [r["step"] for r in records] == [0, 1]
    first, second = records
    assert abs(first["chosen_reward"]) < 1e-6 and abs(first["rejected_reward"]) < 1e-6
    assert abs(second["chosen_reward"]) > 1e-4 and abs(second["rejected_reward"]) > 1e-4, (
        f"rewards after one policy update are {second['chosen_reward']}, {second['rejected_reward']}: "
        "the reference moves with the policy"
    )


def _reduce_two_microbatches() -> float:
    import torch

    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics

    with model_parallel(ParallelConfig()):
        out = reduce_metrics([{"m": torch.tensor([1.0, 1.0], dtype=torch.float64)},
                              {"m": torch.tensor([0.0, 99.0], dtype=torch.float64)}])
    return out["m"]


def test_reduce_metrics_pools_sum_and_count():
    """A ``[sum, count]`` metric (GRPO's per-token clip fraction, ratio, KL) is pooled over the
    microbatches, not averaged per microbatch: sums 1 and 0 over 1 and 99 tokens give 1/100."""
    from tests.dist import run_distributed

    assert run_distributed(_reduce_two_microbatches, 1)[0] == 1.0 / 100


def _flags_checked(lr_by_rank: list[float]) -> str | None:
    import torch.distributed as dist

    from megatron_prune.config import TrainConfig
    from megatron_prune.training.session import UsageError, check_same_flags

    try:
        check_same_flags({"TrainConfig": TrainConfig(lr=lr_by_rank[dist.get_rank()])})
    except UsageError as exc:
        return str(exc)
    return None


def test_ranks_launched_with_other_flags_stop_with_one_message():
    """Nodes started with different commands: every rank names the flag and the rank (before,
    other layouts waited in the first collective until the timeout; other values trained silently)."""
    assert run_distributed(_flags_checked, world_size=2, lr_by_rank=[1e-5, 1e-5]) == [None, None]
    message = ("rank 1 was launched with other flags than rank 0: --lr 0.0001 (rank 0: 1e-05); launch every node "
               "with the same command")
    assert run_distributed(_flags_checked, world_size=2, lr_by_rank=[1e-5, 1e-4]) == [message, message]


def _largest(values: list[int]) -> int:
    import torch.distributed as dist

    from megatron_prune.training.parallel import largest_over_ranks

    return largest_over_ranks(values[dist.get_rank()])


def test_peak_memory_is_the_largest_over_ranks():
    """``peak_mem_bytes`` is the rank that peaked highest (a later pipeline stage or another expert-parallel
    rank may peak above the logging rank): every rank gets the largest of the ranks' values."""
    assert run_distributed(_largest, world_size=2, values=[7, 3]) == [7, 7]
    assert run_distributed(_largest, world_size=2, values=[3, 2**40]) == [2**40, 2**40]
