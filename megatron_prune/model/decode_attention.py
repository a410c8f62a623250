"""KV-cached decoding without per-token work over the whole cache beyond the attention itself.

:func:`single_query_attention` attends one new token per row over a KV cache without copying the
cache per query head. Megatron's local ``DotProductAttention`` repeats every key/value group
``np / ng`` times (``repeat_interleave``) before two batched matmuls; in KV-cached decoding that
copies the whole cache on every token, and on CPU the copies and the strided matmuls are most of a
decoding step. With one query per row, the ``np / ng`` query heads of a group can instead act as
that group's queries: ``[b, ng, np / ng, hn]`` against the group's own keys ``[b, ng, sk, hn]``.
No mask is needed: one query attends every cached key (Megatron applies no mask there either), and
the sampler never caches padding a row could attend to. The result equals Megatron's up to float
rounding (tests/unit/model/test_decode_attention.py).

:class:`RotatedKeyCacheSelfAttention` caches keys with their rotary embedding applied, so a
decoding step rotates its own new keys only, and allocates the cache on the layer's device, laid
out for :func:`single_query_attention` when the core attention uses it.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention

__all__ = ["RotatedKeyCacheSelfAttention", "single_query_attention", "with_rotated_key_cache"]


def single_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, softmax_scale: float, softmax_in_fp32: bool,
) -> torch.Tensor:
    """Attention of ``query [1, b, np, hn]`` over ``key``/``value`` ``[sk, b, ng, hn]`` with no mask;
    returns ``[1, b, np * hn]``. Query head ``h`` uses key/value group ``h // (np / ng)``, as
    Megatron's ``repeat_interleave`` does; fp16/bf16 inputs are computed in fp32 when
    ``softmax_in_fp32``."""
    sq, b, np_, hn = query.shape
    sk, _, ng, _ = key.shape
    assert sq == 1 and np_ % ng == 0 and key.shape[1] == b and value.shape == key.shape, "bad decode shapes"
    compute = torch.float32 if softmax_in_fp32 and query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q = query.reshape(b, ng, np_ // ng, hn).to(compute)
    k = key.permute(1, 2, 0, 3).to(compute)
    v = value.permute(1, 2, 0, 3).to(compute)
    context = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=softmax_scale)  # [b, ng, np/ng, hn]
    return context.to(query.dtype).reshape(1, b, np_ * hn)


class RotatedKeyCacheSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` whose static KV cache holds keys with their rotary embedding
    applied (and, with the local core attention, is laid out for :func:`single_query_attention`).

    Megatron's static-batching path caches keys before the rotary embedding and rotates the whole
    cached prefix again on every forward (positions ``0 .. end``), which costs as much as the
    attention itself while decoding. Here each forward rotates only its own new keys, at their
    positions, before they are stored, and tells the forward that the keys are rotated. The
    rotation is elementwise per position, so the cached keys, and every output, are the same bits
    as Megatron's. Other paths (no cache, dynamic batching, flash decoding) are Megatron's own.
    """

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):
        """Megatron's ``[seq, batch, groups, dim]`` cache, on the layer's own device (Megatron's
        allocates on the current CUDA device). For the local core attention it is stored batch- and
        group-major, so each row's keys of one group are contiguous for the per-group decoding
        attention; Megatron indexes the cache by slices only, which work with any strides."""
        shape = (inference_max_sequence_length, batch_size, self.num_query_groups_per_partition, dim)
        device = next(self.parameters()).device
        if not getattr(self.core_attention, "decodes_per_group", False):
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty((batch_size, shape[2], shape[0], dim), dtype=dtype, device=device).permute(2, 0, 1, 3)

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb, *args,
                                        inference_params=None, **kwargs):
        context = inference_context if inference_context is not None else inference_params
        if (context is None or not context.is_static_batching() or self.config.flash_decode
                or rotary_pos_emb is None or rotary_pos_emb[1] is None):
            return super()._adjust_key_value_for_inference(inference_context, query, key, value, rotary_pos_emb,
                                                           *args, inference_params=inference_params, **kwargs)
        start = context.sequence_len_offset
        key = apply_rotary_pos_emb(key, rotary_pos_emb[1][start : start + key.size(0)], config=self.config,
                                   mscale=_yarn_get_concentration_factor_from_config(self.config),
                                   cp_group=self.pg_collection.cp)
        query, key, value, (q_pos_emb, _), attn_mask_type, block_table = super()._adjust_key_value_for_inference(
            context, query, key, value, rotary_pos_emb, *args, **kwargs)
        return query, key, value, (q_pos_emb, None), attn_mask_type, block_table


def with_rotated_key_cache(layer_spec):
    """A transformer-layer ``ModuleSpec`` whose ``SelfAttention`` is :class:`RotatedKeyCacheSelfAttention`."""
    attn = layer_spec.submodules.self_attention
    if attn.module is not SelfAttention:
        return layer_spec
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(
        layer_spec.submodules, self_attention=dataclasses.replace(attn, module=RotatedKeyCacheSelfAttention)))
