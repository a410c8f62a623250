"""The concat layout's attention mask, against its definition written out position by position.

A concat row packs a pair's chosen and rejected sequences (and trailing padding); a token may
attend exactly to the tokens at or before it *in its own sequence*, and position ids restart at
every sequence. Under one causal mask over the whole row the rejected response would read the
chosen one: the loss changes while every shape stays right.
"""

from __future__ import annotations

import torch

from megatron_prune.config import PruneConfig
from megatron_prune.data.preference import PreferencePair
from megatron_prune.dpo.batch import CHOSEN, REJECTED, build_microbatch, plan_pair

OFF = PruneConfig(position_ratio=1.0, seq_min_ratio=1.0, branch=False)


def test_concat_rows_mask_each_sequence_from_the_others():
    pairs = [PreferencePair([5, 6, 7], [8, 9], [10, 11, 12, 13], "mem", 0),
             PreferencePair([5, 6], [14, 15, 16], [17], "mem", 1)]
    plans = [plan_pair(p, sample_id=i, step=0, seed=0, prune=OFF) for i, p in enumerate(pairs)]
    seq_length = 16
    batch = build_microbatch(plans, branches=[[CHOSEN, REJECTED]] * 2, layout="concat", seq_length=seq_length,
                             pad_id=0)
    assert batch.attention_mask is None  # attention follows the segments
    mask = batch.segments.dense_mask()
    assert mask.shape == (2, 1, seq_length, seq_length)
    for row, plan in enumerate(plans):
        lengths = [len(plan.prompt) + len(plan.responses[b]) for b in (CHOSEN, REJECTED)]
        segment = [0] * lengths[0] + [1] * lengths[1] + [2] * (seq_length - sum(lengths))  # 2 = padding
        positions = list(range(lengths[0])) + list(range(lengths[1]))
        for q in range(seq_length):
            for k in range(seq_length):
                allowed = segment[q] == segment[k] and (k <= q if segment[q] < 2 else k == q)  # padding: itself
                assert bool(mask[row, 0, q, k]) is not allowed, (row, q, k)
        assert batch.position_ids[row, : sum(lengths)].tolist() == positions
        assert torch.equal(batch.tokens[row, : sum(lengths)],
                           torch.tensor(plan.prompt + plan.responses[CHOSEN] + plan.prompt + plan.responses[REJECTED]))
