"""Dist checkpoints saved at one layout load bit-exact at another."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed


def save_then_load(*, save_layout: dict, load_layouts: list[dict], root: str) -> list[dict]:
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    arch = get_preset("tiny")
    parallel = ParallelConfig(**save_layout)
    with model_parallel(parallel, seed=7):
        model = setup_model(arch, parallel, seed=7, trainable=False)
        saved = gather_global_state(model)
        save_checkpoint(root, iteration=3, model=model, arch=arch)
    out = []
    for layout in load_layouts:
        parallel = ParallelConfig(**layout)
        with model_parallel(parallel, seed=99):  # a different seed: every weight must come from disk
            model = setup_model(arch, parallel, seed=99, trainable=False)
            meta = load_checkpoint(root, model=model, arch=arch)
            out.append(dict(iteration=meta["iteration"], same=_same(saved, gather_global_state(model))))
    return out


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_tp2xpp2_checkpoint_reloads_bit_exact_at_other_layouts(tmp_path):
    layouts = [
        dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1),
        dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=1),
        dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=4),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1),
    ]
    results = run_distributed(
        save_then_load, 4, root=str(tmp_path / "ckpt"),
        save_layout=dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
        load_layouts=layouts,
    )
    for layout, res in zip(layouts, results[0]):
        assert res["iteration"] == 3
        assert res["same"], f"weights differ after loading at {layout}"


def rng_after_resume(*, root: str) -> dict:
    """Each rank's torch generator saved at DP=2 (a state per rank), then after a resume at DP=2 and
    after one at TP=2 (the same world size)."""
    import torch.distributed as dist

    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    arch = get_preset("tiny")
    out = {}
    for name, layout in (("save", {}), ("dp2", {}), ("tp2", dict(tensor_model_parallel_size=2))):
        parallel = ParallelConfig(**layout)
        with model_parallel(parallel, seed=7):
            model = setup_model(arch, parallel, seed=7, trainable=False)
            if name == "save":
                torch.manual_seed(1000 + dist.get_rank())  # a state of this rank's own
                save_checkpoint(root, iteration=1, model=model, arch=arch)
            else:
                load_checkpoint(root, model=model, arch=arch, restore_rng=True)
            out[name] = torch.get_rng_state()
    return out


@pytest.mark.distributed
def test_rank_generators_are_restored_at_the_saving_layout_only(tmp_path):
    """At another layout of the same world size rank k holds another part of the model: TP ranks
    given two former DP ranks' states would draw different LoRA dropout masks on one input."""
    ranks = run_distributed(rng_after_resume, 2, root=str(tmp_path / "ckpt"))
    assert not torch.equal(ranks[0]["save"], ranks[1]["save"])
    for got in ranks:
        assert torch.equal(got["dp2"], got["save"])
        assert not torch.equal(got["tp2"], got["save"])
    assert torch.equal(ranks[0]["tp2"], ranks[1]["tp2"])  # the launch's seeding: one stream for both TP ranks
