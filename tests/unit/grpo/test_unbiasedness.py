"""DPPO is unbiased for full-batch GRPO: checked by exact enumeration, not Monte Carlo.

Every keep draw of prompts and completions is enumerated and weighted by its probability: the
production samplers (``prune_prompts`` / ``prune_completions``) take each draw, with the uniform
``keep_uniform`` would return set by the test (independent draws: one uniform per item, below or
above its probability; systematic draws: one uniform per group or batch, at each piece of
[0, 1) on which the keep pattern is constant). Kept completions carry the weights production
computes (``KeepDecision.weights``, ``combine_weights``); the importance-weighted gradient of
each pruned batch is computed by autograd through ``grpo_loss``, and the expectation must equal
the full-batch GRPO gradient. The KL term is on, so some per-completion terms are nonzero at
zero advantage. Negative controls: uncorrected weights, a normaliser that depends on the draw,
and a biased filter (DAPO-style: drop zero-variance groups, no correction) fail the equality.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from megatron_prune.grpo.advantages import AdvantageConfig, group_advantages, zero_variance_groups
from megatron_prune.grpo.dppo import (
    COMPLETION_LEVEL,
    PROMPT_BATCH_KEY,
    PROMPT_LEVEL,
    DPPOConfig,
    KeepDecision,
    PromptHistory,
    combine_weights,
    prune_completions,
    prune_prompts,
    solve_keep_probs,
)
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


def prompt_draws(probs: list[float], ids: list[int], sampling: str) -> list[tuple[dict, float]]:
    """Every prompt-level draw as (the uniforms ``keep_uniform`` returns, probability)."""
    if sampling == "systematic":  # one uniform for the batch
        return [({(PROMPT_LEVEL, PROMPT_BATCH_KEY): u}, length) for u, length in _pieces(probs)]
    return _independent_draws([(PROMPT_LEVEL, i) for i in ids], probs)


def completion_draws(q: torch.Tensor, kept: list[int], sampling: str) -> list[tuple[dict, float]]:
    """Every completion-level draw over the groups of ``kept`` (``q``: their keep probabilities)."""
    if sampling == "systematic":  # one uniform per group
        return [({(COMPLETION_LEVEL, i): u for i, (u, _) in zip(kept, combo)}, math.prod(length for _, length in combo))
                for combo in itertools.product(*[_pieces(q[k].tolist()) for k in range(len(kept))])]
    keys = [(COMPLETION_LEVEL, (i, j)) for i in kept for j in range(q.shape[1])]
    return _independent_draws(keys, q.flatten().tolist())


@pytest.fixture
def uniforms(monkeypatch) -> dict:
    """The uniform ``keep_uniform`` returns for each (level, item id): the tests set them to run
    every draw of the production samplers (``prune_prompts`` / ``prune_completions``)."""
    import megatron_prune.grpo.dppo as dppo

    table: dict = {}
    monkeypatch.setattr(dppo, "keep_uniform", lambda *, seed, step, level, item_id: table[(level, item_id)])
    return table


def dppo_expected_gradient(
    *,
    rollouts: list[Rollout],
    history: PromptHistory,
    config: DPPOConfig,
    normaliser_fn,
    uniforms: dict,
    sequence_mean: bool = False,
) -> tuple[torch.Tensor, float]:
    """E over every prompt and completion draw of the DPPO gradient; also the total probability.

    Each draw is taken by ``prune_prompts`` / ``prune_completions`` (their uniforms set in
    ``uniforms``), and the kept completions are weighted by what production computes
    (``KeepDecision.weights`` combined by ``combine_weights``); the probability of each draw is
    the length of its uniforms' interval. Also checks that every prompt is kept with its
    probability and every completion with its own, given its prompt.
    """
    ids = list(range(len(rollouts)))
    advantages = group_advantages(torch.stack([r.rewards for r in rollouts]), config=AdvantageConfig())

    def decide_prompts() -> KeepDecision:
        return prune_prompts(prompt_ids=ids, history=history, config=config, seed=0, step=0)

    def decide_completions(kept: list[int]) -> KeepDecision:
        return prune_completions(advantages=advantages[kept], prompt_ids=kept, config=config, seed=0, step=0)

    uniforms.clear()
    uniforms.update({(PROMPT_LEVEL, PROMPT_BATCH_KEY): 0.0} | {(PROMPT_LEVEL, i): 0.0 for i in ids})
    probs = decide_prompts().probs  # the probabilities do not depend on the uniforms
    expected, total = torch.zeros_like(THETA), 0.0
    prompt_frequency = torch.zeros_like(probs)
    for prompt_uniforms, prompt_probability in prompt_draws(probs.tolist(), ids, config.prompt_sampling):
        if prompt_probability <= 0:
            continue
        uniforms.clear()
        uniforms.update(prompt_uniforms)
        prompts = decide_prompts()
        prompt_frequency += prompt_probability * prompts.keep.double()
        kept = [i for i in ids if prompts.keep[i]]
        if not kept:
            total += prompt_probability
            continue
        uniforms.update({(COMPLETION_LEVEL, i): 0.0 for i in kept}
                        | {(COMPLETION_LEVEL, (i, j)): 0.0 for i in kept for j in range(GROUP)})
        q = decide_completions(kept).probs
        completion_frequency = torch.zeros_like(q)
        for completion_uniforms, completion_probability in completion_draws(q, kept, config.sampling):
            if completion_probability <= 0:
                continue
            uniforms.update(completion_uniforms)
            decision = decide_completions(kept)
            completion_frequency += completion_probability * decision.keep.double()
            weights = combine_weights(prompt_weights=prompts.weights[kept], completion_weights=decision.weights)
            rows = [(i, j) for k, i in enumerate(kept) for j in range(GROUP) if decision.keep[k, j]]
            gradient = pruned_gradient(
                rollouts=rollouts,
                advantages=advantages,
                rows=rows,
                weights=[float(weights[kept.index(i), j]) for i, j in rows],
                normaliser=normaliser_fn(kept),
                sequence_mean=sequence_mean,
            )
            probability = prompt_probability * completion_probability
            expected += probability * gradient
            total += probability
        torch.testing.assert_close(completion_frequency, q, rtol=0, atol=1e-12)
    torch.testing.assert_close(prompt_frequency, probs, rtol=0, atol=1e-12)
    return expected, total


ROLLOUTS = [
    make_rollout(seed=1, rewards=[1.0, 1.0, 1.0], lengths=[4, 2, 3]),  # zero variance: A = 0
    make_rollout(seed=2, rewards=[1.0, 0.0, 0.0], lengths=[3, 4, 1]),
    make_rollout(seed=3, rewards=[0.5, 0.2, 0.9], lengths=[2, 4, 4]),
]
FULL_TOKENS = float(sum(r.mask.sum().item() for r in ROLLOUTS))
DPPO = DPPOConfig(prompt_prune_rate=0.4, completion_prune_rate=0.5, prompt_floor=0.2, completion_floor=0.15)
SAMPLINGS = [  # (completion level, prompt level)
    ("independent", "independent"),
    ("systematic", "independent"),
    ("systematic", "systematic"),
]


def prompt_history(config: DPPOConfig) -> PromptHistory:
    """A real history: prompt 0 was always solved, prompt 1 seen twice, prompt 2 once."""
    history = PromptHistory.from_config(config)
    history.update(0, torch.tensor([1.0, 1.0, 1.0]))
    history.update(1, torch.tensor([1.0, 0.0, 1.0]))
    history.update(1, torch.tensor([0.0, 0.0, 1.0]))
    history.update(2, torch.tensor([0.0, 1.0, 0.0]))
    return history


def history_prompt_probs_for(history: PromptHistory, config: DPPOConfig, ids: list[int]) -> list[float]:
    return prune_prompts(prompt_ids=ids, history=history, config=config, seed=0, step=0).probs.tolist()


def history_prompt_probs(config: DPPOConfig) -> list[float]:
    return history_prompt_probs_for(prompt_history(config), config, [0, 1, 2])


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


@pytest.mark.parametrize("sampling,prompt_sampling", SAMPLINGS)
def test_dppo_gradient_is_unbiased_by_exact_enumeration(sampling, prompt_sampling, uniforms):
    """Independent or systematic (dependent) draws at either level: unbiasedness needs only each
    item's marginal keep probability, which the enumeration also checks."""
    config = dataclasses.replace(DPPO, sampling=sampling, prompt_sampling=prompt_sampling)
    expected, total = dppo_expected_gradient(
        rollouts=ROLLOUTS, history=prompt_history(config), config=config,
        normaliser_fn=lambda kept: FULL_TOKENS, uniforms=uniforms,
    )
    assert abs(total - 1.0) < 1e-12
    full = full_gradient(ROLLOUTS, normaliser=FULL_TOKENS)
    assert full.abs().max() > 1e-3
    torch.testing.assert_close(expected, full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("history_score", ["informative", "pass-rate"])
def test_dppo_gradient_is_unbiased_under_every_history_score(history_score, uniforms):
    """The history only sets the prompt keep probabilities; with the 1/p weights any of its scores
    leaves the estimate unbiased (checked on probabilities the score really spreads)."""
    config = dataclasses.replace(DPPO, history_score=history_score)
    scores = prompt_history(config).scores([0, 1, 2])
    probs = solve_keep_probs(scores, prune_rate=config.prompt_prune_rate, floor=config.prompt_floor).tolist()
    assert len(set(probs)) >= 2 and all(0.2 <= p < 1.0 for p in probs), probs
    expected, total = dppo_expected_gradient(
        rollouts=ROLLOUTS, history=prompt_history(config), config=config,
        normaliser_fn=lambda kept: FULL_TOKENS, uniforms=uniforms,
    )
    assert abs(total - 1.0) < 1e-12
    torch.testing.assert_close(expected, full_gradient(ROLLOUTS, normaliser=FULL_TOKENS), rtol=1e-10, atol=1e-12)


def test_uncorrected_weights_are_caught(uniforms, monkeypatch):
    """Negative control: kept completions without the 1/q correction are biased, and the
    enumeration above sees it."""
    monkeypatch.setattr(KeepDecision, "weights", property(lambda self: self.keep.double()))
    expected, _ = dppo_expected_gradient(
        rollouts=ROLLOUTS, history=prompt_history(DPPO), config=DPPO,
        normaliser_fn=lambda kept: FULL_TOKENS, uniforms=uniforms,
    )
    assert (expected - full_gradient(ROLLOUTS, normaliser=FULL_TOKENS)).abs().max() > 1e-4


def test_dppo_sequence_mean_loss_is_unbiased(uniforms):
    num_completions = float(len(ROLLOUTS) * GROUP)
    expected, _ = dppo_expected_gradient(
        rollouts=ROLLOUTS,
        history=prompt_history(DPPO),
        config=DPPO,
        normaliser_fn=lambda kept: num_completions,
        uniforms=uniforms,
        sequence_mean=True,
    )
    full = full_gradient(ROLLOUTS, normaliser=num_completions, sequence_mean=True)
    torch.testing.assert_close(expected, full, rtol=1e-10, atol=1e-12)


def test_kept_token_normaliser_is_biased(uniforms):
    """Normalising by the tokens of the rolled-out prompts (depends on the prompt draw) is biased."""
    expected, _ = dppo_expected_gradient(
        rollouts=ROLLOUTS,
        history=prompt_history(DPPO),
        config=DPPO,
        normaliser_fn=lambda kept: float(sum(ROLLOUTS[i].mask.sum().item() for i in kept)),
        uniforms=uniforms,
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


def test_unbiased_over_rollouts_with_a_constant_normaliser(uniforms):
    """Prompt pruning happens before rollout; with Z fixed before the step the estimator stays unbiased."""
    config = DPPOConfig(prompt_prune_rate=0.3, completion_prune_rate=0.4, prompt_floor=0.2, completion_floor=0.2)
    history = PromptHistory.from_config(config)
    history.update(0, torch.tensor([1.0, 0.0, 0.0]))
    history.update(1, torch.tensor([1.0, 1.0, 1.0]))  # prompt 1 looks uninformative: kept less often
    uniforms.update({(PROMPT_LEVEL, 0): 0.0, (PROMPT_LEVEL, 1): 0.0})
    assert 0.2 < min(history_prompt_probs_for(history, config, [0, 1])) < 0.9
    constant = float(2 * GROUP * MAX_TOKENS)  # P * G * max_new_tokens (Dr. GRPO)
    expected, full = torch.zeros_like(THETA), torch.zeros_like(THETA)
    biased = torch.zeros_like(THETA)
    for (p0, r0), (p1, r1) in itertools.product(*ROLLOUT_OUTCOMES):
        rollouts = [r0, r1]
        estimate, _ = dppo_expected_gradient(
            rollouts=rollouts, history=history, config=config, normaliser_fn=lambda kept: constant, uniforms=uniforms,
        )
        expected += p0 * p1 * estimate
        full += p0 * p1 * full_gradient(rollouts, normaliser=constant)
        kept_tokens, _ = dppo_expected_gradient(
            rollouts=rollouts,
            history=history,
            config=config,
            uniforms=uniforms,
            normaliser_fn=lambda kept: float(sum(rollouts[i].mask.sum().item() for i in kept)),
        )
        biased += p0 * p1 * kept_tokens
    torch.testing.assert_close(expected, full, rtol=1e-10, atol=1e-12)
    full_token_mean = torch.zeros_like(THETA)
    for (p0, r0), (p1, r1) in itertools.product(*ROLLOUT_OUTCOMES):
        tokens = float(r0.mask.sum().item() + r1.mask.sum().item())
        full_token_mean += p0 * p1 * full_gradient([r0, r1], normaliser=tokens)
    assert (biased - full_token_mean).abs().max() > 1e-5


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
