"""The precomputed reference table (``--ref-mode precomputed``) does not depend on the layout that
computes it: under the interleaved pipeline schedule (which needs a stage's worth of microbatches per
pass) and under expert parallelism with a data size that leaves some data-parallel rank without a pair
in the last pass (its expert-parallel peer still meets it in every MoE all-to-all), the table equals
the single-rank one. Both crashed or hung before every rank ran the same passes."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_dpo_cli import TRAIN, run_cli

pytestmark = pytest.mark.e2e


def _table(tmp_path, name: str, *flags: str, nproc: int) -> dict:
    run = tmp_path / name
    run.mkdir()
    cache = run / "cache"
    run_cli(run, "--data-path", str(tmp_path / "pairs.jsonl"), "--train-iters", "1", "--global-batch-size", "4",
            "--ref-mode", "precomputed", "--ref-cache", str(cache), "--distributed-timeout-minutes", "2", *flags,
            nproc=nproc, timeout=400)
    (path,) = cache.glob("ref_logps_*.pt")
    return torch.load(path)["logps"]


@pytest.mark.parametrize("model, layout", [
    pytest.param(["--micro-batch-size", "1"],
                 ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"], id="pp2-vpp2"),
    pytest.param(["--model-preset", "tiny-moe", "--micro-batch-size", "2"], ["--expert-model-parallel-size", "2"],
                 id="moe-ep2-uneven-data"),
])
def test_the_reference_table_is_the_single_rank_one(tmp_path, model, layout):
    with open(TRAIN) as src:  # 17 pairs: the last pass of 2 ranks x 2 pairs has one pair
        (tmp_path / "pairs.jsonl").write_text("".join(src.readlines()[:17]))
    single = _table(tmp_path, "single", *model, nproc=1)
    table = _table(tmp_path, "layout", *model, *layout, nproc=2)
    assert single.keys() == table.keys() and len(single) == 2 * 17
    for key, values in single.items():
        torch.testing.assert_close(table[key], values, rtol=1e-5, atol=1e-6)
