"""Every run-time change megatron-prune makes to Megatron-Core or MindSpeed.

Nothing is patched at import. Call :func:`apply_cpu_patches` (done by
``megatron_prune.training.parallel.initialize`` when the accelerator is CPU).
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


__all__ = [
    "Patch",
    "PatchTargetError",
    "apply_cpu_patches",
    "apply_patches",
    "is_applied",
    "register",
    "registered",
    "revert_patches",
    "rewrite_source",
]
