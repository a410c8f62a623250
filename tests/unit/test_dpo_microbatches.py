"""DPO microbatch grouping: pairs of similar row length share a microbatch, sizes stay equal."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_prune.config import DPOConfig, PruneConfig
from megatron_prune.data.preference import PreferencePair
from megatron_prune.dpo.batch import CHOSEN, REJECTED, build_microbatch, round_up, row_length
from megatron_prune.dpo.step import DPOStep, DPOStepSettings

OFF = PruneConfig(position_ratio=1.0, seq_min_ratio=1.0, branch=False)


def step_for(layout: str, mbs: int, prune: PruneConfig = OFF, *, pack_rows: bool = False) -> DPOStep:
    runner = object.__new__(DPOStep)  # grouping needs no model or process groups
    runner.s = DPOStepSettings(dpo=DPOConfig(layout=layout, pack_rows=pack_rows), prune=prune, seed=3,
                               micro_batch_size=mbs, pad_id=0)
    return runner


def pairs(n: int, seed: int = 0) -> list[tuple[int, PreferencePair]]:
    rng = random.Random(seed)
    return [(i, PreferencePair([1] * rng.randint(5, 60), [2] * rng.randint(1, 40), [3] * rng.randint(1, 40),
                               "mem", i)) for i in range(n)]


def padded_tokens(groups, layout, branches_of) -> int:
    total = 0
    for g in groups:
        branches = [branches_of(p) for p in g]
        batch = build_microbatch(g, branches=branches, layout=layout, pad_id=0,
                                 seq_length=round_up(row_length(g, layout=layout, branches=branches), 8))
        total += batch.tokens.numel()
    return total


@pytest.mark.parametrize("layout", ["concat", "full"])
def test_groups_are_length_sorted_equal_sized_and_pad_less(layout):
    runner = step_for(layout, mbs=2)
    plans = runner.plan(0, pairs(12))
    both = lambda p: [CHOSEN, REJECTED]  # noqa: E731
    groups = runner._groups(plans, both)
    assert [len(g) for g in groups] == [2] * 6
    assert sorted(p.sample_id for g in groups for p in g) == list(range(12))  # every pair exactly once
    lengths = [row_length([p], layout=layout, branches=[both(p)]) for g in groups for p in g]
    assert lengths == sorted(lengths, reverse=True)
    in_order = [plans[i : i + 2] for i in range(0, 12, 2)]
    assert padded_tokens(groups, layout, both) < padded_tokens(in_order, layout, both)


def test_each_pass_groups_by_its_own_rows():
    """Under branch pruning the kept and the pruned branch make different rows, hence groups."""
    runner = step_for("concat", mbs=2, prune=PruneConfig(position_ratio=1.0, seq_min_ratio=1.0, branch=True))
    plans = runner.plan(0, pairs(8, seed=1))
    kept = runner._groups(plans, lambda p: [p.kept_branch])
    pruned = runner._groups(plans, lambda p: [1 - p.kept_branch])
    for groups, branch_of in ((kept, lambda p: p.kept_branch), (pruned, lambda p: 1 - p.kept_branch)):
        lengths = [len(p.prompt) + len(p.responses[branch_of(p)]) for g in groups for p in g]
        assert lengths == sorted(lengths, reverse=True)
    assert [p.sample_id for g in kept for p in g] != [p.sample_id for g in pruned for p in g]


@pytest.mark.parametrize("layout, mbs, n", [("concat", 2, 12), ("shared", 2, 12), ("concat", 4, 10), ("shared", 3, 16)])
def test_packed_rows_balance_the_microbatches_tokens(layout, mbs, n):
    """With packed rows nothing pads between pairs, so the grouping balances tokens instead: the
    longest packed row (the pass's peak, and under PP every microbatch's length) is shorter than
    with the length-sorted grouping, and the microbatch sizes are those of the padded grouping."""
    both = lambda p: [CHOSEN, REJECTED]  # noqa: E731
    packed, padded = step_for(layout, mbs, pack_rows=True), step_for(layout, mbs)
    plans = packed.plan(0, pairs(n, seed=2))
    groups, sorted_groups = packed._groups(plans, both), padded._groups(plans, both)
    assert [len(g) for g in groups] == [len(g) for g in sorted_groups]
    assert sorted(p.sample_id for g in groups for p in g) == list(range(n))  # every pair exactly once
    lengths = {p.sample_id: row_length([p], layout=layout, branches=[both(p)]) for p in plans}
    tokens = [sum(lengths[p.sample_id] for p in g) for g in groups]
    sorted_tokens = [sum(lengths[p.sample_id] for p in g) for g in sorted_groups]
    assert max(tokens) < max(sorted_tokens)
    full = [t for t, g in zip(tokens, groups) if len(g) == mbs]  # the remainder group is lighter by design
    assert max(full) - min(full) < max(lengths.values())  # within one pair of balanced
    assert packed._groups(plans, both) == groups  # a pure function of the plans


def test_last_group_holds_the_remainder():
    runner = step_for("concat", mbs=4)
    groups = runner._groups(runner.plan(0, pairs(10)), lambda p: [CHOSEN, REJECTED])
    assert [len(g) for g in groups] == [4, 4, 2]


def _plan(prompt, chosen, rejected, *, sample_id=0, prune=OFF, step=0):
    from megatron_prune.dpo.batch import plan_pair

    return plan_pair(PreferencePair(prompt, chosen, rejected, "mem", sample_id), sample_id=sample_id, step=step,
                     seed=3, prune=prune)


def test_shared_row_layout_positions_and_scored_tokens():
    """[prompt(3), chosen(2), rejected(3)]: rejected rotates as if it followed the prompt, both first
    tokens are scored from the prompt's last position, later tokens from their own previous one."""
    from megatron_prune.model.segments import Segment

    plan = _plan([11, 12, 13], [21, 22], [31, 32, 33])
    assert row_length([plan], layout="shared", branches=[[CHOSEN, REJECTED]]) == 8
    assert row_length([plan], layout="concat", branches=[[CHOSEN, REJECTED]]) == 11
    batch = build_microbatch([plan], branches=[[CHOSEN, REJECTED]], layout="shared", seq_length=10, pad_id=0)
    assert batch.tokens.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 0, 0]]
    assert batch.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 3, 4, 5]
    assert batch.attention_mask is None
    assert batch.segments.rows == [[Segment(0, 3), Segment(3, 5, 0, 3), Segment(5, 8, 0, 3)]]
    # One row: flat index = position; chosen 21 <- 2, 22 <- 3; rejected 31 <- 2, 32 <- 5, 33 <- 6.
    assert batch.selection.index.tolist() == [2, 3, 2, 5, 6]
    assert batch.selection.labels.tolist() == [21, 22, 31, 32, 33]
    assert batch.selection.seq_ids.tolist() == [0, 0, 1, 1, 1]
    assert [(r.branch, r.num_scored, r.length) for r in batch.responses] == [(CHOSEN, 2, 2), (REJECTED, 3, 3)]
    assert batch.executed_tokens == 8
    mask = batch.segments.dense_mask()[0, 0]
    allowed = {q: [k for k in range(10) if not mask[q, k]] for q in range(8)}
    assert allowed[4] == [0, 1, 2, 3, 4]  # chosen: prompt + itself
    assert allowed[6] == [0, 1, 2, 5, 6]  # rejected: prompt + itself, never chosen


def test_shared_rows_in_a_microbatch_of_two_and_one_branch_rows():
    from megatron_prune.model.segments import Segment

    a, b = _plan([1, 2], [3], [4, 5], sample_id=0), _plan([6, 7, 8], [9, 10], [12], sample_id=1)
    batch = build_microbatch([a, b], branches=[[REJECTED], [CHOSEN, REJECTED]], layout="shared", seq_length=8,
                             pad_id=0, num_rows=3)
    assert batch.tokens.tolist() == [[1, 2, 4, 5, 0, 0, 0, 0], [6, 7, 8, 9, 10, 12, 0, 0], [0] * 8]
    assert batch.segments.rows == [[Segment(0, 4)], [Segment(0, 3), Segment(3, 5, 0, 3), Segment(5, 6, 0, 3)], []]
    assert batch.position_ids[1, :6].tolist() == [0, 1, 2, 3, 4, 3]
    # flat index = position * 3 rows + row
    assert batch.selection.index.tolist() == [1 * 3 + 0, 2 * 3 + 0, 2 * 3 + 1, 3 * 3 + 1, 2 * 3 + 1]
    assert batch.selection.labels.tolist() == [4, 5, 9, 10, 12]


def test_concat_rows_are_independent_segments_with_restarting_positions():
    from megatron_prune.model.segments import Segment

    plan = _plan([1, 2], [3], [4, 5])
    batch = build_microbatch([plan], branches=[[CHOSEN, REJECTED]], layout="concat", seq_length=8, pad_id=0)
    assert batch.attention_mask is None
    assert batch.segments.rows == [[Segment(0, 3), Segment(3, 7)]]
    assert batch.position_ids[0, :7].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert build_microbatch([plan], branches=[[CHOSEN, REJECTED]], layout="full", seq_length=8,
                            pad_id=0).segments is None


def test_shared_layout_groups_by_prompt_plus_both_responses():
    runner = step_for("shared", mbs=2)
    plans = runner.plan(0, pairs(10, seed=2))
    both = lambda p: [CHOSEN, REJECTED]  # noqa: E731
    groups = runner._groups(plans, both)
    lengths = [len(p.prompt) + len(p.responses[0]) + len(p.responses[1]) for g in groups for p in g]
    assert lengths == sorted(lengths, reverse=True)
    assert padded_tokens(groups, "shared", both) < padded_tokens(groups, "concat", both)


def test_pruned_branch_joins_the_training_row_when_that_is_cheaper():
    from megatron_prune.dpo.batch import FlopWeights, pruned_branch_joins_training_row

    weights = FlopWeights(body=100.0, attention=1.0, head=50.0)
    branch = PruneConfig(position_ratio=1.0, seq_min_ratio=1.0, branch=True)
    long_prompt = _plan([1] * 40, [2] * 5, [3] * 5, prune=branch)
    short_prompt = _plan([1] * 5, [2] * 40, [3] * 40, prune=branch)
    assert pruned_branch_joins_training_row(long_prompt, weights=weights)  # prompt again >> backward of 5 tokens
    assert not pruned_branch_joins_training_row(short_prompt, weights=weights)
    # The attention term alone decides it too: a long prompt is quadratic to run again.
    no_body = FlopWeights(body=0.0, attention=1.0, head=0.0)
    assert pruned_branch_joins_training_row(_plan([1] * 30, [2] * 4, [3] * 4, prune=branch), weights=no_body)


def test_flop_weights_count_a_moe_layers_active_experts():
    """The cost model that picks where a pruned branch runs counts what a token computes: a MoE
    layer's router and its top-k experts, a dense layer's MLP (not a dense MLP everywhere)."""
    from types import SimpleNamespace

    from megatron_prune.dpo.step import _flop_weights

    h, heads, kv_heads, head_dim, layers, vocab = 64, 4, 2, 16, 4, 512
    common = dict(hidden_size=h, num_attention_heads=heads, num_query_groups=kv_heads, kv_channels=head_dim,
                  gated_linear_unit=True, ffn_hidden_size=128, num_layers=layers)
    attention = h * (heads + 2 * kv_heads) * head_dim + heads * head_dim * h
    for moe, mlp in (
        (dict(num_moe_experts=None), [3 * h * 128] * layers),
        (dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1, 1]),
         [3 * h * 128] + [h * 4 + 2 * 3 * h * 32] * 3),
        (dict(num_moe_experts=8, moe_router_topk=1, moe_ffn_hidden_size=16, moe_layer_freq=2),
         [h * 8 + 3 * h * 16, 3 * h * 128] * 2),
    ):
        chunk = torch.nn.Module()
        chunk.config, chunk.vocab_size = SimpleNamespace(**common, **moe), vocab
        weights = _flop_weights(chunk)
        assert weights.body == 2.0 * (attention * layers + sum(mlp)), moe
        assert weights.attention == 4.0 * heads * head_dim * layers and weights.head == 2.0 * h * vocab


def test_shared_layout_without_selective_head_is_refused():
    from megatron_prune.config import DPOConfig

    settings = DPOStepSettings(dpo=DPOConfig(layout="shared"), prune=PruneConfig(
        position_ratio=1.0, seq_min_ratio=1.0, branch=False, selective_head=False), seed=0, micro_batch_size=1,
        pad_id=0)
    with pytest.raises(ValueError, match="selective head"):
        DPOStep(settings=settings, policy=[], reference=None, ref_lookup=lambda *a: None)


def test_packed_rows_keep_every_token_position_segment_and_scored_position():
    from megatron_prune.dpo.batch import pack_rows
    from megatron_prune.model.segments import Segment

    a, b = _plan([1, 2], [3], [4, 5], sample_id=0), _plan([6, 7, 8], [9, 10], [12], sample_id=1)
    padded = build_microbatch([a, b], branches=[[REJECTED], [CHOSEN, REJECTED]], layout="shared", seq_length=8,
                              pad_id=0, num_rows=3)
    batch = pack_rows(padded, seq_length=16, pad_id=0)
    assert batch.row_starts == [0, 4, 10]  # row 0 holds 4 tokens, row 1 six, row 2 none
    assert batch.tokens.tolist() == [[1, 2, 4, 5, 6, 7, 8, 9, 10, 12] + [0] * 6]
    assert batch.position_ids[0, :10].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 3]
    assert batch.segments.rows == [[Segment(0, 4), Segment(4, 7), Segment(7, 9, 4, 7), Segment(9, 10, 4, 7)]]
    # the same tokens scored for the same labels, at their packed places (flat index = position, one row)
    assert batch.selection.index.tolist() == [1, 2, 4 + 2, 4 + 3, 4 + 2]
    assert batch.selection.labels.tolist() == padded.selection.labels.tolist() == [4, 5, 9, 10, 12]
    assert batch.executed_tokens == padded.executed_tokens == 10
    with pytest.raises(ValueError, match="concat and shared"):
        pack_rows(build_microbatch([a], branches=[[CHOSEN]], layout="full", seq_length=8, pad_id=0),
                  seq_length=8, pad_id=0)


def test_packed_rows_keep_the_router_padding_mask():
    """A branch-pruned response run inside a shared training row stays out of a MoE model's router
    losses once rows are packed (--dpo-pack-rows), as it does unpacked; the row padding dropped by
    packing is not counted, the packed row's tail is."""
    import dataclasses

    from megatron_prune.dpo.batch import pack_rows

    a = dataclasses.replace(_plan([1, 2], [3, 4], [5, 6, 7], sample_id=0), kept_branch=CHOSEN)
    b = _plan([8, 9, 10], [11], [12, 13], sample_id=1)
    padded = build_microbatch([a, b], branches=[[CHOSEN, REJECTED], [CHOSEN, REJECTED]], layout="shared",
                              seq_length=12, pad_id=0, num_rows=3)
    assert padded.padding_mask[0, :7].tolist() == [False] * 4 + [True] * 3  # a's pruned rejected
    batch = pack_rows(padded, seq_length=16, pad_id=0)
    assert batch.row_starts == [0, 7, 13]
    expected = padded.padding_mask[0, :7].tolist() + padded.padding_mask[1, :6].tolist() + [True] * 3
    assert batch.padding_mask[0].tolist() == expected


def test_packing_the_full_layout_is_refused_by_its_flag():
    with pytest.raises(ValueError, match="--dpo-pack-rows needs --dpo-layout concat or shared"):
        DPOConfig(layout="full", pack_rows=True)


def test_prefix_length_is_the_ceiling_of_rho_times_length():
    """Sequence pruning keeps ceil(rho * L) tokens, rho uniform in [min, 1]: the whole response
    (its last token, EOS) is sometimes kept."""
    import math

    from megatron_prune.sampling import prefix_length, uniform

    length, low = 40, 0.5
    kept = [prefix_length(length, min_ratio=low, seed=3, step=s, sample_id=1, what="p") for s in range(400)]
    assert kept == [math.ceil((low + (1 - low) * uniform(3, s, 1, "p")) * length) for s in range(400)]
    assert length in kept


def test_sequence_pruning_keeps_a_prefix_of_each_response():
    from megatron_prune.config import PruneConfig
    from megatron_prune.data.preference import PreferencePair
    from megatron_prune.dpo.batch import plan_pair
    from megatron_prune.sampling import prefix_length

    prune = PruneConfig(position_ratio=1.0, seq_min_ratio=0.5, branch=False)
    chosen, rejected = list(range(100, 140)), list(range(200, 233))
    for step in range(5):
        plan = plan_pair(PreferencePair([1, 2, 3], chosen, rejected, "mem", 7), sample_id=7, step=step, seed=3,
                         prune=prune)
        for b, (name, ids) in enumerate((("chosen", chosen), ("rejected", rejected))):
            n = prefix_length(len(ids), min_ratio=0.5, seed=3, step=step, sample_id=7, what=f"prefix/{name}")
            assert plan.responses[b] == ids[:n]
