"""The gloo test launcher (tests/dist.py) itself."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist

import tests.dist as dist_harness


def world_size_of_this_rank() -> int:
    return dist.get_world_size()


def fails_inside_with_a_port_error(marker_dir: str) -> None:
    if dist.get_rank() == 0:  # rank 0 always gets this far; a peer may be stopped before it does
        open(os.path.join(marker_dir, f"ran-{os.getpid()}"), "w").close()
    raise OSError("EADDRINUSE: the function under test itself hit a taken port")


def test_a_port_error_inside_the_function_is_not_retried(tmp_path):
    """Only a launch that failed before the function ran is retried: a failure of the test function
    itself is reported at once, even when its text mentions a taken port."""
    with pytest.raises(dist_harness.DistributedTestError, match="EADDRINUSE: the function under test"):
        dist_harness.run_distributed(fails_inside_with_a_port_error, 2, marker_dir=str(tmp_path))
    assert len(os.listdir(tmp_path)) == 1, "rank 0 ran the function more than once: the launch was retried"


def test_a_taken_rendezvous_port_is_retried_on_a_new_one(monkeypatch):
    """The first probed port is held by another listener when rank 0 binds it: the launch fails
    with EADDRINUSE before the test function runs, and the launcher retries on a fresh port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = dist_harness._free_port
        monkeypatch.setattr(dist_harness, "_free_port", lambda: ports.pop() if ports else real())
        assert dist_harness.run_distributed(world_size_of_this_rank, 2) == [2, 2]
        assert not ports, "the taken port was never tried"
