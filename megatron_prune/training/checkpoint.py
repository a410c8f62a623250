"""Atomic, resharding checkpoints on Megatron dist checkpointing (torch_dist).

Layout of a save directory::

    SAVE/latest_checkpointed_iteration.txt   the newest complete iteration (replaced atomically)
    SAVE/iter_0000010/                        one complete checkpoint
        meta.json                             architecture, iteration, format; written last
        dist/                                 model (+ optimizer) sharded state, any TP x PP x DP x EP;
                                              under LoRA the adapters alone (meta.json's lora_base
                                              records where the frozen base comes from)
        trainer_state.pt                      data position, sampler/DPPO state, per-rank RNG

meta.json also records which trainer wrote the checkpoint (``trainer_kind``: dpo or grpo).

A checkpoint is written into ``iter_XXXXXXX.tmp`` and renamed into place only when complete, so
a kill during a save leaves the previous checkpoint loadable; a Ctrl-C (SIGINT) during a save
stops every rank once the save is published (:func:`save_checkpoint`). ``--load`` picks the
newest complete one (holding every file of :data:`REQUIRED`) and says which; a newer directory
that is not complete is named in a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import threading
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core.utils import unwrap_model

from megatron_prune.model.arch import ModelArch
from megatron_prune.ranks import first_rank
from megatron_prune.training.parallel import any_rank, broadcast_object

logger = logging.getLogger(__name__)

FORMAT = "megatron-prune/1"
TRACKER = "latest_checkpointed_iteration.txt"
META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


REQUIRED = (META, "trainer_state.pt", os.path.join("dist", ".metadata"))
"""What a complete checkpoint directory holds (``save_checkpoint`` writes ``meta.json`` last, so a
save always has them all; a directory without one of them is a partial copy or a damaged save)."""

_warned: set[str] = set()


def _speaks() -> bool:
    """This process is the one that warns: rank 0 (before the process group starts, by torchrun's RANK)."""
    return first_rank()


def _warn_once(message: str) -> None:
    """Log ``message`` once per process from rank 0 (a load reads the checkpoint's metadata several times)."""
    if message not in _warned and _speaks():
        _warned.add(message)
        logger.warning("%s", message)


def _missing(path: str) -> list[str]:
    """The entries of :data:`REQUIRED` that ``path`` lacks."""
    return [name for name in REQUIRED if not os.path.isfile(os.path.join(path, name))]


def _is_complete(path: str) -> bool:
    return not _missing(path)


def _lacks(path: str) -> str:
    return f"missing {', '.join(_missing(path))}"


def _partial_saves(root: str) -> list[str]:
    """``iter_*`` directories under ``root`` that are not complete checkpoints (``.tmp`` ones included)."""
    return sorted(d for d in os.listdir(root) if d.startswith("iter_") and os.path.isdir(os.path.join(root, d))
                  and not _is_complete(os.path.join(root, d)))


def _describe_partial(root: str, names: list[str]) -> str:
    return ", ".join(f"{name} (a save that did not finish)" if name.endswith(".tmp")
                     else f"{name} (a replaced checkpoint not yet deleted)" if name.endswith(".old")
                     else f"{name} ({_lacks(os.path.join(root, name))})" for name in names)


def _newest_complete(root: str) -> tuple[str | None, str | None]:
    """The newest complete checkpoint under the save directory ``root`` (None if there is none), and a
    warning to give when it is not the one the tracker or the newest ``iter_*`` directory names."""
    tracker = os.path.join(root, TRACKER)
    named = None
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        named = iteration_dir(root, int(text)) if text.isdigit() else os.path.join(root, text)
        if _is_complete(named):
            return named, None
    complete = sorted(
        d for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit() and _is_complete(os.path.join(root, d))
    )
    chosen = os.path.join(root, complete[-1]) if complete else None
    if named is not None:
        what = f"which is incomplete ({_lacks(named)})" if os.path.isdir(named) else "which does not exist"
        return chosen, f"{tracker} names {named}, {what}"
    newer = [d for d in _partial_saves(root) if d[5:].isdigit() and (not complete or d > complete[-1])]
    if newer and chosen is not None:
        return chosen, "; ".join(f"{os.path.join(root, d)} is incomplete ({_lacks(os.path.join(root, d))})"
                                 for d in newer)
    return chosen, None


def find_latest(root: str, *, flag: str = "--load") -> str:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one); errors name ``flag``.

    A directory the tracker names, or a newer ``iter_*`` one, that lacks a file of :data:`REQUIRED`
    is passed over with a warning (once) naming it and what it misses.
    """
    if _is_complete(root):
        return root
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"{flag} {root}: not a directory")
    if not os.path.isdir(root):
        raise CheckpointError(f"{flag} {root}: directory does not exist")
    if os.path.isfile(os.path.join(root, META)) or os.path.isdir(os.path.join(root, "dist")):
        # One checkpoint directory, named on its own.
        raise CheckpointError(f"{flag} {root}: incomplete checkpoint ({_lacks(root)}); "
                              f"give its save directory to load the newest complete one")
    chosen, warning = _newest_complete(root)
    if chosen is None:
        partial = _partial_saves(root)
        found = f"; found only {_describe_partial(root, partial)}" if partial else ""
        raise CheckpointError(f"{flag} {root}: no complete checkpoint found (expected iter_*/ holding "
                              f"{', '.join(REQUIRED)}){found}")
    if warning:
        _warn_once(f"{warning}; using {chosen}")
    return chosen


def holds_checkpoint(root: str) -> bool:
    """Whether ``root`` (a save directory or one checkpoint) holds a complete checkpoint."""
    return os.path.isdir(root) and (_is_complete(root) or _newest_complete(root)[0] is not None)


def resume_source(save: str | None, load: str | None, *, can_start_fresh: bool) -> str | None:
    """The ``--load`` a run resumes from, or None when it starts fresh. Checked before any rank works.

    ``--save X --load X`` (the same directory) is how a launch script resumes whatever is there:
    while ``X`` holds no complete checkpoint yet (it does not exist, is empty, or only a killed
    first save left a ``.tmp``) the run starts fresh, with a notice; without a model of its own
    (``can_start_fresh``: a ``--model-preset`` or ``--hf-model``) there is nothing to start from.
    A ``--save`` that already holds checkpoints is refused without ``--load`` (the run would start
    again at iteration 0 and overwrite them) and with another ``--load`` (its checkpoints would
    land among them). Errors are :class:`CheckpointError`.
    """
    if load is not None and save is not None and os.path.realpath(load) == os.path.realpath(save) \
            and not holds_checkpoint(load):
        if not can_start_fresh:
            try:
                find_latest(load)
            except CheckpointError as exc:
                raise CheckpointError(f"{exc}; a first run into --save {save} needs --model-preset or --hf-model "
                                      "to start from") from None
        if _speaks():
            partial = _partial_saves(load) if os.path.isdir(load) else []
            left = f"; found only {_describe_partial(load, partial)}" if partial else ""
            print(f"[megatron-prune] --load {load} holds no complete checkpoint yet{left}: starting a new run "
                  f"at iteration 0 that saves into --save {save}", flush=True)
        return None
    if load is None and save is not None and holds_checkpoint(save):
        raise CheckpointError(f"--save {save} already holds checkpoints (newest: {find_latest(save, flag='--save')}) "
                              f"that a new run would overwrite; pass --load {save} to resume from it, or choose "
                              "another --save")
    inside = load is not None and save is not None and \
        os.path.realpath(load).startswith(os.path.realpath(save) + os.sep)  # --load X/iter_N --save X
    if load is not None and save is not None and holds_checkpoint(save) and not inside \
            and os.path.realpath(load) != os.path.realpath(save):
        raise CheckpointError(f"--save {save} already holds checkpoints (newest: {find_latest(save, flag='--save')}) "
                              f"that this run from --load {load} would overwrite; choose another --save")
    return load


def _cause(exc: BaseException) -> str:
    """``Type: message`` of ``exc``; for torch's CheckpointException (a BaseException whose text is
    every rank's traceback) the first failing rank's exception and its rank."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank, (first, _) = next(iter(sorted(exc.failures.items(), key=lambda item: item[0])))
        ranks = ", ".join(str(r) for r in sorted(exc.failures))
        return f"{type(first).__name__}: {first} (on rank {rank}; failed on ranks {ranks})"
    return f"{type(exc).__name__}: {exc}"


def _unreadable(ckpt: str, part: str, exc: BaseException) -> str:
    return (f"{os.path.join(ckpt, part)} cannot be read ({_cause(exc)}); if the files are damaged, "
            f"--load an earlier checkpoint directory of the same run ({os.path.dirname(ckpt)}/iter_*) or remove "
            f"{os.path.basename(ckpt)} so the newest complete one before it is used")


def read_meta(path: str) -> dict[str, Any]:
    """Metadata of the newest complete checkpoint at ``path`` (with its resolved ``path``)."""
    ckpt = find_latest(path)
    try:
        with open(os.path.join(ckpt, META), encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(_unreadable(ckpt, META, exc)) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT})")
    meta["path"] = ckpt
    return meta


def read_trainer_state(ckpt: str) -> dict[str, Any]:
    """The ``trainer_state.pt`` of the checkpoint directory ``ckpt`` (an ``iter_*`` folder): trainer,
    scheduler and per-rank RNG states."""
    try:
        return torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)  # in REQUIRED
    except Exception as exc:
        raise CheckpointError(_unreadable(ckpt, "trainer_state.pt", exc)) from exc


def read_arch(path: str) -> ModelArch:
    return ModelArch.from_dict(read_meta(path)["arch"])


def _model_sharded_state_dict(model: list[torch.nn.Module], *, adapters_only: bool = False) -> dict[str, Any]:
    def chunk_state(chunk) -> dict[str, Any]:
        state = unwrap_model(chunk).sharded_state_dict()
        # A LoRA checkpoint that records its base (lora_base in meta.json) holds the adapters alone.
        return {k: v for k, v in state.items() if k.endswith((".lora_A", ".lora_B"))} if adapters_only else state

    if len(model) == 1:
        return {"model": chunk_state(model[0])}
    return {f"model{i}": chunk_state(chunk) for i, chunk in enumerate(model)}


def _check_lora_layout(meta: dict[str, Any], model: list[torch.nn.Module], ckpt: str) -> bool:
    """True when the checkpoint holds adapters only; refuses LoRA checkpoints for models without adapters."""
    if not meta.get("lora"):
        return False
    from megatron_prune.model.lora import is_lora_model

    if not is_lora_model(model):
        raise CheckpointError(f"{ckpt} holds LoRA adapters (rank {meta['lora']['rank']}); it can only be loaded "
                              "into a model with the same --lora-rank and --lora-targets")
    return "lora_base" in meta


# How optimizer state is laid out on disk (recorded in meta.json): a distributed (ZeRO-1)
# optimizer writes its shards gathered back into per-parameter tensors ("fully reshardable"),
# which any TP x PP x DP layout of a distributed optimizer can read back; the two kinds of
# optimizer do not read each other's state.
LOCAL_OPTIMIZER = "local"
DISTRIBUTED_OPTIMIZER = "distributed/fully_reshardable"


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def optimizer_format(optimizer) -> str:
    """How ``optimizer`` saves its state: ``DISTRIBUTED_OPTIMIZER`` or ``LOCAL_OPTIMIZER``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    kinds = {isinstance(o, DistributedOptimizer) for o in _chained(optimizer)}
    assert len(kinds) == 1, "a mix of distributed and local optimizers"
    return DISTRIBUTED_OPTIMIZER if kinds.pop() else LOCAL_OPTIMIZER


def optimizer_record(*, optimizer: str, bf16: bool, distributed: bool) -> dict[str, str]:
    """What meta.json records of a run's optimizer state: its format, kind and precision."""
    return {"optimizer_format": DISTRIBUTED_OPTIMIZER if distributed else LOCAL_OPTIMIZER, "optimizer": optimizer,
            "precision": "bf16" if bf16 else "fp32"}


def _record_of(optimizer) -> dict[str, str]:
    config = _chained(optimizer)[0].config
    return optimizer_record(optimizer=config.optimizer, bf16=bool(config.bf16),
                            distributed=optimizer_format(optimizer) == DISTRIBUTED_OPTIMIZER)


def optimizer_mismatch(meta: dict[str, Any], wanted: dict[str, str]) -> str | None:
    """Why the optimizer state of ``meta``'s checkpoint cannot be resumed by an optimizer recorded as
    ``wanted`` (:func:`optimizer_record`), or None. A checkpoint that predates a record says nothing."""
    ckpt = meta["path"]
    saved_format = meta.get("optimizer_format", LOCAL_OPTIMIZER)
    if saved_format != wanted["optimizer_format"]:
        return (f"{ckpt}: optimizer state was saved {_describe(saved_format)} and cannot be loaded "
                f"{_describe(wanted['optimizer_format'])}; "
                f"{'add' if saved_format == DISTRIBUTED_OPTIMIZER else 'drop'} --use-distributed-optimizer, "
                "or use --finetune to load weights only")
    saved_kind = meta.get("optimizer")
    if saved_kind is not None and saved_kind != wanted["optimizer"]:
        return (f"{ckpt}: optimizer state was saved by --optimizer {saved_kind} and this run has --optimizer "
                f"{wanted['optimizer']}, whose state it cannot load; resume with --optimizer {saved_kind}, or use "
                "--finetune to start the new optimizer from the checkpoint's weights")
    saved_precision = meta.get("precision")
    if saved_precision is not None and saved_precision != wanted["precision"]:
        flag = {"bf16": "--bf16", "fp32": "no --bf16"}
        return (f"{ckpt}: the checkpoint's run trained in {saved_precision} ({flag[saved_precision]}) and this run "
                f"in {wanted['precision']} ({flag[wanted['precision']]}); their optimizer states differ (--bf16 "
                f"keeps fp32 main weights beside the bf16 ones): resume with {flag[saved_precision]}, or use "
                "--finetune to load weights only")
    return None


def _unsplit(key: str) -> str:
    return key.split(".", 1)[1] if key.startswith("chained_") else key


def is_optimizer_key(key: str) -> bool:
    """Whether a checkpoint tensor key is optimizer state: ``optimizer.*``, or ``chained_<i>.optimizer.*``
    where expert parallelism splits the optimizer."""
    return _unsplit(key).startswith("optimizer.")


def _expert_split_keys(ckpt: str, optimizer_state: dict[str, Any]) -> dict[str, str] | None:
    """Whether the optimizer state of ``ckpt`` was saved across Megatron's expert split.

    Under expert parallelism Megatron keeps the expert parameters in an optimizer of their own,
    chained after the dense one, and keys the saved tensors by optimizer
    (``chained_<i>.optimizer.state.exp_avg.<param>``); at EP=1 one optimizer holds every parameter
    (``optimizer.state.exp_avg.<param>``). None when every rank finds its tensors under its own
    keys; otherwise this rank's key -> the saved key of the same tensor. Collective (every rank
    learns whether any rank crosses the split).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    saved = set(dist_checkpointing.load_tensors_metadata(os.path.join(ckpt, "dist")).keys())
    wanted = {v.key for v in nested_values(optimizer_state) if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    by_name = {_unsplit(k): k for k in saved}
    missing = wanted - saved
    across = bool(missing) and all(_unsplit(k) in by_name for k in missing)
    flag = torch.tensor([int(across)])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not flag.item():
        return None
    return {k: by_name.get(_unsplit(k), k) for k in wanted}


class _FromCheckpoint:
    """Marks where a loaded tensor goes in an optimizer state loaded across the expert split."""


def _across_split_template(optimizer_state: dict[str, Any], keys: dict[str, str]) -> Any:
    """Point this rank's optimizer tensors at their saved keys; return the state's structure with
    the tensors marked (everything else — param groups — is this optimizer's own)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
    from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedBase, ShardedTensor,
                                                          ShardedTensorFactory)

    def leaf(value):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            value.key = keys[value.key]
        if isinstance(value, ShardedBase):
            return _FromCheckpoint
        return value.unwrap() if isinstance(value, LocalNonpersistentObject) else value

    return dict_list_map_outplace(leaf, optimizer_state)


def _fill(template: Any, loaded: Any) -> Any:
    if template is _FromCheckpoint:
        assert isinstance(loaded, torch.Tensor), "an optimizer tensor was not loaded"
        return loaded
    if isinstance(template, dict):
        return {k: _fill(v, loaded.get(k) if isinstance(loaded, dict) else None) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None)
                for i, v in enumerate(template)]
    return template


def _saved_steps(common: Any) -> list:
    """Step counts in an optimizer's saved common state: ``common_step`` (local optimizer) or
    each param group's ``step`` (distributed optimizer)."""
    if isinstance(common, dict):
        return [float(v) for k, v in common.items() if k in ("common_step", "step")] + [
            s for k, v in common.items() if k not in ("common_step", "step") for s in _saved_steps(v)]
    if isinstance(common, list):
        return [s for v in common for s in _saved_steps(v)]
    return []


def _across_split_state(template: Any, loaded: Any, *, ckpt: str, optimizer) -> Any:
    """The optimizer state to load: this optimizer's own structure and param groups (learning rates
    are set again when the scheduler's state loads), the tensors loaded from their saved keys, and
    the step count the saved optimizers shared, where the resuming optimizer reads it: torch's Adam
    per parameter (Megatron's ``common_step``), Transformer Engine's and Apex's fused Adam in each
    param group (as an int: their kernels take one)."""
    from megatron.core import dist_checkpointing

    state = _fill(template, loaded)
    steps = _saved_steps(dist_checkpointing.load_common_state_dict(os.path.join(ckpt, "dist")).get("optimizer"))
    if not steps:
        return state
    assert len(set(steps)) == 1, f"the saved optimizers' step counts differ: {sorted(set(steps))}"
    chained = _chained(optimizer)
    for part, sub in zip(chained, [state[i] for i in range(len(chained))] if len(chained) > 1 else [state]):
        if "param_state_sharding_type" in sub:  # distributed optimizer: the step is in the param groups
            for group in sub["optimizer"]["param_groups"]:
                group["step"] = int(steps[0])
            continue
        inner = sub["optimizer"] if "fp32_from_fp16_params" in sub else sub
        if _is_torch_adam(part.optimizer):
            inner["state"]["common_step"] = torch.tensor(steps[0])
        else:
            for group in inner["param_groups"]:
                group["step"] = int(steps[0])
    return state


def _is_torch_adam(inner) -> bool:
    return isinstance(inner, (torch.optim.Adam, torch.optim.AdamW))


def _init_distributed_optimizer_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet a placeholder Adam state.

    Megatron's distributed optimizer reads the step count out of the existing state while
    building the state dict to load into; every value is overwritten by the load.
    """
    for opt in _chained(optimizer):
        inner = opt.optimizer
        if inner.state or not _is_torch_adam(inner):
            continue  # fused (TE/Apex) Adam keeps its step in the param groups: Megatron allocates
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                inner.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                inner.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _optimizer_sharded_state_dict(optimizer, model_state: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    # The model chunks of the interleaved schedule share their local key names: keep every chunk's
    # entries (the optimizer matches its parameters to them by tensor, not by key).
    flat = {f"{chunk}.{key}": value for chunk, sd in model_state.items() for key, value in sd.items()}
    if optimizer_format(optimizer) == LOCAL_OPTIMIZER:
        return optimizer.sharded_state_dict(flat, is_loading=is_loading)
    if is_loading:
        _init_distributed_optimizer_state(optimizer)
    # Off CUDA the shards are gathered over the gloo data-parallel group (Megatron's NCCL path
    # allocates on the current CUDA device); both variants read back the same way.
    on_cuda = any(p.is_cuda for o in _chained(optimizer) for g in o.optimizer.param_groups for p in g["params"])
    metadata = {"distrib_optim_sharding_type": "fully_reshardable",
                "distrib_optim_fully_reshardable_mem_efficient": not on_cuda}
    state = optimizer.sharded_state_dict(flat, is_loading=is_loading, metadata=metadata)
    # Only the first data-parallel rank holds the gathered state (and rank 0 writes the common,
    # non-tensor part); the others' None would only make their common state differ from rank 0's.
    for sd in (state, *(v for v in state.values() if isinstance(v, dict))):
        if "param_state" in sd and sd["param_state"] is None:
            del sd["param_state"]
    return state


def _load_distributed_optimizer(optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict`` for a distributed optimizer's fully reshardable state.

    Megatron copies the loaded tensors over every entry of torch Adam's per-parameter state,
    ``step`` included, which that format does not carry (the step count lives in the param
    groups): the parameter state is copied here with ``step`` set aside. Megatron also gives
    every parameter the same ``step`` tensor object, which torch's Adam would then advance
    once per parameter and step: each parameter gets its own copy.
    """
    chained = _chained(optimizer)
    states = [state] if len(chained) == 1 else [state[i] for i in range(len(chained))]
    for opt, sd in zip(chained, states):
        if not _is_torch_adam(opt.optimizer):
            opt.load_state_dict(sd)
            continue
        param_state = sd.pop("param_state")
        assert sd.pop("param_state_sharding_type") == "fully_reshardable"
        opt.load_state_dict(sd)  # param groups (learning rates, step count), grad scaler
        steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                opt.optimizer.state[p]["step"] = step.clone()
    if len(chained) > 1:
        optimizer._synchronize_steps()


@contextlib.contextmanager
def _sigint_held() -> Iterator[list[int]]:
    """Hold SIGINT for the block; yield the list each held signal is appended to.

    Why not let it raise: Megatron's sharded write forks writer processes into this process's
    group, so a Ctrl-C reaches them too. KeyboardInterrupt kills a writer before it reports, and
    the save then waits for that report forever; in this process, a KeyboardInterrupt raised while
    ``os.fork`` returns (in an at-fork callback) is printed and dropped, so the Ctrl-C is lost, or
    the save hangs if a writer died. Held, the write completes. A second SIGINT raises at once
    here (the previous checkpoint stays loadable); the writers ignore every SIGINT.
    """
    held: list[int] = []
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler \
            or threading.current_thread() is not threading.main_thread():
        yield held  # SIGINT does not raise here (ignored, or handled by the caller): leave it be
        return
    owner = os.getpid()

    def hold(signum, frame):
        if os.getpid() != owner:
            return  # a writer process forked by the save (it inherits this handler): it finishes its part
        held.append(signum)
        if len(held) > 1:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, hold)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def save_checkpoint(
    root: str,
    *,
    iteration: int,
    model: list[torch.nn.Module],
    arch: ModelArch,
    optimizer=None,
    scheduler_state: dict | None = None,
    trainer_state: dict | None = None,
    extra_meta: dict | None = None,
) -> str:
    """Save model (and optimizer) shards plus trainer state; publish atomically. Collective.

    A SIGINT on any rank during the save is held until the checkpoint is published, then raises
    KeyboardInterrupt on every rank (the ranks agree in one all-reduce, so none is left waiting in
    a collective for a rank that stopped); a second SIGINT raises at once on the rank it reaches.
    """
    with _sigint_held() as held:
        final = _save(root, iteration=iteration, model=model, arch=arch, optimizer=optimizer,
                      scheduler_state=scheduler_state, trainer_state=trainer_state, extra_meta=extra_meta)
        (stop,) = any_rank(bool(held))
    if stop or held:  # held: a SIGINT after the ranks agreed stops this rank as it would between saves
        raise KeyboardInterrupt
    return final


def _save(root: str, *, iteration: int, model: list[torch.nn.Module], arch: ModelArch, optimizer,
          scheduler_state: dict | None, trainer_state: dict | None, extra_meta: dict | None) -> str:
    from megatron.core import dist_checkpointing

    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    failure, cause = None, None
    if _rank() == 0:
        try:  # on a full disk, creating a directory is the first thing that fails
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "dist"))
        except OSError as exc:
            failure, cause = (f"--save {root}: creating {tmp} for the checkpoint of iteration {iteration} failed "
                              f"({_cause(exc)}); the checkpoints published before it are intact"), exc
    agree_or_raise(failure, cause)
    assert "lora" not in (extra_meta or {}) or "lora_base" in extra_meta, "a LoRA checkpoint records its base"
    state = _model_sharded_state_dict(model, adapters_only="lora_base" in (extra_meta or {}))
    if optimizer is not None:
        state["optimizer"] = _optimizer_sharded_state_dict(optimizer, state, is_loading=False)
    try:
        dist_checkpointing.save(state, os.path.join(tmp, "dist"))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # torch's is a BaseException: it would skip every handler
        raise CheckpointError(f"--save {root}: writing the checkpoint of iteration {iteration} into {tmp} failed "
                              f"({_cause(exc)}); the checkpoints published before it are intact") from exc
    rng = {
        "torch": torch.get_rng_state(),
        "device": _device_rng_state(),
        "tracker": _rng_tracker_states(),
    }
    gathered: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, rng)
    else:
        gathered = [rng]
    if _rank() == 0:
        meta = {"format": FORMAT, "iteration": iteration, "arch": arch.to_dict(),
                "has_optimizer": optimizer is not None, **(extra_meta or {})}
        if optimizer is not None:
            meta.update(_record_of(optimizer))
        try:  # a full disk fails here too (torch's own message names no file)
            torch.save(
                {"trainer": trainer_state or {}, "scheduler": scheduler_state or {}, "rng_per_rank": gathered,
                 "rng_layout": _rng_layout()},
                os.path.join(tmp, "trainer_state.pt"),
            )
            with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2)
        except (OSError, RuntimeError) as exc:
            failure, cause = (f"--save {root}: writing the checkpoint of iteration {iteration} into {tmp} "
                              f"failed ({_cause(exc)}); the checkpoints published before it are intact"), exc
    agree_or_raise(failure, cause)
    if _rank() == 0:
        _replace_dir(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        try:
            with open(tracker_tmp, "w") as f:
                f.write(str(iteration))
            os.replace(tracker_tmp, os.path.join(root, TRACKER))
        except OSError as exc:  # the checkpoint is complete; only the pointer to it is stale
            logger.warning("--save %s: saved %s, but updating %s failed (%s): a --load of %s resumes from the "
                           "iteration it still names", root, final, TRACKER, _cause(exc), root)
        logger.info("saved checkpoint %s", final)
    _barrier()
    return final


def agree_or_raise(failure: str | None, cause: BaseException | None = None) -> None:
    """Raise rank 0's ``failure`` (a save's own files are written by rank 0 alone) on every rank. In
    place of a barrier, which would let the others go on as if the checkpoint were saved (into the
    next collective, waiting for a rank that stopped). Collective."""
    failure = broadcast_object(failure)
    if failure is not None:
        raise CheckpointError(failure) from cause


def _replace_dir(new: str, final: str) -> None:
    """Publish ``new`` as ``final``. An existing ``final`` (a re-save of the same iteration) is
    renamed aside before it is deleted: a kill while deleting it in place could leave its metadata
    and index with half its shards, which would pass for a complete checkpoint."""
    aside = final + ".old"
    if os.path.isdir(final):
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(new, final)
    shutil.rmtree(aside, ignore_errors=True)  # also one that a kill left behind


def load_checkpoint(
    path: str,
    *,
    model: list[torch.nn.Module],
    arch: ModelArch | None = None,
    optimizer=None,
    restore_rng: bool = False,
) -> dict[str, Any]:
    """Load the newest complete checkpoint at ``path`` into ``model`` (any layout). Collective.

    Returns the metadata plus ``trainer`` / ``scheduler`` states when present.
    """
    from megatron.core import dist_checkpointing

    meta = read_meta(path)
    ckpt = meta["path"]
    if arch is not None and ModelArch.from_dict(meta["arch"]) != arch:
        raise CheckpointError(
            f"{ckpt}: checkpoint architecture {meta['arch']} does not match the model being built "
            f"{arch.to_dict()}; drop --model-preset/--hf-model to take the architecture from the checkpoint"
        )
    if optimizer is not None and not meta.get("has_optimizer"):
        raise CheckpointError(f"{ckpt}: has no optimizer state (a converted model?); use --finetune to load weights only")
    problem = None if optimizer is None else optimizer_mismatch(meta, _record_of(optimizer))
    if problem:
        raise CheckpointError(problem)
    state = _model_sharded_state_dict(model, adapters_only=_check_lora_layout(meta, model, ckpt))
    if optimizer is not None:
        state["optimizer"] = _optimizer_sharded_state_dict(optimizer, state, is_loading=True)
        across = _expert_split_keys(ckpt, state["optimizer"])
        if across is not None:
            template = _across_split_template(state["optimizer"], across)
    try:
        loaded = dist_checkpointing.load(state, os.path.join(ckpt, "dist"))
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # damaged files: many types, torch's a BaseException
        raise CheckpointError(_unreadable(ckpt, "dist/", exc)) from exc
    if len(model) == 1:
        unwrap_model(model[0]).load_state_dict(loaded["model"], strict=False)
    else:
        for i, chunk in enumerate(model):
            unwrap_model(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
    if optimizer is not None:
        loaded_optimizer = loaded["optimizer"]
        if across is not None:  # saved on the other side of the expert split
            loaded_optimizer = _across_split_state(template, loaded_optimizer, ckpt=ckpt, optimizer=optimizer)
        if optimizer_format(optimizer) == DISTRIBUTED_OPTIMIZER:
            _load_distributed_optimizer(optimizer, loaded_optimizer)
        else:
            optimizer.load_state_dict(loaded_optimizer)
    extra = read_trainer_state(ckpt)
    meta["trainer"] = extra.get("trainer", {})
    meta["scheduler"] = extra.get("scheduler", {})
    per_rank = extra.get("rng_per_rank") or []
    # Rank k's generators only at the layout that saved them: at another one of the same world size
    # rank k holds another part (TP ranks given two DP ranks' states would drop out differently on
    # one input), so the launch's own seeding, consistent for its layout, stands.
    same_layout = extra.get("rng_layout", _rng_layout()) == _rng_layout()  # older checkpoints: world size only
    if restore_rng and same_layout and len(per_rank) == (dist.get_world_size() if dist.is_initialized() else 1):
        mine = per_rank[_rank()]
        torch.set_rng_state(mine["torch"])
        _set_device_rng_state(mine.get("device"))
        _set_rng_tracker_states(mine["tracker"])
    if _rank() == 0:
        logger.info("loaded checkpoint %s (iteration %s)", ckpt, meta["iteration"])
    return meta


def load_model_weights(path: str, *, model: list[torch.nn.Module], arch: ModelArch) -> None:
    """Load only the model weights of the checkpoint at ``path`` (no adapters) into ``model``,
    at any layout: no optimizer, trainer state or RNG (a LoRA base). Collective."""
    assert not read_meta(path).get("lora"), "checked by the caller"
    load_checkpoint(path, model=model, arch=arch)


def _describe(fmt: str) -> str:
    return "with --use-distributed-optimizer" if fmt == DISTRIBUTED_OPTIMIZER else "without --use-distributed-optimizer"


def _rng_layout() -> dict[str, int | None]:
    """The parallel layout the ranks' generator states belong to (empty outside a Megatron layout)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size(), "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(), "cp": ps.get_context_parallel_world_size()}


def _device_rng_state() -> dict | None:
    """The GPU's (NPU's) default generator, which draws what runs outside Megatron's tracker forks
    (hidden dropout without sequence parallelism), with the device kind; None on CPU, where torch's
    generator is the device's."""
    from megatron_prune.accelerator import get_accelerator

    accelerator = get_accelerator()
    module = accelerator.module
    return None if module is None else {"kind": accelerator.kind, "state": module.get_rng_state()}


def _set_device_rng_state(saved: dict | None) -> None:
    """Restore :func:`_device_rng_state`; one from another kind of device (or none) is left alone:
    the launch's seeding stands."""
    from megatron_prune.accelerator import get_accelerator

    accelerator = get_accelerator()
    if saved is not None and accelerator.module is not None and saved["kind"] == accelerator.kind:
        accelerator.module.set_rng_state(saved["state"])


def _rng_tracker_states():
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker().get_states()


def _set_rng_tracker_states(states) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    get_cuda_rng_tracker().set_states(states)
