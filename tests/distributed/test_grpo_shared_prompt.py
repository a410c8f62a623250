"""GRPO ``--shared-prompt`` is exact: the same step as without it, on fewer tokens.

One GRPO step through the trainer's objective (rollout, DPPO keep draws, old-policy and
reference scoring, the update) with each prompt's kept completions laid out as
``[prompt, c1, ..., ck]`` must give the sampled completions, loss, policy loss, KL and every
gradient of the same step without sharing — with DPPO completion pruning and the KL term, padded
rows and dense packing (several groups per row), at one rank and at DP=2, TP=2 and PP=2 — while the
training pass runs fewer tokens.
"""

from __future__ import annotations

import functools

import pytest

from tests.dist import every_rank, run_distributed
from tests.distributed.test_grpo import assert_same, grpo_step

pytestmark = pytest.mark.distributed

PRUNED_KL = dict(dppo=dict(completion_prune_rate=0.5), kl_beta=0.1)


def _case(*, packed: bool, shared: bool) -> dict:
    return dict(dppo=dict(PRUNED_KL["dppo"], dense_packing=packed, shared_prompt=shared), kl_beta=PRUNED_KL["kl_beta"])


def _single_rank() -> dict:
    return {(packed, shared): grpo_step(**_case(packed=packed, shared=shared))
            for packed in (False, True) for shared in (False, True)}


def _two_ranks() -> dict:
    return {name: grpo_step(parallel=par, **_case(packed=True, shared=True))
            for name, par in (("dp2", dict()), ("tp2", dict(tensor_model_parallel_size=2)),
                              ("pp2", dict(pipeline_model_parallel_size=2)))}


@functools.lru_cache(maxsize=1)
def single_rank() -> dict:
    return run_distributed(_single_rank, 1)[0]


def assert_same_step(ref: dict, got: dict, label: str) -> None:
    """Same completions, loss terms, KL and gradients (relative to each tensor's scale); the
    token count differs by design."""
    assert_same(ref, got, label,
                metrics=("loss", "policy_loss", "kl_loss", "kl", "reward_mean", "kept_completion_fraction"))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_shared_prompt_equals_unshared(packed):
    runs = single_rank()
    plain, shared = runs[(packed, False)], runs[(packed, True)]
    assert plain["metrics"]["kept_completion_fraction"] < 1.0 and plain["metrics"]["kl_loss"] != 0.0
    assert_same_step(plain, shared, f"shared vs not ({'packed' if packed else 'padded'})")
    assert shared["metrics"]["train_tokens"] < plain["metrics"]["train_tokens"]


def test_shared_prompt_at_dp2_tp2_and_pp2():
    ref = single_rank()[(True, False)]
    shared_tokens = single_rank()[(True, True)]["metrics"]["train_tokens"]
    for rank, name, result in every_rank(run_distributed(_two_ranks, 2)):
        assert_same_step(ref, result, f"rank {rank}: {name}")
        # Data-parallel ranks take whole groups: the prompts are not copied more often than on one rank.
        assert result["metrics"]["train_tokens"] == shared_tokens, name
