"""End-to-end ``python -m megatron_prune.grpo`` on the toy task (CPU, gloo)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import read_jsonl, run_cmd, torchrun_cmd, undocumented_keys

TOY = ["--model-preset", "tiny", "--device", "cpu", "--task", "toy", "--toy-num-prompts", "32",
       "--global-batch-size", "16", "--micro-batch-size", "16", "--seq-length", "64",
       "--group-size", "8", "--max-new-tokens", "8", "--lr", "1e-2", "--seed", "1234"]
DPPO = ["--dppo-prompt-prune-rate", "0.3", "--dppo-completion-prune-rate", "0.3", "--dense-packing"]


def run_grpo(args: list[str], *, log, nproc: int = 2, timeout: float = 600):
    return run_cmd(torchrun_cmd(["-m", "megatron_prune.grpo", *args], nproc=nproc), log=log, timeout=timeout)


def test_dry_run_and_bad_flags(tmp_path):
    ok = run_cmd(torchrun_cmd(["-m", "megatron_prune.grpo", *TOY, "--dry-run"], nproc=1), log=tmp_path / "dry.log")
    ok.check_ok()
    assert "GRPOConfig" in ok.output and "DPPOArgs" in ok.output
    bad = run_cmd(torchrun_cmd(["-m", "megatron_prune.grpo", *TOY, "--task", "gsm8k", "--dry-run"], nproc=1),
                  log=tmp_path / "bad.log")
    assert bad.returncode != 0 and "--task gsm8k needs --data-path" in bad.output
    # Fewer prompts than a step draws: refused once the file is read, before any model is built.
    from megatron_prune.data import GSM8K_SAMPLE

    few = run_cmd(torchrun_cmd(["-m", "megatron_prune.grpo", *TOY, "--task", "gsm8k", "--data-path", GSM8K_SAMPLE,
                                "--seq-length", "256", "--global-batch-size", "512", "--train-iters", "1"], nproc=1),
                  log=tmp_path / "few.log")
    assert few.returncode != 0
    assert (f"error: --global-batch-size 512 asks for 512 different prompts a step (one group of --group-size "
            f"completions each), but --data-path {GSM8K_SAMPLE} holds 300 usable prompts") in few.output, few.output
    assert "ValueError" not in few.output and "_check_ids" not in few.output


def test_two_steps_tp2_dppo(tmp_path):
    """Smoke: 2 steps at TP=2 with DPPO and packing write complete metrics."""
    metrics = tmp_path / "m.jsonl"
    run_grpo([*TOY, *DPPO, "--tensor-model-parallel-size", "2", "--train-iters", "2",
              "--metrics-jsonl", str(metrics)], log=tmp_path / "run.log").check_ok()
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == [0, 1]
    for key in ("loss", "reward_mean", "accuracy", "kept_prompt_fraction", "kept_completion_fraction", "density",
                "rollout_time_s", "reference_time_s", "train_time_s", "policy_tokens"):
        assert key in records[-1], key
    assert records[-1]["kept_completion_fraction"] < 1.0
    assert not undocumented_keys(records, "dppo.md")


# The learning configuration (examples/grpo_cpu.sh): toy prompts without filler (BOS SEP digit), 4-token
# completions, 32 prompts x 8 completions per step, Adam at lr 2e-2. A random policy scores ~0.10.
LEARN_ITERS = 40
LEARN = ["--model-preset", "tiny", "--device", "cpu", "--task", "toy", "--toy-num-prompts", "64",
         "--toy-prompt-length", "3", "--global-batch-size", "32", "--micro-batch-size", "32", "--seq-length", "64",
         "--group-size", "8", "--max-new-tokens", "4", "--lr", "2e-2", "--seed", "1234",
         "--train-iters", str(LEARN_ITERS)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["grpo", "dppo"])
def test_toy_reward_rises(tmp_path, mode):
    """GRPO and DPPO (prompt and completion pruning, dense packing) both raise the toy reward: the
    mean reward of the last 5 steps exceeds the first 5 steps' by a margin far above the step-to-step
    noise of a random policy (per-step std ~0.02, so ~0.01 for a 5-step mean)."""
    metrics = tmp_path / "m.jsonl"
    run_grpo([*LEARN, *(DPPO if mode == "dppo" else []), "--metrics-jsonl", str(metrics)],
             log=tmp_path / "run.log", nproc=1, timeout=1200).check_ok()
    rewards = [r["reward_mean"] for r in read_jsonl(metrics)]
    assert len(rewards) == LEARN_ITERS
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15, f"{mode}: a random policy should score ~0.1, got {first:.3f}"
    assert last > first + 0.06, f"{mode}: reward {first:.3f} -> {last:.3f}: {[round(r, 2) for r in rewards]}"


def test_a_rollout_with_every_prompt_pruned_says_so(tmp_path):
    """Two prompts pruned at rate 0.7 leave some rollouts empty: such a step rolls out and trains
    nothing, logs kept_prompt_fraction 0 and says that its reward metrics are 0 by convention."""
    metrics = tmp_path / "m.jsonl"
    run = run_grpo(["--model-preset", "tiny", "--device", "cpu", "--task", "toy-binary", "--toy-num-prompts", "2",
                    "--global-batch-size", "2", "--group-size", "2", "--dppo-prompt-prune-rate", "0.7",
                    "--max-new-tokens", "4", "--seq-length", "32", "--train-iters", "8",
                    "--metrics-jsonl", str(metrics)], log=tmp_path / "log.txt", nproc=1).check_ok()
    empty = [r["step"] for r in read_jsonl(metrics) if r["kept_prompt_fraction"] == 0]
    assert empty, "no rollout was empty: the case is not drawn"
    for step in empty:
        assert (f"step {step + 1}/8: prompt pruning kept none of this rollout's prompts, so nothing was rolled out or "
                "trained; its reward metrics are 0 by convention; the optimizer still steps: its momentum and "
                "weight decay, if any, still move the weights") in run.output
    assert "degrees of freedom" not in run.output


def test_a_minibatch_emptied_by_prompt_pruning_says_so(tmp_path):
    """Each minibatch holds the drawn prompts of its positions, so prompt pruning can empty one while
    the rollout's other minibatch trains: that update trains nothing (gradient 0) and says so, naming
    the step as the progress line does. With a KL term no completion is skipped for its advantage, so
    pruning is the only way a minibatch empties."""
    metrics = tmp_path / "m.jsonl"
    run = run_grpo(["--model-preset", "tiny", "--device", "cpu", "--task", "toy-binary", "--toy-num-prompts", "4",
                    "--global-batch-size", "4", "--group-size", "2", "--minibatches", "2",
                    "--dppo-prompt-prune-rate", "0.5", "--kl-beta", "0.1", "--max-new-tokens", "4",
                    "--seq-length", "32", "--train-iters", "12", "--metrics-jsonl", str(metrics)],
                   log=tmp_path / "log.txt", nproc=1).check_ok()
    records = read_jsonl(metrics)
    emptied = [r for r in records if r["train_tokens"] == 0 and r["kept_prompt_fraction"] > 0]
    assert emptied, "no minibatch was emptied while its rollout kept prompts: the case is not drawn"
    for r in emptied:
        assert r["grad_norm"] == 0.0
        assert (f"step {r['step'] + 1}/12: minibatch {r['step'] % 2 + 1} of 2 of this rollout kept no completions "
                "(its prompts pruned, or its completions' advantages all 0), so this update trains nothing (loss "
                "and gradient 0); the optimizer still steps") in run.output, run.output[-3000:]
    assert run.output.count("kept no completions") == len(emptied)
    # The first rollout's prompts have no history: nothing can be pruned yet, and the run says so once.
    assert records[0]["kept_prompt_fraction"] == 1.0
    assert ("step 1/12: no prompt of this step has been rolled out before, so --dppo-prompt-prune-rate keeps them "
            "all: a prompt is pruned only from its second visit, by its reward history (the first epoch over 4 "
            "prompts is 2 steps at --global-batch-size 4; said once)") in run.output
    assert run.output.count("has been rolled out before") == 1
