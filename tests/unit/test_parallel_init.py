"""How a process without torchrun starts torch.distributed."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os
import torch.distributed as dist
from megatron.core import parallel_state
from megatron_prune.model.provider import ParallelConfig
from megatron_prune.training.parallel import initialize_distributed, initialize_model_parallel

initialize_distributed()
initialize_model_parallel(ParallelConfig(), seed=1)
import torch
x = torch.ones(2)
dist.all_reduce(x, group=parallel_state.get_data_parallel_group())
from torch.distributed import distributed_c10d
store = distributed_c10d._get_default_store()
store = getattr(store, "underlying_store", store)  # the default group's store is prefixed
print(dist.get_world_size(), parallel_state.get_tensor_model_parallel_world_size(), x.tolist(),
      "MASTER_PORT" in os.environ, type(store).__name__)
"""


def test_one_process_without_torchrun_needs_no_port():
    """Without torchrun's variables the process group lives on an in-process store: no TCP port is
    probed and bound later, so two single-process jobs started together cannot take the same one.
    Megatron's groups and a collective still work."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "1 1 [1.0, 1.0] False HashStore", out.stdout


def test_several_ranks_without_a_rendezvous_port_are_refused_before_any_work():
    """``WORLD_SIZE=2`` without ``MASTER_PORT`` (ranks started by hand, not by torchrun) cannot
    meet: the CLI says how to launch them, exit code 2, before the model is built."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(WORLD_SIZE="2", RANK="0", PYTHONWARNINGS="ignore")
    sample = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_prune", "data", "samples",
                          "hh_rlhf_sample.jsonl")
    out = subprocess.run([sys.executable, "-m", "megatron_prune.dpo", "--model-preset", "tiny",
                          "--data-path", sample, "--global-batch-size", "4", "--micro-batch-size", "1"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "WORLD_SIZE=2 but MASTER_PORT is not set" in out.stderr and "torchrun" in out.stderr, out.stderr


TIMEOUTS = """
import torch
from megatron.core import parallel_state as ps
from megatron_prune.model.provider import ParallelConfig
from megatron_prune.training.parallel import initialize_distributed, initialize_model_parallel

initialize_distributed(timeout_minutes=0.5)
initialize_model_parallel(ParallelConfig(), seed=1)
groups = {"data": ps.get_data_parallel_group(), "tensor": ps.get_tensor_model_parallel_group(),
          "pipeline": ps.get_pipeline_model_parallel_group(), "expert": ps.get_expert_model_parallel_group()}
for name, group in groups.items():
    print(name, group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


def test_every_parallel_group_waits_as_long_as_the_timeout_flag_says():
    """--distributed-timeout-minutes must reach Megatron's data-, tensor- and pipeline-parallel groups
    too: their default (30 minutes) would keep a rank waiting on a dead peer in the gradient all-reduce."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", TIMEOUTS], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seconds = dict(line.split() for line in proc.stdout.splitlines())
    assert seconds == {"data": "30.0", "tensor": "30.0", "pipeline": "30.0", "expert": "30.0"}, seconds


LONELY = """
from megatron_prune.training.parallel import initialize_distributed

initialize_distributed(timeout_minutes=0.05)
"""


def test_a_rank_that_never_joins_is_named_as_such():
    """Rank 1 stopped before the process group started (its node refused a flag or lacks the data
    file) and says why in its own log; rank 0 waited the whole timeout and then died with torch's
    ``DistStoreError: wait timeout ... keys: /default_pg/0//cpu//0/1``, which names neither."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", LONELY], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert ("CollectiveTimeout: rank 0 of 2: not every rank joined the process group within the 0.05-minute "
            "timeout (--distributed-timeout-minutes); a rank that stopped before joining says why in its own "
            "node's log") in out.stderr, out.stderr[-3000:]
