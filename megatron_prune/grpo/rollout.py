"""Rollout: sample G completions per prompt with the policy in its training layout.

A full-recompute sampler: for every new token the active sequences (right-padded, causal)
run forward-only through Megatron's own schedule, so any TP / PP layout works (the schedule
does the p2p; under the interleaved schedule a decoding step runs placeholder microbatches up to
a multiple of the stages). On the last pipeline stage the logits at each sequence's last
position are gathered over TP, the padded vocabulary columns are dropped, and a token is
drawn with a per-completion ``torch.Generator`` seeded by ``(seed, step, prompt id,
completion index)`` (one float64 uniform per token, inverse CDF over float64
probabilities), so the draws do not depend on rank or layout. The tokens are broadcast
from the last stage to the other stages of the pipeline group; TP ranks compute identical
draws from identical gathered logits.

By default each step recomputes the whole prefix (cost ~ (prompt + new)^2 per token for
attention, linear for the rest): the simple, layout-agnostic baseline. With
``SamplingSettings.kv_cache`` generation runs on Megatron's inference path instead, with prompts
of different lengths in one batch (per rollout microbatch; the sequences are sorted by prompt
length first, so a microbatch holds similar lengths): a ``StaticInferenceContext``, one prefill
of the shortest prompt's length, then one single-token forward per position. Rows whose prompt
is longer are fed their own prompt tokens until their prompt ends ("start at the shortest
prompt"), so every token sits at its true position, the plain causal mask is exact and no
padding is ever attended (Megatron's rotary embedding on the inference path takes positions from
the cache offset, not from ``position_ids``, so left padding would shift them). Under pipeline
parallelism every forward is one forward-only microbatch of Megatron's schedule (the p2p carries
the hidden states), each stage caches its own layers, and the last stage's draws are broadcast
as in the uncached sampler; under the interleaved schedule, which runs microbatches in groups of
one per stage, the batch is split into that many microbatches, each with its own cache. Under
sequence parallelism the cached forwards run with it switched off (a decoding step has one token
per row) and the training passes with it on. The model's self-attention
(:class:`~megatron_prune.model.decode_attention.RotatedKeyCacheSelfAttention`) allocates the cache
on its own device, caches keys with their rotary embedding applied and, with the local layer spec,
lays the cache out for attention per key/value group. Same generators, same draws: in fp32 the
cached and uncached samplers give the same tokens (tests/unit/grpo/test_rollout_cache.py). In bf16
a one-token decoding step and a whole-prefix forward round differently (other matrix shapes), so
near-ties can pick other tokens; training is unaffected (its log-probs are recomputed).

Under expert parallelism the ranks of an expert-parallel group (data-parallel ranks with their
own prompts) must run every MoE forward together. So, only then, the data-parallel ranks agree
before each forward on how many microbatches it runs (the most any rank needs) and keep
stepping until none of them has a row left: a rank whose rows have ended (or that has none)
runs padding rows, and a KV-cached batch is sized for the longest any rank needs. Padding rows
draw nothing, so the tokens stay a pure function of (seed, step, prompt id, completion index).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.utils import unwrap_model

from megatron_prune.sampling import canonical_id
from megatron_prune.training.parallel import expert_parallel_max, schedule_microbatches
from megatron_prune.training.step import run_schedule

__all__ = ["SamplingSettings", "Completion", "generate", "sample_from_logits", "completion_seed"]


@dataclass(kw_only=True)
class SamplingSettings:
    """How completions are sampled."""

    max_new_tokens: int
    """Most tokens generated per completion."""
    eos_id: int
    """Token that ends a completion (it is part of the completion)."""
    stop_ids: frozenset[int] = frozenset()
    """Other tokens that end a completion as ``eos_id`` does (the model's generation config may end
    turns with several)."""
    pad_id: int
    """Padding token of the right-padded rows."""
    vocab_size: int
    """True vocabulary size; logits of the padded columns beyond it are never sampled."""
    seed: int
    """Seed of every draw."""
    temperature: float = 1.0
    """Temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass; 1 = off."""
    micro_batch_size: int | None = None
    """Sequences per forward microbatch (None: all active sequences in one)."""
    pad_multiple: int = 8
    """Row length is padded to a multiple of this (and of TP)."""
    kv_cache: bool = False
    """KV-cached generation on Megatron's inference path (``StaticInferenceContext``): prompts of
    any lengths in one batch per microbatch, one prefill, then one single-token forward per
    position. Any TP / PP layout: under the interleaved schedule a cached forward runs one
    microbatch per stage, each with its own cache."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def ends(self, token: int) -> bool:
        """Whether ``token`` ends a completion."""
        return token == self.eos_id or token in self.stop_ids


@dataclass
class Completion:
    """One sampled completion."""

    prompt_id: Hashable
    """Id of its prompt."""
    index: int
    """j: its index within the prompt's group."""
    tokens: list[int]
    """Sampled token ids (ending with EOS when it stopped early)."""
    sample_logprobs: list[float] = field(default_factory=list)
    """Log-prob of each token under the sampling distribution (temperature, top-p)."""


def completion_seed(*, seed: int, step: int, prompt_id: Hashable, index: int) -> int:
    """63-bit seed of completion ``index`` of ``prompt_id`` at rollout ``step``."""
    key = repr((int(seed), int(step), canonical_id(prompt_id), int(index))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=b"mp.rollout").digest(), "little") >> 1


_SAMPLING_CHUNK_ELEMENTS = 1 << 22  # float64 elements per chunk of rows (32 MiB per temporary)


def sample_from_logits(
    logits: torch.Tensor, generators: Sequence[torch.Generator], *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [n, V]``; return ``(tokens [n], sampling log-probs [n])``.

    Row r draws one float64 uniform from ``generators[r]`` and inverts its CDF. The rows are drawn
    together (in chunks of rows for large vocabularies), each exactly as it would be alone."""
    logits = logits.detach()
    if temperature == 0.0:
        tokens = logits.to(torch.float64).argmax(dim=-1)
        return tokens, torch.zeros(len(tokens), dtype=torch.float32)
    assert len(generators) == logits.shape[0], (len(generators), logits.shape)
    rows = max(1, _SAMPLING_CHUNK_ELEMENTS // max(logits.shape[-1], 1))
    tokens, logprobs = [], []
    for start in range(0, logits.shape[0], rows):
        t, lp = _inverse_cdf_draws(logits[start : start + rows], generators[start : start + rows],
                                   temperature=temperature, top_p=top_p)
        tokens.append(t)
        logprobs.append(lp)
    if not tokens:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32)
    return torch.cat(tokens), torch.cat(logprobs)


def _inverse_cdf_draws(
    logits: torch.Tensor, generators: Sequence[torch.Generator], *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.log_softmax(logits.to(torch.float64) / temperature, dim=-1).exp()
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True, stable=True)
        keep = probs.cumsum(-1) - probs < top_p  # the first token is always kept
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])[:, None] * total
    pick = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
    while True:  # guard against u landing on a zero-width bin at the end
        empty = probs.gather(-1, pick) == 0
        if not empty.any():
            break
        pick -= empty.long()
    chosen = probs.gather(-1, pick)[:, 0].tolist()
    logprobs = [math.log(c / t) for c, t in zip(chosen, total[:, 0].tolist())]
    tokens = order.gather(-1, pick) if order is not None else pick
    return tokens[:, 0].cpu(), torch.tensor(logprobs, dtype=torch.float32)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _logits_forward_step(data_iterator, model, *, vocab_size: int):
    tokens, position_ids, last = next(data_iterator)
    output = model(tokens, position_ids, None)
    return output, partial(_last_position_logits, last=last, vocab_size=vocab_size)


def _last_position_logits(output: torch.Tensor, *, last: torch.Tensor, vocab_size: int):
    """Loss function of the logits pass: full-vocabulary logits at each row's last position."""
    rows = output[torch.arange(output.shape[0], device=output.device), last.to(output.device)]  # [b, V/tp]
    full = gather_from_tensor_model_parallel_region(rows.contiguous())
    return torch.zeros((), device=output.device), {"logits": full[:, :vocab_size].float().cpu()}


def _num_microbatches(num_sequences: int, settings: SamplingSettings) -> int:
    if not num_sequences:
        return 0
    return -(-num_sequences // min(settings.micro_batch_size or num_sequences, num_sequences))


def next_token_logits(
    model: list[torch.nn.Module], sequences: Sequence[Sequence[int]], *, settings: SamplingSettings,
    num_microbatches: int | None = None,
) -> torch.Tensor | None:
    """Logits ``[n, vocab]`` of the next token of each sequence (last stage), None on other stages.
    ``num_microbatches``: run that many (at least what the sequences need), the extra ones of padding
    rows only; ``sequences`` may then be empty."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    length = _round_up(max((len(s) for s in sequences), default=1), math.lcm(settings.pad_multiple, tp))
    mbs = max(min(settings.micro_batch_size or len(sequences), len(sequences)), 1)
    num_micro = max(_num_microbatches(len(sequences), settings), num_microbatches or 0)
    batches = []
    for m in range(num_micro):
        chunk = list(sequences[m * mbs : (m + 1) * mbs])
        real = len(chunk)
        chunk += [[settings.pad_id]] * (mbs - real)  # dummy rows keep every microbatch the same shape
        tokens = torch.full((mbs, length), settings.pad_id, dtype=torch.long)
        for row, seq in enumerate(chunk):
            tokens[row, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        last = torch.tensor([len(seq) - 1 for seq in chunk], dtype=torch.long)
        position_ids = torch.arange(length, dtype=torch.long).expand(mbs, length).contiguous()
        batches.append((tokens, position_ids, last))
    iterators = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
    with torch.no_grad():
        outputs = run_schedule(
            forward_step_func=partial(_logits_forward_step, vocab_size=settings.vocab_size),
            data_iterator=iterators, model=model, num_microbatches=num_micro, seq_length=length,
            micro_batch_size=mbs, forward_only=True,
        )
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([o["logits"] for o in outputs])[: len(sequences)]


def _broadcast_from_last_stage(values: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's ``values`` on every stage (shape and dtype known everywhere)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    dist.broadcast(values, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return values


def generate(
    *,
    model: list[torch.nn.Module],
    prompts: Sequence[tuple[Hashable, Sequence[int]]],
    group_size: int,
    settings: SamplingSettings,
    step: int,
) -> list[list[Completion]]:
    """``group_size`` completions of each ``(prompt_id, prompt tokens)``; identical on every rank of
    the model-parallel group. Collective over that group: every rank must call it with the same
    prompts."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    for prompt_id, tokens in prompts:
        if not tokens:
            raise ValueError(f"prompt {prompt_id!r} is empty; the first completion token has no context")
    completions = [
        Completion(prompt_id=pid, index=j, tokens=[]) for pid, _ in prompts for j in range(group_size)
    ]
    contexts = [list(tokens) for _, tokens in prompts for _ in range(group_size)]
    generators = [
        torch.Generator().manual_seed(completion_seed(seed=settings.seed, step=step, prompt_id=c.prompt_id, index=c.index))
        for c in completions
    ]
    if settings.kv_cache:
        with _sequence_parallel_off(model):
            _generate_cached(model, contexts, completions, generators, settings=settings)
        return [completions[k * group_size : (k + 1) * group_size] for k in range(len(prompts))]
    active = list(range(len(completions)))
    for _ in range(settings.max_new_tokens):
        num_micro = schedule_microbatches(_num_microbatches(len(active), settings))
        if not num_micro:
            break
        logits = next_token_logits(model, [contexts[i] + completions[i].tokens for i in active], settings=settings,
                                   num_microbatches=num_micro)
        if not active:  # padding rows only, run with the other ranks of the expert-parallel group
            continue
        tokens = torch.zeros(len(active), dtype=torch.long)
        logprobs = torch.zeros(len(active), dtype=torch.float32)
        if logits is not None:
            tokens, logprobs = sample_from_logits(
                logits, [generators[i] for i in active], temperature=settings.temperature, top_p=settings.top_p
            )
        tokens = _broadcast_from_last_stage(tokens)
        logprobs = _broadcast_from_last_stage(logprobs)
        for i, token, logprob in zip(active, tokens.tolist(), logprobs.tolist()):
            completions[i].tokens.append(token)
            completions[i].sample_logprobs.append(logprob)
        active = [i for i in active if not settings.ends(completions[i].tokens[-1])]
    return [completions[k * group_size : (k + 1) * group_size] for k in range(len(prompts))]


_SEQUENCE_PARALLEL_FLAGS = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


@contextmanager
def _sequence_parallel_off(model: list[torch.nn.Module]):
    """The model without sequence parallelism while the block runs, as Megatron-Core's inference
    controller switches it (the config and the same per-module flags): a decoding step feeds one
    token per row, which cannot be split over the TP ranks. Column- and row-parallel linears then
    all-reduce instead of gathering and reduce-scattering, which gives the same sums; MoE layers
    outside training accept it too. Every flag gets its own value back afterwards, also on error.
    (Megatron-Core's ``set_model_to_sequence_parallel`` caches the modules by ``id(model)``, which
    a later model can reuse once the first is freed, so the flags are collected here each time.)"""
    chunks = unwrap_model(model)
    config = chunks[0].config
    if not config.sequence_parallel:
        yield
        return
    saved = [(module, flag, module.__dict__[flag]) for chunk in chunks for module in chunk.modules()
             for flag in _SEQUENCE_PARALLEL_FLAGS if flag in module.__dict__]
    config.sequence_parallel = False
    for module, flag, _ in saved:
        setattr(module, flag, False)
    try:
        yield
    finally:
        config.sequence_parallel = True
        for module, flag, value in saved:
            setattr(module, flag, value)


def _cache_parts(model: list[torch.nn.Module]) -> int:
    """Microbatches of one cached forward: one per pipeline stage under the interleaved schedule
    (which runs microbatches in groups of one per stage through each chunk), else one."""
    return parallel_state.get_pipeline_model_parallel_world_size() if len(model) > 1 else 1


def _generate_cached(
    model: list[torch.nn.Module], contexts: list[list[int]], completions: list[Completion],
    generators: list[torch.Generator], *, settings: SamplingSettings,
) -> None:
    """KV-cached sampling: sequences sorted by prompt length, ``micro_batch_size`` of them
    (default: all) per batch."""
    from megatron.core.inference.contexts import StaticInferenceContext

    order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
    mbs = settings.micro_batch_size or max(len(order), 1)
    num_batches = expert_parallel_max(-(-len(order) // mbs))
    was_training = [chunk.training for chunk in model]
    for chunk in model:
        chunk.eval()  # Megatron turns the causal mask off for cached decoding only outside training mode
    try:
        with torch.no_grad():
            for k in range(num_batches):
                _cached_batch(model, order[k * mbs : (k + 1) * mbs], contexts, completions, generators,
                              settings=settings, context_cls=StaticInferenceContext)
    finally:
        for chunk, mode in zip(model, was_training):
            chunk.train(mode)


def _cached_batch(model, rows, contexts, completions, generators, *, settings, context_cls) -> None:
    """One batch from the shortest prompt on: a prefill of ``shortest`` tokens, then one token per
    forward for every row — a prompt token while the row's prompt lasts, a sampled token after it,
    padding (read by nothing) once the row has ended.

    Under expert parallelism (``rows`` may then be empty: one padding row runs) the batch keeps
    stepping until every data-parallel rank's batch has ended, its cache sized for the most
    forwards any of them needs. Under the interleaved schedule the batch is split into one
    microbatch per stage, each with its own cache, padding rows filling the last."""
    prompts = [contexts[i] for i in rows] or [[settings.pad_id]]
    shortest = min(len(p) for p in prompts)
    # A row of length L samples at forwards L - shortest ... L - shortest + max_new_tokens - 1.
    forwards = expert_parallel_max(max(len(p) for p in prompts) - shortest + settings.max_new_tokens)
    parts = _cache_parts(model)
    size = -(-len(prompts) // parts)
    prompts += [[settings.pad_id] * shortest] * (size * parts - len(prompts))
    b = len(prompts)
    lengths = [len(p) for p in prompts]
    caches = [context_cls(size, shortest + forwards) for _ in range(parts)]
    tokens = torch.tensor([p[:shortest] for p in prompts], dtype=torch.long)
    position_ids = torch.arange(shortest, dtype=torch.long).expand(b, shortest).contiguous()
    done = [r >= len(rows) for r in range(b)]  # padding rows draw nothing
    fed = shortest  # tokens of each row in the cache once this forward has run
    while True:
        logits = _cached_forward(model, tokens, position_ids, caches)  # None off the last pipeline stage
        for context in caches:
            context.sequence_len_offset += tokens.shape[1]
            context.enable_decode_mode()  # after the prefill every forward is one token
        next_tokens = torch.full((b,), settings.pad_id, dtype=torch.long)
        sampling = [r for r in range(b) if not done[r] and fed >= lengths[r]]
        for r in range(b):
            if fed < lengths[r]:
                next_tokens[r] = prompts[r][fed]
        if sampling:
            drawn = torch.zeros(len(sampling), dtype=torch.long)
            logprobs = torch.zeros(len(sampling), dtype=torch.float32)
            if logits is not None:
                # Sampled on the CPU, as the uncached path does: the same logits draw the same tokens on any device.
                last = logits[sampling, -1, : settings.vocab_size].float().cpu()
                drawn, logprobs = sample_from_logits(last, [generators[rows[r]] for r in sampling],
                                                     temperature=settings.temperature, top_p=settings.top_p)
            drawn, logprobs = _broadcast_from_last_stage(drawn), _broadcast_from_last_stage(logprobs)
            for r, token, logprob in zip(sampling, drawn.tolist(), logprobs.tolist()):
                completion = completions[rows[r]]
                completion.tokens.append(token)
                completion.sample_logprobs.append(logprob)
                next_tokens[r] = token
                done[r] = settings.ends(token) or len(completion.tokens) == settings.max_new_tokens
        if not expert_parallel_max(int(not all(done))):
            break
        tokens = next_tokens[:, None]
        position_ids = torch.full((b, 1), fed, dtype=torch.long)
        fed += 1


def _cached_forward(model: list[torch.nn.Module], tokens: torch.Tensor, position_ids: torch.Tensor,
                    caches: list) -> torch.Tensor | None:
    """One forward of a cached batch: logits ``[b, s, V]`` on the last pipeline stage, None elsewhere.

    Under pipeline parallelism it runs as forward-only microbatches of Megatron's schedule, one
    per cache (the rows split evenly between them), which sends the hidden states from stage to
    stage; each stage keeps its own layers' keys and values in its copy of each cache (the same
    offsets on every stage; under the interleaved schedule each chunk's layers, by their global
    layer numbers).
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return model[0](tokens, position_ids, None, inference_context=caches[0], runtime_gather_output=True)
    size = tokens.shape[0] // len(caches)
    microbatches = [(tokens[k * size : (k + 1) * size], position_ids[k * size : (k + 1) * size], cache)
                    for k, cache in enumerate(caches)]

    def forward_step(data_iterator, chunk):
        tokens, position_ids, cache = next(data_iterator)
        output = chunk(tokens, position_ids, None, inference_context=cache, runtime_gather_output=True)
        return output, lambda logits: (torch.zeros((), device=logits.device), {"logits": logits})

    iterators = [iter(microbatches) for _ in model] if len(model) > 1 else iter(microbatches)
    outputs = run_schedule(forward_step_func=forward_step, data_iterator=iterators, model=model,
                           num_microbatches=len(caches), seq_length=tokens.shape[1], micro_batch_size=size,
                           forward_only=True)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([o["logits"] for o in outputs])

