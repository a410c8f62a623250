"""Checkpoints under the interleaved pipeline schedule (PP=2 x VPP=2, two model chunks per rank).

The chunks of one rank share their local parameter names, so their checkpoint entries must stay
apart for the optimizer state to find its parameters. A DPO run and a GRPO run (DPPO, dense
packing, placeholder microbatches) save at VPP; resuming a checkpoint at VPP repeats the
uninterrupted run's later steps bit for bit, and the DPO checkpoint also resumes at TP=2 without
the interleaved schedule (same losses within fp32). The plain and the distributed optimizer are
both covered.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.conftest import TINY_DPO, read_jsonl, run_cmd, run_dpo, torchrun_cmd
from tests.e2e.test_grpo_resume import ARGS as GRPO_TOY_ARGS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VPP = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]
STEPS = 4


def _resumed_equal(reference: list[dict], resumed: list[dict], keys, *, first: int) -> None:
    assert [r["step"] for r in resumed] == list(range(first, len(reference)))
    for r in resumed:
        for key in keys:
            assert r[key] == reference[r["step"]][key], f"step {r['step']} {key}: {r[key]!r} != {reference[r['step']][key]!r}"


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["adam", "distopt"])
def test_dpo_checkpoint_at_vpp_resumes_exactly_and_at_another_layout(tmp_path, optimizer):
    common = [*TINY_DPO, *optimizer, "--train-iters", str(STEPS)]
    ckpt = tmp_path / "ckpt"
    run_dpo([*common, *VPP, "--save", str(ckpt), "--save-interval", "2", "--metrics-jsonl", str(tmp_path / "ref.jsonl")],
            log=tmp_path / "ref.txt").check_ok()
    reference = read_jsonl(tmp_path / "ref.jsonl")
    assert [r["step"] for r in reference] == list(range(STEPS))

    same = run_dpo([*common, *VPP, "--load", str(ckpt / "iter_0000002"), "--metrics-jsonl", str(tmp_path / "vpp.jsonl")],
                   log=tmp_path / "vpp.txt").check_ok()
    assert "(iteration 2)" in same.output
    _resumed_equal(reference, read_jsonl(tmp_path / "vpp.jsonl"), ("loss", "grad_norm", "margin", "lr"), first=2)

    other = run_dpo([*common, "--tensor-model-parallel-size", "2", "--load", str(ckpt / "iter_0000002"),
                     "--metrics-jsonl", str(tmp_path / "tp2.jsonl")], log=tmp_path / "tp2.txt").check_ok()
    assert "(iteration 2)" in other.output
    got = read_jsonl(tmp_path / "tp2.jsonl")
    assert [r["step"] for r in got] == [2, 3]
    for r in got:
        ref = reference[r["step"]]
        assert r["scored_positions"] == ref["scored_positions"]
        assert math.isclose(r["loss"], ref["loss"], rel_tol=1e-5, abs_tol=1e-6), (r["loss"], ref["loss"])
        assert math.isclose(r["grad_norm"], ref["grad_norm"], rel_tol=1e-4), (r["grad_norm"], ref["grad_norm"])


def test_grpo_at_vpp_trains_saves_and_resumes_exactly(tmp_path):
    steps = 6  # checkpoints at 3 (inside a rollout: two updates per rollout) and 6
    args = [*GRPO_TOY_ARGS, *VPP, "--train-iters", str(steps), "--kl-beta", "0.05"]
    grpo = lambda extra: torchrun_cmd(["-m", "megatron_prune.grpo", *args, *extra], nproc=2)  # noqa: E731
    ckpt = tmp_path / "ckpt"
    run_cmd(grpo(["--save", str(ckpt), "--metrics-jsonl", str(tmp_path / "ref.jsonl")]),
            log=tmp_path / "ref.txt").check_ok()
    reference = read_jsonl(tmp_path / "ref.jsonl")
    assert [r["step"] for r in reference] == list(range(steps))
    assert all(math.isfinite(r["loss"]) for r in reference)
    assert any(r["kept_completion_fraction"] < 1 for r in reference)  # pruned passes ran (placeholders)

    resumed = run_cmd(grpo(["--load", str(ckpt / "iter_0000003"), "--save", str(tmp_path / "resumed"),
                            "--metrics-jsonl", str(tmp_path / "resumed.jsonl")]),
                      log=tmp_path / "resumed.txt").check_ok()
    assert "(iteration 3)" in resumed.output
    _resumed_equal(reference, read_jsonl(tmp_path / "resumed.jsonl"),
                   ("loss", "policy_loss", "kl_loss", "grad_norm", "lr", "reward_mean", "policy_tokens"), first=3)
