"""Attention of one new token per row over a KV cache, without copying the cache per query head.

Megatron's local ``DotProductAttention`` repeats every key/value group ``np / ng`` times
(``repeat_interleave``) before two batched matmuls. In KV-cached decoding that copies the whole
cache on every token, and on CPU the copies and the strided matmuls are most of a decoding step.
With one query per row, the ``np / ng`` query heads of a group can instead act as that group's
queries: ``[b, ng, np / ng, hn]`` against the group's own keys ``[b, ng, sk, hn]``. No mask is
needed: one query attends every cached key (Megatron applies no mask there either), and the
sampler never caches padding a row could attend to. The result equals Megatron's up to float
rounding (tests/unit/test_decode_attention.py).
"""

from __future__ import annotations

import torch

__all__ = ["single_query_attention"]


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
