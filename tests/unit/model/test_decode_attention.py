"""One query per row over a KV cache: the per-group path against plain attention and Megatron's own.

The reference is written here in float64: keys and values repeated to every query head (head h
reads group h // (np / ng)), softmax(q k^T * scale) v with no mask. The module check builds the
local layer spec's core attention (``SegmentAttention``) and compares its decoding path with
Megatron's ``DotProductAttention.forward`` on the same inputs, and checks which path runs when.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from megatron_prune.model.decode_attention import single_query_attention
from tests.dist import run_distributed


def reference(query, key, value, scale):
    """query [1, b, np, hn], key/value [sk, b, ng, hn] -> [1, b, np * hn], float64."""
    _, b, np_, hn = query.shape
    rep = np_ // key.shape[2]
    q = query.double().permute(1, 2, 0, 3)  # [b, np, 1, hn]
    k = key.double().permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
    v = value.double().permute(1, 2, 0, 3).repeat_interleave(rep, dim=1)
    out = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) @ v  # [b, np, 1, hn]
    return out.permute(2, 0, 1, 3).reshape(1, b, np_ * hn)


def cache_slice(sk: int, b: int, ng: int, hn: int, seed: int) -> torch.Tensor:
    """The first ``sk`` positions of a larger cache ``[sk + 5, b, ng, hn]``, as Megatron hands them over."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sk + 5, b, ng, hn, generator=g)[:sk]


@pytest.mark.parametrize("np_, ng", [(4, 2), (6, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("sk", [1, 9])
def test_equals_plain_attention_over_repeated_groups(np_, ng, sk):
    b, hn = 5, 8
    query = torch.randn(1, b, np_, hn, generator=torch.Generator().manual_seed(np_ * 10 + ng))
    key, value = cache_slice(sk, b, ng, hn, seed=1), cache_slice(sk, b, ng, hn, seed=2)
    scale = 1 / math.sqrt(hn)
    out = single_query_attention(query, key, value, softmax_scale=scale, softmax_in_fp32=True)
    assert out.shape == (1, b, np_ * hn) and out.dtype == query.dtype
    assert_close(out.double(), reference(query, key, value, scale), rtol=1e-5, atol=1e-6)


def test_bf16_is_computed_in_fp32():
    b, np_, ng, hn, sk = 3, 4, 2, 16, 40
    query = torch.randn(1, b, np_, hn).bfloat16()
    key, value = cache_slice(sk, b, ng, hn, seed=3).bfloat16(), cache_slice(sk, b, ng, hn, seed=4).bfloat16()
    out = single_query_attention(query, key, value, softmax_scale=0.3, softmax_in_fp32=True)
    assert out.dtype == torch.bfloat16
    assert_close(out.double(), reference(query, key, value, 0.3), rtol=0, atol=1e-2)


def _module_paths() -> dict:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_prune.model import segment_attention as module
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig, transformer_config
    from megatron_prune.training.parallel import model_parallel

    out = {}
    with model_parallel(ParallelConfig(), seed=5):
        config = transformer_config(get_preset("tiny"), ParallelConfig())
        attention = module.SegmentAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                            attention_type="self")
        np_, ng, hn = config.num_attention_heads, config.num_query_groups, config.kv_channels
        b, sk = 4, 11
        g = torch.Generator().manual_seed(7)
        query = torch.randn(1, b, np_, hn, generator=g)
        key, value = torch.randn(sk, b, ng, hn, generator=g), torch.randn(sk, b, ng, hn, generator=g)
        calls = []
        original = module.single_query_attention

        def counting(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        module.single_query_attention = counting
        try:
            attention.eval()
            out["decoding"] = attention(query, key, value, None)
            out["decoding_calls"] = len(calls)
            out["megatron"] = DotProductAttention.forward(attention, query, key, value, None)
            attention.train()
            out["training"] = attention(query, key, value, None)
            attention.eval()
            prefill = torch.randn(sk, b, np_, hn, generator=g)
            out["prefill"] = attention(prefill, key, value, None)
            out["prefill_megatron"] = DotProductAttention.forward(attention, prefill, key, value, None)
            out["calls"] = len(calls)
            out["scale"] = attention.softmax_scale
            out["inputs"] = (query, key, value)
        finally:
            module.single_query_attention = original
    return out


def test_local_core_attention_decodes_per_group_and_matches_megatron():
    out = run_distributed(_module_paths, world_size=1)[0]
    assert out["decoding_calls"] == 1  # eval mode, one query, no mask: the per-group path
    assert out["calls"] == 1  # training mode and a multi-token forward keep Megatron's path
    assert_close(out["decoding"], out["megatron"], rtol=1e-5, atol=1e-6)
    assert_close(out["decoding"].double(), reference(*out["inputs"], out["scale"]), rtol=1e-5, atol=1e-6)
    assert_close(out["training"], out["megatron"], rtol=0, atol=0)
    assert_close(out["prefill"], out["prefill_megatron"], rtol=0, atol=0)


def _cached_logits(rotated: bool, kv_heads: int) -> dict:
    import dataclasses

    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.transformer.attention import SelfAttention

    from megatron_prune.model import decode_attention
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    if not rotated:  # Megatron's own path: unrotated keys cached, the whole prefix rotated every forward
        decode_attention.RotatedKeyCacheSelfAttention._adjust_key_value_for_inference = (
            SelfAttention._adjust_key_value_for_inference)
    with model_parallel(ParallelConfig(), seed=11):
        arch = dataclasses.replace(get_preset("tiny"), num_key_value_heads=kv_heads)
        model = setup_model(arch, ParallelConfig(), seed=11)[0]
        attentions = [m for m in model.modules() if isinstance(m, SelfAttention)]
        model.eval()
        g = torch.Generator().manual_seed(3)
        tokens = torch.randint(3, 500, (3, 12), generator=g)
        context = StaticInferenceContext(3, 12)
        logits = []
        with torch.no_grad():
            prefill = 5
            out = model(tokens[:, :prefill], torch.arange(prefill).expand(3, prefill), None,
                        inference_context=context, runtime_gather_output=True)
            logits.append(out)
            context.sequence_len_offset += prefill
            context.enable_decode_mode()
            for position in range(prefill, 12):
                out = model(tokens[:, position : position + 1], torch.full((3, 1), position), None,
                            inference_context=context, runtime_gather_output=True)
                logits.append(out)
                context.sequence_len_offset += 1
            full = model(tokens, torch.arange(12).expand(3, 12), None)  # no cache: a plain causal forward
    # The prefill returns its last position's logits only.
    return {"cached": torch.cat(logits, dim=1), "uncached": full[:, prefill - 1 :],
            "classes": sorted({type(m).__name__ for m in attentions}),
            "first_key": context.key_value_memory_dict[1][0].clone()}


@pytest.mark.parametrize("kv_heads", [2, 4])  # grouped-query and plain multi-head attention
def test_rotated_key_cache_gives_megatrons_bits(kv_heads):
    ours = run_distributed(_cached_logits, world_size=1, rotated=True, kv_heads=kv_heads)[0]
    megatron = run_distributed(_cached_logits, world_size=1, rotated=False, kv_heads=kv_heads)[0]
    assert ours["classes"] == ["RotatedKeyCacheSelfAttention"]
    assert torch.equal(ours["cached"], megatron["cached"])
    assert_close(ours["cached"], ours["uncached"], rtol=1e-4, atol=1e-5)
    # What is cached differs: rotated keys here, unrotated ones in Megatron's path (position 0 is
    # rotated by angle 0, so only the later positions tell them apart).
    assert torch.equal(ours["first_key"][0], megatron["first_key"][0])
    assert not torch.equal(ours["first_key"][1:12], megatron["first_key"][1:12])
    # The cache is stored row- and group-major: one row's keys of one group are contiguous.
    assert ours["first_key"].permute(1, 2, 0, 3).is_contiguous()
