"""The GRPO token-level objective, with per-completion importance weights for DPPO.

For token ``t`` of completion ``j`` with ratio ``rho = exp(logp - old_logp)``::

    term = -min(rho * A_j, clip(rho, 1 - eps_low, 1 + eps_high) * A_j) + beta * k3
    k3   = exp(ref - logp) - (ref - logp) - 1
    loss = sum_tokens mask * weight_j * term / normaliser

``weight_j`` is the DPPO importance weight ``1/(p_i q_ij)`` (1 without pruning) and the
``normaliser`` is fixed by the caller from the *unpruned* batch (e.g. its total valid
tokens, or a constant): dividing by the kept token count would bias the gradient
(docs/dppo.md). With ``normaliser = number of completions`` and token weights from
:func:`sequence_mean_token_weights`, the loss is the per-sequence-mean GRPO instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GRPOLossConfig", "grpo_loss", "sequence_mean_token_weights"]


@dataclass(kw_only=True)
class GRPOLossConfig:
    """Clipping and KL settings of the GRPO objective."""

    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clipped below at ``1 - clip_eps_low``."""
    clip_eps_high: float = 0.2
    """Upper clip: at ``1 + clip_eps_high``; DAPO's clip-higher uses e.g. 0.28."""
    kl_beta: float = 0.0
    """Coefficient of the k3 KL estimator to the reference policy; 0 disables the term."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low}")
        if not self.clip_eps_high >= 0.0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high}")
        if not (self.kl_beta >= 0.0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"kl_beta must be a finite number >= 0, got {self.kl_beta}")


def _per_token(value: torch.Tensor, *, like: torch.Tensor, name: str) -> torch.Tensor:
    """Broadcast a per-completion ``[N]`` or per-token ``[N, T]`` tensor to ``like``'s shape."""
    if value.shape == like.shape:
        return value.to(like.dtype)
    if value.dim() == 1 and like.dim() == 2 and value.shape[0] == like.shape[0]:
        return value.to(like.dtype)[:, None].expand_as(like)
    raise ValueError(
        f"{name} must be per completion [{like.shape[0]}] or per token {list(like.shape)}, got {list(value.shape)}"
    )


def _check_normaliser(normaliser: float | torch.Tensor) -> None:
    value = float(normaliser)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"normaliser must be a positive finite number (from the unpruned batch), got {value}")


def sequence_mean_token_weights(mask: torch.Tensor) -> torch.Tensor:
    """Per-token ``1 / len_j`` (0 at padding): turns the token sum into a sum of per-sequence means."""
    lengths = mask.sum(dim=-1, keepdim=True)
    return torch.where(mask.bool(), 1.0 / lengths.clamp(min=1).to(torch.float64), 0.0)


def grpo_loss(
    *,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    normaliser: float | torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    config: GRPOLossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss over a flat set of completions and its metrics.

    Args:
        logprobs: ``[N, T]`` log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: ``[N, T]`` log-probs under the rollout policy.
        advantages: ``[N]`` per completion (broadcast to its tokens) or ``[N, T]``.
        mask: ``[N, T]`` bool or 0/1: which tokens are valid completion tokens.
        normaliser: positive constant from the unpruned batch, e.g. its total valid tokens.
        ref_logprobs: ``[N, T]`` reference log-probs; required when ``kl_beta > 0``, and used
            for the ``kl`` metric whenever given.
        weights: ``[N]`` or ``[N, T]`` importance weights (DPPO ``1/(p q)``); None means 1.
        config: clipping and KL settings.

    Returns:
        ``(loss, metrics)``: metrics are detached scalars averaged over valid tokens without
        importance weights: ``clip_fraction``, ``ratio_mean``, ``kl`` (when ``ref_logprobs``),
        and the weighted, normalised parts ``policy_loss`` and ``kl_loss``.
    """
    config = config or GRPOLossConfig()
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [num_completions, num_tokens], got {list(logprobs.shape)}")
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name} must have the shape of logprobs {list(logprobs.shape)}, got {list(tensor.shape)}")
    if config.kl_beta > 0 and ref_logprobs is None:
        raise ValueError("kl_beta > 0 needs ref_logprobs")
    _check_normaliser(normaliser)

    valid = mask.bool()
    dtype = logprobs.dtype
    advantages = _per_token(advantages, like=logprobs, name="advantages")
    token_weights = valid.to(dtype)
    if weights is not None:
        token_weights = token_weights * _per_token(weights, like=logprobs, name="weights")

    # Zero the log-ratio at padding so exp() of garbage cannot produce inf * 0 = NaN.
    log_ratio = torch.where(valid, logprobs - old_logprobs.to(dtype), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    policy_term = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    policy_loss = (policy_term * token_weights).sum() / normaliser
    loss = policy_loss

    metrics: dict[str, torch.Tensor] = {}
    kl_loss = torch.zeros((), dtype=dtype, device=logprobs.device)
    if ref_logprobs is not None:
        log_ref_ratio = torch.where(valid, ref_logprobs.to(dtype) - logprobs, torch.zeros_like(logprobs))
        k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        if config.kl_beta > 0:
            kl_loss = config.kl_beta * (k3 * token_weights).sum() / normaliser
            loss = loss + kl_loss
        metrics["kl"] = _masked_mean(k3, valid)

    is_clipped = ((advantages > 0) & (ratio > 1.0 + config.clip_eps_high)) | (
        (advantages < 0) & (ratio < 1.0 - config.clip_eps_low)
    )
    metrics["clip_fraction"] = _masked_mean(is_clipped.to(dtype), valid)
    metrics["ratio_mean"] = _masked_mean(ratio, valid)
    metrics["policy_loss"] = policy_loss.detach()
    metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics


def _masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    count = valid.sum()
    if count == 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return (values.detach() * valid).sum() / count
