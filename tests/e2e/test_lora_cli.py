"""LoRA through the CLI: a pruned DPO run at TP=2 with sequence parallelism and adapter dropout,
SIGKILLed and resumed (bit-exact losses), a wrong --lora-rank refused at resume, and both
exports of its checkpoint by tools/convert_megatron_to_hf.py; the three reference modes agree.

Launches: the uninterrupted run, the killed run, its resume, the refused resume (fails at
validation), two exports; then one short run per reference mode.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.conftest import REPO, TINY_DPO, last_per_step, launch_env, read_jsonl, run_cmd, run_dpo, run_dpo_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 4
LORA = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--lora-rank", "8", "--lora-alpha", "16",
        "--lora-dropout", "0.1"]


def test_lora_dpo_kill_resume_and_export(tmp_path):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    common = [*TINY_DPO, *LORA, "--train-iters", str(STEPS), "--save-interval", "2"]
    run_dpo([*common, "--save", str(ref_dir / "ckpt"), "--metrics-jsonl", str(ref_dir / "m.jsonl")],
            log=tmp_path / "reference.txt").check_ok()
    reference = read_jsonl(ref_dir / "m.jsonl")
    assert [r["step"] for r in reference] == list(range(STEPS))
    # A fresh adapter is the base model and the reference is the base: no margin at the start
    # beyond what the pruned layouts' rounding leaves.
    assert abs(reference[0]["margin"]) < 1e-4

    args = [*common, "--save", str(run_dir / "ckpt"), "--metrics-jsonl", str(run_dir / "m.jsonl")]
    run_dpo_until(args, log=tmp_path / "killed.txt", metrics=run_dir / "m.jsonl", lines=3)
    published = int((run_dir / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    meta = json.loads((run_dir / "ckpt" / f"iter_{published:07d}" / "meta.json").read_text())
    assert meta["lora"] == {"rank": 8, "alpha": 16.0, "dropout": 0.1,
                            "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}

    wrong = run_dpo([*args, "--load", str(run_dir / "ckpt"), "--lora-rank", "4"], log=tmp_path / "wrong.txt")
    assert wrong.returncode != 0 and "holds LoRA adapters of rank 8" in wrong.output

    run_dpo([*args, "--load", str(run_dir / "ckpt")], log=tmp_path / "resumed.txt").check_ok()
    got = last_per_step(read_jsonl(run_dir / "m.jsonl"))
    for ref in reference:
        for key in ("loss", "grad_norm", "margin"):
            assert got[ref["step"]][key] == ref[key], f"step {ref['step']} {key}"

    tool = [sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--load", str(ref_dir / "ckpt")]
    refused = run_cmd([*tool, "--hf-out", str(tmp_path / "plain")], log=tmp_path / "refused.txt", env=launch_env())
    assert refused.returncode == 2 and "--merge-lora" in refused.output
    run_cmd([*tool, "--hf-out", str(tmp_path / "merged"), "--merge-lora", "--peft-out", str(tmp_path / "peft")],
            log=tmp_path / "export.txt", env=launch_env()).check_ok()
    assert (tmp_path / "merged" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json",
                                                                      "adapter_model.safetensors"]


def test_lora_reference_modes_agree(tmp_path):
    """Under LoRA the base is the starting model: the adapter-off reference, a separate frozen copy
    (online) and cached log-probs computed with the adapter-off policy (precomputed) give the same run."""
    runs = {}
    for mode in ("adapter-off", "online", "precomputed"):
        d = tmp_path / mode
        run_dpo(["--model-preset", "tiny", "--data-path", TINY_DPO[TINY_DPO.index("--data-path") + 1],
                 "--seq-length", "128", "--max-prompt-length", "64", "--global-batch-size", "8",
                 "--micro-batch-size", "2", "--lr", "1e-3", "--tensor-model-parallel-size", "2",
                 "--lora-rank", "8", "--train-iters", "3", "--ref-mode", mode, "--ref-cache", str(d / "cache"),
                 "--metrics-jsonl", str(d / "m.jsonl")], log=tmp_path / f"{mode}.txt").check_ok()
        runs[mode] = [(r["loss"], r["grad_norm"]) for r in read_jsonl(d / "m.jsonl")]
    assert len(runs["adapter-off"]) == 3
    assert runs["online"] == runs["adapter-off"] == runs["precomputed"]
