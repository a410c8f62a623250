"""GRPO token loss against a per-token Python reference, clipping, KL and validation."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_prune.grpo.loss import GRPOLossConfig, grpo_loss, sequence_mean_token_weights


def reference_loss(*, logp, old, ref, adv, mask, weights, normaliser, eps_low, eps_high, beta) -> float:
    """Token-by-token transcription of the formula in the module docstring (no tensor ops)."""
    total = 0.0
    for n in range(len(logp)):
        for t in range(len(logp[n])):
            if not mask[n][t]:
                continue
            ratio = math.exp(logp[n][t] - old[n][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            term = -min(ratio * adv[n], clipped * adv[n])
            d = ref[n][t] - logp[n][t]
            term += beta * (math.exp(d) - d - 1)
            total += weights[n] * term
    return total / normaliser


def random_batch(seed: int = 0, n: int = 4, t: int = 6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    old = logp + 0.4 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.rand(n, t, generator=g) > 0.3
    mask[:, 0] = True
    weights = 1 + 3 * torch.rand(n, generator=g, dtype=torch.float64)
    return logp, old, ref, adv, mask, weights


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28)])
def test_matches_token_reference(beta, eps):
    logp, old, ref, adv, mask, weights = random_batch()
    config = GRPOLossConfig(clip_eps_low=eps[0], clip_eps_high=eps[1], kl_beta=beta)
    loss, metrics = grpo_loss(
        logprobs=logp, old_logprobs=old, ref_logprobs=ref, advantages=adv, mask=mask,
        normaliser=17.0, weights=weights, config=config,
    )
    expected = reference_loss(
        logp=logp.tolist(), old=old.tolist(), ref=ref.tolist(), adv=adv.tolist(), mask=mask.tolist(),
        weights=weights.tolist(), normaliser=17.0, eps_low=eps[0], eps_high=eps[1], beta=beta,
    )
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert (metrics["policy_loss"] + metrics["kl_loss"]).item() == pytest.approx(expected, rel=1e-12)
    assert set(metrics) == {"clip_fraction", "ratio_mean", "kl", "policy_loss", "kl_loss"}
    ratio = torch.exp(logp - old)[mask]
    assert metrics["ratio_mean"].item() == pytest.approx(ratio.mean().item())
    d = (ref - logp)[mask]
    assert metrics["kl"].item() == pytest.approx((torch.exp(d) - d - 1).mean().item())


def test_per_token_advantages_equal_broadcast():
    logp, old, ref, adv, mask, weights = random_batch(seed=1)
    a, _ = grpo_loss(logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, normaliser=5.0, weights=weights)
    b, _ = grpo_loss(
        logprobs=logp, old_logprobs=old, advantages=adv[:, None].expand_as(logp), mask=mask, normaliser=5.0,
        weights=weights[:, None].expand_as(logp),
    )
    assert torch.equal(a, b)


def test_unit_weights_are_the_unweighted_loss_bit_for_bit():
    logp, old, ref, adv, mask, _ = random_batch(seed=2)
    kwargs = dict(logprobs=logp, old_logprobs=old, ref_logprobs=ref, advantages=adv, mask=mask, normaliser=9.0,
                  config=GRPOLossConfig(kl_beta=0.1))
    a, _ = grpo_loss(**kwargs)
    b, _ = grpo_loss(**kwargs, weights=torch.ones(len(adv), dtype=torch.float64))
    assert torch.equal(a, b)


def test_asymmetric_clip_and_clip_fraction():
    # two tokens with ratio 1.25 and positive advantage, one with ratio 0.7 and negative advantage
    old = torch.zeros(3, 1, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.25], [1.25], [0.7]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    mask = torch.ones(3, 1, dtype=torch.bool)
    loss, metrics = grpo_loss(logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, normaliser=3.0,
                              config=GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    loss.backward()
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 3)  # only the 0.7 < 0.8 token
    assert logp.grad[0, 0].item() != 0 and logp.grad[2, 0].item() == 0
    logp.grad = None
    loss, metrics = grpo_loss(logprobs=logp, old_logprobs=old, advantages=adv, mask=mask, normaliser=3.0,
                              config=GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    loss.backward()
    assert metrics["clip_fraction"].item() == pytest.approx(1.0)
    assert torch.all(logp.grad == 0)


def _one_token_loss(ratio: float, advantage: float, config: GRPOLossConfig):
    logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss, metrics = grpo_loss(logprobs=logp, old_logprobs=torch.zeros(1, 1, dtype=torch.float64),
                              advantages=torch.tensor([advantage], dtype=torch.float64),
                              mask=torch.ones(1, 1, dtype=torch.bool), normaliser=1.0, config=config)
    loss.backward()
    return loss, metrics, logp.grad[0, 0].item()


def test_clip_fraction_uses_eps_low_below_and_eps_high_above():
    # 1 - eps_high = 0.72 < 0.75 < 0.8 = 1 - eps_low: with A < 0 the ratio 0.75 is clipped by the
    # lower bound (the objective is the constant -0.8 * A there, so its gradient is 0), and the
    # metric must count it; comparing with 1 - eps_high instead would miss it.
    config = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, metrics, grad = _one_token_loss(0.75, -1.0, config)
    assert loss.item() == pytest.approx(-min(0.75 * -1.0, 0.8 * -1.0))  # = 0.8: the clipped term
    assert grad == 0.0
    assert metrics["clip_fraction"].item() == 1.0
    # Mirror on the positive side: 1.25 < 1 + eps_high = 1.28, so with A > 0 nothing is clipped
    # (the gradient of -rho * A in log rho is -rho * A = -1.25), though 1.25 > 1 + eps_low.
    loss, metrics, grad = _one_token_loss(1.25, 1.0, config)
    assert loss.item() == pytest.approx(-1.25)
    assert grad == pytest.approx(-1.25)
    assert metrics["clip_fraction"].item() == 0.0
    # and past 1 + eps_high it is clipped
    loss, metrics, grad = _one_token_loss(1.3, 1.0, config)
    assert grad == 0.0 and metrics["clip_fraction"].item() == 1.0


def test_padding_garbage_does_not_leak():
    logp, old, ref, adv, mask, weights = random_batch(seed=3)
    dirty_logp, dirty_old, dirty_ref = logp.clone(), old.clone(), ref.clone()
    dirty_logp[~mask], dirty_old[~mask], dirty_ref[~mask] = 50.0, -math.inf, 80.0
    dirty_logp.requires_grad_(True)
    config = GRPOLossConfig(kl_beta=0.2)
    clean, _ = grpo_loss(logprobs=logp, old_logprobs=old, ref_logprobs=ref, advantages=adv, mask=mask,
                         normaliser=4.0, weights=weights, config=config)
    dirty, metrics = grpo_loss(logprobs=dirty_logp, old_logprobs=dirty_old, ref_logprobs=dirty_ref, advantages=adv,
                               mask=mask, normaliser=4.0, weights=weights, config=config)
    dirty.backward()
    assert torch.isfinite(dirty) and torch.isfinite(dirty_logp.grad).all()
    assert dirty.item() == pytest.approx(clean.item(), rel=1e-12)
    assert torch.all(dirty_logp.grad[~mask] == 0)
    assert all(torch.isfinite(v) for v in metrics.values())


def test_empty_batch_gives_zero_loss_with_a_graph():
    logp = torch.zeros(0, 4, requires_grad=True)
    loss, metrics = grpo_loss(logprobs=logp, old_logprobs=torch.zeros(0, 4), advantages=torch.zeros(0),
                              mask=torch.zeros(0, 4, dtype=torch.bool), normaliser=10)
    loss.backward()
    assert loss.item() == 0.0 and metrics["clip_fraction"].item() == 0.0


def test_sequence_mean_token_weights():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    weights = sequence_mean_token_weights(mask)
    assert weights.tolist() == [[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"normaliser": 0.0}, "normaliser"),
        ({"normaliser": float("inf")}, "normaliser"),
        ({"advantages": torch.zeros(3)}, "advantages"),
        ({"weights": torch.zeros(2, 3)}, "weights"),
        ({"mask": torch.ones(2, 5, dtype=torch.bool)}, "mask"),
        ({"config": GRPOLossConfig(kl_beta=0.1)}, "ref_logprobs"),
    ],
)
def test_bad_arguments_raise(overrides, message):
    kwargs = dict(logprobs=torch.zeros(2, 4), old_logprobs=torch.zeros(2, 4), advantages=torch.zeros(2),
                  mask=torch.ones(2, 4, dtype=torch.bool), normaliser=1.0)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message):
        grpo_loss(**kwargs)


@pytest.mark.parametrize("field, value", [("clip_eps_low", 1.0), ("clip_eps_high", -0.1), ("kl_beta", -1.0)])
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        GRPOLossConfig(**{field: value})


@pytest.mark.parametrize("value", [math.inf, math.nan, -0.1])
def test_settings_refuse_values_no_run_can_use(value):
    """The configs refuse NaN and infinity too (code that builds them without the CLI's parser)."""
    from megatron_prune.grpo.rollout import SamplingSettings

    with pytest.raises(ValueError, match="kl_beta must be a finite number >= 0"):
        GRPOLossConfig(kl_beta=value)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingSettings(max_new_tokens=4, eos_id=1, pad_id=0, vocab_size=8, seed=0, temperature=value)
