"""Keep probabilities, counter-based draws and the prompt history of DPPO."""

from __future__ import annotations

import io
import itertools
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
    systematic_keep,
    varied_group_probability,
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


@pytest.mark.parametrize("tiny", [1e-20, 1e-100, 1e-300, 5e-324])
def test_the_target_is_met_when_a_score_has_decayed_to_almost_nothing(tiny):
    # a prompt whose groups kept coming out all-equal: its moving-average score decays towards 0
    scores = torch.tensor([tiny] + [0.5] * 8, dtype=torch.float64)
    probs = solve_keep_probs(scores, prune_rate=0.5, floor=0.3)
    assert 1 - probs.mean().item() == pytest.approx(0.5, abs=1e-9)
    assert probs[0].item() == 0.3
    assert torch.allclose(probs[1:], torch.full((8,), (0.5 * 9 - 0.3) / 8, dtype=torch.float64))


@pytest.mark.parametrize("large, tiny", [(1.0, 1e-310), (5.0, 4e-324)])
def test_the_target_is_met_when_scores_span_more_than_float64(large, tiny):
    # the multiplier that lifts the tiny scores above the floor lies beyond float64 (and their ratio
    # to the largest score underflows): no NaN, and still the requested rate
    scores = torch.tensor([large] + [tiny] * 9, dtype=torch.float64)
    probs = solve_keep_probs(scores, prune_rate=0.5, floor=0.1)
    assert not probs.isnan().any() and probs[0].item() == 1.0
    assert 1 - probs.mean().item() == pytest.approx(0.5, abs=1e-9)
    assert torch.allclose(probs[1:], torch.full((9,), 4 / 9, dtype=torch.float64))


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
    for sampling in ("independent", "systematic"):  # a repeated prompt is named as one
        config = DPPOConfig(completion_prune_rate=0.5, sampling=sampling)
        with pytest.raises(ValueError, match="^prompt ids must be unique"):
            prune_completions(advantages=torch.ones(2, 3), prompt_ids=[4, 4], config=config, seed=0, step=0)


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
    with pytest.raises(ValueError, match="missing"):
        restored.load_state_dict({"decay": 0.25})


def test_history_resumed_under_other_settings(caplog, monkeypatch):
    """A resume may change --dppo-history-decay (the scores go on at the new rate) or
    --dppo-history-score (the scores measured something else: every prompt starts unseen, said)."""
    monkeypatch.setenv("RANK", "0")
    history = PromptHistory(decay=0.25, score="std")
    history.update_batch([5, 6], torch.tensor([[0.0, 1.0], [1.0, 1.0]]))
    slower = PromptHistory(decay=0.5, score="std")
    slower.load_state_dict(history.state_dict())
    assert slower.score(5) == history.score(5) == 0.5
    slower.update(5, torch.tensor([1.0, 1.0]))
    assert slower.score(5) == 0.25  # 0.5 * 0.5 + 0.5 * 0: the new decay
    informative = PromptHistory(decay=0.25, score="informative")
    with caplog.at_level("WARNING"):
        informative.load_state_dict(history.state_dict())
    assert len(informative) == 0 and 5 not in informative
    assert ("the checkpoint's prompt history scores 'std', this run --dppo-history-score 'informative': the 2 "
            "recorded prompts start unseen") in caplog.messages


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


# --- systematic (balanced) draws --------------------------------------------------------------


def _pieces(probs: list[float]) -> list[tuple[float, float]]:
    """(midpoint, length) of the pieces of [0, 1) between the fractional parts of every subset sum of
    ``probs``: a systematic draw over these items, in any order, is constant on each piece."""
    cuts = {0.0, 1.0}
    for r in range(1, len(probs) + 1):
        for subset in itertools.combinations(probs, r):
            total = math.fsum(subset)
            cuts.add(total - math.floor(total))
    cuts = sorted(c for c in cuts if 0.0 <= c <= 1.0)
    return [((a + b) / 2, b - a) for a, b in zip(cuts, cuts[1:]) if b - a > 1e-12]


GROUPS = [
    [0.5, 0.5, 0.5, 0.5],
    [0.25, 0.25],
    [0.1, 1.0, 0.7, 0.35, 0.9],
    [0.6, 0.6, 0.6],
    [1.0, 1.0],
    [0.15, 0.15, 0.15],
]


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: "-".join(map(str, g)))
def test_systematic_completion_keep_frequency_is_its_probability_by_exact_enumeration(group, monkeypatch):
    """Through prune_completions: the group uniform, enumerated over the pieces of [0, 1) where the
    pattern is constant, keeps every completion with exactly its probability q_ij, and the number
    kept is floor or ceil of sum q."""
    import megatron_prune.grpo.dppo as dppo

    config = DPPOConfig(completion_prune_rate=0.3, completion_floor=0.05, sampling="systematic")
    advantages = torch.tensor([[0.3, -1.2, 2.0, 0.7, -0.4][: len(group)]])
    probs = torch.tensor([group], dtype=torch.float64)
    monkeypatch.setattr(dppo, "solve_keep_probs", lambda scores, **_: probs.clone())
    frequency = torch.zeros(len(group), dtype=torch.float64)
    for u, length in _pieces(group):
        monkeypatch.setattr(dppo, "keep_uniform", lambda *, seed, step, level, item_id, u=u: u)
        decision = prune_completions(advantages=advantages, prompt_ids=[7], config=config, seed=0, step=0)
        kept = int(decision.keep.sum())
        assert math.floor(sum(group) + 1e-9) <= kept <= math.ceil(sum(group) - 1e-9)
        frequency += length * decision.keep[0].double()
    torch.testing.assert_close(frequency, torch.tensor(group, dtype=torch.float64), rtol=0, atol=1e-12)


def test_systematic_prompt_keep_frequency_is_its_probability_by_exact_enumeration(monkeypatch):
    import megatron_prune.grpo.dppo as dppo

    config = DPPOConfig(prompt_prune_rate=0.4, prompt_floor=0.1, prompt_sampling="systematic")
    history = PromptHistory.from_config(config)
    for prompt_id, rewards in ((3, [1.0, 1.0]), (1, [0.0, 1.0]), (8, [0.0, 0.5]), (5, [0.2, 0.3])):
        history.update(prompt_id, torch.tensor(rewards))
    ids = [3, 1, 8, 5, 11]  # 11 is unseen: always kept
    probs = prune_prompts(prompt_ids=ids, history=history, config=config, seed=0, step=0).probs
    assert 0.1 <= probs.min() < probs.max() <= 1.0
    frequency = torch.zeros(len(ids), dtype=torch.float64)
    for u, length in _pieces(probs.tolist()):
        monkeypatch.setattr(dppo, "keep_uniform", lambda *, seed, step, level, item_id, u=u: u)
        decision = prune_prompts(prompt_ids=ids, history=history, config=config, seed=0, step=0)
        assert math.floor(probs.sum() + 1e-9) <= int(decision.keep.sum()) <= math.ceil(probs.sum() - 1e-9)
        frequency += length * decision.keep.double()
    torch.testing.assert_close(frequency, probs, rtol=0, atol=1e-12)


def test_systematic_keeps_each_groups_weighted_advantages_balanced():
    """Completions taken in order of advantage: with q = 1/2 a group of two positive and two negative
    advantages always keeps one of each, so sum_j w_ij A_ij = 0 for every draw; independent draws
    do not (and a draw in index order would not either)."""
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0]] * 64)
    ids = list(range(64))
    for sampling, balanced in (("systematic", True), ("independent", False)):
        config = DPPOConfig(completion_prune_rate=0.5, completion_floor=0.1, sampling=sampling)
        decision = prune_completions(advantages=advantages, prompt_ids=ids, config=config, seed=3, step=1)
        assert torch.all(decision.probs == 0.5)
        weighted = (decision.weights * advantages.double()).sum(dim=1)
        assert bool(torch.all(weighted == 0)) is balanced, (sampling, weighted.abs().mean())


def test_systematic_draws_are_a_pure_function_of_seed_step_and_prompt_id():
    """Per-prompt decisions do not depend on the batch's order or split (layouts agree), repeat for the
    same (seed, step) (resume agrees), and change with the step and the seed."""
    config = DPPOConfig(completion_prune_rate=0.5, completion_floor=0.1)
    assert config.sampling == "systematic"
    generator = torch.Generator().manual_seed(0)
    advantages = torch.randn(12, 4, generator=generator, dtype=torch.float64)
    advantages[3] = 0.0
    ids = [100 + 3 * k for k in range(12)]
    # one shared multiplier c needs the whole batch: the probabilities are taken from it
    whole = prune_completions(advantages=advantages, prompt_ids=ids, config=config, seed=5, step=9)
    again = prune_completions(advantages=advantages, prompt_ids=ids, config=config, seed=5, step=9)
    assert torch.equal(whole.keep, again.keep)
    perm = torch.randperm(12, generator=generator)
    permuted = prune_completions(advantages=advantages[perm], prompt_ids=[ids[k] for k in perm], config=config,
                                 seed=5, step=9)
    assert torch.equal(permuted.keep, whole.keep[perm])
    assert torch.equal(permuted.probs, whole.probs[perm])
    steps = torch.stack([prune_completions(advantages=advantages, prompt_ids=ids, config=config, seed=5,
                                           step=s).keep for s in range(200)]).double()
    frequency = steps.mean(dim=0)
    sigma = (whole.probs * (1 - whole.probs) / 200).sqrt()
    assert torch.all((frequency - whole.probs).abs() <= 5 * sigma + 1e-12), (frequency - whole.probs).abs().max()
    other_seed = prune_completions(advantages=advantages, prompt_ids=ids, config=config, seed=6, step=9)
    assert not torch.equal(other_seed.keep, whole.keep)


def test_systematic_prompt_draws_do_not_depend_on_batch_order():
    config = DPPOConfig(prompt_prune_rate=0.5, prompt_floor=0.1, prompt_sampling="systematic")
    history = PromptHistory.from_config(config)
    history.update_batch(list(range(10)), torch.rand(10, 4, generator=torch.Generator().manual_seed(1)))
    ids = list(range(10))
    a = prune_prompts(prompt_ids=ids, history=history, config=config, seed=2, step=4)
    perm = torch.randperm(10, generator=torch.Generator().manual_seed(2)).tolist()
    b = prune_prompts(prompt_ids=[ids[k] for k in perm], history=history, config=config, seed=2, step=4)
    assert torch.equal(b.keep, a.keep[perm])
    assert int(a.keep.sum()) in (math.floor(a.probs.sum()), math.ceil(a.probs.sum()))


def test_systematic_keep_checks_its_arguments():
    with pytest.raises(ValueError, match="permutation"):
        systematic_keep(torch.tensor([0.5, 0.5]), order=[0, 0], uniform=0.3)
    with pytest.raises(ValueError, match="uniform"):
        systematic_keep(torch.tensor([0.5]), order=[0], uniform=1.0)
    assert systematic_keep(torch.tensor([0.5, 0.5, 1.0]), order=[2, 0, 1], uniform=0.0).tolist() == [True, False, True]


def test_rates_the_floor_cannot_reach_and_bad_samplings_raise():
    with pytest.raises(ValueError, match="at most 1 - floor"):
        DPPOConfig(completion_prune_rate=0.95, completion_floor=0.1)
    with pytest.raises(ValueError, match="prompt_prune_rate"):
        DPPOConfig(prompt_prune_rate=0.6, prompt_floor=0.5)
    DPPOConfig(prompt_prune_rate=0.5, prompt_floor=0.5)  # exactly reachable: every prompt at the floor
    with pytest.raises(ValueError, match="sampling"):
        DPPOConfig(sampling="stratified")
    with pytest.raises(ValueError, match="prompt_sampling"):
        DPPOConfig(prompt_sampling="balanced")


def test_max_weight_bounds_every_combined_weight():
    config = DPPOConfig(prompt_prune_rate=0.5, completion_prune_rate=0.7, prompt_floor=0.2, completion_floor=0.25)
    assert config.max_weight == pytest.approx(20.0)
    assert DPPOConfig(completion_prune_rate=0.5, completion_floor=0.25).max_weight == pytest.approx(4.0)
    assert DPPOConfig().max_weight == 1.0
    history = PromptHistory.from_config(config)
    history.update_batch(list(range(6)), torch.tensor([[1.0, 1.0]] * 3 + [[0.0, 1.0]] * 3))
    prompts = prune_prompts(prompt_ids=list(range(8)), history=history, config=config, seed=0, step=0)
    advantages = torch.cat([torch.zeros(4, 3), torch.randn(4, 3, generator=torch.Generator().manual_seed(0))])
    completions = prune_completions(advantages=advantages, prompt_ids=list(range(8)), config=config, seed=0, step=0)
    combined = (1.0 / prompts.probs)[:, None] * (1.0 / completions.probs)
    assert combined.max() <= config.max_weight + 1e-9
    assert combined.max() == pytest.approx(config.max_weight)  # a floored prompt with a zero-advantage completion


def test_history_ema_weights_the_old_score_by_decay():
    """``--dppo-history-decay d``: new score = d * old + (1 - d) * observed (at d != 0.5, where the
    two weights differ)."""
    from megatron_prune.grpo.dppo import PromptHistory

    history = PromptHistory(decay=0.9, score="std")
    history.update("a", torch.tensor([0.0, 1.0]))  # population std 0.5
    history.update("a", torch.tensor([0.0, 0.0]))  # std 0
    assert history.score("a") == 0.9 * 0.5 + 0.1 * 0.0


def test_informative_score_is_zero_for_a_zero_variance_group():
    from megatron_prune.grpo.dppo import PromptHistory

    history = PromptHistory(decay=0.0, score="informative")
    history.update("a", torch.tensor([1.0, 1.0, 1.0]))
    assert history.score("a") == 0.0


# --- pass-rate history ----------------------------------------------------------------------


def _varied_group_probability_by_quadrature(passes: float, fails: float, group_size: int) -> float:
    """1 - E[s^G + (1-s)^G] for s ~ Beta(1 + passes, 1 + fails), by the midpoint rule on the density."""
    s = (torch.arange(200_000, dtype=torch.float64) + 0.5) / 200_000
    alpha, beta = 1.0 + passes, 1.0 + fails
    log_norm = math.lgamma(alpha + beta) - math.lgamma(alpha) - math.lgamma(beta)
    density = torch.exp(log_norm + (alpha - 1) * torch.log(s) + (beta - 1) * torch.log1p(-s))
    return 1.0 - ((s**group_size + (1 - s) ** group_size) * density).mean().item()


@pytest.mark.parametrize("groups, decay", [
    ([[1, 1, 1, 0]], 0.5),
    ([[1, 1, 1, 0], [1, 1, 1, 1]], 0.5),
    ([[0, 0, 0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]], 0.8),
    ([[0.25, 1.0, 0.5], [1.0, 1.0, 0.0]], 0.3),
])
def test_pass_rate_score_is_the_posterior_probability_that_a_group_varies(groups, decay):
    """After groups r_1..r_T: passes = sum_t decay^(T-t) sum(r_t), fails likewise with 1 - r; the
    score is 1 - E[s^G] - E[(1-s)^G] under Beta(1 + passes, 1 + fails), G the last group's size."""
    history = PromptHistory(decay=decay, score="pass-rate")
    for group in groups:
        score = history.update("p", torch.tensor(group, dtype=torch.float64))
    T = len(groups)
    passes = sum(decay ** (T - 1 - t) * sum(group) for t, group in enumerate(groups))
    fails = sum(decay ** (T - 1 - t) * sum(1 - r for r in group) for t, group in enumerate(groups))
    expected = _varied_group_probability_by_quadrature(passes, fails, len(groups[-1]))
    assert score == history.score("p") == pytest.approx(expected, abs=1e-7)
    assert history.count("p") == T


def test_pass_rate_ranks_prompts_by_how_often_their_groups_vary():
    """Half-solved > mostly solved > always solved; and one all-pass group of a mostly-solved
    prompt lowers its score a little, where the std score drops it to a fraction of what it was."""
    history = PromptHistory(decay=0.5, score="pass-rate")
    std = PromptHistory(decay=0.5, score="std")
    half, mostly, always = [1.0, 0.0] * 4, [1.0] * 7 + [0.0], [1.0] * 8
    for _ in range(4):
        for prompt, group in (("half", half), ("mostly", mostly), ("always", always)):
            history.update(prompt, torch.tensor(group))
            std.update(prompt, torch.tensor(group))
    assert history.score("half") > history.score("mostly") > history.score("always") > 0
    before, std_before = history.score("mostly"), std.score("mostly")
    history.update("mostly", torch.tensor(always))
    std.update("mostly", torch.tensor(always))
    assert 0.6 * before < history.score("mostly") < before
    assert std.score("mostly") == pytest.approx(0.5 * std_before)
    assert varied_group_probability(passes=0.0, fails=0.0, group_size=8) == pytest.approx(1 - 2 / 9)
    assert varied_group_probability(passes=3.0, fails=1.0, group_size=1) == pytest.approx(0.0, abs=1e-12)


def test_pass_rate_refuses_rewards_outside_zero_one():
    history = PromptHistory(decay=0.5, score="pass-rate")
    with pytest.raises(ValueError, match=r"'pass-rate' .* needs them in \[0, 1\]; prompt 'q3' got a reward of -1"):
        history.update("q3", torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="prompt 4 got a reward of nan"):
        history.update(4, torch.tensor([float("nan"), 1.0]))
    assert len(history) == 0
    with pytest.raises(ValueError, match="group_size >= 1"):
        varied_group_probability(passes=1.0, fails=0.0, group_size=0)


def test_pass_rate_history_resumes_with_its_counts():
    """The counts, not just the scores, come back: the next update after a resume gives the score
    of a run that never stopped."""
    groups = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    history = PromptHistory(decay=0.25, score="pass-rate")
    history.update_batch([5, "q7"], groups)
    buffer = io.BytesIO()
    torch.save(history.state_dict(), buffer)
    buffer.seek(0)
    restored = PromptHistory(decay=0.25, score="pass-rate")
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.scores([5, "q7"]).tolist() == history.scores([5, "q7"]).tolist()
    for h in (history, restored):
        h.update_batch([5, "q7"], groups.flip(0))
    assert restored.scores([5, "q7"]).tolist() == history.scores([5, "q7"]).tolist()
    state = history.state_dict()
    del state["evidence"]
    with pytest.raises(ValueError, match="'pass-rate' needs one .* evidence entry per prompt"):
        PromptHistory(decay=0.25, score="pass-rate").load_state_dict(state)
