"""Layout-independent weight initialisation: one seed, one model, at any TP x PP x VPP.

Every tensor is generated whole from a generator seeded by (seed, checkpoint key, layer) and each
rank copies out its own shard, located through Megatron's own ``sharded_state_dict`` (the same
map dist checkpointing uses). So a TP=2 x PP=2 model holds exactly the slices of the TP=1
model built from the same seed.
"""

from __future__ import annotations

import hashlib

import torch

from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

INIT_STD = 0.02


def iter_sharded_tensors(sharded_state_dict) -> list[ShardedTensor]:
    """Flatten a sharded state dict into ShardedTensors whose ``data`` alias the parameters."""
    out: list[ShardedTensor] = []

    def visit(value) -> None:
        if isinstance(value, ShardedTensor):
            out.append(value)
        elif isinstance(value, ShardedTensorFactory):
            visit(value.build())
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    visit(sharded_state_dict)
    return out


def _seed_for(seed: int, key: str, prefix: tuple[int, ...]) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{prefix}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _global_init(key: str, shape: tuple[int, ...], seed: int, prefix: tuple[int, ...]) -> torch.Tensor:
    name = key.rsplit(".", 1)[-1]
    if "norm" in key and name.endswith("weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(_seed_for(seed, key, prefix))
    return torch.randn(shape, generator=gen) * INIT_STD


def global_slice(sh: ShardedTensor, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` (global shape without prepended axes) that ``sh`` holds locally."""
    p = sh.prepend_axis_num
    index = tuple(
        slice(off, off + size) for off, size in zip(sh.global_offset[p:], sh.local_shape)
    )
    return full[index]


@torch.no_grad()
def init_model_chunks(chunks: list[torch.nn.Module], *, seed: int) -> None:
    """Initialise every parameter of this rank's chunks from the layout-independent global model."""
    for chunk in chunks:
        for sh in iter_sharded_tensors(chunk.sharded_state_dict()):
            if sh.data is None or not torch.is_floating_point(sh.data):
                continue
            p = sh.prepend_axis_num
            prefix = tuple(sh.global_offset[:p])
            full = _global_init(sh.key, tuple(sh.global_shape[p:]), seed, prefix)
            sh.data.copy_(global_slice(sh, full).to(sh.data.dtype))
