"""``dpo_pair_losses`` on hand-computed cases: −log σ(β (Δ_chosen − Δ_rejected))."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_prune.dpo.loss import dpo_pair_losses

LOG2 = math.log(2.0)


def softplus(x: float) -> float:
    """−log σ(−x) = log(1 + e^x), written out."""
    return math.log1p(math.exp(x))


def test_chosen_far_above_rejected_gives_loss_below_log2_and_the_reverse_above():
    chosen = torch.tensor([2.0, -1.0])
    rejected = torch.tensor([-1.0, 2.0])
    loss, stats = dpo_pair_losses(chosen, rejected, beta=1.0)
    assert loss[0] < LOG2 < loss[1]
    # margin +3 -> log(1 + e^-3); margin -3 -> log(1 + e^3)
    assert loss.tolist() == pytest.approx([softplus(-3.0), softplus(3.0)], rel=1e-6)
    assert stats["margin"].tolist() == pytest.approx([3.0, -3.0])
    assert stats["reward_accuracy"].tolist() == [1.0, 0.0]
    assert stats["chosen_reward"].tolist() == pytest.approx([2.0, -1.0])
    assert stats["rejected_reward"].tolist() == pytest.approx([-1.0, 2.0])


def test_beta_scales_the_margin():
    chosen, rejected = torch.tensor([0.5]), torch.tensor([0.1])
    for beta in (0.1, 0.5, 2.0):
        loss, stats = dpo_pair_losses(chosen, rejected, beta=beta)
        assert float(loss[0]) == pytest.approx(softplus(-beta * 0.4), rel=1e-6)
        assert float(stats["margin"][0]) == pytest.approx(beta * 0.4, rel=1e-6)
        assert float(stats["chosen_reward"][0]) == pytest.approx(beta * 0.5, rel=1e-6)
        assert float(stats["rejected_reward"][0]) == pytest.approx(beta * 0.1, rel=1e-6)
    small = dpo_pair_losses(chosen, rejected, beta=0.1)[0]
    large = dpo_pair_losses(chosen, rejected, beta=2.0)[0]
    assert large < small < LOG2


def test_ties_give_log2_and_half_accuracy():
    chosen = torch.tensor([0.3, -1.2, 0.0])
    loss, stats = dpo_pair_losses(chosen, chosen.clone(), beta=0.7)
    assert loss.tolist() == pytest.approx([LOG2] * 3, rel=1e-6)
    assert stats["reward_accuracy"].tolist() == [0.5, 0.5, 0.5]
    assert stats["margin"].tolist() == [0.0, 0.0, 0.0]


def test_gradient_matches_the_logistic_derivative():
    """d loss / d Δ_chosen = −β σ(−m), d loss / d Δ_rejected = +β σ(−m), m = β (Δ_w − Δ_l)."""
    chosen = torch.tensor([0.4, -0.2], requires_grad=True)
    rejected = torch.tensor([0.1, 0.3], requires_grad=True)
    beta = 0.5
    loss, _ = dpo_pair_losses(chosen, rejected, beta=beta)
    loss.sum().backward()
    for i, (w, l) in enumerate([(0.4, 0.1), (-0.2, 0.3)]):
        s = 1.0 / (1.0 + math.exp(beta * (w - l)))
        assert float(chosen.grad[i]) == pytest.approx(-beta * s, rel=1e-5)
        assert float(rejected.grad[i]) == pytest.approx(beta * s, rel=1e-5)


def test_grad_scale_scales_only_the_gradient():
    chosen = torch.tensor([0.4, -0.2], requires_grad=True)
    rejected = torch.tensor([0.1, 0.3], requires_grad=True)
    plain, _ = dpo_pair_losses(chosen, rejected, beta=1.0)
    (g_plain,) = torch.autograd.grad(plain.sum(), chosen)
    scale = torch.tensor([2.0, 1.0 / 0.3])
    scaled, _ = dpo_pair_losses(chosen, rejected, beta=1.0, grad_scale=scale)
    assert scaled.tolist() == pytest.approx(plain.tolist(), rel=1e-7)
    (g_scaled,) = torch.autograd.grad(scaled.sum(), chosen)
    torch.testing.assert_close(g_scaled, g_plain * scale)
