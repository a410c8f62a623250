"""DPO with pruning: equivalences between layouts, heads and parallel layouts (gloo).

The objective itself (pruning off against an independent reference, the estimators' expectations
through the real step, the compute savings) is pinned in ``test_dpo_objective.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.dist import every_rank, run_distributed
from tests.distributed.dpo_harness import NUM_PAIRS, assert_same, dpo_grads

PRUNED = dict(position_ratio=0.6, seq_min_ratio=0.5)
MODES = {
    "off": {},
    "position": dict(position_ratio=0.6),
    "sequence": dict(seq_min_ratio=0.5),
    "branch": dict(branch=True),
    "all": dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True),
}


def single_rank_checks() -> dict:
    out = {
        "full": dpo_grads(layout="full"),
        "concat": dpo_grads(layout="concat"),
        "full_logits": dpo_grads(layout="concat", prune=dict(selective_head=False)),
        "full_mbs1": dpo_grads(layout="full", micro_batch_size=1),
        "sum_full": dpo_grads(layout="full", reduction="sum"),
        "sum_concat": dpo_grads(layout="concat", reduction="sum"),
    }
    out["modes"] = {name: dpo_grads(prune=prune) for name, prune in MODES.items()}
    out["tied_all"] = dpo_grads(prune=MODES["all"], preset="tiny-tied")
    return out


def layout_checks() -> dict:
    layouts = {
        "dp2": dict(),
        "tp2": dict(tensor_model_parallel_size=2),
        "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
        "pp2": dict(pipeline_model_parallel_size=2),
    }
    out = {
        (layout, mode): dpo_grads(parallel=par, prune=MODES[mode])
        for layout, par in layouts.items()
        for mode in ("off", "all")
    }
    # Tied embeddings: first and last stage share the weight the selective head reads.
    out[("pp2-tied", "tied_all")] = dpo_grads(parallel=layouts["pp2"], prune=MODES["all"], preset="tiny-tied")
    return out


def layout_checks_4() -> dict:
    par = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    out = {("tp2xpp2", mode): dpo_grads(parallel=par, prune=MODES[mode]) for mode in MODES}
    # More TP ranks than the tiny preset's 2 key-value heads: Megatron gathers the QKV projection
    # and each rank takes its group's slice, so every key-value head is used by two ranks.
    for mode in ("off", "all"):
        out[("tp4", mode)] = dpo_grads(parallel=dict(tensor_model_parallel_size=4), prune=MODES[mode])
    return out


@pytest.fixture(scope="module")
def single() -> dict:
    return run_distributed(single_rank_checks, 1)[0]


@pytest.mark.distributed
def test_full_equals_full_concat(single):
    assert_same(single["full"], single["concat"], "full vs concat")
    assert_same(single["full"], single["full_mbs1"], "micro batch 2 vs 1")
    assert_same(single["sum_full"], single["sum_concat"], "sum form: full vs concat")


@pytest.mark.distributed
def test_selective_head_equals_full_logits_path(single):
    assert_same(single["full_logits"], single["concat"], "selective head vs full logits")


@pytest.mark.distributed
def test_pruning_modes_cut_what_they_promise(single):
    base = single["modes"]["off"]["counters"]
    pos = single["modes"]["position"]["counters"]
    seq = single["modes"]["sequence"]["counters"]
    assert pos["scored_positions"] < 0.7 * base["scored_positions"]
    assert pos["policy_tokens"] == base["policy_tokens"]
    assert seq["policy_tokens"] < base["policy_tokens"] and seq["ref_tokens"] < base["ref_tokens"]
    # Branch pruning: one response of each pair runs without a backward.
    branch = single["modes"]["branch"]["counters"]
    assert 0 < branch["train_tokens"] < branch["policy_tokens"] == base["policy_tokens"]
    assert branch["forward_only_tokens"] == branch["ref_tokens"] + branch["policy_tokens"] - branch["train_tokens"]
    for name in ("position", "sequence", "branch", "all"):
        diff = max((single["modes"][name]["grads"][k] - base_g).abs().max().item()
                   for k, base_g in single["modes"]["off"]["grads"].items())
        assert diff > 0, f"{name} pruning changed nothing"


@pytest.mark.distributed
def test_layouts_match_single_rank_2_ranks(single):
    for rank, (layout, mode), got in every_rank(run_distributed(layout_checks, 2)):
        ref = single[mode] if mode == "tied_all" else single["modes"][mode]
        assert_same(ref, got, f"rank {rank}: {layout}/{mode}")
        # The step's token counters count the whole step (every data-parallel rank's share).
        for name in ("policy_tokens", "ref_tokens", "train_tokens", "scored_positions"):
            assert got["counters"][name] == ref["counters"][name], f"rank {rank}: {layout}/{mode}: {name}"


@pytest.mark.distributed
def test_layouts_match_single_rank_4_ranks(single):
    for rank, (layout, mode), got in every_rank(run_distributed(layout_checks_4, 4)):
        assert_same(single["modes"][mode], got, f"rank {rank}: {layout}/{mode}")


def test_position_pruning_reward_estimate_is_unbiased_by_enumeration():
    """E over uniform k-subsets of the averaged log-ratio equals the full average (exactly)."""
    from megatron_prune.dpo.loss import response_log_ratios

    gen = torch.Generator().manual_seed(0)
    length = 7
    policy = torch.randn(length, generator=gen, dtype=torch.float64)
    ref = torch.randn(length, generator=gen, dtype=torch.float64)
    for reduction in ("mean", "sum"):
        full = (policy - ref).sum() if reduction == "sum" else (policy - ref).mean()  # the unpruned Δ, by hand
        for k in range(1, length + 1):
            estimates = [
                response_log_ratios(policy[list(s)], ref[list(s)], seq_ids=torch.zeros(k, dtype=torch.long),
                                    num_scored=[k], lengths=[length], reduction=reduction)[0].double()
                for s in itertools.combinations(range(length), k)
            ]
            torch.testing.assert_close(torch.stack(estimates).mean(), full.double(), rtol=1e-6, atol=1e-6)


def test_position_subset_size_and_determinism():
    from megatron_prune.sampling import position_subset

    a = position_subset(50, ratio=0.6, seed=1, step=3, sample_id=7, what="positions/chosen")
    b = position_subset(50, ratio=0.6, seed=1, step=3, sample_id=7, what="positions/chosen")
    c = position_subset(50, ratio=0.6, seed=1, step=4, sample_id=7, what="positions/chosen")
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert len(a) == 30 and len(set(a.tolist())) == 30 and a.min() >= 0 and a.max() < 50
    assert torch.equal(position_subset(9, ratio=1.0, seed=1, step=0, sample_id=0, what="x"), torch.arange(9))


def test_prefix_length_range():
    from megatron_prune.sampling import prefix_length

    lengths = [prefix_length(40, min_ratio=0.5, seed=3, step=s, sample_id=1, what="p") for s in range(200)]
    assert min(lengths) >= 20 and max(lengths) <= 40 and len(set(lengths)) > 10
    assert prefix_length(40, min_ratio=1.0, seed=3, step=0, sample_id=1, what="p") == 40


assert NUM_PAIRS % 4 == 0, "pairs must split over DP=2 x micro batch 2"
