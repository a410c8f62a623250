"""Fuzzing preference files: every record ends as a pair, a DataError naming it, or a counted skip."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_prune.data.preference import PreferenceDataConfig, load_preference_pairs
from megatron_prune.data.records import DataError
from megatron_prune.data.tokenizer import load_tokenizer

from .helpers import write_jsonl

TOKENIZER = load_tokenizer("tiny")
CONFIG = dict(max_seq_length=64)
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Short texts that keep a valid record well inside max_seq_length (prompt <= ~25 tokens).
short_text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=15)


def encode(record) -> bytes:
    return json.dumps(record, ensure_ascii=False).encode("utf-8")


@st.composite
def valid_line(draw):
    prompt = draw(short_text.filter(str.strip))  # a blank prompt is a bad record ("empty prompt")
    chosen, rejected = "a" + draw(short_text), "b" + draw(short_text)
    shape = draw(st.sampled_from(["explicit", "messages", "hh", "helpsteer3"]))
    if shape == "explicit":
        return encode({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    if shape == "messages":
        messages = [{"role": "user", "content": prompt}]
        return encode({"prompt": messages, "chosen": [{"role": "assistant", "content": chosen}], "rejected": rejected})
    if shape == "hh":
        head = f"\n\nHuman: {prompt}\n\nAssistant:"
        return encode({"chosen": f"{head} {chosen}", "rejected": f"{head} {rejected}"})
    preference = draw(st.sampled_from([-3, -2, -1, 1, 2, 3]))
    context = [{"role": "user", "content": prompt}]
    return encode({"context": context, "response1": chosen, "response2": rejected, "overall_preference": preference})


def _is_json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw.decode("utf-8")), dict)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False


garbage_line = st.binary(min_size=1, max_size=40).filter(
    lambda b: b"\n" not in b and b.strip() and not _is_json_object(b)
)
wrong_value = st.one_of(
    st.none(), st.integers(), st.floats(allow_nan=False), st.booleans(), st.lists(st.integers(), max_size=2)
)


@st.composite
def invalid_line(draw):
    kind = draw(st.sampled_from(["garbage", "missing", "wrong type", "empty", "same", "non-utf8", "long prompt"]))
    record = {"prompt": draw(short_text), "chosen": "a" + draw(short_text), "rejected": "b" + draw(short_text)}
    if kind == "garbage":
        return draw(garbage_line)
    if kind == "missing":
        del record[draw(st.sampled_from(sorted(record)))]
    elif kind == "wrong type":
        record[draw(st.sampled_from(sorted(record)))] = draw(wrong_value)
    elif kind == "empty":
        record[draw(st.sampled_from(["chosen", "rejected"]))] = draw(st.sampled_from(["", " ", "\n\t"]))
    elif kind == "same":
        record["rejected"] = record["chosen"]
    elif kind == "long prompt":
        record["prompt"] = "word " * draw(st.integers(min_value=40, max_value=80))
    raw = encode(record)
    if kind == "non-utf8":
        cut = raw.index(b'"chosen": "') + len(b'"chosen": "')
        raw = raw[:cut] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80abc"])) + raw[cut:]
    return raw


@st.composite
def fuzz_file(draw):
    """``[(line_bytes, is_valid)]`` mixing valid records and every kind of bad one."""
    kinds = draw(st.lists(st.booleans(), min_size=1, max_size=12))
    return [(draw(valid_line()), True) if ok else (draw(invalid_line()), False) for ok in kinds]


@FUZZ
@given(fuzz_file())
def test_skipping_counts_every_bad_record(tmp_path_factory, content):
    path = write_jsonl(tmp_path_factory.mktemp("fuzz") / "pairs.jsonl", [line for line, _ in content])
    config = PreferenceDataConfig(skip_invalid=True, **CONFIG)
    pairs, skipped = load_preference_pairs(path, tokenizer=TOKENIZER, config=config)
    assert len(pairs) + sum(skipped.values()) == len(content)
    assert [pair.line for pair in pairs] == [n for n, (_, ok) in enumerate(content, start=1) if ok]
    for pair in pairs:
        assert len(pair.prompt_ids) + max(len(pair.chosen_ids), len(pair.rejected_ids)) <= 64
        assert all(0 <= i < TOKENIZER.vocab_size for i in pair.prompt_ids + pair.chosen_ids + pair.rejected_ids)


@FUZZ
@given(fuzz_file())
def test_first_bad_record_raises_naming_file_and_line(tmp_path_factory, content):
    path = write_jsonl(tmp_path_factory.mktemp("fuzz") / "pairs.jsonl", [line for line, _ in content])
    bad = [n for n, (_, ok) in enumerate(content, start=1) if not ok]
    config = PreferenceDataConfig(**CONFIG)
    if not bad:
        pairs, skipped = load_preference_pairs(path, tokenizer=TOKENIZER, config=config)
        assert len(pairs) == len(content) and not skipped
        return
    with pytest.raises(DataError) as info:
        load_preference_pairs(path, tokenizer=TOKENIZER, config=config)
    assert (info.value.path, info.value.line) == (path, bad[0])
    assert str(info.value).startswith(f"{path}:{bad[0]}: {info.value.reason}")
