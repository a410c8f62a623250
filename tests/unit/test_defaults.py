"""Defaults a user gets without asking, and the named settings they can ask for.

Pruning presets and overrides through the real parser; the SGD momentum and the GRPO advantage
std through the objects that consume them; the Megatron-Core version check; and the one-way
import order of the CLI modules (checked in fresh interpreters).
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import sys

import pytest
import torch

from megatron_prune.arguments import build_parser, configs_from_args
from megatron_prune.config import MODEL_PRESETS, PruneConfig

STUDY = dict(position_ratio=0.6, seq_min_ratio=0.5, branch=True, branch_chosen_prob=0.5)
EXACT = dict(position_ratio=1.0, seq_min_ratio=1.0, branch=False, branch_chosen_prob=0.5)


def _prune(argv: list[str]) -> PruneConfig:
    from megatron_prune.dpo.__main__ import GROUPS

    parser = build_parser("megatron-prune-dpo", GROUPS, "")
    return configs_from_args(parser.parse_args(["--model-preset", "tiny", *argv]), GROUPS)["PruneConfig"]


def _values(prune: PruneConfig) -> dict:
    return {name: getattr(prune, name) for name in STUDY}


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], EXACT),
        (["--prune-preset", "study"], STUDY),
        (["--prune-preset", "study", "--prune-position-ratio", "0.8"], {**STUDY, "position_ratio": 0.8}),
        (["--prune-position-ratio", "0.8", "--prune-preset", "study"], {**STUDY, "position_ratio": 0.8}),
        (["--prune-preset", "study", "--no-prune-branch"], {**STUDY, "branch": False}),
        (["--prune-preset", "study", "--prune-seq-min-ratio", "1"], {**STUDY, "seq_min_ratio": 1.0}),
        (["--prune-preset", "study", "--prune-branch-chosen-prob", "0.3"], {**STUDY, "branch_chosen_prob": 0.3}),
        (["--prune-branch"], {**EXACT, "branch": True}),
        (["--prune-position-ratio", "0.6"], {**EXACT, "position_ratio": 0.6}),
    ],
)
def test_prune_preset_and_overrides(argv, expected):
    prune = _prune(argv)
    assert _values(prune) == expected
    assert prune.selective_head is True


def test_programmatic_defaults_match_the_cli():
    assert _values(PruneConfig()) == EXACT == _values(PruneConfig.off())
    assert _values(PruneConfig(preset="study")) == STUDY
    assert _values(PruneConfig(preset="study", branch=False)) == {**STUDY, "branch": False}
    with pytest.raises(ValueError, match="--prune-preset must be one of study"):
        PruneConfig(preset="fast")
    with pytest.raises(ValueError, match="--prune-position-ratio"):
        PruneConfig(preset="study", position_ratio=0.0)


def test_model_preset_choices_are_the_presets():
    from megatron_prune.model.arch import PRESETS

    assert MODEL_PRESETS == tuple(PRESETS)


# --------------------------------------------------------------------------- optimizer


def _optimizer_config(monkeypatch, argv: list[str]):
    """The OptimizerConfig the DPO CLI's flags hand to Megatron (model, optimizer and schedule stubbed)."""
    from megatron_prune.dpo.__main__ import GROUPS
    from megatron_prune.training import model_setup, session

    seen = []
    monkeypatch.setattr(model_setup, "get_megatron_optimizer", lambda config, model: seen.append(config) or object())
    monkeypatch.setattr(model_setup, "prefer_fused_torch_adam", lambda optimizer: 0)
    monkeypatch.setattr(session, "setup_model", lambda *a, **k: [])
    monkeypatch.setattr(session, "build_scheduler", lambda optimizer, train: None)
    configs = configs_from_args(build_parser("megatron-prune-dpo", GROUPS, "").parse_args(
        ["--model-preset", "tiny", *argv]), GROUPS)
    session.build_parts(None, None, configs["ModelConfig"], configs["TrainConfig"])
    return seen[-1]


@pytest.mark.parametrize("argv, field, expected", [
    (["--optimizer", "sgd"], "sgd_momentum", 0.9),  # Megatron's default
    (["--optimizer", "sgd", "--sgd-momentum", "0"], "sgd_momentum", 0.0),
    (["--optimizer", "sgd", "--sgd-momentum", "0.5"], "sgd_momentum", 0.5),
    ([], "adam_eps", 1e-8),  # Megatron's default
    (["--adam-eps", "1e-5"], "adam_eps", 1e-5),
])
def test_optimizer_flags_reach_megatron(monkeypatch, argv, field, expected):
    """--sgd-momentum and --adam-eps are handed to Megatron's OptimizerConfig, with the optimizer they belong to."""
    config = _optimizer_config(monkeypatch, argv)
    assert config.optimizer == ("sgd" if "sgd" in argv else "adam") and getattr(config, field) == expected


def test_bad_optimizer_flags_are_refused():
    from megatron_prune.config import ModelConfig, TrainConfig

    assert TrainConfig().sgd_momentum == 0.9 and ModelConfig().device == "auto"
    with pytest.raises(ValueError, match="--sgd-momentum must be in"):
        TrainConfig(sgd_momentum=1.0)
    with pytest.raises(ValueError, match="--adam-eps must be > 0"):
        TrainConfig(adam_eps=0.0)


# --------------------------------------------------------------------------- GRPO advantages


@pytest.mark.parametrize("choice", ["population", "sample"])
def test_advantage_std_choice(choice):
    """population: (r - mean) / (pstdev + 1e-6), the default; sample: / (stdev + 1e-4), TRL's."""
    from megatron_prune.grpo.advantages import group_advantages
    from megatron_prune.grpo.config import GRPOConfig

    rewards = [[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.25], [0.0] * 8, [0.0, 1.0] * 4]
    config = GRPOConfig(group_size=8, advantage_std=choice) if choice != "population" else GRPOConfig(group_size=8)
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), config=config.advantage_config())
    for row, out in zip(rewards, got.tolist()):
        mean = statistics.fmean(row)
        std = statistics.pstdev(row) + 1e-6 if choice == "population" else statistics.stdev(row) + 1e-4
        assert out == pytest.approx([(r - mean) / std for r in row], rel=1e-12, abs=1e-12)


def test_advantage_std_needs_two_samples():
    from megatron_prune.grpo.config import GRPOConfig

    with pytest.raises(ValueError, match="--advantage-std sample needs --group-size >= 2"):
        GRPOConfig(group_size=1, advantage_std="sample")


# --------------------------------------------------------------------------- versions


@pytest.mark.parametrize("found", ["0.17.0", "0.15.2", "1.0.0rc1", "0.16"])
def test_megatron_core_version_outside_the_range(found, caplog):
    from megatron_prune.training.session import UsageError, check_versions

    if found == "0.16":
        assert check_versions("cpu", megatron_version=found).startswith("megatron-core 0.16")
        return
    with pytest.raises(UsageError) as info:
        check_versions("cpu", megatron_version=found)
    message = str(info.value)
    assert f"megatron-core {found} is installed" in message and "megatron-core>=0.16,<0.17" in message
    assert "pip install 'megatron-core==0.16.1'" in message
    with caplog.at_level(logging.WARNING):
        assert check_versions("cuda", megatron_version=found).startswith(f"megatron-core {found}")
    assert any("is tested with" in r.getMessage() for r in caplog.records)


def test_installed_megatron_core_is_in_the_tested_range():
    from megatron_prune.training.session import check_versions

    assert "tested: >=0.16,<0.17" in check_versions("cpu")


def test_setup_py_declares_the_tested_range():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert '"megatron-core>=0.16,<0.17"' in text


# --------------------------------------------------------------------------- import order


MODULES = ["megatron_prune.adapters.mindspeed", "megatron_prune.arguments", "megatron_prune.training.session",
           "megatron_prune.training.cli"]


@pytest.mark.parametrize("module", MODULES)
def test_each_cli_module_imports_alone(module):
    """Each module imports first in a fresh interpreter (no import cycle on the launch path), and the
    adapter, used by the CLI, imports neither the CLI modules nor the session, even when it declares
    the trainers' flags."""
    code = f"""
import argparse, sys
import {module}
if {module!r} == "megatron_prune.adapters.mindspeed":
    {module}.add_plugin_flags(argparse.ArgumentParser())
    bad = [m for m in ("megatron_prune.arguments", "megatron_prune.training.session", "megatron_prune.training.cli")
           if m in sys.modules]
    assert not bad, bad
if {module!r} == "megatron_prune.arguments":
    assert "megatron_prune.training.session" not in sys.modules
    assert "megatron_prune.adapters.mindspeed" not in sys.modules
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# --------------------------------------------------------------------------- GRPO prompts


def test_grpo_prompts_keep_bos_and_template_head_when_truncated():
    from megatron_prune.data import GSM8K_SAMPLE
    from megatron_prune.data.tokenizer import load_tokenizer
    from megatron_prune.grpo.trainer import math_source

    tokenizer = load_tokenizer("tiny")
    head = [tokenizer.bos_id] + tokenizer.encode("\n\nHuman:")  # what every plain-template prompt starts with
    full = math_source(task="gsm8k", paths=[GSM8K_SAMPLE], tokenizer=tokenizer, max_prompt_length=10**6)
    cut = math_source(task="gsm8k", paths=[GSM8K_SAMPLE], tokenizer=tokenizer, max_prompt_length=24)
    for i in range(5):
        whole, short = full.get(i), cut.get(i)
        assert not whole.truncated and list(whole.tokens[: len(head)]) == head
        assert short.truncated and len(short.tokens) == 24
        assert short.tokens[0] == tokenizer.bos_id
        kept_head = next(n for n in range(24) if short.tokens[n] != whole.tokens[n])
        assert 1 <= kept_head <= len(head)
        assert short.tokens[kept_head:] == whole.tokens[-(24 - kept_head):]


def test_grpo_prompts_with_special_token_text_are_counted_and_said(tmp_path, caplog, monkeypatch):
    """A problem whose text holds a special token's text (already chat-templated) is said once."""
    import json

    from megatron_prune.data.tokenizer import load_tokenizer
    from megatron_prune.grpo.trainer import math_source

    from .data.helpers import CHAT_TEMPLATE, save_hf_tokenizer

    monkeypatch.setenv("RANK", "0")
    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path / "tok", chat_template=CHAT_TEMPLATE))
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "2+2=4\n#### 4"}) + "\n"
                            for q in ("What is 2+2?", "<|user|>What is 2+2?</s><|assistant|>")))
    with caplog.at_level("WARNING"):
        source = math_source(task="gsm8k", paths=[str(path)], tokenizer=tokenizer, max_prompt_length=64)
    assert len(source) == 2
    assert (f"special-token text in 1 problems (first: {path}:2 holds '</s>') is tokenized as that token; "
            "prompts already formatted with a chat template are formatted twice: give plain text"
            ) in caplog.messages
