"""Segment layouts: which keys each query of a microbatch may attend to.

A row of a microbatch holds *segments*: runs of tokens that attend causally to themselves and
fully to an optional *prefix* earlier in the same row (a shared prompt). A shared DPO row
``[prompt(P), chosen(C), rejected(R)]`` is ``Segment(0, P)``, ``Segment(P, P+C, 0, P)``,
``Segment(P+C, P+C+R, 0, P)``; a densely packed row is one prefix-less segment per sequence.
Positions covered by no segment are padding and attend to themselves only, so no query row is
fully masked.

:meth:`SegmentLayout.dense_mask` is the reference semantics (Megatron's ``[b, 1, s, s]`` bool
mask, ``True`` = masked). :meth:`SegmentLayout.to_table` encodes the layout as a small int64
tensor, the form in which it travels through Megatron's transformer block to
:class:`megatron_prune.model.segment_attention.SegmentAttention` (see that module).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Segment", "SegmentLayout", "TABLE_FIELDS"]

TABLE_FIELDS = 4
"""Columns of :meth:`SegmentLayout.to_table`: start, end, prefix_start, prefix_end."""


@dataclass(frozen=True)
class Segment:
    """A run of tokens in one row that attends causally to itself and fully to an optional prefix."""

    start: int
    """First token of the segment in its row."""
    end: int
    """One past its last token; attention is causal inside ``[start, end)`` (empty when equal)."""
    prefix_start: int = 0
    """First key of the prefix every query of the segment also sees."""
    prefix_end: int = 0
    """One past the prefix's last key; ``prefix_end <= start``; no prefix when equal to ``prefix_start``."""

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def prefix_length(self) -> int:
        return self.prefix_end - self.prefix_start


@dataclass
class SegmentLayout:
    """Which keys each query of a ``[b, s]`` microbatch may attend to."""

    rows: list[list[Segment]]
    """Segments of each row; positions covered by no segment are padding."""
    seq_length: int
    """s: tokens per row."""

    def __post_init__(self) -> None:
        self.rows = [list(row) for row in self.rows]
        if self.seq_length < 1:
            raise ValueError(f"a segment layout needs seq_length >= 1, got {self.seq_length}")
        for r, row in enumerate(self.rows):
            covered = sorted((seg.start, seg.end) for seg in row if seg.end > seg.start)
            for seg in row:
                where = f"row {r}: {seg}"
                if not 0 <= seg.start <= seg.end <= self.seq_length:
                    raise ValueError(f"{where} does not lie inside a row of {self.seq_length} tokens")
                if not 0 <= seg.prefix_start <= seg.prefix_end:
                    raise ValueError(f"{where} has a prefix that ends before it starts")
                if seg.prefix_length and seg.prefix_end > seg.start:
                    raise ValueError(f"{where}: its prefix must end at or before the segment's first token")
            for (_, end), (start, _) in zip(covered, covered[1:]):
                if start < end:
                    raise ValueError(f"row {r}: segments overlap at token {start}")

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def dense_mask(self) -> torch.Tensor:
        """``[b, 1, s, s]`` bool, ``True`` = masked: the attention the layout means, written out."""
        s = self.seq_length
        allowed = torch.zeros(self.batch_size, s, s, dtype=torch.bool)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        for r, row in enumerate(self.rows):
            covered = torch.zeros(s, dtype=torch.bool)
            for seg in row:
                own = slice(seg.start, seg.end)
                allowed[r, own, own] = causal[: seg.length, : seg.length]
                allowed[r, own, seg.prefix_start : seg.prefix_end] = True
                covered[own] = True
            padding = (~covered).nonzero().flatten()
            allowed[r, padding, padding] = True
        return ~allowed[:, None]

    def to_table(self) -> torch.Tensor:
        """``[b, n, 4]`` int64 (CPU): each row's segments as ``start, end, prefix_start, prefix_end``.

        Rows with fewer than ``n`` segments are filled with ``-1`` rows; empty segments are left out.
        """
        kept = [[seg for seg in row if seg.length > 0] for row in self.rows]
        n = max((len(row) for row in kept), default=0)
        table = torch.full((self.batch_size, max(n, 1), TABLE_FIELDS), -1, dtype=torch.long)
        for r, row in enumerate(kept):
            for k, seg in enumerate(row):
                table[r, k] = torch.tensor([seg.start, seg.end, seg.prefix_start, seg.prefix_end])
        return table

    @classmethod
    def from_table(cls, table: torch.Tensor, *, seq_length: int) -> SegmentLayout:
        """Inverse of :meth:`to_table`."""
        assert table.dim() == 3 and table.shape[-1] == TABLE_FIELDS, "not a segment table"
        rows = [[Segment(*entry) for entry in row if entry[0] >= 0] for row in table.tolist()]
        return cls(rows=rows, seq_length=seq_length)

    def attention_pairs(self) -> int:
        """Query-key pairs segment attention computes: ``sum len * (prefix + (len + 1) / 2)`` plus one per padding token."""
        pairs = 0
        for row in self.rows:
            for seg in row:
                pairs += seg.length * seg.prefix_length + seg.length * (seg.length + 1) // 2
            pairs += self.seq_length - sum(seg.length for seg in row)
        return pairs
