"""The DPO loss on (estimated) length-averaged policy/reference log-ratios.

For a response r with scored positions S_r (a uniform subset under position pruning) the
log-ratio is ``Δ_r = c_r · Σ_{t ∈ S_r} (log π(t) − log π_ref(t))`` with ``c_r = 1/|S_r|``
(``mean``: an unbiased estimate of the length-averaged log-ratio) or ``c_r = T_r/|S_r|``
(``sum``: unbiased for the summed log-ratio). The pair loss is ``−log σ(β (Δ_w − Δ_l))``.

Branch pruning: the pruned branch's Δ comes from a no-grad pass; the kept branch b carries the
gradient, scaled by 1/q_b. The loss *value* is unchanged; the gradient's expectation over the
branch draw is the full gradient: q_w·(1/q_w)·∂L/∂Δ_w·∇Δ_w + q_l·(1/q_l)·∂L/∂Δ_l·∇Δ_l.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


def response_log_ratios(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    *,
    seq_ids: torch.Tensor,
    num_scored: Sequence[int],
    lengths: Sequence[int],
    reduction: str,
) -> torch.Tensor:
    """Δ per response ([num_responses]) from per-token log-probs of the scored positions."""
    device = policy_logps.device
    seq_ids = seq_ids.to(device)
    num_scored_t = torch.tensor(num_scored, dtype=torch.float32, device=device)
    if reduction == "mean":
        coef = 1.0 / num_scored_t
    elif reduction == "sum":
        coef = torch.tensor(lengths, dtype=torch.float32, device=device) / num_scored_t
    else:
        raise ValueError(f"reduction must be mean or sum, got {reduction!r}")
    per_token = (policy_logps.float() - ref_logps.float().to(device)) * coef[seq_ids]
    out = torch.zeros(len(num_scored), dtype=torch.float32, device=per_token.device)
    return out.index_add(0, seq_ids, per_token)


def dpo_pair_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    *,
    beta: float,
    grad_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair DPO loss; ``grad_scale`` (1/q of the kept branch) scales only the gradient."""
    margin = beta * (chosen - rejected)
    loss = -F.logsigmoid(margin)
    if grad_scale is not None:
        loss = loss.detach() + (loss - loss.detach()) * grad_scale
    stats = {
        "margin": margin.detach(),
        # A tie (e.g. policy == reference at the start) counts as half right, so chance is 0.5.
        "reward_accuracy": (margin.detach() > 0).float() + 0.5 * (margin.detach() == 0).float(),
        "chosen_reward": beta * chosen.detach(),
        "rejected_reward": beta * rejected.detach(),
    }
    return loss, stats
