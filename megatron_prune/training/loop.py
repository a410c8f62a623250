"""The one training loop shared by DPO and GRPO.

An :class:`Objective` accumulates one step's gradients (through Megatron's schedules) and
reports metrics; the loop owns everything around it: optimizer and LR schedule, non-finite
checks on all ranks together, timing and peak memory, metrics (JSON lines, TensorBoard,
console), and atomic checkpoints with exact resume (model, optimizer, scheduler, RNG, data
position and the objective's own sampler state).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_prune.accelerator import get_accelerator
from megatron_prune.arguments import UsageError
from megatron_prune.config import CheckpointConfig, LoggingConfig, TrainConfig
from megatron_prune.model.arch import ModelArch
from megatron_prune.training import checkpoint as ckpt_io
from megatron_prune.training.exit_conditions import ExitConditions
from megatron_prune.training.parallel import (
    collective_failure,
    guard_collectives,
    is_logging_rank,
    largest_over_ranks,
)

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient with --on-nonfinite stop."""


class Objective(Protocol):
    """What the loop needs from DPO or GRPO."""

    def train_step(self, step: int) -> dict[str, float]:
        """Accumulate gradients of ``step`` into the model's grad buffers; return metrics
        (identical on every rank, including ``loss``)."""

    def evaluate(self, step: int) -> dict[str, float] | None:
        """Held-out metrics, or None when there is nothing to evaluate."""

    def state_dict(self) -> dict[str, Any]:
        """Data position and sampler state, for exact resume."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingParts:
    """Model, optimizer and schedule of a run."""

    model: list[torch.nn.Module]
    """DDP-wrapped policy chunks."""
    optimizer: Any
    """Megatron optimizer."""
    scheduler: OptimizerParamScheduler
    """Learning-rate schedule."""
    arch: ModelArch
    """Architecture (recorded in checkpoints)."""
    extra_meta: dict = field(default_factory=dict)
    """Recorded in every checkpoint's meta.json (e.g. which reference model the run uses)."""
    hf_assets: str | None = None
    """HF model directory the run started from (``--hf-model``): its config and tokenizer files
    are kept in ``hf_assets/`` of the save directory, so an export finds them."""


def _schedule_of(train: TrainConfig) -> dict[str, Any]:
    """The schedule fields (:data:`_SCHEDULE_FLAGS`' keys) this launch's flags set."""
    return {"max_lr": train.lr, "min_lr": train.min_lr, "lr_warmup_steps": train.lr_warmup_iters,
            "lr_decay_steps": max(train.train_iters, train.lr_warmup_iters + 1),
            "lr_decay_style": train.lr_decay_style, "start_wd": train.weight_decay}


def build_scheduler(optimizer, train: TrainConfig) -> OptimizerParamScheduler:
    schedule = _schedule_of(train)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,  # the warm-up's start; not in the scheduler's state, so a resume must not depend on the flags
        **schedule,
        end_wd=train.weight_decay,
        wd_incr_steps=schedule["lr_decay_steps"],
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not train.override_opt_param_scheduler,
        override_opt_param_scheduler=train.override_opt_param_scheduler,
    )


def grads_are_finite(model: list[torch.nn.Module]) -> bool:
    """True on every rank iff every rank's gradients are finite (one all-reduce)."""
    bad = torch.zeros(1)
    for chunk in model:
        for p in chunk.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is not None and not torch.isfinite(grad).all():
                bad.fill_(1.0)
                break
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0.0


def _strict_json(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with non-finite floats as null: a skipped step's NaN loss would make the line
    invalid JSON for every reader but Python's (jq, JavaScript, most JSON libraries)."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}


class MetricsWriter:
    """JSON lines (and TensorBoard when installed) from the logging rank only."""

    def __init__(self, cfg: LoggingConfig) -> None:
        self.cfg = cfg
        self.active = is_logging_rank()
        self.jsonl = None
        self.tb = None
        if not self.active:
            return
        if cfg.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.metrics_jsonl)), exist_ok=True)
            self.jsonl = open(cfg.metrics_jsonl, "a", encoding="utf-8")
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(cfg.tensorboard_dir)
            except ImportError:
                logger.warning("--tensorboard-dir given but tensorboard is not installed; skipping it")

    def write(self, record: dict[str, Any]) -> None:
        if not self.active:
            return
        if self.jsonl:
            self.jsonl.write(json.dumps(_strict_json(record), allow_nan=False) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()


MAX_SKIPPED_IN_A_ROW = 10
"""--on-nonfinite skip: this many skipped steps in a row end the run (as --on-nonfinite stop does)."""

TRAINER_KINDS = ("dpo", "grpo")


def trainer_kind(objective: Objective) -> str | None:
    """Which trainer runs ``objective``: the ``megatron_prune`` package defining it, ``"dpo"`` or
    ``"grpo"`` (recorded in checkpoints as ``trainer_kind``); None for an objective of neither."""
    package = type(objective).__module__.split(".")
    return package[1] if len(package) > 1 and package[0] == "megatron_prune" and package[1] in TRAINER_KINDS \
        else None


def _check_same_trainer(meta: dict[str, Any], mine: str | None, load: str) -> None:
    """A checkpoint resumes only under the trainer that wrote it (one without the record: any)."""
    saved = meta.get("trainer_kind")
    if saved and mine and saved != mine:
        raise UsageError(
            f"--load {load}: {meta['path']} is a {saved.upper()} checkpoint; the {mine.upper()} trainer cannot "
            f"resume its optimizer, schedule and data position: pass --finetune to start from its weights, or "
            f"--load a {mine.upper()} checkpoint"
        )


_FINETUNE_HINT = "or --finetune to start a new run from its weights"


def _check_seed(saved: dict[str, Any], seed: int | None, load: str) -> None:
    """The saved data order applies to this run: same --seed."""
    if saved and seed is not None and saved.get("seed") != seed:
        raise UsageError(
            f"--load {load}: the checkpoint was trained with --seed {saved.get('seed')} and this run has --seed "
            f"{seed}, which would change the data order: pass --seed {saved.get('seed')} to resume it "
            f"({_FINETUNE_HINT})"
        )


def _check_iteration(iteration: int, train_iters: int, load: str) -> None:
    if iteration > train_iters:
        # A usage error (exit 2): the flags contradict the checkpoint (a lowered --train-iters or another
        # run's checkpoint); going on would neither train nor reproduce that run.
        raise UsageError(f"--load {load}: the checkpoint is at iteration {iteration}, past --train-iters "
                         f"{train_iters}: nothing to train; raise --train-iters above {iteration} to train further")


def _resumed_state(ckpt: CheckpointConfig, *, lora: bool) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The checkpoint's meta.json and trainer state (``trainer_state.pt``: the objective's data
    position and samplers, the schedule) that ``--load`` will resume, or None for a fresh start or
    a weights-only start (``--finetune``, a checkpoint without optimizer, a LoRA base)."""
    if not ckpt.load or ckpt.finetune:
        return None
    meta = ckpt_io.read_meta(ckpt.load)
    if not resumes_training_state(ckpt, meta, lora=lora):
        return None
    return meta, ckpt_io.read_trainer_state(meta["path"])


def resumes_training_state(ckpt: CheckpointConfig, meta: dict[str, Any], *, lora: bool) -> bool:
    """Whether ``--load`` (whose checkpoint's meta.json is ``meta``) resumes optimizer and trainer state:
    not a fresh start, ``--finetune``, a converted model, or a LoRA run from a checkpoint without adapters."""
    return bool(ckpt.load) and not ckpt.finetune and bool(meta.get("has_optimizer")) \
        and not (lora and not meta.get("lora"))


def _objective_state(state: dict[str, Any]) -> dict[str, Any]:
    return state.get("trainer", {}).get("objective", {})


def check_resumable(ckpt: CheckpointConfig, *, kind: str, seed: int, train_iters: int, lora: bool,
                    optimizer: dict[str, str] | None = None) -> None:
    """What :func:`resume` refuses that the checkpoint's own files tell — another trainer's
    checkpoint, another ``--seed``, an iteration past ``--train-iters``, an optimizer state this
    run's ``optimizer`` (:func:`~megatron_prune.training.checkpoint.optimizer_record`) cannot load —
    checked before any rank starts (also under ``--dry-run``). The data size needs the loaded data:
    the trainers check it with :func:`check_resumed_data_size` as soon as the data is read, before
    any model is built. A weights-only start resumes nothing and is not checked."""
    resumed = _resumed_state(ckpt, lora=lora)
    if resumed is None:
        return
    meta, saved = resumed[0], _objective_state(resumed[1])
    _check_same_trainer(meta, kind, ckpt.load)
    problem = None if optimizer is None else ckpt_io.optimizer_mismatch(meta, optimizer)
    if problem:  # it starts with the checkpoint's path: said once where --load names that checkpoint
        same = os.path.abspath(ckpt.load) == os.path.abspath(meta["path"])
        raise UsageError(f"--load {problem}" if same else f"--load {ckpt.load}: {problem}")
    _check_seed(saved.get("sampler") or {}, seed, ckpt.load)
    _check_iteration(int(meta["iteration"]), train_iters, ckpt.load)


def check_resumed_data_size(ckpt: CheckpointConfig, *, num_samples: int, kind: str, lora: bool) -> None:
    """The training data has as many samples as the data ``--load`` resumes a position in (the
    refusal :func:`resume` would make after building the model, made before it)."""
    resumed = _resumed_state(ckpt, lora=lora)
    sampler = (_objective_state(resumed[1]).get("sampler") if resumed else None) or {}
    if sampler:
        _check_num_samples(sampler.get("num_samples"), num_samples, ckpt.load, kind=kind)


def _check_data_position(saved_state: dict[str, Any], objective: Objective, load: str, *, kind: str | None) -> None:
    """The saved data position applies to this run's data: same --seed, same number of samples;
    files of other content (same count) are warned about, as a resume may mean to switch them."""
    state = objective.state_dict()
    saved = (saved_state or {}).get("sampler") or {}
    mine = state.get("sampler") or {}
    if not saved or not mine:
        return
    _check_seed(saved, mine.get("seed"), load)
    _check_num_samples(saved.get("num_samples"), mine.get("num_samples"), load, kind=kind)
    before, now = (saved_state or {}).get("data_sha256"), state.get("data_sha256")
    if before and now and before != now and is_logging_rank():
        print(f"[megatron-prune] WARNING: --load {load}: the training data's files hold other content than the "
              f"checkpoint's run read (the same {mine.get('num_samples')} samples by count; sha256 {now[:12]} against "
              f"{before[:12]}), so the resumed data position walks other records; resume with the same files, or "
              f"--finetune to start a new data order", flush=True)


def _check_num_samples(saved: int | None, mine: int | None, load: str, *, kind: str | None) -> None:
    if saved != mine:
        flags = "--data-path or --toy-num-prompts" if kind == "grpo" else "--data-path"
        raise UsageError(
            f"--load {load}: the checkpoint's run trained on {saved} samples and this run's "
            f"training data has {mine} (another {flags}, or other records skipped), so its "
            f"data position does not apply: resume with the same training data ({_FINETUNE_HINT})"
        )


def resume(parts: TrainingParts, objective: Objective, ckpt: CheckpointConfig, *,
           train_iters: int) -> tuple[int, dict[str, Any]]:
    """Load ``--load`` if given; return the first step to run (of ``train_iters``) and the loop's own
    saved state (``skipped_in_a_row``; empty for a fresh or weights-only start)."""
    if not ckpt.load:
        return 0, {}
    meta = ckpt_io.read_meta(ckpt.load)
    from megatron_prune.model.lora import is_lora_model

    if not meta.get("lora") and is_lora_model(parts.model):
        # The LoRA base: its weights were loaded before the adapters were added (session.build_parts).
        if is_logging_rank():
            print(f"[megatron-prune] LoRA starts from the model weights of {meta['path']} (iteration "
                  f"{meta['iteration']}) as its frozen base: fresh adapters and optimizer, iteration 0"
                  f"{'; its optimizer and trainer state are not used' if meta.get('has_optimizer') else ''}",
                  flush=True)
        return 0, {}
    weights_only = ckpt.finetune or not meta.get("has_optimizer")
    if not weights_only:
        _check_same_trainer(meta, trainer_kind(objective), ckpt.load)
    loaded = ckpt_io.load_checkpoint(
        ckpt.load, model=parts.model, arch=parts.arch,
        optimizer=None if weights_only else parts.optimizer, restore_rng=not weights_only,
    )
    saved_state = loaded.get("trainer", {}).get("objective", {})
    if not weights_only:
        _check_data_position(saved_state, objective, ckpt.load, kind=trainer_kind(objective))
    if is_logging_rank():
        print(f"[megatron-prune] loaded {loaded['path']} (iteration {loaded['iteration']}"
              f"{', weights only' if weights_only else ''})", flush=True)
    if weights_only:
        # Under --bf16 (and the distributed optimizer) the optimizer holds fp32 main copies of the
        # weights, taken when it was built: its first step would write them back over these.
        parts.optimizer.reload_model_params()
        return 0, {}
    _say_flags_changed(meta.get("flags"), parts.extra_meta.get("flags"))
    _say_reference_changed(meta, parts.extra_meta)
    _apply_optimizer_flags(parts.optimizer)
    if loaded.get("scheduler"):
        _say_schedule_kept({key: getattr(parts.scheduler, key) for key in _SCHEDULE_FLAGS}, loaded["scheduler"],
                           train_iters=train_iters, override=parts.scheduler.override_opt_param_scheduler)
        if parts.scheduler.override_opt_param_scheduler:
            _apply_schedule_flags(parts.optimizer, parts.scheduler)
        parts.scheduler.load_state_dict(loaded["scheduler"])
    objective.load_state_dict(saved_state)
    return int(loaded["iteration"]), loaded.get("trainer", {}).get("loop", {})


# Scheduler fields a resumed run takes from its checkpoint (Megatron's rule), and the flags that set them.
_SCHEDULE_FLAGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
                   "lr_decay_steps": "--train-iters", "lr_decay_style": "--lr-decay-style",
                   "start_wd": "--weight-decay"}


def _say_flags_changed(recorded: dict | None, current: dict | None) -> None:
    """One line naming each recorded objective or batch flag this resumed launch changed (allowed:
    a resume may change them on purpose, but never without a word)."""
    if not recorded or not current:
        return
    recorded, current = _with_lora_alpha(recorded), _with_lora_alpha(current)
    if recorded.get("--ref-mode", "") is None:  # saved before the resolved mode was recorded
        recorded = {**recorded, "--ref-mode": "adapter-off" if recorded.get("--lora-rank") else "online"}
    def same(flag: str) -> bool:
        if flag == "--lora-targets" and isinstance(current[flag], str) and isinstance(recorded[flag], str):
            names = lambda text: {n.strip() for n in text.split(",") if n.strip()}  # noqa: E731
            return names(current[flag]) == names(recorded[flag])  # a set: order and spacing are no change
        return current[flag] == recorded[flag]

    changed = [f"{flag} {current[flag]} (checkpoint: {recorded[flag]})"
               for flag in sorted(current) if flag in recorded and not same(flag)]
    if changed and is_logging_rank():
        print("[megatron-prune] resuming with flags that differ from the checkpoint's run: " + ", ".join(changed),
              flush=True)


def _say_reference_changed(recorded: dict, current: dict) -> None:
    """One line when a resumed run compares against another reference than its checkpoint's
    (``--ref-load``, which the flag record leaves out as a path)."""
    keys = ("reference_load", "reference_hf_model")
    if not all(key in recorded and key in current for key in keys):
        return
    was, now = (tuple(meta[key] for key in keys) for meta in (recorded, current))
    if was == now or not is_logging_rank():
        return
    name = lambda ref: ref[0] or ref[1] or "the preset's initial weights"  # noqa: E731
    if was[0] is not None and not os.path.exists(was[0]):  # moved: maybe the same weights, not "another"
        print(f"[megatron-prune] resuming against the reference model at {name(now)}; the checkpoint's, "
              f"{name(was)}, no longer exists", flush=True)
    else:
        print(f"[megatron-prune] resuming against another reference model: {name(now)} (checkpoint: {name(was)})",
              flush=True)


def _with_lora_alpha(record: dict) -> dict:
    """``record`` with an unset ``--lora-alpha`` as the alpha it means (the rank): a resume without
    the flag takes the checkpoint's alpha, which is no change."""
    if record.get("--lora-alpha") is None and record.get("--lora-rank"):
        return {**record, "--lora-alpha": float(record["--lora-rank"])}
    return record


def _apply_optimizer_flags(optimizer) -> None:
    """Loading the optimizer restores the checkpoint's param groups, betas, epsilon and momentum
    included; put back this launch's (``--adam-beta1/2``, ``--adam-eps``, ``--sgd-momentum``), so a
    changed flag applies as the resume line says. The learning rate and weight decay stay the
    schedule's (Megatron's rule)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        config = inner.config
        for group in inner.optimizer.param_groups:
            if "betas" in group:
                group["betas"] = (config.adam_beta1, config.adam_beta2)
                group["eps"] = config.adam_eps
            if "momentum" in group:
                group["momentum"] = config.sgd_momentum


def _apply_schedule_flags(optimizer, scheduler: OptimizerParamScheduler) -> None:
    """Under ``--override-opt-param-scheduler``: the loaded param groups carry the checkpoint's peak
    and final rates, which Megatron's scheduler reads before its own; put this launch's in their place."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = scheduler.max_lr, scheduler.min_lr


def say_resume_notes(configs: dict[str, Any], *, lora: bool, lora_base: dict | None = None) -> None:
    """What the resume of ``--load`` will say about changed flags, the reference and the kept
    schedule, said by a ``--dry-run`` (from the checkpoint's files and this launch's flags, without
    building a model); ``lora_base`` as the launch checks resolved it."""
    from megatron_prune.training.session import UsageError, flag_record, reference_meta, reference_source

    ckpt, train = configs["CheckpointConfig"], configs["TrainConfig"]
    resumed = _resumed_state(ckpt, lora=lora)
    if resumed is None:
        return
    meta, state = resumed
    _say_flags_changed(meta.get("flags"), flag_record(configs))
    ref_load = next((cfg.ref_load for cfg in configs.values() if getattr(cfg, "ref_load", None)), None)
    model = configs["ModelConfig"]
    try:
        reference = reference_meta(model, ckpt, reference_source(model, ckpt, ref_load, lora_base=lora_base),
                                   lora_base=lora_base)
    except UsageError:  # not found: a run that needs no reference (GRPO at --kl-beta 0) records none either
        reference = {}
    _say_reference_changed(meta, reference)
    if state.get("scheduler"):
        _say_schedule_kept(_schedule_of(train), state["scheduler"], train_iters=train.train_iters,
                           override=train.override_opt_param_scheduler)


def _say_schedule_kept(launch: dict[str, Any], saved: dict, *, train_iters: int, override: bool) -> None:
    """A resumed run continues the checkpoint's learning-rate schedule (as Megatron does) unless
    ``--override-opt-param-scheduler``: say which, once, for every schedule flag whose value this
    launch changed, instead of ignoring it silently (``--train-iters`` only where it sets a decay
    horizon: not under a constant schedule); and warn when the run goes on past the kept decay."""
    keys = [k for k in _SCHEDULE_FLAGS if k != "lr_decay_steps" or saved.get("lr_decay_style") != "constant"]

    def named(key: str, value) -> str:
        if key != "lr_decay_steps":
            return f"{_SCHEDULE_FLAGS[key]} {value}"
        if value == train_iters:
            return f"the decay horizon --train-iters {value}"
        # A warm-up that outlasts --train-iters sets the horizon (the schedule needs one step past it).
        return f"the decay horizon of {value} steps (--lr-warmup-iters {launch['lr_warmup_steps']} + 1)"

    changed = [f"{named(key, launch[key])} (checkpoint: {saved[key]})"
               for key in keys if key in saved and launch[key] != saved[key]]
    if not is_logging_rank():
        return
    if override:
        if changed:
            print("[megatron-prune] resuming with this launch's learning-rate schedule (--override-opt-param-scheduler)"
                  f" from step {saved.get('num_steps', 0)}: " + ", ".join(changed), flush=True)
        return
    if changed:
        print("[megatron-prune] resuming continues the checkpoint's learning-rate schedule; ignored: "
              + ", ".join(changed) + "; --override-opt-param-scheduler runs this launch's schedule from the "
              "checkpoint's step, --finetune starts a new schedule from its weights", flush=True)
    decay_end = int(saved.get("lr_decay_steps", train_iters))
    first = max(decay_end, int(saved.get("num_steps", 0))) + 1  # steps already trained are not this run's
    if saved.get("lr_decay_style", "constant") != "constant" and first <= train_iters:
        min_lr = float(saved.get("min_lr", 0.0))
        what = "learning rate 0: they train nothing" if min_lr == 0 else f"the schedule's final --min-lr {min_lr:g}"
        print(f"[megatron-prune] WARNING: the checkpoint's {saved['lr_decay_style']} schedule ends at step "
              f"{decay_end}, so steps {first}-{train_iters} of --train-iters {train_iters} run at {what}; "
              "--override-opt-param-scheduler decays over --train-iters instead", flush=True)


def _carry_hf_assets(ckpt: CheckpointConfig, hf_model: str | None) -> None:
    """Keep the original HF config and tokenizer next to our checkpoints (for export): from the HF
    directory the run started from, else from ``hf_assets/`` beside the checkpoint it loaded.
    Collective: rank 0 copies, and a copy that fails there (a full disk) stops every rank with one
    ``--save`` error instead of leaving the others waiting for it in the save's collectives."""
    if not ckpt.save:
        return
    from megatron_prune.model.hf_convert import ASSETS_DIR

    failure = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            _copy_hf_assets(ckpt, hf_model)
        except OSError as exc:
            failure = (f"--save {ckpt.save}: copying the HF config and tokenizer files into "
                       f"{os.path.join(ckpt.save, ASSETS_DIR)} failed ({exc}); this iteration was not saved, "
                       "the checkpoints published before it are intact")
    ckpt_io.agree_or_raise(failure)


def _copy_hf_assets(ckpt: CheckpointConfig, hf_model: str | None) -> None:
    from megatron_prune.model.hf_convert import ASSETS_DIR, assets_beside, copy_hf_assets

    dst = os.path.join(ckpt.save, ASSETS_DIR)
    if hf_model is not None and os.path.isdir(hf_model):
        if not os.path.isdir(dst):
            copy_hf_assets(hf_model, dst)
        return
    src = assets_beside(ckpt.load) if ckpt.load else None
    if src is not None and (not os.path.isdir(dst) or not os.path.samefile(src, dst)):  # same: resumed in place
        shutil.copytree(src, dst, dirs_exist_ok=True)


def save(parts: TrainingParts, objective: Objective, ckpt: CheckpointConfig, step: int, *,
         skipped_in_a_row: int = 0) -> None:
    _carry_hf_assets(ckpt, parts.hf_assets)
    kind = trainer_kind(objective)
    path = ckpt_io.save_checkpoint(
        ckpt.save, iteration=step, model=parts.model, arch=parts.arch, optimizer=parts.optimizer,
        scheduler_state=parts.scheduler.state_dict(),
        trainer_state={"objective": objective.state_dict(), "loop": {"skipped_in_a_row": skipped_in_a_row}},
        extra_meta={**parts.extra_meta, **({"trainer_kind": kind} if kind else {})},
    )
    if is_logging_rank():
        print(f"[megatron-prune] saved {path}", flush=True)


def train(
    *,
    objective: Objective,
    parts: TrainingParts,
    train_cfg: TrainConfig,
    ckpt: CheckpointConfig,
    log_cfg: LoggingConfig,
    eval_interval: int | None = None,
) -> list[dict[str, Any]]:
    """Run steps from the resumed position to ``train_iters``; return the per-step records."""
    acc = get_accelerator()
    with guard_collectives(f"loading --load {ckpt.load}"):
        start, loop_state = resume(parts, objective, ckpt, train_iters=train_cfg.train_iters)
    total = train_cfg.train_iters
    _check_iteration(start, total, ckpt.load)
    if start == total:
        # Exit 0: the same command launched again after its run finished (a requeued job, a script that
        # always passes --save X --load X) finds the work done; that is success, not an error.
        if is_logging_rank():
            print(f"[megatron-prune] nothing to train: the checkpoint is at iteration {start} = --train-iters "
                  f"{total}; raise --train-iters to train further", flush=True)
        return []
    exits = ExitConditions(ckpt)
    if exits.received_before_start():
        if is_logging_rank():
            then = (f"--load {ckpt.load} resumes from iteration {start}" if start
                    else "launched again, it starts from the beginning")
            print(f"[megatron-prune] stopping before step {start + 1}/{total}: {exits.signal.name} received "
                  f"(--exit-signal-handler) while starting up; no step trained, no checkpoint saved; {then}", flush=True)
        return []
    writer = MetricsWriter(log_cfg)
    records = []
    step = start
    # Carried across a resume: --on-nonfinite skip counts the steps skipped in a row of the whole run.
    skipped_in_a_row = int(loop_state.get("skipped_in_a_row", 0))
    with exits.watching():
        try:
            for step in range(start, train_cfg.train_iters):
                acc.synchronize()
                acc.reset_peak_memory()
                t0 = time.perf_counter()
                for chunk in parts.model:
                    chunk.zero_grad_buffer()
                parts.optimizer.zero_grad()
                metrics = objective.train_step(step)
                loss_finite = math.isfinite(metrics.get("loss", 0.0))
                finite = loss_finite and grads_are_finite(parts.model)
                if not finite and train_cfg.on_nonfinite == "stop":
                    which = f"loss={metrics.get('loss')}" + (", finite: the gradient is not" if loss_finite else "")
                    raise NonFiniteError(  # numbered as the progress line: metrics.jsonl's "step" + 1
                        f"step {step + 1}/{total}: non-finite loss or gradient ({which}); "
                        "rerun with --on-nonfinite skip to skip such steps"
                    )
                grad_norm = None
                lr = parts.optimizer.param_groups[0]["lr"]  # what this step's update uses
                if finite:
                    success, grad_norm, _ = parts.optimizer.step()
                    finite = bool(success)
                if finite:
                    parts.scheduler.step(1)
                    skipped_in_a_row = 0
                else:
                    skipped_in_a_row += 1
                    if is_logging_rank():
                        logger.warning("step %d/%d skipped: non-finite loss or gradient", step + 1, total)
                    if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                        raise NonFiniteError(
                            f"step {step + 1}/{total}: {skipped_in_a_row} steps in a row had a non-finite loss or "
                            "gradient; --on-nonfinite skip stops here (the weights or the data are broken, not one "
                            f"batch: steps {step + 2 - skipped_in_a_row}..{step + 1} were skipped)")
                acc.synchronize()
                record = {
                    "step": step,
                    **metrics,
                    "grad_norm": grad_norm,
                    "lr": lr,
                    "skipped": not finite,
                    "step_time_s": time.perf_counter() - t0,
                    # The rank that peaked highest (pipeline stages and expert-parallel ranks differ).
                    "peak_mem_bytes": largest_over_ranks(acc.peak_memory_bytes()),
                }
                if eval_interval and ((step + 1) % eval_interval == 0 or step + 1 == train_cfg.train_iters):
                    held_out = objective.evaluate(step)
                    if held_out:
                        record.update({f"eval_{k}": v for k, v in held_out.items()})
                records.append(record)
                writer.write(record)
                # Steps N, 2N, ... (1-based, as Megatron-LM and --eval-interval count), the run's first and its last.
                if is_logging_rank() and ((step + 1) % log_cfg.log_interval == 0 or step == start
                                          or step + 1 == train_cfg.train_iters):
                    print(_progress_line(record, train_cfg.train_iters), flush=True)
                done = step + 1
                saved = bool(ckpt.save and ((ckpt.save_interval and done % ckpt.save_interval == 0) or done == total))
                if saved:
                    save(parts, objective, ckpt, done, skipped_in_a_row=skipped_in_a_row)
                reason = exits.reason(done) if done < total else None
                if reason:
                    if ckpt.save and not saved:
                        save(parts, objective, ckpt, done, skipped_in_a_row=skipped_in_a_row)
                    if is_logging_rank():
                        then = f"--load {ckpt.save} resumes" if ckpt.save else "nothing saved (no --save)"
                        print(f"[megatron-prune] stopping after step {done}/{total}: {reason}; {then}", flush=True)
                    break
        except RuntimeError as exc:  # a timed-out collective: say which rank and step
            failure = collective_failure(exc, during=f"step {step + 1}/{total}")
            if failure is None:
                raise
            raise failure from exc
        finally:
            writer.close()
    return records


def _progress_line(record: dict[str, Any], total: int) -> str:
    shown = [f"step {record['step'] + 1}/{total}"]
    for key in ("loss", "reward_accuracy", "margin", "reward_mean", "eval_reward_accuracy", "grad_norm", "step_time_s"):
        value = record.get(key)
        if isinstance(value, (int, float)):
            shown.append(f"{key} {value:.4g}")
    for key in ("train_tokens", "forward_only_tokens"):
        value = record.get(key)
        if isinstance(value, (int, float)):
            shown.append(f"{key} {int(value)}")
    if record.get("skipped"):
        shown.append("SKIPPED")
    return "[megatron-prune] " + " | ".join(shown)
