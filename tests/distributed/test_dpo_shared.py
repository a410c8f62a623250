"""The shared DPO layout (one row ``[prompt, chosen, rejected]`` per pair) against the others (gloo).

``shared`` equals ``full`` and ``concat`` — loss, metrics and every gradient, fp32 — with every
combination of position, sequence and branch pruning, at micro-batch 1 and 2; under branch
pruning each way of running the pruned branch (on the training pass's stored prompt keys and
values, inside the training row with detached log-probs, or as its own no-grad row) is forced in
turn, and the last two mixed per pair. The parallel layouts (TP=2, TP=2+SP, PP=2, PP=2 with
virtual stages, DP=2, TP=2 x PP=2) equal the single rank; under PP the pruned responses on stored
keys run on every stage and ride to the next one as extra rows of the p2p tensor. Packed rows
(``--dpo-pack-rows``: each microbatch's rows end to end in one row) equal the padded rows in both
segment layouts and every scheme. The shared layout against the independent plain-PyTorch
reference, and branch pruning's unbiasedness in it, are in ``test_dpo_objective.py``.
"""

from __future__ import annotations

import itertools

import pytest

from tests.dist import every_rank, run_distributed
from tests.distributed.dpo_harness import assert_same, dpo_grads

PRUNINGS = dict(position=dict(position_ratio=0.6), sequence=dict(seq_min_ratio=0.5), branch=dict(branch=True))


def _mixed(sample_id: int) -> bool:
    return sample_id % 3 == 0  # joins 0, 3, 6: the separate pass gets a short last microbatch


def _combos() -> dict[str, dict]:
    out = {}
    for n in range(len(PRUNINGS) + 1):
        for names in itertools.combinations(PRUNINGS, n):
            prune = {k: v for name in names for k, v in PRUNINGS[name].items()}
            out["+".join(names) or "off"] = prune
    return out


COMBOS = _combos()
JOINS = {"joined": True, "separate": False, "prefix-kv": None}  # None: the step's own choice
# (pruning combination, how the pruned branch runs) for every combination; the second only with branch.
CASES = [(name, None) for name, p in COMBOS.items() if not p.get("branch")] + [
    (name, join) for name, p in COMBOS.items() if p.get("branch") for join in JOINS]
# (pruning, pruned-branch scheme, micro-batch size, --dpo-pack-rows)
PARALLEL_CASES = [("off", None, 2, False), ("position+sequence+branch", "mixed", 2, False),
                  ("branch", "joined", 1, False), ("position+sequence+branch", "prefix-kv", 2, False),
                  ("position+sequence+branch", "mixed", 2, True)]
# Packed rows (--dpo-pack-rows) at a single rank: (layout, pruning, pruned-branch scheme).
PACKED_CASES = [("concat", "off", None), ("concat", "position+sequence+branch", None), ("shared", "off", None)] + [
    ("shared", "position+sequence+branch", join) for join in (*JOINS, "mixed")]
LAYOUTS_2 = {
    "dp2": dict(),
    "tp2": dict(tensor_model_parallel_size=2),
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2-vpp2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
}


# Pruned responses on stored keys across pipeline stages: (micro-batch size, --dpo-pack-rows). At
# micro-batch 2 some microbatch's pruned responses outgrow its training row's length, so they
# travel in two extra rows; packed, in one.
PIPELINE_LAYOUTS = {
    2: {"pp2": dict(pipeline_model_parallel_size=2),
        "pp2-vpp2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)},
    4: {"tp2-sp-pp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2)},
}
PIPELINE_CASES = [(2, False), (1, True)]


def _join(name):
    return {None: None, "mixed": _mixed, **JOINS}[name]


def single_rank_checks() -> dict:
    out = {"full": {}, "concat": {}, "shared": {}}
    for name, prune in COMBOS.items():
        out["full"][name] = dpo_grads(layout="full", prune=prune)
        out["concat"][name] = dpo_grads(layout="concat", prune=prune)
    for name, join in CASES:
        for mbs in (1, 2):
            out["shared"][(name, join, mbs)] = dpo_grads(layout="shared", prune=COMBOS[name], join=_join(join),
                                                         micro_batch_size=mbs)
    name = "position+sequence+branch"
    out["shared"][(name, "mixed", 2)] = dpo_grads(layout="shared", prune=COMBOS[name], join=_mixed)
    out["packed"] = {(layout, name, join): dpo_grads(layout=layout, prune=COMBOS[name], join=_join(join), pack_rows=True)
                     for layout, name, join in PACKED_CASES}
    return out


def parallel_checks(layouts: dict) -> dict:
    return {
        (layout, name, join, mbs, pack): dpo_grads(layout="shared", parallel=par, prune=COMBOS[name], join=_join(join),
                                                   micro_batch_size=mbs, pack_rows=pack)
        for layout, par in layouts.items() for name, join, mbs, pack in PARALLEL_CASES
    }


@pytest.fixture(scope="module")
def single() -> dict:
    return run_distributed(single_rank_checks, 1)[0]


@pytest.mark.distributed
def test_shared_equals_full_and_concat_with_every_pruning(single):
    for name in COMBOS:
        assert_same(single["full"][name], single["concat"][name], f"concat/{name}")
    for (name, join, mbs), got in single["shared"].items():
        assert_same(single["full"][name], got, f"shared/{name}/{join}/mbs{mbs}")


@pytest.mark.distributed
def test_shared_rows_run_the_prompt_once(single):
    off = single["shared"][("off", None, 2)]["counters"]
    concat = single["concat"]["off"]["counters"]
    full = single["full"]["off"]["counters"]
    assert concat["policy_tokens"] == full["policy_tokens"]
    # Both layouts run every response token once; concat runs each prompt twice, shared once.
    prompts = concat["policy_tokens"] - off["policy_tokens"]
    assert prompts > 0 and off["ref_tokens"] == concat["ref_tokens"] - prompts
    assert off["scored_positions"] == concat["scored_positions"]


@pytest.mark.distributed
def test_branch_pruning_runs_the_pruned_branch_where_it_was_told(single):
    for name in ("branch", "position+sequence+branch"):
        joined = single["shared"][(name, "joined", 2)]["counters"]
        separate = single["shared"][(name, "separate", 2)]["counters"]
        # Joined: no forward-only policy pass, the pruned responses run in the training pass.
        assert joined["forward_only_tokens"] == joined["ref_tokens"], name
        assert separate["forward_only_tokens"] > separate["ref_tokens"], name
        assert joined["train_tokens"] > separate["train_tokens"], name
        assert joined["policy_tokens"] < separate["policy_tokens"], name  # the prompt ran once per pair
        # On stored keys and values: the training rows of `separate`, the pruned responses forward
        # only and without their prompts (so the policy runs `joined`'s tokens, none in a backward).
        kv = single["shared"][(name, "prefix-kv", 2)]["counters"]
        assert kv["train_tokens"] == separate["train_tokens"], name
        assert kv["policy_tokens"] == joined["policy_tokens"], name
        assert kv["forward_only_tokens"] - kv["ref_tokens"] == kv["policy_tokens"] - kv["train_tokens"] > 0, name
    mixed = single["shared"][("position+sequence+branch", "mixed", 2)]
    assert_same(single["full"]["position+sequence+branch"], mixed, "shared/mixed")
    counters = mixed["counters"]
    assert counters["ref_tokens"] < counters["forward_only_tokens"]


@pytest.mark.distributed
def test_packed_rows_equal_padded_rows_and_run_no_padding_between_pairs(single):
    saved = 0
    for (layout, name, join), got in single["packed"].items():
        padded = single["full"][name] if layout == "concat" else single["shared"][(name, join, 2)]
        where = f"packed/{layout}/{name}/{join}"
        assert_same(padded, got, where)
        mine, theirs = got["counters"], padded["counters"]
        assert mine["policy_tokens"] == theirs["policy_tokens"] and mine["ref_tokens"] == theirs["ref_tokens"], where
        if layout == "concat":
            theirs = single["concat"][name]["counters"]
        # one row per microbatch: only its tail pads (up to the length multiple)
        assert mine["ref_padded_tokens"] <= theirs["ref_padded_tokens"], where
        assert mine["policy_padded_tokens"] <= theirs["policy_padded_tokens"], where
        saved += theirs["policy_padded_tokens"] - mine["policy_padded_tokens"]
    assert saved > 0, "packing removed no padding in any case"


@pytest.mark.distributed
def test_shared_parallel_layouts_match_single_rank_2_ranks(single):
    results = run_distributed(parallel_checks, 2, layouts=LAYOUTS_2)
    assert len(results[0]) == len(LAYOUTS_2) * len(PARALLEL_CASES)
    for rank, (layout, name, join, mbs, pack), got in every_rank(results):
        assert_same(single["full"][name], got, f"rank {rank}: {layout}/{name}/{join}/mbs{mbs}/packed={pack}")


@pytest.mark.distributed
def test_shared_parallel_layouts_match_single_rank_tp2xpp2(single):
    par = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for rank, (layout, name, join, mbs, pack), got in every_rank(run_distributed(parallel_checks, 4,
                                                                                layouts={"tp2xpp2": par})):
        assert_same(single["full"][name], got, f"rank {rank}: {layout}/{name}/{join}/mbs{mbs}/packed={pack}")


def policy_as_reference_margins() -> dict:
    from tests.distributed.dpo_harness import SEED

    return {layout: dpo_grads(layout=layout, parallel=dict(tensor_model_parallel_size=2), pack_rows=True,
                              reference_seed=SEED)["metrics"]
            for layout in ("concat", "shared")}


@pytest.mark.distributed
def test_packed_rows_under_tensor_parallelism_score_the_policy_as_its_reference():
    """Policy = reference (same weights): every margin is exactly 0 with packed rows at TP=2, as
    at one rank. A packed microbatch is one row, and the first layer's ``[s, 1, h]`` activation,
    transposed from ``[1, s, h]``, kept a batch stride on its size-1 dimension, for which
    ``torch.matmul`` picks its kernel by whether the operands require gradients: the trainable
    policy and the frozen reference rounded the first projection differently (margins ~1e-8,
    step-0 reward accuracy 0.5625 instead of 0.5)."""
    for rank, layout, metrics in every_rank(run_distributed(policy_as_reference_margins, 2)):
        for key in ("margin", "chosen_reward", "rejected_reward"):
            assert float(metrics[key]) == 0.0, (rank, layout, key, metrics)
        assert float(metrics["reward_accuracy"]) == 0.5, (rank, layout, metrics)


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_shared_layout_trains_like_concat(tmp_path):
    """``python -m megatron_prune.dpo --dpo-layout shared`` with every pruning, the precomputed
    reference and a held-out set gives concat's run (online reference): same losses over two
    optimizer steps, same held-out accuracy."""
    from tests.e2e.test_dpo_cli import HELDOUT, run_cli

    common = ("--train-iters", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
              "--prune-preset", "study", "--eval-data-path", HELDOUT, "--eval-interval", "2")
    (tmp_path / "concat").mkdir()
    (tmp_path / "shared").mkdir()
    concat = run_cli(tmp_path / "concat", *common, "--dpo-layout", "concat")
    shared = run_cli(tmp_path / "shared", *common, "--dpo-layout", "shared", "--ref-mode", "precomputed",
                     "--ref-cache", str(tmp_path / "cache"))
    steps = [r for r in concat if "loss" in r]
    assert len(steps) == 2 and len([r for r in shared if "loss" in r]) == 2
    for a, b in zip(steps, [r for r in shared if "loss" in r]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        # The tiny model runs every pruned branch in its own row: only the reference would share.
        assert b["policy_tokens"] <= a["policy_tokens"] and b["ref_tokens"] == 0
    evals = [(a["eval_reward_accuracy"], b["eval_reward_accuracy"]) for a, b in zip(concat, shared)
             if "eval_reward_accuracy" in a]
    assert evals and all(x == y for x, y in evals)


def prefix_kv_checks(layouts: dict, preset: str = "tiny") -> dict:
    prune = COMBOS["position+sequence+branch"]
    return {(layout, mbs, pack): dpo_grads(layout="shared", parallel=par, prune=prune, micro_batch_size=mbs,
                                           pack_rows=pack, preset=preset)
            for layout, par in layouts.items() for mbs, pack in PIPELINE_CASES}


def _assert_prefix_kv_matches_single_rank(preset: str, layouts_by_nproc: dict) -> None:
    single = run_distributed(prefix_kv_checks, 1, layouts={"single": {}}, preset=preset)[0]
    for nproc, layouts in layouts_by_nproc.items():
        results = run_distributed(prefix_kv_checks, nproc, layouts=layouts, preset=preset)
        for rank, (layout, mbs, pack), got in every_rank(results):
            where = f"{preset} rank {rank}: {layout}/mbs{mbs}/packed={pack}"
            mine = single[("single", mbs, pack)]
            assert_same(mine, got, where)
            # The same scheme ran: no pruned response in a backward, none with its prompt again.
            for name in ("train_tokens", "policy_tokens", "forward_only_tokens"):
                assert got["counters"][name] == mine["counters"][name], f"{where}: {name}"


@pytest.mark.distributed
def test_pruned_responses_on_stored_keys_cross_pipeline_stages():
    _assert_prefix_kv_matches_single_rank("tiny", PIPELINE_LAYOUTS)


@pytest.mark.distributed
def test_pruned_responses_on_stored_keys_cross_stages_with_expert_parallelism():
    # The pruned responses' forward runs every MoE layer's all-to-all on each stage, between the
    # data-parallel ranks of two pipelines whose p2p tensors carry different numbers of rows.
    _assert_prefix_kv_matches_single_rank("tiny-moe", {4: {
        "ep2xpp2": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
        "ep2xpp2-vpp2": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2)}})
