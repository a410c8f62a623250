"""Math problems: GSM8K and MATH records, answers, prompt templates, errors and skips."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_prune.data import GSM8K_SAMPLE
from megatron_prune.data.math import (
    GSM8K_PROMPT_TEMPLATE,
    MathDataConfig,
    MathDataset,
    gsm8k_answer,
    last_boxed,
    load_math_problems,
    parse_math_record,
)
from megatron_prune.data.records import DataError, RecordError

from .helpers import write_jsonl


def test_bundled_gsm8k_sample():
    dataset = MathDataset(GSM8K_SAMPLE)
    assert len(dataset) == 300 and not dataset.skipped
    first = dataset[0]
    assert first.answer == "72" and first.line == 1 and first.source == GSM8K_SAMPLE
    assert first.prompt_text.startswith("Natalia sold clips")
    assert first.prompt_text.endswith('output the final answer after "####".')
    with open(GSM8K_SAMPLE, encoding="utf-8") as handle:
        finals = [json.loads(line)["answer"].splitlines()[-1] for line in handle]
    for problem, final in zip(dataset, finals):
        assert final.replace(",", "") == f"#### {problem.answer}"


def test_gsm8k_answer():
    assert gsm8k_answer("step\n#### 1,234") == "1234"
    assert gsm8k_answer("step\n####-5.5\n") == "-5.5"
    assert gsm8k_answer("#### $5") == "$5" and gsm8k_answer("#### 10%") == "10%"
    assert gsm8k_answer("#### $1,000") == "$1000" and gsm8k_answer("#### 12,500%") == "12500%"
    assert gsm8k_answer("#### \u22123") == "-3"  # the Unicode minus sign
    for bad in ("no answer", "#### \nmore", "####"):
        with pytest.raises(RecordError, match="no final answer"):
            gsm8k_answer(bad)
    # References the reward could never match (it compares one number): refused, not trained on at reward 0.
    for bad in ("two", "3/4", "12,34", "3 apples and 4 pears", "1e5", "2:30"):
        with pytest.raises(RecordError, match=f"'#### {bad}' is not one number"):
            gsm8k_answer(f"step\n#### {bad}")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789-+.,/$% :e", min_size=1, max_size=12))
def test_every_accepted_gsm8k_reference_scores_its_own_answer(tail):
    """What the loader accepts, the reward matches: the reference's own '#### N' earns the reward."""
    from megatron_prune.grpo.rewards import GSM8KReward

    try:
        reference = gsm8k_answer(f"work\n#### {tail}")
    except RecordError:
        return
    assert GSM8KReward()(f"The answer:\n#### {tail}", reference) == 1.0


def test_math_boxed():
    assert last_boxed(r"So $x = \boxed{\frac{1}{2}}$.") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{ {a}+{b} }") == "{a}+{b}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed{2} and an unclosed \boxed{3") == "2"
    assert last_boxed(r"so $\boxed 5$") == "5"  # brace-less, as the reward reads it
    for bad in ("no box", r"\boxed{}", r"\boxed{unclosed"):
        with pytest.raises(RecordError, match="no final answer"):
            last_boxed(bad)


def test_math_record_and_templates():
    prompt, answer = parse_math_record({"problem": "What is $1+1$?", "solution": r"$\boxed{2}$", "level": "Level 1"})
    assert answer == "2"
    assert prompt == "What is $1+1$?\nLet's think step by step and output the final answer within \\boxed{}."
    prompt, _ = parse_math_record({"question": " Q? ", "answer": "#### 1"}, prompt_template="Solve: {question}")
    assert prompt == "Solve: Q?"
    assert GSM8K_PROMPT_TEMPLATE.replace("{question}", "Q?") == parse_math_record({"question": "Q?", "answer": "#### 1"})[0]
    # a forced format meeting the other one's records says what the file holds
    with pytest.raises(RecordError, match=r"wrong format: a gsm8k record \(question/answer\), not a math one"):
        parse_math_record({"question": "Q?", "answer": "#### 1"}, format="math")
    with pytest.raises(RecordError, match=r"wrong format: a math record \(problem/solution\), not a gsm8k one"):
        parse_math_record({"problem": "P?", "solution": r"\boxed{1}"}, format="gsm8k")
    # a box that holds nothing a completion could match is refused when the record loads
    with pytest.raises(RecordError, match=r"no final answer: the last .* holds no answer"):
        parse_math_record({"problem": "P?", "solution": r"So \boxed{\,}."})
    with pytest.raises(RecordError, match="missing field: 'solution'"):
        parse_math_record({"problem": "P?"}, format="math")
    with pytest.raises(ValueError, match="question"):
        MathDataConfig(prompt_template="no field")


BAD_LINES = [
    (b"{oops", "malformed json"),
    (b"[1, 2]", "not an object"),
    (b'{"question": "\xfe", "answer": "#### 1"}', "invalid utf-8"),
    (b'{"question": "q"}', "missing field"),
    (b'{"title": "q"}', "unknown format"),
    (b'{"question": 5, "answer": "#### 1"}', "wrong type"),
    (b'{"question": " ", "answer": "#### 1"}', "empty field"),
    (b'{"question": "q", "answer": "1"}', "no final answer"),
    (b'{"question": "q", "answer": "#### two"}', "no final answer"),
    (b'{"problem": "p", "solution": "no box"}', "no final answer"),
]
GOOD = {"question": "q", "answer": "#### 1"}


@pytest.mark.parametrize("line, reason", BAD_LINES, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_LINES)])
def test_bad_record_raises_naming_file_and_line(tmp_path, line, reason):
    path = write_jsonl(tmp_path / "math.jsonl", [GOOD, GOOD, line])
    with pytest.raises(DataError) as info:
        load_math_problems(path)
    assert (info.value.path, info.value.line, info.value.reason) == (path, 3, reason)
    assert str(info.value).startswith(f"{path}:3: {reason}")


@pytest.mark.parametrize("line, message", [
    (b'{"question": "q", "answer": "#### 1"', "malformed json: Expecting ',' delimiter at the end of the line"),
    (b'{"question": "q" "answer": "#### 1"}', "malformed json: Expecting ',' delimiter at character 18 of the line"),
    (b'{"question": " ", "answer": "#### 1"}', "empty field: 'question' is empty"),
    (b'{"question": "q", "answer": "#### two"}', "no final answer: '#### two' is not one number"),
    (b'{"question": "q"}', "missing field 'answer'"),
])
def test_bad_record_message_reads_as_one_sentence(tmp_path, line, message):
    """The whole message, file line first: no parser position that contradicts it, the reason and
    its detail kept apart (a bare quoted name, as in "missing field 'answer'", joins its reason)."""
    path = write_jsonl(tmp_path / "math.jsonl", [GOOD, GOOD, line])
    with pytest.raises(DataError) as info:
        load_math_problems(path)
    assert str(info.value).startswith(f"{path}:3: {message}"), str(info.value)


def test_bad_records_are_counted_when_skipping(tmp_path, caplog):
    path = write_jsonl(tmp_path / "math.jsonl", [GOOD] + [line for line, _ in BAD_LINES])
    with caplog.at_level("WARNING"):
        dataset = MathDataset(path, config=MathDataConfig(skip_invalid=True))
    assert len(dataset) == 1
    assert sum(dataset.skipped.values()) == len(BAD_LINES) and dataset.skipped["no final answer"] == 3
    assert any(f"{path}:2: malformed json" in message for message in caplog.messages)


def test_an_empty_file_among_others_is_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n")
    with pytest.raises(DataError) as info:
        MathDataset([GSM8K_SAMPLE, str(empty)])
    assert str(info.value) == (f"{empty}: empty data file: no records to read (expected math problems; the other "
                               "files hold records)")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=30).filter(lambda b: b"\n" not in b and b.strip()),
            st.dictionaries(
                st.sampled_from(["question", "answer", "problem", "solution"]),
                st.one_of(st.text(max_size=20), st.integers()),
                max_size=4,
            ).map(lambda d: json.dumps(d).encode()),
            st.integers(0, 10**6).map(lambda n: json.dumps({"question": "q", "answer": f"work\n#### {n}"}).encode()),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_fuzz_every_record_is_yielded_or_skipped(tmp_path_factory, lines):
    path = write_jsonl(tmp_path_factory.mktemp("fuzz") / "math.jsonl", lines)
    problems, skipped = load_math_problems(path, config=MathDataConfig(skip_invalid=True))
    assert len(problems) + sum(skipped.values()) == len(lines)
    first_bad = next((n for n in range(1, len(lines) + 1) if n not in {p.line for p in problems}), None)
    if first_bad is None:
        return
    with pytest.raises(DataError) as info:
        load_math_problems(path)
    assert (info.value.path, info.value.line) == (path, first_bad)
