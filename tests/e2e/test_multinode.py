"""Two torchrun agents on this machine act as two nodes (c10d rendezvous on loopback) and train
a few DPO steps at TP=2 x DP=2 through examples/dpo_multinode.sh."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.e2e.conftest import REPO, launch_env, free_port, read_jsonl, _kill_group

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

SCRIPT = str(REPO / "examples" / "dpo_multinode.sh")
STEPS = 2


def _env(node_rank: int, port: int, **extra: str) -> dict[str, str]:
    return launch_env(NODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GPUS="2", TP="2", PP="1", PYTHON=sys.executable, RDZV_ID=f"test-{port}", **extra)


def _plugin_args(metrics) -> list[str]:
    return ["--train-iters", str(STEPS), "--global-batch-size", "4", "--micro-batch-size", "1",
            "--seq-length", "128", "--max-prompt-length", "64", "--lr", "1e-3", "--device", "cpu",
            "--metrics-jsonl", str(metrics)]


def test_dry_run_prints_the_torchrun_command():
    out = subprocess.run(["bash", SCRIPT, "--train-iters", "3"], env=_env(1, 29555, DRY_RUN="1"),
                         capture_output=True, text=True, check=True).stdout
    for part in ("-m torch.distributed.run", "--nnodes 2", "--node-rank 1", "--nproc-per-node 2",
                 "--rdzv-backend c10d", "--rdzv-endpoint 127.0.0.1:29555", "-m megatron_prune.dpo",
                 "--tensor-model-parallel-size 2", "--prune-branch", "--train-iters 3"):
        assert part in out, out


@pytest.mark.slow  # 4 ranks on 2 cores: ~95 s measured
def test_two_nodes_on_loopback_train_tp2_dp2(tmp_path):
    port = free_port()
    metrics = tmp_path / "m.jsonl"
    procs, logs = [], []
    for node in (0, 1):
        logs.append(tmp_path / f"node{node}.txt")
        procs.append(subprocess.Popen(["bash", SCRIPT, *_plugin_args(metrics)], cwd=REPO, env=_env(node, port),
                                      stdout=logs[-1].open("w"), stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(1.0)  # node 0 hosts the rendezvous store
    deadline = time.monotonic() + 420
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("two-node run timed out:\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    finally:
        for proc in procs:
            _kill_group(proc)
    outputs = [log.read_text() for log in logs]
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} exit {proc.returncode}:\n{out[-4000:]}"
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["loss"] == r["loss"] and not r["skipped"] for r in records)
    assert sum(f"step {STEPS}/{STEPS}" in out for out in outputs) == 1  # one logging rank in the job
