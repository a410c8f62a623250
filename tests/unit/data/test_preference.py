"""Preference records: every shape and file format, the HH-RLHF split, the truncation rule, errors and skips."""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
import sys

import pytest

from megatron_prune.data import HH_RLHF_HELDOUT, HH_RLHF_SAMPLE
from megatron_prune.data.preference import (
    PreferenceDataConfig,
    PreferenceDataset,
    PreferenceText,
    load_preference_pairs,
    parse_hh_dialogue,
    parse_preference_record,
    split_hh_transcript,
    prompt_head_length,
    tokenize_preference,
    truncate_pair,
    truncate_prompt,
)
from megatron_prune.data.records import DataError, RecordError
from megatron_prune.data.tokenizer import load_tokenizer, render_plain_template

from .helpers import CHAT_TEMPLATE, save_hf_tokenizer, write_jsonl

USER = [{"role": "user", "content": "Hi there"}]


def ids_text(tokenizer, pair):
    """Decoded (prompt, chosen, rejected) of a pair; responses without their eos."""
    strip = lambda ids: ids[:-1] if ids and ids[-1] == tokenizer.eos_id else ids  # noqa: E731
    return tuple(tokenizer.decode(ids) for ids in (pair.prompt_ids, strip(pair.chosen_ids), strip(pair.rejected_ids)))


# --------------------------------------------------------------------------- shapes


def test_explicit_strings():
    text = parse_preference_record({"prompt": "Hi there", "chosen": "Hello!", "rejected": "Go away."})
    assert text == PreferenceText(USER, "Hello!", "Go away.")


def test_explicit_string_prompt_in_hh_form_is_a_dialogue():
    prompt = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye\n\nAssistant:"
    text = parse_preference_record({"prompt": prompt, "chosen": " Bye!", "rejected": " No."})
    assert [m["role"] for m in text.prompt] == ["user", "assistant", "user"]
    assert render_plain_template(text.prompt) == prompt
    assert (text.chosen, text.rejected) == ("Bye!", "No.")
    # The same prompt stripped of its leading newlines and with a space after the last marker.
    stripped = parse_preference_record({"prompt": prompt.lstrip("\n") + " ", "chosen": "Bye!", "rejected": "No."})
    assert stripped == text


def test_hh_prompt_split_from_its_responses_tokenizes_as_the_whole_transcripts(tmp_path, tiny_tokenizer):
    """HH-RLHF as prompt / chosen / rejected (the responses keep the space after "Assistant:")
    trains the same tokens as the whole transcripts: no second space before each response."""
    prompt = "\n\nHuman: Tell me a joke\n\nAssistant:"
    whole = {"chosen": prompt + " Why did the chicken cross?", "rejected": prompt + " No."}
    split = {"prompt": prompt, "chosen": " Why did the chicken cross?", "rejected": " No."}
    path = write_jsonl(tmp_path / "pairs.jsonl", [whole, split])
    pairs, _ = load_preference_pairs(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(max_seq_length=256))
    ids = [(p.prompt_ids, p.chosen_ids, p.rejected_ids) for p in pairs]
    assert len(ids) == 2 and ids[0] == ids[1]
    transcript = tiny_tokenizer.decode(pairs[1].prompt_ids + pairs[1].chosen_ids[:-1])
    assert transcript.endswith(whole["chosen"])


def test_explicit_message_lists():
    system = [{"role": "system", "content": "Be kind."}] + USER
    record = {
        "prompt": system,
        "chosen": system + [{"role": "assistant", "content": "Hello!"}],  # full conversation
        "rejected": [{"role": "assistant", "content": "Go away."}],  # just the reply
    }
    assert parse_preference_record(record) == PreferenceText(system, "Hello!", "Go away.")
    mixed = {"prompt": system, "chosen": "Hello!", "rejected": [{"role": "assistant", "content": "Go away."}]}
    assert parse_preference_record(mixed) == PreferenceText(system, "Hello!", "Go away.")


def test_explicit_string_responses_that_repeat_the_prompt_lose_that_copy():
    """A transcript beside its prompt would train the prompt twice; it parses as the hh record does."""
    prompt = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Tell me a joke\n\nAssistant:"
    chosen, rejected = prompt + " Why did the chicken...", prompt + " No."
    explicit = parse_preference_record({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    assert explicit.repeated_prompt_removed
    hh = parse_preference_record({"chosen": chosen, "rejected": rejected})
    assert dataclasses.replace(explicit, repeated_prompt_removed=False) == hh
    assert (explicit.chosen, explicit.rejected) == ("Why did the chicken...", "No.")
    plain = parse_preference_record({"prompt": "Hi there", "chosen": "Hi there Hello!", "rejected": "Hi there Bye."})
    assert plain == PreferenceText(USER, " Hello!", " Bye.", repeated_prompt_removed=True)


def test_removed_prompt_copies_are_counted_and_said(tmp_path, tiny_tokenizer, caplog, monkeypatch):
    """Cutting the prompt's copy off both responses changes what trains, so the loader says how
    many pairs it cut and where the first one is."""
    monkeypatch.setenv("RANK", "0")
    quoting = {"prompt": "Hi there", "chosen": "Hi there Hello!", "rejected": "Hi there Bye."}
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, quoting, quoting | {"chosen": "Hi there Hey."}])
    with caplog.at_level("WARNING"):
        dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(max_seq_length=256))
    assert [pair.repeated_prompt_removed for pair in dataset] == [False, True, True]
    assert (f"2 preference pairs had responses that both begin with their prompt string (first: {path}:2); that copy "
            "of the prompt was removed from both responses") in caplog.messages


def test_explicit_string_response_that_only_begins_like_the_prompt_is_kept():
    record = {"prompt": "Say cheese", "chosen": "Say cheese!", "rejected": "No."}
    assert parse_preference_record(record) == PreferenceText(
        [{"role": "user", "content": "Say cheese"}], "Say cheese!", "No.")


def test_explicit_response_list_must_be_one_assistant_message():
    record = {"prompt": USER, "chosen": [{"role": "user", "content": "x"}], "rejected": "y"}
    with pytest.raises(RecordError, match="one assistant message"):
        parse_preference_record(record)


def test_hh_split():
    chosen = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Tell me a joke\n\nAssistant: Why did the chicken..."
    rejected = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Tell me a joke\n\nAssistant: No."
    prompt, response = split_hh_transcript(chosen)
    assert prompt == "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Tell me a joke\n\nAssistant:"
    assert response == " Why did the chicken..."
    text = parse_preference_record({"chosen": chosen, "rejected": rejected})
    assert text.prompt == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Tell me a joke"},
    ]
    assert (text.chosen, text.rejected) == ("Why did the chicken...", "No.")


def test_chat_messages_without_a_prompt_share_their_prompt():
    """TRL's conversational implicit-prompt records: the prompt is the messages both lists share."""
    turns = [{"role": "system", "content": "Be kind."}, *USER, {"role": "assistant", "content": "Hi."},
             {"role": "user", "content": "A joke?"}]
    record = {"chosen": turns + [{"role": "assistant", "content": "Why did..."}],
              "rejected": turns + [{"role": "assistant", "content": "No."}]}
    assert parse_preference_record(record) == PreferenceText(turns, "Why did...", "No.")
    cases = [
        ({"chosen": turns + [{"role": "assistant", "content": "a"}], "rejected": "b"}, "wrong type"),
        ({"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
          "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]}, "no shared prefix"),
        ({"chosen": turns + [{"role": "assistant", "content": "a"}],
          "rejected": turns + [{"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]},
         "one assistant message"),
        ({"chosen": "c", "rejected": "r"}, "a record without 'prompt' must hold HH-RLHF transcripts or chat messages"),
    ]
    for bad, message in cases:
        with pytest.raises(RecordError, match=re.escape(message)):
            parse_preference_record(bad)


def test_hh_split_on_real_bundled_records(tiny_tokenizer):
    """Prompt + response of every bundled pair reproduces the original transcript exactly."""
    pairs, skipped = load_preference_pairs([HH_RLHF_SAMPLE, HH_RLHF_HELDOUT], tokenizer=tiny_tokenizer)
    assert len(pairs) == 500 and not skipped
    records = {}
    for path in (HH_RLHF_SAMPLE, HH_RLHF_HELDOUT):
        with open(path, encoding="utf-8") as handle:
            records.update({(path, n): json.loads(line) for n, line in enumerate(handle, start=1)})
    for pair in pairs:
        record = records[(pair.source, pair.line)]
        prompt, chosen, rejected = ids_text(tiny_tokenizer, pair)
        assert pair.prompt_ids[0] == tiny_tokenizer.bos_id
        assert prompt.endswith("\n\nAssistant:")
        assert prompt + chosen == record["chosen"]
        assert prompt + rejected == record["rejected"]
        assert pair.chosen_ids[-1] == pair.rejected_ids[-1] == tiny_tokenizer.eos_id
        assert render_plain_template(parse_hh_dialogue(prompt)) == prompt


@pytest.mark.parametrize("prompt", [
    "\n\nHuman:\n\nAssistant:",  # an empty turn: the bare marker
    "\n\nHuman:  two spaces kept\n\nAssistant: a reply ending in a newline\n\n\nHuman: next\n\nAssistant:",
    "\n\nHuman: trailing spaces  \n\nAssistant:\n\nHuman: \tafter an empty assistant turn\n\nAssistant:",
])
def test_hh_transcripts_round_trip_with_their_whitespace(prompt):
    """The plain template is the inverse of the HH-RLHF parser, whitespace included: only the one
    space after each marker belongs to the template, everything else is the turn's text."""
    messages = parse_hh_dialogue(prompt)
    assert render_plain_template(messages) == prompt


def test_hh_first_record_by_hand(tiny_tokenizer):
    with open(HH_RLHF_SAMPLE, encoding="utf-8") as handle:
        record = json.loads(handle.readline())
    text = parse_preference_record(record)
    assert text.prompt[0] == {"role": "user", "content": "what are some pranks with a pen i can do?"}
    assert text.prompt[-1] == {"role": "user", "content": "okay some of these do not have anything to do with pens"}
    assert text.chosen.startswith("No, sorry!")
    assert text.rejected.startswith("There are lots of funny things")


@pytest.mark.parametrize("preference, chosen", [(-3, "A"), (-1, "A"), (1, "B"), (3, "B"), (2.0, "B"), (-1.0, "A")])
def test_helpsteer3(preference, chosen):
    record = {"context": USER, "response1": "A", "response2": "B", "overall_preference": preference, "domain": "general"}
    text = parse_preference_record(record)
    assert text == PreferenceText(USER, chosen, "B" if chosen == "A" else "A")


def test_helpsteer3_tie_is_always_a_counted_skip(tmp_path, tiny_tokenizer):
    records = [
        {"context": USER, "response1": "A", "response2": "B", "overall_preference": 0},
        {"context": USER, "response1": "A", "response2": "B", "overall_preference": 2},
    ]
    path = write_jsonl(tmp_path / "hs3.jsonl", records)
    pairs, skipped = load_preference_pairs(path, tokenizer=tiny_tokenizer)  # skip_invalid is off
    assert [p.line for p in pairs] == [2] and skipped == {"tie": 1}


def test_format_override(tmp_path, tiny_tokenizer):
    record = {"prompt": "ignored", "chosen": "\n\nHuman: a\n\nAssistant: b", "rejected": "\n\nHuman: a\n\nAssistant: c"}
    assert parse_preference_record(record).prompt == [{"role": "user", "content": "ignored"}]
    assert parse_preference_record(record, format="hh").prompt == [{"role": "user", "content": "a"}]
    with pytest.raises(RecordError, match="missing field"):
        parse_preference_record(record, format="helpsteer3")
    with pytest.raises(ValueError, match="format"):
        PreferenceDataConfig(format="ultrafeedback")
    # Forced to hh, a prompt/chosen/rejected record is told apart from a broken transcript.
    explicit = {"prompt": "q", "chosen": "a", "rejected": "b"}
    with pytest.raises(RecordError, match=r"this record has a 'prompt': drop --data-format or give --data-format "
                                          r"explicit\)$"):
        parse_preference_record(explicit, format="hh")
    with pytest.raises(RecordError, match="a record without 'prompt' must hold HH-RLHF transcripts"):
        parse_preference_record({"chosen": "a", "rejected": "b"}, format="hh")


def test_parquet(tmp_path, tiny_tokenizer):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"prompt": USER, "chosen": "Hello!", "rejected": "Go away."},
        {"prompt": USER, "chosen": "Hey", "rejected": "Hey"},
    ]
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=f"{path}:2: identical responses"):
        load_preference_pairs(path, tokenizer=tiny_tokenizer)
    config = PreferenceDataConfig(skip_invalid=True)
    pairs, skipped = load_preference_pairs(path, tokenizer=tiny_tokenizer, config=config)
    assert [p.line for p in pairs] == [1] and skipped == {"identical responses": 1}
    prompt, chosen, rejected = ids_text(tiny_tokenizer, pairs[0])
    assert (prompt, chosen, rejected) == ("\n\nHuman: Hi there\n\nAssistant:", " Hello!", " Go away.")


def test_parquet_without_pyarrow_is_a_data_error_with_the_way_out(tmp_path, tiny_tokenizer, monkeypatch):
    """pyarrow is optional: a Parquet file without it names the file and the fix, as a DataError (the
    CLI prints it as one line) and without the skip hint, which could not help."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import of pyarrow now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "pairs.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError) as exc:
        load_preference_pairs(path, tokenizer=tiny_tokenizer)
    assert str(exc.value) == f"{path}: reading Parquet needs pyarrow: pip install pyarrow, or convert the file to JSON Lines"
    assert exc.value.line is None


def test_gzip_jsonl(tmp_path, tiny_tokenizer):
    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"prompt": "x", "chosen": "a", "rejected": "b"}) + "\n")
    assert len(load_preference_pairs(path, tokenizer=tiny_tokenizer)[0]) == 1


def _gzip_bytes(records) -> bytes:
    return gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records), mtime=0)


PAIRS = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(200)]
UNREADABLE_GZIP = [
    pytest.param(_gzip_bytes(PAIRS)[:-40], "Compressed file ended before the end-of-stream marker was reached",
                 id="truncated"),
    pytest.param(b'{"prompt": "x", "chosen": "a", "rejected": "b"}\n', "Not a gzipped file (b'{\"')",
                 id="not-gzip"),
    pytest.param(_gzip_bytes(PAIRS)[:-8] + b"\0" * 8, "CRC check failed", id="bad-crc"),
    pytest.param(_gzip_bytes(PAIRS)[:20] + b"\xff" * 4 + _gzip_bytes(PAIRS)[24:], "Error -3 while decompressing data",
                 id="corrupt-deflate"),  # zlib.error
]


@pytest.mark.parametrize("content, reason", UNREADABLE_GZIP)
@pytest.mark.parametrize("skip_invalid", [False, True], ids=["strict", "skip-invalid"])
def test_unreadable_gzip_is_a_data_error_naming_the_file(tmp_path, tiny_tokenizer, content, reason, skip_invalid):
    """A truncated or non-gzip .jsonl.gz ends the run with one DataError naming the file (the CLI
    prints it as one line); skipping cannot help, so there is no record number (and no skip hint)."""
    path = tmp_path / "pairs.jsonl.gz"
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(skip_invalid=skip_invalid))
    assert str(info.value).startswith(f"{path}: unreadable gzip: ") and reason in str(info.value)
    assert info.value.line is None


@pytest.mark.parametrize("name", ["pairs.json", "pairs.json.gz"])
@pytest.mark.parametrize("indent", [None, 2], ids=["one-line", "indented"])
def test_json_array_file(tmp_path, tiny_tokenizer, name, indent):
    """A .json file holding one JSON array of records (json.dump, Dataset.to_json(lines=False))
    reads like JSON Lines; a record's number is its 1-based position in the array."""
    records = [PAIRS[0], ["not", "an", "object"], {"prompt": "x", "chosen": "a"}, PAIRS[1]]
    data = json.dumps(records, indent=indent).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tiny_tokenizer)
    assert str(info.value) == f"{path}:2: not an object: expected a JSON object, got list"
    dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(skip_invalid=True))
    assert [pair.line for pair in dataset] == [1, 4]
    assert dict(dataset.skipped) == {"not an object": 1, "missing field": 1}
    assert ids_text(tiny_tokenizer, dataset[1])[1:] == (" good 1", " bad 1")


def test_json_lines_in_a_json_file_still_read_line_by_line(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "pairs.json", [PAIRS[0], b"", PAIRS[1]])
    assert [pair.line for pair in PreferenceDataset(path, tokenizer=tiny_tokenizer)] == [1, 3]


def test_malformed_json_array_says_how_the_file_was_read(tmp_path, tiny_tokenizer):
    """An array cut short fails as a whole, naming the file and where parsing stopped, and saying
    why the file was read as one array (no record number: skipping cannot help)."""
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps(PAIRS[:3], indent=2)[:-20])
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(skip_invalid=True))
    assert re.fullmatch(
        rf"{re.escape(str(path))}: malformed json: .*: line 1[0-9] column \d+ \(char \d+\) "
        r"\(a \.json file starting with '\[' is read as one JSON array of records\)", str(info.value)), info.value
    assert info.value.line is None


@pytest.mark.parametrize("name", ["pairs.json", "pairs.json.gz", "pairs.jsonl"])
@pytest.mark.parametrize("layout, what", [
    ("object", "one JSON object spread over several lines"), ("columns", "a dict of columns")])
def test_one_pretty_printed_json_object_is_one_error(tmp_path, tiny_tokenizer, name, layout, what):
    """A .json file holding one indented object (or a dict of columns, as Dataset.to_dict writes)
    is one error saying what the file is, not a "malformed json" for each of its lines."""
    value = PAIRS[0] if layout == "object" else {key: [pair[key] for pair in PAIRS[:2]] for key in PAIRS[0]}
    path, error = _pretty_printed_file_error(tmp_path, tiny_tokenizer, name, value)
    assert error == (f"{path}: not JSON Lines: the file is {what}; write one record per line (JSON Lines), "
                     "or a JSON array of records")


def _pretty_printed_file_error(tmp_path, tokenizer, name: str, value) -> tuple:
    """The one DataError of reading ``value`` written indented into file ``name``, skipping bad records."""
    data = json.dumps(value, indent=2).encode()
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tokenizer, config=PreferenceDataConfig(skip_invalid=True))
    return path, str(info.value)


@pytest.mark.parametrize("name", ["pairs.jsonl", "pairs.jsonl.gz"])
def test_a_pretty_printed_json_array_named_jsonl_is_one_error(tmp_path, tiny_tokenizer, name):
    """Records written as an indented JSON array into a .jsonl file: one error saying what the file
    is and how to read it, not a "malformed json" for each of its lines (or, skipping, a skip each)."""
    path, error = _pretty_printed_file_error(tmp_path, tiny_tokenizer, name, PAIRS[:3])
    assert error == (f"{path}: not JSON Lines: the file is one JSON array spread over several lines; name it .json "
                     "to read it as an array of records, or write one record per line")


def test_a_large_file_with_a_bad_first_line_is_not_parsed_whole(tmp_path, tiny_tokenizer, monkeypatch):
    """Past the probe's size limit a broken first record is one malformed line, as in any JSON Lines
    file: the file is not read whole into memory to see whether it is one value."""
    from megatron_prune.data import records

    data = json.dumps(PAIRS[:3], indent=2).encode()
    monkeypatch.setattr(records, "_ONE_VALUE_PROBE_LIMIT", len(data) - 1)
    path = tmp_path / "pairs.jsonl"
    path.write_bytes(data)
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig())
    assert str(info.value).startswith(f"{path}:1: malformed json"), info.value


def test_json_lines_with_a_bad_first_line_still_read_line_by_line(tmp_path, tiny_tokenizer):
    """A bad first line of a JSON Lines .json file is a skip like any other line; the records after
    it still read (the check for one pretty-printed object must leave the file where it was)."""
    path = tmp_path / "pairs.json"
    path.write_bytes(b'{"prompt": "x",\n' + b"".join(json.dumps(r).encode() + b"\n" for r in PAIRS[:3]))
    dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(skip_invalid=True))
    assert [pair.line for pair in dataset] == [2, 3, 4] and dict(dataset.skipped) == {"malformed json": 1}


@pytest.mark.parametrize("name, array", [("pairs.jsonl", False), ("pairs.json", True), ("pairs.jsonl.gz", False)])
def test_utf8_byte_order_mark_is_ignored(tmp_path, tiny_tokenizer, name, array):
    data = json.dumps(PAIRS[:2]).encode() if array else b"".join(json.dumps(r).encode() + b"\n" for r in PAIRS[:2])
    data = b"\xef\xbb\xbf" + data
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer)
    assert [pair.line for pair in dataset] == [1, 2] and not dataset.skipped
    assert ids_text(tiny_tokenizer, dataset[0])[0] == "\n\nHuman: question 0\n\nAssistant:"


# --------------------------------------------------------------------------- truncation


def test_truncation_rule():
    prompt, chosen, rejected = list(range(10)), [100, 101, 102, 103, 104], [200, 201]
    # No truncation needed.
    assert truncate_pair(prompt, chosen, rejected, max_seq_length=15) == (prompt, chosen, rejected)
    # Responses cut from the right so that prompt + each response fits.
    assert truncate_pair(prompt, chosen, rejected, max_seq_length=13) == (prompt, [100, 101, 102], [200, 201])
    # The prompt is cut from the left to max_prompt_length first.
    out = truncate_pair(prompt, chosen, rejected, max_seq_length=8, max_prompt_length=4)
    assert out == ([6, 7, 8, 9], [100, 101, 102, 103], [200, 201])
    # A prompt leaving no room for any response token is an error.
    with pytest.raises(RecordError, match="prompt too long"):
        truncate_pair(prompt, chosen, rejected, max_seq_length=10)
    # Responses that become identical after truncation carry no preference.
    with pytest.raises(RecordError, match="identical responses"):
        truncate_pair(prompt, [5, 6, 7], [5, 6, 8], max_seq_length=12)


def test_prompt_head_is_kept_only_with_room_for_prompt_text():
    """The template head survives left truncation only when some of the prompt's own tokens fit
    after it; a head that fills the whole budget gives way to the prompt's last tokens."""
    prompt = list(range(10))
    assert truncate_prompt(prompt, max_length=4, keep_head=3) == [0, 1, 2, 9]
    assert truncate_prompt(prompt, max_length=4, keep_head=4) == [6, 7, 8, 9]
    assert truncate_prompt(prompt, max_length=4, keep_head=6) == [6, 7, 8, 9]
    assert truncate_prompt(prompt, max_length=10, keep_head=10) == prompt  # fits: nothing cut


def test_truncation_on_tokenized_pairs(tiny_tokenizer):
    config = PreferenceDataConfig(max_seq_length=64, max_prompt_length=40)
    dataset = PreferenceDataset(HH_RLHF_HELDOUT, tokenizer=tiny_tokenizer, config=config)
    full = PreferenceDataset(HH_RLHF_HELDOUT, tokenizer=tiny_tokenizer)
    assert len(dataset) + sum(dataset.skipped.values()) == 100
    full_by_line = {pair.line: pair for pair in full}
    head = prompt_head_length(tiny_tokenizer)
    assert head >= 1 and tiny_tokenizer.bos_id is not None
    cut = collections.Counter()
    for short in dataset:
        long = full_by_line[short.line]
        assert len(short.prompt_ids) <= 40
        assert short.prompt_ids[0] == tiny_tokenizer.bos_id  # BOS survives left truncation
        if short.prompt_ids != long.prompt_ids:
            cut["prompt"] += 1
            kept = 40 - head
            assert short.prompt_ids == long.prompt_ids[:head] + long.prompt_ids[-kept:]
        for part, kept_ids, whole in (("chosen", short.chosen_ids, long.chosen_ids),
                                      ("rejected", short.rejected_ids, long.rejected_ids)):
            assert len(short.prompt_ids) + len(kept_ids) <= 64
            assert kept_ids == whole[: len(kept_ids)]
            cut[part] += len(kept_ids) < len(whole)
    assert cut["prompt"] > 0 and cut["chosen"] > 0 and cut["rejected"] > 0
    assert dataset.truncated == cut  # every cut part is counted, and nothing else
    assert not full.truncated


def test_truncation_is_counted_and_logged(tmp_path, tiny_tokenizer, caplog):
    """Truncated pairs are kept, counted per part in ``truncated`` and logged; a record that
    becomes invalid by truncation is a skip, not a truncation."""
    records = [
        {"prompt": "short", "chosen": "a", "rejected": "b"},
        {"prompt": "long " * 60, "chosen": "a", "rejected": "b"},
        {"prompt": "short", "chosen": "long " * 60, "rejected": "b"},
        {"prompt": "short", "chosen": "same " * 60 + "x", "rejected": "same " * 60 + "y"},
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    config = PreferenceDataConfig(max_seq_length=48, max_prompt_length=16, skip_invalid=True)
    with caplog.at_level("WARNING"):
        dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer, config=config)
    assert [pair.line for pair in dataset] == [1, 2, 3]
    assert dict(dataset.skipped) == {"identical responses": 1}
    assert dict(dataset.truncated) == {"prompt": 1, "chosen": 1}
    assert dataset[2].chosen_ids[-1] != tiny_tokenizer.eos_id  # a cut response loses its eos
    assert ("loaded 3 preference pairs, truncated to fit max_seq_length=48, max_prompt_length=16 (pairs per cut part): "
            "{'prompt': 1, 'chosen': 1}") in caplog.messages


def test_prompt_head_is_bos_and_template_preamble(tiny_tokenizer):
    """The kept head is BOS plus the plain template's first marker, found without knowing the template."""
    head = prompt_head_length(tiny_tokenizer)
    preamble = [tiny_tokenizer.bos_id] + tiny_tokenizer.encode("\n\nHuman:")
    ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=True)
    assert ids[:head] == preamble[:head] and head >= 1
    assert truncate_prompt(list(range(10)), max_length=4, keep_head=2) == [0, 1, 8, 9]
    assert truncate_prompt(list(range(10)), max_length=2, keep_head=2) == [8, 9]
    assert truncate_prompt(list(range(3)), max_length=4, keep_head=2) == [0, 1, 2]


def test_missing_rejected_names_the_field(tmp_path, tiny_tokenizer):
    for record in ({"prompt": "x", "chosen": "a"}, {"chosen": "\n\nHuman: a\n\nAssistant: b"}):
        path = write_jsonl(tmp_path / "one.jsonl", [json.dumps(record).encode()])
        with pytest.raises(DataError) as info:
            load_preference_pairs(path, tokenizer=tiny_tokenizer)
        assert str(info.value) == f"{path}:1: missing field 'rejected'"


def test_config_validation():
    with pytest.raises(ValueError, match="max_prompt_length"):
        PreferenceDataConfig(max_seq_length=16, max_prompt_length=16)
    with pytest.raises(ValueError, match="max_seq_length"):
        PreferenceDataConfig(max_seq_length=1)


# --------------------------------------------------------------------------- bad records


BAD_LINES = [
    (b'{"prompt": "x", "chosen": "a"', "malformed json"),
    (b'["prompt", "chosen"]', "not an object"),
    (b'{"prompt": "x", "chosen": "a", "rejected": "\xff"}', "invalid utf-8"),
    (b'{"prompt": "x", "chosen": "a", "rejected": "\\ud800"}', "invalid utf-8"),
    (b'{"prompt": "x", "chosen": "a"}', "missing field"),
    (b'{"prompt": "x", "chosen": 3, "rejected": "b"}', "wrong type"),
    (b'{"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"}', "invalid messages"),
    (b'{"prompt": "x", "chosen": "  ", "rejected": "b"}', "empty response"),
    (b'{"prompt": "x", "chosen": "same", "rejected": "same"}', "identical responses"),
    (b'{"chosen": "no turns", "rejected": "at all"}', "not a dialogue"),
    (b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b", "rejected": "\\n\\nHuman: z\\n\\nAssistant: c"}', "no shared prefix"),
    (b'{"context": [{"role": "user", "content": "q"}], "response1": "a", "response2": "b", "overall_preference": 7}', "invalid value"),
    (b'{"context": [{"role": "user", "content": "q"}], "response1": "a", "response2": "b", "overall_preference": 1.5}', "invalid value"),
    (b'{"text": "hello"}', "unknown format"),
    (b'{"chosen": "\\n\\nHuman: a\\n\\nAssistant: b"}', "missing field"),
    (json.dumps({"prompt": "long " * 300, "chosen": "a", "rejected": "b"}).encode(), "prompt too long"),
]
GOOD = json.dumps({"prompt": "x", "chosen": "a", "rejected": "b"}).encode()


@pytest.mark.parametrize("line, reason", BAD_LINES, ids=[reason for _, reason in BAD_LINES])
def test_bad_record_raises_naming_file_and_line(tmp_path, tiny_tokenizer, line, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, line, GOOD])
    config = PreferenceDataConfig(max_seq_length=256)
    with pytest.raises(DataError) as info:
        load_preference_pairs(path, tokenizer=tiny_tokenizer, config=config)
    assert (info.value.path, info.value.line, info.value.reason) == (path, 2, reason)
    assert str(info.value).startswith(f"{path}:2: {reason}")


def test_bad_records_are_counted_and_logged_when_skipping(tmp_path, tiny_tokenizer, caplog):
    lines = [GOOD] + [line for line, _ in BAD_LINES] + [b"", b"   ", GOOD]  # blank lines are not records
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    config = PreferenceDataConfig(max_seq_length=256, skip_invalid=True)
    with caplog.at_level("WARNING"):
        dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer, config=config)
    assert [p.line for p in dataset] == [1, len(lines)]
    expected = {}
    for _, reason in BAD_LINES:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(dataset.skipped) == expected
    for number, (_, reason) in enumerate(BAD_LINES, start=2):
        assert any(f"{path}:{number}: {reason}" in message for message in caplog.messages)


def test_skips_are_logged_by_rank_0_only(tmp_path, tiny_tokenizer, caplog, monkeypatch):
    """Every rank reads the data and counts the same skips; only rank 0 logs them (each rank
    logged every skipped record, so a launch printed each one world-size times)."""
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, BAD_LINES[0][0], GOOD])
    config = PreferenceDataConfig(max_seq_length=256, skip_invalid=True)
    for rank, logged in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level("WARNING"):
            dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer, config=config)
        assert dict(dataset.skipped) == {"malformed json": 1}
        assert any(f"{path}:2: malformed json" in m for m in caplog.messages) is logged, caplog.messages


def test_repeated_pairs_are_kept_and_counted(tmp_path, tiny_tokenizer, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    other = {"prompt": "Hi there", "chosen": "Hello!", "rejected": "Go away."}
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, other, GOOD, GOOD])
    with caplog.at_level("WARNING"):
        dataset = PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(max_seq_length=256))
    assert [p.line for p in dataset] == [1, 2, 3, 4] and not dataset.skipped
    assert (f"2 preference pairs repeat an earlier pair token for token (first: {path}:3 repeats {path}:1); kept, "
            "so each trains as often as it appears") in caplog.messages


def test_special_token_text_is_counted_and_said(tmp_path, caplog, monkeypatch):
    """Record text that holds a special token's text (a prompt already rendered with a chat
    template) becomes that token's id; the loader says how many pairs hold one, and where."""
    monkeypatch.setenv("RANK", "0")
    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path / "tok", chat_template=CHAT_TEMPLATE))
    templated = {"prompt": "<s><|user|>hello</s><|assistant|>", "chosen": "hello world", "rejected": "the fox"}
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "hello", "chosen": "world", "rejected": "fox"},
                                                  {"prompt": "hello", "chosen": "world</s>", "rejected": "fox"},
                                                  templated])
    with caplog.at_level("WARNING"):
        dataset = PreferenceDataset(path, tokenizer=tokenizer, config=PreferenceDataConfig(max_seq_length=256))
    assert [pair.special_text for pair in dataset] == [None, "</s>", "</s>"]
    assert (f"special-token text in 2 preference pairs (first: {path}:2 holds '</s>') is tokenized as that "
            "token; records already formatted with a chat template are formatted twice: give plain text or chat "
            "messages") in caplog.messages
    assert tokenizer.eos_id in dataset[1].chosen_ids[:-1]  # what the warning is about
    assert load_tokenizer("tiny").special_text_in(["<s> </s>"]) is None  # SentencePiece reads them as text


def test_empty_dataset_and_missing_file(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [BAD_LINES[0][0]])
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(skip_invalid=True))
    assert str(info.value) == f"{path}: no usable preference pairs: skipped: {{'malformed json': 1}}"
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        PreferenceDataset(tmp_path / "missing.jsonl", tokenizer=tiny_tokenizer)
    with pytest.raises(DataError, match="unknown file type"):
        PreferenceDataset(write_jsonl(tmp_path / "pairs.csv", [GOOD]), tokenizer=tiny_tokenizer)


@pytest.mark.parametrize("name, content", [("empty.jsonl", b""), ("blank.jsonl", b"\n  \n\r\n"),
                                           ("bom.jsonl", b"\xef\xbb\xbf\n"), ("empty.json", b"[]\n")])
def test_empty_file_says_it_is_empty(tmp_path, tiny_tokenizer, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tiny_tokenizer, config=PreferenceDataConfig(skip_invalid=True))
    assert str(info.value) == f"{path}: empty data file: no records to read (expected preference pairs)"
    other = write_jsonl(tmp_path / "also_empty.jsonl", [])
    with pytest.raises(DataError) as info:
        PreferenceDataset([path, other], tokenizer=tiny_tokenizer)
    assert str(info.value) == f"{path}, {other}: empty data files: no records to read (expected preference pairs)"
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])  # an empty file among others is named, not passed over
    with pytest.raises(DataError) as info:
        PreferenceDataset([good, path], tokenizer=tiny_tokenizer)
    assert str(info.value) == (f"{path}: empty data file: no records to read (expected preference pairs; the other "
                               "files hold records)")


def test_a_file_whose_records_are_all_skipped_is_counted_not_called_empty(tmp_path, tiny_tokenizer):
    """Under --skip-invalid-records a file of bad records beside a good one has records: they are
    skipped and counted, not refused as an empty file."""
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": USER, "chosen": "Hey", "rejected": "Hey"}] * 2)
    pairs, skipped = load_preference_pairs([good, bad], tokenizer=tiny_tokenizer,
                                           config=PreferenceDataConfig(skip_invalid=True))
    assert len(pairs) == 1 and skipped == {"identical responses": 2}


def test_directory_as_data_path_says_it_is_a_directory(tmp_path, tiny_tokenizer):
    with pytest.raises(DataError) as info:
        PreferenceDataset(tmp_path, tokenizer=tiny_tokenizer)
    assert str(info.value) == (f"{tmp_path}: is a directory: expected a data file "
                               "(.jsonl, .json, .jsonl.gz, .json.gz, .parquet)")


def test_prompt_head_is_measured_on_the_prompts_own_messages(tmp_path):
    """A template that adds a default system prompt when there is none: a prompt with its own short
    system prompt keeps that one and the template's markers as its head, not as many tokens as the
    default preamble has (which reached into the user's text)."""
    template = ("{% if messages[0]['role'] != 'system' %}<s>[SYS]You are a helpful assistant made by someone[/SYS]"
                "{% endif %}{% for m in messages %}{% if m['role'] == 'system' %}<s>[SYS]{{ m['content'] }}[/SYS]"
                "{% else %}[{{ m['role'] }}]{{ m['content'] }}</s>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    tokenizer = load_tokenizer(save_hf_tokenizer(str(tmp_path / "tok"), chat_template=template))
    user = {"role": "user", "content": "FIRSTWORDS " + "the quick brown fox " * 30 + "LASTQUESTION?"}
    for messages, head_text in (([{"role": "system", "content": "Be brief"}, user], "<s>[SYS]Be brief[/SYS][user]"),
                                ([user], "<s>[SYS]You are a helpful assistant made by someone[/SYS][user]")):
        prompt, _, _ = tokenize_preference(PreferenceText(messages, "hello", "world"), tokenizer,
                                           max_seq_length=200, max_prompt_length=100)
        text = tokenizer.decode(prompt)
        assert len(prompt) == 100 and text.startswith(head_text) and text.endswith("LASTQUESTION?</s>[assistant]")
        assert "FIRSTWORDS" not in text
