"""End-to-end runs of ``python -m megatron_prune.dpo`` on the bundled data."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from tests.e2e.conftest import undocumented_keys

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_prune", "data", "samples")
TRAIN = os.path.join(SAMPLES, "hh_rlhf_sample.jsonl")
HELDOUT = os.path.join(SAMPLES, "hh_rlhf_heldout.jsonl")


def run_cli(tmp_path, *extra: str, nproc: int = 1, timeout: int = 600) -> list[dict]:
    metrics = tmp_path / "metrics.jsonl"
    base = ["-m", "megatron_prune.dpo", "--model-preset", "tiny", "--data-path", TRAIN, "--device", "cpu",
            "--seq-length", "256", "--max-prompt-length", "128", "--metrics-jsonl", str(metrics), *extra]
    if nproc == 1:
        cmd = [sys.executable, *base]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *base]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert proc.returncode == 0, f"CLI failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


SEED = 1234
BETA = 0.5


def heldout_accuracy_by_reference(*, save_dir: str, seed: int, seq_length: int, max_prompt_length: int,
                                  first_n: int) -> dict:
    """Held-out reward accuracy of the saved policy, by the plain-PyTorch DPO reference.

    The reference model is the starting policy (the preset's weights at ``seed``), as in the run.
    Also the accuracy over the first ``first_n`` pairs (the run's own evaluation uses only whole
    microbatches).
    """
    import torch

    from megatron_prune.data.preference import PreferenceDataConfig, PreferenceDataset
    from megatron_prune.data.tokenizer import load_tokenizer
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.checkpoint import load_checkpoint
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel
    from tests.distributed.dpo_reference import pair_log_ratios, reward_accuracy

    data_cfg = PreferenceDataConfig(max_seq_length=seq_length, max_prompt_length=max_prompt_length, format="auto",
                                    skip_invalid=False)
    heldout = PreferenceDataset([HELDOUT], tokenizer=load_tokenizer("tiny"), config=data_cfg)
    pairs = [heldout[i] for i in range(len(heldout))]
    assert len(pairs) > first_n
    par = ParallelConfig()
    with model_parallel(par, seed=seed):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=seed, trainable=False)
        load_checkpoint(save_dir, model=policy, arch=arch)
        reference = setup_model(arch, par, seed=seed, trainable=False)
        with torch.no_grad():
            chosen, rejected = pair_log_ratios(policy[0], reference[0], pairs, vocab_size=arch.vocab_size,
                                               reduction="mean")
    margins = BETA * (chosen - rejected)
    return dict(accuracy=reward_accuracy(margins), pairs=len(pairs), max_abs_margin=float(margins.abs().max()),
                first_n_accuracy=reward_accuracy(margins[:first_n]))


@pytest.mark.e2e
def test_pruned_dpo_learns_on_bundled_data(tmp_path):
    """All prunings on: training loss falls and held-out reward accuracy rises above chance.

    The held-out accuracy is computed from the saved weights by the independent reference
    (``tests/distributed/dpo_reference.py``), not from the trainer's own margin. Measured on the
    2-core CPU machine: 0.61 after 24 steps (chance, 0.5, at step 0, where policy == reference).
    """
    from tests.dist import run_distributed

    steps = 24
    save = tmp_path / "ckpt"
    records = run_cli(
        tmp_path, "--eval-data-path", HELDOUT, "--eval-interval", str(steps), "--train-iters", str(steps), "--seed", str(SEED), "--save", str(save),
        "--global-batch-size", "32", "--micro-batch-size", "8", "--lr", "1e-3", "--dpo-beta", str(BETA),
        "--dpo-logp-reduction", "mean", "--lr-warmup-iters", "2",
        "--prune-position-ratio", "0.6", "--prune-seq-min-ratio", "0.5", "--prune-branch",
        "--prune-branch-chosen-prob", "0.5",
        timeout=1200,
    )
    assert [r["step"] for r in records] == list(range(steps))
    assert not undocumented_keys(records, "dpo.md")
    # Step 0: policy == reference, so every margin is 0 up to float noise (accuracy is chance).
    assert abs(records[0]["margin"]) < 1e-6
    first = statistics.mean(r["loss"] for r in records[:6])
    last = statistics.mean(r["loss"] for r in records[-6:])
    assert last < first - 0.004, f"loss did not fall: first 6 steps {first:.4f}, last 6 {last:.4f}"
    evaluated = 96  # the run evaluates whole microbatches of 8: 96 of the 100 held-out pairs
    held = run_distributed(heldout_accuracy_by_reference, 1, save_dir=str(save), seed=SEED, seq_length=256,
                           max_prompt_length=128, first_n=evaluated)[0]
    assert held["pairs"] >= 90 and held["max_abs_margin"] > 1e-3, held
    assert held["accuracy"] > 0.55, f"held-out reward accuracy by the reference: {held}"
    # The run's own evaluation (unpruned step, same weights) agrees with the reference.
    assert abs(records[-1]["eval_reward_accuracy"] - held["first_n_accuracy"]) <= 1.0 / evaluated + 1e-9, held


@pytest.mark.e2e
def test_precomputed_reference_matches_online(tmp_path):
    """The cached reference log-probs give the same run as the online reference model, read at the
    positions position pruning scores; data tokenized otherwise gets a table of its own."""
    common = ("--train-iters", "2", "--global-batch-size", "4", "--micro-batch-size", "2", "--lr", "1e-3",
              "--prune-branch", "--prune-position-ratio", "0.5")
    online = run_cli(tmp_path / "a" if (tmp_path / "a").mkdir() is None else tmp_path, *common)
    cache = tmp_path / "cache"
    pre = run_cli(tmp_path / "b" if (tmp_path / "b").mkdir() is None else tmp_path, *common,
                  "--ref-mode", "precomputed", "--ref-cache", str(cache))
    assert any(p.name.startswith("ref_logps_") for p in cache.iterdir())
    assert [r["step"] for r in online] == [r["step"] for r in pre] and len(online) == 2
    for a, b in zip(online, pre, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert b["ref_tokens"] == 0 and a["ref_tokens"] > 0
    (stored,) = cache.glob("ref_logps_*.pt")
    # Prompts cut shorter are other tokens: a new table, not the first one read at the wrong ids.
    run_cli(tmp_path / "c" if (tmp_path / "c").mkdir() is None else tmp_path, *common, "--max-prompt-length", "64",
            "--ref-mode", "precomputed", "--ref-cache", str(cache))
    assert len(list(cache.glob("ref_logps_*.pt"))) == 2
    # A table copied under another table's name is checked against the data it is read for.
    (shorter,) = set(cache.glob("ref_logps_*.pt")) - {stored}
    original = shorter.read_bytes()
    shorter.write_bytes(stored.read_bytes())
    with pytest.raises(AssertionError, match=r"CLI failed \(2\)") as failed:
        run_cli(tmp_path / "c", *common, "--max-prompt-length", "64", "--ref-mode", "precomputed",
                "--ref-cache", str(cache))
    assert f"reference log-probs cache {shorter} was stored for key {stored.stem[len('ref_logps_'):]}" in str(failed.value)
    shorter.write_bytes(original)
    # A cache file that cannot be read stops the run in one line naming it.
    stored.write_bytes(stored.read_bytes()[:100])
    with pytest.raises(AssertionError, match=r"CLI failed \(2\)") as failed:
        run_cli(tmp_path / "b", *common, "--ref-mode", "precomputed", "--ref-cache", str(cache))
    assert f"reference log-probs cache {stored} cannot be read" in str(failed.value)
    assert "delete it to recompute" in str(failed.value) and "Traceback" not in str(failed.value)
