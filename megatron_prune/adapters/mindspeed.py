"""Ascend 910B through MindSpeed: start-up order, patches, flags and packed batches.

MindSpeed adapts Megatron to the NPU by *patching it at import*: ``import
mindspeed.megatron_adaptor`` imports ``torch_npu.contrib.transfer_to_npu`` (``torch.cuda`` ->
NPU), parses ``sys.argv`` for its features' flags (``get_mindspeed_args``: known flags typed,
unknown ones kept as strings), and has every enabled ``MindSpeedFeature`` register patches with
``MindSpeedPatchesManager`` before applying them. Modules that did ``from megatron... import f``
*before* that keep the CUDA functions, hence the strict order below.

Entry points, in the order the trainers call them:

1. :func:`bootstrap_device` (first line of ``main``, before anything imports Megatron): reads
   ``--device`` from argv; for ``npu`` (or ``auto`` on an NPU host) runs :func:`prepare_ascend`.
2. :func:`prepare_ascend`: checks torch_npu and MindSpeed are installed and that Megatron is
   not loaded yet, imports torch_npu, adds the plugin's own ``MindSpeedFeature`` to MindSpeed's
   feature list, imports MindSpeed's adaptor (which applies MindSpeed's patches *and* ours, ours
   registered last, as wrappers), then selects the ``npu`` accelerator (``hccl`` backend).
3. :func:`parse_mindspeed_flags`: the trainers parse their own flags with
   ``parse_known_args``; on NPU the leftovers must be flags MindSpeed declares (or the few
   Megatron-LM flags MindSpeed reads, such as ``--use-flash-attn``), otherwise it is an error.

The plugin's feature (:func:`plugin_feature_class`) does two things inside MindSpeed:
``register_args`` declares every megatron-prune flag (typed, ``default=SUPPRESS``, plain
identifier dests) so MindSpeed's pre-parse and a MindSpeed-patched Megatron-LM ``parse_args``
accept them; ``register_patches`` registers the ``mindspeed`` group of
:mod:`megatron_prune.patches.mindspeed_compat` as MindSpeed *wrappers* (function names ending in
``wrapper``), which MindSpeed applies on top of its own replacement and re-applies on
``repatch``. Nothing here runs at import.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import logging
import re
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch

from megatron_prune import accelerator as acc_mod
from megatron_prune.accelerator import (
    MINDSPEED_ADAPTOR,
    TRANSFER_TO_NPU,
    Accelerator,
    AcceleratorError,
    check_import_order,
    get_accelerator,
    npu_available,
    require_mindspeed,
    require_torch_npu,
    require_visible_npu,
    set_accelerator,
)

logger = logging.getLogger(__name__)

PLUGIN_FEATURE_NAME = "megatron-prune"
"""Name of the plugin's ``MindSpeedFeature`` (MindSpeed normalises it to ``megatron_prune``)."""

MEGATRON_LM_FLAGS_READ_BY_MINDSPEED: dict[str, dict[str, Any]] = {
    "--use-flash-attn": dict(
        action="store_true",
        help="MindSpeed: fused attention (npu_fusion_attention); needed for packed (THD) batches on NPU.",
    ),
}
"""Megatron-LM training flags that MindSpeed features read from its namespace without declaring them."""

PLUGIN_CONFIG_MODULES = ("megatron_prune.config", "megatron_prune.dpo.config", "megatron_prune.grpo.config")
"""Modules whose dataclasses define the trainers' flags (none of them imports Megatron)."""


@dataclass
class _AscendState:
    prepared: bool = False
    """prepare_ascend() completed in this process."""
    route: str = ""
    """How our patches reached MindSpeed: ``feature`` or ``patch_manager``."""
    patch_names: tuple[str, ...] = ()
    """Our patches registered with MindSpeed's manager."""


_STATE = _AscendState()
_WRAPPERS: dict[str, Callable[[Any], Any]] = {}


# --- 1. which device ----------------------------------------------------------------------------
def requested_device(argv: Sequence[str] | None = None) -> str:
    """The value of ``--device`` in ``argv`` (default ``sys.argv[1:]``), ``auto`` when absent or
    malformed (the trainer's own parser then reports it, with its usage line)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--device", default="auto")
    try:
        known, _ = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    except argparse.ArgumentError:
        return "auto"
    return known.device if known.device in ("auto", *acc_mod.KINDS) else "auto"


def bootstrap_device(argv: Sequence[str] | None = None) -> str:
    """First call of a trainer's ``main``: resolve ``--device`` and, for the NPU, prepare MindSpeed.

    Must run before anything imports Megatron (``megatron_prune.dpo``/``grpo`` package
    ``__init__`` files must stay free of Megatron imports). Returns the accelerator kind.
    """
    requested = requested_device(argv)
    if requested == "npu" or (requested == "auto" and npu_available()):
        return prepare_ascend().kind
    return set_accelerator(requested).kind


# --- 2. MindSpeed before Megatron ---------------------------------------------------------------
def prepare_ascend() -> Accelerator:
    """Make this process an Ascend NPU process; idempotent. Call before anything imports Megatron.

    Raises :class:`~megatron_prune.accelerator.AcceleratorError` naming the package when
    torch_npu or MindSpeed is missing, when Megatron was imported before MindSpeed's adaptor
    ("imported too late"), or when the plugin's CPU patches were applied in this process.
    """
    if _STATE.prepared:
        return get_accelerator()
    require_torch_npu()
    require_mindspeed()
    _refuse_cpu_patches()
    check_import_order()
    adaptor_was_loaded = MINDSPEED_ADAPTOR in sys.modules
    _import("torch_npu", "torch_npu")
    require_visible_npu()
    _import(TRANSFER_TO_NPU, "torch_npu")  # MindSpeed's adaptor does this first as well
    manager_cls, feature_base = _features_api()
    if manager_cls is not None:
        _add_plugin_feature(manager_cls, feature_base)
    _import(MINDSPEED_ADAPTOR, "MindSpeed")
    if manager_cls is not None and _STATE.patch_names:
        _STATE.route = "feature"
    elif adaptor_was_loaded:
        _register_with_patch_manager(
            f"{MINDSPEED_ADAPTOR} was imported before prepare_ascend(): the plugin's flags were parsed by "
            "MindSpeed as untyped unknown arguments; registering the plugin's patches now"
        )
    elif manager_cls is not None:
        _register_with_patch_manager("MindSpeed's adaptor did not call the plugin feature; registering its patches directly")
    else:
        _register_with_patch_manager(None)  # a MindSpeed without features_manager
    acc_mod.mark_npu_stack_ready()
    accelerator = set_accelerator("npu")
    _STATE.prepared = True
    logger.info(
        "megatron-prune on Ascend: MindSpeed adaptor loaded, backend %s, plugin patches %s via %s",
        accelerator.backend,
        ", ".join(_STATE.patch_names) or "none",
        _STATE.route,
    )
    return accelerator


def ascend_state() -> dict[str, Any]:
    """What :func:`prepare_ascend` did in this process (for logs and tests)."""
    return dataclasses.asdict(_STATE)


def _import(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        hint = (
            "source CANN's set_env.sh and check that torch_npu matches torch and CANN"
            if package == "torch_npu"
            else "check that MindSpeed's branch matches the installed Megatron-Core (e.g. core_r0.16.0 for 0.16.x)"
        )
        raise AcceleratorError(f"importing {module} (package {package}) failed: {exc}; {hint}") from exc


def _refuse_cpu_patches() -> None:
    from megatron_prune.patches import is_applied, registered

    applied = [p.name for p in registered("cpu") if is_applied(p.name)]
    if applied:
        raise AcceleratorError(
            f"the plugin's CPU patches are applied in this process ({', '.join(applied[:3])}, ...); "
            "an NPU run must start in a fresh process with --device npu"
        )


def _features_api() -> tuple[Any, Any]:
    """(MindSpeedFeaturesManager, MindSpeedFeature), or (None, None) on a MindSpeed without them."""
    try:
        module = importlib.import_module("mindspeed.features_manager")
    except ImportError as exc:
        if exc.name and exc.name.startswith("mindspeed.features_manager"):
            return None, None
        raise AcceleratorError(f"importing mindspeed.features_manager failed: {exc}") from exc
    manager = getattr(module, "MindSpeedFeaturesManager", None)
    base = getattr(module, "MindSpeedFeature", None)
    if manager is None or base is None or not hasattr(manager, "FEATURES_LIST"):
        return None, None
    return manager, base


def _add_plugin_feature(manager_cls: Any, feature_base: type) -> None:
    """Append the plugin's feature to MindSpeed's list (last, so our wrappers are outermost)."""
    wanted = PLUGIN_FEATURE_NAME.replace("-", "_")
    if any(getattr(f, "feature_name", None) == wanted for f in manager_cls.FEATURES_LIST):
        return
    manager_cls.FEATURES_LIST.append(plugin_feature_class(feature_base)())


def _register_with_patch_manager(warning: str | None) -> None:
    """Register and apply our wrappers directly when the plugin feature could not do it."""
    from mindspeed.patch_utils import MindSpeedPatchesManager

    if warning:
        logger.warning(warning)
    _STATE.patch_names = tuple(register_plugin_patches(MindSpeedPatchesManager))
    MindSpeedPatchesManager.apply_patches()
    _STATE.route = "patch_manager"


# --- the plugin's MindSpeed feature and patches -------------------------------------------------
def plugin_feature_class(feature_base: type) -> type:
    """The plugin's ``MindSpeedFeature`` subclass, built on MindSpeed's real base class.

    Always applied (``is_need_apply`` is True: the patches adapt inputs, they are not an
    optimisation); ``optimization_level=0`` also marks it as a default feature for MindSpeed.
    """

    class MegatronPruneFeature(feature_base):  # type: ignore[misc, valid-type]
        """megatron-prune inside MindSpeed: declares the plugin's flags, registers its wrappers."""

        def __init__(self) -> None:
            super().__init__(PLUGIN_FEATURE_NAME, optimization_level=0)

        def is_need_apply(self, args: Any) -> bool:
            return True

        def register_args(self, parser: argparse.ArgumentParser) -> None:
            add_plugin_flags(parser)

        def register_patches(self, patch_manager: Any, args: Any) -> None:
            _STATE.patch_names = tuple(register_plugin_patches(patch_manager))

    return MegatronPruneFeature


def register_plugin_patches(patch_manager: Any) -> list[str]:
    """Register the ``mindspeed`` patch group with MindSpeed's patch manager, as wrappers."""
    return register_patches_with(patch_manager, _plugin_patches())


def register_patches_with(patch_manager: Any, patches: Sequence[Any]) -> list[str]:
    """Register ``patches`` (registry :class:`Patch` objects) with a MindSpeed-style manager.

    ``patch_manager.register_patch(target, new_func)`` stacks ``new_func`` as a decorator of
    whatever is installed (MindSpeed's replacement, or Megatron's original) when its name ends
    in ``wrapper``; re-registering the same wrapper object is a no-op. Returns the patch names.
    """
    names = []
    for patch in patches:
        patch_manager.register_patch(patch.target, _as_mindspeed_wrapper(patch))
        names.append(patch.name)
    return names


def _plugin_patches() -> list[Any]:
    from megatron_prune.patches import mindspeed_compat, registered

    return registered(mindspeed_compat.GROUP)


def _as_mindspeed_wrapper(patch: Any) -> Callable[[Any], Any]:
    """A decorator MindSpeed recognises as a wrapper (its ``__name__`` ends in ``wrapper``)."""
    if patch.name in _WRAPPERS:
        return _WRAPPERS[patch.name]
    from megatron_prune.patches.registry import PATCH_MARK

    def wrapper(original: Any) -> Any:
        replacement = patch.build(original)
        try:
            setattr(replacement, PATCH_MARK, patch.name)
            replacement.__wrapped__ = original
        except (AttributeError, TypeError):
            pass
        logger.info("megatron-prune patch %s -> %s (via MindSpeed): %s", patch.name, patch.target, patch.reason)
        return replacement

    wrapper.__name__ = wrapper.__qualname__ = "megatron_prune_" + re.sub(r"\W", "_", patch.name) + "_wrapper"
    _WRAPPERS[patch.name] = wrapper
    return wrapper


# --- 3. flags -----------------------------------------------------------------------------------
def add_plugin_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Declare every megatron-prune flag on ``parser`` for MindSpeed's argument handling.

    Types, choices and help come from :mod:`megatron_prune.config`. Dests are the plain
    identifiers argparse derives from the flag (MindSpeed copies unknown namespace keys onto
    ``TransformerConfig`` with ``make_dataclass``, which rejects the trainers' dotted dests).
    Defaults are ``SUPPRESS``, so only flags actually given reach MindSpeed's namespace. A flag
    the parser already has (Megatron-LM's own ``--lr``, ``--seq-length``, ...) is left alone.
    Returns the flags added.
    """
    from megatron_prune.config import field_docs, flag_of

    group = parser.add_argument_group(title="megatron-prune")
    added = []
    for cls in plugin_config_classes():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = flag_of(f)
            dest = flag[2:].replace("-", "_")
            base, is_list = _scalar_type(hints[f.name])
            if base is bool:
                specs = [(flag, dict(action="store_true"))]
                if "bool_off" in f.metadata:
                    specs.append((f.metadata["bool_off"], dict(action="store_false")))
            else:
                kwargs: dict[str, Any] = dict(type=base)
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
                if is_list:
                    kwargs["nargs"] = f.metadata.get("nargs", "+")
                specs = [(flag, kwargs)]
            for option, kwargs in specs:
                try:
                    group.add_argument(option, dest=dest, default=argparse.SUPPRESS, help=docs.get(f.name, ""), **kwargs)
                except argparse.ArgumentError:
                    continue  # already declared (by Megatron-LM, MindSpeed, or another config class)
                added.append(option)
    return added


def plugin_config_classes() -> list[type]:
    """The flag dataclasses of both trainers, from :data:`PLUGIN_CONFIG_MODULES` (those present)."""
    classes = []
    for name in PLUGIN_CONFIG_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        module = importlib.import_module(name)
        classes += [
            obj
            for obj in vars(module).values()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == name
        ]
    return classes


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, is_list) of ``int | None``, ``list[str]``, ``float`` ..."""
    origin = typing.get_origin(annotation)
    if origin is list:
        return typing.get_args(annotation)[0], True
    if origin is not None:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _scalar_type(args[0])
    return annotation, False


def mindspeed_parser() -> argparse.ArgumentParser:
    """A parser of the flags MindSpeed's features declare (ours excluded) plus
    :data:`MEGATRON_LM_FLAGS_READ_BY_MINDSPEED`. Needs :func:`prepare_ascend` first."""
    manager_cls, _ = _features_api()
    parser = argparse.ArgumentParser(prog="mindspeed", add_help=False, allow_abbrev=False)
    if manager_cls is not None:
        ours = PLUGIN_FEATURE_NAME.replace("-", "_")
        for feature in manager_cls.FEATURES_LIST:
            if getattr(feature, "feature_name", None) != ours:
                feature.register_args(parser)
    for flag, kwargs in MEGATRON_LM_FLAGS_READ_BY_MINDSPEED.items():
        try:
            parser.add_argument(flag, **kwargs)
        except argparse.ArgumentError:
            pass
    return parser


def parse_mindspeed_flags(unknown: Sequence[str]) -> argparse.Namespace:
    """Check the flags a trainer's parser did not know: each must be MindSpeed's.

    ``unknown`` is the second result of the trainer's ``parse_known_args``. Returns them
    parsed (MindSpeed itself already read them from ``sys.argv``); raises ``ValueError``
    naming the rest.
    """
    parsed, rest = mindspeed_parser().parse_known_args(list(unknown))
    if rest:
        raise ValueError(
            f"unrecognized arguments: {' '.join(rest)} (neither a flag of this trainer nor one that MindSpeed declares)"
        )
    return parsed


# --- packed sequences -> THD PackedSeqParams ----------------------------------------------------
def thd_cu_seqlens(rows: Sequence[Any]) -> torch.Tensor:
    """Int32 ``cu_seqlens`` (Megatron's convention, leading 0) of packed rows laid end to end.

    THD attention takes one ``[1, R*C]`` sequence: the ``[R, C]`` tokens and position ids of a
    :class:`~megatron_prune.data.packing.PackedBatch` reshaped to ``[1, R*C]``. Each packed
    sequence is one segment and each row's trailing padding is one more segment (so it attends
    only to itself), hence the last entry is ``R*C``.
    """
    from megatron_prune.data.packing import row_cu_seqlens

    bounds = [0]
    base = 0
    for row in rows:
        cu = row_cu_seqlens(row, include_padding=True)
        bounds.extend(base + int(b) for b in cu[1:])
        base += row.capacity
    return torch.tensor(bounds, dtype=torch.int32)


def thd_packed_seq_params(rows: Sequence[Any], *, device: torch.device | str | None = None) -> Any:
    """Megatron ``PackedSeqParams(qkv_format="thd")`` for packed rows laid end to end.

    The same object serves TE on CUDA and MindSpeed on NPU: Megatron's attention and THD RoPE
    read the leading-0 ``cu_seqlens``; the ``mindspeed`` patch converts them to the cumulative
    end offsets of ``npu_fusion_attention`` (TND) right before MindSpeed's fused attention.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = thd_cu_seqlens(rows)
    if device is not None:
        cu = cu.to(device)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def npu_actual_seq_len(cu_seqlens: Any) -> list[int]:
    """``cu_seqlens`` -> ``actual_seq_qlen`` of ``npu_fusion_attention`` (see mindspeed_compat)."""
    from megatron_prune.patches.mindspeed_compat import npu_actual_seq_len as convert

    return convert(cu_seqlens)


__all__ = [
    "MEGATRON_LM_FLAGS_READ_BY_MINDSPEED",
    "PLUGIN_FEATURE_NAME",
    "add_plugin_flags",
    "ascend_state",
    "bootstrap_device",
    "mindspeed_parser",
    "npu_actual_seq_len",
    "parse_mindspeed_flags",
    "plugin_config_classes",
    "plugin_feature_class",
    "prepare_ascend",
    "register_patches_with",
    "register_plugin_patches",
    "requested_device",
    "thd_cu_seqlens",
    "thd_packed_seq_params",
]
