"""DPPO is unbiased for full-batch GRPO: checked by exact enumeration, not Monte Carlo.

Every keep pattern of prompts and completions is enumerated and weighted by its
probability. The importance-weighted gradient of each pruned batch is computed by
autograd through ``grpo_loss``, and the expectation must equal the full-batch GRPO
gradient. The KL term is on, so some per-completion terms are nonzero at zero
advantage. Independent draws enumerate Bernoulli patterns; systematic (dependent) draws
enumerate each group's uniform over the pieces of [0, 1) where the keep pattern is constant. A biased filter (DAPO-style: drop zero-variance groups, no correction) must
fail the same equality.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from megatron_prune.grpo.advantages import AdvantageConfig, group_advantages, zero_variance_groups
from megatron_prune.grpo.dppo import DPPOConfig, PromptHistory, prune_completions, prune_prompts
from megatron_prune.grpo.loss import GRPOLossConfig, grpo_loss, sequence_mean_token_weights

DTYPE = torch.float64
DIM = 5
MAX_TOKENS = 4
GROUP = 3


@dataclass
class Rollout:
    """One prompt's group: per-token features of the tiny policy, valid mask, rewards."""

    features: torch.Tensor  # [G, T, DIM]
    mask: torch.Tensor  # [G, T] bool
    rewards: torch.Tensor  # [G]


def make_rollout(*, seed: int, rewards: list[float], lengths: list[int]) -> Rollout:
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(GROUP, MAX_TOKENS, DIM, generator=generator, dtype=DTYPE)
    mask = torch.arange(MAX_TOKENS)[None, :] < torch.tensor(lengths)[:, None]
    return Rollout(features=features, mask=mask, rewards=torch.tensor(rewards, dtype=DTYPE))


def token_logprobs(theta: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """A tiny differentiable 'policy': log-prob of each sampled token, always <= 0."""
    return -torch.nn.functional.softplus(features @ theta)


THETA = torch.tensor([0.3, -0.2, 0.5, 0.1, -0.4], dtype=DTYPE)
THETA_OLD = THETA + torch.tensor([0.25, -0.3, 0.2, -0.35, 0.3], dtype=DTYPE)  # ratios far from 1: clipping happens
THETA_REF = THETA + torch.tensor([-0.5, 0.4, -0.3, 0.2, 0.1], dtype=DTYPE)
LOSS_CONFIG = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.1)


def pruned_gradient(
    *,
    rollouts: list[Rollout],
    advantages: torch.Tensor,
    rows: list[tuple[int, int]],
    weights: list[float] | None,
    normaliser: float,
    loss_config: GRPOLossConfig = LOSS_CONFIG,
    sequence_mean: bool = False,
) -> torch.Tensor:
    """Gradient of grpo_loss over the completions ``rows`` = [(prompt, j)], by autograd."""
    theta = THETA.clone().requires_grad_(True)
    if not rows:
        return torch.zeros_like(THETA)
    features = torch.stack([rollouts[i].features[j] for i, j in rows])
    mask = torch.stack([rollouts[i].mask[j] for i, j in rows])
    row_weights = torch.ones(len(rows), dtype=DTYPE) if weights is None else torch.tensor(weights, dtype=DTYPE)
    if sequence_mean:
        row_weights = row_weights[:, None] * sequence_mean_token_weights(mask)
    loss, _ = grpo_loss(
        logprobs=token_logprobs(theta, features),
        old_logprobs=token_logprobs(THETA_OLD, features),
        ref_logprobs=token_logprobs(THETA_REF, features),
        advantages=torch.stack([advantages[i, j] for i, j in rows]),
        mask=mask,
        normaliser=normaliser,
        weights=row_weights,
        config=loss_config,
    )
    loss.backward()
    return theta.grad.detach()


def all_rows(prompts: list[int]) -> list[tuple[int, int]]:
    return [(i, j) for i in prompts for j in range(GROUP)]


def bernoulli_patterns(probs: list[float]):
    """Yield (pattern, probability) for every keep pattern of independent Bernoullis."""
    for pattern in itertools.product((0, 1), repeat=len(probs)):
        probability = 1.0
        for keep, p in zip(pattern, probs):
            probability *= p if keep else 1.0 - p
        yield pattern, probability


def dppo_expected_gradient(
    *,
    rollouts: list[Rollout],
    prompt_probs: list[float],
    config: DPPOConfig,
    normaliser_fn,
    sequence_mean: bool = False,
) -> tuple[torch.Tensor, float]:
    """E over every prompt and completion keep pattern of the DPPO gradient; also the total probability."""
    advantages = group_advantages(torch.stack([r.rewards for r in rollouts]), config=AdvantageConfig())
    expected = torch.zeros_like(THETA)
    total_probability = 0.0
    for prompt_pattern, prompt_probability in bernoulli_patterns(prompt_probs):
        kept = [i for i, keep in enumerate(prompt_pattern) if keep]
        if not kept:
            total_probability += prompt_probability
            continue
        decision = prune_completions(
            advantages=advantages[kept], prompt_ids=kept, config=config, seed=0, step=0
        )  # the probabilities are what matter here; the draw itself is enumerated below
        q = decision.probs
        candidates = all_rows(kept)
        q_flat = [q[kept.index(i), j].item() for i, j in candidates]
        for completion_pattern, completion_probability in bernoulli_patterns(q_flat):
            rows = [row for row, keep in zip(candidates, completion_pattern) if keep]
            weights = [1.0 / (prompt_probs[i] * q_flat[candidates.index((i, j))]) for i, j in rows]
            gradient = pruned_gradient(
                rollouts=rollouts,
                advantages=advantages,
                rows=rows,
                weights=weights,
                normaliser=normaliser_fn(kept),
                sequence_mean=sequence_mean,
            )
            probability = prompt_probability * completion_probability
            expected += probability * gradient
            total_probability += probability
    return expected, total_probability


ROLLOUTS = [
    make_rollout(seed=1, rewards=[1.0, 1.0, 1.0], lengths=[4, 2, 3]),  # zero variance: A = 0
    make_rollout(seed=2, rewards=[1.0, 0.0, 0.0], lengths=[3, 4, 1]),
    make_rollout(seed=3, rewards=[0.5, 0.2, 0.9], lengths=[2, 4, 4]),
]
FULL_TOKENS = float(sum(r.mask.sum().item() for r in ROLLOUTS))
DPPO = DPPOConfig(prompt_prune_rate=0.4, completion_prune_rate=0.5, prompt_floor=0.2, completion_floor=0.15)


def history_prompt_probs(config: DPPOConfig) -> list[float]:
    """Prompt keep probabilities from a real history: prompt 0 was always solved, prompt 2 is new."""
    history = PromptHistory.from_config(config)
    history.update(0, torch.tensor([1.0, 1.0, 1.0]))
    history.update(1, torch.tensor([1.0, 0.0, 1.0]))
    history.update(1, torch.tensor([0.0, 0.0, 1.0]))
    history.update(2, torch.tensor([0.0, 1.0, 0.0]))
    decision = prune_prompts(prompt_ids=[0, 1, 2], history=history, config=config, seed=0, step=0)
    return decision.probs.tolist()


def full_gradient(
    rollouts: list[Rollout],
    *,
    normaliser: float,
    loss_config: GRPOLossConfig = LOSS_CONFIG,
    sequence_mean: bool = False,
) -> torch.Tensor:
    advantages = group_advantages(torch.stack([r.rewards for r in rollouts]))
    return pruned_gradient(
        rollouts=rollouts,
        advantages=advantages,
        rows=all_rows(list(range(len(rollouts)))),
        weights=None,
        normaliser=normaliser,
        loss_config=loss_config,
        sequence_mean=sequence_mean,
    )


def test_setup_is_nontrivial():
    prompt_probs = history_prompt_probs(DPPO)
    assert all(0.2 <= p < 1.0 for p in prompt_probs), prompt_probs
    assert abs((1 - sum(prompt_probs) / 3) - 0.4) < 1e-9
    assert zero_variance_groups(torch.stack([r.rewards for r in ROLLOUTS])).tolist() == [True, False, False]
    _, metrics = grpo_loss(
        logprobs=token_logprobs(THETA, torch.cat([r.features for r in ROLLOUTS])),
        old_logprobs=token_logprobs(THETA_OLD, torch.cat([r.features for r in ROLLOUTS])),
        advantages=group_advantages(torch.stack([r.rewards for r in ROLLOUTS])).flatten(),
        mask=torch.cat([r.mask for r in ROLLOUTS]),
        normaliser=FULL_TOKENS,
    )
    assert 0.0 < metrics["clip_fraction"].item() < 1.0, "the test should exercise the clipped branch"


def test_dppo_gradient_is_unbiased_by_exact_enumeration():
    prompt_probs = history_prompt_probs(DPPO)
    expected, total = dppo_expected_gradient(
        rollouts=ROLLOUTS, prompt_probs=prompt_probs, config=DPPO, normaliser_fn=lambda kept: FULL_TOKENS
    )
    assert abs(total - 1.0) < 1e-12
    full = full_gradient(ROLLOUTS, normaliser=FULL_TOKENS)
    assert full.abs().max() > 1e-3
    torch.testing.assert_close(expected, full, rtol=1e-10, atol=1e-12)


def test_dppo_sequence_mean_loss_is_unbiased():
    prompt_probs = history_prompt_probs(DPPO)
    num_completions = float(len(ROLLOUTS) * GROUP)
    expected, _ = dppo_expected_gradient(
        rollouts=ROLLOUTS,
        prompt_probs=prompt_probs,
        config=DPPO,
        normaliser_fn=lambda kept: num_completions,
        sequence_mean=True,
    )
    full = full_gradient(ROLLOUTS, normaliser=num_completions, sequence_mean=True)
    torch.testing.assert_close(expected, full, rtol=1e-10, atol=1e-12)


def test_kept_token_normaliser_is_biased():
    """Normalising by the tokens of the rolled-out prompts (depends on the prompt draw) is biased."""
    prompt_probs = history_prompt_probs(DPPO)
    expected, _ = dppo_expected_gradient(
        rollouts=ROLLOUTS,
        prompt_probs=prompt_probs,
        config=DPPO,
        normaliser_fn=lambda kept: float(sum(ROLLOUTS[i].mask.sum().item() for i in kept)),
    )
    full = full_gradient(ROLLOUTS, normaliser=FULL_TOKENS)
    assert (expected - full).abs().max() > 1e-4


def dapo_filter_gradient(*, normaliser_fn, loss_config: GRPOLossConfig) -> torch.Tensor:
    """DAPO-style dynamic sampling: drop zero-variance groups, no importance correction."""
    rewards = torch.stack([r.rewards for r in ROLLOUTS])
    kept = [i for i, zero in enumerate(zero_variance_groups(rewards).tolist()) if not zero]
    return pruned_gradient(
        rollouts=ROLLOUTS,
        advantages=group_advantages(rewards),
        rows=all_rows(kept),
        weights=None,
        normaliser=normaliser_fn(kept),
        loss_config=loss_config,
    )


@pytest.mark.parametrize("renormalise", [False, True], ids=["full-normaliser", "kept-normaliser"])
def test_dapo_filter_is_biased_with_kl(renormalise):
    def normaliser_fn(kept):
        return float(sum(ROLLOUTS[i].mask.sum().item() for i in kept)) if renormalise else FULL_TOKENS

    filtered = dapo_filter_gradient(normaliser_fn=normaliser_fn, loss_config=LOSS_CONFIG)
    full = full_gradient(ROLLOUTS, normaliser=FULL_TOKENS)
    assert (filtered - full).abs().max() > 1e-4
    with pytest.raises(AssertionError):
        torch.testing.assert_close(filtered, full, rtol=1e-10, atol=1e-12)


def test_dapo_filter_is_exact_only_without_kl_and_with_the_full_normaliser():
    no_kl = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_beta=0.0)
    filtered = dapo_filter_gradient(normaliser_fn=lambda kept: FULL_TOKENS, loss_config=no_kl)
    torch.testing.assert_close(filtered, full_gradient(ROLLOUTS, normaliser=FULL_TOKENS, loss_config=no_kl))


# --- the expectation also runs over the rollout ------------------------------------------

# Two prompts, each with two possible rollouts (different rewards and lengths).
ROLLOUT_OUTCOMES = [
    [
        (0.6, make_rollout(seed=11, rewards=[0.0, 0.0, 0.0], lengths=[4, 1, 2])),
        (0.4, make_rollout(seed=12, rewards=[1.0, 0.0, 1.0], lengths=[2, 3, 4])),
    ],
    [
        (0.3, make_rollout(seed=13, rewards=[0.2, 0.8, 0.5], lengths=[1, 4, 3])),
        (0.7, make_rollout(seed=14, rewards=[1.0, 1.0, 1.0], lengths=[3, 3, 4])),
    ],
]


def test_unbiased_over_rollouts_with_a_constant_normaliser():
    """Prompt pruning happens before rollout; with Z fixed before the step the estimator stays unbiased."""
    config = DPPOConfig(prompt_prune_rate=0.3, completion_prune_rate=0.4, prompt_floor=0.2, completion_floor=0.2)
    prompt_probs = [0.5, 0.9]
    constant = float(2 * GROUP * MAX_TOKENS)  # P * G * max_new_tokens (Dr. GRPO)
    expected, full = torch.zeros_like(THETA), torch.zeros_like(THETA)
    biased = torch.zeros_like(THETA)
    for (p0, r0), (p1, r1) in itertools.product(*ROLLOUT_OUTCOMES):
        rollouts = [r0, r1]
        estimate, _ = dppo_expected_gradient(
            rollouts=rollouts, prompt_probs=prompt_probs, config=config, normaliser_fn=lambda kept: constant
        )
        expected += p0 * p1 * estimate
        full += p0 * p1 * full_gradient(rollouts, normaliser=constant)
        kept_tokens, _ = dppo_expected_gradient(
            rollouts=rollouts,
            prompt_probs=prompt_probs,
            config=config,
            normaliser_fn=lambda kept: float(sum(rollouts[i].mask.sum().item() for i in kept)),
        )
        biased += p0 * p1 * kept_tokens
    torch.testing.assert_close(expected, full, rtol=1e-10, atol=1e-12)
    full_token_mean = torch.zeros_like(THETA)
    for (p0, r0), (p1, r1) in itertools.product(*ROLLOUT_OUTCOMES):
        tokens = float(r0.mask.sum().item() + r1.mask.sum().item())
        full_token_mean += p0 * p1 * full_gradient([r0, r1], normaliser=tokens)
    assert (biased - full_token_mean).abs().max() > 1e-5


# --- dependent (systematic) draws --------------------------------------------------------------


def _pieces(probs: list[float]) -> list[tuple[float, float]]:
    """(midpoint, length) of the pieces of [0, 1) cut at the fractional parts of every subset sum of
    ``probs``: a systematic draw over these items (in any order) is constant on each piece."""
    cuts = {0.0, 1.0}
    for r in range(1, len(probs) + 1):
        for subset in itertools.combinations(probs, r):
            total = sum(subset)
            cuts.add(total - int(total))
    cuts = sorted(cuts)
    return [((a + b) / 2, b - a) for a, b in zip(cuts, cuts[1:]) if b - a > 1e-12]


def _independent_draws(keys: list, probs: list[float]) -> list[tuple[dict, float]]:
    """Every keep pattern of independent draws: (uniform per key, probability) with each uniform
    below its key's probability (kept) or above it (pruned)."""
    return [({key: u for key, u in zip(keys, us)}, math.prod(ls))
            for combo in itertools.product(*[[(0.0, p), ((1 + p) / 2, 1 - p)] for p in probs])
            for us, ls in [zip(*combo)]]


@pytest.mark.parametrize("prompt_sampling", ["independent", "systematic"])
def test_dppo_gradient_is_unbiased_with_systematic_draws(prompt_sampling, monkeypatch):
    """Systematic draws make the keeps within a group (or batch) dependent; unbiasedness needs only
    each item's marginal keep probability. Exact enumeration of the group uniforms (and of the prompt
    draws) through prune_prompts / prune_completions, with the uniforms set at keep_uniform."""
    import megatron_prune.grpo.dppo as dppo

    config = DPPOConfig(prompt_prune_rate=0.4, completion_prune_rate=0.5, prompt_floor=0.2, completion_floor=0.15,
                        sampling="systematic", prompt_sampling=prompt_sampling)
    history = PromptHistory.from_config(config)
    history.update(0, torch.tensor([1.0, 1.0, 1.0]))
    history.update(1, torch.tensor([1.0, 0.0, 1.0]))
    history.update(2, torch.tensor([0.0, 1.0, 0.0]))
    advantages = group_advantages(torch.stack([r.rewards for r in ROLLOUTS]), config=AdvantageConfig())
    table: dict = {}
    monkeypatch.setattr(dppo, "keep_uniform", lambda *, seed, step, level, item_id: table.get((level, item_id), 0.0))
    ids = [0, 1, 2]
    probs = prune_prompts(prompt_ids=ids, history=history, config=DPPOConfig(
        prompt_prune_rate=0.4, prompt_floor=0.2), seed=0, step=0).probs.tolist()
    if prompt_sampling == "systematic":
        prompt_draws = [({("prompt", "batch"): u}, length) for u, length in _pieces(probs)]
    else:
        prompt_draws = _independent_draws([("prompt", i) for i in ids], probs)
    expected, total = torch.zeros_like(THETA), 0.0
    for prompt_table, prompt_probability in prompt_draws:
        if prompt_probability <= 0:
            continue
        table.clear()
        table.update(prompt_table)
        prompts = prune_prompts(prompt_ids=ids, history=history, config=config, seed=0, step=0)
        kept = [i for i in ids if prompts.keep[i]]
        q = prune_completions(advantages=advantages[kept], prompt_ids=kept, config=DPPOConfig(
            completion_prune_rate=0.5, completion_floor=0.15), seed=0, step=0).probs
        for combo in itertools.product(*[_pieces(q[k].tolist()) for k in range(len(kept))]):
            table.update({("completion", i): u for i, (u, _) in zip(kept, combo)})
            decision = prune_completions(advantages=advantages[kept], prompt_ids=kept, config=config, seed=0, step=0)
            rows = [(i, j) for k, i in enumerate(kept) for j in range(GROUP) if decision.keep[k, j]]
            weights = [1.0 / (probs[i] * float(q[kept.index(i), j])) for i, j in rows]
            gradient = pruned_gradient(rollouts=ROLLOUTS, advantages=advantages, rows=rows, weights=weights,
                                       normaliser=FULL_TOKENS)
            probability = prompt_probability * math.prod(length for _, length in combo)
            expected += probability * gradient
            total += probability
    assert abs(total - 1.0) < 1e-12
    torch.testing.assert_close(expected, full_gradient(ROLLOUTS, normaliser=FULL_TOKENS), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("sampling", ["independent", "systematic"])
def test_skipping_zero_advantages_keeps_the_estimate_unbiased(sampling, monkeypatch):
    """skip_zero_advantage: completions with advantage exactly 0 get probability 0 (never kept), the
    others meet the rest of the rate, and sum_ij keep/q * A_ij * x_ij still has expectation
    sum_ij A_ij * x_ij (the skipped terms are exactly 0), by exact enumeration of the draws."""
    import megatron_prune.grpo.dppo as dppo

    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.5], [0.0, 1.0, 0.0, 0.0]])
    advantages = group_advantages(rewards, config=AdvantageConfig())
    zero = advantages == 0
    assert int(zero.sum()) == 6  # the equal-reward group, and group 1's two completions at its mean
    x = torch.linspace(-1.0, 2.0, advantages.numel(), dtype=torch.float64).reshape(advantages.shape)
    ids = [0, 1, 2]
    table: dict = {}
    monkeypatch.setattr(dppo, "keep_uniform", lambda *, seed, step, level, item_id: table.get(item_id, 0.0))
    for rate in (0.6, 0.3, 0.0):
        config = DPPOConfig(completion_prune_rate=rate, completion_floor=0.15, sampling=sampling,
                            skip_zero_advantage=True)
        probs = prune_completions(advantages=advantages, prompt_ids=ids, config=config, seed=0, step=0).probs
        assert torch.equal(probs == 0, zero)
        if rate * advantages.numel() >= int(zero.sum()):
            assert 1.0 - probs.mean().item() == pytest.approx(rate, abs=1e-12)
        else:  # the zeros alone prune more than asked: every other completion is kept
            assert torch.equal(probs[~zero], torch.ones_like(probs[~zero]))
        if sampling == "systematic":
            draws = [({i: u for i, (u, _) in zip(ids, combo)}, math.prod(length for _, length in combo))
                     for combo in itertools.product(*[_pieces(probs[k].tolist()) for k in range(len(ids))])]
        else:
            draws = _independent_draws([(i, j) for i in ids for j in range(advantages.shape[1])],
                                       probs.flatten().tolist())
        expected, frequency, total = 0.0, torch.zeros_like(probs), 0.0
        for uniforms, probability in draws:
            if probability <= 0:
                continue
            table.clear()
            table.update(uniforms)
            decision = prune_completions(advantages=advantages, prompt_ids=ids, config=config, seed=0, step=0)
            assert not decision.keep[zero].any()
            expected += probability * float((decision.weights * advantages.double() * x).sum())
            frequency += probability * decision.keep.double()
            total += probability
        assert total == pytest.approx(1.0, abs=1e-12)
        torch.testing.assert_close(frequency, probs, rtol=0, atol=1e-12)
        assert expected == pytest.approx(float((advantages.double() * x).sum()), abs=1e-12)
