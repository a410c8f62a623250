"""Tokenizers: the bundled tiny model, SentencePiece files, local HF directories, chat templates."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_prune.data import GSM8K_SAMPLE, HH_RLHF_HELDOUT, HH_RLHF_SAMPLE
from megatron_prune.data.preference import PreferenceDataConfig, load_preference_pairs
from megatron_prune.data.records import DataError
from megatron_prune.data.tokenizer import (
    BUNDLED_TOKENIZERS,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
    load_tokenizer,
    render_plain_template,
)

from .helpers import CHAT_TEMPLATE, QWEN3_TEMPLATE, save_hf_tokenizer, write_jsonl

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def sample_texts():
    with open(HH_RLHF_SAMPLE, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            yield record["chosen"]
            yield record["rejected"]
    with open(GSM8K_SAMPLE, encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            yield record["question"]
            yield record["answer"]


def test_tiny_special_ids_and_vocab(tiny_tokenizer):
    assert tiny_tokenizer.vocab_size == 512
    assert (tiny_tokenizer.pad_id, tiny_tokenizer.bos_id, tiny_tokenizer.eos_id) == (0, 2, 3)
    assert len({tiny_tokenizer.pad_id, tiny_tokenizer.bos_id, tiny_tokenizer.eos_id}) == 3


def test_tiny_round_trips_the_bundled_samples(tiny_tokenizer):
    with open(HH_RLHF_HELDOUT, encoding="utf-8") as handle:
        heldout = [json.loads(line)["chosen"] for line in handle]
    for text in [*sample_texts(), *heldout]:
        ids = tiny_tokenizer.encode(text)
        assert all(0 <= i < 512 for i in ids)
        assert tiny_tokenizer.decode(ids) == text


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\u2581")))
def test_tiny_encodes_any_text_by_byte_fallback(text):
    tokenizer = load_tokenizer("tiny")
    ids = tokenizer.encode(text)
    assert all(0 <= i < 512 for i in ids)
    assert 1 not in ids  # <unk>: byte fallback covers every character
    assert tokenizer.decode(ids) == text


def test_build_tiny_is_deterministic():
    path = os.path.join(os.path.dirname(BUNDLED_TOKENIZERS["tiny"]), "build_tiny.py")
    spec = importlib.util.spec_from_file_location("build_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(BUNDLED_TOKENIZERS["tiny"], "rb") as handle:
        assert module.train_tiny_model() == handle.read()


def test_plain_template_is_hh_rlhf(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(MESSAGES)
    assert text == (
        "\n\nSystem: Be brief.\n\nHuman: What is 2+2?\n\nAssistant: 4\n\nHuman: And 3+3?\n\nAssistant:"
    )
    assert render_plain_template(MESSAGES, add_generation_prompt=False) == text[: -len("\n\nAssistant:")]
    ids = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    assert ids[0] == tiny_tokenizer.bos_id and tiny_tokenizer.decode(ids[1:]) == text
    assert tiny_tokenizer.render_response("6") == " 6"


@pytest.mark.parametrize(
    "messages,message",
    [
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        ([{"role": "user"}], "message 0 content must be a string"),
        ([{"role": "robot", "content": "x"}], "message 0 has role 'robot'"),
        ([{"role": "user", "content": 3}], "message 0 content must be a string"),
        (["x"], "message 0 must be an object"),
    ],
)
def test_chat_template_rejects_bad_messages(tiny_tokenizer, messages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny_tokenizer.apply_chat_template(messages)


def test_sentencepiece_file_path(tmp_path):
    import sentencepiece as spm

    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["hello world", "the quick brown fox jumps"] * 20),
        model_prefix=str(prefix),
        vocab_size=25,
        model_type="unigram",
        minloglevel=2,
    )
    tokenizer = load_tokenizer(f"{prefix}.model")
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert tokenizer.vocab_size == 25
    assert tokenizer.pad_id == tokenizer.eos_id  # no pad piece: pad with eos
    assert tokenizer.decode(tokenizer.encode("hello world")).strip() == "hello world"


def test_hf_directory_with_chat_template(tmp_path):
    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE))
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template
    assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2)
    text = tokenizer.apply_chat_template(MESSAGES[1:2])
    assert text == "<s><|user|>What is 2+2?</s><|assistant|>"
    ids = tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=True)
    assert ids[0] == tokenizer.bos_id and ids.count(tokenizer.eos_id) == 1  # special tokens in the text
    assert tokenizer.render_response("4") == "4"
    sample = "héllo 🙂 world\n\nnew"
    assert tokenizer.decode(tokenizer.encode(sample)) == sample


def test_hf_directory_without_chat_template_uses_plain_template(tmp_path):
    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path, chat_template=None, bos=False))
    assert not tokenizer.has_chat_template
    assert tokenizer.bos_id is None and tokenizer.pad_id == tokenizer.eos_id
    assert tokenizer.apply_chat_template(MESSAGES) == render_plain_template(MESSAGES)
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    assert tokenizer.decode(ids) == render_plain_template(MESSAGES)
    assert tokenizer.render_response("4") == " 4"


EXPECTED = ("; a tokenizer is a bundled name (tiny), a SentencePiece .model file or a local Hugging Face tokenizer "
            "directory (as written by save_pretrained)")


def test_missing_or_bad_tokenizer_errors_name_the_path(tmp_path):
    """Each error names the path, what is wrong and what a tokenizer may be, on one line; a path
    that exists is a TokenizerError (the CLI prints it as a one-line usage error)."""
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as info:
        load_tokenizer(missing)
    assert str(info.value) == f"{missing}: tokenizer not found{EXPECTED}"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(empty)
    assert str(info.value) == (f"{empty}: not a Hugging Face tokenizer directory: it holds none of tokenizer.json, "
                               f"tokenizer_config.json, tokenizer.model, vocab.json{EXPECTED}")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(broken)
    assert str(info.value).startswith(f"{broken}: not a Hugging Face tokenizer directory: its files do not load (")
    assert str(info.value).endswith(EXPECTED) and "\n" not in str(info.value)
    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "x", "chosen": "a", "rejected": "b"}])
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(data)
    assert re.fullmatch(rf"{re.escape(data)}: not a SentencePiece model \(.+\){re.escape(EXPECTED)}", str(info.value))


def test_hf_tokenizer_file_instead_of_its_directory_points_to_the_directory(tmp_path):
    directory = save_hf_tokenizer(tmp_path / "tok", chat_template=None)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(os.path.join(directory, "tokenizer.json"))
    assert str(info.value) == (f"{directory}/tokenizer.json: a Hugging Face tokenizer file, not a SentencePiece "
                               f"model: pass its directory {directory}{EXPECTED}")
    assert isinstance(load_tokenizer(directory), HFTokenizer)  # the way out works


def test_preference_pairs_through_a_chat_template(tmp_path):
    strict = CHAT_TEMPLATE.replace(
        "{% for m in messages %}",
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}",
    )
    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path / "tok", chat_template=strict))
    records = [
        {"chosen": "\n\nHuman: hello\n\nAssistant: world", "rejected": "\n\nHuman: hello\n\nAssistant: fox"},
        {"prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "chosen": "a", "rejected": "b"},
    ]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    with pytest.raises(DataError, match=f"{path}:2: chat template failed.*no system role"):
        load_preference_pairs(path, tokenizer=tokenizer)
    pairs, skipped = load_preference_pairs(path, tokenizer=tokenizer, config=PreferenceDataConfig(skip_invalid=True))
    assert skipped == {"chat template failed": 1}
    pair = pairs[0]
    assert tokenizer.decode(pair.prompt_ids) == "<s><|user|>hello</s><|assistant|>"
    assert pair.chosen_ids == tokenizer.encode("world") + [tokenizer.eos_id]
    assert pair.rejected_ids == tokenizer.encode("fox") + [tokenizer.eos_id]


# Modelled on Qwen3's template: the last assistant turn after the last user message opens with an
# empty think block, and content is trimmed; every turn ends "</s>\n".
THINKING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ m['content'] | trim }}</s>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_response_is_what_the_chat_template_renders_for_it(tmp_path):
    """A pair's response is the template's own rendering of the reply as the next assistant turn (here
    the empty think block and the trimming), up to the eos that ends it: prompt + response is the
    whole conversation as the model's template writes it."""
    from megatron_prune.data.preference import PreferenceText, tokenize_preference

    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path, chat_template=THINKING_TEMPLATE))
    prompt = MESSAGES[:2]
    text = PreferenceText(prompt=prompt, chosen=" It is 4.\n", rejected="5")
    prompt_ids, chosen, rejected = tokenize_preference(text, tokenizer, max_seq_length=512)
    for reply, ids in ((text.chosen, chosen), (text.rejected, rejected)):
        whole = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": reply}],
                                              add_generation_prompt=False)
        assert ids[-1] == tokenizer.eos_id and ids.count(tokenizer.eos_id) == 1
        assert tokenizer.decode(prompt_ids + ids) == whole.removesuffix("\n")
    assert tokenizer.decode(chosen) == "<think>\n\n</think>\n\nIt is 4.</s>"


def test_a_sentencepiece_model_with_a_dummy_prefix_gives_a_response_one_space(tmp_path):
    """Llama-2-style models prefix every encoded text with a word boundary; the response must not get
    a second one: its pieces are those of the whole transcript."""
    import sentencepiece as spm

    from megatron_prune.data.preference import parse_preference_record, tokenize_preference

    corpus = list(sample_texts())[:200]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_prefix=str(tmp_path / "sp"), model_type="bpe", vocab_size=600,
        byte_fallback=True, bos_id=1, eos_id=2, unk_id=0, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, character_coverage=1.0, minloglevel=2)
    tokenizer = load_tokenizer(tmp_path / "sp.model")
    record = {"chosen": "\n\nHuman: What is 2+2?\n\nAssistant: It is 4.",
              "rejected": "\n\nHuman: What is 2+2?\n\nAssistant: five"}
    prompt_ids, chosen, _ = tokenize_preference(parse_preference_record(record), tokenizer, max_seq_length=512)
    assert tokenizer.decode(prompt_ids + chosen[:-1]) == record["chosen"]
    whole = tokenizer.encode(record["chosen"])
    assert chosen[:-1] == whole[-len(chosen) + 1:]


def test_eos_text_inside_a_reply_does_not_cut_it(tmp_path):
    """A template whose turns end with another marker than eos: the reply's own text may hold the eos
    text (a reply about tokens), and must survive whole; only what the template writes after it is cut."""
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path, chat_template=template))
    reply = "Append </s> after the text, then go on."
    assert tokenizer.render_response(reply, MESSAGES[1:2]) == reply + "<|end|>"


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}], ids=["thinking", "non-thinking"])
def test_a_rewritten_reply_keeps_the_templates_rendering(tmp_path, kwargs):
    """A reply whose think block the template rewrites: prompt + response is the whole conversation
    as the template writes it. With thinking off the prompt holds the empty block, so a reply
    holding a think block of its own follows it as written (the template would replace the
    prompt's block)."""
    from megatron_prune.data.preference import PreferenceText, tokenize_preference

    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path, chat_template=QWEN3_TEMPLATE), chat_template_kwargs=kwargs)
    prompt = MESSAGES[:2]
    text = PreferenceText(prompt=prompt, chosen="<think>\nadd them\n</think>\n\nIt is 4.", rejected="It is 5.")
    prompt_ids, chosen, rejected = tokenize_preference(text, tokenizer, max_seq_length=512)
    for reply, ids in ((text.chosen, chosen), (text.rejected, rejected))[1 if kwargs else 0:]:
        whole = tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": reply}],
                                              add_generation_prompt=False)
        assert tokenizer.decode(prompt_ids + ids) == whole.removesuffix("\n")
    generation = tokenizer.decode(prompt_ids)
    if kwargs:  # the empty block is the prompt's, so a plain reply's response is the reply alone
        assert generation.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert tokenizer.decode(rejected) == "It is 5.</s>"
        assert tokenizer.decode(chosen) == "<think>\nadd them\n</think>\n\nIt is 4.</s>"
    else:
        assert generation.endswith("<|im_start|>assistant\n")
        assert tokenizer.decode(rejected) == "<think>\n\n</think>\n\nIt is 5.</s>"


def test_each_prompt_is_framed_once_for_its_pair(tmp_path, monkeypatch):
    """A pair's two responses share their prompt's generation prompt and sentinel rendering: four
    template renderings a pair, not six, and alternating prompts are never mixed up."""
    tokenizer = load_tokenizer(save_hf_tokenizer(tmp_path, chat_template=THINKING_TEMPLATE))
    calls = []
    render = tokenizer._tok.apply_chat_template
    monkeypatch.setattr(tokenizer._tok, "apply_chat_template", lambda *a, **k: calls.append(1) or render(*a, **k))
    first, second = MESSAGES[:2], [{"role": "user", "content": "And 3+3?"}]
    assert tokenizer.render_response("4", first) == "<think>\n\n</think>\n\n4"
    assert tokenizer.render_response("5", first) == "<think>\n\n</think>\n\n5"
    assert len(calls) == 4
    assert tokenizer.render_response("6", second) == "<think>\n\n</think>\n\n6"
    assert tokenizer.render_response("7", first) == "<think>\n\n</think>\n\n7"


@pytest.mark.parametrize("text, message", [
    ("enable_thinking=false", "must be a JSON object such as"),
    ('["enable_thinking"]', "must be a JSON object such as .*got list"),
    ('{"add_generation_prompt": false, "tokenize": true}', "may not set add_generation_prompt, tokenize: the trainers"),
])
def test_chat_template_kwargs_that_are_not_template_variables_are_refused(text, message):
    from megatron_prune.config import ModelConfig

    with pytest.raises(ValueError, match=f"--chat-template-kwargs {message}"):
        ModelConfig(chat_template_kwargs=text)
    assert ModelConfig(chat_template_kwargs='{"enable_thinking": false}').chat_template_args == {"enable_thinking": False}


def test_a_stop_id_that_is_an_added_token_ends_replies(tmp_path):
    """Chat models end their turns with a token added to the base vocabulary (<|im_end|>, <|eot_id|>):
    its id counts in the vocabulary size, so a generation_config.json listing it keeps it as a stop id."""
    from transformers import AutoTokenizer

    directory = save_hf_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(directory)
    base = hf.vocab_size
    hf.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    hf.save_pretrained(directory)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end >= base  # outside the base vocabulary
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 2]}))
    tokenizer = load_tokenizer(directory)
    assert tokenizer.vocab_size == im_end + 1
    assert tokenizer.stop_ids == {2, im_end}


def test_a_post_processor_that_adds_bos_adds_none_to_encoded_text(tmp_path):
    """A tokenizer.json whose post-processor adds BOS (Llama-2/3 style): encode gives the text's own
    tokens, so a response starts without a BOS, and a prompt rendered by a chat template that writes
    BOS itself holds exactly one."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    directory = save_hf_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(directory)
    hf._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf.save_pretrained(directory)
    assert AutoTokenizer.from_pretrained(directory).encode("hello")[0] == 1  # the saved post-processor adds BOS
    tokenizer = load_tokenizer(directory)
    assert tokenizer.bos_id == 1
    hello = tokenizer.encode("hello")
    assert 1 not in hello and tokenizer.decode(hello) == "hello"
    ids = tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=True)
    assert ids[0] == 1 and ids.count(1) == 1
    assert tokenizer.decode(ids) == "<s><|user|>What is 2+2?</s><|assistant|>"


def test_a_json_true_among_the_generation_eos_ids_is_no_token(tmp_path):
    """A JSON true in generation_config.json's eos_token_id is no token id (Python's True == 1): it is
    dropped, not read as id 1."""
    directory = save_hf_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, True]}))
    assert load_tokenizer(directory).stop_ids == {2}
