"""What a new user does first, through the commands they run: the README's commands and the
example scripts (dry run, and the CPU ones for real with tiny settings), exact DPO by default,
errors that say the way out, GRPO prompts that do not fit, and the token metrics.

Launches are few and tiny (the tiny preset, 1-2 steps); each costs ~15-40 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import REPO, SAMPLE, launch_env, read_jsonl, torchrun_cmd

pytestmark = pytest.mark.e2e

SAMPLES = REPO / "megatron_prune" / "data" / "samples"
GSM8K = str(SAMPLES / "gsm8k_sample.jsonl")
TIMING = ("step_time_s", "peak_mem_bytes", "rollout_time_s", "reference_time_s", "old_logprob_time_s", "train_time_s")


def _run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run to completion, stdout and stderr in one pipe (in the order the user sees them)."""
    return subprocess.run(cmd, cwd=REPO, env=env or launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)


def _dpo(tmp_path: Path, name: str, *extra: str) -> tuple[list[dict], str]:
    metrics = tmp_path / f"{name}.jsonl"
    proc = _run([sys.executable, "-m", "megatron_prune.dpo", "--model-preset", "tiny", "--data-path", SAMPLE,
                 "--device", "cpu", "--seq-length", "128", "--max-prompt-length", "64", "--train-iters", "2",
                 "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
                 "--metrics-jsonl", str(metrics), *extra])
    assert proc.returncode == 0, proc.stdout[-5000:]
    return read_jsonl(metrics), proc.stdout


# --------------------------------------------------------------------------- DPO defaults and metrics


def test_dpo_without_prune_flags_is_exact_dpo(tmp_path):
    """No --prune-* flag gives the run of --prune-position-ratio 1 --prune-seq-min-ratio 1, bit for bit;
    train_tokens / forward_only_tokens are in the JSONL and the progress line, and branch pruning
    moves the pruned branch's tokens from the first to the second."""
    default, out = _dpo(tmp_path, "default")
    explicit, _ = _dpo(tmp_path, "explicit", "--prune-position-ratio", "1", "--prune-seq-min-ratio", "1")
    assert len(default) == len(explicit) == 2
    for a, b in zip(default, explicit):
        assert {k: v for k, v in a.items() if k not in TIMING} == {k: v for k, v in b.items() if k not in TIMING}
    assert [r["loss"] for r in default] == [r["loss"] for r in explicit]
    for r in default:  # exact DPO: every policy token trains; forward-only work is the reference model's
        assert r["train_tokens"] == r["policy_tokens"] > 0 and r["forward_only_tokens"] == r["ref_tokens"] > 0
    assert re.search(r"train_tokens \d+ \| forward_only_tokens \d+", out), out[-3000:]

    branch, _ = _dpo(tmp_path, "branch", "--prune-branch")
    for r in branch:
        pruned_branch = r["policy_tokens"] - r["train_tokens"]
        assert 0 < r["train_tokens"] < r["policy_tokens"]
        assert r["forward_only_tokens"] == r["ref_tokens"] + pruned_branch


# --------------------------------------------------------------------------- errors


def _in_process(module: str, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    main = __import__(f"megatron_prune.{module}.__main__", fromlist=["main"]).main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


def test_resume_with_load_alone_finds_the_recorded_tokenizer(tmp_path):
    """A run of the tiny preset saved; ``--load`` alone (no preset, no --tokenizer) continues it:
    the checkpoint records the tokenizer the run used, as it records the architecture."""
    ckpt = tmp_path / "ckpt"
    first, _ = _dpo(tmp_path, "first", "--train-iters", "1", "--save", str(ckpt))
    metrics = tmp_path / "resumed.jsonl"
    proc = _run([sys.executable, "-m", "megatron_prune.dpo", "--load", str(ckpt), "--data-path", SAMPLE,
                 "--device", "cpu", "--seq-length", "128", "--max-prompt-length", "64", "--train-iters", "2",
                 "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
                 "--metrics-jsonl", str(metrics)])
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert [r["step"] for r in first] == [0] and [r["step"] for r in read_jsonl(metrics)] == [1]


def test_bad_records_name_file_line_and_the_way_out(tmp_path, monkeypatch, capsys):
    good = json.dumps({"prompt": "hi", "chosen": "a", "rejected": "b"})
    cases = [
        ('{"prompt": "hi", "chosen": "a"', "malformed json"),
        (json.dumps({"prompt": "hi", "chosen": "a"}), "missing field 'rejected'"),
        (json.dumps({"chosen": "\n\nHuman: hi\n\nAssistant: a"}), "missing field 'rejected'"),
    ]
    for number, (line, reason) in enumerate(cases):
        path = tmp_path / f"bad{number}.jsonl"
        path.write_text(f"{good}\n{line}\n")
        code, err = _in_process("dpo", ["--model-preset", "tiny", "--device", "cpu", "--data-path", str(path),
                                        "--seq-length", "64"], monkeypatch, capsys)
        assert code == 2
        assert f"{path}:2: {reason}" in err, err
        assert "pass --skip-invalid-records" in err and "Traceback" not in err, err


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["plain", "distributed"])
def test_bf16_finetune_trains_the_loaded_weights(tmp_path, optimizer):
    """Under --bf16 the optimizer keeps fp32 main copies of the weights, taken when it is built,
    before --load fills the model: a weights-only load (--finetune, a converted checkpoint) was
    undone by the first step, which wrote the preset's initialisation back. At --lr 0 the policy
    must stay the loaded weights, the reference: margin 0 at every step."""
    source = tmp_path / "source"
    _dpo(tmp_path, "source", "--train-iters", "2", "--lr", "1e-2", "--bf16", *optimizer, "--save", str(source))
    tuned, out = _dpo(tmp_path, "tuned", "--load", str(source), "--finetune", "--lr", "0", "--train-iters", "3",
                      "--bf16", *optimizer)
    assert "weights only" in out
    assert [r["step"] for r in tuned] == [0, 1, 2]
    assert all(r["margin"] == 0.0 for r in tuned), [r["margin"] for r in tuned]


def test_resume_keeps_the_recorded_reference_and_finetune_compares_with_the_loaded_weights(tmp_path):
    """A run trained against ``--ref-load A`` and resumed with ``--load`` (``--model-preset`` still
    on the command line, ``--ref-load`` not) keeps A as its reference: its steps equal the
    uninterrupted run's. ``--finetune`` from A starts with policy = reference = A (margin 0)."""
    a = tmp_path / "a"
    _dpo(tmp_path, "a", "--train-iters", "1", "--save", str(a))
    whole, _ = _dpo(tmp_path, "whole", "--ref-load", str(a), "--train-iters", "3")
    part = tmp_path / "part"
    _dpo(tmp_path, "first", "--ref-load", str(a), "--train-iters", "2", "--save", str(part), "--save-interval", "2")
    resumed, out = _dpo(tmp_path, "resumed", "--load", str(part), "--train-iters", "3")
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == whole[2]["loss"] and resumed[0]["margin"] == whole[2]["margin"], (resumed, whole)
    assert "another reference model" not in out and "--ref-mode" not in out
    # Another --ref-load on resume is taken, and said (the flag record leaves paths out).
    _, out = _dpo(tmp_path, "other", "--load", str(part), "--ref-load", str(part / "iter_0000002"),
                  "--train-iters", "3")
    assert (f"resuming against another reference model: {part / 'iter_0000002'} (checkpoint: "
            f"{a / 'iter_0000001'})") in out, out
    dry = _run([sys.executable, "-m", "megatron_prune.dpo", "--data-path", SAMPLE, "--device", "cpu", "--seq-length",
                "128", "--train-iters", "3", "--load", str(part), "--ref-load", str(part / "iter_0000002"), "--dry-run"])
    assert dry.returncode == 0 and (f"resuming against another reference model: {part / 'iter_0000002'} "
                                    f"(checkpoint: {a / 'iter_0000001'})") in dry.stdout, dry.stdout[-3000:]
    tuned, _ = _dpo(tmp_path, "tuned", "--load", str(a), "--finetune", "--train-iters", "1")
    assert tuned[0]["step"] == 0 and tuned[0]["margin"] == 0.0 and tuned[0]["reward_accuracy"] == 0.5, tuned
    # The recorded reference has moved: the dry run already names it (not as a --load the user gave).
    a.rename(tmp_path / "moved")
    moved = _run([sys.executable, "-m", "megatron_prune.dpo", "--data-path", SAMPLE, "--device", "cpu",
                  "--seq-length", "128", "--train-iters", "3", "--load", str(part), "--dry-run"])
    assert moved.returncode == 2 and moved.stdout.strip().splitlines()[-1] == (
        f"megatron-prune: error: --load {part} records its reference model as {a / 'iter_0000001'}, which no "
        "longer exists; pass --ref-load with where that checkpoint is now"), moved.stdout[-3000:]
    # Given where it is now, the dry run says what the run will: the same weights, moved, not "another" model.
    found = _run([sys.executable, "-m", "megatron_prune.dpo", "--data-path", SAMPLE, "--device", "cpu",
                  "--seq-length", "128", "--train-iters", "3", "--load", str(part), "--dry-run",
                  "--ref-load", str(tmp_path / "moved" / "iter_0000001")])
    assert found.returncode == 0, found.stdout[-3000:]
    assert (f"resuming against the reference model at {tmp_path / 'moved' / 'iter_0000001'}; the checkpoint's, "
            f"{a / 'iter_0000001'}, no longer exists") in found.stdout, found.stdout[-3000:]
    assert "another reference model" not in found.stdout


def _heldout(tmp_path: Path, pairs: int) -> Path:
    path = tmp_path / f"heldout{pairs}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}?", "chosen": f"yes {i}", "rejected": f"no {i}"}) + "\n"
                            for i in range(pairs)))
    return path


def test_heldout_set_too_small_for_one_microbatch_is_refused_before_training(tmp_path, monkeypatch, capsys):
    metrics = tmp_path / "m.jsonl"
    code, err = _in_process("dpo", ["--model-preset", "tiny", "--device", "cpu", "--data-path", SAMPLE,
                                    "--eval-data-path", str(_heldout(tmp_path, 1)), "--seq-length", "128",
                                    "--max-prompt-length", "64", "--global-batch-size", "2", "--micro-batch-size", "2",
                                    "--metrics-jsonl", str(metrics)], monkeypatch, capsys)
    assert code == 2
    assert ("--eval-data-path has 1 usable pair(s), fewer than the --micro-batch-size 2 x data-parallel size 1 = 2 "
            "that one evaluation needs; add held-out pairs or lower --micro-batch-size") in err, err
    assert "Traceback" not in err and not metrics.exists()


def test_heldout_pairs_left_out_are_said_and_counted(tmp_path):
    """3 held-out pairs at micro-batch 2: each evaluation runs 2, the run says so once, and every
    evaluation record carries the count."""
    records, out = _dpo(tmp_path, "eval3", "--train-iters", "1", "--global-batch-size", "2",
                        "--eval-data-path", str(_heldout(tmp_path, 3)))
    assert "held-out data: each evaluation runs 2 of 3 pairs" in out and "the last 1 are left out" in out, out
    assert "are also training pairs" not in out
    assert records[-1]["eval_pairs"] == 2 and 0.0 <= records[-1]["eval_reward_accuracy"] <= 1.0, records
    assert "fewer than --global-batch-size" not in out
    # Training data smaller than a global batch: said, not silent; held-out pairs that are training pairs: said.
    _, out = _dpo(tmp_path, "train3", "--train-iters", "1", "--data-path", str(_heldout(tmp_path, 3)),
                  "--eval-data-path", str(_heldout(tmp_path, 3)))
    assert "held-out data: 3 of its 3 pairs are also training pairs (same tokens)" in out, out
    assert "training data: 3 pairs, fewer than --global-batch-size 4: every step holds some pairs more than once" \
        in out, out


def test_unknown_model_preset_under_torchrun_ends_with_one_line(tmp_path):
    """A real 2-rank launch: the usage error is the last line the user reads, after torchrun's report."""
    proc = _run(torchrun_cmd(["-m", "megatron_prune.dpo", "--model-preset", "big", "--data-path", SAMPLE]),
                timeout=240)
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines[-1] == ("megatron-prune-dpo: error: argument --model-preset: invalid choice: 'big' (choose from "
                         "'tiny', 'tiny-tied', 'tiny-moe') (run with --help to see every flag, its choices and default)"), \
        proc.stdout[-4000:]
    assert "usage:" not in proc.stdout and "[rank0]:" not in proc.stdout


# --------------------------------------------------------------------------- GRPO prompts and metrics


def test_grpo_prompt_budget_refused_before_any_rank_works(monkeypatch, capsys):
    base = ["--model-preset", "tiny", "--device", "cpu", "--task", "gsm8k", "--data-path", GSM8K]
    code, err = _in_process("grpo", [*base, "--seq-length", "64", "--max-new-tokens", "8",
                                     "--max-prompt-length", "60"], monkeypatch, capsys)
    assert code == 2 and "--max-prompt-length 60 + --max-new-tokens 8 exceed --seq-length 64" in err, err
    code, err = _in_process("grpo", [*base, "--seq-length", "8", "--max-new-tokens", "8"], monkeypatch, capsys)
    assert code == 2 and "--seq-length 8 leaves no room for a prompt" in err, err
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.parametrize("recompute, refused", [
    (["--recompute-activations"], True),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"], True),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe"], True),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"], False),
], ids=["activations", "full", "selective-moe", "selective-no-moe"])
def test_grpo_router_losses_with_router_recompute_refused(recompute, refused, monkeypatch, capsys):
    """GRPO gives each training microbatch's router losses their weight in the forward (a placeholder
    none); a router rerun in the backward would add them at the full weight, placeholders included."""
    from megatron_prune.grpo.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")

    def dry_run(*argv):
        try:
            code = main(["--model-preset", "tiny-moe", "--device", "cpu", "--task", "toy", "--dry-run", *argv])
        except SystemExit as exc:
            code = exc.code
        return code, capsys.readouterr().err

    code, err = dry_run(*recompute, "--moe-z-loss-coeff", "0.001")
    if refused:
        assert code == 2 and "GRPO cannot combine --moe-z-loss-coeff > 0 with activation recompute" in err, err
    else:
        assert code == 0, err
    assert dry_run(*recompute)[0] == 0  # without router losses


def test_grpo_left_truncates_long_prompts_and_reports_tokens(tmp_path):
    """GSM8K prompts are longer than --seq-length minus --max-new-tokens: without --max-prompt-length
    they are left-truncated (counted in the metrics, logged), the run trains, the JSONL carries
    train_tokens / forward_only_tokens, and a step where every group has equal rewards says so (and,
    by default, trains and scores nothing)."""
    cmd = [sys.executable, "-m", "megatron_prune.grpo", "--model-preset", "tiny", "--device", "cpu",
           "--task", "gsm8k", "--data-path", GSM8K, "--seq-length", "48", "--max-new-tokens", "4",
           "--group-size", "2", "--global-batch-size", "2", "--micro-batch-size", "2", "--train-iters", "2",
           "--ppo-epochs", "2", "--dense-packing", "--temperature", "0"]
    # Greedy sampling: a group's completions are identical, so its rewards are equal and every
    # advantage is 0. Trained anyway (--no-skip-zero-advantage), they show the token counts.
    metrics = tmp_path / "grpo.jsonl"
    proc = _run([*cmd, "--no-skip-zero-advantage", "--metrics-jsonl", str(metrics)])
    assert proc.returncode == 0, proc.stdout[-5000:]
    (first, second) = read_jsonl(metrics)
    assert first["truncated_prompts"] == 2.0
    assert "step 1/2: 2 of 2 prompts were longer than the prompt budget and were left-truncated" in proc.stdout
    assert first["train_tokens"] == first["policy_tokens"] > 0
    assert first["forward_only_tokens"] > 0  # old log-probs, scored once for the two updates of the rollout
    assert second["forward_only_tokens"] == 0
    assert first["zero_variance_groups"] == 1.0 and first["loss"] == 0.0
    assert ("step 1/2: every group's rewards are equal (zero variance), so every advantage is 0: loss and gradient "
            "are 0; the optimizer still steps: its momentum and weight decay, if any, still move the weights"
            in proc.stdout), proc.stdout[-3000:]
    # By default (no KL) those completions are skipped: nothing is scored or trained, same loss.
    skipped = tmp_path / "skipped.jsonl"
    proc = _run([*cmd, "--metrics-jsonl", str(skipped), "--save", str(tmp_path / "ckpt")])
    assert proc.returncode == 0, proc.stdout[-5000:]
    for got in read_jsonl(skipped):
        assert got["train_tokens"] == got["forward_only_tokens"] == got["loss"] == 0.0
        assert got["kept_completion_fraction"] == 0.0
    assert "step 1/2: every group's rewards are equal (zero variance)" in proc.stdout, proc.stdout[-3000:]
    # The checkpoint recorded the tokenizer: --load alone (no preset, no --tokenizer) goes on.
    resume = [a for a in cmd if a not in ("--model-preset", "tiny")]
    resume[resume.index("--train-iters") + 1] = "3"
    proc = _run([*resume, "--load", str(tmp_path / "ckpt"), "--metrics-jsonl", str(skipped)])
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert [r["step"] for r in read_jsonl(skipped)] == [0, 1, 2]


# --------------------------------------------------------------------------- examples and README


def _bare_env(**extra: str) -> dict[str, str]:
    """A shell as a user has it after the first README command: nothing activated, no torchrun on PATH."""
    env = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    env.update(extra)
    return env


DRY_RUNS = [
    ("examples/quickstart.sh", {}, "-m megatron_prune.dpo"),
    ("examples/grpo_cpu.sh", {}, "-m megatron_prune.grpo"),
    ("examples/dpo_multinode.sh", {}, "-m megatron_prune.dpo"),
    ("examples/dpo_qwen3_4b_8gpu.sh", {"HF_MODEL": "/models/Qwen3-4B", "DATA": "prefs.jsonl"}, "-m megatron_prune.dpo"),
    ("examples/grpo_qwen3_4b_8gpu.sh", {}, "-m megatron_prune.grpo"),
    ("examples/grpo_qwen3_4b_8gpu.sh", {"THINKING": "0"}, "-m megatron_prune.grpo"),
]


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the project's .venv")
@pytest.mark.parametrize("script, env, module", DRY_RUNS, ids=[s + "".join(f" {k}={v}" for k, v in e.items())
                                                                 for s, e, _ in DRY_RUNS])
def test_example_dry_run_uses_the_project_env(script, env, module):
    """Each example prints its command in dry-run mode from a shell with nothing activated, and every
    flag of the command exists (the CPU examples run for real below, which needs .venv's torchrun)."""
    proc = subprocess.run(["bash", script], cwd=REPO, env=_bare_env(DRY_RUN="1", **env), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = shlex.split(proc.stdout.strip().splitlines()[-1])
    words = [w for w in words if "=" not in w or w.startswith("-")]  # drop leading VAR=value
    assert module in " ".join(words)
    _assert_flags_exist(words)
    if env.get("THINKING") == "0":  # the JSON reaches the flag as one word
        assert words[words.index("--chat-template-kwargs") + 1] == '{"enable_thinking": false}', words
    if "--exit-signal-handler" in words:  # torchrun's 30 s before SIGKILL would cut the step and its save
        assert "--shutdown-timeout" in words[:words.index("-m")], words


@pytest.mark.parametrize("script", ["examples/quickstart.sh", "examples/grpo_cpu.sh", "examples/dpo_qwen3_4b_8gpu.sh",
                                    "examples/grpo_qwen3_4b_8gpu.sh"])
def test_flags_after_an_example_script_override_its_own(script):
    """``bash script --train-iters 7 ...``: the flags come last in the launch, where they win (they were
    dropped without a word)."""
    extra = ["--train-iters", "7", "--chat-template-kwargs", '{"enable_thinking": false}']
    proc = subprocess.run(["bash", script, *extra], cwd=REPO, env=_bare_env(DRY_RUN="1"), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert shlex.split(proc.stdout.strip().splitlines()[-1])[-len(extra):] == extra


def _assert_flags_exist(words: list[str]) -> None:
    from megatron_prune.arguments import build_parser

    if "-m" not in words:
        return
    at = [i for i, w in enumerate(words[:-1]) if w == "-m"]
    modules = [(i, words[i + 1]) for i in at if words[i + 1].startswith("megatron_prune.")]
    if not modules:
        return
    i, module = modules[-1]
    groups = __import__(f"{module}.__main__", fromlist=["GROUPS"]).GROUPS
    parser = build_parser(module, groups, "")
    args = [w for w in words[i + 2 :] if w != "..."]
    _, unknown = parser.parse_known_args(args)
    assert not [u for u in unknown if u.startswith("--")], f"{module}: unknown flags {unknown}"


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split("  #")[0].strip()
            if line:
                commands.append(line)
    return commands


def test_readme_commands_name_real_scripts_and_flags():
    """Every README command names a script or tool of the repository and only flags that exist."""
    commands = _readme_commands()
    assert commands[:2] == ["bash examples/quickstart.sh", "bash tests/run.sh"]
    assert any(c.startswith(". .venv/bin/activate") for c in commands), "README must say how to use .venv"
    for command in commands:
        words = shlex.split(command)
        for word in words:
            if word.startswith(("examples/", "tools/", "tests/")) and "/" in word:
                assert (REPO / word).exists(), f"{command}: {word} does not exist"
        _assert_flags_exist(words)


def test_readme_tools_answer_help():
    tools = sorted({w for c in _readme_commands() for w in shlex.split(c) if w.startswith("tools/") and
                    w.endswith(".py")})
    assert tools
    for tool in tools:
        proc = _run([sys.executable, tool, "--help"], timeout=300)
        assert proc.returncode == 0 and "usage" in proc.stdout.lower(), f"{tool}:\n{proc.stdout[-2000:]}"


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the project's .venv")
def test_quickstart_runs_and_explains_its_numbers(tmp_path):
    """The first README command, for real with tiny settings, from a shell with nothing activated."""
    out = tmp_path / "qs"
    proc = subprocess.run(["bash", "examples/quickstart.sh"], cwd=REPO, timeout=900, capture_output=True, text=True,
                          env=_bare_env(STEPS="1", GBS="4", MBS="2", EVAL_INTERVAL="1", OUT=str(out)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    record = read_jsonl(out / "metrics.jsonl")[-1]
    assert {"train_tokens", "forward_only_tokens", "eval_reward_accuracy"} <= set(record)
    tail = proc.stdout.strip().splitlines()[-5:]
    text = "\n".join(tail)
    assert "Held-out reward accuracy" in text and "0.5 = chance" in text
    assert f"Metrics, one JSON line per step: {out / 'metrics.jsonl'}" in text
    assert "bash examples/grpo_cpu.sh" in text and "tools/bench_dpo.py" in text


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").exists(), reason="needs the project's .venv")
def test_grpo_example_runs(tmp_path):
    out = tmp_path / "grpo"
    proc = subprocess.run(["bash", "examples/grpo_cpu.sh"], cwd=REPO, timeout=900, capture_output=True, text=True,
                          env=_bare_env(ITERS="1", GBS="4", OUT=str(out)))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    (record,) = read_jsonl(out / "metrics.jsonl")
    assert {"reward_mean", "train_tokens", "forward_only_tokens"} <= set(record)


def test_ctrl_c_ends_in_one_line_that_says_how_to_resume(tmp_path):
    """SIGINT (Ctrl-C) mid-run: exit code 130 and one line saying what there is to resume, no
    traceback. (No save runs during the steps, so the signal cannot land inside one: that case is
    test_interrupt_during_save.py.)"""
    import signal
    import time

    metrics, save = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_prune.dpo", "--model-preset", "tiny", "--data-path", SAMPLE,
                             "--device", "cpu", "--seq-length", "128", "--max-prompt-length", "64",
                             "--train-iters", "10000", "--global-batch-size", "2", "--micro-batch-size", "2",
                             "--save", str(save), "--metrics-jsonl", str(metrics)],
                            cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400  # a loaded CI machine
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out[-3000:]
    assert f"megatron-prune: interrupted before the first checkpoint in --save {save} (nothing to resume)" in out, \
        out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_eval_runs_after_every_eval_interval_steps(tmp_path):
    """``--eval-interval 2 --train-iters 3`` evaluates after the 2nd step and at the end (0-based steps 1, 2);
    ``--log-interval 2`` prints the same 1-based steps (2, the last) besides the first, so every
    evaluation reaches the console."""
    records, out = _dpo(tmp_path, "evalint", "--train-iters", "3", "--global-batch-size", "2",
                        "--eval-data-path", str(_heldout(tmp_path, 2)), "--eval-interval", "2", "--log-interval", "2")
    assert [r["step"] for r in records if "eval_reward_accuracy" in r] == [1, 2]
    lines = [line for line in out.splitlines() if line.startswith("[megatron-prune] step ")]
    assert [line.split()[2] for line in lines] == ["1/3", "2/3", "3/3"], out[-3000:]
    assert [("eval_reward_accuracy" in line) for line in lines] == [False, True, True], out[-3000:]


def test_evaluation_is_unpruned_dpo_on_the_heldout_pairs(tmp_path, trained_reference):
    """A pruned run (--prune-preset study: position, sequence and branch pruning) evaluates the
    held-out pairs without pruning: at unchanged weights (--lr 0) its evaluation reports what an
    unpruned run training on those pairs reports for its first step."""
    lines = (REPO / "megatron_prune" / "data" / "samples" / "hh_rlhf_heldout.jsonl").read_text().splitlines()[:8]
    heldout = tmp_path / "heldout8.jsonl"
    heldout.write_text("\n".join(lines) + "\n")
    reference = ["--ref-load", str(trained_reference)]  # differs from the starting policy: margins are not 0
    pruned, _ = _dpo(tmp_path, "pruned", "--train-iters", "1", "--lr", "0", "--prune-preset", "study",
                     "--eval-data-path", str(heldout), *reference)
    [evaluation] = [r for r in pruned if "eval_margin" in r]
    assert evaluation["eval_pairs"] == 8
    metrics = tmp_path / "on_heldout.jsonl"
    proc = _run([sys.executable, "-m", "megatron_prune.dpo", "--model-preset", "tiny", "--data-path", str(heldout),
                 "--device", "cpu", "--seq-length", "128", "--max-prompt-length", "64", "--train-iters", "1",
                 "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "0", "--metrics-jsonl", str(metrics),
                 *reference])
    assert proc.returncode == 0, proc.stdout[-5000:]
    [unpruned] = read_jsonl(metrics)
    assert abs(unpruned["margin"]) > 1e-4
    for key in ("loss", "margin", "reward_accuracy", "chosen_reward", "rejected_reward"):
        assert evaluation[f"eval_{key}"] == pytest.approx(unpruned[key], rel=1e-5, abs=1e-7), key


def test_heldout_pairs_under_the_interleaved_schedule_are_whole_pipeline_groups(capsys):
    """Megatron's interleaved schedule refuses a last group of microbatches smaller than the
    pipeline: each evaluation runs a multiple of PP microbatches (3 pairs at PP 2: 2 of them)."""
    from megatron_prune.dpo.trainer import heldout_pairs
    from megatron_prune.training.session import UsageError

    assert heldout_pairs(3, micro_batch_size=1, dp=1) == 3
    assert heldout_pairs(3, micro_batch_size=1, dp=1, interleaved_pp=2) == 2
    assert "runs 2 of 3 pairs" in capsys.readouterr().out
    assert heldout_pairs(12, micro_batch_size=2, dp=2, interleaved_pp=2) == 8
    with pytest.raises(UsageError, match=r"x --pipeline-model-parallel-size 4 \(the interleaved schedule\) = 4"):
        heldout_pairs(3, micro_batch_size=1, dp=1, interleaved_pp=4)
    # At --micro-batch-size 1 the only way out is more pairs (every data-parallel rank runs one).
    with pytest.raises(UsageError, match=r"= 4 that one evaluation needs; add held-out pairs$"):
        heldout_pairs(3, micro_batch_size=1, dp=2, interleaved_pp=2)
