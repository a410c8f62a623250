"""The DPO objective for the shared training loop, and the run entry point."""

from __future__ import annotations

import array
import hashlib
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from megatron_prune.config import CheckpointConfig, DPOConfig, LoggingConfig, ModelConfig, PruneConfig, TrainConfig
from megatron_prune.data.preference import PreferenceDataConfig, PreferenceDataset, same_pairs
from megatron_prune.data.sampler import EpochSampler, dp_shard
from megatron_prune.dpo.batch import CHOSEN, REJECTED
from megatron_prune.dpo.step import DPOStep, DPOStepSettings
from megatron_prune.lora_config import lora_active
from megatron_prune.ranks import first_rank
from megatron_prune.training import session
from megatron_prune.training.loop import check_resumed_data_size, train
from megatron_prune.training.parallel import any_rank, is_logging_rank, world_size_from_env
from megatron_prune.training.step import reduce_metrics

logger = logging.getLogger(__name__)


class DPOObjective:
    """Draws each step's pairs, runs the pruned DPO passes, keeps the data position."""

    def __init__(
        self,
        *,
        dataset: PreferenceDataset,
        eval_dataset: PreferenceDataset | None,
        runner: DPOStep,
        eval_runner: DPOStep | None,
        train_cfg: TrainConfig,
        eval_pairs: int = 0,
    ) -> None:
        self.dataset = dataset
        self.eval_dataset = eval_dataset
        self.runner = runner
        self.eval_runner = eval_runner
        self.train_cfg = train_cfg
        # A step never holds a pair twice where the data can fill it: crossing into the next epoch, a
        # pair the step already took waits for the next step (still within its epoch).
        self.sampler = EpochSampler(len(dataset), seed=train_cfg.seed,
                                    distinct=len(dataset) >= train_cfg.global_batch_size)
        self.eval_pairs = eval_pairs

    def _my_samples(self, indices: list[int], dataset: PreferenceDataset) -> list:
        mine = dp_shard(indices, dp_rank=parallel_state.get_data_parallel_rank(),
                        dp_size=parallel_state.get_data_parallel_world_size())
        return [(i, dataset[i]) for i in mine]

    def train_step(self, step: int) -> dict[str, float]:
        indices = self.sampler.next_indices(self.train_cfg.global_batch_size)
        outputs, counters = self.runner.run(step, self._my_samples(indices, self.dataset))
        return {**reduce_metrics(outputs), **counters}

    def evaluate(self, step: int) -> dict[str, float] | None:
        if self.eval_dataset is None:
            return None
        indices = list(range(self.eval_pairs))
        outputs, _ = self.eval_runner.run(step, self._my_samples(indices, self.eval_dataset), forward_only=True)
        return {**reduce_metrics(outputs), "pairs": float(self.eval_pairs)}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "data_sha256": self.dataset.content_sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])


def heldout_pairs(total: int, *, micro_batch_size: int, dp: int, interleaved_pp: int = 1) -> int:
    """How many of ``total`` held-out pairs each evaluation runs: whole micro-batches on every
    data-parallel rank (every rank runs the same microbatches), under the interleaved schedule
    (``interleaved_pp``: the pipeline size) a multiple of the pipeline size of them. Too few pairs
    for one is a usage error before any rank starts; the pairs left out are said once, and each
    evaluation reports its count as ``eval_pairs``."""
    per_step = micro_batch_size * dp * interleaved_pp
    stages = (f" x --pipeline-model-parallel-size {interleaved_pp} (the interleaved schedule)"
              if interleaved_pp > 1 else "")
    if total < per_step:
        raise session.UsageError(
            f"--eval-data-path has {total} usable pair(s), fewer than the --micro-batch-size {micro_batch_size} "
            f"x data-parallel size {dp}{stages} = {per_step} that one evaluation needs; add held-out pairs"
            + (" or lower --micro-batch-size" if micro_batch_size > 1 else ""))
    usable = total - total % per_step
    if usable < total and first_rank():
        print(f"[megatron-prune] held-out data: each evaluation runs {usable} of {total} pairs (whole micro-batches "
              f"of {micro_batch_size} on {dp} data-parallel rank(s){stages}); the last {total - usable} are left out",
              flush=True)
    return usable


def heldout_overlap(train: PreferenceDataset, heldout: PreferenceDataset) -> int:
    """How many held-out pairs are also training pairs, token for token (the same file passed
    twice, or a split that leaked)."""
    return len(same_pairs(heldout.pairs, train.pairs))


def _fingerprint(dataset: PreferenceDataset, extra: str) -> str:
    """Key of a precomputed reference table: the reference model (``extra``) and the token ids of
    every pair in order. Hashing the tokens, not the files, makes any change that alters what the
    reference scores (another tokenizer, chat format, ``--seq-length`` or ``--max-prompt-length``,
    an edited record) a new table, and a moved copy of the same data reuses the old one."""
    h = hashlib.sha256(extra.encode())
    for pair in dataset.pairs:
        for ids in (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids):
            h.update(len(ids).to_bytes(4, "little"))
            h.update(array.array("q", ids).tobytes())
    return h.hexdigest()[:16]


def reference_table_key(dataset: PreferenceDataset, *, arch, identity: str, seed: int, bf16: bool) -> str:
    """Key of a precomputed reference table: the tokens (see :func:`_fingerprint`), the
    architecture, the reference's identity, the seed where it is a preset's initialisation (the
    weights of a checkpoint or HF directory do not depend on it) and the precision it was scored in
    (bf16 log-probs are not fp32's: the step-0 log-ratio would not be 0)."""
    initialised = seed if identity == "initialisation" else ""
    return _fingerprint(dataset, f"{arch.to_dict()}|{identity}|{initialised}|{'bf16' if bf16 else 'fp32'}")


def reference_identity(ref_meta: dict, *, ref_source: str | None, lora_base: dict | None,
                       adapter_off_base: bool) -> str:
    """What a precomputed reference table was scored with, by content, not by path: the LoRA
    base's record (it carries the weights' fingerprint) when the adapter-off policy scores it, else
    the reference checkpoint's or HF directory's weight fingerprint, or, for a preset's
    initialisation, nothing beyond the architecture and seed the key adds. Two bases of one
    architecture, or new weights written where old ones were, then never share a table: the
    weights are hashed whole (the base's record alone samples them), which costs a read of the
    weights, far less than the reference pass it saves."""
    import json

    from megatron_prune.model.lora_base import hf_fingerprint, megatron_fingerprint

    from megatron_prune.training.checkpoint import read_meta

    if adapter_off_base:
        record = json.dumps({k: v for k, v in lora_base.items() if k != "path"}, sort_keys=True)
        if lora_base.get("kind") == "hf":
            return record + "|hf:" + hf_fingerprint(lora_base["path"], full=True)
        if lora_base.get("kind") == "megatron":
            meta = read_meta(lora_base["path"])
            return record + "|megatron:" + megatron_fingerprint(meta["path"], meta, full=True)
        return record
    if ref_source is not None:
        meta = read_meta(ref_source)
        return "megatron:" + megatron_fingerprint(meta["path"], meta, full=True)
    if ref_meta.get("reference_hf_model"):
        return "hf:" + hf_fingerprint(ref_meta["reference_hf_model"], full=True)
    return "initialisation"


def reference_cache_dir(dpo: DPOConfig, ckpt: CheckpointConfig) -> str:
    """Where ``--ref-mode precomputed`` keeps its tables: ``--ref-cache``, else ``ref_logps`` under
    ``--save``, else beside the first training file."""
    return dpo.ref_cache or os.path.join(ckpt.save or os.path.dirname(os.path.abspath(dpo.data_path[0])), "ref_logps")


def reference_table_path(cache_dir: str, fingerprint: str) -> str:
    return os.path.join(cache_dir, f"ref_logps_{fingerprint}.pt")


def check_reference_cache_writable(dpo: DPOConfig, ckpt: CheckpointConfig, *, table: str | None = None) -> None:
    """UsageError unless the reference cache can be written, checked before the reference pass
    that fills it (``table``: the one file it would write, when known). A folder that already
    holds tables may be read-only: a shared cache is reused, never written."""
    cache_dir = reference_cache_dir(dpo, ckpt)
    if table is None and os.path.isdir(cache_dir) and any(
            n.startswith("ref_logps_") and n.endswith(".pt") for n in os.listdir(cache_dir)):
        return
    flag = "--ref-cache" if dpo.ref_cache else "--ref-cache (default: ref_logps under --save, else beside --data-path)"
    session.check_writable(flag, cache_dir, file=table)


def check_reference_table(table: Any, dataset: PreferenceDataset, path: str) -> None:
    """UsageError unless ``table`` holds one log-prob per response token of every pair of
    ``dataset`` (a file copied or renamed under another table's key is caught here)."""
    for index, pair in enumerate(dataset.pairs):
        for branch, ids in ((CHOSEN, pair.chosen_ids), (REJECTED, pair.rejected_ids)):
            values = table.get((index, branch)) if isinstance(table, dict) else None
            if not isinstance(values, torch.Tensor) or values.numel() != len(ids):
                found = f"{values.numel()} values" if isinstance(values, torch.Tensor) else "nothing"
                raise session.UsageError(
                    f"reference log-probs cache {path} does not match the data: pair {index} ({pair.source}:"
                    f"{pair.line}) has a {'chosen' if branch == CHOSEN else 'rejected'} response of {len(ids)} "
                    f"tokens, the table holds {found} for it; delete the file to recompute, or point --ref-cache "
                    "elsewhere")


def reference_shares(num_pairs: int, *, batch: int) -> list[list[int]]:
    """This data-parallel rank's pair indices for each pass that precomputes the reference table.

    Every rank runs the same passes with the same microbatch count — ``batch`` pairs each, and under
    the interleaved schedule a pipeline size of them — because expert-parallel peers meet in every
    MoE layer's all-to-all and the interleaved schedule needs a stage's worth of microbatches. A
    rank whose share of the last pass is short fills it with pairs of that pass again (scored twice,
    the same values), so each pass covers its chunk of the data and no rank idles.
    """
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    per_rank = batch * (parallel_state.get_pipeline_model_parallel_world_size() if vpp > 1 else 1)
    shares = []
    for start in range(0, num_pairs, per_rank * dp):
        chunk = list(range(start, min(start + per_rank * dp, num_pairs)))
        mine = chunk[dp_rank::dp]
        shares.append((mine + chunk * per_rank)[:per_rank])
    return shares


def _read_reference_table(path: str, fingerprint: str, dataset: PreferenceDataset) -> dict:
    """The stored table at ``path``, checked against its key and the data; UsageError otherwise."""
    try:
        table = torch.load(path)
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        raise session.UsageError(f"reference log-probs cache {path} cannot be read ({exc}); delete it to "
                                 "recompute, or point --ref-cache elsewhere") from None
    if isinstance(table, dict) and "fingerprint" in table:  # tables stored before it held its key are bare
        if table["fingerprint"] != fingerprint:
            raise session.UsageError(
                f"reference log-probs cache {path} was stored for key {table['fingerprint']}, not {fingerprint} "
                "(a file copied or renamed); delete it to recompute, or point --ref-cache elsewhere")
        table = table["logps"]
    check_reference_table(table, dataset, path)
    return table


def precompute_reference(*, runner_off: DPOStep, dataset: PreferenceDataset, cache_dir: str,
                         fingerprint: str, batch: int) -> dict[tuple[int, int], torch.Tensor]:
    """Reference log-probs of every response token of ``dataset``, cached on disk and reused.

    Computed with the starting policy (which is the reference) before training; every rank
    receives the whole table, because a pair may land on any DP rank in a later step.
    """
    path = reference_table_path(cache_dir, fingerprint)
    # Every rank must take the same branch (the computation is collective): a table on some nodes
    # only (a cache directory on node-local disk) is computed again by all.
    (missing_somewhere,) = any_rank(not os.path.isfile(path))
    if not missing_somewhere:
        try:
            table, problem = _read_reference_table(path, fingerprint, dataset), None
        except session.UsageError as exc:
            problem = exc
        # One rank's unusable copy (its node's) stops every rank, at once rather than at a timeout.
        (failed,) = any_rank(problem is not None)
        if failed:
            raise problem or session.UsageError(
                f"reference log-probs cache {path}: another rank's copy of it cannot be used (its node's log "
                "says why); delete that copy to recompute, or point --ref-cache elsewhere")
        if is_logging_rank():
            print(f"[megatron-prune] reusing reference log-probs {path}", flush=True)
        return table
    table: dict[tuple[int, int], torch.Tensor] = {}
    indices = list(range(len(dataset)))
    for mine in reference_shares(len(dataset), batch=batch):
        found = runner_off.reference_logps(runner_off.plan(0, [(i, dataset[i]) for i in mine]))
        if found:
            table.update(found)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, table)
    for part in gathered:
        table.update(part)
    missing = [(i, b) for i in indices for b in (CHOSEN, REJECTED) if (i, b) not in table]
    assert not missing, f"reference log-probs missing for {missing[:3]}"
    # The first rank of every node writes (a node-local cache directory then holds it next time);
    # each writer its own temporary file, so that writers sharing a directory never collide.
    if dist.get_rank() == 0 or os.environ.get("LOCAL_RANK") == "0":
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.tmp"
        torch.save({"fingerprint": fingerprint, "logps": table}, tmp)
        os.replace(tmp, path)
        print(f"[megatron-prune] stored reference log-probs for {len(dataset)} pairs in {path}", flush=True)
    dist.barrier()
    return table


def check_dpo_flags(configs: dict[str, Any]) -> session.LaunchChecks:
    """The DPO run's flag checks that need no rank and no data (the CLI runs them before
    ``--dry-run`` returns): the reference mode, the architecture, under LoRA the base, and the
    tokenizer (loaded)."""
    dpo: DPOConfig = configs["DPOConfig"]
    model, train = configs["ModelConfig"], configs["TrainConfig"]
    from megatron_prune.training.parallel import validate_layout

    dp = validate_layout(session.parallel_config(model), world_size_from_env())
    session.check_interleaved_microbatches(model, train, dp=dp)
    if train.seq_length < 2:
        raise session.UsageError(f"--seq-length {train.seq_length} leaves no room for a pair: a sequence needs at "
                                 "least a prompt token and a response token")
    if not dpo.data_path:
        raise session.UsageError("--data-path is required")
    session.check_data_files("--data-path", dpo.data_path)
    session.check_data_files("--eval-data-path", dpo.eval_data_path)
    if dpo.layout == "shared" and not configs["PruneConfig"].selective_head:
        raise session.UsageError("--dpo-layout shared needs the selective head (both responses' first tokens are "
                                 "scored from the prompt's last position); drop --no-selective-head")
    from megatron_prune.lora_config import resolve_ref_mode

    try:
        ref_mode = resolve_ref_mode(dpo.ref_mode, configs.get("LoRAConfig"), ref_load=dpo.ref_load)
    except ValueError as exc:
        raise session.UsageError(str(exc)) from None
    if ref_mode == "precomputed":
        check_reference_cache_writable(dpo, configs["CheckpointConfig"])
    arch, lora_base = session.resolve_model_and_base(configs, kind="dpo")
    if ref_mode != "adapter-off":  # the reference must be found before any rank starts
        session.reference_source(configs["ModelConfig"], configs["CheckpointConfig"], dpo.ref_load, lora_base=lora_base)
    spec, tokenizer = session.check_tokenizer(configs["ModelConfig"], configs["CheckpointConfig"], arch)
    return session.LaunchChecks(arch=arch, lora_base=lora_base, tokenizer=tokenizer, tokenizer_spec=spec,
                                ref_mode=ref_mode)


def run_dpo(configs: dict[str, Any], checked: session.LaunchChecks | None = None) -> list[dict[str, Any]]:
    """Train DPO as the flags say; ``checked`` is what :func:`check_dpo_flags` returned for these
    configs (the CLI has run it before ``--dry-run``), run here when None."""
    model_cfg: ModelConfig = configs["ModelConfig"]
    train_cfg: TrainConfig = configs["TrainConfig"]
    ckpt_cfg: CheckpointConfig = configs["CheckpointConfig"]
    log_cfg: LoggingConfig = configs["LoggingConfig"]
    prune: PruneConfig = configs["PruneConfig"]
    dpo: DPOConfig = configs["DPOConfig"]
    from megatron_prune.lora_config import lora_meta

    checked = checked or check_dpo_flags(configs)
    ref_mode, arch, lora_base = checked.ref_mode, checked.arch, checked.lora_base
    tokenizer, tokenizer_spec = checked.tokenizer, checked.tokenizer_spec
    data_cfg = PreferenceDataConfig(max_seq_length=train_cfg.seq_length, max_prompt_length=train_cfg.max_prompt_length,
                                    format=dpo.data_format, skip_invalid=dpo.skip_invalid)
    dataset = PreferenceDataset(dpo.data_path, tokenizer=tokenizer, config=data_cfg)
    eval_dataset = PreferenceDataset(dpo.eval_data_path, tokenizer=tokenizer, config=data_cfg) if dpo.eval_data_path else None
    for name, ds in (("training", dataset), ("held-out", eval_dataset)):
        # (truncation is said by the dataset's own warning, once)
        if ds is not None and ds.skipped and first_rank():
            print(f"[megatron-prune] {name} data: {len(ds)} pairs, skipped {dict(ds.skipped)}", flush=True)
    shared = heldout_overlap(dataset, eval_dataset) if eval_dataset is not None else 0
    if shared and first_rank():
        print(f"[megatron-prune] held-out data: {shared} of its {len(eval_dataset)} pairs are also training pairs "
              "(same tokens); held-out reward accuracy reads high on them", flush=True)

    lora = configs.get("LoRAConfig")
    lora_on = lora_active(lora)
    check_resumed_data_size(ckpt_cfg, num_samples=len(dataset), kind="dpo", lora=lora_on)
    if len(dataset) < train_cfg.global_batch_size and first_rank():
        print(f"[megatron-prune] training data: {len(dataset)} pairs, fewer than --global-batch-size "
              f"{train_cfg.global_batch_size}: every step holds some pairs more than once", flush=True)
    eval_pairs = 0
    if eval_dataset is not None:
        from megatron_prune.training.parallel import validate_layout

        dp = validate_layout(session.parallel_config(model_cfg), world_size_from_env())
        vpp = model_cfg.virtual_pipeline_model_parallel_size or 1
        interleaved = model_cfg.pipeline_model_parallel_size if vpp > 1 else 1
        eval_pairs = heldout_pairs(len(eval_dataset), micro_batch_size=train_cfg.micro_batch_size, dp=dp,
                                   interleaved_pp=interleaved)

    parallel = session.start(model_cfg, train_cfg, configs)
    session.check_same_data({"--data-path": dataset.content_sha256,
                             "--eval-data-path": eval_dataset.content_sha256 if eval_dataset is not None else None})
    parts = session.build_parts(arch, parallel, model_cfg, train_cfg, lora=lora, lora_base=lora_base)
    ref_source = session.reference_source(model_cfg, ckpt_cfg, dpo.ref_load, lora_base=lora_base)
    ref_meta = session.reference_meta(model_cfg, ckpt_cfg, ref_source, lora_base=lora_base)
    parts.extra_meta = {**ref_meta,
                        **lora_meta(lora, base=lora_base),
                        **session.tokenizer_meta(tokenizer_spec), "flags": session.flag_record(configs)}
    settings = DPOStepSettings(dpo=dpo, prune=prune, seed=train_cfg.seed, micro_batch_size=train_cfg.micro_batch_size,
                               pad_id=tokenizer.pad_id)
    off = DPOStepSettings(dpo=dpo, prune=PruneConfig.off(selective_head=prune.selective_head),
                          seed=train_cfg.seed, micro_batch_size=train_cfg.micro_batch_size, pad_id=tokenizer.pad_id)

    def make_reference():
        # Under LoRA the base weights are the starting model, so the adapter-off policy is the
        # reference (also for precomputing); online keeps a separate frozen copy.
        if ref_mode == "adapter-off" or (ref_mode == "precomputed" and lora_on and not dpo.ref_load):
            from megatron_prune.model.lora import adapter_off

            return adapter_off(parts.model)
        return session.build_reference(arch, parallel, model_cfg, train_cfg, ref_source, lora_base=lora_base,
                                       ckpt=ckpt_cfg)

    if ref_mode in ("online", "adapter-off"):
        reference = make_reference()
        runner = DPOStep(settings=settings, policy=parts.model, reference=reference)
        eval_runner = DPOStep(settings=off, policy=parts.model, reference=reference)
    else:
        reference = make_reference()
        cache_dir = reference_cache_dir(dpo, ckpt_cfg)
        identity = reference_identity(ref_meta, ref_source=ref_source, lora_base=lora_base,
                                      adapter_off_base=lora_on and not dpo.ref_load)
        fp = reference_table_key(dataset, arch=arch, identity=identity, seed=train_cfg.seed, bf16=model_cfg.bf16)
        precompute_off = DPOStep(settings=off, policy=parts.model, reference=reference)
        if not os.path.isfile(reference_table_path(cache_dir, fp)):  # to be written: checked before the pass
            check_reference_cache_writable(dpo, ckpt_cfg, table=reference_table_path(cache_dir, fp))
        table = precompute_reference(runner_off=precompute_off, dataset=dataset, cache_dir=cache_dir,
                                     fingerprint=fp, batch=train_cfg.micro_batch_size)
        eval_runner = precompute_off if eval_dataset is not None else None
        if eval_dataset is None:
            del reference
        runner = DPOStep(settings=settings, policy=parts.model, reference=None,
                         ref_lookup=lambda sid, branch: table[(sid, branch)])
    objective = DPOObjective(dataset=dataset, eval_dataset=eval_dataset, runner=runner, eval_runner=eval_runner,
                             train_cfg=train_cfg, eval_pairs=eval_pairs)
    return train(objective=objective, parts=parts, train_cfg=train_cfg, ckpt=ckpt_cfg, log_cfg=log_cfg,
                 eval_interval=dpo.eval_interval or (train_cfg.train_iters if eval_dataset is not None else None))
