"""Megatron's activation recompute flags (--recompute-granularity, --recompute-method,
--recompute-num-layers, --recompute-modules): each reruns in the backward exactly the parts it names
(forward calls counted per module), and a DPO step with branch pruning then gives the loss, metrics
and gradients of the same step without recompute, at one rank and at TP=2 and PP=2. The flags'
refusals are in tests/e2e/test_flags.py."""

from __future__ import annotations

import pytest

from tests.dist import every_rank, run_distributed
from tests.distributed.dpo_harness import SEED, assert_same, dpo_grads

FULL_UNIFORM_2 = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
FULL_BLOCK_1 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
SELECTIVE_MLP = dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])
OPTIONS = {"full-uniform-2": FULL_UNIFORM_2, "full-block-1": FULL_BLOCK_1, "selective": SELECTIVE,
           "selective-mlp": SELECTIVE_MLP}
BRANCH = dict(branch=True, position_ratio=0.6)


def forward_calls(options: dict) -> dict[str, int]:
    """Forward calls of the tiny model's layers, core attentions and MLPs in one forward and backward."""
    import torch

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(recompute_options=options)
    counts = {"layer": 0, "core_attn": 0, "mlp": 0}

    def counter(kind):
        def hook(module, args, output):
            counts[kind] += 1
        return hook

    with model_parallel(par, seed=SEED):
        chunk = setup_model(get_preset("tiny"), par, seed=SEED)[0]
        chunk.train()
        for layer in chunk.module.decoder.layers:
            layer.register_forward_hook(counter("layer"))
            layer.self_attention.core_attention.register_forward_hook(counter("core_attn"))
            layer.mlp.register_forward_hook(counter("mlp"))
        tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(SEED))
        positions = torch.arange(16).expand(2, 16)
        chunk(tokens, positions, None, labels=tokens).sum().backward()
    return counts


@pytest.mark.distributed
def test_each_flag_reruns_exactly_the_parts_it_names():
    layers = 4  # the tiny preset
    once = {"layer": layers, "core_attn": layers, "mlp": layers}
    expected = {
        "none": once,
        "full-uniform-2": {k: 2 * layers for k in once},  # every layer, twice
        "full-block-1": {k: layers + 1 for k in once},  # the stage's first layer only
        "selective": {**once, "core_attn": 2 * layers},
        "selective-mlp": {**once, "core_attn": 2 * layers, "mlp": 2 * layers},
    }
    got = {name: run_distributed(forward_calls, 1, options=opts)[0]
           for name, opts in {"none": {}, **OPTIONS}.items()}
    assert got == expected


def steps_with_recompute(layouts: dict[str, dict]) -> dict:
    return {(layout, name): dpo_grads(parallel={**par, "recompute_options": opts}, prune=BRANCH)
            for layout, par in layouts.items() for name, opts in OPTIONS.items()}


@pytest.mark.distributed
def test_recompute_leaves_the_step_unchanged_at_one_rank_tp2_and_pp2():
    reference = run_distributed(dpo_grads, 1, prune=BRANCH)[0]
    for rank, (layout, name), got in every_rank(run_distributed(steps_with_recompute, 1, layouts={"single": {}})):
        assert_same(reference, got, f"rank {rank}: {layout}/{name}")
    layouts = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2)}
    for rank, (layout, name), got in every_rank(run_distributed(steps_with_recompute, 2, layouts=layouts)):
        assert_same(reference, got, f"rank {rank}: {layout}/{name}")


@pytest.mark.parametrize("flags, options", [
    ([], {}),
    (["--recompute-activations"], dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)),
    (["--recompute-granularity", "full"], dict(recompute_granularity="full", recompute_method="uniform",
                                                recompute_num_layers=1)),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"], dict(
        recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
    (["--recompute-granularity", "selective"], dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"], dict(
        recompute_granularity="selective", recompute_modules=["core_attn", "mlp"])),
])
def test_the_flags_reach_the_model_layout(flags, options):
    """The DPO and GRPO flags give the model builder Megatron's recompute fields (unset ones take
    Megatron's usual defaults: uniform, one layer; core attention)."""
    from megatron_prune.arguments import build_parser, configs_from_args
    from megatron_prune.dpo.__main__ import GROUPS as DPO_GROUPS
    from megatron_prune.grpo.__main__ import GROUPS as GRPO_GROUPS
    from megatron_prune.training.session import parallel_config

    for prog, groups in (("megatron-prune-dpo", DPO_GROUPS), ("megatron-prune-grpo", GRPO_GROUPS)):
        configs = configs_from_args(build_parser(prog, groups, "").parse_args(["--model-preset", "tiny", *flags]), groups)
        assert parallel_config(configs["ModelConfig"]).recompute_options == options, prog
