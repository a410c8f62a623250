"""Megatron-Core places that assume Transformer Engine where it is missing, on any device.

Applied by :func:`megatron_prune.patches.apply_missing_te_patches` when Megatron's MoE utilities
found no Transformer Engine GEMM at import (no TE, or a stand-in without it), on CPU, GPU and NPU
alike; with TE nothing here runs.
"""

from __future__ import annotations

from .registry import Patch, register, rewrite_source

GROUP = "no_te"
CHECKED = ("0.16.1",)

for _fn in ("forward", "backward"):
    register(
        Patch(
            name=f"no_te.RouterGatingLinearFunction.{_fn}",
            target=f"megatron.core.transformer.moe.moe_utils.RouterGatingLinearFunction.{_fn}",
            reason="without Transformer Engine the MoE router GEMM reads te_general_gemm, which is then never "
                   "defined (every MoE forward would raise NameError)",
            build=rewrite_source(("te_general_gemm is not None", "False")),
            group=GROUP,
            checked_versions=CHECKED,
        )
    )
