"""Flags that other settings make pointless: one line each, before any rank works (also under ``--dry-run``).

A flag given on the command line that the rest of the run ignores (a DPPO floor without a prune rate,
a router loss coefficient on a dense model, ...) gets a warning from rank 0, and the run goes on
without it; a flag that contradicts another one so that the run cannot be what was asked is a usage
error (exit code 2). Only flags on the command line are checked (``arguments.given_fields``): a
default, or a value a preset such as ``--prune-preset study`` sets, never is.

Flag checks that need only the flag's own config stay in the configs' ``__post_init__`` (e.g.
``--save-interval`` needs ``--save``); the rules here look across configs, at the architecture or at
a ``--load`` checkpoint. A rule names its flags as ``Config.field``; it applies only where the CLI has
that config, and each flag gets the line of the first rule that fires for it. ``why`` is formatted
with the setting as ``s`` and the flag's name as ``flag``, and follows ``--flag value`` in the line.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_prune.arguments import UsageError
from megatron_prune.config import PRUNE_PRESETS, flag_of
from megatron_prune.grpo.config import TOY_TASKS
from megatron_prune.lora_config import lora_active
from megatron_prune.ranks import first_rank

__all__ = ["RULES", "Rule", "Setting", "check", "shown", "warn"]

@dataclass(frozen=True)
class Rule:
    flags: tuple[str, ...]
    """The flags the rule is about, as ``Config.field``."""
    when: Callable[["Setting"], bool]
    """True where the flags do nothing (or contradict another flag)."""
    why: str
    """The rest of the line after ``--flag value``."""
    error: bool = False
    """A usage error (exit code 2) instead of a warning."""


class Setting:
    """The resolved configs of a run, with what the rules ask of them (computed when first asked)."""

    def __init__(self, configs: dict[str, Any], given: frozenset[str], data_parallel: int = 1) -> None:
        self.configs, self.given, self.data_parallel = configs, given, data_parallel
        get = configs.get
        self.model, self.train, self.ckpt = get("ModelConfig"), get("TrainConfig"), get("CheckpointConfig")
        self.prune, self.dpo, self.lora = get("PruneConfig"), get("DPOConfig"), get("LoRAConfig")
        self.grpo, self.dppo = get("GRPOConfig"), get("DPPOArgs")

    @functools.cached_property
    def arch(self):
        """The architecture the run builds (``--load`` already resolved by the CLI's checks)."""
        from megatron_prune.training import session

        return session.resolve_arch(self.model, self.ckpt)

    @functools.cached_property
    def load_meta(self) -> dict:
        """The metadata of the ``--load`` checkpoint the run starts from ({} when it starts fresh)."""
        if not self.ckpt.load:
            return {}
        from megatron_prune.training.checkpoint import read_meta

        return read_meta(self.ckpt.load)

    @property
    def resumes(self) -> bool:
        """Whether ``--load`` resumes optimizer and trainer state (not a fresh or weights-only start)."""
        from megatron_prune.training.loop import resumes_training_state

        return resumes_training_state(self.ckpt, self.load_meta, lora=self.lora_on)

    @property
    def resumes_distributed_optimizer(self) -> bool:
        """Whether the run resumes optimizer state saved in the distributed format (which only that optimizer reads)."""
        from megatron_prune.training.checkpoint import DISTRIBUTED_OPTIMIZER

        return self.resumes and self.load_meta.get("optimizer_format") == DISTRIBUTED_OPTIMIZER

    @functools.cached_property
    def tokenizer_spec(self) -> str | None:
        """The tokenizer the run resolves (None where it cannot: the launch checks say why)."""
        from megatron_prune.training import session

        try:
            return session.resolve_tokenizer(self.model, self.ckpt)
        except (UsageError, OSError, ValueError):  # the launch checks report it with their own message
            return None

    @functools.cached_property
    def has_chat_template(self) -> bool:
        """Whether that tokenizer brings its own chat template (True where it does not load)."""
        from megatron_prune.data.tokenizer import load_tokenizer

        try:
            return load_tokenizer(self.tokenizer_spec).has_chat_template
        except (UsageError, OSError, ValueError):  # the launch checks report it with their own message
            return True

    @property
    def toy(self) -> bool:
        return self.grpo is not None and self.grpo.task in TOY_TASKS

    @property
    def lora_on(self) -> bool:
        return lora_active(self.lora)

    @functools.cached_property
    def lora_narrowest(self) -> tuple[int, str]:
        """The smallest input or output width of a linear the adapters target, and that linear."""
        a = self.arch
        ffn = min(a.intermediate_size, a.moe_intermediate_size or a.intermediate_size) if a.is_moe else a.intermediate_size
        widths = {"linear_qkv": (a.hidden_size, (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim),
                  "linear_proj": (a.num_attention_heads * a.head_dim, a.hidden_size),
                  "linear_fc1": (a.hidden_size, 2 * ffn), "linear_fc2": (ffn, a.hidden_size)}
        return min((min(widths[name]), name) for name in self.lora.target_names)

    @property
    def layers_per_chunk(self) -> int:
        """Layers of each pipeline stage (of each model chunk under the interleaved schedule)."""
        m = self.model
        return self.arch.num_layers // (m.pipeline_model_parallel_size * (m.virtual_pipeline_model_parallel_size or 1))

    @property
    def schedule_from_flags(self) -> bool:
        """Whether this launch's schedule flags set the learning rate: a resume keeps the checkpoint's
        schedule (and says so) unless --override-opt-param-scheduler."""
        return not self.resumes or self.train.override_opt_param_scheduler

    @property
    def warmup_outlasts_run(self) -> bool:
        return self.schedule_from_flags and self.train.lr_warmup_iters >= self.train.train_iters

    @property
    def preset_flags(self) -> str:
        """The flags of the values ``--prune-preset`` sets, as an English list."""
        fields = {f.name: f for f in dataclasses.fields(self.prune)}
        flags = [flag_of(fields[name]) for name in PRUNE_PRESETS[self.prune.preset]]
        return ", ".join(flags[:-1]) + " and " + flags[-1] if len(flags) > 1 else flags[0]


RULES: list[Rule] = [
    # model and parallelism
    Rule(("ModelConfig.expert_model_parallel_size", "ModelConfig.moe_token_dispatcher",
          "ModelConfig.moe_aux_loss_coeff", "ModelConfig.moe_z_loss_coeff"),
         lambda s: not s.arch.is_moe,
         "has no effect: the model ({s.arch.model_type}) is dense, it has no mixture-of-experts layers"),
    Rule(("ModelConfig.recompute_modules",), lambda s: "moe" in (s.model.recompute_modules or ()) and not s.arch.is_moe,
         "names moe, which has no effect: the model ({s.arch.model_type}) is dense, it has no mixture-of-experts "
         "layers"),
    Rule(("ModelConfig.tokenizer", "ModelConfig.chat_template_kwargs"), lambda s: s.toy,
         "has no effect with --task {s.grpo.task} (the toy tasks work on token ids, with no tokenizer)"),
    Rule(("ModelConfig.chat_template_kwargs",), lambda s: s.tokenizer_spec and not s.has_chat_template,
         "has no effect: the tokenizer {s.tokenizer_spec} has no chat template of its own (prompts and responses "
         "use the plain transcript format, which takes no variables)"),
    Rule(("ModelConfig.use_distributed_optimizer",),
         lambda s: s.data_parallel == 1 and not s.resumes_distributed_optimizer,
         "shards nothing at data-parallel size 1: each rank holds its parameters' whole optimizer state "
         "either way; it only saves that state in the distributed format, which a resume then needs {flag} to read"),
    Rule(("ModelConfig.recompute_num_layers",),
         lambda s: s.model.recompute_method == "block" and s.model.recompute_num_layers > s.layers_per_chunk,
         "is more than the layers of each pipeline stage ({s.layers_per_chunk}; of each model chunk under the "
         "interleaved schedule): --recompute-method block recomputes the first N layers of each, so every layer is recomputed; "
         "give at most {s.layers_per_chunk}"),
    # training: the optimizer and its schedule
    Rule(("TrainConfig.lr",), lambda s: s.schedule_from_flags and s.train.lr == 0,
         "trains nothing: every update is scaled by the learning rate, so the weights never change; give --lr > 0"),
    Rule(("TrainConfig.lr_warmup_iters",), lambda s: s.warmup_outlasts_run,
         "is not below --train-iters {s.train.train_iters}: the run ends inside the warm-up, so the learning rate "
         "never reaches --lr {s.train.lr:g}; lower --lr-warmup-iters below --train-iters"),
    Rule(("TrainConfig.lr_decay_style", "TrainConfig.min_lr"), lambda s: s.warmup_outlasts_run,
         "has no effect: --lr-warmup-iters {s.train.lr_warmup_iters} is not below --train-iters "
         "{s.train.train_iters}, so the run ends before any decay"),
    Rule(("TrainConfig.min_lr",), lambda s: s.schedule_from_flags and s.train.lr_decay_style == "constant",
         "has no effect with --lr-decay-style constant (the rate stays at --lr after the warm-up); "
         "--lr-decay-style linear or cosine decays to it"),
    Rule(("TrainConfig.adam_beta1", "TrainConfig.adam_beta2"), lambda s: s.train.optimizer == "sgd",
         "has no effect with --optimizer sgd (it is one of Adam's moment decays)"),
    Rule(("TrainConfig.adam_eps",), lambda s: s.train.optimizer == "sgd",
         "has no effect with --optimizer sgd (it is Adam's epsilon)"),
    Rule(("TrainConfig.sgd_momentum",), lambda s: s.train.optimizer == "adam",
         "has no effect with --optimizer adam (it is SGD's momentum: pass --optimizer sgd to use it)"),
    Rule(("TrainConfig.max_prompt_length",), lambda s: s.toy,
         "has no effect with --task {s.grpo.task}: its prompts are --toy-prompt-length {s.grpo.toy_prompt_length} "
         "tokens"),
    # checkpointing
    Rule(("CheckpointConfig.finetune",), lambda s: not s.ckpt.load,
         "has no effect: --load {s.ckpt.save} holds no complete checkpoint yet, so the run starts fresh"),
    Rule(("CheckpointConfig.finetune",), lambda s: not s.load_meta.get("has_optimizer"),
         "has no effect: --load {s.ckpt.load} holds weights only (a converted model, no optimizer state), which a "
         "run always starts from at iteration 0"),
    Rule(("CheckpointConfig.finetune",), lambda s: s.lora_on and not s.load_meta.get("lora"),
         "has no effect with --lora-rank {s.lora.rank}: --load {s.ckpt.load} holds no adapters, so it is the frozen "
         "base that LoRA starts from at iteration 0 anyway"),
    Rule(("TrainConfig.override_opt_param_scheduler",),
         lambda s: not s.resumes,
         "has no effect: the run resumes no learning-rate schedule (it starts at iteration 0 with this launch's "
         "flags anyway)"),
    Rule(("CheckpointConfig.exit_signal",), lambda s: not s.ckpt.exit_signal_handler,
         "has no effect without --exit-signal-handler (it is the signal that handler catches)"),
    Rule(("CheckpointConfig.exit_interval",),
         lambda s: s.ckpt.exit_interval is not None and s.ckpt.exit_interval >= s.train.train_iters,
         "has no effect: its first multiple is not below --train-iters {s.train.train_iters}, where the run ends anyway"),
    Rule(("CheckpointConfig.save_interval",),
         lambda s: s.ckpt.save_interval is not None and s.ckpt.save_interval >= s.train.train_iters,
         "has no effect: its first multiple is not below --train-iters {s.train.train_iters}, where the run saves "
         "anyway"),
    Rule(("DPOConfig.eval_interval",),
         lambda s: s.dpo.eval_interval is not None and s.dpo.eval_interval >= s.train.train_iters,
         "has no effect: its first multiple is not below --train-iters {s.train.train_iters}, where the run evaluates "
         "anyway"),
    # LoRA
    Rule(("LoRAConfig.alpha", "LoRAConfig.dropout", "LoRAConfig.targets"), lambda s: not s.lora_on,
         "needs --lora-rank > 0 (LoRA is off at rank 0): give --lora-rank, or drop {flag}", error=True),
    Rule(("LoRAConfig.rank",), lambda s: s.lora_on and s.lora.rank >= s.lora_narrowest[0],
         "is not below {s.lora_narrowest[0]}, the narrowest side of the {s.lora_narrowest[1]} it adapts: that "
         "adapter is full-rank and holds more values than the weight it adapts, so LoRA saves nothing there; give a "
         "rank well below the model's widths"),
    # DPO pruning
    Rule(("PruneConfig.branch_chosen_prob",), lambda s: not s.prune.branch,
         "has no effect without --prune-branch (it is the chosen branch's keep probability under branch pruning)"),
    Rule(("PruneConfig.preset",),
         lambda s: all(f"PruneConfig.{name}" in s.given for name in PRUNE_PRESETS[s.prune.preset]),
         "has no effect: {s.preset_flags}, all given as well, override every value it sets"),
    # GRPO
    Rule(("GRPOConfig.ref_load",), lambda s: s.grpo.kl_beta == 0,
         "has no effect with --kl-beta 0: without a KL term there is no reference model (give --kl-beta > 0 to "
         "use it)"),
    Rule(("GRPOConfig.toy_num_prompts", "GRPOConfig.toy_num_digits", "GRPOConfig.toy_prompt_length"),
         lambda s: not s.toy, "has no effect with --task {s.grpo.task} (it shapes the toy tasks' prompts)"),
    Rule(("GRPOConfig.skip_invalid",), lambda s: s.toy,
         "has no effect with --task {s.grpo.task} (its prompts are generated: there are no records to skip)"),
    Rule(("GRPOConfig.top_p",), lambda s: s.grpo.temperature == 0,
         "has no effect with --temperature 0 (greedy sampling takes the most likely token)"),
    Rule(("GRPOConfig.temperature",), lambda s: s.grpo.temperature == 0,
         "samples greedily: the --group-size {s.grpo.group_size} completions of a prompt are identical, so their "
         "rewards are equal, every advantage is 0 and the policy term trains nothing; give --temperature > 0"),
    Rule(("GRPOConfig.clip_eps_low", "GRPOConfig.clip_eps_high"), lambda s: s.grpo.updates_per_rollout == 1,
         "has no effect with --ppo-epochs 1 and --minibatches 1: each rollout feeds one update, whose PPO ratio is "
         "exactly 1, so nothing is clipped"),
    Rule(("GRPOConfig.advantage_std",), lambda s: not s.grpo.normalize_std,
         "has no effect with --no-std-normalization (the advantages are not divided by a std)"),
    # DPPO
    Rule(("DPPOArgs.prompt_floor", "DPPOArgs.history_decay", "DPPOArgs.history_score", "DPPOArgs.prompt_sampling"),
         lambda s: s.dppo.prompt_prune_rate == 0,
         "has no effect without --dppo-prompt-prune-rate > 0 (no prompt is pruned)"),
    Rule(("DPPOArgs.completion_floor", "DPPOArgs.sampling"), lambda s: s.dppo.completion_prune_rate == 0,
         "has no effect without --dppo-completion-prune-rate > 0 (no completion is pruned)"),
    Rule(("DPPOArgs.pack_window",), lambda s: not s.dppo.dense_packing,
         "has no effect without --dense-packing (it is the packer's sorting window)"),
    Rule(("DPPOArgs.skip_zero_advantage",), lambda s: s.grpo.kl_beta > 0,
         "has no effect with --kl-beta {s.grpo.kl_beta:g}: with a KL term every completion has a gradient, so none "
         "is skipped"),
]


def _field(config: Any, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(config) if f.name == name)


def shown(config: Any, name: str) -> str:
    """A flag as the command line gave it: ``--flag value``, or the switch alone (``--no-...`` when off)."""
    field = _field(config, name)
    value = getattr(config, name)
    if isinstance(value, bool):
        return flag_of(field) if value else field.metadata.get("bool_off", flag_of(field))
    if isinstance(value, (list, tuple)):
        return " ".join([flag_of(field), *map(str, value)])
    if isinstance(value, float) and float(f"{value:g}") == value:
        value = f"{value:g}"  # 0 rather than 0.0, 1e-05 as typed
    return f"{flag_of(field)} {value}"


def check(configs: dict[str, Any], given: frozenset[str], *, data_parallel: int = 1) -> list[str]:
    """The warning lines for the flags in ``given`` (``Config.field`` names) that ``configs`` ignore at
    ``data_parallel`` ranks; raises :class:`UsageError` for the first flag that contradicts another one."""
    setting = Setting(configs, given, data_parallel)
    lines, seen = [], set()
    for rule in RULES:
        for name in rule.flags:
            group, field = name.split(".")
            config = configs.get(group)
            if config is None or name not in given or name in seen or not rule.when(setting):
                continue
            seen.add(name)
            flag = flag_of(_field(config, field))
            line = f"{shown(config, field)} {rule.why.format(s=setting, flag=flag)}"
            if rule.error:
                raise UsageError(line)
            lines.append(line)
    return lines


def warn(lines: list[str]) -> None:
    """Print each line as a warning, from rank 0 only."""
    if not first_rank():
        return
    for line in lines:
        print(f"megatron-prune: warning: {line}", file=sys.stderr, flush=True)
