"""The GRPO (+DPPO) objective for the shared training loop, and the run entry point.

One rollout feeds ``ppo_epochs x minibatches`` consecutive optimizer steps; the rollout
buffer lives in the objective and a rollout happens only when the buffer is used up. A
rollout, for the global batch of prompts (identical on every rank):

1. DPPO prompt pruning (before rollout: pruned prompts cost no generation);
2. generation of G completions per kept prompt, each DP rank its share, then gathered;
3. rewards, and group advantages on the full groups;
4. DPPO completion pruning (pruned completions cost no training forward/backward) and the
   importance weights ``1/(p q)``;
5. old log-probs (forward-only, once per rollout, only when a rollout feeds more than one
   update) and reference log-probs (``--kl-beta > 0``).

Every update step trains one minibatch: the kept completions of a fixed slice of the global
prompt list, sharded over DP. Its normaliser comes from the *unpruned* slice
(``prompts x G x max_new_tokens``, or ``prompts x G`` with per-sequence means), so DPPO's
estimator stays unbiased (docs/dppo.md).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_prune.config import CheckpointConfig, LoggingConfig, ModelConfig, TrainConfig
from megatron_prune.data.records import LoadedRecords
from megatron_prune.data.sampler import EpochSampler
from megatron_prune.grpo.advantages import group_advantages, zero_variance_groups
from megatron_prune.grpo.config import DPPOArgs, GRPOConfig, check_prompt_count
from megatron_prune.grpo.dppo import DPPOPruner, combine_weights
from megatron_prune.grpo.rollout import Completion, SamplingSettings, generate
from megatron_prune.grpo.step import GRPOStep, GRPOStepSettings, TrainItem
from megatron_prune.lora_config import lora_active
from megatron_prune.ranks import first_rank
from megatron_prune.training import session
from megatron_prune.training.loop import check_resumed_data_size, train
from megatron_prune.training.parallel import is_logging_rank

logger = logging.getLogger(__name__)

# A step without a gradient still runs the optimizer and the learning-rate schedule, as GRPO's
# reference implementations do, so the run's steps stay the schedule's steps.
_STILL_STEPS = "; the optimizer still steps: its momentum and weight decay, if any, still move the weights"


# ---------------------------------------------------------------------------------------
# prompts and rewards
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One prompt of the task."""

    prompt_id: int
    tokens: tuple[int, ...]
    answer: str
    truncated: bool = False
    """Its template-rendered tokens were left-truncated to fit (BOS and the template head kept)."""


class PromptSource:
    """Indexable prompts of a task plus its reward on completion token ids."""

    def __init__(self, *, size: int, get: Callable[[int], Prompt], score: Callable[[Prompt, list[int]], float],
                 eos_id: int, pad_id: int, records: LoadedRecords | None = None,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        self.records = records
        """The loaded files the prompts come from (None for the toy tasks, which have none)."""
        self.size = size
        self.get = get
        self.score = score
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        """Other tokens that end a completion (see :attr:`SamplingSettings.stop_ids`)."""
        self.pad_id = pad_id

    def __len__(self) -> int:
        return self.size


def toy_source(*, vocab_size: int, num_prompts: int, seed: int, num_digits: int = 10,
               prompt_length: int = 8, binary: bool = False) -> PromptSource:
    from megatron_prune.grpo.rewards import ToyTask, ToyTaskConfig

    task = ToyTask(ToyTaskConfig(vocab_size=vocab_size, seed=seed, num_digits=num_digits, prompt_length=prompt_length,
                                 binary=binary))

    def get(i: int) -> Prompt:
        p = task.prompt(i)
        return Prompt(i, p.token_ids, p.reference_answer)

    def score(prompt: Prompt, completion: list[int]) -> float:
        return task.score_tokens(completion, target_digit=int(prompt.answer))

    return PromptSource(size=num_prompts, get=get, score=score, eos_id=task.config.eos_token_id,
                        pad_id=task.config.pad_token_id)


def math_source(*, task: str, paths: list[str], tokenizer, max_prompt_length: int,
                skip_invalid: bool = False, model_dir: str | None = None) -> PromptSource:
    """Problems of ``paths`` as chat-templated prompts of at most ``max_prompt_length`` tokens
    (longer ones are left-truncated, keeping BOS and the template's preamble, and flagged).
    ``model_dir``: the HF model directory, whose ``generation_config.json`` eos ids end completions
    (else the tokenizer's directory's)."""
    from megatron_prune.data.math import MathDataConfig, MathDataset
    from megatron_prune.data.tokenizer import generation_eos_ids
    from megatron_prune.grpo.rewards import THINK_CLOSE, THINK_OPEN
    from megatron_prune.data.preference import prompt_head_length, truncate_prompt
    from megatron_prune.grpo.rewards import get_reward

    dataset = MathDataset(paths, config=MathDataConfig(format=task, skip_invalid=skip_invalid))
    special = [(p, tokenizer.special_text_in([p.prompt_text])) for p in dataset.problems]
    special = [(p, text) for p, text in special if text is not None]
    if special and first_rank():
        problem, text = special[0]
        logger.warning("special-token text in %d problems (first: %s:%d holds %r) is tokenized as that token; "
                       "prompts already formatted with a chat template are formatted twice: give plain text",
                       len(special), problem.source, problem.line, text)
    reward = get_reward(task)
    head = prompt_head_length(tokenizer)

    def get(i: int) -> Prompt:
        problem = dataset[i]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": problem.prompt_text}], tokenize=True)
        kept = truncate_prompt(ids, max_length=max_prompt_length, keep_head=head, decode=tokenizer.decode)
        return Prompt(i, tuple(kept), problem.answer, truncated=len(kept) < len(ids))

    stops, listed_in = tokenizer.stop_ids, getattr(tokenizer, "path", "")
    model_ids = generation_eos_ids(model_dir, vocab_size=tokenizer.vocab_size) if model_dir else None
    if model_ids is not None:  # the model's own list, where the tokenizer comes from elsewhere
        stops, listed_in = frozenset({tokenizer.eos_id} | model_ids), model_dir
    if stops != {tokenizer.eos_id} and first_rank():
        print(f"[megatron-prune] completions end at eos {tokenizer.eos_id} and at "
              f"{', '.join(map(str, sorted(stops - {tokenizer.eos_id})))} (the eos ids of "
              f"{os.path.join(listed_in, 'generation_config.json')})", flush=True)
    # A template whose generation prompt opens the reasoning block (Qwen3 thinking models, QwQ,
    # R1 distills): the completion starts inside it, and is graded as if it began with <think>.
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], add_generation_prompt=True)
    opened = probe.count(THINK_OPEN) > probe.count(THINK_CLOSE)

    def score(prompt: Prompt, completion: list[int]) -> float:
        if completion and completion[-1] in stops:
            completion = completion[:-1]
        text = tokenizer.decode(completion)
        return float(reward(THINK_OPEN + text if opened else text, prompt.answer))

    return PromptSource(size=len(dataset), get=get, score=score, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                        records=dataset, stop_ids=frozenset(stops - {tokenizer.eos_id}))


# ---------------------------------------------------------------------------------------
# the objective
# ---------------------------------------------------------------------------------------


@dataclass
class RolloutBuffer:
    """One rollout's training items, split into minibatches, and its metrics."""

    index: int
    """Rollout number (keys every draw of the rollout)."""
    minibatches: list[list[TrainItem]]
    """Kept completions of each minibatch (global, in a fixed order)."""
    normalisers: list[float]
    """Normaliser of each minibatch, from its unpruned prompts."""
    metrics: dict[str, float]
    """Reward and pruning metrics of the rollout."""


def _dp() -> tuple[int, int]:
    return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()


def _expert_parallel() -> bool:
    return parallel_state.get_expert_model_parallel_world_size() > 1


def _gather_over_dp(local: list) -> list:
    """Concatenation of every DP rank's ``local`` list, in DP-rank order."""
    _, size = _dp()
    if size == 1:
        return list(local)
    parts: list = [None] * size
    dist.all_gather_object(parts, local, group=parallel_state.get_data_parallel_group())
    return [x for part in parts for x in part]


def rollout_metrics(*, group_size: int, rewards: torch.Tensor, num_prompts: int, kept_prompts: int,
                    minibatches: list, completions: dict, ends: frozenset[int] = frozenset()) -> dict[str, float]:
    """One rollout's logged metrics: ``rewards`` ``[kept prompts, group_size]`` of the prompts rolled
    out (of ``num_prompts`` drawn), ``minibatches`` the completions kept for training, ``ends`` the
    tokens that end a completion (one without any was cut by ``--max-new-tokens``)."""
    kept_completions = sum(len(items) for items in minibatches)
    lengths = [len(t) for group in completions.values() for t in group]
    clipped = sum(not t or t[-1] not in ends for group in completions.values() for t in group)
    return {
        # Means in float64: a float32 mean of 0/1 values logs as 0.800000011920929.
        "reward_mean": float(rewards.double().mean()) if rewards.numel() else 0.0,
        "accuracy": float((rewards == 1.0).double().mean()) if rewards.numel() else 0.0,
        "kept_prompt_fraction": kept_prompts / num_prompts,
        "kept_completion_fraction": kept_completions / max(kept_prompts * group_size, 1),
        "zero_variance_groups": float(zero_variance_groups(rewards).double().mean()) if kept_prompts else 0.0,
        "completion_length": sum(lengths) / max(len(lengths), 1),
        "clipped_completions": clipped / max(len(lengths), 1),
        "rollout_tokens": float(sum(lengths)),
    }


class GRPOObjective:
    """Rollout, rewards, DPPO pruning and the GRPO updates of each step."""

    def __init__(
        self,
        *,
        source: PromptSource,
        runner: GRPOStep,
        grpo: GRPOConfig,
        dppo: DPPOArgs,
        sampling: SamplingSettings,
        train_cfg: TrainConfig,
    ) -> None:
        if train_cfg.global_batch_size % grpo.minibatches:
            raise ValueError(f"--global-batch-size {train_cfg.global_batch_size} does not split into "
                             f"--minibatches {grpo.minibatches}")
        self.source = source
        self.runner = runner
        self.grpo = grpo
        self.dppo_args = dppo
        self.sampling = sampling
        self.train_cfg = train_cfg
        self.sampler = EpochSampler(len(source), seed=train_cfg.seed, distinct=True)  # a group per prompt id
        self.pruner = DPPOPruner(config=dppo.dppo_config(kl_beta=grpo.kl_beta), seed=train_cfg.seed)
        self.buffer: RolloutBuffer | None = None
        self._before_buffer: dict[str, Any] | None = None  # sampler and history before the buffer's draws
        self._steps_done = 0
        self._warned_clipped = False
        self._told_unseen = False

    # -- rollout ----------------------------------------------------------------------------------
    def _generate(self, prompts: list[Prompt], step: int) -> dict[Hashable, list[Completion]]:
        dp_rank, dp_size = _dp()
        mine = prompts[dp_rank::dp_size]
        groups = []
        if mine or _expert_parallel():  # a rank without prompts still runs the MoE forwards of its EP group
            groups = generate(model=self.runner.policy, prompts=[(p.prompt_id, p.tokens) for p in mine],
                              group_size=self.grpo.group_size, settings=self.sampling, step=step)
        local = [(p.prompt_id, [c.tokens for c in group]) for p, group in zip(mine, groups)]
        return dict(_gather_over_dp(local))

    def _step_name(self, step: int) -> str:
        """A step as the progress line numbers it (metrics.jsonl's ``"step"`` counts from 0)."""
        return f"step {step + 1}/{self.train_cfg.train_iters}"

    def _rollout(self, rollout: int, step: int | None = None) -> RolloutBuffer:
        """The rollout of index ``rollout``, drawn at ``step`` (by default the rollout's first). Its
        draws are keyed by that step, not by the index: a resume that changes the updates per
        rollout maps later steps onto indices an earlier split already drew with."""
        step = rollout * self.grpo.updates_per_rollout if step is None else step
        timer = time.perf_counter()
        G = self.grpo.group_size
        self._before_buffer = {"sampler": self.sampler.state_dict(), "dppo": self.pruner.state_dict()}
        ids = self.sampler.next_indices(self.train_cfg.global_batch_size)
        prompts = {i: self.source.get(i) for i in ids}
        prompt_decision = self.pruner.select_prompts(step=step, prompt_ids=ids)
        self._tell_unseen(ids, step)
        kept_ids = [i for i, keep in zip(ids, prompt_decision.keep.tolist()) if keep]
        completions = self._generate([prompts[i] for i in kept_ids], step)
        rollout_time = time.perf_counter() - timer

        rewards = torch.tensor(
            [[self.source.score(prompts[i], tokens) for tokens in completions[i]] for i in kept_ids], dtype=torch.float32
        ).reshape(len(kept_ids), G)
        advantages = group_advantages(rewards, config=self.grpo.advantage_config())
        completion_decision = self.pruner.select_completions(step=step, prompt_ids=kept_ids, advantages=advantages)
        weights = combine_weights(prompt_weights=prompt_decision.weights[prompt_decision.keep],
                                  completion_weights=completion_decision.weights)
        self.pruner.observe(prompt_ids=kept_ids, rewards=rewards)

        per_minibatch = len(ids) // self.grpo.minibatches
        slot = {i: position // per_minibatch for position, i in enumerate(ids)}
        minibatches: list[list[TrainItem]] = [[] for _ in range(self.grpo.minibatches)]
        for k, i in enumerate(kept_ids):
            for j in range(G):
                if completion_decision.keep[k, j]:
                    minibatches[slot[i]].append(TrainItem(
                        prompt_id=i, index=j, prompt=list(prompts[i].tokens), completion=list(completions[i][j]),
                        advantage=float(advantages[k, j]), weight=float(weights[k, j]),
                    ))
        tokens_per = G * (self.grpo.max_new_tokens if self.grpo.loss_normalization == "constant" else 1)
        normalisers = [float(per_minibatch * tokens_per)] * self.grpo.minibatches
        metrics = rollout_metrics(group_size=G, rewards=rewards, num_prompts=len(ids), kept_prompts=len(kept_ids),
                                  minibatches=minibatches, completions=completions,
                                  ends=self.source.stop_ids | {self.source.eos_id})
        metrics["rollout_time_s"] = rollout_time
        self._warn_clipped(metrics["clipped_completions"], step)
        # Unbiased all-prompt mean reward (reward_mean averages the rolled-out prompts only): every
        # completion of a rolled-out prompt is scored, so the prompt weight 1/p is the only correction.
        prompt_weights = prompt_decision.weights[prompt_decision.keep]
        metrics["reward_mean_weighted"] = float((prompt_weights[:, None] * rewards.double()).sum()) / (len(ids) * G)
        metrics["truncated_prompts"] = float(sum(prompts[i].truncated for i in ids))
        if metrics["truncated_prompts"] and is_logging_rank():
            logger.warning("%s: %d of %d prompts were longer than the prompt budget and were left-truncated "
                           "(BOS and the chat template's head kept); set --max-prompt-length or a longer --seq-length",
                           self._step_name(step), int(metrics["truncated_prompts"]), len(ids))

        forward_only = 0  # this rank's tokens of the forward-only passes; summed over DP in train_step
        timer = time.perf_counter()
        # A minibatch (or a rank's share) may lose every completion to pruning; under expert
        # parallelism the rank still runs placeholder forwards with its EP group.
        if self.grpo.kl_beta > 0:
            for items in minibatches:
                if self._mine(items) or _expert_parallel():
                    forward_only += self.runner.score(self._mine(items), which="ref").valid_tokens
        metrics["reference_time_s"] = time.perf_counter() - timer
        timer = time.perf_counter()
        if self.grpo.updates_per_rollout > 1:
            for items in minibatches:
                if self._mine(items) or _expert_parallel():
                    forward_only += self.runner.score(self._mine(items), which="old").valid_tokens
        metrics["old_logprob_time_s"] = time.perf_counter() - timer
        metrics["forward_only_tokens"] = float(forward_only)
        return RolloutBuffer(rollout, minibatches, normalisers, metrics)

    def _mine(self, items: list[TrainItem]) -> list[TrainItem]:
        dp_rank, dp_size = _dp()
        if not self.runner.s.shared_prompt:
            return items[dp_rank::dp_size]
        # Whole groups per rank, so that a group's completions share one prompt copy.
        groups: dict = {}
        for it in items:
            groups.setdefault(it.prompt_id, []).append(it)
        return [it for k, members in enumerate(groups.values()) if k % dp_size == dp_rank for it in members]

    # -- the loop's interface ---------------------------------------------------------------------
    def train_step(self, step: int) -> dict[str, float]:
        self._steps_done = step + 1
        updates = self.grpo.updates_per_rollout
        rollout, update = divmod(step, updates)
        fresh = self.buffer is None or self.buffer.index != rollout
        if fresh:
            if update and self.buffer is None and is_logging_rank():
                logger.warning("%s: resumed inside the rollout of %s: rolling out again with the current policy",
                               self._step_name(step), self._step_name(rollout * updates))
            self.buffer = self._rollout(rollout, step)
        minibatch = update % self.grpo.minibatches
        timer = time.perf_counter()
        metrics, layout = self.runner.train(self._mine(self.buffer.minibatches[minibatch]),
                                            normaliser=self.buffer.normalisers[minibatch])
        train_time = time.perf_counter() - timer
        rollout_metrics = dict(self.buffer.metrics)
        if not fresh:  # phases that ran at an earlier step cost nothing now
            for key in ("rollout_time_s", "reference_time_s", "old_logprob_time_s", "forward_only_tokens"):
                rollout_metrics[key] = 0.0
        counts = torch.tensor([layout.valid_tokens, layout.row_tokens, rollout_metrics["forward_only_tokens"]],
                              dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        if is_logging_rank():
            self._say_nothing_trained(step, fresh, rollout_metrics, minibatch)
        return {
            **metrics, **rollout_metrics,
            "train_time_s": train_time + rollout_metrics["old_logprob_time_s"],
            "policy_tokens": float(counts[0]),
            "train_tokens": float(counts[0]),
            "forward_only_tokens": float(counts[2]),
            "density": float(counts[0] / counts[1]) if counts[1] else 1.0,
            "fresh_rollout": float(fresh),
        }

    def _say_nothing_trained(self, step: int, fresh: bool, metrics: dict[str, float], minibatch: int) -> None:
        """Warn of a step whose loss and gradient are 0 by construction (an empty rollout: at its first step)."""
        name = self._step_name(step)
        if metrics["kept_prompt_fraction"] == 0:
            if fresh:
                logger.warning("%s: prompt pruning kept none of this rollout's prompts, so nothing was rolled out or "
                               "trained; its reward metrics are 0 by convention%s", name, _STILL_STEPS)
        elif metrics["zero_variance_groups"] == 1.0 and self.grpo.kl_beta == 0:
            logger.warning("%s: every group's rewards are equal (zero variance), so every advantage is 0: loss and "
                           "gradient are 0%s", name, _STILL_STEPS)
        elif not self.buffer.minibatches[minibatch]:
            # A minibatch holds the drawn prompts of its positions, so pruning (or skipping the completions
            # whose advantage is 0) can empty it while others train: its share of the estimate is 0.
            logger.warning("%s: minibatch %d of %d of this rollout kept no completions (its prompts pruned, or "
                           "its completions' advantages all 0), so this update trains nothing (loss and gradient "
                           "0)%s", name, minibatch + 1, self.grpo.minibatches, _STILL_STEPS)

    def evaluate(self, step: int) -> dict[str, float] | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        """Sampler position and prompt history; inside a rollout (the next step reuses the current
        rollout) also that rollout, so a resumed run trains on the same completions, weights and
        old log-probs. Collective (gathers the log-probs each rank scored): call it on every rank."""
        state: dict[str, Any] = {"sampler": self.sampler.state_dict(), "dppo": self.pruner.state_dict()}
        if self.source.records is not None:
            state["data_sha256"] = self.source.records.content_sha256
        if self.buffer is not None and self._steps_done % self.grpo.updates_per_rollout:
            state["rollout"] = self._buffer_state()
            state["before_rollout"] = self._before_buffer  # a resume that cannot reuse it draws it again
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        reused = "rollout" in state and self._reusable(state["rollout"])
        # A saved rollout this run cannot reuse is drawn again: the same prompts, from the sampler
        # position and prompt history before it (checkpoints saved before they were kept: after it).
        source = (state.get("before_rollout") or state) if "rollout" in state and not reused else state
        if "sampler" in source:
            self.sampler.load_state_dict(source["sampler"])
        if "dppo" in source:
            self.pruner.load_state_dict(source["dppo"])
        if reused:
            self.buffer = self._load_buffer(state["rollout"])
            self._before_buffer = state.get("before_rollout")  # for the next save inside this rollout

    def _reusable(self, saved: dict[str, Any]) -> bool:
        """Whether this run can train on the saved rollout; says why not."""
        splits = (len(saved["minibatches"]), saved.get("updates_per_rollout", self.grpo.updates_per_rollout))
        changed = self._changed_rollout_flags(saved)
        if splits != (self.grpo.minibatches, self.grpo.updates_per_rollout):
            if is_logging_rank():  # its minibatches and update count no longer map onto this run's steps
                logger.warning("the checkpoint stopped inside a rollout split into %d minibatches for %d "
                               "updates; this run has --minibatches %d and %d updates per rollout (--ppo-epochs "
                               "%d), so that rollout is not reused", *splits, self.grpo.minibatches,
                               self.grpo.updates_per_rollout, self.grpo.ppo_epochs)
            return False
        if changed:
            if is_logging_rank():
                logger.warning("the checkpoint stopped inside a rollout made with %s, so that rollout is not "
                               "reused", "; ".join(changed))
            return False
        if self._rerendered_prompts(saved):
            if is_logging_rank():
                logger.warning("the checkpoint stopped inside a rollout whose prompts this run makes of other "
                               "tokens (changed data files, tokenizer, --chat-template-kwargs, --max-prompt-length "
                               "or --seq-length), so that rollout is not reused")
            return False
        return True

    def _tell_unseen(self, ids: list, step: int) -> None:
        """Say once when prompt pruning is on but no prompt of the step has a history: a prompt
        never rolled out has keep probability 1, so nothing is pruned until prompts come round again."""
        if (self.dppo_args.prompt_prune_rate <= 0 or self._told_unseen
                or any(i in self.pruner.history for i in ids) or not is_logging_rank()):
            return
        self._told_unseen = True
        logger.warning("%s: no prompt of this step has been rolled out before, so --dppo-prompt-prune-rate keeps "
                       "them all: a prompt is pruned only from its second visit, by its reward history (the first "
                       "epoch over %d prompts is %d steps at --global-batch-size %d; said once)", self._step_name(step),
                       len(self.source), -(-len(self.source) // len(ids)) * self.grpo.updates_per_rollout, len(ids))

    def _warn_clipped(self, clipped: float, step: int) -> None:
        """Say once when most completions of a graded task run out of --max-new-tokens: a cut
        completion states no final answer, so it scores 0 whatever it was reasoning towards."""
        if clipped <= 0.5 or self.source.records is None or self._warned_clipped or not is_logging_rank():
            return
        self._warned_clipped = True
        logger.warning("%s: %.0f%% of the completions reached --max-new-tokens %d without ending, and a completion "
                       "cut before its final answer scores 0; raise --max-new-tokens if the model needs more room "
                       "(said once; the clipped_completions metric follows it)", self._step_name(step),
                       100 * clipped, self.grpo.max_new_tokens)

    def _rollout_flags(self) -> dict[str, Any]:
        """The flags a saved rollout was made for: its reference log-probs and kept zero-advantage
        completions (a KL term or not), its normalisers, its old log-probs' temperature and the
        tokens that ended its completions."""
        return {"--kl-beta": "> 0" if self.grpo.kl_beta > 0 else "0",
                "--loss-normalization": self.grpo.loss_normalization,
                "--max-new-tokens": self.grpo.max_new_tokens,
                "--group-size": self.grpo.group_size,
                "--temperature": self.grpo.temperature,
                "stop ids": sorted(self.source.stop_ids | {self.source.eos_id})}

    def _rerendered_prompts(self, saved: dict[str, Any]) -> bool:
        """Whether a prompt of the saved rollout is not the tokens this run gives its prompt id."""
        saved_prompts = {item["prompt_id"]: tuple(item["prompt"]) for items in saved["minibatches"] for item in items}
        return any(not 0 <= i < len(self.source) or tokens != self.source.get(i).tokens
                   for i, tokens in saved_prompts.items())

    def _changed_rollout_flags(self, saved: dict[str, Any]) -> list[str]:
        """``"--flag X (this run: Y)"`` for each of :meth:`_rollout_flags` the saved rollout differs in.
        A checkpoint from before the flags were recorded is checked for its reference log-probs only."""
        mine = self._rollout_flags()
        if "flags" not in saved:
            has_ref = any(which == "ref" for _, _, which in saved["logprobs"])
            saved = {"flags": {"--kl-beta": "> 0" if has_ref else "0"} if saved["logprobs"] else {}}
        return [f"{flag} {value} (this run: {mine[flag]})" for flag, value in saved["flags"].items()
                if flag in mine and value != mine[flag]]

    def _buffer_state(self) -> dict[str, Any]:
        buffer = self.buffer
        scored = {}  # each rank scored its own share (on the last pipeline stage)
        for m, items in enumerate(buffer.minibatches):
            for n, item in enumerate(items):
                for which in ("old", "ref"):
                    values = getattr(item, f"{which}_logprobs")
                    if values is not None:
                        scored[(m, n, which)] = values.detach().cpu()
        if dist.is_initialized() and dist.get_world_size() > 1:
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, scored)
            scored = {key: value for part in parts for key, value in part.items()}
        fields = ("prompt_id", "index", "prompt", "completion", "advantage", "weight")
        return {
            "index": buffer.index, "normalisers": list(buffer.normalisers), "metrics": dict(buffer.metrics),
            "updates_per_rollout": self.grpo.updates_per_rollout, "flags": self._rollout_flags(),
            "minibatches": [[{name: getattr(item, name) for name in fields} for item in items]
                            for items in buffer.minibatches],
            "logprobs": scored,
        }

    @staticmethod
    def _load_buffer(state: dict[str, Any]) -> RolloutBuffer:
        minibatches = [[TrainItem(**item) for item in items] for items in state["minibatches"]]
        for (m, n, which), values in state["logprobs"].items():
            setattr(minibatches[m][n], f"{which}_logprobs", values)
        return RolloutBuffer(state["index"], minibatches, list(state["normalisers"]), dict(state["metrics"]))


# ---------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------


def build_source(grpo: GRPOConfig, *, arch, model_cfg: ModelConfig, ckpt_cfg: CheckpointConfig,
                 train_cfg: TrainConfig, tokenizer_name: str | None = None, tokenizer=None) -> PromptSource:
    """The task's prompts; ``tokenizer`` is the loaded tokenizer, else ``tokenizer_name`` the
    resolved one (resolved here when None too)."""
    if grpo.task in ("toy", "toy-binary"):
        return toy_source(vocab_size=arch.vocab_size, num_prompts=grpo.toy_num_prompts, seed=train_cfg.seed,
                          num_digits=grpo.toy_num_digits, prompt_length=grpo.toy_prompt_length,
                          binary=grpo.task == "toy-binary")
    if not grpo.data_path:
        raise session.UsageError(f"--task {grpo.task} needs --data-path")
    from megatron_prune.data.tokenizer import load_tokenizer

    if tokenizer is None:
        tokenizer = load_tokenizer(tokenizer_name or session.resolve_tokenizer(model_cfg, ckpt_cfg),
                                   chat_template_kwargs=model_cfg.chat_template_args)
    if tokenizer.vocab_size > arch.vocab_size:
        raise session.UsageError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {arch.vocab_size}")
    # Without --max-prompt-length a prompt may use whatever the completion leaves of --seq-length.
    limit = train_cfg.max_prompt_length or train_cfg.seq_length - grpo.max_new_tokens
    return math_source(task=grpo.task, paths=grpo.data_path, tokenizer=tokenizer, max_prompt_length=limit,
                       skip_invalid=grpo.skip_invalid, model_dir=model_cfg.hf_model)


def build_objective(*, configs: dict[str, Any], arch, policy, reference, source: PromptSource) -> GRPOObjective:
    """The objective from the parsed configs (also used by tests and the benchmark)."""
    train_cfg: TrainConfig = configs["TrainConfig"]
    grpo: GRPOConfig = configs["GRPOConfig"]
    dppo: DPPOArgs = configs["DPPOArgs"]
    settings = GRPOStepSettings(
        loss=grpo.loss_config(), micro_batch_size=train_cfg.micro_batch_size, pad_id=source.pad_id,
        normalization=grpo.loss_normalization, dense_packing=dppo.dense_packing, shared_prompt=dppo.shared_prompt,
        pack_capacity=train_cfg.seq_length, pack_window=dppo.pack_window, temperature=grpo.temperature,
    )
    sampling = SamplingSettings(
        max_new_tokens=grpo.max_new_tokens, eos_id=source.eos_id, stop_ids=source.stop_ids, pad_id=source.pad_id,
        vocab_size=arch.vocab_size,
        seed=train_cfg.seed, temperature=grpo.temperature, top_p=grpo.top_p, kv_cache=grpo.kv_cache,
        micro_batch_size=grpo.rollout_micro_batch_size,
    )
    runner = GRPOStep(settings=settings, policy=policy, reference=reference)
    return GRPOObjective(source=source, runner=runner, grpo=grpo, dppo=dppo, sampling=sampling, train_cfg=train_cfg)


def run_grpo(configs: dict[str, Any], checked: session.LaunchChecks | None = None) -> list[dict[str, Any]]:
    """Train GRPO as the flags say; ``checked`` is what the CLI's launch checks returned for these
    configs, looked up here when None."""
    model_cfg: ModelConfig = configs["ModelConfig"]
    train_cfg: TrainConfig = configs["TrainConfig"]
    ckpt_cfg: CheckpointConfig = configs["CheckpointConfig"]
    log_cfg: LoggingConfig = configs["LoggingConfig"]
    grpo: GRPOConfig = configs["GRPOConfig"]
    from megatron_prune.lora_config import lora_meta

    toy = grpo.task in ("toy", "toy-binary")  # the toy tasks use token ids, no tokenizer
    if checked is None:
        arch, lora_base = session.resolve_model_and_base(configs, kind="grpo")
        tokenizer = None
        tokenizer_name = None if toy or not grpo.data_path else session.resolve_tokenizer(model_cfg, ckpt_cfg)
    else:
        arch, lora_base, tokenizer, tokenizer_name = (checked.arch, checked.lora_base, checked.tokenizer,
                                                      checked.tokenizer_spec)
    source = build_source(grpo, arch=arch, model_cfg=model_cfg, ckpt_cfg=ckpt_cfg, train_cfg=train_cfg,
                          tokenizer_name=tokenizer_name, tokenizer=tokenizer)
    check_prompt_count(len(source), train_cfg.global_batch_size, grpo)
    lora = configs.get("LoRAConfig")
    lora_on = lora_active(lora)
    check_resumed_data_size(ckpt_cfg, num_samples=len(source), kind="grpo", lora=lora_on)
    # Recorded at --kl-beta 0 too, so a resume may turn the KL term on against the same model.
    ref_source, ref_meta = None, {}
    try:
        ref_source = session.reference_source(model_cfg, ckpt_cfg, grpo.ref_load, lora_base=lora_base)
        ref_meta = session.reference_meta(model_cfg, ckpt_cfg, ref_source, lora_base=lora_base)
    except session.UsageError:
        if grpo.kl_beta > 0:
            raise
    parallel = session.start(model_cfg, train_cfg, configs)
    session.check_same_data({"--data-path": source.records.content_sha256 if source.records is not None else None})
    parts = session.build_parts(arch, parallel, model_cfg, train_cfg, lora=lora, lora_base=lora_base)
    parts.extra_meta.update(ref_meta)
    reference = None
    if grpo.kl_beta > 0:
        if lora_on and not grpo.ref_load:
            from megatron_prune.model.lora import adapter_off

            reference = adapter_off(parts.model)  # the KL reference: the policy with adapters off
        else:
            reference = session.build_reference(arch, parallel, model_cfg, train_cfg, ref_source,
                                                lora_base=lora_base, ckpt=ckpt_cfg)
    parts.extra_meta.update(lora_meta(lora, base=lora_base))
    parts.extra_meta["flags"] = session.flag_record(configs)
    if tokenizer_name is not None:
        parts.extra_meta.update(session.tokenizer_meta(tokenizer_name))
    objective = build_objective(configs=configs, arch=arch, policy=parts.model, reference=reference, source=source)
    return train(objective=objective, parts=parts, train_cfg=train_cfg, ckpt=ckpt_cfg, log_cfg=log_cfg)
