"""``python -m megatron_prune.grpo`` / ``megatron-prune-grpo``: GRPO with DPPO pruning on Megatron-Core.

Launch with torchrun for several ranks, e.g.::

    torchrun --nproc-per-node 2 -m megatron_prune.grpo --model-preset tiny --task toy \\
        --tensor-model-parallel-size 2 --group-size 8 --dppo-completion-prune-rate 0.3
"""

from __future__ import annotations

import sys

from megatron_prune.config import CheckpointConfig, LoggingConfig, ModelConfig, TrainConfig
from megatron_prune.grpo.config import TOY_TASKS, DPPOArgs, GRPOConfig, check_lengths, check_prompt_count
from megatron_prune.lora_config import LoRAConfig
from megatron_prune.training.cli import run_cli

GROUPS = {
    "model and parallelism": ModelConfig,
    "training": TrainConfig,
    "GRPO": GRPOConfig,
    "DPPO pruning (--dppo-*)": DPPOArgs,
    "LoRA (--lora-*)": LoRAConfig,
    "checkpointing": CheckpointConfig,
    "logging": LoggingConfig,
}


def _checks(configs):
    from megatron_prune.arguments import UsageError

    grpo: GRPOConfig = configs["GRPOConfig"]
    if configs["TrainConfig"].global_batch_size % grpo.minibatches:
        raise UsageError(f"--global-batch-size {configs['TrainConfig'].global_batch_size} does not split "
                         f"into --minibatches {grpo.minibatches}")
    if grpo.task in TOY_TASKS:
        check_prompt_count(grpo.toy_num_prompts, configs["TrainConfig"].global_batch_size, grpo)
    if grpo.task not in TOY_TASKS and not grpo.data_path:
        raise UsageError(f"--task {grpo.task} needs --data-path")
    from megatron_prune.training import session

    session.check_data_files("--data-path", grpo.data_path)
    train = configs["TrainConfig"]
    check_lengths(seq_length=train.seq_length, max_new_tokens=grpo.max_new_tokens,
                  max_prompt_length=train.max_prompt_length,
                  toy_prompt_length=grpo.toy_prompt_length if grpo.task in TOY_TASKS else None)
    model = configs["ModelConfig"]
    arch, lora_base = session.resolve_model_and_base(configs, kind="grpo")  # under LoRA also the base
    _check_router_losses_without_recompute(model, arch)
    if grpo.kl_beta > 0:  # the KL reference must be found before any rank starts
        session.reference_source(model, configs["CheckpointConfig"], grpo.ref_load, lora_base=lora_base)
    spec, tokenizer = ((None, None) if grpo.task in TOY_TASKS
                       else session.check_tokenizer(model, configs["CheckpointConfig"], arch))
    return session.LaunchChecks(arch=arch, lora_base=lora_base, tokenizer=tokenizer, tokenizer_spec=spec)


def _check_router_losses_without_recompute(model: ModelConfig, arch) -> None:
    """GRPO sets each training microbatch's router-loss weight in its forward (placeholders: none);
    a router recomputed in the backward would add its losses at the full weight."""
    from megatron_prune.arguments import UsageError
    from megatron_prune.model.moe import router_reruns_in_backward

    losses = [flag for flag, value in (("--moe-aux-loss-coeff", model.moe_aux_loss_coeff),
                                       ("--moe-z-loss-coeff", model.moe_z_loss_coeff)) if value > 0]
    if arch.is_moe and losses and router_reruns_in_backward(model.recompute_kwargs):
        raise UsageError(f"GRPO cannot combine {' and '.join(losses)} > 0 with activation recompute that reruns "
                         "the MoE routers (--recompute-activations, --recompute-granularity full, or "
                         "--recompute-modules moe): set the router-loss coefficients to 0 or recompute only "
                         "core_attn/mlp")


def _run(configs, checked):
    from megatron_prune.grpo.trainer import run_grpo

    return run_grpo(configs, checked)


def main(argv: list[str] | None = None) -> int:
    return run_cli(prog="megatron-prune-grpo", description="GRPO with DPPO two-level pruning",
                   groups=GROUPS, run=_run, argv=argv, extra_checks=_checks)


if __name__ == "__main__":
    sys.exit(main())
