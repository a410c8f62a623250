"""The metrics a GRPO rollout logs."""

from __future__ import annotations

import torch

from megatron_prune.grpo.trainer import rollout_metrics


def test_fractions_log_as_the_fractions_they_are():
    """Float32 rewards averaged in float32 logged 0.05 as 0.05000000074505806 and 4/5 as
    0.800000011920929; the logged means are the exact fractions."""
    rewards = torch.zeros(5, 4)  # 5 groups of 4, float32 as the reward functions return them
    rewards[0, 0] = 1.0  # one mixed group: 4 of 5 groups have equal rewards
    completions = {k: [[7] * (k + 1)] * 4 for k in range(5)}
    got = rollout_metrics(group_size=4, rewards=rewards, num_prompts=8, kept_prompts=5,
                          minibatches=[[None] * 3, [None] * 2], completions=completions)
    assert got["reward_mean"] == 0.05 and got["accuracy"] == 0.05
    assert got["zero_variance_groups"] == 0.8
    assert got["kept_prompt_fraction"] == 5 / 8 and got["kept_completion_fraction"] == 5 / 20
    assert got["completion_length"] == 3.0 and got["rollout_tokens"] == 60.0


def test_an_empty_rollout_logs_zeros():
    got = rollout_metrics(group_size=4, rewards=torch.zeros(0, 4), num_prompts=8, kept_prompts=0,
                          minibatches=[], completions={})
    assert got == {"reward_mean": 0.0, "accuracy": 0.0, "kept_prompt_fraction": 0.0, "kept_completion_fraction": 0.0,
                   "zero_variance_groups": 0.0, "completion_length": 0.0, "clipped_completions": 0.0,
                   "rollout_tokens": 0.0}


def test_a_completion_without_an_ending_token_is_clipped():
    """A completion is clipped where it ends in none of ``ends`` (eos or another stop id): cut by
    --max-new-tokens. An empty one (a zero budget) is clipped too."""
    completions = {0: [[5, 2], [5, 5], [9, 1]], 1: [[5, 5], [], [2]]}
    got = rollout_metrics(group_size=3, rewards=torch.zeros(2, 3), num_prompts=2, kept_prompts=2,
                          minibatches=[], completions=completions, ends=frozenset({1, 2}))
    assert got["clipped_completions"] == 3 / 6


def test_accuracy_counts_only_fully_correct_completions():
    """Partial credit (a toy task's fractional rewards) raises the mean reward, not the accuracy:
    only a reward of 1 is a correct completion."""
    rewards = torch.tensor([[1.0, 0.5, 0.25, 0.0], [0.75, 0.0, 0.0, 1.0]])
    got = rollout_metrics(group_size=4, rewards=rewards, num_prompts=2, kept_prompts=2, minibatches=[],
                          completions={})
    assert got["accuracy"] == 2 / 8
    assert got["reward_mean"] == 3.5 / 8


def _rollout_with_a_stop_id() -> dict:
    """One GRPO step of the tiny model on the toy task whose source ends completions at a frequent
    token besides eos (as a generation config's end-of-turn id does): the completions the step
    rolled out and its metrics."""
    from collections import Counter

    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo import trainer
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.rollout import generate
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    with model_parallel(par, seed=3):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=3)
        toy = trainer.toy_source(vocab_size=arch.vocab_size, num_prompts=8, seed=3)
        configs = {"TrainConfig": TrainConfig(global_batch_size=8, micro_batch_size=8, seq_length=32, seed=3),
                   "GRPOConfig": GRPOConfig(group_size=4, max_new_tokens=8, temperature=0.3, top_p=0.5),
                   "DPPOArgs": DPPOArgs()}
        plain = trainer.build_objective(configs=configs, arch=arch, policy=policy, reference=None, source=toy)
        groups = generate(model=policy, prompts=[(i, toy.get(i).tokens) for i in range(8)], group_size=4,
                          settings=plain.sampling, step=0)
        stop = Counter(t for g in groups for c in g for t in c.tokens[:-1]).most_common(1)[0][0]
        source = trainer.PromptSource(size=8, get=toy.get, score=toy.score, eos_id=toy.eos_id, pad_id=toy.pad_id,
                                      stop_ids=frozenset({stop}))
        objective = trainer.build_objective(configs=configs, arch=arch, policy=policy, reference=None,
                                            source=source)
        rolled: list[list[int]] = []
        original = trainer.generate

        def recording(**kwargs):
            out = original(**kwargs)
            rolled.extend(c.tokens for g in out for c in g)
            return out

        trainer.generate = recording
        try:
            metrics = objective.train_step(0)
        finally:
            trainer.generate = original
        return {"stop": stop, "eos": toy.eos_id, "completions": rolled, "metrics": metrics}


def test_a_completion_ended_by_a_stop_id_is_not_clipped():
    """The trainer's clipped_completions counts the completions that ran out of --max-new-tokens: one
    that ended at a generation-config stop id (not eos) ended, and is not clipped."""
    from tests.dist import run_distributed

    out = run_distributed(_rollout_with_a_stop_id, 1)[0]
    stop, completions = out["stop"], out["completions"]
    assert len(completions) == 32
    ended_at_stop = sum(c[-1] == stop for c in completions)
    assert ended_at_stop > 0  # else the check below cannot tell the stop id from a clipped end
    assert all(stop not in c[:-1] for c in completions)  # the stop id ends a completion
    clipped = [c for c in completions if c[-1] not in (stop, out["eos"])]
    assert all(len(c) == 8 for c in clipped)
    assert out["metrics"]["clipped_completions"] == len(clipped) / 32
