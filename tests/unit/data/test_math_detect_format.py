"""Record shapes are detected by the fields a record holds, including MATH records that carry an ``answer``."""

from __future__ import annotations

from megatron_prune.data.math import MATH_PROMPT_TEMPLATE, MathDataConfig, detect_format, load_math_problems

from .helpers import write_jsonl

# MATH-500 and DeepScaleR records: problem and solution, plus the final answer on its own.
MATH_WITH_ANSWER = {"problem": "What is $3 + 4$?", "solution": "We add: $3 + 4 = \\boxed{7}$.", "answer": "7",
                    "subject": "Prealgebra", "level": 1}


def test_a_math_record_with_an_answer_field_is_a_math_record():
    assert detect_format(MATH_WITH_ANSWER) == "math"
    assert detect_format({"question": "q", "answer": "#### 1"}) == "gsm8k"
    assert detect_format({"problem": "p", "solution": "\\boxed{1}"}) == "math"


def test_auto_format_loads_math_records_with_an_answer_field(tmp_path):
    path = write_jsonl(tmp_path / "math500.jsonl", [MATH_WITH_ANSWER, {"question": "q", "answer": "w\n#### 2"}])
    problems, skipped = load_math_problems(path, config=MathDataConfig(format="auto"))
    assert not skipped
    assert [p.answer for p in problems] == ["7", "2"]
    assert problems[0].prompt_text == MATH_PROMPT_TEMPLATE.replace("{question}", "What is $3 + 4$?")


def test_a_gsm8k_answer_that_ends_its_sentence_with_a_period_is_its_number(tmp_path):
    from megatron_prune.grpo.rewards import GSM8KReward

    records = [{"question": "q", "answer": "w\n#### 18."}, {"question": "q", "answer": "w\n#### 1,234."},
               {"question": "q", "answer": "w\n#### 3.5."}]
    problems, skipped = load_math_problems(write_jsonl(tmp_path / "gsm8k.jsonl", records))
    assert not skipped and [p.answer for p in problems] == ["18", "1234", "3.5"]
    assert GSM8KReward()("so the answer is\n#### 18", problems[0].answer) == 1.0
    assert GSM8KReward()("#### 17", problems[0].answer) == 0.0
