"""Microbatch counts the interleaved pipeline schedule accepts, and row lengths that every
tensor-parallel size splits (sequence parallelism shards the sequence over the TP ranks)."""

from __future__ import annotations

import pytest

from megatron_prune.grpo.loss import GRPOLossConfig
from megatron_prune.grpo.step import GRPOStepSettings, TrainItem, layout_items


@pytest.mark.parametrize("pp, vpp, need, runs", [(4, 2, 1, 4), (4, 2, 5, 8), (2, 4, 1, 2), (2, 4, 3, 4),
                                                 (4, 1, 5, 5), (2, 2, 0, 0)])
def test_interleaved_schedule_runs_a_multiple_of_the_pipeline_stages(monkeypatch, pp, vpp, need, runs):
    """Megatron's interleaved schedule takes microbatches in groups of one per pipeline stage (not
    per model chunk): fewer than the stages, or a remainder, is refused."""
    from megatron.core import parallel_state

    from megatron_prune.training.parallel import schedule_microbatches

    monkeypatch.setattr(parallel_state, "get_expert_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: pp)
    monkeypatch.setattr(parallel_state, "get_virtual_pipeline_model_parallel_world_size",
                        lambda: vpp if vpp > 1 else None)
    assert schedule_microbatches(need) == runs


def _items(n: int) -> list[TrainItem]:
    return [TrainItem(prompt_id=k, index=0, prompt=list(range(1, 4 + k)), completion=[7] * (2 + 3 * k), advantage=1.0)
            for k in range(n)]


@pytest.mark.parametrize("tp", [1, 2, 3, 6, 16])
@pytest.mark.parametrize("dense_packing", [False, True])
def test_grpo_rows_split_over_any_tensor_parallel_size(tp, dense_packing):
    settings = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=2, pad_id=0, dense_packing=dense_packing,
                                pack_capacity=40)
    layout = layout_items(_items(5), settings=settings, tp=tp)
    assert layout.seq_length % tp == 0 and layout.seq_length % settings.pad_multiple == 0
    assert all(batch.tokens.shape[1] == layout.seq_length for batch in layout.batches)
