"""The GSM8K reward reads numbers written with LaTeX spacing and escaped dollars as the numbers they are.

Chat and math models box answers in LaTeX: thousands as ``1,\\!000`` (the MATH dataset's own
style) or ``1\\,000``, money as ``\\$5``, a negative amount as ``-\\$5``. Each expected value
below is what a reader sees in the rendered formula.
"""

from __future__ import annotations

import pytest

from megatron_prune.grpo.rewards import GSM8KReward, extract_gsm8k_answer

LATEX_NUMBERS = [
    ("\\boxed{1,\\!000}", "1000"),  # thousands, MATH style
    ("\\boxed{10,\\!000}", "10000"),
    ("\\boxed{1\\,000}", "1000"),  # thousands, thin space
    ("\\boxed{12\\,500}", "12500"),
    ("\\boxed{\\$1,\\!200}", "1200"),
    ("The total is $2,\\!500$.", "2500"),  # no box: the last number
    ("#### 1,\\!000", "1000"),  # after the marker
    ("\\boxed{-\\$5}", "-5"),  # the sign before an escaped dollar
    ("So she is down $-\\$5$.", "-5"),
    ("\\boxed{-\\,5}", "-5"),  # the sign before a thin space
]


@pytest.mark.parametrize("completion, number", LATEX_NUMBERS, ids=[c for c, _ in LATEX_NUMBERS])
def test_latex_spacing_and_escaped_dollars_keep_the_number(completion, number):
    assert extract_gsm8k_answer(completion) == number


@pytest.mark.parametrize("completion, right, wrong", [
    ("\\boxed{12\\,500}", "12500", "500"),  # was: 500 credited, 12500 not
    ("\\boxed{1,\\!000}", "1000", "0"),
    ("\\boxed{-\\$5}", "-5", "5"),  # was: the loss of $5 credited as a gain of 5
])
def test_the_reward_credits_the_written_number_not_a_part_of_it(completion, right, wrong):
    reward = GSM8KReward()
    assert reward(completion, right) == 1.0
    assert reward(completion, wrong) == 0.0


# LaTeX outside a box: after the marker, or in the text's last number. A fraction is its value and
# {,} a thousands comma there too, as they are inside a box.
LATEX_OUTSIDE_A_BOX = [
    ("#### \\frac{3}{4}", "0.75"),
    ("#### -\\frac{1}{2}", "-0.5"),
    ("#### 1{,}000", "1000"),
    ("The answer is $-\\frac{7}{2}$.", "-3.5"),
    ("Each gets $2\\frac{1}{2}$ pies.", "2.5"),
    ("The total is $12{,}500$.", "12500"),
    ("So $\\dfrac{12}{4} = 3$ cups", "3"),  # the last number is still the last number
    ("Step 2\n$\\frac{3}{4}$ of it", "0.75"),  # a number on the line before makes no mixed number
]


@pytest.mark.parametrize("completion, number", LATEX_OUTSIDE_A_BOX, ids=[c for c, _ in LATEX_OUTSIDE_A_BOX])
def test_latex_fractions_and_commas_outside_a_box_are_read_whole(completion, number):
    assert extract_gsm8k_answer(completion) == number


@pytest.mark.parametrize("completion, wrong", [
    ("#### -\\frac{1}{2}", "1"),  # was: credited as 1
    ("#### \\frac{3}{4}", "3"),
    ("The answer is $\\frac{3}{4}$.", "4"),
    ("The total is $12{,}500$.", "500"),
])
def test_a_part_of_a_latex_number_outside_a_box_earns_nothing(completion, wrong):
    assert GSM8KReward()(completion, wrong) == 0.0
