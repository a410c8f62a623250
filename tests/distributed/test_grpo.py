"""GRPO step (generation included) is layout independent; DPPO off is plain GRPO; packing changes nothing.

Two launches: one rank for the reference results, four ranks for TP=2 (DP=2), PP=2 (DP=2),
TP=2 x PP=2 and PP=2 x VPP=2 (DP=2), each compared with the single-rank step of the same seed: sampled tokens,
loss and whole gradients (relative to each tensor's scale, as in dpo_harness.assert_same).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.dist import every_rank, run_distributed
from tests.distributed.dpo_harness import assert_metrics_and_grads

pytestmark = pytest.mark.distributed

SEED = 4321
LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "pp2": dict(pipeline_model_parallel_size=2),
    "tp2pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    # interleaved schedule: each pass is padded with placeholder microbatches to a multiple of the
    # stages (a decoding step of a rank's last active sequences, a pruned packed pass: one or three)
    "pp2vpp2": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
}
CASES = {
    "plain": dict(),
    "dppo_packed_kl": dict(dppo=dict(completion_prune_rate=0.5, dense_packing=True), kl_beta=0.1),
}


def grpo_step(*, parallel: dict | None = None, dppo: dict | None = None, kl_beta: float = 0.0,
              no_pruner: bool = False, lora: dict | None = None) -> dict:
    """Metrics, sampled completions and whole gradients of one GRPO step (no optimizer step).
    With ``lora`` the policy trains adapters (set non-zero, so they act) and the KL reference is
    the adapter-off policy."""
    from megatron_prune.config import TrainConfig
    from megatron_prune.grpo.config import DPPOArgs, GRPOConfig
    from megatron_prune.grpo.dppo import KeepDecision
    from megatron_prune.grpo.trainer import build_objective, toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(**(parallel or {}))
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny")
        if lora is None:
            policy = setup_model(arch, par, seed=SEED)
            reference = setup_model(arch, par, seed=SEED + 1, trainable=False) if kl_beta else None
        else:
            from megatron_prune.model.lora import LoRAConfig, adapter_off
            from tests.distributed.test_lora import perturb_adapters

            policy = setup_model(arch, par, seed=SEED, lora=LoRAConfig(**lora))
            perturb_adapters(policy)
            reference = adapter_off(policy) if kl_beta else None
        configs = {
            "TrainConfig": TrainConfig(global_batch_size=4, micro_batch_size=4, seq_length=48, seed=SEED),
            "GRPOConfig": GRPOConfig(group_size=4, max_new_tokens=6, kl_beta=kl_beta),
            "DPPOArgs": DPPOArgs(**(dppo or {})),
        }
        source = toy_source(vocab_size=arch.vocab_size, num_prompts=16, seed=SEED)
        objective = build_objective(configs=configs, arch=arch, policy=policy, reference=reference, source=source)
        if no_pruner:  # plain GRPO: keep everything, no weights drawn at all
            def keep_all(*, step, prompt_ids, advantages=None):
                shape = (len(prompt_ids),) if advantages is None else tuple(advantages.shape)
                return KeepDecision(probs=torch.ones(shape, dtype=torch.float64),
                                    keep=torch.ones(shape, dtype=torch.bool), target_rate=0.0)

            objective.pruner.select_prompts = keep_all
            objective.pruner.select_completions = keep_all
        return train_step_result(objective, policy)


def train_step_result(objective, policy) -> dict:
    """Step 0 of ``objective`` through the trainer: its metrics, the whole gradients and the
    trained items (prompt, completion index, tokens, weight, advantage)."""
    from megatron_prune.model.global_state import gather_global_state

    for chunk in policy:
        chunk.zero_grad_buffer()
    metrics = objective.train_step(0)
    grads = gather_global_state(policy, source="main_grad")
    items = [(it.prompt_id, it.index, tuple(it.completion), it.weight, it.advantage)
             for mb in objective.buffer.minibatches for it in mb]
    return dict(metrics=metrics, grads=grads, items=items)


def _single_rank_all() -> dict:
    out = {name: grpo_step(**case) for name, case in CASES.items()}
    out["plain_no_pruner"] = grpo_step(no_pruner=True)
    out["plain_every_completion"] = grpo_step(dppo=dict(skip_zero_advantage=False))
    out["dppo_unpacked_kl"] = grpo_step(dppo=dict(completion_prune_rate=0.5), kl_beta=0.1)
    return out


def _layouts_all() -> dict:
    return {(layout, name): grpo_step(parallel=par, **case) for layout, par in LAYOUTS.items()
            for name, case in CASES.items()}


@functools.lru_cache(maxsize=1)
def single_rank() -> dict:
    return run_distributed(_single_rank_all, 1)[0]


STEP_METRICS = ("loss", "policy_loss", "kl_loss", "reward_mean", "kept_completion_fraction", "policy_tokens")


def assert_same(ref: dict, got: dict, label: str, *, metrics: tuple[str, ...] = STEP_METRICS, rtol=1e-5,
                atol=1e-7) -> None:
    """Same sampled completions with the same keep weights and advantages, ``metrics`` and every gradient."""
    assert [i[:3] for i in got["items"]] == [i[:3] for i in ref["items"]], f"{label}: sampled completions differ"
    for a, b in zip(got["items"], ref["items"]):
        assert a[3:] == pytest.approx(b[3:], rel=1e-6, abs=1e-7), f"{label}: weight or advantage of {a[:2]}"
    assert_metrics_and_grads(ref, got, label, metrics, rtol=rtol, atol=atol)


def test_dppo_off_is_plain_grpo():
    ref = single_rank()
    plain, off = ref["plain_no_pruner"], ref["plain_every_completion"]
    assert off["items"] == plain["items"]
    assert all(w == 1.0 for *_, w, _ in off["items"]) and len(off["items"]) == 4 * 4
    assert off["metrics"]["loss"] == plain["metrics"]["loss"]
    for key, grad in plain["grads"].items():
        assert torch.equal(off["grads"][key], grad), key


def test_skipping_zero_advantages_is_exact():
    """Without KL (the default skip): the step trains exactly the completions with a nonzero
    advantage, and its loss and every gradient equal the step that trains all of them."""
    ref = single_rank()
    every, skipped = ref["plain_every_completion"], ref["plain"]
    zeros = [item for item in every["items"] if item[-1] == 0.0]
    assert zeros, "the step has no zero-advantage completion: the test would prove nothing"
    assert skipped["items"] == [item for item in every["items"] if item[-1] != 0.0]
    assert skipped["metrics"]["policy_tokens"] < every["metrics"]["policy_tokens"]
    assert_metrics_and_grads(every, skipped, "skip vs every completion", ("loss", "policy_loss", "reward_mean"),
                             rtol=1e-5, atol=1e-7)


def test_packed_equals_unpacked():
    ref = single_rank()
    packed, unpacked = ref["dppo_packed_kl"], ref["dppo_unpacked_kl"]
    assert packed["metrics"]["kept_completion_fraction"] < 1.0  # pruning really happened
    assert 0.0 < packed["metrics"]["density"] <= 1.0
    assert_same(unpacked, packed, "packed vs unpacked")


def test_layouts_equal_single_rank():
    ref = single_rank()
    # every rank returns the metrics and the gathered, complete gradients: all are checked
    for rank, (layout, name), result in every_rank(run_distributed(_layouts_all, 4)):
        assert_same(ref[name], result, f"rank {rank}: {layout}/{name}")


def _rollout_vs_training_logprobs(*, dense_packing: bool) -> dict:
    """Sampling log-probs recorded by the rollout vs the training pass's log-probs of the same
    tokens (selective head, padded or packed rows), at temperature 1 and 0.7 (top-p 1); then one
    SGD step on a batch with one positive- and one negative-advantage completion."""
    from megatron_prune.grpo.loss import GRPOLossConfig
    from megatron_prune.grpo.rollout import SamplingSettings, generate
    from megatron_prune.grpo.step import GRPOStep, GRPOStepSettings, TrainItem
    from megatron_prune.grpo.trainer import toy_source
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    out: dict = {}
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=SEED)
        source = toy_source(vocab_size=arch.vocab_size, num_prompts=8, seed=SEED)
        prompts = [source.get(i) for i in range(3)]
        for temperature in (1.0, 0.7):
            sampling = SamplingSettings(max_new_tokens=7, eos_id=source.eos_id, pad_id=source.pad_id,
                                        vocab_size=arch.vocab_size, seed=SEED, temperature=temperature)
            groups = generate(model=policy, prompts=[(p.prompt_id, p.tokens) for p in prompts], group_size=3,
                              settings=sampling, step=0)
            items = [TrainItem(prompt_id=c.prompt_id, index=c.index, prompt=list(p.tokens), completion=list(c.tokens),
                               advantage=0.0) for p, group in zip(prompts, groups) for c in group]
            settings = GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=4, pad_id=source.pad_id,
                                        dense_packing=dense_packing, pack_capacity=32, temperature=temperature)
            GRPOStep(settings=settings, policy=policy).score(items, which="old")
            sampled = torch.tensor([lp for group in groups for c in group for lp in c.sample_logprobs])
            out[temperature] = (sampled, torch.cat([it.old_logprobs for it in items]))

        if not dense_packing:  # KV-cached generation (Megatron's static inference context) = full recompute
            mixed = [(p.prompt_id, p.tokens) for p in prompts] + [(99, (1, 3, 9, 5, 6))]  # two prompt lengths
            for temperature, top_p in ((1.0, 1.0), (0.8, 0.9)):
                runs = []
                for kv_cache in (False, True):
                    sampling = SamplingSettings(max_new_tokens=7, eos_id=source.eos_id, pad_id=source.pad_id,
                                                vocab_size=arch.vocab_size, seed=SEED, temperature=temperature,
                                                top_p=top_p, kv_cache=kv_cache, micro_batch_size=5)
                    groups = generate(model=policy, prompts=mixed, group_size=3, settings=sampling, step=1)
                    runs.append([(c.tokens, c.sample_logprobs) for group in groups for c in group])
                out[("kv", temperature)] = runs

        # gradient sign: one step along -grad raises the positive-advantage completion's log-probs
        prompt = list(prompts[0].tokens)
        items = [TrainItem(prompt_id=0, index=0, prompt=prompt, completion=[11, 21, 31, 41], advantage=1.0),
                 TrainItem(prompt_id=0, index=1, prompt=prompt, completion=[12, 22, 32, 42], advantage=-1.0)]
        step = GRPOStep(settings=GRPOStepSettings(loss=GRPOLossConfig(), micro_batch_size=2, pad_id=source.pad_id,
                                                  dense_packing=dense_packing, pack_capacity=32), policy=policy)
        step.score(items, which="old")
        before = [it.old_logprobs.clone() for it in items]
        for chunk in policy:
            chunk.zero_grad_buffer()
        step.train(items, normaliser=8.0)
        with torch.no_grad():
            for chunk in policy:
                for param in chunk.parameters():
                    param -= 1e-2 * param.main_grad
        step.score(items, which="old")
        out["delta"] = [(it.advantage, float((it.old_logprobs - b).sum())) for it, b in zip(items, before)]
    return out


def _logprob_checks() -> dict:
    return {packed: _rollout_vs_training_logprobs(dense_packing=packed) for packed in (False, True)}


def test_training_logprobs_match_rollout():
    """Sampling and training log-probs agree to 1e-5 (padded and packed rows, temperature 1 and
    0.7); KV-cached generation gives the full-recompute sampler's tokens; and one step along the GRPO gradient raises the positive-advantage completion's
    log-probs and lowers the negative one's."""
    results = run_distributed(_logprob_checks, 1)[0]
    for packed, got in results.items():
        for temperature in (1.0, 0.7):
            sampled, trained = got[temperature]
            torch.testing.assert_close(trained, sampled, rtol=0, atol=1e-5,
                                       msg=lambda m: f"packed={packed} temperature={temperature}: {m}")
        if not packed:
            for temperature in (1.0, 0.8):
                uncached, cached = got[("kv", temperature)]
                assert [t for t, _ in cached] == [t for t, _ in uncached], f"KV cache changed the tokens (T={temperature})"
                torch.testing.assert_close(torch.tensor([lp for _, lps in cached for lp in lps]),
                                           torch.tensor([lp for _, lps in uncached for lp in lps]), rtol=0, atol=1e-5)
        (up_adv, up), (down_adv, down) = got["delta"]
        assert up_adv > 0 and up > 0, (packed, got["delta"])
        assert down_adv < 0 and down < 0, (packed, got["delta"])
