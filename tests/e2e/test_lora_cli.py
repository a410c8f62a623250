"""LoRA through the CLI: a pruned DPO run at TP=2 with sequence parallelism and adapter dropout,
SIGKILLed and resumed (bit-exact losses), a wrong --lora-rank refused at resume, and both
exports of its checkpoint by tools/convert_megatron_to_hf.py; the three reference modes agree;
a run from --hf-model whose adapters-only checkpoint finds its base again (resume at another
layout, export through the recorded base and through --base-hf, a moved base refused).

Launches: the uninterrupted run, the killed run, its resume, the refused resume (fails at
validation), two exports; then one short run per reference mode; then the --hf-model runs.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.e2e.conftest import REPO, TINY_DPO, last_per_step, launch_env, read_jsonl, run_cmd, run_dpo, run_dpo_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 4
ADAPTER_KEYS = sorted(f"decoder.layers.{name}.{ab}" for name in ("self_attention.linear_qkv", "self_attention.linear_proj",
                                                                 "mlp.linear_fc1", "mlp.linear_fc2")
                      for ab in ("lora_A", "lora_B"))


def _model_keys(root) -> list[str]:
    """Model tensor keys saved in the newest checkpoint under ``root`` (optimizer state left out)."""
    from megatron.core import dist_checkpointing

    from megatron_prune.training.checkpoint import find_latest

    metadata = dist_checkpointing.load_tensors_metadata(str(root if (root / "dist").is_dir() else
                                                            find_latest(str(root))) + "/dist")
    return sorted(k for k in metadata if not k.startswith("optimizer."))


def _dir_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
LORA = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--lora-rank", "8", "--lora-alpha", "16",
        "--lora-dropout", "0.1"]


def test_lora_dpo_kill_resume_and_export(tmp_path):
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    common = [*TINY_DPO, *LORA, "--train-iters", str(STEPS), "--save-interval", "2"]
    first = run_dpo([*common, "--save", str(ref_dir / "ckpt"), "--metrics-jsonl", str(ref_dir / "m.jsonl")],
                    log=tmp_path / "reference.txt").check_ok()
    # The deprecated torch collectives Megatron calls under sequence parallelism are not the user's to fix.
    assert "FutureWarning" not in first.output, first.output[-3000:]
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
    assert {k: meta["lora_base"][k] for k in ("kind", "name")} == {"kind": "preset", "name": "tiny"}
    assert _model_keys(run_dir / "ckpt") == ADAPTER_KEYS  # adapters only: no base weight in the checkpoint

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
    # Both outputs are checked before either is written: a full --peft-out leaves no --hf-out behind.
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    refused = run_cmd([*tool, "--hf-out", str(tmp_path / "merged"), "--merge-lora", "--peft-out",
                       str(tmp_path / "full")], log=tmp_path / "refused_peft.txt", env=launch_env())
    assert refused.returncode == 2 and f"--peft-out {tmp_path / 'full'} exists and is not an empty" in refused.output
    assert not (tmp_path / "merged").exists()
    exported = run_cmd([*tool, "--hf-out", str(tmp_path / "merged"), "--merge-lora", "--peft-out",
                        str(tmp_path / "peft")], log=tmp_path / "export.txt", env=launch_env()).check_ok()
    assert (f"note: {tmp_path / 'peft'}/adapter_config.json names no base_model_name_or_path: the base is the "
            "built-in preset 'tiny' (seed 1234), which has no HF directory; export merged weights with --hf-out DIR "
            "--merge-lora instead") in exported.output, exported.output[-2000:]
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
                 "--lora-rank", "8", "--train-iters", "3", "--ref-mode", mode,
                 *(["--ref-cache", str(d / "cache")] if mode == "precomputed" else []),
                 "--metrics-jsonl", str(d / "m.jsonl")], log=tmp_path / f"{mode}.txt").check_ok()
        runs[mode] = [(r["loss"], r["grad_norm"]) for r in read_jsonl(d / "m.jsonl")]
    assert len(runs["adapter-off"]) == 3
    assert runs["online"] == runs["adapter-off"]
    # The cache is filled by its own pass with other microbatch shapes, so segment attention sums
    # over other padded blocks: equal up to float rounding, not bit for bit.
    for (loss, norm), (ref_loss, ref_norm) in zip(runs["precomputed"], runs["adapter-off"], strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-6) and norm == pytest.approx(ref_norm, rel=1e-6)


def test_lora_checkpoint_finds_its_hf_base(tmp_path):
    """From --hf-model: the checkpoint holds adapters only (smaller than the base) and records
    the base; --load alone resumes on it at another layout (PP=2 after TP=2) and follows the
    uninterrupted run; both exports find it, --base-hf gives the same files from a moved copy;
    once the base has moved, training and export stop with one message naming it and the flag."""
    from tests.e2e.test_hf_model_cli import _tiny_qwen3

    hf = tmp_path / "hf"
    _tiny_qwen3(hf)
    common = ["--tokenizer", "tiny", "--data-path", TINY_DPO[TINY_DPO.index("--data-path") + 1],
              "--seq-length", "128", "--max-prompt-length", "64", "--global-batch-size", "4",
              "--micro-batch-size", "2", "--lr", "1e-3", "--lora-rank", "8", "--save-interval", "2"]
    tp2 = ["--tensor-model-parallel-size", "2"]
    full = tmp_path / "full"
    run_dpo([*common, *tp2, "--hf-model", str(hf), "--train-iters", "3", "--save", str(full / "ckpt"),
             "--metrics-jsonl", str(full / "m.jsonl")], log=tmp_path / "full.txt").check_ok()
    run = tmp_path / "run"
    run_dpo([*common, *tp2, "--hf-model", str(hf), "--train-iters", "2", "--save", str(run / "ckpt"),
             "--metrics-jsonl", str(run / "m.jsonl")], log=tmp_path / "first.txt").check_ok()
    ckpt = run / "ckpt" / "iter_0000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora_base"]["kind"] == "hf" and meta["lora_base"]["path"] == str(hf.resolve())
    assert meta["lora_base"]["fingerprint"].startswith("sha256:")
    assert _model_keys(ckpt) == ADAPTER_KEYS
    # Adapters (13k parameters here) and their two Adam moments, against the base's 140k weights.
    assert _dir_bytes(ckpt / "dist") < _dir_bytes(hf) * 0.6, (_dir_bytes(ckpt / "dist"), _dir_bytes(hf))

    # --load alone (no --hf-model, no --tokenizer needed beyond the recorded base) at PP=2.
    resume = [*common, "--pipeline-model-parallel-size", "2", "--train-iters", "3", "--save", str(run / "ckpt"),
              "--metrics-jsonl", str(run / "m.jsonl"), "--load", str(run / "ckpt")]
    resumed = run_dpo(resume, log=tmp_path / "resumed.txt").check_ok()
    # Without --lora-alpha on either launch the alpha is the rank's both times: nothing changed.
    assert "differ from the checkpoint" not in resumed.output, resumed.output[-3000:]
    got, want = last_per_step(read_jsonl(run / "m.jsonl")), last_per_step(read_jsonl(full / "m.jsonl"))
    assert sorted(got) == [0, 1, 2]
    for step in range(3):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4, abs=1e-6), step

    tool = [sys.executable, str(REPO / "tools" / "convert_megatron_to_hf.py"), "--load", str(full / "ckpt")]
    run_cmd([*tool, "--hf-out", str(tmp_path / "merged"), "--merge-lora", "--peft-out", str(tmp_path / "peft")],
            log=tmp_path / "export.txt", env=launch_env()).check_ok()
    peft_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert peft_config["base_model_name_or_path"] == str(hf.resolve())
    assert (tmp_path / "merged" / "generation_config.json").is_file()  # the base's own assets were carried over

    moved = tmp_path / "moved_hf"
    shutil.move(str(hf), str(moved))
    refused = run_cmd([*tool, "--hf-out", str(tmp_path / "merged2"), "--merge-lora"], log=tmp_path / "refused.txt",
                      env=launch_env())
    assert refused.returncode == 2 and str(hf.resolve()) in refused.output and "--base-hf DIR" in refused.output
    assert not (tmp_path / "merged2").exists()
    run_cmd([*tool, "--hf-out", str(tmp_path / "merged2"), "--merge-lora", "--base-hf", str(moved)],
            log=tmp_path / "export2.txt", env=launch_env()).check_ok()
    from safetensors.torch import load_file

    first, second = load_file(tmp_path / "merged" / "model.safetensors"), load_file(tmp_path / "merged2" / "model.safetensors")
    assert first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)

    stopped = run_dpo([*resume, "--train-iters", "4"], log=tmp_path / "moved.txt")
    assert stopped.returncode != 0 and str(hf.resolve()) in stopped.output and "--hf-model DIR" in stopped.output
