"""Deterministic, resumable sample order and data-parallel sharding.

The order of epoch ``e`` is a pure function of ``(seed, e, num_samples)``: a stable sort of
the indices by a 64-bit hash (splitmix64) of ``(seed, e, index)``, computed with plain integer
arithmetic, so it does not change with the numpy or torch version, the rank or the layout.
A :class:`EpochSampler` walks these orders epoch after epoch; its position is a small state
dict, so a resumed run continues with exactly the indices it would have seen.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Sequence, TypeVar

import numpy as np

logger = logging.getLogger(__name__)

T = TypeVar("T")
_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def epoch_permutation(num_samples: int, *, seed: int, epoch: int) -> list[int]:
    """The order of ``range(num_samples)`` in ``epoch`` for ``seed`` (a pure function)."""
    if num_samples < 0 or epoch < 0:
        raise ValueError(f"num_samples ({num_samples}) and epoch ({epoch}) must be >= 0")
    base = _splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    base = _splitmix64(base ^ np.uint64(epoch & _MASK64))
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.arange(num_samples, dtype=np.uint64) + base)
    return np.argsort(keys, kind="stable").tolist()


class EpochSampler:
    """Indices in epoch-shuffled order, forever; ``state_dict`` records the position.

    A request that runs past the end of an epoch continues with the next epoch's order, so no
    sample is dropped and every epoch visits each index exactly once.

    With ``distinct`` a request never holds an index twice (GRPO: a prompt's group is keyed by
    its index). Where a request crosses into the next epoch, an index it already took from the
    old epoch's tail is deferred: it opens the next request instead, still within its epoch.
    """

    def __init__(self, num_samples: int, *, seed: int, shuffle: bool = True, distinct: bool = False):
        if num_samples < 1:
            raise ValueError(f"EpochSampler needs at least one sample, got num_samples={num_samples}")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.distinct = distinct
        self.epoch = 0
        self.position = 0
        self.deferred: list[int] = []
        self._order: list[int] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        """The index order of ``epoch`` (identity order when ``shuffle`` is off)."""
        if not self.shuffle:
            return list(range(self.num_samples))
        return epoch_permutation(self.num_samples, seed=self.seed, epoch=epoch)

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` indices, advancing the position (across epochs if needed)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        if self.distinct:
            return self._next_distinct(count)
        # Indices a distinct request deferred (a resume may turn distinct off: another batch size) still
        # belong to this epoch's visit, so they come first here too.
        indices, self.deferred = self.deferred[:count], self.deferred[count:]
        while len(indices) < count:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            take = min(count - len(indices), self.num_samples - self.position)
            indices.extend(self._order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_samples:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return indices

    def _next_distinct(self, count: int) -> list[int]:
        if count > self.num_samples:
            raise ValueError(f"{count} distinct indices requested from {self.num_samples} samples")
        indices, self.deferred = self.deferred[:count], self.deferred[count:]
        taken, deferred = set(indices), []
        while len(indices) < count:
            if self._order is None:
                self._order = self.epoch_order(self.epoch)
            index = self._order[self.position]
            self.position += 1
            if self.position == self.num_samples:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
            if index in taken:  # only after crossing into a new epoch: its turn comes next request
                deferred.append(index)
            else:
                indices.append(index)
                taken.add(index)
        self.deferred = self.deferred + deferred
        return indices

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_indices(1)[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "deferred": list(self.deferred),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the seed, size and shuffle flag must match."""
        for key in ("seed", "num_samples", "shuffle"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"cannot resume sampler: saved {key}={state.get(key)!r} but this run has "
                    f"{key}={getattr(self, key)!r} (the data order would change)"
                )
        epoch, position = state.get("epoch"), state.get("position")
        valid_epoch = isinstance(epoch, int) and epoch >= 0
        if not valid_epoch or not isinstance(position, int) or not 0 <= position < self.num_samples:
            raise ValueError(f"cannot resume sampler: invalid epoch={epoch!r} position={position!r}")
        deferred = state.get("deferred", [])  # absent in states saved before deferral existed
        if not isinstance(deferred, list) or not all(isinstance(i, int) and 0 <= i < self.num_samples for i in deferred):
            raise ValueError(f"cannot resume sampler: invalid deferred indices {deferred!r}")
        self.epoch, self.position, self._order, self.deferred = epoch, position, None, list(deferred)


def dp_shard(global_batch: Sequence[T], *, dp_rank: int, dp_size: int) -> list[T]:
    """This data-parallel rank's contiguous slice of a global batch (equal slices per rank)."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, dp_size), got dp_rank={dp_rank}, dp_size={dp_size}")
    if len(global_batch) % dp_size:
        raise ValueError(
            f"global batch of {len(global_batch)} does not split evenly over {dp_size} data-parallel ranks"
        )
    per_rank = len(global_batch) // dp_size
    return list(global_batch[dp_rank * per_rank : (dp_rank + 1) * per_rank])
