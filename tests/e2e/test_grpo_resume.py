"""Kill-and-resume of GRPO with DPPO: a run killed with SIGKILL and resumed repeats the uninterrupted
run bit for bit.

DPPO is on at both levels (prompt rate 0.5, completion rate 0.5) with dense packing, on 6 toy
prompts drawn 4 per step, so every prompt comes back within two steps: the prompt draws after
the resume depend on the restored prompt history, the prompts on the restored sampler position.
Six prompts in fours cross an epoch inside a rollout: rollout 1 would draw prompt 3 twice, so the
sampler defers its second visit to rollout 2, and the checkpoint at step 3 holds that deferral.
Two updates per rollout (``--ppo-epochs 2``) with checkpoints every 3 steps, so a checkpoint
falls inside a rollout: the resumed run must train on the same rollout (completions, weights and
old log-probs) as the uninterrupted one. Launches: the uninterrupted 10-step run, a run killed
after its fourth step, its resume.
"""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import REPO, check_resumed_steps, read_jsonl, run_cmd, run_until, torchrun_cmd

pytestmark = pytest.mark.e2e

STEPS = 10
ARGS = ["--model-preset", "tiny", "--device", "cpu", "--task", "toy", "--toy-num-prompts", "6",
        "--toy-prompt-length", "3", "--global-batch-size", "4", "--micro-batch-size", "4", "--seq-length", "32",
        "--group-size", "4", "--max-new-tokens", "4", "--lr", "2e-2", "--seed", "77", "--ppo-epochs", "2",
        "--dppo-prompt-prune-rate", "0.5", "--dppo-completion-prune-rate", "0.5", "--dense-packing",
        "--train-iters", str(STEPS), "--save-interval", "3"]
# Checkpoints at steps 3 and 9 fall inside a rollout (two updates per rollout), 6 between rollouts.
SAME = ("loss", "policy_loss", "grad_norm", "lr", "reward_mean", "reward_mean_weighted", "kept_prompt_fraction",
        "kept_completion_fraction", "policy_tokens", "rollout_tokens", "density", "clip_fraction", "ratio_mean")


def _grpo(args: list[str]) -> list[str]:
    return torchrun_cmd(["-m", "megatron_prune.grpo", *args], nproc=1)


def _run_until(args: list[str], *, log, metrics, lines: int, timeout: float = 300) -> None:
    """Start a GRPO run and SIGKILL it (agent and rank) once ``metrics`` has ``lines`` lines."""
    run_until(_grpo(args), log=log, metrics=metrics, lines=lines, timeout=timeout)


def test_grpo_sigkill_then_resume_is_bit_exact(tmp_path):
    ref_metrics = tmp_path / "ref.jsonl"
    run_cmd(_grpo([*ARGS, "--save", str(tmp_path / "ref_ckpt"), "--metrics-jsonl", str(ref_metrics)]),
            log=tmp_path / "ref.txt").check_ok()
    reference = read_jsonl(ref_metrics)
    assert [r["step"] for r in reference] == list(range(STEPS))
    assert min(r["kept_prompt_fraction"] for r in reference) < 1.0  # the prompt history prunes
    assert min(r["kept_completion_fraction"] for r in reference) < 1.0

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*ARGS, "--save", str(ckpt), "--metrics-jsonl", str(metrics)]
    # SIGKILLed once step index 3 is logged: normally iter_0000003 (inside rollout 1) is published and
    # step 4 is mid-flight; on a starved machine the kill may land after iter_0000006 or iter_0000009.
    _run_until(args, log=tmp_path / "killed.txt", metrics=metrics, lines=4)
    killed = read_jsonl(metrics)
    assert [r["step"] for r in killed[:4]] == [0, 1, 2, 3] and killed[-1]["step"] < STEPS - 1
    published = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert published in (3, 6, 9)

    resumed = run_cmd(_grpo([*args, "--load", str(ckpt)]), log=tmp_path / "resumed.txt").check_ok()
    loaded = re.search(r"\[megatron-prune\] loaded (\S+) \(iteration (\d+)\)", resumed.output)
    assert loaded and int(loaded.group(2)) == published, resumed.output[-3000:]
    assert "rolling out again" not in resumed.output

    check_resumed_steps(killed=killed, records=read_jsonl(metrics), reference=reference, published=published,
                        keys=SAME)


def test_resume_with_another_split_of_the_rollout_or_history_score(tmp_path):
    """A resume may change --minibatches / --ppo-epochs and the prompt history's score: the saved
    rollout (split for the old updates) is not reused but rolled out again, the history restarts,
    and each is said (it crashed on an index or trained half a rollout, and the history refused)."""
    at = ARGS.index("--save-interval")
    base = ARGS[:at] + ARGS[at + 2:]
    args = [*base, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    run_cmd(_grpo([*args, "--exit-interval", "1"]), log=tmp_path / "first.txt").check_ok()
    changed = [*args, "--minibatches", "2", "--ppo-epochs", "1", "--dppo-history-score", "pass-rate",
               "--train-iters", "3"]
    resumed = run_cmd(_grpo(changed), log=tmp_path / "resumed.txt").check_ok()
    assert ("the checkpoint stopped inside a rollout split into 1 minibatches for 2 updates; this run has "
            "--minibatches 2 and 2 updates per rollout (--ppo-epochs 1), so that rollout is not reused"
            ) in resumed.output
    assert "step 2/3: resumed inside the rollout of step 1/3: rolling out again with the current policy" in resumed.output
    assert "--dppo-history-score 'pass-rate': the " in resumed.output
    assert "saved " in resumed.output and "Traceback" not in resumed.output


def test_resume_may_turn_the_kl_term_on(tmp_path):
    """A run saved at --kl-beta 0 records its reference (the preset's initialisation here), so a
    resume with --kl-beta > 0 compares against it; it was refused, after the ranks had started,
    with a hint to pass --ref-load that no preset run has. Saved inside a rollout (two updates per
    rollout), the resume rolls out again: the saved rollout has no reference log-probs and has
    dropped the zero-advantage completions the KL term trains (reusing it crashed)."""
    at = ARGS.index("--save-interval")
    base = ARGS[:at] + ARGS[at + 2:]
    args = [*base, "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt")]
    run_cmd(_grpo([*args, "--train-iters", "1"]), log=tmp_path / "first.txt").check_ok()
    metrics = tmp_path / "m.jsonl"
    resumed = run_cmd(_grpo([*args, "--train-iters", "3", "--kl-beta", "0.05", "--metrics-jsonl", str(metrics)]),
                      log=tmp_path / "resumed.txt").check_ok()
    assert "--kl-beta 0.05 (checkpoint: 0.0)" in resumed.output
    assert ("the checkpoint stopped inside a rollout made with --kl-beta 0 (this run: > 0), so that rollout is "
            "not reused") in resumed.output
    assert "step 2/3: resumed inside the rollout of step 1/3: rolling out again" in resumed.output
    records = read_jsonl(metrics)
    assert [r["step"] for r in records] == [1, 2] and [r["fresh_rollout"] for r in records] == [1.0, 1.0]
    assert all("kl" in r and r["kl"] >= 0 for r in records)


def test_a_resume_that_renders_the_prompts_otherwise_rolls_out_again(tmp_path):
    """The saved rollout holds its prompts' tokens: a resume whose prompts render to other tokens
    (--chat-template-kwargs here: Qwen3's non-thinking mode ends each prompt with an empty think
    block) or that ends completions at other tokens rolls out again and says why, and one that
    renders them alike reuses the rollout."""
    from tests.unit.data.helpers import QWEN3_TEMPLATE, save_hf_tokenizer

    tokenizer = save_hf_tokenizer(tmp_path / "tok", chat_template=QWEN3_TEMPLATE)
    gsm8k = str(REPO / "megatron_prune" / "data" / "samples" / "gsm8k_sample.jsonl")
    common = ["--model-preset", "tiny", "--device", "cpu", "--tokenizer", tokenizer, "--task", "gsm8k",
              "--data-path", gsm8k, "--global-batch-size", "2", "--micro-batch-size", "2", "--seq-length", "256",
              "--group-size", "2", "--max-new-tokens", "4", "--ppo-epochs", "2", "--seed", "5",
              "--no-skip-zero-advantage"]  # the untrained model scores 0: keep its completions in the rollout
    # Two rollouts (steps 1 and 3), saved inside the second.
    first = run_cmd(_grpo([*common, "--train-iters", "3", "--save", str(tmp_path / "ckpt")]),
                    log=tmp_path / "first.txt").check_ok()
    # an untrained model's 4 tokens end no completion: said once (not at each rollout), with the flag to raise
    assert first.output.count("of the completions reached --max-new-tokens") == 1
    assert "step 1/3: 100% of the completions reached --max-new-tokens 4 without ending" in first.output
    resume = [*common, "--train-iters", "4", "--load", str(tmp_path / "ckpt")]
    same = run_cmd(_grpo([*resume, "--metrics-jsonl", str(tmp_path / "same.jsonl")]),
                   log=tmp_path / "same.txt").check_ok()
    assert "rolling out again" not in same.output and "not reused" not in same.output
    [record] = read_jsonl(tmp_path / "same.jsonl")
    assert record["fresh_rollout"] == 0.0 and record["policy_tokens"] > 0
    changed = run_cmd(_grpo([*resume, "--chat-template-kwargs", '{"enable_thinking": false}', "--metrics-jsonl",
                             str(tmp_path / "changed.jsonl")]), log=tmp_path / "changed.txt").check_ok()
    [record] = read_jsonl(tmp_path / "changed.jsonl")
    assert record["fresh_rollout"] == 1.0
    # another token that ends a completion (a generation_config.json that lists one more eos id)
    (tmp_path / "tok" / "generation_config.json").write_text('{"eos_token_id": [2, 1]}')
    stops = run_cmd(_grpo(resume), log=tmp_path / "stops.txt").check_ok()
    assert ("the checkpoint stopped inside a rollout made with stop ids [2] (this run: [1, 2]), so that rollout is "
            "not reused") in stops.output
    assert ("the checkpoint stopped inside a rollout whose prompts this run makes of other tokens (changed data "
            "files, tokenizer, --chat-template-kwargs, --max-prompt-length or --seq-length), so that rollout is not "
            "reused") in changed.output
    assert "step 4/4: resumed inside the rollout of step 3/4: rolling out again" in changed.output
