"""``python -m megatron_prune.grpo``: GRPO with DPPO pruning on Megatron-Core.

Launch with torchrun for several ranks, e.g.::

    torchrun --nproc-per-node 2 -m megatron_prune.grpo --model-preset tiny --task toy \\
        --tensor-model-parallel-size 2 --group-size 8 --dppo-completion-prune-rate 0.3
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from megatron_prune.arguments import parse_configs
from megatron_prune.config import CheckpointConfig, LoggingConfig, ModelConfig, TrainConfig
from megatron_prune.grpo.config import DPPOArgs, GRPOConfig

GROUPS = {
    "model and parallelism": ModelConfig,
    "training": TrainConfig,
    "GRPO": GRPOConfig,
    "DPPO pruning (--dppo-*)": DPPOArgs,
    "checkpointing": CheckpointConfig,
    "logging": LoggingConfig,
}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Megatron warns at import about Apex/TE fallbacks that are expected on the local spec.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    args, configs = parse_configs("megatron-prune-grpo", GROUPS, "GRPO with DPPO two-level pruning", argv)
    from megatron_prune.training import session

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        dp = session.validate(configs["ModelConfig"], configs["TrainConfig"], configs["CheckpointConfig"],
                              world_size=world)
        grpo: GRPOConfig = configs["GRPOConfig"]
        if configs["TrainConfig"].global_batch_size % grpo.minibatches:
            raise session.UsageError(f"--global-batch-size {configs['TrainConfig'].global_batch_size} does not split "
                                     f"into --minibatches {grpo.minibatches}")
        if grpo.task != "toy" and not grpo.data_path:
            raise session.UsageError(f"--task {grpo.task} needs --data-path")
    except ValueError as exc:
        session.fail_usage(exc)
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[megatron-prune] dry run: world {world}, data-parallel {dp}; configs:")
            for name, cfg in configs.items():
                print(f"  {name}: {cfg}")
        return 0
    from megatron_prune.data.records import DataError
    from megatron_prune.grpo.trainer import run_grpo

    try:
        run_grpo(configs)
    except (session.UsageError, DataError, FileNotFoundError) as exc:
        session.fail_usage(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
