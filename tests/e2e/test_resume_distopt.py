"""Kill-and-resume with ``--use-distributed-optimizer`` (optimizer state sharded over DP=2).

DPO and GRPO runs are SIGKILLed after a checkpoint and resumed: every later step repeats the
uninterrupted run bit for bit (losses, grad norms), so the sharded Adam state and its step count
came back whole. The DPO checkpoint also reloads at TP=2 x DP=1, and loading it without the flag
is refused with a message naming both optimizer layouts.
"""

from __future__ import annotations

import math
import re

import pytest

from tests.e2e.conftest import (TINY_DPO, check_resumed_steps, read_jsonl, run_cmd, run_dpo, run_dpo_until, run_until,
                                torchrun_cmd)
from tests.e2e.test_grpo_resume import ARGS as GRPO_TOY_ARGS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DISTOPT = ["--use-distributed-optimizer"]
STEPS = 6


def test_dpo_distopt_dp2_resume_bit_exact_and_other_layouts(tmp_path):
    common = [*TINY_DPO, *DISTOPT, "--train-iters", str(STEPS), "--save-interval", "2"]
    run_dpo([*common, "--save", str(tmp_path / "ref"), "--metrics-jsonl", str(tmp_path / "ref.jsonl")],
            log=tmp_path / "ref.txt").check_ok()
    reference = read_jsonl(tmp_path / "ref.jsonl")
    assert [r["step"] for r in reference] == list(range(STEPS))

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*common, "--save", str(ckpt), "--metrics-jsonl", str(metrics)]
    run_dpo_until(args, log=tmp_path / "killed.txt", metrics=metrics, lines=3)
    killed = read_jsonl(metrics)
    published = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert published in (2, 4) and killed[-1]["step"] < STEPS - 1
    resumed = run_dpo([*args, "--load", str(ckpt)], log=tmp_path / "resumed.txt").check_ok()
    assert f"(iteration {published})" in resumed.output
    check_resumed_steps(killed=killed, records=read_jsonl(metrics), reference=reference, published=published,
                  keys=("loss", "grad_norm", "margin", "scored_positions", "lr"))

    # The DP=2 checkpoint at TP=2 x DP=1: same steps within fp32 (a different reduction order).
    other = tmp_path / "tp2.jsonl"
    run_dpo([*TINY_DPO, *DISTOPT, "--tensor-model-parallel-size", "2", "--train-iters", str(STEPS),
             "--load", str(tmp_path / "ref" / "iter_0000004"), "--metrics-jsonl", str(other)],
            log=tmp_path / "tp2.txt").check_ok()
    got = read_jsonl(other)
    assert [r["step"] for r in got] == [4, 5]
    for r in got:
        ref = reference[r["step"]]
        assert math.isclose(r["loss"], ref["loss"], rel_tol=1e-5, abs_tol=1e-6), (r["loss"], ref["loss"])
        assert math.isclose(r["grad_norm"], ref["grad_norm"], rel_tol=1e-4), (r["grad_norm"], ref["grad_norm"])

    refused = run_dpo([*TINY_DPO, "--train-iters", str(STEPS), "--load", str(tmp_path / "ref")],
                      log=tmp_path / "refused.txt", nproc=1)
    assert refused.returncode != 0
    assert re.search(r"optimizer state was saved with --use-distributed-optimizer and cannot be loaded "
                     r"without --use-distributed-optimizer; add --use-distributed-optimizer", refused.output), \
        refused.output[-3000:]


def _grpo(args: list[str]) -> list[str]:
    return torchrun_cmd(["-m", "megatron_prune.grpo", *args], nproc=2)


def _grpo_until(args: list[str], *, log, metrics, lines: int, timeout: float = 300) -> None:
    """Start a DP=2 GRPO run and SIGKILL it (agent and ranks) once ``metrics`` has ``lines`` lines."""
    run_until(_grpo(args), log=log, metrics=metrics, lines=lines, timeout=timeout)


def test_grpo_distopt_dp2_resume_bit_exact(tmp_path):
    steps = 8  # checkpoints at 3 (inside a rollout), 6 and 8
    args = [*GRPO_TOY_ARGS, *DISTOPT, "--micro-batch-size", "2", "--train-iters", str(steps)]
    run_cmd(_grpo([*args, "--save", str(tmp_path / "ref"), "--metrics-jsonl", str(tmp_path / "ref.jsonl")]),
            log=tmp_path / "ref.txt").check_ok()
    reference = read_jsonl(tmp_path / "ref.jsonl")
    assert [r["step"] for r in reference] == list(range(steps))

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*args, "--save", str(ckpt), "--metrics-jsonl", str(metrics)]
    _grpo_until(args, log=tmp_path / "killed.txt", metrics=metrics, lines=4)
    killed = read_jsonl(metrics)
    published = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert published in (3, 6) and killed[-1]["step"] < steps - 1
    resumed = run_cmd(_grpo([*args, "--load", str(ckpt)]), log=tmp_path / "resumed.txt").check_ok()
    assert f"(iteration {published})" in resumed.output
    check_resumed_steps(killed=killed, records=read_jsonl(metrics), reference=reference, published=published,
                  keys=("loss", "policy_loss", "grad_norm", "lr", "reward_mean", "policy_tokens"))
