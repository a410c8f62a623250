"""The rollout sampler draws the same tokens and log-probs as a plain one-row-at-a-time reference.

``sample_from_logits`` draws every row of a decoding step together (and, for large vocabularies,
in chunks of rows). The reference below draws each row on its own, in float64, with the same
rule: one uniform from the row's own generator, scaled by the total mass, inverted through the
cumulative distribution (of the top-p nucleus when ``top_p < 1``). Equality is exact: the rows'
draws must not depend on how many rows share a call, or layouts and resumed runs would disagree.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_prune.grpo import rollout
from megatron_prune.grpo.rollout import completion_seed, sample_from_logits


def reference_draw(row: torch.Tensor, generator: torch.Generator, *, temperature: float, top_p: float):
    logp = torch.log_softmax(row.to(torch.float64) / temperature, dim=-1)
    probs = logp.exp()
    order = torch.arange(len(probs))
    if top_p < 1.0:
        probs, order = probs.sort(descending=True, stable=True)
        before = probs.cumsum(0) - probs
        probs = torch.where(before < top_p, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    pick = min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)
    while probs[pick] == 0:
        pick -= 1
    return int(order[pick]), math.log(probs[pick].item() / cdf[-1].item())


def generators(count: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(completion_seed(seed=seed, step=3, prompt_id=("p", i // 4), index=i % 4))
            for i in range(count)]


def awkward_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Random logits of mixed sharpness, plus a one-hot row, a row with half the vocabulary at -inf
    and a flat row."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * 8
    logits[0] = -math.inf
    logits[0, vocab - 1] = 0.0
    logits[1, vocab // 2 :] = -math.inf
    logits[2] = 0.0
    return logits


@pytest.mark.parametrize("vocab", [5, 300])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (1.3, 0.3)])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_batched_draws_equal_one_row_at_a_time(vocab, temperature, top_p, chunk_rows, monkeypatch):
    if chunk_rows is not None:  # force several chunks of rows, the last one short
        monkeypatch.setattr(rollout, "_SAMPLING_CHUNK_ELEMENTS", chunk_rows * vocab)
    rows = 23
    logits = awkward_logits(rows, vocab, seed=vocab)
    tokens, logprobs = sample_from_logits(logits, generators(rows, seed=7), temperature=temperature, top_p=top_p)
    expected = [reference_draw(row, g, temperature=temperature, top_p=top_p)
                for row, g in zip(logits, generators(rows, seed=7))]
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    assert tokens.tolist() == [t for t, _ in expected]
    assert torch.equal(logprobs, torch.tensor([lp for _, lp in expected], dtype=torch.float32))
    assert tokens[0] == vocab - 1 and logprobs[0] == 0.0  # the one-hot row
    assert tokens[1] < vocab // 2  # never a token at -inf


def test_a_rows_draw_does_not_depend_on_the_rows_beside_it():
    logits = awkward_logits(12, 50, seed=1)
    together = sample_from_logits(logits, generators(12, seed=2), temperature=1.0, top_p=0.95)
    alone = [sample_from_logits(logits[i : i + 1], generators(12, seed=2)[i : i + 1], temperature=1.0, top_p=0.95)
             for i in range(12)]
    assert together[0].tolist() == [int(t) for t, _ in alone]
    assert torch.equal(together[1], torch.cat([lp for _, lp in alone]))


def test_greedy_and_empty_batches():
    logits = awkward_logits(6, 9, seed=4)
    tokens, logprobs = sample_from_logits(logits, generators(6, seed=0), temperature=0.0, top_p=1.0)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist() and not logprobs.any()
    tokens, logprobs = sample_from_logits(torch.zeros(0, 9), [], temperature=1.0, top_p=1.0)
    assert tokens.shape == (0,) and logprobs.shape == (0,)


def test_completion_seeds_depend_on_the_prompt_ids_value_not_its_type():
    np = pytest.importorskip("numpy")
    seeds = {completion_seed(seed=1, step=2, prompt_id=prompt_id, index=3)
             for prompt_id in (5, np.int64(5), torch.tensor(5))}
    assert len(seeds) == 1
    assert completion_seed(seed=1, step=2, prompt_id=6, index=3) not in seeds
    with pytest.raises(ValueError, match="ints, strings or tuples"):
        completion_seed(seed=1, step=2, prompt_id=5.0, index=3)


def test_each_rollout_step_draws_afresh():
    """A completion's seed depends on the rollout step: a prompt rolled out again (at another step,
    with the same policy) gets new draws, not a replay of its earlier completions."""
    seeds = {completion_seed(seed=1, step=step, prompt_id=7, index=j) for step in range(4) for j in range(8)}
    assert len(seeds) == 4 * 8
    logits = torch.zeros(8, 50)  # a policy that did not change between the steps

    def draws(step: int) -> list[int]:
        gens = [torch.Generator().manual_seed(completion_seed(seed=1, step=step, prompt_id=7, index=j))
                for j in range(8)]
        return sample_from_logits(logits, gens, temperature=1.0, top_p=1.0)[0].tolist()

    first, second, third = draws(0), draws(1), draws(2)
    assert first != second and second != third and first != third
