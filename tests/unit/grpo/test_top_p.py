"""Top-p (nucleus) sampling of the rollout sampler against a hand-computed nucleus.

``sample_from_logits`` is what ``generate`` (plain and KV-cached) draws every token with; the
draws here are seeded the way a rollout seeds them (one ``torch.Generator`` per completion,
seeded by ``completion_seed``), so every assertion is deterministic. The expected
distribution is written out by hand: with probabilities ``[0.5, 0.3, 0.15, 0.05]`` and
``top_p = 0.7`` the nucleus is the two most likely tokens (0.5 < 0.7, 0.5 + 0.3 >= 0.7: the
token that crosses top_p is kept), renormalised over their mass 0.8.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_prune.grpo.rollout import completion_seed, sample_from_logits


def seeded_generators(count: int, *, seed: int, step: int = 0, prompt_id: int = 0) -> list[torch.Generator]:
    """One generator per draw, seeded like the completions of one prompt in a rollout."""
    return [torch.Generator().manual_seed(completion_seed(seed=seed, step=step, prompt_id=prompt_id, index=i))
            for i in range(count)]


def logits_for(probs_by_token: list[float], temperature: float) -> torch.Tensor:
    """Logits whose softmax at ``temperature`` is ``probs_by_token`` (plus an arbitrary offset)."""
    return temperature * torch.log(torch.tensor(probs_by_token, dtype=torch.float64)) + 1.5


# The vocabulary order is deliberately not the probability order, so the sampler's sort and
# its mapping back to token ids are both exercised.
PROBS = {2: 0.5, 0: 0.3, 3: 0.15, 1: 0.05}
TOP_P = 0.7
NUCLEUS_MASS = 0.5 + 0.3
EXPECTED = {2: 0.5 / NUCLEUS_MASS, 0: 0.3 / NUCLEUS_MASS, 3: 0.0, 1: 0.0}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_p_samples_the_renormalised_nucleus(temperature):
    draws = 4000
    logits = logits_for([PROBS[t] for t in range(4)], temperature).expand(draws, 4)
    tokens, logprobs = sample_from_logits(logits, seeded_generators(draws, seed=11), temperature=temperature,
                                          top_p=TOP_P)
    assert tokens.shape == (draws,) and logprobs.shape == (draws,)
    counts = {t: int((tokens == t).sum()) for t in range(4)}
    for token, p in EXPECTED.items():
        if p == 0.0:
            assert counts[token] == 0, (token, counts)  # outside the nucleus: never drawn
            continue
        # binomial count: 4 standard errors (sd of the frequency is sqrt(p (1 - p) / n) ~ 0.0077)
        tolerance = 4 * math.sqrt(p * (1 - p) / draws)
        assert abs(counts[token] / draws - p) < tolerance, (token, counts)
    # the returned log-prob is that of the sampling distribution: renormalised over the nucleus
    for token, p in EXPECTED.items():
        if p > 0:
            picked = logprobs[tokens == token].double()
            assert torch.allclose(picked, torch.full_like(picked, math.log(p)), atol=1e-6), token


def test_top_p_draws_are_a_function_of_the_seeds():
    logits = logits_for([PROBS[t] for t in range(4)], 1.0).expand(64, 4)
    a = sample_from_logits(logits, seeded_generators(64, seed=3), temperature=1.0, top_p=TOP_P)
    b = sample_from_logits(logits, seeded_generators(64, seed=3), temperature=1.0, top_p=TOP_P)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_top_token_above_top_p_is_always_drawn(temperature):
    # p = [0.02, 0.95, 0.03] at top_p 0.9: the top token alone exceeds top_p, so the nucleus is
    # that token only (never empty) and its sampling probability is 1 (log-prob 0).
    draws = 300
    logits = logits_for([0.02, 0.95, 0.03], temperature).expand(draws, 3)
    tokens, logprobs = sample_from_logits(logits, seeded_generators(draws, seed=5), temperature=temperature,
                                          top_p=0.9)
    assert tokens.tolist() == [1] * draws
    assert torch.allclose(logprobs.double(), torch.zeros(draws, dtype=torch.float64), atol=1e-6)


def test_top_p_one_keeps_the_full_distribution():
    # Control: without top-p the low-probability tokens are drawn and log-probs are the plain ones.
    draws = 4000
    logits = logits_for([PROBS[t] for t in range(4)], 1.0).expand(draws, 4)
    tokens, logprobs = sample_from_logits(logits, seeded_generators(draws, seed=11), temperature=1.0, top_p=1.0)
    for token, p in PROBS.items():
        tolerance = 4 * math.sqrt(p * (1 - p) / draws)
        assert abs(int((tokens == token).sum()) / draws - p) < tolerance, token
        picked = logprobs[tokens == token].double()
        assert torch.allclose(picked, torch.full_like(picked, math.log(p)), atol=1e-6), token
