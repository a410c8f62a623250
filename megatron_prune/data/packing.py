"""Dense sequence packing: a window-based greedy packer and packed-row tensors.

:func:`pack_sequences` places variable-length sequences (in arrival order) into rows of
a fixed token capacity. It reads the next ``window`` sequences, sorts them by length
(longest first) and puts each into the first open row with room (first-fit
decreasing), opening a new row when none has room.

Open rows stay open across windows by default (``carry_open_rows=True``): a short
sequence arriving later can fill a hole left by an earlier window, which comes close to
a global first-fit-decreasing, while the window bounds how far the order is disturbed.
On 400 GSM8K-like lengths (mean 135, max 400 tokens) in 512-token rows: 108 rows
(density 0.975, lower bound 106) with window 64, against 110 rows when each window
closes its rows and a density of 0.34 with one padded sequence per row
(tests/unit/test_packing.py prints the table). With ``carry_open_rows=False``
every window closes its rows, so a row holds only sequences from one window (a
streaming packer that can emit rows as soon as a window is placed).

For a packed row the helpers build the token tensor, position ids that restart at each
sequence, a block-diagonal causal attention mask (``True`` = masked, Megatron's
convention), ``cu_seqlens`` for THD / ``PackedSeqParams``, and map per-token outputs
back to per-sequence order. The padding at the end of a row is treated as one extra
segment that attends only to itself, so no query row of the mask is fully masked (a
fully masked softmax row is NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "PackedRow",
    "PackingPlan",
    "PackedBatch",
    "pack_sequences",
    "row_segment_ids",
    "row_position_ids",
    "row_attention_mask",
    "row_cu_seqlens",
    "build_row_tokens",
    "pack_tensors",
    "unpack_row",
    "unpack",
]


@dataclass(frozen=True)
class PackedRow:
    """One row of the packing: which sequences it holds and where."""

    sequence_indices: tuple[int, ...]
    """Indices (into the packer's input) of the sequences, in row order."""
    offsets: tuple[int, ...]
    """Start position of each sequence in the row."""
    lengths: tuple[int, ...]
    """Length of each sequence."""
    capacity: int
    """Row length in tokens."""

    @property
    def used(self) -> int:
        """Valid tokens in the row."""
        return sum(self.lengths)

    @property
    def padding(self) -> int:
        """Padding tokens at the end of the row."""
        return self.capacity - self.used


@dataclass(frozen=True)
class PackingPlan:
    """The rows of a packing and its valid-token density."""

    rows: tuple[PackedRow, ...]
    """The packed rows, in the order they were opened."""
    capacity: int
    """Row length in tokens."""
    num_sequences: int
    """How many sequences were packed."""

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def total_tokens(self) -> int:
        """Valid tokens over all rows."""
        return sum(row.used for row in self.rows)

    @property
    def density(self) -> float:
        """Valid-token density: total tokens / (rows * capacity); 1.0 for an empty plan."""
        if not self.rows:
            return 1.0
        return self.total_tokens / (self.num_rows * self.capacity)

    def locations(self) -> list[tuple[int, int]]:
        """``(row, offset)`` of every sequence, indexed by sequence index."""
        found: list[tuple[int, int] | None] = [None] * self.num_sequences
        for row_index, row in enumerate(self.rows):
            for index, offset in zip(row.sequence_indices, row.offsets):
                found[index] = (row_index, offset)
        assert all(item is not None for item in found), "a packing plan lost a sequence"
        return found  # type: ignore[return-value]


class _OpenRow:
    __slots__ = ("serial", "indices", "offsets", "lengths", "used")

    def __init__(self, serial: int) -> None:
        self.serial = serial
        self.indices: list[int] = []
        self.offsets: list[int] = []
        self.lengths: list[int] = []
        self.used = 0

    def add(self, index: int, length: int) -> None:
        self.indices.append(index)
        self.offsets.append(self.used)
        self.lengths.append(length)
        self.used += length

    def freeze(self, capacity: int) -> PackedRow:
        return PackedRow(tuple(self.indices), tuple(self.offsets), tuple(self.lengths), capacity)


def _check_lengths(lengths: Sequence[int], capacity: int) -> list[int]:
    checked = []
    for index, length in enumerate(lengths):
        length = int(length)
        if length <= 0:
            raise ValueError(f"sequence {index} has length {length}; lengths must be positive")
        if length > capacity:
            raise ValueError(f"sequence {index} has length {length}, longer than the row capacity {capacity}")
        checked.append(length)
    return checked


def pack_sequences(
    lengths: Sequence[int], *, capacity: int, window: int = 64, carry_open_rows: bool = True
) -> PackingPlan:
    """Pack sequences of ``lengths`` (in arrival order) into rows of ``capacity`` tokens.

    Args:
        lengths: length of each sequence, in arrival order.
        capacity: tokens per row; a longer sequence is a ``ValueError`` naming it.
        window: how many upcoming sequences are sorted together (1 = plain first fit).
        carry_open_rows: keep rows with room open for later windows (denser) instead of
            closing them at the end of each window.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    checked = _check_lengths(lengths, capacity)
    closed: list[_OpenRow] = []
    open_rows: list[_OpenRow] = []
    for start in range(0, len(checked), window):
        chunk = range(start, min(start + window, len(checked)))
        for index in sorted(chunk, key=lambda i: (-checked[i], i)):
            row = next((r for r in open_rows if r.used + checked[index] <= capacity), None)
            if row is None:
                row = _OpenRow(serial=len(closed) + len(open_rows))
                open_rows.append(row)
            row.add(index, checked[index])
        if carry_open_rows:
            closed.extend(r for r in open_rows if r.used == capacity)
            open_rows = [r for r in open_rows if r.used < capacity]
        else:
            closed.extend(open_rows)
            open_rows = []
    closed.extend(open_rows)
    rows = sorted(closed, key=lambda r: r.serial)
    return PackingPlan(rows=tuple(r.freeze(capacity) for r in rows), capacity=capacity, num_sequences=len(checked))


# ---------------------------------------------------------------------------------------
# tensors of a packed row
# ---------------------------------------------------------------------------------------


def row_segment_ids(row: PackedRow) -> torch.Tensor:
    """Long ``[capacity]``: slot ``k`` for tokens of the row's k-th sequence, -1 for padding."""
    segments = torch.full((row.capacity,), -1, dtype=torch.long)
    for slot, (offset, length) in enumerate(zip(row.offsets, row.lengths)):
        segments[offset : offset + length] = slot
    return segments


def row_position_ids(row: PackedRow) -> torch.Tensor:
    """Long ``[capacity]``: positions restarting at 0 for every sequence (and for the padding)."""
    positions = torch.empty(row.capacity, dtype=torch.long)
    for offset, length in zip(row.offsets, row.lengths):
        positions[offset : offset + length] = torch.arange(length)
    positions[row.used :] = torch.arange(row.padding)
    return positions


def row_attention_mask(row: PackedRow) -> torch.Tensor:
    """Bool ``[capacity, capacity]``, ``True`` = masked: causal inside each sequence, nothing across.

    The trailing padding forms its own causal segment, so every query sees at least itself.
    """
    segments = row_segment_ids(row)
    same_segment = segments[:, None] == segments[None, :]
    causal = torch.ones(row.capacity, row.capacity, dtype=torch.bool).tril()
    return ~(same_segment & causal)


def row_cu_seqlens(row: PackedRow, *, include_padding: bool = False) -> torch.Tensor:
    """Int32 cumulative sequence lengths ``[0, l_0, l_0 + l_1, ...]`` for THD attention.

    With ``include_padding`` the trailing padding is appended as one more segment so that
    the last entry equals the capacity (as ``cu_seqlens_*_padded`` expects).
    """
    bounds = [0]
    for length in row.lengths:
        bounds.append(bounds[-1] + length)
    if include_padding and row.padding:
        bounds.append(row.capacity)
    return torch.tensor(bounds, dtype=torch.int32)


def build_row_tokens(row: PackedRow, sequences: Sequence[torch.Tensor], *, pad_id: int = 0) -> torch.Tensor:
    """``[capacity, ...]`` tensor of the row, ``sequences`` indexed like the packer's input."""
    first = sequences[row.sequence_indices[0]]
    out = torch.full((row.capacity, *first.shape[1:]), pad_id, dtype=first.dtype)
    for index, offset, length in zip(row.sequence_indices, row.offsets, row.lengths):
        sequence = sequences[index]
        if sequence.shape[0] != length:
            raise ValueError(f"sequence {index} has {sequence.shape[0]} tokens but was packed with length {length}")
        out[offset : offset + length] = sequence
    return out


@dataclass(frozen=True)
class PackedBatch:
    """All rows of a plan as tensors (Megatron's ``[b, s]`` / ``[b, 1, s, s]`` layouts)."""

    tokens: torch.Tensor
    """``[rows, capacity]`` packed tokens, padded with ``pad_id``."""
    position_ids: torch.Tensor
    """``[rows, capacity]`` positions restarting at every sequence."""
    attention_mask: torch.Tensor
    """``[rows, 1, capacity, capacity]`` bool, True = masked."""
    segment_ids: torch.Tensor
    """``[rows, capacity]`` slot of the sequence in its row, -1 at padding."""
    valid: torch.Tensor
    """``[rows, capacity]`` bool, True at real tokens."""


def pack_tensors(plan: PackingPlan, sequences: Sequence[torch.Tensor], *, pad_id: int = 0) -> PackedBatch:
    """Build the packed tensors of ``plan`` from the per-sequence tensors."""
    if len(sequences) != plan.num_sequences:
        raise ValueError(f"plan packs {plan.num_sequences} sequences, got {len(sequences)}")
    segments = torch.stack([row_segment_ids(row) for row in plan.rows])
    return PackedBatch(
        tokens=torch.stack([build_row_tokens(row, sequences, pad_id=pad_id) for row in plan.rows]),
        position_ids=torch.stack([row_position_ids(row) for row in plan.rows]),
        attention_mask=torch.stack([row_attention_mask(row) for row in plan.rows])[:, None],
        segment_ids=segments,
        valid=segments >= 0,
    )


def unpack_row(values: torch.Tensor, row: PackedRow) -> list[torch.Tensor]:
    """Split per-token ``[capacity, ...]`` outputs of one row into its sequences (row order)."""
    if values.shape[0] != row.capacity:
        raise ValueError(f"row values have {values.shape[0]} positions, capacity is {row.capacity}")
    return [values[offset : offset + length] for offset, length in zip(row.offsets, row.lengths)]


def unpack(values: torch.Tensor, plan: PackingPlan) -> list[torch.Tensor]:
    """Per-token ``[rows, capacity, ...]`` outputs back to one tensor per sequence, in input order."""
    if values.shape[:2] != (plan.num_rows, plan.capacity):
        raise ValueError(f"values must start with [{plan.num_rows}, {plan.capacity}], got {list(values.shape)}")
    out: list[torch.Tensor | None] = [None] * plan.num_sequences
    for row_values, row in zip(values, plan.rows):
        for index, piece in zip(row.sequence_indices, unpack_row(row_values, row)):
            out[index] = piece
    return out  # type: ignore[return-value]
