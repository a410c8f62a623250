"""Math problems with verifiable answers (GRPO) from local JSONL or Parquet files.

Record shapes, detected per record (or forced with ``format=``):

``gsm8k``
    ``question`` and ``answer``, whose last line is ``#### N``; the answer is N with
    surrounding whitespace, thousands separators and a final period removed (``"#### 1,000."`` -> ``"1000"``).
``math``
    MATH-style ``problem`` and ``solution``; the answer is the content of the last
    ``\\boxed{...}`` (or ``\\fbox{...}``) in the solution, braces balanced.

Prompt templates (``prompt_text`` is the user message; the caller applies the chat template):

* GSM8K: ``GSM8K_PROMPT_TEMPLATE`` asks for the final answer after ``####``;
* MATH: ``MATH_PROMPT_TEMPLATE`` asks for the final answer in ``\\boxed{}``.

Both take the problem text as ``{question}``, substituted literally (not ``str.format``, so
other braces, as in LaTeX, need no escaping). Bad records follow the rules of
``preference.py``: DataError naming file, line and reason, or with ``skip_invalid=True`` a
logged skip counted per reason; yielded + skipped always equals the number of input records.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
from typing import Any, Iterator, Sequence

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
from megatron_prune.ranks import first_rank

logger = logging.getLogger(__name__)

FORMATS = ("auto", "gsm8k", "math")
GSM8K_PROMPT_TEMPLATE = '{question}\nLet\'s think step by step and output the final answer after "####".'
MATH_PROMPT_TEMPLATE = "{question}\nLet's think step by step and output the final answer within \\boxed{}."
_GSM8K_ANSWER = re.compile(r"^####\s*(.+?)\s*$")
_NUMBER_WITH_COMMAS = re.compile(r"^\$?[-+]?\d{1,3}(,\d{3})+(\.\d+)?%?$")
_ONE_NUMBER = re.compile(r"^\$?[-+]?(?:\d+(?:\.\d+)?|\.\d+)%?$")
MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
"""The minus sign and the small and fullwidth hyphen-minus, each read as ``-`` (dashes are not:
an en dash is as often a range or a bullet as a sign)."""
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")

PathLike = str | os.PathLike


@dataclasses.dataclass(kw_only=True)
class MathDataConfig:
    """How math records are read and turned into prompts."""

    format: str = "auto"
    """Record shape: auto (detected per record), gsm8k or math."""
    prompt_template: str | None = None
    """Template with a ``{question}`` field (replaced literally); None: the format's own template."""
    skip_invalid: bool = False
    """Count and log bad records instead of raising DataError on the first one."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.prompt_template is not None and "{question}" not in self.prompt_template:
            raise ValueError(f"prompt_template must contain '{{question}}', got {self.prompt_template!r}")


@dataclasses.dataclass
class MathProblem:
    """One problem: the user prompt, the reference answer, and where it came from."""

    prompt_text: str
    answer: str
    source: str
    line: int


_FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def detect_format(record: dict[str, Any]) -> str:
    """The shape whose fields the record holds the most of (a MATH-500 record has problem, solution
    and answer: math); a record with only one of a shape's two fields is that shape, missing the other."""
    present = {kind: sum(name in record for name in names) for kind, names in _FIELDS.items()}
    kind = max(present, key=present.get)  # the first of equals
    if present[kind]:
        return kind
    keys = sorted(record)[:8]
    raise RecordError("unknown format", f"expected question/answer or problem/solution; got keys {keys}")


def gsm8k_answer(answer: str) -> str:
    """The final answer of a GSM8K solution (its last non-empty line, ``#### N``)."""
    lines = [line for line in answer.splitlines() if line.strip()]
    match = _GSM8K_ANSWER.match(lines[-1].strip()) if lines else None
    if match is None:
        raise RecordError("no final answer", "the last line of 'answer' must be '#### <answer>'")
    value = match.group(1).translate(MINUS_SIGNS)
    number = value.removesuffix(".")  # "#### 18." ends its sentence
    plain = number.replace(",", "") if _NUMBER_WITH_COMMAS.match(number) else number
    # The reward compares one number: a reference like "1/2" or "3 apples and 4 pears" could never be matched.
    if not _ONE_NUMBER.match(plain):
        raise RecordError("no final answer", f"'#### {value[:40]}' is not one number (e.g. '#### 72' or '#### -3.5')")
    return plain


def last_boxed(solution: str) -> str:
    """The content of the last ``\\boxed{...}`` in ``solution`` (nested braces allowed)."""
    starts = [m.end() for m in _BOXED.finditer(solution)]
    for start in reversed(starts):
        depth = 1
        for index in range(start, len(solution)):
            depth += {"{": 1, "}": -1}.get(solution[index], 0)
            if depth == 0:
                content = solution[start:index].strip()
                if content:
                    return content
                break
    from megatron_prune.grpo.rewards import extract_boxed  # the reward's reading, "\\boxed 5" included

    content = (extract_boxed(solution) or "").strip()
    if content:
        return content
    raise RecordError("no final answer", "no non-empty, closed \\boxed{...} in 'solution'")


def _text_field(record: dict[str, Any], name: str) -> str:
    if name not in record:
        raise RecordError("missing field", repr(name))
    value = record[name]
    if not isinstance(value, str):
        raise RecordError("wrong type", f"{name!r} must be str, got {type(value).__name__}")
    if not value.strip():
        raise RecordError("empty field", f"{name!r} is empty")
    check_encodable([value])
    return value


def parse_math_record(
    record: dict[str, Any], *, format: str = "auto", prompt_template: str | None = None
) -> tuple[str, str]:
    """``(prompt_text, answer)`` of one record; RecordError if unusable."""
    kind = detect_format(record) if format == "auto" else format
    if format != "auto" and not any(name in record for name in _FIELDS[format]):
        other = next((k for k, names in _FIELDS.items() if k != format and any(n in record for n in names)), None)
        if other is not None:  # every record of the file fails alike: say what the file is
            raise RecordError("wrong format", f"a {other} record ({'/'.join(_FIELDS[other])}), not a {format} one "
                                              f"({'/'.join(_FIELDS[format])})")
    if kind == "gsm8k":
        question, answer = _text_field(record, "question"), gsm8k_answer(_text_field(record, "answer"))
        template = prompt_template or GSM8K_PROMPT_TEMPLATE
    elif kind == "math":
        question, answer = _text_field(record, "problem"), last_boxed(_text_field(record, "solution"))
        from megatron_prune.grpo.rewards import normalize_math_answer

        if not normalize_math_answer(answer):  # "\\boxed{\\,}": nothing a completion could match
            raise RecordError("no final answer", f"the last \\boxed{{...}} in 'solution' holds no answer: {answer!r}")
        template = prompt_template or MATH_PROMPT_TEMPLATE
    else:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    return template.replace("{question}", question.strip()), answer


def iter_math_problems(path: PathLike, *, config: MathDataConfig, policy: SkipPolicy) -> Iterator[MathProblem]:
    """Problems of one file in order; each bad record goes to ``policy`` (raise, or count and log)."""
    source = os.fspath(path)
    for line, record in iter_records(source):
        if isinstance(record, DataError):
            policy.handle(record)
            continue
        try:
            prompt_text, answer = parse_math_record(
                record, format=config.format, prompt_template=config.prompt_template
            )
        except RecordError as exc:
            policy.handle(record_error(source, line, exc))
            continue
        yield MathProblem(prompt_text=prompt_text, answer=answer, source=source, line=line)


def load_math_problems(
    paths: PathLike | Sequence[PathLike], *, config: MathDataConfig | None = None
) -> tuple[list[MathProblem], collections.Counter[str]]:
    """All problems of ``paths`` (files in the given order) and the skip counts per reason."""
    config = config or MathDataConfig()
    policy = SkipPolicy(skip_invalid=config.skip_invalid)
    problems: list[MathProblem] = read_files(
        [paths] if isinstance(paths, (str, os.PathLike)) else paths,
        lambda path: iter_math_problems(path, config=config, policy=policy), policy=policy, what="math problems")
    if policy.skipped and first_rank():  # every rank loads the data; one says so
        skipped = sum(policy.skipped.values())
        logger.warning("loaded %d math problems, skipped %d records: %s", len(problems), skipped, dict(policy.skipped))
    return problems, policy.skipped


class MathDataset(LoadedRecords):
    """Math problems of local files; ``skipped`` counts skipped records per reason."""

    def __init__(self, paths: PathLike | Sequence[PathLike], *, config: MathDataConfig | None = None):
        self.config = config or MathDataConfig()
        files = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        problems, skipped = load_math_problems(files, config=self.config)
        super().__init__(files, problems, skipped, what="math problems")

    @property
    def problems(self) -> list[MathProblem]:
        return self.items
