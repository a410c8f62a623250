"""Runtime faults: a NaN loss on one rank, and a rank that never joins a collective.

The NaN is injected without a product backdoor: a wrapper script (written to tmp_path) patches
``dpo_pair_losses`` as the DPO step sees it so that, on data-parallel rank 1 only, step K's
per-pair losses are NaN, then calls the CLI's ``main`` under torchrun. The loss and gradients
are all-reduced over DP, so both ranks must see the fault and take the same decision.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from tests.e2e.conftest import TINY_DPO, launch_env, read_jsonl, run_cmd, torchrun_cmd

pytestmark = pytest.mark.e2e

NAN_STEP = 1

WRAPPER = textwrap.dedent(
    """
    import os, sys
    import megatron_prune.dpo.step as dpo_step
    import megatron_prune.dpo.trainer as trainer

    nan_step = int(sys.argv[1])
    current = {"step": -1}
    real_train_step = trainer.DPOObjective.train_step
    real_losses = dpo_step.dpo_pair_losses

    def train_step(self, step):
        current["step"] = step
        return real_train_step(self, step)

    def dpo_pair_losses(*args, **kwargs):
        losses, stats = real_losses(*args, **kwargs)
        every = os.environ.get("NAN_EVERY_STEP") == "1"  # from nan_step on, not only at it
        hit = current["step"] >= nan_step if every else current["step"] == nan_step
        if hit and os.environ["RANK"] == "1":
            losses = losses * float("nan")
        return losses, stats

    trainer.DPOObjective.train_step = train_step
    dpo_step.dpo_pair_losses = dpo_pair_losses
    from megatron_prune.dpo.__main__ import main
    sys.exit(main(sys.argv[2:]))
    """
)


def _run_with_nan(tmp_path, mode: str, iters: int, *, every: bool = False):
    script = tmp_path / "nan_at_step.py"
    script.write_text(WRAPPER)
    metrics = tmp_path / "m.jsonl"
    args = [*TINY_DPO, "--train-iters", str(iters), "--on-nonfinite", mode, "--metrics-jsonl", str(metrics)]
    env = launch_env(NAN_EVERY_STEP="1" if every else "0")
    run = run_cmd(torchrun_cmd([str(script), str(NAN_STEP), *args]), log=tmp_path / "log.txt", timeout=300, env=env)
    return run, (read_jsonl(metrics) if metrics.exists() else [])


def test_nan_on_one_rank_stops_all_ranks_naming_the_step(tmp_path):
    run, records = _run_with_nan(tmp_path, "stop", iters=3)
    assert run.returncode != 0
    # Numbered as the progress line: the step after "step 1/3" (metrics.jsonl's "step": 1).
    assert f"[megatron-prune] step {NAN_STEP}/3 |" in run.output, run.output[-4000:]
    message = f"step {NAN_STEP + 1}/3: non-finite loss or gradient"
    # Both ranks stop at the same step (rank 1 made the NaN, rank 0 learnt it from the all-reduce),
    # each with one line naming itself and the step.
    assert len(set(re.findall(rf"megatron-prune: rank (\d+): {message}", run.output))) == 2, run.output[-4000:]
    assert [r["step"] for r in records] == list(range(NAN_STEP))
    assert "--on-nonfinite skip" in run.output


def test_nan_on_one_rank_skips_the_step_and_continues(tmp_path):
    run, records = _run_with_nan(tmp_path, "skip", iters=3)
    run.check_ok()
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["skipped"] for r in records] == [False, True, False]
    bad = records[NAN_STEP]
    assert bad["grad_norm"] is None and bad["loss"] != bad["loss"]  # NaN recorded as such
    assert all(r["loss"] == r["loss"] and r["grad_norm"] is not None for r in (records[0], records[2]))
    assert "SKIPPED" in run.output


def test_skipping_stops_after_ten_non_finite_steps_in_a_row(tmp_path):
    """--on-nonfinite skip does not run on forever when every step is non-finite (broken weights or
    data): ten skipped steps in a row end the run like --on-nonfinite stop, naming the step."""
    run, records = _run_with_nan(tmp_path, "skip", iters=14, every=True)
    assert run.returncode != 0
    assert "step 11/14: 10 steps in a row had a non-finite loss or gradient" in run.output, run.output[-4000:]
    assert [r["skipped"] for r in records] == [False] + [True] * 9


HANG = textwrap.dedent(
    """
    import sys, time
    import torch.distributed as dist
    from megatron_prune.training.parallel import initialize_distributed, guard_collectives

    initialize_distributed(timeout_minutes=0.1)
    if dist.get_rank() == 1:
        time.sleep(30)  # never joins the barrier below
        sys.exit(0)
    with guard_collectives("test barrier"):
        dist.barrier()
    """
)


def test_rank_that_never_joins_gives_an_error_not_a_hang(tmp_path):
    """initialize_distributed's timeout turns a missing rank into an error naming rank and call."""
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    run = run_cmd(torchrun_cmd([str(script)]), log=tmp_path / "log.txt", timeout=180)
    assert run.returncode != 0
    assert "CollectiveTimeout" in run.output, run.output[-4000:]
    assert "rank 0 of 2: a collective did not complete within the 0.1-minute timeout during test barrier" \
        in run.output, run.output[-4000:]
