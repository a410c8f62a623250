"""Tokenizers: one small interface over Hugging Face tokenizers and SentencePiece models.

Everything is local: a Hugging Face tokenizer is read from a directory (never a hub name), a
SentencePiece model from a ``.model`` file, and ``load_tokenizer("tiny")`` returns the bundled
512-piece model of the ``--model-preset tiny`` model (built by ``tokenizer/build_tiny.py``).

Chat formatting. A tokenizer with its own chat template (a Hugging Face tokenizer whose
``chat_template`` is set) uses it. Every other tokenizer uses the *plain template*, the
HH-RLHF transcript format::

    "\\n\\nSystem: {system}"      (a system message, if any)
    "\\n\\nHuman: {user}"
    "\\n\\nAssistant: {assistant}"
    ...
    "\\n\\nAssistant:"            (the generation prompt)

and an assistant response follows the generation prompt after one space
(``render_response``; none is added where the SentencePiece model prefixes every text with one), so
that prompt + response is exactly an HH-RLHF transcript. With a chat template, a response is what
the template renders after the generation prompt when the reply is the next assistant turn, up to
the first eos it writes after the reply (e.g. Qwen3's empty ``<think></think>`` block before the
reply). ``--chat-template-kwargs`` gives the template extra variables (``enable_thinking``). An empty
message renders as the bare marker (``"\\n\\nHuman:"``). Token ids of a rendered prompt start
with ``bos_id`` when the plain template is used and the tokenizer has one; a model's own chat
template decides that itself (its rendered text carries any special tokens it wants).
"""

from __future__ import annotations

import abc
import functools
import json
import logging
import os
from typing import Any, Sequence

logger = logging.getLogger(__name__)

BUNDLED_TOKENIZER_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer")
BUNDLED_TOKENIZERS = {"tiny": os.path.join(BUNDLED_TOKENIZER_DIR, "tiny.model")}
"""Names that :func:`load_tokenizer` resolves to files shipped with the package."""

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory holding none of these is not a Hugging Face tokenizer."""
EXPECTED_TOKENIZER = (f"a tokenizer is a bundled name ({', '.join(BUNDLED_TOKENIZERS)}), a SentencePiece .model file or a "
                      "local Hugging Face tokenizer directory (as written by save_pretrained)")
"""What :func:`load_tokenizer` accepts; ends every :class:`TokenizerError`."""

PLAIN_ROLE_MARKERS = {"system": "\n\nSystem:", "user": "\n\nHuman:", "assistant": "\n\nAssistant:"}
"""Turn markers of the plain (HH-RLHF) chat template, by message role."""
PLAIN_GENERATION_PROMPT = PLAIN_ROLE_MARKERS["assistant"]

Message = dict[str, str]

RESERVED_TEMPLATE_ARGS = frozenset({"messages", "conversation", "add_generation_prompt", "continue_final_message",
                                    "tokenize", "chat_template", "tools", "documents", "return_tensors",
                                    "return_dict", "padding", "truncation", "max_length", "tokenizer_kwargs",
                                    "return_assistant_tokens_mask", "sanitize_control_tokens", "bos_token",
                                    "eos_token", "pad_token", "unk_token"})
"""Keyword arguments of ``apply_chat_template`` (and variables it sets itself) that the trainers
choose; ``--chat-template-kwargs`` may not set them."""


def parse_chat_template_kwargs(text: str) -> dict[str, Any]:
    """The variables a ``--chat-template-kwargs`` JSON object gives the chat template; ValueError
    naming the flag when ``text`` is not a JSON object or sets a variable the trainers choose."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": false}}', "
                         f"got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": false}}', "
                         f"got {type(value).__name__} {text!r}")
    reserved = sorted(RESERVED_TEMPLATE_ARGS & value.keys())
    if reserved:
        raise ValueError(f"--chat-template-kwargs may not set {', '.join(reserved)}: the trainers set "
                         f"{'it' if len(reserved) == 1 else 'them'} for each prompt and response they render")
    return value


class TokenizerError(ValueError):
    """A tokenizer path that exists but holds no usable tokenizer; the message names the path,
    what is wrong and what is expected (the CLI prints it as one line)."""

    def __init__(self, path: str, problem: str):
        self.path = path
        super().__init__(f"{path}: {problem}; {EXPECTED_TOKENIZER}")


class Tokenizer(abc.ABC):
    """Text <-> token ids, special ids and chat formatting (see the module docstring)."""

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens added."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included; every id is below it."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None:
        """Beginning-of-sequence id, or None when the tokenizer has none."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id; every response ends with it."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """Padding id (the eos id when the tokenizer defines no pad token)."""

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end a generated reply: eos, and for a Hugging Face tokenizer directory the eos ids
        of a ``generation_config.json`` beside it (a chat model may end its turns with another token
        than eos; :func:`generation_eos_ids`)."""
        return frozenset({self.eos_id})

    @property
    def has_chat_template(self) -> bool:
        """True when the tokenizer brings its own chat template (else the plain template is used)."""
        return False

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        """Render ``messages`` as a prompt (text, or token ids with ``tokenize=True``)."""
        validate_messages(messages)
        text = render_plain_template(messages, add_generation_prompt=add_generation_prompt)
        if not tokenize:
            return text
        prefix = [self.bos_id] if self.bos_id is not None else []
        return prefix + self.encode(text)

    def render_response(self, content: str, prompt: Sequence[Message] | None = None) -> str:
        """The text that follows the generation prompt of ``prompt`` for an assistant reply ``content``
        (before the eos id that ends every response)."""
        return " " + content if content else content

    @property
    def special_texts(self) -> tuple[str, ...]:
        """Texts that :meth:`encode` turns into a special token's id wherever they occur (none for
        SentencePiece, which encodes ``<s>`` in text as plain characters)."""
        return ()

    def special_text_in(self, texts: Sequence[str]) -> str | None:
        """The first special token's text found in any of ``texts`` (record text that was already
        formatted with a chat template holds them), else None."""
        return next((special for special in self.special_texts for text in texts if special in text), None)


def validate_messages(messages: Any) -> None:
    """Raise ValueError unless ``messages`` is a non-empty list of {"role", "content"} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {index} must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in PLAIN_ROLE_MARKERS:
            raise ValueError(f"message {index} has role {role!r}; expected one of {', '.join(PLAIN_ROLE_MARKERS)}")
        if not isinstance(content, str):
            raise ValueError(f"message {index} content must be a string, got {type(content).__name__}")


def render_plain_template(messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """The plain HH-RLHF-style rendering of ``messages`` (see the module docstring)."""
    parts = []
    for message in messages:
        content = message["content"]
        parts.append(PLAIN_ROLE_MARKERS[message["role"]] + (" " + content if content else ""))
    if add_generation_prompt:
        parts.append(PLAIN_GENERATION_PROMPT)
    return "".join(parts)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; chat formatting by the plain template."""

    def __init__(self, model_file: str | os.PathLike):
        import sentencepiece as spm

        self.path = os.fspath(model_file)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path}: SentencePiece model file not found")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as exc:
            raise TokenizerError(self.path, _not_a_model(self.path, exc)) from exc
        if self._sp.eos_id() < 0:
            raise TokenizerError(self.path, "SentencePiece model has no eos piece; responses need one")

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    @functools.cached_property
    def _adds_dummy_prefix(self) -> bool:
        """Whether encoding starts every text with a word boundary (``add_dummy_prefix``, as
        Llama-2's and Mistral's models do)."""
        pieces = self._sp.encode("a", out_type=str)
        return bool(pieces) and pieces[0].startswith("\u2581")

    def render_response(self, content: str, prompt: Sequence[Message] | None = None) -> str:
        # Such a model already gives the reply the space that follows "Assistant:" in a transcript.
        return content if self._adds_dummy_prefix else super().render_response(content, prompt)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int | None:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


_SENTINEL = "\ue000megatron-prune-reply\ue000"
"""A reply no template changes (private-use characters, no whitespace to trim)."""


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer saved in a local directory (``save_pretrained``); no hub access."""

    def __init__(self, directory: str | os.PathLike, *, chat_template_kwargs: dict[str, Any] | None = None):
        from transformers import AutoTokenizer

        self.path = os.fspath(directory)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        """Extra variables for the chat template (``--chat-template-kwargs``)."""
        self._last_frame: tuple[tuple, tuple[str, str] | None] | None = None
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"{self.path}: tokenizer directory not found")
        if not any(os.path.isfile(os.path.join(self.path, name)) for name in HF_TOKENIZER_FILES):
            raise TokenizerError(
                self.path, f"not a Hugging Face tokenizer directory: it holds none of {', '.join(HF_TOKENIZER_FILES)}"
            )
        try:
            self._tok = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TokenizerError(self.path, f"not a Hugging Face tokenizer directory: its files do not load "
                                            f"({_one_line(exc)})") from exc
        if self._tok.eos_token_id is None:
            raise TokenizerError(self.path, "tokenizer defines no eos token; responses need one")
        if self._tok.pad_token_id is None:
            logger.info("%s: no pad token, padding with eos id %d", self.path, self._tok.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def bos_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def eos_id(self) -> int:
        return self._tok.eos_token_id

    @property
    def pad_id(self) -> int:
        pad = self._tok.pad_token_id
        return pad if pad is not None else self.eos_id

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    @functools.cached_property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.eos_id} | (generation_eos_ids(self.path, vocab_size=self.vocab_size) or set()))

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True, tokenize: bool = False
    ) -> str | list[int]:
        if not self.has_chat_template:
            return super().apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize
            )
        validate_messages(messages)
        try:
            text = self._tok.apply_chat_template(
                [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
                **self.chat_template_kwargs,
            )
        except Exception as exc:  # jinja2 raises its own TemplateError (raise_exception in templates)
            raise ValueError(f"{self.path}: the chat template rejected the messages ({exc})") from exc
        return self.encode(text) if tokenize else text

    def render_response(self, content: str, prompt: Sequence[Message] | None = None) -> str:
        """With a chat template: what the template renders after ``prompt``'s generation prompt when
        ``content`` is the next assistant turn, up to the first eos the template writes after the reply
        (Qwen3's empty ``<think></think>`` block, Llama-3's trimming and end-of-turn token); the bare
        ``content`` without a ``prompt``, or where the template renders the earlier turns differently
        once a reply follows."""
        if not self.has_chat_template:
            return super().render_response(content, prompt)
        if prompt is None:
            return content
        frame = self._reply_frame(tuple((m["role"], m["content"]) for m in prompt))
        if frame is None:
            return content
        generation, after = frame
        whole = self._render_turns([*prompt, {"role": "assistant", "content": content}])
        reply = whole[len(generation):] if whole.startswith(generation) else None
        # The template may rewrite a reply around it (Qwen3's splits one holding a think block), but
        # what it writes after the reply is the same.
        if reply is None or not reply.endswith(after):
            return content
        end = after.find(self._tok.eos_token)
        return reply[: len(reply) - len(after)] + (after[:end] if end >= 0 else after)

    def _render_turns(self, messages: list[Message]) -> str:
        return self.apply_chat_template(messages, add_generation_prompt=False)

    def _reply_frame(self, prompt: tuple[tuple[str, str], ...]) -> tuple[str, str] | None:
        """``(generation prompt, what the template writes after any reply)`` for ``prompt``, from a
        sentinel reply, so that the eos is looked for after the reply, never in it (a reply's text
        may hold the eos text); None where the template renders ``prompt`` differently once a reply
        follows. Kept for the last prompt asked: a pair's two responses share it."""
        if self._last_frame is not None and self._last_frame[0] == prompt:
            return self._last_frame[1]
        messages = [{"role": role, "content": content} for role, content in prompt]
        generation = self.apply_chat_template(messages, add_generation_prompt=True)
        whole = self._render_turns([*messages, {"role": "assistant", "content": _SENTINEL}])
        around = whole[len(generation):] if whole.startswith(generation) else None
        frame = None if around is None or around.count(_SENTINEL) != 1 else (generation, around.split(_SENTINEL)[1])
        self._last_frame = (prompt, frame)
        return frame

    @functools.cached_property
    def special_texts(self) -> tuple[str, ...]:  # read once: the loaders ask for every record
        special = {token.content for token in self._tok.added_tokens_decoder.values() if token.special}
        return tuple(sorted(special | set(self._tok.all_special_tokens)))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def generation_eos_ids(directory: str, *, vocab_size: int) -> set[int] | None:
    """The eos ids listed by ``directory/generation_config.json`` (below ``vocab_size``); None when
    the directory has no such file or it cannot be read (said once)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            listed = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        logger.warning("%s: not read (%s); its eos ids do not end completions", path, _one_line(exc))
        return None
    listed = listed if isinstance(listed, list) else [listed]
    return {i for i in listed if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size}


def _not_a_model(path: str, exc: Exception) -> str:
    """Why a file is no SentencePiece model; an HF tokenizer file points to its directory."""
    if os.path.basename(path) in HF_TOKENIZER_FILES:
        directory = os.path.dirname(path) or "."
        return f"a Hugging Face tokenizer file, not a SentencePiece model: pass its directory {directory}"
    return f"not a SentencePiece model ({_one_line(exc)})"


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_tokenizer(path_or_name: str | os.PathLike, *, chat_template_kwargs: dict[str, Any] | None = None) -> Tokenizer:
    """A bundled tokenizer by name (``"tiny"``), a SentencePiece ``.model`` file or an HF directory;
    ``chat_template_kwargs``: extra variables for an HF tokenizer's chat template (the others have none).

    FileNotFoundError when ``path_or_name`` is none of them, :class:`TokenizerError` when it
    exists but holds no usable tokenizer."""
    spec = os.fspath(path_or_name)
    if spec in BUNDLED_TOKENIZERS:
        return SentencePieceTokenizer(BUNDLED_TOKENIZERS[spec])
    if os.path.isdir(spec):
        return HFTokenizer(spec, chat_template_kwargs=chat_template_kwargs)
    if os.path.isfile(spec):
        return SentencePieceTokenizer(spec)
    raise FileNotFoundError(f"{spec}: tokenizer not found; {EXPECTED_TOKENIZER}")
