"""LoRAConfig: defaults, validation messages, and its flags in both CLIs."""

from __future__ import annotations

import pytest

from megatron_prune.model.lora import TARGETS, LoRAConfig


def test_default_is_off_with_every_linear_targeted():
    cfg = LoRAConfig()
    assert cfg.rank == 0 and not cfg.enabled
    assert cfg.targets == "linear_qkv,linear_proj,linear_fc1,linear_fc2"
    assert cfg.target_names == TARGETS


def test_scale_is_alpha_over_rank():
    assert LoRAConfig(rank=8).scale == 1.0
    assert LoRAConfig(rank=8, alpha=16.0).scale == 2.0
    assert LoRAConfig(rank=64, alpha=16.0).scale == 0.25


@pytest.mark.parametrize("rank, alpha", [(49, 1.0), (3, 5.0), (64, None)])
def test_the_checkpoint_records_alpha_as_given(rank, alpha):
    """The recorded alpha (PEFT's ``lora_alpha`` on export) is the flag's value, not rank * (alpha / rank),
    which rounds (1 at rank 49 became 0.9999999999999999)."""
    from megatron_prune.lora_config import lora_meta

    recorded = lora_meta(LoRAConfig(rank=rank, alpha=alpha))["lora"]["alpha"]
    assert recorded == (alpha if alpha is not None else float(rank))


def test_targets_are_parsed_from_a_comma_list():
    assert LoRAConfig(rank=4, targets="linear_qkv, linear_fc2").target_names == ("linear_qkv", "linear_fc2")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=-1), "--lora-rank"),
        (dict(rank=2.5), "--lora-rank"),
        (dict(rank=4, alpha=0.0), "--lora-alpha"),
        (dict(rank=4, alpha=float("nan")), "--lora-alpha"),
        (dict(rank=4, dropout=1.0), "--lora-dropout"),
        (dict(rank=4, dropout=-0.1), "--lora-dropout"),
        (dict(rank=4, targets="linear_qkv,q_proj"), "unknown target(s) q_proj"),
        (dict(rank=4, targets=" , "), "--lora-targets"),
        (dict(rank=4, targets="linear_qkv,linear_qkv"), "twice"),
    ],
)
def test_bad_values_raise_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LoRAConfig(**kwargs)


@pytest.mark.parametrize("cli", ["dpo", "grpo"])
def test_flags_in_both_clis(cli):
    import importlib

    from megatron_prune.arguments import build_parser, configs_from_args

    groups = importlib.import_module(f"megatron_prune.{cli}.__main__").GROUPS
    parser = build_parser(cli, groups, "")
    argv = ["--model-preset", "tiny", "--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.05",
            "--lora-targets", "linear_qkv,linear_fc1"]
    cfg = configs_from_args(parser.parse_args(argv), groups)["LoRAConfig"]
    assert cfg == LoRAConfig(rank=16, alpha=32.0, dropout=0.05, targets="linear_qkv,linear_fc1")
    default = configs_from_args(parser.parse_args(["--model-preset", "tiny"]), groups)["LoRAConfig"]
    assert default == LoRAConfig()


@pytest.mark.parametrize("argv, message", [(["--lora-rank", "-2"], "--lora-rank"),
                                           (["--lora-rank", "4", "--lora-targets", "mlp"], "unknown target")])
def test_cli_rejects_bad_lora_flags_before_any_work(argv, message, capsys):
    from megatron_prune.dpo.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--model-preset", "tiny", "--data-path", "x.jsonl", "--dry-run", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
