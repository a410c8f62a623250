"""Adapter dropout masks on 2 gloo ranks: the TP ranks share a mask exactly where they hold the
same adapter input, draw their own where they hold different parts of it, and pipeline stages
draw from different streams."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed

pytestmark = pytest.mark.distributed

SEQ, BATCH = 32, 2


def _first_masks(preset: str, parallel: dict) -> dict:
    """Per kind of adapter (column/row, dense/expert), this rank's first dropout mask and the input it
    dropped, from one training forward (a stage-1 chunk gets a fixed hidden state)."""
    import torch.distributed as dist

    from megatron_prune.model import lora
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    found: dict = {}
    original = lora._LoRAMixin._adapter_input

    def spy(self, x):
        out = original(self, x)
        kind = ("expert " if self.explicit_expert_comm else "") + type(self).__name__
        if x.numel() and kind not in found:
            found[kind] = {"input": x.detach().clone(), "dropped": ((out == 0) & (x != 0)).contiguous()}
        return out

    lora._LoRAMixin._adapter_input = spy
    try:
        par = ParallelConfig(**parallel)
        with model_parallel(par, seed=1234):
            chunk = setup_model(get_preset(preset), par, seed=1234,
                                lora=lora.LoRAConfig(rank=4, dropout=0.5))[0]
            module = chunk.module if hasattr(chunk, "module") else chunk
            tokens = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
            positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
            if par.pipeline_model_parallel_size > 1 and dist.get_rank() == 1:
                hidden = module.config.hidden_size
                module.set_input_tensor(torch.randn(SEQ, BATCH, hidden, generator=torch.Generator().manual_seed(5)))
            module(tokens, positions, None)
    finally:
        lora._LoRAMixin._adapter_input = original
    return found


def masks(runs: dict) -> dict:
    return {name: _first_masks(**kw) for name, kw in runs.items()}


RUNS = {
    "tp2": dict(preset="tiny", parallel=dict(tensor_model_parallel_size=2)),
    "tp2-sp": dict(preset="tiny", parallel=dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": dict(preset="tiny", parallel=dict(pipeline_model_parallel_size=2)),
    "moe-tp2-sp": dict(preset="tiny-moe", parallel=dict(tensor_model_parallel_size=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    return run_distributed(masks, 2, runs=RUNS)


def _same(per_rank: list[dict], run: str, kind: str, what: str) -> bool:
    a, b = (r[run][kind][what] for r in per_rank)
    return a.shape == b.shape and torch.equal(a, b)


def test_each_mask_drops_about_the_given_rate(per_rank):
    for rank, runs in enumerate(per_rank):
        for run, kinds in runs.items():
            for kind, seen in kinds.items():
                rate = seen["dropped"].float().sum() / (seen["input"] != 0).sum()
                assert 0.4 < rate < 0.6, (rank, run, kind, rate)


@pytest.mark.parametrize("run", ["tp2", "tp2-sp"])
def test_tp_ranks_share_a_mask_only_where_they_share_the_input(per_rank, run):
    # without SP a column adapter's input is replicated over TP: one mask, or the ranks' halves of B
    # would see different dropouts of one input; a row adapter holds its rank's input columns, and
    # under SP every adapter its rank's sequence shard (or columns): masks of their own
    column_shared = run == "tp2"
    assert _same(per_rank, run, "LoRAColumnParallelLinear", "input") is column_shared
    assert _same(per_rank, run, "LoRAColumnParallelLinear", "dropped") is column_shared
    assert not _same(per_rank, run, "LoRARowParallelLinear", "dropped")


def test_pipeline_stages_draw_their_own_masks(per_rank):
    # stage 1's first layer must not repeat the mask stage 0's first layer drew
    assert not _same(per_rank, "pp2", "LoRAColumnParallelLinear", "dropped")


def test_expert_tp_ranks_share_the_mask_of_their_shared_tokens(per_rank):
    # the token dispatcher gathers an expert's tokens over expert TP: both ranks' column experts see
    # the same tokens, and must drop the same entries of them
    assert _same(per_rank, "moe-tp2-sp", "expert LoRAColumnParallelLinear", "input")
    assert _same(per_rank, "moe-tp2-sp", "expert LoRAColumnParallelLinear", "dropped")
    assert not _same(per_rank, "moe-tp2-sp", "expert LoRARowParallelLinear", "dropped")
