"""The segment path honours the model's attention settings as Megatron's own attention does.

``SegmentAttention`` (the local layer spec's core attention) is built the way Megatron's
``SelfAttention`` builds its core attention and compared with Megatron's ``DotProductAttention``
on the equivalent dense mask: with a configured ``softmax_scale``, and with attention dropout
(refused in training, where the segment path would silently drop none; plain attention in eval).
The per-token rotary angles that a ``segments=`` forward uses are compared with Megatron's own
``RotaryEmbedding`` at the same positions, with position interpolation and interleaved rotary.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.testing import assert_close

from tests.dist import run_distributed


def _layout():
    from megatron_prune.model.segments import Segment, SegmentLayout

    # [prompt, r1, r2] and a second group after a gap of padding
    return SegmentLayout(rows=[[Segment(0, 5), Segment(5, 8, 0, 5), Segment(8, 12, 0, 5), Segment(13, 16)]],
                         seq_length=16)


def _segment_and_megatron(*, softmax_scale: float | None = None, attention_dropout: float = 0.0) -> dict:
    """Outputs of SegmentAttention (segment table) and DotProductAttention (dense mask), per mode."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig, transformer_config
    from megatron_prune.model.segment_attention import SegmentAttention
    from megatron_prune.training.parallel import model_parallel

    out = {}
    with model_parallel(ParallelConfig(), seed=3):
        config = transformer_config(get_preset("tiny"), ParallelConfig())
        config.softmax_scale, config.attention_dropout = softmax_scale, attention_dropout
        # As Megatron's SelfAttention builds its core attention: the config's scale passed on.
        segment, megatron = (cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self", softmax_scale=config.softmax_scale)
                             for cls in (SegmentAttention, DotProductAttention))
        layout = _layout()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(16, 1, config.num_attention_heads, config.kv_channels, generator=g)
        k, v = torch.randn(2, 16, 1, config.num_query_groups, config.kv_channels, generator=g)
        for mode in ("train", "eval"):
            segment.train(mode == "train")
            megatron.train(mode == "train")
            try:
                out[mode] = segment(q, k, v, layout.to_table(), attn_mask_type=AttnMaskType.causal)
            except ValueError as exc:
                out[mode] = str(exc)
            if mode == "eval" or attention_dropout == 0:
                out[f"{mode}_megatron"] = megatron(q, k, v, layout.dense_mask(), attn_mask_type=AttnMaskType.causal)
        out["default_scale"] = config.kv_channels ** -0.5
    return out


def test_configured_softmax_scale_is_megatrons():
    """A non-default softmax_scale: the segment path equals Megatron's attention with that scale
    (and differs from the default 1/sqrt(d), so the scale is what the comparison checks)."""
    out = run_distributed(_segment_and_megatron, world_size=1, softmax_scale=0.05)[0]
    assert 0.05 != pytest.approx(out["default_scale"])
    assert_close(out["train"], out["train_megatron"], rtol=1e-5, atol=1e-6)
    assert_close(out["eval"], out["eval_megatron"], rtol=1e-5, atol=1e-6)
    default = run_distributed(_segment_and_megatron, world_size=1)[0]
    assert (default["train"] - out["train"]).abs().max() > 1e-2


def test_attention_dropout_is_refused_in_training_only():
    """Attention dropout the segment path does not implement: a training forward is refused with a
    message; an eval forward (no dropout anywhere) runs and is Megatron's attention."""
    out = run_distributed(_segment_and_megatron, world_size=1, attention_dropout=0.1)[0]
    assert isinstance(out["train"], str) and "does not implement attention dropout" in out["train"]
    assert not isinstance(out["eval"], str), out["eval"]
    assert_close(out["eval"], out["eval_megatron"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"seq_len_interpolation_factor": 2.0}, {"rotary_interleaved": True}],
                         ids=["default", "interpolation", "interleaved"])
def test_per_token_rotary_is_megatrons_rotary_at_each_position(options, monkeypatch):
    """Per-token rotary angles of a ``segments=`` forward (a response's positions continue from
    its prompt's end, not from the row index) are Megatron's RotaryEmbedding at those positions."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_prune.model.selective_gpt import SelectiveGPTModel

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # Megatron moves inv_freq to the GPU
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True,
                           **options)
    megatron = rope(32)  # [32, 1, 1, d]: positions 0..31
    # row 0: [prompt 0..9, r1 10..19, r2 10..21]; row 1: two sequences restarting at 0
    positions = torch.stack([torch.cat([torch.arange(20), torch.arange(10, 22)]),
                             torch.cat([torch.arange(12), torch.arange(20)])])
    ours = SelectiveGPTModel._per_token_rotary(types.SimpleNamespace(rotary_pos_emb=rope), positions)
    assert ours.shape == (32, 2, 1, 16)
    for row in range(2):
        assert_close(ours[:, row], megatron[positions[row], 0], rtol=0, atol=1e-6)
