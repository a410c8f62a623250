"""``python -m megatron_prune.dpo`` / ``megatron-prune-dpo``: DPO with graph pruning on Megatron-Core.

Launch with torchrun for several ranks, e.g.::

    torchrun --nproc-per-node 2 -m megatron_prune.dpo --model-preset tiny \\
        --data-path megatron_prune/data/samples/hh_rlhf_sample.jsonl --tensor-model-parallel-size 2
"""

from __future__ import annotations

import sys

from megatron_prune.config import CheckpointConfig, DPOConfig, LoggingConfig, ModelConfig, PruneConfig, TrainConfig
from megatron_prune.lora_config import LoRAConfig
from megatron_prune.training.cli import run_cli

GROUPS = {
    "model and parallelism": ModelConfig,
    "training": TrainConfig,
    "DPO": DPOConfig,
    "pruning (--prune-*)": PruneConfig,
    "LoRA (--lora-*)": LoRAConfig,
    "checkpointing": CheckpointConfig,
    "logging": LoggingConfig,
}


def _checks(configs):
    from megatron_prune.dpo.trainer import check_dpo_flags

    return check_dpo_flags(configs)


def _run(configs, checked):
    from megatron_prune.dpo.trainer import run_dpo

    return run_dpo(configs, checked)


def main(argv: list[str] | None = None) -> int:
    return run_cli(prog="megatron-prune-dpo", description="DPO with position/sequence/branch pruning",
                   groups=GROUPS, run=_run, argv=argv, extra_checks=_checks)


if __name__ == "__main__":
    sys.exit(main())
