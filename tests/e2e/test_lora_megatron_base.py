"""LoRA started from one of our Megatron checkpoints (``--load`` of a checkpoint without adapters).

DPO: an HF model converted by tools/convert_hf_to_megatron.py at TP=1 and loaded at TP=2 trains
the same LoRA run, loss for loss, as ``--hf-model`` of the model it was converted from; its
checkpoint records the converted base, a SIGKILLed run resumes bit for bit, the merged export
reads the base from the Megatron checkpoint, a moved base is refused with its path, and given
with ``--base-load`` it resumes the run bit for bit, is recorded at its new place, and exports the
same merged weights.
GRPO: a full-parameter training checkpoint as the base (its optimizer and trainer state left
out, as the log says), killed and resumed bit for bit.

Launches: one conversion, the --hf-model run, the run from the converted checkpoint (killed),
its resume, one export, the resume with the moved base; GRPO: the full-parameter run, the uninterrupted LoRA run, the killed
one, its resume.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest

from tests.e2e.conftest import (REPO, SAMPLE, check_resumed_steps, last_per_step, launch_env, read_jsonl, run_cmd, run_dpo,
                                run_dpo_until, run_until, torchrun_cmd)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 3
DPO = ["--tokenizer", "tiny", "--data-path", SAMPLE, "--seq-length", "128", "--max-prompt-length", "64",
       "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3", "--lora-rank", "8",
       "--tensor-model-parallel-size", "2", "--train-iters", str(STEPS)]


def test_lora_dpo_from_converted_checkpoint(tmp_path):
    from megatron_prune.lora_config import LoRAConfig, check_load
    from tests.e2e.test_hf_model_cli import _tiny_qwen3

    hf, converted = tmp_path / "hf", tmp_path / "converted"
    _tiny_qwen3(hf)
    conversion = run_cmd([sys.executable, str(REPO / "tools" / "convert_hf_to_megatron.py"), "--hf-dir", str(hf),
                          "--save", str(converted)], log=tmp_path / "convert.txt", env=launch_env()).check_ok()
    # The model has no tokenizer files; the converter says so (the runs below pass --tokenizer).
    assert (f"{hf} holds no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json): "
            "the trainers will need --tokenizer to read text data, and an export will have no tokenizer"
            ) in conversion.output

    run_dpo([*DPO, "--hf-model", str(hf), "--metrics-jsonl", str(tmp_path / "hf.jsonl")],
            log=tmp_path / "hf.txt").check_ok()
    want = read_jsonl(tmp_path / "hf.jsonl")
    assert [r["step"] for r in want] == list(range(STEPS))

    run = tmp_path / "run"
    args = [*DPO, "--save", str(run / "ckpt"), "--save-interval", "1", "--metrics-jsonl", str(run / "m.jsonl")]
    killed = run_dpo_until([*args, "--load", str(converted)], log=tmp_path / "killed.txt",
                           metrics=run / "m.jsonl", lines=STEPS - 1)
    assert "LoRA starts from the model weights of" in killed.output and "iteration 0" in killed.output
    first = read_jsonl(run / "m.jsonl")
    # The converted weights are the HF weights in fp32, loaded at TP=2 from a TP=1 save: the same
    # shards as --hf-model fills, so the same arithmetic bit for bit.
    for got in first:
        for key in ("loss", "grad_norm", "margin"):
            assert got[key] == want[got["step"]][key], f"step {got['step']} {key}"

    published = int((run / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    assert published in (1, 2), published
    ckpt = run / "ckpt" / f"iter_{published:07d}"
    meta = json.loads((ckpt / "meta.json").read_text())
    base = meta["lora_base"]
    assert base["kind"] == "megatron" and base["path"] == str(converted.resolve() / "iter_0000000")
    assert base["fingerprint"].startswith("sha256:")

    # Resumed with --load alone: the base is found where the checkpoint records it.
    run_dpo([*args, "--load", str(run / "ckpt")], log=tmp_path / "resumed.txt").check_ok()
    got = last_per_step(read_jsonl(run / "m.jsonl"))
    assert sorted(got) == list(range(STEPS))
    for ref in want:
        for key in ("loss", "grad_norm", "margin"):
            assert got[ref["step"]][key] == ref[key], f"step {ref['step']} {key}"

    exported = run_cmd([sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--load", str(ckpt),
                        "--hf-out", str(tmp_path / "merged"), "--merge-lora", "--peft-out", str(tmp_path / "peft")],
                       log=tmp_path / "export.txt", env=launch_env()).check_ok()
    assert "names no base_model_name_or_path: the base is the Megatron checkpoint" in exported.output
    from safetensors.torch import load_file

    merged, original = load_file(tmp_path / "merged" / "model.safetensors"), load_file(hf / "model.safetensors")
    assert merged.keys() == original.keys()
    assert all(merged[k].equal(original[k]) for k in original if "proj" not in k)  # norms, embeddings
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not merged[q].equal(original[q])  # the adapters trained
    assert (tmp_path / "merged" / "generation_config.json").is_file()  # the converted base's hf_assets
    peft = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    # Merged = base + (alpha/r) B A with the PEFT tensors (alpha = r here): the base read from the
    # Megatron checkpoint is the HF model the adapters were trained on.
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    delta = peft[f"{prefix}.lora_B.weight"].double() @ peft[f"{prefix}.lora_A.weight"].double()
    name = "model.layers.1.mlp.down_proj.weight"
    assert merged[name].equal((original[name].double() + delta).float())

    lora = LoRAConfig(rank=8)
    assert check_load(str(ckpt), lora)["fingerprint"] == base["fingerprint"]
    shutil.move(str(converted), str(tmp_path / "moved"))
    with pytest.raises(ValueError, match=re.escape(base["path"]) + ".*is missing.*--base-load DIR"):
        check_load(str(ckpt), lora)

    # The moved base given with --base-load: the run resumes from the published checkpoint with the
    # same losses, and its own checkpoints record the new place (later resumes need no flag).
    again = tmp_path / "again"
    run_dpo([*DPO, "--load", str(ckpt), "--base-load", str(tmp_path / "moved"), "--save", str(again / "ckpt"),
             "--metrics-jsonl", str(again / "m.jsonl")], log=tmp_path / "moved.txt").check_ok()
    got = last_per_step(read_jsonl(again / "m.jsonl"))
    assert sorted(got) == list(range(published, STEPS))
    for step, rec in got.items():
        for key in ("loss", "grad_norm", "margin"):
            assert rec[key] == want[step][key], f"step {step} {key}"
    final = json.loads((again / "ckpt" / f"iter_{STEPS:07d}" / "meta.json").read_text())["lora_base"]
    assert final == dict(base, path=str((tmp_path / "moved").resolve() / "iter_0000000"))
    # The export finds the moved base the same way: the merged weights are those exported before the move.
    run_cmd([sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--load", str(ckpt),
             "--hf-out", str(tmp_path / "merged_moved"), "--merge-lora", "--base-load", str(tmp_path / "moved")],
            log=tmp_path / "export_moved.txt", env=launch_env()).check_ok()
    again_merged = load_file(tmp_path / "merged_moved" / "model.safetensors")
    assert again_merged.keys() == merged.keys() and all(again_merged[k].equal(merged[k]) for k in merged)


GRPO_STEPS = 6
GRPO = ["--device", "cpu", "--task", "toy", "--toy-num-prompts", "8", "--toy-prompt-length", "3",
        "--global-batch-size", "4", "--micro-batch-size", "4", "--seq-length", "32", "--group-size", "4",
        "--max-new-tokens", "4", "--lr", "2e-2", "--seed", "77", "--ppo-epochs", "2", "--kl-beta", "0.05"]
SAME = ("loss", "policy_loss", "grad_norm", "reward_mean", "clip_fraction", "ratio_mean")


def _grpo(args: list[str]) -> list[str]:
    return torchrun_cmd(["-m", "megatron_prune.grpo", *args], nproc=1)


def test_lora_grpo_from_training_checkpoint_kill_resume(tmp_path):
    full = tmp_path / "full"
    run_cmd(_grpo([*GRPO, "--model-preset", "tiny", "--train-iters", "1", "--save", str(full)]),
            log=tmp_path / "full.txt").check_ok()
    lora = [*GRPO, "--lora-rank", "4", "--train-iters", str(GRPO_STEPS), "--save-interval", "2"]
    uninterrupted = run_cmd(_grpo([*lora, "--load", str(full), "--save", str(tmp_path / "ref_ckpt"),
                                   "--metrics-jsonl", str(tmp_path / "ref.jsonl")]),
                            log=tmp_path / "ref.txt").check_ok()
    assert "its optimizer and trainer state are not used" in uninterrupted.output
    reference = read_jsonl(tmp_path / "ref.jsonl")
    assert [r["step"] for r in reference] == list(range(GRPO_STEPS))  # iteration 0, not the base's 1

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [*lora, "--save", str(ckpt), "--metrics-jsonl", str(metrics)]
    run_until(_grpo([*args, "--load", str(full)]), log=tmp_path / "killed.txt", metrics=metrics, lines=3)
    killed = read_jsonl(metrics)
    published = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    # Killed once step index 2 is logged: iter_0000002 (inside a rollout) is published, or on a
    # starved machine iter_0000004.
    assert published in (2, 4) and killed[-1]["step"] < GRPO_STEPS - 1, (published, killed[-1]["step"])

    run_cmd(_grpo([*args, "--load", str(ckpt)]), log=tmp_path / "resumed.txt").check_ok()
    check_resumed_steps(killed=killed, records=read_jsonl(metrics), reference=reference, published=published,
                        keys=SAME)
