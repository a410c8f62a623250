"""What a DPO step and a held-out evaluation report, against an independent plain-PyTorch reference.

- Branch pruning (q_w = 0.3, so the kept branch's gradient carries a weight 1/q ≠ 2): the reported
  loss, margin, rewards and reward accuracy are the unweighted ones of the unpruned objective, in
  the concat layout (pruned branch in its own forward-only pass) and the shared layout (on the
  training pass's prompt keys and values).
- Data parallelism with several microbatches per rank: the training step's and the held-out
  evaluation's metrics are means over every pair of the global batch (reward accuracy: the
  fraction of pairs ranked right, a tie counting half), not over ranks or microbatches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_distributed
from tests.distributed import dpo_reference as R
from tests.distributed.dpo_harness import SEED, sample_pairs

BETA = 0.6
PRUNE_OFF = dict(position_ratio=1.0, seq_min_ratio=1.0, branch=False, branch_chosen_prob=0.5, selective_head=True)


def _expected(policy, reference, pairs, vocab_size: int) -> dict:
    """Per-pair means written out here from the reference log-ratios."""
    with torch.no_grad():
        chosen, rejected = R.pair_log_ratios(policy[0], reference[0], pairs, vocab_size=vocab_size, reduction="mean")
    chosen, rejected = chosen.double(), rejected.double()
    margins = BETA * (chosen - rejected)
    right = sum(1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margins.tolist())
    return dict(loss=float(-F.logsigmoid(margins).mean()), margin=float(margins.mean()),
                chosen_reward=float(BETA * chosen.mean()), rejected_reward=float(BETA * rejected.mean()),
                reward_accuracy=right / len(pairs), min_abs_margin=float(margins.abs().min()),
                positive=int((margins > 0).sum()))


def _settings(*, layout: str, micro_batch_size: int, **prune):
    from megatron_prune.config import DPOConfig, PruneConfig
    from megatron_prune.dpo.step import DPOStepSettings

    _, pad_id = sample_pairs()
    return DPOStepSettings(dpo=DPOConfig(layout=layout, beta=BETA), prune=PruneConfig(**{**PRUNE_OFF, **prune}),
                           seed=SEED, micro_batch_size=micro_batch_size, pad_id=pad_id)


def _models():
    from megatron_prune.model.arch import get_preset
    from megatron_prune.training.model_setup import setup_model

    arch = get_preset("tiny")
    from megatron_prune.model.provider import ParallelConfig

    policy = setup_model(arch, ParallelConfig(), seed=SEED)
    reference = setup_model(arch, ParallelConfig(), seed=SEED + 1, trainable=False)
    return arch, policy, reference


def branch_metrics() -> dict:
    from megatron_prune.dpo.step import DPOStep
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics

    samples, _ = sample_pairs()
    out = {}
    with model_parallel(ParallelConfig(), seed=SEED):
        arch, policy, reference = _models()
        out["expected"] = _expected(policy, reference, [p for _, p in samples], arch.vocab_size)
        for layout in ("concat", "shared"):
            for step in (0, 1):  # two draws of the kept branches
                runner = DPOStep(settings=_settings(layout=layout, micro_batch_size=2, branch=True,
                                                    branch_chosen_prob=0.3),
                                 policy=policy, reference=reference)
                for chunk in policy:
                    chunk.zero_grad_buffer()
                plans = runner.plan(step, samples)
                outputs, _ = runner.run(step, samples)
                out[(layout, step)] = dict(metrics=reduce_metrics(outputs),
                                           kept_chosen=sum(p.kept_branch == 0 for p in plans))
    return out


@pytest.mark.distributed
def test_branch_pruning_reports_the_unweighted_metrics():
    res = run_distributed(branch_metrics, 1)[0]
    want = res["expected"]
    assert want["min_abs_margin"] > 1e-4 and 0 < want["positive"] < 8, want  # signs are not rounding noise
    for key, got in res.items():
        if key == "expected":
            continue
        assert 0 < got["kept_chosen"] < 8, f"{key}: every pair kept the same branch"
        for name in ("loss", "margin", "chosen_reward", "rejected_reward"):
            assert got["metrics"][name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), f"{key}: {name}"
        assert got["metrics"]["reward_accuracy"] == want["reward_accuracy"], key


def data_parallel_metrics() -> dict:
    from megatron.core import parallel_state

    from megatron_prune.config import TrainConfig
    from megatron_prune.data.sampler import dp_shard
    from megatron_prune.dpo.step import DPOStep
    from megatron_prune.dpo.trainer import DPOObjective
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics

    samples, _ = sample_pairs()
    pairs = [p for _, p in samples]
    with model_parallel(ParallelConfig(), seed=SEED):
        assert parallel_state.get_data_parallel_world_size() == 2
        arch, policy, reference = _models()
        expected = _expected(policy, reference, pairs, arch.vocab_size)
        runner = DPOStep(settings=_settings(layout="concat", micro_batch_size=1), policy=policy, reference=reference)
        mine = dp_shard(samples, dp_rank=parallel_state.get_data_parallel_rank(), dp_size=2)
        for chunk in policy:
            chunk.zero_grad_buffer()
        outputs, _ = runner.run(0, mine)
        train = reduce_metrics(outputs)
        microbatches = len(outputs)
        objective = DPOObjective(
            dataset=pairs, eval_dataset=pairs, runner=runner,
            eval_runner=DPOStep(settings=_settings(layout="concat", micro_batch_size=1), policy=policy,
                                reference=reference),
            train_cfg=TrainConfig(global_batch_size=len(pairs), micro_batch_size=1, seed=SEED),
            eval_pairs=len(pairs))
        held_out = objective.evaluate(0)
    return dict(expected=expected, train=train, eval=held_out, microbatches=microbatches)


@pytest.mark.distributed
def test_data_parallel_metrics_are_means_over_every_pair():
    for rank, got in enumerate(run_distributed(data_parallel_metrics, 2)):
        want = got["expected"]
        assert got["microbatches"] == 4, rank
        assert got["eval"]["pairs"] == 8.0, rank
        for which in ("train", "eval"):
            for name in ("loss", "margin", "chosen_reward", "rejected_reward"):
                assert got[which][name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), f"rank {rank} {which} {name}"
            assert got[which]["reward_accuracy"] == want["reward_accuracy"], (rank, which)
