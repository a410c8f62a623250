"""GRPO dense packing hands the model one attention segment per packed sequence, not an s^2 mask.

The layout's segments must mean exactly the block-diagonal causal mask of the packing
(``row_attention_mask``) on every real token, and the attention they cost is that of the
sequences, not of the rows. The numerics (packed == unpacked, at every parallel layout) are
checked by tests/distributed/test_grpo.py and test_grpo_objective.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_prune.data.packing import pack_sequences, row_attention_mask
from megatron_prune.grpo.loss import GRPOLossConfig
from megatron_prune.grpo.step import GRPOStepSettings, TrainItem, layout_items, microbatch_rows


def _items(n: int, seed: int = 0) -> list[TrainItem]:
    rng = random.Random(seed)
    return [
        TrainItem(prompt_id=k // 4, index=k % 4, prompt=[rng.randint(1, 50) for _ in range(rng.randint(3, 30))],
                  completion=[rng.randint(1, 50) for _ in range(rng.randint(1, 40))], advantage=1.0)
        for k in range(n)
    ]


def test_packed_rows_carry_segments_equal_to_the_packing_mask():
    items = _items(34)  # 11 rows in microbatches of 3, 3, 3 + 2 real rows and a placeholder
    settings = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=3, pad_id=0, dense_packing=True,
                                pack_capacity=128, pack_window=16)
    layout = layout_items(items, settings=settings, pp=2)
    plan = pack_sequences([it.length for it in items], capacity=128, window=16)
    spans = microbatch_rows(plan.num_rows, micro_batch_size=3, equal_shapes=True)
    assert len(spans) == len(layout.batches) and any(real < rows for _, real, rows in spans)
    pairs = dense_pairs = 0
    for batch, (start, real, rows) in zip(layout.batches, spans):
        assert batch.attention_mask is None and batch.segments is not None
        s = batch.tokens.shape[1]
        assert batch.segments.seq_length == s and batch.segments.batch_size == rows
        mask = batch.segments.dense_mask()
        for r, row in enumerate(plan.rows[start : start + real]):
            used = row.used
            assert torch.equal(mask[r, 0, :used, :used], row_attention_mask(row)[:used, :used])
        causal = ~torch.ones(s, s, dtype=torch.bool).tril()
        for r in range(real, rows):  # placeholder rows under PP: plain causal
            assert torch.equal(mask[r, 0], causal)
        pairs += batch.segments.attention_pairs()
        dense_pairs += batch.tokens.shape[0] * s * s
    assert pairs < 0.5 * dense_pairs


def test_padded_rows_stay_plain_causal():
    settings = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=2, pad_id=0)
    for batch in layout_items(_items(5), settings=settings).batches:
        assert batch.attention_mask is None and batch.segments is None


@pytest.mark.parametrize("packed", [False, True])
def test_a_group_longer_than_a_row_is_split_with_a_prompt_copy_per_part(packed):
    """--shared-prompt: a group of 4 x (40-token prompt + 30-token completion) = 160 tokens does not
    fit 128-token rows, so it is split; every part carries its own copy of the prompt, every row
    stays within the capacity, and each completion token still sees exactly its prompt and its own
    earlier tokens, at positions 0, 1, ..., in order."""
    prompt = list(range(1, 41))
    items = [TrainItem(prompt_id=0, index=j, prompt=prompt, completion=[100 + 10 * j + t for t in range(30)],
                       advantage=1.0) for j in range(4)]
    settings = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=2, pad_id=0, dense_packing=packed,
                                shared_prompt=True, pack_capacity=128)
    layout = layout_items(items, settings=settings)
    assert layout.seq_length <= 128
    scored = {}
    for batch in layout.batches:
        b = batch.tokens.shape[0]
        assert batch.tokens.shape[1] <= 128 and batch.segments is not None
        visible = ~batch.segments.dense_mask()[:, 0]  # [b, s, s]
        for index, label, seq in zip(*(t.tolist() for t in (batch.selection.index, batch.selection.labels,
                                                              batch.selection.seq_ids))):
            position, row = divmod(index, b)
            item = batch.items[seq]
            j = scored.setdefault(item.index, 0)
            keys = visible[row, position].nonzero().flatten()
            assert batch.tokens[row, keys].tolist() == prompt + item.completion[:j]
            assert batch.position_ids[row, keys].tolist() == list(range(len(prompt) + j))
            assert label == item.completion[j]
            scored[item.index] = j + 1
    assert scored == {j: 30 for j in range(4)}
    # a prompt copy takes 2 completions (40 + 2 x 30 <= 128 < 40 + 3 x 30): two parts, two copies
    assert sum(batch.tokens.eq(prompt[-1]).sum().item() for batch in layout.batches) == 2
