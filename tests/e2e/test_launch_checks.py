"""A launch checks its flags once: the CLI's checks (which ``--dry-run`` also runs) hand what they
found to the run, so the architecture, the checkpoint and the output paths are looked up, and the
tokenizer loaded, one time per rank, not once more when the trainer starts."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from tests.dist import run_distributed

pytestmark = pytest.mark.e2e


def _count_launch(trainer: str, argv: list[str], metrics: str) -> dict:
    """Run the trainer's CLI ``main`` in this process, counting the lookups the checks make."""
    import importlib

    from megatron_prune.data import tokenizer as tokenizer_module
    from megatron_prune.training import session

    calls = {"resolve_model_and_base": 0, "check_output_paths": 0, "load_tokenizer": 0}

    def counting(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        setattr(module, name, wrapper)

    counting(session, "resolve_model_and_base")
    counting(session, "check_output_paths")
    counting(tokenizer_module, "load_tokenizer")
    main = importlib.import_module(f"megatron_prune.{trainer}.__main__").main
    assert main([*argv, "--metrics-jsonl", metrics]) == 0
    with open(metrics, encoding="utf-8") as f:
        calls["steps"] = [json.loads(line)["step"] for line in f if line.strip()]
    return calls


def _launch(trainer: str, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(_count_launch, 1, trainer=trainer, argv=[*argv, "--save", os.path.join(tmp, "ckpt")],
                               metrics=os.path.join(tmp, "metrics.jsonl"))[0]


def test_dpo_launch_checks_once_and_loads_the_tokenizer_once():
    from megatron_prune.data import HH_RLHF_SAMPLE

    calls = _launch("dpo", ["--model-preset", "tiny", "--device", "cpu", "--data-path", HH_RLHF_SAMPLE,
                            "--seq-length", "128", "--max-prompt-length", "64", "--global-batch-size", "2",
                            "--micro-batch-size", "2", "--train-iters", "1"])
    assert calls["steps"] == [0]
    assert calls["resolve_model_and_base"] == 1 and calls["check_output_paths"] == 1, calls
    assert calls["load_tokenizer"] == 1, calls


def test_grpo_launch_checks_once_and_loads_the_tokenizer_once():
    from megatron_prune.data import GSM8K_SAMPLE

    calls = _launch("grpo", ["--model-preset", "tiny", "--device", "cpu", "--task", "gsm8k", "--data-path",
                             GSM8K_SAMPLE, "--seq-length", "160", "--max-new-tokens", "8", "--group-size", "2",
                             "--global-batch-size", "2", "--micro-batch-size", "2", "--train-iters", "1"])
    assert calls["steps"] == [0]
    assert calls["resolve_model_and_base"] == 1 and calls["check_output_paths"] == 1, calls
    assert calls["load_tokenizer"] == 1, calls
