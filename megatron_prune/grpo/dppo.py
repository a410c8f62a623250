"""DPPO: unbiased two-level dynamic pruning for GRPO.

* **Prompt level** (before rollout): prompt ``i`` is kept with probability ``p_i`` derived
  from its history (:class:`PromptHistory`); a kept prompt's loss is multiplied by ``1/p_i``.
* **Completion level** (after rewards and advantages on the *full* group): completion
  ``ij`` is kept with probability ``q_ij`` increasing in ``|A_ij|``; a kept completion is
  multiplied by ``1/q_ij``.

Both levels use one rule (:func:`solve_keep_probs`): ``prob = clip(c * score, floor, 1)``
with the multiplier ``c`` found by bisection so that the expected prune fraction
``1 - mean(prob)`` equals the target rate. Keep draws are a pure function of
``(seed, step, level, id)`` (:func:`keep_uniform`), so every rank and every layout
draws the same decisions without communication. A level draws either independently (one
uniform per item) or systematically (:func:`systematic_keep`: one uniform per group of
completions, or per batch of prompts, with every item still kept with exactly its
probability). The estimator and its proof of unbiasedness are in docs/dppo.md.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from megatron_prune.ranks import first_rank
from megatron_prune.sampling import canonical_id

logger = logging.getLogger(__name__)

__all__ = [
    "PROMPT_LEVEL",
    "COMPLETION_LEVEL",
    "DPPOConfig",
    "KeepDecision",
    "PromptHistory",
    "DPPOPruner",
    "solve_keep_probs",
    "keep_uniform",
    "sample_keep",
    "systematic_keep",
    "prune_prompts",
    "prune_completions",
    "combine_weights",
    "varied_group_probability",
]

PROMPT_LEVEL = "prompt"
COMPLETION_LEVEL = "completion"
_HISTORY_SCORES = ("std", "informative", "pass-rate")
SAMPLINGS = ("systematic", "independent")
PROMPT_BATCH_KEY = "batch"
"""Id of the one uniform of a systematic prompt-level draw (the level keys it apart from items)."""
_BISECTION_STEPS = 200


@dataclass(kw_only=True)
class DPPOConfig:
    """Knobs of DPPO pruning. Both rates at 0 reproduce plain GRPO exactly."""

    prompt_prune_rate: float = 0.0
    """Target r_q: expected fraction of prompts pruned before rollout, in [0, 1)."""
    completion_prune_rate: float = 0.0
    """Target r_o: expected fraction of completions pruned after scoring, in [0, 1)."""
    prompt_floor: float = 0.3
    """Smallest prompt keep probability, in (0, 1]; bounds the importance weight by 1/floor."""
    completion_floor: float = 0.3
    """Smallest completion keep probability, in (0, 1]; zero-advantage completions get it (unless skipped)."""
    history_decay: float = 0.5
    """EMA decay of a prompt's history score: ``s <- decay * s + (1 - decay) * observation``."""
    history_score: str = "std"
    """What a prompt's history scores: ``std`` (EMA of its groups' reward std), ``informative`` (EMA of
    1 if std > 0) or ``pass-rate`` (the probability that its next group has unequal rewards, from a
    Beta posterior of its pass rate; rewards in [0, 1])."""
    unseen_prompt_score: float | None = None
    """Score of a prompt with no history; None keeps it with probability 1."""
    sampling: str = "systematic"
    """Completion keep draws: ``systematic`` (one uniform per group, completions taken in order of
    advantage, so each group keeps a balanced spread of its advantages) or ``independent`` (one
    uniform per completion). Both keep every completion with probability exactly ``q_ij``."""
    prompt_sampling: str = "independent"
    """Prompt keep draws: ``independent`` (one uniform per prompt) or ``systematic`` (one uniform
    per batch, prompts in order of keep probability then id: the kept count is ``sum p`` rounded)."""
    skip_zero_advantage: bool = False
    """Completions whose advantage is exactly 0 get keep probability 0, and the completion-level
    rate is met by the others (all kept when the zeros alone reach it). Exact only when such a
    completion's loss is identically 0, i.e. without a KL term: then dropping it changes neither
    the expected gradient nor its variance. The GRPO trainer sets it when ``--kl-beta`` is 0."""

    def __post_init__(self) -> None:
        _check_rate("prompt_prune_rate", self.prompt_prune_rate)
        _check_rate("completion_prune_rate", self.completion_prune_rate)
        _check_floor("prompt_floor", self.prompt_floor)
        _check_floor("completion_floor", self.completion_floor)
        for level, rate, floor in (("prompt", self.prompt_prune_rate, self.prompt_floor),
                                   ("completion", self.completion_prune_rate, self.completion_floor)):
            if rate > 1.0 - floor + 1e-12:
                raise ValueError(
                    f"{level}_prune_rate {rate} cannot be reached with {level}_floor {floor}: every item is kept "
                    f"with probability at least the floor, so at most 1 - floor = {1.0 - floor:.4g} can be pruned "
                    f"(lower {level}_floor to prune more)"
                )
        for name in ("sampling", "prompt_sampling"):
            if getattr(self, name) not in SAMPLINGS:
                raise ValueError(f"{name} must be one of {SAMPLINGS}, got {getattr(self, name)!r}")
        if not 0.0 <= self.history_decay < 1.0:
            raise ValueError(f"history_decay must be in [0, 1), got {self.history_decay}")
        if self.history_score not in _HISTORY_SCORES:
            raise ValueError(f"history_score must be one of {_HISTORY_SCORES}, got {self.history_score!r}")
        if self.unseen_prompt_score is not None and not self.unseen_prompt_score >= 0:
            raise ValueError(f"unseen_prompt_score must be None or >= 0, got {self.unseen_prompt_score}")

    @property
    def enabled(self) -> bool:
        """Whether any pruning is requested."""
        return self.prompt_prune_rate > 0 or self.completion_prune_rate > 0

    @property
    def max_weight(self) -> float:
        """Largest importance weight ``1/(p q)`` a kept completion can get: ``1/floor`` per pruning
        level (a level at rate 0 keeps everything with probability 1)."""
        prompt = 1.0 / self.prompt_floor if self.prompt_prune_rate > 0 else 1.0
        completion = 1.0 / self.completion_floor if self.completion_prune_rate > 0 else 1.0
        return prompt * completion


def _check_rate(name: str, rate: float) -> None:
    if not (isinstance(rate, (int, float)) and 0.0 <= rate < 1.0):
        raise ValueError(f"{name} must be in [0, 1), got {rate!r}")


def _check_floor(name: str, floor: float) -> None:
    if not (isinstance(floor, (int, float)) and 0.0 < floor <= 1.0):
        why = ("a keep probability above 0: a zero floor makes the estimator biased" if floor <= 0.0
               else "a keep probability")
        raise ValueError(f"{name} must be in (0, 1] ({why}), got {floor!r}")


# ---------------------------------------------------------------------------------------
# keep probabilities
# ---------------------------------------------------------------------------------------


def solve_keep_probs(scores: torch.Tensor, *, prune_rate: float, floor: float) -> torch.Tensor:
    """Keep probabilities (float64, shape of ``scores``) for non-negative ``scores``.

    ``prob = clip(c * score, floor, 1)``, with ``c >= 0`` found by bisection (on ``log c``) so
    that ``mean(prob) = 1 - prune_rate``. A score of ``+inf`` means "always keep" (prob 1).
    Monotone: a larger score never gets a smaller probability.

    Two targets cannot be met by the rule alone, and are handled as follows:

    * the rate is higher than the floor allows (``mean`` at ``c = 0`` is already above
      the target): every finite score gets ``floor`` and less than ``prune_rate`` is pruned;
    * the rate is lower than the rule can reach (``c -> inf`` gives every positive score
      1 but zero scores still sit at the floor): positive scores get 1 and zero scores
      share a raised floor that meets the target exactly.

    ``prune_rate == 0`` returns exactly ones.
    """
    _check_rate("prune_rate", prune_rate)
    _check_floor("floor", floor)
    flat = scores.detach().to(torch.float64).flatten()
    if torch.isnan(flat).any() or (flat < 0).any():
        raise ValueError("keep-probability scores must be non-negative and not NaN")
    if flat.numel() == 0 or prune_rate == 0.0:
        return torch.ones_like(flat).reshape(scores.shape)
    target = 1.0 - prune_rate
    always = torch.isinf(flat)
    finite = torch.where(always, torch.zeros_like(flat), flat)
    positive = (finite > 0) & ~always

    lowest = torch.where(always, torch.ones_like(flat), torch.full_like(flat, floor))
    if lowest.mean().item() >= target:
        return lowest.reshape(scores.shape)
    highest = torch.where(positive | always, torch.ones_like(flat), torch.full_like(flat, floor))
    if highest.mean().item() <= target:
        zero = ~(positive | always)
        num_zero = int(zero.sum().item())
        if num_zero == 0:  # only when the rate rounds to 0 in float64
            return highest.reshape(scores.shape)
        raised = (target * flat.numel() - (flat.numel() - num_zero)) / num_zero
        raised_probs = torch.full_like(flat, min(max(raised, floor), 1.0))
        return torch.where(zero, raised_probs, highest).reshape(scores.shape)
    return _bisect_multiplier(finite, positive, always, target=target, floor=floor).reshape(scores.shape)


def _bisect_multiplier(finite: torch.Tensor, positive: torch.Tensor, always: torch.Tensor, *, target: float,
                       floor: float) -> torch.Tensor:
    """``clip(c * score, floor, 1)`` at the smallest ``c`` whose mean reaches ``target`` (which lies strictly
    between the means at ``c = 0`` and ``c = inf``).

    ``c`` is first narrowed on a log scale, then halved to adjacent floats. The log scale is needed where
    a score has decayed to 1e-100 of the others (a prompt whose groups kept coming out all-equal): c's
    bracket then spans hundreds of decades, which halving c alone would never narrow. The last phase
    keeps simple cases exact (equal scores at rate 1/2 give probabilities of exactly 1/2)."""
    ones = torch.ones_like(finite)
    relative = torch.where(positive, finite / finite[positive].max(), ones)  # largest positive score: 1
    log_finite = torch.where(positive, finite, ones).log()  # of the scores, not of their ratios: those may underflow
    log_relative = log_finite - log_finite[positive].max()

    def probs_at(scaled: torch.Tensor) -> torch.Tensor:
        return torch.where(always, ones, torch.where(positive, scaled, 0.0 * ones).clamp(min=floor, max=1.0))

    def reaches(scaled: torch.Tensor) -> bool:
        # an exactly rounded sum, so that the batch's order (a layout, a DP split) cannot flip a comparison
        return math.fsum(probs_at(scaled).tolist()) / finite.numel() >= target

    low, high = math.log(floor), -log_relative[positive].min().item()  # every score at the floor / at 1
    for _ in range(_BISECTION_STEPS):
        if high - low <= math.log(2.0):
            break
        middle = 0.5 * (low + high)
        if reaches((middle + log_relative).exp()):
            high = middle
        else:
            low = middle
    if high > math.log(torch.finfo(torch.float64).max) - 1.0:
        # c beyond float64: halve c / e^high instead, against the scores scaled by e^high (the largest
        # become inf, which the clip takes to 1)
        relative = (high + log_relative).exp()
        low, high = math.exp(low - high), 1.0
    else:
        low, high = math.exp(low), math.exp(high)
    for _ in range(_BISECTION_STEPS):
        middle = 0.5 * (low + high)
        if not low < middle < high:
            break
        if reaches(middle * relative):
            high = middle
        else:
            low = middle
    return probs_at(high * relative)


# ---------------------------------------------------------------------------------------
# counter-based sampling
# ---------------------------------------------------------------------------------------


def keep_uniform(*, seed: int, step: int, level: str, item_id: Hashable) -> float:
    """A uniform number in [0, 1) that depends only on ``(seed, step, level, item_id)``.

    Counter-based: a BLAKE2b hash of the key, so it is the same on every rank, in every
    layout and after a resume, and different keys give (pseudo-)independent numbers.
    """
    key = repr((int(seed), int(step), str(level), canonical_id(item_id))).encode()
    digest = hashlib.blake2b(key, digest_size=8, person=b"mp.dppo").digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def _check_ids(item_ids: Sequence[Hashable], count: int, what: str) -> list:
    ids = [canonical_id(item_id) for item_id in item_ids]
    if len(ids) != count:
        raise ValueError(f"got {len(ids)} {what} ids for {count} items")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{what} ids must be unique within a step (they seed the keep draws)")
    return ids


def sample_keep(
    probs: torch.Tensor, *, seed: int, step: int, level: str, item_ids: Sequence[Hashable]
) -> torch.Tensor:
    """Bool tensor shaped like ``probs``: item ``k`` kept iff ``keep_uniform(..., item_ids[k]) < probs[k]``.

    ``item_ids`` lists one unique id per element of ``probs`` in row-major order.
    """
    ids = _check_ids(item_ids, probs.numel(), level)
    uniforms = torch.tensor(
        [keep_uniform(seed=seed, step=step, level=level, item_id=item_id) for item_id in ids], dtype=torch.float64
    )
    return (uniforms < probs.detach().to(torch.float64).flatten()).reshape(probs.shape)


def systematic_keep(probs: torch.Tensor, *, order: Sequence[int], uniform: float) -> torch.Tensor:
    """Systematic sampling: bool mask of the items of ``probs`` (1-D, each in [0, 1]) that are kept.

    The items are laid end to end on the line in ``order``, item ``k`` covering
    ``[C_{k-1}, C_k)`` with ``C_k`` the partial sums of the probabilities; the points
    ``uniform + m`` (m = 0, 1, ...) pick the items they land in. For ``uniform ~ U[0, 1)`` each
    item is kept with probability exactly its own (its interval has that length and holds at
    most one point), while the number kept is ``floor`` or ``ceil`` of ``sum(probs)`` and
    neighbours in ``order`` are rarely kept or pruned together.
    """
    values = probs.detach().to(torch.float64).flatten().tolist()
    if sorted(order) != list(range(len(values))):
        raise ValueError(f"order must be a permutation of range({len(values)}), got {list(order)}")
    if not 0.0 <= uniform < 1.0:
        raise ValueError(f"uniform must be in [0, 1), got {uniform}")
    keep = [False] * len(values)
    start = 0.0
    for k in order:
        end = start + values[k]
        keep[k] = math.ceil(end - uniform) > math.ceil(start - uniform)  # a point u + m lies in [start, end)
        start = end
    return torch.tensor(keep, dtype=torch.bool).reshape(probs.shape)


@dataclass(frozen=True)
class KeepDecision:
    """Keep probabilities, the sampled keep mask and the importance weights of one level."""

    probs: torch.Tensor
    """Keep probability of each item (float64)."""
    keep: torch.Tensor
    """Bool: whether each item is kept."""
    target_rate: float
    """The requested prune rate."""

    @property
    def weights(self) -> torch.Tensor:
        """Importance weight ``1/prob`` for kept items, 0 for pruned ones (float64)."""
        return torch.where(self.keep, 1.0 / self.probs, torch.zeros_like(self.probs))

    @property
    def expected_rate(self) -> float:
        """``1 - mean(probs)``: the prune rate the probabilities achieve in expectation."""
        return 1.0 - self.probs.mean().item() if self.probs.numel() else 0.0

    @property
    def realized_rate(self) -> float:
        """Fraction of items actually pruned by this draw."""
        return 1.0 - self.keep.to(torch.float64).mean().item() if self.keep.numel() else 0.0


def combine_weights(*, prompt_weights: torch.Tensor, completion_weights: torch.Tensor) -> torch.Tensor:
    """Per-completion IS weight ``(1/p_i) * (1/q_ij)`` for ``[P]`` prompt and ``[P, G]`` completion weights."""
    if prompt_weights.dim() != 1 or completion_weights.dim() != 2:
        raise ValueError(
            f"expected prompt weights [P] and completion weights [P, G], got {tuple(prompt_weights.shape)} "
            f"and {tuple(completion_weights.shape)}"
        )
    if prompt_weights.shape[0] != completion_weights.shape[0]:
        raise ValueError(
            f"{prompt_weights.shape[0]} prompt weights for {completion_weights.shape[0]} groups of completions"
        )
    return prompt_weights[:, None] * completion_weights


# ---------------------------------------------------------------------------------------
# prompt history
# ---------------------------------------------------------------------------------------


def varied_group_probability(*, passes: float, fails: float, group_size: int) -> float:
    """``1 - E[s^G] - E[(1 - s)^G]`` for ``s ~ Beta(1 + passes, 1 + fails)``, ``G = group_size``:
    the probability that ``G`` independent pass/fail draws are neither all passes nor all fails."""
    if passes < 0 or fails < 0 or group_size < 1:
        raise ValueError(f"need passes, fails >= 0 and group_size >= 1, got {passes}, {fails}, {group_size}")
    alpha, beta = 1.0 + passes, 1.0 + fails
    all_pass = all_fail = 1.0
    for k in range(group_size):  # E[s^G] = prod_k (alpha + k) / (alpha + beta + k)
        all_pass *= (alpha + k) / (alpha + beta + k)
        all_fail *= (beta + k) / (alpha + beta + k)
    return max(0.0, 1.0 - all_pass - all_fail)


class PromptHistory:
    """Per-prompt record of how informative its groups have been.

    After each step, :meth:`update` records a kept prompt's full group of rewards.

    * ``score="std"`` / ``"informative"``: the observation is the group's reward std, or 1/0 for
      nonzero/zero std; the score is ``decay * old + (1 - decay) * observation``, or the first
      observation itself. Prompts whose groups keep having no reward variance drift to score 0.
    * ``score="pass-rate"``: rewards in [0, 1] count as passes (a reward of 0.3 is 0.3 of a pass).
      The prompt keeps decayed counts ``passes <- decay * passes + sum(r)`` and
      ``fails <- decay * fails + sum(1 - r)``; its pass rate ``s`` has the posterior
      ``Beta(1 + passes, 1 + fails)``, and the score is the posterior probability that a group of
      ``G`` completions (the size of its last group) is not all passes or all fails,
      ``1 - E[s^G] - E[(1 - s)^G]``. A prompt whose groups pass 90% of the time then scores
      about ``1 - 0.9^8 = 0.57`` at ``G = 8`` whether its last group happened to vary or not,
      where ``std`` jumps between 0 and 0.3.

    Under every score, prompts that keep giving groups of equal rewards (all solved or all
    failed) are pruned most.
    """

    def __init__(self, *, decay: float = 0.5, score: str = "std") -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if score not in _HISTORY_SCORES:
            raise ValueError(f"score must be one of {_HISTORY_SCORES}, got {score!r}")
        self.decay = float(decay)
        self.score_kind = score
        self._scores: dict[int | str | tuple, float] = {}
        self._counts: dict[int | str | tuple, int] = {}
        # pass-rate only: decayed passes and decayed fails
        self._evidence: dict[int | str | tuple, tuple[float, float]] = {}

    @classmethod
    def from_config(cls, config: DPPOConfig) -> PromptHistory:
        return cls(decay=config.history_decay, score=config.history_score)

    def __len__(self) -> int:
        return len(self._scores)

    def __contains__(self, prompt_id: Hashable) -> bool:
        return canonical_id(prompt_id) in self._scores

    def _observation(self, rewards: torch.Tensor) -> float:
        std = rewards.std(correction=0).item()
        return std if self.score_kind == "std" else float(std > 0)

    def update(self, prompt_id: Hashable, rewards: torch.Tensor) -> float:
        """Record one group of rewards of ``prompt_id``; return its new score."""
        key = canonical_id(prompt_id)
        rewards = rewards.detach().to(torch.float64).flatten()
        if rewards.numel() == 0:
            raise ValueError("cannot update a prompt's history from an empty group of rewards")
        if self.score_kind == "pass-rate":
            score = self._update_pass_rate(key, rewards)
        else:
            score = self._observation(rewards)
            if key in self._scores:
                score = self.decay * self._scores[key] + (1.0 - self.decay) * score
        self._scores[key] = score
        self._counts[key] = self._counts.get(key, 0) + 1
        return score

    def _update_pass_rate(self, key: int | str | tuple, rewards: torch.Tensor) -> float:
        inside = (rewards >= 0) & (rewards <= 1)
        if not bool(inside.all()):
            bad = rewards[~inside][0].item()
            raise ValueError(f"prompt history score 'pass-rate' counts rewards as passes and needs them in [0, 1]; "
                             f"prompt {key!r} got a reward of {bad:g} (use the 'std' score for other rewards)")
        passes, fails = self._evidence.get(key, (0.0, 0.0))
        passes = self.decay * passes + rewards.sum().item()
        fails = self.decay * fails + (1.0 - rewards).sum().item()
        self._evidence[key] = (passes, fails)
        return varied_group_probability(passes=passes, fails=fails, group_size=rewards.numel())

    def update_batch(self, prompt_ids: Sequence[Hashable], rewards: torch.Tensor) -> None:
        """Record rewards ``[P, G]`` of the prompts ``prompt_ids``."""
        if rewards.dim() != 2 or rewards.shape[0] != len(prompt_ids):
            raise ValueError(f"rewards must be [{len(prompt_ids)}, G], got {tuple(rewards.shape)}")
        for prompt_id, group in zip(prompt_ids, rewards):
            self.update(prompt_id, group)

    def score(self, prompt_id: Hashable) -> float | None:
        """The prompt's score, or None if it has no history."""
        return self._scores.get(canonical_id(prompt_id))

    def count(self, prompt_id: Hashable) -> int:
        """How many groups of the prompt were recorded."""
        return self._counts.get(canonical_id(prompt_id), 0)

    def scores(self, prompt_ids: Sequence[Hashable], *, unseen: float | None = None) -> torch.Tensor:
        """Float64 scores of ``prompt_ids``; a prompt with no history gets ``unseen`` (None: +inf)."""
        fill = math.inf if unseen is None else float(unseen)
        values = [self.score(prompt_id) for prompt_id in prompt_ids]
        return torch.tensor([fill if value is None else value for value in values], dtype=torch.float64)

    def state_dict(self) -> dict:
        """Plain-Python state for checkpoints."""
        keys = list(self._scores)
        return {
            "decay": self.decay,
            "score": self.score_kind,
            "ids": keys,
            "scores": [self._scores[key] for key in keys],
            "counts": [self._counts[key] for key in keys],
            **({"evidence": [list(self._evidence[key]) for key in keys]} if self.score_kind == "pass-rate" else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. A resume may change the settings: under another decay the
        recorded scores go on decaying at the new rate; under another score kind they measure
        something else, so the history starts empty (every prompt unseen) and a warning says so."""
        missing = {"decay", "score", "ids", "scores", "counts"} - set(state)
        if missing:
            raise ValueError(f"PromptHistory state is missing {sorted(missing)}")
        if not len(state["ids"]) == len(state["scores"]) == len(state["counts"]):
            raise ValueError("PromptHistory state has ids, scores and counts of different lengths")
        if state["score"] != self.score_kind:
            if first_rank():
                logger.warning("the checkpoint's prompt history scores %r, this run --dppo-history-score %r: the "
                               "%d recorded prompts start unseen", state["score"], self.score_kind, len(state["ids"]))
            self._scores, self._counts, self._evidence = {}, {}, {}
            return
        if self.score_kind == "pass-rate" and len(state.get("evidence", ())) != len(state["ids"]):
            raise ValueError("PromptHistory state of score 'pass-rate' needs one (passes, fails) evidence entry "
                             "per prompt")
        keys = [canonical_id(item) for item in state["ids"]]
        if self.score_kind == "pass-rate":
            self._evidence = {key: (float(p), float(f)) for key, (p, f) in zip(keys, state["evidence"])}
        self._scores = dict(zip(keys, (float(s) for s in state["scores"])))
        self._counts = dict(zip(keys, (int(c) for c in state["counts"])))


# ---------------------------------------------------------------------------------------
# the two levels
# ---------------------------------------------------------------------------------------


def prune_prompts(
    *, prompt_ids: Sequence[Hashable], history: PromptHistory, config: DPPOConfig, seed: int, step: int
) -> KeepDecision:
    """Prompt-level decision for one step, taken before rollout.

    ``prompt_ids`` must be unique and stable (e.g. dataset indices): they key both the
    history and the keep draws.
    """
    scores = history.scores(prompt_ids, unseen=config.unseen_prompt_score)
    probs = solve_keep_probs(scores, prune_rate=config.prompt_prune_rate, floor=config.prompt_floor)
    if config.prompt_sampling == "independent":
        keep = sample_keep(probs, seed=seed, step=step, level=PROMPT_LEVEL, item_ids=prompt_ids)
    else:  # one uniform for the batch; a stable order that does not depend on the batch's layout
        ids = _check_ids(prompt_ids, probs.numel(), PROMPT_LEVEL)
        order = sorted(range(len(ids)), key=lambda k: (float(probs[k]), repr(ids[k])))
        uniform = keep_uniform(seed=seed, step=step, level=PROMPT_LEVEL, item_id=PROMPT_BATCH_KEY)
        keep = systematic_keep(probs, order=order, uniform=uniform)
    return KeepDecision(probs=probs, keep=keep, target_rate=config.prompt_prune_rate)


def prune_completions(
    *, advantages: torch.Tensor, prompt_ids: Sequence[Hashable], config: DPPOConfig, seed: int, step: int
) -> KeepDecision:
    """Completion-level decision ``[P, G]`` from advantages of the full groups of the kept prompts.

    ``q_ij = clip(c * |A_ij|, floor, 1)`` with ``c`` shared by the whole batch, so groups
    with zero advantage give up their completions first. Independent draws: completion ``j``
    of prompt ``i`` draws with the id ``(prompt_ids[i], j)``. Systematic draws: the group of
    prompt ``i`` draws one uniform with the id ``prompt_ids[i]`` and takes its completions in
    order of advantage (then ``j``), so the kept completions spread over the group's
    advantages and the weighted advantages ``sum_j w_ij A_ij`` stay near their expectation 0.
    """
    if advantages.dim() != 2 or advantages.shape[0] != len(prompt_ids):
        raise ValueError(f"advantages must be [{len(prompt_ids)}, G], got {tuple(advantages.shape)}")
    scores = advantages.detach().abs()
    if config.skip_zero_advantage:
        probs = _keep_probs_skipping_zeros(scores, config)
    else:
        probs = solve_keep_probs(scores, prune_rate=config.completion_prune_rate, floor=config.completion_floor)
    ids = _check_ids(prompt_ids, len(prompt_ids), PROMPT_LEVEL)
    if config.sampling == "independent":
        item_ids = [(prompt_id, j) for prompt_id in ids for j in range(advantages.shape[1])]
        keep = sample_keep(probs, seed=seed, step=step, level=COMPLETION_LEVEL, item_ids=item_ids)
    else:
        keep = torch.zeros(probs.shape, dtype=torch.bool)
        for k, prompt_id in enumerate(ids):
            row = advantages[k].detach().to(torch.float64).tolist()
            order = sorted(range(len(row)), key=lambda j: (row[j], j))
            uniform = keep_uniform(seed=seed, step=step, level=COMPLETION_LEVEL, item_id=prompt_id)
            keep[k] = systematic_keep(probs[k], order=order, uniform=uniform)
    return KeepDecision(probs=probs, keep=keep, target_rate=config.completion_prune_rate)


def _keep_probs_skipping_zeros(scores: torch.Tensor, config: DPPOConfig) -> torch.Tensor:
    """Probability 0 for zero scores; the others share the rest of the completion-level rate,
    ``(r n - zeros) / (n - zeros)`` of them pruned (none when the zeros alone reach ``r``)."""
    zero = scores == 0
    probs = torch.zeros(scores.shape, dtype=torch.float64)
    n, zeros = scores.numel(), int(zero.sum())
    if zeros < n:
        rate = max(0.0, (config.completion_prune_rate * n - zeros) / (n - zeros))
        probs[~zero] = solve_keep_probs(scores[~zero], prune_rate=rate, floor=config.completion_floor)
    return probs


class DPPOPruner:
    """DPPO state for a training run: config, seed and the checkpointable prompt history.

    One step::

        prompts = pruner.select_prompts(step=t, prompt_ids=ids)          # before rollout
        kept = [i for i, k in zip(ids, prompts.keep) if k]
        # ... rollout and rewards [len(kept), G] for the kept prompts ...
        advantages = group_advantages(rewards)                            # on full groups
        completions = pruner.select_completions(step=t, prompt_ids=kept, advantages=advantages)
        weights = combine_weights(prompt_weights=prompts.weights[prompts.keep],
                                  completion_weights=completions.weights)
        pruner.observe(prompt_ids=kept, rewards=rewards)                  # after the step
    """

    def __init__(self, *, config: DPPOConfig, seed: int) -> None:
        self.config = config
        self.seed = int(seed)
        self.history = PromptHistory.from_config(config)

    def select_prompts(self, *, step: int, prompt_ids: Sequence[Hashable]) -> KeepDecision:
        return prune_prompts(prompt_ids=prompt_ids, history=self.history, config=self.config, seed=self.seed, step=step)

    def select_completions(
        self, *, step: int, prompt_ids: Sequence[Hashable], advantages: torch.Tensor
    ) -> KeepDecision:
        return prune_completions(
            advantages=advantages, prompt_ids=prompt_ids, config=self.config, seed=self.seed, step=step
        )

    def observe(self, *, prompt_ids: Sequence[Hashable], rewards: torch.Tensor) -> None:
        """Record the full-group rewards of the prompts rolled out this step."""
        self.history.update_batch(prompt_ids, rewards)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "history": self.history.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """The prompt history (its settings may change on resume; see :meth:`PromptHistory.load_state_dict`)."""
        assert state.get("seed") == self.seed, "a resume that changes --seed is refused at load"
        self.history.load_state_dict(state["history"])
