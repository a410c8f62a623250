"""Atomic, resharding checkpoints on Megatron dist checkpointing (torch_dist).

Layout of a save directory::

    SAVE/latest_checkpointed_iteration.txt   the newest complete iteration (replaced atomically)
    SAVE/iter_0000010/                        one complete checkpoint
        meta.json                             architecture, iteration, format; written last
        dist/                                 model (+ optimizer) sharded state, any TP x PP x DP
        trainer_state.pt                      data position, sampler/DPPO state, per-rank RNG

A checkpoint is written into ``iter_XXXXXXX.tmp`` and renamed into place only when complete, so
a kill during a save leaves the previous checkpoint loadable. ``--load`` picks the newest
complete one and says which.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from megatron_prune.model.arch import ModelArch

logger = logging.getLogger(__name__)

FORMAT = "megatron-prune/1"
TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META)) and os.path.isdir(os.path.join(path, "dist"))


def find_latest(root: str) -> str:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one)."""
    if _is_complete(root):
        return root
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: directory does not exist")
    tracker = os.path.join(root, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        candidate = iteration_dir(root, int(text)) if text.isdigit() else os.path.join(root, text)
        if _is_complete(candidate):
            return candidate
        logger.warning("%s names %s, which is incomplete; scanning for another", tracker, candidate)
    complete = sorted(
        d for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit() and _is_complete(os.path.join(root, d))
    )
    if not complete:
        raise CheckpointError(f"--load {root}: no complete checkpoint found (expected iter_*/{META})")
    return os.path.join(root, complete[-1])


def read_meta(path: str) -> dict[str, Any]:
    """Metadata of the newest complete checkpoint at ``path`` (with its resolved ``path``)."""
    ckpt = find_latest(path)
    with open(os.path.join(ckpt, META), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    meta["path"] = ckpt
    return meta


def read_arch(path: str) -> ModelArch:
    return ModelArch.from_dict(read_meta(path)["arch"])


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _model_sharded_state_dict(model: list[torch.nn.Module]) -> dict[str, Any]:
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def save_checkpoint(
    root: str,
    *,
    iteration: int,
    model: list[torch.nn.Module],
    arch: ModelArch,
    optimizer=None,
    scheduler_state: dict | None = None,
    trainer_state: dict | None = None,
    extra_meta: dict | None = None,
) -> str:
    """Save model (and optimizer) shards plus trainer state; publish atomically. Collective."""
    from megatron.core import dist_checkpointing

    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "dist"))
    _barrier()
    state = _model_sharded_state_dict(model)
    if optimizer is not None:
        flat = {}
        for sd in state.values():
            flat.update(sd)
        state["optimizer"] = optimizer.sharded_state_dict(flat)
    dist_checkpointing.save(state, os.path.join(tmp, "dist"))
    rng = {
        "torch": torch.get_rng_state(),
        "tracker": _rng_tracker_states(),
    }
    gathered: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, rng)
    else:
        gathered = [rng]
    if _rank() == 0:
        torch.save(
            {"trainer": trainer_state or {}, "scheduler": scheduler_state or {}, "rng_per_rank": gathered},
            os.path.join(tmp, "trainer_state.pt"),
        )
        meta = {"format": FORMAT, "iteration": iteration, "arch": arch.to_dict(),
                "has_optimizer": optimizer is not None, **(extra_meta or {})}
        with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def load_checkpoint(
    path: str,
    *,
    model: list[torch.nn.Module],
    arch: ModelArch | None = None,
    optimizer=None,
    restore_rng: bool = False,
) -> dict[str, Any]:
    """Load the newest complete checkpoint at ``path`` into ``model`` (any layout). Collective.

    Returns the metadata plus ``trainer`` / ``scheduler`` states when present.
    """
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    ckpt = meta["path"]
    if arch is not None and ModelArch.from_dict(meta["arch"]) != arch:
        raise CheckpointError(
            f"{ckpt}: checkpoint architecture {meta['arch']} does not match the model being built "
            f"{arch.to_dict()}; drop --model-preset/--hf-model to take the architecture from the checkpoint"
        )
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{ckpt}: has no optimizer state (a converted model?); use --finetune to load weights only")
    state = _model_sharded_state_dict(model)
    if optimizer is not None:
        flat = {}
        for sd in state.values():
            flat.update(sd)
        state["optimizer"] = optimizer.sharded_state_dict(flat, is_loading=True)
    loaded = dist_checkpointing.load(state, os.path.join(ckpt, "dist"))
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(loaded["model"], strict=False)
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    extra_path = os.path.join(ckpt, "trainer_state.pt")
    if os.path.isfile(extra_path):
        extra = torch.load(extra_path, weights_only=False)
        meta["trainer"] = extra.get("trainer", {})
        meta["scheduler"] = extra.get("scheduler", {})
        per_rank = extra.get("rng_per_rank") or []
        if restore_rng and len(per_rank) == (dist.get_world_size() if dist.is_initialized() else 1):
            torch.set_rng_state(per_rank[_rank()]["torch"])
            _set_rng_tracker_states(per_rank[_rank()]["tracker"])
    if _rank() == 0:
        logger.info("loaded checkpoint %s (iteration %s)", ckpt, meta["iteration"])
    return meta


def _rng_tracker_states():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def _set_rng_tracker_states(states) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(states)
