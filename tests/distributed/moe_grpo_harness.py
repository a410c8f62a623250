"""GRPO on tiny-moe at expert parallelism 2 (EP=2 x DP=2) equals the single rank: the step and
its checks, run inside tests/distributed/test_moe.py's launches.

One GRPO step, generation included, with DPPO at prompt and completion level, dense packing or
padded rows, old log-probs (two PPO epochs), a KL reference, and the full-recompute or KV-cached
sampler. Small microbatches make the two data-parallel ranks need different numbers of rollout
and training microbatches and stop sampling at different steps, which is what expert parallelism
(each MoE forward is a collective over both ranks) must follow. Compared with one rank: the
sampled completions, the loss and every gradient (fp32, 1e-5). Router losses are off unless
``parallel`` sets their coefficients: each is a mean over one microbatch's real tokens (padding is
masked out), weighted by 1 / (the rank's microbatches x DP), so it depends on the microbatching
(which completions share a microbatch, how many each rank runs), which differs between two
data-parallel ranks and one. tests/distributed/test_moe_router_losses.py runs this step with them
on, at EP=1 and EP=2 of the same DP=2.
"""

from __future__ import annotations

import torch

from tests.distributed.test_grpo import assert_same, train_step_result

SEED = 4321
CASES = {
    "dppo-prompt-completion-packed": dict(dense_packing=True, kv_cache=False),
    "dppo-prompt-completion-padded-kv-cache": dict(dense_packing=False, kv_cache=True),
}
METRICS = ("loss", "policy_loss", "kl_loss", "reward_mean", "kept_prompt_fraction", "kept_completion_fraction",
           "policy_tokens")


def moe_grpo_step(*, dense_packing: bool, kv_cache: bool, parallel: dict | None = None) -> dict:
    """Metrics, kept completions and whole gradients of one GRPO step on tiny-moe, and how many
    placeholder training microbatches and padding-only rollout microbatches this rank ran."""
    import megatron_prune.grpo.rollout as rollout
    import megatron_prune.grpo.step as grpo_step
    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.trainer import build_objective, toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    padding = {"placeholders": 0, "padding_microbatches": 0}
    original_pad, original_logits = grpo_step.pad_microbatches, rollout.next_token_logits

    def counting_pad(layout, count, **kwargs):
        padding["placeholders"] += max(count - len(layout.batches), 0)
        return original_pad(layout, count, **kwargs)

    def counting_logits(model, sequences, *, settings, num_microbatches=None):
        padding["padding_microbatches"] += (num_microbatches or 0) - rollout._num_microbatches(len(sequences), settings)
        return original_logits(model, sequences, settings=settings, num_microbatches=num_microbatches)

    def counting_batch(model, rows, *args, **kwargs):
        padding["padding_microbatches"] += not rows
        return original_batch(model, rows, *args, **kwargs)

    par = ParallelConfig(**(parallel or {}))
    original_batch = rollout._cached_batch
    grpo_step.pad_microbatches, rollout.next_token_logits = counting_pad, counting_logits
    rollout._cached_batch = counting_batch
    try:
        with model_parallel(par, seed=SEED):
            arch = get_preset("tiny-moe")
            policy = setup_model(arch, par, seed=SEED)
            reference = setup_model(arch, par, seed=SEED + 1, trainable=False)
            configs = {
                "TrainConfig": TrainConfig(global_batch_size=6, micro_batch_size=1, seq_length=16, seed=SEED),
                "GRPOConfig": GRPOConfig(group_size=4, max_new_tokens=6, kl_beta=0.1, ppo_epochs=2,
                                         rollout_micro_batch_size=3, kv_cache=kv_cache),
                # Floors of 0.1: these draws leave rank 1 with fewer training microbatches than rank 0,
                # so the placeholder padding runs (the test asserts it did).
                "DPPOArgs": DPPOArgs(prompt_prune_rate=0.4, completion_prune_rate=0.5, sampling="independent",
                                     prompt_floor=0.1, completion_floor=0.1, dense_packing=dense_packing),
            }
            source = toy_source(vocab_size=arch.vocab_size, num_prompts=16, seed=SEED)
            objective = build_objective(configs=configs, arch=arch, policy=policy, reference=reference,
                                        source=source)
            # A reward history (as after earlier steps) so that prompt-level pruning has scores to go by.
            history = torch.arange(16 * 4, dtype=torch.float32).reshape(16, 4).remainder(torch.arange(1, 17)[:, None])
            objective.pruner.observe(prompt_ids=list(range(16)), rewards=(history > 1).float())
            result = train_step_result(objective, policy)
    finally:
        grpo_step.pad_microbatches, rollout.next_token_logits = original_pad, original_logits
        rollout._cached_batch = original_batch
    return dict(result, padding=padding)


def grpo_cases(parallel: dict | None = None) -> dict:
    return {name: moe_grpo_step(**case, parallel=parallel) for name, case in CASES.items()}


def assert_grpo_cases(single: dict, ranks: list[dict]) -> None:
    """Every rank's GRPO step at EP=2 equals the single rank's, and the padding really ran."""
    for name, ref in single.items():
        # The pruning really happened, at both levels.
        assert ref["metrics"]["kept_prompt_fraction"] < 1.0 and ref["metrics"]["kept_completion_fraction"] < 1.0
        assert ref["padding"] == {"placeholders": 0, "padding_microbatches": 0}  # EP=1: nothing padded
        for rank, got in enumerate(ranks):
            assert_same(ref, got[name], f"ep2 rank {rank}/{name}", metrics=METRICS)
        # The ranks' work differed and the padding followed it: some rank ran placeholder training
        # microbatches and padding-only rollout microbatches (or KV-cached batches).
        for kind in ("placeholders", "padding_microbatches"):
            assert sum(got[name]["padding"][kind] for got in ranks) > 0, (name, kind)
