"""Assemble whole (layout-independent) tensors from every rank's shards.

Used to compare a TP x PP run with the single-rank run tensor by tensor, and to export.
Keys are Megatron's checkpoint keys; layer-stacked tensors keep their leading layer axis.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron.core.utils import unwrap_model

from megatron_prune.model.init import iter_sharded_tensors


@contextlib.contextmanager
def _params_hold(chunks, source: str) -> Iterator[None]:
    """Temporarily put each parameter's ``source`` (``main_grad``) into its data."""
    stash = []
    with torch.no_grad():
        for chunk in chunks:
            for p in unwrap_model(chunk).parameters():
                value = getattr(p, source, None)
                if value is None:
                    value = torch.zeros_like(p)
                stash.append((p, p.data.clone()))
                p.data.copy_(value.view_as(p).to(p.dtype))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, data in stash:
                p.data.copy_(data)


def _from_every_rank(pieces: list) -> list[list]:
    """Every rank's ``pieces``, in rank order, on every rank (one process: just these)."""
    if not dist.is_initialized():
        return [pieces]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    return everyone


def gather_global_state(chunks, *, source: str = "param") -> dict[str, torch.Tensor]:
    """Whole tensors (fp32, CPU) on every rank: parameters (``param``) or gradients (``main_grad``)."""
    ctx = contextlib.nullcontext() if source == "param" else _params_hold(chunks, source)
    pieces = []
    with ctx:
        for chunk in chunks:
            for sh in iter_sharded_tensors(unwrap_model(chunk).sharded_state_dict()):
                if sh.data is None or not torch.is_floating_point(sh.data):
                    continue
                if any(r != 0 for r in (sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,))):
                    continue
                pieces.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                               sh.data.detach().float().cpu().clone()))
    everyone = _from_every_rank(pieces)
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in everyone:
        for key, shape, offset, data in rank_pieces:
            full = out.setdefault(key, torch.full(shape, float("nan")))
            lead = len(shape) - data.dim()
            index = tuple(offset[:lead]) + tuple(
                slice(o, o + n) for o, n in zip(offset[lead:], data.shape)
            )
            full[index] = data
    return out


def replica_differences(chunks) -> list[str]:
    """Keys of the tensors whose copies differ between the ranks that hold them: data-parallel
    replicas, TP-replicated weights (norms) and a tied embedding's last-stage copy must stay
    bit-identical, which :func:`gather_global_state` (replica 0 only) cannot see. Every rank gets
    the same sorted list; empty when all copies agree."""
    pieces = []
    for chunk in chunks:
        for sh in iter_sharded_tensors(unwrap_model(chunk).sharded_state_dict()):
            if sh.data is not None and torch.is_floating_point(sh.data):
                pieces.append((sh.key, tuple(sh.global_offset), sh.data.detach().float().cpu().clone()))
    everyone = _from_every_rank(pieces)
    first: dict[tuple, torch.Tensor] = {}
    differ = set()
    for rank_pieces in everyone:
        for key, offset, data in rank_pieces:
            seen = first.setdefault((key, offset), data)
            if seen is not data and not torch.equal(seen, data):
                differ.add(key)
    return sorted(differ)
