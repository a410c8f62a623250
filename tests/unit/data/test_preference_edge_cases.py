"""Preference records at the edges: non-ASCII prompts cut from the left, HH transcripts stripped of their
leading newlines, responses only the tokenizer cannot tell apart."""

from __future__ import annotations

import pytest

from megatron_prune.data.preference import parse_preference_record, prompt_head, tokenize_preference

from .helpers import save_hf_tokenizer

# Byte-fallback and byte-level tokenizers spell each of these characters with several tokens.
CJK_PROMPT = "请用中文回答这个问题：今天天气怎么样？我想出去散步😀，东京、大阪和京都哪里更好？"


def _tokenizers(tmp_path):
    from megatron_prune.data.tokenizer import load_tokenizer

    return {"tiny": load_tokenizer("tiny"),
            "byte-level BPE": load_tokenizer(save_hf_tokenizer(tmp_path / "hf", chat_template=None))}


@pytest.mark.parametrize("name", ["tiny", "byte-level BPE"])
def test_left_truncated_prompt_starts_on_a_whole_character(tmp_path, name):
    """Cut from the left to any --max-prompt-length, a prompt keeps its head and then text that is
    the end of the rendered prompt: no orphan bytes of a character the cut went through (which
    decode as U+FFFD), and no more tokens lost than such a character has."""
    tokenizer = _tokenizers(tmp_path)[name]
    text = parse_preference_record({"prompt": CJK_PROMPT, "chosen": "好的", "rejected": "不"})
    whole = tokenizer.apply_chat_template(text.prompt, add_generation_prompt=True, tokenize=True)
    rendered = tokenizer.apply_chat_template(text.prompt, add_generation_prompt=True)
    head = prompt_head(tokenizer, text.prompt, whole)
    assert "\ufffd" not in tokenizer.decode(whole)
    for max_prompt_length in range(head + 4, len(whole)):
        prompt_ids, _, _ = tokenize_preference(text, tokenizer, max_seq_length=len(whole) + 16,
                                               max_prompt_length=max_prompt_length)
        assert prompt_ids[:head] == whole[:head]
        tail = tokenizer.decode(prompt_ids[head:])
        assert "\ufffd" not in tail, (max_prompt_length, tail)
        assert rendered.endswith(tail)
        # no more lost than the bytes a UTF-8 character has after its first (3 at most)
        assert max_prompt_length - 3 <= len(prompt_ids) <= max_prompt_length


# ------------------------------------------------------------------ HH transcripts without their leading newlines


def test_hh_transcripts_stripped_of_their_leading_newlines_are_the_same_dialogue():
    """``text.strip()`` on an HH-RLHF record leaves ``"Human: ..."``; as an explicit prompt that form is
    read as the dialogue, and as chosen/rejected transcripts it must be too (not refused)."""
    prompt = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: A joke?\n\nAssistant:"
    record = {"chosen": prompt + " Why did the chicken...", "rejected": prompt + " No."}
    expected = parse_preference_record(record)
    for strip in ("\n", "\n\n"):
        stripped = {key: value.removeprefix(strip) for key, value in record.items()}
        assert parse_preference_record(stripped) == expected
        assert parse_preference_record(stripped, format="hh") == expected


# --------------------------------------------------------------------------- responses the tokenizer cannot tell apart


def _nfc_tokenizer(directory):
    """A byte-level BPE tokenizer that normalizes text to NFC first (as Qwen2's does)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_prune.data.tokenizer import load_tokenizer

    raw = RawTokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["hello world"] * 10, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", bos_token="<s>").save_pretrained(str(directory))
    return load_tokenizer(str(directory))


def test_responses_that_tokenize_alike_are_not_said_to_be_truncated(tmp_path):
    """Two texts that differ only in their Unicode normalization form are one token sequence to an
    NFC tokenizer: the record carries no preference, and its error must not blame a truncation
    that never happened."""
    from megatron_prune.data.preference import PreferenceDataConfig, PreferenceDataset
    from megatron_prune.data.records import DataError

    from .helpers import write_jsonl

    tokenizer = _nfc_tokenizer(tmp_path / "nfc")
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert composed != decomposed and tokenizer.encode(composed) == tokenizer.encode(decomposed)
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Hi", "chosen": composed, "rejected": decomposed}])
    with pytest.raises(DataError) as info:
        PreferenceDataset(path, tokenizer=tokenizer, config=PreferenceDataConfig(max_seq_length=64))
    message = str(info.value)
    assert message.startswith(f"{path}:1: identical responses: ") and "truncat" not in message
    # A pair that only truncation makes identical still says so.
    long = {"prompt": "Hi", "chosen": "hello " * 40 + "a", "rejected": "hello " * 40 + "b"}
    path = write_jsonl(tmp_path / "long.jsonl", [long])
    with pytest.raises(DataError, match=r"long\.jsonl:1: identical responses: .* after truncation"):
        PreferenceDataset(path, tokenizer=tokenizer, config=PreferenceDataConfig(max_seq_length=32))
