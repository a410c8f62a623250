"""The DPO step on a CUDA GPU equals the same step on the CPU (fp32, one rank).

Every case of ``tests.gpu.worker.CASES`` (the full, concat and shared layouts, packed rows, the
selective and the whole head, position, sequence and branch pruning) runs through ``DPOStep`` in
one process per device; loss, margins, rewards, the pruning counters and every gradient must
agree. Weights and pruning draws do not depend on the device, so what differs is only the order
of floating-point reductions in the GPU kernels (and the attention kernels PyTorch picks there).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.dpo_harness import assert_same
from tests.gpu.worker import CASES

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# fp32 both sides with TF32 off; GPU reductions run in another order than the CPU's, so
# agreement is to ~1e-6 of each tensor's scale. 1e-4 leaves headroom and still catches a wrong
# mask, a dropped token or a mis-weighted branch (those move gradients by percent).
RTOL, ATOL = 1e-4, 1e-6


def _run(device: str, out: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MASTER_PORT", None)
    subprocess.run([sys.executable, "-m", "tests.gpu.worker", "--device", device, "--out", out],
                   cwd=ROOT, env=env, check=True, timeout=600)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("gpu_parity")
    return {device: _run(device, str(tmp / f"{device}.pt")) for device in ("cpu", "cuda")}


@pytest.mark.parametrize("case", list(CASES))
def test_dpo_step_on_cuda_equals_the_cpu_step(results, case):
    cpu, cuda = results["cpu"][case], results["cuda"][case]
    assert cuda["counters"] == cpu["counters"], f"{case}: the pruning draws differ between devices"
    assert_same(cpu, cuda, f"{case} cuda vs cpu", rtol=RTOL, atol=ATOL)
    assert any(float(g.abs().max()) > 0 for g in cuda["grads"].values()), f"{case}: all gradients are zero"
