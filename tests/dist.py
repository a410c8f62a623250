"""Run a test function on N gloo ranks (CPU) and collect each rank's return value.

``run_distributed(fn, world_size, **kwargs)`` starts ``world_size`` processes; each starts
torch.distributed through the plugin's own ``initialize_distributed`` (so the CPU patches are
applied exactly as in production), calls ``fn(**kwargs)`` and returns its (picklable) result.
``fn`` must be a module-level function of an importable test module. Parallel state is torn
down in ``finally`` blocks, so a failing layout cannot poison the next launch.

The ranks are forked from a ``forkserver`` that imported torch and Megatron once per test session,
so a launch costs about a second instead of the 5-15 s of importing Megatron in every rank; a rank
still starts with nothing initialised (no process group, no parallel state, the test's environment
restored). Checking one layout of a tiny model takes < 1 s, so tests loop over layouts inside one
launch with :func:`megatron_prune.training.parallel.model_parallel`.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, fn: Callable, world_size: int, port: int, outdir: str, kwargs: dict,
            environ: dict[str, str]) -> None:
    # A forkserver child starts from the server's environment, not the test's: restore the test's.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")

    torch.set_num_threads(1)
    from megatron_prune.training.parallel import initialize_distributed

    try:
        initialize_distributed(timeout_minutes=3)
        open(os.path.join(outdir, f"{rank}.started"), "w").close()
        result = fn(**kwargs)
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException:  # report, then fail the process so the launcher sees it
        with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class DistributedTestError(AssertionError):
    pass


_PORT_TAKEN = ("EADDRINUSE", "address already in use")


# Ranks fork from a server that imported these once per test session (~4 s a rank with "spawn",
# where every rank imports Megatron again); they hold no state until a rank initializes.
mp.set_forkserver_preload(["torch", "torch.distributed", "megatron.core", "megatron_prune.training.parallel"])


def run_distributed(fn: Callable, world_size: int, **kwargs: Any) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``world_size`` gloo ranks; return the per-rank results.

    The rendezvous port is probed free and bound seconds later by rank 0, after Megatron's
    imports; a concurrent job (the mutation harness runs two) can take it in between. A launch
    that fails only because the port was taken, before ``fn`` ran, is retried on a new port.
    """
    for attempt in range(3):
        with tempfile.TemporaryDirectory() as outdir:
            try:
                mp.start_processes(
                    _worker,
                    args=(fn, world_size, _free_port(), outdir, kwargs, dict(os.environ)),
                    nprocs=world_size,
                    join=True,
                    start_method="forkserver",
                )
            except Exception as exc:  # noqa: BLE001 - re-raised with every rank's traceback
                reports = []
                for rank in range(world_size):
                    path = os.path.join(outdir, f"{rank}.pkl")
                    if os.path.exists(path):
                        with open(path, "rb") as f:
                            status, payload = pickle.load(f)
                        if status == "error":
                            reports.append(f"--- rank {rank} ---\n{payload}")
                text = "\n".join(reports) or str(exc)
                started = any(os.path.exists(os.path.join(outdir, f"{rank}.started")) for rank in range(world_size))
                if attempt < 2 and not started and any(mark in text for mark in _PORT_TAKEN):
                    continue
                raise DistributedTestError(text) from None
            results = []
            for rank in range(world_size):
                with open(os.path.join(outdir, f"{rank}.pkl"), "rb") as f:
                    results.append(pickle.load(f)[1])
            return results
    raise AssertionError("unreachable: the last attempt returns or raises")


def every_rank(results: list[dict]) -> Iterator[tuple[int, Any, Any]]:
    """``(rank, key, value)`` over every rank's result dict, after checking that every rank
    returned the same cases: a test checks what each rank computed, not only rank 0's."""
    keys = list(results[0])
    for rank, result in enumerate(results):
        assert list(result) == keys, f"rank {rank} returned cases {list(result)}, rank 0 {keys}"
    for rank, result in enumerate(results):
        for key, value in result.items():
            yield rank, key, value
