"""LoRA export of a bf16 run: both exports keep the adapters' dtype (one rank, about 20 s)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.e2e.conftest import REPO, TINY_DPO, launch_env, run_cmd, run_dpo

pytestmark = pytest.mark.e2e


def test_a_bf16_lora_checkpoint_exports_in_bf16(tmp_path):
    """--dtype auto keeps the adapters' dtype: in a bf16 run they are bf16 while their fp32 Adam state
    sits in the same checkpoint under keys that also end in lora_A/lora_B, and must not set it."""
    from safetensors import safe_open

    common = [*TINY_DPO, "--lora-rank", "4", "--bf16", "--train-iters", "1", "--save", str(tmp_path / "ckpt")]
    run_dpo(common, log=tmp_path / "run.txt", nproc=1).check_ok()
    tool = [sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--load", str(tmp_path / "ckpt")]
    run_cmd([*tool, "--hf-out", str(tmp_path / "merged"), "--merge-lora", "--peft-out", str(tmp_path / "peft")],
            log=tmp_path / "export.txt", env=launch_env()).check_ok()
    for path in (tmp_path / "merged" / "model.safetensors", tmp_path / "peft" / "adapter_model.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            dtypes = {f.get_tensor(key).dtype for key in f.keys()}
        assert dtypes == {torch.bfloat16}, (path, dtypes)
