"""Process groups: torch.distributed start-up and Megatron model-parallel state."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Iterator


import torch.distributed as dist

from megatron_prune.accelerator import get_accelerator
from megatron_prune.model.provider import ParallelConfig

logger = logging.getLogger(__name__)

_timeout_minutes: float | None = None
"""The collective timeout initialize_distributed started the process group with."""


class CollectiveTimeout(RuntimeError):
    """A collective timed out or lost a peer; the message names this rank and the call."""


def validate_layout(parallel: ParallelConfig, world_size: int, *, dry_run_hint: bool = True) -> int:
    """Check the layout against the world size; return the data-parallel size. ``dry_run_hint``:
    the command has ``--dry-run`` (the trainers), so a refusal can suggest it."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ValueError(f"--tensor-model-parallel-size ({tp}) and --pipeline-model-parallel-size ({pp}) must be >= 1")
    if world_size % (tp * pp):
        hint = ("" if "WORLD_SIZE" in os.environ else
                " (this process was not started by torchrun, so it is a world of one rank: launch it with "
                "torchrun --nproc-per-node N" + (", or set WORLD_SIZE=N to check a layout with --dry-run)"
                                                 if dry_run_hint else ")"))
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size x "
            f"pipeline-model-parallel-size = {tp} x {pp}{hint}"
        )
    if parallel.sequence_parallel and tp == 1:
        raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
    vpp = parallel.virtual_pipeline_model_parallel_size
    if vpp is not None and (vpp < 2 or pp < 2):
        raise ValueError(f"--virtual-pipeline-model-parallel-size {vpp} needs a value >= 2 and "
                         f"--pipeline-model-parallel-size > 1 (it is {pp})")
    ep = parallel.expert_model_parallel_size
    if ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if (world_size // (tp * pp)) % ep:
        raise ValueError(
            f"--expert-model-parallel-size ({ep}) must divide the data-parallel size "
            f"{world_size // (tp * pp)} (experts are spread over data-parallel ranks)"
        )
    return world_size // (tp * pp)


def world_size_from_env() -> int:
    """``WORLD_SIZE`` (1 when unset), or a ValueError naming a value that is not a positive integer."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"WORLD_SIZE={text!r} is not a positive integer (torchrun sets it; unset it to run one "
                         "process)")
    return int(text)


def check_rendezvous_env() -> None:
    """Several ranks need a rendezvous address: refuse ``WORLD_SIZE > 1`` without ``MASTER_PORT``."""
    world_size = os.environ.get("WORLD_SIZE", "1")
    if world_size != "1" and "MASTER_PORT" not in os.environ:
        raise ValueError(
            f"WORLD_SIZE={world_size} but MASTER_PORT is not set: launch the ranks with torchrun "
            "(python -m torch.distributed.run), which sets MASTER_ADDR and MASTER_PORT, or set both"
        )


def initialize_distributed(*, timeout_minutes: float = 10.0) -> None:
    """Start torch.distributed from torchrun's environment (a single process when absent).

    On CPU this also applies the registered Megatron CPU patches, and on every device the ones
    Megatron needs where Transformer Engine is missing.
    """
    from megatron_prune.patches import apply_cpu_patches, apply_missing_te_patches

    acc = get_accelerator()
    if acc.kind == "cpu":
        apply_cpu_patches()
    apply_missing_te_patches()
    acc.set_device()
    if dist.is_initialized():
        return
    global _timeout_minutes
    _timeout_minutes = timeout_minutes
    timeout = datetime.timedelta(minutes=timeout_minutes)
    world_size = os.environ.get("WORLD_SIZE", "1")
    check_rendezvous_env()
    if "MASTER_PORT" not in os.environ:
        # One process without a rendezvous: an in-process store, so no TCP port is probed and then
        # bound later (another job on the machine could take it in between and fail this one's start).
        dist.init_process_group(backend=acc.process_group_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    rank = int(os.environ.get("RANK", "0"))
    try:
        dist.init_process_group(backend=acc.process_group_backend, rank=rank, world_size=int(world_size),
                                timeout=timeout)
    except RuntimeError as exc:  # torch's DistStoreError names a store key, not the rank that never came
        if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
            raise
        raise CollectiveTimeout(
            f"rank {rank} of {world_size}: not every rank joined the process group within the "
            f"{timeout_minutes:g}-minute timeout (--distributed-timeout-minutes); a rank that stopped before "
            "joining says why in its own node's log (a refused flag, or a data file, tokenizer or checkpoint "
            "that its node lacks)") from exc


def collective_failure(exc: BaseException, *, during: str) -> CollectiveTimeout | None:
    """A :class:`CollectiveTimeout` naming this rank and ``during`` if ``exc`` is a backend error
    from a timed-out collective or a vanished peer (gloo and NCCL raise a bare RuntimeError /
    DistBackendError that names neither); None for any other error."""
    if isinstance(exc, CollectiveTimeout) or not isinstance(exc, RuntimeError) or not dist.is_initialized():
        return None
    text = str(exc).lower()
    where = f"rank {dist.get_rank()} of {dist.get_world_size()}"
    if "timed out" in text or "timeout" in text:
        limit = f"the {_timeout_minutes:g}-minute timeout" if _timeout_minutes is not None else "its timeout"
        what = f"a collective did not complete within {limit} during {during}"
    elif "connection reset" in text or "connection closed" in text or "broken pipe" in text:
        what = f"a collective lost its connection to another rank during {during}"
    else:
        return None
    return CollectiveTimeout(
        f"{where}: {what}; another rank died, hung or is in a different call -- see its log "
        f"(--distributed-timeout-minutes sets the limit). Backend said: {exc}"
    )


@contextlib.contextmanager
def guard_collectives(during: str) -> Iterator[None]:
    """Re-raise a collective timeout / lost peer inside the block as :class:`CollectiveTimeout`."""
    try:
        yield
    except RuntimeError as exc:
        failure = collective_failure(exc, during=during)
        if failure is None:
            raise
        raise failure from exc


def initialize_model_parallel(parallel: ParallelConfig, *, seed: int) -> None:
    """Create Megatron's TP/PP/DP groups for ``parallel`` and seed the RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    validate_layout(parallel, dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        # --distributed-timeout-minutes for every group it creates, not only the world group
        **({} if _timeout_minutes is None else {"distributed_timeout_minutes": _timeout_minutes}),
    )
    # Pipeline stages draw from different streams (Megatron-LM's offset): the same seed would give
    # stage 1's first layer the dropout masks of stage 0's first layer.
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    get_accelerator().manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down Megatron's parallel state *and* the process groups it created.

    Megatron's own ``destroy_model_parallel`` only forgets its groups; each gloo group keeps its
    threads and sockets, so re-initialising for another layout (tests, converters) leaks
    hundreds of threads per cycle. Every group but the world group is destroyed here.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    world = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)


@contextlib.contextmanager
def model_parallel(parallel: ParallelConfig, *, seed: int = 1234) -> Iterator[None]:
    """Model-parallel state for the duration of the block, always torn down afterwards."""
    initialize_model_parallel(parallel, seed=seed)
    try:
        yield
    finally:
        destroy_model_parallel()


def is_logging_rank() -> bool:
    """First rank of the last pipeline stage, data- and tensor-parallel rank 0: reports metrics."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return True
    if not parallel_state.model_parallel_is_initialized():
        return dist.get_rank() == 0
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown_distributed() -> None:
    """End a finished run: wait for every rank, then destroy all process groups, world included.

    Leaving gloo groups to interpreter teardown lets one rank close its sockets while a peer's
    gloo threads still run, which intermittently aborts that peer ("terminate called without an
    active exception") after a run that had finished. Only called after success: on an error the
    peers may never reach the barrier.
    """
    if not dist.is_initialized():
        return
    with guard_collectives("the end-of-run barrier"):
        dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()


def expert_parallel_max(value: int) -> int:
    """The largest ``value`` over the data-parallel ranks under expert parallelism, ``value`` itself
    otherwise (then nothing is communicated).

    The ranks of an expert-parallel group (a slice of the data-parallel ranks) run every MoE
    forward together — the token dispatcher is a collective over the group — so they must run as
    many forwards as each other. Collective over the data-parallel group when EP > 1.
    """
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() == 1:
        return value
    (value,) = max_over_ranks(value, group=parallel_state.get_data_parallel_group())
    return value


def schedule_microbatches(value: int) -> int:
    """How many microbatches a pass that needs ``value`` runs (0 stays 0): the most any rank of
    its expert-parallel group needs (:func:`expert_parallel_max`, collective under EP), rounded up
    to a multiple of the pipeline stages under the interleaved schedule, which runs microbatches
    in groups of one per stage through each model chunk and refuses fewer, or a remainder. The
    extra microbatches are the caller's placeholders (rows without items)."""
    from megatron.core import parallel_state

    value = expert_parallel_max(value)
    if value and (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        value = -(-value // stages) * stages
    return value


def max_over_ranks(*values: int, group=None) -> tuple[int, ...]:
    """Each value's largest over the ranks of ``group`` (the world by default), in one all-reduce;
    the values themselves without a process group or on a group of one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return tuple(int(v) for v in values)
    import torch

    largest = torch.tensor([int(v) for v in values], dtype=torch.long)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return tuple(largest.tolist())


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """Each flag, true when it is true on any rank. Collective over the world (one all-reduce)."""
    return tuple(bool(v) for v in max_over_ranks(*flags))


def largest_over_ranks(value: int) -> int:
    """The largest ``value`` over every rank (one all-reduce)."""
    (value,) = max_over_ranks(value)
    return value


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


__all__ = [
    "CollectiveTimeout",
    "any_rank",
    "barrier",
    "collective_failure",
    "broadcast_object",
    "check_rendezvous_env",
    "destroy_model_parallel",
    "expert_parallel_max",
    "largest_over_ranks",
    "schedule_microbatches",
    "guard_collectives",
    "initialize_distributed",
    "initialize_model_parallel",
    "is_logging_rank",
    "model_parallel",
    "shutdown_distributed",
    "validate_layout",
    "world_size",
]
