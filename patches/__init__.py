"""Every run-time change megatron-prune makes to Megatron-Core or MindSpeed.

Nothing is patched at import. Call :func:`apply_cpu_patches` (done by
``megatron_prune.training.parallel.initialize_distributed`` when the accelerator is CPU) and
:func:`apply_missing_te_patches` (done there on every device).
"""

from .registry import (
    Patch,
    PatchTargetError,
    apply_patches,
    is_applied,
    register,
    registered,
    revert_patches,
    rewrite_source,
)


def apply_cpu_patches() -> list[str]:
    """Make Megatron-Core run on CPU with gloo. Idempotent; a no-op list when already applied."""
    return apply_patches("cpu")


def apply_missing_te_patches() -> list[str]:
    """Make Megatron-Core's MoE router run without Transformer Engine, on any device: applied only
    when Megatron found no TE GEMM at import. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if "te_general_gemm" in vars(moe_utils):
        return []
    return apply_patches("no_te")


__all__ = [
    "Patch",
    "PatchTargetError",
    "apply_cpu_patches",
    "apply_missing_te_patches",
    "apply_patches",
    "is_applied",
    "register",
    "registered",
    "revert_patches",
    "rewrite_source",
]
