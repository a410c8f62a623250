"""The metrics a GRPO rollout logs."""

from __future__ import annotations

import torch

from megatron_prune.grpo.trainer import rollout_metrics


def test_fractions_log_as_the_fractions_they_are():
    """Float32 rewards averaged in float32 logged 0.05 as 0.05000000074505806 and 4/5 as
    0.800000011920929; the logged means are the exact fractions."""
    rewards = torch.zeros(5, 4)  # 5 groups of 4, float32 as the reward functions return them
    rewards[0, 0] = 1.0  # one mixed group: 4 of 5 groups have equal rewards
    completions = {k: [[7] * (k + 1)] * 4 for k in range(5)}
    got = rollout_metrics(group_size=4, rewards=rewards, num_prompts=8, kept_prompts=5,
                          minibatches=[[None] * 3, [None] * 2], completions=completions)
    assert got["reward_mean"] == 0.05 and got["accuracy"] == 0.05
    assert got["zero_variance_groups"] == 0.8
    assert got["kept_prompt_fraction"] == 5 / 8 and got["kept_completion_fraction"] == 5 / 20
    assert got["completion_length"] == 3.0 and got["rollout_tokens"] == 60.0


def test_an_empty_rollout_logs_zeros():
    got = rollout_metrics(group_size=4, rewards=torch.zeros(0, 4), num_prompts=8, kept_prompts=0,
                          minibatches=[], completions={})
    assert got == {"reward_mean": 0.0, "accuracy": 0.0, "kept_prompt_fraction": 0.0, "kept_completion_fraction": 0.0,
                   "zero_variance_groups": 0.0, "completion_length": 0.0, "clipped_completions": 0.0,
                   "rollout_tokens": 0.0}


def test_a_completion_without_an_ending_token_is_clipped():
    """A completion is clipped where it ends in none of ``ends`` (eos or another stop id): cut by
    --max-new-tokens. An empty one (a zero budget) is clipped too."""
    completions = {0: [[5, 2], [5, 5], [9, 1]], 1: [[5, 5], [], [2]]}
    got = rollout_metrics(group_size=3, rewards=torch.zeros(2, 3), num_prompts=2, kept_prompts=2,
                          minibatches=[], completions=completions, ends=frozenset({1, 2}))
    assert got["clipped_completions"] == 3 / 6
