"""Train the bundled tiny SentencePiece tokenizer ``tiny.model`` (run once; deterministic).

    python megatron_prune/data/tokenizer/build_tiny.py [--output PATH]

(Run it as a script: ``megatron_prune.data.tokenizer`` is the tokenizer module, not this folder.)

A 512-piece byte-fallback BPE model for the ``--model-preset tiny`` model (vocab 512), trained
on the bundled HH-RLHF and GSM8K samples in file order with one thread and no input sampling,
so the same samples always give the same model bytes.

Ids: ``<pad>`` 0, ``<unk>`` 1, ``<s>`` (bos) 2, ``</s>`` (eos) 3, then the user-defined pieces
(newline and the HH-RLHF turn markers), the 256 byte pieces ``<0x00>``..``<0xFF>`` and the
learned merges. Text is not normalised and no dummy prefix is added, so
``decode(encode(text)) == text`` for any UTF-8 text that does not contain U+2581 ("▁",
SentencePiece's own space symbol, which decodes as a space).
"""

from __future__ import annotations

import argparse
import io
import json
import os
from typing import Iterator

VOCAB_SIZE = 512
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
USER_DEFINED_SYMBOLS = ["\n", "\n\nHuman:", "\n\nAssistant:"]
HERE = os.path.dirname(os.path.abspath(__file__))
SAMPLES = os.path.join(os.path.dirname(HERE), "samples")
TRAINING_FILES = {
    "hh_rlhf_sample.jsonl": ("chosen", "rejected"),
    "gsm8k_sample.jsonl": ("question", "answer"),
}


def training_texts(samples_dir: str = SAMPLES) -> Iterator[str]:
    for name, fields in TRAINING_FILES.items():
        with open(os.path.join(samples_dir, name), encoding="utf-8") as handle:
            for line in handle:
                record = json.loads(line)
                for field in fields:
                    yield record[field]


def train_tiny_model(samples_dir: str = SAMPLES) -> bytes:
    """Return the serialized SentencePiece model trained on the bundled samples."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=training_texts(samples_dir),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        byte_fallback=True,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        user_defined_symbols=USER_DEFINED_SYMBOLS,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        character_coverage=1.0,
        max_sentence_length=1 << 20,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=os.path.join(HERE, "tiny.model"))
    args = parser.parse_args()
    with open(args.output, "wb") as handle:
        handle.write(train_tiny_model())
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
