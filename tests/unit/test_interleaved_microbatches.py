"""Under the interleaved schedule a step's microbatches are a multiple of the pipeline stages (not of
the model chunks per stage), at least one per stage."""

from __future__ import annotations

import pytest

from megatron_prune.config import ModelConfig, TrainConfig
from megatron_prune.training.session import UsageError, check_interleaved_microbatches


def _check(pp: int, vpp: int, global_batch: int, micro_batch: int = 1, dp: int = 1) -> None:
    check_interleaved_microbatches(
        ModelConfig(model_preset="tiny", pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp),
        TrainConfig(global_batch_size=global_batch, micro_batch_size=micro_batch), dp=dp)


def test_a_multiple_of_the_pipeline_stages_passes_whatever_the_model_chunks():
    _check(pp=2, vpp=4, global_batch=4, micro_batch=2)  # 2 microbatches: one per stage, fewer than the 4 chunks
    _check(pp=2, vpp=3, global_batch=8, micro_batch=2)  # 4: not a multiple of the 3 chunks
    _check(pp=4, vpp=2, global_batch=8, micro_batch=1, dp=2)  # 4 per data-parallel rank


@pytest.mark.parametrize("pp, vpp, global_batch, micro_batch, dp, gives", [
    pytest.param(4, 2, 2, 1, 1, 2, id="fewer-than-the-stages-though-a-multiple-of-the-chunks"),
    pytest.param(4, 2, 6, 1, 1, 6, id="not-a-multiple-of-the-stages-though-one-of-the-chunks"),
    pytest.param(2, 4, 6, 2, 1, 3, id="odd-count"),
])
def test_a_count_that_is_no_multiple_of_the_pipeline_stages_is_refused(pp, vpp, global_batch, micro_batch, dp, gives):
    message = (rf"--virtual-pipeline-model-parallel-size {vpp} needs a multiple of --pipeline-model-parallel-size "
               rf"{pp} microbatches per step; .* gives {gives}$")
    with pytest.raises(UsageError, match=message):
        _check(pp, vpp, global_batch, micro_batch, dp)


def test_without_the_interleaved_schedule_any_count_passes():
    _check(pp=4, vpp=1, global_batch=3)
