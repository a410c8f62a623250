"""Changes that make Megatron-Core, as patched by MindSpeed, take the plugin's inputs on NPU.

Group ``mindspeed``. These patches are *not* applied with :func:`registry.apply_patches`: they
are handed to MindSpeed's own patch manager as wrappers by
:mod:`megatron_prune.adapters.mindspeed` (``prepare_ascend``), so that each one wraps whatever
MindSpeed installed on the same target and survives MindSpeed's ``repatch``. Registering them
here keeps the one-registry rule: every run-time change the plugin makes is listed in
:mod:`megatron_prune.patches.registry`. None of them runs on CPU or CUDA.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

from .registry import Patch, register

GROUP = "mindspeed"
CHECKED = ("0.16.1",)


def npu_actual_seq_len(cu_seqlens: Any) -> list[int]:
    """Megatron's THD ``cu_seqlens`` ``[0, l0, l0+l1, ...]`` -> the NPU's ``[l0, l0+l1, ...]``.

    ``torch_npu.npu_fusion_attention`` with ``input_layout="TND"`` takes ``actual_seq_qlen`` /
    ``actual_seq_kvlen`` as the cumulative *end* offsets of the sequences, without the leading 0
    (MindSpeed builds them that way in ``compute_actual_seq_len`` and its EOD-reset data path).
    A list that does not start with 0 is taken to be in that form already and returned as is.
    """
    values = cu_seqlens.tolist() if hasattr(cu_seqlens, "tolist") else list(cu_seqlens)
    values = [int(v) for v in values]
    if values and values[0] == 0:
        values = values[1:]
    if any(b <= a for a, b in zip(values, values[1:])) or (values and values[0] <= 0):
        raise ValueError(f"cu_seqlens must be strictly increasing sequence boundaries, got {values}")
    return values


def _offsets_like(values: list[int], like: Any):
    import torch

    device = like.device if isinstance(like, torch.Tensor) else None
    return torch.tensor(values, dtype=torch.int32, device=device)


def to_npu_packed_seq_params(params: Any) -> Any:
    """A copy of a THD ``PackedSeqParams`` whose cu_seqlens MindSpeed's TND attention reads right.

    ``cu_seqlens_*_padded`` (when set) describe where the sequences lie in the packed tensor,
    which is what the TND kernel needs; they are used in place of the unpadded ones. Anything
    that is not a ``thd`` PackedSeqParams in Megatron's convention is returned unchanged.
    """
    if params is None or getattr(params, "qkv_format", None) != "thd":
        return params
    q = params.cu_seqlens_q_padded if getattr(params, "cu_seqlens_q_padded", None) is not None else params.cu_seqlens_q
    kv = params.cu_seqlens_kv_padded if getattr(params, "cu_seqlens_kv_padded", None) is not None else params.cu_seqlens_kv
    if q is None or kv is None or len(q) == 0 or int(q[0]) != 0:
        return params
    converted = copy.copy(params)
    # A tensor, as Megatron's are: MindSpeed's fusion attention calls ``.tolist()`` on these.
    converted.cu_seqlens_q = _offsets_like(npu_actual_seq_len(q), q)
    converted.cu_seqlens_kv = _offsets_like(npu_actual_seq_len(kv), kv)
    converted.cu_seqlens_q_padded = None
    converted.cu_seqlens_kv_padded = None
    return converted


def _thd_cu_seqlens_for_npu(original):
    """Wrap ``DotProductAttention.forward`` (MindSpeed's fusion-attention replacement on NPU)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        params = bound.arguments.get("packed_seq_params")
        converted = to_npu_packed_seq_params(params)
        if converted is params:
            return original(*args, **kwargs)
        bound.arguments["packed_seq_params"] = converted
        return original(*bound.args, **bound.kwargs)

    return forward


register(
    Patch(
        name="mindspeed.DotProductAttention.forward.thd_cu_seqlens",
        target="megatron.core.transformer.dot_product_attention.DotProductAttention.forward",
        reason=(
            "Megatron's THD cu_seqlens start with 0, but MindSpeed's npu_fusion_attention TND path passes "
            "cu_seqlens_q.tolist() as actual_seq_qlen, which must be the cumulative end offsets"
        ),
        build=_thd_cu_seqlens_for_npu,
        group=GROUP,
        checked_versions=CHECKED,
    )
)
