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
    if __name__ == "__main__":  # the checkpoint writer's worker processes import this file again
        from megatron_prune.dpo.__main__ import main
        sys.exit(main(sys.argv[2:]))
    """
)


def _run_with_nan(tmp_path, mode: str, iters: int, *, every: bool = False, extra: tuple = ()):
    script = tmp_path / "nan_at_step.py"
    script.write_text(WRAPPER)
    metrics = tmp_path / "m.jsonl"
    args = [*TINY_DPO, "--train-iters", str(iters), "--on-nonfinite", mode, "--metrics-jsonl", str(metrics), *extra]
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
    # torchrun's failure report names rank 0 and its line as the root cause, not a pointer to the elastic docs.
    report = run.output[run.output.index("Root Cause"):]
    assert re.search(rf"rank\s*: 0 .*\n(.*\n)*?\s*traceback : megatron-prune: rank 0: {message}", report), report
    assert [r["step"] for r in records] == list(range(NAN_STEP))
    assert "--on-nonfinite skip" in run.output


def _saved_state(path) -> dict:
    """Everything a checkpoint holds that a training step changes: weights, Adam moments and step
    count, the learning-rate schedule's position (the data sampler moves on in any case)."""
    import warnings

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(str(path / "dist"), str(path / "whole.pt"))
    state = {k: v for k, v in torch.load(path / "whole.pt", weights_only=False).items() if torch.is_tensor(v)}
    common = torch.load(path / "dist" / "common.pt", weights_only=False)["optimizer"]["state"]
    trainer = torch.load(path / "trainer_state.pt", weights_only=False)
    return {**state, "adam_steps": common["common_step"], "lr_steps": trainer["scheduler"]["num_steps"]}


def test_nan_on_one_rank_skips_the_step_and_continues(tmp_path):
    save = tmp_path / "ckpt"
    run, records = _run_with_nan(tmp_path, "skip", iters=3, extra=("--save", str(save), "--save-interval", "1",
                                                                     "--lr-warmup-iters", "2"))
    run.check_ok()
    assert [r["step"] for r in records] == [0, 1, 2]
    assert [r["skipped"] for r in records] == [False, True, False]
    bad = records[NAN_STEP]
    # Non-finite values are written as null: a bare NaN would make the line invalid JSON outside Python.
    assert bad["grad_norm"] is None and bad["loss"] is None
    assert all(r["loss"] is not None and r["grad_norm"] is not None for r in (records[0], records[2]))
    assert "NaN" not in (tmp_path / "m.jsonl").read_text()
    assert "SKIPPED" in run.output
    # Skipped means untouched: no optimizer step (weights, moments, Adam's count) and no step of
    # the warm-up schedule, on every rank (the checkpoint holds each DP rank's shard).
    before, skipped, after = (_saved_state(save / f"iter_{i:07d}") for i in (NAN_STEP, NAN_STEP + 1, NAN_STEP + 2))
    import torch

    assert before.keys() == skipped.keys()
    changed = [k for k in before if not torch.equal(torch.as_tensor(before[k]), torch.as_tensor(skipped[k]))]
    assert not changed, f"the skipped step changed {changed[:5]}"
    assert records[NAN_STEP + 1]["lr"] == records[NAN_STEP]["lr"] > records[0]["lr"]
    # ... while the step after it trains again.
    assert [k for k in before if not torch.equal(torch.as_tensor(skipped[k]), torch.as_tensor(after[k]))]


def test_skipping_stops_after_ten_non_finite_steps_in_a_row(tmp_path):
    """--on-nonfinite skip does not run on forever when every step is non-finite (broken weights or
    data): ten skipped steps in a row end the run like --on-nonfinite stop, naming the step."""
    run, records = _run_with_nan(tmp_path, "skip", iters=14, every=True)
    assert run.returncode != 0
    assert ("step 11/14: 10 steps in a row had a non-finite loss or gradient; --on-nonfinite skip stops here (the "
            "weights or the data are broken, not one batch: steps 2..11 were skipped)") in run.output, run.output[-4000:]
    assert [r["skipped"] for r in records] == [False] + [True] * 9


def test_steps_skipped_in_a_row_are_counted_across_a_resume(tmp_path):
    """The count of skipped steps in a row is saved with the checkpoint: a run killed (here: ended)
    after 5 of them and resumed stops at the same step as the uninterrupted run (the count started
    over, so a broken run went on for up to 9 more steps after each resume)."""
    save = tmp_path / "ckpt"
    first, _ = _run_with_nan(tmp_path, "skip", iters=6, every=True, extra=("--save", str(save)))
    first.check_ok()
    run, records = _run_with_nan(tmp_path, "skip", iters=14, every=True, extra=("--save", str(save), "--load", str(save)))
    assert run.returncode != 0
    assert ("step 11/14: 10 steps in a row had a non-finite loss or gradient; --on-nonfinite skip stops here (the "
            "weights or the data are broken, not one batch: steps 2..11 were skipped)") in run.output, run.output[-4000:]
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
