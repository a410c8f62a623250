"""Shared set-up for DPO tests: a tiny policy/reference pair on bundled HH-RLHF pairs."""

from __future__ import annotations

import contextlib
import functools

import torch

SEED = 4321
NUM_PAIRS = 8
MAX_SEQ = 80


@functools.lru_cache(maxsize=1)
def sample_pairs():
    from megatron_prune.data import HH_RLHF_SAMPLE
    from megatron_prune.data.preference import PreferenceDataConfig, PreferenceDataset
    from megatron_prune.data.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny")
    ds = PreferenceDataset(
        [HH_RLHF_SAMPLE],
        tokenizer=tok,
        config=PreferenceDataConfig(max_seq_length=MAX_SEQ, max_prompt_length=48),
    )
    return [(i, ds[i]) for i in range(NUM_PAIRS)], tok.pad_id


def dpo_grads(
    *,
    parallel: dict | None = None,
    prune: dict | None = None,
    layout: str = "concat",
    micro_batch_size: int = 2,
    reduction: str = "mean",
    step: int = 0,
    reference_seed: int = SEED + 1,
    preset: str = "tiny",
    join=None,
    pack_rows: bool = False,
):
    """Loss metrics and whole gradients of one DPO step (no optimizer step).

    ``join`` (shared layout under branch pruning): None keeps the step's own choice (the pruned
    responses run on the training pass's prompt keys and values where they can); True/False/a
    callable of the sample id turns that off and forces, for every pair or per pair, whether the
    pruned branch runs inside the training row or as its own row. ``pack_rows`` lays each
    microbatch's rows end to end in one row (``--dpo-pack-rows``).
    """
    from megatron.core import parallel_state

    from megatron_prune.config import DPOConfig, PruneConfig
    from megatron_prune.data.sampler import dp_shard
    from megatron_prune.dpo.step import DPOStep, DPOStepSettings
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.global_state import gather_global_state
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model
    from megatron_prune.training.parallel import model_parallel
    from megatron_prune.training.step import reduce_metrics

    samples, pad_id = sample_pairs()
    par = ParallelConfig(**(parallel or {}))
    off = dict(position_ratio=1.0, seq_min_ratio=1.0, branch=False, branch_chosen_prob=0.5, selective_head=True)
    prune_cfg = PruneConfig(**{**off, **(prune or {})})
    with model_parallel(par, seed=SEED):
        arch = get_preset(preset)
        policy = setup_model(arch, par, seed=SEED)
        reference = setup_model(arch, par, seed=reference_seed, trainable=False)
        optimizer = build_optimizer(policy, OptimConfig(optimizer="sgd", lr=0.0), bf16=False)
        settings = DPOStepSettings(
            dpo=DPOConfig(layout=layout, loss_average=reduction, pack_rows=pack_rows), prune=prune_cfg, seed=SEED,
            micro_batch_size=micro_batch_size, pad_id=pad_id, pruned_branch_on_prefix_kv=join is None,
        )
        runner = DPOStep(settings=settings, policy=policy, reference=reference)
        mine = dp_shard(samples, dp_rank=parallel_state.get_data_parallel_rank(),
                        dp_size=parallel_state.get_data_parallel_world_size())
        for chunk in policy:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        with forced_join(join):
            outputs, counters = runner.run(step, mine)
        metrics = reduce_metrics(outputs)
        grads = gather_global_state(policy, source="main_grad")
    return dict(metrics=metrics, counters=counters, grads=grads)


@contextlib.contextmanager
def forced_join(join):
    """Replace the shared layout's per-pair choice (pruned branch in the training row or not)."""
    import megatron_prune.dpo.step as step_mod

    if join is None:
        yield
        return
    original = step_mod.pruned_branch_joins_training_row
    step_mod.pruned_branch_joins_training_row = lambda plan, **kw: join(plan.sample_id) if callable(join) else join
    try:
        yield
    finally:
        step_mod.pruned_branch_joins_training_row = original


def assert_same(ref: dict, got: dict, label: str, *, rtol=1e-5, atol=1e-7) -> None:
    """Metrics and every gradient equal within fp32 tolerance; gradients are compared relative
    to each tensor's own scale (reductions in another order differ by ulps of the largest entry)."""
    assert_metrics_and_grads(ref, got, label, ("loss", "margin", "reward_accuracy", "chosen_reward", "rejected_reward"),
                             rtol=rtol, atol=atol)


def assert_metrics_and_grads(ref: dict, got: dict, label: str, metrics: tuple[str, ...], *, rtol: float,
                             atol: float) -> None:
    """``metrics`` equal within (rtol, atol); every gradient within rtol of its tensor's largest entry."""
    for name in metrics:
        torch.testing.assert_close(got["metrics"][name], ref["metrics"][name], rtol=rtol, atol=atol,
                                   msg=f"{label}: {name}")
    assert_same_tensors(ref, got, label, kinds=("grads",), rtol=rtol, atol=atol, relative_atol=True)


def assert_same_tensors(ref: dict, got: dict, label: str, *, kinds: tuple[str, ...] = ("grads", "params"),
                        rtol: float, atol: float, relative_atol: bool = False) -> None:
    """Whole tensors ``got[kind][key]`` equal ``ref[kind][key]`` (same keys, no NaN left by an
    unfilled shard); ``relative_atol``: atol grows to rtol x the tensor's largest entry. Gradients
    that ``got`` holds as None are skipped only where it says ``grads_sliced`` (the distributed
    optimizer: each DP rank keeps its reduce-scattered slice); any other missing kind fails."""
    for kind in kinds:
        if got[kind] is None:
            assert kind == "grads" and got.get("grads_sliced"), f"{label}: no {kind} collected"
            continue
        assert set(got[kind]) == set(ref[kind]), f"{label}: different {kind} keys"
        for key, expected in ref[kind].items():
            actual = got[kind][key]
            assert not torch.isnan(actual).any(), f"{label}: {kind} {key} has unfilled shards"
            tol = max(atol, rtol * float(expected.abs().max())) if relative_atol else atol
            torch.testing.assert_close(actual, expected, rtol=rtol, atol=tol,
                                       msg=lambda m: f"{label}: {kind} {key}: {m}")
