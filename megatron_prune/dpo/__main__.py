"""``python -m megatron_prune.dpo`` / ``megatron-prune-dpo``: DPO with graph pruning on Megatron-Core.

Launch with torchrun for several ranks, e.g.::

    torchrun --nproc-per-node 2 -m megatron_prune.dpo --model-preset tiny \\
        --data-path megatron_prune/data/samples/hh_rlhf_sample.jsonl --tensor-model-parallel-size 2
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from megatron_prune.arguments import parse_configs
from megatron_prune.config import CheckpointConfig, DPOConfig, LoggingConfig, ModelConfig, PruneConfig, TrainConfig

GROUPS = {
    "model and parallelism": ModelConfig,
    "training": TrainConfig,
    "DPO": DPOConfig,
    "pruning (--prune-*)": PruneConfig,
    "checkpointing": CheckpointConfig,
    "logging": LoggingConfig,
}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Megatron warns at import about Apex/TE fallbacks that are expected on the local spec.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    args, configs = parse_configs("megatron-prune-dpo", GROUPS, "DPO with position/sequence/branch pruning", argv)
    from megatron_prune.training import session

    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        dp = session.validate(configs["ModelConfig"], configs["TrainConfig"], configs["CheckpointConfig"],
                              world_size=world)
    except ValueError as exc:
        session.fail_usage(exc)
    if args.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[megatron-prune] dry run: world {world}, data-parallel {dp}; configs:")
            for name, cfg in configs.items():
                print(f"  {name}: {cfg}")
        return 0
    from megatron_prune.data.records import DataError
    from megatron_prune.dpo.trainer import run_dpo

    try:
        run_dpo(configs)
    except (session.UsageError, DataError, FileNotFoundError) as exc:
        session.fail_usage(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
