"""Group-relative advantages."""

from __future__ import annotations

import pytest
import torch

from megatron_prune.grpo.advantages import AdvantageConfig, group_advantages, zero_variance_groups


def test_centred_and_std_normalised():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    plain = group_advantages(rewards, config=AdvantageConfig(normalize_std=False))
    torch.testing.assert_close(plain, rewards - rewards.mean(dim=1, keepdim=True))
    normalised = group_advantages(rewards, config=AdvantageConfig(eps=1e-12))
    torch.testing.assert_close(normalised[0], torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64))
    assert torch.all(normalised[1] == 0)
    torch.testing.assert_close(normalised.mean(dim=1), torch.zeros(3, dtype=torch.float64))
    sample = group_advantages(rewards, config=AdvantageConfig(unbiased_std=True, eps=1e-12))
    torch.testing.assert_close(sample[0], torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64) * (3 / 4) ** 0.5)


def test_zero_variance_groups():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True]


@pytest.mark.parametrize("group_size", [8, 16])
def test_equal_fractional_rewards_give_exactly_zero_advantage(group_size):
    """A group of equal rewards like 2/3 (the toy task's k/L) has a float mean a rounding residue
    away from its value; that residue, divided by the equally small std, must not become a shared
    advantage of ~0.06 that pushes the whole group one way and escapes the zero-advantage skip."""
    from megatron_prune.grpo.dppo import DPPOConfig, prune_completions

    values = sorted({k / n for n in range(1, 17) for k in range(n + 1)})
    rewards = torch.tensor(values, dtype=torch.float32)[:, None].expand(-1, group_size).contiguous()
    assert (rewards.mean(dim=1) != rewards[:, 0]).any(), "no residue: the case this test is about is not drawn"
    for config in (AdvantageConfig(), AdvantageConfig(unbiased_std=True, eps=1e-4),
                   AdvantageConfig(normalize_std=False)):
        assert torch.all(group_advantages(rewards, config=config) == 0), config
    decision = prune_completions(advantages=group_advantages(rewards), prompt_ids=list(range(len(values))),
                                 config=DPPOConfig(skip_zero_advantage=True), seed=0, step=0)
    assert int(decision.keep.sum()) == 0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_prompts"):
        group_advantages(torch.zeros(4))
    with pytest.raises(ValueError, match="floating"):
        group_advantages(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(2, 1), config=AdvantageConfig(unbiased_std=True))
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=0.0)
