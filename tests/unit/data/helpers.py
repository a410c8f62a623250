"""Helpers for the data tests."""

from __future__ import annotations

import json


def write_jsonl(path, records) -> str:
    """Write records (dicts as JSON, bytes verbatim) one per line; return the path."""
    with open(path, "wb") as handle:
        for record in records:
            line = record if isinstance(record, bytes) else json.dumps(record, ensure_ascii=False).encode("utf-8")
            handle.write(line + b"\n")
    return str(path)


def save_hf_tokenizer(directory, *, chat_template: str | None, bos: bool = True) -> str:
    """A small byte-level BPE tokenizer with <pad>, <s>, </s> saved as a Hugging Face directory."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(["hello world", "the quick brown fox"] * 10, trainer=trainer)
    specials = {"bos_token": "<s>", "pad_token": "<pad>"} if bos else {}
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", **specials)
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(directory))
    return str(directory)


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Modelled on Qwen3's template in full: a final reply holding a think block is rewritten around it
# (the reasoning moves into the template's own block), and ``enable_thinking=false`` ends the
# generation prompt with an empty think block, which the final turn then repeats.
QWEN3_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}"
    "{% set content = m['content'] %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n<think>\n{{ reasoning }}\n</think>\n\n{{ content | trim }}</s>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
