"""The flags named in the issues are a public contract: they must exist with these exact names."""

from __future__ import annotations

import pytest

DPO_FLAGS = [
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
    "--micro-batch-size", "--global-batch-size", "--seq-length", "--train-iters", "--lr", "--bf16",
    "--seed", "--load", "--save", "--save-interval", "--prune-position-ratio", "--prune-seq-min-ratio",
    "--prune-branch", "--prune-branch-chosen-prob", "--dpo-layout", "--dpo-beta", "--ref-mode",
    "--data-path", "--hf-model", "--model-preset", "--metrics-jsonl", "--device", "--dry-run",
    "--prune-preset", "--no-prune-branch", "--sgd-momentum", "--skip-invalid-records", "--max-prompt-length",
    # Megatron's own names, which launch scripts carry over
    "--exit-signal-handler", "--exit-signal", "--exit-duration-in-mins", "--exit-interval",
    "--recompute-activations", "--recompute-granularity", "--recompute-method", "--recompute-num-layers",
    "--recompute-modules",
]
GRPO_FLAGS = ["--task", "--group-size", "--max-new-tokens", "--std-normalization", "--no-std-normalization",
              "--advantage-std", "--skip-invalid-records", "--max-prompt-length", "--sgd-momentum",
              "--dppo-prompt-prune-rate", "--dppo-completion-prune-rate", "--dense-packing", "--shared-prompt"]
CHOICES = {
    "--optimizer": ["adam", "sgd"], "--lr-decay-style": ["constant", "linear", "cosine"],
    "--data-format": ["auto", "explicit", "hh", "helpsteer3"], "--model-preset": ["tiny", "tiny-tied"],
    "--device": ["auto", "cuda", "npu", "cpu"], "--prune-preset": ["study"], "--dpo-layout": ["full", "concat", "shared"],
    "--dpo-logp-reduction": ["mean", "sum"], "--ref-mode": ["online", "precomputed"], "--on-nonfinite": ["stop", "skip"],
}
GRPO_CHOICES = {"--task": ["toy", "toy-binary", "gsm8k", "math"], "--dppo-history-score": ["std", "informative", "pass-rate"],
                "--advantage-std": ["population", "sample"], "--loss-normalization": ["constant", "sequence"]}


def _dpo_parser():
    from megatron_prune.arguments import build_parser
    from megatron_prune.dpo.__main__ import GROUPS

    return build_parser("megatron-prune-dpo", GROUPS, "")


def test_dpo_contract_flags_exist():
    options = set(_dpo_parser()._option_string_actions)
    missing = [f for f in DPO_FLAGS if f not in options]
    assert not missing, f"public DPO flags missing: {missing}"


def _grpo_parser():
    from megatron_prune.arguments import build_parser
    from megatron_prune.grpo.__main__ import GROUPS

    return build_parser("megatron-prune-grpo", GROUPS, "")


def test_grpo_contract_flags_exist():
    options = set(_grpo_parser()._option_string_actions)
    missing = [f for f in GRPO_FLAGS if f not in options]
    assert not missing, f"public GRPO flags missing: {missing}"


def test_dpo_defaults_are_exact_dpo():
    """No --prune-* flag: every stochastic pruning off (the exact selective head stays on)."""
    from megatron_prune.arguments import configs_from_args
    from megatron_prune.dpo.__main__ import GROUPS

    configs = configs_from_args(_dpo_parser().parse_args(["--model-preset", "tiny"]), GROUPS)
    prune, dpo = configs["PruneConfig"], configs["DPOConfig"]
    assert (prune.position_ratio, prune.seq_min_ratio, prune.branch) == (1.0, 1.0, False)
    assert prune.selective_head is True and prune.preset is None
    assert dpo.beta == 1.0 and dpo.loss_average == "mean"


@pytest.mark.parametrize("parser, choices", [("dpo", CHOICES), ("grpo", GRPO_CHOICES)])
def test_help_shows_every_choice_and_switch_default(parser, choices):
    """--help lists the allowed values of every choice flag, on/off of every switch, and metavars
    named after their flags; it cites no file outside the repository's docs."""
    p = _dpo_parser() if parser == "dpo" else _grpo_parser()
    text = " ".join(p.format_help().split())
    for flag, values in choices.items():
        allowed = list(p._option_string_actions[flag].choices)
        assert set(values) <= set(allowed), flag
        assert f"{flag} {{{','.join(allowed)}}}" in text, flag
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        if action.nargs == 0:  # a switch
            assert "(default: on" in action.help or "(default: off" in action.help, action.option_strings
        elif action.choices is None:
            assert action.metavar == action.option_strings[0].lstrip("-").upper().replace("-", "_")
    assert "DESIGN" not in text and "§" not in text
    if parser == "grpo":
        assert "--std-normalization Divide" in text and "(default: on)" in text


def test_every_flag_has_help():
    for action in _dpo_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, f"{action.option_strings} has no help text"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prune-position-ratio", "0"], "--prune-position-ratio"),
        (["--prune-position-ratio", "1.5"], "--prune-position-ratio"),
        (["--prune-seq-min-ratio", "0"], "--prune-seq-min-ratio"),
        (["--prune-branch-chosen-prob", "1"], "--prune-branch-chosen-prob"),
        (["--dpo-beta", "0"], "--dpo-beta"),
    ],
)
def test_bad_values_name_the_flag(argv, message, capsys):
    from megatron_prune.arguments import parse_configs
    from megatron_prune.dpo.__main__ import GROUPS

    with pytest.raises(SystemExit) as exc:
        parse_configs("megatron-prune-dpo", GROUPS, "", ["--model-preset", "tiny", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_given_fields_are_the_flags_on_the_command_line():
    """The parse records which flags were given: not the defaults, not what --prune-preset fills in;
    a switch counts whichever form was typed (--prune-branch / --no-prune-branch)."""
    from megatron_prune.arguments import GIVEN, parse_configs
    from megatron_prune.dpo.__main__ import GROUPS

    args, configs = parse_configs("megatron-prune-dpo", GROUPS, "", ["--model-preset", "tiny"])
    assert getattr(args, GIVEN) == {"ModelConfig.model_preset"}
    args, configs = parse_configs("megatron-prune-dpo", GROUPS, "",
                                  ["--model-preset", "tiny", "--prune-preset", "study", "--no-prune-branch",
                                   "--lr", "1e-6", "--data-path", "a.jsonl", "b.jsonl"])
    assert getattr(args, GIVEN) == {"ModelConfig.model_preset", "PruneConfig.preset", "PruneConfig.branch",
                                    "TrainConfig.lr", "DPOConfig.data_path"}
    prune = configs["PruneConfig"]
    assert (prune.position_ratio, prune.branch, prune.branch_chosen_prob) == (0.6, False, 0.5)  # the preset's values
    assert configs["TrainConfig"].lr == 1e-6 and configs["DPOConfig"].data_path == ["a.jsonl", "b.jsonl"]


def test_the_repeated_error_line_is_appended_to_a_log_file(tmp_path):
    """After torchrun exits, a detached process repeats the error line; writing at the launcher's
    old offset of a redirected log overwrote what the script appended after the launcher."""
    import subprocess
    import sys

    from megatron_prune.arguments import _REPEAT_AFTER_LAUNCHER

    log = tmp_path / "log"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(log, "w") as launcher_stderr:  # the job's `> log 2>&1`, its offset where the launcher stopped
        launcher_stderr.write("torchrun report\n")
        launcher_stderr.flush()
        with open(log, "a") as script:  # the script's `echo ... >> log` after the launcher returned
            script.write("AFTER\n")
        subprocess.run([sys.executable, "-c", _REPEAT_AFTER_LAUNCHER, str(dead.pid), "megatron-prune: error: x"],
                       stderr=launcher_stderr, check=True, timeout=60)
    assert log.read_text().splitlines() == ["torchrun report", "AFTER", "megatron-prune: error: x"]


def test_every_nodes_first_rank_says_the_usage_error(monkeypatch, capsys, tmp_path):
    """Under torchrun on several nodes each node's log is often its own file: the first local rank
    of every node prints the line (and hands it to its launcher); the other ranks stay quiet."""
    import pytest

    from megatron_prune import arguments

    started = []
    monkeypatch.setattr(arguments.subprocess, "Popen", lambda *a, **k: started.append(a))
    monkeypatch.setattr(arguments.time, "sleep", lambda seconds: None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    for rank, local_rank, speaks in [("0", "0", True), ("2", "0", True), ("3", "1", False)]:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        started.clear()
        with pytest.raises(SystemExit) as exc:
            arguments.fail_usage("--lr must be >= 0")
        assert exc.value.code == 2
        assert (capsys.readouterr().err == "megatron-prune: error: --lr must be >= 0\n") == speaks
        assert bool(started) == speaks


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "cpu", "--use-flash-attn"], "unrecognized arguments: --use-flash-attn"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    ],
)
def test_a_bad_flag_off_the_npu_is_a_usage_error(argv, message, monkeypatch, capsys):
    """Off the NPU an unknown flag (even one of MindSpeed's) is the trainer's usage error, exit code 2,
    not a MindSpeed import error; an unknown --device value is one too, not a traceback."""
    from megatron_prune import accelerator as acc_mod
    from megatron_prune.dpo.__main__ import main

    monkeypatch.setattr(acc_mod, "_CURRENT", None)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exc:
        main(["--model-preset", "tiny", "--dry-run", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
