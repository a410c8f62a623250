"""Under LoRA with --ref-load, the reference is that checkpoint in every reference mode (not in the
slow LoRA CLI file: this one is short and pins which model scores the precomputed table)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import TINY_DPO, read_jsonl, run_dpo

pytestmark = pytest.mark.e2e


def test_lora_with_a_ref_load_scores_that_reference_in_every_mode(tmp_path, trained_reference):
    """With --ref-load the reference is that checkpoint, not the LoRA base: online and precomputed
    (the table is scored with the --ref-load model) give the same first step, whose margin is not 0
    (a reference equal to the fresh adapters' base would give exactly 0)."""
    data = TINY_DPO[TINY_DPO.index("--data-path") + 1]
    common = ["--model-preset", "tiny", "--data-path", data, "--seq-length", "128", "--max-prompt-length", "64",
              "--global-batch-size", "4", "--micro-batch-size", "2"]
    reference = trained_reference
    first = {}
    for mode in ("online", "precomputed"):
        d = tmp_path / mode
        run_dpo([*common, "--lr", "1e-3", "--train-iters", "1", "--lora-rank", "4", "--ref-load", str(reference),
                 "--ref-mode", mode, *(["--ref-cache", str(d / "cache")] if mode == "precomputed" else []),
                 "--metrics-jsonl", str(d / "m.jsonl")], log=tmp_path / f"{mode}.txt", nproc=1).check_ok()
        first[mode] = read_jsonl(d / "m.jsonl")[0]
    assert abs(first["online"]["margin"]) > 1e-4, first["online"]
    for key in ("loss", "margin", "reward_accuracy"):
        assert first["precomputed"][key] == pytest.approx(first["online"][key], rel=1e-5, abs=1e-7), key
