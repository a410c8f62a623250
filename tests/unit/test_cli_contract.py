"""The flags named in the issues are a public contract: they must exist with these exact names."""

from __future__ import annotations

import pytest

DPO_FLAGS = [
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--sequence-parallel",
    "--micro-batch-size", "--global-batch-size", "--seq-length", "--train-iters", "--lr", "--bf16",
    "--seed", "--load", "--save", "--save-interval", "--prune-position-ratio", "--prune-seq-min-ratio",
    "--prune-branch", "--prune-branch-chosen-prob", "--dpo-layout", "--dpo-beta", "--ref-mode",
    "--data-path", "--hf-model", "--model-preset", "--metrics-jsonl", "--device", "--dry-run",
]


def _dpo_parser():
    from megatron_prune.arguments import build_parser
    from megatron_prune.dpo.__main__ import GROUPS

    return build_parser("megatron-prune-dpo", GROUPS, "")


def test_dpo_contract_flags_exist():
    options = set(_dpo_parser()._option_string_actions)
    missing = [f for f in DPO_FLAGS if f not in options]
    assert not missing, f"public DPO flags missing: {missing}"


def test_defaults_follow_the_study():
    from megatron_prune.arguments import configs_from_args
    from megatron_prune.dpo.__main__ import GROUPS

    configs = configs_from_args(_dpo_parser().parse_args(["--model-preset", "tiny"]), GROUPS)
    prune, dpo = configs["PruneConfig"], configs["DPOConfig"]
    assert (prune.position_ratio, prune.seq_min_ratio, prune.branch_chosen_prob) == (0.6, 0.5, 0.5)
    assert dpo.beta == 1.0 and dpo.loss_average == "mean"


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
