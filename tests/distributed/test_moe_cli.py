"""``python -m megatron_prune.dpo`` on the tiny-moe preset at EP=2: flags to metrics to checkpoint (and
a resume of it at EP=1); GRPO at EP=2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_dpo_cli import run_cli


@pytest.mark.e2e
def test_dpo_cli_runs_moe_with_expert_parallelism(tmp_path):
    rows = run_cli(tmp_path, "--model-preset", "tiny-moe", "--expert-model-parallel-size", "2",
                   "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--train-iters", "2",
                   "--global-batch-size", "4", "--micro-batch-size", "1", "--prune-position-ratio", "0.6",
                   "--prune-branch", "--save", str(tmp_path / "ckpt"), nproc=2)
    assert [r["step"] for r in rows] == [0, 1]
    # Reported on every step; positive (each is coefficient x a positive loss, over 3 MoE layers).
    assert all(r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0 for r in rows)
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000002")
    # Exported to HF although EP=2 saved its optimizer state as chained_<i>.optimizer.* (it was refused).
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_megatron_to_hf.py")
    export = subprocess.run([sys.executable, tool, "--load", str(tmp_path / "ckpt"), "--hf-out", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=300)
    assert export.returncode == 0, export.stderr[-2000:]
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors"]
    # Resumed at EP=1 (one optimizer where EP=2 saved a dense and an expert one), optimizer state included.
    resumed_dir = tmp_path / "ep1"
    resumed_dir.mkdir()
    resumed = run_cli(resumed_dir, "--model-preset", "tiny-moe", "--train-iters", "3", "--global-batch-size", "4",
                      "--micro-batch-size", "1", "--prune-position-ratio", "0.6", "--prune-branch",
                      "--load", str(tmp_path / "ckpt"))
    assert [r["step"] for r in resumed] == [2]


@pytest.mark.e2e
def test_dense_runs_report_no_router_losses(tmp_path):
    rows = run_cli(tmp_path, "--train-iters", "1", "--global-batch-size", "2", "--micro-batch-size", "1",
                   "--moe-aux-loss-coeff", "0.01")
    assert "moe_aux_loss" not in rows[0] and "moe_z_loss" not in rows[0]


@pytest.mark.e2e
def test_grpo_cli_runs_moe_with_dppo(tmp_path):
    """GRPO with DPPO and dense packing on tiny-moe at EP=2 (DP=2: the ranks' rollouts end at
    different steps and their training passes run different numbers of microbatches), router
    losses reported."""
    from tests.e2e.conftest import read_jsonl
    from tests.e2e.test_grpo_cli import DPPO, TOY, run_grpo

    metrics = tmp_path / "m.jsonl"
    toy = [a if a != "tiny" else "tiny-moe" for a in TOY]
    run_grpo([*toy, *DPPO, "--micro-batch-size", "8", "--train-iters", "2", "--moe-aux-loss-coeff", "0.01",
              "--expert-model-parallel-size", "2",
              "--metrics-jsonl", str(metrics)],
             log=tmp_path / "run.log").check_ok()
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == [0, 1]
    assert all(r["moe_aux_loss"] > 0 for r in records) and "moe_z_loss" not in records[-1]
    assert records[-1]["kept_completion_fraction"] < 1.0


@pytest.mark.e2e
def test_dpo_shared_layout_branch_pruning_under_expert_and_pipeline_parallelism(tmp_path):
    """At PP=2 the shared layout's pruned branch joins the training row or runs in its own forward-only
    pass, the cheaper per pair; expert-parallel peers (DP=2, EP=2) must make one choice, or one runs a
    pass the other does not and their MoE all-to-alls hang. The run equals the single-rank one."""
    flags = ["--model-preset", "tiny-moe", "--train-iters", "4", "--lr", "1e-3", "--global-batch-size", "8", "--micro-batch-size", "2",
             "--seq-length", "128", "--max-prompt-length", "64", "--seed", "7", "--prune-preset", "study",
             "--dpo-layout", "shared", "--distributed-timeout-minutes", "2"]
    (tmp_path / "one").mkdir()
    (tmp_path / "four").mkdir()
    single = run_cli(tmp_path / "one", *flags)
    four = run_cli(tmp_path / "four", *flags, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size",
                   "2", nproc=4, timeout=400)
    assert [r["step"] for r in four] == [0, 1, 2, 3]
    for a, b in zip(single, four, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
