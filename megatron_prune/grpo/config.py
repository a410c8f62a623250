"""Flags of the GRPO trainer: the objective and rollout (``GRPOConfig``) and DPPO (``DPPOArgs``).

Each field's docstring is its ``--help`` text (:mod:`megatron_prune.arguments`). The classes
translate into the component configs of :mod:`megatron_prune.grpo` (``AdvantageConfig``,
``GRPOLossConfig``, ``DPPOConfig``), which validate the values again.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from megatron_prune.grpo.advantages import AdvantageConfig
from megatron_prune.grpo.dppo import DPPOConfig
from megatron_prune.grpo.loss import GRPOLossConfig

TASKS = ("toy", "toy-binary", "gsm8k", "math")
TOY_TASKS = ("toy", "toy-binary")
MIN_TEMPERATURE = 1e-4
"""Smallest positive --temperature (0 is greedy)."""
NORMALISATIONS = ("constant", "sequence")
ADVANTAGE_STDS = ("population", "sample")
ADVANTAGE_EPS = {"population": 1e-6, "sample": 1e-4}
"""Added to the std before dividing, per --advantage-std."""


def _flag(name: str, **extra) -> dict:
    return {"flag": name, **extra}


@dataclass(kw_only=True)
class GRPOConfig:
    """The GRPO objective, its prompts and its rollout."""

    task: str = field(default="toy", metadata=_flag("--task", choices=TASKS))
    """Prompts and verifiable reward: toy (learnable by a tiny model on CPU; reward = fraction of
    answer tokens in the prompt's digit class), toy-binary (the same prompts, reward 1 when the first
    answer token is in the class, else 0: whole groups all-right or all-wrong), gsm8k or math."""
    data_path: list[str] = field(default_factory=list, metadata=_flag("--data-path", nargs="+"))
    """GSM8K / MATH problem files (JSONL or Parquet); needed for --task gsm8k|math."""
    skip_invalid: bool = field(default=False, metadata=_flag("--skip-invalid-records"))
    """Skip malformed problem records with a counted, logged warning instead of stopping at the first one."""
    toy_num_prompts: int = field(default=256, metadata=_flag("--toy-num-prompts"))
    """Size of the toy task's prompt set (prompts 0..N-1 of its deterministic stream)."""
    toy_num_digits: int = field(default=10, metadata=_flag("--toy-num-digits"))
    """Digit classes of the toy task (2..10); a random policy scores about 1/N."""
    toy_prompt_length: int = field(default=3, metadata=_flag("--toy-prompt-length"))
    """Toy prompt tokens: BOS, random filler, SEP, the digit token (>= 3; 3 = no filler: the tiny
    transformer learns it within ~40 steps, random filler slows it down several-fold)."""
    group_size: int = field(default=8, metadata=_flag("--group-size"))
    """G: completions sampled per prompt."""
    max_new_tokens: int = field(default=16, metadata=_flag("--max-new-tokens"))
    """Most tokens generated per completion (eos or a stop id ends one earlier); the default suits the toy tasks,
    GSM8K/MATH completions need room for their reasoning and answer (a few hundred tokens)."""
    temperature: float = field(default=1.0, metadata=_flag("--temperature"))
    """Sampling temperature; 0 = greedy (a group's completions are then identical, so their advantages are 0).
    Training log-probs are taken at the same temperature (greedy: 1)."""
    top_p: float = field(default=1.0, metadata=_flag("--top-p"))
    """Nucleus sampling: sample from the smallest token set with this much probability; 1 = off (unused at
    --temperature 0). Training log-probs use the whole tempered distribution, as TRL's and verl's do, so
    below 1 the completions are slightly off-policy for the loss."""
    rollout_micro_batch_size: int | None = field(default=None, metadata=_flag("--rollout-micro-batch-size"))
    """Sequences per generation microbatch (default: all of a rank's sequences in one)."""
    kv_cache: bool = field(default=False, metadata=_flag("--kv-cache"))
    """KV-cached generation on Megatron's inference path (StaticInferenceContext), prompts of different
    lengths in one batch; any TP / PP / VPP layout (each pipeline stage keeps its own layers' cache). With
    --sequence-parallel the cached forwards run without it (a decoding step feeds one token per row) and
    training with it. The same tokens as without the cache in fp32; in bf16 near-ties may differ (rounding)."""
    clip_eps_low: float = field(default=0.2, metadata=_flag("--clip-eps-low"))
    """Lower clip of the PPO ratio: 1 - eps_low (it binds only when a rollout feeds several updates: --ppo-epochs
    or --minibatches > 1; with one, the ratio is exactly 1)."""
    clip_eps_high: float = field(default=0.2, metadata=_flag("--clip-eps-high"))
    """Upper clip of the PPO ratio: 1 + eps_high (DAPO's clip-higher uses e.g. 0.28); like --clip-eps-low it
    binds only when a rollout feeds several updates."""
    kl_beta: float = field(default=0.0, metadata=_flag("--kl-beta"))
    """Coefficient of the k3 KL to the reference (a frozen copy of the starting model; under LoRA the policy with
    its adapters switched off); 0 = no KL term and no reference pass."""
    normalize_std: bool = field(default=True, metadata=_flag("--std-normalization", bool_off="--no-std-normalization"))
    """Divide group-relative advantages by the group's reward std (off: Dr. GRPO's r - mean)."""
    advantage_std: str = field(default="population", metadata=_flag("--advantage-std", choices=ADVANTAGE_STDS))
    """Which std --std-normalization divides by: population (divide by G, plus 1e-6) or sample (divide by
    G - 1, plus 1e-4, as TRL does); they differ by a factor sqrt(G / (G - 1))."""
    loss_normalization: str = field(default="constant", metadata=_flag("--loss-normalization", choices=NORMALISATIONS))
    """Token-loss normaliser from the unpruned batch: constant (prompts x G x max-new-tokens) or sequence (per-sequence mean over prompts x G)."""
    ppo_epochs: int = field(default=1, metadata=_flag("--ppo-epochs"))
    """Passes over each rollout batch; every pass is --minibatches optimizer steps."""
    minibatches: int = field(default=1, metadata=_flag("--minibatches"))
    """Optimizer steps per pass over a rollout batch (its prompts split into this many parts)."""
    ref_load: str | None = field(default=None, metadata=_flag("--ref-load"))
    """Checkpoint of the reference model for --kl-beta > 0 (default: the starting model, with --finetune the loaded weights; a resumed run uses the one it recorded)."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in ("toy_num_prompts", "max_new_tokens", "ppo_epochs", "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # Logits divided by it overflow: the log-probs turn infinite and the loss NaN.
            raise ValueError(f"--temperature {self.temperature} is below {MIN_TEMPERATURE}, where the scaled logits "
                             "overflow; use --temperature 0 for greedy sampling")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.rollout_micro_batch_size is not None and self.rollout_micro_batch_size < 1:
            raise ValueError(f"--rollout-micro-batch-size must be >= 1, got {self.rollout_micro_batch_size}")
        if self.loss_normalization not in NORMALISATIONS:
            raise ValueError(f"--loss-normalization must be one of {NORMALISATIONS}, got {self.loss_normalization!r}")
        self.loss_config()  # validates the clip and KL values
        self.advantage_config()
        if self.group_size < 2:
            raise ValueError(f"--group-size must be >= 2, got {self.group_size}: advantages are relative to the "
                             "group, so with one completion per prompt every advantage is 0 and nothing trains")
        if not 2 <= self.toy_num_digits <= 10:
            raise ValueError(f"--toy-num-digits must be in [2, 10], got {self.toy_num_digits}")
        if self.toy_prompt_length < 3:
            raise ValueError(f"--toy-prompt-length must be >= 3 (BOS, separator, digit), got {self.toy_prompt_length}")
        if self.task in TOY_TASKS and self.data_path:
            raise ValueError(f"--data-path is for --task gsm8k or math; --task {self.task} makes its own prompts")

    @property
    def updates_per_rollout(self) -> int:
        """Optimizer steps that reuse one rollout batch."""
        return self.ppo_epochs * self.minibatches

    def loss_config(self) -> GRPOLossConfig:
        try:
            return GRPOLossConfig(clip_eps_low=self.clip_eps_low, clip_eps_high=self.clip_eps_high, kl_beta=self.kl_beta)
        except ValueError as exc:
            message = str(exc)
            for name in ("clip_eps_low", "clip_eps_high", "kl_beta"):  # the flags, not the fields
                message = message.replace(name, "--" + name.replace("_", "-"))
            raise ValueError(message) from None

    def advantage_config(self) -> AdvantageConfig:
        if self.advantage_std not in ADVANTAGE_STDS:
            raise ValueError(f"--advantage-std must be one of {', '.join(ADVANTAGE_STDS)}, got {self.advantage_std!r}")
        if self.normalize_std and self.advantage_std == "sample" and self.group_size < 2:
            raise ValueError("--advantage-std sample needs --group-size >= 2")
        return AdvantageConfig(normalize_std=self.normalize_std, unbiased_std=self.advantage_std == "sample",
                               eps=ADVANTAGE_EPS[self.advantage_std])


@dataclass(kw_only=True)
class DPPOArgs:
    """DPPO: unbiased prompt- and completion-level pruning, and dense packing (docs/dppo.md)."""

    prompt_prune_rate: float = field(default=0.0, metadata=_flag("--dppo-prompt-prune-rate"))
    """r_q: expected fraction of prompts pruned before rollout (they cost no rollout); 0 = off. A prompt
    never rolled out is kept, so pruning starts at the prompts' second visit (the second epoch)."""
    completion_prune_rate: float = field(default=0.0, metadata=_flag("--dppo-completion-prune-rate"))
    """r_o: expected fraction of completions pruned after rewards (no training forward/backward); 0 = off."""
    prompt_floor: float = field(default=0.3, metadata=_flag("--dppo-prompt-floor"))
    """Smallest prompt keep probability under --dppo-prompt-prune-rate (> 0; the importance weight is at most its inverse). At most 1 - floor of
    the prompts can be pruned. 0.3 (with the completion floor: weights <= 11) learns better per step and per second
    than 0.1 (weights <= 100) on the benchmark tasks: the floor bounds the gradient's variance (docs/dppo.md)."""
    completion_floor: float = field(default=0.3, metadata=_flag("--dppo-completion-floor"))
    """Smallest completion keep probability under --dppo-completion-prune-rate (> 0); at most 1 - floor of the completions can be pruned."""
    history_decay: float = field(default=0.5, metadata=_flag("--dppo-history-decay"))
    """EMA decay of each prompt's reward-spread history (it sets the prompt keep probabilities under
    --dppo-prompt-prune-rate)."""
    history_score: str = field(default="std", metadata=_flag("--dppo-history-score",
                                                             choices=("std", "informative", "pass-rate")))
    """What the prompt history scores (under --dppo-prompt-prune-rate): std (moving average of each group's reward
    std), informative (of 1 if the std is nonzero), or pass-rate (rewards in [0, 1]: the probability that the
    prompt's next group has unequal rewards, from a Beta posterior of its pass rate with counts decayed by
    --dppo-history-decay)."""
    sampling: str = field(default="systematic", metadata=_flag("--dppo-sampling", choices=("systematic", "independent")))
    """Completion keep draws under --dppo-completion-prune-rate: systematic (one uniform per group, completions in order of advantage: each group keeps
    a balanced spread of its advantages) or independent (one uniform per completion). Both keep each completion with
    exactly its probability (unbiased); systematic keeps each group's count at its expected number, rounded, and its weighted
    advantages near zero (docs/dppo.md)."""
    prompt_sampling: str = field(default="independent",
                                 metadata=_flag("--dppo-prompt-sampling", choices=("independent", "systematic")))
    """Prompt keep draws under --dppo-prompt-prune-rate: independent (one uniform per prompt) or systematic (one uniform per batch, prompts in order
    of keep probability: the number kept is the expected number, rounded)."""
    dense_packing: bool = field(default=False, metadata=_flag("--dense-packing"))
    """Pack the surviving sequences into rows of --seq-length tokens, rounded up to a multiple of lcm(8, TP)
    (each sequence attends only to itself)."""
    shared_prompt: bool = field(default=False, metadata=_flag("--shared-prompt"))
    """Run each prompt once for all of its kept completions, [prompt, c1, ..., ck], in the training, old-policy and
    reference passes (each completion attends to the prompt and itself; exact: same loss and gradients, fewer
    tokens); with --dense-packing a row holds several such groups. Rollout is unchanged."""
    pack_window: int = field(default=64, metadata=_flag("--pack-window"))
    """Sequences sorted together by --dense-packing's window-based first-fit-decreasing packer."""
    skip_zero_advantage: bool = field(default=True, metadata=_flag("--skip-zero-advantage",
                                                                   bool_off="--no-skip-zero-advantage"))
    """Leave completions whose advantage is exactly 0 (every completion of a group with equal rewards) out of
    the training passes when --kl-beta is 0: their loss and gradient are exactly 0, so this is exact (with or
    without DPPO; DPPO's completion rate is then met by the other completions). Off with --kl-beta > 0."""

    def __post_init__(self) -> None:
        if self.pack_window < 1:
            raise ValueError(f"--pack-window must be >= 1, got {self.pack_window}")
        self.dppo_config(kl_beta=0.0)  # validates the rates and floors

    def dppo_config(self, *, kl_beta: float) -> DPPOConfig:
        """The pruner's config; ``kl_beta`` (required: skipping with a KL term would drop its gradient)
        decides whether zero-advantage completions may be skipped."""
        try:
            return DPPOConfig(
                prompt_prune_rate=self.prompt_prune_rate, completion_prune_rate=self.completion_prune_rate,
                prompt_floor=self.prompt_floor, completion_floor=self.completion_floor,
                history_decay=self.history_decay, history_score=self.history_score,
                sampling=self.sampling, prompt_sampling=self.prompt_sampling,
                skip_zero_advantage=self.skip_zero_advantage and kl_beta == 0,
            )
        except ValueError as exc:  # DPPOConfig names its fields; the user typed the flags
            message = re.sub(r"\b(prompt_prune_rate|completion_prune_rate|prompt_floor|completion_floor|history_decay|"
                             r"history_score|prompt_sampling|sampling)\b",
                             lambda m: "--dppo-" + m.group(1).replace("_", "-"), str(exc))
            raise ValueError(message) from None


def check_prompt_count(num_prompts: int, global_batch_size: int, grpo: GRPOConfig) -> None:
    """A step samples ``--global-batch-size`` different prompts; refuse a task with fewer."""
    if num_prompts >= global_batch_size:
        return
    from megatron_prune.arguments import UsageError  # not at the top: the MindSpeed adapter imports this module

    where = (f"--toy-num-prompts is {num_prompts}" if grpo.task in TOY_TASKS
             else f"--data-path {' '.join(grpo.data_path)} holds {num_prompts} usable prompts")
    raise UsageError(f"--global-batch-size {global_batch_size} asks for {global_batch_size} different prompts "
                     f"a step (one group of --group-size completions each), but {where}: lower "
                     f"--global-batch-size to at most {num_prompts} or give more prompts")


def check_lengths(*, seq_length: int, max_new_tokens: int, max_prompt_length: int | None,
                  toy_prompt_length: int | None = None) -> None:
    """A prompt and its completion must fit in one ``--seq-length`` sequence; refuse lengths that cannot."""
    from megatron_prune.arguments import UsageError

    room = seq_length - max_new_tokens
    if room < 1:
        raise UsageError(f"--seq-length {seq_length} leaves no room for a prompt before --max-new-tokens "
                         f"{max_new_tokens}; raise --seq-length or lower --max-new-tokens")
    if max_prompt_length is not None and max_prompt_length > room:
        raise UsageError(f"--max-prompt-length {max_prompt_length} + --max-new-tokens {max_new_tokens} "
                         f"exceed --seq-length {seq_length}: a prompt and its completion would not fit in one "
                         f"sequence; lower --max-prompt-length to at most {room} or raise --seq-length")
    if toy_prompt_length is not None and toy_prompt_length > room:
        raise UsageError(f"--toy-prompt-length {toy_prompt_length} + --max-new-tokens {max_new_tokens} "
                         f"exceed --seq-length {seq_length}")
