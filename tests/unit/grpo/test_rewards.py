"""Reward extraction and normalisation (GSM8K, MATH), the registry and the toy task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_prune.data import GSM8K_SAMPLE
from megatron_prune.grpo.rewards import (
    GSM8KReward,
    MathReward,
    RewardFn,
    ToyReward,
    ToyTask,
    ToyTaskConfig,
    available_rewards,
    extract_boxed,
    extract_gsm8k_answer,
    get_reward,
    math_answers_equal,
    normalize_math_answer,
    normalize_number,
    register_reward,
)

GSM8K = Path(GSM8K_SAMPLE)  # the bundled 300 GSM8K problems

# --- registry -----------------------------------------------------------------------------


def test_registry():
    assert {"gsm8k", "math", "toy"} <= set(available_rewards())
    for name in ("gsm8k", "math", "toy"):
        assert isinstance(get_reward(name), RewardFn)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("gsm8k", GSM8KReward)


# --- GSM8K --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("72", "72"),
        ("$1,234.00", "1234"),
        ("  - 5 apples", "-5"),
        ("0.50", "0.5"),
        ("12.5%", "12.5"),
        (".5", "0.5"),
        ("no number", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "completion, reference, reward",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "#### 72", 1.0),  # correct
        ("The answer is\n#### $72.00", "... \n#### 72", 1.0),  # $ and trailing .0
        ("#### 1,000", "#### 1000", 1.0),  # thousands comma
        ("#### 7 2", "#### 72", 0.0),  # space inside a number is not a number
        ("Total: 10 then 72", "#### 72", 1.0),  # fallback: last number
        ("Total: 72 then 10", "#### 72", 0.0),  # fallback picks the last one: wrong
        ("#### 71", "#### 72", 0.0),  # wrong
        ("#### ", "#### 72", 0.0),  # malformed: empty answer
        ("I cannot solve this.", "#### 72", 0.0),  # no answer at all
        ("#### -3", "#### -3", 1.0),
        ("#### \u22123", "#### -3", 1.0),  # the Unicode minus sign is a sign
        ("#### \u22123", "#### 3", 0.0),  # ... so -3 is not 3
        ("#### \uff0d3", "#### -3", 1.0),  # fullwidth hyphen-minus
        ("The answer is \u22123", "#### -3", 1.0),  # without a marker the sign counts too
        ("The answer is \u22123", "#### 3", 0.0),
        ("From 2023-2024 it grew", "#### 2024", 1.0),  # a hyphen after a number is no sign
        ("The answer is room B-12", "#### 12", 1.0),  # ... nor one after a letter
        ("It is -5 now", "#### -5", 1.0),
        ("#### 5 #### 6", "#### 6", 1.0),  # the last marker wins
        # A fraction or a power is never read as one of its parts (they were: reward 1 for wrong answers).
        ("So she pays \\boxed{\\dfrac{3}{4}} of the cost.", "4", 0.0),
        ("So she pays \\boxed{\\frac{3}{4}}.", "4", 0.0),
        ("So she pays \\boxed{\\frac{3}{4}}.", "3", 0.0),
        ("So she pays \\boxed{7/2}.", "2", 0.0),
        ("The answer is 3/4.", "4", 0.0),
        ("\\boxed{2^{10}}", "10", 0.0),
        ("\\boxed{2^{10}}", "2", 0.0),
        ("It is 10^3", "3", 0.0),
        ("#### 7/2", "7", 0.0),
        ("#### 5e2", "5", 0.0),
        ("#### 2^10", "2", 0.0),
        ("\\boxed{x} after 3 steps", "3", 0.0),  # a box without a number answers nothing
        # ... and counts as its value
        ("\\boxed{\\frac{14}{2}}", "7", 1.0),
        ("\\boxed{\\tfrac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac12}", "0.5", 1.0),
        ("#### 14/2", "7", 1.0),
        ("The answer is 1/2.", "0.5", 1.0),
        ("#### 1e3", "1000", 1.0),
        ("2^10 = 1024", "1024", 1.0),
        ("\\boxed{2\\frac{1}{2}}", "2.5", 1.0),  # a mixed number
        ("\\boxed{2\\frac{1}{2}}", "10.5", 0.0),  # ... not 21/2
    ],
)
def test_gsm8k_reward(completion, reference, reward):
    assert GSM8KReward()(completion, reference) == reward


def test_gsm8k_marker_rules():
    assert extract_gsm8k_answer("I think #### but then 72") == "72"  # first number after the last marker
    assert extract_gsm8k_answer("####") is None
    assert extract_gsm8k_answer("no digits") is None
    with pytest.raises(ValueError, match="reference has no number"):
        GSM8KReward()("#### 1", "#### none")


def test_gsm8k_reference_answers_score_themselves():
    with GSM8K.open() as handle:
        answers = [json.loads(line)["answer"] for _, line in zip(range(300), handle)]
    reward = GSM8KReward()
    assert all(reward(answer, answer) == 1.0 for answer in answers)
    assert all(extract_gsm8k_answer(answer) is not None for answer in answers)


# --- MATH ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is $\\boxed{42}$.", "42"),
        ("\\boxed{\\frac{1}{2}} and later \\boxed{\\sqrt{3}}", "\\sqrt{3}"),  # last box
        ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("$\\boxed 5$", "5"),
        ("\\boxed {5}", "5"),  # a space before the braces keeps the box
        ("\\fbox  {7}", "7"),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("no box here: 42", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "answer, normalized",
    [
        ("\\dfrac{3}{4}", "\\frac{3}{4}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("3/4", "\\frac{3}{4}"),
        ("x = 5", "5"),
        ("\\left( 1,\\! 2 \\right)", "(1,2)"),
        ("10\\text{ inches}", "10"),  # a unit, as MATH writes it (with its space)
        ("12\\mbox{ cm}.", "12"),
        ("\\text{(A)}", "(A)"),  # no space: an answer, not a unit
        ("10{,}000", "10000"),  # LaTeX's thousands separator
        ("6   7", "6,7"),  # two numbers stay two
        ("1\\,000", "1000"),  # a thin space inside a number is no gap
        ("5.", "5"),
        ("90^\\circ", "90"),
        ("50\\%", "50"),
        ("\\$ 1,000", "1000"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("\u22123", "-3"),  # the Unicode minus sign
        ("\\frac{\u22121}{2}", "\\frac{-1}{2}"),
    ],
)
def test_normalize_math_answer(answer, normalized):
    assert normalize_math_answer(answer) == normalized


@pytest.mark.parametrize(
    "predicted, reference, equal",
    [
        ("\\frac{1}{2}", "0.5", True),  # numeric comparison
        ("\\dfrac{2}{4}", "\\frac12", True),
        ("-\\frac{3}{4}", "-3/4", True),
        ("x=2", "2.0", True),
        ("\\text{(A)}", "(A)", True),
        ("\\frac{1}{3}", "0.333", False),
        ("2", "3", False),
        ("", "", False),
        ("\\frac{1}{0}", "\\frac{1}{0}", True),  # identical strings still match
    ],
)
def test_math_answers_equal(predicted, reference, equal):
    assert math_answers_equal(predicted, reference) is equal


@pytest.mark.parametrize(
    "completion, reference, reward",
    [
        ("So the answer is $\\boxed{\\dfrac{1}{2}}$.", "\\frac{1}{2}", 1.0),  # correct
        ("$\\boxed{0.5}$", "We get ... $\\boxed{\\frac12}$.", 1.0),  # reference is a solution
        ("$\\boxed{3}$", "4", 0.0),  # wrong
        ("$\\boxed{\\frac{1}{2}$", "\\frac{1}{2}", 0.0),  # malformed
        ("The answer is 1/2.", "\\frac{1}{2}", 0.0),  # no box: no answer
        # the left-hand side counts where both have one (the asymptote x = 3 is not y = 3) ...
        ("The vertical asymptote is \\boxed{x = 3}.", "y = 3", 0.0),
        ("\\boxed{x = 2x + 1}", "y = 2x + 1", 0.0),
        ("\\boxed{y = 3}", "y = 3", 1.0),
        ("\\boxed{3}", "x = 3", 1.0),  # ... and not where one side has none
        ("\\boxed{6   7}", "67", 0.0),  # two numbers are not one
        ("\\boxed{5}", "5\\text{ cm}", 1.0),  # a unit in the reference
        ("\\boxed{12\\text{ inches}}", "12", 1.0),
        ("\\boxed{10000}", "10{,}000", 1.0),
        ("\\boxed{10{,}000}", "10000", 1.0),
        ("\\boxed {5}", "5", 1.0),
        ("\\boxed{5 \\text{inches}}", "5\\text{ inches}", 1.0),  # a unit with or without its space
        ("\\boxed{5\\mbox{cm}}", "5\\mbox{ cm}", 1.0),
        ("\\boxed{\\$5 \\text{ million}}", "5", 0.0),  # a magnitude is no unit
        ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),  # a word alone is the answer
        ("\\boxed{\\mathrm{odd}}", "\\text{odd}", 1.0),  # a word in any text or font command
        ("\\boxed{\\mathbf{(C)}}", "(C)", 1.0),
        ("\\boxed{\\textbf{even}}", "\\textrm{even}", 1.0),
        ("\\boxed{\\mathrm{odd}}", "\\text{even}", 0.0),
        ("\\boxed{x_1 = 3}", "x_{1} = 3", 1.0),  # one variable, written two ways
    ],
)
def test_math_reward(completion, reference, reward):
    assert MathReward()(completion, reference) == reward


def test_math_reward_rejects_an_empty_reference():
    with pytest.raises(ValueError, match="empty"):
        MathReward()("\\boxed{1}", "  ")


# --- toy task -----------------------------------------------------------------------------


def test_toy_prompts_are_deterministic():
    task = ToyTask(ToyTaskConfig(seed=3))
    again = ToyTask(ToyTaskConfig(seed=3))
    assert task.prompts(20) == again.prompts(20)
    assert task.prompt(7) == task.prompts(1, start=7)[0]
    assert task.prompts(20) != ToyTask(ToyTaskConfig(seed=4)).prompts(20)
    prompt = task.prompt(0)
    cfg = task.config
    assert len(prompt.token_ids) == cfg.prompt_length
    assert prompt.token_ids[0] == cfg.bos_token_id and prompt.token_ids[-2] == cfg.sep_token_id
    assert task.token_class(prompt.token_ids[-1]) == prompt.target_digit
    assert all(0 <= t < cfg.vocab_size for t in prompt.token_ids)
    digits = {p.target_digit for p in task.prompts(200)}
    assert digits == set(range(cfg.num_digits))


def test_toy_scoring():
    task = ToyTask()
    three = [task.digit_token_id(3), task.digit_token_id(3) + 10, task.digit_token_id(3) + 500 - 500 % 10]
    assert task.score_tokens(three, target_digit=3) == 1.0
    assert task.score_tokens([task.digit_token_id(3), task.digit_token_id(4)], target_digit=3) == 0.5
    assert task.score_tokens([task.digit_token_id(3), 2, task.digit_token_id(4)], target_digit=3) == 1.0  # EOS stops
    assert task.score_tokens([2], target_digit=3) == 0.0
    assert task.score_tokens([0, 1, 3], target_digit=3) == 0.0  # special tokens never match
    assert task.score_text("3 3 3 x", target_digit=3) == 0.75
    assert task.score_text("   ", target_digit=3) == 0.0
    reward = get_reward("toy")
    assert reward("33", task.prompt(0).reference_answer) == float(task.prompt(0).target_digit == 3)
    assert ToyReward()("777", "7") == 1.0
    with pytest.raises(ValueError, match="one digit"):
        ToyReward()("7", "77")
    with pytest.raises(ValueError, match="digit"):
        task.score_tokens([5], target_digit=10)


def test_toy_random_policy_has_dense_reward():
    """A uniform policy scores ~1/num_digits with spread inside groups: advantages are nonzero."""
    task = ToyTask()
    g = torch.Generator().manual_seed(0)
    completions = torch.randint(0, task.config.vocab_size, (64, 8, 8), generator=g)  # prompts x G x tokens
    rewards = torch.tensor(
        [[task.score_tokens(c.tolist(), target_digit=p.target_digit) for c in group]
         for p, group in zip(task.prompts(64), completions)]
    )
    assert 0.05 < rewards.mean().item() < 0.15
    assert (rewards.std(dim=1) > 0).double().mean() > 0.9


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_digits": 11}, "num_digits"),
        ({"vocab_size": 20}, "vocab_size"),
        ({"prompt_length": 2}, "prompt_length"),
        ({"eos_token_id": 1}, "distinct"),
    ],
)
def test_toy_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        ToyTaskConfig(**overrides)


# --- toy-binary ---------------------------------------------------------------------------


def test_toy_binary_scoring():
    """Binary toy reward: 1 exactly when the first completion token (before EOS) is in the target
    class, whatever follows; special tokens and empty completions score 0."""
    task = ToyTask(ToyTaskConfig(binary=True))
    three, four = task.digit_token_id(3), task.digit_token_id(4)
    assert task.score_tokens([three + 20, four, four], target_digit=3) == 1.0
    assert task.score_tokens([four, three, three], target_digit=3) == 0.0
    assert task.score_tokens([2, three], target_digit=3) == 0.0  # EOS first: empty answer
    assert task.score_tokens([1, three], target_digit=3) == 0.0  # a special token is no digit
    assert task.score_text(" 3 x y", target_digit=3) == 1.0
    assert task.score_text("x 3 3", target_digit=3) == 0.0
    reward = get_reward("toy-binary")
    assert reward("3abc", "3") == 1.0 and reward("a333", "3") == 0.0
    with pytest.raises(ValueError, match="one digit"):
        reward("7", "77")


def test_toy_binary_random_policy_has_whole_group_zero_variance():
    """A uniform policy is right ~1/num_digits of the time and many groups are all-wrong
    (probability (9/10)^8 ~ 0.43 for G = 8); every reward is 0 or 1."""
    task = ToyTask(ToyTaskConfig(binary=True))
    g = torch.Generator().manual_seed(0)
    completions = torch.randint(0, task.config.vocab_size, (256, 8, 4), generator=g)
    rewards = torch.tensor(
        [[task.score_tokens(c.tolist(), target_digit=p.target_digit) for c in group]
         for p, group in zip(task.prompts(256), completions)]
    )
    assert set(rewards.unique().tolist()) <= {0.0, 1.0}
    assert 0.06 < rewards.mean().item() < 0.14
    all_wrong = (rewards.sum(dim=1) == 0).double().mean().item()
    assert 0.3 < all_wrong < 0.56, all_wrong


def test_toy_binary_is_a_grpo_cli_task():
    """``--task toy-binary`` builds the toy prompts with the binary reward (and needs no data)."""
    from megatron_prune.config import CheckpointConfig, ModelConfig, TrainConfig
    from megatron_prune.grpo.config import TASKS, GRPOConfig
    from megatron_prune.grpo.trainer import build_source
    from megatron_prune.model.arch import get_preset

    assert "toy-binary" in TASKS
    arch = get_preset("tiny")
    sources = {task: build_source(GRPOConfig(task=task), arch=arch, model_cfg=ModelConfig(), ckpt_cfg=CheckpointConfig(),
                                  train_cfg=TrainConfig(seed=5)) for task in ("toy", "toy-binary")}
    prompt = sources["toy-binary"].get(0)
    assert prompt == sources["toy"].get(0)  # the same prompts
    task = ToyTask(ToyTaskConfig(vocab_size=arch.vocab_size))
    right, wrong = task.digit_token_id(int(prompt.answer)), task.digit_token_id((int(prompt.answer) + 1) % 10)
    assert sources["toy-binary"].score(prompt, [right, wrong, wrong]) == 1.0
    assert sources["toy-binary"].score(prompt, [wrong, right, right]) == 0.0
    assert sources["toy"].score(prompt, [wrong, right, right]) == pytest.approx(2 / 3)


def test_math_negative_fraction_keeps_its_sign():
    """Numeric comparison of a negative LaTeX fraction keeps its sign."""
    from megatron_prune.grpo.rewards import MathReward, math_answers_equal

    assert math_answers_equal("-\\frac{1}{2}", "-0.5")
    assert not math_answers_equal("-\\frac{1}{2}", "0.5")
    assert MathReward()("\\boxed{-\\frac{1}{2}}", "0.5") == 0.0


# --- reasoning models: answers after </think> -----------------------------------------------

THINKING = [
    # (completion, GSM8K reward for reference 72, why)
    ("<think>\n3 * 24 = 72, so #### 72? no, 60\n</think>\n\nThe answer is 60.", 0.0, "a draft inside the reasoning"),
    ("<think>\nfirst 24, then 48\n</think>\n\nSo she pays #### 72<|im_end|>", 1.0, "the answer after </think>"),
    ("<think>\nchecking again: 24 + 48 = 72", 0.0, "reasoning cut by max-new-tokens: no answer"),
    ("Let me add 24 and 48.\n</think>\n\n\\boxed{72} (from 3 steps)", 1.0, "block opened by the template, boxed"),
    ("No reasoning block, 24 + 48 = 72", 1.0, "plain text: the last number"),
]


@pytest.mark.parametrize("completion, reward, why", THINKING, ids=[why for *_, why in THINKING])
def test_gsm8k_grades_what_follows_the_reasoning(completion, reward, why):
    assert GSM8KReward()(completion, "#### 72") == reward, why


@pytest.mark.parametrize("completion, reward", [
    ("<think>\\boxed{\\frac12}</think> so it is 1/3", 0.0),
    ("<think>\\boxed{\\frac13} or \\boxed{\\frac12}</think> The answer is \\boxed{\\frac{1}{2}}.", 1.0),
    ("<think>\\boxed{\\frac12} and still thinking", 0.0),
    # reasoning reopened after the answer: what it drafts does not count
    ("<think>\\boxed{\\frac13}</think> The answer is \\boxed{\\frac12}. <think>or \\boxed{\\frac13}", 1.0),
    ("<think>\\boxed{\\frac12}</think> The answer is \\boxed{\\frac13}. <think>or \\boxed{\\frac12}", 0.0),
])
def test_math_grades_what_follows_the_reasoning(completion, reward):
    assert MathReward()(completion, "\\frac{1}{2}") == reward


def test_gsm8k_without_a_marker_takes_the_last_boxed_answer_before_the_last_number():
    assert extract_gsm8k_answer("The total is \\boxed{72} over 3 days") == "72"
    assert extract_gsm8k_answer("#### 72 and \\boxed{5}") == "72"  # the marker still comes first
    assert extract_gsm8k_answer("\\boxed{3 \\times 6 = 18}") == "18"  # the box's result, not its first factor
    assert extract_gsm8k_answer("\\boxed{1{,}000}") == "1000"
    assert extract_gsm8k_answer("\\boxed{\\frac{36}{2}} that is 18") == "18"  # no plain number: the last one
