"""A save that fails in what rank 0 alone writes (the ``iter_*.tmp`` folder it creates, then
``trainer_state.pt`` and ``meta.json`` after the shards) stops every rank with the same ``--save``
error, instead of letting the other ranks go on as if the checkpoint were saved, into the next
collective, waiting for a rank that stopped (on NCCL, until --distributed-timeout-minutes)."""

from __future__ import annotations

import os

import pytest

from tests.dist import run_distributed


def _rank_0_disk_fills(root: str, where: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_prune.model.arch import get_preset
    from megatron_prune.training import checkpoint as ckpt

    def fake_save(state, path):  # the sharded write (collective in Megatron) succeeds on every rank
        if dist.get_rank() == 0:
            for name in ("shard_0.distcp", ".metadata"):
                with open(os.path.join(path, name), "w") as f:
                    f.write("x")
        dist.barrier()

    dist_checkpointing.save = fake_save
    ckpt._rng_tracker_states = lambda: {}
    real_save, real_makedirs = torch.save, os.makedirs

    def save(iteration):
        return ckpt.save_checkpoint(root, iteration=iteration, model=[], arch=get_preset("tiny"),
                                    trainer_state={"objective": {"step": iteration}})

    save(2)

    def disk_full_save(obj, path, *args, **kwargs):
        if isinstance(path, str) and path.endswith("trainer_state.pt"):
            raise OSError(28, "No space left on device")
        return real_save(obj, path, *args, **kwargs)  # torch pickles tensors through it (all_gather_object)

    def disk_full_makedirs(path, *args, **kwargs):
        if str(path).endswith(os.path.join("iter_0000004.tmp", "dist")):
            raise OSError(28, "No space left on device")
        return real_makedirs(path, *args, **kwargs)

    if where == "trainer_state":
        torch.save = disk_full_save
    else:
        os.makedirs = disk_full_makedirs
    try:
        save(4)
        outcome = "returned"
    except ckpt.CheckpointError as exc:
        outcome = str(exc)
    except Exception as exc:  # noqa: BLE001 - what the rank saw instead of the --save error
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        torch.save, os.makedirs = real_save, real_makedirs
    return {"outcome": outcome}


@pytest.mark.parametrize("where", ["trainer_state", "mkdir"])
def test_a_disk_full_in_rank_0s_files_stops_every_rank_with_the_save_error(tmp_path, where):
    root = str(tmp_path / "ckpts")
    results = run_distributed(_rank_0_disk_fills, 2, root=root, where=where)
    tmp = f"{root}/iter_0000004.tmp"
    expected = (f"--save {root}: writing the checkpoint of iteration 4 into {tmp} failed" if where == "trainer_state"
                else f"--save {root}: creating {tmp} for the checkpoint of iteration 4 failed")
    for rank, result in enumerate(results):
        assert result["outcome"] == (f"{expected} (OSError: [Errno 28] No space left on device); the checkpoints "
                                     "published before it are intact"), f"rank {rank}"
    # on disk: the previous checkpoint is the newest complete one, and the tracker still names it
    assert [d for d in sorted(os.listdir(root)) if not d.endswith(".tmp")] == [
        "iter_0000002", "latest_checkpointed_iteration.txt"]
    with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "2"


def _rank_0_cannot_copy_the_hf_files(root: str, hf_dir: str) -> dict:
    import torch.distributed as dist

    from megatron_prune.config import CheckpointConfig
    from megatron_prune.model import hf_convert
    from megatron_prune.training import checkpoint as ckpt, loop

    def disk_full_copy(src, dst, *args, **kwargs):
        if dist.get_rank() == 0:
            raise OSError(28, "No space left on device")

    hf_convert.copy_hf_assets = disk_full_copy
    try:
        loop._carry_hf_assets(CheckpointConfig(save=root), hf_dir)
        outcome = "returned"
    except ckpt.CheckpointError as exc:
        outcome = str(exc)
    except Exception as exc:  # noqa: BLE001 - what the rank saw instead of the --save error
        outcome = f"{type(exc).__name__}: {exc}"
    return {"outcome": outcome}


def test_a_failed_copy_of_the_hf_files_stops_every_rank_with_the_save_error(tmp_path):
    """Before a save rank 0 alone copies the HF config and tokenizer files beside the checkpoints;
    a full disk there must stop every rank, not rank 0 alone with the others waiting in the save."""
    root, hf_dir = tmp_path / "ckpts", tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    results = run_distributed(_rank_0_cannot_copy_the_hf_files, 2, root=str(root), hf_dir=str(hf_dir))
    for rank, result in enumerate(results):
        assert result["outcome"] == (
            f"--save {root}: copying the HF config and tokenizer files into {root}/hf_assets failed "
            "([Errno 28] No space left on device); this iteration was not saved, the checkpoints published "
            "before it are intact"), f"rank {rank}"
