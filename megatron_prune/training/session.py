"""Start-up shared by the trainers: validate, start the process groups, build model and optimizer."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from megatron_prune.accelerator import set_accelerator
from megatron_prune.arguments import UsageError, fail_usage
from megatron_prune.config import CheckpointConfig, ModelConfig, TrainConfig
from megatron_prune.lora_config import lora_active
from megatron_prune.model.arch import ModelArch, get_preset
from megatron_prune.model.provider import VOCAB_PAD_MULTIPLE, ParallelConfig, padded_vocab_size
from megatron_prune.ranks import first_rank
from megatron_prune.training.loop import TrainingParts, build_scheduler
from megatron_prune.training.model_setup import OptimConfig, build_optimizer, setup_model

logger = logging.getLogger(__name__)


__all__ = ["UsageError", "fail_usage", "check_versions", "validate", "start", "build_parts"]

MEGATRON_CORE_TESTED = ((0, 16), (0, 17))
"""Megatron-Core releases this plugin is tested with: >= 0.16, < 0.17 (setup.py pins the same range)."""
MEGATRON_CORE_CHECKED = "0.16.1"
"""The release every CPU patch and Megatron seam was checked on."""


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_versions(device: str, *, megatron_version: str | None = None) -> str:
    """The installed Megatron-Core version, checked against the tested range.

    Outside the range on CPU (where our patches rebind Megatron internals and would not apply)
    this is a :class:`UsageError`; on an accelerator it is a warning. Returns a one-line report.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = megatron_version or version("megatron-core")
    except PackageNotFoundError:
        found = "(not installed)"
    low, high = MEGATRON_CORE_TESTED
    tested = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    release = _release(found)
    if not release or not low <= release[:2] < high:
        message = (f"megatron-core {found} is installed, but megatron-prune is tested with megatron-core{tested} "
                   f"(its CPU patches were checked on {MEGATRON_CORE_CHECKED}); "
                   f"install it with: pip install 'megatron-core=={MEGATRON_CORE_CHECKED}'")
        if device == "cpu":
            raise UsageError(message)
        logger.warning("%s", message)
    return f"megatron-core {found} (tested: {tested})"


def parallel_config(model: ModelConfig) -> ParallelConfig:
    return ParallelConfig(
        tensor_model_parallel_size=model.tensor_model_parallel_size,
        pipeline_model_parallel_size=model.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=model.virtual_pipeline_model_parallel_size,
        sequence_parallel=model.sequence_parallel,
        bf16=model.bf16,
        recompute_options=model.recompute_kwargs,
        expert_model_parallel_size=model.expert_model_parallel_size,
        moe_token_dispatcher=model.moe_token_dispatcher,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=model.moe_z_loss_coeff,
    )


def validate(model: ModelConfig, train: TrainConfig, ckpt: CheckpointConfig, *, world_size: int,
             batch_of_microbatches: bool = True) -> int:
    """Check flags and layout against the world size; return the data-parallel size.

    ``batch_of_microbatches``: the global batch is made of whole microbatches (DPO). GRPO's
    global batch counts prompts and its microbatches hold completion rows, so there it only has
    to split over the data-parallel ranks."""
    from megatron_prune.training.parallel import validate_layout

    sources = [s for s in (model.model_preset, model.hf_model) if s]
    if len(sources) > 1:
        raise UsageError("give one of --model-preset and --hf-model, not both")
    if not sources and not ckpt.load:
        raise UsageError("no model: give --model-preset, --hf-model or --load")
    dp = validate_layout(parallel_config(model), world_size)
    if batch_of_microbatches and train.global_batch_size % (train.micro_batch_size * dp):
        raise UsageError(
            f"--global-batch-size {train.global_batch_size} is not divisible by --micro-batch-size "
            f"{train.micro_batch_size} x data-parallel size {dp}"
        )
    if train.global_batch_size % dp:
        raise UsageError(f"--global-batch-size {train.global_batch_size} is not divisible by the data-parallel "
                         f"size {dp}")
    if model.hf_model and not os.path.isdir(model.hf_model):
        raise UsageError(f"--hf-model {model.hf_model}: not a directory")
    if model.use_distributed_optimizer and train.optimizer != "adam":
        raise UsageError(f"--use-distributed-optimizer needs --optimizer adam (Megatron's distributed optimizer "
                         f"supports Adam only), got --optimizer {train.optimizer}")
    return dp


def check_interleaved_microbatches(model: ModelConfig, train: TrainConfig, *, dp: int) -> None:
    """Under the interleaved schedule every pass of a step runs a multiple of the pipeline size of
    microbatches, at least one per stage (Megatron's schedule refuses a last group smaller than the
    pipeline). DPO's passes take their microbatches from the global batch; GRPO pads its passes
    with placeholders instead."""
    vpp, pp = model.virtual_pipeline_model_parallel_size or 1, model.pipeline_model_parallel_size
    microbatches = train.global_batch_size // (train.micro_batch_size * dp)
    if vpp > 1 and (microbatches < pp or microbatches % pp):
        raise UsageError(
            f"--virtual-pipeline-model-parallel-size {vpp} needs a multiple of --pipeline-model-parallel-size {pp} "
            f"microbatches per step; --global-batch-size {train.global_batch_size} / (--micro-batch-size "
            f"{train.micro_batch_size} x data-parallel size {dp}) gives {microbatches}")


def resolve_arch(model: ModelConfig, ckpt: CheckpointConfig) -> ModelArch:
    if model.model_preset:
        arch = get_preset(model.model_preset)
    elif model.hf_model:
        from megatron_prune.model.hf_convert import check_hf_weights, read_hf_arch

        # The converter's checks: config fields the model cannot represent, and safetensors with
        # missing, extra or misshapen tensors, refused here rather than trained without them.
        arch = read_hf_arch(model.hf_model)
        check_hf_weights(model.hf_model, arch)
    else:
        from megatron_prune.training.checkpoint import read_arch

        return read_arch(ckpt.load)
    if ckpt.load:
        from megatron_prune.training.checkpoint import read_arch

        found = read_arch(ckpt.load)
        if found != arch:
            from megatron_prune.model.arch import arch_difference

            raise UsageError(
                f"--load {ckpt.load} holds a different architecture ({found.model_type}, "
                f"{found.num_layers} layers, hidden {found.hidden_size}: "
                f"{arch_difference(found.to_dict(), arch.to_dict())}) than the model asked for; "
                "drop --model-preset/--hf-model to use the checkpoint's own"
            )
    return arch


def check_data_files(flag: str, paths) -> None:
    """Every file ``flag`` names is a data file the readers take (checked before any rank works,
    also under ``--dry-run``)."""
    from megatron_prune.data.records import data_files_problem

    problem = data_files_problem(flag, paths)
    if problem:
        raise UsageError(problem)


# Flags a resume may change without a word: paths, layout and logging (resharding and moving
# files are ordinary), the schedule (said by its own notice), --train-iters (extending a run),
# --seed (refused when it changes), --finetune / --base-load (how the load happens).
_UNRECORDED = {"data_path", "eval_data_path", "ref_cache", "ref_load", "base_load", "tokenizer", "save", "load",
               "save_interval", "finetune", "train_iters", "seed", "lr", "min_lr", "lr_warmup_iters",
               "lr_decay_style", "weight_decay", "override_opt_param_scheduler", "eval_interval",
               "distributed_timeout_minutes", "skip_invalid"}
_RECORDED_GROUPS = ("TrainConfig", "PruneConfig", "DPOConfig", "GRPOConfig", "DPPOArgs", "LoRAConfig")


def flag_record(configs: dict) -> dict:
    """The run's objective and batch flags as ``{flag: value}``, recorded in each checkpoint so a
    resume can say which of them it changed."""
    from megatron_prune.config import flag_of

    record = {}
    for group in _RECORDED_GROUPS:
        cfg = configs.get(group)
        if cfg is None:
            continue
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            if f.name not in _UNRECORDED and (value is None or isinstance(value, (bool, int, float, str))):
                record[flag_of(f)] = value
    model = configs.get("ModelConfig")
    if model is not None:  # the model's flags that are terms of the loss
        from megatron_prune.config import ModelConfig

        fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            record[flag_of(fields[name])] = getattr(model, name)
        # and what the chat template renders (as canonical JSON: spacing is no change)
        args = model.chat_template_args
        record[flag_of(fields["chat_template_kwargs"])] = json.dumps(args, sort_keys=True) if args else None
    dpo = configs.get("DPOConfig")
    if dpo is not None:  # the mode that runs, not "unset": a resume then names a real change only
        from megatron_prune.lora_config import resolve_ref_mode

        try:
            record["--ref-mode"] = resolve_ref_mode(dpo.ref_mode, configs.get("LoRAConfig"), ref_load=dpo.ref_load)
        except ValueError:
            pass  # refused at launch with its own message
    return record


def check_tokenizer(model: ModelConfig, ckpt: CheckpointConfig, arch: ModelArch) -> tuple[str, Any]:
    """The tokenizer the run resolves, as ``(spec, tokenizer)``: loaded to check it against the
    model's vocabulary (also under ``--dry-run``) and returned so the run neither resolves nor
    loads it again."""
    from megatron_prune.data.tokenizer import TokenizerError, load_tokenizer

    name = resolve_tokenizer(model, ckpt)
    try:
        tokenizer = load_tokenizer(name, chat_template_kwargs=model.chat_template_args)
    except (TokenizerError, FileNotFoundError) as exc:
        hint = "" if model.tokenizer else " (no --tokenizer was given, so the run looked there; pass --tokenizer DIR)"
        raise UsageError(f"{exc}{hint}") from None
    if tokenizer.vocab_size > arch.vocab_size:
        raise UsageError(f"tokenizer {name} has {tokenizer.vocab_size} tokens but the model only {arch.vocab_size}: "
                         "its ids past the model's vocabulary have no embedding; pass the model's own tokenizer "
                         "(--tokenizer)")
    return name, tokenizer


@dataclasses.dataclass(frozen=True)
class LaunchChecks:
    """What a trainer's launch checks found (before any rank works, also under ``--dry-run``),
    handed on to the run so it neither looks again nor loads the tokenizer a second time."""

    arch: ModelArch
    """The architecture to build."""
    lora_base: dict | None
    """Under LoRA, where the frozen base comes from (None without LoRA)."""
    tokenizer: Any = None
    """The loaded tokenizer (None where the run needs none: GRPO's toy tasks)."""
    tokenizer_spec: str | None = None
    """What ``tokenizer`` was loaded from (``"tiny"``, a path or an HF name), as the checkpoint
    records it."""
    ref_mode: str | None = None
    """DPO's resolved ``--ref-mode`` (None for GRPO)."""


def resolve_model_and_base(configs: dict, *, kind: str) -> tuple[ModelArch, dict | None]:
    """The architecture to build and, under LoRA, where its frozen base comes from: what both
    trainers check before any rank starts (and ``--dry-run`` too), with whether a ``--load`` this
    ``kind`` of trainer (``"dpo"`` or ``"grpo"``) would resume fits the run. Reads only checkpoint
    and HF metadata; a mismatch or a missing checkpoint is a :class:`UsageError`."""
    from megatron_prune.lora_config import check_load
    from megatron_prune.training.checkpoint import CheckpointError

    from megatron_prune.training.checkpoint import find_latest, resume_source

    model, train, ckpt = configs["ModelConfig"], configs["TrainConfig"], configs["CheckpointConfig"]
    ref_load = next((cfg.ref_load for cfg in configs.values() if getattr(cfg, "ref_load", None)), None)
    try:
        ckpt.load = resume_source(ckpt.save, ckpt.load, can_start_fresh=bool(model.model_preset or model.hf_model))
        arch = resolve_arch(model, ckpt)
        lora_base = check_load(ckpt.load, configs.get("LoRAConfig"), hf_model=model.hf_model,
                               model_preset=model.model_preset, seed=train.seed)
        _refuse_new_run_into_its_source(ckpt, lora_active(configs.get("LoRAConfig")))
        if ref_load is not None:
            find_latest(ref_load, flag="--ref-load")
            _check_full_weights(ref_load, arch)
        from megatron_prune.training.loop import check_resumable

        lora = configs.get("LoRAConfig")
        from megatron_prune.training.checkpoint import optimizer_record

        check_resumable(ckpt, kind=kind, seed=train.seed, train_iters=train.train_iters, lora=lora_active(lora),
                        optimizer=optimizer_record(optimizer=train.optimizer, bf16=model.bf16,
                                                   distributed=model.use_distributed_optimizer))
    except UsageError:
        raise
    except (ValueError, FileNotFoundError, CheckpointError) as exc:
        raise UsageError(str(exc)) from None
    if model.expert_model_parallel_size > 1 and not arch.is_moe:
        raise UsageError(f"--expert-model-parallel-size {model.expert_model_parallel_size} needs a mixture-of-experts "
                         f"model; {arch.model_type} is dense")
    check_layout_fits(arch, model)
    if train.seq_length > arch.max_position_embeddings:
        raise UsageError(f"--seq-length {train.seq_length} is longer than the model's context (max_position_embeddings "
                         f"{arch.max_position_embeddings}): positions past it were never trained; lower --seq-length")
    check_output_paths(configs)
    has_reference = kind == "dpo" or configs["GRPOConfig"].kl_beta > 0
    notice = finetune_notice(ckpt, ref_load) if has_reference else None
    if notice and first_rank():
        print(f"[megatron-prune] {notice}", flush=True)
    return arch, lora_base


MERGE_HINT = ("merge them into full weights first (python tools/convert_megatron_to_hf.py --load {ckpt} --hf-out "
              "MERGED --merge-lora, then python tools/convert_hf_to_megatron.py --hf-dir MERGED --save REF) and pass "
              "--ref-load REF")


def _check_full_weights(ref_load: str, arch: ModelArch) -> None:
    """A reference is a whole frozen model of the policy's architecture: a LoRA checkpoint (adapters,
    no base weights) or another architecture is refused before any rank builds one."""
    from megatron_prune.model.arch import arch_difference
    from megatron_prune.training.checkpoint import read_meta

    meta = read_meta(ref_load)
    if meta.get("lora"):
        raise UsageError(f"--ref-load {ref_load} holds LoRA adapters (rank {meta['lora']['rank']}), not a whole "
                         f"model, and a reference loads whole models only; " + MERGE_HINT.format(ckpt=ref_load))
    if ModelArch.from_dict(meta["arch"]) != arch:
        raise UsageError(f"--ref-load {ref_load}: {meta['path']} holds another architecture "
                         f"({arch_difference(meta['arch'], arch.to_dict())}) than the policy; the reference must be "
                         "the same model")


def finetune_notice(ckpt: CheckpointConfig, ref_load: str | None) -> str | None:
    """The line a ``--finetune`` of a LoRA checkpoint says at launch: training goes on from its
    adapters, but the reference is its base (adapters off), not the adapted model."""
    if not (ckpt.finetune and ckpt.load) or ref_load:
        return None
    from megatron_prune.training.checkpoint import read_meta

    meta = read_meta(ckpt.load)
    if not meta.get("lora"):
        return None
    return (f"--finetune of the LoRA checkpoint {meta['path']}: training starts from its adapters, and the "
            f"reference is its base with the adapters off (the adapters are not part of it); for the adapted "
            f"model as the reference, " + MERGE_HINT.format(ckpt=ckpt.load))


def check_layout_fits(arch: ModelArch, model: ModelConfig | ParallelConfig) -> None:
    """The parallel layout splits this architecture: heads over TP, layers over PP x VPP, a MoE
    model's experts over EP with sequence parallelism at TP > 1 (Megatron would otherwise stop
    every rank with an assertion after the processes started, or build fewer layers). ``model``
    is the trainers' flags or, for the conversion tools, the layout itself."""
    tp, pp = model.tensor_model_parallel_size, model.pipeline_model_parallel_size
    vpp = model.virtual_pipeline_model_parallel_size or 1
    if arch.num_attention_heads % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide the model's {arch.num_attention_heads} "
                         "attention heads")
    vocab = padded_vocab_size(arch.vocab_size)
    if vocab % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide the model's padded vocabulary ({vocab} "
                         f"rows: {arch.vocab_size} padded to a multiple of {VOCAB_PAD_MULTIPLE}, the same at every "
                         "TP so that checkpoints reshard); use a TP size that divides it")
    if arch.intermediate_size % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide the model's MLP width "
                         f"(intermediate_size {arch.intermediate_size})")
    if arch.is_moe and arch.moe_intermediate_size % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide the model's expert MLP width "
                         f"(moe_intermediate_size {arch.moe_intermediate_size})")
    groups = arch.num_key_value_heads
    if groups % tp and tp % groups:
        raise UsageError(f"--tensor-model-parallel-size {tp} is neither a multiple nor a divisor of the model's "
                         f"{groups} key-value heads")
    if arch.num_layers % (pp * vpp):
        split = f"--pipeline-model-parallel-size {pp}" + (f" x --virtual-pipeline-model-parallel-size {vpp}"
                                                          if vpp > 1 else "")
        raise UsageError(f"{split} does not divide the model's {arch.num_layers} layers into equal stages")
    recompute = model.recompute_kwargs if isinstance(model, ModelConfig) else {}
    per_chunk = arch.num_layers // (pp * vpp)
    if recompute.get("recompute_method") == "uniform" and per_chunk % recompute["recompute_num_layers"]:
        where = ("the model's" if pp * vpp == 1 else "the") + f" {per_chunk} layers"
        where += "" if pp * vpp == 1 else " of each model chunk" if vpp > 1 else " of each pipeline stage"
        raise UsageError(f"--recompute-num-layers {recompute['recompute_num_layers']} does not divide {where} "
                         "into chunks (--recompute-method uniform); use a divisor, or --recompute-method block")
    if arch.is_moe:
        from megatron_prune.model.moe import moe_config_kwargs

        try:
            layout = model if isinstance(model, ParallelConfig) else parallel_config(model)
            moe_config_kwargs(arch, layout, grouped_gemm=False)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def check_output_paths(configs: dict) -> None:
    """``--save``, ``--metrics-jsonl``'s folder and ``--tensorboard-dir`` can be written, checked
    before any rank trains rather than at the first save."""
    ckpt = configs["CheckpointConfig"]
    log = configs.get("LoggingConfig")
    if ckpt.save is not None:
        check_writable("--save", ckpt.save)
    if log is not None and log.metrics_jsonl:
        check_writable("--metrics-jsonl", os.path.dirname(os.path.abspath(log.metrics_jsonl)), file=log.metrics_jsonl)
    if log is not None and log.tensorboard_dir:
        check_writable("--tensorboard-dir", log.tensorboard_dir)
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise UsageError(f"--tensorboard-dir {log.tensorboard_dir} needs the tensorboard package "
                             "(pip install tensorboard), or leave out --tensorboard-dir") from None


def check_writable(flag: str, path: str, *, file: str | None = None) -> None:
    """``path`` is a directory this process can create or write into: probed by creating and
    removing an empty folder in its nearest existing ancestor (permission bits alone let root
    pass where the filesystem refuses, e.g. a read-only mount). ``file`` is what the flag named,
    when that is a file inside ``path``."""
    shown = file or path
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {shown}: {existing} exists and is not a directory")
    if file is not None and os.path.exists(file) and not os.access(file, os.W_OK):
        raise UsageError(f"{flag} {shown}: the file cannot be written")
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".megatron-prune-write-probe-", dir=existing))
    except OSError as exc:
        raise UsageError(f"{flag} {shown}: cannot write into {existing} ({exc.strerror or exc})") from None


def resolve_tokenizer(model: ModelConfig, ckpt: CheckpointConfig) -> str:
    """``--tokenizer``; else the preset's; else, resuming, the one the checkpoint records while it
    is there (so ``--hf-model`` naming another copy of a LoRA base keeps the run's tokenizer);
    else ``--hf-model``'s; else what the checkpoint keeps beside it."""
    if model.tokenizer:
        return model.tokenizer
    if model.model_preset:
        return "tiny"
    if not ckpt.load:
        if model.hf_model:
            return model.hf_model
        raise UsageError("cannot tell which tokenizer to use: pass --tokenizer")
    from megatron_prune.training.checkpoint import read_meta

    meta = read_meta(ckpt.load)
    recorded = meta.get("tokenizer")  # what the run that saved the checkpoint used
    if recorded == "tiny" or (recorded and os.path.exists(recorded)):
        return recorded
    if model.hf_model:
        return model.hf_model
    from megatron_prune.model.hf_convert import assets_beside

    assets = assets_beside(ckpt.load)  # kept by the converter and by every run that saves
    if assets is not None:
        return assets
    base = meta.get("lora_base") or {}  # a LoRA checkpoint started from --hf-model: its base has one
    if base.get("kind") == "hf" and os.path.isdir(base.get("path") or ""):
        return base["path"]
    gone = f" (the checkpoint records {recorded}, which no longer exists)" if recorded else ""
    raise UsageError(f"cannot tell which tokenizer to use{gone}: pass --tokenizer")


def tokenizer_meta(spec: str) -> dict[str, str]:
    """The checkpoint record of the tokenizer a run uses, so ``--load`` alone finds it again."""
    return {"tokenizer": spec if spec == "tiny" or not os.path.exists(spec) else os.path.abspath(spec)}


def start(model: ModelConfig, train: TrainConfig, configs: dict | None = None) -> ParallelConfig:
    """Choose the device, start torch.distributed and Megatron's parallel state; ``configs``: every
    rank's flags, checked to be the same before the parallel groups are built."""
    from megatron_prune.training.parallel import initialize_distributed, initialize_model_parallel

    kind = set_accelerator(model.device).kind
    if kind == "npu":
        from megatron_prune.adapters import mindspeed

        mindspeed.prepare_ascend()
    initialize_distributed(timeout_minutes=train.distributed_timeout_minutes)
    if configs is not None:
        check_same_flags(configs)
    parallel = parallel_config(model)
    initialize_model_parallel(parallel, seed=train.seed)
    return parallel


def check_same_flags(configs: dict) -> None:
    """UsageError on every rank unless every rank was launched with the same flags (nodes started
    with different commands otherwise build different parallel groups and wait for each other
    until the timeout, or train with different settings silently). One all-gather."""
    from megatron_prune.config import flag_of

    mine = {flag_of(f): repr(getattr(cfg, f.name)) for cfg in configs.values() if dataclasses.is_dataclass(cfg)
            for f in dataclasses.fields(cfg)}
    for rank, theirs, first, differ in _differing_ranks(mine):
        shown = "; ".join(f"{flag} {theirs.get(flag)} (rank 0: {first.get(flag)})" for flag in differ[:4])
        raise UsageError(f"rank {rank} was launched with other flags than rank 0: {shown}"
                         f"{' ...' if len(differ) > 4 else ''}; launch every node with the same command")


def check_same_data(digests: dict[str, str | None]) -> None:
    """UsageError on every rank unless every rank read the same bytes for each data flag
    (``{flag: content digest}``): a node holding another copy of a file at the same path would
    train on other data without a word. One all-gather."""
    for rank, _, _, differ in _differing_ranks(digests):
        raise UsageError(f"rank {rank} read other data than rank 0 for {' and '.join(differ)}: the files at "
                         "that path differ between its node and rank 0's; give every node the same files")


def _differing_ranks(mine: dict) -> list[tuple[int, dict, dict, list]]:
    """``(rank, its dict, rank 0's dict, the keys that differ)`` for each rank whose ``mine`` differs
    from rank 0's; every rank gets the same list (one all-gather), so every rank raises together."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differing = []
    for rank, theirs in enumerate(every):
        differ = sorted(key for key in set(every[0]) | set(theirs) if every[0].get(key) != theirs.get(key))
        if differ:
            differing.append((rank, theirs, every[0], differ))
    return differing


def build_parts(arch: ModelArch, parallel: ParallelConfig, model: ModelConfig, train: TrainConfig, *,
                lora=None, lora_base: dict | None = None) -> TrainingParts:
    """``lora_base``: the checked base record of a LoRA run (``lora_config.check_load``)."""
    if lora_active(lora):  # the base is loaded before adapters are added and DDP wraps
        if lora_base is not None:
            from megatron_prune.model.lora_base import BaseSource, load_base_weights

            source = BaseSource.from_dict(lora_base)
            base = lambda chunks: load_base_weights(chunks, source, arch=arch)  # noqa: E731
        else:
            base = (lambda chunks: load_hf_weights(chunks, model.hf_model, arch)) if model.hf_model else None
        policy = setup_model(arch, parallel, seed=train.seed, use_distributed_optimizer=model.use_distributed_optimizer,
                             lora=lora, load_base=base)
    else:
        policy = setup_model(arch, parallel, seed=train.seed, use_distributed_optimizer=model.use_distributed_optimizer)
        if model.hf_model:
            load_hf_weights(policy, model.hf_model, arch)
    optimizer = build_optimizer(
        policy,
        OptimConfig(
            optimizer=train.optimizer, lr=train.lr, min_lr=train.min_lr, weight_decay=train.weight_decay,
            adam_beta1=train.adam_beta1, adam_beta2=train.adam_beta2, adam_eps=train.adam_eps,
            sgd_momentum=train.sgd_momentum,
            clip_grad=train.clip_grad,
            use_distributed_optimizer=model.use_distributed_optimizer,
        ),
        bf16=model.bf16,
    )
    return TrainingParts(model=policy, optimizer=optimizer, scheduler=build_scheduler(optimizer, train), arch=arch,
                         hf_assets=model.hf_model)


def reference_source(model: ModelConfig, ckpt: CheckpointConfig, ref_load: str | None, *,
                     lora_base: dict | None = None) -> str | None:
    """Checkpoint the reference model loads from; None = the starting weights (an HF directory,
    see :func:`reference_hf_dir`, or the preset's initialisation; under LoRA the recorded base
    ``lora_base``).

    - ``--ref-load`` wins.
    - Resuming (``--load`` without ``--finetune``): the reference the checkpoint records
      (``reference_load`` in its metadata), whatever ``--model-preset``/``--hf-model`` also say,
      so a resumed run keeps comparing against the model it was trained against.
    - ``--finetune``: the loaded weights are the starting model, so they are the reference.
    - A converted model (no optimizer state) is the starting point and the reference.
    - A LoRA run that starts from a checkpoint without adapters starts from that checkpoint's
      weights: they are its base and its reference.
    """
    from megatron_prune.training.checkpoint import find_latest, read_meta

    # A save directory names whichever checkpoint is newest when it is read; the reference is the
    # one checkpoint it names now (recorded so), not the newest of a run that goes on saving there.
    if ref_load:
        return os.path.abspath(find_latest(ref_load, flag="--ref-load"))
    if not ckpt.load:
        return None
    meta = read_meta(ckpt.load)
    if lora_base is not None and not meta.get("lora"):
        return None
    if not meta.get("has_optimizer"):
        return os.path.abspath(find_latest(ckpt.load))  # a converted model: it is the starting point
    if ckpt.finetune and not meta.get("lora"):
        return os.path.abspath(find_latest(ckpt.load))
    if "reference_load" not in meta:
        raise UsageError(f"--load {ckpt.load} does not record its reference model; pass --ref-load with the "
                         "checkpoint of the model that run started from")
    recorded = meta["reference_load"]  # None: the starting weights (an HF directory, the preset)
    if recorded is not None and not os.path.isdir(recorded):
        raise UsageError(f"--load {ckpt.load} records its reference model as {recorded}, which no longer exists; "
                         "pass --ref-load with where that checkpoint is now")
    return recorded


def _refuse_new_run_into_its_source(ckpt: CheckpointConfig, lora_on: bool) -> None:
    """A run that starts at iteration 0 from a training checkpoint's weights (``--finetune``, or
    LoRA starting from a checkpoint without adapters) must not save into that run's folder: its
    saves would replace the checkpoints of the same iterations, its own base or reference among
    them, and a later ``--load`` would mix the two runs."""
    if not (ckpt.load and ckpt.save):
        return
    load, save = os.path.realpath(ckpt.load), os.path.realpath(ckpt.save)
    if load != save and not load.startswith(save + os.sep):
        return
    from megatron_prune.training.checkpoint import read_meta

    meta = read_meta(ckpt.load)
    if not meta.get("has_optimizer"):
        return  # a converted model: a run's saves (iteration 1 on) leave it in place
    if ckpt.finetune or (lora_on and not meta.get("lora")):
        how = "--finetune" if ckpt.finetune else "LoRA starting from its model weights"
        raise UsageError(f"--load {ckpt.load}: {how} starts a new run at iteration 0 from it, and --save "
                         f"{ckpt.save} is that run's folder: the new checkpoints would replace its checkpoints of the "
                         "same iterations (the new run's base and reference among them); choose another --save")


def reference_hf_dir(model: ModelConfig, ckpt: CheckpointConfig, source: str | None, *,
                     lora_base: dict | None = None) -> str | None:
    """The HF directory the reference loads when :func:`reference_source` gave no checkpoint: the
    run's ``--hf-model`` when it starts from it, or, on resume, the one the checkpoint records
    (``reference_hf_model``), so ``--load`` alone keeps an HF-started run's reference."""
    if source is not None or lora_base is not None:
        return None
    if ckpt.load and not ckpt.finetune:
        from megatron_prune.training.checkpoint import read_meta

        meta = read_meta(ckpt.load)
        if meta.get("has_optimizer") and "reference_hf_model" in meta:
            return meta["reference_hf_model"]
    return model.hf_model


def build_reference(arch: ModelArch, parallel: ParallelConfig, model: ModelConfig, train: TrainConfig,
                    source: str | None, *, lora_base: dict | None = None, ckpt: CheckpointConfig | None = None):
    """A frozen reference model in the same layout: the checkpoint ``source``; else under LoRA
    the recorded base ``lora_base``; else the HF weights :func:`reference_hf_dir` names; else the
    preset's initialisation."""
    reference = setup_model(arch, parallel, seed=train.seed, trainable=False)
    hf_dir = reference_hf_dir(model, ckpt or CheckpointConfig(), source, lora_base=lora_base)
    if source:
        from megatron_prune.training.checkpoint import load_checkpoint

        load_checkpoint(source, model=reference, arch=arch)
    elif lora_base is not None:
        from megatron_prune.model.lora_base import BaseSource, load_base_weights

        load_base_weights(reference, BaseSource.from_dict(lora_base), arch=arch)
    elif hf_dir:
        load_hf_weights(reference, hf_dir, arch)
    return reference


def reference_meta(model: ModelConfig, ckpt: CheckpointConfig, source: str | None, *,
                   lora_base: dict | None = None) -> dict:
    """What a checkpoint records about its reference, for a resumed run to find it again."""
    hf_dir = reference_hf_dir(model, ckpt, source, lora_base=lora_base)
    return {"reference_load": source, "reference_hf_model": os.path.abspath(hf_dir) if hf_dir else None}


def load_hf_weights(chunks, hf_dir: str, arch: ModelArch) -> None:
    """Fill this rank's shards straight from the HF safetensors (streamed, one layer at a time)."""
    from megatron_prune.model.hf_convert import fill_model_from_hf_dir

    fill_model_from_hf_dir(chunks, hf_dir=hf_dir, arch=arch)
