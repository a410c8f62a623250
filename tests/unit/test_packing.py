"""Window-based greedy packing, packed-row tensors and packed-vs-unpacked equivalence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_prune.data import GSM8K_SAMPLE
from megatron_prune.data.packing import (
    PackedRow,
    pack_sequences,
    pack_tensors,
    row_attention_mask,
    row_cu_seqlens,
    row_position_ids,
    row_segment_ids,
    unpack,
    unpack_row,
)

GSM8K = Path(GSM8K_SAMPLE)  # the bundled 300 GSM8K problems


def check_plan(plan, lengths, capacity):
    placed = sorted(i for row in plan.rows for i in row.sequence_indices)
    assert placed == list(range(len(lengths))), "every sequence exactly once"
    for row in plan.rows:
        assert row.used <= capacity and row.capacity == capacity
        assert list(row.lengths) == [lengths[i] for i in row.sequence_indices]
        expected_offsets = [sum(row.lengths[:k]) for k in range(len(row.lengths))]
        assert list(row.offsets) == expected_offsets
    assert plan.total_tokens == sum(lengths)
    if plan.rows:
        assert plan.density == pytest.approx(sum(lengths) / (plan.num_rows * capacity))


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), max_size=120),
    capacity=st.integers(64, 200),
    window=st.integers(1, 50),
    carry=st.booleans(),
)
def test_every_sequence_placed_once_and_rows_fit(lengths, capacity, window, carry):
    plan = pack_sequences(lengths, capacity=capacity, window=window, carry_open_rows=carry)
    check_plan(plan, lengths, capacity)
    # never worse than the trivial bound, never more rows than sequences
    assert plan.num_rows >= -(-sum(lengths) // capacity)
    assert plan.num_rows <= len(lengths)
    locations = plan.locations()
    for index, (row, offset) in enumerate(locations):
        assert plan.rows[row].offsets[plan.rows[row].sequence_indices.index(index)] == offset


def test_window_sorting_beats_plain_first_fit_and_carrying_rows_helps():
    lengths = [10, 60, 30, 70, 40, 90, 20, 80, 50, 100] * 10
    first_fit = pack_sequences(lengths, capacity=100, window=1)
    windowed = pack_sequences(lengths, capacity=100, window=10)
    closed = pack_sequences(lengths, capacity=100, window=10, carry_open_rows=False)
    assert windowed.density == 1.0  # pairs (10,90), (20,80), ...: first-fit decreasing finds them
    assert first_fit.density < windowed.density
    assert closed.density <= windowed.density


def test_empty_input_and_errors():
    plan = pack_sequences([], capacity=8)
    assert plan.num_rows == 0 and plan.density == 1.0
    with pytest.raises(ValueError, match="sequence 2 has length 9, longer than the row capacity 8"):
        pack_sequences([3, 4, 9], capacity=8)
    with pytest.raises(ValueError, match="sequence 1 has length 0"):
        pack_sequences([3, 0], capacity=8)
    with pytest.raises(ValueError, match="capacity"):
        pack_sequences([1], capacity=0)
    with pytest.raises(ValueError, match="window"):
        pack_sequences([1], capacity=4, window=0)


def test_row_tensors():
    row = PackedRow(sequence_indices=(4, 1), offsets=(0, 3), lengths=(3, 2), capacity=7)
    assert row_segment_ids(row).tolist() == [0, 0, 0, 1, 1, -1, -1]
    assert row_position_ids(row).tolist() == [0, 1, 2, 0, 1, 0, 1]
    assert row_cu_seqlens(row).tolist() == [0, 3, 5]
    assert row_cu_seqlens(row, include_padding=True).tolist() == [0, 3, 5, 7]
    assert row_cu_seqlens(row).dtype == torch.int32
    mask = row_attention_mask(row)
    assert mask.dtype == torch.bool and mask.shape == (7, 7)
    allowed = ~mask
    assert allowed[2, :3].all() and not allowed[2, 3:].any()  # causal inside sequence 0
    assert allowed[4, 3:5].all() and not allowed[4, :3].any()  # sequence 1 cannot see sequence 0
    assert not allowed[3, 4]  # causal
    assert allowed.any(dim=1).all(), "no fully masked query row"
    pieces = unpack_row(torch.arange(7), row)
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4]]


def test_cu_seqlens_of_a_full_row_has_no_empty_padding_segment():
    """A row without padding already ends at its capacity: the padded cu_seqlens (THD's
    ``cu_seqlens_*_padded``) are its plain ones, with no zero-length segment appended."""
    full = PackedRow(sequence_indices=(0, 1), offsets=(0, 3), lengths=(3, 4), capacity=7)
    assert full.padding == 0
    assert row_cu_seqlens(full).tolist() == [0, 3, 7]
    assert row_cu_seqlens(full, include_padding=True).tolist() == [0, 3, 7]


class TinyCausalAttention(torch.nn.Module):
    """One-head causal self-attention with RoPE-free learned positions; mask True = masked."""

    def __init__(self, vocab: int = 50, dim: int = 16, max_positions: int = 64) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab, dim, generator=generator, dtype=torch.float64))
        self.positions = torch.nn.Parameter(torch.randn(max_positions, dim, generator=generator, dtype=torch.float64))
        self.qkv = torch.nn.Parameter(torch.randn(dim, 3 * dim, generator=generator, dtype=torch.float64) / dim**0.5)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed[tokens] + self.positions[position_ids]
        q, k, v = (x @ self.qkv).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(mask, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


def test_packed_attention_equals_separate_runs():
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 17, 3, 9, 12, 1, 20, 7, 7, 2]
    sequences = [torch.randint(0, 50, (n,), generator=generator) for n in lengths]
    plan = pack_sequences(lengths, capacity=24, window=4)
    batch = pack_tensors(plan, sequences, pad_id=0)
    assert batch.tokens.shape == (plan.num_rows, 24) and batch.attention_mask.shape == (plan.num_rows, 1, 24, 24)
    model = TinyCausalAttention()
    packed_out = model(batch.tokens, batch.position_ids, batch.attention_mask[:, 0])
    assert torch.isfinite(packed_out).all()
    per_sequence = unpack(packed_out, plan)
    causal = lambda n: ~torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
    for index, tokens in enumerate(sequences):
        alone = model(tokens[None], torch.arange(len(tokens))[None], causal(len(tokens))[None])[0]
        torch.testing.assert_close(per_sequence[index], alone, rtol=1e-12, atol=1e-12)
    assert batch.valid.sum().item() == sum(lengths)
    for row, row_tokens in zip(plan.rows, batch.tokens):
        assert (row_tokens[row.used :] == 0).all()


def test_pack_tensors_validates():
    plan = pack_sequences([2, 3], capacity=8)
    with pytest.raises(ValueError, match="2 sequences"):
        pack_tensors(plan, [torch.zeros(2, dtype=torch.long)])
    with pytest.raises(ValueError, match="packed with length"):
        pack_tensors(plan, [torch.zeros(2, dtype=torch.long), torch.zeros(4, dtype=torch.long)])
    with pytest.raises(ValueError, match="values"):
        unpack(torch.zeros(3, 8), plan)


def test_density_on_gsm8k_lengths():
    """GSM8K lengths (question + answer characters / 4 as a token estimate) of the bundled 300 records."""
    with GSM8K.open() as handle:
        records = [json.loads(line) for _, line in zip(range(300), handle)]
    lengths = [max(1, (len(r["question"]) + len(r["answer"])) // 4) for r in records]
    capacity = 512
    lower_bound = -(-sum(lengths) // capacity)
    padded = sum(lengths) / (len(lengths) * max(lengths))  # one sequence per row, padded to the longest
    lines = [
        f"GSM8K lengths: n={len(lengths)} mean={sum(lengths) / len(lengths):.0f} max={max(lengths)}, "
        f"capacity {capacity}, at least {lower_bound} rows; one-per-row padded density {padded:.3f}"
    ]
    plans = {}
    for carry in (True, False):
        for window in (1, 16, 64, 400):
            plan = pack_sequences(lengths, capacity=capacity, window=window, carry_open_rows=carry)
            check_plan(plan, lengths, capacity)
            plans[window, carry] = plan
            lines.append(
                f"  window={window:3d} carry_open_rows={carry!s:5}: {plan.num_rows} rows, density {plan.density:.4f}"
            )
    print("\n" + "\n".join(lines))
    assert plans[64, True].density > 0.95 and plans[64, True].num_rows <= lower_bound + 3
    assert plans[400, True].density >= plans[1, True].density
    assert plans[64, True].density >= plans[64, False].density > 2 * padded


# --------------------------------------------------------------------------- GRPO training layouts


def _grpo_items(lengths):
    from megatron_prune.grpo.step import TrainItem

    return [TrainItem(prompt_id=k, index=0, prompt=[5 + k % 7] * max(1, n // 3),
                      completion=[100 + k] * (n - max(1, n // 3)), advantage=1.0) for k, n in enumerate(lengths)]


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(2, 30), min_size=0, max_size=40), mbs=st.integers(1, 12),
       dense=st.booleans(), pp=st.sampled_from([1, 2]))
def test_grpo_layout_runs_no_padding_rows(lengths, mbs, dense, pp):
    """The training passes run only the rows the items need: no microbatch is padded up to the
    micro batch size, no row is all padding (beyond fewer than one per microbatch under PP, where
    every microbatch has one shape), every completion token is scored exactly once at the position
    that predicts it, and the reported density is that of what runs."""
    from megatron_prune.grpo.loss import GRPOLossConfig
    from megatron_prune.grpo.step import GRPOStepSettings, layout_items

    items = _grpo_items(lengths)
    settings_ = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=mbs, pad_id=0, dense_packing=dense,
                                 pack_capacity=64, pad_multiple=8)
    layout = layout_items(items, settings=settings_, pp=pp)
    if dense and items:
        needed = pack_sequences([it.length for it in items], capacity=64, window=64).num_rows
    else:
        needed = max(len(items), 1)
    assert len(layout.batches) == -(-needed // mbs)
    run_rows = [b.tokens.shape[0] for b in layout.batches]
    assert all(r <= mbs for r in run_rows)
    if pp > 1:
        assert len(set(run_rows)) == 1
        assert sum(run_rows) - needed < len(run_rows)
    else:
        assert sum(run_rows) == needed
    slots = 0
    scored: list[int] = []
    for batch in layout.batches:
        rows, length = batch.tokens.shape
        assert length == layout.seq_length
        slots += rows * length
        sel = batch.selection
        if not batch.items:
            continue
        position, row = sel.index // rows, sel.index % rows
        assert torch.equal(batch.tokens[row, position + 1], sel.labels)  # position p predicts token p + 1
        counts = torch.bincount(sel.seq_ids, minlength=len(batch.items)).tolist()
        assert counts == [len(it.completion) for it in batch.items], "each completion token scored once"
        for k, it in enumerate(batch.items):
            assert sel.labels[sel.seq_ids == k].tolist() == it.completion
        real_rows = set(row.tolist())
        assert len(real_rows) >= rows - (1 if pp > 1 else 0), "a row of real tokens only"
        scored += [it.prompt_id for it in batch.items]
    assert sorted(scored) == list(range(len(items)))
    assert layout.row_tokens == slots
    assert layout.valid_tokens == sum(lengths)
    if items:
        assert layout.density == pytest.approx(sum(lengths) / slots)


def test_grpo_packed_density_on_short_completions():
    """Ten rows' worth of short sequences with a micro batch size of 32 run as ten dense rows, not 32."""
    from megatron_prune.grpo.loss import GRPOLossConfig
    from megatron_prune.grpo.step import GRPOStepSettings, layout_items

    items = _grpo_items([7] * 90)  # 630 tokens in 64-token rows: 10 rows of 9 sequences
    settings_ = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=32, pad_id=0, dense_packing=True,
                                 pack_capacity=64)
    layout = layout_items(items, settings=settings_)
    assert [b.tokens.shape[0] for b in layout.batches] == [10]
    assert layout.density >= 0.9, layout.density
