"""The trainers users launch, on a CUDA GPU: bf16, the nccl process group, pruning on.

One torchrun rank each (one GPU is enough): DPO with every pruning and the shared layout saves a
checkpoint and resumes from it; LoRA DPO trains; GRPO with DPPO trains with dense packing, and
with KV-cached generation and shared prompts; DPO with full and selective recompute repeats the
run without. Each run must finish, log finite losses for every
step and keep the pruning it was asked for.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.conftest import SAMPLE, read_jsonl, run_cmd, torchrun_cmd

pytestmark = pytest.mark.gpu

DPO = ["--model-preset", "tiny", "--data-path", SAMPLE, "--device", "cuda", "--bf16",
       "--seq-length", "128", "--max-prompt-length", "64", "--global-batch-size", "8", "--micro-batch-size", "2",
       "--lr", "1e-3", "--prune-position-ratio", "0.6", "--prune-seq-min-ratio", "0.5", "--prune-branch",
       "--dpo-layout", "shared", "--seed", "1234"]
GRPO = ["--model-preset", "tiny", "--device", "cuda", "--bf16", "--task", "toy", "--toy-num-prompts", "32",
        "--global-batch-size", "16", "--micro-batch-size", "16", "--seq-length", "64", "--group-size", "8",
        "--max-new-tokens", "8", "--lr", "1e-2", "--seed", "1234",
        "--dppo-prompt-prune-rate", "0.3", "--dppo-completion-prune-rate", "0.3", "--dense-packing"]


def _finite_losses(records: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in records] == steps
    assert all(math.isfinite(r["loss"]) for r in records), [r["loss"] for r in records]


def test_dpo_on_cuda_bf16_trains_saves_and_resumes(tmp_path):
    save, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    first = [*DPO, "--train-iters", "2", "--save", str(save), "--save-interval", "2", "--metrics-jsonl", str(metrics)]
    run_cmd(torchrun_cmd(["-m", "megatron_prune.dpo", *first], nproc=1), log=tmp_path / "a.log").check_ok()
    _finite_losses(read_jsonl(metrics), [0, 1])
    resumed = tmp_path / "resumed.jsonl"
    again = [*DPO, "--train-iters", "3", "--load", str(save), "--metrics-jsonl", str(resumed)]
    run_cmd(torchrun_cmd(["-m", "megatron_prune.dpo", *again], nproc=1), log=tmp_path / "b.log").check_ok()
    records = read_jsonl(resumed)
    _finite_losses(records, [2])
    assert records[0]["train_tokens"] < records[0]["policy_tokens"], "branch pruning did not prune the backward"


@pytest.mark.parametrize("extra", [[], ["--kv-cache", "--shared-prompt"]], ids=["packed", "kv-cache-shared-prompt"])
def test_grpo_dppo_on_cuda_bf16_trains(tmp_path, extra):
    metrics = tmp_path / "metrics.jsonl"
    run_cmd(torchrun_cmd(["-m", "megatron_prune.grpo", *GRPO, *extra, "--train-iters", "2",
                          "--metrics-jsonl", str(metrics)], nproc=1), log=tmp_path / "run.log").check_ok()
    records = read_jsonl(metrics)
    _finite_losses(records, [0, 1])
    # Rate 0.3 at the completion level drops about 30 of 128 completions a step (90 kept at this
    # seed on the CPU); that no completion was dropped in either step would mean DPPO never ran.
    assert all(0.0 < r["kept_completion_fraction"] for r in records)
    assert any(r["kept_completion_fraction"] < 1.0 for r in records), [r["kept_completion_fraction"] for r in records]


def test_lora_dpo_on_cuda_bf16_trains(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    args = [*DPO, "--lora-rank", "8", "--train-iters", "2", "--metrics-jsonl", str(metrics)]
    run_cmd(torchrun_cmd(["-m", "megatron_prune.dpo", *args], nproc=1), log=tmp_path / "run.log").check_ok()
    _finite_losses(read_jsonl(metrics), [0, 1])


@pytest.fixture(scope="module")
def dpo_losses_without_recompute(tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("no_recompute")
    metrics = tmp / "metrics.jsonl"
    run_cmd(torchrun_cmd(["-m", "megatron_prune.dpo", *DPO, "--train-iters", "2", "--metrics-jsonl", str(metrics)],
                         nproc=1), log=tmp / "run.log").check_ok()
    return [r["loss"] for r in read_jsonl(metrics)]


@pytest.mark.parametrize(
    "recompute",
    [["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"],
     ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"]],
    ids=["full-block-1", "selective-core_attn-mlp"],
)
def test_dpo_on_cuda_with_recompute_repeats_the_run_without(tmp_path, recompute, dpo_losses_without_recompute):
    # Recompute reruns the same forward (Megatron's CUDA RNG tracker restores dropout's state), so
    # the step-0 loss is the same and step 1 differs at most by the backward's reduction order.
    metrics = tmp_path / "metrics.jsonl"
    run_cmd(torchrun_cmd(["-m", "megatron_prune.dpo", *DPO, *recompute, "--train-iters", "2",
                          "--metrics-jsonl", str(metrics)], nproc=1), log=tmp_path / "run.log").check_ok()
    losses = [r["loss"] for r in read_jsonl(metrics)]
    assert losses == pytest.approx(dpo_losses_without_recompute, rel=1e-3, abs=1e-4)
