"""Keep probabilities, counter-based draws and the prompt history of DPPO."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_prune.grpo.dppo import (
    COMPLETION_LEVEL,
    PROMPT_LEVEL,
    DPPOConfig,
    DPPOPruner,
    KeepDecision,
    PromptHistory,
    combine_weights,
    keep_uniform,
    prune_completions,
    prune_prompts,
    sample_keep,
    solve_keep_probs,
)

scores_strategy = st.lists(
    st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=10.0)), min_size=1, max_size=40
)


# --- keep probabilities -------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(scores=scores_strategy, rate=st.floats(0.0, 0.95), floor=st.floats(0.01, 1.0))
def test_probs_respect_floor_and_meet_the_target_when_achievable(scores, rate, floor):
    probs = solve_keep_probs(torch.tensor(scores, dtype=torch.float64), prune_rate=rate, floor=floor)
    assert probs.dtype == torch.float64
    assert (probs >= floor - 1e-12).all() and (probs <= 1.0).all()
    expected_rate = 1.0 - probs.mean().item()
    if 1.0 - rate >= floor:  # achievable: the floor leaves room for the requested rate
        assert expected_rate == pytest.approx(rate, abs=1e-9)
    else:  # not achievable: everything sits at the floor, pruning as much as allowed
        assert torch.allclose(probs, torch.full_like(probs, floor))


@settings(max_examples=150, deadline=None)
@given(scores=scores_strategy, rate=st.floats(0.0, 0.95), floor=st.floats(0.01, 1.0))
def test_probs_are_monotone_in_score(scores, rate, floor):
    scores_t = torch.tensor(scores, dtype=torch.float64)
    probs = solve_keep_probs(scores_t, prune_rate=rate, floor=floor)
    order = torch.argsort(scores_t)
    assert (probs[order].diff() >= -1e-12).all()


def test_scaling_regime_gives_proportional_probs_and_floor_at_zero_advantage():
    scores = torch.tensor([0.0, 0.0, 0.1, 0.2, 0.4, 3.0], dtype=torch.float64)
    probs = solve_keep_probs(scores, prune_rate=0.5, floor=0.1)
    assert probs[:2].tolist() == [0.1, 0.1]
    assert probs[5].item() == 1.0
    assert 1 - probs.mean().item() == pytest.approx(0.5, abs=1e-12)
    # strictly inside (floor, 1): proportional to the score (one multiplier c)
    inner = (probs > 0.1) & (probs < 1.0)
    ratios = probs[inner] / scores[inner]
    assert inner.sum() >= 2 and torch.allclose(ratios, ratios[0].expand_as(ratios))


def test_low_rate_with_many_zero_scores_raises_their_floor_exactly():
    scores = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    probs = solve_keep_probs(scores, prune_rate=0.1, floor=0.1)
    assert probs[3].item() == 1.0
    assert torch.allclose(probs[:3], torch.full((3,), (0.9 * 4 - 1) / 3, dtype=torch.float64))


def test_zero_rate_is_exactly_one_and_infinite_score_always_kept():
    scores = torch.tensor([0.0, 0.5, math.inf], dtype=torch.float64)
    assert torch.equal(solve_keep_probs(scores, prune_rate=0.0, floor=0.1), torch.ones(3, dtype=torch.float64))
    probs = solve_keep_probs(scores, prune_rate=0.5, floor=0.1)
    assert probs[2].item() == 1.0 and probs[0].item() == 0.1
    assert 1 - probs.mean().item() == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prune_rate": 1.0, "floor": 0.1}, "prune_rate"),
        ({"prune_rate": -0.1, "floor": 0.1}, "prune_rate"),
        ({"prune_rate": 0.5, "floor": 0.0}, "floor"),
        ({"prune_rate": 0.5, "floor": 1.5}, "floor"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        solve_keep_probs(torch.ones(3), **kwargs)


def test_negative_or_nan_scores_raise():
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="non-negative"):
            solve_keep_probs(torch.tensor([1.0, bad]), prune_rate=0.5, floor=0.1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("prompt_prune_rate", 1.0),
        ("completion_prune_rate", -0.5),
        ("prompt_floor", 0.0),
        ("completion_floor", 2.0),
        ("history_decay", 1.0),
        ("history_score", "mean"),
        ("unseen_prompt_score", -1.0),
    ],
)
def test_config_validation(field, value):
    with pytest.raises(ValueError, match=field):
        DPPOConfig(**{field: value})


# --- draws --------------------------------------------------------------------------------


def test_draws_are_a_pure_function_of_the_key():
    a = keep_uniform(seed=3, step=7, level=PROMPT_LEVEL, item_id=12)
    assert a == keep_uniform(seed=3, step=7, level=PROMPT_LEVEL, item_id=12)
    assert 0.0 <= a < 1.0
    others = {
        keep_uniform(seed=4, step=7, level=PROMPT_LEVEL, item_id=12),
        keep_uniform(seed=3, step=8, level=PROMPT_LEVEL, item_id=12),
        keep_uniform(seed=3, step=7, level=COMPLETION_LEVEL, item_id=12),
        keep_uniform(seed=3, step=7, level=PROMPT_LEVEL, item_id=13),
        keep_uniform(seed=3, step=7, level=PROMPT_LEVEL, item_id="12"),
    }
    assert a not in others and len(others) == 5
    # numpy / torch integers are the same id as Python ints
    assert a == keep_uniform(seed=3, step=7, level=PROMPT_LEVEL, item_id=torch.tensor(12))


def test_draws_are_independent_of_batch_layout():
    probs = torch.linspace(0.1, 1.0, 10, dtype=torch.float64)
    ids = list(range(100, 110))
    keep = sample_keep(probs, seed=1, step=2, level=PROMPT_LEVEL, item_ids=ids)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0))
    keep_perm = sample_keep(probs[perm], seed=1, step=2, level=PROMPT_LEVEL, item_ids=[ids[i] for i in perm])
    assert torch.equal(keep_perm, keep[perm])
    # splitting the batch across "ranks" gives the same decisions
    halves = torch.cat(
        [
            sample_keep(probs[:5], seed=1, step=2, level=PROMPT_LEVEL, item_ids=ids[:5]),
            sample_keep(probs[5:], seed=1, step=2, level=PROMPT_LEVEL, item_ids=ids[5:]),
        ]
    )
    assert torch.equal(halves, keep)


def test_draws_look_uniform_and_independent():
    """Deterministic (fixed keys), so this never flakes; it guards against a broken hash."""
    n = 20000
    u = torch.tensor([keep_uniform(seed=0, step=0, level=PROMPT_LEVEL, item_id=i) for i in range(n)])
    v = torch.tensor([keep_uniform(seed=0, step=1, level=PROMPT_LEVEL, item_id=i) for i in range(n)])
    w = torch.tensor([keep_uniform(seed=0, step=0, level=PROMPT_LEVEL, item_id=i + 1) for i in range(n)])
    sigma = (1 / 12 / n) ** 0.5
    assert abs(u.mean().item() - 0.5) < 5 * sigma
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 5 / n**0.5
    assert abs(torch.corrcoef(torch.stack([u[:-1], w[:-1]]))[0, 1].item()) < 5 / n**0.5
    histogram = torch.histc(u, bins=10, min=0, max=1)
    assert (histogram - n / 10).abs().max() < 5 * (n / 10) ** 0.5
    keep = sample_keep(torch.full((n,), 0.3, dtype=torch.float64), seed=5, step=0, level="x", item_ids=range(n))
    assert abs(keep.double().mean().item() - 0.3) < 5 * (0.21 / n) ** 0.5


def test_duplicate_or_bad_ids_raise():
    with pytest.raises(ValueError, match="unique"):
        sample_keep(torch.ones(2), seed=0, step=0, level=PROMPT_LEVEL, item_ids=[1, 1])
    with pytest.raises(ValueError, match="ids"):
        sample_keep(torch.ones(2), seed=0, step=0, level=PROMPT_LEVEL, item_ids=[1])
    with pytest.raises(ValueError, match="ints, strings"):
        sample_keep(torch.ones(1), seed=0, step=0, level=PROMPT_LEVEL, item_ids=[1.5])


def test_keep_decision_weights():
    decision = KeepDecision(
        probs=torch.tensor([0.5, 0.25, 1.0], dtype=torch.float64),
        keep=torch.tensor([True, False, True]),
        target_rate=0.4,
    )
    assert decision.weights.tolist() == [2.0, 0.0, 1.0]
    assert decision.expected_rate == pytest.approx(1 - 1.75 / 3)
    assert decision.realized_rate == pytest.approx(1 / 3)
    combined = combine_weights(
        prompt_weights=torch.tensor([2.0, 4.0]), completion_weights=torch.tensor([[1.0, 0.0], [10.0, 2.0]])
    )
    assert combined.tolist() == [[2.0, 0.0], [40.0, 8.0]]
    with pytest.raises(ValueError, match="groups"):
        combine_weights(prompt_weights=torch.ones(3), completion_weights=torch.ones(2, 2))


# --- the two levels -----------------------------------------------------------------------


def test_pruning_off_keeps_everything_with_unit_weights():
    config = DPPOConfig()
    history = PromptHistory()
    history.update(0, torch.zeros(4))
    prompts = prune_prompts(prompt_ids=[0, 1, 2], history=history, config=config, seed=0, step=0)
    assert prompts.keep.all() and torch.equal(prompts.weights, torch.ones(3, dtype=torch.float64))
    advantages = torch.tensor([[0.0, 0.0], [1.0, -1.0], [0.5, -0.5]])
    completions = prune_completions(advantages=advantages, prompt_ids=[0, 1, 2], config=config, seed=0, step=0)
    assert completions.keep.all() and torch.equal(completions.weights, torch.ones(3, 2, dtype=torch.float64))


def test_completion_level_prunes_zero_advantage_first():
    config = DPPOConfig(completion_prune_rate=0.5, completion_floor=0.05)
    advantages = torch.cat([torch.zeros(50, 4), torch.randn(50, 4, generator=torch.Generator().manual_seed(0))])
    decision = prune_completions(advantages=advantages, prompt_ids=list(range(100)), config=config, seed=0, step=3)
    assert decision.probs.shape == (100, 4)
    assert torch.all(decision.probs[:50] == 0.05)
    assert decision.expected_rate == pytest.approx(0.5, abs=1e-9)
    assert decision.keep[:50].double().mean() < 0.15 < decision.keep[50:].double().mean()
    with pytest.raises(ValueError, match="advantages"):
        prune_completions(advantages=torch.zeros(3), prompt_ids=[0, 1, 2], config=config, seed=0, step=0)


def test_prompt_level_uses_history_and_keeps_unseen_prompts():
    config = DPPOConfig(prompt_prune_rate=0.5, prompt_floor=0.1)
    history = PromptHistory.from_config(config)
    for prompt_id in range(8):
        solved, mixed = torch.tensor([1.0, 1.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 0.0, 1.0])
        history.update(prompt_id, solved if prompt_id < 4 else mixed)
    decision = prune_prompts(prompt_ids=list(range(10)), history=history, config=config, seed=0, step=0)
    assert decision.probs[8:].tolist() == [1.0, 1.0]  # unseen
    assert torch.all(decision.probs[:4] == 0.1)  # always solved: floor
    assert torch.allclose(decision.probs[4:8], torch.full((4,), 0.65, dtype=torch.float64))
    assert decision.expected_rate == pytest.approx(0.5, abs=1e-9)
    unseen = DPPOConfig(prompt_prune_rate=0.3, unseen_prompt_score=0.0)
    decision = prune_prompts(prompt_ids=[8, 9, 4], history=history, config=unseen, seed=0, step=0)
    assert decision.probs[0].item() == decision.probs[1].item() < decision.probs[2].item()


# --- history --------------------------------------------------------------------------------


def test_history_ema_and_scores():
    history = PromptHistory(decay=0.5, score="std")
    assert history.score(1) is None and 1 not in history
    assert history.update(1, torch.tensor([0.0, 1.0])) == pytest.approx(0.5)
    assert history.update(1, torch.tensor([1.0, 1.0])) == pytest.approx(0.25)
    assert history.count(1) == 2 and len(history) == 1
    informative = PromptHistory(decay=0.0, score="informative")
    informative.update("a", torch.tensor([0.2, 0.3]))
    assert informative.score("a") == 1.0
    scores = history.scores([1, 2])
    assert scores[0].item() == pytest.approx(0.25) and math.isinf(scores[1].item())
    assert history.scores([2], unseen=0.7).tolist() == [0.7]
    with pytest.raises(ValueError, match="empty"):
        history.update(3, torch.tensor([]))
    with pytest.raises(ValueError, match="rewards"):
        history.update_batch([1, 2], torch.zeros(3, 2))


def test_history_state_dict_round_trip_through_torch_save():
    history = PromptHistory(decay=0.25, score="std")
    history.update_batch([5, "q7", (1, 2)], torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.2, 0.4]]))
    buffer = io.BytesIO()
    torch.save(history.state_dict(), buffer)
    buffer.seek(0)
    restored = PromptHistory(decay=0.25, score="std")
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for prompt_id in (5, "q7", (1, 2)):
        assert restored.score(prompt_id) == history.score(prompt_id)
        assert restored.count(prompt_id) == history.count(prompt_id)
    with pytest.raises(ValueError, match="decay"):
        PromptHistory(decay=0.5).load_state_dict(history.state_dict())
    with pytest.raises(ValueError, match="missing"):
        restored.load_state_dict({"decay": 0.25})


def test_pruner_resume_reproduces_decisions():
    config = DPPOConfig(prompt_prune_rate=0.4, completion_prune_rate=0.5)
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    pruner = DPPOPruner(config=config, seed=11)
    pruner.observe(prompt_ids=[0, 1, 2, 3], rewards=rewards)
    state = pruner.state_dict()
    resumed = DPPOPruner(config=config, seed=11)
    resumed.load_state_dict(state)
    a = pruner.select_prompts(step=5, prompt_ids=[0, 1, 2, 3])
    b = resumed.select_prompts(step=5, prompt_ids=[0, 1, 2, 3])
    assert torch.equal(a.keep, b.keep) and torch.equal(a.probs, b.probs)
    advantages = torch.tensor([[0.0, 0.0], [-1.0, 1.0]])
    c = pruner.select_completions(step=5, prompt_ids=[1, 3], advantages=advantages)
    d = resumed.select_completions(step=5, prompt_ids=[1, 3], advantages=advantages)
    assert torch.equal(c.keep, d.keep)
    with pytest.raises(ValueError, match="seed"):
        DPPOPruner(config=config, seed=12).load_state_dict(state)
