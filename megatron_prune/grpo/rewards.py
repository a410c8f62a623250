"""Verifiable rewards for GRPO: a pluggable interface, a registry, GSM8K, MATH and a toy task.

Every reward is a callable ``reward(completion_text, reference_answer) -> float``
(:class:`RewardFn`). Rewards are registered by name (:func:`register_reward`) and built
with :func:`get_reward`; ``gsm8k``, ``math``, ``toy`` and ``toy-binary`` are registered here.

A completion that reasons in a ``<think>`` block (Qwen3 and other reasoning models) is graded on
what follows its last ``</think>`` (:func:`final_answer_text`); one whose reasoning never closed
(cut by ``--max-new-tokens``) has no answer. Drafts inside the reasoning never count.

Extraction returns ``None`` when a completion has no usable answer; a missing answer
scores 0, never an exception, because a policy in training produces malformed text all
the time. Bad *arguments* (a reference without an answer, a bad config) raise
``ValueError``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, runtime_checkable

from megatron_prune.data.math import MINUS_SIGNS

__all__ = [
    "RewardFn",
    "register_reward",
    "get_reward",
    "available_rewards",
    "normalize_number",
    "extract_gsm8k_answer",
    "final_answer_text",
    "GSM8KReward",
    "extract_boxed",
    "normalize_math_answer",
    "math_answers_equal",
    "MathReward",
    "ToyTaskConfig",
    "ToyPrompt",
    "ToyTask",
    "ToyReward",
    "ToyBinaryReward",
]


@runtime_checkable
class RewardFn(Protocol):
    """A verifiable reward: score one completion against the reference answer."""

    def __call__(self, completion_text: str, reference_answer: str) -> float: ...


# ---------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------

_REGISTRY: dict[str, Callable[[], RewardFn]] = {}


def register_reward(name: str, factory: Callable[[], RewardFn]) -> None:
    """Register ``factory`` (a zero-argument callable returning a :class:`RewardFn`) as ``name``.

    Registering a name twice is an error: a second reward silently replacing the first is
    the kind of surprise that costs a training run.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"reward {name!r} is already registered")
    if not callable(factory):
        raise ValueError(f"reward factory for {name!r} must be callable, got {factory!r}")
    _REGISTRY[name] = factory


def get_reward(name: str) -> RewardFn:
    """Build the reward registered as ``name``."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; registered: {', '.join(available_rewards())}")
    return _REGISTRY[name]()


def available_rewards() -> list[str]:
    """Names accepted by :func:`get_reward`, sorted."""
    return sorted(_REGISTRY)


# ---------------------------------------------------------------------------------------
# numbers (shared by GSM8K and MATH)
# ---------------------------------------------------------------------------------------

# A number: thousands groups ("1,234,567") or plain digits, optional decimals, or ".5"; a
# fraction's denominator ("3/4") and a decimal exponent ("5e2") belong to it, so that neither is
# read as one of its parts.
_NUMBER_RE = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?(?:[eE][-+]?\d+)?")


def _number_of(match: re.Match, text: str) -> str | None:
    """The text of a number ``match`` in ``text``; ``None`` where it is the base or exponent of a
    power ("2^{10}"): reading the power as one of its parts would credit a wrong answer."""
    if text[: match.start()].rstrip("{").endswith("^") or text[match.end():].lstrip("}").startswith("^"):
        return None
    return match.group(0)


def _to_fraction(text: str) -> Fraction | None:
    try:
        return Fraction(text.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _format_fraction(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    # Exact decimals print as decimals ("0.5"); others as "a/b".
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator != 1:
        return f"{value.numerator}/{value.denominator}"
    text = f"{float(value):.15f}".rstrip("0").rstrip(".")
    return text if Fraction(text) == value else f"{value.numerator}/{value.denominator}"


_LATEX_SPACE = re.compile(r"\\[,!;: ]")
"""LaTeX spacing commands, which sit inside numbers: thousands as ``1,\\!000`` or ``1\\,000``, a sign as ``-\\,5``."""


def _number_text(text: str) -> str:
    """``text`` with its minus signs read as ``-`` and LaTeX spacing and dollar signs (``\\$`` too)
    removed, so that ``-\\$5`` and ``1,\\!000`` read as ``-5`` and ``1,000``, not ``5`` and ``000``."""
    return _LATEX_SPACE.sub("", text.translate(MINUS_SIGNS)).replace("\\$", "").replace("$", "")


def normalize_number(text: str) -> str | None:
    """Canonical string of the first number in ``text``, or ``None`` if there is none.

    Removes ``$``, ``%``, spaces, LaTeX spacing and thousands commas and drops trailing zeros:
    ``"$1,234.50"`` -> ``"1234.5"``, ``"72.0"`` -> ``"72"``, ``"- 5"`` -> ``"-5"``, ``"1,\\!000"`` -> ``"1000"``.
    """
    # Read past, the sign of "−3" (U+2212) was lost and it scored as 3.
    cleaned = _number_text(text).replace("%", "").replace("\\", "")
    cleaned = re.sub(r"(?<=[-+])\s+(?=\d|\.)", "", cleaned.strip())
    match = _NUMBER_RE.search(cleaned)
    number = None if match is None else _number_of(match, cleaned)
    value = None if number is None else _to_fraction(number)
    return None if value is None else _format_fraction(value)


# ---------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------

_GSM8K_MARKER = "####"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def final_answer_text(completion_text: str) -> str | None:
    """The part of a completion that states its answer: after the last ``</think>`` where it has
    one (the template may have opened the block in the prompt) and before a ``<think>`` that
    reopens the reasoning there, ``None`` where a ``<think>`` block never closed, else the whole
    text."""
    if THINK_CLOSE in completion_text:
        return completion_text.rsplit(THINK_CLOSE, 1)[1].split(THINK_OPEN, 1)[0]
    return None if THINK_OPEN in completion_text else completion_text


def extract_gsm8k_answer(text: str) -> str | None:
    """The normalised final answer of a GSM8K-style text.

    If the text contains ``####``, the answer is the first number after the *last*
    marker (``None`` if no number follows: the model committed to an answer and gave
    none). Without a marker, the last number of the last ``\\boxed{}`` (the form chat models
    answer in; after its last ``=``), ``None`` if the box holds none; without a box, the last
    number of the text. Everywhere LaTeX's ``{,}`` reads as a comma, ``\\frac{a}{b}`` as ``a/b``
    and spacing (``1,\\!000``, ``1\\,000``) and ``\\$`` as nothing. A fraction counts as its value
    and a power as no number, never as one of their parts.
    """
    if _GSM8K_MARKER in text:
        tail = text.rsplit(_GSM8K_MARKER, 1)[1]
        return normalize_number(_read_latex(tail))
    boxed = extract_boxed(text)
    if boxed is None:
        return _last_number(_read_latex(text))
    content = _read_latex(boxed)
    if "\\frac" in content:  # a fraction of more than two numbers: not read here
        return None
    return _last_number(content.rsplit("=", 1)[-1])


def _read_latex(text: str) -> str:
    """``text`` with LaTeX's ``{,}`` read as a comma and ``\\frac{a}{b}`` (``\\frac ab``, a mixed
    ``2\\frac{1}{2}``) as ``a/b``, so that a fraction is read as its value, never as a part of it."""
    text = re.sub(r"(\d+)[^\S\n]*\\[dt]?frac\s*\{\s*(\d+)\s*\}\s*\{\s*(\d+)\s*\}", _mixed_number, text)
    text = re.sub(r"\\[dt]?frac\s*(\d)\s*(\d)", r"\1/\2", text.replace("{,}", ","))
    return re.sub(r"\\[dt]?frac\s*\{\s*([^{}]*?)\s*\}\s*\{\s*([^{}]*?)\s*\}", r"\1/\2", text)


def _mixed_number(match: re.Match) -> str:
    """``2\\frac{1}{2}`` as the fraction it stands for, ``5/2`` (a zero denominator: left alone)."""
    whole, numerator, denominator = (int(part) for part in match.groups())
    if denominator == 0:
        return match.group(0)
    value = whole + Fraction(numerator, denominator)
    return f"{value.numerator}/{value.denominator}"


def _last_number(text: str) -> str | None:
    """The normalised last number of ``text``, or ``None``."""
    cleaned = _number_text(text)
    matches = list(_NUMBER_RE.finditer(cleaned))
    if not matches:
        return None
    last = matches[-1]
    number = _number_of(last, cleaned)
    if number is None:
        return None
    if number[0] in "+-" and last.start() > 0 and cleaned[last.start() - 1].isalnum():
        number = number[1:]  # "2023-2024", "x-5": a hyphen after a word or number joins, it is no sign
    return normalize_number(number)


@dataclass(frozen=True, kw_only=True)
class GSM8KReward:
    """1.0 when the completion's final number equals the reference's ``#### N``, else 0.0."""

    correct: float = 1.0
    """Reward for a correct answer."""
    incorrect: float = 0.0
    """Reward for a wrong, missing or malformed answer."""

    def __call__(self, completion_text: str, reference_answer: str) -> float:
        reference = extract_gsm8k_answer(reference_answer)
        if reference is None:
            raise ValueError(f"GSM8K reference has no number: {reference_answer[-80:]!r}")
        answer = final_answer_text(completion_text)
        predicted = None if answer is None else extract_gsm8k_answer(answer)
        return self.correct if predicted is not None and predicted == reference else self.incorrect


# ---------------------------------------------------------------------------------------
# MATH
# ---------------------------------------------------------------------------------------


def _balanced_group(text: str, start: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[start] == "{"`` and the index after it."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for index in range(start, len(text)):
        char = text[index]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index], index + 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with balanced braces.

    Also accepts the brace-less form ``\\boxed 5``. Returns ``None`` when there is no box or
    the last box is not closed.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    name_end = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    after = name_end
    while after < len(text) and text[after].isspace():
        after += 1
    if after > name_end and after < len(text) and text[after] != "{":  # "\\boxed 5"
        match = re.match(r"[^\s$]+", text[after:])
        return match.group(0) if match else None
    group = _balanced_group(text, after)
    return None if group is None else group[0]


def _unwrap_command(text: str, command: str) -> str:
    """Replace every ``\\command{X}`` by ``X`` (balanced braces)."""
    token = "\\" + command
    while True:
        start = text.find(token + "{")
        if start < 0:
            return text
        group = _balanced_group(text, start + len(token))
        if group is None:
            return text
        content, end = group
        text = text[:start] + content + text[end:]


_VARIABLE = r"[a-zA-Z](?:_\{?\w+\}?)?"
"""A one-letter variable, optionally subscripted (``x``, ``x_1``, ``x_{12}``): a leading ``x =``."""

_MAGNITUDES = {"hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions",
               "trillion", "trillions", "dozen", "dozens", "percent"}
"""Words after a number that change its value: never dropped as a unit."""


def normalize_math_answer(answer: str) -> str:
    """Canonical form of a MATH answer string, for string comparison.

    Strips spaces, ``\\left``/``\\right``, spacing commands (``\\!``, ``\\,``, ...), a
    unit after a number in ``\\text{...}``/``\\mbox{...}`` (words, not "million" and the like),
    ``\\text{}``-style wrappers (keeping their content), degrees, percent and dollar signs,
    a trailing ``.``, and a leading ``x =``; maps ``\\dfrac``/``\\tfrac`` to ``\\frac``,
    ``\\frac12`` to ``\\frac{1}{2}``, a plain ``a/b`` of integers to ``\\frac{a}{b}``,
    LaTeX's ``{,}`` to a comma, and a space between two digits to a comma (``6 7`` is not ``67``).
    """
    text = answer.strip().translate(MINUS_SIGNS).replace("{,}", ",")
    unit = re.search(r"(?<=[\d}])\s*\\(?:text|mbox)\{\s*([a-zA-Z][a-zA-Z ]*)\}\s*\.?$", text)
    if unit and not set(unit.group(1).lower().split()) & _MAGNITUDES:
        text = text[: unit.start()]
    text = re.sub(r"\\left(?![a-zA-Z])", "", text)
    text = re.sub(r"\\right(?![a-zA-Z])", "", text)
    text = re.sub(r"\\[!,;:]|\\ |~", "", text)
    text = text.replace("\\displaystyle", "")
    for command in ("text", "textbf", "textrm", "mathrm", "mathbf", "mbox"):
        text = _unwrap_command(text, command)
    text = re.sub(r"\^\{?\\circ\}?", "", text)
    text = text.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"(?<=\d)\s+(?=\d)", ",", text)
    text = re.sub(r"\s+", "", text)
    text = re.sub(rf"^{_VARIABLE}=", "", text)
    text = text.rstrip(".")
    text = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", text)
    text = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", text)
    text = re.sub(r"\\sqrt(\d+)", r"\\sqrt{\1}", text)
    text = re.sub(r"^(-?)(\d+)/(\d+)$", r"\1\\frac{\2}{\3}", text)
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    text = re.sub(r"^(-?)\.(\d)", r"\g<1>0.\2", text)
    return text


def _parse_math_number(normalized: str) -> Fraction | None:
    """Numeric value of a normalised answer that is an integer, decimal or simple fraction."""
    if re.fullmatch(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)", normalized):
        return _to_fraction(normalized)
    match = re.fullmatch(r"([-+]?)\\frac\{([-+]?\d+)\}\{([-+]?\d+)\}", normalized)
    if match is None:
        return None
    sign, numerator, denominator = match.groups()
    if int(denominator) == 0:
        return None
    value = Fraction(int(numerator), int(denominator))
    return -value if sign == "-" else value


_LEFT_SIDE = re.compile(rf"^\s*({_VARIABLE})\s*=")


def math_answers_equal(predicted: str, reference: str) -> bool:
    """True when the normalised strings match, or both parse as numbers and are equal. A leading
    ``x =`` counts only where both sides have one: then the variables must be the same."""
    sides = [_LEFT_SIDE.match(text.translate(MINUS_SIGNS)) for text in (predicted, reference)]
    if all(sides) and len({re.sub(r"[{}\s]", "", side.group(1)) for side in sides}) > 1:
        return False
    left, right = normalize_math_answer(predicted), normalize_math_answer(reference)
    if left == right:
        return bool(left)
    left_value, right_value = _parse_math_number(left), _parse_math_number(right)
    return left_value is not None and left_value == right_value


@dataclass(frozen=True, kw_only=True)
class MathReward:
    """1.0 when the last ``\\boxed{}`` of the completion matches the reference answer.

    The reference may be a bare answer (``"\\frac{1}{2}"``) or a full solution containing a
    ``\\boxed{}``.
    """

    correct: float = 1.0
    """Reward for a correct answer."""
    incorrect: float = 0.0
    """Reward for a wrong, missing or malformed answer."""

    def __call__(self, completion_text: str, reference_answer: str) -> float:
        reference = extract_boxed(reference_answer)
        if reference is None:
            reference = reference_answer
        if not normalize_math_answer(reference):
            raise ValueError(f"MATH reference answer is empty: {reference_answer[-80:]!r}")
        answer = final_answer_text(completion_text)
        predicted = None if answer is None else extract_boxed(answer)
        if predicted is None:
            return self.incorrect
        return self.correct if math_answers_equal(predicted, reference) else self.incorrect


# ---------------------------------------------------------------------------------------
# toy task
# ---------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ToyTaskConfig:
    """A verifiable task that a tiny random model learns on CPU in a few dozen steps.

    The prompt asks "answer with the digit X". Every token id at or above
    ``num_special_tokens`` belongs to a *digit class* ``(id - num_special_tokens) %
    num_digits``; the reward of a completion is the fraction of its tokens (before the
    first ``eos_token_id``) whose class is X. A random policy therefore scores about
    ``1 / num_digits`` with real spread inside every group (a binomial fraction over the
    completion length), so group-relative advantages are nonzero from step one and the
    reward is dense: the policy only has to move probability mass onto the ~vocab/num_digits
    tokens of the class named by the last prompt token. Measured with the defaults
    (tests/unit/grpo/test_toy_grpo.py): a 91k-parameter GRU language model, 16 prompts x
    8 completions x 8 tokens per step, Adam at lr 3e-2, lifts the mean reward from ~0.1
    to above 0.7 in about 30 GRPO steps, with DPPO pruning on. The step size matters:
    each token's logit is learned mostly from its own samples, and at lr 1e-2 the reward
    barely moves in 40 steps.

    The tiny Megatron transformer (``--model-preset tiny``) learns it more slowly with the
    default 8-token prompts: the digit sits behind random filler, and completion positions
    only see it through attention, which starts out uniform; at lr 1e-2..3e-2 the reward
    stayed at ~0.10-0.14 over 20-40 steps (at 3e-2 the policy collapses onto digit-blind
    tokens first). Without filler (``prompt_length=3``: BOS, SEP, digit; the GRPO CLI's
    ``--toy-prompt-length`` default), 4-token completions, 32 prompts x 8 completions per
    step and Adam at lr 2e-2, the mean reward rises from ~0.10 to ~0.37 (GRPO) and ~0.29
    (DPPO, 30% prompt and completion pruning) over 40 steps
    (tests/e2e/test_grpo_cli.py::test_toy_reward_rises, examples/grpo_cpu.sh).

    The text form scores the fraction of non-space characters equal to the digit.

    With ``binary`` the reward is verifiable and all-or-nothing instead: 1 when the completion's
    *first* token (its answer) is in the class of X, else 0. A random policy is right with
    probability about ``1 / num_digits``, so with groups of G completions a group is all-wrong
    with probability about ``(1 - 1/num_digits)^G`` (0.43 for 10 digits and G = 8) and, once the
    policy has learned a prompt, all-right: whole groups have zero reward variance, the regime
    in which prompt-level pruning saves work.
    """

    vocab_size: int = 512
    """Token vocabulary size of the model being trained."""
    num_digits: int = 10
    """Number of digit classes (targets are 0 .. num_digits-1)."""
    prompt_length: int = 8
    """Tokens per prompt: BOS, random filler, SEP, the digit token."""
    num_special_tokens: int = 4
    """Ids below this are special (0 pad, 1 bos, 2 eos, 3 sep) and never match a class."""
    seed: int = 0
    """Seed of the prompt generator; prompt ``i`` depends only on ``(seed, i)``."""
    binary: bool = False
    """Binary reward: 1 when the first completion token is in the target class, else 0."""

    pad_token_id: int = 0
    """Padding id."""
    bos_token_id: int = 1
    """Beginning-of-sequence id, the first prompt token."""
    eos_token_id: int = 2
    """End of a completion: tokens after it are ignored by the reward."""
    sep_token_id: int = 3
    """Separator before the digit token."""

    def __post_init__(self) -> None:
        if self.num_digits < 2 or self.num_digits > 10:
            raise ValueError(f"num_digits must be in [2, 10], got {self.num_digits}")
        if self.num_special_tokens < 4:
            raise ValueError(f"num_special_tokens must be >= 4, got {self.num_special_tokens}")
        special = (self.pad_token_id, self.bos_token_id, self.eos_token_id, self.sep_token_id)
        if len(set(special)) != 4 or not all(0 <= t < self.num_special_tokens for t in special):
            raise ValueError(
                f"pad/bos/eos/sep ids must be distinct and below num_special_tokens="
                f"{self.num_special_tokens}, got {special}"
            )
        if self.vocab_size < self.num_special_tokens + 2 * self.num_digits:
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small for {self.num_special_tokens} special "
                f"tokens and {self.num_digits} digit classes (need at least two tokens per class)"
            )
        if self.prompt_length < 3:
            raise ValueError(f"prompt_length must be >= 3 (bos, sep, digit), got {self.prompt_length}")


@dataclass(frozen=True)
class ToyPrompt:
    """One toy prompt."""

    index: int
    """Position in the task's deterministic prompt stream; use it as the prompt id."""
    target_digit: int
    """The digit the completion should consist of."""
    token_ids: tuple[int, ...]
    """Prompt tokens: BOS, filler, SEP, digit token."""
    text: str
    """Text form of the prompt."""

    @property
    def reference_answer(self) -> str:
        """Reference answer for :class:`ToyReward`: the digit as a string."""
        return str(self.target_digit)


class ToyTask:
    """Deterministic toy prompts and their scoring, on token ids or on text."""

    def __init__(self, config: ToyTaskConfig | None = None) -> None:
        self.config = config or ToyTaskConfig()

    def digit_token_id(self, digit: int) -> int:
        """The token id that names ``digit`` in a prompt (a member of the digit's class)."""
        self._check_digit(digit)
        return self.config.num_special_tokens + digit

    def token_class(self, token_id: int) -> int | None:
        """Digit class of a token id, or ``None`` for special tokens."""
        if token_id < self.config.num_special_tokens:
            return None
        return (token_id - self.config.num_special_tokens) % self.config.num_digits

    def prompt(self, index: int) -> ToyPrompt:
        """Prompt number ``index`` (a pure function of ``(config.seed, index)``)."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        cfg = self.config
        rng = random.Random(f"megatron_prune.toy:{cfg.seed}:{index}")
        digit = rng.randrange(cfg.num_digits)
        filler = [rng.randrange(cfg.num_special_tokens, cfg.vocab_size) for _ in range(cfg.prompt_length - 3)]
        tokens = (cfg.bos_token_id, *filler, cfg.sep_token_id, self.digit_token_id(digit))
        return ToyPrompt(index=index, target_digit=digit, token_ids=tokens, text=f"Answer with the digit {digit}.")

    def prompts(self, count: int, *, start: int = 0) -> list[ToyPrompt]:
        """Prompts ``start .. start+count-1``."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        return [self.prompt(index) for index in range(start, start + count)]

    def score_tokens(self, completion_ids: Sequence[int], *, target_digit: int) -> float:
        """Fraction of completion tokens before the first EOS whose class is ``target_digit``
        (binary: 1.0 when the first of them is in that class, else 0.0)."""
        self._check_digit(target_digit)
        tokens = [int(t) for t in completion_ids]
        if self.config.eos_token_id in tokens:
            tokens = tokens[: tokens.index(self.config.eos_token_id)]
        if not tokens:
            return 0.0
        if self.config.binary:
            return float(self.token_class(tokens[0]) == target_digit)
        return sum(self.token_class(t) == target_digit for t in tokens) / len(tokens)

    def score_text(self, completion_text: str, *, target_digit: int) -> float:
        """Fraction of non-space characters of the completion equal to the digit (binary: 1.0
        when the first non-space character is the digit, else 0.0)."""
        self._check_digit(target_digit)
        chars = [c for c in completion_text if not c.isspace()]
        if not chars:
            return 0.0
        if self.config.binary:
            return float(chars[0] == str(target_digit))
        return sum(c == str(target_digit) for c in chars) / len(chars)

    def _check_digit(self, digit: int) -> None:
        if not 0 <= digit < self.config.num_digits:
            raise ValueError(f"digit must be in [0, {self.config.num_digits}), got {digit}")


@dataclass(frozen=True, kw_only=True)
class ToyReward:
    """Text form of the toy task as a :class:`RewardFn`; the reference answer is the digit."""

    num_digits: int = 10
    """Number of digit classes; the reference must be one of ``0 .. num_digits-1``."""
    binary: bool = False
    """All-or-nothing: 1 when the first non-space character is the digit."""

    def __call__(self, completion_text: str, reference_answer: str) -> float:
        reference = reference_answer.strip()
        if not (reference.isdigit() and len(reference) == 1 and int(reference) < self.num_digits):
            raise ValueError(
                f"toy reference answer must be one digit below {self.num_digits}, got {reference_answer!r}"
            )
        task = ToyTask(ToyTaskConfig(num_digits=self.num_digits, binary=self.binary))
        return task.score_text(completion_text, target_digit=int(reference))


@dataclass(frozen=True, kw_only=True)
class ToyBinaryReward(ToyReward):
    """Binary text form of the toy task: 1.0 when the completion starts with the digit."""

    binary: bool = True
    """Always binary."""


register_reward("gsm8k", GSM8KReward)
register_reward("math", MathReward)
register_reward("toy", ToyReward)
register_reward("toy-binary", ToyBinaryReward)
