"""``--hf-model``: the DPO trainer starts from a local HF directory and its weights are exported back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_dpo_cli import TRAIN

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _tiny_qwen3(path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(path, safe_serialization=True)


@pytest.mark.e2e
def test_dpo_from_hf_model_then_export(tmp_path):
    hf = tmp_path / "hf"
    _tiny_qwen3(hf)
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 512}')  # an asset to carry to the export
    metrics = tmp_path / "m.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "megatron_prune.dpo", "--hf-model", str(hf), "--tokenizer", "tiny",
           "--data-path", TRAIN, "--device", "cpu", "--seq-length", "256", "--max-prompt-length", "128",
           "--train-iters", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
           "--save", str(tmp_path / "ckpt"), "--metrics-jsonl", str(metrics)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    # Policy and reference both start from the HF weights: the first margins are zero.
    assert abs(records[0]["margin"]) < 1e-6 and len(records) == 2

    out = tmp_path / "hf_out"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_megatron_to_hf.py"),
                           "--load", str(tmp_path / "ckpt"), "--hf-out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The checkpoint kept the HF directory's config and tokenizer files: the export copies them
    # (the original config, not one rebuilt from the architecture) without being told where they are.
    assert "no tokenizer" not in proc.stderr, proc.stderr[-3000:]
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 512}'
    assert (out / "generation_config.json").is_file()
    original, exported = (json.loads((d / "config.json").read_text()) for d in (hf, out))
    assert {k: v for k, v in exported.items() if k not in ("dtype", "torch_dtype", "transformers_version")} == \
        {k: v for k, v in original.items() if k not in ("dtype", "torch_dtype", "transformers_version")}
    import torch
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(hf)
    after = AutoModelForCausalLM.from_pretrained(out)
    changed = [n for n, p in after.state_dict().items() if not torch.equal(p, before.state_dict()[n])]
    assert changed, "training changed no weight in the exported model"
    # Resuming needs neither --hf-model nor --tokenizer: the checkpoint recorded the tokenizer the
    # run used ("tiny"), which wins over its hf_assets/ (config files here, no tokenizer).
    resume = [a for a in cmd if a not in ("--hf-model", str(hf), "--tokenizer", "tiny")]
    resume[resume.index("--train-iters") + 1] = "3"
    proc = subprocess.run([*resume, "--load", str(tmp_path / "ckpt")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in resumed] == [0, 1, 2]
    # ... and it keeps the HF weights as its reference (the checkpoint records where they came
    # from): its step equals the uninterrupted run's.
    whole_metrics = tmp_path / "whole.jsonl"
    whole = [a for a in cmd if a not in ("--save", str(tmp_path / "ckpt"))]
    whole[whole.index("--train-iters") + 1] = "3"
    whole[whole.index("--metrics-jsonl") + 1] = str(whole_metrics)
    proc = subprocess.run(whole, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    uninterrupted = [json.loads(line) for line in whole_metrics.read_text().splitlines()]
    assert resumed[2]["loss"] == uninterrupted[2]["loss"], (resumed, uninterrupted)
    tokens = torch.tensor([[2, 17, 33, 90]])
    generated = after.generate(tokens, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 8)
