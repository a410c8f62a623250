"""Group-relative advantages for GRPO.

For rewards shaped ``[num_prompts, G]`` (G completions per prompt),
``A_ij = r_ij - mean_j r_ij``, optionally divided by ``std_j r_ij + eps``: the population std
(divide by G) with ``eps = 1e-6`` by default, or the sample std (divide by G - 1) with
``eps = 1e-4`` as TRL computes it (``--advantage-std sample``); the two differ by a factor
``sqrt(G / (G - 1))`` whenever the std is not tiny.
A group whose rewards are all equal has advantage 0 exactly.
Advantages are always computed on the *full* group, before any completion-level pruning
(docs/dppo.md explains why this matters for unbiasedness).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AdvantageConfig", "group_advantages", "zero_variance_groups"]


@dataclass(kw_only=True)
class AdvantageConfig:
    """How group-relative advantages are formed."""

    normalize_std: bool = True
    """Divide by the group's reward standard deviation (GRPO); False gives Dr. GRPO's ``r - mean``."""
    unbiased_std: bool = False
    """Use the sample std (divide by G-1) instead of the population std (divide by G)."""
    eps: float = 1e-6
    """Added to the std before dividing, so zero-variance groups give zero advantage, not NaN."""

    def __post_init__(self) -> None:
        if not self.eps > 0:
            raise ValueError(f"AdvantageConfig.eps must be > 0, got {self.eps}")


def group_advantages(rewards: torch.Tensor, *, config: AdvantageConfig | None = None) -> torch.Tensor:
    """Advantages ``[num_prompts, G]`` from rewards ``[num_prompts, G]``."""
    config = config or AdvantageConfig()
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, group_size], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got {rewards.dtype}")
    group_size = rewards.shape[1]
    if group_size < 1:
        raise ValueError("group_size must be >= 1")
    if config.normalize_std and config.unbiased_std and group_size < 2:
        raise ValueError("an unbiased std needs group_size >= 2")
    # A group of equal rewards has advantage 0 exactly. Its float mean can miss the common value
    # by a rounding residue (8 x 2/3 in fp32 leaves 6e-8), which the std (that same residue)
    # would scale up to about 0.06 for every completion of the group.
    centred = torch.where(zero_variance_groups(rewards)[:, None], 0.0,
                          rewards - rewards.mean(dim=1, keepdim=True))
    if not config.normalize_std or not rewards.shape[0]:  # no groups (every prompt pruned): nothing to scale
        return centred
    std = rewards.std(dim=1, keepdim=True, correction=1 if config.unbiased_std else 0)
    return centred / (std + config.eps)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Bool ``[num_prompts]``: groups whose rewards are all equal (every advantage is zero)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_prompts, group_size], got shape {tuple(rewards.shape)}")
    return (rewards == rewards[:, :1]).all(dim=1)
