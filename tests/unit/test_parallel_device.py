"""initialize_distributed selects this rank's device before it starts the process group."""

from __future__ import annotations

import os
import subprocess
import sys

_GPU_INIT = """
import types
import megatron_prune.training.parallel as parallel

calls = []
gpu = types.SimpleNamespace(kind="cuda", set_device=lambda: calls.append("set_device"), process_group_backend="gloo")
parallel.get_accelerator = lambda: gpu
parallel.dist.init_process_group = lambda *args, **kwargs: calls.append("init_process_group")
parallel.initialize_distributed()
print(*calls)
"""


def test_each_rank_selects_its_device_before_the_process_group():
    """Without set_device every rank of a node stays on device 0 (duplicate-device errors in
    NCCL/HCCL, or one device out of memory); it must come before the group starts."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", _GPU_INIT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "set_device init_process_group", (out.stdout + out.stderr)[-3000:]
