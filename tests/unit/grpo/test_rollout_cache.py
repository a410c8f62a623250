"""KV-cached generation batches prompts of different lengths and gives the uncached sampler's tokens.

The reference is the full-recompute sampler (every token recomputes the whole right-padded prefix
through Megatron's schedule); the cached sampler runs Megatron's static inference context with all
prompt lengths in one batch ("start at the shortest prompt"). Greedy and sampled (temperature,
top-p) draws, with and without rollout microbatches, at one rank, TP=2, PP=2, PP=2 x VPP=2,
TP=2 x PP=2, and with sequence parallelism (TP=2 + SP, TP=2 + SP x PP=2).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_distributed

SEED = 2468
# Prompt lengths 3..11, unsorted, with repeats: one batch mixes all of them.
PROMPTS = [(0, (1, 3, 9)), (1, (1, 40, 77, 3, 5)), (2, (1, 3, 6)), (3, (1, 8, 200, 31, 99, 17, 3, 7)),
           (4, (1, 11, 12, 13, 14, 15, 16, 17, 18, 3, 8)), (5, (1, 60, 3, 4))]


def _sample_all(tp: int = 1, pp: int = 1, vpp: int | None = None, sp: bool = False, cases=((0.0, 1.0), (1.0, 1.0), (0.8, 0.9)),
                micro_batches=(None, 7)) -> dict:
    from megatron_prune.grpo import rollout
    from megatron_prune.grpo.rollout import SamplingSettings, generate
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sp)
    out: dict = {}
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=SEED)
        calls: list[int] = []
        original = rollout._cached_batch

        def counting(model, rows, *args, **kwargs):
            calls.append(len(rows))
            return original(model, rows, *args, **kwargs)

        rollout._cached_batch = counting
        try:
            for temperature, top_p in cases:
                for mbs in micro_batches:
                    runs = {}
                    for kv_cache in (False, True):
                        calls.clear()
                        sampling = SamplingSettings(max_new_tokens=6, eos_id=2, pad_id=0, vocab_size=arch.vocab_size,
                                                    seed=SEED, temperature=temperature, top_p=top_p,
                                                    kv_cache=kv_cache, micro_batch_size=mbs)
                        groups = generate(model=policy, prompts=PROMPTS, group_size=3, settings=sampling, step=5)
                        runs[kv_cache] = ([[c.tokens for c in g] for g in groups],
                                          [[c.sample_logprobs for c in g] for g in groups], list(calls))
                    out[(temperature, top_p, mbs)] = runs
        finally:
            rollout._cached_batch = original
        if sp:  # the cached sampler switched sequence parallelism off for its forwards, then back on
            linears = [m for m in policy[0].modules() if hasattr(m, "sequence_parallel")]
            assert linears and policy[0].config.sequence_parallel
            assert all(m.sequence_parallel for m in linears), "sequence parallelism not restored"
    return out


def _check(results: dict) -> None:
    for (temperature, top_p, mbs), runs in results.items():
        label = f"T={temperature} top_p={top_p} mbs={mbs}"
        (plain_tokens, plain_lps, _), (cached_tokens, cached_lps, batches) = runs[False], runs[True]
        assert cached_tokens == plain_tokens, label
        assert all(len(c) == 6 or c[-1] == 2 for g in cached_tokens for c in g), label
        torch.testing.assert_close(torch.tensor([lp for g in cached_lps for c in g for lp in c]),
                                   torch.tensor([lp for g in plain_lps for c in g for lp in c]), rtol=0, atol=1e-5)
        n = len(PROMPTS) * 3  # 18 sequences of 6 prompt lengths
        assert len(cached_tokens) * 3 == n
        assert batches == ([n] if mbs is None else [7, 7, 4]), f"{label}: one batch per microbatch, got {batches}"


def test_mixed_length_cached_batches_give_the_uncached_tokens():
    results = run_distributed(_sample_all, 1)[0]
    _check(results)
    greedy = results[(0.0, 1.0, None)][True][0]
    sampled = results[(1.0, 1.0, None)][True][0]
    assert all(len({tuple(c) for c in g}) == 1 for g in greedy)  # greedy: a group is one completion
    assert any(len({tuple(c) for c in g}) > 1 for g in sampled)  # sampling: it is not


def _sample_to_eos() -> dict:
    """Sampled completions with an EOS no draw can give (every one runs to max_new_tokens), then with
    a frequent token as EOS, uncached and cached, in one batch and in microbatches."""
    from collections import Counter

    from megatron_prune.grpo.rollout import SamplingSettings, generate
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model
    from megatron_prune.training.parallel import model_parallel

    par = ParallelConfig()
    with model_parallel(par, seed=SEED):
        arch = get_preset("tiny")
        policy = setup_model(arch, par, seed=SEED)

        def run(eos_id: int, kv_cache: bool, mbs: int | None, stop_ids: frozenset = frozenset()) -> list:
            sampling = SamplingSettings(max_new_tokens=6, eos_id=eos_id, pad_id=0, vocab_size=arch.vocab_size,
                                        seed=SEED, temperature=1.0, kv_cache=kv_cache, micro_batch_size=mbs,
                                        stop_ids=stop_ids)
            groups = generate(model=policy, prompts=PROMPTS, group_size=3, settings=sampling, step=5)
            return [(c.tokens, c.sample_logprobs) for g in groups for c in g]

        free = run(arch.vocab_size, False, None)  # token ids are < vocab_size: nothing ends early
        eos = Counter(t for tokens, _ in free for t in tokens[:5]).most_common(1)[0][0]
        runs = {(kv, mbs): run(eos, kv, mbs) for kv in (False, True) for mbs in (None, 7)}
        # the same token as one of the generation config's end-of-turn ids, eos being another one
        runs.update({("stop id", kv): run(arch.vocab_size, kv, None, frozenset({eos})) for kv in (False, True)})
        return {"free": free, "eos": eos, "runs": runs}


def test_completions_end_at_their_first_eos_cached_or_not():
    """A completion ends with its first EOS (or other stop id): with the same seeds it is the EOS-free
    completion cut after its first EOS (each completion's draws depend only on its own tokens and
    generator)."""
    out = run_distributed(_sample_to_eos, 1)[0]
    eos = out["eos"]

    def cut(tokens, logprobs):
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        return tokens[:end], logprobs[:end]

    assert all(len(tokens) == 6 for tokens, _ in out["free"])
    expected = [cut(*c) for c in out["free"]]
    assert any(len(t) < 6 for t, _ in expected) and any(len(t) == 6 for t, _ in expected)
    for (kv_cache, mbs), got in out["runs"].items():
        label = f"{kv_cache} {mbs}"
        assert [t for t, _ in got] == [t for t, _ in expected], label
        torch.testing.assert_close(torch.tensor([lp for _, lps in got for lp in lps]),
                                   torch.tensor([lp for _, lps in expected for lp in lps]), rtol=0, atol=1e-5)


def _tiny_policy_and_settings():
    from megatron_prune.grpo.rollout import SamplingSettings
    from megatron_prune.model.arch import get_preset
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.model_setup import setup_model

    arch = get_preset("tiny")
    policy = setup_model(arch, ParallelConfig(), seed=SEED)

    def settings(kv_cache: bool) -> SamplingSettings:
        return SamplingSettings(max_new_tokens=3, eos_id=2, pad_id=0, vocab_size=arch.vocab_size, seed=SEED,
                                kv_cache=kv_cache)

    return policy, settings


def _modes_after_cached_generation() -> dict:
    """The training flags of the model's modules after cached generation from a model in training
    mode, then from one in eval mode."""
    from megatron_prune.grpo.rollout import generate
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel

    out = {}
    with model_parallel(ParallelConfig(), seed=SEED):
        policy, settings = _tiny_policy_and_settings()
        for mode in (True, False):
            for chunk in policy:
                chunk.train(mode)
            generate(model=policy, prompts=PROMPTS[:2], group_size=2, settings=settings(True), step=0)
            out[mode] = {m.training for chunk in policy for m in chunk.modules()}
    return out


def test_cached_generation_gives_the_model_its_mode_back():
    """The cached sampler decodes in eval mode (Megatron's inference path needs it), then puts every
    module back in the mode it found it in: the training passes that follow run in training mode
    (dropout, MoE router losses), and a model in eval mode stays in eval mode."""
    out = run_distributed(_modes_after_cached_generation, 1)[0]
    assert out[True] == {True}
    assert out[False] == {False}


def _generate_from_an_empty_prompt() -> None:
    from megatron_prune.grpo.rollout import generate
    from megatron_prune.model.provider import ParallelConfig
    from megatron_prune.training.parallel import model_parallel

    with model_parallel(ParallelConfig(), seed=SEED):
        policy, settings = _tiny_policy_and_settings()
        for kv_cache in (False, True):
            with pytest.raises(ValueError, match="prompt 0 is empty"):
                generate(model=policy, prompts=[(0, ()), (1, (1, 5))], group_size=1, settings=settings(kv_cache),
                         step=0)


def test_an_empty_prompt_is_refused_cached_or_not():
    """A prompt without tokens gives its first completion token no context: a ValueError naming the
    prompt, with or without the KV cache (checked on the rank)."""
    run_distributed(_generate_from_an_empty_prompt, 1)


@pytest.mark.distributed
def test_mixed_length_cached_batches_under_tensor_parallelism():
    """TP = 2 (vocabulary-parallel logits gathered on the inference path): same tokens as the
    uncached sampler of the same layout, on both ranks."""
    results = run_distributed(_sample_all, 2, tp=2, cases=((0.0, 1.0), (1.0, 1.0)), micro_batches=(None,))
    for rank_results in results:
        _check(rank_results)
    assert results[0] == results[1]


@pytest.mark.distributed
def test_mixed_length_cached_batches_under_pipeline_parallelism():
    """PP = 2, PP = 2 x VPP = 2 and TP = 2 x PP = 2: every cached forward runs through the schedule,
    each stage caching its own layers (under the interleaved schedule: two microbatches of a
    batch, each with its own cache, the odd batch of 7 rows padded to 8); the same tokens and
    log-probs as the uncached sampler of the same layout, and as one rank, on every rank."""
    single = run_distributed(_sample_all, 1, cases=((0.0, 1.0), (0.8, 0.9)))[0]
    for nproc, layout in ((2, dict(pp=2)), (2, dict(pp=2, vpp=2)), (4, dict(tp=2, pp=2))):
        results = run_distributed(_sample_all, nproc, cases=((0.0, 1.0), (0.8, 0.9)), **layout)
        for rank, rank_results in enumerate(results):
            _check(rank_results)
            assert rank_results == results[0], f"{layout}: rank {rank} differs from rank 0"
            for key, runs in rank_results.items():
                tokens, logprobs, batches = runs[True]
                (want_tokens, want_logprobs, _), want_batches = single[key][False], single[key][True][2]
                assert (tokens, batches) == (want_tokens, want_batches), f"{layout} rank {rank} {key}"
                torch.testing.assert_close(torch.tensor([lp for g in logprobs for c in g for lp in c]),
                                           torch.tensor([lp for g in want_logprobs for c in g for lp in c]),
                                           rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_mixed_length_cached_batches_under_sequence_parallelism():
    """TP = 2 + SP and TP = 2 + SP x PP = 2: the cached forwards run with sequence parallelism
    switched off (a decoding step has one token per row) and switched back on afterwards; the
    same tokens and log-probs as one rank's uncached sampler, on every rank."""
    single = run_distributed(_sample_all, 1, cases=((0.0, 1.0), (0.8, 0.9)), micro_batches=(7,))[0]
    for nproc, layout in ((2, dict(tp=2, sp=True)), (4, dict(tp=2, pp=2, sp=True))):
        results = run_distributed(_sample_all, nproc, cases=((0.0, 1.0), (0.8, 0.9)), micro_batches=(7,), **layout)
        for rank, rank_results in enumerate(results):
            _check(rank_results)
            for key, runs in rank_results.items():
                tokens, logprobs, _ = runs[True]
                want_tokens, want_logprobs, _ = single[key][False]
                assert tokens == want_tokens, f"{layout} rank {rank} {key}"
                torch.testing.assert_close(torch.tensor([lp for g in logprobs for c in g for lp in c]),
                                           torch.tensor([lp for g in want_logprobs for c in g for lp in c]),
                                           rtol=0, atol=1e-5)


def test_cli_accepts_kv_cache_under_pipeline_and_sequence_parallelism(monkeypatch):
    from megatron_prune.grpo.__main__ import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    base = ["--model-preset", "tiny", "--device", "cpu", "--task", "toy", "--global-batch-size", "4",
            "--micro-batch-size", "4", "--kv-cache", "--dry-run"]
    for layout in (["--pipeline-model-parallel-size", "2"],
                   ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
                   ["--tensor-model-parallel-size", "2", "--sequence-parallel"]):
        assert main(base + layout) == 0, layout
