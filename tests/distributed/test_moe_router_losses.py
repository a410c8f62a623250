"""The router losses a MoE DPO step reports (``moe_aux_loss``, ``moe_z_loss``) have the right value,
not only a positive one or the same one at every layout (tests/distributed/test_moe.py).

One real DPO training step on tiny-moe (one rank, two microbatches of different lengths, both
coefficients non-zero and not 1). Forward pre-hooks on every MoE router record its input hidden
states and weight on each training call; the test then recomputes, in plain PyTorch (float64),
the losses Megatron-Core 0.16 defines for the preset's router (softmax scores, top-2 of 4
experts, ``moe_router_load_balancing_type="aux_loss"``, TP = CP = 1), over the microbatch's real
tokens only (the padding after them excluded through Megatron's router padding mask):

- load balancing (``switch_load_balancing_loss_func``): per layer and microbatch, with T real tokens,
  ``E / (k T^2) * sum_i (sum_x softmax(logits)[x, i]) * (tokens routed to expert i)``, the
  routing being the top-k of the softmax over all experts (``compute_routing_scores_for_aux_loss``);
- z-loss (``z_loss_func``): per layer and microbatch, ``mean_x logsumexp(logits[x])^2``;

Megatron's tracker stores each without its coefficient (``loss / coeff``), so the metric must be
``coeff * sum over layers and microbatches / number of microbatches``, the microbatches of every
data-parallel rank counted (one rank, and DP = 2 with one microbatch per rank).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_distributed

# Neither 1 nor equal: a coefficient applied twice or the other loss's coefficient shows.
AUX, Z = 0.02, 0.003
NUM_PAIRS = 2  # one pair per microbatch: two microbatches
MOE_LAYERS = 3  # tiny-moe: layers 1-3 (layer 0 is dense)
RTOL = 1e-5


def _router_config_facts(router) -> dict:
    cfg = router.config
    return dict(
        num_experts=cfg.num_moe_experts, topk=router.topk, score_function=router.score_function,
        load_balancing_type=cfg.moe_router_load_balancing_type, aux_coeff=cfg.moe_aux_loss_coeff,
        z_coeff=cfg.moe_z_loss_coeff, fusion=cfg.moe_router_fusion, jitter=cfg.moe_input_jitter_eps,
        expert_bias=router.expert_bias is not None, bias=router.bias is not None,
        group_topk=cfg.moe_router_group_topk, force_balance=cfg.moe_router_force_load_balancing,
        capacity=cfg.moe_expert_capacity_factor, tp_cp=router.tp_cp_group.size(),
        per_token=router.calculate_per_token_loss,
    )


def hooked_moe_dpo_step() -> dict:
    """The step's metrics and, per router call, what the router saw (hidden states, weight)."""
    from megatron.core import parallel_state

    from megatron_prune.config import DPOConfig, PruneConfig
    from megatron_prune.data.sampler import dp_shard
    from megatron_prune.dpo.step import DPOStep, DPOStepSettings
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics
    from tests.distributed.dpo_harness import SEED, sample_pairs

    samples, pad_id = sample_pairs()
    # The second pair cut shorter: the two microbatches differ in length (160 vs 80 tokens).
    (i, first), (j, second) = samples[:NUM_PAIRS]
    second = dataclasses.replace(second, prompt_ids=second.prompt_ids[:20], chosen_ids=second.chosen_ids[:20],
                                 rejected_ids=second.rejected_ids[:14])
    samples = [(i, first), (j, second)]
    real_tokens = {k: 2 * len(s.prompt_ids) + len(s.chosen_ids) + len(s.rejected_ids) for k, s in samples}
    par = ParallelConfig(moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z)
    off = dict(position_ratio=1.0, seq_min_ratio=1.0, branch=False, branch_chosen_prob=0.5, selective_head=True)
    calls: list[dict] = []

    def record(name):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["input"]
            mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
            calls.append(dict(
                layer=name, hidden=hidden.detach().clone(), weight=module.weight.detach().clone(),
                tracked=module.training and torch.is_grad_enabled(), padding_mask=mask,
            ))
        return hook

    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny-moe")
        policy = setup_model(arch, par, seed=SEED)
        reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
        routers = {f"{c}.{n}": m for c, chunk in enumerate(policy) for n, m in chunk.named_modules()
                   if n.endswith("mlp.router")}
        handles = [m.register_forward_pre_hook(record(n), with_kwargs=True) for n, m in routers.items()]
        facts = [_router_config_facts(m) for m in routers.values()]
        settings = DPOStepSettings(dpo=DPOConfig(layout="concat"), prune=PruneConfig(**off), seed=SEED,
                                   micro_batch_size=1, pad_id=pad_id)
        runner = DPOStep(settings=settings, policy=policy, reference=reference)
        mine = dp_shard(samples, dp_rank=parallel_state.get_data_parallel_rank(),
                        dp_size=parallel_state.get_data_parallel_world_size())
        for chunk in policy:
            chunk.zero_grad_buffer()
        try:
            outputs, _ = runner.run(0, mine)
        finally:
            for h in handles:
                h.remove()
        metrics = reduce_metrics(outputs)
    return dict(metrics=metrics, calls=calls, routers=sorted(routers), facts=facts,
                num_microbatches=len(outputs), real_tokens=sorted(real_tokens[k] for k, _ in mine))


def expected_router_losses(hidden: torch.Tensor, weight: torch.Tensor, padding: torch.Tensor | None, *,
                           topk: int) -> tuple[float, float]:
    """Megatron 0.16's load-balancing loss and z-loss of one router call over its real tokens
    (``padding``: ``[s, b]``, True at padding), without coefficient."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    if padding is not None:
        hidden = hidden[~padding.reshape(-1)]
    logits = F.linear(hidden.double(), weight.double())  # [T, E]
    tokens, experts = logits.shape
    scores = torch.softmax(logits, dim=-1)
    chosen = scores.topk(topk, dim=-1).indices
    # The top-k must not hinge on float rounding (Megatron picks it from float32 logits).
    ordered = scores.sort(dim=-1, descending=True).values
    assert (ordered[:, topk - 1] - ordered[:, topk]).min() > 1e-6, "near-tie in the top-k routing"
    routed = torch.zeros_like(scores).scatter(1, chosen, 1.0).sum(dim=0)  # tokens per expert
    load_balancing = experts / (topk * tokens * tokens) * (scores.sum(dim=0) * routed).sum()
    z = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    return float(load_balancing), float(z)


@pytest.fixture(scope="module")
def step() -> dict:
    return run_distributed(hooked_moe_dpo_step, 1)[0]


def _check_router_config(step: dict) -> None:
    """The router configuration the formulas of :func:`expected_router_losses` are written for."""
    assert len(step["routers"]) == MOE_LAYERS
    for facts in step["facts"]:
        assert facts == dict(num_experts=4, topk=2, score_function="softmax", load_balancing_type="aux_loss",
                             aux_coeff=AUX, z_coeff=Z, fusion=False, jitter=None, expert_bias=False, bias=False,
                             group_topk=None, force_balance=False, capacity=None, tp_cp=1,
                             per_token=facts["per_token"])


def _tracked_calls(step: dict) -> list[dict]:
    """The router calls of the training pass: every MoE layer once per training microbatch (no
    recomputation, no extra passes), each masking exactly the padding: its pair's tokens
    (prompt + chosen, prompt + rejected) are the only ones counted."""
    tracked = [c for c in step["calls"] if c["tracked"]]
    assert len(tracked) == MOE_LAYERS * step["num_microbatches"]
    assert sorted(c["layer"] for c in tracked) == sorted(step["routers"] * step["num_microbatches"])
    counted = sorted(_real(c) for c in tracked if c["layer"] == step["routers"][0])
    assert counted == step["real_tokens"]
    return tracked


def _real(call: dict) -> int:
    """Tokens the router call counts (no mask: the microbatch has no padding)."""
    mask = call["padding_mask"]
    return call["hidden"].shape[:2].numel() if mask is None else int((~mask).sum())


@pytest.mark.distributed
def test_reported_router_losses_equal_megatrons_formulas(step):
    _check_router_config(step)
    num_microbatches = step["num_microbatches"]
    assert num_microbatches == NUM_PAIRS
    tracked = _tracked_calls(step)
    # The microbatches differ in length, so per-microbatch token normalisation matters, and padding is masked.
    assert len({_real(c) for c in tracked}) > 1
    assert any(c["padding_mask"] is not None and c["padding_mask"].any() for c in tracked), "no padding tested"

    losses = [expected_router_losses(c["hidden"], c["weight"], c["padding_mask"], topk=2) for c in tracked]
    expected_aux = AUX * sum(lb for lb, _ in losses) / num_microbatches
    expected_z = Z * sum(z for _, z in losses) / num_microbatches
    metrics = step["metrics"]
    assert metrics["moe_aux_loss"] == pytest.approx(expected_aux, rel=RTOL, abs=0)
    assert metrics["moe_z_loss"] == pytest.approx(expected_z, rel=RTOL, abs=0)


@pytest.mark.distributed
def test_router_losses_are_averaged_over_data_parallel_ranks():
    """At DP = 2 each rank trains one of the two microbatches (160 and 80 tokens): the reported
    losses are the mean over both ranks' microbatches of what each added, on every rank — not one
    rank's value, not the sum over ranks, not a token-weighted mean."""
    ranks = run_distributed(hooked_moe_dpo_step, 2)
    per_rank = []
    for rank, step in enumerate(ranks):
        _check_router_config(step)
        assert step["num_microbatches"] == NUM_PAIRS // 2, f"rank {rank}"
        tracked = _tracked_calls(step)
        losses = [expected_router_losses(c["hidden"], c["weight"], c["padding_mask"], topk=2) for c in tracked]
        per_rank.append((sum(lb for lb, _ in losses), sum(z for _, z in losses),
                         _real(tracked[0])))
    assert per_rank[0][2] != per_rank[1][2], "the two ranks' microbatches should differ in length"
    # Each rank's own value differs from the mean: a metric that skipped the DP reduction shows.
    assert per_rank[0][0] != pytest.approx(per_rank[1][0], rel=1e-3)
    microbatches = sum(step["num_microbatches"] for step in ranks)
    expected_aux = AUX * sum(lb for lb, _, _ in per_rank) / microbatches
    expected_z = Z * sum(z for _, z, _ in per_rank) / microbatches
    for rank, step in enumerate(ranks):
        assert step["metrics"]["moe_aux_loss"] == pytest.approx(expected_aux, rel=RTOL, abs=0), f"rank {rank}"
        assert step["metrics"]["moe_z_loss"] == pytest.approx(expected_z, rel=RTOL, abs=0), f"rank {rank}"


def grpo_placeholder_pass() -> dict:
    """A GRPO training pass with nothing to train (a placeholder microbatch: every completion pruned,
    or every advantage 0), then one with a completion, on tiny-moe with both router losses on."""
    from megatron_prune.grpo.loss import GRPOLossConfig
    from megatron_prune.grpo.step import GRPOStep, GRPOStepSettings, TrainItem
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z)
    out = {}
    with model_parallel(par, seed=7):
        policy = setup_model(get_preset("tiny-moe"), par, seed=7)
        step = GRPOStep(settings=GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=4, pad_id=0), policy=policy)
        item = TrainItem(prompt_id=0, index=0, prompt=[1, 5, 9], completion=[4, 7, 2], advantage=1.0, weight=1.0)
        for name, items in (("empty", []), ("one", [item])):
            for chunk in policy:
                chunk.zero_grad_buffer()
            metrics, layout = step.train(items, normaliser=8.0)
            grads = [p.main_grad for chunk in policy for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]
            out[name] = {"metrics": metrics, "microbatches": len(layout.batches),
                         "grad_abs_sum": float(sum(g.abs().sum() for g in grads))}
    return out


@pytest.mark.distributed
def test_a_placeholder_microbatch_adds_no_router_loss():
    """A placeholder's loss and gradient are 0, router losses included: its pad rows still go through
    the routers, whose load-balancing and z-losses moved every weight on a step said to train nothing
    (Adam turns any gradient into an update of about the learning rate). The next pass has them again."""
    (got,) = run_distributed(grpo_placeholder_pass, 1)
    empty, one = got["empty"], got["one"]
    assert empty["microbatches"] == 1 and empty["grad_abs_sum"] == 0.0
    assert empty["metrics"]["moe_aux_loss"] == 0.0 and empty["metrics"]["moe_z_loss"] == 0.0
    assert one["grad_abs_sum"] > 0 and one["metrics"]["moe_aux_loss"] > 0 and one["metrics"]["moe_z_loss"] > 0


def grpo_step_with_router_losses(ep: int) -> dict:
    from tests.distributed.moe_grpo_harness import moe_grpo_step

    return moe_grpo_step(dense_packing=True, kv_cache=False,
                         parallel=dict(expert_model_parallel_size=ep, moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z))


@pytest.mark.distributed
def test_grpo_router_losses_do_not_depend_on_the_placeholders_a_layout_needs():
    """The same GRPO step (DP = 2, DPPO leaves the ranks with 3 and 2 training microbatches) at EP = 1
    and at EP = 2, where the rank with fewer runs placeholders to keep the expert all-to-alls in
    step. Megatron weights router losses by 1 / (the rank's microbatches x DP): the placeholders
    used to dilute the real microbatches' share (gradients 19 % apart), and each rank reported its
    own value. Both router-loss gradients and metrics are now the same at both layouts, on every rank."""
    from tests.distributed.test_grpo import assert_metrics_and_grads

    ep1 = run_distributed(grpo_step_with_router_losses, 2, ep=1)
    ep2 = run_distributed(grpo_step_with_router_losses, 2, ep=2)
    assert [rank["padding"]["placeholders"] for rank in ep1] == [0, 0]
    assert sum(rank["padding"]["placeholders"] for rank in ep2) > 0
    for name in ("moe_aux_loss", "moe_z_loss"):
        values = [rank["metrics"][name] for rank in ep1 + ep2]
        assert values[0] > 0 and values == pytest.approx([values[0]] * 4, rel=RTOL, abs=0), (name, values)
    for rank, got in enumerate(ep2):
        assert_metrics_and_grads(ep1[0], got, f"ep2 rank {rank}", ("loss",), rtol=1e-5, atol=1e-7)


def grpo_padded_and_packed() -> dict:
    """One GRPO training pass over the same two completions of different lengths, as one microbatch
    of two padded rows and as one densely packed row: router-loss metrics and router gradients."""
    from megatron_prune.grpo.loss import GRPOLossConfig
    from megatron_prune.grpo.step import GRPOStep, GRPOStepSettings, TrainItem
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z)
    items = [TrainItem(prompt_id=0, index=0, prompt=[1, 5, 9, 3], completion=[4, 7, 2, 8, 8, 6, 1], advantage=1.0,
                       weight=1.0),
             TrainItem(prompt_id=1, index=0, prompt=[2, 6], completion=[3, 3], advantage=-0.5, weight=1.0)]
    out = {}
    with model_parallel(par, seed=7):
        policy = setup_model(get_preset("tiny-moe"), par, seed=7)
        for packed in (False, True):
            settings = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=2, pad_id=0, dense_packing=packed,
                                        pack_capacity=32)
            for chunk in policy:
                chunk.zero_grad_buffer()
            metrics, layout = GRPOStep(settings=settings, policy=policy).train(items, normaliser=8.0)
            router = {n: p.main_grad.clone() for chunk in policy for n, p in chunk.named_parameters()
                      if n.endswith("router.weight")}
            out["packed" if packed else "padded"] = dict(metrics=metrics, router=router, slots=layout.row_tokens,
                                                         microbatches=len(layout.batches))
    return out


@pytest.mark.distributed
def test_grpo_router_losses_do_not_count_padding():
    """Padding is no token the router is trained on: the same two completions padded to one row
    length (15 tokens in 32 slots) or packed end to end give the same router losses and the
    same router gradients."""
    (got,) = run_distributed(grpo_padded_and_packed, 1)
    padded, packed = got["padded"], got["packed"]
    assert padded["microbatches"] == packed["microbatches"] == 1
    assert padded["slots"] == 32 and packed["slots"] < padded["slots"]
    for name in ("moe_aux_loss", "moe_z_loss"):
        assert padded["metrics"][name] > 0
        assert packed["metrics"][name] == pytest.approx(padded["metrics"][name], rel=RTOL, abs=0), name
    assert len(padded["router"]) == MOE_LAYERS
    for name, grad in padded["router"].items():
        torch.testing.assert_close(packed["router"][name], grad, rtol=1e-5, atol=1e-8, msg=name)


def shared_branch_pruning(join: bool) -> dict:
    from tests.distributed.dpo_harness import dpo_grads

    return dpo_grads(preset="tiny-moe", parallel=dict(moe_aux_loss_coeff=AUX, moe_z_loss_coeff=Z), layout="shared",
                     prune=dict(branch=True), micro_batch_size=1, join=join)


@pytest.mark.distributed
def test_a_pruned_branch_in_the_training_row_adds_no_router_loss():
    """Shared layout under branch pruning: a pruned response run inside the training row (for its
    log-probs only) is left out of the router losses, as one run in its own forward-only pass is, so
    where the step runs it (a cost heuristic) changes neither the router losses nor any gradient."""
    from tests.distributed.dpo_harness import assert_metrics_and_grads

    (joined,) = run_distributed(shared_branch_pruning, 1, join=True)
    (separate,) = run_distributed(shared_branch_pruning, 1, join=False)
    assert joined["counters"]["forward_only_tokens"] < separate["counters"]["forward_only_tokens"]
    assert joined["metrics"]["moe_aux_loss"] > 0 and joined["metrics"]["moe_z_loss"] > 0
    assert_metrics_and_grads(separate, joined, "pruned branch joined vs separate",
                             ("loss", "margin", "moe_aux_loss", "moe_z_loss"), rtol=1e-5, atol=1e-7)


def grpo_training_pass_after_a_forward_only_pass() -> dict:
    """At TP = 2 with sequence parallelism (the group-mean z-loss) and padding in the microbatch: the
    router losses of a GRPO training pass alone, and of the same pass right after the policy's
    forward-only old-log-prob pass over the same completions."""
    from megatron_prune.grpo.loss import GRPOLossConfig
    from megatron_prune.grpo.step import GRPOStep, GRPOStepSettings, TrainItem
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    def items() -> list:
        return [TrainItem(prompt_id=0, index=0, prompt=[1, 5, 9, 3], completion=[4, 7, 2, 8, 8, 6, 1], advantage=1.0),
                TrainItem(prompt_id=1, index=0, prompt=[2, 6], completion=[3, 3], advantage=-0.5)]

    par = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, moe_aux_loss_coeff=AUX,
                         moe_z_loss_coeff=Z)
    with model_parallel(par, seed=7):
        policy = setup_model(get_preset("tiny-moe"), par, seed=7)
        step = GRPOStep(settings=GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=2, pad_id=0), policy=policy)
        alone, layout = step.train(items(), normaliser=8.0)
        scored = items()
        step.score(scored, which="old")
        after, _ = step.train(scored, normaliser=8.0)
    padding = layout.batches[0].padding_mask
    return dict(alone=alone, after=after, padded=bool(padding.any()) and not bool(padding.all()),
                scored=all(it.old_logprobs is not None for it in scored))


@pytest.mark.distributed
def test_forward_only_passes_add_no_router_loss_at_tensor_parallel_2():
    """The policy's forward-only passes (old log-probs, a pruned branch) run in training mode under
    no_grad: their router losses are neither added nor reported, so a training pass reports the
    same router losses whether or not such a pass ran before it."""
    ranks = run_distributed(grpo_training_pass_after_a_forward_only_pass, 2)
    for rank, got in enumerate(ranks):
        assert got["padded"] and got["scored"], rank
        for name in ("moe_aux_loss", "moe_z_loss"):
            assert got["alone"][name] > 0, (rank, name)
            assert got["after"][name] == pytest.approx(got["alone"][name], rel=RTOL, abs=0), (rank, name)
