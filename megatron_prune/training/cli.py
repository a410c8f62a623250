"""The command-line driver shared by ``python -m megatron_prune.dpo`` and ``...grpo``."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable

from megatron_prune.arguments import GIVEN, exit_reported, fail_usage, ignore_expected_warnings, parse_configs
from megatron_prune.ranks import first_rank
from megatron_prune.training import exit_conditions  # noqa: F401  (starts the --exit-duration-in-mins clock)


def run_cli(
    *,
    prog: str,
    description: str,
    groups: dict[str, type],
    run: Callable[[dict[str, Any], Any], Any],
    argv: list[str] | None = None,
    extra_checks: Callable[[dict[str, Any]], Any] | None = None,
) -> int:
    """Parse flags into configs, validate them against the world size before any rank does work
    (one message from rank 0, exit code 2), warn (rank 0) about each given flag the run ignores
    (:mod:`megatron_prune.training.dead_flags`), honour ``--dry-run``, then ``run(configs, checked)``
    with what ``extra_checks(configs)`` returned, so the run need not check again."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ignore_expected_warnings()
    # The device comes first: on Ascend, torch_npu and MindSpeed must load before Megatron.
    from megatron_prune.accelerator import AcceleratorError
    from megatron_prune.adapters.mindspeed import bootstrap_device, parse_mindspeed_flags

    try:
        kind = bootstrap_device(argv)
    except (AcceleratorError, RuntimeError) as exc:
        if not {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
            fail_usage(exc)  # every node's first rank says it: a node without the device is often not the first
        kind = "cpu"  # the help needs no device
    # MindSpeed's own flags (e.g. --use-flash-attn) are accepted on the NPU only.
    args, configs = parse_configs(prog, groups, description, argv,
                                  unknown_handler=parse_mindspeed_flags if kind == "npu" else None)
    # From here --exit-signal-handler's signal is recorded, not fatal, up to the end of the process group: a
    # preemption while the run checks its flags, builds the model, loads data or a checkpoint stops it cleanly
    # before its first step (training.loop.train); one after the last step lets the ranks finish.
    with exit_conditions.recording(exit_conditions.watched_signal(configs["CheckpointConfig"])):
        return _checked_run(prog, args, configs, kind=kind, run=run, extra_checks=extra_checks)


def _checked_run(prog: str, args, configs: dict[str, Any], *, kind: str, run: Callable[[dict[str, Any], Any], Any],
                 extra_checks: Callable[[dict[str, Any]], Any] | None) -> int:
    from megatron_prune.data.records import DataError
    from megatron_prune.data.tokenizer import TokenizerError
    from megatron_prune.training import dead_flags, session
    from megatron_prune.training.parallel import check_rendezvous_env, world_size_from_env

    try:
        world = world_size_from_env()
        versions = session.check_versions(kind)
        dp = session.validate(configs["ModelConfig"], configs["TrainConfig"], configs["CheckpointConfig"],
                              world_size=world, batch_of_microbatches="GRPOConfig" not in configs)
        checked = extra_checks(configs) if extra_checks is not None else None
        ignored = dead_flags.check(configs, getattr(args, GIVEN), data_parallel=dp)
    except ValueError as exc:
        session.fail_usage(exc)
    dead_flags.warn(ignored)
    if args.dry_run:
        if first_rank():
            print(f"[megatron-prune] dry run: world {world}, data-parallel {dp}, {versions}; configs:")
            for name, cfg in configs.items():
                print(f"  {name}: {cfg}")
            resolved = _resolved_defaults(configs)
            if resolved:
                print(f"  resolved: {', '.join(resolved)}")
            from megatron_prune.lora_config import lora_active
            from megatron_prune.training.loop import say_resume_notes

            say_resume_notes(configs, lora=lora_active(configs.get("LoRAConfig")),
                             lora_base=checked.lora_base if checked is not None else None)
        return 0
    try:
        check_rendezvous_env()
    except ValueError as exc:
        session.fail_usage(exc)
    from megatron_prune.training.checkpoint import CheckpointError
    from megatron_prune.training.loop import NonFiniteError

    if first_rank():
        import torch

        print(f"[megatron-prune] {prog}: world {world}, data-parallel {dp}, {versions}, torch {torch.__version__}",
              flush=True)
    try:
        run(configs, checked)
    except DataError as exc:
        session.fail_usage(with_way_out(exc))
    except (session.UsageError, FileNotFoundError, TokenizerError, CheckpointError) as exc:
        session.fail_usage(exc)
    except NonFiniteError as exc:  # every rank took the decision; each says so, rank 0 tells torchrun
        message = f"megatron-prune: rank {os.environ.get('RANK', '0')}: {exc}"
        print(message, file=sys.stderr, flush=True)
        exit_reported(message, code=1, printed=True)
    except KeyboardInterrupt:
        if first_rank():
            from megatron_prune.training.checkpoint import holds_checkpoint

            save = configs["CheckpointConfig"].save
            if not save:
                where = ""
            elif holds_checkpoint(save):
                where = f"; --load {save} resumes from its newest complete checkpoint"
            else:
                where = f" before the first checkpoint in --save {save} (nothing to resume)"
            print(f"megatron-prune: interrupted{where}", file=sys.stderr, flush=True)
        return 130  # the shell's code for a run ended by Ctrl-C
    except Exception as exc:
        _record_failure(exc)
        raise
    from megatron_prune.training.parallel import shutdown_distributed

    shutdown_distributed()
    return 0


SKIP_HINT = ("; to skip such records instead (each one counted and logged), pass --skip-invalid-records")


def with_way_out(exc: Exception) -> str:
    """A data error naming file:line, plus how to go on without the record."""
    if getattr(exc, "line", None) is None:
        return str(exc)
    return f"{exc}{SKIP_HINT}"


def _record_failure(exc: Exception) -> None:
    """Under torchrun: the exception and its traceback go into this rank's error file, so the
    launcher's "Root Cause" report shows them instead of a pointer to the elastic docs."""
    if "TORCHELASTIC_ERROR_FILE" in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


def _resolved_defaults(configs: dict[str, Any]) -> list[str]:
    """The flags left unset above whose value the run decides, as it will run them: the DPO
    reference mode, and LoRA's alpha (the rank, or a resumed checkpoint's)."""
    from megatron_prune.lora_config import lora_active, resolve_ref_mode

    lora, dpo = configs.get("LoRAConfig"), configs.get("DPOConfig")
    resolved = []
    if dpo is not None:
        resolved.append(f"--ref-mode {resolve_ref_mode(dpo.ref_mode, lora, ref_load=dpo.ref_load)}")
    if lora_active(lora):
        resolved.append(f"--lora-alpha {lora.rank * lora.scale:g} (scale {lora.scale:g})")
    return resolved
