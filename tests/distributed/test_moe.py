"""Mixture-of-experts (tiny-moe) under expert parallelism: one DPO training step equals the single rank.

Compared on the whole (layout-independent) tensors: the loss, the router's load-balancing and
z losses, every gradient and every parameter after an Adam step. Routing is drop-less, so every
layout computes the same function. The router losses count the real tokens of a microbatch
only; each pair is padded to one common length, longer than the pair, so at TP=2 with sequence
parallelism the two ranks' shards hold different amounts of padding (the z-loss is still the
mean over the whole microbatch's real tokens).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed
from tests.distributed.dpo_harness import SEED, assert_same_tensors, sample_pairs

AUX, Z = 1e-2, 1e-3
RTOL, ATOL = 1e-5, 1e-7
# Longer than every concatenated pair of the sample, so all rows pad to this one length.
COMMON_LENGTH = 256

LAYOUTS_2 = {
    "ep2": dict(expert_model_parallel_size=2),
    # Megatron's allgather dispatcher, over the tensor-parallel group (refused at EP > 1).
    "tp2-sp-allgather": dict(tensor_model_parallel_size=2, sequence_parallel=True, moe_token_dispatcher="allgather"),
}
LAYOUTS_4 = {
    "ep2xtp2-sp": dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    # The second stage takes its sequence-parallel shard of the padding mask itself.
    "tp2xpp2-sp": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True),
    "ep2xpp2": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
    # One layer per model chunk: the dense layer 0 and the MoE layers land on different chunks.
    "ep2xpp2-vpp2": dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2,
                         virtual_pipeline_model_parallel_size=2),
    "ep2xdp2-distopt": dict(expert_model_parallel_size=2, distopt=True),
}


# Resumes across Megatron's expert split (separate dense and expert optimizers at EP > 1, one at
# EP=1): (saved at, resumed at), both directions, the local and the distributed optimizer.
CROSS_SPLIT = {
    "ep2-to-ep1": (dict(expert_model_parallel_size=2), {}),
    "ep1-to-ep2-distopt": (dict(distopt=True), dict(expert_model_parallel_size=2, distopt=True)),
}

EXPERT_FC1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
ALL_PRUNINGS = dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True)


def moe_dpo_step(*, parallel: dict | None = None, aux: float = AUX, z: float = Z, corrupt=None,
                 prune: dict | None = None, steps: tuple[int, ...] = (0,), save_dir: str | None = None,
                 load_dir: str | None = None) -> dict:
    """DPO steps on tiny-moe: metrics, whole gradients (None under the distributed optimizer,
    where each rank holds a slice) and whole parameters after the last step. ``load_dir``: resume
    from that checkpoint first; ``save_dir``: save model and optimizer after the first step."""
    from megatron.core import parallel_state

    from megatron_prune.config import DPOConfig, PruneConfig
    from megatron_prune.data.sampler import dp_shard
    from megatron_prune.dpo.step import DPOStep, DPOStepSettings
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics

    parallel = dict(parallel or {})
    distopt = parallel.pop("distopt", False)
    samples, pad_id = sample_pairs()
    par = ParallelConfig(**parallel, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
    off = dict(position_ratio=1.0, seq_min_ratio=1.0, branch=False, branch_chosen_prob=0.5, selective_head=True)
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny-moe")
        policy = setup_model(arch, par, seed=SEED, use_distributed_optimizer=distopt)
        if corrupt is not None:
            corrupt(policy)
        reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
        # Adam with a large epsilon: smooth in the gradient, so ulp-level gradient differences stay
        # ulp-level in the parameters (the distributed optimizer supports Adam only).
        optimizer = build_optimizer(policy, OptimConfig(optimizer="adam", lr=0.01, adam_eps=1e-3, clip_grad=1.0,
                                                        use_distributed_optimizer=distopt), bf16=False)
        settings = DPOStepSettings(dpo=DPOConfig(layout="concat"), prune=PruneConfig(**{**off, **(prune or {})}),
                                   seed=SEED, micro_batch_size=1, pad_id=pad_id, pad_multiple=COMMON_LENGTH)
        runner = DPOStep(settings=settings, policy=policy, reference=reference)
        mine = dp_shard(samples, dp_rank=parallel_state.get_data_parallel_rank(),
                        dp_size=parallel_state.get_data_parallel_world_size())
        if load_dir is not None:
            load_checkpoint(load_dir, model=policy, arch=arch, optimizer=optimizer)
        for step in steps:
            for chunk in policy:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            outputs, _ = runner.run(step, mine)
            metrics = reduce_metrics(outputs)
            grads = None if distopt else gather_global_state(policy, source="main_grad")
            _, grad_norm, _ = optimizer.step()
            if save_dir is not None and step == steps[0]:
                save_checkpoint(save_dir, iteration=step + 1, model=policy, arch=arch, optimizer=optimizer)
        params = gather_global_state(policy)
    return dict(metrics=metrics, grad_norm=grad_norm, grads=grads, params=params, grads_sliced=distopt)


def run_layouts(layouts: dict, *, negative_control: bool = False, resume_root: str | None = None,
                cross_root: str | None = None, grpo_layout: str | None = None) -> dict:
    out = {name: moe_dpo_step(parallel=par) for name, par in layouts.items()}
    if grpo_layout is not None:
        from tests.distributed.moe_grpo_harness import CASES, moe_grpo_step

        out["grpo kv-cache"] = moe_grpo_step(**CASES["dppo-prompt-completion-padded-kv-cache"],
                                             parallel=layouts[grpo_layout])
    if cross_root is not None:
        # Two steps straight through, saving after the first; the second again from that checkpoint
        # on the other side of the expert split.
        for name, (saved, resumed) in CROSS_SPLIT.items():
            root = f"{cross_root}/{name}"
            out[f"cross {name}: straight"] = moe_dpo_step(parallel=saved, steps=(0, 1), save_dir=root)
            out[f"cross {name}: resumed"] = moe_dpo_step(parallel=resumed, steps=(1,), load_dir=root)
    if resume_root is not None:
        # Two steps straight through at EP=2 x DP=2 with the distributed optimizer, saving after the
        # first; then the second step again from that checkpoint.
        distopt = LAYOUTS_4["ep2xdp2-distopt"]
        out["resume: straight"] = moe_dpo_step(parallel=distopt, steps=(0, 1), save_dir=resume_root)
        out["resume: ep2xdp2"] = moe_dpo_step(parallel=distopt, steps=(1,), load_dir=resume_root)
    if negative_control:
        out["swapped-experts"] = moe_dpo_step(parallel=LAYOUTS_2["ep2"], corrupt=_swap_two_local_experts)
        out["all-prunings"] = moe_dpo_step(parallel=LAYOUTS_2["ep2"], prune=ALL_PRUNINGS)
    return out


def _swap_two_local_experts(model) -> None:
    """Negative control: expert-parallel rank 1 holds its two experts of the first MoE layer swapped."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_rank() != 1:
        return
    layer = next(layer for layer in model[0].module.decoder.layers if hasattr(layer.mlp, "router"))
    first, second = layer.mlp.experts.local_experts[:2]
    with torch.no_grad():
        for a, b in zip(first.parameters(), second.parameters()):
            tmp = a.detach().clone()
            a.copy_(b)
            b.copy_(tmp)


def single_rank_checks() -> dict:
    from tests.distributed.moe_grpo_harness import grpo_cases

    return dict(main=moe_dpo_step(), no_router_losses=moe_dpo_step(aux=0.0, z=0.0),
                all_prunings=moe_dpo_step(prune=ALL_PRUNINGS), grpo=grpo_cases())


def ep2_checks(**kwargs) -> dict:
    """The DPO layouts at two ranks, and (every rank's) GRPO step at EP=2."""
    from tests.distributed.moe_grpo_harness import grpo_cases

    grpo = grpo_cases(LAYOUTS_2["ep2"])
    return dict(dpo=run_layouts(**kwargs), grpo=grpo)


def assert_same_step(ref: dict, got: dict, label: str) -> None:
    for name in ("loss", "margin", "moe_aux_loss", "moe_z_loss"):
        torch.testing.assert_close(got["metrics"][name], ref["metrics"][name], rtol=RTOL, atol=ATOL,
                                   msg=f"{label}: {name}")
    torch.testing.assert_close(got["grad_norm"], ref["grad_norm"], rtol=RTOL, atol=0, msg=f"{label}: grad norm")
    assert_same_tensors(ref, got, label, rtol=RTOL, atol=ATOL, relative_atol=True)


@pytest.fixture(scope="module")
def single() -> dict:
    return run_distributed(single_rank_checks, 1)[0]


@pytest.mark.distributed
def test_single_rank_step_is_a_moe_step(single):
    """The reference itself: the router losses are reported and reach the router's gradient (and
    leave the DPO loss alone), and every expert got a gradient."""
    main, plain = single["main"], single["no_router_losses"]
    assert main["metrics"]["moe_aux_loss"] > 0 and main["metrics"]["moe_z_loss"] > 0
    assert "moe_aux_loss" not in plain["metrics"] and plain["metrics"]["loss"] == main["metrics"]["loss"]
    # Layers 1-3 are MoE layers (layer 0 is dense): fc1 and fc2 of each, stacked over the 4 experts.
    expert_grads = [g for k, g in main["grads"].items() if ".experts." in k]
    assert len(expert_grads) == 3 * 2 and all(g.shape[0] == 4 for g in expert_grads)
    assert all(g[e].abs().max() > 0 for g in expert_grads for e in range(4))
    router = [k for k in main["grads"] if k.endswith("router.weight")]
    assert router and all(not torch.equal(main["grads"][k], plain["grads"][k]) for k in router)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(ep2_checks, 2, layouts=LAYOUTS_2, negative_control=True,
                           cross_root=str(tmp_path_factory.mktemp("cross")))


@pytest.mark.distributed
def test_grpo_at_expert_parallel_2_matches_single_rank(single, two_ranks):
    """GRPO with DPPO (prompt and completion level), a KL reference and two PPO epochs, packed
    rows or the KV-cached sampler: the ranks stop sampling and run training microbatches
    differently, and the step still equals one rank's (sampled completions, loss, gradients)."""
    from tests.distributed.moe_grpo_harness import assert_grpo_cases

    assert_grpo_cases(single["grpo"], [rank["grpo"] for rank in two_ranks])


@pytest.mark.distributed
def test_expert_parallel_2_ranks_matches_single_rank(single, two_ranks):
    results = dict(two_ranks[0]["dpo"])
    # Optimizer state saved at EP=2 resumes at EP=1 and the reverse: the resumed step equals the
    # straight run's second step (loss, gradients, parameters after Adam with the loaded moments).
    for name in CROSS_SPLIT:
        straight = results.pop(f"cross {name}: straight")
        assert_same_step(straight, results.pop(f"cross {name}: resumed"), f"resumed across the split, {name}")
        assert not torch.equal(straight["params"][EXPERT_FC1], single["main"]["params"][EXPERT_FC1])
    bad = results.pop("swapped-experts")
    # Position, sequence and branch pruning together (the pruned branch runs forward-only).
    assert_same_step(single["all_prunings"], results.pop("all-prunings"), "ep2, all prunings")
    for name, got in results.items():
        assert_same_step(single["main"], got, name)
    with pytest.raises(AssertionError):
        assert_same_step(single["main"], bad, "swapped experts")


@pytest.mark.distributed
def test_expert_parallel_4_ranks_matches_single_rank(single, tmp_path):
    from tests.distributed.moe_grpo_harness import METRICS
    from tests.distributed.test_grpo import assert_same

    ranks = run_distributed(run_layouts, 4, layouts=LAYOUTS_4, resume_root=str(tmp_path / "ckpt"),
                            grpo_layout="ep2xtp2-sp")
    # GRPO with the KV-cached sampler at EP=2 x TP=2 with sequence parallelism (switched off for the
    # cached forwards, MoE layers included): every rank's step equals one rank's.
    for rank, got in enumerate(ranks):
        assert_same(single["grpo"]["dppo-prompt-completion-padded-kv-cache"], got.pop("grpo kv-cache"),
                    f"ep2xtp2-sp rank {rank}, GRPO with --kv-cache", metrics=METRICS)
    results = ranks[0]
    straight = results.pop("resume: straight")
    same = results.pop("resume: ep2xdp2")
    for name, got in results.items():
        assert_same_step(single["main"], got, name)
    # Resuming at the saved layout is bit-exact: expert and dense parameters and their sharded
    # optimizer state (expert-data-parallel groups) round-trip through the checkpoint.
    assert not torch.equal(straight["params"][EXPERT_FC1], single["main"]["params"][EXPERT_FC1])
    assert same["metrics"] == straight["metrics"]
    assert all(torch.equal(same["params"][k], v) for k, v in straight["params"].items())


def fused_adam_across_the_split(root: str) -> dict:
    from tests.distributed import fused_adam_standin

    fused_adam_standin.install()
    straight = moe_dpo_step(parallel=dict(expert_model_parallel_size=2), steps=(0, 1), save_dir=root)
    fused_adam_standin.STEPS_USED.clear()
    resumed = moe_dpo_step(parallel={}, steps=(1,), load_dir=root)
    return dict(straight=straight, resumed=resumed, steps=list(fused_adam_standin.STEPS_USED))


@pytest.mark.distributed
def test_fused_adam_resumes_across_the_split_at_its_step(tmp_path):
    """Transformer Engine's and Apex's fused Adam keep the step in each param group, which the
    cross-split load used to leave empty (only torch's per-parameter ``common_step`` was set): Apex
    restarted bias correction at step 1, TE failed to load. The resumed step is now step 2, the
    straight run's."""
    got = run_distributed(fused_adam_across_the_split, 2, root=str(tmp_path / "ckpt"))[0]
    assert got["steps"] and set(got["steps"]) == {2}, got["steps"]
    assert_same_step(got["straight"], got["resumed"], "fused Adam resumed EP=2 -> EP=1")


def grpo_passes_with_an_empty_share() -> dict:
    """Step 0 of GRPO on tiny-moe at EP=2 (DP=2) through the trainer, with a KL reference and two PPO
    epochs: two minibatches of one prompt each, DPPO keeping one of its two completions, so one rank's
    share of every minibatch is empty. Each GRPO pass a rank starts is announced to its expert-parallel
    peer first; a pass the peer does not start at the same time fails at once (rather than hanging
    in the MoE all-to-all). Returns the passes this rank ran, with the number of its items."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.trainer import build_objective, toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    passes: list[tuple] = []

    def announced(runner, method: str) -> None:
        run = getattr(runner, method)

        def wrapper(items, **kwargs):
            label = (method, kwargs.get("which"))
            group = parallel_state.get_expert_model_parallel_group()
            peers: list = [None] * dist.get_world_size(group)
            dist.all_gather_object(peers, label, group=group)
            assert all(p == label for p in peers), f"expert-parallel ranks start different passes: {peers}"
            passes.append((*label, len(items)))
            return run(items, **kwargs)

        setattr(runner, method, wrapper)

    par = ParallelConfig(expert_model_parallel_size=2)
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny-moe")
        policy = setup_model(arch, par, seed=SEED)
        reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
        configs = {
            "TrainConfig": TrainConfig(global_batch_size=2, micro_batch_size=1, seq_length=16, seed=SEED),
            "GRPOConfig": GRPOConfig(group_size=2, max_new_tokens=4, kl_beta=0.1, ppo_epochs=2, minibatches=2),
            # Systematic draws keep exactly the expected number of each group's completions: 1 of 2.
            "DPPOArgs": DPPOArgs(completion_prune_rate=0.5, completion_floor=0.3, sampling="systematic"),
        }
        source = toy_source(vocab_size=arch.vocab_size, num_prompts=4, seed=SEED)
        objective = build_objective(configs=configs, arch=arch, policy=policy, reference=reference, source=source)
        for method in ("score", "train"):
            announced(objective.runner, method)
        for chunk in policy:
            chunk.zero_grad_buffer()
        objective.train_step(0)
    return dict(passes=passes, minibatches=[len(items) for items in objective.buffer.minibatches])


@pytest.mark.distributed
def test_grpo_expert_parallel_ranks_run_every_pass_together_with_an_empty_share():
    """A rank whose share of a minibatch is empty still runs the reference and old-log-prob passes
    (placeholders) with its expert-parallel peer, whose MoE all-to-alls need it."""
    ranks = run_distributed(grpo_passes_with_an_empty_share, 2)
    assert ranks[0]["minibatches"] == ranks[1]["minibatches"] == [1, 1]
    expected = [("score", "ref"), ("score", "ref"), ("score", "old"), ("score", "old"), ("train", None)]
    for got in ranks:
        assert [p[:2] for p in got["passes"]] == expected
    # Every pass had one completion on one rank and none on the other.
    assert [p[2] for p in ranks[0]["passes"]] == [1, 1, 1, 1, 1]
    assert [p[2] for p in ranks[1]["passes"]] == [0, 0, 0, 0, 0]
