"""Deterministic samplers for the prunings: pure functions of (seed, step, sample id).

Every draw uses its own counter-based generator keyed by (seed, step, sample id, what), so all
TP/PP/DP ranks, any layout and a resumed run draw exactly the same values without talking.
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Hashable

import torch


def canonical_id(item_id: Hashable) -> int | str | tuple:
    """``item_id`` as a plain int, str or tuple of them, so that ``5``, ``numpy.int64(5)`` and
    ``torch.tensor(5)`` key the same draws."""
    if isinstance(item_id, str):
        return item_id
    if isinstance(item_id, tuple):
        return tuple(canonical_id(part) for part in item_id)
    try:
        return operator.index(item_id)
    except TypeError:
        raise ValueError(f"item ids must be ints, strings or tuples of them, got {item_id!r}") from None


def draw_key(seed: int, step: int, sample_id: int, what: str) -> int:
    """A 63-bit generator seed for one draw."""
    digest = hashlib.blake2b(f"{seed}/{step}/{sample_id}/{what}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def generator(seed: int, step: int, sample_id: int, what: str) -> torch.Generator:
    return torch.Generator().manual_seed(draw_key(seed, step, sample_id, what))


def uniform(seed: int, step: int, sample_id: int, what: str) -> float:
    """One U[0, 1) draw."""
    return float(torch.rand((), generator=generator(seed, step, sample_id, what), dtype=torch.float64))


def prefix_length(length: int, *, min_ratio: float, seed: int, step: int, sample_id: int, what: str) -> int:
    """Kept prefix of a response of ``length`` tokens: ceil(rho * length), rho ~ U(min_ratio, 1).

    At least one token is kept; ``min_ratio == 1`` keeps everything (sequence pruning off).
    """
    if min_ratio >= 1.0 or length <= 1:
        return length
    rho = min_ratio + (1.0 - min_ratio) * uniform(seed, step, sample_id, what)
    return max(1, min(length, math.ceil(rho * length)))


def position_subset(length: int, *, ratio: float, seed: int, step: int, sample_id: int, what: str) -> torch.Tensor:
    """Sorted uniform subset of ``max(1, round(ratio * length))`` of ``range(length)``.

    ``ratio == 1`` returns every position (position pruning off).
    """
    if ratio >= 1.0:
        return torch.arange(length)
    k = max(1, min(length, round(ratio * length)))
    perm = torch.randperm(length, generator=generator(seed, step, sample_id, what))
    return perm[:k].sort().values


def keep_chosen_branch(*, chosen_prob: float, seed: int, step: int, sample_id: int) -> bool:
    """Branch pruning: True keeps the chosen branch's backward (probability q_w)."""
    return uniform(seed, step, sample_id, "branch") < chosen_prob
