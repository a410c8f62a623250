"""Preference pairs (DPO) from local JSONL or Parquet files, as token ids.

Record shapes, detected per record (or forced with ``format=``):

``explicit``
    ``prompt``, ``chosen``, ``rejected``. The prompt is a string (one user message; a string
    already in HH-RLHF form, ``"\\n\\nHuman: ...\\n\\nAssistant:"``, is parsed as a dialogue) or
    a message list ``[{"role", "content"}]``. A response is a string or a message list: the
    prompt's messages may be repeated at its start, what remains must be one assistant message;
    string responses that both start with the prompt string (transcripts) lose that copy, and
    after an HH-RLHF-form prompt also the one space the plain template puts after the marker.
``hh``
    HH-RLHF: ``chosen`` and ``rejected`` are full transcripts (their leading newlines may be
    stripped) sharing the dialogue up to the last ``"\\n\\nAssistant:"``. The prompt is that
    shared dialogue, marker included; a response is the rest (its single leading space belongs
    to the plain template). The same record with message lists instead of transcripts (TRL's
    conversational "implicit prompt"): the prompt is the messages both lists share, and each
    must end in one assistant message after them.
``helpsteer3``
    HelpSteer3-Preference: ``context`` (message list), ``response1``, ``response2`` and
    ``overall_preference`` (int in [-3, 3]; negative prefers response1, positive response2).
    A tie (0) carries no preference and is always a counted skip (reason ``"tie"``).

Detection: ``context``, ``response1`` or ``response2`` -> helpsteer3; else ``prompt`` -> explicit;
else ``chosen`` or ``rejected`` -> hh. A record of a detected shape that lacks one of its fields is
invalid with reason ``"missing field"`` naming the field (e.g. ``missing field 'rejected'``).

Token ids: the prompt is rendered by the tokenizer's chat template (the plain HH-RLHF template
when it has none, see ``tokenizer.py``) with the generation prompt; each response is
``encode(render_response(text, prompt)) + [eos]`` (with a chat template: what the template renders
for the reply as the next assistant turn).

Truncation rule (``max_seq_length`` L, ``max_prompt_length`` P):

1. a prompt longer than P tokens keeps its head (BOS, the template's preamble and any leading
   system messages: everything before the text of its first user or assistant message,
   :func:`prompt_head`) and its last ``P - head`` tokens (left truncation that never drops BOS,
   the preamble or the system prompt; a head of P tokens or more is not kept), less the up to 3
   tokens at the cut that hold only the rest of a character whose first byte was cut off;
2. each response keeps its first ``L - len(prompt)`` tokens (right truncation; a cut response
   loses its eos), so prompt+chosen and prompt+rejected both fit in L;
3. when the prompt leaves no room for a response token (only possible when P is None or
   P >= L) the record is invalid (reason ``"prompt too long"``), and so is a pair whose two
   responses are the same tokens after truncation, or already before it (texts that differ only
   in what the tokenizer does not keep, e.g. their Unicode normalization form) (reason
   ``"identical responses"``).

Kept pairs that lost tokens to rules 1 and 2 are counted per part (``"prompt"``, ``"chosen"``,
``"rejected"``) in :attr:`PreferenceDataset.truncated` and logged.

Bad records raise :class:`DataError` naming file, 1-based line/record number and reason; with
``skip_invalid=True`` each is logged and counted in ``skipped`` instead. Nothing is dropped
silently: yielded + skipped always equals the number of input records. Pairs that repeat an
earlier pair token for token are kept (each trains as often as it appears) and counted in one
warning.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from typing import Any, Callable, Iterator, Sequence

from megatron_prune.data.records import (
    DataError,
    LoadedRecords,
    RecordError,
    SkipPolicy,
    check_encodable,
    iter_records,
    read_files,
    record_error,
)
from megatron_prune.data.tokenizer import (
    PLAIN_GENERATION_PROMPT,
    PLAIN_ROLE_MARKERS,
    Message,
    Tokenizer,
    validate_messages,
)
from megatron_prune.ranks import first_rank

logger = logging.getLogger(__name__)

FORMATS = ("auto", "explicit", "hh", "helpsteer3")
ALWAYS_SKIPPED = frozenset({"tie"})
"""Reasons that are counted skips even without ``skip_invalid`` (the record is valid but unusable)."""
PAIR_PARTS = ("prompt", "chosen", "rejected")
"""Keys of the truncation counts, in the order of a pair's token ids."""

PathLike = str | os.PathLike


@dataclasses.dataclass(kw_only=True)
class PreferenceDataConfig:
    """How preference records are read, tokenized and truncated."""

    max_seq_length: int = 1024
    """Longest prompt+response sequence, in tokens; both prompt+chosen and prompt+rejected fit."""
    max_prompt_length: int | None = None
    """Prompts longer than this keep their last tokens; None: never truncate the prompt."""
    format: str = "auto"
    """Record shape: auto (detected per record), explicit, hh or helpsteer3."""
    skip_invalid: bool = False
    """Count and log bad records instead of raising DataError on the first one."""

    def __post_init__(self) -> None:
        if self.max_seq_length < 2:
            raise ValueError(f"max_seq_length must be >= 2, got {self.max_seq_length}")
        if self.max_prompt_length is not None and not 1 <= self.max_prompt_length < self.max_seq_length:
            raise ValueError(
                f"max_prompt_length must be in [1, max_seq_length={self.max_seq_length}), "
                f"got {self.max_prompt_length}"
            )
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")


@dataclasses.dataclass(frozen=True)
class PreferenceText:
    """A parsed preference record before tokenization."""

    prompt: list[Message]
    chosen: str
    rejected: str
    repeated_prompt_removed: bool = False
    """Both string responses began with the prompt string, and that copy was cut off."""


@dataclasses.dataclass
class PreferencePair:
    """One preference pair as token ids; ``source`` and ``line`` locate the input record."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    source: str
    line: int
    repeated_prompt_removed: bool = False
    """The record's responses repeated the prompt at their start; the loader cut that copy off."""
    special_text: str | None = None
    """The first special token's text found in the record (tokenized as that token), if any."""

    def tokens(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The pair's token ids, hashable: two pairs with equal tokens are the same pair."""
        return tuple(self.prompt_ids), tuple(self.chosen_ids), tuple(self.rejected_ids)


def same_pairs(pairs: Sequence[PreferencePair],
               others: Sequence[PreferencePair]) -> list[tuple[PreferencePair, PreferencePair]]:
    """``(pair, the first of ``others`` with the same token ids)`` for every pair of ``pairs`` that
    has one (keyed by hash, so only ints are kept for ``others``; the tokens confirm each match)."""
    first: dict[int, PreferencePair] = {}
    for other in others:
        first.setdefault(hash(other.tokens()), other)
    found = []
    for pair in pairs:
        earlier = first.get(hash(pair.tokens()))
        if earlier is not None and earlier is not pair and earlier.tokens() == pair.tokens():
            found.append((pair, earlier))
    return found


# --------------------------------------------------------------------------- parsing


def detect_format(record: dict[str, Any]) -> str:
    """The record shape of ``record`` (see the module docstring); RecordError if none fits."""
    if "context" in record or "response1" in record or "response2" in record:
        return "helpsteer3"
    if "prompt" in record:
        return "explicit"
    if "chosen" in record or "rejected" in record:
        return "hh"  # a record with only one of them then names the missing field
    raise RecordError(
        "unknown format",
        "expected prompt/chosen/rejected, chosen/rejected or context/response1/response2; "
        f"got keys {sorted(record)[:8]}",
    )


def parse_preference_record(record: dict[str, Any], *, format: str = "auto") -> PreferenceText:
    """Prompt messages and the chosen/rejected texts of one record; RecordError if unusable."""
    kind = detect_format(record) if format == "auto" else format
    if kind == "explicit":
        text = _parse_explicit(record)
    elif kind == "hh":
        text = _parse_hh(record)
    elif kind == "helpsteer3":
        text = _parse_helpsteer3(record)
    else:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    for name in ("chosen", "rejected"):
        if not getattr(text, name).strip():
            raise RecordError("empty response", f"{name} response is empty")
    if text.chosen == text.rejected:
        raise RecordError("identical responses", "chosen and rejected are the same text")
    check_encodable([m["content"] for m in text.prompt] + [text.chosen, text.rejected])
    return text


def _field(record: dict[str, Any], name: str, types: type | tuple[type, ...]) -> Any:
    if name not in record:
        raise RecordError("missing field", repr(name))
    value = record[name]
    if not isinstance(value, types) or isinstance(value, bool):
        expected = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise RecordError("wrong type", f"{name!r} must be {expected}, got {type(value).__name__}")
    return value


def _messages(value: Any, name: str) -> list[Message]:
    try:
        validate_messages(value)
    except ValueError as exc:
        raise RecordError("invalid messages", f"{name}: {exc}") from None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def split_hh_transcript(transcript: str) -> tuple[str, str]:
    """``(prompt, response)`` of an HH-RLHF transcript, cut after its last ``"\\n\\nAssistant:"``."""
    cut = transcript.rfind(PLAIN_GENERATION_PROMPT)
    if cut < 0:
        raise RecordError("not a dialogue", f"no {PLAIN_GENERATION_PROMPT!r} turn in the transcript")
    end = cut + len(PLAIN_GENERATION_PROMPT)
    return transcript[:end], transcript[end:]


def parse_hh_dialogue(prompt: str) -> list[Message]:
    """Messages of an HH-RLHF prompt ``"\\n\\nHuman: ...\\n\\nAssistant:"`` (the inverse of the plain template)."""
    if not prompt.endswith(PLAIN_GENERATION_PROMPT):
        raise RecordError("not a dialogue", f"prompt does not end with {PLAIN_GENERATION_PROMPT!r}")
    body = prompt[: -len(PLAIN_GENERATION_PROMPT)]
    markers = sorted(PLAIN_ROLE_MARKERS.items(), key=lambda item: -len(item[1]))
    messages: list[Message] = []
    position = 0
    while position < len(body):
        role, marker = next(((r, m) for r, m in markers if body.startswith(m, position)), (None, None))
        if role is None:
            raise RecordError("not a dialogue", "transcript must start with '\\n\\nHuman:'")
        start = position + len(marker)
        ends = [body.find(m, start) for _, m in markers]
        position = min([e for e in ends if e >= 0], default=len(body))
        messages.append({"role": role, "content": _drop_one_space(body[start:position])})
    if not messages:
        raise RecordError("not a dialogue", "empty dialogue before the last assistant turn")
    return messages


def _drop_one_space(text: str) -> str:
    return text[1:] if text.startswith(" ") else text


def _parse_hh(record: dict[str, Any]) -> PreferenceText:
    chosen = _field(record, "chosen", (str, list))
    rejected = _field(record, "rejected", (str, list))
    if isinstance(chosen, list) or isinstance(rejected, list):
        return _parse_implicit_chat(chosen, rejected)
    try:
        prompt_c, response_c = split_hh_transcript(chosen)
        prompt_r, response_r = split_hh_transcript(rejected)
    except RecordError as exc:
        hint = ("--data-format hh reads only 'chosen' and 'rejected' as whole transcripts, and this record has a "
                "'prompt': drop --data-format or give --data-format explicit" if "prompt" in record else
                "a record without 'prompt' must hold HH-RLHF transcripts or chat messages in 'chosen' and 'rejected'")
        raise RecordError(exc.reason, f"{exc.detail} ({hint})") from None
    if prompt_c != prompt_r:
        raise RecordError("no shared prefix", "chosen and rejected differ before their last assistant turn")
    # Also with the transcripts' leading newlines stripped ("Human: ..."), as an explicit prompt is read.
    dialogue = parse_hh_dialogue("\n\n" + prompt_c.lstrip("\n"))
    return PreferenceText(dialogue, _drop_one_space(response_c), _drop_one_space(response_r))


def _parse_implicit_chat(chosen: Any, rejected: Any) -> PreferenceText:
    """Chat messages without a ``prompt``: the prompt is what both lists share."""
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise RecordError("wrong type", "'chosen' and 'rejected' must both be transcripts or both message lists")
    chosen_turns, rejected_turns = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    shared = 0
    while (shared < min(len(chosen_turns), len(rejected_turns)) - 1
           and chosen_turns[shared] == rejected_turns[shared]):
        shared += 1
    prompt = chosen_turns[:shared]
    if not prompt:
        raise RecordError("no shared prefix", "chosen and rejected share no messages before their responses")
    return PreferenceText(prompt, _response(chosen_turns, prompt, "chosen"), _response(rejected_turns, prompt, "rejected"))


def _parse_explicit(record: dict[str, Any]) -> PreferenceText:
    prompt = _field(record, "prompt", (str, list))
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RecordError("empty prompt", "'prompt' is empty")
        # HH form, also with its text stripped ("Human: ...\n\nAssistant:"): otherwise it would be
        # wrapped in a second Human/Assistant turn.
        hh_form = "\n\n" + prompt.lstrip("\n").rstrip(" ")
        is_hh = hh_form.startswith(PLAIN_ROLE_MARKERS["user"]) and hh_form.endswith(PLAIN_GENERATION_PROMPT)
        messages = parse_hh_dialogue(hh_form) if is_hh else [{"role": "user", "content": prompt}]
    else:
        messages = _messages(prompt, "prompt")
    chosen, rejected = _field(record, "chosen", (str, list)), _field(record, "rejected", (str, list))
    removed = False
    if isinstance(prompt, str):
        chosen, rejected, removed = _without_repeated_prompt(prompt, chosen, rejected)
        if is_hh:
            # An HH transcript writes "Assistant: reply"; the template puts that one space back.
            chosen, rejected = (_drop_one_space(r) if isinstance(r, str) else r for r in (chosen, rejected))
    return PreferenceText(messages, _response(chosen, messages, "chosen"), _response(rejected, messages, "rejected"),
                          repeated_prompt_removed=removed)


def _without_repeated_prompt(prompt: str, chosen: Any, rejected: Any) -> tuple[Any, Any, bool]:
    """String responses that both start with the prompt string (full transcripts beside their
    prompt) lose that copy, as message-list responses lose the prompt's messages; otherwise the
    prompt would be trained twice. Only both together: one response that merely begins with the
    prompt's words is left as it is. The flag says whether the copy was cut (the loader counts
    and says it, as a pair whose responses quote the prompt on purpose would lose the quote)."""
    if not (isinstance(chosen, str) and isinstance(rejected, str)
            and chosen.startswith(prompt) and rejected.startswith(prompt)):
        return chosen, rejected, False
    return chosen[len(prompt):], rejected[len(prompt):], True


def _response(value: str | list, prompt: list[Message], name: str) -> str:
    if isinstance(value, str):
        return value
    turns = _messages(value, name)
    if turns[: len(prompt)] == prompt:
        turns = turns[len(prompt) :]
    if len(turns) != 1 or turns[0]["role"] != "assistant":
        raise RecordError("invalid messages", f"{name} must be one assistant message after the prompt")
    return turns[0]["content"]


def _parse_helpsteer3(record: dict[str, Any]) -> PreferenceText:
    context = _messages(_field(record, "context", list), "context")
    response1 = _field(record, "response1", str)
    response2 = _field(record, "response2", str)
    preference = _field(record, "overall_preference", (int, float))
    if isinstance(preference, float):  # 2.0 from a pandas export; 1.5 is no HelpSteer3 score
        if not preference.is_integer():
            raise RecordError("invalid value", f"overall_preference must be an integer in [-3, 3], got {preference}")
        preference = int(preference)
    if not -3 <= preference <= 3:
        raise RecordError("invalid value", f"overall_preference must be in [-3, 3], got {preference}")
    if preference == 0:
        raise RecordError("tie", "overall_preference is 0 (no preference)")
    chosen, rejected = (response1, response2) if preference < 0 else (response2, response1)
    return PreferenceText(context, chosen, rejected)


# --------------------------------------------------------------------------- tokenization


_HEAD_PROBES = ("a", "7")


@functools.lru_cache(maxsize=16)
def prompt_head_length(tokenizer: Tokenizer) -> int:
    """Tokens every rendered prompt starts with: BOS and the chat template's fixed preamble.

    Measured as the common prefix of two one-message prompts that differ only in their text, so
    it never reaches into a message (a merge across the boundary only makes it shorter).
    """
    probe = [{"role": "user", "content": _HEAD_PROBES[0]}]
    return prompt_head(tokenizer, probe, tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=True))


def prompt_head(tokenizer: Tokenizer, messages: list[Message], prompt_ids: Sequence[int]) -> int:
    """Tokens of ``prompt_ids`` (``messages`` rendered) before the text of its first message that
    is not a system message: BOS, the template's preamble and the system prompt.

    The common prefix with the same messages whose that text is one probe character, for two
    probes. Measured on the prompt's own messages, not a one-message probe: a template that adds a
    default system prompt when there is none has a longer preamble than the prompt, which would
    keep the start of the user's text as "head".
    """
    first = next((k for k, m in enumerate(messages) if m["role"] != "system"), None)
    if first is None:
        return 0
    n = len(prompt_ids)
    for probe in _HEAD_PROBES:
        changed = [*messages[:first], {**messages[first], "content": probe}, *messages[first + 1:]]
        ids = tokenizer.apply_chat_template(changed, add_generation_prompt=True, tokenize=True)
        n = min(n, next((k for k, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(ids), n)))
    return n


def truncate_prompt(prompt_ids: Sequence[int], *, max_length: int, keep_head: int = 0,
                    decode: Callable[[Sequence[int]], str] | None = None) -> list[int]:
    """Left-truncate ``prompt_ids`` to ``max_length`` tokens, keeping its first ``keep_head`` tokens
    (BOS and the template's preamble) when there is room for more than them. With ``decode`` (the
    tokenizer's), the kept tail also loses the tokens at its start that hold only the rest of a
    character the cut went through (:func:`without_cut_character`)."""
    prompt = list(prompt_ids)
    if len(prompt) <= max_length:
        return prompt
    if keep_head >= max_length:
        keep_head = 0
    tail = prompt[len(prompt) - (max_length - keep_head) :]
    return prompt[:keep_head] + (without_cut_character(tail, decode) if decode is not None else tail)


UTF8_CONTINUATION_BYTES = 3
"""The most bytes a UTF-8 character has after its first."""


def without_cut_character(tail: list[int], decode: Callable[[Sequence[int]], str]) -> list[int]:
    """``tail`` (the end of a token sequence) without its leading tokens that are bytes of a character
    whose first byte was cut off (byte-fallback and byte-level tokenizers spell a character with
    several tokens): they decode as U+FFFD. At most :data:`UTF8_CONTINUATION_BYTES` tokens go, and
    never the last one."""
    for _ in range(UTF8_CONTINUATION_BYTES):
        if len(tail) < 2 or not decode(tail).startswith("\ufffd"):
            break
        tail = tail[1:]
    return tail


def truncate_pair(
    prompt_ids: Sequence[int],
    chosen_ids: Sequence[int],
    rejected_ids: Sequence[int],
    *,
    max_seq_length: int,
    max_prompt_length: int | None = None,
    keep_head: int = 0,
    decode: Callable[[Sequence[int]], str] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Apply the truncation rule of the module docstring; RecordError when nothing is left."""
    prompt = list(prompt_ids)
    if max_prompt_length is not None:
        prompt = truncate_prompt(prompt, max_length=max_prompt_length, keep_head=keep_head, decode=decode)
    budget = max_seq_length - len(prompt)
    if budget < 1:
        raise RecordError(
            "prompt too long",
            f"prompt is {len(prompt)} tokens, leaving no room for a response in --seq-length {max_seq_length} "
            "(--max-prompt-length below it keeps each prompt's last tokens)",
        )
    chosen, rejected = list(chosen_ids[:budget]), list(rejected_ids[:budget])
    if chosen == rejected:
        cut = len(chosen_ids) > budget or len(rejected_ids) > budget
        why = "after truncation" if cut else "(their texts differ only in what the tokenizer does not keep)"
        raise RecordError("identical responses", f"chosen and rejected are the same {len(chosen)} tokens {why}")
    return prompt, chosen, rejected


def tokenize_preference(
    text: PreferenceText,
    tokenizer: Tokenizer,
    *,
    max_seq_length: int,
    max_prompt_length: int | None = None,
    truncated: collections.Counter[str] | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Token ids ``(prompt, chosen, rejected)`` of a parsed record, truncated to fit; each part
    that lost tokens adds one to ``truncated[part]`` (see :data:`PAIR_PARTS`)."""
    try:
        prompt_ids = tokenizer.apply_chat_template(text.prompt, add_generation_prompt=True, tokenize=True)
        chosen_ids = tokenizer.encode(tokenizer.render_response(text.chosen, text.prompt)) + [tokenizer.eos_id]
        rejected_ids = tokenizer.encode(tokenizer.render_response(text.rejected, text.prompt)) + [tokenizer.eos_id]
    except ValueError as exc:
        raise RecordError("chat template failed", str(exc)) from None
    whole = (prompt_ids, chosen_ids, rejected_ids)
    too_long = max_prompt_length is not None and len(prompt_ids) > max_prompt_length
    kept = truncate_pair(*whole, max_seq_length=max_seq_length, max_prompt_length=max_prompt_length,
                         keep_head=prompt_head(tokenizer, text.prompt, prompt_ids) if too_long else 0,
                         decode=tokenizer.decode)
    if truncated is not None:
        truncated.update(part for part, before, after in zip(PAIR_PARTS, whole, kept) if len(after) < len(before))
    return kept


# --------------------------------------------------------------------------- loading


def iter_preference_pairs(
    path: PathLike,
    *,
    tokenizer: Tokenizer,
    config: PreferenceDataConfig,
    policy: SkipPolicy,
    truncated: collections.Counter[str] | None = None,
) -> Iterator[PreferencePair]:
    """Pairs of one file in order; each bad record goes to ``policy`` (raise, or count and log),
    each truncated part of a yielded pair is counted in ``truncated``."""
    source = os.fspath(path)
    for line, record in iter_records(source):
        if isinstance(record, DataError):
            policy.handle(record)
            continue
        try:
            text = parse_preference_record(record, format=config.format)
            ids = tokenize_preference(
                text, tokenizer, max_seq_length=config.max_seq_length, max_prompt_length=config.max_prompt_length,
                truncated=truncated,
            )
        except RecordError as exc:
            if exc.reason in ALWAYS_SKIPPED:
                policy.skip(record_error(source, line, exc))
            else:
                policy.handle(record_error(source, line, exc))
            continue
        special = tokenizer.special_text_in([m["content"] for m in text.prompt] + [text.chosen, text.rejected])
        yield PreferencePair(*ids, source=source, line=line, repeated_prompt_removed=text.repeated_prompt_removed,
                             special_text=special)


def load_preference_pairs(
    paths: PathLike | Sequence[PathLike],
    *,
    tokenizer: Tokenizer,
    config: PreferenceDataConfig | None = None,
    truncated: collections.Counter[str] | None = None,
) -> tuple[list[PreferencePair], collections.Counter[str]]:
    """All pairs of ``paths`` (files in the given order) and the skip counts per reason; the
    truncated parts of the pairs are counted into ``truncated`` and logged."""
    config = config or PreferenceDataConfig()
    policy = SkipPolicy(skip_invalid=config.skip_invalid)
    truncated = collections.Counter() if truncated is None else truncated
    pairs: list[PreferencePair] = read_files(
        _as_list(paths), lambda path: iter_preference_pairs(path, tokenizer=tokenizer, config=config, policy=policy,
                                                            truncated=truncated),
        policy=policy, what="preference pairs")
    says = first_rank()
    if policy.skipped and says:
        skipped = sum(policy.skipped.values())
        logger.warning("loaded %d preference pairs, skipped %d records: %s", len(pairs), skipped, dict(policy.skipped))
    cut = [pair for pair in pairs if pair.repeated_prompt_removed]
    if cut and says:
        logger.warning("%d preference pairs had responses that both begin with their prompt string (first: %s:%d); "
                       "that copy of the prompt was removed from both responses", len(cut), cut[0].source,
                       cut[0].line)
    special = [pair for pair in pairs if pair.special_text is not None]
    if special and says:
        logger.warning("special-token text in %d preference pairs (first: %s:%d holds %r) is tokenized as that "
                       "token; records already formatted with a chat template are formatted twice: give "
                       "plain text or chat messages", len(special), special[0].source, special[0].line,
                       special[0].special_text)
    repeats = _repeated_pairs(pairs)
    if repeats and says:
        later, earlier = repeats[0]
        logger.warning("%d preference pairs repeat an earlier pair token for token (first: %s:%d repeats %s:%d); "
                       "kept, so each trains as often as it appears", len(repeats), later.source, later.line,
                       earlier.source, earlier.line)
    if truncated and says:
        logger.warning("loaded %d preference pairs, truncated to fit max_seq_length=%d, max_prompt_length=%s "
                       "(pairs per cut part): %s", len(pairs), config.max_seq_length, config.max_prompt_length,
                       dict(truncated))
    return pairs, policy.skipped


def _repeated_pairs(pairs: Sequence[PreferencePair]) -> list[tuple[PreferencePair, PreferencePair]]:
    """``(pair, the first pair with the same token ids)`` for every pair that repeats an earlier one."""
    return same_pairs(pairs, pairs)


def _as_list(paths: PathLike | Sequence[PathLike]) -> list[PathLike]:
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


class PreferenceDataset(LoadedRecords):
    """Preference pairs of local files, loaded and tokenized up front.

    ``skipped`` counts skipped records per reason; ``len(self) + sum(skipped.values())`` is the
    number of input records.
    """

    truncated: collections.Counter[str]
    """Kept pairs that lost tokens, per part: ``"prompt"`` (left-truncated to max_prompt_length),
    ``"chosen"`` and ``"rejected"`` (cut from the right to fit max_seq_length, losing their eos)."""

    def __init__(
        self, paths: PathLike | Sequence[PathLike], *, tokenizer: Tokenizer, config: PreferenceDataConfig | None = None
    ):
        self.config = config or PreferenceDataConfig()
        files = [os.fspath(p) for p in _as_list(paths)]
        self.truncated = collections.Counter()
        pairs, skipped = load_preference_pairs(files, tokenizer=tokenizer, config=self.config,
                                               truncated=self.truncated)
        super().__init__(files, pairs, skipped, what="preference pairs")

    @property
    def pairs(self) -> list[PreferencePair]:
        return self.items
