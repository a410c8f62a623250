"""The gloo test launcher (tests/dist.py) itself."""

from __future__ import annotations

import socket

import torch.distributed as dist

import tests.dist as dist_harness


def world_size_of_this_rank() -> int:
    return dist.get_world_size()


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
